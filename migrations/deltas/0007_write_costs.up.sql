-- Revision 0007_write_costs: what the tracking triggers cost a writer.
--
-- compaction.rederive takes two short paths before the general one: the touched Runs
-- form no pair before or after the write (one statement, no judging of messages), or
-- their new pairs come after the last pair (numbered next, only the ranges they complete
-- hashed). The general path moves to compaction.rederive_general. rederive and
-- track_source_changes keep one cached plan per statement (plan_cache_mode).
-- Replaces: compaction.rederive(text, text[]), compaction.track_source_changes().
-- Adds: compaction.rederive_general(text, text[], compaction.pairs[], compaction.pairs[], int).

-- The general path of compaction.rederive, called with the conversation_state row
-- already taken: the touched runs' pairs as they are now (p_fresh, pair_index unset)
-- and as they were (p_stale), and the pair count before the write. Finds the earliest
-- (seq, message_id) position where a pair appeared, vanished or moved, renumbers from
-- there, and re-hashes the ranges whose ids changed or whose pairs were touched.
CREATE FUNCTION compaction.rederive_general(
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
    v_moved    compaction.pairs[];
    v_from_seq bigint;
    v_from_id  text;
    v_base     int;
    v_count    int := p_pair_count;
    v_ranges   int[];
BEGIN
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
COMMENT ON FUNCTION compaction.rederive_general(text, text[], compaction.pairs[], compaction.pairs[], int) IS
    'Internal: the general path of rederive (a pair changed, vanished or moved): renumbers from the earliest changed position and re-hashes the ranges affected';

-- Re-derives one conversation's pairs and ranges after a write touched the runs named
-- (NULL: every run of the conversation). Most writes take one of two short paths, each a
-- few lookups by key: the touched runs form no pair before or after the write (a Run
-- inserted as running, a message of a Run not settled yet: three of the four statements
-- an agent writes per Run), or their pairs are new and come after the last pair (the
-- Run settled at the end of the conversation). Anything else (a pair changed, vanished
-- or moved, a Run inserted before others) goes to compaction.rederive_general.
CREATE OR REPLACE FUNCTION compaction.rederive(p_conversation_id text, p_run_ids text[])
RETURNS void
LANGUAGE plpgsql
VOLATILE
-- No SECURITY DEFINER and no SET clause: only the engine's owner may execute it, and it
-- runs under the settings of its callers, the tracking trigger and rederive_conversation
-- (owner's rights, search_path pg_catalog, pg_temp, JIT off; the trigger also forces
-- generic plans, which suit every statement here: each looks rows up by key). Applying
-- SET clauses on each of the four calls per appended Run cost more than this function's
-- statements. Every name is schema-qualified all the same.
AS $$
DECLARE
    v_runs  text[] := p_run_ids;
    v_fresh compaction.pairs[];
    v_stale compaction.pairs[];
    v_count int;
    v_last  compaction.pairs;
    v_new   int;
BEGIN
    -- First: this row serialises the conversation's derived-state writers (see above).
    -- A transaction bumps generation once, also when nothing derived changes: a writer at
    -- REPEATABLE READ whose snapshot misses this transaction's source rows (a message of
    -- a Run it is settling) must fail on this row rather than judge without them. When
    -- the row's current version is this transaction's own (an earlier statement bumped
    -- it, outside any subtransaction), its lock is held until commit and the bump is
    -- done: reading it suffices, and the row does not grow a version per statement.
    SELECT cs.pair_count INTO v_count
    FROM compaction.conversation_state AS cs
    WHERE cs.conversation_id = p_conversation_id
      AND cs.xmin = pg_catalog.pg_current_xact_id()::xid;
    IF NOT FOUND THEN
        UPDATE compaction.conversation_state AS cs
        SET generation = cs.generation + 1
        WHERE cs.conversation_id = p_conversation_id
        RETURNING cs.pair_count INTO v_count;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (p_conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1
        RETURNING cs.pair_count INTO v_count;
    END IF;

    IF v_runs IS NULL THEN
        v_runs := ARRAY(SELECT sr.run_id FROM compaction.source_runs AS sr
                        WHERE sr.conversation_id = p_conversation_id
                        UNION
                        SELECT p.run_id FROM compaction.pairs AS p
                        WHERE p.conversation_id = p_conversation_id);
    ELSIF NOT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                      WHERE sr.run_id = ANY (v_runs)
                        AND sr.conversation_id = p_conversation_id
                        -- judge_runs' first rule: only a Run in one of these can pair
                        -- (track_source_changes asks the same, word for word)
                        AND sr.status IN ('completed', 'partial', 'clarify_pending'))
          AND NOT EXISTS (SELECT 1 FROM compaction.pairs AS p
                          WHERE p.conversation_id = p_conversation_id
                            AND p.run_id = ANY (v_runs)) THEN
        -- No touched Run can form a pair, and none had one: nothing derived changes.
        -- One statement instead of judging the Runs' messages.
        RETURN;
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

    -- Appending: no touched run had a pair, and every new pair comes after the last pair
    -- (pair order is (seq, message_id), NULL seq last, as in judged_pairs). The new pairs
    -- take the next numbers; only ranges they complete are new, and nothing else moves.
    IF pg_catalog.cardinality(v_stale) = 0 THEN
        SELECT p.* INTO v_last
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id AND p.pair_index = v_count - 1;
        IF v_count = 0 OR (v_last.run_id IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM pg_catalog.unnest(v_fresh) AS f
               WHERE NOT CASE WHEN v_last.user_seq IS NULL THEN
                                  f.user_seq IS NULL
                                  AND f.user_message_id > v_last.user_message_id
                              ELSE f.user_seq IS NULL OR f.user_seq > v_last.user_seq
                                   OR (f.user_seq = v_last.user_seq
                                       AND f.user_message_id > v_last.user_message_id)
                         END)) THEN
            INSERT INTO compaction.pairs
                (conversation_id, run_id, pair_index, user_seq, user_message_id, user_bytes,
                 assistant_message_id, assistant_bytes)
            SELECT p_conversation_id, f.run_id,
                   v_count + (pg_catalog.row_number() OVER (ORDER BY f.user_seq, f.user_message_id))::int - 1,
                   f.user_seq, f.user_message_id, f.user_bytes, f.assistant_message_id,
                   f.assistant_bytes
            FROM pg_catalog.unnest(v_fresh) AS f;
            v_new := v_count + pg_catalog.cardinality(v_fresh);
            IF v_new / 10 > v_count / 10 THEN
                -- The ranges the new pairs complete, each hashed from its 20 messages.
                INSERT INTO compaction.ranges AS r
                    (conversation_id, from_pair, source_message_ids, source_hash)
                SELECT p_conversation_id, w.from_pair, w.ids, compaction.range_hash(w.ids)
                FROM (SELECT g.from_pair,
                             ARRAY(SELECT u.id
                                   FROM compaction.pairs AS p
                                   CROSS JOIN LATERAL pg_catalog.unnest(
                                       ARRAY[p.user_message_id, p.assistant_message_id])
                                       WITH ORDINALITY AS u (id, ord)
                                   WHERE p.conversation_id = p_conversation_id
                                     AND p.pair_index BETWEEN g.from_pair AND g.from_pair + 9
                                   ORDER BY p.pair_index, u.ord) AS ids
                      FROM pg_catalog.generate_series(v_count / 10 * 10, v_new - 10, 10)
                          AS g (from_pair)) AS w
                ON CONFLICT (conversation_id, from_pair) DO UPDATE
                    SET source_message_ids = EXCLUDED.source_message_ids,
                        source_hash = EXCLUDED.source_hash;
            END IF;
            UPDATE compaction.conversation_state AS cs
            SET pair_count = v_new
            WHERE cs.conversation_id = p_conversation_id;
            RETURN;
        END IF;
    END IF;

    PERFORM compaction.rederive_general(p_conversation_id, v_runs, v_fresh, v_stale, v_count);
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
-- One cached plan per statement: the transition tables and the runs' key lookups plan
-- the same for every write, and a custom plan per statement cost more than running it.
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_conversation_column text := TG_ARGV[0];
    v_run_column          text := nullif(TG_ARGV[1], '');
    v_conversations       text[] := '{}';
    v_runs                text[] := '{}';
    v_conversation        text;
    v_run_ids             text[];
    v_elsewhere           boolean;
    v_unchanged           boolean;
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

    -- The common statement (an agent's single-row writes): its rows name one conversation
    -- and every run they name belongs to it now. A lookup of those runs decides that,
    -- where the general grouping below costs several times as much to start.
    v_conversation := v_conversations[1];
    IF v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        IF v_run_column IS NULL THEN
            PERFORM compaction.rederive(v_conversation, NULL);
            RETURN NULL;
        END IF;
        v_run_ids := pg_catalog.array_remove(v_runs, NULL);
        IF pg_catalog.cardinality(v_run_ids) = 0 THEN
            RETURN NULL;  -- rows of no run: no pair can change
        ELSIF pg_catalog.cardinality(v_run_ids) > 2 THEN
            v_run_ids := ARRAY(SELECT DISTINCT r.run_id
                               FROM pg_catalog.unnest(v_run_ids) AS r (run_id));
        END IF;
        -- A later statement of a transaction that already holds this conversation's
        -- conversation_state row (see rederive) also asks rederive's no-change question
        -- here, in the same statement: its snapshot is taken after the lock was, so it
        -- sees what rederive would see. An agent's second and third statements per Run
        -- end here.
        SELECT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                       WHERE sr.run_id = ANY (v_run_ids)
                         AND sr.conversation_id <> v_conversation),
               -- rederive's no-change test, word for word
               NOT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                           WHERE sr.run_id = ANY (v_run_ids)
                             AND sr.conversation_id = v_conversation
                             AND sr.status IN ('completed', 'partial', 'clarify_pending'))
               AND NOT EXISTS (SELECT 1 FROM compaction.pairs AS p
                               WHERE p.conversation_id = v_conversation
                                 AND p.run_id = ANY (v_run_ids))
        INTO v_elsewhere, v_unchanged
        FROM compaction.conversation_state AS cs
        WHERE cs.conversation_id = v_conversation
          AND cs.xmin = pg_catalog.pg_current_xact_id()::xid;
        IF NOT FOUND THEN
            v_elsewhere := EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                                   WHERE sr.run_id = ANY (v_run_ids)
                                     AND sr.conversation_id <> v_conversation);
            v_unchanged := false;
        END IF;
        IF NOT v_elsewhere THEN
            IF NOT v_unchanged THEN
                PERFORM compaction.rederive(v_conversation, v_run_ids);
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

CALL compaction.assign_ownership();
