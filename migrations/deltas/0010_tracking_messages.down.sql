-- Revision 0010_tracking_messages, down: tracking without a message id column. Tables
-- attached with one are re-attached without it (their writes re-derive the touched
-- conversation whole again); the derived state is then used after the next rebuild
-- (CALL compaction.rebuild_derived_state()), exact from the views until then.

CREATE OR REPLACE FUNCTION compaction.track_source_changes()
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
    v_elsewhere           boolean;
    v_count               int;
    v_unchanged           boolean;
    v_touched             record;
BEGIN
    IF TG_LEVEL <> 'STATEMENT' OR TG_WHEN <> 'AFTER' OR TG_NARGS <> 2
       OR v_conversation_column IS NULL THEN
        RAISE EXCEPTION 'track_source_changes must be an AFTER ... FOR EACH STATEMENT trigger with two arguments: the conversation id column and the run id column (or '''')'
            USING ERRCODE = 'CP020';
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        -- No transition table says what went: stop trusting the derived state until a
        -- rebuild (every function judges from the views meanwhile, exact and slower).
        UPDATE compaction.source_tracking SET stamp = NULL, object_oids = NULL, stamped_at = NULL;
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

    -- The common statement (an agent's single-row writes): its rows name one conversation
    -- and every run they name belongs to it now. A lookup of those runs decides that,
    -- where the general grouping below costs several times as much to start.
    v_conversation := v_conversations[1];
    IF v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        IF v_run_column IS NULL THEN
            PERFORM compaction.rederive(v_conversation, NULL);
            RETURN NULL;
        END IF;
        v_run_ids := pg_catalog.array_remove(v_runs, NULL);
        IF pg_catalog.cardinality(v_run_ids) = 0 THEN
            RETURN NULL;  -- rows of no run: no pair can change
        ELSIF pg_catalog.cardinality(v_run_ids) > 2 THEN
            v_run_ids := ARRAY(SELECT DISTINCT r.run_id
                               FROM pg_catalog.unnest(v_run_ids) AS r (run_id));
        END IF;
        -- Whether a touched run lives in another conversation and, for a later statement
        -- of a transaction that already holds this conversation's conversation_state row
        -- (see rederive), rederive's no-change question and the pair count, in one
        -- statement: its snapshot is taken after the lock was, so it sees what rederive
        -- would see. An agent's second and third statements per Run end here.
        SELECT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                       WHERE sr.run_id = ANY (v_run_ids)
                         AND sr.conversation_id <> v_conversation),
               cs.pair_count,
               CASE WHEN cs.pair_count IS NOT NULL THEN
                   -- rederive's no-change test, word for word
                   NOT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                               WHERE sr.run_id = ANY (v_run_ids)
                                 AND sr.conversation_id = v_conversation
                                 AND sr.status IN ('completed', 'partial', 'clarify_pending'))
                   AND NOT EXISTS (SELECT 1 FROM compaction.pairs AS p
                                   WHERE p.conversation_id = v_conversation
                                     AND p.run_id = ANY (v_run_ids))
               END
        INTO v_elsewhere, v_count, v_unchanged
        FROM (SELECT) AS one
        LEFT JOIN compaction.conversation_state AS cs
          ON cs.conversation_id = v_conversation
         AND cs.xmin = pg_catalog.pg_current_xact_id()::xid;
        IF NOT v_elsewhere THEN
            IF v_count IS NULL THEN
                PERFORM compaction.rederive(v_conversation, v_run_ids);
            ELSIF NOT v_unchanged THEN
                PERFORM compaction.rederive_runs(v_conversation, v_run_ids, v_count);
            END IF;
            RETURN NULL;
        END IF;
    END IF;

    -- Each touched conversation once, in a fixed order (concurrent bulk writers lock
    -- conversation_state rows in one order), with the runs it must look at: the runs
    -- named by the rows, under the conversation the rows name and under the conversation
    -- the run belongs to now (a message filed under another conversation still counts
    -- against its run's).
    FOR v_touched IN
        WITH touched AS (
            SELECT t.conversation_id, t.run_id
            FROM ROWS FROM (pg_catalog.unnest(v_conversations), pg_catalog.unnest(v_runs))
                AS t (conversation_id, run_id)
        )
        SELECT t.conversation_id,
               array_agg(DISTINCT t.run_id) FILTER (WHERE t.run_id IS NOT NULL) AS run_ids
        FROM (SELECT c.conversation_id, c.run_id FROM touched AS c
              UNION
              SELECT sr.conversation_id, sr.run_id
              FROM compaction.source_runs AS sr
              WHERE sr.run_id IN (SELECT c.run_id FROM touched AS c)) AS t
        WHERE t.conversation_id IS NOT NULL
        GROUP BY t.conversation_id
        ORDER BY t.conversation_id
    LOOP
        IF v_run_column IS NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, NULL);
        ELSIF v_touched.run_ids IS NOT NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, v_touched.run_ids);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.track_source_changes() IS
    'Trigger (AFTER ... FOR EACH STATEMENT, transition tables new_rows/old_rows; arguments: conversation id column, run id column or ''''): keeps the derived state of the conversations a statement touched';

DROP FUNCTION compaction.attach_source_tracking(regclass, text, text, text);

CREATE FUNCTION compaction.attach_source_tracking(
    p_table regclass, p_conversation_column text, p_run_column text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_column text;
    v_event  text;
BEGIN
    IF p_table IS NULL OR p_conversation_column IS NULL OR p_run_column IS NULL THEN
        RAISE EXCEPTION 'attach_source_tracking needs a table, its conversation id column and its run id column ('''' when it has none)'
            USING ERRCODE = 'CP020';
    END IF;
    FOREACH v_column IN ARRAY ARRAY[p_conversation_column, nullif(p_run_column, '')] LOOP
        IF v_column IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM pg_catalog.pg_attribute AS a
               WHERE a.attrelid = p_table AND a.attname = v_column
                 AND a.attnum > 0 AND NOT a.attisdropped) THEN
            RAISE EXCEPTION 'table % has no column %', p_table, v_column
                USING ERRCODE = 'CP020';
        END IF;
    END LOOP;
    PERFORM compaction.detach_source_tracking(p_table);
    FOREACH v_event IN ARRAY ARRAY['insert', 'update', 'delete', 'truncate'] LOOP
        EXECUTE pg_catalog.format(
            'CREATE TRIGGER %I AFTER %s ON %s %s FOR EACH STATEMENT'
            ' EXECUTE FUNCTION compaction.track_source_changes(%L, %L)',
            'compaction_track_' || v_event, pg_catalog.upper(v_event), p_table,
            CASE v_event
                WHEN 'insert' THEN 'REFERENCING NEW TABLE AS new_rows'
                WHEN 'update' THEN 'REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows'
                WHEN 'delete' THEN 'REFERENCING OLD TABLE AS old_rows'
                ELSE ''
            END,
            p_conversation_column, p_run_column);
        -- ALWAYS: logical replication's apply (session_replication_role = replica) too.
        EXECUTE pg_catalog.format('ALTER TABLE %s ENABLE ALWAYS TRIGGER %I',
                                  p_table, 'compaction_track_' || v_event);
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.attach_source_tracking(regclass, text, text) IS
    'Attaches the change-tracking triggers (INSERT, UPDATE, DELETE, TRUNCATE) to a host table behind the source views, naming its conversation id and run id columns; then CALL compaction.rebuild_derived_state()';

DO $$
DECLARE
    v_trigger record;
BEGIN
    FOR v_trigger IN
        SELECT DISTINCT t.tgrelid::regclass AS tab,
               pg_catalog.encode(t.tgargs, 'escape') AS args
        FROM pg_catalog.pg_trigger AS t
        WHERE t.tgfoid = 'compaction.track_source_changes()'::regprocedure
          AND t.tgnargs = 3
    LOOP
        -- tgargs holds the arguments NUL-terminated: conversation column, '' , message column.
        PERFORM compaction.attach_source_tracking(
            v_trigger.tab,
            pg_catalog.split_part(v_trigger.args, '\000', 1),
            pg_catalog.split_part(v_trigger.args, '\000', 2));
    END LOOP;
END
$$;

CALL compaction.assign_ownership();
