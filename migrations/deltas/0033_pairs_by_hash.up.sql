-- 0033_pairs_by_hash: compaction.pairs finds a Run's pair through a hash index on run_id
-- instead of its primary key on (conversation_id, run_id), a B-tree holding both text ids
-- of every pair: with uuid-like ids about 105 bytes a pair against 34 for the hash index
-- (docs/operations.md, "Space to plan"). The primary key moves to (conversation_id,
-- pair_index), which was already unique (pairs_pair_index_key) and keeps the name
-- pairs_pkey. No function changes: every lookup by run id names the conversation too,
-- and the planner takes the new indexes for the same statements.
--
-- Both new indexes are built here unless they exist already, valid: on a large, live
-- database a DBA builds them first with CREATE INDEX CONCURRENTLY (docs/operations.md,
-- "Upgrading"), and this revision then only swaps the constraints, holding pairs'
-- ACCESS EXCLUSIVE lock for as long as catalog changes take. Built here instead, they
-- hold pairs' SHARE lock while they build, and tracked writes wait for it.
--
-- Each DDL statement runs on its own (EXECUTE): Citus sends a distributed table's DDL to
-- the nodes as the text of the statement that ran it, which must be one command.
DO $$
DECLARE
    v_index text;
BEGIN
    -- An index a failed CREATE INDEX CONCURRENTLY left behind is invalid: built again.
    FOREACH v_index IN ARRAY ARRAY['pairs_run_idx', 'pairs_pair_index_pkey'] LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_index AS i
                   WHERE i.indexrelid = pg_catalog.to_regclass('compaction.' || v_index)
                     AND NOT (i.indisvalid AND i.indisready)) THEN
            EXECUTE pg_catalog.format('DROP INDEX compaction.%I', v_index);
        END IF;
    END LOOP;
    EXECUTE 'CREATE INDEX IF NOT EXISTS pairs_run_idx ON compaction.pairs USING hash (run_id)';
    EXECUTE 'CREATE UNIQUE INDEX IF NOT EXISTS pairs_pair_index_pkey'
            ' ON compaction.pairs (conversation_id, pair_index)';
    EXECUTE 'ALTER TABLE compaction.pairs DROP CONSTRAINT pairs_pkey';
    EXECUTE 'ALTER TABLE compaction.pairs DROP CONSTRAINT pairs_pair_index_key';
    -- Renames pairs_pair_index_pkey to pairs_pkey.
    EXECUTE 'ALTER TABLE compaction.pairs ADD CONSTRAINT pairs_pkey'
            ' PRIMARY KEY USING INDEX pairs_pair_index_pkey';
END
$$;
COMMENT ON INDEX compaction.pairs_run_idx IS
    'The pair of a Run, by run id (a hash index: equality is the only question asked of it)';

CALL compaction.assign_ownership();
