-- 0036_one_query_per_conversation: judge_runs asks Citus for one
-- conversation in one query, sent whole to the node that holds it. Measured on a loopback
-- cluster (a coordinator and two workers, a conversation of 100 runs), every call that
-- judges a conversation from the views (always on Citus: worker_targets, claim's
-- current_range, range_replies, a projection) took about 20 ms, of which:
--
-- * 4.6 ms were the verdicts' statement, which also held the read of named runs by run
--   id alone: Citus read every shard of the runs for it even when no run was named. The
--   named runs are now read in a statement of their own, only when named (re-derivation,
--   never on Citus), and the verdicts' statement is one query of one conversation
--   (1.2 ms);
-- * 10-13 ms were the cross-conversation question (DESIGN §3), whose subquery of the
--   conversation's runs Citus ran first and sent to every worker. Up to 256 runs, the
--   runs are now read first and asked about as a value (3.9 ms at 10 runs, 6.3 ms at
--   100); a larger value, copied into each of the 32 shards' queries, costs more than
--   the subquery (22 against 14 ms at 1,000 runs), so larger conversations keep it.
--
-- No verdict changes; the function is replaced whole.

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
    v_foreign      text[];
    v_runs         text[];
    v_many         boolean := false;
    v_named_ids    text[];
    v_named_status text[];
BEGIN
    -- §3: a run with a user or assistant message filed under another conversation is no
    -- pair. That is the one question that crosses conversations, so it is asked on its
    -- own, by run id alone (a read of every shard under Citus); everything else below
    -- addresses this conversation's rows only.
    -- Runs named are asked about as named (revision 0034): v_foreign is only compared
    -- with this conversation's runs below, so a named run of another conversation
    -- changes no verdict, and no read of the conversation's runs is needed. (That read,
    -- by run id and conversation in the generic plan this function keeps, was planned on
    -- the conversation's prefix of the runs' key when conversations are small on
    -- average: a write to a 10,000-run conversation read all 10,000.)
    -- A whole conversation's runs go into the question as a value when there are at most
    -- 256 of them (revision 0036): under Citus, a subquery there became a distributed
    -- subplan, its result sent to every worker before the read of every shard (9-10 ms
    -- where the value costs 3.5-6 ms up to 100 runs). A larger value, copied into each
    -- shard's query, costs more than the subplan (22 against 14 ms at 1,000 runs), so a
    -- conversation with more runs keeps the subquery.
    -- (Not read with a LIMIT: a LIMIT invites a plan that scans the table for the first
    -- rows it finds, and a host's table behind the view may be large.)
    IF p_run_ids IS NULL THEN
        SELECT pg_catalog.array_agg(sr.run_id) INTO v_runs
        FROM compaction.source_runs AS sr
        WHERE sr.conversation_id = p_conversation_id;
        v_many := coalesce(pg_catalog.cardinality(v_runs) > 256, false);
    ELSE
        v_runs := p_run_ids;
    END IF;
    IF v_many THEN
        SELECT pg_catalog.array_agg(DISTINCT sm.run_id) INTO v_foreign
        FROM compaction.source_messages AS sm
        WHERE sm.run_id = ANY (ARRAY(SELECT sr.run_id
                                     FROM compaction.source_runs AS sr
                                     WHERE sr.conversation_id = p_conversation_id))
          AND sm.role IN ('user', 'assistant')
          AND sm.conversation_id IS DISTINCT FROM p_conversation_id;
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT sm.run_id) INTO v_foreign
        FROM compaction.source_messages AS sm
        WHERE sm.run_id = ANY (v_runs)
          AND sm.role IN ('user', 'assistant')
          AND sm.conversation_id IS DISTINCT FROM p_conversation_id;
    END IF;
    -- The runs named, found by run id first (OFFSET 0 keeps the conversation's test out
    -- of that scan): in this function's generic plan, both tests in one scan were
    -- planned on the conversation's prefix of the runs' key wherever conversations are
    -- small on average, reading every run of a large one (revision 0034). Read here, in
    -- a statement of their own (revision 0036): inside the statement below, this read of
    -- the runs by run id alone made Citus read every shard of the runs even for a whole
    -- conversation (4.6 ms against 1.2 ms for one conversation's query, sent whole to the
    -- node that holds it). Only re-derivation names runs, and it never runs on Citus.
    IF p_run_ids IS NOT NULL THEN
        SELECT pg_catalog.array_agg(n.run_id), pg_catalog.array_agg(n.status)
        INTO v_named_ids, v_named_status
        FROM (SELECT sr.run_id, sr.conversation_id, sr.status
              FROM compaction.source_runs AS sr
              WHERE sr.run_id = ANY (p_run_ids)
              OFFSET 0) AS n
        WHERE n.conversation_id = p_conversation_id;
    END IF;
    RETURN QUERY
    -- A lateral aggregate per run: the messages of each run are fetched by the run_id
    -- index, so the cost follows this conversation's size, never the table's.
    WITH runs AS (
        -- Every run of the conversation, or only the runs named: re-derivation judges
        -- the runs a write touched by the run_id index, never the whole conversation.
        SELECT sr.run_id, sr.status
        FROM compaction.source_runs AS sr
        WHERE p_run_ids IS NULL AND sr.conversation_id = p_conversation_id
        UNION ALL
        SELECT u.run_id, u.status
        FROM ROWS FROM (pg_catalog.unnest(v_named_ids), pg_catalog.unnest(v_named_status))
             AS u (run_id, status)
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
