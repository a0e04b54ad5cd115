-- 0048_foreign_messages: the revised §3 (docs/contract.md). A message belongs to its own
-- conversation's run of its run id; a user or assistant message whose conversation has no
-- run of that id is foreign, and breaks the run of that id in every conversation that has
-- one. A run id repeated in two conversations, each with its own run, is now a pair in
-- each. The derived pairs judge each conversation by its own rows; the new table
-- compaction.foreign_messages records, per conversation, the run ids its foreign messages
-- name; the tracking writes only the rows of the conversations a statement names; a read
-- uses a conversation's derived state while no foreign message names one of its pairs'
-- runs (compaction.derived_state_serves), and judges it from the views otherwise.
-- verify_conversation checks the record too. A message a host's view gives no
-- conversation breaks nothing (it belongs to none, and is recorded under none). The
-- functions changed are replaced whole.


-- Revision 0048 (docs/contract.md §3, §11): the one question of a run's judgement
-- that crosses conversations, whether a foreign message names the run, asked of a
-- record the tracking keeps per conversation. A message is foreign when its own
-- conversation has no run of its run_id; such a user or assistant message breaks run R
-- in every conversation that has one. One row per (conversation holding such messages,
-- run id they name): the conversation's own tracking writes it (its rows only,
-- co-located on Citus), and a conversation's reads ask it about their pairs' run ids
-- (compaction.derived_state_serves). Rows exist only while a message waits for its Run
-- (written before it) or is misfiled, so the table stays small, and it is read whole:
-- no index but its key, which the tracking's writes use.
CREATE TABLE compaction.foreign_messages (
    conversation_id text NOT NULL,
    run_id          text NOT NULL,
    CONSTRAINT foreign_messages_pkey PRIMARY KEY (conversation_id, run_id)
);
COMMENT ON TABLE compaction.foreign_messages IS
    'Derived state: each conversation holding a user/assistant message whose run_id names no run of that conversation (a foreign message, contract §3), with the run id named; such a message breaks run R in every conversation that has one';

CREATE TRIGGER foreign_messages_truncate_guard
    BEFORE TRUNCATE ON compaction.foreign_messages
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.foreign_messages ENABLE ALWAYS TRIGGER foreign_messages_truncate_guard;

DROP FUNCTION compaction.judge_runs(text, text[]);

CREATE OR REPLACE FUNCTION compaction.derived_state_serves(p_conversation_id text)
RETURNS boolean
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_named text[];
BEGIN
    IF NOT compaction.derived_state_current() THEN
        RETURN false;
    END IF;
    SELECT pg_catalog.array_agg(DISTINCT f.run_id) INTO v_named
    FROM compaction.foreign_messages AS f;
    IF v_named IS NULL THEN
        RETURN true;
    END IF;
    RETURN NOT EXISTS (
        SELECT 1
        FROM pg_catalog.unnest(v_named) AS k (run_id)
        CROSS JOIN LATERAL (
            SELECT 1 FROM compaction.pairs AS p
            WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
              AND p.run_id = k.run_id
              AND (p.conversation_id = p_conversation_id) IS TRUE
            OFFSET 0) AS q);
END
$$;
COMMENT ON FUNCTION compaction.derived_state_serves(text) IS
    'True when reads of this conversation use the derived state: it is in use (derived_state_current) and no foreign message (contract §3) names a run of one of the conversation''s derived pairs (else its reads judge it from the views)';

CREATE OR REPLACE FUNCTION compaction.judge_runs(p_conversation_id text, p_run_ids text[] DEFAULT NULL,
                                      p_foreign boolean DEFAULT true)
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
    -- §3 (revision 0048): a run named by a foreign user or assistant message, one filed
    -- under a conversation that has no run of that id, is no pair. A message whose own
    -- conversation has a run of that id belongs to that run alone. That is the one
    -- question that crosses conversations, so it is asked on its own, by run id (a read
    -- of every shard under Citus); everything else below addresses this conversation's
    -- rows only. A message a host's view gives no conversation belongs to none and is
    -- recorded under none (compaction.foreign_messages is kept per conversation): it
    -- breaks nothing.
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
    IF NOT coalesce(p_foreign, true) THEN
        NULL;  -- the conversation's own rows only: v_foreign stays NULL
    ELSIF p_run_ids IS NULL THEN
        SELECT pg_catalog.array_agg(sr.run_id) INTO v_runs
        FROM compaction.source_runs AS sr
        WHERE sr.conversation_id = p_conversation_id;
        v_many := coalesce(pg_catalog.cardinality(v_runs) > 256, false);
    ELSE
        v_runs := p_run_ids;
    END IF;
    IF NOT coalesce(p_foreign, true) THEN
        NULL;
    ELSIF v_many THEN
        SELECT pg_catalog.array_agg(DISTINCT sm.run_id) INTO v_foreign
        FROM compaction.source_messages AS sm
        WHERE sm.run_id = ANY (ARRAY(SELECT sr.run_id
                                     FROM compaction.source_runs AS sr
                                     WHERE sr.conversation_id = p_conversation_id))
          AND sm.role IN ('user', 'assistant')
          AND sm.conversation_id <> p_conversation_id
          AND NOT EXISTS (SELECT 1 FROM compaction.source_runs AS so
                          WHERE so.conversation_id = sm.conversation_id
                            AND so.run_id = sm.run_id);
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT sm.run_id) INTO v_foreign
        FROM compaction.source_messages AS sm
        WHERE sm.run_id = ANY (v_runs)
          AND sm.role IN ('user', 'assistant')
          AND sm.conversation_id <> p_conversation_id
          AND NOT EXISTS (SELECT 1 FROM compaction.source_runs AS so
                          WHERE so.conversation_id = sm.conversation_id
                            AND so.run_id = sm.run_id);
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
COMMENT ON FUNCTION compaction.judge_runs(text, text[], boolean) IS
    'Internal: every run of a conversation (or only those named) with the first eligibility rule it breaks (NULL when it forms a pair), its pair''s ids and UTF-8 byte lengths; no text (p_foreign = false: by the conversation''s own rows, without the foreign-message rule)';

CREATE OR REPLACE FUNCTION compaction.indexed_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_message_id      text,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY
        SELECT p.pair_index, p.run_id, p.user_message_id, p.user_bytes,
               p.assistant_message_id, p.assistant_bytes
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id
        ORDER BY p.pair_index;
    ELSE
        RETURN QUERY
        SELECT j.pair_index, j.run_id, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes
        FROM compaction.judged_pairs(p_conversation_id) AS j
        ORDER BY j.pair_index;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.indexed_pairs(text) IS
    'Eligible pairs of a conversation without their text: pair_index, run and message ids, UTF-8 byte lengths (what planning and projection need before reading any text)';

CREATE OR REPLACE FUNCTION compaction.explain_runs(p_conversation_id text)
RETURNS TABLE (run_id text, run_status text, eligible boolean, reason text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_unpaired text[];
    v_runs     text[];
    v_statuses text[];
    v_reasons  text[];
    v_seqs     bigint[];
BEGIN
    IF NOT compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY
        SELECT j.run_id, j.run_status, j.reason IS NULL, j.reason
        FROM compaction.judge_runs(p_conversation_id) AS j
        ORDER BY j.reason IS NULL, j.user_seq NULLS FIRST, j.run_id;
        RETURN;
    END IF;
    -- The runs without a pair are judged, for their reasons. Each step is a statement of
    -- its own, results passed on in arrays (DESIGN §11: no engine function nested in a
    -- query on distributed tables).
    SELECT pg_catalog.array_agg(sr.run_id) INTO v_unpaired
    FROM compaction.source_runs AS sr
    WHERE sr.conversation_id = p_conversation_id
      AND NOT EXISTS (SELECT 1 FROM compaction.pairs AS p
                      WHERE p.conversation_id = p_conversation_id AND p.run_id = sr.run_id);
    SELECT pg_catalog.array_agg(j.run_id), pg_catalog.array_agg(j.run_status),
           pg_catalog.array_agg(j.reason), pg_catalog.array_agg(j.user_seq)
    INTO v_runs, v_statuses, v_reasons, v_seqs
    FROM compaction.judge_runs(p_conversation_id, coalesce(v_unpaired, '{}')) AS j;
    RETURN QUERY
    SELECT v.run_id, v.run_status, v.reason IS NULL, v.reason
    FROM (SELECT sr.run_id, sr.status AS run_status, NULL::text AS reason, p.user_seq
          FROM compaction.source_runs AS sr
          JOIN compaction.pairs AS p
            ON p.conversation_id = p_conversation_id AND p.run_id = sr.run_id
          WHERE sr.conversation_id = p_conversation_id
          UNION ALL
          SELECT j.run_id, j.run_status, j.reason, j.user_seq
          FROM ROWS FROM (pg_catalog.unnest(v_runs), pg_catalog.unnest(v_statuses),
                          pg_catalog.unnest(v_reasons), pg_catalog.unnest(v_seqs))
               AS j (run_id, run_status, reason, user_seq)) AS v
    ORDER BY v.reason IS NULL, v.user_seq NULLS FIRST, v.run_id;
END
$$;
COMMENT ON FUNCTION compaction.explain_runs(text) IS
    'Every run of a conversation with whether it forms a pair and, if not, the first rule it breaks (no message text)';

CREATE OR REPLACE FUNCTION compaction.current_range(p_conversation_id text, p_from_pair int)
RETURNS TABLE (pair_count bigint, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_pairs bigint;
    v_ids   text[];
BEGIN
    IF compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY
        SELECT coalesce((SELECT cs.pair_count::bigint FROM compaction.conversation_state AS cs
                         WHERE cs.conversation_id = p_conversation_id), 0),
               r.source_message_ids, r.source_hash
        FROM (SELECT 1) AS one
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
        RETURN;
    END IF;
    -- Judged from the views: the number of pairs needs no text; the hash reads the
    -- range's 20 messages and nothing else.
    SELECT count(*),
           ARRAY(SELECT pg_catalog.unnest(array_agg(
               ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)
               FILTER (WHERE j.pair_index BETWEEN p_from_pair AND p_from_pair::bigint + 9)))
    INTO v_pairs, v_ids
    FROM compaction.judged_pairs(p_conversation_id) AS j;
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0
       OR pg_catalog.cardinality(v_ids) <> 20 THEN
        RETURN QUERY SELECT v_pairs, NULL::text[], NULL::text;
    ELSE
        RETURN QUERY SELECT v_pairs, v_ids, compaction.range_hash(p_conversation_id, v_ids);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.current_range(text, int) IS
    'Internal: the conversation''s pair count and, when pairs from_pair..from_pair+9 exist, their 20 current source ids and hash';

CREATE OR REPLACE FUNCTION compaction.current_ranges(p_conversation_id text, p_from_pairs int[])
RETURNS TABLE (from_pair int, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_from int[];
    v_ids  text[];
BEGIN
    IF compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY
        SELECT r.from_pair, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair = ANY (p_from_pairs)
        ORDER BY r.from_pair;
        RETURN;
    END IF;
    -- v_ids: each complete range's 20 ids [u0, a0, ..., u9, a9], in v_from's order; then
    -- their hashes, one statement each (DESIGN §11).
    SELECT pg_catalog.array_agg(c.from_pair ORDER BY c.from_pair),
           ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(c.ids ORDER BY c.from_pair)))
    INTO v_from, v_ids
    FROM (SELECT (j.pair_index / 10 * 10)::int AS from_pair,
                 ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(
                     ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)))
                     AS ids
          FROM compaction.judged_pairs(p_conversation_id) AS j
          WHERE j.pair_index / 10 * 10 = ANY (p_from_pairs)
          GROUP BY j.pair_index / 10 * 10
          HAVING count(*) = 10) AS c;
    RETURN QUERY
    SELECT u.from_pair, g.ids, h.source_hash
    FROM ROWS FROM (pg_catalog.unnest(v_from)) WITH ORDINALITY AS u (from_pair, k)
    JOIN compaction.id_ranges(v_ids) AS g ON g.k = u.k
    LEFT JOIN compaction.range_hashes(p_conversation_id, v_from, v_ids) AS h
      ON h.from_pair = u.from_pair
    ORDER BY u.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.current_ranges(text, int[]) IS
    'Internal: current_range for many ranges of one conversation (one judgement from the views, or one read of the derived state): each range asked for whose 10 pairs exist, with its 20 current source ids and hash';

CREATE OR REPLACE FUNCTION compaction.target_ranges(p_conversation_id text, p_from_pairs int[] DEFAULT NULL)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_from int[];
    v_ids  text[];
BEGIN
    IF compaction.derived_state_serves(p_conversation_id) THEN
        IF p_from_pairs IS NULL THEN
            RETURN QUERY
            SELECT r.from_pair, r.from_pair + 9, r.source_message_ids, r.source_hash
            FROM compaction.ranges AS r
            JOIN compaction.conversation_state AS cs ON cs.conversation_id = r.conversation_id
            WHERE r.conversation_id = p_conversation_id
              AND compaction.is_target(r.from_pair, cs.pair_count)
            ORDER BY r.from_pair;
        ELSE
            -- The ranges named, each by key (a worker names a few of a long conversation).
            RETURN QUERY
            SELECT r.from_pair, r.from_pair + 9, r.source_message_ids, r.source_hash
            FROM compaction.ranges AS r
            JOIN compaction.conversation_state AS cs ON cs.conversation_id = r.conversation_id
            WHERE r.conversation_id = p_conversation_id AND r.from_pair = ANY (p_from_pairs)
              AND compaction.is_target(r.from_pair, cs.pair_count)
            ORDER BY r.from_pair;
        END IF;
        RETURN;
    END IF;
    -- Judged from the views: the targets' ids, then all their hashes in one statement
    -- (revision 0023; range_hash per target before).
    WITH pairs AS (
        SELECT j.pair_index / 10 * 10 AS from_pair,
               j.pair_index,
               j.user_message_id,
               j.assistant_message_id,
               count(*) OVER () AS n_pairs
        FROM compaction.judged_pairs(p_conversation_id) AS j
    ),
    ranges AS (
        SELECT p.from_pair,
               -- unnest of the 10x2 array walks it row by row: [u0, a0, u1, a1, ...]
               ARRAY(SELECT pg_catalog.unnest(array_agg(
                   ARRAY[p.user_message_id, p.assistant_message_id] ORDER BY p.pair_index)))
                   AS ids
        FROM pairs AS p
        WHERE compaction.is_target(p.from_pair, p.n_pairs)
          AND (p_from_pairs IS NULL OR p.from_pair = ANY (p_from_pairs))
        GROUP BY p.from_pair
    )
    SELECT pg_catalog.array_agg(r.from_pair::int ORDER BY r.from_pair),
           ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(r.ids ORDER BY r.from_pair)))
    INTO v_from, v_ids
    FROM ranges AS r;
    RETURN QUERY
    SELECT u.from_pair, u.from_pair + 9, g.ids, h.source_hash
    FROM ROWS FROM (pg_catalog.unnest(v_from)) WITH ORDINALITY AS u (from_pair, k)
    JOIN compaction.id_ranges(v_ids) AS g ON g.k = u.k
    LEFT JOIN compaction.range_hashes(p_conversation_id, v_from, v_ids) AS h
      ON h.from_pair = u.from_pair
    ORDER BY u.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.target_ranges(text, int[]) IS
    'Internal: the ranges named (all when NULL) that the window policy makes targets now, with their 20 source ids and hash, from one judgement (plan_targets and claim_targets)';

CREATE OR REPLACE FUNCTION compaction.refresh_foreign_messages(p_conversation_id text, p_run_ids text[])
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    IF p_run_ids IS NULL THEN
        DELETE FROM compaction.foreign_messages AS f
        WHERE f.conversation_id = p_conversation_id;
        INSERT INTO compaction.foreign_messages (conversation_id, run_id)
        SELECT DISTINCT p_conversation_id, sm.run_id
        FROM compaction.source_messages AS sm
        WHERE sm.conversation_id = p_conversation_id
          AND sm.run_id IS NOT NULL
          AND sm.role IN ('user', 'assistant')
          AND NOT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                          WHERE sr.conversation_id = p_conversation_id
                            AND sr.run_id = sm.run_id);
        RETURN;
    END IF;
    -- Each run named looked up on its own, by key (a lateral subquery per run, kept apart
    -- by OFFSET 0, as in rederive, revision 0035); its messages only when the conversation
    -- has no such run (the common answer: it has). As EXISTS tests, the generic plan may
    -- hash a subquery instead, reading every run of the conversation once per write.
    WITH judged AS (
        SELECT k.run_id, r.held IS NULL AND coalesce(m.found, false) AS is_foreign
        FROM (SELECT DISTINCT u.run_id FROM pg_catalog.unnest(p_run_ids) AS u (run_id)
              WHERE u.run_id IS NOT NULL) AS k
        LEFT JOIN LATERAL (
            SELECT true AS held FROM compaction.source_runs AS sr
            WHERE sr.run_id = k.run_id AND sr.conversation_id = p_conversation_id
            OFFSET 0) AS r ON true
        LEFT JOIN LATERAL (
            SELECT pg_catalog.bool_or(true) AS found
            FROM (SELECT 1 FROM compaction.source_messages AS sm
                  WHERE r.held IS NULL
                    AND sm.run_id = k.run_id
                    AND sm.conversation_id = p_conversation_id
                    AND sm.role IN ('user', 'assistant')
                  OFFSET 0) AS x) AS m ON true
    ), gone AS (
        DELETE FROM compaction.foreign_messages AS f
        USING judged AS j
        WHERE f.conversation_id = p_conversation_id AND f.run_id = j.run_id
          AND NOT j.is_foreign
    )
    INSERT INTO compaction.foreign_messages (conversation_id, run_id)
    SELECT p_conversation_id, j.run_id FROM judged AS j WHERE j.is_foreign
    ON CONFLICT (conversation_id, run_id) DO NOTHING;
END
$$;
COMMENT ON FUNCTION compaction.refresh_foreign_messages(text, text[]) IS
    'Internal: with the conversation''s conversation_state row held, records which of the run ids named (NULL: all) the conversation''s foreign user/assistant messages name (contract §3), from its own rows';

CREATE OR REPLACE FUNCTION compaction.rederive(p_conversation_id text, p_run_ids text[],
                                    p_table oid DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
VOLATILE
-- No SECURITY DEFINER and no SET clause: only the engine's owner may execute it, and it
-- runs under the settings of its callers, the tracking trigger and rederive_conversation
-- (owner's rights, search_path pg_catalog, pg_temp, JIT off; the trigger also forces
-- generic plans, which suit every statement here: each looks rows up by key). Applying
-- SET clauses on each call cost more than this function's statements. Every name is
-- schema-qualified all the same.
AS $$
DECLARE
    v_runs  text[] := p_run_ids;
    v_count int;
BEGIN
    -- First: this row serialises the conversation's derived-state writers (see above).
    -- A transaction bumps generation once, also when nothing derived changes: a writer at
    -- REPEATABLE READ whose snapshot misses this transaction's source rows (a message of
    -- a Run it is settling) must fail on this row rather than judge without them. When
    -- the row's current version is this transaction's own (an earlier statement bumped
    -- it, outside any subtransaction), its lock is held until commit and the bump is
    -- done: reading it suffices, and the row does not grow a version per statement.
    UPDATE compaction.conversation_state AS cs
    SET generation = cs.generation + 1
    WHERE cs.conversation_id = p_conversation_id
      AND cs.xmin <> pg_catalog.pg_current_xact_id()::xid
    RETURNING cs.pair_count INTO v_count;
    IF NOT FOUND THEN
        SELECT cs.pair_count INTO v_count
        FROM compaction.conversation_state AS cs
        WHERE cs.conversation_id = p_conversation_id;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (p_conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1
        RETURNING cs.pair_count INTO v_count;
    END IF;
    -- Cheap first (one statement, the common answer no): a rebuild under way has not
    -- reached the conversation, or none is under way and no trigger of the calling table
    -- is one the derived state was stamped under (its tracking was attached since); then
    -- defer_to_rebuild decides under its lock. (No name-typed argument: its collation,
    -- "C", would become the text parameters' and keep every lookup here off its index.)
    IF p_table IS NOT NULL
       AND EXISTS (SELECT 1 FROM compaction.source_tracking AS st
                   WHERE st.singleton
                     AND (st.rebuild_after < p_conversation_id
                          OR (st.rebuild_after IS NULL
                              AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t
                                              WHERE t.tgrelid = p_table
                                                AND t.oid = ANY (st.object_oids)))))
       AND compaction.defer_to_rebuild(p_conversation_id) THEN
        RETURN;
    END IF;
    -- Revision 0048: the conversation's foreign messages first; the pairs below are
    -- judged by its own rows alone.
    PERFORM compaction.refresh_foreign_messages(p_conversation_id, p_run_ids);

    IF v_runs IS NULL THEN
        v_runs := ARRAY(SELECT sr.run_id FROM compaction.source_runs AS sr
                        WHERE sr.conversation_id = p_conversation_id
                        UNION
                        SELECT p.run_id FROM compaction.pairs AS p
                        WHERE p.conversation_id = p_conversation_id);
    -- Each run named is looked up on its own (a lateral subquery per run, kept apart by
    -- OFFSET 0), never as "run_id = ANY (the runs) of this conversation": the trigger's
    -- generic plan prices an array as ten probes, so wherever conversations are small on
    -- average it found them on the conversation's prefix of a key, and every tracked
    -- write to a large conversation read all its runs and pairs (revision 0035).
    ELSIF NOT EXISTS (SELECT 1
                      FROM pg_catalog.unnest(v_runs) AS k (run_id)
                      CROSS JOIN LATERAL (
                          SELECT 1 FROM compaction.source_runs AS sr
                          WHERE sr.run_id = k.run_id
                            AND sr.conversation_id = p_conversation_id
                            -- judge_runs' first rule: only a Run in one of these can pair
                            -- (track_source_changes asks the same, word for word)
                            AND sr.status IN ('completed', 'partial', 'clarify_pending')
                            -- and only one with a user message of its own (revision
                            -- 0047; 0048: a message belongs to its own conversation's
                            -- run, docs/contract.md §3, so no other conversation is
                            -- read). A Run written in its final state before its
                            -- messages ends here, unjudged.
                            AND EXISTS (SELECT 1 FROM compaction.source_messages AS sm
                                        WHERE sm.run_id = k.run_id
                                          AND sm.conversation_id = p_conversation_id
                                          AND sm.role = 'user')
                          OFFSET 0) AS r)
          AND NOT EXISTS (SELECT 1
                          FROM pg_catalog.unnest(v_runs) AS k (run_id)
                          CROSS JOIN LATERAL (
                              -- The conversation as a filter, not an index condition
                              -- (revision 0044): the only index for this lookup is then
                              -- pairs_run_hash_idx. As a condition, where pairs has no
                              -- statistics yet, the planner read the conversation's
                              -- primary key entries as well (a BitmapAnd), all of them for
                              -- every tracked write.
                              SELECT 1 FROM compaction.pairs AS p
                              WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                                AND p.run_id = k.run_id
                                AND (p.conversation_id = p_conversation_id) IS TRUE
                              OFFSET 0) AS q) THEN
        -- No touched Run can form a pair, and none had one: nothing derived changes.
        -- One statement instead of judging the Runs' messages.
        RETURN;
    END IF;
    PERFORM compaction.rederive_runs(p_conversation_id, v_runs, v_count);
END
$$;
COMMENT ON FUNCTION compaction.rederive(text, text[], oid) IS
    'Internal: re-derives one conversation''s pairs and ranges after a write touched the runs named (NULL: all), from the earliest changed position on; from a tracking trigger (p_table, its table), not when a rebuild will derive the conversation after this transaction (compaction.defer_to_rebuild)';

CREATE OR REPLACE FUNCTION compaction.rederive_runs(
    p_conversation_id text, p_run_ids text[], p_pair_count int)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_fresh compaction.pairs[];
    v_stale compaction.pairs[];
    v_last  text;
    v_after boolean;
    v_new   int;
BEGIN
    -- In one statement: the pairs these runs form now (pair_index is set below), the
    -- rows they had, and whether every new pair comes after the last pair.
    WITH fresh AS (
        SELECT j.run_id, j.user_seq, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes
        -- by the conversation's own rows (revision 0048; see judge_runs)
        FROM compaction.judge_runs(p_conversation_id, p_run_ids, false) AS j
        WHERE j.reason IS NULL
    )
    SELECT (SELECT coalesce(array_agg(ROW(p_conversation_id, f.run_id, 0, f.user_seq,
                                          f.user_message_id, f.user_bytes,
                                          f.assistant_message_id,
                                          f.assistant_bytes)::compaction.pairs), '{}')
            FROM fresh AS f),
           -- None where the conversation has no pair (a rebuild's first pass). A few runs
           -- (a write's): each run's pair looked up on its own, as in rederive (revision
           -- 0035), a run named twice once. Many (the whole conversation re-derived, a
           -- bulk statement): the conversation's pairs joined with them, where as many
           -- probes would cost more. A generic plan keeps both; the one-time tests pick.
           (SELECT coalesce(array_agg(s.p), '{}')
            FROM (SELECT q.p
                  FROM (SELECT DISTINCT k.run_id
                        FROM pg_catalog.unnest(p_run_ids) AS k (run_id)
                        WHERE p_pair_count > 0 AND pg_catalog.cardinality(p_run_ids) <= 16) AS k
                  CROSS JOIN LATERAL (
                      -- the conversation as a filter: see rederive (revision 0044)
                      SELECT p FROM compaction.pairs AS p
                      WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                        AND p.run_id = k.run_id
                        AND (p.conversation_id = p_conversation_id) IS TRUE
                      OFFSET 0) AS q
                  UNION ALL
                  SELECT p FROM compaction.pairs AS p
                  WHERE p_pair_count > 0 AND pg_catalog.cardinality(p_run_ids) > 16
                    AND p.conversation_id = p_conversation_id
                    -- a semi-join, not "= ANY": an array parameter is searched row by
                    -- row, not hashed (30,000 runs: 23.9 s a conversation, revision 0034)
                    AND p.run_id IN (SELECT k.run_id
                                     FROM pg_catalog.unnest(p_run_ids) AS k (run_id))) AS s),
           l.user_message_id,
           NOT EXISTS (SELECT 1 FROM fresh AS f
                       WHERE NOT CASE WHEN l.user_seq IS NULL THEN
                                          f.user_seq IS NULL
                                          AND f.user_message_id > l.user_message_id
                                      ELSE f.user_seq IS NULL OR f.user_seq > l.user_seq
                                           OR (f.user_seq = l.user_seq
                                               AND f.user_message_id > l.user_message_id)
                                 END)
    INTO v_fresh, v_stale, v_last, v_after
    FROM (SELECT) AS one
    LEFT JOIN compaction.pairs AS l
      ON l.conversation_id = p_conversation_id AND l.pair_index = p_pair_count - 1;
    IF pg_catalog.cardinality(v_fresh) = 0 AND pg_catalog.cardinality(v_stale) = 0 THEN
        RETURN;  -- the runs touched form no pair, before or after: nothing derived changes
    END IF;

    IF pg_catalog.cardinality(v_stale) > 0
       OR NOT (p_pair_count = 0 OR (v_last IS NOT NULL AND v_after)) THEN
        PERFORM compaction.rederive_general(p_conversation_id, p_run_ids, v_fresh, v_stale,
                                            p_pair_count);
        RETURN;
    END IF;

    -- Appending.
    v_new := p_pair_count + pg_catalog.cardinality(v_fresh);
    WITH added AS (
        INSERT INTO compaction.pairs
            (conversation_id, run_id, pair_index, user_seq, user_message_id, user_bytes,
             assistant_message_id, assistant_bytes)
        SELECT p_conversation_id, f.run_id,
               p_pair_count + (pg_catalog.row_number() OVER (ORDER BY f.user_seq, f.user_message_id))::int - 1,
               f.user_seq, f.user_message_id, f.user_bytes, f.assistant_message_id,
               f.assistant_bytes
        FROM pg_catalog.unnest(v_fresh) AS f
        RETURNING 1
    )
    UPDATE compaction.conversation_state AS cs
    SET pair_count = v_new
    WHERE cs.conversation_id = p_conversation_id;
    IF v_new / 10 > p_pair_count / 10 THEN
        -- The ranges the new pairs complete, each hashed from its 20 messages.
        INSERT INTO compaction.ranges AS r
            (conversation_id, from_pair, source_message_ids, source_hash)
        SELECT p_conversation_id, w.from_pair, w.ids, compaction.range_hash(p_conversation_id, w.ids)
        FROM (SELECT g.from_pair,
                     ARRAY(SELECT u.id
                           FROM compaction.pairs AS p
                           CROSS JOIN LATERAL pg_catalog.unnest(
                               ARRAY[p.user_message_id, p.assistant_message_id])
                               WITH ORDINALITY AS u (id, ord)
                           WHERE p.conversation_id = p_conversation_id
                             AND p.pair_index BETWEEN g.from_pair AND g.from_pair + 9
                           ORDER BY p.pair_index, u.ord) AS ids
              FROM pg_catalog.generate_series(p_pair_count / 10 * 10, v_new - 10, 10)
                  AS g (from_pair)) AS w
        ON CONFLICT (conversation_id, from_pair) DO UPDATE
            SET source_message_ids = EXCLUDED.source_message_ids,
                source_hash = EXCLUDED.source_hash;
        -- A range completed again may make its summaries current again.
        PERFORM compaction.rederive_summary_verdicts(
            p_conversation_id,
            ARRAY(SELECT pg_catalog.generate_series(p_pair_count / 10 * 10, v_new - 10, 10)));
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.rederive_runs(text, text[], int) IS
    'Internal: with the conversation_state row held, judges the runs named and appends their new pairs at the end, or hands the change to rederive_general';

CREATE OR REPLACE FUNCTION compaction.track_source_changes()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One cached plan per statement: the transition tables and the runs' key lookups plan
-- the same for every write, and a custom plan per statement cost more than running it.
SET plan_cache_mode = force_generic_plan
-- Every lookup here (and in the rederive functions it calls) is by key. A generic plan
-- made while the tables were still small would scan them instead, and a long transaction
-- (a bulk import into a new database: no ANALYZE in between) would pay for that on every
-- statement, quadratically.
SET enable_seqscan = off
AS $$
DECLARE
    v_conversation_column text := TG_ARGV[0];
    v_run_column          text := nullif(TG_ARGV[1], '');
    v_conversations       text[] := '{}';
    v_runs                text[] := '{}';
    v_conversation        text;
    v_run_ids             text[];
    v_count               int;
    v_unchanged           boolean;
    v_touched             record;
    v_message_ids         text[];
    v_first_seq           bigint;
    v_first_id            text;
    v_runs_known          boolean := v_run_column IS NOT NULL;
BEGIN
    IF TG_LEVEL <> 'STATEMENT' OR TG_WHEN <> 'AFTER' OR TG_NARGS NOT IN (2, 3)
       OR v_conversation_column IS NULL THEN
        RAISE EXCEPTION 'track_source_changes must be an AFTER ... FOR EACH STATEMENT trigger with two or three arguments: the conversation id column, the run id column (or ''''), and for a table without a run column optionally its message id column'
            USING ERRCODE = 'CP020';
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        -- No transition table says what went: stop trusting the derived state until a
        -- rebuild (every function judges from the views meanwhile, exact and slower).
        -- A rebuild's resume point goes too (revision 0030): the conversations before it
        -- lost rows no trigger re-derived, so the next rebuild starts over, and one under
        -- way fails at its next commit instead of putting them in use.
        UPDATE compaction.source_tracking
        SET stamp = NULL, object_oids = NULL, stamped_at = NULL,
            rebuild_stamp = NULL, rebuild_after = NULL, rebuild_done = NULL,
            rebuild_total = NULL, rebuild_started_at = NULL, rebuild_updated_at = NULL;
        RETURN NULL;
    END IF;

    -- The columns named by the arguments, as text (the form the views expose them in).
    -- Static statements over the transition tables keep their plans across calls, where
    -- dynamic SQL would be planned again for every statement of the host. Columns named
    -- conversation_id and run_id (the reference tables) are read directly: plpgsql plans
    -- a statement only when it first runs, per table, so these never meet a table
    -- without them; other names go through the row as jsonb.
    IF v_conversation_column = 'conversation_id' AND v_run_column = 'run_id' THEN
        IF TG_OP = 'INSERT' THEN
            SELECT coalesce(array_agg(n.conversation_id::text), '{}'),
                   coalesce(array_agg(n.run_id::text), '{}')
            INTO v_conversations, v_runs
            FROM new_rows AS n;
        ELSIF TG_OP = 'DELETE' THEN
            SELECT coalesce(array_agg(o.conversation_id::text), '{}'),
                   coalesce(array_agg(o.run_id::text), '{}')
            INTO v_conversations, v_runs
            FROM old_rows AS o;
        ELSE
            SELECT coalesce(array_agg(r.conversation_id), '{}'), coalesce(array_agg(r.run_id), '{}')
            INTO v_conversations, v_runs
            FROM (SELECT n.conversation_id::text, n.run_id::text FROM new_rows AS n
                  UNION ALL
                  SELECT o.conversation_id::text, o.run_id::text FROM old_rows AS o)
                AS r (conversation_id, run_id);
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM new_rows AS n
        CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(n) AS fields) AS j;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM old_rows AS o
        CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(o) AS fields) AS j;
    ELSE
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM (SELECT pg_catalog.to_jsonb(n) AS fields FROM new_rows AS n
              UNION ALL
              SELECT pg_catalog.to_jsonb(o) FROM old_rows AS o) AS j;
    END IF;

    v_conversation := v_conversations[1];

    -- A table without a run column (its runs are derived by the views, as in the Agents
    -- SDK recipe) that names its message id column: an INSERT into one conversation
    -- touches the runs the view gives the new messages, and the run of the message just
    -- before the earliest of them (an insert can cut that run short). An append then
    -- re-derives its own run, not the whole conversation. Updates and deletes re-derive
    -- the conversation: the run a message left cannot be known once it has left. When
    -- the view shows none of the new messages, or one without a seq, the same.
    -- Each new message is looked up by its id on its own (revision 0039, as revision
    -- 0035 does for the runs): asked as "these ids of this conversation", the generic
    -- plan priced the ids as ten and read the conversation's prefix of an index instead,
    -- every entry of a long conversation twice an insert (in a 30,000-item session of
    -- the Agents SDK's table, an append 4.5 ms against 2.2 ms at 600 items).
    IF NOT v_runs_known AND TG_NARGS = 3 AND TG_OP = 'INSERT'
       AND v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        v_message_ids := ARRAY(SELECT j.fields ->> TG_ARGV[2]
                               FROM new_rows AS n
                               CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(n) AS fields) AS j);
        SELECT sm.seq, sm.message_id INTO v_first_seq, v_first_id
        FROM pg_catalog.unnest(v_message_ids) AS k (message_id)
        CROSS JOIN LATERAL (
            SELECT s.seq, s.message_id
            FROM compaction.source_messages AS s
            WHERE s.message_id = k.message_id AND s.conversation_id = v_conversation
            OFFSET 0) AS sm
        ORDER BY sm.seq NULLS FIRST, sm.message_id
        LIMIT 1;
        IF v_first_seq IS NOT NULL THEN
            v_runs := ARRAY(
                SELECT sm.run_id
                FROM pg_catalog.unnest(v_message_ids) AS k (message_id)
                CROSS JOIN LATERAL (
                    SELECT s.run_id
                    FROM compaction.source_messages AS s
                    WHERE s.message_id = k.message_id AND s.conversation_id = v_conversation
                    OFFSET 0) AS sm
                UNION
                (SELECT sp.run_id
                 FROM compaction.source_messages AS sp
                 WHERE sp.conversation_id = v_conversation
                   AND (sp.seq, sp.message_id) < (v_first_seq, v_first_id)
                 ORDER BY sp.seq DESC, sp.message_id DESC
                 LIMIT 1));
            v_runs_known := true;
        END IF;
    END IF;

    -- The common statement (an agent's single-row writes): its rows name one conversation.
    -- Revision 0048: a statement re-derives only the conversations its rows name, by
    -- their own rows (docs/contract.md §3: a message belongs to its own conversation's
    -- run of its run id, and a foreign one is recorded under its own conversation,
    -- compaction.foreign_messages; §11), so no other conversation is asked about here.
    IF v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        IF NOT v_runs_known THEN
            PERFORM compaction.rederive(v_conversation, NULL, TG_RELID);
            RETURN NULL;
        END IF;
        v_run_ids := pg_catalog.array_remove(v_runs, NULL);
        IF pg_catalog.cardinality(v_run_ids) = 0 THEN
            RETURN NULL;  -- rows of no run: no pair can change
        ELSIF pg_catalog.cardinality(v_run_ids) > 2 THEN
            v_run_ids := ARRAY(SELECT DISTINCT r.run_id
                               FROM pg_catalog.unnest(v_run_ids) AS r (run_id));
        END IF;
        -- For a later statement of a transaction that already holds this conversation's
        -- conversation_state row (see rederive): rederive's no-change question and the
        -- pair count, in one statement: its snapshot is taken after the lock was, so it
        -- sees what rederive would see. An agent's second and third statements per Run
        -- end here.
        SELECT cs.pair_count,
               CASE WHEN cs.pair_count IS NOT NULL THEN
                   -- rederive's no-change test, word for word
                   NOT EXISTS (SELECT 1
                               FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                               CROSS JOIN LATERAL (
                                   SELECT 1 FROM compaction.source_runs AS sr
                                   WHERE sr.run_id = k.run_id
                                     AND sr.conversation_id = v_conversation
                                     AND sr.status IN ('completed', 'partial', 'clarify_pending')
                                     AND EXISTS (SELECT 1
                                                 FROM compaction.source_messages AS sm
                                                 WHERE sm.run_id = k.run_id
                                                   AND sm.conversation_id = v_conversation
                                                   AND sm.role = 'user')
                                   OFFSET 0) AS r)
                   AND NOT EXISTS (SELECT 1
                                   FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                                   CROSS JOIN LATERAL (
                                       -- the conversation as a filter: see rederive
                                       -- (revision 0044)
                                       SELECT 1 FROM compaction.pairs AS p
                                       WHERE pg_catalog.hashtext(p.run_id)
                                             = pg_catalog.hashtext(k.run_id)
                                         AND p.run_id = k.run_id
                                         AND (p.conversation_id = v_conversation) IS TRUE
                                       OFFSET 0) AS q)
               END
        INTO v_count, v_unchanged
        FROM (SELECT) AS one
        LEFT JOIN compaction.conversation_state AS cs
          ON cs.conversation_id = v_conversation
         AND cs.xmin = pg_catalog.pg_current_xact_id()::xid;
        IF v_count IS NULL THEN
            PERFORM compaction.rederive(v_conversation, v_run_ids, TG_RELID);
            RETURN NULL;
        END IF;
        -- The row is held: the record of foreign messages first, as rederive does (also
        -- for a conversation left to a rebuild below, which derives it again whole).
        PERFORM compaction.refresh_foreign_messages(v_conversation, v_run_ids);
        IF v_unchanged THEN
            NULL;
        ELSIF EXISTS (SELECT 1 FROM compaction.source_tracking AS st
                      WHERE st.singleton
                        AND (st.rebuild_after < v_conversation
                             OR (st.rebuild_after IS NULL
                                 AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t
                                                 WHERE t.tgrelid = TG_RELID
                                                   AND t.oid = ANY (st.object_oids)))))
              AND compaction.defer_to_rebuild(v_conversation) THEN
            NULL;  -- left to the rebuild (compaction.rederive's test)
        ELSE
            PERFORM compaction.rederive_runs(v_conversation, v_run_ids, v_count);
        END IF;
        RETURN NULL;
    END IF;

    -- Each touched conversation once, in a fixed order (concurrent bulk writers lock
    -- conversation_state rows in one order), with the runs its rows name.
    FOR v_touched IN
        SELECT t.conversation_id,
               array_agg(DISTINCT t.run_id) FILTER (WHERE t.run_id IS NOT NULL) AS run_ids
        FROM ROWS FROM (pg_catalog.unnest(v_conversations), pg_catalog.unnest(v_runs))
             AS t (conversation_id, run_id)
        WHERE t.conversation_id IS NOT NULL
        GROUP BY t.conversation_id
        ORDER BY t.conversation_id
    LOOP
        IF v_run_column IS NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, NULL, TG_RELID);
        ELSIF v_touched.run_ids IS NOT NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, v_touched.run_ids, TG_RELID);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.track_source_changes() IS
    'Trigger (AFTER ... FOR EACH STATEMENT, transition tables new_rows/old_rows; arguments: conversation id column, run id column or ''''): keeps the derived state of the conversations a statement touched';

CREATE OR REPLACE FUNCTION compaction.verify_conversation(p_conversation_id text)
RETURNS TABLE (problem text, detail text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_ids     bigint[];
    v_scopes  text[];
    v_froms   int[];
    v_reasons text[];
    v_judged  jsonb;
    v_ranges  jsonb;
    v_foreign text[];
BEGIN
    -- Every summary judged now against the derived ranges (checked against the views
    -- below): the verdicts the derived state must hold.
    SELECT pg_catalog.array_agg(j.summary_id), pg_catalog.array_agg(j.scope),
           pg_catalog.array_agg(j.from_pair), pg_catalog.array_agg(j.reason)
    INTO v_ids, v_scopes, v_froms, v_reasons
    FROM compaction.judge_summaries(p_conversation_id, NULL) AS j;
    -- The pairs judged from the views and the full ranges' hashes, each in a statement
    -- that reads no engine table (revision 0022): on Citus a statement that reads a
    -- distributed table runs on the shard, where these functions cannot run theirs.
    -- Revision 0048: the pairs as the conversation's own rows make them (every rule of
    -- docs/contract.md §3 but the foreign-message one, which reads apply from the record
    -- of foreign messages checked below), numbered as judged_pairs numbers them.
    SELECT coalesce(pg_catalog.jsonb_agg(pg_catalog.to_jsonb(j)), '[]')
    INTO v_judged
    FROM (SELECT (row_number() OVER w - 1)::int AS pair_index,
                 o.run_id, o.user_seq, o.user_message_id, o.user_bytes,
                 o.assistant_message_id, o.assistant_bytes
          FROM compaction.judge_runs(p_conversation_id, NULL, false) AS o
          WHERE o.reason IS NULL
          WINDOW w AS (ORDER BY o.user_seq, o.user_message_id)) AS j;
    -- The run ids this conversation's foreign messages name, judged from the views.
    SELECT pg_catalog.array_agg(DISTINCT sm.run_id ORDER BY sm.run_id) INTO v_foreign
    FROM compaction.source_messages AS sm
    WHERE sm.conversation_id = p_conversation_id
      AND sm.run_id IS NOT NULL
      AND sm.role IN ('user', 'assistant')
      AND NOT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                      WHERE sr.conversation_id = p_conversation_id
                        AND sr.run_id = sm.run_id);
    SELECT coalesce(pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
               'from_pair', g.from_pair, 'ids', g.ids,
               'hash', compaction.range_hash(p_conversation_id, g.ids))), '[]')
    INTO v_ranges
    FROM (SELECT j.pair_index / 10 * 10 AS from_pair,
                 ARRAY(SELECT pg_catalog.unnest(array_agg(
                     ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)))
                     AS ids
          FROM pg_catalog.jsonb_to_recordset(v_judged)
               AS j (pair_index int, user_message_id text, assistant_message_id text)
          GROUP BY j.pair_index / 10 * 10
          HAVING count(*) = 10) AS g;
    RETURN QUERY
        WITH judged AS (
            SELECT j.*
            FROM pg_catalog.jsonb_to_recordset(v_judged)
                 AS j (pair_index int, run_id text, user_seq bigint, user_message_id text,
                       user_bytes int, assistant_message_id text, assistant_bytes int)
        ), stored AS (
            SELECT p.* FROM compaction.pairs AS p WHERE p.conversation_id = p_conversation_id
        ), judged_ranges AS (
            SELECT r.from_pair, r.ids, r.hash
            FROM pg_catalog.jsonb_to_recordset(v_ranges) AS r (from_pair int, ids text[], hash text)
        ), stored_ranges AS (
            SELECT r.* FROM compaction.ranges AS r WHERE r.conversation_id = p_conversation_id
        ), counts AS (
            SELECT (SELECT count(*) FROM judged) AS judged,
                   (SELECT cs.pair_count FROM compaction.conversation_state AS cs
                    WHERE cs.conversation_id = p_conversation_id) AS stored
        )
        SELECT 'pair_count'::text,
               pg_catalog.format('judged %s pairs, derived state has %s', c.judged,
                                 coalesce(c.stored::text, 'no row'))
        FROM counts AS c
        WHERE c.judged <> coalesce(c.stored, 0)
        UNION ALL
        SELECT CASE WHEN s.run_id IS NULL THEN 'pair_missing'
                    WHEN j.run_id IS NULL THEN 'pair_extra'
                    ELSE 'pair_differs' END,
               pg_catalog.format('run %s: judged %s, derived %s',
                                 coalesce(j.run_id, s.run_id),
                                 CASE WHEN j.run_id IS NULL THEN 'no pair' ELSE pg_catalog.format(
                                     'pair %s (seq %s, user %s %s bytes, assistant %s %s bytes)',
                                     j.pair_index, j.user_seq, j.user_message_id, j.user_bytes,
                                     j.assistant_message_id, j.assistant_bytes) END,
                                 CASE WHEN s.run_id IS NULL THEN 'no pair' ELSE pg_catalog.format(
                                     'pair %s (seq %s, user %s %s bytes, assistant %s %s bytes)',
                                     s.pair_index, s.user_seq, s.user_message_id, s.user_bytes,
                                     s.assistant_message_id, s.assistant_bytes) END)
        FROM judged AS j
        FULL JOIN stored AS s ON s.run_id = j.run_id
        WHERE (j.pair_index, j.user_seq, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes)
              IS DISTINCT FROM
              (s.pair_index, s.user_seq, s.user_message_id, s.user_bytes,
               s.assistant_message_id, s.assistant_bytes)
        UNION ALL
        SELECT CASE WHEN s.from_pair IS NULL THEN 'range_missing'
                    WHEN j.from_pair IS NULL THEN 'range_extra'
                    WHEN j.ids IS DISTINCT FROM s.source_message_ids THEN 'range_ids_differ'
                    ELSE 'range_hash_differs' END,
               pg_catalog.format('pairs %s-%s: judged hash %s, derived hash %s',
                                 coalesce(j.from_pair, s.from_pair),
                                 coalesce(j.from_pair, s.from_pair) + 9,
                                 coalesce(j.hash, 'none'), coalesce(s.source_hash, 'none'))
        FROM judged_ranges AS j
        FULL JOIN stored_ranges AS s ON s.from_pair = j.from_pair
        WHERE (j.ids, j.hash) IS DISTINCT FROM (s.source_message_ids, s.source_hash)
        UNION ALL
        SELECT CASE WHEN s.summary_id IS NULL THEN 'verdict_missing'
                    WHEN j.summary_id IS NULL THEN 'verdict_extra'
                    ELSE 'verdict_differs' END,
               pg_catalog.format('summary %s (scope %s, pairs %s-%s): judged %s, derived %s',
                                 coalesce(j.summary_id, s.summary_id),
                                 coalesce(j.scope, s.scope),
                                 coalesce(j.from_pair, s.from_pair),
                                 coalesce(j.from_pair, s.from_pair) + 9,
                                 CASE WHEN j.summary_id IS NULL THEN 'no summary'
                                      ELSE coalesce(j.reason, 'used') END,
                                 CASE WHEN s.summary_id IS NULL THEN 'no verdict'
                                      ELSE coalesce(s.reason, 'used') END)
        FROM ROWS FROM (pg_catalog.unnest(v_ids), pg_catalog.unnest(v_scopes),
                        pg_catalog.unnest(v_froms), pg_catalog.unnest(v_reasons))
             AS j (summary_id, scope, from_pair, reason)
        FULL JOIN (SELECT v.* FROM compaction.summary_verdicts AS v
                   WHERE v.conversation_id = p_conversation_id) AS s
          ON s.summary_id = j.summary_id
        WHERE (j.scope, j.from_pair, j.reason) IS DISTINCT FROM (s.scope, s.from_pair, s.reason)
        UNION ALL
        SELECT CASE WHEN s.run_id IS NULL THEN 'foreign_missing' ELSE 'foreign_extra' END,
               pg_catalog.format('run id %s: judged %s, derived %s',
                                 coalesce(j.run_id, s.run_id),
                                 CASE WHEN j.run_id IS NULL THEN 'no foreign message'
                                      ELSE 'named by a foreign message' END,
                                 CASE WHEN s.run_id IS NULL THEN 'not recorded'
                                      ELSE 'recorded' END)
        FROM pg_catalog.unnest(v_foreign) AS j (run_id)
        FULL JOIN (SELECT f.run_id FROM compaction.foreign_messages AS f
                   WHERE f.conversation_id = p_conversation_id) AS s
          ON s.run_id = j.run_id
        WHERE j.run_id IS NULL OR s.run_id IS NULL
        ORDER BY 1, 2;
END
$$;
COMMENT ON FUNCTION compaction.verify_conversation(text) IS
    'Recomputes one conversation from the source views and returns one row per difference from the derived state: pairs and ranges (as the conversation''s own rows make them), summary verdicts, and the run ids its foreign messages name (no rows: consistent); ids, counts, hashes and reasons only';

CREATE OR REPLACE PROCEDURE compaction.rebuild_derived_state(p_batch int DEFAULT 100,
                                                  p_restart boolean DEFAULT false)
LANGUAGE plpgsql
-- No SET clause: a procedure with one cannot COMMIT. Every name below is qualified.
AS $$
DECLARE
    v_stamp     text;
    v_after     text;
    v_from      text;
    v_next      text;
    v_batch     text[];
    v_held      text;
    v_missed    text;
    v_gave_way  boolean := false;
    v_lock_wait text;
    v_placed    int;
    v_busy      boolean;
    v_done      bigint;
    v_total     bigint;
    v_resumed   bigint;
    v_began     timestamptz := pg_catalog.clock_timestamp();
    v_batch_at  timestamptz;
    v_noted_at  timestamptz := pg_catalog.clock_timestamp();
    v_rate      double precision;
BEGIN
    IF p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'rebuild_derived_state needs a batch size of at least 1' USING ERRCODE = 'CP020';
    END IF;
    v_stamp := compaction.source_stamp();
    IF v_stamp IS NULL THEN
        RAISE EXCEPTION 'the source is not tracked: some table behind compaction.source_runs / compaction.source_messages has no enabled-always track_source_changes trigger for INSERT, UPDATE, DELETE and TRUNCATE'
            USING ERRCODE = 'CP021',
                  HINT = 'Attach the tracking triggers (docs/integrating.md); without them the engine judges from the views on each call.';
    END IF;
    SELECT st.rebuild_after, st.rebuild_done, st.rebuild_total INTO v_after, v_done, v_total
    FROM compaction.source_tracking AS st
    WHERE st.rebuild_stamp = v_stamp AND NOT coalesce(p_restart, false);
    IF v_after IS NULL THEN
        -- A new rebuild: how many conversations, counted once (the ETA's denominator).
        v_after := '';
        v_done := 0;
        SELECT count(*) INTO v_total
        FROM (SELECT DISTINCT sr.conversation_id FROM compaction.source_runs AS sr) AS c;
        -- The shared resume point never moves back under one source stamp (revision
        -- 0031): another rebuild may be under way, and a writer must not leave it a
        -- conversation it has derived already (see the batch's end).
        UPDATE compaction.source_tracking AS st
        SET rebuild_stamp = v_stamp,
            rebuild_after = CASE WHEN st.rebuild_stamp = v_stamp THEN st.rebuild_after
                                 ELSE v_after END,
            rebuild_done = 0, rebuild_total = v_total, rebuild_started_at = pg_catalog.now(),
            rebuild_updated_at = pg_catalog.now();
        COMMIT;
        RAISE NOTICE 'derived state: rebuilding about % conversations', v_total;
    ELSE
        RAISE NOTICE 'derived state: resuming after conversation % (% of about % done)',
            v_after, v_done, v_total;
    END IF;
    v_resumed := v_done;
    LOOP
        -- Per transaction: every lookup of a re-derivation is by key (as in the tracking
        -- trigger), and fresh expression indexes may lack statistics; the resume point
        -- makes a commit lost in a crash cost only its batch again. JIT off as in every
        -- writer (revision 0020): with sequential scans priced out, the one-row UPDATE of
        -- the resume point costs above jit_above_cost and compiled for 35-90 ms at each
        -- commit, 60% of a rebuild's time. Generic plans, as the tracking trigger forces
        -- (revision 0035): re-derivation's statements are planned for one conversation at
        -- a time, and a custom plan for each conversation cost more to make than to run
        -- (about a tenth of a first rebuild at 200,000 messages).
        PERFORM pg_catalog.set_config('enable_seqscan', 'off', true);
        PERFORM pg_catalog.set_config('jit', 'off', true);
        PERFORM pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);
        PERFORM pg_catalog.set_config('synchronous_commit', 'off', true);
        IF v_gave_way THEN
            -- The last batch gave way (below): wait for the writers it waited for while
            -- holding nothing, then derive it again.
            PERFORM FROM compaction.source_tracking AS st WHERE st.singleton FOR UPDATE;
            COMMIT;
            v_gave_way := false;
            CONTINUE;
        END IF;
        v_from := v_after;
        v_batch := '{}';
        v_placed := 0;
        v_batch_at := pg_catalog.clock_timestamp();
        LOOP
            -- The next conversation in key order, as the first row of an ordered read:
            -- over a view that is not one table (the Agents SDK recipe's runs come from
            -- its messages) min() aggregated every row after the resume point at each
            -- step, a rebuild quadratic in the conversations (revision 0028).
            -- Revision 0048: the messages' conversations too, since a conversation with
            -- no run may hold foreign messages (compaction.foreign_messages).
            v_next := least(
                (SELECT sr.conversation_id FROM compaction.source_runs AS sr
                 WHERE sr.conversation_id > v_after
                 ORDER BY sr.conversation_id LIMIT 1),
                (SELECT sm.conversation_id FROM compaction.source_messages AS sm
                 WHERE sm.conversation_id > v_after
                 ORDER BY sm.conversation_id LIMIT 1),
                (SELECT cs.conversation_id FROM compaction.conversation_state AS cs
                 WHERE cs.conversation_id > v_after
                 ORDER BY cs.conversation_id LIMIT 1));
            EXIT WHEN v_next IS NULL;
            -- A conversation a writer holds ends the batch before it (revision 0031): the
            -- next transaction waits for it holding nothing, so the writer may go on to a
            -- conversation of this batch without a deadlock, which PostgreSQL would
            -- resolve by failing whichever of the two began waiting first.
            IF pg_catalog.cardinality(v_batch) = 0 THEN
                NULL;  -- the first of a transaction: waiting for it holds nothing
            ELSIF EXISTS (SELECT FROM compaction.conversation_state AS cs
                          WHERE cs.conversation_id = v_next) THEN
                PERFORM FROM compaction.conversation_state AS cs
                WHERE cs.conversation_id = v_next
                FOR NO KEY UPDATE SKIP LOCKED;
                EXIT WHEN NOT FOUND;
            ELSE
                -- No committed row (a conversation written before the tracking was
                -- attached): its first tracked write may be creating the row now,
                -- unseen, and inserting it would wait for that writer. Insert it without
                -- waiting, in a subtransaction; at most 32 a batch, well under the 64 a
                -- backend's snapshot entry holds before every snapshot taken anywhere
                -- must look subtransactions up.
                EXIT WHEN v_placed >= 32;
                v_placed := v_placed + 1;
                v_busy := false;
                v_lock_wait := pg_catalog.current_setting('lock_timeout');
                PERFORM pg_catalog.set_config('lock_timeout', '1ms', true);
                BEGIN
                    INSERT INTO compaction.conversation_state AS cs
                        (conversation_id, pair_count, generation)
                    VALUES (v_next, 0, 1)
                    ON CONFLICT (conversation_id) DO NOTHING;
                EXCEPTION WHEN lock_not_available THEN
                    v_busy := true;
                END;
                PERFORM pg_catalog.set_config('lock_timeout', v_lock_wait, true);
                EXIT WHEN v_busy;
            END IF;
            PERFORM compaction.rederive_conversation(v_next);
            v_after := v_next;
            v_batch := v_batch || v_next;
            EXIT WHEN pg_catalog.cardinality(v_batch) >= p_batch
                   OR pg_catalog.clock_timestamp() - v_batch_at >= interval '20 milliseconds';
        END LOOP;
        -- The writers that left a conversation of this batch (or, at the end, any after
        -- it) to the rebuild have ended once this lock is had; see the comment above. A
        -- writer that holds it may be waiting for a conversation of the batch: past 100
        -- ms (well below deadlock_timeout, 1 s by default) the batch gives way, undone,
        -- rather than let PostgreSQL fail the writer (revision 0031).
        v_lock_wait := pg_catalog.current_setting('lock_timeout');
        PERFORM pg_catalog.set_config('lock_timeout', '100ms', true);
        BEGIN
            SELECT st.rebuild_stamp INTO v_held
            FROM compaction.source_tracking AS st
            WHERE st.singleton
            FOR UPDATE;
        EXCEPTION WHEN lock_not_available THEN
            v_gave_way := true;
        END;
        IF v_gave_way THEN
            ROLLBACK;
            v_after := v_from;
            CONTINUE;
        END IF;
        PERFORM pg_catalog.set_config('lock_timeout', v_lock_wait, true);
        IF v_held IS DISTINCT FROM v_stamp THEN
            -- Another rebuild under the same source (a second `pycompactor migrate` of a
            -- deploy) derived every conversation and stamped: this one's work is done.
            IF v_held IS NULL AND compaction.derived_state_current()
               AND (SELECT st.stamp FROM compaction.source_tracking AS st) = v_stamp THEN
                COMMIT;
                RAISE NOTICE 'derived state: in use, put there by another rebuild (% conversations this run)',
                    v_done - v_resumed + pg_catalog.cardinality(v_batch);
                RETURN;
            END IF;
            RAISE EXCEPTION 'the source was truncated, or a rebuild under changed source views started, while this rebuild ran; run it again'
                USING ERRCODE = 'CP021';
        END IF;
        -- Two statements, so that the batch's end bounds the index scan: with the bound
        -- in an OR, a repair over a populated derived state read every conversation after
        -- the batch at each commit.
        IF v_next IS NULL THEN
            SELECT cs.conversation_id INTO v_missed
            FROM compaction.conversation_state AS cs
            WHERE cs.conversation_id > v_from
              AND cs.conversation_id <> ALL (v_batch)
            ORDER BY cs.conversation_id
            LIMIT 1;
        ELSE
            SELECT cs.conversation_id INTO v_missed
            FROM compaction.conversation_state AS cs
            WHERE cs.conversation_id > v_from AND cs.conversation_id <= v_after
              AND cs.conversation_id <> ALL (v_batch)
            ORDER BY cs.conversation_id
            LIMIT 1;
        END IF;
        IF v_missed IS NOT NULL THEN
            -- Up to the conversation before it: the next batch starts with it.
            v_batch := ARRAY(SELECT b.id FROM pg_catalog.unnest(v_batch) AS b (id)
                             WHERE b.id < v_missed);
            v_after := coalesce((SELECT max(b.id) FROM pg_catalog.unnest(v_batch) AS b (id)),
                                v_from);
        END IF;
        v_done := v_done + pg_catalog.cardinality(v_batch);
        -- Every conversation derived: stamped below, under this lock.
        EXIT WHEN v_next IS NULL AND v_missed IS NULL;
        -- Forward only: a rebuild ahead of this one has derived the conversations up to
        -- its point, and a writer must find them past the resume point, not left to a
        -- rebuild that another's stamp may end first.
        UPDATE compaction.source_tracking AS st
        SET rebuild_after = GREATEST(st.rebuild_after, v_after), rebuild_done = v_done,
            rebuild_updated_at = pg_catalog.clock_timestamp()
        WHERE st.singleton;
        COMMIT;
        IF pg_catalog.clock_timestamp() - v_noted_at >= interval '1 second' THEN
            v_noted_at := pg_catalog.clock_timestamp();
            v_rate := (v_done - v_resumed)
                      / greatest(extract(epoch FROM v_noted_at - v_began), 0.001);
            RAISE NOTICE 'derived state: % of about % conversations, % a second, about % s left',
                v_done, v_total, round(v_rate::numeric, 1),
                round((greatest(v_total - v_done, 0) / greatest(v_rate, 0.001))::numeric);
        END IF;
    END LOOP;
    v_rate := (v_done - v_resumed)
              / greatest(extract(epoch FROM pg_catalog.clock_timestamp() - v_began), 0.001);
    RAISE NOTICE 'derived state: % conversations (% this run, % a second)',
        v_done, v_done - v_resumed, round(v_rate::numeric, 1);
    PERFORM compaction.stamp_derived_state(v_stamp);
    COMMIT;
END
$$;
COMMENT ON PROCEDURE compaction.rebuild_derived_state(int, boolean) IS
    'Repair and upgrade step: re-derives every conversation in id order, committing at most p_batch conversations or 20 ms of work at a time and never waiting for a writer long while it holds them, resuming after the last committed one when the source is unchanged (p_restart: start over), then puts the derived state in use; CALL outside a transaction block';

CREATE OR REPLACE FUNCTION compaction.claim(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Every lookup in this call is by key. A worker's connection lives for hours, and a plan
-- cached while the engine's tables were still small (a new deployment, a first backlog)
-- would scan them instead, at a cost that grows with every job until autovacuum's ANALYZE
-- has them planned again (revision 0017 measured a claim -> complete cycle at less than
-- half its speed after 1,600 cycles on one connection). With sequential scans disabled
-- the first plans are the index plans, and they hold whatever the tables' size; jit off,
-- since the disabled scans' cost would cross jit_above_cost and compile on every call.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- Revision 0045: caller_now and checked_lease are called only when they have
    -- something to check (a given p_now, a lease out of range); each call carries a SET
    -- clause, whose save and restore of the settings cost more than the rule.
    v_now         timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                      ELSE compaction.caller_now(p_now) END;
    v_lease       timestamptz := v_now + CASE WHEN p_lease >= interval '1 second'
                                                   AND p_lease <= interval '1 day'
                                              THEN p_lease
                                              ELSE compaction.checked_lease(p_lease) END;
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_is_target   boolean;
    v_answer      record;
    v_oversized   text;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;

    -- Checks in the contract's order; the first failing one is the answer.
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN
        RETURN QUERY SELECT false, 'invalid_range'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT compaction.valid_source_ids(p_source_message_ids) THEN
        RETURN QUERY SELECT false, 'invalid_source_ids'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    IF v_accepts IS NOT TRUE THEN
        RETURN QUERY SELECT false, 'prompt_version_closed'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    -- The range as it is now, from the derived state (no message text read): the pair
    -- count decides whether it is a target, the stored ids and hash whether it matches.
    -- Read before the conversation's lock (revision 0038): the lock orders the engine's
    -- writers of the conversation, and none of them changes its history, so the answer
    -- is the same either side of it; judged from the views (Citus, an untracked source)
    -- it is most of a claim's time, which the conversation's other writers no longer wait
    -- for. With the derived state in use, current_range's read is made here (revision
    -- 0045, as range_replies does): the call of a set-returning definer function cost
    -- more than its one statement.
    IF compaction.derived_state_serves(p_conversation_id) THEN
        SELECT coalesce((SELECT cs.pair_count::bigint FROM compaction.conversation_state AS cs
                         WHERE cs.conversation_id = p_conversation_id), 0),
               r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM (SELECT 1) AS one
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
    ELSE
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    END IF;
    v_is_target := compaction.is_target(p_from_pair, v_pairs);

    -- From here on the conversation's engine rows are ours until commit: the statement of
    -- lock_conversation, written out here and in fence (revision 0018), where a call per
    -- cycle would cost as much as the row lock itself.
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    -- The one writer under the lock that follows a change of history is an erasure (its
    -- history deleted before it or with it): a conversation with an erasure's tombstone
    -- is judged again, under the lock, so that no claim lands after an erasure on
    -- history it judged before.
    IF EXISTS (SELECT 1 FROM compaction.event_log AS e
               WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
        v_is_target := compaction.is_target(p_from_pair, v_pairs);
    END IF;
    -- An assignment, not a query: a claim -> complete cycle costs 1.0% more
    -- instructions than with the checks written out in claim (a query over the call,
    -- 1.6%).
    v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                       p_source_message_ids, p_source_hash, p_model,
                                       p_prompt_version, p_worker, v_now, v_lease,
                                       v_is_target, v_target_ids, v_target_hash);
    claimed := v_answer.claimed;
    reason := v_answer.reason;
    job_id := v_answer.job_id;
    attempt := v_answer.attempt;
    lease_expires_at := v_answer.lease_expires_at;
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, bound to the calling login, or returns the first refusal reason (see DESIGN §6)';

CREATE OR REPLACE FUNCTION compaction.range_replies(
    p_conversation_id text, p_from_pair int, p_source_hash text)
RETURNS TABLE (pair_index int, assistant_message_id text, assistant_content text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_derived boolean := compaction.derived_state_serves(p_conversation_id);
    v_ids     text[];
    v_hash    text;
BEGIN
    IF p_source_hash IS NULL THEN
        RETURN;
    END IF;
    -- Revision 0037: judged from the views (always on Citus, and on a source without
    -- tracking), the range's current ids cost a judgment of the whole conversation, which
    -- the claim made a moment before. The claim bound the range to the 20 ids its job
    -- keeps: the replies are read with the hash of those ids' texts as they are now, in
    -- one statement (one snapshot, one query to the node that holds the conversation),
    -- and returned only when it is the claimed hash, so the model still never sees text
    -- the hash does not cover. A range that moved with its texts unchanged is not
    -- noticed here; its summary is then judged stale_source, as any summary of a range
    -- that moved after it was written. With no job of that hash, the current range.
    IF NOT v_derived THEN
        SELECT j.source_message_ids INTO v_ids
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.from_pair = p_from_pair
          AND j.source_hash = p_source_hash
        LIMIT 1;
        IF v_ids IS NOT NULL THEN
            RETURN QUERY
            WITH m AS (
                -- Each message looked up on its own, as range_hash does.
                SELECT u.ord, u.message_id, s.role, s.content
                FROM pg_catalog.unnest(v_ids) WITH ORDINALITY AS u (message_id, ord)
                CROSS JOIN LATERAL (
                    SELECT sm.role, sm.content FROM compaction.source_messages AS sm
                    WHERE sm.conversation_id = p_conversation_id
                      AND sm.message_id = u.message_id
                    OFFSET 0) AS s)
            SELECT (p_from_pair + m.ord / 2 - 1)::int, m.message_id, m.content
            FROM m
            WHERE m.ord % 2 = 0 AND m.role = 'assistant'
              -- range_hash's rule, over the rows this statement read
              AND (SELECT CASE WHEN count(*) = 20 THEN
                              pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                                  pg_catalog.int4send(pg_catalog.octet_length(h.message_id))
                                  || pg_catalog.convert_to(h.message_id, 'UTF8')
                                  || pg_catalog.int4send(pg_catalog.octet_length(h.content))
                                  || pg_catalog.convert_to(h.content, 'UTF8'),
                                  ''::bytea ORDER BY h.ord)), 'hex')
                          END
                   FROM m AS h) = p_source_hash
            ORDER BY m.ord;
            RETURN;
        END IF;
    END IF;
    -- Only while the range is what the claim bound: a range edited after the claim
    -- returns no rows, so the model never summarises text the hash does not cover. The
    -- range first, then the texts: one statement each (DESIGN §11). With the derived
    -- state in use the range is current_range's read of compaction.ranges, made here:
    -- current_range would ask derived_state_current again.
    IF v_derived THEN
        SELECT r.source_message_ids, r.source_hash INTO v_ids, v_hash
        FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
    ELSE
        SELECT r.source_message_ids, r.source_hash INTO v_ids, v_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    END IF;
    IF v_hash IS DISTINCT FROM p_source_hash THEN
        RETURN;
    END IF;
    -- source_message_ids is [u0, a0, ..., u9, a9]: the replies sit at the even positions.
    RETURN QUERY
    SELECT (p_from_pair + u.ord / 2 - 1)::int, m.message_id, m.content
    FROM pg_catalog.unnest(v_ids) WITH ORDINALITY AS u (message_id, ord)
    JOIN compaction.source_messages AS m
      ON m.conversation_id = p_conversation_id AND m.message_id = u.message_id
     AND m.role = 'assistant'
    WHERE u.ord % 2 = 0
    ORDER BY u.ord;
END
$$;
COMMENT ON FUNCTION compaction.range_replies(text, int, text) IS
    'The 10 assistant replies of range from_pair (pair_index, message id, text), only while their texts hash to the source hash given: the range''s current hash, or (judged from the views) that of the ids of the job claimed with that hash; no user text';

CREATE OR REPLACE FUNCTION compaction.projection_summaries(p_conversation_id text, p_scope text)
RETURNS TABLE (
    summary_id         bigint,
    from_pair          int,
    to_pair            int,
    source_message_ids text[],
    source_hash        text,
    prompt_version     text,
    projectable        boolean,
    completed_at       timestamptz,
    summary_bytes      int,
    source_current     boolean,
    version_rank       int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_derived boolean := compaction.derived_state_serves(p_conversation_id);
    v_ranges  int[];
    v_from    int[];
    v_ids     text[];
    v_hashes  text[];
BEGIN
    -- source_current: the range exists now with exactly the stored ids and hash. From the
    -- derived state that is a comparison per summary. Judged from the views, one call
    -- of current_ranges judges the conversation once for every summarized range
    -- (revision 0023: current_range per range before, a whole judgement each, so a
    -- projection's cost grew with the square of the conversation's length), in a
    -- statement of its own (DESIGN §11: no engine function nested in a query on
    -- distributed tables).
    IF NOT v_derived THEN
        SELECT pg_catalog.array_agg(DISTINCT s.from_pair) INTO v_ranges
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id AND s.scope = p_scope;
    END IF;
    IF v_ranges IS NOT NULL THEN
        SELECT pg_catalog.array_agg(c.from_pair ORDER BY c.from_pair),
               ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(
                   c.source_message_ids ORDER BY c.from_pair))),
               pg_catalog.array_agg(c.source_hash ORDER BY c.from_pair)
        INTO v_from, v_ids, v_hashes
        FROM compaction.current_ranges(p_conversation_id, v_ranges) AS c
        WHERE c.source_hash IS NOT NULL;
    END IF;
    RETURN QUERY
    WITH summaries AS (
        SELECT s.summary_id, s.from_pair, s.to_pair, s.source_message_ids, s.source_hash,
               s.prompt_version, s.completed_at, pg_catalog.octet_length(s.summary) AS bytes
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.scope = p_scope
    ), now_ranges AS (
        SELECT r.from_pair, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        WHERE v_derived AND r.conversation_id = p_conversation_id
          AND r.from_pair IN (SELECT x.from_pair FROM summaries AS x)
        UNION ALL
        SELECT u.from_pair, g.ids, u.source_hash
        FROM ROWS FROM (pg_catalog.unnest(v_from), pg_catalog.unnest(v_hashes))
             WITH ORDINALITY AS u (from_pair, source_hash, k)
        JOIN compaction.id_ranges(v_ids) AS g ON g.k = u.k
        WHERE NOT v_derived
    )
    SELECT s.summary_id,
           s.from_pair,
           s.to_pair,
           s.source_message_ids,
           s.source_hash,
           s.prompt_version,
           -- A version missing from prompt_versions is never projected.
           COALESCE(v.projectable, false),
           s.completed_at,
           s.bytes,
           coalesce(n.source_message_ids = s.source_message_ids
                    AND n.source_hash = s.source_hash, false),
           -- Preference among a range's projectable summaries (revision 0009): the
           -- version's number after '@', higher first; -1 for a version without one.
           coalesce(pg_catalog.substring(s.prompt_version, '@([0-9]{1,9})$')::int, -1)
    FROM summaries AS s
    LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = s.prompt_version
    LEFT JOIN now_ranges AS n ON n.from_pair = s.from_pair
    ORDER BY s.from_pair, s.summary_id;
END
$$;
COMMENT ON FUNCTION compaction.projection_summaries(text, text) IS
    'Completed summaries of a conversation and scope without their text: source binding, version, whether it is projectable, completed_at, UTF-8 byte length, whether its source is current, and the version''s rank (the number after @, -1 without one; higher is preferred)';

CREATE OR REPLACE FUNCTION compaction.projection_frame(p_conversation_id text, p_scope text, p_pairs int)
RETURNS TABLE (
    derived               boolean,
    pair_count            int,
    first_pair            int,
    user_message_ids      text[],
    assistant_message_ids text[],
    user_bytes            int[],
    assistant_bytes       int[],
    summary_ids           bigint[],
    summary_from_pairs    int[],
    summary_reasons       text[],
    summary_bytes         int[]
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One plan for every call: the statements are lookups by key whatever the conversation,
-- and planning them afresh cost more than running them.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_count int;
    v_first int;
BEGIN
    IF p_pairs IS NULL OR p_pairs < 0 THEN
        RAISE EXCEPTION 'p_pairs must be 0 or more, got %', p_pairs USING ERRCODE = 'CP020';
    END IF;
    IF NOT compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY SELECT * FROM compaction.judged_frame(p_conversation_id, p_scope);
        RETURN;
    END IF;
    SELECT cs.pair_count INTO v_count
    FROM compaction.conversation_state AS cs
    WHERE cs.conversation_id = p_conversation_id;
    v_count := coalesce(v_count, 0);
    v_first := greatest(0, v_count - p_pairs);
    v_first := v_first - v_first % 10;
    RETURN QUERY
    WITH suffix AS (
        -- The four arrays take the rows in the subquery's order, read in index order
        -- (revision 0029: an ORDER BY in each aggregate sorted them four times).
        SELECT pg_catalog.array_agg(p.user_message_id) AS users,
               pg_catalog.array_agg(p.assistant_message_id) AS assistants,
               pg_catalog.array_agg(p.user_bytes) AS user_sizes,
               pg_catalog.array_agg(p.assistant_bytes) AS assistant_sizes
        FROM (SELECT q.user_message_id, q.assistant_message_id, q.user_bytes, q.assistant_bytes
              FROM compaction.pairs AS q
              WHERE q.conversation_id = p_conversation_id AND q.pair_index >= v_first
              ORDER BY q.pair_index) AS p
    ), verdicts AS (
        -- One sort for the four arrays: they take the rows in the subquery's order (an
        -- ORDER BY in each aggregate sorted them four times). The driver checks the order
        -- all the same.
        SELECT pg_catalog.array_agg(o.summary_id) AS ids,
               pg_catalog.array_agg(o.from_pair) AS froms,
               pg_catalog.array_agg(o.reason) AS reasons,
               pg_catalog.array_agg(o.bytes) AS sizes
        FROM (SELECT v.summary_id, v.from_pair, v.reason, NULL::int AS bytes
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
                AND v.reason IS NOT NULL
              UNION ALL
              SELECT v.summary_id, v.from_pair, NULL::text,
                     (SELECT pg_catalog.octet_length(js.summary)
                      FROM compaction.job_summaries AS js
                      WHERE js.conversation_id = p_conversation_id
                        AND js.summary_id = v.summary_id)
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
                AND v.reason IS NULL AND v.from_pair >= v_first
              ORDER BY 2, 1) AS o
    )
    SELECT true, v_count, v_first,
           coalesce(x.users, '{}'), coalesce(x.assistants, '{}'),
           coalesce(x.user_sizes, '{}'), coalesce(x.assistant_sizes, '{}'),
           coalesce(y.ids, '{}'), coalesce(y.froms, '{}'), coalesce(y.reasons, '{}'),
           coalesce(y.sizes, '{}')
    FROM suffix AS x CROSS JOIN verdicts AS y;
END
$$;
COMMENT ON FUNCTION compaction.projection_frame(text, text, int) IS
    'What a projection plans from, in one row: the pair count, the metadata of the newest p_pairs pairs (from first_pair, whole ranges; no text), every rejected summary of the conversation and scope with its reason (version_not_projectable, stale_source, superseded), and the chosen summary (reason NULL) of each range those pairs cover with its UTF-8 byte length; while the derived state is not in use, derived = false and every pair and verdict, judged from the views (first_pair 0)';

CREATE OR REPLACE FUNCTION compaction.citus_tables()
RETURNS TABLE (table_name text, placement text, step int, colocation text)
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    -- In distribution order: reference tables first (distributed tables refer to them),
    -- then each distributed table after the tables its foreign keys name. The queue is
    -- distributed apart from the other tables (revision 0022): an application's
    -- transaction that writes its history, with its own login, and then calls
    -- compaction.enqueue (the owner's) may not touch placements co-located with the ones
    -- it wrote as another user, and no statement joins the queue with another table.
    VALUES ('compaction.settings', 'reference', 1, NULL),
           ('compaction.prompt_versions', 'reference', 2, NULL),
           ('compaction.admission', 'reference', 3, NULL),
           ('compaction.source_tracking', 'reference', 4, NULL),
           ('compaction_source.conversations', 'distributed', 5, 'conversation'),
           ('compaction_source.runs', 'distributed', 6, 'conversation'),
           ('compaction_source.messages', 'distributed', 7, 'conversation'),
           ('compaction.jobs', 'distributed', 8, 'conversation'),
           ('compaction.attempts', 'distributed', 9, 'conversation'),
           ('compaction.job_summaries', 'distributed', 10, 'conversation'),
           ('compaction.event_log', 'distributed', 11, 'conversation'),
           ('compaction.queue', 'distributed', 12, 'queue'),
           ('compaction.conversation_state', 'distributed', 13, 'conversation'),
           ('compaction.pairs', 'distributed', 14, 'conversation'),
           ('compaction.ranges', 'distributed', 15, 'conversation'),
           ('compaction.summary_verdicts', 'distributed', 16, 'conversation'),
           ('compaction.conversation_locks', 'distributed', 17, 'conversation'),
           ('compaction.foreign_messages', 'distributed', 18, 'conversation')
$$;
COMMENT ON FUNCTION compaction.citus_tables() IS
    'Every engine table with its Citus placement (distributed by conversation_id, or reference), the order compaction.distribute_on_citus() applies them in, and the co-location group of a distributed table (conversation, or queue alone)';

CREATE OR REPLACE PROCEDURE compaction.distribute_on_citus()
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table   record;
    v_trigger record;
    v_first     text;
    v_fk        record;
    v_restore   text[] := '{}';
    v_statement text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_extension AS e WHERE e.extname = 'citus') THEN
        RAISE EXCEPTION 'Citus is not installed in database %', pg_catalog.current_database()
            USING ERRCODE = 'CP020', HINT = 'CREATE EXTENSION citus; on the coordinator first.';
    END IF;
    -- The guards and truncate triggers only read their own row: safe on shards, but Citus
    -- wants to be told so.
    IF pg_catalog.current_setting('citus.enable_unsafe_triggers', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'citus.enable_unsafe_triggers must be on for the engine''s row guards'
            USING ERRCODE = 'CP020',
                  HINT = 'ALTER SYSTEM SET citus.enable_unsafe_triggers = on on every node, then reload.';
    END IF;
    -- The source tables' statement triggers (change tracking, DESIGN §2, and the queue)
    -- read transition tables, which Citus does not give triggers on shards: detached.
    -- The engine then judges from the views on the node that holds each conversation
    -- (exact, slower), and writers call compaction.enqueue (or workers run --sweep).
    -- Revision 0042: from every table, not only the reference tables. A host's own
    -- tables tracked while the engine ran on one node keep their triggers when Citus
    -- distributes them, and every write to them then fails on the shards ("could not
    -- create distributed plan"); attach_source_tracking refuses on Citus from now on.
    FOR v_trigger IN
        SELECT t.tgname, t.tgrelid::regclass AS rel
        FROM pg_catalog.pg_trigger AS t
        WHERE t.tgfoid IN ('compaction.track_source_changes()'::regprocedure,
                           'compaction.source_enqueue()'::regprocedure)
          AND NOT t.tgisinternal
        ORDER BY t.tgrelid, t.tgname
    LOOP
        EXECUTE pg_catalog.format('DROP TRIGGER %I ON %s', v_trigger.tgname, v_trigger.rel);
    END LOOP;
    -- Foreign keys go first and come back last: Citus distributes a table only when no
    -- local table refers to it, and turns a local table that refers to a reference table
    -- into a Citus-local one (dropping views on it) instead of leaving it for later.
    -- Sequential mode lets the same transaction add them back on the shards.
    EXECUTE 'SET LOCAL citus.multi_shard_modify_mode = sequential';
    FOR v_fk IN
        SELECT c.conrelid::regclass AS rel, c.conname, pg_catalog.pg_get_constraintdef(c.oid) AS def
        FROM pg_catalog.pg_constraint AS c
        WHERE c.contype = 'f'
          AND c.conrelid IN (SELECT ct.table_name::regclass FROM compaction.citus_tables() AS ct)
        ORDER BY c.conrelid, c.conname
    LOOP
        v_restore := v_restore || pg_catalog.format('ALTER TABLE %s ADD CONSTRAINT %I %s',
                                                    v_fk.rel, v_fk.conname, v_fk.def);
        EXECUTE pg_catalog.format('ALTER TABLE %s DROP CONSTRAINT %I', v_fk.rel, v_fk.conname);
    END LOOP;
    FOR v_table IN SELECT ct.table_name, ct.placement, ct.step, ct.colocation
                   FROM compaction.citus_tables() AS ct ORDER BY ct.step LOOP
        IF v_table.placement = 'reference' THEN
            EXECUTE 'SELECT create_reference_table($1)' USING v_table.table_name::regclass;
        ELSE
            -- With the first table of its group; the first of the conversation group
            -- joins the host's own tables of the default group, the queue joins none.
            v_first := (SELECT ct.table_name FROM compaction.citus_tables() AS ct
                        WHERE ct.colocation = v_table.colocation AND ct.step < v_table.step
                        ORDER BY ct.step LIMIT 1);
            EXECUTE 'SELECT create_distributed_table($1, ''conversation_id'', colocate_with => $2)'
                USING v_table.table_name::regclass,
                      coalesce(v_first, CASE v_table.colocation WHEN 'queue' THEN 'none'
                                                                ELSE 'default' END);
        END IF;
    END LOOP;
    FOREACH v_statement IN ARRAY v_restore LOOP
        EXECUTE v_statement;
    END LOOP;
    -- judge_runs keeps one generic plan on a single node (planning per call costs more
    -- than running); Citus can plan its queries only with the values bound.
    ALTER FUNCTION compaction.judge_runs(text, text[], boolean) RESET plan_cache_mode;
    -- Revision 0038: a judgement's question to every shard of the messages runs on one
    -- connection per node. Its tasks are index probes of a few runs each; with more
    -- connections the executor opened new ones to the workers in most judgements (14 ms
    -- against 9.6 ms for a conversation of 100 runs on the loopback cluster, and the
    -- drain of `make bench-citus` took 7.4-9.2 s against 5.6-5.8 s).
    ALTER FUNCTION compaction.judge_runs(text, text[], boolean)
        SET citus.max_adaptive_executor_pool_size = 1;
    -- Revision 0041: judged from the views (always, on Citus) projection_read sends the
    -- texts in its own statement (through projection_texts until revision 0043), whose
    -- queries Citus can plan only with the values bound; on one node it forces generic
    -- plans.
    ALTER FUNCTION compaction.projection_read(text, text, int, bigint, int)
        RESET plan_cache_mode;
    CALL compaction.place_audit_views();
    CALL compaction.place_view_grants();
END
$$;
COMMENT ON PROCEDURE compaction.distribute_on_citus() IS
    'Citus: detaches the change-tracking and queue triggers from every table, distributes every engine table as compaction.citus_tables() says, then places the audit views and the reader''s and worker''s grants (run once, as a superuser, on the coordinator)';


-- Where the derived state is in use, the record of foreign messages is filled and the
-- conversations whose runs a message of another conversation names are re-derived (the
-- only ones whose own judgement differs from the pairs kept under the old rule). Else
-- the next rebuild derives everything.
DO $$
DECLARE
    v_conversation text;
BEGIN
    IF compaction.derived_state_current() THEN
        INSERT INTO compaction.foreign_messages (conversation_id, run_id)
        SELECT DISTINCT sm.conversation_id, sm.run_id
        FROM compaction.source_messages AS sm
        WHERE sm.conversation_id IS NOT NULL
          AND sm.run_id IS NOT NULL
          AND sm.role IN ('user', 'assistant')
          AND NOT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                          WHERE sr.conversation_id = sm.conversation_id
                            AND sr.run_id = sm.run_id);
        FOR v_conversation IN
            SELECT DISTINCT sr.conversation_id
            FROM compaction.source_runs AS sr
            WHERE EXISTS (SELECT 1 FROM compaction.source_messages AS sm
                          WHERE sm.run_id = sr.run_id
                            AND sm.role IN ('user', 'assistant')
                            AND sm.conversation_id IS DISTINCT FROM sr.conversation_id)
            ORDER BY 1
        LOOP
            PERFORM compaction.rederive_conversation(v_conversation);
        END LOOP;
    END IF;
END
$$;

-- A database already distributed on Citus: the new table joins the conversation group,
-- and judge_runs, made anew, gets back the settings distribute_on_citus gives it.
DO $$
BEGIN
    IF compaction.engine_distributed() THEN
        EXECUTE 'SELECT create_distributed_table(''compaction.foreign_messages'','
                ' ''conversation_id'', colocate_with => ''compaction.pairs'')';
        ALTER FUNCTION compaction.judge_runs(text, text[], boolean) RESET plan_cache_mode;
        ALTER FUNCTION compaction.judge_runs(text, text[], boolean)
            SET citus.max_adaptive_executor_pool_size = 1;
    END IF;
END
$$;

CALL compaction.assign_ownership();
-- After ownership has passed to compaction_owner, as sql/90_roles.sql does.
REVOKE TRUNCATE ON compaction.foreign_messages FROM compaction_owner;
