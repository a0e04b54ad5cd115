-- pycompactor stored logic, section 2b: keeping the derived state (sql/15_derived_state.sql).
--
-- compaction.track_source_changes() is an AFTER ... FOR EACH STATEMENT trigger with
-- transition tables. The reference tables carry it below; a host that re-points the source
-- views attaches it to its own tables (docs/integrating.md), naming in its arguments the
-- column that holds the conversation id and the one that holds the run id, as the views
-- expose them (cast to text). Per statement it re-derives each touched conversation once,
-- from the earliest changed position on (compaction.rederive): appending a Run costs the
-- work of that Run, an edit in the middle re-numbers and re-hashes from that point on,
-- and a 10,000-row INSERT re-derives once, not 10,000 times.
--
-- Writers of one conversation's derived state serialise on its compaction.conversation_state
-- row, updated first (once per transaction: later statements of the transaction hold it
-- already): at READ COMMITTED the second writer waits and then sees the first's commit; at
-- REPEATABLE READ or SERIALIZABLE it fails with a serialization error rather than number
-- pairs from a snapshot that misses the other writer's rows.

-- Revision 0030: whether a tracked write may leave a conversation to a rebuild. Called
-- by compaction.rederive with the conversation's conversation_state row held, when the
-- conversation lies after the resume point of a rebuild under way, or when no rebuild is
-- under way and the calling trigger is not one the derived state was stamped under (the
-- tracking was just attached, or a TRUNCATE took the derived state out of use): the
-- window before an install's rebuild starts. True when the derived state is not in use
-- (so no call reads the conversation's rows meanwhile), the writer runs at READ
-- COMMITTED (a snapshot older than the resume point would make the lock below fail), and
-- the rebuild has not reached the conversation, judged under the lock. The lock (FOR KEY
-- SHARE on source_tracking, held to the writer's end) is what a rebuild waits for before
-- it moves its resume point past a batch, and before it stamps: a conversation this
-- writer creates is invisible to the rebuild's ordered reads until it commits, and the
-- rebuild looks for such conversations once the lock is its own. A conversation a
-- rebuild's open batch holds is not left to it: the writer waited for that batch to
-- commit on the row, and reads the resume point after it.
CREATE FUNCTION compaction.defer_to_rebuild(p_conversation_id text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
-- No SECURITY DEFINER and no SET clause: only the engine's owner may execute it, from
-- compaction.rederive and the tracking trigger.
AS $$
DECLARE
    v_after text;
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN false;
    END IF;
    SELECT st.rebuild_after INTO v_after
    FROM compaction.source_tracking AS st
    WHERE st.singleton
    FOR KEY SHARE;
    -- After the lock: a rebuild that finished while this writer waited for it has put the
    -- derived state in use (and cleared the resume point).
    IF compaction.derived_state_current() THEN
        RETURN false;
    END IF;
    RETURN v_after IS NULL OR p_conversation_id > v_after;
END
$$;
COMMENT ON FUNCTION compaction.defer_to_rebuild(text) IS
    'Internal: with the conversation''s conversation_state row held, true when a rebuild will derive this conversation after the calling transaction ends (the derived state is not in use, and no rebuild has reached the conversation), so the tracking may leave it alone; holds source_tracking FOR KEY SHARE to the end of the transaction';

-- Revision 0048: the conversation's record of foreign messages (contract §3,
-- compaction.foreign_messages) for the runs named (NULL: every run id its messages
-- name), from the conversation's own rows: a run id is recorded while one of the
-- conversation's user or assistant messages names it and the conversation has no run of
-- that id. Called by compaction.rederive and the tracking trigger with the
-- conversation's conversation_state row held, so the conversation's writers take their
-- turns (a message and its Run written at once by two transactions: the second sees the
-- first's rows). Only this conversation's rows are read and written (docs/contract.md
-- §11). No SET clause, as rederive.
CREATE FUNCTION compaction.refresh_foreign_messages(p_conversation_id text, p_run_ids text[])
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

-- Re-derives one conversation's pairs and ranges after a write touched the runs named
-- (NULL: every run of the conversation). Most writes take a short path of a few lookups
-- by key: the touched runs form no pair before or after the write (a Run inserted as
-- running, a message of a Run not settled yet: three of the four statements an agent
-- writes per Run; since revision 0047 also a Run written settled before its messages, as
-- the worked example's application writes a turn), or their pairs are new and come after
-- the last pair (the Run settled at the end of the conversation; compaction.rederive_runs).
-- Anything else (a pair changed, vanished or moved, a Run inserted before others) goes to
-- compaction.rederive_general.
--
-- Revision 0030: the tracking triggers pass their table (p_table): while the derived
-- state is not in use and a rebuild is under way or about to start, a conversation no
-- rebuild has reached is left to it (compaction.defer_to_rebuild), after this row is
-- taken. The rebuild derives it later from a snapshot that holds this write, so the write
-- costs the row's update alone, and the rebuild's pairs go to the right end of pairs'
-- indexes, where a page splits at the fill factor, not in two halves (a rebuild under an
-- application writing a turn every 20 ms left them 51% full; one left alone, 90%).
CREATE FUNCTION compaction.rederive(p_conversation_id text, p_run_ids text[],
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
                            -- run, contract §3, so no other conversation is
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

-- The rest of compaction.rederive, called with the conversation's conversation_state row
-- held (p_pair_count is its pair count): judges the runs named, and appends their pairs
-- when no touched run had one and every new pair comes after the last pair (pair order
-- is (seq, message_id), NULL seq last, as in judged_pairs): the new pairs take the next
-- numbers, only ranges they complete are new, nothing else moves. No SET clause, as
-- rederive.
CREATE FUNCTION compaction.rederive_runs(
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

-- The general path of compaction.rederive (from rederive_runs), called with the
-- conversation_state row already taken: the touched runs' pairs as they are now
-- (p_fresh, pair_index unset) and as they were (p_stale), and the pair count before the
-- write. Finds the earliest (seq, message_id) position where a pair appeared, vanished
-- or moved, renumbers from there, and re-hashes the ranges whose ids changed or whose
-- pairs were touched.
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
    -- Only on a table the source views read (revision 0049, issue 62): a trigger its
    -- owner attached to a scratch table does nothing. While the derived state is in use,
    -- the source's tables are those whose tracking triggers it was stamped with (two
    -- lookups by key); otherwise, and for a TRUNCATE, the views are walked.
    IF NOT coalesce((SELECT tg.oid = ANY (st.object_oids)
                     FROM pg_catalog.pg_trigger AS tg, compaction.source_tracking AS st
                     WHERE st.singleton AND tg.tgrelid = TG_RELID AND tg.tgname = TG_NAME
                       AND st.object_oids IS NOT NULL), false)
       AND NOT compaction.source_reads(TG_RELID) THEN
        RETURN NULL;
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
    -- their own rows (contract §3: a message belongs to its own conversation's
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
--
-- Revision 0019: online on a busy table. CREATE TRIGGER waits for every transaction
-- writing the table, and every write queues behind it while it waits: the table's lock
-- is taken first, waiting at most 50 ms a try (the host's writes wait no longer), and
-- tried again after a pause until it is had. Dropping a trigger takes the lock that
-- blocks reads too, so only triggers that exist are dropped (none on a first attach).
CREATE FUNCTION compaction.attach_source_tracking(
    p_table regclass, p_conversation_column text, p_run_column text,
    p_message_column text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '50ms'
AS $$
DECLARE
    v_column      text;
    v_event       text;
    v_mode        text;
    v_try         int := 0;
    v_distributed boolean;
BEGIN
    IF p_table IS NULL OR p_conversation_column IS NULL OR p_run_column IS NULL THEN
        RAISE EXCEPTION 'attach_source_tracking needs a table, its conversation id column and its run id column ('''' when it has none)'
            USING ERRCODE = 'CP020';
    END IF;
    IF p_message_column IS NOT NULL AND p_run_column <> '' THEN
        RAISE EXCEPTION 'attach_source_tracking: a message id column is for a table without a run column (its runs come from the views)'
            USING ERRCODE = 'CP020';
    END IF;
    -- Revision 0042: never on Citus. The triggers read transition tables and ask about
    -- other conversations' rows, which a trigger on a shard may not: once attached there,
    -- every write to the table failed on its shards ("could not create distributed
    -- plan"), the application's included. There the engine judges from the views on each
    -- call instead (contract §11). Citus's catalog exists only where Citus is installed, so
    -- it is asked for by name first (and read with EXECUTE: this function runs with its
    -- caller's rights, who may not execute compaction.engine_distributed).
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition AS p
                                WHERE p.logicalrelid IN ($1, ''compaction.jobs''::regclass))'
            INTO v_distributed
            USING p_table;
        IF v_distributed THEN
            RAISE EXCEPTION 'attach_source_tracking: % is on Citus, where the tracking triggers cannot run (every write to the table would fail on its shards)', p_table
                USING ERRCODE = 'CP020',
                      HINT = 'Do not attach them on Citus: the engine judges from the views there (docs/operations.md, "Scaling out with Citus").';
        END IF;
    END IF;
    FOREACH v_column IN ARRAY ARRAY[p_conversation_column, nullif(p_run_column, ''),
                                    p_message_column] LOOP
        IF v_column IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM pg_catalog.pg_attribute AS a
               WHERE a.attrelid = p_table AND a.attname = v_column
                 AND a.attnum > 0 AND NOT a.attisdropped) THEN
            RAISE EXCEPTION 'table % has no column %', p_table, v_column
                USING ERRCODE = 'CP020';
        END IF;
    END LOOP;
    v_mode := CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS tg
                                WHERE tg.tgrelid = p_table
                                  AND tg.tgname LIKE 'compaction\_track\_%')
                   THEN 'ACCESS EXCLUSIVE' ELSE 'SHARE ROW EXCLUSIVE' END;
    LOOP
        BEGIN
            EXECUTE pg_catalog.format('LOCK TABLE %s IN %s MODE', p_table, v_mode);
            EXIT;
        EXCEPTION WHEN lock_not_available THEN
            v_try := v_try + 1;
            IF v_try >= 200 THEN
                RAISE EXCEPTION 'attach_source_tracking: table % stayed busy (200 tries of 50 ms)', p_table
                    USING ERRCODE = 'CP031',
                          HINT = 'A long transaction holds the table: let it finish, then attach again.';
            END IF;
            -- a pause the host's queued writes get through in
            PERFORM pg_catalog.pg_sleep(least(0.01 * v_try, 0.5));
        END;
    END LOOP;
    FOREACH v_event IN ARRAY ARRAY['insert', 'update', 'delete', 'truncate'] LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS tg
                   WHERE tg.tgrelid = p_table AND tg.tgname = 'compaction_track_' || v_event) THEN
            EXECUTE pg_catalog.format('DROP TRIGGER %I ON %s',
                                      'compaction_track_' || v_event, p_table);
        END IF;
        EXECUTE pg_catalog.format(
            'CREATE TRIGGER %I AFTER %s ON %s %s FOR EACH STATEMENT'
            ' EXECUTE FUNCTION compaction.track_source_changes(%L, %L%s)',
            'compaction_track_' || v_event, pg_catalog.upper(v_event), p_table,
            CASE v_event
                WHEN 'insert' THEN 'REFERENCING NEW TABLE AS new_rows'
                WHEN 'update' THEN 'REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows'
                WHEN 'delete' THEN 'REFERENCING OLD TABLE AS old_rows'
                ELSE ''
            END,
            p_conversation_column, p_run_column,
            CASE WHEN p_message_column IS NOT NULL
                 THEN ', ' || pg_catalog.quote_literal(p_message_column) ELSE '' END);
        -- ALWAYS: logical replication's apply (session_replication_role = replica) too.
        EXECUTE pg_catalog.format('ALTER TABLE %s ENABLE ALWAYS TRIGGER %I',
                                  p_table, 'compaction_track_' || v_event);
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.attach_source_tracking(regclass, text, text, text) IS
    'Attaches the change-tracking triggers (INSERT, UPDATE, DELETE, TRUNCATE) to a host table behind the source views, naming its conversation id and run id columns (or '''' and, optionally, its message id column, so an append re-derives only its run); waits at most 50 ms at a time for the table; then CALL compaction.rebuild_derived_state(). Refused (CP020) on Citus, where the triggers cannot run on the shards';

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

-- The oracle (contract §2): recomputes one conversation from the views and names every
-- difference from the derived state. Ids, positions, counts and hashes only: an auditor
-- may run it.
CREATE FUNCTION compaction.verify_conversation(p_conversation_id text)
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
    -- contract §3 but the foreign-message one, which reads apply from the record
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
    PERFORM compaction.rederive_summary_verdicts(p_conversation_id, NULL);
END
$$;
COMMENT ON FUNCTION compaction.rederive_conversation(text) IS
    'Repair: re-derives one conversation''s pairs, ranges and summary verdicts from the source views (e.g. after writes with the tracking triggers disabled)';

-- Every conversation, in conversation id order, then the stamp that puts the derived
-- state in use. Writes during the rebuild are tracked; while the derived state is not in
-- use, a write to a conversation the rebuild has not reached (or, before a rebuild starts,
-- a write through a trigger attached since the stamp) is left to it (revision 0030,
-- compaction.defer_to_rebuild). The stamp is set only if the source stamp did not change
-- while the rebuild ran. Call it outside a transaction block:
-- CALL compaction.rebuild_derived_state();
--
-- Revision 0019: it scales and resumes. The next conversation is one index probe (the
-- least id after the last one done, among the source's runs and the derived state's
-- conversations), never a selection over every run; a transaction derives at most
-- p_batch conversations and commits once it has held their rows for 20 ms, so a host
-- write waits at most about that long for a conversation the rebuild holds; each commit
-- moves the resume point in compaction.source_tracking, so a cancelled rebuild (or one
-- that failed) continues after the last conversation it committed, as long as the
-- source stamp is the same. Progress with a rate and an ETA: NOTICEs about once a
-- second, and the view compaction.rebuild_progress. Each conversation is re-derived by
-- compaction.rederive_conversation(id), which addresses that conversation alone (docs/contract.md
-- §11).
--
-- Revision 0030: before a commit moves the resume point past a batch, the rebuild takes
-- source_tracking's row FOR UPDATE, so it waits for the writers that left a conversation
-- of the batch to it; a conversation one of them created was invisible to the ordered
-- reads, so the resume point moves only up to the first such conversation, and the next
-- batch derives it. The last commit stamps the derived state under that lock. A TRUNCATE
-- under way clears the resume point (the trigger above): the rebuild then fails at its
-- next commit.
--
-- Revision 0031: the rebuild never waits for a writer long while it holds a batch. A
-- writer's transaction may hold one conversation (or source_tracking's row, having left a
-- conversation to the rebuild) and then ask for a conversation the batch holds; had the
-- rebuild waited for the writer meanwhile, PostgreSQL would break the deadlock after
-- deadlock_timeout by failing whichever began waiting first, often the writer. So a
-- conversation a writer holds, or whose conversation_state row a writer is creating (its
-- first tracked write since the tracking was attached), ends the batch before it; and
-- the lock on source_tracking is waited for at most 100 ms: past that, the batch is
-- rolled back, the rebuild waits holding nothing, and derives the batch again. Two
-- rebuilds may run at once (each process of a deploy runs `pycompactor migrate`): the
-- shared resume point only moves forward, and one that finds the derived state put in
-- use by the other returns.
CREATE PROCEDURE compaction.rebuild_derived_state(p_batch int DEFAULT 100,
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
        stamped_at = pg_catalog.now(),
        rebuild_stamp = NULL, rebuild_after = NULL, rebuild_done = NULL,
        rebuild_total = NULL, rebuild_started_at = NULL, rebuild_updated_at = NULL;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.stamp_derived_state(text) IS
    'Internal: last step of rebuild_derived_state: puts the derived state in use under the given source stamp, unless the source changed meanwhile';

CREATE VIEW compaction.rebuild_progress AS
    SELECT st.rebuild_done AS done,
           st.rebuild_total AS total,
           st.rebuild_after AS resume_after,
           st.rebuild_started_at AS started_at,
           st.rebuild_updated_at AS updated_at,
           st.rebuild_stamp = compaction.source_stamp() AS resumable,
           CASE WHEN st.rebuild_updated_at > st.rebuild_started_at THEN
               st.rebuild_done / extract(epoch FROM st.rebuild_updated_at - st.rebuild_started_at)
           END AS per_second,
           CASE WHEN st.rebuild_updated_at > st.rebuild_started_at AND st.rebuild_done > 0 THEN
               (st.rebuild_updated_at - st.rebuild_started_at)
               * (greatest(st.rebuild_total - st.rebuild_done, 0)::double precision / st.rebuild_done)
           END AS eta
    FROM compaction.source_tracking AS st
    WHERE st.rebuild_stamp IS NOT NULL;
COMMENT ON VIEW compaction.rebuild_progress IS
    'A rebuild under way or stopped: conversations done of about total, the resume point, whether a CALL compaction.rebuild_derived_state() now continues from it, the rate over its life (per second) and the time left at that rate; no row when none is under way';
