-- 0035_keys_looked_up_one_by_one: lookups that name a few keys of one conversation look
-- each key up on its own. The engine's functions keep generic plans (the tracking
-- trigger forces them; plan_cache_mode = auto takes one after five calls), which price
-- "key = ANY (an array)" or a join against an unnested array as about ten rows, and the
-- conversation's prefix of an index by its average size: wherever conversations are
-- small on average, the planner read the whole conversation and filtered it. Measured
-- on a 3,000-pair conversation among 300 of 5 pairs (tests/sql/test_query_plans.py):
-- 18,000 index entries of the runs and pairs an append, 2,400 an edit of a pair.
--
-- * rederive's and track_source_changes' no-change test, rederive_runs' stale pairs and
--   rederive_general's touched ranges (found once now, where it asked twice): a lateral
--   subquery per run, kept apart by OFFSET 0, plans on the run's own index entries
--   whatever the statistics;
-- * range_hash, for each range a write completes: its 20 messages, each looked up the
--   same way (a hash join had read every message of a large conversation);
-- * source_enqueue's question whether this transaction holds every conversation's queue
--   entry already: each NOT EXISTS kept a subplan per row by OFFSET 0 (as an anti-join
--   on a queue without statistics, it read every entry at each statement).
-- * rebuild_derived_state derives under generic plans, as the tracking trigger does: a
--   custom plan for each conversation cost more to make than to run.
--
-- The functions and the procedure are replaced whole; only those lookups (and the
-- rebuild's plan_cache_mode) change.

CREATE OR REPLACE FUNCTION compaction.range_hash(p_conversation_id text, p_message_ids text[])
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
        -- messages (revision 0035).
        CROSS JOIN LATERAL (
            SELECT sm.content FROM compaction.source_messages AS sm
            WHERE sm.conversation_id = p_conversation_id AND sm.message_id = ids.id
            OFFSET 0) AS m);
END
$$;

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
                              SELECT 1 FROM compaction.pairs AS p
                              WHERE p.conversation_id = p_conversation_id
                                AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                                AND p.run_id = k.run_id
                              OFFSET 0) AS q) THEN
        -- No touched Run can form a pair, and none had one: nothing derived changes.
        -- One statement instead of judging the Runs' messages.
        RETURN;
    END IF;
    PERFORM compaction.rederive_runs(p_conversation_id, v_runs, v_count);
END
$$;

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
                      SELECT p FROM compaction.pairs AS p
                      WHERE p.conversation_id = p_conversation_id
                        AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                        AND p.run_id = k.run_id
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
    UPDATE compaction.pairs AS p
    SET user_bytes = f.user_bytes,
        assistant_message_id = f.assistant_message_id,
        assistant_bytes = f.assistant_bytes
    FROM pg_catalog.unnest(v_fresh) AS f
    WHERE p.conversation_id = p_conversation_id
      AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(f.run_id)
      AND p.run_id = f.run_id
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
            SELECT p.pair_index FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id
              AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
              AND p.run_id = k.run_id
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
    IF NOT v_runs_known AND TG_NARGS = 3 AND TG_OP = 'INSERT'
       AND v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        v_message_ids := ARRAY(SELECT j.fields ->> TG_ARGV[2]
                               FROM new_rows AS n
                               CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(n) AS fields) AS j);
        SELECT sm.seq, sm.message_id INTO v_first_seq, v_first_id
        FROM compaction.source_messages AS sm
        WHERE sm.message_id = ANY (v_message_ids) AND sm.conversation_id = v_conversation
        ORDER BY sm.seq NULLS FIRST, sm.message_id
        LIMIT 1;
        IF v_first_seq IS NOT NULL THEN
            v_runs := ARRAY(
                SELECT sm.run_id
                FROM compaction.source_messages AS sm
                WHERE sm.message_id = ANY (v_message_ids) AND sm.conversation_id = v_conversation
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
                                       SELECT 1 FROM compaction.pairs AS p
                                       WHERE p.conversation_id = v_conversation
                                         AND pg_catalog.hashtext(p.run_id)
                                             = pg_catalog.hashtext(k.run_id)
                                         AND p.run_id = k.run_id
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

CREATE OR REPLACE FUNCTION compaction.source_enqueue()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Nothing to do when this transaction already holds the queue entry of every
    -- conversation the statement wrote (an earlier statement inserted, requeued or locked
    -- it, outside any subtransaction: its lock lasts until commit, so nobody else changes
    -- it) and the upsert below would not update it: it would find that row and change
    -- nothing. An agent's later statements per Run end here. Each conversation's entry is
    -- looked up on its own key (OFFSET 0 keeps each NOT EXISTS a subplan per row): as an
    -- anti-join, planned on a queue without statistics, it read every entry through the
    -- index on (scope, enqueued_at) at each statement (revision 0035).
    IF TG_OP = 'INSERT' THEN
        IF NOT EXISTS (SELECT 1 FROM new_rows AS n
                       WHERE n.conversation_id IS NOT NULL
                         AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                         WHERE q.conversation_id = n.conversation_id
                                           AND q.scope = 'default'
                                           AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                           AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                         OFFSET 0)) THEN
            RETURN NULL;
        END IF;
    ELSIF TG_OP = 'DELETE' THEN
        IF NOT EXISTS (SELECT 1 FROM old_rows AS o
                       WHERE o.conversation_id IS NOT NULL
                         AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                         WHERE q.conversation_id = o.conversation_id
                                           AND q.scope = 'default'
                                           AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                           AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                         OFFSET 0)) THEN
            RETURN NULL;
        END IF;
    ELSIF NOT EXISTS (SELECT 1
                      FROM (SELECT n.conversation_id FROM new_rows AS n
                            UNION ALL
                            SELECT o.conversation_id FROM old_rows AS o) AS c
                      WHERE c.conversation_id IS NOT NULL
                        AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                        WHERE q.conversation_id = c.conversation_id
                                          AND q.scope = 'default'
                                          AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                          AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                        OFFSET 0)) THEN
        RETURN NULL;
    END IF;

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
            v_next := least(
                (SELECT sr.conversation_id FROM compaction.source_runs AS sr
                 WHERE sr.conversation_id > v_after
                 ORDER BY sr.conversation_id LIMIT 1),
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

CALL compaction.assign_ownership();
