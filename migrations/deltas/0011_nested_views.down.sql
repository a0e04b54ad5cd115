-- Revision 0011_nested_views, down: source_stamp reads the source views' own rules only
-- (a source view reading another view makes the source untracked again).

CREATE OR REPLACE FUNCTION compaction.source_stamp()
RETURNS text
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_tracker regprocedure := pg_catalog.to_regprocedure('compaction.track_source_changes()');
BEGIN
    RETURN (
        WITH rules AS (
            SELECT rw.oid, rw.ev_class, rw.xmin
            FROM pg_catalog.pg_rewrite AS rw
            WHERE rw.ev_class IN (pg_catalog.to_regclass('compaction.source_runs'),
                                  pg_catalog.to_regclass('compaction.source_messages'))
        ),
        relations AS (
            SELECT DISTINCT d.refobjid AS relid
            FROM rules AS ru
            JOIN pg_catalog.pg_depend AS d
              ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = ru.oid
            WHERE d.refclassid = 'pg_catalog.pg_class'::regclass
              AND d.deptype = 'n'
              AND d.refobjid <> ru.ev_class
        ),
        triggers AS (
            SELECT tg.oid, tg.xmin, tg.tgrelid, tg.tgtype::int AS tgtype
            FROM pg_catalog.pg_trigger AS tg
            WHERE tg.tgrelid IN (SELECT rel.relid FROM relations AS rel)
              AND tg.tgfoid = v_tracker
              AND tg.tgenabled = 'A'
        ),
        tracked AS (
            -- tgtype bits: 1 row, 2 before, 4 insert, 8 delete, 16 update, 32 truncate
            SELECT c.relkind IN ('r', 'p')
                   AND coalesce(pg_catalog.bit_or(t.tgtype) OPERATOR(pg_catalog.&) 60 = 60, false)
                   AND coalesce(pg_catalog.bool_and(t.tgtype OPERATOR(pg_catalog.&) 3 = 0), false)
                       AS complete
            FROM relations AS rel
            JOIN pg_catalog.pg_class AS c ON c.oid = rel.relid
            LEFT JOIN triggers AS t ON t.tgrelid = rel.relid
            GROUP BY rel.relid, c.relkind
        )
        SELECT CASE WHEN (SELECT count(*) FROM rules) = 2
                     AND (SELECT pg_catalog.bool_and(t.complete) FROM tracked AS t) THEN
                   (SELECT pg_catalog.string_agg(o.oid::text || ':' || o.xmin::text, ','
                                                 ORDER BY o.oid)
                    FROM (SELECT ru.oid, ru.xmin FROM rules AS ru
                          UNION ALL
                          SELECT t.oid, t.xmin FROM triggers AS t) AS o)
               END);
END
$$;
COMMENT ON FUNCTION compaction.source_stamp() IS
    'Identifies the source views and the tracking triggers behind them as they are now (oid:xmin of each catalog row); NULL when some table behind the views is not fully tracked';

CALL compaction.assign_ownership();
