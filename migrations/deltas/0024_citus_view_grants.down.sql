-- 0024_citus_view_grants, reversed: the grants revoked where the engine is distributed,
-- place_audit_views and distribute_on_citus as revision 0023 had them.

DO $$
BEGIN
    IF compaction.engine_distributed() THEN
        REVOKE SELECT ON compaction.jobs, compaction.job_summaries FROM compaction_reader;
        REVOKE SELECT ON compaction_source.runs, compaction_source.messages
        FROM compaction_worker, compaction_reader;
        REVOKE USAGE ON SCHEMA compaction_source FROM compaction_worker, compaction_reader;
    END IF;
END
$$;

DROP PROCEDURE compaction.place_view_grants();

CREATE OR REPLACE PROCEDURE compaction.place_audit_views()
LANGUAGE plpgsql
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
    IF v_distributed THEN
        CREATE OR REPLACE VIEW compaction.audit_jobs AS
            SELECT * FROM compaction.read_audit_jobs();
        CREATE OR REPLACE VIEW compaction.audit_exhausted AS
            SELECT * FROM compaction.read_audit_exhausted();
        CREATE OR REPLACE VIEW compaction.audit_queue AS
            SELECT * FROM compaction.read_audit_queue();
    ELSE
        CREATE OR REPLACE VIEW compaction.audit_jobs AS
            SELECT * FROM compaction.audit_jobs_rows;
        CREATE OR REPLACE VIEW compaction.audit_exhausted AS
            SELECT * FROM compaction.audit_exhausted_rows;
        CREATE OR REPLACE VIEW compaction.audit_queue AS
            SELECT * FROM compaction.audit_queue_rows;
    END IF;
END
$$;

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
    FOR v_trigger IN
        SELECT t.tgname, t.tgrelid::regclass AS rel
        FROM pg_catalog.pg_trigger AS t
        WHERE t.tgrelid IN (pg_catalog.to_regclass('compaction_source.runs'),
                            pg_catalog.to_regclass('compaction_source.messages'))
          AND t.tgfoid IN ('compaction.track_source_changes()'::regprocedure,
                           'compaction.source_enqueue()'::regprocedure)
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
    CALL compaction.place_audit_views();
END
$$;
COMMENT ON PROCEDURE compaction.distribute_on_citus() IS
    'Citus: detaches the source tables'' statement triggers and distributes every engine table as compaction.citus_tables() says (run once, as a superuser, on the coordinator)';

DROP FUNCTION compaction.engine_distributed();

CALL compaction.assign_ownership();
