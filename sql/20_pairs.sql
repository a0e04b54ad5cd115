-- pycompactor stored logic, section 2: eligible pairs, the window policy, source binding.
--
-- The read functions run as the engine owner (SECURITY DEFINER): the source views run
-- with their owner's rights anyway, and the audit views must be able to recompute a hash
-- for a role that may never read message text itself. They switch JIT off: they are
-- short OLTP statements, and on freshly loaded, unanalyzed tables a misestimated function
-- scan would otherwise cross jit_above_cost and spend 100x the query's time compiling.

-- Shared by eligibility (content rule of pairs) and summary validation: content means a
-- character other than the six ASCII whitespace characters, so NBSP, U+3000 and
-- zero-width characters count as content. The prefix test decides almost every text from
-- its first characters, and substr() detoasts only that slice of a large message.
CREATE FUNCTION compaction.has_content(p_text text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
-- No SET clause, so the planner can inline it into the per-message aggregate of
-- judge_runs (20,000 calls for a 10,000-pair conversation). Every name, operators
-- included, is schema-qualified, so no search_path can change what it means.
AS $$
    SELECT p_text IS NOT NULL
       AND (pg_catalog.btrim(pg_catalog.substr(p_text, 1, 64),
                             E' \t\n\r\f' OPERATOR(pg_catalog.||) pg_catalog.chr(11))
                OPERATOR(pg_catalog.<>) ''
            OR pg_catalog.btrim(p_text, E' \t\n\r\f' OPERATOR(pg_catalog.||) pg_catalog.chr(11))
                OPERATOR(pg_catalog.<>) '')
$$;
COMMENT ON FUNCTION compaction.has_content(text) IS
    'True when the text has a character other than space, \t, \n, \r, \f, \v (NULL is no content)';

-- The fixed window (contract §4) in one place: range k is a target iff 10k + 30 <= N, so
-- at least 30 pairs precede the first target and the newest 20 are never in one.
CREATE FUNCTION compaction.is_target(p_from_pair int, p_pairs bigint)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT p_from_pair OPERATOR(pg_catalog.>=) 0
       AND p_from_pair OPERATOR(pg_catalog.%) 10 OPERATOR(pg_catalog.=) 0
       AND p_from_pair::bigint OPERATOR(pg_catalog.+) 30 OPERATOR(pg_catalog.<=) p_pairs
$$;
COMMENT ON FUNCTION compaction.is_target(int, bigint) IS
    'The window policy: true when the range starting at from_pair is a compaction target among N eligible pairs (from_pair a non-negative multiple of 10 and from_pair + 30 <= N)';

-- One verdict per run of the conversation. The single place where §3's rules live:
-- indexed_pairs keeps the runs with no reason, explain_runs shows the reasons. It returns
-- no message text (byte lengths come from the varlena header without detoasting), so
-- judging a long conversation does not read its text.
-- p_foreign = false judges the runs by the conversation's own rows
-- alone, every rule but the foreign-message one (contract §3): what the derived
-- pairs keep (compaction.rederive_runs), since only another conversation's tracking sees
-- that rule's answer change; reads apply it through compaction.derived_state_serves.
CREATE FUNCTION compaction.judge_runs(p_conversation_id text, p_run_ids text[] DEFAULT NULL,
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
    -- §3: a run named by a foreign user or assistant message, one filed
    -- under a conversation that has no run of that id, is no pair. A message whose own
    -- conversation has a run of that id belongs to that run alone. That is the one
    -- question that crosses conversations, so it is asked on its own, by run id (a read
    -- of every shard under Citus); everything else below addresses this conversation's
    -- rows only. A message a host's view gives no conversation belongs to none and is
    -- recorded under none (compaction.foreign_messages is kept per conversation): it
    -- breaks nothing.
    -- Runs named are asked about as named: v_foreign is only compared
    -- with this conversation's runs below, so a named run of another conversation
    -- changes no verdict, and no read of the conversation's runs is needed. (That read,
    -- by run id and conversation in the generic plan this function keeps, was planned on
    -- the conversation's prefix of the runs' key when conversations are small on
    -- average: a write to a 10,000-run conversation read all 10,000.)
    -- A whole conversation's runs go into the question as a value when there are at most
    -- 256 of them: under Citus, a subquery there became a distributed
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
    -- small on average, reading every run of a large one. Read here, in
    -- a statement of their own: inside the statement below, this read of
    -- the runs by run id alone made Citus read every shard of the runs even for a whole
    -- conversation (4.6 ms against 1.2 ms for one conversation's query, sent whole to the
    -- node that holds it). Only re-derivation names runs, and it never runs on Citus.
    -- Each named run by (conversation, run id), a lookup of its own (as
    -- in rederive): on Citus it stays on the conversation's shard, where a read by run id
    -- alone read every shard, which a tracking trigger on a shard may not (contract
    -- §11).
    IF p_run_ids IS NOT NULL THEN
        SELECT pg_catalog.array_agg(n.run_id), pg_catalog.array_agg(n.status)
        INTO v_named_ids, v_named_status
        FROM (SELECT DISTINCT u.run_id FROM pg_catalog.unnest(p_run_ids) AS u (run_id)) AS k
        CROSS JOIN LATERAL (
            SELECT sr.run_id, sr.status
            FROM compaction.source_runs AS sr
            WHERE sr.conversation_id = p_conversation_id AND sr.run_id = k.run_id
            OFFSET 0) AS n;
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

-- The pairs as judged from the views on this call: the truth the derived state caches,
-- read when the derived state does not serve the conversation
-- (compaction.derived_state_serves).
CREATE FUNCTION compaction.judged_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_seq             bigint,
    user_message_id      text,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT (row_number() OVER w - 1)::int,
           j.run_id, j.user_seq, j.user_message_id, j.user_bytes, j.assistant_message_id,
           j.assistant_bytes
    FROM compaction.judge_runs(p_conversation_id) AS j
    WHERE j.reason IS NULL
    WINDOW w AS (ORDER BY j.user_seq, j.user_message_id)
    ORDER BY j.user_seq, j.user_message_id
$$;
COMMENT ON FUNCTION compaction.judged_pairs(text) IS
    'Internal: the eligible pairs of a conversation judged from the source views on this call (no derived state), without text';

CREATE FUNCTION compaction.indexed_pairs(p_conversation_id text)
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

-- Texts are fetched by message id for the pairs asked for only; the run and role are
-- matched too, so a host view with a duplicated message id cannot graft a stranger's text.
CREATE FUNCTION compaction.eligible_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_message_id      text,
    user_content         text,
    assistant_message_id text,
    assistant_content    text
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_indexes    int[];
    v_runs       text[];
    v_users      text[];
    v_assistants text[];
BEGIN
    -- The pairs first, then their texts: one statement each (contract §11).
    SELECT pg_catalog.array_agg(i.pair_index ORDER BY i.pair_index),
           pg_catalog.array_agg(i.run_id ORDER BY i.pair_index),
           pg_catalog.array_agg(i.user_message_id ORDER BY i.pair_index),
           pg_catalog.array_agg(i.assistant_message_id ORDER BY i.pair_index)
    INTO v_indexes, v_runs, v_users, v_assistants
    FROM compaction.indexed_pairs(p_conversation_id) AS i;
    RETURN QUERY
    SELECT i.pair_index, i.run_id, i.user_message_id, u.content, i.assistant_message_id, a.content
    FROM ROWS FROM (pg_catalog.unnest(v_indexes), pg_catalog.unnest(v_runs),
                    pg_catalog.unnest(v_users), pg_catalog.unnest(v_assistants))
         AS i (pair_index, run_id, user_message_id, assistant_message_id)
    JOIN compaction.source_messages AS u
      ON u.conversation_id = p_conversation_id AND u.message_id = i.user_message_id
     AND u.run_id = i.run_id AND u.role = 'user'
    JOIN compaction.source_messages AS a
      ON a.conversation_id = p_conversation_id AND a.message_id = i.assistant_message_id
     AND a.run_id = i.run_id AND a.role = 'assistant'
    ORDER BY i.pair_index;
END
$$;
COMMENT ON FUNCTION compaction.eligible_pairs(text) IS
    'Settled user/assistant pairs of a conversation, ordered by the user message (seq, message_id); pair_index is 0-based';

-- While the derived state serves the conversation (and no foreign
-- message names one of its pairs' runs), a run that holds a pair there is eligible
-- without judging it again (the derived state is exact, and a run's verdict does not
-- depend on the other runs: re-derivation judges runs one by one the same way);
-- only the runs without a pair are judged, for their reasons. check-source calls this
-- for every sampled conversation, and judging a run through a host's views can be dear
-- (the Agents SDK recipe parses each item's JSON).
CREATE FUNCTION compaction.explain_runs(p_conversation_id text)
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
    -- its own, results passed on in arrays (contract §11: no engine function nested in a
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

-- enc(s) = 4-byte big-endian length of UTF-8(s), then UTF-8(s); the database is UTF8,
-- so convert_to(..., 'UTF8') is the text's own bytes. The hash of a range is the SHA-256
-- of enc(u0 id) enc(u0 text) enc(a0 id) enc(a0 text) ... enc(a9 text).
CREATE FUNCTION compaction.range_hash(p_conversation_id text, p_message_ids text[])
RETURNS text
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- plpgsql, not sql: PostgreSQL before 18 plans a SQL function's body again in every
-- statement that calls it (about 0.3 ms for this join, paid by each Run that completes a
-- range); plpgsql keeps the plan for the session.
AS $$
BEGIN
    -- p_message_ids is [u0, a0, ..., u9, a9]: the hash input walks it two by two.
    RETURN (
        SELECT CASE WHEN pg_catalog.cardinality(p_message_ids) = 20
                     AND count(*) = 20 THEN
                   pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                       pg_catalog.int4send(pg_catalog.octet_length(ids.id))
                       || pg_catalog.convert_to(ids.id, 'UTF8')
                       || pg_catalog.int4send(pg_catalog.octet_length(m.content))
                       || pg_catalog.convert_to(m.content, 'UTF8'),
                       ''::bytea ORDER BY ids.ord)), 'hex')
               END
        FROM pg_catalog.unnest(p_message_ids) WITH ORDINALITY AS ids (id, ord)
        -- Each message looked up on its own (a lateral subquery, kept apart by OFFSET 0):
        -- a join was planned, once this function's plan turned generic, as a hash join
        -- over the conversation's messages wherever conversations are small on average,
        -- and every range a write completed in a large conversation read all of its
        -- messages.
        CROSS JOIN LATERAL (
            SELECT sm.content FROM compaction.source_messages AS sm
            WHERE sm.conversation_id = p_conversation_id AND sm.message_id = ids.id
            OFFSET 0) AS m);
END
$$;
COMMENT ON FUNCTION compaction.range_hash(text, text[]) IS
    'Source hash of a range of one conversation given its 20 current source ids [u0, a0, ..., u9, a9], reading only those messages; NULL unless all 20 are found exactly once';

-- A flat array of ids cut back into its ranges of 20 ([u0, a0, ..., u9,
-- a9] each), numbered from 1 in order. The callers that judge from the views pass many
-- ranges' ids between their statements in one array (contract §11: a statement of their
-- own for each engine function); a subscript of a text[] inside a query walks the array
-- from its start, so slicing each range out of it cost the square of the ranges (55 ms
-- for 1,000 ranges, more than hashing them). One pass instead. No SET clause, so it is
-- inlined into its callers; every name is schema-qualified.
CREATE FUNCTION compaction.id_ranges(p_ids text[])
RETURNS TABLE (k bigint, ids text[])
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT (i.ord OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog./) 20 OPERATOR(pg_catalog.+) 1,
           pg_catalog.array_agg(i.id ORDER BY i.ord)
    FROM pg_catalog.unnest(p_ids) WITH ORDINALITY AS i (id, ord)
    GROUP BY 1
$$;
COMMENT ON FUNCTION compaction.id_ranges(text[]) IS
    'Internal: a flat array of ranges'' ids cut into its ranges of 20, numbered k = 1, 2, ... in order';

-- The hashes of many ranges of one conversation in one statement, with
-- range_hash's rule for each (NULL unless its 20 ids are found exactly once). The callers
-- that judge from the views (projection_summaries, plan_targets) needed one hash per range,
-- and a call of range_hash per range read the same rows in as many statements: under
-- Citus, as many queries from the coordinator. p_message_ids holds the ranges' ids in
-- the order of p_from_pairs, 20 each [u0, a0, ..., u9, a9]; a range none of whose ids is
-- found is not returned.
CREATE FUNCTION compaction.range_hashes(p_conversation_id text, p_from_pairs int[],
                                        p_message_ids text[])
RETURNS TABLE (from_pair int, source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF coalesce(pg_catalog.cardinality(p_message_ids), 0)
       <> 20 * coalesce(pg_catalog.cardinality(p_from_pairs), 0) THEN
        RAISE EXCEPTION 'range_hashes needs 20 ids per range: % ranges, % ids',
                pg_catalog.cardinality(p_from_pairs), pg_catalog.cardinality(p_message_ids)
            USING ERRCODE = 'CP020';
    END IF;
    RETURN QUERY
        SELECT p_from_pairs[(g.k + 1)::int],
               CASE WHEN count(*) = 20 THEN
                   pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                       pg_catalog.int4send(pg_catalog.octet_length(g.id))
                       || pg_catalog.convert_to(g.id, 'UTF8')
                       || pg_catalog.int4send(pg_catalog.octet_length(m.content))
                       || pg_catalog.convert_to(m.content, 'UTF8'),
                       ''::bytea ORDER BY g.ord)), 'hex')
               END
        FROM (SELECT (i.ord - 1) / 20 AS k, i.ord, i.id
              FROM pg_catalog.unnest(p_message_ids) WITH ORDINALITY AS i (id, ord)) AS g
        JOIN compaction.source_messages AS m
          ON m.conversation_id = p_conversation_id AND m.message_id = g.id
        GROUP BY g.k;
END
$$;
COMMENT ON FUNCTION compaction.range_hashes(text, int[], text[]) IS
    'Internal: range_hash of many ranges of one conversation in one statement (p_message_ids: 20 ids per range, in the order of p_from_pairs)';

-- One range of a conversation as it is now: how many pairs the conversation has, and
-- the range's 20 source ids and hash when pairs from_pair .. from_pair+9 all exist.
-- Where claim, source_hash and the worker's reads learn what is current; with the
-- derived state in use, claim and range_replies make its read of
-- compaction.ranges themselves, sparing a set-returning definer's call.
CREATE FUNCTION compaction.current_range(p_conversation_id text, p_from_pair int)
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

-- current_range for many ranges of one conversation. From the derived
-- state, one read of the ranges asked for; judged from the views, one judgement and one
-- statement of hashes for all of them, where a call of current_range per range judged
-- the whole conversation each time (a projection or an audit of stale summaries cost the
-- square of the history). Each range asked for whose 10 pairs exist now, with its 20
-- ids and hash (NULL, as range_hash's, when its messages are not all found once).
CREATE FUNCTION compaction.current_ranges(p_conversation_id text, p_from_pairs int[])
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
    -- their hashes, one statement each (contract §11).
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

-- The targets among the ranges asked for (all of them when none is named),
-- judged once. plan_targets is this with none named; compaction.claim_targets names the
-- ranges a worker is about to claim, so that a batch of claims judges the conversation
-- once, and hashes only the ranges it claims.
CREATE FUNCTION compaction.target_ranges(p_conversation_id text, p_from_pairs int[] DEFAULT NULL)
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
    -- (not range_hash per target).
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

CREATE FUNCTION compaction.plan_targets(p_conversation_id text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT t.from_pair, t.to_pair, t.source_message_ids, t.source_hash
    FROM compaction.target_ranges(p_conversation_id) AS t
$$;
COMMENT ON FUNCTION compaction.plan_targets(text) IS
    'Ranges of 10 pairs the fixed window policy makes targets now (N >= 10k + 30), with their 20 source ids [u0, a0, ..., u9, a9] and source hash';

CREATE FUNCTION compaction.source_hash(p_conversation_id text, p_from_pair int)
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT c.source_hash
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS c
    WHERE p_from_pair >= 0 AND p_from_pair % 10 = 0
$$;
COMMENT ON FUNCTION compaction.source_hash(text, int) IS
    'SHA-256 (lowercase hex) binding pairs from_pair..from_pair+9 (ids and texts of both sides); NULL unless all 10 pairs exist and from_pair is a non-negative multiple of 10';
