-- pycompactor stored logic, section 8: scaling out with Citus (contract §11).
--
-- The engine runs unchanged on Citus once its tables are distributed: every
-- per-conversation table by conversation_id, co-located with the others, and the global
-- tables as reference tables. compaction.citus_tables() is the one list of which is
-- which; the static conformance test (tests/sql/test_citus_rules.py) checks the catalog
-- against it, and compaction.distribute_on_citus() applies it (docs/operations.md,
-- "Scaling out with Citus").

CREATE FUNCTION compaction.citus_tables()
RETURNS TABLE (table_name text, placement text, step int, colocation text)
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    -- In distribution order: reference tables first (distributed tables refer to them),
    -- then each distributed table after the tables its foreign keys name. The queue is
    -- distributed apart from the other tables: an application's
    -- transaction that writes its history, with its own login, and then calls
    -- compaction.enqueue (the owner's) may not touch placements co-located with the ones
    -- it wrote as another user, and no statement joins the queue with another table.
    VALUES ('compaction.settings', 'reference', 1, NULL),
           ('compaction.prompt_versions', 'reference', 2, NULL),
           ('compaction.admission', 'reference', 3, NULL),
           ('compaction.source_tracking', 'reference', 4, NULL),
           ('compaction_source.conversations', 'distributed', 5, 'conversation'),
           ('compaction_source.runs', 'distributed', 6, 'conversation'),
           ('compaction_source.messages', 'distributed', 7, 'conversation'),
           ('compaction.jobs', 'distributed', 8, 'conversation'),
           ('compaction.attempts', 'distributed', 9, 'conversation'),
           ('compaction.job_summaries', 'distributed', 10, 'conversation'),
           ('compaction.event_log', 'distributed', 11, 'conversation'),
           ('compaction.queue', 'distributed', 12, 'queue'),
           ('compaction.conversation_state', 'distributed', 13, 'conversation'),
           ('compaction.pairs', 'distributed', 14, 'conversation'),
           ('compaction.ranges', 'distributed', 15, 'conversation'),
           ('compaction.summary_verdicts', 'distributed', 16, 'conversation'),
           ('compaction.conversation_locks', 'distributed', 17, 'conversation'),
           ('compaction.foreign_messages', 'distributed', 18, 'conversation')
$$;
COMMENT ON FUNCTION compaction.citus_tables() IS
    'Every engine table with its Citus placement (distributed by conversation_id, or reference), the order compaction.distribute_on_citus() applies them in, and the co-location group of a distributed table (conversation, or queue alone)';

-- Whether the engine's tables are distributed here (compaction.jobs in Citus's
-- metadata): the form the audit views and the view grants take. Citus's
-- catalog exists only where Citus is installed, so it is asked for by name first.
CREATE FUNCTION compaction.engine_distributed()
RETURNS boolean
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_distributed boolean := false;
BEGIN
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition
                                WHERE logicalrelid = ''compaction.jobs''::regclass)'
            INTO v_distributed;
    END IF;
    RETURN v_distributed;
END
$$;
COMMENT ON FUNCTION compaction.engine_distributed() IS
    'Internal: true when the engine''s tables are distributed by Citus (compaction.jobs is in pg_dist_partition)';

-- The audit views over engine tables are facades (sql/50_audit.sql): over their bodies
-- on one node, through the definer functions read_audit_* once the tables are
-- distributed. Called by distribute_on_citus and by every migration that changes an
-- audit view, so that an upgrade keeps each database's form.
CREATE PROCEDURE compaction.place_audit_views()
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF compaction.engine_distributed() THEN
        CREATE OR REPLACE VIEW compaction.audit_jobs AS
            SELECT * FROM compaction.read_audit_jobs();
        CREATE OR REPLACE VIEW compaction.audit_exhausted AS
            SELECT * FROM compaction.read_audit_exhausted();
        CREATE OR REPLACE VIEW compaction.audit_queue AS
            SELECT * FROM compaction.read_audit_queue();
        CREATE OR REPLACE VIEW compaction.audit_events AS
            SELECT * FROM compaction.read_audit_events();
    ELSE
        CREATE OR REPLACE VIEW compaction.audit_jobs AS
            SELECT * FROM compaction.audit_jobs_rows;
        CREATE OR REPLACE VIEW compaction.audit_exhausted AS
            SELECT * FROM compaction.audit_exhausted_rows;
        CREATE OR REPLACE VIEW compaction.audit_queue AS
            SELECT * FROM compaction.audit_queue_rows;
        CREATE OR REPLACE VIEW compaction.audit_events AS
            SELECT * FROM compaction.audit_events_rows;
    END IF;
END
$$;
COMMENT ON PROCEDURE compaction.place_audit_views() IS
    'Migration and Citus step: points the audit views at their bodies (one node) or at the definer functions read_audit_* (Citus, where a view''s shard queries run with the caller''s rights)';

-- The reader's and the worker's views on Citus. There, as for the
-- auditor's views above, a view's queries on the shards run with the caller's rights,
-- not its owner's: a reader reading compaction.summaries was refused the shards of
-- job_summaries, and both roles were refused the schema of the source views' tables.
-- Their views are read with a filter by conversation, which a facade over a function
-- would lose (every summary read to return one conversation's), so on Citus each role
-- holds SELECT on what its views read instead: the reader on jobs and job_summaries (the
-- rows compaction.summaries shows, and the identities that hold no summary yet:
-- metadata), both roles on the reference source tables and USAGE on their schema (a
-- host that points the source views at its own distributed tables grants the same on
-- those, docs/operations.md). Nothing is granted on one node.
CREATE PROCEDURE compaction.place_view_grants()
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF compaction.engine_distributed() THEN
        GRANT USAGE ON SCHEMA compaction_source TO compaction_worker, compaction_reader;
        GRANT SELECT ON compaction_source.runs, compaction_source.messages
        TO compaction_worker, compaction_reader;
        GRANT SELECT ON compaction.jobs, compaction.job_summaries TO compaction_reader;
    END IF;
END
$$;
COMMENT ON PROCEDURE compaction.place_view_grants() IS
    'Migration and Citus step: where the engine is distributed, grants the reader and the worker SELECT on the tables their views read (Citus runs a view''s shard queries with the caller''s rights); nothing on one node';

-- Run once by a superuser on the coordinator, after `pycompactor migrate` and before any
-- history is written (create_distributed_table moves existing rows, but a large table is
-- better distributed empty). One transaction: all or nothing.
CREATE PROCEDURE compaction.distribute_on_citus()
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
    v_in_use    boolean := compaction.derived_state_current();
    v_stamp     text;
    v_tables    text[];
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
    -- The queue triggers on the source tables insert into the queue, which lives in a
    -- co-location group of its own: on a shard, that is a write to
    -- another node, which Citus refuses a trigger. Detached: writers call
    -- compaction.enqueue (or workers run --sweep).
    -- The change-tracking triggers (contract §2, §11) stay: they write derived
    -- rows of the conversations their statement names only, on the shards co-located
    -- with the one that fires them (compaction.distributed_relation tells them which
    -- distributed table a shard is).
    FOR v_trigger IN
        SELECT t.tgname, t.tgrelid::regclass AS rel
        FROM pg_catalog.pg_trigger AS t
        WHERE t.tgfoid = 'compaction.source_enqueue()'::regprocedure
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
    ALTER FUNCTION compaction.judge_runs(text, text[], boolean) RESET plan_cache_mode;
    -- A judgement's question to every shard of the messages runs on one
    -- connection per node. Its tasks are index probes of a few runs each; with more
    -- connections the executor opened new ones to the workers in most judgements (14 ms
    -- against 9.6 ms for a conversation of 100 runs on the loopback cluster, and the
    -- drain of `make bench-citus` took 7.4-9.2 s against 5.6-5.8 s).
    ALTER FUNCTION compaction.judge_runs(text, text[], boolean)
        SET citus.max_adaptive_executor_pool_size = 1;
    -- Every read of the derived state asks the record of foreign messages, on
    -- every shard, first (derived_state_serves): on one connection per node, as
    -- judge_runs' question above.
    ALTER FUNCTION compaction.derived_state_serves(text)
        SET citus.max_adaptive_executor_pool_size = 1;
    -- audit_stale_summaries compares every summary with its range in one statement, a
    -- task per shard: on one connection per node too (more connections were opened
    -- afresh for each audit: 21 ms against 14 ms on the loopback cluster, 32 shards).
    ALTER FUNCTION compaction.stale_summaries()
        SET citus.max_adaptive_executor_pool_size = 1;
    -- Judged from the views (always, on Citus) projection_read sends the
    -- texts in its own statement, whose
    -- queries Citus can plan only with the values bound; on one node it forces generic
    -- plans.
    ALTER FUNCTION compaction.projection_read(text, text, int, bigint, int)
        RESET plan_cache_mode;
    -- The derived state is read on Citus too; projection_frame's statements
    -- (one generic plan on one node) Citus plans only with their values bound.
    ALTER FUNCTION compaction.projection_frame(text, text, int)
        SET plan_cache_mode = force_custom_plan;
    ALTER FUNCTION compaction.derived_frame(text, text, int)
        SET plan_cache_mode = force_custom_plan;
    CALL compaction.place_audit_views();
    CALL compaction.place_view_grants();
    -- The tracking triggers fire on the workers and call the engine's functions there.
    -- Citus created on the workers those that depend on nothing local; the rest (whose
    -- arguments are rows of the engine's tables: compaction.rederive_general's, ...)
    -- exist there once their tables are distributed and they are made Citus objects.
    -- No distribution argument: a call is never delegated to a worker (docs/operations.md).
    FOR v_statement IN
        EXECUTE 'SELECT p.oid::regprocedure::text
                 FROM pg_catalog.pg_proc AS p
                 WHERE p.pronamespace = ''compaction''::regnamespace
                   AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_object AS o
                                   WHERE o.classid = ''pg_catalog.pg_proc''::regclass
                                     AND o.objid = p.oid)
                 ORDER BY 1'
    LOOP
        EXECUTE 'SELECT create_distributed_function($1::regprocedure)' USING v_statement;
    END LOOP;
    -- The derived state moved with its tables and the tracking kept it: in use again
    -- under the source as it now stands (the stamp names its catalog rows, which
    -- distributing the tables replaced).
    -- Written here, as the caller (the superuser that placed source_tracking in this
    -- transaction: Citus refuses another user its placements now), not by
    -- compaction.stamp_derived_state.
    IF v_in_use THEN
        v_stamp := compaction.source_stamp();
        v_tables := compaction.stamped_tables(v_stamp);
        UPDATE compaction.source_tracking
        SET stamp = v_stamp,
            object_oids = compaction.stamped_oids(v_stamp),
            tracked_tables = v_tables,
            stamped_at = pg_catalog.now()
        WHERE v_stamp IS NOT NULL;
    END IF;
END
$$;
COMMENT ON PROCEDURE compaction.distribute_on_citus() IS
    'Citus: detaches the change-tracking and queue triggers from every table, distributes every engine table as compaction.citus_tables() says, then places the audit views and the reader''s and worker''s grants (run once, as a superuser, on the coordinator)';
