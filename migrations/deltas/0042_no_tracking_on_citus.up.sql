-- 0042_no_tracking_on_citus: the change-tracking triggers never run on Citus. They read
-- transition tables and ask about other conversations' rows, which a trigger on a shard
-- may not: attached to a distributed table (attach_source_tracking let a DBA do it, and
-- a host's table tracked on one node kept its triggers when Citus distributed it), every
-- write to that table failed on its shards, the application's included ("could not
-- create distributed plan"). attach_source_tracking now refuses on Citus (CP020);
-- distribute_on_citus detaches them from every table, not only the reference tables';
-- and since no derived state is kept on Citus, complete and import_summary no longer
-- write the new summary's verdict there (always stale_source, read by nothing: about a
-- quarter of a completion's time under the conversation's lock). Functions only; one
-- node answers as before.

CREATE OR REPLACE FUNCTION compaction.attach_source_tracking(
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
    -- call instead (DESIGN §11). Citus's catalog exists only where Citus is installed, so
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

CREATE OR REPLACE FUNCTION compaction.rederive_summary_verdicts(
    p_conversation_id text, p_from_pairs int[], p_new_summary_id bigint DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_from_pairs int[] := p_from_pairs;
    v_from       int;
    v_ids        bigint[];
    v_scopes     text[];
    v_froms      int[];
    v_reasons    text[];
BEGIN
    -- Revision 0042: on Citus no derived state is kept (the tracking triggers cannot run
    -- on the shards, and a rebuild needs them), so nothing reads the verdict a new summary
    -- would get: complete and import_summary write none there. Judged against ranges
    -- that are never derived, it was always stale_source, and its two statements took
    -- about a quarter of a completion's time under the conversation's lock (the drain of
    -- `make bench-citus`: 4.7-5.0 s against 5.2-5.6 s, docs/benchmarks.md).
    -- Whether Citus is loaded at all is asked first: where it is not, one setting's
    -- lookup is the whole cost (calling engine_distributed added 0.8% to the
    -- instructions of a claim -> complete cycle on one node).
    IF p_new_summary_id IS NOT NULL
       AND pg_catalog.current_setting('citus.version', true) IS NOT NULL
       AND compaction.engine_distributed() THEN
        RETURN;
    END IF;
    IF p_new_summary_id IS NOT NULL THEN
        -- complete and import_summary write derived state here: like the tracking paths,
        -- they take the conversation's conversation_state row first (sql/25_tracking.sql),
        -- so a source write that re-judges the same range waits for this transaction and
        -- then sees its summary, or this one waits and then judges the range as written.
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (p_conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        -- The common case, in one statement: the first summary of its range in its scope
        -- has no other to be preferred to, so its verdict is judge_summaries' first two
        -- rules alone (written here again; verify_conversation compares the result with
        -- judge_summaries).
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT p_conversation_id, js.summary_id, j.scope, j.from_pair,
               CASE WHEN NOT coalesce(pv.projectable, false) THEN 'version_not_projectable'
                    WHEN NOT coalesce(r.source_hash = j.source_hash
                                      AND r.source_message_ids = j.source_message_ids, false)
                        THEN 'stale_source' END
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        LEFT JOIN compaction.prompt_versions AS pv ON pv.prompt_version = j.prompt_version
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = j.from_pair
        WHERE js.conversation_id = p_conversation_id AND js.summary_id = p_new_summary_id
          AND NOT EXISTS (SELECT 1 FROM compaction.summary_verdicts AS o
                          WHERE o.conversation_id = p_conversation_id
                            AND o.from_pair = j.from_pair AND o.scope = j.scope);
        IF FOUND THEN
            RETURN;
        END IF;
        -- Provisional, so the judgment below finds it with its range's other summaries.
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT p_conversation_id, js.summary_id, j.scope, j.from_pair, 'stale_source'
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        WHERE js.conversation_id = p_conversation_id AND js.summary_id = p_new_summary_id
        RETURNING v.from_pair INTO v_from;
        v_from_pairs := coalesce(v_from_pairs, '{}') || v_from;
    END IF;
    IF v_from_pairs IS NULL THEN
        DELETE FROM compaction.summary_verdicts AS v WHERE v.conversation_id = p_conversation_id;
    ELSE
        SELECT pg_catalog.array_agg(v.summary_id) INTO v_ids
        FROM compaction.summary_verdicts AS v
        WHERE v.conversation_id = p_conversation_id AND v.from_pair = ANY (v_from_pairs);
        IF v_ids IS NULL THEN
            RETURN;  -- no summary of those ranges: nothing to judge (the common case)
        END IF;
        DELETE FROM compaction.summary_verdicts AS v
        WHERE v.conversation_id = p_conversation_id AND v.summary_id = ANY (v_ids);
    END IF;
    -- The judgment first, then the rows: one statement each (DESIGN §11).
    SELECT pg_catalog.array_agg(j.summary_id), pg_catalog.array_agg(j.scope),
           pg_catalog.array_agg(j.from_pair), pg_catalog.array_agg(j.reason)
    INTO v_ids, v_scopes, v_froms, v_reasons
    FROM compaction.judge_summaries(p_conversation_id, v_ids) AS j;
    INSERT INTO compaction.summary_verdicts (conversation_id, summary_id, scope, from_pair, reason)
    SELECT p_conversation_id, u.summary_id, u.scope, u.from_pair, u.reason
    FROM ROWS FROM (pg_catalog.unnest(v_ids), pg_catalog.unnest(v_scopes),
                    pg_catalog.unnest(v_froms), pg_catalog.unnest(v_reasons))
         AS u (summary_id, scope, from_pair, reason);
END
$$;
COMMENT ON FUNCTION compaction.rederive_summary_verdicts(text, int[], bigint) IS
    'Internal: re-judges the summaries of the listed ranges of a conversation (every summary when NULL) into compaction.summary_verdicts, first adding p_new_summary_id''s row when given (not on Citus, where no derived state is kept)';

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
    ALTER FUNCTION compaction.judge_runs(text, text[]) RESET plan_cache_mode;
    -- Revision 0038: a judgement's question to every shard of the messages runs on one
    -- connection per node. Its tasks are index probes of a few runs each; with more
    -- connections the executor opened new ones to the workers in most judgements (14 ms
    -- against 9.6 ms for a conversation of 100 runs on the loopback cluster, and the
    -- drain of `make bench-citus` took 7.4-9.2 s against 5.6-5.8 s).
    ALTER FUNCTION compaction.judge_runs(text, text[])
        SET citus.max_adaptive_executor_pool_size = 1;
    -- Revision 0041: judged from the views (always, on Citus) projection_read sends the
    -- texts in its own statement, through projection_texts, whose queries Citus can
    -- plan only with the values bound; on one node it forces generic plans.
    ALTER FUNCTION compaction.projection_read(text, text, int, bigint, int)
        RESET plan_cache_mode;
    CALL compaction.place_audit_views();
    CALL compaction.place_view_grants();
END
$$;
COMMENT ON PROCEDURE compaction.distribute_on_citus() IS
    'Citus: detaches the change-tracking and queue triggers from every table, distributes every engine table as compaction.citus_tables() says, then places the audit views and the reader''s and worker''s grants (run once, as a superuser, on the coordinator)';

CALL compaction.assign_ownership();
