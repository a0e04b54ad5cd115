-- 0033_pairs_by_hash, downgrade: compaction.pairs' keys as revision 0025 left them, the
-- primary key on (conversation_id, run_id) and pairs_pair_index_key unique on
-- (conversation_id, pair_index). Builds the run-id key under pairs' SHARE lock. Each DDL
-- statement on its own, for Citus (as the upgrade).
DO $$
BEGIN
    EXECUTE 'CREATE UNIQUE INDEX pairs_run_pkey ON compaction.pairs (conversation_id, run_id)';
    EXECUTE 'CREATE UNIQUE INDEX pairs_pair_index_unique'
            ' ON compaction.pairs (conversation_id, pair_index)';
    EXECUTE 'ALTER TABLE compaction.pairs DROP CONSTRAINT pairs_pkey';
    EXECUTE 'DROP INDEX compaction.pairs_run_idx';
    EXECUTE 'ALTER TABLE compaction.pairs ADD CONSTRAINT pairs_pkey'
            ' PRIMARY KEY USING INDEX pairs_run_pkey';
    EXECUTE 'ALTER TABLE compaction.pairs ADD CONSTRAINT pairs_pair_index_key'
            ' UNIQUE USING INDEX pairs_pair_index_unique';
END
$$;

CALL compaction.assign_ownership();
