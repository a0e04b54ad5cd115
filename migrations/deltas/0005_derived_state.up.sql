-- Delta 0005_derived_state (frozen once released): derived state kept by the engine
-- (sql/15_derived_state.sql, sql/25_tracking.sql, sql/35_worker_reads.sql), the read
-- functions of sql/20_pairs.sql and sql/60_projection.sql and compaction.claim reading it,
-- the truncate guards of the new tables (sql/40_immutability.sql) and their grants
-- (sql/90_roles.sql).
--
-- The new tables start empty and compaction.source_tracking unstamped, so every function
-- keeps judging from the views (exact) until `pycompactor migrate` (or
-- CALL compaction.rebuild_derived_state()) has re-derived every conversation in batches
-- of their own transactions and stamped it.

-- ==== sql/15_derived_state.sql ====
CREATE TABLE compaction.conversation_state (
    conversation_id text NOT NULL,
    pair_count      int NOT NULL,
    -- Bumped by every re-derivation: a writer whose snapshot predates another writer's
    -- commit (REPEATABLE READ, SERIALIZABLE) fails on this row instead of numbering from
    -- a stale view of the conversation.
    generation      bigint NOT NULL,
    CONSTRAINT conversation_state_pkey PRIMARY KEY (conversation_id),
    CONSTRAINT conversation_state_pair_count_not_negative CHECK (pair_count >= 0)
);
COMMENT ON TABLE compaction.conversation_state IS
    'Derived state: eligible pair count per conversation, and the row that serialises the conversation''s derived-state writers';

CREATE TABLE compaction.pairs (
    conversation_id      text NOT NULL,
    run_id               text NOT NULL,
    pair_index           int NOT NULL,
    user_seq             bigint,
    user_message_id      text NOT NULL,
    user_bytes           int NOT NULL,
    assistant_message_id text NOT NULL,
    assistant_bytes      int NOT NULL,
    CONSTRAINT pairs_pkey PRIMARY KEY (conversation_id, run_id),
    CONSTRAINT pairs_pair_index_key UNIQUE (conversation_id, pair_index),
    CONSTRAINT pairs_pair_index_not_negative CHECK (pair_index >= 0)
);
COMMENT ON TABLE compaction.pairs IS
    'Derived state: the eligible pairs of each conversation (DESIGN §3) with pair_index, ids and UTF-8 sizes; no text';
-- Re-derivation finds the pair before a changed position and the pairs after it in
-- (seq, message_id) order, the order pair_index follows.
CREATE INDEX pairs_order_idx ON compaction.pairs (conversation_id, user_seq, user_message_id);

CREATE TABLE compaction.ranges (
    conversation_id    text NOT NULL,
    from_pair          int NOT NULL,
    source_message_ids text[] NOT NULL,
    source_hash        text NOT NULL,
    CONSTRAINT ranges_pkey PRIMARY KEY (conversation_id, from_pair),
    CONSTRAINT ranges_from_pair_valid CHECK (from_pair >= 0 AND from_pair % 10 = 0)
);
COMMENT ON TABLE compaction.ranges IS
    'Derived state: every complete range of 10 pairs with its 20 current source ids [u0, a0, ..., u9, a9] and source hash (DESIGN §5)';

CREATE TABLE compaction.source_tracking (
    singleton   boolean NOT NULL DEFAULT true,
    stamp       text,
    object_oids oid[],
    stamped_at  timestamptz,
    CONSTRAINT source_tracking_pkey PRIMARY KEY (singleton),
    CONSTRAINT source_tracking_single_row CHECK (singleton)
);
COMMENT ON TABLE compaction.source_tracking IS
    'Derived state: the source stamp (compaction.source_stamp()) the derived state was last rebuilt under, and the catalog rows it names; NULL until a rebuild';
INSERT INTO compaction.source_tracking (singleton, stamp, object_oids, stamped_at)
VALUES (true, NULL, NULL, NULL);

-- What the derived state depends on, read from the catalogs: the rewrite rules of the two
-- source views and the tracking triggers of every table they read, each as oid:xmin. A
-- catalog row's xmin changes whenever the row is replaced (CREATE OR REPLACE VIEW,
-- ENABLE/DISABLE TRIGGER) and its oid when it is dropped and made again (DROP/CREATE
-- TRIGGER, a dump and restore), so any such change yields another stamp. NULL when some
-- table behind the views lacks an enabled-always (fires under any
-- session_replication_role) statement-level AFTER tracking trigger for INSERT, UPDATE,
-- DELETE and TRUNCATE, or the views read something other than tables.
CREATE FUNCTION compaction.source_stamp()
RETURNS text
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_tracker regprocedure := pg_catalog.to_regprocedure('compaction.track_source_changes()');
BEGIN
    RETURN (
        WITH rules AS (
            SELECT rw.oid, rw.ev_class, rw.xmin
            FROM pg_catalog.pg_rewrite AS rw
            WHERE rw.ev_class IN (pg_catalog.to_regclass('compaction.source_runs'),
                                  pg_catalog.to_regclass('compaction.source_messages'))
        ),
        relations AS (
            SELECT DISTINCT d.refobjid AS relid
            FROM rules AS ru
            JOIN pg_catalog.pg_depend AS d
              ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = ru.oid
            WHERE d.refclassid = 'pg_catalog.pg_class'::regclass
              AND d.deptype = 'n'
              AND d.refobjid <> ru.ev_class
        ),
        triggers AS (
            SELECT tg.oid, tg.xmin, tg.tgrelid, tg.tgtype::int AS tgtype
            FROM pg_catalog.pg_trigger AS tg
            WHERE tg.tgrelid IN (SELECT rel.relid FROM relations AS rel)
              AND tg.tgfoid = v_tracker
              AND tg.tgenabled = 'A'
        ),
        tracked AS (
            -- tgtype bits: 1 row, 2 before, 4 insert, 8 delete, 16 update, 32 truncate
            SELECT c.relkind IN ('r', 'p')
                   AND coalesce(pg_catalog.bit_or(t.tgtype) OPERATOR(pg_catalog.&) 60 = 60, false)
                   AND coalesce(pg_catalog.bool_and(t.tgtype OPERATOR(pg_catalog.&) 3 = 0), false)
                       AS complete
            FROM relations AS rel
            JOIN pg_catalog.pg_class AS c ON c.oid = rel.relid
            LEFT JOIN triggers AS t ON t.tgrelid = rel.relid
            GROUP BY rel.relid, c.relkind
        )
        SELECT CASE WHEN (SELECT count(*) FROM rules) = 2
                     AND (SELECT pg_catalog.bool_and(t.complete) FROM tracked AS t) THEN
                   (SELECT pg_catalog.string_agg(o.oid::text || ':' || o.xmin::text, ','
                                                 ORDER BY o.oid)
                    FROM (SELECT ru.oid, ru.xmin FROM rules AS ru
                          UNION ALL
                          SELECT t.oid, t.xmin FROM triggers AS t) AS o)
               END);
END
$$;
COMMENT ON FUNCTION compaction.source_stamp() IS
    'Identifies the source views and the tracking triggers behind them as they are now (oid:xmin of each catalog row); NULL when some table behind the views is not fully tracked';

-- Called by every read, so it re-reads only the catalog rows the stamp names, by oid: a
-- changed view or trigger changes their xmin, a dropped one removes its row, a new
-- dependency can only come with a changed view.
CREATE FUNCTION compaction.derived_state_current()
RETURNS boolean
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN coalesce((
        SELECT st.stamp = (SELECT pg_catalog.string_agg(o.oid::text || ':' || o.xmin::text, ','
                                                        ORDER BY o.oid)
                           FROM (SELECT rw.oid, rw.xmin FROM pg_catalog.pg_rewrite AS rw
                                 WHERE rw.oid = ANY (st.object_oids)
                                 UNION ALL
                                 SELECT tg.oid, tg.xmin FROM pg_catalog.pg_trigger AS tg
                                 WHERE tg.oid = ANY (st.object_oids) AND tg.tgenabled = 'A') AS o)
        FROM compaction.source_tracking AS st), false);
END
$$;
COMMENT ON FUNCTION compaction.derived_state_current() IS
    'True when the derived state is in use: it was rebuilt under the source views and tracking triggers that exist now (else every function judges from the views)';

CREATE FUNCTION compaction.derived_state_status()
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN compaction.derived_state_current() THEN 'in_use'
                WHEN compaction.source_stamp() IS NULL THEN 'untracked'
                ELSE 'not_rebuilt' END
$$;
COMMENT ON FUNCTION compaction.derived_state_status() IS
    'in_use (derived state kept and used), not_rebuilt (tracked, but CALL compaction.rebuild_derived_state() has not run since the views or triggers changed), untracked (some table behind the views has no tracking triggers: every call judges from the views)';

-- ==== sql/20_pairs.sql: eligibility with an optional run list, reads from derived state ====
DROP FUNCTION compaction.judge_runs(text);
CREATE FUNCTION compaction.judge_runs(p_conversation_id text, p_run_ids text[] DEFAULT NULL)
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
BEGIN
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
        SELECT sr.run_id, sr.conversation_id, sr.status
        FROM compaction.source_runs AS sr
        WHERE sr.run_id = ANY (p_run_ids) AND sr.conversation_id = p_conversation_id
    ),
    per_run AS (
        SELECT r.run_id,
               r.status AS run_status,
               m.*
        FROM runs AS r
        CROSS JOIN LATERAL (
            SELECT count(*) FILTER (WHERE sm.role = 'user') AS n_user,
                   count(*) FILTER (WHERE sm.role = 'assistant') AS n_assistant,
                   coalesce(bool_or(sm.conversation_id IS DISTINCT FROM p_conversation_id),
                            false) AS foreign_message,
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
            WHERE sm.run_id = r.run_id
              AND sm.role IN ('user', 'assistant')
        ) AS m
    )
    SELECT p.run_id,
           p.run_status,
           CASE
               WHEN p.run_status IS NULL
                 OR p.run_status NOT IN ('completed', 'partial', 'clarify_pending')
                   THEN 'run_status'
               WHEN p.foreign_message THEN 'foreign_message'
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
COMMENT ON FUNCTION compaction.judge_runs(text, text[]) IS
    'Internal: every run of a conversation (or only those named) with the first eligibility rule it breaks (NULL when it forms a pair), its pair''s ids and UTF-8 byte lengths; no text';

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
    IF compaction.derived_state_current() THEN
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
    IF compaction.derived_state_current() THEN
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
        RETURN QUERY SELECT v_pairs, v_ids, compaction.range_hash(v_ids);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.current_range(text, int) IS
    'Internal: the conversation''s pair count and, when pairs from_pair..from_pair+9 exist, their 20 current source ids and hash';

CREATE OR REPLACE FUNCTION compaction.plan_targets(p_conversation_id text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF compaction.derived_state_current() THEN
        RETURN QUERY
        SELECT r.from_pair, r.from_pair + 9, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        JOIN compaction.conversation_state AS cs ON cs.conversation_id = r.conversation_id
        WHERE r.conversation_id = p_conversation_id
          AND compaction.is_target(r.from_pair, cs.pair_count)
        ORDER BY r.from_pair;
        RETURN;
    END IF;
    RETURN QUERY
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
                   AS source_message_ids
        FROM pairs AS p
        WHERE compaction.is_target(p.from_pair, p.n_pairs)
        GROUP BY p.from_pair
    )
    SELECT r.from_pair::int, (r.from_pair + 9)::int, r.source_message_ids,
           compaction.range_hash(r.source_message_ids)
    FROM ranges AS r
    ORDER BY r.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.plan_targets(text) IS
    'Ranges of 10 pairs the fixed window policy makes targets now (N >= 10k + 30), with their 20 source ids [u0, a0, ..., u9, a9] and source hash';

CREATE OR REPLACE FUNCTION compaction.source_hash(p_conversation_id text, p_from_pair int)
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

-- ==== sql/25_tracking.sql ====
-- Re-derives one conversation's pairs and ranges after a write touched the runs named
-- (NULL: every run of the conversation). Reads the views for those runs only, finds the
-- earliest (seq, message_id) position where a pair appeared, vanished or moved, renumbers
-- from there, and re-hashes the ranges whose ids changed or whose pairs were touched.
CREATE FUNCTION compaction.rederive(p_conversation_id text, p_run_ids text[])
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
CREATE FUNCTION compaction.track_source_changes()
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

-- The reference tables are tracked from the start. ENABLE ALWAYS: logical replication's
-- apply (session_replication_role = replica) keeps the derived state too.
CREATE TRIGGER runs_track_insert
    AFTER INSERT ON compaction_source.runs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER runs_track_update
    AFTER UPDATE ON compaction_source.runs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER runs_track_delete
    AFTER DELETE ON compaction_source.runs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER runs_track_truncate
    AFTER TRUNCATE ON compaction_source.runs
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER messages_track_insert
    AFTER INSERT ON compaction_source.messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER messages_track_update
    AFTER UPDATE ON compaction_source.messages
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER messages_track_delete
    AFTER DELETE ON compaction_source.messages
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER messages_track_truncate
    AFTER TRUNCATE ON compaction_source.messages
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_insert;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_update;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_delete;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_truncate;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_track_insert;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_track_update;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_track_delete;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_track_truncate;

-- ---------------------------------------------------------------------------------------
-- Attaching the tracking to a host's own tables
-- ---------------------------------------------------------------------------------------

-- Runs with the caller's rights (the host table's owner creates triggers on its table);
-- it needs EXECUTE on track_source_changes, which the engine's owner grants.
CREATE FUNCTION compaction.attach_source_tracking(
    p_table regclass, p_conversation_column text, p_run_column text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_column text;
    v_event  text;
BEGIN
    IF p_table IS NULL OR p_conversation_column IS NULL OR p_run_column IS NULL THEN
        RAISE EXCEPTION 'attach_source_tracking needs a table, its conversation id column and its run id column ('''' when it has none)'
            USING ERRCODE = 'CP020';
    END IF;
    FOREACH v_column IN ARRAY ARRAY[p_conversation_column, nullif(p_run_column, '')] LOOP
        IF v_column IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM pg_catalog.pg_attribute AS a
               WHERE a.attrelid = p_table AND a.attname = v_column
                 AND a.attnum > 0 AND NOT a.attisdropped) THEN
            RAISE EXCEPTION 'table % has no column %', p_table, v_column
                USING ERRCODE = 'CP020';
        END IF;
    END LOOP;
    PERFORM compaction.detach_source_tracking(p_table);
    FOREACH v_event IN ARRAY ARRAY['insert', 'update', 'delete', 'truncate'] LOOP
        EXECUTE pg_catalog.format(
            'CREATE TRIGGER %I AFTER %s ON %s %s FOR EACH STATEMENT'
            ' EXECUTE FUNCTION compaction.track_source_changes(%L, %L)',
            'compaction_track_' || v_event, pg_catalog.upper(v_event), p_table,
            CASE v_event
                WHEN 'insert' THEN 'REFERENCING NEW TABLE AS new_rows'
                WHEN 'update' THEN 'REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows'
                WHEN 'delete' THEN 'REFERENCING OLD TABLE AS old_rows'
                ELSE ''
            END,
            p_conversation_column, p_run_column);
        -- ALWAYS: logical replication's apply (session_replication_role = replica) too.
        EXECUTE pg_catalog.format('ALTER TABLE %s ENABLE ALWAYS TRIGGER %I',
                                  p_table, 'compaction_track_' || v_event);
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.attach_source_tracking(regclass, text, text) IS
    'Attaches the change-tracking triggers (INSERT, UPDATE, DELETE, TRUNCATE) to a host table behind the source views, naming its conversation id and run id columns; then CALL compaction.rebuild_derived_state()';

CREATE FUNCTION compaction.detach_source_tracking(p_table regclass)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_event text;
BEGIN
    FOREACH v_event IN ARRAY ARRAY['insert', 'update', 'delete', 'truncate'] LOOP
        EXECUTE pg_catalog.format('DROP TRIGGER IF EXISTS %I ON %s',
                                  'compaction_track_' || v_event, p_table);
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.detach_source_tracking(regclass) IS
    'Removes the change-tracking triggers attach_source_tracking created on a host table (the engine then judges from the views on each call)';

-- ---------------------------------------------------------------------------------------
-- Proof and repair
-- ---------------------------------------------------------------------------------------

-- The oracle (DESIGN §2): recomputes one conversation from the views and names every
-- difference from the derived state. Ids, positions, counts and hashes only: an auditor
-- may run it.
CREATE FUNCTION compaction.verify_conversation(p_conversation_id text)
RETURNS TABLE (problem text, detail text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    WITH judged AS (
        SELECT j.* FROM compaction.judged_pairs(p_conversation_id) AS j
    ), stored AS (
        SELECT p.* FROM compaction.pairs AS p WHERE p.conversation_id = p_conversation_id
    ), judged_ranges AS (
        SELECT g.from_pair, g.ids, compaction.range_hash(g.ids) AS hash
        FROM (SELECT j.pair_index / 10 * 10 AS from_pair,
                     ARRAY(SELECT pg_catalog.unnest(array_agg(
                         ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)))
                         AS ids
              FROM judged AS j
              GROUP BY j.pair_index / 10 * 10
              HAVING count(*) = 10) AS g
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
    ORDER BY 1, 2
$$;
COMMENT ON FUNCTION compaction.verify_conversation(text) IS
    'Recomputes one conversation from the source views and returns one row per difference from the derived state (no rows: consistent); ids, counts and hashes only';

CREATE FUNCTION compaction.rederive_conversation(p_conversation_id text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    IF p_conversation_id IS NULL THEN
        RAISE EXCEPTION 'rederive_conversation needs a conversation id' USING ERRCODE = 'CP020';
    END IF;
    PERFORM compaction.rederive(p_conversation_id, NULL);
END
$$;
COMMENT ON FUNCTION compaction.rederive_conversation(text) IS
    'Repair: re-derives one conversation''s pairs and ranges from the source views (e.g. after writes with the tracking triggers disabled)';

-- Every conversation, in batches of one transaction each (no transaction holds every
-- conversation, progress is reported as NOTICEs), then the stamp that puts the derived
-- state in use. Writes during the rebuild are tracked as usual; the stamp is set only if
-- the source stamp did not change while the rebuild ran. Call it outside a transaction
-- block: CALL compaction.rebuild_derived_state();
CREATE PROCEDURE compaction.rebuild_derived_state(p_batch int DEFAULT 100)
LANGUAGE plpgsql
-- No SET clause: a procedure with one cannot COMMIT. Every name below is qualified.
AS $$
DECLARE
    v_stamp text;
    v_after text := '';
    v_batch text[];
    v_conversation text;
    v_done bigint := 0;
    v_total bigint;
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
    SELECT count(*) INTO v_total
    FROM (SELECT sr.conversation_id FROM compaction.source_runs AS sr
          UNION SELECT cs.conversation_id FROM compaction.conversation_state AS cs) AS c;
    LOOP
        v_batch := ARRAY(SELECT c.conversation_id
                         FROM (SELECT sr.conversation_id FROM compaction.source_runs AS sr
                               WHERE sr.conversation_id > v_after
                               UNION
                               SELECT cs.conversation_id FROM compaction.conversation_state AS cs
                               WHERE cs.conversation_id > v_after) AS c
                         ORDER BY c.conversation_id
                         LIMIT p_batch);
        EXIT WHEN pg_catalog.cardinality(v_batch) = 0;
        FOREACH v_conversation IN ARRAY v_batch LOOP
            PERFORM compaction.rederive_conversation(v_conversation);
        END LOOP;
        v_done := v_done + pg_catalog.cardinality(v_batch);
        v_after := v_batch[pg_catalog.cardinality(v_batch)];
        COMMIT;
        RAISE NOTICE 'derived state: % of % conversations', v_done, v_total;
    END LOOP;
    PERFORM compaction.stamp_derived_state(v_stamp);
    COMMIT;
END
$$;
COMMENT ON PROCEDURE compaction.rebuild_derived_state(int) IS
    'Repair and upgrade step: re-derives every conversation in batches (one transaction each), then puts the derived state in use; CALL outside a transaction block';

CREATE FUNCTION compaction.stamp_derived_state(p_stamp text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- A view re-pointed or a trigger disabled while the rebuild ran: the rows derived
    -- before that may be stale, so the derived state stays out of use.
    IF p_stamp IS NULL OR p_stamp IS DISTINCT FROM compaction.source_stamp() THEN
        RAISE EXCEPTION 'the source views or tracking triggers changed during the rebuild; run it again'
            USING ERRCODE = 'CP021';
    END IF;
    UPDATE compaction.source_tracking
    SET stamp = p_stamp,
        object_oids = ARRAY(SELECT pg_catalog.split_part(o.item, ':', 1)::oid
                            FROM pg_catalog.unnest(pg_catalog.string_to_array(p_stamp, ',')) AS o (item)),
        stamped_at = pg_catalog.now();
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.stamp_derived_state(text) IS
    'Internal: last step of rebuild_derived_state: puts the derived state in use under the given source stamp, unless the source changed meanwhile';

-- ==== sql/30_claims.sql: claim compares with the derived range ====
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
AS $$
#variable_conflict use_column
DECLARE
    v_now         timestamptz := coalesce(p_now, pg_catalog.now());
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_job_id      bigint;
    v_failed      int;
    v_attempt     int;
    v_max_running int;
    v_in_flight   bigint;
    v_lease       timestamptz;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL OR p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker, and a positive lease'
            USING ERRCODE = 'CP020';
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

    -- From here on the conversation's engine rows are ours until commit.
    PERFORM compaction.lock_conversation(p_conversation_id);

    -- The range as it is now, from the derived state (no message text read): the pair
    -- count decides whether it is a target, the stored ids and hash whether it matches.
    SELECT r.pair_count, r.source_message_ids, r.source_hash
    INTO v_pairs, v_target_ids, v_target_hash
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    IF NOT compaction.is_target(p_from_pair, v_pairs) THEN
        RETURN QUERY SELECT false, 'not_eligible'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT compaction.valid_source_hash(p_source_hash)
       OR v_target_hash IS DISTINCT FROM p_source_hash
       OR v_target_ids IS DISTINCT FROM p_source_message_ids THEN
        RETURN QUERY SELECT false, 'source_mismatch'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;

    IF v_job_id IS NULL THEN
        v_attempt := 1;
    ELSE
        -- Reap this identity: an expired attempt is a failed attempt.
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = v_now
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
          AND a.state = 'running' AND a.lease_expires_at <= v_now;

        IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                   WHERE s.conversation_id = p_conversation_id AND s.job_id = v_job_id) THEN
            RETURN QUERY SELECT false, 'already_completed'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        IF EXISTS (SELECT 1 FROM compaction.attempts AS a
                   WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
                     AND a.state = 'running') THEN
            RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        SELECT count(*) INTO v_failed
        FROM compaction.attempts AS a
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
        IF v_failed >= 2 THEN
            RETURN QUERY SELECT false, 'attempts_exhausted'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        v_attempt := v_failed + 1;
    END IF;

    -- Admission: taken last, only by a claim about to admit, so refusals never queue on
    -- it; held to commit, so the count below is exact across concurrent claimers.
    PERFORM pg_catalog.pg_advisory_xact_lock(1129316352, 2);
    SELECT s.max_running INTO v_max_running FROM compaction.settings AS s;
    SELECT count(*) INTO v_in_flight
    FROM compaction.admission AS ad
    WHERE ad.lease_expires_at > v_now;
    IF v_in_flight >= coalesce(v_max_running, 8) THEN
        RETURN QUERY SELECT false, 'admission_full'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    v_lease := v_now + p_lease;
    BEGIN
        IF v_job_id IS NULL THEN
            INSERT INTO compaction.jobs
                (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
                 model, prompt_version, created_at)
            VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                    p_source_message_ids, p_source_hash, p_model, p_prompt_version, v_now)
            RETURNING job_id INTO v_job_id;
        END IF;
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, v_now, v_lease);
    EXCEPTION WHEN unique_violation THEN
        -- Only reachable when the caller's snapshot predates a concurrent winner
        -- (REPEATABLE READ): the unique indexes decide, the loser gets a refusal row.
        RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END;
    RETURN QUERY SELECT true, 'claimed'::text, v_job_id, v_attempt, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, or returns the first refusal reason (see DESIGN §6)';

-- ==== sql/35_worker_reads.sql ====
CREATE FUNCTION compaction.worker_targets(
    p_conversation_id text, p_scope text, p_model text, p_prompt_version text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT t.from_pair, t.to_pair, t.source_message_ids, t.source_hash,
           EXISTS (SELECT 1
                   FROM compaction.jobs AS j
                   JOIN compaction.job_summaries AS s
                     ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
                   WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
                     AND j.from_pair = t.from_pair AND j.source_hash = t.source_hash
                     AND j.model = p_model AND j.prompt_version = p_prompt_version)
    FROM compaction.plan_targets(p_conversation_id) AS t
    ORDER BY t.from_pair
$$;
COMMENT ON FUNCTION compaction.worker_targets(text, text, text, text) IS
    'The targets of plan_targets with whether that identity (scope, model, prompt version) already holds a completed summary, so a worker claims only what is left';

CREATE FUNCTION compaction.range_replies(
    p_conversation_id text, p_from_pair int, p_source_hash text)
RETURNS TABLE (pair_index int, assistant_message_id text, assistant_content text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    -- Only while the range is what the claim bound: a range edited after the claim
    -- returns no rows, so the model never summarises text the hash does not cover.
    -- source_message_ids is [u0, a0, ..., u9, a9]: the replies sit at the even positions.
    SELECT (p_from_pair + u.ord / 2 - 1)::int, m.message_id, m.content
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS r
    CROSS JOIN LATERAL pg_catalog.unnest(r.source_message_ids)
        WITH ORDINALITY AS u (message_id, ord)
    JOIN compaction.source_messages AS m
      ON m.message_id = u.message_id AND m.role = 'assistant'
    WHERE r.source_hash = p_source_hash AND u.ord % 2 = 0
    ORDER BY u.ord
$$;
COMMENT ON FUNCTION compaction.range_replies(text, int, text) IS
    'The 10 assistant replies of range from_pair (pair_index, message id, text), only while the range''s current source hash equals the one given; no user text';

-- ==== sql/40_immutability.sql: truncate guards of the derived state ====
-- The derived state (revision 0005) is a cache of the source: emptied by TRUNCATE it would
-- be trusted and wrong. It changes only through re-derivation.
CREATE TRIGGER conversation_state_truncate_guard
    BEFORE TRUNCATE ON compaction.conversation_state
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER pairs_truncate_guard
    BEFORE TRUNCATE ON compaction.pairs
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER ranges_truncate_guard
    BEFORE TRUNCATE ON compaction.ranges
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER source_tracking_truncate_guard
    BEFORE TRUNCATE ON compaction.source_tracking
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.conversation_state ENABLE ALWAYS TRIGGER conversation_state_truncate_guard;
ALTER TABLE compaction.pairs ENABLE ALWAYS TRIGGER pairs_truncate_guard;
ALTER TABLE compaction.ranges ENABLE ALWAYS TRIGGER ranges_truncate_guard;
ALTER TABLE compaction.source_tracking ENABLE ALWAYS TRIGGER source_tracking_truncate_guard;

-- ==== sql/60_projection.sql: whether each summary's source is current ====
DROP FUNCTION compaction.projection_range_hashes(int[], text[]);
DROP FUNCTION compaction.projection_summaries(text, text);
CREATE FUNCTION compaction.projection_summaries(p_conversation_id text, p_scope text)
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
    source_current     boolean
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_derived boolean := compaction.derived_state_current();
BEGIN
    -- source_current: the range exists now with exactly the stored ids and hash. From the
    -- derived state that is a comparison per summary; judged from the views it costs one
    -- hash per distinct range that has summaries.
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
        SELECT f.from_pair, c.source_message_ids, c.source_hash
        FROM (SELECT DISTINCT x.from_pair FROM summaries AS x) AS f
        CROSS JOIN LATERAL compaction.current_range(p_conversation_id, f.from_pair) AS c
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
                    AND n.source_hash = s.source_hash, false)
    FROM summaries AS s
    LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = s.prompt_version
    LEFT JOIN now_ranges AS n ON n.from_pair = s.from_pair
    ORDER BY s.from_pair, s.summary_id;
END
$$;
COMMENT ON FUNCTION compaction.projection_summaries(text, text) IS
    'Completed summaries of a conversation and scope without their text: source binding, version, whether it is projectable, completed_at, UTF-8 byte length, and whether its source is current';

-- ==== sql/90_roles.sql ====
CALL compaction.assign_ownership();

GRANT EXECUTE ON FUNCTION compaction.projection_summaries(text, text)
TO compaction_worker, compaction_reader;

-- Derived state (revision 0005). The worker plans from it and reads a claimed range's
-- replies; the auditor may prove it against the views (ids, counts and hashes only).
-- Re-derivation and the rebuild are the owner's; a host attaching the tracking trigger to
-- its own tables is granted EXECUTE on compaction.track_source_changes() by the owner
-- (docs/integrating.md).
GRANT EXECUTE ON FUNCTION
    compaction.worker_targets(text, text, text, text),
    compaction.range_replies(text, int, text)
TO compaction_worker;
GRANT EXECUTE ON FUNCTION compaction.verify_conversation(text) TO compaction_auditor;
GRANT EXECUTE ON FUNCTION compaction.derived_state_status()
TO compaction_worker, compaction_reader, compaction_auditor;
REVOKE TRUNCATE ON compaction.conversation_state, compaction.pairs, compaction.ranges,
                   compaction.source_tracking
FROM compaction_owner;
