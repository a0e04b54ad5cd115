-- Revision 0008_write_costs, down: the definitions of rederive and track_source_changes
-- (0005_derived_state), source_enqueue (0006_queue_leases) and range_hash
-- (0001_foundation); rederive_runs and rederive_general go.

-- Re-derives one conversation's pairs and ranges after a write touched the runs named
-- (NULL: every run of the conversation). Reads the views for those runs only, finds the
-- earliest (seq, message_id) position where a pair appeared, vanished or moved, renumbers
-- from there, and re-hashes the ranges whose ids changed or whose pairs were touched.
CREATE OR REPLACE FUNCTION compaction.rederive(p_conversation_id text, p_run_ids text[])
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_runs     text[] := p_run_ids;
    v_fresh    compaction.pairs[];
    v_stale    compaction.pairs[];
    v_moved    compaction.pairs[];
    v_from_seq bigint;
    v_from_id  text;
    v_base     int;
    v_count    int;
    v_ranges   int[];
BEGIN
    -- First: this row serialises the conversation's derived-state writers (see above).
    INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
    VALUES (p_conversation_id, 0, 1)
    ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1
    RETURNING cs.pair_count INTO v_count;

    IF v_runs IS NULL THEN
        v_runs := ARRAY(SELECT sr.run_id FROM compaction.source_runs AS sr
                        WHERE sr.conversation_id = p_conversation_id
                        UNION
                        SELECT p.run_id FROM compaction.pairs AS p
                        WHERE p.conversation_id = p_conversation_id);
    END IF;

    -- The pairs these runs form now, and the rows they had (pair_index is set below).
    SELECT coalesce(array_agg(ROW(p_conversation_id, j.run_id, 0, j.user_seq,
                                  j.user_message_id, j.user_bytes, j.assistant_message_id,
                                  j.assistant_bytes)::compaction.pairs), '{}')
    INTO v_fresh
    FROM compaction.judge_runs(p_conversation_id, v_runs) AS j
    WHERE j.reason IS NULL;
    SELECT coalesce(array_agg(p), '{}')
    INTO v_stale
    FROM compaction.pairs AS p
    WHERE p.conversation_id = p_conversation_id AND p.run_id = ANY (v_runs);
    IF pg_catalog.cardinality(v_fresh) = 0 AND pg_catalog.cardinality(v_stale) = 0 THEN
        RETURN;  -- the runs touched form no pair, before or after: nothing derived changes
    END IF;

    -- Sizes and the assistant side change in place; the position (seq, user id) cannot.
    UPDATE compaction.pairs AS p
    SET user_bytes = f.user_bytes,
        assistant_message_id = f.assistant_message_id,
        assistant_bytes = f.assistant_bytes
    FROM pg_catalog.unnest(v_fresh) AS f
    WHERE p.conversation_id = p_conversation_id AND p.run_id = f.run_id
      AND p.user_seq IS NOT DISTINCT FROM f.user_seq AND p.user_message_id = f.user_message_id
      AND (p.user_bytes, p.assistant_message_id, p.assistant_bytes)
          IS DISTINCT FROM (f.user_bytes, f.assistant_message_id, f.assistant_bytes);

    -- The earliest position where a pair appeared, vanished or moved (pair order is
    -- (seq, message_id), NULL seq last, as in judged_pairs).
    WITH diff AS (
        SELECT s.user_seq AS old_seq, s.user_message_id AS old_id,
               f.user_seq AS new_seq, f.user_message_id AS new_id
        FROM pg_catalog.unnest(v_stale) AS s
        FULL JOIN pg_catalog.unnest(v_fresh) AS f ON f.run_id = s.run_id
        WHERE s.run_id IS NULL OR f.run_id IS NULL
           OR s.user_seq IS DISTINCT FROM f.user_seq OR s.user_message_id <> f.user_message_id
    ), keys AS (
        SELECT d.old_seq AS seq, d.old_id AS id FROM diff AS d WHERE d.old_id IS NOT NULL
        UNION ALL
        SELECT d.new_seq, d.new_id FROM diff AS d WHERE d.new_id IS NOT NULL
    )
    SELECT k.seq, k.id INTO v_from_seq, v_from_id
    FROM keys AS k
    ORDER BY k.seq, k.id
    LIMIT 1;

    IF FOUND THEN
        -- Pairs before that position keep their numbers: continue after the last of them.
        IF v_from_seq IS NULL THEN
            SELECT p.pair_index INTO v_base
            FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id
              AND (p.user_seq IS NOT NULL OR p.user_message_id < v_from_id)
            ORDER BY p.user_seq DESC, p.user_message_id DESC
            LIMIT 1;
        ELSE
            SELECT p.pair_index INTO v_base
            FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id
              AND (p.user_seq, p.user_message_id) < (v_from_seq, v_from_id)
            ORDER BY p.user_seq DESC, p.user_message_id DESC
            LIMIT 1;
        END IF;
        v_base := coalesce(v_base + 1, 0);

        -- Everything from that position on is numbered anew (delete, then insert: the
        -- unique pair_index never sees two rows on one number). Two statements, so each
        -- is a range scan of pairs_order_idx.
        IF v_from_seq IS NULL THEN
            WITH gone AS (
                DELETE FROM compaction.pairs AS p
                WHERE p.conversation_id = p_conversation_id
                  AND p.user_seq IS NULL AND p.user_message_id >= v_from_id
                RETURNING p.*
            )
            SELECT coalesce(array_agg(g), '{}') INTO v_moved
            FROM gone AS g
            WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_runs) AS r (run_id)
                              WHERE r.run_id = g.run_id);
        ELSE
            WITH gone AS (
                DELETE FROM compaction.pairs AS p
                WHERE p.conversation_id = p_conversation_id
                  AND ((p.user_seq, p.user_message_id) >= (v_from_seq, v_from_id)
                       OR p.user_seq IS NULL)
                RETURNING p.*
            )
            SELECT coalesce(array_agg(g), '{}') INTO v_moved
            FROM gone AS g
            WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_runs) AS r (run_id)
                              WHERE r.run_id = g.run_id);
        END IF;
        INSERT INTO compaction.pairs AS p
            (conversation_id, run_id, pair_index, user_seq, user_message_id, user_bytes,
             assistant_message_id, assistant_bytes)
        SELECT p_conversation_id, x.run_id,
               v_base + (pg_catalog.row_number() OVER (ORDER BY x.user_seq, x.user_message_id))::int - 1,
               x.user_seq, x.user_message_id, x.user_bytes, x.assistant_message_id,
               x.assistant_bytes
        FROM (SELECT m.* FROM pg_catalog.unnest(v_moved) AS m
              UNION ALL
              SELECT f.* FROM pg_catalog.unnest(v_fresh) AS f
              WHERE NOT EXISTS (SELECT 1 FROM compaction.pairs AS q
                                WHERE q.conversation_id = p_conversation_id
                                  AND q.run_id = f.run_id)) AS x;
        SELECT coalesce(max(p.pair_index) + 1, 0) INTO v_count
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id;
        v_ranges := ARRAY(SELECT pg_catalog.generate_series(v_base / 10 * 10, v_count - 10, 10));
    ELSE
        v_ranges := '{}';
    END IF;

    -- Ranges to look at: those re-numbered above, and those holding a touched pair (its
    -- text may have changed). Only ranges whose ids changed or that hold a touched pair
    -- are hashed again, each from its 20 messages.
    v_ranges := v_ranges || ARRAY(
        SELECT p.pair_index / 10 * 10
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id
          AND p.run_id IN (SELECT f.run_id FROM pg_catalog.unnest(v_fresh) AS f));
    WITH wanted AS (
        SELECT DISTINCT w.from_pair,
               w.from_pair IN (SELECT p.pair_index / 10 * 10
                               FROM compaction.pairs AS p
                               WHERE p.conversation_id = p_conversation_id
                                 AND p.run_id IN (SELECT f.run_id
                                                  FROM pg_catalog.unnest(v_fresh) AS f))
                   AS touched
        FROM pg_catalog.unnest(v_ranges) AS w (from_pair)
        WHERE w.from_pair + 10 <= v_count
    ), present AS (
        SELECT w.from_pair, w.touched,
               ARRAY(SELECT u.id
                     FROM compaction.pairs AS p
                     CROSS JOIN LATERAL pg_catalog.unnest(
                         ARRAY[p.user_message_id, p.assistant_message_id])
                         WITH ORDINALITY AS u (id, ord)
                     WHERE p.conversation_id = p_conversation_id
                       AND p.pair_index BETWEEN w.from_pair AND w.from_pair + 9
                     ORDER BY p.pair_index, u.ord) AS ids
        FROM wanted AS w
    )
    INSERT INTO compaction.ranges AS r (conversation_id, from_pair, source_message_ids, source_hash)
    SELECT p_conversation_id, c.from_pair, c.ids, compaction.range_hash(c.ids)
    FROM present AS c
    WHERE c.touched
       OR NOT EXISTS (SELECT 1 FROM compaction.ranges AS o
                      WHERE o.conversation_id = p_conversation_id
                        AND o.from_pair = c.from_pair
                        AND o.source_message_ids = c.ids)
    ON CONFLICT (conversation_id, from_pair) DO UPDATE
        SET source_message_ids = EXCLUDED.source_message_ids,
            source_hash = EXCLUDED.source_hash;
    DELETE FROM compaction.ranges AS r
    WHERE r.conversation_id = p_conversation_id AND r.from_pair > v_count - 10;
    UPDATE compaction.conversation_state AS cs
    SET pair_count = v_count
    WHERE cs.conversation_id = p_conversation_id AND cs.pair_count <> v_count;
END
$$;
COMMENT ON FUNCTION compaction.rederive(text, text[]) IS
    'Internal: re-derives one conversation''s pairs and ranges after a write touched the runs named (NULL: all), from the earliest changed position on';

-- The trigger. Arguments: the name of the column holding the conversation id, and of the
-- column holding the run id ('' when the table has none: the touched conversations are
-- then re-derived whole); their text form must be what the views expose. Transition
-- tables must be named new_rows and old_rows.
CREATE OR REPLACE FUNCTION compaction.track_source_changes()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_conversation_column text := TG_ARGV[0];
    v_run_column          text := nullif(TG_ARGV[1], '');
    v_conversations       text[] := '{}';
    v_runs                text[] := '{}';
    v_touched             record;
BEGIN
    IF TG_LEVEL <> 'STATEMENT' OR TG_WHEN <> 'AFTER' OR TG_NARGS <> 2
       OR v_conversation_column IS NULL THEN
        RAISE EXCEPTION 'track_source_changes must be an AFTER ... FOR EACH STATEMENT trigger with two arguments: the conversation id column and the run id column (or '''')'
            USING ERRCODE = 'CP020';
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        -- No transition table says what went: stop trusting the derived state until a
        -- rebuild (every function judges from the views meanwhile, exact and slower).
        UPDATE compaction.source_tracking SET stamp = NULL, object_oids = NULL, stamped_at = NULL;
        RETURN NULL;
    END IF;

    -- The columns named by the arguments, as text (the form the views expose them in).
    -- Static statements over the transition tables keep their plans across calls, where
    -- dynamic SQL would be planned again for every statement of the host.
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        SELECT v_conversations || array_agg(j.fields ->> v_conversation_column),
               v_runs || array_agg(j.fields ->> v_run_column)
        INTO v_conversations, v_runs
        FROM new_rows AS n
        CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(n) AS fields) AS j;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        SELECT v_conversations || array_agg(j.fields ->> v_conversation_column),
               v_runs || array_agg(j.fields ->> v_run_column)
        INTO v_conversations, v_runs
        FROM old_rows AS o
        CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(o) AS fields) AS j;
    END IF;

    -- Each touched conversation once, in a fixed order (concurrent bulk writers lock
    -- conversation_state rows in one order), with the runs it must look at: the runs
    -- named by the rows, under the conversation the rows name and under the conversation
    -- the run belongs to now (a message filed under another conversation still counts
    -- against its run's).
    FOR v_touched IN
        WITH touched AS (
            SELECT t.conversation_id, t.run_id
            FROM ROWS FROM (pg_catalog.unnest(v_conversations), pg_catalog.unnest(v_runs))
                AS t (conversation_id, run_id)
        )
        SELECT t.conversation_id,
               array_agg(DISTINCT t.run_id) FILTER (WHERE t.run_id IS NOT NULL) AS run_ids
        FROM (SELECT c.conversation_id, c.run_id FROM touched AS c
              UNION
              SELECT sr.conversation_id, sr.run_id
              FROM compaction.source_runs AS sr
              WHERE sr.run_id IN (SELECT c.run_id FROM touched AS c)) AS t
        WHERE t.conversation_id IS NOT NULL
        GROUP BY t.conversation_id
        ORDER BY t.conversation_id
    LOOP
        IF v_run_column IS NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, NULL);
        ELSIF v_touched.run_ids IS NOT NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, v_touched.run_ids);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.track_source_changes() IS
    'Trigger (AFTER ... FOR EACH STATEMENT, transition tables new_rows/old_rows; arguments: conversation id column, run id column or ''''): keeps the derived state of the conversations a statement touched';

-- Writes to the reference history enqueue the conversations they touch (scope
-- 'default'), once per statement, so a bulk COPY costs one INSERT here.
CREATE OR REPLACE FUNCTION compaction.source_enqueue()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- The upsert of compaction.enqueue, for every conversation the statement wrote, in
    -- one sorted statement: concurrent bulk writers take queue row locks in one order.
    IF TG_OP = 'INSERT' THEN
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT n.conversation_id, 'default', pg_catalog.now()
        FROM new_rows AS n
        WHERE n.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT o.conversation_id, 'default', pg_catalog.now()
        FROM old_rows AS o
        WHERE o.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    ELSE
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT c.conversation_id, 'default', pg_catalog.now()
        FROM (SELECT n.conversation_id FROM new_rows AS n
              UNION ALL
              SELECT o.conversation_id FROM old_rows AS o) AS c
        WHERE c.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.source_enqueue() IS
    'Trigger: enqueues (scope default) every conversation whose reference runs or messages a statement wrote';

-- enc(s) = 4-byte big-endian length of UTF-8(s), then UTF-8(s); the database is UTF8,
-- so convert_to(..., 'UTF8') is the text's own bytes. The hash of a range is the SHA-256
-- of enc(u0 id) enc(u0 text) enc(a0 id) enc(a0 text) ... enc(a9 text).
CREATE OR REPLACE FUNCTION compaction.range_hash(p_message_ids text[])
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    -- p_message_ids is [u0, a0, ..., u9, a9]: the hash input walks it two by two.
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
    JOIN compaction.source_messages AS m ON m.message_id = ids.id
$$;
COMMENT ON FUNCTION compaction.range_hash(text[]) IS
    'Source hash of a range given its 20 current source ids [u0, a0, ..., u9, a9], reading only those messages; NULL unless all 20 are found exactly once';

DROP FUNCTION compaction.rederive_general(text, text[], compaction.pairs[], compaction.pairs[], int);
DROP FUNCTION compaction.rederive_runs(text, text[], int);
