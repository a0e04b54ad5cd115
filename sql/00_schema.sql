-- pycompactor stored logic, section 0: preconditions, roles and schemas.
--
-- The files in sql/ are the complete current definition of the engine, applied in
-- file-name order. Alembic revisions under migrations/ apply the same state as a
-- series of frozen deltas; tests/migrations proves both paths build identical catalogs.
--
-- Project SQLSTATEs (class CP), mapped to Python in pycompactor/errors.py:
--   CP001  database is not UTF8-encoded
--   CP002  invalid range (from_pair negative or not a multiple of 10)
--   CP003  invalid source ids (not exactly 20 distinct non-null ids)
--   CP004  invalid source hash (not 64 lowercase hex characters)
--   CP005  invalid summary (not_stopped, tool_calls, empty or too_long)
--   CP006  a completed summary already exists for this identity
--   CP007  unknown prompt version
--   CP010  immutable row: completed summaries and their identity never change
--   CP011  append-only table: rows can be added, never changed or removed
--   CP012  TRUNCATE refused on an engine table
--   CP013  a prompt version is frozen (only closing accepts_new_jobs)
--   CP020  invalid argument to an engine function (bounds included)
--   CP021  the source is not tracked, or changed during the rebuild
--   CP022  p_now is not finite, or before the attempt started
--   CP023  a lease outside 1 second to 1 day
--   CP024  a failure reason that is not a code
--   CP025  p_now from a caller that may not set the clock
--   CP031  a host table stayed busy while the tracking triggers waited for it
-- docs/contract.md has the same table with the Python exception of each.

-- Byte budgets, hashes and the whitespace rule are defined on UTF-8; any other server
-- encoding would silently change what a hash or a byte count means.
DO $$
BEGIN
    IF pg_catalog.current_setting('server_encoding') <> 'UTF8' THEN
        RAISE EXCEPTION 'pycompactor needs a UTF8-encoded database; % is %',
            pg_catalog.current_database(), pg_catalog.current_setting('server_encoding')
            USING ERRCODE = 'CP001',
                  HINT = 'Create the database with ENCODING ''UTF8'' (and a UTF-8 locale or TEMPLATE template0).';
    END IF;
END
$$;

-- Roles are cluster-wide: another database of the same cluster may have created them
-- already, possibly at this very moment, so creation tolerates losing that race.
DO $$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['compaction_owner', 'compaction_worker',
                                  'compaction_reader', 'compaction_auditor']
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = v_role) THEN
            BEGIN
                EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', v_role);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
END
$$;

-- The migration runner creates schema compaction before the first revision, because
-- alembic keeps its version table inside it.
CREATE SCHEMA IF NOT EXISTS compaction;
COMMENT ON SCHEMA compaction IS
    'pycompactor engine: cross-run conversation compaction (tables are internal; functions and views are the interface)';

CREATE SCHEMA compaction_source;
COMMENT ON SCHEMA compaction_source IS
    'pycompactor reference history tables for greenfield use; hosts may re-point compaction.source_* views elsewhere';

-- Advisory locks are transaction-scoped only (PgBouncer transaction pooling) and use
-- the two-key form with the project class 1129316352 (0x43500000, 'CP' << 24 >> 8):
--   (1129316352, 1)  migrations: serialises concurrent `pycompactor migrate` runs
--   (1129316352, 2)  admission once, before the lock became slot
--                    rows (compaction.admission); the key stays reserved
--   (1129316352, h)  one conversation's engine writers once, h =
--                    hashtext(conversation_id) moved off 0..15. Any login can take an
--                    advisory lock, so one with no engine grant could stall a
--                    conversation: the writers now lock the conversation's row of
--                    compaction.conversation_locks instead, which only the owner can.
-- A login that holds (1129316352, 1) can still delay `pycompactor migrate`, nothing else.
