-- Delta 0_1_0_baseline, upgrade: the whole schema of pycompactor 0.1.0, sql/ verbatim.
-- Written by scripts/build_baseline.py (`make baseline`); until 0.1.0 is released it is
-- regenerated from sql/, never edited by hand. From the release on it is frozen.

-- ==== sql/00_schema.sql ====
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
--   (1129316352, 2)  admission until revision 0007, which replaced the lock with slot
--                    rows (compaction.admission); the key stays reserved
--   (1129316352, h)  one conversation's engine writers until revision 0018, h =
--                    hashtext(conversation_id) moved off 0..15. Any login can take an
--                    advisory lock, so one with no engine grant could stall a
--                    conversation: the writers now lock the conversation's row of
--                    compaction.conversation_locks instead, which only the owner can.
-- A login that holds (1129316352, 1) can still delay `pycompactor migrate`, nothing else.

-- ==== sql/10_source.sql ====
-- pycompactor stored logic, section 1: the source contract.
--
-- The engine reads history only through compaction.source_runs and
-- compaction.source_messages. By default they select from the reference tables below;
-- a host re-points them at its own tables with CREATE OR REPLACE VIEW (docs/integrating.md).

CREATE TABLE compaction_source.conversations (
    conversation_id text NOT NULL,
    CONSTRAINT conversations_pkey PRIMARY KEY (conversation_id)
);
COMMENT ON TABLE compaction_source.conversations IS
    'Reference history: one row per durable conversation thread';

CREATE TABLE compaction_source.runs (
    run_id          text NOT NULL,
    conversation_id text NOT NULL,
    status          text NOT NULL,
    created_at      timestamptz,
    -- conversation_id leads every key (DESIGN §11): under Citus these tables are
    -- distributed by it, co-located with the engine's per-conversation tables.
    CONSTRAINT runs_pkey PRIMARY KEY (conversation_id, run_id),
    CONSTRAINT runs_conversation_fkey FOREIGN KEY (conversation_id)
        REFERENCES compaction_source.conversations (conversation_id)
);
COMMENT ON TABLE compaction_source.runs IS
    'Reference history: one row per Run (execution of one request); status completed, partial or clarify_pending can form a pair';

-- The tracking triggers find runs by id alone (which conversation a changed message's run
-- is in); the primary key leads with conversation_id (DESIGN §11).
CREATE INDEX runs_run_idx ON compaction_source.runs (run_id);

CREATE TABLE compaction_source.messages (
    message_id      text NOT NULL,
    conversation_id text NOT NULL,
    run_id          text,
    role            text NOT NULL,
    status          text NOT NULL,
    content         text NOT NULL,
    seq             bigint NOT NULL,
    created_at      timestamptz,
    -- No foreign key to runs (revision 0013): one by run_id alone cannot exist once the
    -- table is distributed by conversation_id, and one by (conversation_id, run_id) would
    -- forbid what DESIGN §3 defines, a run's message filed under another conversation
    -- (the run is then no pair). A dangling run_id forms no pair either.
    CONSTRAINT messages_pkey PRIMARY KEY (conversation_id, message_id)
);
COMMENT ON TABLE compaction_source.messages IS
    'Reference history: messages of all roles; seq orders them within a conversation';

-- Judging a run reads its messages in its conversation (run_id, conversation_id), and
-- asks by run_id alone whether any was filed under another conversation.
CREATE INDEX messages_run_idx ON compaction_source.messages (run_id, conversation_id);
-- Reading a conversation in order (newest-first projection, check-source samples).
CREATE INDEX messages_conversation_seq_idx
    ON compaction_source.messages (conversation_id, seq, message_id);

CREATE VIEW compaction.source_runs AS
    SELECT r.run_id, r.conversation_id, r.status
    FROM compaction_source.runs AS r;
COMMENT ON VIEW compaction.source_runs IS
    'Source contract: runs(run_id text, conversation_id text, status text); re-point with CREATE OR REPLACE VIEW';

CREATE VIEW compaction.source_messages AS
    SELECT m.message_id, m.conversation_id, m.run_id, m.role, m.status, m.content, m.seq
    FROM compaction_source.messages AS m;
COMMENT ON VIEW compaction.source_messages IS
    'Source contract: messages(message_id, conversation_id, run_id, role, status, content text; seq bigint); re-point with CREATE OR REPLACE VIEW';

-- ==== sql/15_derived_state.sql ====
-- pycompactor stored logic, section 1b: derived state kept from the source (DESIGN §2).
--
-- A cache, never a second truth. Judging every run, numbering every pair and hashing
-- ranges on each call made every call cost what the whole history costs. The engine keeps
-- the result instead, written by the tracking triggers (sql/25_tracking.sql) in the same
-- transaction as the source writes it derives from:
--   compaction.pairs               one row per eligible pair: run, ids, pair_index, UTF-8 sizes
--   compaction.ranges              one row per complete range of 10 pairs: 20 ids and hash
--   compaction.conversation_state  pair count, and the row every writer of one
--                                  conversation's derived state updates first
--   compaction.summary_verdicts    every completed summary's verdict against the ranges
--   compaction.foreign_messages    the run ids each conversation's foreign messages name
--   compaction.source_tracking     under which source definition the derived state was built
--
-- The read functions (sql/20_pairs.sql) use the derived state only while
-- compaction.derived_state_current() holds: the source views and the tracking triggers
-- behind them are exactly those the state was last rebuilt under. Re-pointing a view,
-- disabling or dropping a tracking trigger, or TRUNCATE of a tracked table makes it false,
-- and every function falls back to judging from the views on each call (exact, slower)
-- until `CALL compaction.rebuild_derived_state()` re-derives everything.
--
-- pairs, ranges and summary_verdicts judge each conversation by its own rows alone (the
-- rules of docs/contract.md §3 but the foreign-message one); foreign_messages records, per
-- conversation, the run ids its foreign messages name. Each is written only by the
-- tracking of its own conversation. A read uses a conversation's derived state while no
-- foreign message names one of its pairs' runs (compaction.derived_state_serves); else it
-- judges that conversation from the views, exact, for as long as the message stays.
--
-- Citus (DESIGN §11): the per-conversation tables lead every key with conversation_id;
-- source_tracking is a single-row global table (a reference table).

CREATE TABLE compaction.conversation_state (
    conversation_id text NOT NULL,
    pair_count      int NOT NULL,
    -- Bumped by every re-derivation: a writer whose snapshot predates another writer's
    -- commit (REPEATABLE READ, SERIALIZABLE) fails on this row instead of numbering from
    -- a stale view of the conversation.
    generation      bigint NOT NULL,
    CONSTRAINT conversation_state_pkey PRIMARY KEY (conversation_id),
    CONSTRAINT conversation_state_pair_count_not_negative CHECK (pair_count >= 0)
);
COMMENT ON TABLE compaction.conversation_state IS
    'Derived state: eligible pair count per conversation, and the row that serialises the conversation''s derived-state writers';

CREATE TABLE compaction.pairs (
    conversation_id      text NOT NULL,
    run_id               text NOT NULL,
    pair_index           int NOT NULL,
    user_seq             bigint,
    user_message_id      text NOT NULL,
    user_bytes           int NOT NULL,
    assistant_message_id text NOT NULL,
    assistant_bytes      int NOT NULL,
    CONSTRAINT pairs_pkey PRIMARY KEY (conversation_id, pair_index),
    CONSTRAINT pairs_pair_index_not_negative CHECK (pair_index >= 0)
);
COMMENT ON TABLE compaction.pairs IS
    'Derived state: the eligible pairs of each conversation (DESIGN §3) with pair_index, ids and UTF-8 sizes; no text';
-- The tracking finds a written Run's pair by its conversation and run id. This index
-- keys it by a 4-byte hash of the run id alone (revision 0044): the B-tree on
-- (conversation_id, run_id) that did until revision 0033 held both text ids of every
-- pair, 107 of the derived state's 370 MB at 2M messages (docs/operations.md, "Space to
-- plan"), and the one on (conversation_id, hashtext(run_id)) that followed still held
-- the conversation's id in every entry, about 34 bytes a message where ids are uuids;
-- this one holds 16-byte entries whatever the ids. A lookup by run compares the hash, the
-- run id and the conversation, the conversation as a filter the primary key cannot serve
-- (rederive), so it plans on this index whatever the statistics say: where pairs had
-- none yet, a condition on the conversation had the planner read the conversation's
-- primary key entries too. Runs whose ids share a hash share a key; the lookup's other
-- conditions tell them apart. (A hash index on run_id was smaller still, but was not
-- chosen either without statistics: a tracked append to a 10,000-pair conversation cost
-- 3x.)
CREATE INDEX pairs_run_hash_idx ON compaction.pairs (pg_catalog.hashtext(run_id));
COMMENT ON INDEX compaction.pairs_run_hash_idx IS
    'The pair of a Run, by the hash of its run id (lookups compare the run id and the conversation too)';

CREATE TABLE compaction.ranges (
    conversation_id    text NOT NULL,
    from_pair          int NOT NULL,
    source_message_ids text[] NOT NULL,
    source_hash        text NOT NULL,
    CONSTRAINT ranges_pkey PRIMARY KEY (conversation_id, from_pair),
    CONSTRAINT ranges_from_pair_valid CHECK (from_pair >= 0 AND from_pair % 10 = 0)
);
COMMENT ON TABLE compaction.ranges IS
    'Derived state: every complete range of 10 pairs with its 20 current source ids [u0, a0, ..., u9, a9] and source hash (DESIGN §5)';

-- Revision 0014: every completed summary's verdict as projection_frame reads it, kept
-- with the ranges it depends on (re-judged whenever a range is written, and when a summary
-- of its range completes or is imported), so a projection reads one index entry per
-- summary instead of comparing every summary's 20 ids and hash with its range.
CREATE TABLE compaction.summary_verdicts (
    conversation_id text NOT NULL,
    summary_id      bigint NOT NULL,
    scope           text NOT NULL,
    from_pair       int NOT NULL,
    -- NULL: the summary its range uses in its scope (projectable, source current, and
    -- preferred among such); else the first reason of DESIGN §9 that applies.
    reason          text,
    CONSTRAINT summary_verdicts_pkey PRIMARY KEY (conversation_id, summary_id),
    CONSTRAINT summary_verdicts_reason_valid
        CHECK (reason IN ('version_not_projectable', 'stale_source', 'superseded'))
);
COMMENT ON TABLE compaction.summary_verdicts IS
    'Derived state: every completed summary''s verdict against the current ranges (reason NULL for the one each range uses in its scope, else version_not_projectable, stale_source or superseded)';
-- Re-judging finds a range's summaries by from_pair. A projection reads, for one scope,
-- the chosen summaries of the ranges its budget may reach (summary_verdicts_one_chosen)
-- and every rejected one (summary_verdicts_rejected_idx, revision 0015): none of the
-- chosen summaries beyond the reach, the many in a long conversation's steady state.
CREATE INDEX summary_verdicts_range_idx
    ON compaction.summary_verdicts (conversation_id, from_pair, scope, summary_id) INCLUDE (reason);
CREATE UNIQUE INDEX summary_verdicts_one_chosen
    ON compaction.summary_verdicts (conversation_id, scope, from_pair) WHERE reason IS NULL;
CREATE INDEX summary_verdicts_rejected_idx
    ON compaction.summary_verdicts (conversation_id, scope, from_pair, summary_id) INCLUDE (reason)
    WHERE reason IS NOT NULL;

-- Revision 0048 (docs/contract.md §3, §11): the one question of a run's judgement
-- that crosses conversations, whether a foreign message names the run, asked of a
-- record the tracking keeps per conversation. A message is foreign when its own
-- conversation has no run of its run_id; such a user or assistant message breaks run R
-- in every conversation that has one. One row per (conversation holding such messages,
-- run id they name): the conversation's own tracking writes it (its rows only,
-- co-located on Citus), and a conversation's reads ask it about their pairs' run ids
-- (compaction.derived_state_serves). Rows exist only while a message waits for its Run
-- (written before it) or is misfiled, so the table stays small, and it is read whole:
-- no index but its key, which the tracking's writes use.
CREATE TABLE compaction.foreign_messages (
    conversation_id text NOT NULL,
    run_id          text NOT NULL,
    CONSTRAINT foreign_messages_pkey PRIMARY KEY (conversation_id, run_id)
);
COMMENT ON TABLE compaction.foreign_messages IS
    'Derived state: each conversation holding a user/assistant message whose run_id names no run of that conversation (a foreign message, contract §3), with the run id named; such a message breaks run R in every conversation that has one';

CREATE TABLE compaction.source_tracking (
    singleton   boolean NOT NULL DEFAULT true,
    stamp       text,
    object_oids oid[],
    stamped_at  timestamptz,
    -- Revision 0019: a rebuild's resume point, kept with the stamp it runs under. A
    -- cancelled rebuild continues after rebuild_after when the source stamp is the same
    -- (the conversations before it were derived and have been tracked since); NULL when
    -- no rebuild is under way.
    rebuild_stamp      text,
    rebuild_after      text,
    rebuild_done       bigint,
    rebuild_total      bigint,
    rebuild_started_at timestamptz,
    rebuild_updated_at timestamptz,
    CONSTRAINT source_tracking_pkey PRIMARY KEY (singleton),
    CONSTRAINT source_tracking_single_row CHECK (singleton)
);
COMMENT ON TABLE compaction.source_tracking IS
    'Derived state: the source stamp (compaction.source_stamp()) the derived state was last rebuilt under, and the catalog rows it names (NULL until a rebuild); and the resume point of a rebuild under way';
INSERT INTO compaction.source_tracking (singleton, stamp, object_oids, stamped_at)
VALUES (true, NULL, NULL, NULL);

-- What the derived state depends on, read from the catalogs: the rewrite rules of the two
-- source views and of every view they read, through any depth (revision 0011: a host's
-- views may read views of its own), and the tracking triggers of every table behind
-- them, each as oid:xmin. A catalog row's xmin changes whenever the row is replaced
-- (CREATE OR REPLACE VIEW, ENABLE/DISABLE TRIGGER) and its oid when it is dropped and
-- made again (DROP/CREATE TRIGGER, a dump and restore), so any such change yields another
-- stamp. NULL when some table behind the views lacks an enabled-always (fires under any
-- session_replication_role) statement-level AFTER tracking trigger for INSERT, UPDATE,
-- DELETE and TRUNCATE, or the views read something other than tables and views.
CREATE FUNCTION compaction.source_stamp()
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
        WITH RECURSIVE rules AS (
            SELECT rw.oid, rw.ev_class, rw.xmin
            FROM pg_catalog.pg_rewrite AS rw
            WHERE rw.ev_class IN (pg_catalog.to_regclass('compaction.source_runs'),
                                  pg_catalog.to_regclass('compaction.source_messages'))
            UNION
            -- the rules of the (plain) views those rules read, and so on; a materialized
            -- view stays a relation: REFRESH changes it without any trigger
            SELECT rw.oid, rw.ev_class, rw.xmin
            FROM rules AS ru
            JOIN pg_catalog.pg_depend AS d
              ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = ru.oid
            JOIN pg_catalog.pg_class AS v ON v.oid = d.refobjid AND v.relkind = 'v'
            JOIN pg_catalog.pg_rewrite AS rw ON rw.ev_class = v.oid
            WHERE d.refclassid = 'pg_catalog.pg_class'::regclass
              AND d.deptype = 'n'
              AND d.refobjid <> ru.ev_class
        ),
        relations AS (
            -- what the rules read that is not itself one of the views: the tables
            SELECT DISTINCT d.refobjid AS relid
            FROM rules AS ru
            JOIN pg_catalog.pg_depend AS d
              ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = ru.oid
            WHERE d.refclassid = 'pg_catalog.pg_class'::regclass
              AND d.deptype = 'n'
              AND d.refobjid <> ru.ev_class
              AND d.refobjid NOT IN (SELECT r2.ev_class FROM rules AS r2)
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
        SELECT CASE WHEN (SELECT count(*) FROM rules AS ru
                          WHERE ru.ev_class IN (pg_catalog.to_regclass('compaction.source_runs'),
                                                pg_catalog.to_regclass('compaction.source_messages'))) = 2
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

-- Called by every read, so it re-reads only the catalog rows the stamp names, by oid: a
-- changed view or trigger changes their xmin, a dropped one removes its row, a new
-- dependency can only come with a changed view.
CREATE FUNCTION compaction.derived_state_current()
RETURNS boolean
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN coalesce((
        SELECT st.stamp = (SELECT pg_catalog.string_agg(o.oid::text || ':' || o.xmin::text, ','
                                                        ORDER BY o.oid)
                           FROM (SELECT rw.oid, rw.xmin FROM pg_catalog.pg_rewrite AS rw
                                 WHERE rw.oid = ANY (st.object_oids)
                                 UNION ALL
                                 SELECT tg.oid, tg.xmin FROM pg_catalog.pg_trigger AS tg
                                 WHERE tg.oid = ANY (st.object_oids) AND tg.tgenabled = 'A') AS o)
        FROM compaction.source_tracking AS st), false);
END
$$;
COMMENT ON FUNCTION compaction.derived_state_current() IS
    'True when the derived state is in use: it was rebuilt under the source views and tracking triggers that exist now (else every function judges from the views)';

CREATE FUNCTION compaction.derived_state_status()
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN compaction.derived_state_current() THEN 'in_use'
                WHEN compaction.source_stamp() IS NULL THEN 'untracked'
                ELSE 'not_rebuilt' END
$$;
COMMENT ON FUNCTION compaction.derived_state_status() IS
    'in_use (derived state kept and used), not_rebuilt (tracked, but CALL compaction.rebuild_derived_state() has not run since the views or triggers changed), untracked (some table behind the views has no tracking triggers: every call judges from the views)';

-- Revision 0048: whether a read of one conversation may use its derived state. The
-- derived pairs judge the conversation by its own rows (docs/contract.md §3 but the
-- foreign-message rule, which only other conversations' tracking sees change): they are the
-- conversation's pairs while no foreign message names one of their runs. The record of
-- foreign messages is read first, whole (it holds only messages waiting for their Run or
-- misfiled: one short read, on Citus of every shard), then the few run ids it names are
-- looked up among the conversation's pairs, each on its own (see compaction.rederive on
-- pairs_run_hash_idx). Two statements: the second reads only the conversation's shard.
CREATE FUNCTION compaction.derived_state_serves(p_conversation_id text)
RETURNS boolean
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_named text[];
BEGIN
    IF NOT compaction.derived_state_current() THEN
        RETURN false;
    END IF;
    SELECT pg_catalog.array_agg(DISTINCT f.run_id) INTO v_named
    FROM compaction.foreign_messages AS f;
    IF v_named IS NULL THEN
        RETURN true;
    END IF;
    RETURN NOT EXISTS (
        SELECT 1
        FROM pg_catalog.unnest(v_named) AS k (run_id)
        CROSS JOIN LATERAL (
            SELECT 1 FROM compaction.pairs AS p
            WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
              AND p.run_id = k.run_id
              AND (p.conversation_id = p_conversation_id) IS TRUE
            OFFSET 0) AS q);
END
$$;
COMMENT ON FUNCTION compaction.derived_state_serves(text) IS
    'True when reads of this conversation use the derived state: it is in use (derived_state_current) and no foreign message (contract §3) names a run of one of the conversation''s derived pairs (else its reads judge it from the views)';

-- ==== sql/20_pairs.sql ====
-- pycompactor stored logic, section 2: eligible pairs, the window policy, source binding.
--
-- The read functions run as the engine owner (SECURITY DEFINER): the source views run
-- with their owner's rights anyway, and the audit views must be able to recompute a hash
-- for a role that may never read message text itself. They switch JIT off: they are
-- short OLTP statements, and on freshly loaded, unanalyzed tables a misestimated function
-- scan would otherwise cross jit_above_cost and spend 100x the query's time compiling.

-- Shared by eligibility (content rule of pairs) and summary validation: content means a
-- character other than the six ASCII whitespace characters, so NBSP, U+3000 and
-- zero-width characters count as content. The prefix test decides almost every text from
-- its first characters, and substr() detoasts only that slice of a large message.
CREATE FUNCTION compaction.has_content(p_text text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
-- No SET clause, so the planner can inline it into the per-message aggregate of
-- judge_runs (20,000 calls for a 10,000-pair conversation). Every name, operators
-- included, is schema-qualified, so no search_path can change what it means.
AS $$
    SELECT p_text IS NOT NULL
       AND (pg_catalog.btrim(pg_catalog.substr(p_text, 1, 64),
                             E' \t\n\r\f' OPERATOR(pg_catalog.||) pg_catalog.chr(11))
                OPERATOR(pg_catalog.<>) ''
            OR pg_catalog.btrim(p_text, E' \t\n\r\f' OPERATOR(pg_catalog.||) pg_catalog.chr(11))
                OPERATOR(pg_catalog.<>) '')
$$;
COMMENT ON FUNCTION compaction.has_content(text) IS
    'True when the text has a character other than space, \t, \n, \r, \f, \v (NULL is no content)';

-- The fixed window (DESIGN §4) in one place: range k is a target iff 10k + 30 <= N, so
-- at least 30 pairs precede the first target and the newest 20 are never in one.
CREATE FUNCTION compaction.is_target(p_from_pair int, p_pairs bigint)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT p_from_pair OPERATOR(pg_catalog.>=) 0
       AND p_from_pair OPERATOR(pg_catalog.%) 10 OPERATOR(pg_catalog.=) 0
       AND p_from_pair::bigint OPERATOR(pg_catalog.+) 30 OPERATOR(pg_catalog.<=) p_pairs
$$;
COMMENT ON FUNCTION compaction.is_target(int, bigint) IS
    'The window policy: true when the range starting at from_pair is a compaction target among N eligible pairs (from_pair a non-negative multiple of 10 and from_pair + 30 <= N)';

-- One verdict per run of the conversation. The single place where §3's rules live:
-- indexed_pairs keeps the runs with no reason, explain_runs shows the reasons. It returns
-- no message text (byte lengths come from the varlena header without detoasting), so
-- judging a long conversation does not read its text.
-- Revision 0048: p_foreign = false judges the runs by the conversation's own rows
-- alone, every rule but the foreign-message one (docs/contract.md §3): what the derived
-- pairs keep (compaction.rederive_runs), since only another conversation's tracking sees
-- that rule's answer change; reads apply it through compaction.derived_state_serves.
CREATE FUNCTION compaction.judge_runs(p_conversation_id text, p_run_ids text[] DEFAULT NULL,
                                      p_foreign boolean DEFAULT true)
RETURNS TABLE (
    run_id               text,
    run_status           text,
    reason               text,
    user_message_id      text,
    user_seq             bigint,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One cached plan: a custom plan per call would cost more to plan than to run.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_foreign      text[];
    v_runs         text[];
    v_many         boolean := false;
    v_named_ids    text[];
    v_named_status text[];
BEGIN
    -- §3 (revision 0048): a run named by a foreign user or assistant message, one filed
    -- under a conversation that has no run of that id, is no pair. A message whose own
    -- conversation has a run of that id belongs to that run alone. That is the one
    -- question that crosses conversations, so it is asked on its own, by run id (a read
    -- of every shard under Citus); everything else below addresses this conversation's
    -- rows only. A message a host's view gives no conversation belongs to none and is
    -- recorded under none (compaction.foreign_messages is kept per conversation): it
    -- breaks nothing.
    -- Runs named are asked about as named (revision 0034): v_foreign is only compared
    -- with this conversation's runs below, so a named run of another conversation
    -- changes no verdict, and no read of the conversation's runs is needed. (That read,
    -- by run id and conversation in the generic plan this function keeps, was planned on
    -- the conversation's prefix of the runs' key when conversations are small on
    -- average: a write to a 10,000-run conversation read all 10,000.)
    -- A whole conversation's runs go into the question as a value when there are at most
    -- 256 of them (revision 0036): under Citus, a subquery there became a distributed
    -- subplan, its result sent to every worker before the read of every shard (9-10 ms
    -- where the value costs 3.5-6 ms up to 100 runs). A larger value, copied into each
    -- shard's query, costs more than the subplan (22 against 14 ms at 1,000 runs), so a
    -- conversation with more runs keeps the subquery.
    -- (Not read with a LIMIT: a LIMIT invites a plan that scans the table for the first
    -- rows it finds, and a host's table behind the view may be large.)
    IF NOT coalesce(p_foreign, true) THEN
        NULL;  -- the conversation's own rows only: v_foreign stays NULL
    ELSIF p_run_ids IS NULL THEN
        SELECT pg_catalog.array_agg(sr.run_id) INTO v_runs
        FROM compaction.source_runs AS sr
        WHERE sr.conversation_id = p_conversation_id;
        v_many := coalesce(pg_catalog.cardinality(v_runs) > 256, false);
    ELSE
        v_runs := p_run_ids;
    END IF;
    IF NOT coalesce(p_foreign, true) THEN
        NULL;
    ELSIF v_many THEN
        SELECT pg_catalog.array_agg(DISTINCT sm.run_id) INTO v_foreign
        FROM compaction.source_messages AS sm
        WHERE sm.run_id = ANY (ARRAY(SELECT sr.run_id
                                     FROM compaction.source_runs AS sr
                                     WHERE sr.conversation_id = p_conversation_id))
          AND sm.role IN ('user', 'assistant')
          AND sm.conversation_id <> p_conversation_id
          AND NOT EXISTS (SELECT 1 FROM compaction.source_runs AS so
                          WHERE so.conversation_id = sm.conversation_id
                            AND so.run_id = sm.run_id);
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT sm.run_id) INTO v_foreign
        FROM compaction.source_messages AS sm
        WHERE sm.run_id = ANY (v_runs)
          AND sm.role IN ('user', 'assistant')
          AND sm.conversation_id <> p_conversation_id
          AND NOT EXISTS (SELECT 1 FROM compaction.source_runs AS so
                          WHERE so.conversation_id = sm.conversation_id
                            AND so.run_id = sm.run_id);
    END IF;
    -- The runs named, found by run id first (OFFSET 0 keeps the conversation's test out
    -- of that scan): in this function's generic plan, both tests in one scan were
    -- planned on the conversation's prefix of the runs' key wherever conversations are
    -- small on average, reading every run of a large one (revision 0034). Read here, in
    -- a statement of their own (revision 0036): inside the statement below, this read of
    -- the runs by run id alone made Citus read every shard of the runs even for a whole
    -- conversation (4.6 ms against 1.2 ms for one conversation's query, sent whole to the
    -- node that holds it). Only re-derivation names runs, and it never runs on Citus.
    IF p_run_ids IS NOT NULL THEN
        SELECT pg_catalog.array_agg(n.run_id), pg_catalog.array_agg(n.status)
        INTO v_named_ids, v_named_status
        FROM (SELECT sr.run_id, sr.conversation_id, sr.status
              FROM compaction.source_runs AS sr
              WHERE sr.run_id = ANY (p_run_ids)
              OFFSET 0) AS n
        WHERE n.conversation_id = p_conversation_id;
    END IF;
    RETURN QUERY
    -- A lateral aggregate per run: the messages of each run are fetched by the run_id
    -- index, so the cost follows this conversation's size, never the table's.
    WITH runs AS (
        -- Every run of the conversation, or only the runs named: re-derivation judges
        -- the runs a write touched by the run_id index, never the whole conversation.
        SELECT sr.run_id, sr.status
        FROM compaction.source_runs AS sr
        WHERE p_run_ids IS NULL AND sr.conversation_id = p_conversation_id
        UNION ALL
        SELECT u.run_id, u.status
        FROM ROWS FROM (pg_catalog.unnest(v_named_ids), pg_catalog.unnest(v_named_status))
             AS u (run_id, status)
    ),
    per_run AS (
        SELECT r.run_id,
               r.status AS run_status,
               m.*
        FROM runs AS r
        CROSS JOIN LATERAL (
            SELECT count(*) FILTER (WHERE sm.role = 'user') AS n_user,
                   count(*) FILTER (WHERE sm.role = 'assistant') AS n_assistant,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'user'))[1] AS user_message_id,
                   (array_agg(sm.seq) FILTER (WHERE sm.role = 'user'))[1] AS user_seq,
                   bool_and(compaction.has_content(sm.content)) FILTER (WHERE sm.role = 'user')
                       AS user_has_content,
                   max(pg_catalog.octet_length(sm.content)) FILTER (WHERE sm.role = 'user')
                       AS user_bytes,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_message_id,
                   (array_agg(sm.status) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_status,
                   bool_and(compaction.has_content(sm.content)) FILTER (WHERE sm.role = 'assistant')
                       AS assistant_has_content,
                   max(pg_catalog.octet_length(sm.content)) FILTER (WHERE sm.role = 'assistant')
                       AS assistant_bytes
            FROM compaction.source_messages AS sm
            WHERE sm.conversation_id = p_conversation_id AND sm.run_id = r.run_id
              AND sm.role IN ('user', 'assistant')
        ) AS m
    )
    SELECT p.run_id,
           p.run_status,
           CASE
               WHEN p.run_status IS NULL
                 OR p.run_status NOT IN ('completed', 'partial', 'clarify_pending')
                   THEN 'run_status'
               WHEN p.run_id = ANY (v_foreign) THEN 'foreign_message'
               WHEN p.n_user = 0 THEN 'no_user_message'
               WHEN p.n_user > 1 THEN 'multiple_user_messages'
               WHEN p.n_assistant = 0 THEN 'no_assistant_message'
               WHEN p.n_assistant > 1 THEN 'multiple_assistant_messages'
               WHEN p.assistant_status IS DISTINCT FROM 'completed' THEN 'assistant_not_completed'
               WHEN NOT p.user_has_content THEN 'empty_user_content'
               WHEN NOT p.assistant_has_content THEN 'empty_assistant_content'
           END,
           p.user_message_id,
           p.user_seq,
           p.user_bytes::int,
           p.assistant_message_id,
           p.assistant_bytes::int
    FROM per_run AS p;
END
$$;
COMMENT ON FUNCTION compaction.judge_runs(text, text[], boolean) IS
    'Internal: every run of a conversation (or only those named) with the first eligibility rule it breaks (NULL when it forms a pair), its pair''s ids and UTF-8 byte lengths; no text (p_foreign = false: by the conversation''s own rows, without the foreign-message rule)';

-- The pairs as judged from the views on this call: the truth the derived state caches,
-- read when the derived state does not serve the conversation
-- (compaction.derived_state_serves).
CREATE FUNCTION compaction.judged_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_seq             bigint,
    user_message_id      text,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT (row_number() OVER w - 1)::int,
           j.run_id, j.user_seq, j.user_message_id, j.user_bytes, j.assistant_message_id,
           j.assistant_bytes
    FROM compaction.judge_runs(p_conversation_id) AS j
    WHERE j.reason IS NULL
    WINDOW w AS (ORDER BY j.user_seq, j.user_message_id)
    ORDER BY j.user_seq, j.user_message_id
$$;
COMMENT ON FUNCTION compaction.judged_pairs(text) IS
    'Internal: the eligible pairs of a conversation judged from the source views on this call (no derived state), without text';

CREATE FUNCTION compaction.indexed_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_message_id      text,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY
        SELECT p.pair_index, p.run_id, p.user_message_id, p.user_bytes,
               p.assistant_message_id, p.assistant_bytes
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id
        ORDER BY p.pair_index;
    ELSE
        RETURN QUERY
        SELECT j.pair_index, j.run_id, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes
        FROM compaction.judged_pairs(p_conversation_id) AS j
        ORDER BY j.pair_index;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.indexed_pairs(text) IS
    'Eligible pairs of a conversation without their text: pair_index, run and message ids, UTF-8 byte lengths (what planning and projection need before reading any text)';

-- Texts are fetched by message id for the pairs asked for only; the run and role are
-- matched too, so a host view with a duplicated message id cannot graft a stranger's text.
CREATE FUNCTION compaction.eligible_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_message_id      text,
    user_content         text,
    assistant_message_id text,
    assistant_content    text
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_indexes    int[];
    v_runs       text[];
    v_users      text[];
    v_assistants text[];
BEGIN
    -- The pairs first, then their texts: one statement each (DESIGN §11).
    SELECT pg_catalog.array_agg(i.pair_index ORDER BY i.pair_index),
           pg_catalog.array_agg(i.run_id ORDER BY i.pair_index),
           pg_catalog.array_agg(i.user_message_id ORDER BY i.pair_index),
           pg_catalog.array_agg(i.assistant_message_id ORDER BY i.pair_index)
    INTO v_indexes, v_runs, v_users, v_assistants
    FROM compaction.indexed_pairs(p_conversation_id) AS i;
    RETURN QUERY
    SELECT i.pair_index, i.run_id, i.user_message_id, u.content, i.assistant_message_id, a.content
    FROM ROWS FROM (pg_catalog.unnest(v_indexes), pg_catalog.unnest(v_runs),
                    pg_catalog.unnest(v_users), pg_catalog.unnest(v_assistants))
         AS i (pair_index, run_id, user_message_id, assistant_message_id)
    JOIN compaction.source_messages AS u
      ON u.conversation_id = p_conversation_id AND u.message_id = i.user_message_id
     AND u.run_id = i.run_id AND u.role = 'user'
    JOIN compaction.source_messages AS a
      ON a.conversation_id = p_conversation_id AND a.message_id = i.assistant_message_id
     AND a.run_id = i.run_id AND a.role = 'assistant'
    ORDER BY i.pair_index;
END
$$;
COMMENT ON FUNCTION compaction.eligible_pairs(text) IS
    'Settled user/assistant pairs of a conversation, ordered by the user message (seq, message_id); pair_index is 0-based';

-- While the derived state serves the conversation (revision 0012; 0048: and no foreign
-- message names one of its pairs' runs), a run that holds a pair there is eligible
-- without judging it again (the derived state is exact, and a run's verdict does not
-- depend on the other runs: re-derivation judges runs one by one the same way);
-- only the runs without a pair are judged, for their reasons. check-source calls this
-- for every sampled conversation, and judging a run through a host's views can be dear
-- (the Agents SDK recipe parses each item's JSON).
CREATE FUNCTION compaction.explain_runs(p_conversation_id text)
RETURNS TABLE (run_id text, run_status text, eligible boolean, reason text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_unpaired text[];
    v_runs     text[];
    v_statuses text[];
    v_reasons  text[];
    v_seqs     bigint[];
BEGIN
    IF NOT compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY
        SELECT j.run_id, j.run_status, j.reason IS NULL, j.reason
        FROM compaction.judge_runs(p_conversation_id) AS j
        ORDER BY j.reason IS NULL, j.user_seq NULLS FIRST, j.run_id;
        RETURN;
    END IF;
    -- The runs without a pair are judged, for their reasons. Each step is a statement of
    -- its own, results passed on in arrays (DESIGN §11: no engine function nested in a
    -- query on distributed tables).
    SELECT pg_catalog.array_agg(sr.run_id) INTO v_unpaired
    FROM compaction.source_runs AS sr
    WHERE sr.conversation_id = p_conversation_id
      AND NOT EXISTS (SELECT 1 FROM compaction.pairs AS p
                      WHERE p.conversation_id = p_conversation_id AND p.run_id = sr.run_id);
    SELECT pg_catalog.array_agg(j.run_id), pg_catalog.array_agg(j.run_status),
           pg_catalog.array_agg(j.reason), pg_catalog.array_agg(j.user_seq)
    INTO v_runs, v_statuses, v_reasons, v_seqs
    FROM compaction.judge_runs(p_conversation_id, coalesce(v_unpaired, '{}')) AS j;
    RETURN QUERY
    SELECT v.run_id, v.run_status, v.reason IS NULL, v.reason
    FROM (SELECT sr.run_id, sr.status AS run_status, NULL::text AS reason, p.user_seq
          FROM compaction.source_runs AS sr
          JOIN compaction.pairs AS p
            ON p.conversation_id = p_conversation_id AND p.run_id = sr.run_id
          WHERE sr.conversation_id = p_conversation_id
          UNION ALL
          SELECT j.run_id, j.run_status, j.reason, j.user_seq
          FROM ROWS FROM (pg_catalog.unnest(v_runs), pg_catalog.unnest(v_statuses),
                          pg_catalog.unnest(v_reasons), pg_catalog.unnest(v_seqs))
               AS j (run_id, run_status, reason, user_seq)) AS v
    ORDER BY v.reason IS NULL, v.user_seq NULLS FIRST, v.run_id;
END
$$;
COMMENT ON FUNCTION compaction.explain_runs(text) IS
    'Every run of a conversation with whether it forms a pair and, if not, the first rule it breaks (no message text)';

-- enc(s) = 4-byte big-endian length of UTF-8(s), then UTF-8(s); the database is UTF8,
-- so convert_to(..., 'UTF8') is the text's own bytes. The hash of a range is the SHA-256
-- of enc(u0 id) enc(u0 text) enc(a0 id) enc(a0 text) ... enc(a9 text).
CREATE FUNCTION compaction.range_hash(p_conversation_id text, p_message_ids text[])
RETURNS text
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- plpgsql, not sql: PostgreSQL before 18 plans a SQL function's body again in every
-- statement that calls it (about 0.3 ms for this join, paid by each Run that completes a
-- range); plpgsql keeps the plan for the session.
AS $$
BEGIN
    -- p_message_ids is [u0, a0, ..., u9, a9]: the hash input walks it two by two.
    RETURN (
        SELECT CASE WHEN pg_catalog.cardinality(p_message_ids) = 20
                     AND count(*) = 20 THEN
                   pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                       pg_catalog.int4send(pg_catalog.octet_length(ids.id))
                       || pg_catalog.convert_to(ids.id, 'UTF8')
                       || pg_catalog.int4send(pg_catalog.octet_length(m.content))
                       || pg_catalog.convert_to(m.content, 'UTF8'),
                       ''::bytea ORDER BY ids.ord)), 'hex')
               END
        FROM pg_catalog.unnest(p_message_ids) WITH ORDINALITY AS ids (id, ord)
        -- Each message looked up on its own (a lateral subquery, kept apart by OFFSET 0):
        -- a join was planned, once this function's plan turned generic, as a hash join
        -- over the conversation's messages wherever conversations are small on average,
        -- and every range a write completed in a large conversation read all of its
        -- messages (revision 0035).
        CROSS JOIN LATERAL (
            SELECT sm.content FROM compaction.source_messages AS sm
            WHERE sm.conversation_id = p_conversation_id AND sm.message_id = ids.id
            OFFSET 0) AS m);
END
$$;
COMMENT ON FUNCTION compaction.range_hash(text, text[]) IS
    'Source hash of a range of one conversation given its 20 current source ids [u0, a0, ..., u9, a9], reading only those messages; NULL unless all 20 are found exactly once';

-- Revision 0041: a flat array of ids cut back into its ranges of 20 ([u0, a0, ..., u9,
-- a9] each), numbered from 1 in order. The callers that judge from the views pass many
-- ranges' ids between their statements in one array (DESIGN §11: a statement of their
-- own for each engine function); a subscript of a text[] inside a query walks the array
-- from its start, so slicing each range out of it cost the square of the ranges (55 ms
-- for 1,000 ranges, more than hashing them). One pass instead. No SET clause, so it is
-- inlined into its callers; every name is schema-qualified.
CREATE FUNCTION compaction.id_ranges(p_ids text[])
RETURNS TABLE (k bigint, ids text[])
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT (i.ord OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog./) 20 OPERATOR(pg_catalog.+) 1,
           pg_catalog.array_agg(i.id ORDER BY i.ord)
    FROM pg_catalog.unnest(p_ids) WITH ORDINALITY AS i (id, ord)
    GROUP BY 1
$$;
COMMENT ON FUNCTION compaction.id_ranges(text[]) IS
    'Internal: a flat array of ranges'' ids cut into its ranges of 20, numbered k = 1, 2, ... in order';

-- Revision 0023: the hashes of many ranges of one conversation in one statement, with
-- range_hash's rule for each (NULL unless its 20 ids are found exactly once). The callers
-- that judge from the views (projection_summaries, plan_targets) needed one hash per range,
-- and a call of range_hash per range read the same rows in as many statements: under
-- Citus, as many queries from the coordinator. p_message_ids holds the ranges' ids in
-- the order of p_from_pairs, 20 each [u0, a0, ..., u9, a9]; a range none of whose ids is
-- found is not returned.
CREATE FUNCTION compaction.range_hashes(p_conversation_id text, p_from_pairs int[],
                                        p_message_ids text[])
RETURNS TABLE (from_pair int, source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF coalesce(pg_catalog.cardinality(p_message_ids), 0)
       <> 20 * coalesce(pg_catalog.cardinality(p_from_pairs), 0) THEN
        RAISE EXCEPTION 'range_hashes needs 20 ids per range: % ranges, % ids',
                pg_catalog.cardinality(p_from_pairs), pg_catalog.cardinality(p_message_ids)
            USING ERRCODE = 'CP020';
    END IF;
    RETURN QUERY
        SELECT p_from_pairs[(g.k + 1)::int],
               CASE WHEN count(*) = 20 THEN
                   pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                       pg_catalog.int4send(pg_catalog.octet_length(g.id))
                       || pg_catalog.convert_to(g.id, 'UTF8')
                       || pg_catalog.int4send(pg_catalog.octet_length(m.content))
                       || pg_catalog.convert_to(m.content, 'UTF8'),
                       ''::bytea ORDER BY g.ord)), 'hex')
               END
        FROM (SELECT (i.ord - 1) / 20 AS k, i.ord, i.id
              FROM pg_catalog.unnest(p_message_ids) WITH ORDINALITY AS i (id, ord)) AS g
        JOIN compaction.source_messages AS m
          ON m.conversation_id = p_conversation_id AND m.message_id = g.id
        GROUP BY g.k;
END
$$;
COMMENT ON FUNCTION compaction.range_hashes(text, int[], text[]) IS
    'Internal: range_hash of many ranges of one conversation in one statement (p_message_ids: 20 ids per range, in the order of p_from_pairs)';

-- One range of a conversation as it is now: how many pairs the conversation has, and
-- the range's 20 source ids and hash when pairs from_pair .. from_pair+9 all exist.
-- Where claim, source_hash and the worker's reads learn what is current; with the
-- derived state in use, claim (revision 0045) and range_replies make its read of
-- compaction.ranges themselves, sparing a set-returning definer's call.
CREATE FUNCTION compaction.current_range(p_conversation_id text, p_from_pair int)
RETURNS TABLE (pair_count bigint, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_pairs bigint;
    v_ids   text[];
BEGIN
    IF compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY
        SELECT coalesce((SELECT cs.pair_count::bigint FROM compaction.conversation_state AS cs
                         WHERE cs.conversation_id = p_conversation_id), 0),
               r.source_message_ids, r.source_hash
        FROM (SELECT 1) AS one
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
        RETURN;
    END IF;
    -- Judged from the views: the number of pairs needs no text; the hash reads the
    -- range's 20 messages and nothing else.
    SELECT count(*),
           ARRAY(SELECT pg_catalog.unnest(array_agg(
               ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)
               FILTER (WHERE j.pair_index BETWEEN p_from_pair AND p_from_pair::bigint + 9)))
    INTO v_pairs, v_ids
    FROM compaction.judged_pairs(p_conversation_id) AS j;
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0
       OR pg_catalog.cardinality(v_ids) <> 20 THEN
        RETURN QUERY SELECT v_pairs, NULL::text[], NULL::text;
    ELSE
        RETURN QUERY SELECT v_pairs, v_ids, compaction.range_hash(p_conversation_id, v_ids);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.current_range(text, int) IS
    'Internal: the conversation''s pair count and, when pairs from_pair..from_pair+9 exist, their 20 current source ids and hash';

-- Revision 0023: current_range for many ranges of one conversation. From the derived
-- state, one read of the ranges asked for; judged from the views, one judgement and one
-- statement of hashes for all of them, where a call of current_range per range judged
-- the whole conversation each time (a projection or an audit of stale summaries cost the
-- square of the history). Each range asked for whose 10 pairs exist now, with its 20
-- ids and hash (NULL, as range_hash's, when its messages are not all found once).
CREATE FUNCTION compaction.current_ranges(p_conversation_id text, p_from_pairs int[])
RETURNS TABLE (from_pair int, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_from int[];
    v_ids  text[];
BEGIN
    IF compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY
        SELECT r.from_pair, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair = ANY (p_from_pairs)
        ORDER BY r.from_pair;
        RETURN;
    END IF;
    -- v_ids: each complete range's 20 ids [u0, a0, ..., u9, a9], in v_from's order; then
    -- their hashes, one statement each (DESIGN §11).
    SELECT pg_catalog.array_agg(c.from_pair ORDER BY c.from_pair),
           ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(c.ids ORDER BY c.from_pair)))
    INTO v_from, v_ids
    FROM (SELECT (j.pair_index / 10 * 10)::int AS from_pair,
                 ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(
                     ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)))
                     AS ids
          FROM compaction.judged_pairs(p_conversation_id) AS j
          WHERE j.pair_index / 10 * 10 = ANY (p_from_pairs)
          GROUP BY j.pair_index / 10 * 10
          HAVING count(*) = 10) AS c;
    RETURN QUERY
    SELECT u.from_pair, g.ids, h.source_hash
    FROM ROWS FROM (pg_catalog.unnest(v_from)) WITH ORDINALITY AS u (from_pair, k)
    JOIN compaction.id_ranges(v_ids) AS g ON g.k = u.k
    LEFT JOIN compaction.range_hashes(p_conversation_id, v_from, v_ids) AS h
      ON h.from_pair = u.from_pair
    ORDER BY u.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.current_ranges(text, int[]) IS
    'Internal: current_range for many ranges of one conversation (one judgement from the views, or one read of the derived state): each range asked for whose 10 pairs exist, with its 20 current source ids and hash';

-- Revision 0038: the targets among the ranges asked for (all of them when none is named),
-- judged once. plan_targets is this with none named; compaction.claim_targets names the
-- ranges a worker is about to claim, so that a batch of claims judges the conversation
-- once, and hashes only the ranges it claims.
CREATE FUNCTION compaction.target_ranges(p_conversation_id text, p_from_pairs int[] DEFAULT NULL)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_from int[];
    v_ids  text[];
BEGIN
    IF compaction.derived_state_serves(p_conversation_id) THEN
        IF p_from_pairs IS NULL THEN
            RETURN QUERY
            SELECT r.from_pair, r.from_pair + 9, r.source_message_ids, r.source_hash
            FROM compaction.ranges AS r
            JOIN compaction.conversation_state AS cs ON cs.conversation_id = r.conversation_id
            WHERE r.conversation_id = p_conversation_id
              AND compaction.is_target(r.from_pair, cs.pair_count)
            ORDER BY r.from_pair;
        ELSE
            -- The ranges named, each by key (a worker names a few of a long conversation).
            RETURN QUERY
            SELECT r.from_pair, r.from_pair + 9, r.source_message_ids, r.source_hash
            FROM compaction.ranges AS r
            JOIN compaction.conversation_state AS cs ON cs.conversation_id = r.conversation_id
            WHERE r.conversation_id = p_conversation_id AND r.from_pair = ANY (p_from_pairs)
              AND compaction.is_target(r.from_pair, cs.pair_count)
            ORDER BY r.from_pair;
        END IF;
        RETURN;
    END IF;
    -- Judged from the views: the targets' ids, then all their hashes in one statement
    -- (revision 0023; range_hash per target before).
    WITH pairs AS (
        SELECT j.pair_index / 10 * 10 AS from_pair,
               j.pair_index,
               j.user_message_id,
               j.assistant_message_id,
               count(*) OVER () AS n_pairs
        FROM compaction.judged_pairs(p_conversation_id) AS j
    ),
    ranges AS (
        SELECT p.from_pair,
               -- unnest of the 10x2 array walks it row by row: [u0, a0, u1, a1, ...]
               ARRAY(SELECT pg_catalog.unnest(array_agg(
                   ARRAY[p.user_message_id, p.assistant_message_id] ORDER BY p.pair_index)))
                   AS ids
        FROM pairs AS p
        WHERE compaction.is_target(p.from_pair, p.n_pairs)
          AND (p_from_pairs IS NULL OR p.from_pair = ANY (p_from_pairs))
        GROUP BY p.from_pair
    )
    SELECT pg_catalog.array_agg(r.from_pair::int ORDER BY r.from_pair),
           ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(r.ids ORDER BY r.from_pair)))
    INTO v_from, v_ids
    FROM ranges AS r;
    RETURN QUERY
    SELECT u.from_pair, u.from_pair + 9, g.ids, h.source_hash
    FROM ROWS FROM (pg_catalog.unnest(v_from)) WITH ORDINALITY AS u (from_pair, k)
    JOIN compaction.id_ranges(v_ids) AS g ON g.k = u.k
    LEFT JOIN compaction.range_hashes(p_conversation_id, v_from, v_ids) AS h
      ON h.from_pair = u.from_pair
    ORDER BY u.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.target_ranges(text, int[]) IS
    'Internal: the ranges named (all when NULL) that the window policy makes targets now, with their 20 source ids and hash, from one judgement (plan_targets and claim_targets)';

CREATE FUNCTION compaction.plan_targets(p_conversation_id text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT t.from_pair, t.to_pair, t.source_message_ids, t.source_hash
    FROM compaction.target_ranges(p_conversation_id) AS t
$$;
COMMENT ON FUNCTION compaction.plan_targets(text) IS
    'Ranges of 10 pairs the fixed window policy makes targets now (N >= 10k + 30), with their 20 source ids [u0, a0, ..., u9, a9] and source hash';

CREATE FUNCTION compaction.source_hash(p_conversation_id text, p_from_pair int)
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT c.source_hash
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS c
    WHERE p_from_pair >= 0 AND p_from_pair % 10 = 0
$$;
COMMENT ON FUNCTION compaction.source_hash(text, int) IS
    'SHA-256 (lowercase hex) binding pairs from_pair..from_pair+9 (ids and texts of both sides); NULL unless all 10 pairs exist and from_pair is a non-negative multiple of 10';

-- ==== sql/25_tracking.sql ====
-- pycompactor stored logic, section 2b: keeping the derived state (sql/15_derived_state.sql).
--
-- compaction.track_source_changes() is an AFTER ... FOR EACH STATEMENT trigger with
-- transition tables. The reference tables carry it below; a host that re-points the source
-- views attaches it to its own tables (docs/integrating.md), naming in its arguments the
-- column that holds the conversation id and the one that holds the run id, as the views
-- expose them (cast to text). Per statement it re-derives each touched conversation once,
-- from the earliest changed position on (compaction.rederive): appending a Run costs the
-- work of that Run, an edit in the middle re-numbers and re-hashes from that point on,
-- and a 10,000-row INSERT re-derives once, not 10,000 times.
--
-- Writers of one conversation's derived state serialise on its compaction.conversation_state
-- row, updated first (once per transaction: later statements of the transaction hold it
-- already): at READ COMMITTED the second writer waits and then sees the first's commit; at
-- REPEATABLE READ or SERIALIZABLE it fails with a serialization error rather than number
-- pairs from a snapshot that misses the other writer's rows.

-- Revision 0030: whether a tracked write may leave a conversation to a rebuild. Called
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

-- Revision 0048: the conversation's record of foreign messages (docs/contract.md §3,
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
    -- Each run named looked up on its own, by key (a lateral subquery per run, kept apart
    -- by OFFSET 0, as in rederive, revision 0035); its messages only when the conversation
    -- has no such run (the common answer: it has). As EXISTS tests, the generic plan may
    -- hash a subquery instead, reading every run of the conversation once per write.
    WITH judged AS (
        SELECT k.run_id, r.held IS NULL AND coalesce(m.found, false) AS is_foreign
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
    ), gone AS (
        DELETE FROM compaction.foreign_messages AS f
        USING judged AS j
        WHERE f.conversation_id = p_conversation_id AND f.run_id = j.run_id
          AND NOT j.is_foreign
    )
    INSERT INTO compaction.foreign_messages (conversation_id, run_id)
    SELECT p_conversation_id, j.run_id FROM judged AS j WHERE j.is_foreign
    ON CONFLICT (conversation_id, run_id) DO NOTHING;
END
$$;
COMMENT ON FUNCTION compaction.refresh_foreign_messages(text, text[]) IS
    'Internal: with the conversation''s conversation_state row held, records which of the run ids named (NULL: all) the conversation''s foreign user/assistant messages name (contract §3), from its own rows';

-- Re-derives one conversation's pairs and ranges after a write touched the runs named
-- (NULL: every run of the conversation). Most writes take a short path of a few lookups
-- by key: the touched runs form no pair before or after the write (a Run inserted as
-- running, a message of a Run not settled yet: three of the four statements an agent
-- writes per Run; since revision 0047 also a Run written settled before its messages, as
-- the worked example's application writes a turn), or their pairs are new and come after
-- the last pair (the Run settled at the end of the conversation; compaction.rederive_runs).
-- Anything else (a pair changed, vanished or moved, a Run inserted before others) goes to
-- compaction.rederive_general.
--
-- Revision 0030: the tracking triggers pass their table (p_table): while the derived
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
    v_runs  text[] := p_run_ids;
    v_count int;
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
    IF p_table IS NOT NULL
       AND EXISTS (SELECT 1 FROM compaction.source_tracking AS st
                   WHERE st.singleton
                     AND (st.rebuild_after < p_conversation_id
                          OR (st.rebuild_after IS NULL
                              AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t
                                              WHERE t.tgrelid = p_table
                                                AND t.oid = ANY (st.object_oids)))))
       AND compaction.defer_to_rebuild(p_conversation_id) THEN
        RETURN;
    END IF;
    -- Revision 0048: the conversation's foreign messages first; the pairs below are
    -- judged by its own rows alone.
    PERFORM compaction.refresh_foreign_messages(p_conversation_id, p_run_ids);

    IF v_runs IS NULL THEN
        v_runs := ARRAY(SELECT sr.run_id FROM compaction.source_runs AS sr
                        WHERE sr.conversation_id = p_conversation_id
                        UNION
                        SELECT p.run_id FROM compaction.pairs AS p
                        WHERE p.conversation_id = p_conversation_id);
    -- Each run named is looked up on its own (a lateral subquery per run, kept apart by
    -- OFFSET 0), never as "run_id = ANY (the runs) of this conversation": the trigger's
    -- generic plan prices an array as ten probes, so wherever conversations are small on
    -- average it found them on the conversation's prefix of a key, and every tracked
    -- write to a large conversation read all its runs and pairs (revision 0035).
    ELSIF NOT EXISTS (SELECT 1
                      FROM pg_catalog.unnest(v_runs) AS k (run_id)
                      CROSS JOIN LATERAL (
                          SELECT 1 FROM compaction.source_runs AS sr
                          WHERE sr.run_id = k.run_id
                            AND sr.conversation_id = p_conversation_id
                            -- judge_runs' first rule: only a Run in one of these can pair
                            -- (track_source_changes asks the same, word for word)
                            AND sr.status IN ('completed', 'partial', 'clarify_pending')
                            -- and only one with a user message of its own (revision
                            -- 0047; 0048: a message belongs to its own conversation's
                            -- run, docs/contract.md §3, so no other conversation is
                            -- read). A Run written in its final state before its
                            -- messages ends here, unjudged.
                            AND EXISTS (SELECT 1 FROM compaction.source_messages AS sm
                                        WHERE sm.run_id = k.run_id
                                          AND sm.conversation_id = p_conversation_id
                                          AND sm.role = 'user')
                          OFFSET 0) AS r)
          AND NOT EXISTS (SELECT 1
                          FROM pg_catalog.unnest(v_runs) AS k (run_id)
                          CROSS JOIN LATERAL (
                              -- The conversation as a filter, not an index condition
                              -- (revision 0044): the only index for this lookup is then
                              -- pairs_run_hash_idx. As a condition, where pairs has no
                              -- statistics yet, the planner read the conversation's
                              -- primary key entries as well (a BitmapAnd), all of them for
                              -- every tracked write.
                              SELECT 1 FROM compaction.pairs AS p
                              WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                                AND p.run_id = k.run_id
                                AND (p.conversation_id = p_conversation_id) IS TRUE
                              OFFSET 0) AS q) THEN
        -- No touched Run can form a pair, and none had one: nothing derived changes.
        -- One statement instead of judging the Runs' messages.
        RETURN;
    END IF;
    PERFORM compaction.rederive_runs(p_conversation_id, v_runs, v_count);
END
$$;
COMMENT ON FUNCTION compaction.rederive(text, text[], oid) IS
    'Internal: re-derives one conversation''s pairs and ranges after a write touched the runs named (NULL: all), from the earliest changed position on; from a tracking trigger (p_table, its table), not when a rebuild will derive the conversation after this transaction (compaction.defer_to_rebuild)';

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
BEGIN
    -- In one statement: the pairs these runs form now (pair_index is set below), the
    -- rows they had, and whether every new pair comes after the last pair.
    WITH fresh AS (
        SELECT j.run_id, j.user_seq, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes
        -- by the conversation's own rows (revision 0048; see judge_runs)
        FROM compaction.judge_runs(p_conversation_id, p_run_ids, false) AS j
        WHERE j.reason IS NULL
    )
    SELECT (SELECT coalesce(array_agg(ROW(p_conversation_id, f.run_id, 0, f.user_seq,
                                          f.user_message_id, f.user_bytes,
                                          f.assistant_message_id,
                                          f.assistant_bytes)::compaction.pairs), '{}')
            FROM fresh AS f),
           -- None where the conversation has no pair (a rebuild's first pass). A few runs
           -- (a write's): each run's pair looked up on its own, as in rederive (revision
           -- 0035), a run named twice once. Many (the whole conversation re-derived, a
           -- bulk statement): the conversation's pairs joined with them, where as many
           -- probes would cost more. A generic plan keeps both; the one-time tests pick.
           (SELECT coalesce(array_agg(s.p), '{}')
            FROM (SELECT q.p
                  FROM (SELECT DISTINCT k.run_id
                        FROM pg_catalog.unnest(p_run_ids) AS k (run_id)
                        WHERE p_pair_count > 0 AND pg_catalog.cardinality(p_run_ids) <= 16) AS k
                  CROSS JOIN LATERAL (
                      -- the conversation as a filter: see rederive (revision 0044)
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
                    -- row, not hashed (30,000 runs: 23.9 s a conversation, revision 0034)
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
    IF v_new / 10 > p_pair_count / 10 THEN
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
BEGIN
    -- Sizes and the assistant side change in place; the position (seq, user id) cannot.
    -- A few runs (an edit's): each run's pair found through the run index, the
    -- conversation as a filter (see rederive, revision 0044; as an index condition, where
    -- pairs had no statistics yet, every edit also read the conversation's primary key
    -- entries). Many (a whole conversation re-derived): the conversation's pairs joined
    -- with them through the primary key's prefix, where as many probes would cost more.
    IF pg_catalog.cardinality(v_fresh) <= 16 THEN
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
        -- first one met walking pair_index down from the end (revision 0025: no index of
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
    -- under it (revision 0035).
    v_held := ARRAY(
        SELECT DISTINCT q.pair_index / 10 * 10
        FROM pg_catalog.unnest(v_touched) AS k (run_id)
        CROSS JOIN LATERAL (
            -- the conversation as a filter: see rederive (revision 0044)
            SELECT p.pair_index FROM compaction.pairs AS p
            WHERE pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
              AND p.run_id = k.run_id
              AND (p.conversation_id = p_conversation_id) IS TRUE
            OFFSET 0) AS q);
    v_ranges := v_ranges || v_held;
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

-- The trigger. Arguments: the name of the column holding the conversation id, and of the
-- column holding the run id ('' when the table has none: the touched conversations are
-- then re-derived whole); their text form must be what the views expose. Transition
-- tables must be named new_rows and old_rows.
CREATE FUNCTION compaction.track_source_changes()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One cached plan per statement: the transition tables and the runs' key lookups plan
-- the same for every write, and a custom plan per statement cost more than running it.
SET plan_cache_mode = force_generic_plan
-- Every lookup here (and in the rederive functions it calls) is by key. A generic plan
-- made while the tables were still small would scan them instead, and a long transaction
-- (a bulk import into a new database: no ANALYZE in between) would pay for that on every
-- statement, quadratically.
SET enable_seqscan = off
AS $$
DECLARE
    v_conversation_column text := TG_ARGV[0];
    v_run_column          text := nullif(TG_ARGV[1], '');
    v_conversations       text[] := '{}';
    v_runs                text[] := '{}';
    v_conversation        text;
    v_run_ids             text[];
    v_count               int;
    v_unchanged           boolean;
    v_touched             record;
    v_message_ids         text[];
    v_first_seq           bigint;
    v_first_id            text;
    v_runs_known          boolean := v_run_column IS NOT NULL;
BEGIN
    IF TG_LEVEL <> 'STATEMENT' OR TG_WHEN <> 'AFTER' OR TG_NARGS NOT IN (2, 3)
       OR v_conversation_column IS NULL THEN
        RAISE EXCEPTION 'track_source_changes must be an AFTER ... FOR EACH STATEMENT trigger with two or three arguments: the conversation id column, the run id column (or ''''), and for a table without a run column optionally its message id column'
            USING ERRCODE = 'CP020';
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        -- No transition table says what went: stop trusting the derived state until a
        -- rebuild (every function judges from the views meanwhile, exact and slower).
        -- A rebuild's resume point goes too (revision 0030): the conversations before it
        -- lost rows no trigger re-derived, so the next rebuild starts over, and one under
        -- way fails at its next commit instead of putting them in use.
        UPDATE compaction.source_tracking
        SET stamp = NULL, object_oids = NULL, stamped_at = NULL,
            rebuild_stamp = NULL, rebuild_after = NULL, rebuild_done = NULL,
            rebuild_total = NULL, rebuild_started_at = NULL, rebuild_updated_at = NULL;
        RETURN NULL;
    END IF;

    -- The columns named by the arguments, as text (the form the views expose them in).
    -- Static statements over the transition tables keep their plans across calls, where
    -- dynamic SQL would be planned again for every statement of the host. Columns named
    -- conversation_id and run_id (the reference tables) are read directly: plpgsql plans
    -- a statement only when it first runs, per table, so these never meet a table
    -- without them; other names go through the row as jsonb.
    IF v_conversation_column = 'conversation_id' AND v_run_column = 'run_id' THEN
        IF TG_OP = 'INSERT' THEN
            SELECT coalesce(array_agg(n.conversation_id::text), '{}'),
                   coalesce(array_agg(n.run_id::text), '{}')
            INTO v_conversations, v_runs
            FROM new_rows AS n;
        ELSIF TG_OP = 'DELETE' THEN
            SELECT coalesce(array_agg(o.conversation_id::text), '{}'),
                   coalesce(array_agg(o.run_id::text), '{}')
            INTO v_conversations, v_runs
            FROM old_rows AS o;
        ELSE
            SELECT coalesce(array_agg(r.conversation_id), '{}'), coalesce(array_agg(r.run_id), '{}')
            INTO v_conversations, v_runs
            FROM (SELECT n.conversation_id::text, n.run_id::text FROM new_rows AS n
                  UNION ALL
                  SELECT o.conversation_id::text, o.run_id::text FROM old_rows AS o)
                AS r (conversation_id, run_id);
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM new_rows AS n
        CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(n) AS fields) AS j;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM old_rows AS o
        CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(o) AS fields) AS j;
    ELSE
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM (SELECT pg_catalog.to_jsonb(n) AS fields FROM new_rows AS n
              UNION ALL
              SELECT pg_catalog.to_jsonb(o) FROM old_rows AS o) AS j;
    END IF;

    v_conversation := v_conversations[1];

    -- A table without a run column (its runs are derived by the views, as in the Agents
    -- SDK recipe) that names its message id column: an INSERT into one conversation
    -- touches the runs the view gives the new messages, and the run of the message just
    -- before the earliest of them (an insert can cut that run short). An append then
    -- re-derives its own run, not the whole conversation. Updates and deletes re-derive
    -- the conversation: the run a message left cannot be known once it has left. When
    -- the view shows none of the new messages, or one without a seq, the same.
    -- Each new message is looked up by its id on its own (revision 0039, as revision
    -- 0035 does for the runs): asked as "these ids of this conversation", the generic
    -- plan priced the ids as ten and read the conversation's prefix of an index instead,
    -- every entry of a long conversation twice an insert (in a 30,000-item session of
    -- the Agents SDK's table, an append 4.5 ms against 2.2 ms at 600 items).
    IF NOT v_runs_known AND TG_NARGS = 3 AND TG_OP = 'INSERT'
       AND v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        v_message_ids := ARRAY(SELECT j.fields ->> TG_ARGV[2]
                               FROM new_rows AS n
                               CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(n) AS fields) AS j);
        SELECT sm.seq, sm.message_id INTO v_first_seq, v_first_id
        FROM pg_catalog.unnest(v_message_ids) AS k (message_id)
        CROSS JOIN LATERAL (
            SELECT s.seq, s.message_id
            FROM compaction.source_messages AS s
            WHERE s.message_id = k.message_id AND s.conversation_id = v_conversation
            OFFSET 0) AS sm
        ORDER BY sm.seq NULLS FIRST, sm.message_id
        LIMIT 1;
        IF v_first_seq IS NOT NULL THEN
            v_runs := ARRAY(
                SELECT sm.run_id
                FROM pg_catalog.unnest(v_message_ids) AS k (message_id)
                CROSS JOIN LATERAL (
                    SELECT s.run_id
                    FROM compaction.source_messages AS s
                    WHERE s.message_id = k.message_id AND s.conversation_id = v_conversation
                    OFFSET 0) AS sm
                UNION
                (SELECT sp.run_id
                 FROM compaction.source_messages AS sp
                 WHERE sp.conversation_id = v_conversation
                   AND (sp.seq, sp.message_id) < (v_first_seq, v_first_id)
                 ORDER BY sp.seq DESC, sp.message_id DESC
                 LIMIT 1));
            v_runs_known := true;
        END IF;
    END IF;

    -- The common statement (an agent's single-row writes): its rows name one conversation.
    -- Revision 0048: a statement re-derives only the conversations its rows name, by
    -- their own rows (docs/contract.md §3: a message belongs to its own conversation's
    -- run of its run id, and a foreign one is recorded under its own conversation,
    -- compaction.foreign_messages; §11), so no other conversation is asked about here.
    IF v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        IF NOT v_runs_known THEN
            PERFORM compaction.rederive(v_conversation, NULL, TG_RELID);
            RETURN NULL;
        END IF;
        v_run_ids := pg_catalog.array_remove(v_runs, NULL);
        IF pg_catalog.cardinality(v_run_ids) = 0 THEN
            RETURN NULL;  -- rows of no run: no pair can change
        ELSIF pg_catalog.cardinality(v_run_ids) > 2 THEN
            v_run_ids := ARRAY(SELECT DISTINCT r.run_id
                               FROM pg_catalog.unnest(v_run_ids) AS r (run_id));
        END IF;
        -- For a later statement of a transaction that already holds this conversation's
        -- conversation_state row (see rederive): rederive's no-change question and the
        -- pair count, in one statement: its snapshot is taken after the lock was, so it
        -- sees what rederive would see. An agent's second and third statements per Run
        -- end here.
        SELECT cs.pair_count,
               CASE WHEN cs.pair_count IS NOT NULL THEN
                   -- rederive's no-change test, word for word
                   NOT EXISTS (SELECT 1
                               FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                               CROSS JOIN LATERAL (
                                   SELECT 1 FROM compaction.source_runs AS sr
                                   WHERE sr.run_id = k.run_id
                                     AND sr.conversation_id = v_conversation
                                     AND sr.status IN ('completed', 'partial', 'clarify_pending')
                                     AND EXISTS (SELECT 1
                                                 FROM compaction.source_messages AS sm
                                                 WHERE sm.run_id = k.run_id
                                                   AND sm.conversation_id = v_conversation
                                                   AND sm.role = 'user')
                                   OFFSET 0) AS r)
                   AND NOT EXISTS (SELECT 1
                                   FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                                   CROSS JOIN LATERAL (
                                       -- the conversation as a filter: see rederive
                                       -- (revision 0044)
                                       SELECT 1 FROM compaction.pairs AS p
                                       WHERE pg_catalog.hashtext(p.run_id)
                                             = pg_catalog.hashtext(k.run_id)
                                         AND p.run_id = k.run_id
                                         AND (p.conversation_id = v_conversation) IS TRUE
                                       OFFSET 0) AS q)
               END
        INTO v_count, v_unchanged
        FROM (SELECT) AS one
        LEFT JOIN compaction.conversation_state AS cs
          ON cs.conversation_id = v_conversation
         AND cs.xmin = pg_catalog.pg_current_xact_id()::xid;
        IF v_count IS NULL THEN
            PERFORM compaction.rederive(v_conversation, v_run_ids, TG_RELID);
            RETURN NULL;
        END IF;
        -- The row is held: the record of foreign messages first, as rederive does (also
        -- for a conversation left to a rebuild below, which derives it again whole).
        PERFORM compaction.refresh_foreign_messages(v_conversation, v_run_ids);
        IF v_unchanged THEN
            NULL;
        ELSIF EXISTS (SELECT 1 FROM compaction.source_tracking AS st
                      WHERE st.singleton
                        AND (st.rebuild_after < v_conversation
                             OR (st.rebuild_after IS NULL
                                 AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t
                                                 WHERE t.tgrelid = TG_RELID
                                                   AND t.oid = ANY (st.object_oids)))))
              AND compaction.defer_to_rebuild(v_conversation) THEN
            NULL;  -- left to the rebuild (compaction.rederive's test)
        ELSE
            PERFORM compaction.rederive_runs(v_conversation, v_run_ids, v_count);
        END IF;
        RETURN NULL;
    END IF;

    -- Each touched conversation once, in a fixed order (concurrent bulk writers lock
    -- conversation_state rows in one order), with the runs its rows name.
    FOR v_touched IN
        SELECT t.conversation_id,
               array_agg(DISTINCT t.run_id) FILTER (WHERE t.run_id IS NOT NULL) AS run_ids
        FROM ROWS FROM (pg_catalog.unnest(v_conversations), pg_catalog.unnest(v_runs))
             AS t (conversation_id, run_id)
        WHERE t.conversation_id IS NOT NULL
        GROUP BY t.conversation_id
        ORDER BY t.conversation_id
    LOOP
        IF v_run_column IS NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, NULL, TG_RELID);
        ELSIF v_touched.run_ids IS NOT NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, v_touched.run_ids, TG_RELID);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.track_source_changes() IS
    'Trigger (AFTER ... FOR EACH STATEMENT, transition tables new_rows/old_rows; arguments: conversation id column, run id column or ''''): keeps the derived state of the conversations a statement touched';

-- The reference tables are tracked from the start. ENABLE ALWAYS: logical replication's
-- apply (session_replication_role = replica) keeps the derived state too.
CREATE TRIGGER runs_track_insert
    AFTER INSERT ON compaction_source.runs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER runs_track_update
    AFTER UPDATE ON compaction_source.runs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER runs_track_delete
    AFTER DELETE ON compaction_source.runs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER runs_track_truncate
    AFTER TRUNCATE ON compaction_source.runs
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER messages_track_insert
    AFTER INSERT ON compaction_source.messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER messages_track_update
    AFTER UPDATE ON compaction_source.messages
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER messages_track_delete
    AFTER DELETE ON compaction_source.messages
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
CREATE TRIGGER messages_track_truncate
    AFTER TRUNCATE ON compaction_source.messages
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.track_source_changes('conversation_id', 'run_id');
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_insert;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_update;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_delete;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_track_truncate;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_track_insert;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_track_update;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_track_delete;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_track_truncate;

-- ---------------------------------------------------------------------------------------
-- Attaching the tracking to a host's own tables
-- ---------------------------------------------------------------------------------------

-- Runs with the caller's rights (the host table's owner creates triggers on its table);
-- it needs EXECUTE on track_source_changes, which the engine's owner grants.
--
-- Revision 0019: online on a busy table. CREATE TRIGGER waits for every transaction
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

-- The oracle (DESIGN §2): recomputes one conversation from the views and names every
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
    -- that reads no engine table (revision 0022): on Citus a statement that reads a
    -- distributed table runs on the shard, where these functions cannot run theirs.
    -- Revision 0048: the pairs as the conversation's own rows make them (every rule of
    -- docs/contract.md §3 but the foreign-message one, which reads apply from the record
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

-- Every conversation, in conversation id order, then the stamp that puts the derived
-- state in use. Writes during the rebuild are tracked; while the derived state is not in
-- use, a write to a conversation the rebuild has not reached (or, before a rebuild starts,
-- a write through a trigger attached since the stamp) is left to it (revision 0030,
-- compaction.defer_to_rebuild). The stamp is set only if the source stamp did not change
-- while the rebuild ran. Call it outside a transaction block:
-- CALL compaction.rebuild_derived_state();
--
-- Revision 0019: it scales and resumes. The next conversation is one index probe (the
-- least id after the last one done, among the source's runs and the derived state's
-- conversations), never a selection over every run; a transaction derives at most
-- p_batch conversations and commits once it has held their rows for 20 ms, so a host
-- write waits at most about that long for a conversation the rebuild holds; each commit
-- moves the resume point in compaction.source_tracking, so a cancelled rebuild (or one
-- that failed) continues after the last conversation it committed, as long as the
-- source stamp is the same. Progress with a rate and an ETA: NOTICEs about once a
-- second, and the view compaction.rebuild_progress. Each conversation is re-derived by
-- compaction.rederive_conversation(id), which addresses that conversation alone (DESIGN
-- §11).
--
-- Revision 0030: before a commit moves the resume point past a batch, the rebuild takes
-- source_tracking's row FOR UPDATE, so it waits for the writers that left a conversation
-- of the batch to it; a conversation one of them created was invisible to the ordered
-- reads, so the resume point moves only up to the first such conversation, and the next
-- batch derives it. The last commit stamps the derived state under that lock. A TRUNCATE
-- under way clears the resume point (the trigger above): the rebuild then fails at its
-- next commit.
--
-- Revision 0031: the rebuild never waits for a writer long while it holds a batch. A
-- writer's transaction may hold one conversation (or source_tracking's row, having left a
-- conversation to the rebuild) and then ask for a conversation the batch holds; had the
-- rebuild waited for the writer meanwhile, PostgreSQL would break the deadlock after
-- deadlock_timeout by failing whichever began waiting first, often the writer. So a
-- conversation a writer holds, or whose conversation_state row a writer is creating (its
-- first tracked write since the tracking was attached), ends the batch before it; and
-- the lock on source_tracking is waited for at most 100 ms: past that, the batch is
-- rolled back, the rebuild waits holding nothing, and derives the batch again. Two
-- rebuilds may run at once (each process of a deploy runs `pycompactor migrate`): the
-- shared resume point only moves forward, and one that finds the derived state put in
-- use by the other returns.
CREATE PROCEDURE compaction.rebuild_derived_state(p_batch int DEFAULT 100,
                                                  p_restart boolean DEFAULT false)
LANGUAGE plpgsql
-- No SET clause: a procedure with one cannot COMMIT. Every name below is qualified.
AS $$
DECLARE
    v_stamp     text;
    v_after     text;
    v_from      text;
    v_next      text;
    v_batch     text[];
    v_held      text;
    v_missed    text;
    v_gave_way  boolean := false;
    v_lock_wait text;
    v_placed    int;
    v_busy      boolean;
    v_done      bigint;
    v_total     bigint;
    v_resumed   bigint;
    v_began     timestamptz := pg_catalog.clock_timestamp();
    v_batch_at  timestamptz;
    v_noted_at  timestamptz := pg_catalog.clock_timestamp();
    v_rate      double precision;
BEGIN
    IF p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'rebuild_derived_state needs a batch size of at least 1' USING ERRCODE = 'CP020';
    END IF;
    v_stamp := compaction.source_stamp();
    IF v_stamp IS NULL THEN
        RAISE EXCEPTION 'the source is not tracked: some table behind compaction.source_runs / compaction.source_messages has no enabled-always track_source_changes trigger for INSERT, UPDATE, DELETE and TRUNCATE'
            USING ERRCODE = 'CP021',
                  HINT = 'Attach the tracking triggers (docs/integrating.md); without them the engine judges from the views on each call.';
    END IF;
    SELECT st.rebuild_after, st.rebuild_done, st.rebuild_total INTO v_after, v_done, v_total
    FROM compaction.source_tracking AS st
    WHERE st.rebuild_stamp = v_stamp AND NOT coalesce(p_restart, false);
    IF v_after IS NULL THEN
        -- A new rebuild: how many conversations, counted once (the ETA's denominator).
        v_after := '';
        v_done := 0;
        SELECT count(*) INTO v_total
        FROM (SELECT DISTINCT sr.conversation_id FROM compaction.source_runs AS sr) AS c;
        -- The shared resume point never moves back under one source stamp (revision
        -- 0031): another rebuild may be under way, and a writer must not leave it a
        -- conversation it has derived already (see the batch's end).
        UPDATE compaction.source_tracking AS st
        SET rebuild_stamp = v_stamp,
            rebuild_after = CASE WHEN st.rebuild_stamp = v_stamp THEN st.rebuild_after
                                 ELSE v_after END,
            rebuild_done = 0, rebuild_total = v_total, rebuild_started_at = pg_catalog.now(),
            rebuild_updated_at = pg_catalog.now();
        COMMIT;
        RAISE NOTICE 'derived state: rebuilding about % conversations', v_total;
    ELSE
        RAISE NOTICE 'derived state: resuming after conversation % (% of about % done)',
            v_after, v_done, v_total;
    END IF;
    v_resumed := v_done;
    LOOP
        -- Per transaction: every lookup of a re-derivation is by key (as in the tracking
        -- trigger), and fresh expression indexes may lack statistics; the resume point
        -- makes a commit lost in a crash cost only its batch again. JIT off as in every
        -- writer (revision 0020): with sequential scans priced out, the one-row UPDATE of
        -- the resume point costs above jit_above_cost and compiled for 35-90 ms at each
        -- commit, 60% of a rebuild's time. Generic plans, as the tracking trigger forces
        -- (revision 0035): re-derivation's statements are planned for one conversation at
        -- a time, and a custom plan for each conversation cost more to make than to run
        -- (about a tenth of a first rebuild at 200,000 messages).
        PERFORM pg_catalog.set_config('enable_seqscan', 'off', true);
        PERFORM pg_catalog.set_config('jit', 'off', true);
        PERFORM pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);
        PERFORM pg_catalog.set_config('synchronous_commit', 'off', true);
        IF v_gave_way THEN
            -- The last batch gave way (below): wait for the writers it waited for while
            -- holding nothing, then derive it again.
            PERFORM FROM compaction.source_tracking AS st WHERE st.singleton FOR UPDATE;
            COMMIT;
            v_gave_way := false;
            CONTINUE;
        END IF;
        v_from := v_after;
        v_batch := '{}';
        v_placed := 0;
        v_batch_at := pg_catalog.clock_timestamp();
        LOOP
            -- The next conversation in key order, as the first row of an ordered read:
            -- over a view that is not one table (the Agents SDK recipe's runs come from
            -- its messages) min() aggregated every row after the resume point at each
            -- step, a rebuild quadratic in the conversations (revision 0028).
            -- Revision 0048: the messages' conversations too, since a conversation with
            -- no run may hold foreign messages (compaction.foreign_messages).
            v_next := least(
                (SELECT sr.conversation_id FROM compaction.source_runs AS sr
                 WHERE sr.conversation_id > v_after
                 ORDER BY sr.conversation_id LIMIT 1),
                (SELECT sm.conversation_id FROM compaction.source_messages AS sm
                 WHERE sm.conversation_id > v_after
                 ORDER BY sm.conversation_id LIMIT 1),
                (SELECT cs.conversation_id FROM compaction.conversation_state AS cs
                 WHERE cs.conversation_id > v_after
                 ORDER BY cs.conversation_id LIMIT 1));
            EXIT WHEN v_next IS NULL;
            -- A conversation a writer holds ends the batch before it (revision 0031): the
            -- next transaction waits for it holding nothing, so the writer may go on to a
            -- conversation of this batch without a deadlock, which PostgreSQL would
            -- resolve by failing whichever of the two began waiting first.
            IF pg_catalog.cardinality(v_batch) = 0 THEN
                NULL;  -- the first of a transaction: waiting for it holds nothing
            ELSIF EXISTS (SELECT FROM compaction.conversation_state AS cs
                          WHERE cs.conversation_id = v_next) THEN
                PERFORM FROM compaction.conversation_state AS cs
                WHERE cs.conversation_id = v_next
                FOR NO KEY UPDATE SKIP LOCKED;
                EXIT WHEN NOT FOUND;
            ELSE
                -- No committed row (a conversation written before the tracking was
                -- attached): its first tracked write may be creating the row now,
                -- unseen, and inserting it would wait for that writer. Insert it without
                -- waiting, in a subtransaction; at most 32 a batch, well under the 64 a
                -- backend's snapshot entry holds before every snapshot taken anywhere
                -- must look subtransactions up.
                EXIT WHEN v_placed >= 32;
                v_placed := v_placed + 1;
                v_busy := false;
                v_lock_wait := pg_catalog.current_setting('lock_timeout');
                PERFORM pg_catalog.set_config('lock_timeout', '1ms', true);
                BEGIN
                    INSERT INTO compaction.conversation_state AS cs
                        (conversation_id, pair_count, generation)
                    VALUES (v_next, 0, 1)
                    ON CONFLICT (conversation_id) DO NOTHING;
                EXCEPTION WHEN lock_not_available THEN
                    v_busy := true;
                END;
                PERFORM pg_catalog.set_config('lock_timeout', v_lock_wait, true);
                EXIT WHEN v_busy;
            END IF;
            PERFORM compaction.rederive_conversation(v_next);
            v_after := v_next;
            v_batch := v_batch || v_next;
            EXIT WHEN pg_catalog.cardinality(v_batch) >= p_batch
                   OR pg_catalog.clock_timestamp() - v_batch_at >= interval '20 milliseconds';
        END LOOP;
        -- The writers that left a conversation of this batch (or, at the end, any after
        -- it) to the rebuild have ended once this lock is had; see the comment above. A
        -- writer that holds it may be waiting for a conversation of the batch: past 100
        -- ms (well below deadlock_timeout, 1 s by default) the batch gives way, undone,
        -- rather than let PostgreSQL fail the writer (revision 0031).
        v_lock_wait := pg_catalog.current_setting('lock_timeout');
        PERFORM pg_catalog.set_config('lock_timeout', '100ms', true);
        BEGIN
            SELECT st.rebuild_stamp INTO v_held
            FROM compaction.source_tracking AS st
            WHERE st.singleton
            FOR UPDATE;
        EXCEPTION WHEN lock_not_available THEN
            v_gave_way := true;
        END;
        IF v_gave_way THEN
            ROLLBACK;
            v_after := v_from;
            CONTINUE;
        END IF;
        PERFORM pg_catalog.set_config('lock_timeout', v_lock_wait, true);
        IF v_held IS DISTINCT FROM v_stamp THEN
            -- Another rebuild under the same source (a second `pycompactor migrate` of a
            -- deploy) derived every conversation and stamped: this one's work is done.
            IF v_held IS NULL AND compaction.derived_state_current()
               AND (SELECT st.stamp FROM compaction.source_tracking AS st) = v_stamp THEN
                COMMIT;
                RAISE NOTICE 'derived state: in use, put there by another rebuild (% conversations this run)',
                    v_done - v_resumed + pg_catalog.cardinality(v_batch);
                RETURN;
            END IF;
            RAISE EXCEPTION 'the source was truncated, or a rebuild under changed source views started, while this rebuild ran; run it again'
                USING ERRCODE = 'CP021';
        END IF;
        -- Two statements, so that the batch's end bounds the index scan: with the bound
        -- in an OR, a repair over a populated derived state read every conversation after
        -- the batch at each commit.
        IF v_next IS NULL THEN
            SELECT cs.conversation_id INTO v_missed
            FROM compaction.conversation_state AS cs
            WHERE cs.conversation_id > v_from
              AND cs.conversation_id <> ALL (v_batch)
            ORDER BY cs.conversation_id
            LIMIT 1;
        ELSE
            SELECT cs.conversation_id INTO v_missed
            FROM compaction.conversation_state AS cs
            WHERE cs.conversation_id > v_from AND cs.conversation_id <= v_after
              AND cs.conversation_id <> ALL (v_batch)
            ORDER BY cs.conversation_id
            LIMIT 1;
        END IF;
        IF v_missed IS NOT NULL THEN
            -- Up to the conversation before it: the next batch starts with it.
            v_batch := ARRAY(SELECT b.id FROM pg_catalog.unnest(v_batch) AS b (id)
                             WHERE b.id < v_missed);
            v_after := coalesce((SELECT max(b.id) FROM pg_catalog.unnest(v_batch) AS b (id)),
                                v_from);
        END IF;
        v_done := v_done + pg_catalog.cardinality(v_batch);
        -- Every conversation derived: stamped below, under this lock.
        EXIT WHEN v_next IS NULL AND v_missed IS NULL;
        -- Forward only: a rebuild ahead of this one has derived the conversations up to
        -- its point, and a writer must find them past the resume point, not left to a
        -- rebuild that another's stamp may end first.
        UPDATE compaction.source_tracking AS st
        SET rebuild_after = GREATEST(st.rebuild_after, v_after), rebuild_done = v_done,
            rebuild_updated_at = pg_catalog.clock_timestamp()
        WHERE st.singleton;
        COMMIT;
        IF pg_catalog.clock_timestamp() - v_noted_at >= interval '1 second' THEN
            v_noted_at := pg_catalog.clock_timestamp();
            v_rate := (v_done - v_resumed)
                      / greatest(extract(epoch FROM v_noted_at - v_began), 0.001);
            RAISE NOTICE 'derived state: % of about % conversations, % a second, about % s left',
                v_done, v_total, round(v_rate::numeric, 1),
                round((greatest(v_total - v_done, 0) / greatest(v_rate, 0.001))::numeric);
        END IF;
    END LOOP;
    v_rate := (v_done - v_resumed)
              / greatest(extract(epoch FROM pg_catalog.clock_timestamp() - v_began), 0.001);
    RAISE NOTICE 'derived state: % conversations (% this run, % a second)',
        v_done, v_done - v_resumed, round(v_rate::numeric, 1);
    PERFORM compaction.stamp_derived_state(v_stamp);
    COMMIT;
END
$$;
COMMENT ON PROCEDURE compaction.rebuild_derived_state(int, boolean) IS
    'Repair and upgrade step: re-derives every conversation in id order, committing at most p_batch conversations or 20 ms of work at a time and never waiting for a writer long while it holds them, resuming after the last committed one when the source is unchanged (p_restart: start over), then puts the derived state in use; CALL outside a transaction block';

CREATE FUNCTION compaction.stamp_derived_state(p_stamp text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- A view re-pointed or a trigger disabled while the rebuild ran: the rows derived
    -- before that may be stale, so the derived state stays out of use.
    IF p_stamp IS NULL OR p_stamp IS DISTINCT FROM compaction.source_stamp() THEN
        RAISE EXCEPTION 'the source views or tracking triggers changed during the rebuild; run it again'
            USING ERRCODE = 'CP021';
    END IF;
    UPDATE compaction.source_tracking
    SET stamp = p_stamp,
        object_oids = ARRAY(SELECT pg_catalog.split_part(o.item, ':', 1)::oid
                            FROM pg_catalog.unnest(pg_catalog.string_to_array(p_stamp, ',')) AS o (item)),
        stamped_at = pg_catalog.now(),
        rebuild_stamp = NULL, rebuild_after = NULL, rebuild_done = NULL,
        rebuild_total = NULL, rebuild_started_at = NULL, rebuild_updated_at = NULL;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.stamp_derived_state(text) IS
    'Internal: last step of rebuild_derived_state: puts the derived state in use under the given source stamp, unless the source changed meanwhile';

CREATE VIEW compaction.rebuild_progress AS
    SELECT st.rebuild_done AS done,
           st.rebuild_total AS total,
           st.rebuild_after AS resume_after,
           st.rebuild_started_at AS started_at,
           st.rebuild_updated_at AS updated_at,
           st.rebuild_stamp = compaction.source_stamp() AS resumable,
           CASE WHEN st.rebuild_updated_at > st.rebuild_started_at THEN
               st.rebuild_done / extract(epoch FROM st.rebuild_updated_at - st.rebuild_started_at)
           END AS per_second,
           CASE WHEN st.rebuild_updated_at > st.rebuild_started_at AND st.rebuild_done > 0 THEN
               (st.rebuild_updated_at - st.rebuild_started_at)
               * (greatest(st.rebuild_total - st.rebuild_done, 0)::double precision / st.rebuild_done)
           END AS eta
    FROM compaction.source_tracking AS st
    WHERE st.rebuild_stamp IS NOT NULL;
COMMENT ON VIEW compaction.rebuild_progress IS
    'A rebuild under way or stopped: conversations done of about total, the resume point, whether a CALL compaction.rebuild_derived_state() now continues from it, the rate over its life (per second) and the time left at that rate; no row when none is under way';

-- ==== sql/30_claims.sql ====
-- pycompactor stored logic, section 3: jobs, attempts, summaries, claims and completion.
-- The queue (31_queue.sql), reaping (32_reaping.sql) and imports (33_import.sql) follow.
--
-- Layout. An identity (conversation_id, scope, from_pair, to_pair, source_hash, model,
-- prompt_version) is one row of compaction.jobs, made by its first claim or by an import,
-- and never changed. Each claim of it appends one row to compaction.attempts (at most
-- two: attempts_at_most_two). A completed summary is one row of compaction.job_summaries
-- (one per identity: job_summaries_one_per_identity), written by complete() or
-- import_summary(). compaction.summaries is the public view over them.
--
-- Concurrency. Every writer of one conversation's rows first locks that conversation's
-- row of compaction.conversation_locks until commit (lock_conversation; an advisory lock
-- until revision 0018, which any login could take), so a claim's checks and inserts see
-- a settled state; the partial unique index attempts_one_running and the
-- unique index job_summaries_one_per_identity remain the final word if a caller runs
-- at REPEATABLE READ and the lock's guarantee weakens. Admission is a semaphore of rows:
-- compaction.admission holds slots 1..10000, of which claims use 1..settings.max_running,
-- and an admitting claim takes a free slot with FOR UPDATE SKIP LOCKED, so claims admit in parallel, the
-- count is exact at READ COMMITTED, and at REPEATABLE READ or SERIALIZABLE a claim whose
-- snapshot missed another's slot update gets a serialization failure instead of a second
-- admission. A small global table: a reference table under Citus.
--
-- Time and inputs. The server owns time: p_now is honoured only for a superuser or a
-- member of compaction_owner (caller_now); leases lie within 1 second..1 day
-- (checked_lease); reasons that reach the auditor are codes (checked_reason); identifiers
-- that become index keys are bounded (oversized_identifier, revision 0018).
--
-- Ownership (revision 0018). An attempt belongs to the login that claimed it
-- (attempts.claimed_by, session_user inside claim): complete, fail and heartbeat from any
-- other login, the owner and superusers aside, answer lease_lost and change nothing
-- (fence).
--
-- Citus (DESIGN §11, revision 0013): conversation_id leads every primary key, unique index
-- and foreign key between per-conversation tables (jobs, attempts, job_summaries, queue,
-- event_log); their ids come from plain sequences, which Citus gives each node a range
-- of, and nothing orders by them; no trigger on them touches another row: the admission
-- slots and the log's rows are written by the functions below, and an attempt's guard
-- stamps only its own row.

-- ---------------------------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------------------------

CREATE TABLE compaction.settings (
    singleton   boolean NOT NULL DEFAULT true,
    max_running int NOT NULL DEFAULT 8,
    -- Revision 0026, internal: no unexpired attempt holds a slot above it (see
    -- settings_high_water below). Kept by the engine, never set by hand.
    admission_high_water int NOT NULL DEFAULT 0,
    -- Revision 0048: the owner's model preference among a range's valid summaries
    -- (docs/contract.md §9), set through compaction.set_projection_models, which also
    -- re-judges the verdicts it decides.
    projection_models text[] NOT NULL DEFAULT '{}',
    CONSTRAINT settings_pkey PRIMARY KEY (singleton),
    -- With the primary key, at most one row can exist.
    CONSTRAINT settings_single_row CHECK (singleton),
    CONSTRAINT settings_max_running_not_negative CHECK (max_running >= 0),
    -- One admission slot row per unit: a typo must not create a billion of them.
    CONSTRAINT settings_max_running_bounded CHECK (max_running <= 10000),
    -- A NULL element would name no model (set_projection_models also refuses repeats).
    CONSTRAINT settings_projection_models_named CHECK (
        pg_catalog.array_position(projection_models, NULL) IS NULL
        AND pg_catalog.cardinality(projection_models) <= 100)
);
COMMENT ON TABLE compaction.settings IS
    'Engine settings, a single row: max_running caps running (unexpired) attempts across the database (default 8); projection_models orders a range''s valid summaries by model (set with set_projection_models); admission_high_water is the engine''s own';
COMMENT ON COLUMN compaction.settings.projection_models IS
    'The owner''s model preference for projection (docs/contract.md §9): among a range''s valid summaries of one prompt version, a model named earlier before one named later, named before unnamed; empty by default; set with compaction.set_projection_models';
COMMENT ON COLUMN compaction.settings.admission_high_water IS
    'Internal (revision 0026): no unexpired attempt holds an admission slot above this; at least max_running, raised with it, lowered only by a claim that found the slots above max_running free';

-- Where claims look for attempts admitted before max_running was lowered (revision 0026).
-- Until then an index on the slots' holders answered "the highest held slot", and kept
-- every slot update from being HOT: each claim and each finished attempt wrote three
-- index entries (docs/benchmarks.md). Now the settings row remembers the highest
-- max_running since the slots above the current one were last found free; a claim that
-- finds them free again lowers it (claim), under the transaction-local mark
-- compaction.lowering_high_water, the only way it goes down.
CREATE FUNCTION compaction.settings_high_water()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'UPDATE'
       AND pg_catalog.current_setting('compaction.lowering_high_water', true)
           IS DISTINCT FROM 'on' THEN
        NEW.admission_high_water := GREATEST(NEW.admission_high_water,
                                             OLD.admission_high_water, OLD.max_running);
    END IF;
    NEW.admission_high_water := GREATEST(NEW.admission_high_water, NEW.max_running);
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION compaction.settings_high_water() IS
    'Trigger: keeps settings.admission_high_water at least max_running and never lowers it, except inside a claim that found the slots above max_running free';
CREATE TRIGGER settings_high_water
    BEFORE INSERT OR UPDATE ON compaction.settings
    FOR EACH ROW EXECUTE FUNCTION compaction.settings_high_water();
-- Also for session_replication_role = replica: a replicated max_running still raises it.
ALTER TABLE compaction.settings ENABLE ALWAYS TRIGGER settings_high_water;
INSERT INTO compaction.settings (singleton, max_running) VALUES (true, 8);

CREATE TABLE compaction.prompt_versions (
    prompt_version   text NOT NULL,
    input_kind       text NOT NULL,
    projectable      boolean NOT NULL,
    accepts_new_jobs boolean NOT NULL,
    CONSTRAINT prompt_versions_pkey PRIMARY KEY (prompt_version),
    CONSTRAINT prompt_versions_input_kind_valid CHECK (input_kind IN ('mixed', 'assistant_only'))
);
COMMENT ON TABLE compaction.prompt_versions IS
    'Known prompt versions: input kind, whether their summaries may be projected, whether claims may start new jobs with them';
-- A migration that adds a version also writes it into compaction.job_rules_hold, which
-- holds every job to these versions (revision 0046: no foreign key locks their rows).
INSERT INTO compaction.prompt_versions (prompt_version, input_kind, projectable, accepts_new_jobs)
VALUES ('conversation-compaction@1', 'mixed', false, false),
       ('conversation-compaction@2', 'assistant_only', true, false),
       ('conversation-compaction@3', 'assistant_only', true, true);

-- Shape rules shared by claim (refusal reasons), import_summary (errors) and the tables'
-- CHECK constraints (last line of defence against direct writes by the owner).
--
-- The small rules below run on every claim and completion, in both the functions and the
-- CHECK constraints. Revision 0016: they carry no SET clause, so that the planner inlines
-- the SQL ones into their callers' expressions (as has_content and is_target, sql/
-- 20_pairs.sql), instead of planning each body again in every transaction; every name,
-- operators included, is schema-qualified, so no search_path can change what they mean.
-- valid_source_ids needs a subquery, which rules inlining out: PL/pgSQL keeps its plan
-- for the session instead.
--
-- Revision 0032: the rules a CHECK constraint calls are PL/pgSQL (attempt_rules_hold
-- already was). PostgreSQL prepares a table's CHECK expressions again in every statement
-- that writes the table, and an SQL function inlined there has its body parsed each time:
-- summary_problem and valid_source_hash, inlined into the CHECKs of job_summaries and
-- jobs, were 6.1% of a claim -> complete cycle's instructions (docs/benchmarks.md).
-- PL/pgSQL compiles a body once per session. valid_source_hash also tests its characters
-- with ltrim instead of a regular expression: the pattern's 64-fold repetition cost about
-- 75,000 instructions a call, twice a cycle, where the test below costs a few thousand.
CREATE FUNCTION compaction.valid_source_ids(p_source_message_ids text[])
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    RETURN p_source_message_ids IS NOT NULL
       AND pg_catalog.array_ndims(p_source_message_ids) OPERATOR(pg_catalog.=) 1
       AND pg_catalog.cardinality(p_source_message_ids) OPERATOR(pg_catalog.=) 20
       AND pg_catalog.array_position(p_source_message_ids, NULL::pg_catalog.text) IS NULL
       AND (SELECT pg_catalog.count(DISTINCT i.id)
            FROM pg_catalog.unnest(p_source_message_ids) AS i (id)) OPERATOR(pg_catalog.=) 20;
END
$$;
COMMENT ON FUNCTION compaction.valid_source_ids(text[]) IS
    'Internal: true when the array holds exactly 20 distinct non-null ids (one dimension)';

CREATE FUNCTION compaction.valid_source_hash(p_source_hash text)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    -- What '^[0-9a-f]{64}$' matches: 64 bytes, every one of them in the set (a character
    -- outside it, multibyte or not, is left by ltrim).
    RETURN p_source_hash IS NOT NULL
       AND pg_catalog.octet_length(p_source_hash) OPERATOR(pg_catalog.=) 64
       AND pg_catalog.ltrim(p_source_hash, '0123456789abcdef') OPERATOR(pg_catalog.=) '';
END
$$;
COMMENT ON FUNCTION compaction.valid_source_hash(text) IS
    'Internal: true when the text is 64 lowercase hexadecimal characters (a SHA-256 in hex)';

-- NULL when the text is an acceptable summary, else the reason it is not.
CREATE FUNCTION compaction.summary_problem(p_summary text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    RETURN CASE
               WHEN NOT compaction.has_content(p_summary) THEN 'empty'
               -- characters, not bytes: 6,000 four-byte emoji are a valid summary
               WHEN pg_catalog.char_length(p_summary) OPERATOR(pg_catalog.>) 6000 THEN 'too_long'
           END;
END
$$;
COMMENT ON FUNCTION compaction.summary_problem(text) IS
    'Internal: NULL for a valid summary text, else empty (NULL or whitespace only) or too_long (over 6,000 characters)';

-- complete()'s verdict on a model reply, in the contract's order (DESIGN §6): complete
-- records it, and the worker asks it before --min-figure-retention (only a reply that
-- complete would accept can fail that gate), so Python keeps no copy of the rule.
CREATE FUNCTION compaction.reply_problem(p_summary text, p_finish_reason text,
                                         p_tool_call_count int)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    -- IS DISTINCT FROM, with the operator named: a NULL is neither 'stop' nor 0.
    SELECT CASE
               WHEN NOT coalesce(p_finish_reason OPERATOR(pg_catalog.=) 'stop', false)
                   THEN 'not_stopped'
               WHEN NOT coalesce(p_tool_call_count OPERATOR(pg_catalog.=) 0, false)
                   THEN 'tool_calls'
               ELSE compaction.summary_problem(p_summary)
           END
$$;
COMMENT ON FUNCTION compaction.reply_problem(text, text, int) IS
    'NULL when complete() would accept this reply, else its reason: not_stopped, tool_calls, empty or too_long (checked in that order)';

-- Every rule of a jobs row (the CHECK jobs_rules, revision 0045), as attempt_rules_hold
-- is the attempts': one CHECK whose stored form a claim's insert reads and plans, where
-- five did (about 1% of a claim -> complete cycle's instructions, docs/benchmarks.md). A
-- broken rule is the check_violation of its own name, as when each was a CHECK of its own,
-- and the first of them in the order PostgreSQL checked those (by name):
-- jobs_model_not_empty, jobs_range_valid (from_pair a multiple of 10 from 0, to_pair
-- from_pair + 9), jobs_scope_not_empty, jobs_source_hash_valid, jobs_source_ids_valid.
-- Last, as the foreign key it replaces was checked after the CHECKs (revision 0046), a
-- version compaction.prompt_versions does not hold is that key's foreign_key_violation
-- (23503, jobs_prompt_version_fkey), so a caller sees the error it saw before. The key's
-- check locked the version's row FOR KEY SHARE at every claim, and concurrent claims all
-- lock the same row: each overlap made a MultiXact, whose ids a database spends for good
-- (783 per 1,000 claims at 8 connections, docs/benchmarks.md). The lock guarded against a
-- delete or a change of key that prompt_versions_guard refuses anyway, for the owner
-- too. So the versions are written out here: a version is added by a migration only, and
-- that migration replaces this function with the version added
-- (tests/sql/test_prompt_versions.py holds the two to the same versions). Written out,
-- not read from prompt_versions: the CHECK also runs on Citus shards, where a query of a
-- reference table inside it would be a distributed query of its own. A rule passes when
-- it is NULL, as a CHECK does. PL/pgSQL with no SET clause and every name qualified, as
-- the rules it calls.
CREATE FUNCTION compaction.job_rules_hold(
    p_from_pair int, p_to_pair int, p_source_message_ids text[], p_source_hash text,
    p_scope text, p_model text, p_prompt_version text)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
DECLARE
    v_rule text;
BEGIN
    v_rule := CASE
        WHEN (p_model OPERATOR(pg_catalog.<>) '') IS FALSE THEN 'jobs_model_not_empty'
        WHEN (p_from_pair OPERATOR(pg_catalog.>=) 0
              AND (p_from_pair OPERATOR(pg_catalog.%) 10) OPERATOR(pg_catalog.=) 0
              AND p_to_pair OPERATOR(pg_catalog.=) (p_from_pair OPERATOR(pg_catalog.+) 9)) IS FALSE
            THEN 'jobs_range_valid'
        WHEN (p_scope OPERATOR(pg_catalog.<>) '') IS FALSE THEN 'jobs_scope_not_empty'
        WHEN compaction.valid_source_hash(p_source_hash) IS FALSE THEN 'jobs_source_hash_valid'
        WHEN compaction.valid_source_ids(p_source_message_ids) IS FALSE THEN 'jobs_source_ids_valid'
    END;
    IF v_rule IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "jobs" violates check constraint "%"', v_rule
            USING ERRCODE = 'check_violation', CONSTRAINT = v_rule, TABLE = 'jobs',
                  SCHEMA = 'compaction';
    END IF;
    IF (p_prompt_version OPERATOR(pg_catalog.=) ANY ('{conversation-compaction@1,'
            'conversation-compaction@2,conversation-compaction@3}'::text[])) IS FALSE THEN
        RAISE EXCEPTION 'insert or update on table "jobs" violates foreign key constraint "jobs_prompt_version_fkey"'
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'jobs_prompt_version_fkey',
                  TABLE = 'jobs', SCHEMA = 'compaction',
                  DETAIL = pg_catalog.format(
                      'Key (prompt_version)=(%s) is not present in table "prompt_versions".',
                      p_prompt_version),
                  HINT = 'A prompt version is added by a migration, which writes it into compaction.job_rules_hold too.';
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.job_rules_hold(int, int, text[], text, text, text, text) IS
    'Internal: the CHECK jobs_rules; true when every rule of a jobs row holds, else the check_violation (23514) named after the broken rule (jobs_model_not_empty, jobs_range_valid, jobs_scope_not_empty, jobs_source_hash_valid, jobs_source_ids_valid), or for a version compaction.prompt_versions does not hold the foreign_key_violation (23503) jobs_prompt_version_fkey';

-- Ids are unique, never ordered: under Citus each node draws from its own range.
CREATE SEQUENCE compaction.jobs_job_id_seq AS bigint;
CREATE TABLE compaction.jobs (
    conversation_id    text NOT NULL,
    job_id             bigint NOT NULL DEFAULT pg_catalog.nextval('compaction.jobs_job_id_seq'),
    scope              text NOT NULL,
    from_pair          int NOT NULL,
    to_pair            int NOT NULL,
    source_message_ids text[] NOT NULL,
    source_hash        text NOT NULL,
    model              text NOT NULL,
    prompt_version     text NOT NULL,
    created_at         timestamptz NOT NULL,
    CONSTRAINT jobs_pkey PRIMARY KEY (conversation_id, job_id),
    CONSTRAINT jobs_identity_key
        UNIQUE (conversation_id, scope, from_pair, source_hash, model, prompt_version)
);
COMMENT ON TABLE compaction.jobs IS
    'One row per compaction identity (conversation, scope, range, source hash, model, prompt version) with its 20 source ids; immutable';
ALTER SEQUENCE compaction.jobs_job_id_seq OWNED BY compaction.jobs.job_id;
-- NOT VALID (revision 0045): every row written before it was checked by the five CHECKs
-- this one replaces (and, until revision 0046, by the foreign key on prompt_version its
-- last rule replaces), and jobs are immutable, so a scan under the migration's lock would
-- find nothing; every new row is checked.
ALTER TABLE compaction.jobs
    ADD CONSTRAINT jobs_rules CHECK (compaction.job_rules_hold(
        from_pair, to_pair, source_message_ids, source_hash, scope, model,
        prompt_version)) NOT VALID;
-- complete/fail/heartbeat are addressed by job_id alone (the fencing token is
-- (job_id, attempt)); this finds the job's conversation, then everything is keyed by it.
CREATE INDEX jobs_job_id_idx ON compaction.jobs (job_id);

-- The event log (DESIGN §10) is the view compaction.audit_events (sql/50_audit.sql). Since
-- revision 0027 an attempt's own row records its two events, the claim and the end
-- (claim_* and finish_* columns below: the event id, the clock when it was written, the
-- writing transaction), so a claim -> complete cycle writes no event row; this table,
-- audit_events until then (its constraints, index, sequence and guards keep that name),
-- holds the rest: imports, erasures, the events of the attempts an erasure removes, and
-- every event written before 0027.
CREATE SEQUENCE compaction.audit_events_event_id_seq AS bigint;
CREATE TABLE compaction.event_log (
    conversation_id  text NOT NULL,
    event_id         bigint NOT NULL DEFAULT pg_catalog.nextval('compaction.audit_events_event_id_seq'),
    kind             text NOT NULL,
    occurred_at      timestamptz NOT NULL,
    -- The log's order (revision 0013): the clock when the event was written, which the
    -- engine does only while it holds the conversation, so one conversation's events
    -- follow each other exactly; event_id breaks ties and is unique, not an order.
    recorded_at      timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    -- Identifies the writing transaction (until revision 0013 the erasure guard matched
    -- the tombstone's against its own; kept for the record).
    xact_id          xid8 NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    scope            text,
    from_pair        int,
    to_pair          int,
    job_id           bigint,
    attempt          int,
    reason           text,
    worker           text,
    model            text,
    prompt_version   text,
    source_hash      text,
    summary_id       bigint,
    summary_chars    int,
    erased_jobs      int,
    erased_attempts  int,
    erased_summaries int,
    CONSTRAINT audit_events_pkey PRIMARY KEY (conversation_id, event_id),
    CONSTRAINT audit_events_kind_valid CHECK (
        kind IN ('claim', 'completion', 'failure', 'lease_expiry', 'import', 'erasure'))
);
COMMENT ON TABLE compaction.event_log IS
    'Internal: the events no attempt row records (import, erasure; the events of erased attempts; every event written before revision 0027), append-only; read them through compaction.audit_events';
ALTER SEQUENCE compaction.audit_events_event_id_seq OWNED BY compaction.event_log.event_id;
-- Revision 0007, NOT VALID for the same reason as the attempts' checks: the log is
-- append-only, earlier entries keep what they recorded.
ALTER TABLE compaction.event_log
    ADD CONSTRAINT audit_events_reason_is_code CHECK (reason ~ '^[a-z][a-z0-9_]{0,63}$') NOT VALID,
    ADD CONSTRAINT audit_events_times_finite CHECK (pg_catalog.isfinite(occurred_at)) NOT VALID;
-- The DBA reads the log newest first across conversations.
CREATE INDEX audit_events_recorded_at_idx ON compaction.event_log (recorded_at, event_id);

-- Every rule of an attempt row (the CHECK attempts_rules, revision 0021). A broken rule
-- is reported as the check_violation of its own name, as when each was a CHECK of its
-- own: attempts_at_most_two (bounded retries: the first attempt and one retry, never a
-- third), attempts_state_valid, attempts_finished_iff_terminal,
-- attempts_reason_matches_state, attempts_stats_valid (complete()'s p_stats, DESIGN §6:
-- non-negative counts, NULL when not reported), attempts_times_valid (stored times are
-- the server's, finite and ordered: revision 0007) and attempts_reason_is_code (the
-- auditor reads reasons and never sees content). A rule passes when it is NULL, as a
-- CHECK does. PL/pgSQL with no SET clause and every name qualified: the session keeps its
-- plan, and no search_path changes what it means.
CREATE FUNCTION compaction.attempt_rules_hold(
    p_attempt int, p_state text, p_reason text, p_started_at timestamptz,
    p_lease_expires_at timestamptz, p_finished_at timestamptz, p_input_tokens int,
    p_output_tokens int, p_figures_total int, p_figures_kept int)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
DECLARE
    v_rule text;
BEGIN
    v_rule := CASE
        WHEN (p_attempt OPERATOR(pg_catalog.>=) 1 AND p_attempt OPERATOR(pg_catalog.<=) 2) IS FALSE
            THEN 'attempts_at_most_two'
        WHEN (p_state OPERATOR(pg_catalog.=) ANY (ARRAY['running', 'completed', 'failed'])) IS FALSE
            THEN 'attempts_state_valid'
        WHEN ((p_state OPERATOR(pg_catalog.=) 'running') OPERATOR(pg_catalog.=) (p_finished_at IS NULL)) IS FALSE
            THEN 'attempts_finished_iff_terminal'
        WHEN (CASE p_state
                  WHEN 'running' THEN p_reason IS NULL
                  WHEN 'completed' THEN p_reason OPERATOR(pg_catalog.=) 'completed'
                  ELSE p_reason IS NOT NULL AND p_reason OPERATOR(pg_catalog.<>) ''
              END) IS FALSE
            THEN 'attempts_reason_matches_state'
        WHEN (p_input_tokens OPERATOR(pg_catalog.>=) 0 AND p_output_tokens OPERATOR(pg_catalog.>=) 0
              AND p_figures_total OPERATOR(pg_catalog.>=) 0
              AND p_figures_kept OPERATOR(pg_catalog.>=) 0
              AND p_figures_kept OPERATOR(pg_catalog.<=) p_figures_total
              AND (p_figures_kept IS NULL OR p_figures_total IS NOT NULL)) IS FALSE
            THEN 'attempts_stats_valid'
        WHEN (pg_catalog.isfinite(p_started_at) AND pg_catalog.isfinite(p_lease_expires_at)
              AND (p_finished_at IS NULL
                   OR (pg_catalog.isfinite(p_finished_at)
                       AND p_finished_at OPERATOR(pg_catalog.>=) p_started_at))) IS FALSE
            THEN 'attempts_times_valid'
        WHEN (p_reason OPERATOR(pg_catalog.~) '^[a-z][a-z0-9_]{0,63}$') IS FALSE
            THEN 'attempts_reason_is_code'
    END;
    IF v_rule IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "attempts" violates check constraint "%"', v_rule
            USING ERRCODE = 'check_violation', CONSTRAINT = v_rule, TABLE = 'attempts',
                  SCHEMA = 'compaction';
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.attempt_rules_hold(int, text, text, timestamptz, timestamptz, timestamptz, int, int, int, int) IS
    'Internal: the CHECK attempts_rules; true when every rule of an attempt row holds, else the check_violation (23514) named after the broken rule (attempts_at_most_two, attempts_state_valid, attempts_finished_iff_terminal, attempts_reason_matches_state, attempts_stats_valid, attempts_times_valid, attempts_reason_is_code)';

CREATE TABLE compaction.attempts (
    conversation_id  text NOT NULL,
    job_id           bigint NOT NULL,
    attempt          int NOT NULL,
    state            text NOT NULL,
    reason           text,
    worker           text NOT NULL,
    started_at       timestamptz NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    finished_at      timestamptz,
    finish_reason    text,
    tool_call_count  int,
    response_id      text,
    summary_chars    int,
    input_tokens     int,
    output_tokens    int,
    figures_total    int,
    figures_kept     int,
    -- The login that claimed the attempt (session_user inside claim, revision 0018): the
    -- fenced calls refuse any other login (DESIGN §6), so knowing (job_id, attempt) is not
    -- enough to finish or renew it. NULL on attempts claimed before 0018: those only the
    -- owner or a superuser can finish (their leases run out; the range is claimed again).
    claimed_by       text,
    -- The admission slot the attempt took (revision 0026), freed by that key when it ends
    -- (unless a later claim took the slot over after this lease ran out). NULL on attempts
    -- that ended before 0026.
    slot             int,
    -- The attempt's events (revision 0027; NULL on attempts claimed before it, whose claim
    -- event is in compaction.event_log): the claim's, written with the row, and the
    -- end's, stamped by attempts_guard when the attempt leaves running. Each is an id
    -- from the log's sequence, the clock when it was written (the log's order) and the
    -- writing transaction, as an event_log row has them.
    claim_event_id     bigint DEFAULT pg_catalog.nextval('compaction.audit_events_event_id_seq'),
    claim_recorded_at  timestamptz DEFAULT pg_catalog.clock_timestamp(),
    claim_xact_id      xid8 DEFAULT pg_catalog.pg_current_xact_id(),
    finish_event_id    bigint,
    finish_recorded_at timestamptz,
    finish_xact_id     xid8,
    CONSTRAINT attempts_pkey PRIMARY KEY (conversation_id, job_id, attempt),
    CONSTRAINT attempts_job_fkey FOREIGN KEY (conversation_id, job_id)
        REFERENCES compaction.jobs (conversation_id, job_id)
);
COMMENT ON TABLE compaction.attempts IS
    'Append-only attempt log: one row per claim of an identity (at most 2); only running -> completed | failed (and lease renewal) ever changes';
-- The rules of an attempt row, one CHECK (revision 0021). PostgreSQL rebuilds a table's
-- CHECK expressions from their stored form in every statement that writes a row, and
-- attempts are written twice per cycle: their seven CHECKs were about 12% of a claim ->
-- complete cycle's instructions (docs/benchmarks.md); one call of attempt_rules_hold
-- costs under half of that. NOT VALID because attempts are append-only history: rows
-- written before revision 0007 may hold an infinite time or a free-text reason, and keep
-- what they recorded (the audit views cope with them); every new or changed row is
-- checked, and the five rules older than 0007 held for every row when they were folded in.
ALTER TABLE compaction.attempts
    ADD CONSTRAINT attempts_rules CHECK (compaction.attempt_rules_hold(
        attempt, state, reason, started_at, lease_expires_at, finished_at,
        input_tokens, output_tokens, figures_total, figures_kept)) NOT VALID;
-- The final word on exclusivity: one running attempt per identity, whatever the callers do.
CREATE UNIQUE INDEX attempts_one_running
    ON compaction.attempts (conversation_id, job_id) WHERE state = 'running';

-- Admission: a semaphore of rows. Slots 1..10000 always exist (the bound on max_running,
-- revision 0013: no trigger resizes them); claims use slots 1..settings.max_running. A
-- running attempt holds one slot with a copy of its lease; a free slot has no holder, and
-- a slot whose holder's lease ran out counts as free (expired attempts never count
-- against admission). Not per conversation: under Citus a reference table. Revision
-- 0026: its only index is the primary key on slot, which no update changes, and its pages
-- are half empty, so taking, renewing and freeing a slot are HOT updates that write no
-- index entry; a slot is found by number (attempts.slot), the overflow after a lowered
-- max_running by settings.admission_high_water.
CREATE TABLE compaction.admission (
    slot                   int NOT NULL,
    holder_conversation_id text,
    holder_job_id          bigint,
    holder_attempt         int,
    lease_expires_at       timestamptz,
    CONSTRAINT admission_pkey PRIMARY KEY (slot),
    CONSTRAINT admission_slot_positive CHECK (slot >= 1),
    -- A holder is all four columns or none. Revision 0045: one call instead of three
    -- comparisons, a shorter form for each update of a slot to read and plan (the two a
    -- claim -> complete cycle makes cost 0.8% fewer instructions, docs/benchmarks.md).
    CONSTRAINT admission_holder_complete CHECK (
        pg_catalog.num_nulls(holder_conversation_id, holder_job_id, holder_attempt,
                             lease_expires_at) OPERATOR(pg_catalog.=) ANY ('{0,4}'::int[]))
) WITH (fillfactor = 50);
COMMENT ON TABLE compaction.admission IS
    'Internal: admission slots 1..10000; a running attempt holds one (with its lease), claim takes a free one among 1..settings.max_running or refuses admission_full';
INSERT INTO compaction.admission (slot)
SELECT g.slot FROM pg_catalog.generate_series(1, 10000) AS g (slot);

CREATE SEQUENCE compaction.job_summaries_summary_id_seq AS bigint;
CREATE TABLE compaction.job_summaries (
    conversation_id text NOT NULL,
    summary_id      bigint NOT NULL DEFAULT pg_catalog.nextval('compaction.job_summaries_summary_id_seq'),
    job_id          bigint NOT NULL,
    attempt         int,
    summary         text NOT NULL,
    completed_at    timestamptz NOT NULL,
    CONSTRAINT job_summaries_pkey PRIMARY KEY (conversation_id, summary_id),
    -- One completed summary per identity, ever (an identity is one jobs row).
    CONSTRAINT job_summaries_one_per_identity UNIQUE (conversation_id, job_id),
    CONSTRAINT job_summaries_job_fkey FOREIGN KEY (conversation_id, job_id)
        REFERENCES compaction.jobs (conversation_id, job_id),
    -- attempt is NULL for an imported summary (no attempt produced it here).
    CONSTRAINT job_summaries_attempt_fkey FOREIGN KEY (conversation_id, job_id, attempt)
        REFERENCES compaction.attempts (conversation_id, job_id, attempt),
    CONSTRAINT job_summaries_summary_valid CHECK (compaction.summary_problem(summary) IS NULL)
);
COMMENT ON TABLE compaction.job_summaries IS
    'Completed summaries, one per identity, immutable; attempt is NULL for imports (read them through compaction.summaries)';
ALTER SEQUENCE compaction.job_summaries_summary_id_seq OWNED BY compaction.job_summaries.summary_id;

-- ---------------------------------------------------------------------------------------
-- Claims and completion
-- ---------------------------------------------------------------------------------------

-- One row per conversation the engine has worked on, whose row lock every writer of that
-- conversation's engine rows takes first (revision 0018). Until then the lock was a
-- transaction-scoped advisory lock keyed by hashtext(conversation_id); but any login can
-- take any advisory lock, and one that held a conversation's key stalled its claims and
-- completions and made reap pass it over. Locking a row needs UPDATE on its table, which
-- no role but the owner holds (the engine's functions run as the owner). The lock writes
-- no new row version; the row itself is written once per conversation.
CREATE TABLE compaction.conversation_locks (
    conversation_id text NOT NULL,
    CONSTRAINT conversation_locks_pkey PRIMARY KEY (conversation_id)
);
COMMENT ON TABLE compaction.conversation_locks IS
    'Internal: one row per conversation the engine has worked on; its row lock serialises that conversation''s engine writers (only the owner can lock it)';

-- Serialises every writer of one conversation's engine rows (claim, complete, fail,
-- heartbeat, import_summary, erase_conversation) until commit: the first writer inserts
-- the conversation's row, every later one locks it (ON CONFLICT DO UPDATE locks the row
-- it meets even when its WHERE is false, and writes no new version). One statement, as
-- the advisory lock was; transaction-scoped, so PgBouncer-safe. At REPEATABLE READ a row
-- inserted after the snapshot is a serialization failure, like any engine row. PL/pgSQL
-- with no SET clause keeps the statement's plan for the session; every name is
-- qualified, and only the owner (the engine's definer functions) may execute it. claim
-- and fence, once per cycle each, run the statement itself rather than call this.
CREATE FUNCTION compaction.lock_conversation(p_conversation_id text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
END
$$;
COMMENT ON FUNCTION compaction.lock_conversation(text) IS
    'Internal: locks the conversation''s row of compaction.conversation_locks until commit (inserting it the first time), serialising that conversation''s engine writers';

-- The same lock, if free: reap passes over a conversation whose writer is at work (its
-- fenced call settles any expiry of the attempt it holds) instead of queueing behind it.
-- Only the engine's functions can hold the row, so only an engine writer makes reap pass.
-- Claims and imports write a conversation's row before its jobs, and revision 0018 wrote
-- one for every conversation that had jobs; a conversation without one (jobs the owner
-- inserted by hand) gets it here, so that reap never passes it over for good.
CREATE FUNCTION compaction.try_lock_conversation(p_conversation_id text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    PERFORM 1
    FROM compaction.conversation_locks AS l
    WHERE l.conversation_id OPERATOR(pg_catalog.=) p_conversation_id
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        RETURN true;
    END IF;
    IF EXISTS (SELECT 1 FROM compaction.conversation_locks AS l
               WHERE l.conversation_id OPERATOR(pg_catalog.=) p_conversation_id) THEN
        RETURN false;
    END IF;
    PERFORM compaction.lock_conversation(p_conversation_id);
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.try_lock_conversation(text) IS
    'Internal: takes lock_conversation''s row lock if it is free (true; writing the conversation''s row if it has none), else returns false at once';

-- Whether the session's login stands for the engine's owner: a superuser or a member of
-- compaction_owner. session_user, not current_user: inside the SECURITY DEFINER
-- functions current_user is always the owner. Asked only off the usual path (a given
-- p_now, a fenced call from another login than the claimer's).
CREATE FUNCTION compaction.caller_is_privileged()
RETURNS boolean
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles AS r
                   WHERE r.rolname = session_user AND r.rolsuper)
        OR pg_catalog.pg_has_role(session_user, 'compaction_owner', 'MEMBER')
$$;
COMMENT ON FUNCTION compaction.caller_is_privileged() IS
    'Internal: true when the session''s login is a superuser or a member of compaction_owner';

-- The server owns time (DESIGN §6): p_now exists for tests and repairs by a superuser or
-- the owner. The worker's calls call it only for a given p_now (revision 0045), and
-- checked_lease only for a lease out of its range: a call of a function with a SET clause
-- saves and restores the settings, which costs more than either rule.
CREATE FUNCTION compaction.caller_now(p_now timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_now IS NULL THEN
        RETURN pg_catalog.now();
    END IF;
    IF NOT compaction.caller_is_privileged() THEN
        RAISE EXCEPTION 'p_now is honoured only for a superuser or a member of compaction_owner'
            USING ERRCODE = 'CP025',
                  HINT = 'Omit p_now: the server''s clock decides leases and finish times.';
    END IF;
    IF NOT pg_catalog.isfinite(p_now) THEN
        RAISE EXCEPTION 'p_now must be a finite time, got %', p_now USING ERRCODE = 'CP022';
    END IF;
    RETURN p_now;
END
$$;
COMMENT ON FUNCTION compaction.caller_now(timestamptz) IS
    'Internal: now(), or p_now when the session user is a superuser or a member of compaction_owner (else CP025; a non-finite p_now is CP022)';

-- The longest identifiers the engine takes from a caller, in UTF-8 bytes (revision
-- 0018). They become index keys (jobs_identity_key holds conversation, scope and model
-- together, and a btree entry must fit in a third of a page, 2704 bytes: these limits
-- leave room for the hash and the rest even when nothing compresses), so a longer one
-- used to fail deep inside an insert (54000, index row requires N bytes); the worker's
-- name is kept with every attempt and event. NULL when every argument fits (NULL fits), else the
-- message naming the first one over its limit. One expression with no SET clause, so it
-- inlines into its callers (revision 0016), which it did only from revision 0021: the
-- number was joined to the text by anytextcat, which is STABLE, and an IMMUTABLE SQL
-- function whose body calls a STABLE one is not inlined; it was parsed and planned again
-- in every claim (7% of a claim -> complete cycle's instructions). Casting the number to
-- text makes every call in it immutable.
CREATE FUNCTION compaction.oversized_identifier(p_conversation_id text, p_scope text,
                                                p_model text DEFAULT NULL,
                                                p_worker text DEFAULT NULL)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT CASE
               WHEN pg_catalog.octet_length(p_conversation_id) OPERATOR(pg_catalog.>) 1024
                   THEN 'a conversation id may be at most 1024 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_conversation_id)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_scope) OPERATOR(pg_catalog.>) 1024
                   THEN 'a scope may be at most 1024 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_scope)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_model) OPERATOR(pg_catalog.>) 256
                   THEN 'a model may be at most 256 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_model)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_worker) OPERATOR(pg_catalog.>) 256
                   THEN 'a worker name may be at most 256 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_worker)::pg_catalog.text
           END
$$;
COMMENT ON FUNCTION compaction.oversized_identifier(text, text, text, text) IS
    'Internal: NULL when the conversation id (at most 1024 bytes), scope (1024), model (256) and worker name (256) fit, else the message naming the first one over its limit (callers raise CP020)';

CREATE FUNCTION compaction.checked_lease(p_lease interval)
RETURNS interval
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_lease IS NULL OR p_lease < interval '1 second' OR p_lease > interval '1 day' THEN
        RAISE EXCEPTION 'a lease must lie between 1 second and 1 day, got %', coalesce(p_lease::text, 'NULL')
            USING ERRCODE = 'CP023';
    END IF;
    RETURN p_lease;
END
$$;
COMMENT ON FUNCTION compaction.checked_lease(interval) IS
    'Internal: p_lease if it lies between 1 second and 1 day, else CP023';

-- Reasons reach the auditor, who never sees content: a code, never free text.
CREATE FUNCTION compaction.checked_reason(p_reason text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_reason IS NULL OR p_reason !~ '^[a-z][a-z0-9_]{0,63}$' THEN
        RAISE EXCEPTION 'a reason must be a code matching ^[a-z][a-z0-9_]{0,63}$ (e.g. http_error), not free text'
            USING ERRCODE = 'CP024';
    END IF;
    RETURN p_reason;
END
$$;
COMMENT ON FUNCTION compaction.checked_reason(text) IS
    'Internal: p_reason if it is a code (^[a-z][a-z0-9_]{0,63}$), else CP024; the value is never echoed in the error';

-- What follows an attempt's end (DESIGN §11: written by the engine's functions, not by
-- triggers on its tables, so that every statement addresses one conversation's rows or a
-- global table): its admission slot back, by number (revision 0026), unless another claim
-- took the slot over after the lease ran out. Called right after the write that ended
-- it, under the conversation's lock, with the attempt row that write returned. Until
-- revision 0027 this was record_attempt_change, which also wrote the attempt's event: the
-- attempt row records its own now (attempts_guard stamps the end).
CREATE FUNCTION compaction.release_slot(p_conversation_id text, p_attempt compaction.attempts)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_attempt.state IS DISTINCT FROM 'running' AND p_attempt.slot IS NOT NULL THEN
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.slot = p_attempt.slot AND ad.holder_conversation_id = p_conversation_id
          AND ad.holder_job_id = p_attempt.job_id AND ad.holder_attempt = p_attempt.attempt;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.release_slot(text, compaction.attempts) IS
    'Internal: given an attempt row of a conversation as just written, frees the admission slot it holds once it ended (unless another claim took the slot over)';

-- After max_running was lowered, the claim that finds no unexpired attempt in a slot
-- above it brings admission_high_water down to max_running, so the claims after it skip
-- the look above (revision 0026). Not while a claim that read the higher max_running is
-- taking one of those slots: each slot in the range is locked here, SKIP LOCKED, and only
-- if every one was free and lockable does the high water go down; a slot being taken is
-- locked by its taker until commit, and one taken since is not free on its newest
-- version. A taker whose read of max_running was older than the lowering holds its
-- lock until commit, so either this sees it or it was done before. The mark is what the
-- trigger settings_high_water lets lower it, as SET LOCAL statements that Citus carries
-- to the nodes.
CREATE FUNCTION compaction.lower_high_water(p_max_running int, p_high_water int,
                                            p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_free int;
BEGIN
    SELECT count(*) INTO v_free
    FROM (SELECT 1
          FROM compaction.admission AS ad
          WHERE ad.slot > p_max_running AND ad.slot <= p_high_water
            AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= p_now)
          FOR UPDATE SKIP LOCKED) AS f;
    IF v_free < p_high_water - p_max_running THEN
        RETURN;
    END IF;
    IF compaction.engine_distributed() THEN
        EXECUTE 'SET LOCAL citus.propagate_set_commands = local';
    END IF;
    EXECUTE 'SET LOCAL compaction.lowering_high_water = on';
    UPDATE compaction.settings AS s
    SET admission_high_water = p_max_running
    WHERE s.max_running = p_max_running AND s.admission_high_water = p_high_water;
    EXECUTE 'SET LOCAL compaction.lowering_high_water = off';
END
$$;
COMMENT ON FUNCTION compaction.lower_high_water(int, int, timestamptz) IS
    'Internal: sets settings.admission_high_water to p_max_running when every admission slot in (p_max_running, p_high_water] is free and lockable (called by claim)';

-- Revision 0038: a claim once the range has been judged (p_is_target: the window policy
-- makes it a target now; p_target_ids and p_target_hash: its current ids and hash), under
-- the conversation's lock, which the caller holds: the checks from not_eligible on, in the
-- contract's order, and the writes. compaction.claim judges one range, claim_targets a
-- batch of one conversation's ranges at once; both answer through here.
CREATE FUNCTION compaction.claim_range(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_now                timestamptz,
    p_lease_expires_at   timestamptz,
    p_is_target          boolean,
    p_target_ids         text[],
    p_target_hash        text,
    OUT claimed          boolean,
    OUT reason           text,
    OUT job_id           bigint,
    OUT attempt          int,
    OUT lease_expires_at timestamptz)
RETURNS record
LANGUAGE plpgsql
VOLATILE
-- No SET clause and no SECURITY DEFINER: only the owner may execute it, and it runs
-- inside claim and claim_targets, under their rights, search_path and planner settings
-- (every lookup by key, whatever the tables' statistics when first planned). Either
-- would cost each claim a second change of settings.
AS $$
#variable_conflict use_column
DECLARE
    v_job         compaction.jobs;
    v_job_id      bigint;
    v_attempt_row compaction.attempts;
    v_failed      int;
    v_attempt     int;
    v_max_running int;
    v_high_water  int;
    v_slot        int;
    v_overflow    boolean := false;
    v_room        boolean := true;
    v_expired     compaction.attempts;
BEGIN
    IF p_is_target IS NOT TRUE THEN
        claimed := false;
        reason := 'not_eligible';
        RETURN;
    END IF;
    IF NOT compaction.valid_source_hash(p_source_hash)
       OR p_target_hash IS DISTINCT FROM p_source_hash
       OR p_target_ids IS DISTINCT FROM p_source_message_ids THEN
        claimed := false;
        reason := 'source_mismatch';
        RETURN;
    END IF;

    SELECT j.* INTO v_job
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;
    v_job_id := v_job.job_id;

    IF v_job_id IS NULL THEN
        v_attempt := 1;
    ELSE
        -- Reap this identity: an expired attempt is a failed attempt.
        FOR v_expired IN
            UPDATE compaction.attempts AS a
            SET state = 'failed', reason = 'lease_expired', finished_at = p_now
            WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
              AND a.state = 'running' AND a.lease_expires_at <= p_now
            RETURNING a.*
        LOOP
            PERFORM compaction.release_slot(p_conversation_id, v_expired);
        END LOOP;

        IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                   WHERE s.conversation_id = p_conversation_id AND s.job_id = v_job_id) THEN
            claimed := false;
            reason := 'already_completed';
            job_id := v_job_id;
            RETURN;
        END IF;
        -- The job id is no secret (revision 0018): the running attempt belongs to the
        -- login that claimed it, and only that login can finish or renew it.
        IF EXISTS (SELECT 1 FROM compaction.attempts AS a
                   WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
                     AND a.state = 'running') THEN
            claimed := false;
            reason := 'already_running';
            job_id := v_job_id;
            RETURN;
        END IF;
        SELECT count(*) INTO v_failed
        FROM compaction.attempts AS a
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
        IF v_failed >= 2 THEN
            claimed := false;
            reason := 'attempts_exhausted';
            job_id := v_job_id;
            RETURN;
        END IF;
        v_attempt := v_failed + 1;
    END IF;

    -- Admission last, so refusals never touch it: a free slot (no holder, or a holder
    -- whose lease ran out), locked to commit. SKIP LOCKED lets concurrent claims take
    -- different slots instead of queueing on one lock; a slot being taken by an
    -- uncommitted claim is as good as taken. Under REPEATABLE READ or SERIALIZABLE a
    -- slot another claim took after this snapshot raises a serialization failure.
    SELECT s.max_running, s.admission_high_water INTO v_max_running, v_high_water
    FROM compaction.settings AS s;
    -- Slots above max_running are held only by attempts admitted before it was lowered,
    -- and none above admission_high_water, so the usual case (the two equal) costs
    -- nothing. While any live holder is there, the free slots below do not tell the
    -- count: claims serialise on the live holders above (the no-op update also makes a
    -- claim whose snapshot missed another's fail at REPEATABLE READ) and count every
    -- live holder.
    IF v_high_water > v_max_running THEN
        UPDATE compaction.admission AS ad
        SET lease_expires_at = ad.lease_expires_at
        WHERE ad.slot > v_max_running AND ad.slot <= v_high_water
          AND ad.lease_expires_at > p_now;
        v_overflow := FOUND;
        IF NOT v_overflow THEN
            PERFORM compaction.lower_high_water(v_max_running, v_high_water, p_now);
        END IF;
    END IF;
    -- Counted only while the overflow lasts. As one condition with NOT v_overflow, the
    -- count was a parameterised subquery that PL/pgSQL planned again at every claim (its
    -- custom plan, with v_overflow false, pruned the count, so a generic plan never won).
    IF v_overflow THEN
        SELECT count(*) < v_max_running INTO v_room
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_high_water AND ad.lease_expires_at > p_now;
    END IF;
    IF v_room THEN
        SELECT ad.slot INTO v_slot
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_max_running
          AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= p_now)
        ORDER BY ad.slot
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
    END IF;
    IF v_slot IS NULL THEN
        claimed := false;
        reason := 'admission_full';
        job_id := v_job_id;
        RETURN;
    END IF;

    -- The unique indexes are the final word. At READ COMMITTED the conversation lock has
    -- already ordered competing claims, so no conflict arises; at REPEATABLE READ a
    -- conflict with a winner this snapshot cannot see is a serialization failure (ON
    -- CONFLICT's rule), never a second running attempt. No subtransaction needed.
    IF v_job_id IS NULL THEN
        INSERT INTO compaction.jobs
            (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
             model, prompt_version, created_at)
        VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                p_source_message_ids, p_source_hash, p_model, p_prompt_version, p_now)
        ON CONFLICT DO NOTHING
        RETURNING * INTO v_job;
        v_job_id := v_job.job_id;
    END IF;
    IF v_job_id IS NOT NULL THEN
        -- The attempt belongs to this login from now on (the fence compares).
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at,
             claimed_by, slot)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, p_now, p_lease_expires_at,
                session_user, v_slot)
        ON CONFLICT DO NOTHING
        RETURNING * INTO v_attempt_row;
    END IF;
    IF v_job_id IS NULL OR NOT FOUND THEN
        claimed := false;
        reason := 'already_running';
        job_id := v_job_id;
        RETURN;
    END IF;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = p_conversation_id, holder_job_id = v_job_id,
        holder_attempt = v_attempt, lease_expires_at = p_lease_expires_at
    WHERE ad.slot = v_slot;
    claimed := true;
    reason := 'claimed';
    job_id := v_job_id;
    attempt := v_attempt;
    lease_expires_at := p_lease_expires_at;
END
$$;
COMMENT ON FUNCTION compaction.claim_range(text, text, int, text[], text, text, text, text, timestamptz, timestamptz, boolean, text[], text) IS
    'Internal: the checks of a claim from not_eligible on, and its writes, for a range already judged, under the conversation''s lock its caller (claim, claim_targets) holds';

CREATE FUNCTION compaction.claim(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Every lookup in this call is by key. A worker's connection lives for hours, and a plan
-- cached while the engine's tables were still small (a new deployment, a first backlog)
-- would scan them instead, at a cost that grows with every job until autovacuum's ANALYZE
-- has them planned again (revision 0017 measured a claim -> complete cycle at less than
-- half its speed after 1,600 cycles on one connection). With sequential scans disabled
-- the first plans are the index plans, and they hold whatever the tables' size; jit off,
-- since the disabled scans' cost would cross jit_above_cost and compile on every call.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- Revision 0045: caller_now and checked_lease are called only when they have
    -- something to check (a given p_now, a lease out of range); each call carries a SET
    -- clause, whose save and restore of the settings cost more than the rule.
    v_now         timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                      ELSE compaction.caller_now(p_now) END;
    v_lease       timestamptz := v_now + CASE WHEN p_lease >= interval '1 second'
                                                   AND p_lease <= interval '1 day'
                                              THEN p_lease
                                              ELSE compaction.checked_lease(p_lease) END;
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_is_target   boolean;
    v_answer      record;
    v_oversized   text;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;

    -- Checks in the contract's order; the first failing one is the answer.
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN
        RETURN QUERY SELECT false, 'invalid_range'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT compaction.valid_source_ids(p_source_message_ids) THEN
        RETURN QUERY SELECT false, 'invalid_source_ids'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    IF v_accepts IS NOT TRUE THEN
        RETURN QUERY SELECT false, 'prompt_version_closed'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    -- The range as it is now, from the derived state (no message text read): the pair
    -- count decides whether it is a target, the stored ids and hash whether it matches.
    -- Read before the conversation's lock (revision 0038): the lock orders the engine's
    -- writers of the conversation, and none of them changes its history, so the answer
    -- is the same either side of it; judged from the views (Citus, an untracked source)
    -- it is most of a claim's time, which the conversation's other writers no longer wait
    -- for. With the derived state in use, current_range's read is made here (revision
    -- 0045, as range_replies does): the call of a set-returning definer function cost
    -- more than its one statement.
    IF compaction.derived_state_serves(p_conversation_id) THEN
        SELECT coalesce((SELECT cs.pair_count::bigint FROM compaction.conversation_state AS cs
                         WHERE cs.conversation_id = p_conversation_id), 0),
               r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM (SELECT 1) AS one
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
    ELSE
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    END IF;
    v_is_target := compaction.is_target(p_from_pair, v_pairs);

    -- From here on the conversation's engine rows are ours until commit: the statement of
    -- lock_conversation, written out here and in fence (revision 0018), where a call per
    -- cycle would cost as much as the row lock itself.
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    -- The one writer under the lock that follows a change of history is an erasure (its
    -- history deleted before it or with it): a conversation with an erasure's tombstone
    -- is judged again, under the lock, so that no claim lands after an erasure on
    -- history it judged before.
    IF EXISTS (SELECT 1 FROM compaction.event_log AS e
               WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
        v_is_target := compaction.is_target(p_from_pair, v_pairs);
    END IF;
    -- An assignment, not a query: a claim -> complete cycle costs 1.0% more
    -- instructions than with the checks written out in claim (a query over the call,
    -- 1.6%).
    v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                       p_source_message_ids, p_source_hash, p_model,
                                       p_prompt_version, p_worker, v_now, v_lease,
                                       v_is_target, v_target_ids, v_target_hash);
    claimed := v_answer.claimed;
    reason := v_answer.reason;
    job_id := v_answer.job_id;
    attempt := v_answer.attempt;
    lease_expires_at := v_answer.lease_expires_at;
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, bound to the calling login, or returns the first refusal reason (see DESIGN §6)';


-- Revision 0038: claims of several ranges of one conversation in one call, for a worker
-- with that many model calls free. Each range is answered exactly as compaction.claim
-- would answer it, had the ranges been claimed one after another in the order given, at
-- one instant: the same checks in the contract's order, the same writes, one row per
-- range. The conversation is locked and judged once for the whole batch, where a claim
-- per range judges it each time (from the views, on Citus or an untracked source, that
-- judgement is most of a claim's cost). The first admission_full ends the batch: the
-- ranges after it are not tried and get no row. p_source_message_ids holds one row of
-- ids per range (a two-dimensional array, ranges by ids).
CREATE FUNCTION compaction.claim_targets(
    p_conversation_id    text,
    p_scope              text,
    p_from_pairs         int[],
    p_source_message_ids text[],
    p_source_hashes      text[],
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- As claim's: every lookup by key, whatever the tables' statistics when first planned.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_lease      timestamptz := v_now + CASE WHEN p_lease >= interval '1 second'
                                                  AND p_lease <= interval '1 day'
                                             THEN p_lease
                                             ELSE compaction.checked_lease(p_lease) END;
    v_n          int := coalesce(pg_catalog.cardinality(p_from_pairs), 0);
    v_oversized  text;
    v_accepts    boolean;
    v_refusals   text[] := '{}';
    v_judge      int[] := '{}';
    v_from       int[];
    v_target_ids text[];
    v_hashes     text[];
    v_at         int;
    v_reason     text;
    v_answer     record;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    IF v_n = 0 THEN
        RETURN;
    END IF;
    -- A batch is what a worker's free model calls can take: a few ranges, never a
    -- conversation's history held under its lock at once.
    IF v_n > 100 THEN
        RAISE EXCEPTION 'claim_targets takes at most 100 ranges a call, got %', v_n
            USING ERRCODE = 'CP020';
    END IF;
    IF pg_catalog.array_ndims(p_from_pairs) <> 1
       OR pg_catalog.array_ndims(p_source_message_ids) IS DISTINCT FROM 2
       OR pg_catalog.array_length(p_source_message_ids, 1) <> v_n
       OR pg_catalog.array_ndims(p_source_hashes) IS DISTINCT FROM 1
       OR pg_catalog.cardinality(p_source_hashes) <> v_n THEN
        RAISE EXCEPTION 'claim_targets needs, for each of its % ranges, one row of source ids and one hash', v_n
            USING ERRCODE = 'CP020',
                  HINT = 'p_source_message_ids is a two-dimensional array: one row of 20 ids per range.';
    END IF;

    -- The checks before the conversation's lock, per range, in the contract's order.
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    FOR i IN 1 .. v_n LOOP
        v_reason := CASE
            WHEN p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] IS NULL
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] < 0
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] % 10 <> 0
                THEN 'invalid_range'
            WHEN NOT compaction.valid_source_ids(ARRAY(
                     SELECT pg_catalog.unnest(p_source_message_ids[
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])))
                THEN 'invalid_source_ids'
            WHEN v_accepts IS NOT TRUE THEN 'prompt_version_closed'
        END;
        v_refusals := v_refusals || v_reason;
        IF v_reason IS NULL THEN
            v_judge := v_judge || p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        END IF;
    END LOOP;

    IF pg_catalog.cardinality(v_judge) > 0 THEN
        -- One judgement for the batch, before the conversation's lock as in claim: which
        -- of its ranges are targets now, with their current ids (one row of 20 per
        -- target) and hashes. Judged again under the lock where an erasure's tombstone
        -- is (as in claim).
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
        INTO v_from, v_target_ids, v_hashes
        FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        -- The conversation's engine rows are ours until commit (claim's statement).
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        IF EXISTS (SELECT 1 FROM compaction.event_log AS e
                   WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
            SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
            INTO v_from, v_target_ids, v_hashes
            FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        END IF;
    END IF;

    FOR i IN 1 .. v_n LOOP
        IF v_refusals[i] IS NOT NULL THEN
            RETURN QUERY
            SELECT p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1], false,
                   v_refusals[i], NULL::bigint, NULL::int, NULL::timestamptz;
            CONTINUE;
        END IF;
        from_pair := p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        v_at := pg_catalog.array_position(v_from, from_pair);
        v_answer := compaction.claim_range(
            p_conversation_id, p_scope, from_pair,
            ARRAY(SELECT pg_catalog.unnest(p_source_message_ids[
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])),
            p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1],
            p_model, p_prompt_version, p_worker, v_now, v_lease,
            v_at IS NOT NULL,
            CASE WHEN v_at IS NOT NULL
                 THEN ARRAY(SELECT pg_catalog.unnest(v_target_ids[v_at:v_at][:])) END,
            v_hashes[v_at]);
        claimed := v_answer.claimed;
        reason := v_answer.reason;
        job_id := v_answer.job_id;
        attempt := v_answer.attempt;
        lease_expires_at := v_answer.lease_expires_at;
        RETURN NEXT;
        -- No slot was free: the rest of the batch would find none either.
        EXIT WHEN reason = 'admission_full';
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_targets(text, text, int[], text[], text[], text, text, text, interval, timestamptz) IS
    'Claims several ranges of one conversation under one lock and one judgement, each answered as compaction.claim would answer it in the order given (one row per range; the first admission_full ends the batch); for a worker with that many model calls free';

-- Revision 0040: a worker's look at a conversation and its first claims, in one call. The
-- conversation's targets, judged once, each with whether this identity already holds a
-- summary (what worker_targets answers), and up to p_limit claims among those that do
-- not, tried in target order, each answered as compaction.claim would answer it for the
-- ids and hash just judged: a range refused for itself gives its turn to the next, and
-- the first admission_full or prompt_version_closed ends the claims. A worker calls it
-- with its free model calls as p_limit: where it called worker_targets and then
-- claim_targets, the conversation is judged once instead of twice (on Citus and an
-- untracked source, from the views: most of a claim's cost). The targets not tried come
-- back with claimed NULL, with their ids and hash, for claim_targets once model calls
-- are free; with p_limit 0 this is worker_targets, and takes no lock.
CREATE FUNCTION compaction.claim_next_targets(
    p_conversation_id text,
    p_scope           text,
    p_limit           int,
    p_model           text,
    p_prompt_version  text,
    p_worker          text,
    p_lease           interval DEFAULT '5 minutes',
    p_now             timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean, claimed boolean, reason text, job_id bigint,
               attempt int, lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- As claim's: every lookup by key, whatever the tables' statistics when first planned.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now       timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                    ELSE compaction.caller_now(p_now) END;
    v_lease     timestamptz := v_now + CASE WHEN p_lease >= interval '1 second'
                                                 AND p_lease <= interval '1 day'
                                            THEN p_lease
                                            ELSE compaction.checked_lease(p_lease) END;
    v_oversized text;
    v_accepts   boolean;
    v_from      int[];
    v_ids       text[];
    v_hashes    text[];
    v_done      boolean[];
    v_claims    int := 0;
    v_ended     boolean := false;
    v_locked    boolean := false;
    v_answer    record;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_next_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    -- As claim_targets: a batch is what a worker's free model calls can take.
    IF p_limit IS NULL OR p_limit < 0 OR p_limit > 100 THEN
        RAISE EXCEPTION 'claim_next_targets claims 0 to 100 ranges a call, got %',
                coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'CP020';
    END IF;

    -- The look is worker_targets' answer, judged before the conversation's lock as in
    -- claim. With a claim to try, the conversation's engine rows are then ours until
    -- commit (claim's statement), and it is looked at again under the lock where an
    -- erasure's tombstone is (as in claim). Nothing to claim, no lock.
    LOOP
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair),
               pg_catalog.array_agg(t.completed ORDER BY t.from_pair)
        INTO v_from, v_ids, v_hashes, v_done
        FROM compaction.worker_targets(p_conversation_id, p_scope, p_model,
                                       p_prompt_version) AS t;
        EXIT WHEN v_locked OR p_limit = 0 OR NOT coalesce(false = ANY (v_done), false);
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        v_locked := true;
        SELECT pv.accepts_new_jobs INTO v_accepts
        FROM compaction.prompt_versions AS pv
        WHERE pv.prompt_version = p_prompt_version;
        EXIT WHEN NOT EXISTS (SELECT 1 FROM compaction.event_log AS e
                              WHERE e.conversation_id = p_conversation_id
                                AND e.kind = 'erasure');
    END LOOP;

    FOR k IN 1 .. coalesce(pg_catalog.cardinality(v_from), 0) LOOP
        from_pair := v_from[k];
        to_pair := v_from[k] + 9;
        source_message_ids := ARRAY(SELECT pg_catalog.unnest(v_ids[k:k][:]));
        source_hash := v_hashes[k];
        completed := v_done[k];
        claimed := NULL;
        reason := NULL;
        job_id := NULL;
        attempt := NULL;
        lease_expires_at := NULL;
        IF NOT completed AND v_claims < p_limit AND NOT v_ended THEN
            -- claim's checks in the contract's order. The range is a target with exactly
            -- these ids and this hash: never not_eligible, and source_mismatch only where
            -- its texts could not be hashed (no valid hash).
            IF NOT compaction.valid_source_ids(source_message_ids) THEN
                claimed := false;
                reason := 'invalid_source_ids';
            ELSIF v_accepts IS NOT TRUE THEN
                claimed := false;
                reason := 'prompt_version_closed';
            ELSE
                v_answer := compaction.claim_range(
                    p_conversation_id, p_scope, from_pair, source_message_ids, source_hash,
                    p_model, p_prompt_version, p_worker, v_now, v_lease,
                    true, source_message_ids, source_hash);
                claimed := v_answer.claimed;
                reason := v_answer.reason;
                job_id := v_answer.job_id;
                attempt := v_answer.attempt;
                lease_expires_at := v_answer.lease_expires_at;
            END IF;
            v_claims := v_claims + claimed::int;
            -- A range refused for itself (another worker's attempt running, attempts
            -- exhausted) gives its turn to the next target; no slot free, or a closed
            -- prompt version, would refuse every target after it too.
            v_ended := reason IN ('admission_full', 'prompt_version_closed');
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz) IS
    'The conversation''s targets, each with whether this identity holds a summary (as worker_targets), and up to p_limit claims among those without one, tried in order, each answered as compaction.claim would answer it (claimed NULL: not tried; the first admission_full or prompt_version_closed ends the claims): a worker''s look and first claims under one judgement';

-- The fencing step shared by complete, fail and heartbeat: locks the conversation and the
-- attempt row, and answers whether (job_id, attempt) is still running with a live lease.
-- An expired, unreaped attempt is marked failed (lease_expired) on the way. A given
-- p_conversation_id must name the job's conversation (else the job is not found: the
-- caller answers lease_lost); it lets a distributed database route the call. The job's
-- row comes back with the attempt's (revision 0017), so the caller records the attempt's
-- change without reading either again. An attempt belongs to the login that claimed it
-- (revision 0018, DESIGN §6): to any other login, the owner and superusers aside, the
-- attempt is unknown (the caller answers lease_lost) and nothing changes, not even an
-- expiry. The usual call costs one comparison with the row it has already read.
-- Revision 0045: no SECURITY DEFINER and no SET clause, as claim_range: only the owner
-- may execute it, and it runs inside its three callers, definers with this search_path,
-- where saving and restoring the settings around each call cost more than the comparison.
CREATE FUNCTION compaction.fence(p_job_id bigint, p_attempt int, p_now timestamptz,
                                 p_conversation_id text,
                                 OUT attempt_row compaction.attempts,
                                 OUT job_row compaction.jobs)
RETURNS record
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    IF p_conversation_id IS NULL THEN
        SELECT j.* INTO job_row
        FROM compaction.jobs AS j
        WHERE j.job_id = p_job_id;
    ELSE
        SELECT j.* INTO job_row
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.job_id = p_job_id;
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- lock_conversation's statement (written out, as in claim).
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (job_row.conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    SELECT a.* INTO attempt_row
    FROM compaction.attempts AS a
    WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF attempt_row.claimed_by IS DISTINCT FROM session_user
       AND NOT compaction.caller_is_privileged() THEN
        attempt_row := NULL;
        job_row := NULL;
        RETURN;
    END IF;
    -- Only a superuser's or the owner's p_now can be this early (caller_now).
    IF attempt_row.state = 'running' AND p_now < attempt_row.started_at THEN
        RAISE EXCEPTION 'p_now % is before attempt % of job % started (%)',
                p_now, p_attempt, p_job_id, attempt_row.started_at
            USING ERRCODE = 'CP022';
    END IF;
    IF attempt_row.state = 'running' AND attempt_row.lease_expires_at <= p_now THEN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = p_now
        WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt
        RETURNING a.* INTO attempt_row;
        PERFORM compaction.release_slot(job_row.conversation_id, attempt_row);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz, text) IS
    'Internal: locks attempt (job_id, attempt) of the given conversation (or the job''s) and returns it with its job, first failing it (lease_expired) if its lease ran out; attempt_row NULL if unknown or claimed by another login (owner and superusers aside)';

-- complete()'s p_stats (DESIGN.md §6): NULL, or an object whose keys are among
-- input_tokens, output_tokens, figures_total, figures_kept, each a non-negative integer
-- (JSON number without fraction or exponent, below 2^31), figures_kept only with
-- figures_total and never above it. Anything else is CP020. The counts come back in the
-- matching columns of an attempts row (the other columns NULL).
CREATE FUNCTION compaction.attempt_stats(p_stats jsonb)
RETURNS compaction.attempts
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_stats compaction.attempts;
    v_key   text;
    v_value jsonb;
BEGIN
    IF p_stats IS NULL THEN
        RETURN v_stats;
    END IF;
    IF pg_catalog.jsonb_typeof(p_stats) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'p_stats must be a JSON object or NULL, got a JSON %',
                pg_catalog.jsonb_typeof(p_stats)
            USING ERRCODE = 'CP020';
    END IF;
    FOR v_key, v_value IN SELECT e.key, e.value FROM pg_catalog.jsonb_each(p_stats) AS e LOOP
        IF v_key NOT IN ('input_tokens', 'output_tokens', 'figures_total', 'figures_kept') THEN
            RAISE EXCEPTION 'p_stats: unknown key % (known: input_tokens, output_tokens, figures_total, figures_kept)',
                    pg_catalog.quote_literal(pg_catalog.left(v_key, 64))
                USING ERRCODE = 'CP020';
        END IF;
        IF pg_catalog.jsonb_typeof(v_value) IS DISTINCT FROM 'number'
           OR v_value::text !~ '^(0|[1-9][0-9]{0,9})$' THEN
            RAISE EXCEPTION 'p_stats: % must be a non-negative integer', v_key
                USING ERRCODE = 'CP020';
        END IF;
        IF v_value::text::bigint > 2147483647 THEN
            RAISE EXCEPTION 'p_stats: % must be below 2^31', v_key USING ERRCODE = 'CP020';
        END IF;
    END LOOP;
    v_stats.input_tokens := (p_stats ->> 'input_tokens')::int;
    v_stats.output_tokens := (p_stats ->> 'output_tokens')::int;
    v_stats.figures_total := (p_stats ->> 'figures_total')::int;
    v_stats.figures_kept := (p_stats ->> 'figures_kept')::int;
    IF v_stats.figures_kept IS NOT NULL
       AND (v_stats.figures_total IS NULL OR v_stats.figures_kept > v_stats.figures_total) THEN
        RAISE EXCEPTION 'p_stats: figures_kept needs figures_total and must not exceed it'
            USING ERRCODE = 'CP020';
    END IF;
    RETURN v_stats;
END
$$;
COMMENT ON FUNCTION compaction.attempt_stats(jsonb) IS
    'Internal: validates complete()''s p_stats (CP020 unless NULL or an object of non-negative integer counts) and returns them as attempt columns';

CREATE FUNCTION compaction.complete(
    p_job_id          bigint,
    p_attempt         int,
    p_summary         text,
    p_finish_reason   text,
    p_tool_call_count int,
    p_response_id     text DEFAULT NULL,
    p_now             timestamptz DEFAULT NULL,
    p_stats           jsonb DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text, summary_id bigint)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- caller_now only for a given p_now (revision 0045, as in claim).
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_fenced     record;
    v_attempt    compaction.attempts;
    v_job        compaction.jobs;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    -- Without p_stats, v_stats is what attempt_stats answers for NULL: every column NULL.
    IF p_stats IS NOT NULL THEN
        v_stats := compaction.attempt_stats(p_stats);
    END IF;
    v_fenced := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    v_attempt := v_fenced.attempt_row;
    v_job := v_fenced.job_row;
    IF v_attempt.state = 'completed' THEN
        -- Idempotent for the same token and the same text (a lost reply re-sent); any
        -- other text for a completed attempt is a stale writer: lease_lost.
        SELECT s.summary_id INTO v_summary_id
        FROM compaction.job_summaries AS s
        WHERE s.conversation_id = v_attempt.conversation_id AND s.job_id = p_job_id
          AND s.attempt = p_attempt AND s.summary = p_summary;
        IF FOUND THEN
            RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
        ELSE
            RETURN QUERY SELECT false, 'lease_lost'::text, NULL::bigint;
        END IF;
        RETURN;
    END IF;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, 'lease_lost'::text, NULL::bigint;
        RETURN;
    END IF;

    IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
               WHERE s.conversation_id = v_attempt.conversation_id AND s.job_id = p_job_id) THEN
        v_problem := 'already_completed';
    ELSE
        v_problem := compaction.reply_problem(p_summary, p_finish_reason, p_tool_call_count);
    END IF;

    IF v_problem IS NOT NULL THEN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = v_problem, finished_at = v_now,
            finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
            response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
            input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
            figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept
        WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt
        RETURNING a.* INTO v_attempt;
        PERFORM compaction.release_slot(v_attempt.conversation_id, v_attempt);
        RETURN QUERY SELECT false, v_problem, NULL::bigint;
        RETURN;
    END IF;

    INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
    VALUES (v_attempt.conversation_id, p_job_id, p_attempt, p_summary, v_now)
    RETURNING summary_id INTO v_summary_id;
    -- The new summary's verdict (revision 0045): the common case, the first summary of
    -- its range in its scope, is written here from the job row fence returned, as
    -- rederive_summary_verdicts' first statement writes it from a read of the job (and
    -- under the same conversation_state row, taken first); that function judges the rest,
    -- where the range already has a verdict. Its call, a definer with two SET clauses, and
    -- its reads of the summary and the job were 2.9% of a claim -> complete cycle's
    -- instructions (docs/benchmarks.md). Not on Citus, where no derived state is kept.
    IF pg_catalog.current_setting('citus.version', true) IS NULL
       OR NOT compaction.engine_distributed() THEN
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (v_attempt.conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT v_attempt.conversation_id, v_summary_id, v_job.scope, v_job.from_pair,
               CASE WHEN NOT coalesce((SELECT pv.projectable
                                       FROM compaction.prompt_versions AS pv
                                       WHERE pv.prompt_version = v_job.prompt_version), false)
                        THEN 'version_not_projectable'
                    WHEN NOT coalesce((SELECT r.source_hash = v_job.source_hash
                                              AND r.source_message_ids = v_job.source_message_ids
                                       FROM compaction.ranges AS r
                                       WHERE r.conversation_id = v_attempt.conversation_id
                                         AND r.from_pair = v_job.from_pair), false)
                        THEN 'stale_source' END
        WHERE NOT EXISTS (SELECT 1 FROM compaction.summary_verdicts AS o
                          WHERE o.conversation_id = v_attempt.conversation_id
                            AND o.from_pair = v_job.from_pair AND o.scope = v_job.scope);
        IF NOT FOUND THEN
            PERFORM compaction.rederive_summary_verdicts(v_attempt.conversation_id, '{}',
                                                         v_summary_id);
        END IF;
    END IF;
    UPDATE compaction.attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = v_now,
        finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
        input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    RETURNING a.* INTO v_attempt;
    -- release_slot's statement, written out (revision 0045): the call of a definer with a
    -- SET clause cost more than the update (1.0% of a cycle's instructions).
    IF v_attempt.slot IS NOT NULL THEN
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.slot = v_attempt.slot AND ad.holder_conversation_id = v_attempt.conversation_id
          AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    END IF;
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off or claimed by another login';

CREATE FUNCTION compaction.fail(
    p_job_id  bigint,
    p_attempt int,
    p_reason  text,
    p_now     timestamptz DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                  ELSE compaction.caller_now(p_now) END;
    v_fenced  record;
    v_attempt compaction.attempts;
BEGIN
    PERFORM compaction.checked_reason(p_reason);
    IF p_reason IN ('completed', 'lease_expired') THEN
        RAISE EXCEPTION 'fail needs a reason other than completed or lease_expired'
            USING ERRCODE = 'CP020';
    END IF;
    v_fenced := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    v_attempt := v_fenced.attempt_row;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, 'lease_lost'::text;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET state = 'failed', reason = p_reason, finished_at = v_now
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    RETURNING a.* INTO v_attempt;
    PERFORM compaction.release_slot(v_attempt.conversation_id, v_attempt);
    RETURN QUERY SELECT true, 'failed'::text;
END
$$;
COMMENT ON FUNCTION compaction.fail(bigint, int, text, timestamptz, text) IS
    'Records attempt (job_id, attempt) failed with the worker''s reason code (e.g. http_error, timeout; CP024 unless ^[a-z][a-z0-9_]{0,63}$); lease_lost if fenced off or claimed by another login';

CREATE FUNCTION compaction.heartbeat(
    p_job_id  bigint,
    p_attempt int,
    p_lease   interval DEFAULT '5 minutes',
    p_now     timestamptz DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                  ELSE compaction.caller_now(p_now) END;
    v_lease   timestamptz := v_now + CASE WHEN p_lease >= interval '1 second'
                                               AND p_lease <= interval '1 day'
                                          THEN p_lease
                                          ELSE compaction.checked_lease(p_lease) END;
    v_attempt compaction.attempts;
BEGIN
    v_attempt := (compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id)).attempt_row;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET lease_expires_at = v_lease
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    -- The slot carries a copy of the lease: a renewed attempt keeps counting.
    UPDATE compaction.admission AS ad
    SET lease_expires_at = v_lease
    WHERE ad.slot = v_attempt.slot AND ad.holder_conversation_id = v_attempt.conversation_id
      AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    RETURN QUERY SELECT true, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (1 second..1 day, else CP023); ok = false if fenced off or claimed by another login (lease_lost)';

-- ---------------------------------------------------------------------------------------
-- The public view of completed summaries
-- ---------------------------------------------------------------------------------------

CREATE VIEW compaction.summaries AS
    SELECT s.summary_id,
           j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.source_message_ids,
           j.source_hash,
           j.model,
           j.prompt_version,
           s.summary,
           s.completed_at,
           CASE WHEN s.attempt IS NOT NULL THEN s.job_id END AS job_id,
           s.attempt IS NULL AS imported
    FROM compaction.job_summaries AS s
    JOIN compaction.jobs AS j
      ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id;
COMMENT ON VIEW compaction.summaries IS
    'Every completed summary with its identity and source binding; job_id is NULL for imported summaries';

-- ==== sql/31_queue.sql ====
-- pycompactor stored logic, section 3b: the work queue.
--
-- One entry per (conversation, scope) whose history changed and that no worker has
-- finished examining: filled by enqueue, by the reference tables' statement triggers and
-- by reap (32_reaping.sql); leased by dequeue, removed by ack, given back by release.
-- Liveness comes from the leases, never from a held lock (DESIGN §11).

-- The work queue. dequeue leases entries (hidden until leased_until, identified by
-- lease_token) instead of removing them; ack removes an entry once its worker has
-- examined the conversation, unless an enqueue landed during the lease (requeued_at),
-- in which case the entry becomes visible again at that time. A lease that simply runs
-- out (a dead worker) makes the entry visible again at its original enqueued_at: no
-- reaper needed. One entry per (conversation, scope): each scope keeps its own order.
CREATE TABLE compaction.queue (
    conversation_id text NOT NULL,
    scope           text NOT NULL,
    enqueued_at     timestamptz NOT NULL,
    leased_until    timestamptz,
    lease_token     uuid,
    requeued_at     timestamptz,
    CONSTRAINT queue_pkey PRIMARY KEY (conversation_id, scope),
    CONSTRAINT queue_lease_complete CHECK ((leased_until IS NULL) = (lease_token IS NULL)),
    CONSTRAINT queue_requeued_only_when_leased
        CHECK (requeued_at IS NULL OR lease_token IS NOT NULL),
    -- The server's clock writes these; finite, so the audit view's ages never fail.
    CONSTRAINT queue_times_finite CHECK (
        pg_catalog.isfinite(enqueued_at)
        AND (leased_until IS NULL OR pg_catalog.isfinite(leased_until))
        AND (requeued_at IS NULL OR pg_catalog.isfinite(requeued_at)))
);
COMMENT ON TABLE compaction.queue IS
    'Conversations (per scope) with history no worker has finished examining: filled by enqueue, leased by dequeue, removed by ack';
-- dequeue walks one scope's entries oldest first.
CREATE INDEX queue_scope_enqueued_at_idx ON compaction.queue (scope, enqueued_at, conversation_id);


-- The three writers of queue entries (enqueue, the source tables' trigger, reap) share
-- one upsert: a new entry is inserted; an entry under a lease is marked requeued_at (the
-- first time only), so the acknowledgement of a worker that examined the conversation
-- before this write keeps the entry; any other existing entry is only locked (ON
-- CONFLICT DO UPDATE locks the row even when its WHERE is false; no new row version).
-- The lock lasts until the writer commits: dequeue skips a locked entry and ack waits
-- for it, so no worker examines and acknowledges a conversation whose new history it
-- cannot see yet.
CREATE FUNCTION compaction.enqueue(p_conversation_id text, p_scope text DEFAULT 'default')
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' THEN
        RAISE EXCEPTION 'enqueue needs a conversation id and a non-empty scope'
            USING ERRCODE = 'CP020';
    END IF;
    IF compaction.oversized_identifier(p_conversation_id, p_scope) IS NOT NULL THEN
        RAISE EXCEPTION '%', compaction.oversized_identifier(p_conversation_id, p_scope)
            USING ERRCODE = 'CP020';
    END IF;
    INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
    VALUES (p_conversation_id, p_scope, pg_catalog.now())
    ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
        WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
END
$$;
COMMENT ON FUNCTION compaction.enqueue(text, text) IS
    'Marks a conversation (per scope) as having new history for the worker; cheap and idempotent; an entry under a lease survives its acknowledgement; CP020 for a conversation id or scope over 1024 bytes';

CREATE FUNCTION compaction.dequeue(
    p_scope text DEFAULT 'default',
    p_limit int DEFAULT 100,
    p_lease interval DEFAULT '5 minutes')
RETURNS TABLE (conversation_id text, scope text, enqueued_at timestamptz, lease_token uuid,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now       timestamptz := pg_catalog.now();
    v_until     timestamptz;
    v_candidate record;
    v_token     uuid;
    v_taken     int := 0;
BEGIN
    IF p_scope IS NULL OR p_scope = '' THEN
        RAISE EXCEPTION 'dequeue needs a non-empty scope' USING ERRCODE = 'CP020';
    END IF;
    -- At most 1,000 a call (revision 0018): one call used to hide a whole scope's queue
    -- from every other worker for the lease.
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 1000 THEN
        RAISE EXCEPTION 'dequeue takes a limit between 1 and 1000 entries, got %',
                coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'CP020';
    END IF;
    IF p_lease IS NULL OR p_lease < interval '1 second' OR p_lease > interval '1 day' THEN
        RAISE EXCEPTION 'dequeue needs a lease between 1 second and 1 day' USING ERRCODE = 'CP020';
    END IF;
    v_until := v_now + p_lease;
    -- Candidates are read without row locks (no statement here spans conversations with
    -- FOR UPDATE, so the queue can be distributed by conversation_id); each is then
    -- leased by statements that address its own row. Visible: never leased, or the
    -- lease ran out (its worker died): such an entry keeps its enqueued_at, so it comes
    -- back in its original place without any reaper.
    FOR v_candidate IN
        SELECT q.conversation_id
        FROM compaction.queue AS q
        WHERE q.scope = p_scope AND (q.leased_until IS NULL OR q.leased_until <= v_now)
        ORDER BY q.enqueued_at, q.conversation_id
    LOOP
        -- One row, SKIP LOCKED: an entry that another worker is leasing right now, or
        -- that a writer is enqueueing (its history is not committed yet), is left for a
        -- later dequeue rather than waited for. The visibility test is re-checked on the
        -- newest row version: a lease committed meanwhile makes this one lose and skip.
        PERFORM 1
        FROM compaction.queue AS q
        WHERE q.conversation_id = v_candidate.conversation_id AND q.scope = p_scope
          AND (q.leased_until IS NULL OR q.leased_until <= v_now)
        FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        -- The token is drawn first: Citus takes no volatile function into an UPDATE of
        -- a distributed table.
        v_token := pg_catalog.gen_random_uuid();
        RETURN QUERY
        UPDATE compaction.queue AS q
        SET leased_until = v_until, lease_token = v_token, requeued_at = NULL
        WHERE q.conversation_id = v_candidate.conversation_id AND q.scope = p_scope
        RETURNING q.conversation_id, q.scope, q.enqueued_at, q.lease_token, q.leased_until;
        v_taken := v_taken + 1;
        EXIT WHEN v_taken >= p_limit;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.dequeue(text, int, interval) IS
    'Leases up to p_limit (1 to 1000, else CP020) visible entries of one scope, oldest first, for p_lease (1 second to 1 day, server clock); concurrent workers get disjoint entries; returns each lease_token';

CREATE FUNCTION compaction.ack(p_conversation_id text, p_scope text, p_lease_token uuid)
RETURNS TABLE (ok boolean, reason text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_lease_token IS NULL THEN
        RAISE EXCEPTION 'ack needs a conversation id, a non-empty scope and a lease token'
            USING ERRCODE = 'CP020';
    END IF;
    -- Examined and nothing new since the lease: done. A writer enqueueing this entry
    -- right now holds its row; the DELETE waits for it and re-checks requeued_at.
    DELETE FROM compaction.queue AS q
    WHERE q.conversation_id = p_conversation_id AND q.scope = p_scope
      AND q.lease_token = p_lease_token AND q.requeued_at IS NULL;
    IF FOUND THEN
        RETURN QUERY SELECT true, 'acknowledged'::text;
        RETURN;
    END IF;
    -- New history arrived during the lease: the newer enqueue wins, and the entry waits
    -- again from the moment it arrived.
    UPDATE compaction.queue AS q
    SET enqueued_at = q.requeued_at, leased_until = NULL, lease_token = NULL,
        requeued_at = NULL
    WHERE q.conversation_id = p_conversation_id AND q.scope = p_scope
      AND q.lease_token = p_lease_token AND q.requeued_at IS NOT NULL;
    IF FOUND THEN
        RETURN QUERY SELECT true, 'requeued'::text;
        RETURN;
    END IF;
    RETURN QUERY SELECT false, 'lease_lost'::text;
END
$$;
COMMENT ON FUNCTION compaction.ack(text, text, uuid) IS
    'Acknowledges a leased entry once its conversation was examined: removes it (acknowledged), or keeps it visible if an enqueue landed during the lease (requeued); lease_lost if the token is no longer the entry''s';

CREATE FUNCTION compaction.release(p_conversation_id text, p_scope text, p_lease_token uuid)
RETURNS TABLE (ok boolean, reason text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_lease_token IS NULL THEN
        RAISE EXCEPTION 'release needs a conversation id, a non-empty scope and a lease token'
            USING ERRCODE = 'CP020';
    END IF;
    UPDATE compaction.queue AS q
    SET leased_until = NULL, lease_token = NULL, requeued_at = NULL
    WHERE q.conversation_id = p_conversation_id AND q.scope = p_scope
      AND q.lease_token = p_lease_token;
    IF FOUND THEN
        RETURN QUERY SELECT true, 'released'::text;
    ELSE
        RETURN QUERY SELECT false, 'lease_lost'::text;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.release(text, text, uuid) IS
    'Ends a lease without acknowledging (the worker did not examine the conversation): the entry is visible again in its original place; lease_lost if the token is no longer the entry''s';

-- Writes to the reference history enqueue the conversations they touch (scope
-- 'default'), once per statement, so a bulk COPY costs one INSERT here.
CREATE FUNCTION compaction.source_enqueue()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Nothing to do when this transaction already holds the queue entry of every
    -- conversation the statement wrote (an earlier statement inserted, requeued or locked
    -- it, outside any subtransaction: its lock lasts until commit, so nobody else changes
    -- it) and the upsert below would not update it: it would find that row and change
    -- nothing. An agent's later statements per Run end here. Each conversation's entry is
    -- looked up on its own key (OFFSET 0 keeps each NOT EXISTS a subplan per row): as an
    -- anti-join, planned on a queue without statistics, it read every entry through the
    -- index on (scope, enqueued_at) at each statement (revision 0035).
    IF TG_OP = 'INSERT' THEN
        IF NOT EXISTS (SELECT 1 FROM new_rows AS n
                       WHERE n.conversation_id IS NOT NULL
                         AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                         WHERE q.conversation_id = n.conversation_id
                                           AND q.scope = 'default'
                                           AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                           AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                         OFFSET 0)) THEN
            RETURN NULL;
        END IF;
    ELSIF TG_OP = 'DELETE' THEN
        IF NOT EXISTS (SELECT 1 FROM old_rows AS o
                       WHERE o.conversation_id IS NOT NULL
                         AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                         WHERE q.conversation_id = o.conversation_id
                                           AND q.scope = 'default'
                                           AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                           AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                         OFFSET 0)) THEN
            RETURN NULL;
        END IF;
    ELSIF NOT EXISTS (SELECT 1
                      FROM (SELECT n.conversation_id FROM new_rows AS n
                            UNION ALL
                            SELECT o.conversation_id FROM old_rows AS o) AS c
                      WHERE c.conversation_id IS NOT NULL
                        AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                        WHERE q.conversation_id = c.conversation_id
                                          AND q.scope = 'default'
                                          AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                          AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                        OFFSET 0)) THEN
        RETURN NULL;
    END IF;

    -- The upsert of compaction.enqueue, for every conversation the statement wrote, in
    -- one sorted statement: concurrent bulk writers take queue row locks in one order.
    IF TG_OP = 'INSERT' THEN
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT n.conversation_id, 'default', pg_catalog.now()
        FROM new_rows AS n
        WHERE n.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT o.conversation_id, 'default', pg_catalog.now()
        FROM old_rows AS o
        WHERE o.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    ELSE
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT c.conversation_id, 'default', pg_catalog.now()
        FROM (SELECT n.conversation_id FROM new_rows AS n
              UNION ALL
              SELECT o.conversation_id FROM old_rows AS o) AS c
        WHERE c.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.source_enqueue() IS
    'Trigger: enqueues (scope default) every conversation whose reference runs or messages a statement wrote';

CREATE TRIGGER runs_enqueue_insert
    AFTER INSERT ON compaction_source.runs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER runs_enqueue_update
    AFTER UPDATE ON compaction_source.runs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER runs_enqueue_delete
    AFTER DELETE ON compaction_source.runs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER messages_enqueue_insert
    AFTER INSERT ON compaction_source.messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER messages_enqueue_update
    AFTER UPDATE ON compaction_source.messages
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER messages_enqueue_delete
    AFTER DELETE ON compaction_source.messages
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_enqueue_insert;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_enqueue_update;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_enqueue_delete;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_enqueue_insert;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_enqueue_update;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_enqueue_delete;

-- ==== sql/32_reaping.sql ====
-- pycompactor stored logic, section 3c: reaping.
--
-- reap turns running attempts whose lease ran out into failed (lease_expired) attempts
-- and puts their conversations back on the queue (31_queue.sql), so the one retry the
-- contract allows happens without a sweep. claim and the fenced calls reap the identity
-- they touch themselves (30_claims.sql).
--
-- DESIGN §11: no statement spans conversations with a row lock. reap finds the
-- conversations with expired attempts by a plain read, then settles each one by
-- statements that address that conversation alone (reap_conversation), under its lock,
-- passing over a conversation whose lock is taken (as the row locks' SKIP LOCKED did).

CREATE FUNCTION compaction.reap_conversation(p_conversation_id text, p_now timestamptz)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_expired compaction.attempts;
    v_jobs    bigint[] := '{}';
    v_scope   text;
BEGIN
    -- A conversation whose writer holds its lock right now is passed over: a fenced call
    -- settles the expiry of the attempt it holds itself, a claim reaps the identity it
    -- touches, and the next reap comes back for the rest. Two reapers never wait on each
    -- other either.
    IF NOT compaction.try_lock_conversation(p_conversation_id) THEN
        RETURN 0;
    END IF;
    -- Under the lock the state and lease are read again, so nothing is reaped twice.
    FOR v_expired IN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = p_now
        WHERE a.conversation_id = p_conversation_id
          AND a.state = 'running' AND a.lease_expires_at <= p_now
        RETURNING a.*
    LOOP
        PERFORM compaction.release_slot(p_conversation_id, v_expired);
        v_jobs := v_jobs || v_expired.job_id;
    END LOOP;
    IF pg_catalog.cardinality(v_jobs) > 0 THEN
        -- The expired attempt's worker is gone and can no longer nudge anyone: put the
        -- conversation back on the queue (enqueue's upsert: an entry leased right now is
        -- marked requeued, so the acknowledgement of a worker that examined it before
        -- this expiry keeps it), so the one retry the contract allows happens without a
        -- sweep.
        -- The scopes first, then enqueue: one statement each (DESIGN §11).
        FOREACH v_scope IN ARRAY ARRAY(SELECT DISTINCT j.scope
                                       FROM compaction.jobs AS j
                                       WHERE j.conversation_id = p_conversation_id
                                         AND j.job_id = ANY (v_jobs)
                                       ORDER BY 1)
        LOOP
            PERFORM compaction.enqueue(p_conversation_id, v_scope);
        END LOOP;
    END IF;
    RETURN pg_catalog.cardinality(v_jobs);
END
$$;
COMMENT ON FUNCTION compaction.reap_conversation(text, timestamptz) IS
    'Internal: reap for one conversation, under its lock; returns how many attempts it marked lease_expired';

CREATE FUNCTION compaction.reap(p_now timestamptz DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
DECLARE
    v_now          timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                       ELSE compaction.caller_now(p_now) END;
    v_conversation text;
    v_count        int := 0;
BEGIN
    -- In conversation order (a reaper only ever tries a lock, so none waits anyway).
    FOR v_conversation IN
        SELECT DISTINCT a.conversation_id
        FROM compaction.attempts AS a
        WHERE a.state = 'running' AND a.lease_expires_at <= v_now
        ORDER BY 1
    LOOP
        v_count := v_count + compaction.reap_conversation(v_conversation, v_now);
    END LOOP;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION compaction.reap(timestamptz) IS
    'Marks running attempts whose lease expired at p_now failed (lease_expired) and re-queues their conversations; returns how many';

-- ==== sql/33_import.sql ====
-- pycompactor stored logic, section 3d: imports.
--
-- import_summary records a summary made by an earlier system under the same shape rules
-- (30_claims.sql) and the same immutability (40_immutability.sql); it never requires the
-- source to be current: a stale import is simply never projected.


CREATE FUNCTION compaction.import_summary(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_summary            text,
    p_completed_at       timestamptz)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
DECLARE
    v_job_id     bigint;
    v_summary_id bigint;
    v_problem    text;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_completed_at IS NULL THEN
        RAISE EXCEPTION 'import_summary needs a conversation, a non-empty scope and model, and completed_at'
            USING ERRCODE = 'CP020';
    END IF;
    IF compaction.oversized_identifier(p_conversation_id, p_scope, p_model) IS NOT NULL THEN
        RAISE EXCEPTION '%', compaction.oversized_identifier(p_conversation_id, p_scope, p_model)
            USING ERRCODE = 'CP020';
    END IF;
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN
        RAISE EXCEPTION 'invalid range: from_pair % is not a non-negative multiple of 10', p_from_pair
            USING ERRCODE = 'CP002';
    END IF;
    IF NOT compaction.valid_source_ids(p_source_message_ids) THEN
        RAISE EXCEPTION 'invalid source ids: a range needs exactly 20 distinct non-null message ids'
            USING ERRCODE = 'CP003';
    END IF;
    IF NOT compaction.valid_source_hash(p_source_hash) THEN
        RAISE EXCEPTION 'invalid source hash: expected 64 lowercase hexadecimal characters'
            USING ERRCODE = 'CP004';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM compaction.prompt_versions AS pv
                   WHERE pv.prompt_version = p_prompt_version) THEN
        RAISE EXCEPTION 'unknown prompt version %', p_prompt_version
            USING ERRCODE = 'CP007';
    END IF;
    v_problem := compaction.summary_problem(p_summary);
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid summary: %', v_problem
            USING ERRCODE = 'CP005';
    END IF;

    PERFORM compaction.lock_conversation(p_conversation_id);

    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;
    BEGIN
        IF v_job_id IS NULL THEN
            INSERT INTO compaction.jobs
                (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
                 model, prompt_version, created_at)
            VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                    p_source_message_ids, p_source_hash, p_model, p_prompt_version,
                    p_completed_at)
            RETURNING job_id INTO v_job_id;
        END IF;
        INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
        VALUES (p_conversation_id, v_job_id, NULL, p_summary, p_completed_at)
        RETURNING summary_id INTO v_summary_id;
    EXCEPTION WHEN unique_violation THEN
        RAISE EXCEPTION 'a completed summary already exists for this identity (conversation %, scope %, pairs %-%)',
                p_conversation_id, p_scope, p_from_pair, p_from_pair + 9
            USING ERRCODE = 'CP006';
    END;
    PERFORM compaction.rederive_summary_verdicts(p_conversation_id, '{}', v_summary_id);
    -- Written here, not by a trigger on job_summaries (DESIGN §11); no attempt row records
    -- an import, so the log does.
    INSERT INTO compaction.event_log
        (conversation_id, kind, occurred_at, scope, from_pair, to_pair, job_id,
         model, prompt_version, source_hash, summary_id, summary_chars)
    VALUES (p_conversation_id, 'import', p_completed_at, p_scope, p_from_pair,
            p_from_pair + 9, v_job_id, p_model, p_prompt_version, p_source_hash,
            v_summary_id, pg_catalog.char_length(p_summary));
    RETURN v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.import_summary(text, text, int, text[], text, text, text, text, timestamptz) IS
    'Records a completed summary made by an earlier system (any known prompt version; source need not be current); returns its summary_id';

-- ==== sql/35_worker_reads.sql ====
-- pycompactor stored logic, section 3b: what the worker reads (Python pycompactor.worker).
--
-- A worker pass asks which targets of a conversation are worth a claim and, after a
-- claim, the ten replies the model summarises. Both read derived state and the 10
-- messages of a claimed range, never the rest of the conversation's text, and no user text
-- at all: the model is given assistant replies only (DESIGN §8).

CREATE FUNCTION compaction.worker_targets(
    p_conversation_id text, p_scope text, p_model text, p_prompt_version text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_from   int[];
    v_ids    text[];
    v_hashes text[];
BEGIN
    -- The targets first, then which of them hold a summary: one statement each (DESIGN
    -- §11). The ids travel as one row of 20 per target.
    SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
           pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
           pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
    INTO v_from, v_ids, v_hashes
    FROM compaction.plan_targets(p_conversation_id) AS t;
    RETURN QUERY
    SELECT t.from_pair, t.from_pair + 9,
           ARRAY(SELECT pg_catalog.unnest(v_ids[t.k::int:t.k::int][1:20])), t.source_hash,
           EXISTS (SELECT 1
                   FROM compaction.jobs AS j
                   JOIN compaction.job_summaries AS s
                     ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
                   WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
                     AND j.from_pair = t.from_pair AND j.source_hash = t.source_hash
                     AND j.model = p_model AND j.prompt_version = p_prompt_version)
    FROM ROWS FROM (pg_catalog.unnest(v_from), pg_catalog.unnest(v_hashes))
         WITH ORDINALITY AS t (from_pair, source_hash, k)
    ORDER BY t.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.worker_targets(text, text, text, text) IS
    'The targets of plan_targets with whether that identity (scope, model, prompt version) already holds a completed summary, so a worker claims only what is left';

CREATE FUNCTION compaction.range_replies(
    p_conversation_id text, p_from_pair int, p_source_hash text)
RETURNS TABLE (pair_index int, assistant_message_id text, assistant_content text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_derived boolean := compaction.derived_state_serves(p_conversation_id);
    v_ids     text[];
    v_hash    text;
BEGIN
    IF p_source_hash IS NULL THEN
        RETURN;
    END IF;
    -- Revision 0037: judged from the views (always on Citus, and on a source without
    -- tracking), the range's current ids cost a judgment of the whole conversation, which
    -- the claim made a moment before. The claim bound the range to the 20 ids its job
    -- keeps: the replies are read with the hash of those ids' texts as they are now, in
    -- one statement (one snapshot, one query to the node that holds the conversation),
    -- and returned only when it is the claimed hash, so the model still never sees text
    -- the hash does not cover. A range that moved with its texts unchanged is not
    -- noticed here; its summary is then judged stale_source, as any summary of a range
    -- that moved after it was written. With no job of that hash, the current range.
    IF NOT v_derived THEN
        SELECT j.source_message_ids INTO v_ids
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.from_pair = p_from_pair
          AND j.source_hash = p_source_hash
        LIMIT 1;
        IF v_ids IS NOT NULL THEN
            RETURN QUERY
            WITH m AS (
                -- Each message looked up on its own, as range_hash does.
                SELECT u.ord, u.message_id, s.role, s.content
                FROM pg_catalog.unnest(v_ids) WITH ORDINALITY AS u (message_id, ord)
                CROSS JOIN LATERAL (
                    SELECT sm.role, sm.content FROM compaction.source_messages AS sm
                    WHERE sm.conversation_id = p_conversation_id
                      AND sm.message_id = u.message_id
                    OFFSET 0) AS s)
            SELECT (p_from_pair + m.ord / 2 - 1)::int, m.message_id, m.content
            FROM m
            WHERE m.ord % 2 = 0 AND m.role = 'assistant'
              -- range_hash's rule, over the rows this statement read
              AND (SELECT CASE WHEN count(*) = 20 THEN
                              pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                                  pg_catalog.int4send(pg_catalog.octet_length(h.message_id))
                                  || pg_catalog.convert_to(h.message_id, 'UTF8')
                                  || pg_catalog.int4send(pg_catalog.octet_length(h.content))
                                  || pg_catalog.convert_to(h.content, 'UTF8'),
                                  ''::bytea ORDER BY h.ord)), 'hex')
                          END
                   FROM m AS h) = p_source_hash
            ORDER BY m.ord;
            RETURN;
        END IF;
    END IF;
    -- Only while the range is what the claim bound: a range edited after the claim
    -- returns no rows, so the model never summarises text the hash does not cover. The
    -- range first, then the texts: one statement each (DESIGN §11). With the derived
    -- state in use the range is current_range's read of compaction.ranges, made here:
    -- current_range would ask derived_state_current again.
    IF v_derived THEN
        SELECT r.source_message_ids, r.source_hash INTO v_ids, v_hash
        FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
    ELSE
        SELECT r.source_message_ids, r.source_hash INTO v_ids, v_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    END IF;
    IF v_hash IS DISTINCT FROM p_source_hash THEN
        RETURN;
    END IF;
    -- source_message_ids is [u0, a0, ..., u9, a9]: the replies sit at the even positions.
    RETURN QUERY
    SELECT (p_from_pair + u.ord / 2 - 1)::int, m.message_id, m.content
    FROM pg_catalog.unnest(v_ids) WITH ORDINALITY AS u (message_id, ord)
    JOIN compaction.source_messages AS m
      ON m.conversation_id = p_conversation_id AND m.message_id = u.message_id
     AND m.role = 'assistant'
    WHERE u.ord % 2 = 0
    ORDER BY u.ord;
END
$$;
COMMENT ON FUNCTION compaction.range_replies(text, int, text) IS
    'The 10 assistant replies of range from_pair (pair_index, message id, text), only while their texts hash to the source hash given: the range''s current hash, or (judged from the views) that of the ids of the job claimed with that hash; no user text';

-- ==== sql/40_immutability.sql ====
-- pycompactor stored logic, section 4: immutability and erasure.
--
-- Completed summaries, identities and the event log never change, for any role: the
-- guards below are BEFORE triggers enabled ALWAYS, so they fire for the owner, for a
-- superuser and under session_replication_role = replica. TRUNCATE is refused by
-- statement triggers (and the privilege is revoked in 90_roles.sql). The log's view,
-- compaction.audit_events, refuses UPDATE and DELETE with the log's own guard.
--
-- The one sanctioned removal is compaction.erase_conversation. It writes its erasure
-- tombstone to compaction.event_log, with the events of the attempts it removes, then
-- marks its transaction as erasing that one conversation (the transaction-local setting
-- compaction.erasing) for as long as its deletes run; the delete guards let a row go only
-- while that mark names the row's conversation (compaction.erasing). Revision 0013: the
-- guards read their own row and that setting, never another table (DESIGN §11), so they
-- work where Citus runs them, on the node holding the shard; Citus carries the SET LOCAL
-- there. An accidental DELETE carries no mark and is refused; setting one by hand is as
-- deliberate as disabling a trigger, which the owner can do anyway (docs/security.md).

CREATE FUNCTION compaction.erasing(p_conversation_id text)
RETURNS boolean
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN pg_catalog.current_setting('compaction.erasing', true) = p_conversation_id;
END
$$;
COMMENT ON FUNCTION compaction.erasing(text) IS
    'Internal: true inside erase_conversation(p_conversation_id) while it deletes that conversation''s rows';

CREATE FUNCTION compaction.jobs_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' AND compaction.erasing(OLD.conversation_id) THEN
        RETURN OLD;
    END IF;
    -- Whether the job holds a summary would need another table (DESIGN §11): an identity
    -- never changes, with or without one.
    RAISE EXCEPTION 'compaction.jobs: job % is an identity and never changes (% refused)',
            OLD.job_id, TG_OP
        USING ERRCODE = 'CP010',
              HINT = 'Erasure requests go through compaction.erase_conversation.';
END
$$;
COMMENT ON FUNCTION compaction.jobs_guard() IS
    'Trigger: refuses UPDATE and DELETE of identities (CP010) except inside erase_conversation';

CREATE FUNCTION compaction.job_summaries_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' AND compaction.erasing(OLD.conversation_id) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'compaction.job_summaries: completed summary % is immutable (% refused)',
            OLD.summary_id, TG_OP
        USING ERRCODE = 'CP010',
              HINT = 'Erasure requests go through compaction.erase_conversation.';
END
$$;
COMMENT ON FUNCTION compaction.job_summaries_guard() IS
    'Trigger: refuses UPDATE and DELETE of completed summaries (CP010) except inside erase_conversation';

CREATE FUNCTION compaction.attempts_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF compaction.erasing(OLD.conversation_id) THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION 'compaction.attempts: the attempt log is append-only (DELETE of job % attempt % refused)',
                OLD.job_id, OLD.attempt
            USING ERRCODE = 'CP011';
    END IF;
    -- The only changes: running -> completed | failed, and a running attempt's lease renewal.
    -- Who claimed it never changes (revision 0018: the fence lets that login alone finish
    -- it), nor the admission slot it took (revision 0026: the slot is freed by that key),
    -- nor its claim event (revision 0027).
    IF OLD.state = 'running'
       AND (NEW.conversation_id, NEW.job_id, NEW.attempt, NEW.worker, NEW.started_at,
            NEW.claimed_by, NEW.slot, NEW.claim_event_id, NEW.claim_recorded_at,
            NEW.claim_xact_id)
           IS NOT DISTINCT FROM
           (OLD.conversation_id, OLD.job_id, OLD.attempt, OLD.worker, OLD.started_at,
            OLD.claimed_by, OLD.slot, OLD.claim_event_id, OLD.claim_recorded_at,
            OLD.claim_xact_id) THEN
        IF NEW.state IN ('completed', 'failed') THEN
            -- The end's event (revision 0027), stamped here so that every way an attempt
            -- ends records it, as an event_log row was written: an id of the log's
            -- sequence, the clock now and this transaction. The guard reads and writes
            -- its own row only (DESIGN §11).
            NEW.finish_event_id := pg_catalog.nextval('compaction.audit_events_event_id_seq');
            NEW.finish_recorded_at := pg_catalog.clock_timestamp();
            NEW.finish_xact_id := pg_catalog.pg_current_xact_id();
            RETURN NEW;
        END IF;
        IF NEW.state = 'running'
           AND (NEW.reason, NEW.finished_at, NEW.finish_reason, NEW.tool_call_count,
                NEW.response_id, NEW.summary_chars, NEW.input_tokens, NEW.output_tokens,
                NEW.figures_total, NEW.figures_kept, NEW.finish_event_id,
                NEW.finish_recorded_at, NEW.finish_xact_id)
               IS NOT DISTINCT FROM
               (OLD.reason, OLD.finished_at, OLD.finish_reason, OLD.tool_call_count,
                OLD.response_id, OLD.summary_chars, OLD.input_tokens, OLD.output_tokens,
                OLD.figures_total, OLD.figures_kept, OLD.finish_event_id,
                OLD.finish_recorded_at, OLD.finish_xact_id) THEN
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'compaction.attempts: only running -> completed | failed may change (job % attempt % is %)',
            OLD.job_id, OLD.attempt, OLD.state
        USING ERRCODE = 'CP011';
END
$$;
COMMENT ON FUNCTION compaction.attempts_guard() IS
    'Trigger: attempts are append-only except running -> completed | failed (stamping the end''s event) and lease renewal (never the claiming login, the slot nor the claim event); DELETE only inside erase_conversation';

CREATE FUNCTION compaction.audit_events_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'compaction.audit_events is append-only (% refused)', TG_OP
        USING ERRCODE = 'CP011';
END
$$;
COMMENT ON FUNCTION compaction.audit_events_guard() IS
    'Trigger: refuses every UPDATE and DELETE of the event log (CP011)';

CREATE FUNCTION compaction.truncate_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'TRUNCATE of %.% refused: engine tables are never truncated',
            TG_TABLE_SCHEMA, TG_TABLE_NAME
        USING ERRCODE = 'CP012',
              HINT = 'Erasure requests go through compaction.erase_conversation.';
END
$$;
COMMENT ON FUNCTION compaction.truncate_guard() IS
    'Trigger: refuses TRUNCATE of an engine table (CP012)';

CREATE TRIGGER jobs_guard
    BEFORE UPDATE OR DELETE ON compaction.jobs
    FOR EACH ROW EXECUTE FUNCTION compaction.jobs_guard();
CREATE TRIGGER job_summaries_guard
    BEFORE UPDATE OR DELETE ON compaction.job_summaries
    FOR EACH ROW EXECUTE FUNCTION compaction.job_summaries_guard();
CREATE TRIGGER attempts_guard
    BEFORE UPDATE OR DELETE ON compaction.attempts
    FOR EACH ROW EXECUTE FUNCTION compaction.attempts_guard();
CREATE TRIGGER audit_events_guard
    BEFORE UPDATE OR DELETE ON compaction.event_log
    FOR EACH ROW EXECUTE FUNCTION compaction.audit_events_guard();
ALTER TABLE compaction.jobs ENABLE ALWAYS TRIGGER jobs_guard;
ALTER TABLE compaction.job_summaries ENABLE ALWAYS TRIGGER job_summaries_guard;
ALTER TABLE compaction.attempts ENABLE ALWAYS TRIGGER attempts_guard;
ALTER TABLE compaction.event_log ENABLE ALWAYS TRIGGER audit_events_guard;

-- Prompt versions (revision 0007): rows are added by migrations; a version is never
-- deleted, its input kind and projectability never change (a mixed-input summary must
-- never become projectable), and accepts_new_jobs may only be closed. For the owner too.
CREATE FUNCTION compaction.prompt_versions_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'UPDATE'
       AND NEW.prompt_version = OLD.prompt_version
       AND NEW.input_kind = OLD.input_kind
       AND NEW.projectable = OLD.projectable
       AND (NEW.accepts_new_jobs = OLD.accepts_new_jobs OR NOT NEW.accepts_new_jobs) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'compaction.prompt_versions: % of % refused: versions are never deleted, input_kind and projectable never change, accepts_new_jobs may only go from true to false',
            TG_OP, OLD.prompt_version
        USING ERRCODE = 'CP013',
              HINT = 'A new prompt is a new version, added by a migration.';
END
$$;
COMMENT ON FUNCTION compaction.prompt_versions_guard() IS
    'Trigger: refuses DELETE and every UPDATE of a prompt version except closing accepts_new_jobs (CP013)';

CREATE TRIGGER prompt_versions_guard
    BEFORE UPDATE OR DELETE ON compaction.prompt_versions
    FOR EACH ROW EXECUTE FUNCTION compaction.prompt_versions_guard();
ALTER TABLE compaction.prompt_versions ENABLE ALWAYS TRIGGER prompt_versions_guard;

CREATE TRIGGER jobs_truncate_guard
    BEFORE TRUNCATE ON compaction.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER attempts_truncate_guard
    BEFORE TRUNCATE ON compaction.attempts
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER job_summaries_truncate_guard
    BEFORE TRUNCATE ON compaction.job_summaries
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER audit_events_truncate_guard
    BEFORE TRUNCATE ON compaction.event_log
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER admission_truncate_guard
    BEFORE TRUNCATE ON compaction.admission
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER queue_truncate_guard
    BEFORE TRUNCATE ON compaction.queue
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER settings_truncate_guard
    BEFORE TRUNCATE ON compaction.settings
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER prompt_versions_truncate_guard
    BEFORE TRUNCATE ON compaction.prompt_versions
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.jobs ENABLE ALWAYS TRIGGER jobs_truncate_guard;
ALTER TABLE compaction.attempts ENABLE ALWAYS TRIGGER attempts_truncate_guard;
ALTER TABLE compaction.job_summaries ENABLE ALWAYS TRIGGER job_summaries_truncate_guard;
ALTER TABLE compaction.event_log ENABLE ALWAYS TRIGGER audit_events_truncate_guard;
ALTER TABLE compaction.admission ENABLE ALWAYS TRIGGER admission_truncate_guard;
ALTER TABLE compaction.queue ENABLE ALWAYS TRIGGER queue_truncate_guard;
ALTER TABLE compaction.settings ENABLE ALWAYS TRIGGER settings_truncate_guard;
ALTER TABLE compaction.prompt_versions ENABLE ALWAYS TRIGGER prompt_versions_truncate_guard;

-- The derived state (revision 0005) is a cache of the source: emptied by TRUNCATE it would
-- be trusted and wrong. It changes only through re-derivation.
CREATE TRIGGER conversation_state_truncate_guard
    BEFORE TRUNCATE ON compaction.conversation_state
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER pairs_truncate_guard
    BEFORE TRUNCATE ON compaction.pairs
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER ranges_truncate_guard
    BEFORE TRUNCATE ON compaction.ranges
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER summary_verdicts_truncate_guard
    BEFORE TRUNCATE ON compaction.summary_verdicts
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
CREATE TRIGGER source_tracking_truncate_guard
    BEFORE TRUNCATE ON compaction.source_tracking
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.conversation_state ENABLE ALWAYS TRIGGER conversation_state_truncate_guard;
ALTER TABLE compaction.pairs ENABLE ALWAYS TRIGGER pairs_truncate_guard;
ALTER TABLE compaction.ranges ENABLE ALWAYS TRIGGER ranges_truncate_guard;
ALTER TABLE compaction.summary_verdicts ENABLE ALWAYS TRIGGER summary_verdicts_truncate_guard;
ALTER TABLE compaction.source_tracking ENABLE ALWAYS TRIGGER source_tracking_truncate_guard;
-- Revision 0048: the record of foreign messages, derived state like the others.
CREATE TRIGGER foreign_messages_truncate_guard
    BEFORE TRUNCATE ON compaction.foreign_messages
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.foreign_messages ENABLE ALWAYS TRIGGER foreign_messages_truncate_guard;

-- Revision 0018: emptied, the conversations' lock rows would be written again by the next
-- claim, but reap would pass over conversations with expired attempts until then.
CREATE TRIGGER conversation_locks_truncate_guard
    BEFORE TRUNCATE ON compaction.conversation_locks
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.conversation_locks ENABLE ALWAYS TRIGGER conversation_locks_truncate_guard;

CREATE FUNCTION compaction.erase_conversation(p_conversation_id text, p_reason text)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_jobs      int;
    v_attempts  int;
    v_summaries int;
BEGIN
    IF p_conversation_id IS NULL THEN
        RAISE EXCEPTION 'erase_conversation needs a conversation id' USING ERRCODE = 'CP020';
    END IF;
    -- The tombstone outlives what it erases and the auditor reads it: a code, not text.
    PERFORM compaction.checked_reason(p_reason);
    PERFORM compaction.lock_conversation(p_conversation_id);

    SELECT count(*) INTO v_jobs FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id;
    SELECT count(*) INTO v_attempts FROM compaction.attempts AS a
    WHERE a.conversation_id = p_conversation_id;
    SELECT count(*) INTO v_summaries FROM compaction.job_summaries AS s
    WHERE s.conversation_id = p_conversation_id;

    -- The tombstone comes first. It holds ids, counts, the reason and the time, never
    -- text of the erased rows.
    INSERT INTO compaction.event_log
        (conversation_id, kind, occurred_at, reason, erased_jobs, erased_attempts, erased_summaries)
    VALUES (p_conversation_id, 'erasure', pg_catalog.now(), p_reason, v_jobs, v_attempts, v_summaries);
    -- The events the erased attempts record (revision 0027) stay in the log, as they are
    -- (ids, times, transactions): metadata, which an erasure never took from the auditor.
    INSERT INTO compaction.event_log
        (conversation_id, event_id, kind, occurred_at, recorded_at, xact_id, scope, from_pair,
         to_pair, job_id, attempt, reason, worker, model, prompt_version, source_hash,
         summary_id, summary_chars, erased_jobs, erased_attempts, erased_summaries)
    SELECT e.conversation_id, e.event_id, e.kind, e.occurred_at, e.recorded_at, e.xact_id,
           e.scope, e.from_pair, e.to_pair, e.job_id, e.attempt, e.reason, e.worker, e.model,
           e.prompt_version, e.source_hash, e.summary_id, e.summary_chars, e.erased_jobs,
           e.erased_attempts, e.erased_summaries
    FROM compaction.attempt_events AS e
    WHERE e.conversation_id = p_conversation_id;

    -- The mark the delete guards look for, as SET LOCAL statements: Citus carries those
    -- (and only those) to the nodes that run the deletes, once told to.
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension AS e WHERE e.extname = 'citus') THEN
        EXECUTE 'SET LOCAL citus.propagate_set_commands = local';
    END IF;
    EXECUTE pg_catalog.format('SET LOCAL compaction.erasing = %L', p_conversation_id);
    DELETE FROM compaction.job_summaries AS s WHERE s.conversation_id = p_conversation_id;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
        lease_expires_at = NULL
    WHERE ad.holder_conversation_id = p_conversation_id;
    DELETE FROM compaction.attempts AS a WHERE a.conversation_id = p_conversation_id;
    DELETE FROM compaction.jobs AS j WHERE j.conversation_id = p_conversation_id;
    DELETE FROM compaction.queue AS q WHERE q.conversation_id = p_conversation_id;
    DELETE FROM compaction.summary_verdicts AS v WHERE v.conversation_id = p_conversation_id;
    -- The rest of the caller's transaction is guarded again.
    EXECUTE 'SET LOCAL compaction.erasing = ''''';
    RETURN v_summaries;
END
$$;
COMMENT ON FUNCTION compaction.erase_conversation(text, text) IS
    'Erasure requests (owner/admin only): removes a conversation''s jobs, attempts, summaries and queue entries, never source rows; leaves a content-free tombstone event (p_reason a code, else CP024); returns summaries removed';

-- ==== sql/50_audit.sql ====
-- pycompactor stored logic, section 5: audit views.
--
-- compaction_auditor reads these and nothing else: metadata only (ids, ranges, hashes, models, versions, states, reasons,
-- times, lengths), never message or summary text. Recipes: docs/audit.md.
--
-- Each audit view over engine tables is a facade over a body view of the same name with
-- `_rows` (the logic, granted to nobody) that compaction.place_audit_views() points at
-- the body directly on one node, where a DBA's filter reaches the body's indexes, and
-- through a definer function on Citus (read_audit_*), where a view's shard queries run
-- with the caller's rights and the auditor holds none on the tables.

CREATE VIEW compaction.audit_jobs_rows AS
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           j.created_at,
           a.attempt,
           a.state,
           a.reason,
           a.worker,
           a.started_at,
           a.lease_expires_at,
           a.finished_at,
           -- Rows written before revision 0007 may hold infinite times; no stored
           -- state may make this view fail.
           CASE WHEN pg_catalog.isfinite(a.finished_at) AND pg_catalog.isfinite(a.started_at)
                THEN a.finished_at - a.started_at END AS duration,
           a.finish_reason,
           a.tool_call_count,
           a.response_id,
           a.summary_chars,
           s.summary_id,
           false AS imported,
           a.input_tokens,
           a.output_tokens,
           a.figures_total,
           a.figures_kept,
           a.claimed_by
    FROM compaction.jobs AS j
    JOIN compaction.attempts AS a
      ON a.conversation_id = j.conversation_id AND a.job_id = j.job_id
    LEFT JOIN compaction.job_summaries AS s
      ON s.conversation_id = a.conversation_id AND s.job_id = a.job_id AND s.attempt = a.attempt
    UNION ALL
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           j.created_at,
           NULL::int,
           'imported'::text,
           NULL::text,
           NULL::text,
           NULL::timestamptz,
           NULL::timestamptz,
           s.completed_at,
           NULL::interval,
           NULL::text,
           NULL::int,
           NULL::text,
           pg_catalog.char_length(s.summary),
           s.summary_id,
           true,
           NULL::int,
           NULL::int,
           NULL::int,
           NULL::int,
           NULL::text
    FROM compaction.jobs AS j
    JOIN compaction.job_summaries AS s
      ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
    WHERE s.attempt IS NULL;
COMMENT ON VIEW compaction.audit_jobs_rows IS
    'Internal: the body of compaction.audit_jobs (granted to nobody)';

-- Computed where the source views are (DESIGN §11, revision 0013). A view that called
-- source_hash per row would, under Citus, be pushed down to the shards on the workers,
-- which have no source views; this function reads the summaries' bindings, then asks
-- source_hash once per range on the node it runs on.
CREATE FUNCTION compaction.stale_summaries()
RETURNS TABLE (summary_id bigint, conversation_id text, scope text, from_pair int,
               to_pair int, job_id bigint, imported boolean, model text,
               prompt_version text, completed_at timestamptz, stored_hash text,
               current_hash text, staleness text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_summary record;
    v_cid     text;
    v_from    int[];
    v_hashes  text[];
    v_hash    text;
BEGIN
    FOR v_summary IN
        SELECT s.summary_id AS sid, j.conversation_id AS cid, j.scope AS sc,
               j.from_pair AS fp, j.to_pair AS tp,
               CASE WHEN s.attempt IS NOT NULL THEN j.job_id END AS jid,
               s.attempt IS NULL AS imp, j.model AS mo, j.prompt_version AS pv,
               s.completed_at AS ca, j.source_hash AS sh
        FROM compaction.job_summaries AS s
        JOIN compaction.jobs AS j
          ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id
        ORDER BY j.conversation_id, j.from_pair, s.summary_id
    LOOP
        -- The current hashes of every summarized range of a conversation at once: from
        -- the views, one judgement of the conversation (revision 0023: source_hash per
        -- range before, a whole judgement each). One statement each (DESIGN §11).
        IF v_cid IS DISTINCT FROM v_summary.cid THEN
            v_cid := v_summary.cid;
            v_from := ARRAY(SELECT DISTINCT j.from_pair
                            FROM compaction.job_summaries AS s
                            JOIN compaction.jobs AS j
                              ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id
                            WHERE s.conversation_id = v_cid);
            SELECT pg_catalog.array_agg(c.from_pair), pg_catalog.array_agg(c.source_hash)
            INTO v_from, v_hashes
            FROM compaction.current_ranges(v_cid, v_from) AS c;
        END IF;
        v_hash := v_hashes[pg_catalog.array_position(v_from, v_summary.fp)];
        CONTINUE WHEN v_hash IS NOT DISTINCT FROM v_summary.sh;
        summary_id := v_summary.sid;
        conversation_id := v_summary.cid;
        scope := v_summary.sc;
        from_pair := v_summary.fp;
        to_pair := v_summary.tp;
        job_id := v_summary.jid;
        imported := v_summary.imp;
        model := v_summary.mo;
        prompt_version := v_summary.pv;
        completed_at := v_summary.ca;
        stored_hash := v_summary.sh;
        current_hash := v_hash;
        staleness := CASE WHEN v_hash IS NULL THEN 'range_incomplete' ELSE 'source_changed' END;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.stale_summaries() IS
    'Internal: the rows of audit_stale_summaries (completed summaries whose range''s current hash differs from the stored one)';

CREATE VIEW compaction.audit_stale_summaries AS
    SELECT st.summary_id, st.conversation_id, st.scope, st.from_pair, st.to_pair, st.job_id,
           st.imported, st.model, st.prompt_version, st.completed_at, st.stored_hash,
           st.current_hash, st.staleness
    FROM compaction.stale_summaries() AS st;
COMMENT ON VIEW compaction.audit_stale_summaries IS
    'Audit: completed summaries whose source changed since (hash recomputed in SQL) or whose range no longer has 10 pairs';

CREATE VIEW compaction.audit_exhausted_rows AS
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           max(a.reason) FILTER (WHERE a.attempt = 1) AS first_reason,
           max(a.reason) FILTER (WHERE a.attempt = 2) AS second_reason,
           max(a.finished_at) AS exhausted_at
    FROM compaction.jobs AS j
    JOIN compaction.attempts AS a
      ON a.conversation_id = j.conversation_id AND a.job_id = j.job_id
    WHERE a.state = 'failed'
      AND NOT EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                      WHERE s.conversation_id = j.conversation_id AND s.job_id = j.job_id)
    GROUP BY j.conversation_id, j.scope, j.from_pair, j.to_pair, j.job_id, j.source_hash,
             j.model, j.prompt_version
    HAVING count(*) >= 2;
COMMENT ON VIEW compaction.audit_exhausted_rows IS
    'Internal: the body of compaction.audit_exhausted (granted to nobody)';

-- Both ages use the server's clock; queue times are finite (queue_times_finite).
CREATE VIEW compaction.audit_queue_rows AS
    SELECT q.scope,
           count(*) FILTER (WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS queued,
           count(*) FILTER (WHERE q.leased_until > pg_catalog.now()) AS leased,
           count(*) FILTER (WHERE q.leased_until <= pg_catalog.now()) AS expired_leases,
           min(q.enqueued_at) FILTER (
               WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS oldest_queued_at,
           pg_catalog.now() - min(q.enqueued_at) FILTER (
               WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS oldest_queued_age
    FROM compaction.queue AS q
    GROUP BY q.scope;
COMMENT ON VIEW compaction.audit_queue_rows IS
    'Internal: the body of compaction.audit_queue (granted to nobody)';

-- The event log (DESIGN §10), revision 0027: the events the attempt rows record (each
-- attempt's claim, and its end as the completion, failure or lease expiry it was), and
-- compaction.event_log, which holds the rest (imports, erasures, the events of erased
-- attempts, everything written before 0027). An attempt's event columns are set once
-- (the claim's with the row, the end's by attempts_guard) and never change after, nor do
-- its job's, nor the summary a completion wrote: a row of this view never changes, and
-- erase_conversation moves its attempts' rows into event_log before it deletes them.
-- The columns are event_log's; an attempt's event shows what the row written at that
-- moment held (no reason nor size at the claim; the summary written, at a completion).
CREATE VIEW compaction.attempt_events AS
    SELECT a.conversation_id,
           a.claim_event_id AS event_id,
           'claim'::text AS kind,
           a.started_at AS occurred_at,
           a.claim_recorded_at AS recorded_at,
           a.claim_xact_id AS xact_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           a.job_id,
           a.attempt,
           NULL::text AS reason,
           a.worker,
           j.model,
           j.prompt_version,
           j.source_hash,
           NULL::bigint AS summary_id,
           NULL::int AS summary_chars,
           NULL::int AS erased_jobs,
           NULL::int AS erased_attempts,
           NULL::int AS erased_summaries
    FROM compaction.attempts AS a
    JOIN compaction.jobs AS j
      ON j.conversation_id = a.conversation_id AND j.job_id = a.job_id
    WHERE a.claim_event_id IS NOT NULL
    UNION ALL
    SELECT a.conversation_id,
           a.finish_event_id,
           CASE WHEN a.state = 'completed' THEN 'completion'
                WHEN a.reason = 'lease_expired' THEN 'lease_expiry'
                ELSE 'failure' END,
           a.finished_at,
           a.finish_recorded_at,
           a.finish_xact_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           a.job_id,
           a.attempt,
           a.reason,
           a.worker,
           j.model,
           j.prompt_version,
           j.source_hash,
           s.summary_id,
           a.summary_chars,
           NULL::int,
           NULL::int,
           NULL::int
    FROM compaction.attempts AS a
    JOIN compaction.jobs AS j
      ON j.conversation_id = a.conversation_id AND j.job_id = a.job_id
    LEFT JOIN compaction.job_summaries AS s
      ON s.conversation_id = a.conversation_id AND s.job_id = a.job_id AND s.attempt = a.attempt
    WHERE a.finish_event_id IS NOT NULL;
COMMENT ON VIEW compaction.attempt_events IS
    'Internal: the events the attempt rows record since revision 0027 (claim; completion, failure or lease_expiry), in event_log''s columns (granted to nobody)';

CREATE VIEW compaction.audit_events_rows AS
    SELECT l.conversation_id, l.event_id, l.kind, l.occurred_at, l.recorded_at, l.xact_id,
           l.scope, l.from_pair, l.to_pair, l.job_id, l.attempt, l.reason, l.worker,
           l.model, l.prompt_version, l.source_hash, l.summary_id, l.summary_chars,
           l.erased_jobs, l.erased_attempts, l.erased_summaries
    FROM compaction.event_log AS l
    UNION ALL
    SELECT * FROM compaction.attempt_events;
COMMENT ON VIEW compaction.audit_events_rows IS
    'Internal: the body of compaction.audit_events (granted to nobody)';

-- The definer functions the facades read through on Citus: the body with the owner's
-- rights, so its shard queries run as the owner (who may log in on the nodes), and a
-- caller's filter applies on the coordinator, after the body (a filter pushed into the
-- body's outer join as a constant is a query Citus cannot plan on PostgreSQL 15 and 16).
-- Their columns are spelled out: Citus takes a function that returns a view's row type
-- for a circular dependency of the view, and then refuses to change the view's owner.
CREATE FUNCTION compaction.read_audit_jobs()
RETURNS TABLE (
        conversation_id text, scope text, from_pair int, to_pair int, job_id bigint,
        source_hash text, model text, prompt_version text, created_at timestamptz,
        attempt int, state text, reason text, worker text, started_at timestamptz,
        lease_expires_at timestamptz, finished_at timestamptz, duration interval,
        finish_reason text, tool_call_count int, response_id text, summary_chars int,
        summary_id bigint, imported boolean, input_tokens int, output_tokens int,
        figures_total int, figures_kept int, claimed_by text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_jobs_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_jobs() IS
    'Internal: the rows of audit_jobs with the owner''s rights (what the view reads on Citus)';

CREATE FUNCTION compaction.read_audit_exhausted()
RETURNS TABLE (
        conversation_id text, scope text, from_pair int, to_pair int, job_id bigint,
        source_hash text, model text, prompt_version text, first_reason text,
        second_reason text, exhausted_at timestamptz)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_exhausted_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_exhausted() IS
    'Internal: the rows of audit_exhausted with the owner''s rights (what the view reads on Citus)';

CREATE FUNCTION compaction.read_audit_queue()
RETURNS TABLE (
        scope text, queued bigint, leased bigint, expired_leases bigint,
        oldest_queued_at timestamptz, oldest_queued_age interval)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_queue_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_queue() IS
    'Internal: the rows of audit_queue with the owner''s rights (what the view reads on Citus)';

CREATE FUNCTION compaction.read_audit_events()
RETURNS TABLE (
        conversation_id text, event_id bigint, kind text, occurred_at timestamptz,
        recorded_at timestamptz, xact_id xid8, scope text, from_pair int, to_pair int,
        job_id bigint, attempt int, reason text, worker text, model text,
        prompt_version text, source_hash text, summary_id bigint, summary_chars int,
        erased_jobs int, erased_attempts int, erased_summaries int)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_events_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_events() IS
    'Internal: the rows of audit_events with the owner''s rights (what the view reads on Citus)';

-- The facades, as one node has them (compaction.place_audit_views() chooses the form).
CREATE VIEW compaction.audit_jobs AS SELECT * FROM compaction.audit_jobs_rows;
COMMENT ON VIEW compaction.audit_jobs IS
    'Audit: every job with each attempt (state, reason, worker, lease, duration, finish metadata, token usage and figures kept as reported to complete, NULL when not reported, and the login that claimed it) and imported summaries as state imported; no text';

CREATE VIEW compaction.audit_exhausted AS SELECT * FROM compaction.audit_exhausted_rows;
COMMENT ON VIEW compaction.audit_exhausted IS
    'Audit: identities whose two attempts both failed (claims answer attempts_exhausted), with both reasons';

CREATE VIEW compaction.audit_queue AS SELECT * FROM compaction.audit_queue_rows;
COMMENT ON VIEW compaction.audit_queue IS
    'Audit: the work queue per scope: entries waiting (queued, of which expired_leases were leased by a worker that did not finish), entries under a live lease (leased), and the oldest waiting entry''s enqueue time and age';

CREATE VIEW compaction.audit_events AS SELECT * FROM compaction.audit_events_rows;
COMMENT ON VIEW compaction.audit_events IS
    'Audit: the append-only event log, one row per state change (claim, completion, failure, lease_expiry, import, erasure), in (recorded_at, event_id) order; metadata only, never text';
-- Its rows never change (DESIGN §10): the view is not updatable (a UNION), so an UPDATE or
-- DELETE is refused in every session, session_replication_role = replica included (an
-- INSTEAD OF trigger cannot be enabled ALWAYS, and under replica a disabled one would make
-- such a statement a silent no-op); event_log's guard refuses them on the table (CP011).

-- ==== sql/60_projection.sql ====
-- pycompactor stored logic, section 6: reads behind projection (Python pycompactor.projection).
--
-- project_history plans from metadata and reads text only for what it includes: the
-- eligible pairs come from compaction.indexed_pairs (ids and byte lengths, no text),
-- projection_summaries returns every summary's binding and whether its source is current
-- (compared with the derived ranges, no hashing at read time), and projection_texts
-- returns the texts of the messages and summaries named. All run as the engine owner
-- (SECURITY DEFINER): the source views run with their owner's rights anyway, and the
-- summaries sit behind engine tables.

-- Revision 0048: the owner's model preference (docs/contract.md §9) as a number, higher
-- preferred, like the version's rank: among a range's valid summaries of one version, a
-- model named earlier in settings.projection_models before one named later, named before
-- unnamed (0). SQL, immutable and without SET clauses, so the planner inlines it into
-- the window orders of judge_summaries and judged_frame.
CREATE FUNCTION compaction.model_preference(p_model text, p_models text[])
RETURNS int
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT coalesce(pg_catalog.cardinality(p_models) + 1
                    - pg_catalog.array_position(p_models, p_model), 0)
$$;
COMMENT ON FUNCTION compaction.model_preference(text, text[]) IS
    'Internal: a model''s rank in the owner''s projection preference, higher preferred: cardinality + 1 - its position in p_models, 0 when not named (docs/contract.md §9)';

CREATE FUNCTION compaction.projection_summaries(p_conversation_id text, p_scope text)
RETURNS TABLE (
    summary_id         bigint,
    from_pair          int,
    to_pair            int,
    source_message_ids text[],
    source_hash        text,
    prompt_version     text,
    projectable        boolean,
    completed_at       timestamptz,
    summary_bytes      int,
    source_current     boolean,
    version_rank       int,
    model_rank         int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_derived boolean := compaction.derived_state_serves(p_conversation_id);
    v_ranges  int[];
    v_from    int[];
    v_ids     text[];
    v_hashes  text[];
    v_models  text[] := (SELECT st.projection_models FROM compaction.settings AS st);
BEGIN
    -- source_current: the range exists now with exactly the stored ids and hash. From the
    -- derived state that is a comparison per summary. Judged from the views, one call
    -- of current_ranges judges the conversation once for every summarized range
    -- (revision 0023: current_range per range before, a whole judgement each, so a
    -- projection's cost grew with the square of the conversation's length), in a
    -- statement of its own (DESIGN §11: no engine function nested in a query on
    -- distributed tables).
    IF NOT v_derived THEN
        SELECT pg_catalog.array_agg(DISTINCT s.from_pair) INTO v_ranges
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id AND s.scope = p_scope;
    END IF;
    IF v_ranges IS NOT NULL THEN
        SELECT pg_catalog.array_agg(c.from_pair ORDER BY c.from_pair),
               ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(
                   c.source_message_ids ORDER BY c.from_pair))),
               pg_catalog.array_agg(c.source_hash ORDER BY c.from_pair)
        INTO v_from, v_ids, v_hashes
        FROM compaction.current_ranges(p_conversation_id, v_ranges) AS c
        WHERE c.source_hash IS NOT NULL;
    END IF;
    RETURN QUERY
    WITH summaries AS (
        SELECT s.summary_id, s.from_pair, s.to_pair, s.source_message_ids, s.source_hash,
               s.prompt_version, s.model, s.completed_at,
               pg_catalog.octet_length(s.summary) AS bytes
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.scope = p_scope
    ), now_ranges AS (
        SELECT r.from_pair, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        WHERE v_derived AND r.conversation_id = p_conversation_id
          AND r.from_pair IN (SELECT x.from_pair FROM summaries AS x)
        UNION ALL
        SELECT u.from_pair, g.ids, u.source_hash
        FROM ROWS FROM (pg_catalog.unnest(v_from), pg_catalog.unnest(v_hashes))
             WITH ORDINALITY AS u (from_pair, source_hash, k)
        JOIN compaction.id_ranges(v_ids) AS g ON g.k = u.k
        WHERE NOT v_derived
    )
    SELECT s.summary_id,
           s.from_pair,
           s.to_pair,
           s.source_message_ids,
           s.source_hash,
           s.prompt_version,
           -- A version missing from prompt_versions is never projected.
           COALESCE(v.projectable, false),
           s.completed_at,
           s.bytes,
           coalesce(n.source_message_ids = s.source_message_ids
                    AND n.source_hash = s.source_hash, false),
           -- Preference among a range's projectable summaries (revision 0009): the
           -- version's number after '@', higher first; -1 for a version without one.
           coalesce(pg_catalog.substring(s.prompt_version, '@([0-9]{1,9})$')::int, -1),
           -- Then the owner's model preference (revision 0048), higher first.
           compaction.model_preference(s.model, v_models)
    FROM summaries AS s
    LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = s.prompt_version
    LEFT JOIN now_ranges AS n ON n.from_pair = s.from_pair
    ORDER BY s.from_pair, s.summary_id;
END
$$;
COMMENT ON FUNCTION compaction.projection_summaries(text, text) IS
    'Completed summaries of a conversation and scope without their text: source binding, version, whether it is projectable, completed_at, UTF-8 byte length, whether its source is current, the version''s rank (the number after @, -1 without one; higher is preferred) and the model''s rank in settings.projection_models (higher is preferred, 0 when not named)';

CREATE FUNCTION compaction.projection_texts(
    p_conversation_id text, p_message_ids text[], p_summary_ids bigint[])
RETURNS TABLE (message_id text, summary_id bigint, content text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        -- By primary key, one probe per id (OFFSET 0 keeps the probe a probe on a table
        -- without statistics): only the rows named are read, however long the
        -- conversation.
        SELECT m.message_id, NULL::bigint, m.content
        FROM pg_catalog.unnest(p_message_ids) AS i (message_id)
        CROSS JOIN LATERAL (
            SELECT sm.message_id, sm.content
            FROM compaction.source_messages AS sm
            WHERE sm.conversation_id = p_conversation_id AND sm.message_id = i.message_id
            OFFSET 0) AS m
        UNION ALL
        SELECT NULL::text, s.summary_id, s.summary
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.summary_id = ANY (p_summary_ids);
END
$$;
COMMENT ON FUNCTION compaction.projection_texts(text, text[], bigint[]) IS
    'Texts of the named messages and summaries of one conversation (what a projection includes), one row each';

-- Summary verdicts (revision 0014): the rules of DESIGN §9 that do not depend on the
-- budget, in the order it gives. pycompactor.projection.select_summaries is the in-memory
-- twin. Judged against the derived ranges; compaction.summary_verdicts keeps the result.
CREATE FUNCTION compaction.judge_summaries(p_conversation_id text, p_summary_ids bigint[])
RETURNS TABLE (summary_id bigint, scope text, from_pair int, reason text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_models text[] := (SELECT st.projection_models FROM compaction.settings AS st);
BEGIN
    RETURN QUERY
    WITH stored AS (
        SELECT js.summary_id, j.scope, j.from_pair, js.completed_at,
               -- The owner's model preference (revision 0048), higher preferred.
               compaction.model_preference(j.model, v_models) AS model_rank,
               coalesce(v.projectable, false) AS projectable,
               -- The version's number after '@', higher preferred; -1 without one.
               coalesce(pg_catalog.substring(j.prompt_version, '@([0-9]{1,9})$')::int, -1)
                   AS version_rank,
               -- Current: the range exists now with exactly the stored ids and hash.
               coalesce(r.source_hash = j.source_hash
                        AND r.source_message_ids = j.source_message_ids, false) AS current
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = j.prompt_version
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = j.from_pair
        WHERE js.conversation_id = p_conversation_id
          AND (p_summary_ids IS NULL OR js.summary_id = ANY (p_summary_ids))
    ), judged AS (
        SELECT s.summary_id, s.scope, s.from_pair, s.version_rank, s.model_rank,
               s.completed_at,
               CASE WHEN NOT s.projectable THEN 'version_not_projectable'
                    WHEN NOT s.current THEN 'stale_source' END AS reason
        FROM stored AS s
    )
    SELECT j.summary_id, j.scope, j.from_pair,
           CASE WHEN j.reason IS NULL
                     AND pg_catalog.row_number() OVER (
                             PARTITION BY j.scope, j.from_pair, j.reason IS NULL
                             ORDER BY j.version_rank DESC, j.model_rank DESC,
                                      j.completed_at DESC, j.summary_id DESC) > 1
                THEN 'superseded' ELSE j.reason END
    FROM judged AS j;
END
$$;
COMMENT ON FUNCTION compaction.judge_summaries(text, bigint[]) IS
    'Internal: the verdict on each named summary of a conversation (every summary when NULL) against the derived ranges: NULL for the one its range uses in its scope, else version_not_projectable, stale_source or superseded (DESIGN §9, in that order); name every summary of a range together';

-- Called wherever a range or a summary is written: the tracking paths (the ranges they
-- wrote or deleted), complete and import_summary (the new summary, with the others of its
-- range, which it may supersede), rederive_conversation (all).
CREATE FUNCTION compaction.rederive_summary_verdicts(
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

-- Revision 0048: the owner's model preference (docs/contract.md §9). The verdicts it
-- decides are derived state, so setting it re-judges every conversation that has a
-- verdict, each under its conversation_state row as complete and import_summary take it
-- (sql/25_tracking.sql): a completion that judged its range with the old preference
-- commits before its conversation is re-judged here, and one that waits for this
-- transaction judges with the new one. A conversation without a verdict has no summary
-- to order, and the first summary of a range has none to be preferred to. Slow on a
-- large database (every summary is judged once), and meant to be: it is a rare decision
-- of the owner's. On Citus no verdict is stored and nothing is re-judged.
CREATE FUNCTION compaction.set_projection_models(p_models text[])
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_conversation text;
    v_count        int := 0;
BEGIN
    IF p_models IS NULL
       OR pg_catalog.array_ndims(p_models) > 1
       OR pg_catalog.array_position(p_models, NULL) IS NOT NULL
       OR pg_catalog.cardinality(p_models) > 100
       OR EXISTS (SELECT FROM pg_catalog.unnest(p_models) AS m (model)
                  WHERE NOT compaction.has_content(m.model))
       OR (SELECT count(DISTINCT m.model) FROM pg_catalog.unnest(p_models) AS m (model))
          <> pg_catalog.cardinality(p_models) THEN
        RAISE EXCEPTION 'p_models must list at most 100 distinct model names, none NULL or blank, got %',
            p_models
            USING ERRCODE = 'CP020',
                  HINT = 'Name models as workers record them, e.g. ARRAY[''gpt-4o-mini'']; ''{}'' for no preference.';
    END IF;
    UPDATE compaction.settings AS st
    SET projection_models = p_models
    WHERE st.singleton;
    FOR v_conversation IN
        SELECT DISTINCT v.conversation_id FROM compaction.summary_verdicts AS v ORDER BY 1
    LOOP
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (v_conversation, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        PERFORM compaction.rederive_summary_verdicts(v_conversation, NULL);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION compaction.set_projection_models(text[]) IS
    'Sets the owner''s model preference for projection (settings.projection_models, docs/contract.md §9: among a range''s valid summaries of one version, a model named earlier before one named later, named before unnamed; ''{}'' for none) and re-judges the stored verdicts; returns how many conversations were re-judged (owner only)';

CREATE FUNCTION compaction.projection_models()
RETURNS text[]
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT st.projection_models FROM compaction.settings AS st
$$;
COMMENT ON FUNCTION compaction.projection_models() IS
    'The owner''s model preference for projection (settings.projection_models; empty when none): model names only, no content';

-- Revision 0041: projection_frame's row judged from the views (before an install's
-- rebuild has finished, after a source view is re-pointed, and always on Citus), from one
-- judgement of the conversation. The judgement reads every pair anyway, so the frame
-- holds them all (first_pair 0: a walk never reads again), and each summary of the scope
-- gets the verdict judge_summaries gives it from the derived state, in DESIGN §9's
-- order, against the ranges judged here. Only the ranges whose current ids are those of
-- a projectable summary are hashed: the other summaries are not projectable or stale
-- whatever the texts say. (Until this revision the driver read the pairs through
-- indexed_pairs and then the verdicts' inputs through projection_summaries: two
-- judgements, in four round trips after projection_read's.) Each statement that calls
-- an engine function stands alone (DESIGN §11); between statements the arrays are zipped
-- by unnest, never subscripted in a query, where a subscript walks a text[] from its
-- start.
CREATE FUNCTION compaction.judged_frame(p_conversation_id text, p_scope text)
RETURNS TABLE (
    derived               boolean,
    pair_count            int,
    first_pair            int,
    user_message_ids      text[],
    assistant_message_ids text[],
    user_bytes            int[],
    assistant_bytes       int[],
    summary_ids           bigint[],
    summary_from_pairs    int[],
    summary_reasons       text[],
    summary_bytes         int[]
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Not the generic plans of projection_frame, its caller: the functions this one calls
-- keep the planning they had when the driver called them (on Citus judge_runs has no
-- setting of its own, and Citus plans a query only with its values bound).
SET plan_cache_mode = auto
AS $$
#variable_conflict use_column
DECLARE
    v_users       text[];
    v_assistants  text[];
    v_user_sizes  int[];
    v_sizes       int[];
    -- The scope's summaries, in (from_pair, summary_id) order; v_stored_ids holds their
    -- 20 ids each (n x 20: a stored summary has exactly 20, jobs_valid_source_ids).
    v_summary_ids bigint[];
    v_froms       int[];
    v_stored_ids  text[];
    v_hashes      text[];
    v_projectable boolean[];
    v_ranks       int[];
    v_model_ranks int[];
    v_models      text[] := (SELECT st.projection_models FROM compaction.settings AS st);
    v_completed   timestamptz[];
    v_bytes       int[];
    -- Per summary, whether its range exists now with its 20 ids; the ranges to hash.
    v_same_ids    boolean[];
    v_hash_froms  int[];
    v_hash_ids    text[];
    v_now_froms   int[];
    v_now_hashes  text[];
BEGIN
    -- The one judgement: every eligible pair, in order.
    SELECT pg_catalog.array_agg(j.user_message_id), pg_catalog.array_agg(j.assistant_message_id),
           pg_catalog.array_agg(j.user_bytes), pg_catalog.array_agg(j.assistant_bytes)
    INTO v_users, v_assistants, v_user_sizes, v_sizes
    FROM (SELECT q.user_message_id, q.assistant_message_id, q.user_bytes, q.assistant_bytes
          FROM compaction.judged_pairs(p_conversation_id) AS q
          ORDER BY q.pair_index) AS j;
    -- The scope's summaries, what judge_summaries reads of them.
    SELECT pg_catalog.array_agg(s.summary_id), pg_catalog.array_agg(s.from_pair),
           pg_catalog.array_agg(s.source_message_ids), pg_catalog.array_agg(s.source_hash),
           pg_catalog.array_agg(s.projectable), pg_catalog.array_agg(s.version_rank),
           pg_catalog.array_agg(s.model_rank),
           pg_catalog.array_agg(s.completed_at), pg_catalog.array_agg(s.bytes)
    INTO v_summary_ids, v_froms, v_stored_ids, v_hashes, v_projectable, v_ranks,
         v_model_ranks, v_completed, v_bytes
    FROM (SELECT x.summary_id, x.from_pair, x.source_message_ids, x.source_hash,
                 coalesce(v.projectable, false) AS projectable,
                 -- The version's number after '@', higher preferred; -1 without one.
                 coalesce(pg_catalog.substring(x.prompt_version, '@([0-9]{1,9})$')::int, -1)
                     AS version_rank,
                 -- The owner's model preference (revision 0048), higher preferred.
                 compaction.model_preference(x.model, v_models) AS model_rank,
                 x.completed_at, pg_catalog.octet_length(x.summary) AS bytes
          FROM compaction.summaries AS x
          LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = x.prompt_version
          WHERE x.conversation_id = p_conversation_id AND x.scope = p_scope
          ORDER BY x.from_pair, x.summary_id) AS s;
    -- Which summaries' ranges exist now with their ids, and the ranges whose hash decides
    -- a verdict (a projectable summary's, with its ids), each once, with its 20 ids.
    WITH pairs AS (
        SELECT p.k - 1 AS pair_index, p.user_id, p.assistant_id
        FROM ROWS FROM (pg_catalog.unnest(v_users), pg_catalog.unnest(v_assistants))
             WITH ORDINALITY AS p (user_id, assistant_id, k)
    ), ranges AS (
        -- The current ids of the ranges that have summaries, only.
        SELECT (q.pair_index / 10 * 10)::int AS from_pair,
               pg_catalog.array_agg(x.id ORDER BY q.pair_index, x.n) AS ids
        FROM pairs AS q
        CROSS JOIN LATERAL (VALUES (1, q.user_id), (2, q.assistant_id)) AS x (n, id)
        WHERE (q.pair_index / 10 * 10)::int = ANY (v_froms)
        GROUP BY 1
        HAVING count(*) = 20
    ), compared AS MATERIALIZED (
        SELECT u.k, u.from_pair, u.projectable, r.ids,
               coalesce(r.ids = g.ids, false) AS same_ids
        FROM ROWS FROM (pg_catalog.unnest(v_froms), pg_catalog.unnest(v_projectable))
             WITH ORDINALITY AS u (from_pair, projectable, k)
        JOIN compaction.id_ranges(ARRAY(SELECT pg_catalog.unnest(v_stored_ids))) AS g
          ON g.k = u.k
        LEFT JOIN ranges AS r ON r.from_pair = u.from_pair
    ), hashed AS (
        SELECT DISTINCT ON (c.from_pair) c.from_pair, c.ids
        FROM compared AS c
        WHERE c.projectable AND c.same_ids
        ORDER BY c.from_pair
    )
    SELECT (SELECT pg_catalog.array_agg(c.same_ids ORDER BY c.k) FROM compared AS c),
           (SELECT pg_catalog.array_agg(h.from_pair ORDER BY h.from_pair) FROM hashed AS h),
           (SELECT pg_catalog.array_agg(e.id ORDER BY h.from_pair, e.n)
            FROM hashed AS h
            CROSS JOIN LATERAL pg_catalog.unnest(h.ids) WITH ORDINALITY AS e (id, n))
    INTO v_same_ids, v_hash_froms, v_hash_ids;
    SELECT pg_catalog.array_agg(h.from_pair), pg_catalog.array_agg(h.source_hash)
    INTO v_now_froms, v_now_hashes
    FROM compaction.range_hashes(p_conversation_id, v_hash_froms, v_hash_ids) AS h;
    -- The verdicts: judge_summaries' rule, against the ranges judged above.
    RETURN QUERY
    WITH judged AS (
        SELECT u.summary_id, u.from_pair, u.version_rank, u.model_rank, u.completed_at,
               u.bytes,
               CASE WHEN NOT u.projectable THEN 'version_not_projectable'
                    WHEN NOT coalesce(u.same_ids AND h.source_hash = u.source_hash, false)
                        THEN 'stale_source' END AS reason
        FROM ROWS FROM (pg_catalog.unnest(v_summary_ids), pg_catalog.unnest(v_froms),
                        pg_catalog.unnest(v_hashes), pg_catalog.unnest(v_projectable),
                        pg_catalog.unnest(v_ranks), pg_catalog.unnest(v_model_ranks),
                        pg_catalog.unnest(v_completed),
                        pg_catalog.unnest(v_bytes), pg_catalog.unnest(v_same_ids))
             AS u (summary_id, from_pair, source_hash, projectable, version_rank,
                   model_rank, completed_at, bytes, same_ids)
        LEFT JOIN ROWS FROM (pg_catalog.unnest(v_now_froms), pg_catalog.unnest(v_now_hashes))
             AS h (from_pair, source_hash) ON h.from_pair = u.from_pair
    ), verdicts AS (
        SELECT j.summary_id, j.from_pair,
               CASE WHEN j.reason IS NULL
                         AND pg_catalog.row_number() OVER (
                                 PARTITION BY j.from_pair, j.reason IS NULL
                                 ORDER BY j.version_rank DESC, j.model_rank DESC,
                                          j.completed_at DESC, j.summary_id DESC) > 1
                    THEN 'superseded' ELSE j.reason END AS reason,
               j.bytes
        FROM judged AS j
    ), listed AS (
        -- In (from_pair, summary_id) order, as projection_frame gives them; a size only
        -- for the summary a range uses.
        SELECT pg_catalog.array_agg(o.summary_id) AS ids,
               pg_catalog.array_agg(o.from_pair) AS froms,
               pg_catalog.array_agg(o.reason) AS reasons,
               pg_catalog.array_agg(o.bytes) AS sizes
        FROM (SELECT v.summary_id, v.from_pair, v.reason,
                     CASE WHEN v.reason IS NULL THEN v.bytes END AS bytes
              FROM verdicts AS v
              ORDER BY v.from_pair, v.summary_id) AS o
    )
    SELECT false, coalesce(pg_catalog.cardinality(v_users), 0), 0,
           coalesce(v_users, '{}'), coalesce(v_assistants, '{}'),
           coalesce(v_user_sizes, '{}'), coalesce(v_sizes, '{}'),
           coalesce(l.ids, '{}'), coalesce(l.froms, '{}'), coalesce(l.reasons, '{}'),
           coalesce(l.sizes, '{}')
    FROM listed AS l;
END
$$;
COMMENT ON FUNCTION compaction.judged_frame(text, text) IS
    'Internal: projection_frame''s row judged from the views in one judgement: every eligible pair (first_pair 0) and every summary''s verdict of the scope, derived = false';

-- The projection's one read (revision 0014): what the walk needs from the newest pairs
-- back, and the verdicts it needs, in one statement, so a projection costs one round trip
-- (projection_read) and, while the derived state is in use, grows with the budget rather
-- than with the history. Pair metadata comes only for the newest p_pairs pairs (rounded
-- to whole ranges); the walk asks again for more when it gets past them. The verdicts
-- (revision 0015) are every rejected summary's, wherever its range lies (DESIGN §9: only
-- did_not_fit depends on the budget), and the chosen summaries' of the ranges those pairs
-- cover, with their byte length: a chosen summary beyond the walk's reach is not tried,
-- so not listed. They come in (from_pair, summary_id) order (the aggregates follow the
-- sorted subquery; the driver checks it and sorts if not). While the derived state is not
-- in use, the row is judged_frame's (revision 0041): derived is false, and every pair
-- and every verdict is given, judged from the views.
CREATE FUNCTION compaction.projection_frame(p_conversation_id text, p_scope text, p_pairs int)
RETURNS TABLE (
    derived               boolean,
    pair_count            int,
    first_pair            int,
    user_message_ids      text[],
    assistant_message_ids text[],
    user_bytes            int[],
    assistant_bytes       int[],
    summary_ids           bigint[],
    summary_from_pairs    int[],
    summary_reasons       text[],
    summary_bytes         int[]
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One plan for every call: the statements are lookups by key whatever the conversation,
-- and planning them afresh cost more than running them.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_count int;
    v_first int;
BEGIN
    IF p_pairs IS NULL OR p_pairs < 0 THEN
        RAISE EXCEPTION 'p_pairs must be 0 or more, got %', p_pairs USING ERRCODE = 'CP020';
    END IF;
    IF NOT compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY SELECT * FROM compaction.judged_frame(p_conversation_id, p_scope);
        RETURN;
    END IF;
    SELECT cs.pair_count INTO v_count
    FROM compaction.conversation_state AS cs
    WHERE cs.conversation_id = p_conversation_id;
    v_count := coalesce(v_count, 0);
    v_first := greatest(0, v_count - p_pairs);
    v_first := v_first - v_first % 10;
    RETURN QUERY
    WITH suffix AS (
        -- The four arrays take the rows in the subquery's order, read in index order
        -- (revision 0029: an ORDER BY in each aggregate sorted them four times).
        SELECT pg_catalog.array_agg(p.user_message_id) AS users,
               pg_catalog.array_agg(p.assistant_message_id) AS assistants,
               pg_catalog.array_agg(p.user_bytes) AS user_sizes,
               pg_catalog.array_agg(p.assistant_bytes) AS assistant_sizes
        FROM (SELECT q.user_message_id, q.assistant_message_id, q.user_bytes, q.assistant_bytes
              FROM compaction.pairs AS q
              WHERE q.conversation_id = p_conversation_id AND q.pair_index >= v_first
              ORDER BY q.pair_index) AS p
    ), verdicts AS (
        -- One sort for the four arrays: they take the rows in the subquery's order (an
        -- ORDER BY in each aggregate sorted them four times). The driver checks the order
        -- all the same.
        SELECT pg_catalog.array_agg(o.summary_id) AS ids,
               pg_catalog.array_agg(o.from_pair) AS froms,
               pg_catalog.array_agg(o.reason) AS reasons,
               pg_catalog.array_agg(o.bytes) AS sizes
        FROM (SELECT v.summary_id, v.from_pair, v.reason, NULL::int AS bytes
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
                AND v.reason IS NOT NULL
              UNION ALL
              SELECT v.summary_id, v.from_pair, NULL::text,
                     (SELECT pg_catalog.octet_length(js.summary)
                      FROM compaction.job_summaries AS js
                      WHERE js.conversation_id = p_conversation_id
                        AND js.summary_id = v.summary_id)
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
                AND v.reason IS NULL AND v.from_pair >= v_first
              ORDER BY 2, 1) AS o
    )
    SELECT true, v_count, v_first,
           coalesce(x.users, '{}'), coalesce(x.assistants, '{}'),
           coalesce(x.user_sizes, '{}'), coalesce(x.assistant_sizes, '{}'),
           coalesce(y.ids, '{}'), coalesce(y.froms, '{}'), coalesce(y.reasons, '{}'),
           coalesce(y.sizes, '{}')
    FROM suffix AS x CROSS JOIN verdicts AS y;
END
$$;
COMMENT ON FUNCTION compaction.projection_frame(text, text, int) IS
    'What a projection plans from, in one row: the pair count, the metadata of the newest p_pairs pairs (from first_pair, whole ranges; no text), every rejected summary of the conversation and scope with its reason (version_not_projectable, stale_source, superseded), and the chosen summary (reason NULL) of each range those pairs cover with its UTF-8 byte length; while the derived state is not in use, derived = false and every pair and verdict, judged from the views (first_pair 0)';

-- The projection in one statement (revision 0029): the frame, then the texts of what the
-- budget walk includes, so a projection is one round trip in one snapshot (the
-- statement's own: an autocommit caller needs no transaction for it). When the walk gets
-- past the frame's pairs, the frame is read again further back within the statement. The
-- walk here is pycompactor.projection._walk's twin (and the step back _next_read's), used
-- only to choose which texts to send: the driver walks the returned frame itself and, if
-- a text it needs is not among these, reads again in a snapshot of its own; so a
-- difference between the two walks costs a read, never a different projection (a test
-- holds them equal). p_marker_bytes is the UTF-8 size of the driver's summary marker line
-- without its two pair numbers: the rendering is the driver's, only its size is needed.
-- Judged from the views (revision 0041), the frame holds every pair, so the walk finishes
-- on the first frame and the whole projection is still this one statement.
CREATE FUNCTION compaction.projection_read(
    p_conversation_id text, p_scope text, p_pairs int, p_budget_bytes bigint,
    p_marker_bytes int)
RETURNS TABLE (
    derived               boolean,
    pair_count            int,
    first_pair            int,
    user_message_ids      text[],
    assistant_message_ids text[],
    user_bytes            int[],
    assistant_bytes       int[],
    summary_ids           bigint[],
    summary_from_pairs    int[],
    summary_reasons       text[],
    summary_bytes         int[],
    message_id            text,
    summary_id            bigint,
    content               text
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    f             record;
    -- The frame's arrays as variables of their own: PL/pgSQL subscripts those in place,
    -- where a record's field would be copied whole at every subscript.
    v_users       text[];
    v_assistants  text[];
    v_user_sizes  int[];
    v_sizes       int[];
    v_froms       int[];
    v_reasons     text[];
    v_ids         bigint[];
    v_bytes       int[];
    v_first       int;
    v_wanted      bigint := p_pairs;
    v_given       bigint;
    v_finished    boolean;
    v_remaining   bigint;
    v_index       int;
    v_start       int;
    v_at          int;
    v_chosen      int;
    v_cost        bigint;
    v_dropped     int := -1;
    v_message_ids text[] := '{}';
    v_summary_ids bigint[] := '{}';
BEGIN
    IF p_budget_bytes IS NULL OR p_budget_bytes < 0 THEN
        RAISE EXCEPTION 'p_budget_bytes must be 0 or more, got %', p_budget_bytes
            USING ERRCODE = 'CP020';
    END IF;
    IF p_marker_bytes IS NULL OR p_marker_bytes < 0 THEN
        RAISE EXCEPTION 'p_marker_bytes must be 0 or more, got %', p_marker_bytes
            USING ERRCODE = 'CP020';
    END IF;
    LOOP
        SELECT * INTO f FROM compaction.projection_frame(p_conversation_id, p_scope, v_wanted::int);
        v_users := f.user_message_ids;
        v_assistants := f.assistant_message_ids;
        v_user_sizes := f.user_bytes;
        v_sizes := f.assistant_bytes;
        v_froms := f.summary_from_pairs;
        v_reasons := f.summary_reasons;
        v_ids := f.summary_ids;
        v_bytes := f.summary_bytes;
        v_first := f.first_pair;
        v_remaining := p_budget_bytes;
        v_dropped := -1;
        v_message_ids := '{}';
        v_summary_ids := '{}';
        v_finished := true;
        -- Newest first. The verdicts come in from_pair order, so one cursor (v_chosen)
        -- moving down them finds each range's chosen summary (reason NULL, with its size).
        v_chosen := coalesce(pg_catalog.array_length(v_ids, 1), 0);
        v_index := f.pair_count - 1;
        WHILE v_index >= 0 LOOP
            IF v_index < v_first THEN
                v_finished := false;  -- the walk needs pairs older than the frame's
                EXIT;
            END IF;
            v_start := v_index - v_index % 10;
            WHILE v_chosen > 0 AND (v_froms[v_chosen] > v_start
                                    OR v_reasons[v_chosen] IS NOT NULL) LOOP
                v_chosen := v_chosen - 1;
            END LOOP;
            IF v_chosen > 0 AND v_froms[v_chosen] = v_start AND v_bytes[v_chosen] IS NOT NULL
               AND v_dropped <> v_start THEN
                -- The block: the range's user messages, then the summary message (marker
                -- line with the two pair numbers, newline, summary).
                v_at := v_start - v_first + 1;
                v_cost := p_marker_bytes::bigint + pg_catalog.length(v_start::text)
                          + pg_catalog.length((v_start + 9)::text) + 1 + v_bytes[v_chosen] + 16;
                FOR v_k IN v_at .. v_at + 9 LOOP
                    v_cost := v_cost + v_user_sizes[v_k] + 16;
                END LOOP;
                IF v_cost <= v_remaining THEN
                    v_remaining := v_remaining - v_cost;
                    -- One id at a time (revision 0043): `v := array_append(v, x)` grows
                    -- the variable in place, where `v || slice` or `v || x || y` copied
                    -- the whole list at every step (the square of the texts: a fifth of
                    -- a 1 MiB projection's statement).
                    FOR v_k IN v_at .. v_at + 9 LOOP
                        v_message_ids := pg_catalog.array_append(v_message_ids, v_users[v_k]);
                    END LOOP;
                    v_summary_ids := pg_catalog.array_append(v_summary_ids, v_ids[v_chosen]);
                    v_index := v_start - 1;
                    CONTINUE;
                END IF;
                v_dropped := v_start;  -- it does not fit: this range's raw pairs instead
            END IF;
            v_at := v_index - v_first + 1;
            v_cost := v_user_sizes[v_at]::bigint + v_sizes[v_at] + 32;
            EXIT WHEN v_cost > v_remaining;
            v_remaining := v_remaining - v_cost;
            v_message_ids := pg_catalog.array_append(v_message_ids, v_users[v_at]);
            v_message_ids := pg_catalog.array_append(v_message_ids, v_assistants[v_at]);
            v_index := v_index - 1;
        END LOOP;
        EXIT WHEN v_finished;
        -- Read further back, in this statement's snapshot: as many pairs as the whole
        -- budget would take at the rate it was spent, a quarter more, at least twice as
        -- many, in whole ranges (the driver's _next_read). The frame reaches pair 0 in
        -- the end, where every walk finishes.
        -- In numeric: the budget may be as large as a bigint. At least 10 more than
        -- given, so a frame of no pairs (p_pairs 0) steps back too.
        v_given := f.pair_count - v_first;
        v_wanted := least(greatest(2 * v_given, v_given + 10,
                                   pg_catalog.ceil(v_given::numeric * p_budget_bytes * 5
                                                   / (4 * greatest(p_budget_bytes - v_remaining, 1)))),
                          2147483640)::bigint;
        v_wanted := least(v_wanted + (10 - v_wanted % 10) % 10, 2147483640);
    END LOOP;
    RETURN QUERY SELECT f.derived, f.pair_count, f.first_pair, f.user_message_ids,
                        f.assistant_message_ids, f.user_bytes, f.assistant_bytes,
                        f.summary_ids, f.summary_from_pairs, f.summary_reasons,
                        f.summary_bytes, NULL::text, NULL::bigint, NULL::text;
    RETURN QUERY
        SELECT NULL::boolean, NULL::int, NULL::int, NULL::text[], NULL::text[], NULL::int[],
               NULL::int[], NULL::bigint[], NULL::int[], NULL::text[], NULL::int[],
               t.message_id, t.summary_id, t.content
        -- projection_texts' query, written out (revision 0043): through that function's
        -- statement of its own each text row was stored twice more (a tenth of a 1 MiB
        -- projection). Not shared as an inlined SQL function: no SQL-language function
        -- may read distributed tables, whose parameters Citus cannot plan (the rules in
        -- docs/operations.md, "Scaling out with Citus").
        FROM (SELECT m.message_id, NULL::bigint AS summary_id, m.content
              FROM pg_catalog.unnest(v_message_ids) AS i (message_id)
              CROSS JOIN LATERAL (
                  SELECT sm.message_id, sm.content
                  FROM compaction.source_messages AS sm
                  WHERE sm.conversation_id = p_conversation_id
                    AND sm.message_id = i.message_id
                  OFFSET 0) AS m
              UNION ALL
              SELECT NULL::text, s.summary_id, s.summary
              FROM compaction.summaries AS s
              WHERE s.conversation_id = p_conversation_id
                AND s.summary_id = ANY (v_summary_ids)) AS t;
END
$$;
COMMENT ON FUNCTION compaction.projection_read(text, text, int, bigint, int) IS
    'A projection''s reads in one statement: first projection_frame''s row for the newest p_pairs pairs or, when the budget walk gets past them, for as many more as it needs (text columns NULL), then (message_id, summary_id, content) of each message and summary the walk includes (frame columns NULL). p_marker_bytes: UTF-8 bytes of the summary marker line without its pair numbers';

-- ==== sql/80_citus.sql ====
-- pycompactor stored logic, section 8: scaling out with Citus (DESIGN §11).
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
    -- distributed apart from the other tables (revision 0022): an application's
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
-- metadata): the form the audit views and the view grants take (revision 0024). Citus's
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

-- Revision 0024: the reader's and the worker's views on Citus. There, as for the
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
    ALTER FUNCTION compaction.judge_runs(text, text[], boolean) RESET plan_cache_mode;
    -- Revision 0038: a judgement's question to every shard of the messages runs on one
    -- connection per node. Its tasks are index probes of a few runs each; with more
    -- connections the executor opened new ones to the workers in most judgements (14 ms
    -- against 9.6 ms for a conversation of 100 runs on the loopback cluster, and the
    -- drain of `make bench-citus` took 7.4-9.2 s against 5.6-5.8 s).
    ALTER FUNCTION compaction.judge_runs(text, text[], boolean)
        SET citus.max_adaptive_executor_pool_size = 1;
    -- Revision 0041: judged from the views (always, on Citus) projection_read sends the
    -- texts in its own statement (through projection_texts until revision 0043), whose
    -- queries Citus can plan only with the values bound; on one node it forces generic
    -- plans.
    ALTER FUNCTION compaction.projection_read(text, text, int, bigint, int)
        RESET plan_cache_mode;
    CALL compaction.place_audit_views();
    CALL compaction.place_view_grants();
END
$$;
COMMENT ON PROCEDURE compaction.distribute_on_citus() IS
    'Citus: detaches the change-tracking and queue triggers from every table, distributes every engine table as compaction.citus_tables() says, then places the audit views and the reader''s and worker''s grants (run once, as a superuser, on the coordinator)';

-- ==== sql/90_roles.sql ====
-- pycompactor stored logic, section 9 (last): ownership and privileges.
--
-- Engine objects belong to the NOLOGIN role compaction_owner (alembic's version table
-- excepted: it belongs to whoever migrates). Nobody holds EXECUTE through PUBLIC; each
-- role gets exactly what its job needs (docs/security.md).

CREATE PROCEDURE compaction.assign_ownership()
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_object record;
BEGIN
    EXECUTE 'ALTER SCHEMA compaction OWNER TO compaction_owner';
    EXECUTE 'ALTER SCHEMA compaction_source OWNER TO compaction_owner';
    FOR v_object IN
        SELECT c.oid::regclass AS name,
               CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind
        FROM pg_catalog.pg_class AS c
        WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
          AND c.relkind IN ('r', 'p', 'v', 'S')
          AND c.oid IS DISTINCT FROM pg_catalog.to_regclass('compaction.alembic_version')
          -- sequences owned by a column follow their table
          AND NOT (c.relkind = 'S' AND EXISTS (
                SELECT 1 FROM pg_catalog.pg_depend AS d
                WHERE d.objid = c.oid AND d.deptype IN ('a', 'i')))
    LOOP
        EXECUTE pg_catalog.format('ALTER %s %s OWNER TO compaction_owner', v_object.kind, v_object.name);
    END LOOP;
    FOR v_object IN
        SELECT p.oid::regprocedure AS name,
               CASE p.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END AS kind
        FROM pg_catalog.pg_proc AS p
        WHERE p.pronamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
    LOOP
        EXECUTE pg_catalog.format('ALTER %s %s OWNER TO compaction_owner', v_object.kind, v_object.name);
        EXECUTE pg_catalog.format('REVOKE ALL ON %s %s FROM PUBLIC', v_object.kind, v_object.name);
    END LOOP;
END
$$;
COMMENT ON PROCEDURE compaction.assign_ownership() IS
    'Migration step: hands every engine object to compaction_owner and revokes EXECUTE from PUBLIC (run by each migration)';

CALL compaction.assign_ownership();

GRANT USAGE ON SCHEMA compaction TO compaction_worker, compaction_reader, compaction_auditor;

GRANT EXECUTE ON FUNCTION
    compaction.indexed_pairs(text),
    compaction.eligible_pairs(text),
    compaction.range_hash(text, text[]),
    compaction.plan_targets(text),
    compaction.source_hash(text, int),
    compaction.explain_runs(text)
TO compaction_worker, compaction_reader;

GRANT SELECT ON compaction.source_runs, compaction.source_messages
TO compaction_worker, compaction_reader;

-- Metadata only: which runs form pairs and why not, never their text.
GRANT EXECUTE ON FUNCTION compaction.explain_runs(text) TO compaction_auditor;

-- Database core (revision 0002_core). The worker drives claims through functions only;
-- it holds no INSERT, UPDATE or DELETE on any engine table.
GRANT EXECUTE ON FUNCTION
    compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz),
    compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text),
    compaction.fail(bigint, int, text, timestamptz, text),
    compaction.heartbeat(bigint, int, interval, timestamptz, text),
    compaction.reap(timestamptz),
    compaction.enqueue(text, text),
    compaction.reply_problem(text, text, int)
TO compaction_worker;
-- Revision 0038: a batch of one conversation's claims under one judgement.
GRANT EXECUTE ON FUNCTION
    compaction.claim_targets(text, text, int[], text[], text[], text, text, text, interval, timestamptz)
TO compaction_worker;
-- Revision 0040: a worker's look at a conversation and its first claims in one call.
GRANT EXECUTE ON FUNCTION
    compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz)
TO compaction_worker;
-- reply_problem is no definer: the worker runs its body with its own rights, and that
-- body calls these two (revision 0016; until then the worker's own check of a stopped
-- reply, --min-figure-retention, was refused EXECUTE on summary_problem). Pure functions
-- of their argument: they read nothing.
GRANT EXECUTE ON FUNCTION compaction.summary_problem(text), compaction.has_content(text)
TO compaction_worker;

GRANT SELECT ON compaction.prompt_versions TO compaction_worker, compaction_reader;
GRANT SELECT ON compaction.summaries TO compaction_reader;

-- Metadata only. audit_stale_summaries reads stale_summaries(), and a function inside a
-- view runs with the caller's EXECUTE privilege: it and source_hash return hashes and
-- ids, never text.
GRANT SELECT ON compaction.audit_jobs, compaction.audit_stale_summaries,
                compaction.audit_exhausted, compaction.audit_events
TO compaction_auditor;
GRANT EXECUTE ON FUNCTION compaction.source_hash(text, int), compaction.stale_summaries()
TO compaction_auditor;
-- What the facades read on Citus (revision 0022): the rows their views show, no more.
GRANT EXECUTE ON FUNCTION compaction.read_audit_jobs(), compaction.read_audit_exhausted(),
                          compaction.read_audit_queue(), compaction.read_audit_events()
TO compaction_auditor;

-- TRUNCATE is refused by triggers as well; not even the owner holds the privilege.
REVOKE TRUNCATE ON compaction.jobs, compaction.attempts, compaction.job_summaries,
                   compaction.event_log, compaction.admission, compaction.queue,
                   compaction.settings, compaction.prompt_versions
FROM compaction_owner;

-- Projection (revision 0003_projection): what `pycompactor project` needs, read-only.
-- Pairs come from compaction.indexed_pairs, granted with the read functions of §3–5.
GRANT EXECUTE ON FUNCTION
    compaction.projection_summaries(text, text),
    compaction.projection_texts(text, text[], bigint[]),
    compaction.projection_frame(text, text, int),
    compaction.projection_read(text, text, int, bigint, int)
TO compaction_worker, compaction_reader;
-- Revision 0048: the owner's model preference, names only (shown by `pycompactor audit`
-- and `evaluate`); only the owner sets it (compaction.set_projection_models).
GRANT EXECUTE ON FUNCTION compaction.projection_models()
TO compaction_worker, compaction_reader, compaction_auditor;

-- Derived state (revision 0005). The worker plans from it and reads a claimed range's
-- replies; the auditor may prove it against the views (ids, counts and hashes only).
-- Re-derivation and the rebuild are the owner's; a host attaching the tracking trigger to
-- its own tables is granted EXECUTE on compaction.track_source_changes() by the owner
-- (docs/integrating.md).
GRANT EXECUTE ON FUNCTION
    compaction.worker_targets(text, text, text, text),
    compaction.range_replies(text, int, text)
TO compaction_worker;
GRANT EXECUTE ON FUNCTION compaction.verify_conversation(text) TO compaction_auditor;
GRANT EXECUTE ON FUNCTION compaction.derived_state_status()
TO compaction_worker, compaction_reader, compaction_auditor;
REVOKE TRUNCATE ON compaction.conversation_state, compaction.pairs, compaction.ranges,
                   compaction.summary_verdicts, compaction.source_tracking
FROM compaction_owner;
-- Revision 0048: the record of foreign messages, derived state like the others.
REVOKE TRUNCATE ON compaction.foreign_messages FROM compaction_owner;
-- Revision 0018: no role but the owner holds any privilege on the conversations' lock
-- rows, so no role without engine grants can lock one (docs/security.md).
REVOKE TRUNCATE ON compaction.conversation_locks FROM compaction_owner;

-- Leased queue (revision 0006_queue_leases): the worker leases entries of its scope and
-- acknowledges (or releases) them; the auditor sees the queue per scope, never an id.
GRANT EXECUTE ON FUNCTION
    compaction.dequeue(text, int, interval),
    compaction.ack(text, text, uuid),
    compaction.release(text, text, uuid)
TO compaction_worker;
GRANT SELECT ON compaction.audit_queue TO compaction_auditor;
