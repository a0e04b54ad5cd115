-- 0044_runs_found_by_hash_alone: compaction.pairs finds a Run's pair through
-- pairs_run_hash_idx, a B-tree on hashtext(run_id) alone, instead of pairs_run_idx on
-- (conversation_id, hashtext(run_id)), which held the conversation's id in every entry:
-- about 34 bytes a message where ids are uuids, against 15 for the new index
-- (docs/operations.md, "Space to plan"). The lookups of one run's pair compare the
-- conversation as a filter the primary key cannot serve, so that they plan on the new
-- index whatever the statistics on pairs say: the four functions that make them are
-- replaced whole, with only that changed (and rederive_general's update of the pairs'
-- sizes split in two: a few runs' and many runs').
--
-- The index is built here unless it exists already, valid: on a large, live database a
-- DBA builds it first with CREATE INDEX CONCURRENTLY, and may drop the old one
-- concurrently after this migration (docs/operations.md, "Upgrading"). Built here, it
-- holds pairs' SHARE lock while it builds, and tracked writes wait for it; dropping the
-- old index here holds pairs' ACCESS EXCLUSIVE lock for a moment.
--
-- Each DDL statement runs on its own (EXECUTE): Citus sends a distributed table's DDL to
-- the nodes as the text of the statement that ran it, which must be one command.
DO $$
BEGIN
    -- An index a failed CREATE INDEX CONCURRENTLY left behind is invalid: built again.
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_index AS i
               WHERE i.indexrelid = pg_catalog.to_regclass('compaction.pairs_run_hash_idx')
                 AND NOT (i.indisvalid AND i.indisready)) THEN
        EXECUTE 'DROP INDEX compaction.pairs_run_hash_idx';
    END IF;
    EXECUTE 'CREATE INDEX IF NOT EXISTS pairs_run_hash_idx'
            ' ON compaction.pairs (pg_catalog.hashtext(run_id))';
END
$$;
COMMENT ON INDEX compaction.pairs_run_hash_idx IS
    'The pair of a Run, by the hash of its run id (lookups compare the run id and the conversation too)';

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
        FROM compaction.judge_runs(p_conversation_id, p_run_ids) AS j
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

CREATE OR REPLACE FUNCTION compaction.rederive_general(
    p_conversation_id text, p_run_ids text[], p_fresh compaction.pairs[],
    p_stale compaction.pairs[], p_pair_count int)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Not the generic plans of its caller: how many pairs follow the changed position decides
-- these plans, and a generic plan scanned the whole conversation's pairs.
SET plan_cache_mode = auto
AS $$
DECLARE
    v_runs     text[] := p_run_ids;
    v_fresh    compaction.pairs[] := p_fresh;
    v_stale    compaction.pairs[] := p_stale;
    v_touched  text[] := ARRAY(SELECT f.run_id FROM pg_catalog.unnest(p_fresh) AS f);
    v_moved    compaction.pairs[];
    v_from_seq bigint;
    v_from_id  text;
    v_base     int;
    v_count    int := p_pair_count;
    v_ranges   int[];
    v_held     int[];
BEGIN
    -- Sizes and the assistant side change in place; the position (seq, user id) cannot.
    -- A few runs (an edit's): each run's pair found through the run index, the
    -- conversation as a filter (see rederive, revision 0044; as an index condition, where
    -- pairs had no statistics yet, every edit also read the conversation's primary key
    -- entries). Many (a whole conversation re-derived): the conversation's pairs joined
    -- with them through the primary key's prefix, where as many probes would cost more.
    IF pg_catalog.cardinality(v_fresh) <= 16 THEN
        UPDATE compaction.pairs AS p
        SET user_bytes = f.user_bytes,
            assistant_message_id = f.assistant_message_id,
            assistant_bytes = f.assistant_bytes
        FROM pg_catalog.unnest(v_fresh) AS f
        WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(f.run_id)
          AND p.run_id = f.run_id
          AND (p.conversation_id = p_conversation_id) IS TRUE
          AND p.user_seq IS NOT DISTINCT FROM f.user_seq
          AND p.user_message_id = f.user_message_id
          AND (p.user_bytes, p.assistant_message_id, p.assistant_bytes)
              IS DISTINCT FROM (f.user_bytes, f.assistant_message_id, f.assistant_bytes);
    ELSE
        UPDATE compaction.pairs AS p
        SET user_bytes = f.user_bytes,
            assistant_message_id = f.assistant_message_id,
            assistant_bytes = f.assistant_bytes
        FROM pg_catalog.unnest(v_fresh) AS f
        WHERE p.conversation_id = p_conversation_id
          AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(f.run_id)
          AND p.run_id = f.run_id
          AND p.user_seq IS NOT DISTINCT FROM f.user_seq
          AND p.user_message_id = f.user_message_id
          AND (p.user_bytes, p.assistant_message_id, p.assistant_bytes)
              IS DISTINCT FROM (f.user_bytes, f.assistant_message_id, f.assistant_bytes);
    END IF;

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
        -- The stored pairs are numbered in (seq, message_id) order (only sizes and the
        -- assistant side changed above), so the last pair before the position is the
        -- first one met walking pair_index down from the end (revision 0025: no index of
        -- its own on (seq, message_id), which was a fifth of the derived state); the walk
        -- passes the pairs that are renumbered below anyway.
        SELECT p.pair_index INTO v_base
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id
          AND CASE WHEN v_from_seq IS NULL
                   THEN p.user_seq IS NOT NULL OR p.user_message_id < v_from_id
                   ELSE (p.user_seq, p.user_message_id) < (v_from_seq, v_from_id) END
        ORDER BY p.pair_index DESC
        LIMIT 1;
        v_base := coalesce(v_base + 1, 0);

        -- Everything from that position on is numbered anew (delete, then insert: the
        -- unique pair_index never sees two rows on one number).
        WITH gone AS (
            DELETE FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id AND p.pair_index >= v_base
            RETURNING p.*
        )
        SELECT coalesce(array_agg(g), '{}') INTO v_moved
        FROM gone AS g
        WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_runs) AS r (run_id)
                          WHERE r.run_id = g.run_id);
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
                                  AND pg_catalog.hashtext(q.run_id)
                                      = pg_catalog.hashtext(f.run_id)
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
    -- are hashed again, each from its 20 messages. Each touched run's pair is looked up
    -- on its own, as in rederive: plan_cache_mode = auto turns to a generic plan after
    -- five calls, and "run_id = ANY (the runs)" read every pair of a large conversation
    -- under it (revision 0035).
    v_held := ARRAY(
        SELECT DISTINCT q.pair_index / 10 * 10
        FROM pg_catalog.unnest(v_touched) AS k (run_id)
        CROSS JOIN LATERAL (
            -- the conversation as a filter: see rederive (revision 0044)
            SELECT p.pair_index FROM compaction.pairs AS p
            WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
              AND p.run_id = k.run_id
              AND (p.conversation_id = p_conversation_id) IS TRUE
            OFFSET 0) AS q);
    v_ranges := v_ranges || v_held;
    WITH wanted AS (
        -- IN a subquery, hashed once, not "= ANY (v_held)": an array parameter is
        -- searched row by row (the square of the pairs when a whole conversation is
        -- re-derived)
        SELECT DISTINCT w.from_pair,
               w.from_pair IN (SELECT h.from_pair FROM pg_catalog.unnest(v_held) AS h (from_pair))
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
    SELECT p_conversation_id, c.from_pair, c.ids, compaction.range_hash(p_conversation_id, c.ids)
    FROM present AS c
    WHERE c.touched
       OR NOT EXISTS (SELECT 1 FROM compaction.ranges AS o
                      WHERE o.conversation_id = p_conversation_id
                        AND o.from_pair = c.from_pair
                        AND o.source_message_ids = c.ids)
    ON CONFLICT (conversation_id, from_pair) DO UPDATE
        SET source_message_ids = EXCLUDED.source_message_ids,
            source_hash = EXCLUDED.source_hash;
    WITH gone AS (
        DELETE FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair > v_count - 10
        RETURNING r.from_pair
    )
    SELECT v_ranges || coalesce(pg_catalog.array_agg(g.from_pair), '{}') INTO v_ranges
    FROM gone AS g;
    -- The summaries of every range written or deleted above are judged again.
    PERFORM compaction.rederive_summary_verdicts(p_conversation_id, v_ranges);
    UPDATE compaction.conversation_state AS cs
    SET pair_count = v_count
    WHERE cs.conversation_id = p_conversation_id AND cs.pair_count <> v_count;
END
$$;
COMMENT ON FUNCTION compaction.rederive_general(text, text[], compaction.pairs[], compaction.pairs[], int) IS
    'Internal: the general path of rederive (a pair changed, vanished or moved): renumbers from the earliest changed position and re-hashes the ranges affected';

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
    v_elsewhere           boolean;
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

    -- The common statement (an agent's single-row writes): its rows name one conversation
    -- and every run they name belongs to it now. A lookup of those runs decides that,
    -- where the general grouping below costs several times as much to start.
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
        -- Whether a touched run lives in another conversation and, for a later statement
        -- of a transaction that already holds this conversation's conversation_state row
        -- (see rederive), rederive's no-change question and the pair count, in one
        -- statement: its snapshot is taken after the lock was, so it sees what rederive
        -- would see. An agent's second and third statements per Run end here.
        SELECT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                       WHERE sr.run_id = ANY (v_run_ids)
                         AND sr.conversation_id <> v_conversation),
               cs.pair_count,
               CASE WHEN cs.pair_count IS NOT NULL THEN
                   -- rederive's no-change test, word for word
                   NOT EXISTS (SELECT 1
                               FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                               CROSS JOIN LATERAL (
                                   SELECT 1 FROM compaction.source_runs AS sr
                                   WHERE sr.run_id = k.run_id
                                     AND sr.conversation_id = v_conversation
                                     AND sr.status IN ('completed', 'partial', 'clarify_pending')
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
        INTO v_elsewhere, v_count, v_unchanged
        FROM (SELECT) AS one
        LEFT JOIN compaction.conversation_state AS cs
          ON cs.conversation_id = v_conversation
         AND cs.xmin = pg_catalog.pg_current_xact_id()::xid;
        IF NOT v_elsewhere THEN
            IF v_count IS NULL THEN
                PERFORM compaction.rederive(v_conversation, v_run_ids, TG_RELID);
            ELSIF v_unchanged THEN
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

-- The functions above no longer look pairs up through it.
DO $$
BEGIN
    EXECUTE 'DROP INDEX IF EXISTS compaction.pairs_run_idx';
END
$$;

CALL compaction.assign_ownership();
