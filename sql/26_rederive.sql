-- pycompactor stored logic, section 2b continued: re-deriving one conversation after a
-- tracked write (the triggers are in 25_tracking.sql). Owns defer_to_rebuild,
-- refresh_foreign_messages and compaction.rederive with its two paths, rederive_runs and
-- rederive_general.

-- Whether a tracked write may leave a conversation to a rebuild. Called
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

-- The conversation's record of foreign messages (contract §3,
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
DECLARE
    v_foreign text[];
    v_gone    text[];
    v_run     text;
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
    -- The runs named judged in one statement, then a write only where the record changes
    -- (the common answer: nowhere), each by key. Each run is looked up on its own, by key
    -- (a lateral subquery per run, kept apart by OFFSET 0, as in rederive); its messages
    -- only when the conversation has no such run (the common answer: it has). As EXISTS
    -- tests, the generic plan may hash a subquery instead, reading every run of the
    -- conversation once per write. Not one INSERT ... SELECT with the deletion as a CTE:
    -- Citus cannot place such rows by the statement's text, collects them and sends an
    -- INSERT to every shard of the record, on every tracked write.
    SELECT pg_catalog.array_agg(j.run_id) FILTER (WHERE j.is_foreign AND NOT j.recorded),
           pg_catalog.array_agg(j.run_id) FILTER (WHERE j.recorded AND NOT j.is_foreign)
    INTO v_foreign, v_gone
    FROM (SELECT k.run_id, r.held IS NULL AND coalesce(m.found, false) AS is_foreign,
                 coalesce(f.recorded, false) AS recorded
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
          LEFT JOIN LATERAL (
              SELECT true AS recorded FROM compaction.foreign_messages AS fm
              WHERE fm.conversation_id = p_conversation_id AND fm.run_id = k.run_id
              OFFSET 0) AS f ON true) AS j;
    IF v_gone IS NOT NULL THEN
        DELETE FROM compaction.foreign_messages AS f
        WHERE f.conversation_id = p_conversation_id AND f.run_id = ANY (v_gone);
    END IF;
    FOREACH v_run IN ARRAY coalesce(v_foreign, '{}') LOOP
        INSERT INTO compaction.foreign_messages (conversation_id, run_id)
        VALUES (p_conversation_id, v_run)
        ON CONFLICT (conversation_id, run_id) DO NOTHING;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.refresh_foreign_messages(text, text[]) IS
    'Internal: with the conversation''s conversation_state row held, records which of the run ids named (NULL: all) the conversation''s foreign user/assistant messages name (contract §3), from its own rows';

-- Re-derives one conversation's pairs and ranges after a write touched the runs named
-- (NULL: every run of the conversation). Most writes take a short path of a few lookups
-- by key: the touched runs form no pair before or after the write (a Run inserted as
-- running, a message of a Run not settled yet: three of the four statements an agent
-- writes per Run; also a Run written settled before its messages, as
-- the worked example's application writes a turn), or their pairs are new and come after
-- the last pair (the Run settled at the end of the conversation; compaction.rederive_runs).
-- Anything else (a pair changed, vanished or moved, a Run inserted before others) goes to
-- compaction.rederive_general.
--
-- The tracking triggers pass their table (p_table): while the derived
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
    v_runs         text[] := p_run_ids;
    v_count        int;
    v_unchanged    boolean;
    v_record_kept  boolean;
    -- Citus installed: lookups of pairs name the conversation as an equality, which Citus
    -- prunes to the conversation's shard (as the filter below, every shard is read, which
    -- a trigger on a shard may not do: contract §11).
    v_citus boolean := pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL;
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
    -- (Two IFs: a statement is planned whole, and on a Citus shard, where p_table is
    -- NULL, planning the read of source_tracking would cost a statement for nothing.)
    IF p_table IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM compaction.source_tracking AS st
                   WHERE st.singleton
                     AND (st.rebuild_after < p_conversation_id
                          OR (st.rebuild_after IS NULL
                              AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t
                                              WHERE t.tgrelid = p_table
                                                AND t.oid = ANY (st.object_oids)))))
           AND compaction.defer_to_rebuild(p_conversation_id) THEN
            RETURN;
        END IF;
    END IF;
    -- The conversation's foreign messages first; the pairs below are
    -- judged by its own rows alone.
    IF v_runs IS NULL THEN
        PERFORM compaction.refresh_foreign_messages(p_conversation_id, NULL);
        v_runs := ARRAY(SELECT sr.run_id FROM compaction.source_runs AS sr
                        WHERE sr.conversation_id = p_conversation_id
                        UNION
                        SELECT p.run_id FROM compaction.pairs AS p
                        WHERE p.conversation_id = p_conversation_id);
        PERFORM compaction.rederive_runs(p_conversation_id, v_runs, v_count);
        RETURN;
    END IF;
    -- Two questions in one statement (each a statement Citus plans, on a shard). Whether
    -- a touched Run can form a pair or had one: if not, nothing derived changes, without
    -- judging the Runs' messages. Whether the record of foreign messages may change: not
    -- while the conversation holds every run named and records none of them (the common
    -- answer), so refresh_foreign_messages' own statement is spared.
    -- Each run named is looked up on its own (a lateral subquery per run, kept apart by
    -- OFFSET 0), never as "run_id = ANY (the runs) of this conversation": the trigger's
    -- generic plan prices an array as ten probes, so wherever conversations are small on
    -- average it found them on the conversation's prefix of a key, and every tracked
    -- write to a large conversation read all its runs and pairs.
    SELECT NOT EXISTS (SELECT 1
                       FROM pg_catalog.unnest(v_runs) AS k (run_id)
                       CROSS JOIN LATERAL (
                           SELECT 1 FROM compaction.source_runs AS sr
                           WHERE sr.run_id = k.run_id
                             AND sr.conversation_id = p_conversation_id
                             -- judge_runs' first rule: only a Run in one of these can pair
                             -- (track_source_changes asks the same, word for word)
                             AND sr.status IN ('completed', 'partial', 'clarify_pending')
                             -- and only one with a user message of its own (a
                             -- message belongs to its own conversation's run,
                             -- contract §3, so no other conversation is read). A Run written in its final state before its
                             -- messages ends here, unjudged.
                             AND EXISTS (SELECT 1 FROM compaction.source_messages AS sm
                                         WHERE sm.run_id = k.run_id
                                           AND sm.conversation_id = p_conversation_id
                                           AND sm.role = 'user')
                           OFFSET 0) AS r)
           AND NOT EXISTS (SELECT 1
                           FROM pg_catalog.unnest(v_runs) AS k (run_id)
                           CROSS JOIN LATERAL (
                               -- The conversation as a filter, not an index condition:
                               -- the only index for this lookup is then
                               -- pairs_run_hash_idx. As a condition, where pairs has no
                               -- statistics yet, the planner read the conversation's
                               -- primary key entries as well (a BitmapAnd), all of them for
                               -- every tracked write.
                               SELECT 1 FROM compaction.pairs AS p
                               WHERE NOT v_citus
                                 AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                                 AND p.run_id = k.run_id
                                 AND (p.conversation_id = p_conversation_id) IS TRUE
                               OFFSET 0) AS q)
           AND NOT EXISTS (SELECT 1
                           FROM pg_catalog.unnest(v_runs) AS k (run_id)
                           CROSS JOIN LATERAL (
                               SELECT 1 FROM compaction.pairs AS p
                               WHERE v_citus
                                 AND p.conversation_id = p_conversation_id
                                 AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                                 AND p.run_id = k.run_id
                               OFFSET 0) AS q),
           -- (track_source_changes asks the same, word for word)
           NOT EXISTS (SELECT 1
                       FROM pg_catalog.unnest(v_runs) AS k (run_id)
                       LEFT JOIN LATERAL (
                           SELECT true AS held FROM compaction.source_runs AS sr
                           WHERE sr.run_id = k.run_id
                             AND sr.conversation_id = p_conversation_id
                           OFFSET 0) AS r ON true
                       LEFT JOIN LATERAL (
                           SELECT true AS recorded
                           FROM compaction.foreign_messages AS fm
                           WHERE fm.conversation_id = p_conversation_id
                             AND fm.run_id = k.run_id
                           OFFSET 0) AS f ON true
                       WHERE r.held IS NULL OR f.recorded)
    INTO v_unchanged, v_record_kept;
    IF NOT v_record_kept THEN
        PERFORM compaction.refresh_foreign_messages(p_conversation_id, v_runs);
    END IF;
    IF v_unchanged THEN
        -- No touched Run can form a pair, and none had one: nothing derived changes.
        RETURN;
    END IF;
    PERFORM compaction.rederive_runs(p_conversation_id, v_runs, v_count);
END
$$;
COMMENT ON FUNCTION compaction.rederive(text, text[], oid) IS
    'Internal: re-derives one conversation''s pairs and ranges after a write touched the runs named (NULL: all), from the earliest changed position on; from a tracking trigger (p_table, its table), not when a rebuild will derive the conversation after this transaction (compaction.defer_to_rebuild)';

-- The range writes of rederive_runs and rederive_general in
-- the form Citus runs, from a tracking trigger on a shard and from a repair on the
-- coordinator alike: the conversation's pairs and stored ranges read in a statement of
-- their own each, every range hashed by compaction.range_hash in a statement that reads
-- no distributed table (inside one that does, Citus would run it on the shard as a
-- nested distributed query, which it refuses), and written one row at a time. Writes
-- the ranges p_from_pairs names (each complete range of p_pair_count pairs) whose ids
-- changed, and those p_touched names whatever their ids. No SET clause, as rederive.
CREATE FUNCTION compaction.write_ranges_citus(p_conversation_id text, p_from_pairs int[],
                                              p_touched int[], p_pair_count int)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_lo    int;
    v_hi    int;
    v_pairs jsonb;
    v_old   jsonb;
    v_from  int;
    v_ids   text[];
    v_hash  text;
BEGIN
    SELECT min(f.from_pair), max(f.from_pair) INTO v_lo, v_hi
    FROM pg_catalog.unnest(p_from_pairs) AS f (from_pair)
    WHERE f.from_pair + 10 <= p_pair_count;
    IF v_lo IS NULL THEN
        RETURN;
    END IF;
    SELECT pg_catalog.jsonb_object_agg(p.pair_index::text,
                                       pg_catalog.jsonb_build_array(p.user_message_id,
                                                                    p.assistant_message_id))
    INTO v_pairs
    FROM compaction.pairs AS p
    WHERE p.conversation_id = p_conversation_id
      AND p.pair_index BETWEEN v_lo AND v_hi + 9;
    SELECT pg_catalog.jsonb_object_agg(r.from_pair::text, pg_catalog.to_jsonb(r.source_message_ids))
    INTO v_old
    FROM compaction.ranges AS r
    WHERE r.conversation_id = p_conversation_id
      AND r.from_pair BETWEEN v_lo AND v_hi;
    FOR v_from IN
        SELECT DISTINCT f.from_pair
        FROM pg_catalog.unnest(p_from_pairs) AS f (from_pair)
        WHERE f.from_pair + 10 <= p_pair_count
        ORDER BY 1
    LOOP
        v_ids := ARRAY(SELECT x.id
                       FROM pg_catalog.generate_series(v_from, v_from + 9) AS g (i)
                       CROSS JOIN LATERAL pg_catalog.jsonb_array_elements_text(
                           v_pairs -> g.i::text) WITH ORDINALITY AS x (id, ord)
                       ORDER BY g.i, x.ord);
        CONTINUE WHEN NOT (v_from = ANY (coalesce(p_touched, '{}')))
                  AND pg_catalog.to_jsonb(v_ids) = v_old -> v_from::text;
        v_hash := compaction.range_hash(p_conversation_id, v_ids);
        INSERT INTO compaction.ranges AS r
            (conversation_id, from_pair, source_message_ids, source_hash)
        VALUES (p_conversation_id, v_from, v_ids, v_hash)
        ON CONFLICT (conversation_id, from_pair) DO UPDATE
            SET source_message_ids = EXCLUDED.source_message_ids,
                source_hash = EXCLUDED.source_hash;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.write_ranges_citus(text, int[], int[], int) IS
    'Internal (Citus): writes the complete ranges named whose ids changed, and those touched, each hashed in a statement of its own';

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
    v_i     int;
    v_pair  record;
    -- Citus: the conversation as an equality (see rederive)
    v_citus boolean := pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL;
BEGIN
    IF v_citus THEN
        -- Citus (contract §11): the same, in statements it keeps on the conversation's
        -- shard (it pushes down no lateral subquery over an array, and no function that
        -- reads distributed tables inside a statement that reads them too).
        SELECT coalesce(array_agg(ROW(p_conversation_id, j.run_id, 0, j.user_seq,
                                      j.user_message_id, j.user_bytes,
                                      j.assistant_message_id,
                                      j.assistant_bytes)::compaction.pairs), '{}')
        INTO v_fresh
        FROM compaction.judge_runs(p_conversation_id, p_run_ids, false) AS j
        WHERE j.reason IS NULL;
        -- The rows the runs had and the last pair, in one statement (each row built by
        -- name: Citus returns a whole-row value as a bare record).
        SELECT (SELECT coalesce(array_agg(ROW(p.conversation_id, p.run_id, p.pair_index,
                                              p.user_seq, p.user_message_id, p.user_bytes,
                                              p.assistant_message_id,
                                              p.assistant_bytes)::compaction.pairs), '{}')
                FROM compaction.pairs AS p
                WHERE p_pair_count > 0
                  AND p.conversation_id = p_conversation_id
                  AND pg_catalog.hashtext(p.run_id)
                      = ANY (ARRAY(SELECT pg_catalog.hashtext(k.run_id)
                                   FROM pg_catalog.unnest(p_run_ids) AS k (run_id)))
                  AND p.run_id = ANY (p_run_ids)),
               l.user_message_id,
               NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_fresh) AS f
                           WHERE NOT CASE WHEN l.user_seq IS NULL THEN
                                              f.user_seq IS NULL
                                              AND f.user_message_id > l.user_message_id
                                          ELSE f.user_seq IS NULL OR f.user_seq > l.user_seq
                                               OR (f.user_seq = l.user_seq
                                                   AND f.user_message_id > l.user_message_id)
                                     END)
        INTO v_stale, v_last, v_after
        FROM (SELECT) AS one
        LEFT JOIN compaction.pairs AS l
          ON l.conversation_id = p_conversation_id AND l.pair_index = p_pair_count - 1;
    ELSE
    -- In one statement: the pairs these runs form now (pair_index is set below), the
    -- rows they had, and whether every new pair comes after the last pair.
    WITH fresh AS (
        SELECT j.run_id, j.user_seq, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes
        -- by the conversation's own rows (see judge_runs)
        FROM compaction.judge_runs(p_conversation_id, p_run_ids, false) AS j
        WHERE j.reason IS NULL
    )
    SELECT (SELECT coalesce(array_agg(ROW(p_conversation_id, f.run_id, 0, f.user_seq,
                                          f.user_message_id, f.user_bytes,
                                          f.assistant_message_id,
                                          f.assistant_bytes)::compaction.pairs), '{}')
            FROM fresh AS f),
           -- None where the conversation has no pair (a rebuild's first pass). A few runs
           -- (a write's): each run's pair looked up on its own, as in rederive, a
           -- run named twice once. Many (the whole conversation re-derived, a
           -- bulk statement): the conversation's pairs joined with them, where as many
           -- probes would cost more. A generic plan keeps both; the one-time tests pick.
           (SELECT coalesce(array_agg(s.p), '{}')
            FROM (SELECT q.p
                  FROM (SELECT DISTINCT k.run_id
                        FROM pg_catalog.unnest(p_run_ids) AS k (run_id)
                        WHERE p_pair_count > 0 AND pg_catalog.cardinality(p_run_ids) <= 16) AS k
                  CROSS JOIN LATERAL (
                      -- the conversation as a filter: see rederive
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
                    -- row, not hashed (30,000 runs: 23.9 s a conversation)
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
    END IF;
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
    IF v_citus THEN
        -- Citus: each new pair inserted by key, in the order the statement below numbers
        -- them, then the count. As one INSERT ... SELECT over the array (in a CTE),
        -- Citus collected the rows and sent an INSERT to every shard of the pairs.
        v_i := p_pair_count;
        FOR v_pair IN
            SELECT f.run_id, f.user_seq, f.user_message_id, f.user_bytes,
                   f.assistant_message_id, f.assistant_bytes
            FROM pg_catalog.unnest(v_fresh) AS f
            ORDER BY f.user_seq, f.user_message_id
        LOOP
            INSERT INTO compaction.pairs
                (conversation_id, run_id, pair_index, user_seq, user_message_id, user_bytes,
                 assistant_message_id, assistant_bytes)
            VALUES (p_conversation_id, v_pair.run_id, v_i, v_pair.user_seq,
                    v_pair.user_message_id, v_pair.user_bytes, v_pair.assistant_message_id,
                    v_pair.assistant_bytes);
            v_i := v_i + 1;
        END LOOP;
        UPDATE compaction.conversation_state AS cs
        SET pair_count = v_new
        WHERE cs.conversation_id = p_conversation_id;
    ELSE
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
    END IF;
    IF v_new / 10 > p_pair_count / 10 AND v_citus THEN
        PERFORM compaction.write_ranges_citus(
            p_conversation_id,
            ARRAY(SELECT pg_catalog.generate_series(p_pair_count / 10 * 10, v_new - 10, 10)),
            ARRAY(SELECT pg_catalog.generate_series(p_pair_count / 10 * 10, v_new - 10, 10)),
            v_new);
        PERFORM compaction.rederive_summary_verdicts(
            p_conversation_id,
            ARRAY(SELECT pg_catalog.generate_series(p_pair_count / 10 * 10, v_new - 10, 10)));
    ELSIF v_new / 10 > p_pair_count / 10 THEN
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
    -- Citus: the conversation as an equality (see rederive)
    v_citus    boolean := pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL;
BEGIN
    -- Sizes and the assistant side change in place; the position (seq, user id) cannot.
    -- A few runs (an edit's): each run's pair found through the run index, the
    -- conversation as a filter (see rederive; as an index condition, where
    -- pairs had no statistics yet, every edit also read the conversation's primary key
    -- entries). Many (a whole conversation re-derived): the conversation's pairs joined
    -- with them through the primary key's prefix, where as many probes would cost more.
    IF pg_catalog.cardinality(v_fresh) <= 16 AND NOT v_citus THEN
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
        -- first one met walking pair_index down from the end (no index of
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
    -- under it.
    IF v_citus THEN
        v_held := ARRAY(
            SELECT DISTINCT q.pair_index / 10 * 10
            FROM pg_catalog.unnest(v_touched) AS k (run_id)
            CROSS JOIN LATERAL (
                SELECT p.pair_index FROM compaction.pairs AS p
                WHERE p.conversation_id = p_conversation_id
                  AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                  AND p.run_id = k.run_id
                OFFSET 0) AS q);
    ELSE
        v_held := ARRAY(
            SELECT DISTINCT q.pair_index / 10 * 10
            FROM pg_catalog.unnest(v_touched) AS k (run_id)
            CROSS JOIN LATERAL (
                -- the conversation as a filter: see rederive
                SELECT p.pair_index FROM compaction.pairs AS p
                WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                  AND p.run_id = k.run_id
                  AND (p.conversation_id = p_conversation_id) IS TRUE
                OFFSET 0) AS q);
    END IF;
    v_ranges := v_ranges || v_held;
    IF v_citus THEN
        PERFORM compaction.write_ranges_citus(p_conversation_id, v_ranges, v_held, v_count);
    ELSE
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
    END IF;
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
