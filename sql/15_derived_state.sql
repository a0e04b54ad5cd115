-- pycompactor stored logic, section 1b: derived state kept from the source (contract §2).
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
-- rules of contract §3 but the foreign-message one); foreign_messages records, per
-- conversation, the run ids its foreign messages name. Each is written only by the
-- tracking of its own conversation. A read uses a conversation's derived state while no
-- foreign message names one of its pairs' runs (compaction.derived_state_serves); else it
-- judges that conversation from the views, exact, for as long as the message stays.
--
-- Citus (contract §11): the per-conversation tables lead every key with conversation_id;
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
    'Derived state: the eligible pairs of each conversation (contract §3) with pair_index, ids and UTF-8 sizes; no text';
-- The tracking finds a written Run's pair by its conversation and run id. This index
-- keys it by a 4-byte hash of the run id alone: the B-tree on
-- (conversation_id, run_id) that did once held both text ids of every
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
    'Derived state: every complete range of 10 pairs with its 20 current source ids [u0, a0, ..., u9, a9] and source hash (contract §5)';

-- Every completed summary's verdict as projection_frame reads it, kept
-- with the ranges it depends on (re-judged whenever a range is written, and when a summary
-- of its range completes or is imported), so a projection reads one index entry per
-- summary instead of comparing every summary's 20 ids and hash with its range.
CREATE TABLE compaction.summary_verdicts (
    conversation_id text NOT NULL,
    summary_id      bigint NOT NULL,
    scope           text NOT NULL,
    from_pair       int NOT NULL,
    -- NULL: the summary its range uses in its scope (projectable, source current, and
    -- preferred among such); else the first reason of contract §9 that applies.
    reason          text,
    CONSTRAINT summary_verdicts_pkey PRIMARY KEY (conversation_id, summary_id),
    CONSTRAINT summary_verdicts_reason_valid
        CHECK (reason IN ('version_not_projectable', 'stale_source', 'superseded'))
);
COMMENT ON TABLE compaction.summary_verdicts IS
    'Derived state: every completed summary''s verdict against the current ranges (reason NULL for the one each range uses in its scope, else version_not_projectable, stale_source or superseded)';
-- Re-judging finds a range's summaries by from_pair. A projection reads, for one scope,
-- the chosen summaries of the ranges its budget may reach (summary_verdicts_one_chosen)
-- and every rejected one (summary_verdicts_rejected_idx): none of the
-- chosen summaries beyond the reach, the many in a long conversation's steady state.
CREATE INDEX summary_verdicts_range_idx
    ON compaction.summary_verdicts (conversation_id, from_pair, scope, summary_id) INCLUDE (reason);
CREATE UNIQUE INDEX summary_verdicts_one_chosen
    ON compaction.summary_verdicts (conversation_id, scope, from_pair) WHERE reason IS NULL;
CREATE INDEX summary_verdicts_rejected_idx
    ON compaction.summary_verdicts (conversation_id, scope, from_pair, summary_id) INCLUDE (reason)
    WHERE reason IS NOT NULL;

-- The one question of a run's judgement
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
    -- The tables whose tracking triggers the stamp names, by name (schema.table): on
    -- Citus a trigger fires on a shard, on a node where the stamp's oids mean nothing.
    tracked_tables text[],
    stamped_at  timestamptz,
    -- A rebuild's resume point, kept with the stamp it runs under. A
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
-- source views and of every view they read, through any depth (a host's
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

-- Contract §11: on Citus a tracking trigger fires on a shard (a table named after its
-- distributed table with _<shardid> appended), on the node that holds it; the
-- distributed table is what the source views read and what the stamp names. This is
-- that table, found in Citus's metadata on the node (every node holds it); any other
-- relation is returned as it is. The shard is never looked up in pg_class: in a client's
-- session on a worker (Citus takes writes on any node) Citus hides shards from queries
-- of pg_class, and a write sent there went untracked. Its name comes from regclass and
-- the match from Citus's own shard_name, both through the catalog caches, which hide
-- nothing. No SET clause: called by the tracking trigger on every statement, under its
-- settings.
CREATE FUNCTION compaction.distributed_relation(p_relid oid)
RETURNS oid
LANGUAGE plpgsql
STABLE
AS $$
DECLARE
    v_shard   bigint;
    v_logical oid;
BEGIN
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_shard') IS NULL THEN
        RETURN p_relid;  -- no Citus here
    END IF;
    -- A quoted name ends with its quote: "My Table_102008". A number longer than a
    -- shard id can be ("events_12345678901234567890") names no shard.
    v_shard := pg_catalog.substring(p_relid::regclass::text, '_([0-9]{1,18})"?$')::bigint;
    IF v_shard IS NULL THEN
        RETURN p_relid;
    END IF;
    -- Citus's catalog exists only where Citus is installed: PL/pgSQL plans a statement
    -- when it first runs it, so this one is planned only once Citus was found above,
    -- and then once per session (as EXECUTE it was planned again on every tracked
    -- statement, a tenth of a tracked write's time on a shard).
    SELECT s.logicalrelid INTO v_logical
    FROM pg_catalog.pg_dist_shard AS s
    WHERE s.shardid = v_shard
      AND pg_catalog.to_regclass(pg_catalog.shard_name(s.logicalrelid, s.shardid)) = p_relid;
    RETURN coalesce(v_logical, p_relid);
END
$$;
COMMENT ON FUNCTION compaction.distributed_relation(oid) IS
    'Internal: the distributed table a Citus shard belongs to (read from the node''s Citus metadata), else the relation itself';

-- Whether the source views read this table, through any depth of
-- views, as source_stamp walks them. The tracking triggers act only on such a table: one
-- attached to a scratch table by its owner (who holds EXECUTE on track_source_changes to
-- attach it to the host's tables) once took the derived state out of use for the whole
-- database with a TRUNCATE.
CREATE FUNCTION compaction.source_reads(p_relid oid)
RETURNS boolean
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    WITH RECURSIVE rules AS (
        SELECT rw.oid, rw.ev_class
        FROM pg_catalog.pg_rewrite AS rw
        WHERE rw.ev_class IN (pg_catalog.to_regclass('compaction.source_runs'),
                              pg_catalog.to_regclass('compaction.source_messages'))
        UNION
        SELECT rw.oid, rw.ev_class
        FROM rules AS ru
        JOIN pg_catalog.pg_depend AS d
          ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = ru.oid
        JOIN pg_catalog.pg_class AS v ON v.oid = d.refobjid AND v.relkind = 'v'
        JOIN pg_catalog.pg_rewrite AS rw ON rw.ev_class = v.oid
        WHERE d.refclassid = 'pg_catalog.pg_class'::regclass
          AND d.deptype = 'n'
          AND d.refobjid <> ru.ev_class
    )
    SELECT EXISTS (
        SELECT 1
        FROM rules AS ru
        JOIN pg_catalog.pg_depend AS d
          ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = ru.oid
        WHERE d.refclassid = 'pg_catalog.pg_class'::regclass
          AND d.deptype = 'n'
          AND d.refobjid = p_relid)
$$;
COMMENT ON FUNCTION compaction.source_reads(oid) IS
    'Internal: true when the source views (through any depth of views) read this table: the only tables whose tracking triggers act';

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

-- Whether a read of one conversation may use its derived state. The
-- derived pairs judge the conversation by its own rows (contract §3 but the
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
    IF compaction.engine_distributed() THEN
        -- Citus keeps a lookup on the conversation's shard only when the conversation is
        -- an equality it can prune by (as a filter, below, every shard is read).
        RETURN NOT EXISTS (
            SELECT 1
            FROM pg_catalog.unnest(v_named) AS k (run_id)
            CROSS JOIN LATERAL (
                SELECT 1 FROM compaction.pairs AS p
                WHERE p.conversation_id = p_conversation_id
                  AND pg_catalog.hashtext(p.run_id) = pg_catalog.hashtext(k.run_id)
                  AND p.run_id = k.run_id
                OFFSET 0) AS q);
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
