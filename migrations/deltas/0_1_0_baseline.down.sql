-- Delta 0_1_0_baseline, downgrade: removes everything the baseline created, leaving the
-- database as it was before the first `pycompactor migrate` except for two things kept on
-- purpose: schema compaction (it holds alembic's version table) and the cluster-wide
-- roles compaction_owner, _worker, _reader and _auditor (other databases of the cluster
-- may use them; they own nothing here afterwards, so an administrator may drop them).
--
-- Written by hand, and by catalog rather than by name: the up delta is regenerated from
-- sql/ until 0.1.0 is released, and what the baseline created is exactly what belongs to
-- compaction_owner in the engine's two schemas (compaction.assign_ownership hands every
-- engine object to it; alembic's version table belongs to whoever migrates). Nothing is
-- dropped with CASCADE: a host object built on an engine object (a view over
-- compaction.source_runs, say) stops the downgrade with PostgreSQL's own error naming it.

-- The host's own tables keep taking writes without the engine: the tracking and queueing
-- triggers attach_source_tracking and the recipes put on them go first (they call
-- functions of schema compaction, dropped below). The reference tables' triggers go with
-- the tables.
DO $$
DECLARE
    v_trigger record;
BEGIN
    FOR v_trigger IN
        SELECT t.tgname, t.tgrelid::regclass AS relation
        FROM pg_catalog.pg_trigger AS t
        JOIN pg_catalog.pg_proc AS p ON p.oid = t.tgfoid
        JOIN pg_catalog.pg_class AS c ON c.oid = t.tgrelid
        WHERE p.pronamespace = 'compaction'::regnamespace
          AND c.relnamespace NOT IN ('compaction'::regnamespace,
                                     'compaction_source'::regnamespace)
          AND NOT t.tgisinternal
    LOOP
        EXECUTE pg_catalog.format('DROP TRIGGER %I ON %s', v_trigger.tgname, v_trigger.relation);
    END LOOP;
END
$$;

-- Then the engine's objects, in passes: an object another engine object still depends on
-- (a table a view reads, a function a CHECK calls, a sequence its column owns) fails with
-- dependent_objects_still_exist and waits for the next pass; views first and newest
-- first, so one or two passes usually do. A pass that drops nothing ends the loop with
-- an error naming the host objects that hold what is left.
DO $$
DECLARE
    v_statements text[];
    v_statement  text;
    v_dropped    boolean;
    v_message    text;
    v_detail     text;
BEGIN
    LOOP
        SELECT pg_catalog.array_agg(o.statement ORDER BY o.rank, o.oid DESC)
        INTO v_statements
        FROM (
            SELECT c.oid,
                   CASE c.relkind WHEN 'v' THEN 0 WHEN 'm' THEN 0 WHEN 'S' THEN 3 ELSE 1 END AS rank,
                   pg_catalog.format('DROP %s %s',
                       CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                                      WHEN 'S' THEN 'SEQUENCE' WHEN 'c' THEN 'TYPE'
                                      ELSE 'TABLE' END,
                       c.oid::regclass) AS statement
            FROM pg_catalog.pg_class AS c
            WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
              AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'c')
              AND c.relowner = 'compaction_owner'::regrole
            UNION ALL
            SELECT p.oid, 2,
                   pg_catalog.format('DROP %s %s',
                       CASE p.prokind WHEN 'p' THEN 'PROCEDURE' WHEN 'a' THEN 'AGGREGATE'
                                      ELSE 'FUNCTION' END,
                       p.oid::regprocedure)
            FROM pg_catalog.pg_proc AS p
            WHERE p.pronamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
              AND p.proowner = 'compaction_owner'::regrole
            UNION ALL
            SELECT t.oid, 4, pg_catalog.format('DROP TYPE %s', t.oid::regtype)
            FROM pg_catalog.pg_type AS t
            WHERE t.typnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
              AND t.typowner = 'compaction_owner'::regrole
              AND t.typtype IN ('e', 'd', 'r')
        ) AS o;
        EXIT WHEN v_statements IS NULL;
        v_dropped := false;
        FOREACH v_statement IN ARRAY v_statements LOOP
            BEGIN
                EXECUTE v_statement;
                v_dropped := true;
            EXCEPTION
                WHEN dependent_objects_still_exist THEN
                    NULL;
                -- gone with an object dropped before it (a table's own sequence)
                WHEN undefined_table OR undefined_object OR undefined_function THEN
                    NULL;
            END;
        END LOOP;
        IF NOT v_dropped THEN
            -- Only host objects hold these now: say which on the error's first line, the
            -- one a caller shows (PostgreSQL puts them in the detail).
            BEGIN
                EXECUTE v_statements[1];
            EXCEPTION WHEN dependent_objects_still_exist THEN
                GET STACKED DIAGNOSTICS v_message = MESSAGE_TEXT, v_detail = PG_EXCEPTION_DETAIL;
                RAISE EXCEPTION '% (%)', v_message, pg_catalog.replace(v_detail, E'\n', '; ')
                    USING ERRCODE = 'dependent_objects_still_exist',
                          HINT = 'Drop or re-point those objects of yours, then downgrade again.';
            END;
        END IF;
    END LOOP;
END
$$;

DROP SCHEMA compaction_source;

-- Schema compaction stays for the version table, as the migrator's again and with no
-- engine role's privileges.
REVOKE ALL ON SCHEMA compaction FROM compaction_worker, compaction_reader, compaction_auditor;
ALTER SCHEMA compaction OWNER TO CURRENT_USER;
COMMENT ON SCHEMA compaction IS NULL;
