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
--
-- This file holds the trigger and its attachment to the reference tables. The
-- re-derivation it calls is in 26_rederive.sql, attaching it to a host's tables and the
-- oracle in 27_attach_and_verify.sql, the whole rebuild in 28_rebuild.sql.

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
    v_record_kept         boolean;
    v_touched             record;
    v_message_ids         text[];
    v_first_seq           bigint;
    v_first_id            text;
    v_runs_known          boolean := v_run_column IS NOT NULL;
    -- On Citus the trigger fires on a shard (contract §11): its table is the shard, and
    -- the checks below ask about the distributed table it belongs to.
    v_relid               oid := compaction.distributed_relation(TG_RELID);
    v_on_shard            boolean := v_relid <> TG_RELID;
    v_table               oid := CASE WHEN v_relid <> TG_RELID THEN NULL ELSE TG_RELID END;
BEGIN
    IF TG_LEVEL <> 'STATEMENT' OR TG_WHEN <> 'AFTER' OR TG_NARGS NOT IN (2, 3)
       OR v_conversation_column IS NULL THEN
        RAISE EXCEPTION 'track_source_changes must be an AFTER ... FOR EACH STATEMENT trigger with two or three arguments: the conversation id column, the run id column (or ''''), and for a table without a run column optionally its message id column'
            USING ERRCODE = 'CP020';
    END IF;
    -- Only on a table the source views read: a trigger its
    -- owner attached to a scratch table does nothing. While the derived state is in use,
    -- the source's tables are those whose tracking triggers it was stamped with (two
    -- lookups by key); otherwise, and for a TRUNCATE, the views are walked.
    -- On a Citus shard, trigger oids are this node's and the stamp's are the
    -- coordinator's: the stamp's tables are compared by name instead.
    IF v_on_shard THEN
        IF NOT coalesce((SELECT v_relid::regclass::text = ANY (st.tracked_tables)
                         FROM compaction.source_tracking AS st
                         WHERE st.singleton AND st.tracked_tables IS NOT NULL), false)
           AND NOT compaction.source_reads(v_relid) THEN
            RETURN NULL;
        END IF;
    ELSIF NOT coalesce((SELECT tg.oid = ANY (st.object_oids)
                        FROM pg_catalog.pg_trigger AS tg, compaction.source_tracking AS st
                        WHERE st.singleton AND tg.tgrelid = TG_RELID AND tg.tgname = TG_NAME
                          AND st.object_oids IS NOT NULL), false)
          AND NOT compaction.source_reads(TG_RELID) THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        -- No transition table says what went: stop trusting the derived state until a
        -- rebuild (every function judges from the views meanwhile, exact and slower).
        -- A rebuild's resume point goes too: the conversations before it
        -- lost rows no trigger re-derived, so the next rebuild starts over, and one under
        -- way fails at its next commit instead of putting them in use.
        UPDATE compaction.source_tracking
        SET stamp = NULL, object_oids = NULL, tracked_tables = NULL, stamped_at = NULL,
            rebuild_stamp = NULL, rebuild_after = NULL, rebuild_done = NULL,
            rebuild_total = NULL, rebuild_started_at = NULL, rebuild_updated_at = NULL;
        RETURN NULL;
    END IF;

    -- On a Citus shard, custom plans: Citus plans a statement on distributed tables with
    -- parameters only once their values are bound (a generic plan of any statement but
    -- the simplest fails: "could not create distributed plan"). Restored when the
    -- trigger returns (its SET clause).
    IF v_on_shard THEN
        PERFORM pg_catalog.set_config('plan_cache_mode', 'force_custom_plan', true);
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
    -- Each new message is looked up by its id on its own (as re-derivation
    -- does for the runs): asked as "these ids of this conversation", the generic
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
    -- A statement re-derives only the conversations its rows name, by
    -- their own rows (contract §3: a message belongs to its own conversation's
    -- run of its run id, and a foreign one is recorded under its own conversation,
    -- compaction.foreign_messages; §11), so no other conversation is asked about here.
    IF v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        IF NOT v_runs_known THEN
            PERFORM compaction.rederive(v_conversation, NULL, v_table);
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
        -- conversation_state row (see rederive): rederive's no-change question, whether
        -- the record of foreign messages may change, and the pair count, in one
        -- statement: its snapshot is taken after the lock was, so it sees what rederive
        -- would see. An agent's second and third statements per Run end here. On a Citus
        -- shard too: every statement there is planned by Citus, so each one saved counts.
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
                                       SELECT 1 FROM compaction.pairs AS p
                                       WHERE NOT v_on_shard
                                         AND pg_catalog.hashtext(p.run_id)
                                             = pg_catalog.hashtext(k.run_id)
                                         AND p.run_id = k.run_id
                                         AND (p.conversation_id = v_conversation) IS TRUE
                                       OFFSET 0) AS q)
                   AND NOT EXISTS (SELECT 1
                                   FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                                   CROSS JOIN LATERAL (
                                       SELECT 1 FROM compaction.pairs AS p
                                       WHERE v_on_shard
                                         AND p.conversation_id = v_conversation
                                         AND pg_catalog.hashtext(p.run_id)
                                             = pg_catalog.hashtext(k.run_id)
                                         AND p.run_id = k.run_id
                                       OFFSET 0) AS q)
               END,
               -- rederive's test of the record, word for word
               CASE WHEN cs.pair_count IS NOT NULL THEN
                   NOT EXISTS (SELECT 1
                               FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                               LEFT JOIN LATERAL (
                                   SELECT true AS held FROM compaction.source_runs AS sr
                                   WHERE sr.run_id = k.run_id
                                     AND sr.conversation_id = v_conversation
                                   OFFSET 0) AS r ON true
                               LEFT JOIN LATERAL (
                                   SELECT true AS recorded
                                   FROM compaction.foreign_messages AS fm
                                   WHERE fm.conversation_id = v_conversation
                                     AND fm.run_id = k.run_id
                                   OFFSET 0) AS f ON true
                               WHERE r.held IS NULL OR f.recorded)
               END
        INTO v_count, v_unchanged, v_record_kept
        FROM (SELECT) AS one
        LEFT JOIN compaction.conversation_state AS cs
          ON cs.conversation_id = v_conversation
         AND cs.xmin = pg_catalog.pg_current_xact_id()::xid;
        IF v_count IS NULL THEN
            PERFORM compaction.rederive(v_conversation, v_run_ids, v_table);
            RETURN NULL;
        END IF;
        -- The row is held: the record of foreign messages first, as rederive does (also
        -- for a conversation left to a rebuild below, which derives it again whole).
        IF NOT v_record_kept THEN
            PERFORM compaction.refresh_foreign_messages(v_conversation, v_run_ids);
        END IF;
        IF v_unchanged THEN
            NULL;
        ELSIF v_on_shard THEN
            -- Never left to a rebuild on a shard: that waits on a row of a reference
            -- table, on every node, which a trigger on a shard may not ask for.
            PERFORM compaction.rederive_runs(v_conversation, v_run_ids, v_count);
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
            PERFORM compaction.rederive(v_touched.conversation_id, NULL, v_table);
        ELSIF v_touched.run_ids IS NOT NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, v_touched.run_ids, v_table);
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
