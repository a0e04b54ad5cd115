-- pycompactor stored logic, section 2b continued: attaching the tracking to a host's own
-- tables (attach_source_tracking, detach_source_tracking), and proof and repair of one
-- conversation (verify_conversation, rederive_conversation).

-- ---------------------------------------------------------------------------------------
-- Attaching the tracking to a host's own tables
-- ---------------------------------------------------------------------------------------

-- Runs with the caller's rights (the host table's owner creates triggers on its table);
-- it needs EXECUTE on track_source_changes, which the engine's owner grants.
--
-- Online on a busy table. CREATE TRIGGER waits for every transaction
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
BEGIN
    IF p_table IS NULL OR p_conversation_column IS NULL OR p_run_column IS NULL THEN
        RAISE EXCEPTION 'attach_source_tracking needs a table, its conversation id column and its run id column ('''' when it has none)'
            USING ERRCODE = 'CP020';
    END IF;
    IF p_message_column IS NOT NULL AND p_run_column <> '' THEN
        RAISE EXCEPTION 'attach_source_tracking: a message id column is for a table without a run column (its runs come from the views)'
            USING ERRCODE = 'CP020';
    END IF;
    -- On Citus as on one node: the triggers fire on the table's shards and
    -- write the derived rows of the conversations their statement names, on the
    -- co-located shards (contract §11). Run it on the coordinator, with the table
    -- distributed co-located with compaction.jobs (docs/operations.md).
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
    'Attaches the change-tracking triggers (INSERT, UPDATE, DELETE, TRUNCATE) to a host table behind the source views, naming its conversation id and run id columns (or '''' and, optionally, its message id column, so an append re-derives only its run); waits at most 50 ms at a time for the table; then CALL compaction.rebuild_derived_state(). On Citus, run on the coordinator: the triggers fire on the shards';

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
    -- that reads no engine table: on Citus a statement that reads a
    -- distributed table runs on the shard, where these functions cannot run theirs.
    -- The pairs as the conversation's own rows make them (every rule of
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
