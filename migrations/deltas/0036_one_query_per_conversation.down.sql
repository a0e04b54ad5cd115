-- 0036_one_query_per_conversation, downgrade: judge_runs as revision
-- 0034 left it.

CREATE OR REPLACE FUNCTION compaction.judge_runs(p_conversation_id text, p_run_ids text[] DEFAULT NULL)
RETURNS TABLE (
    run_id               text,
    run_status           text,
    reason               text,
    user_message_id      text,
    user_seq             bigint,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One cached plan: a custom plan per call would cost more to plan than to run.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_foreign text[];
BEGIN
    -- §3: a run with a user or assistant message filed under another conversation is no
    -- pair. That is the one question that crosses conversations, so it is asked on its
    -- own, by run id alone (a plain read of every shard under Citus); everything else
    -- below addresses this conversation's rows only.
    -- Runs named are asked about as named (revision 0034): v_foreign is only compared
    -- with this conversation's runs below, so a named run of another conversation
    -- changes no verdict, and no read of the conversation's runs is needed. (That read,
    -- by run id and conversation in the generic plan this function keeps, was planned on
    -- the conversation's prefix of the runs' key when conversations are small on
    -- average: a write to a 10,000-run conversation read all 10,000.)
    SELECT pg_catalog.array_agg(DISTINCT sm.run_id) INTO v_foreign
    FROM compaction.source_messages AS sm
    -- Two arrays, one evaluated: a generic plan keeps an index scan for each form.
    WHERE sm.run_id = ANY (CASE WHEN p_run_ids IS NULL
                                THEN ARRAY(SELECT sr.run_id
                                           FROM compaction.source_runs AS sr
                                           WHERE sr.conversation_id = p_conversation_id)
                                ELSE p_run_ids
                           END)
      AND sm.role IN ('user', 'assistant')
      AND sm.conversation_id IS DISTINCT FROM p_conversation_id;
    RETURN QUERY
    -- A lateral aggregate per run: the messages of each run are fetched by the run_id
    -- index, so the cost follows this conversation's size, never the table's.
    WITH runs AS (
        -- Every run of the conversation, or only the runs named: re-derivation judges
        -- the runs a write touched by the run_id index, never the whole conversation.
        SELECT sr.run_id, sr.conversation_id, sr.status
        FROM compaction.source_runs AS sr
        WHERE p_run_ids IS NULL AND sr.conversation_id = p_conversation_id
        UNION ALL
        -- The runs named, found by run id first (OFFSET 0 keeps the conversation's test
        -- out of that scan): in this function's generic plan, both tests in one scan were
        -- planned on the conversation's prefix of the runs' key wherever conversations
        -- are small on average, reading every run of a large one (revision 0034). Only
        -- re-derivation names runs, never on Citus, where a read by run id alone would
        -- visit every shard.
        SELECT n.run_id, n.conversation_id, n.status
        FROM (SELECT sr.run_id, sr.conversation_id, sr.status
              FROM compaction.source_runs AS sr
              WHERE sr.run_id = ANY (p_run_ids)
              OFFSET 0) AS n
        WHERE n.conversation_id = p_conversation_id
    ),
    per_run AS (
        SELECT r.run_id,
               r.status AS run_status,
               m.*
        FROM runs AS r
        CROSS JOIN LATERAL (
            SELECT count(*) FILTER (WHERE sm.role = 'user') AS n_user,
                   count(*) FILTER (WHERE sm.role = 'assistant') AS n_assistant,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'user'))[1] AS user_message_id,
                   (array_agg(sm.seq) FILTER (WHERE sm.role = 'user'))[1] AS user_seq,
                   bool_and(compaction.has_content(sm.content)) FILTER (WHERE sm.role = 'user')
                       AS user_has_content,
                   max(pg_catalog.octet_length(sm.content)) FILTER (WHERE sm.role = 'user')
                       AS user_bytes,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_message_id,
                   (array_agg(sm.status) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_status,
                   bool_and(compaction.has_content(sm.content)) FILTER (WHERE sm.role = 'assistant')
                       AS assistant_has_content,
                   max(pg_catalog.octet_length(sm.content)) FILTER (WHERE sm.role = 'assistant')
                       AS assistant_bytes
            FROM compaction.source_messages AS sm
            WHERE sm.conversation_id = p_conversation_id AND sm.run_id = r.run_id
              AND sm.role IN ('user', 'assistant')
        ) AS m
    )
    SELECT p.run_id,
           p.run_status,
           CASE
               WHEN p.run_status IS NULL
                 OR p.run_status NOT IN ('completed', 'partial', 'clarify_pending')
                   THEN 'run_status'
               WHEN p.run_id = ANY (v_foreign) THEN 'foreign_message'
               WHEN p.n_user = 0 THEN 'no_user_message'
               WHEN p.n_user > 1 THEN 'multiple_user_messages'
               WHEN p.n_assistant = 0 THEN 'no_assistant_message'
               WHEN p.n_assistant > 1 THEN 'multiple_assistant_messages'
               WHEN p.assistant_status IS DISTINCT FROM 'completed' THEN 'assistant_not_completed'
               WHEN NOT p.user_has_content THEN 'empty_user_content'
               WHEN NOT p.assistant_has_content THEN 'empty_assistant_content'
           END,
           p.user_message_id,
           p.user_seq,
           p.user_bytes::int,
           p.assistant_message_id,
           p.assistant_bytes::int
    FROM per_run AS p;
END
$$;

-- A replaced function takes its SET clauses again: on a database distributed by Citus,
-- judge_runs plans with the values bound, as distribute_on_citus left it (revision 0034,
-- which replaced it too, did not restore this; this revision does, both ways).
DO $$
BEGIN
    IF compaction.engine_distributed() THEN
        ALTER FUNCTION compaction.judge_runs(text, text[]) RESET plan_cache_mode;
    END IF;
END
$$;

CALL compaction.assign_ownership();
