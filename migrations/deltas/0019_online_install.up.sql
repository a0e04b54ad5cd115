-- 0019_online_install: installing onto a large live database without stalling it
-- (issue 31). attach_source_tracking waits at most 50 ms at a time for the host's table
-- (and drops only triggers that exist, so a first attach never takes the lock that blocks
-- reads); rebuild_derived_state walks conversations by key (one index probe each, no
-- re-selection of every run per batch), commits small batches, keeps a resume point in
-- compaction.source_tracking and reports a rate and an ETA (NOTICEs and the view
-- compaction.rebuild_progress).

ALTER TABLE compaction.source_tracking
    ADD COLUMN rebuild_stamp text,
    ADD COLUMN rebuild_after text,
    ADD COLUMN rebuild_done bigint,
    ADD COLUMN rebuild_total bigint,
    ADD COLUMN rebuild_started_at timestamptz,
    ADD COLUMN rebuild_updated_at timestamptz;
COMMENT ON TABLE compaction.source_tracking IS
    'Derived state: the source stamp (compaction.source_stamp()) the derived state was last rebuilt under, and the catalog rows it names (NULL until a rebuild); and the resume point of a rebuild under way';

-- Runs with the caller's rights (the host table's owner creates triggers on its table);
-- it needs EXECUTE on track_source_changes, which the engine's owner grants.
--
-- Revision 0019: online on a busy table. CREATE TRIGGER waits for every transaction
-- writing the table, and every write queues behind it while it waits: the table's lock
-- is taken first, waiting at most 50 ms a try (the host's writes wait no longer), and
-- tried again after a pause until it is had. Dropping a trigger takes the lock that
-- blocks reads too, so only triggers that exist are dropped (none on a first attach).
CREATE OR REPLACE FUNCTION compaction.attach_source_tracking(
    p_table regclass, p_conversation_column text, p_run_column text,
    p_message_column text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '50ms'
AS $$
DECLARE
    v_column text;
    v_event  text;
    v_mode   text;
    v_try    int := 0;
BEGIN
    IF p_table IS NULL OR p_conversation_column IS NULL OR p_run_column IS NULL THEN
        RAISE EXCEPTION 'attach_source_tracking needs a table, its conversation id column and its run id column ('''' when it has none)'
            USING ERRCODE = 'CP020';
    END IF;
    IF p_message_column IS NOT NULL AND p_run_column <> '' THEN
        RAISE EXCEPTION 'attach_source_tracking: a message id column is for a table without a run column (its runs come from the views)'
            USING ERRCODE = 'CP020';
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
    'Attaches the change-tracking triggers (INSERT, UPDATE, DELETE, TRUNCATE) to a host table behind the source views, naming its conversation id and run id columns (or '''' and, optionally, its message id column, so an append re-derives only its run); waits at most 50 ms at a time for the table; then CALL compaction.rebuild_derived_state()';

DROP PROCEDURE compaction.rebuild_derived_state(int);

-- Every conversation, in conversation id order, then the stamp that puts the derived
-- state in use. Writes during the rebuild are tracked as usual; the stamp is set only if
-- the source stamp did not change while the rebuild ran. Call it outside a transaction
-- block: CALL compaction.rebuild_derived_state();
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
CREATE PROCEDURE compaction.rebuild_derived_state(p_batch int DEFAULT 100,
                                                  p_restart boolean DEFAULT false)
LANGUAGE plpgsql
-- No SET clause: a procedure with one cannot COMMIT. Every name below is qualified.
AS $$
DECLARE
    v_stamp    text;
    v_after    text;
    v_next     text;
    v_done     bigint;
    v_total    bigint;
    v_resumed  bigint;
    v_began    timestamptz := pg_catalog.clock_timestamp();
    v_batch_at timestamptz;
    v_noted_at timestamptz := pg_catalog.clock_timestamp();
    v_in_batch int;
    v_rate     double precision;
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
        UPDATE compaction.source_tracking
        SET rebuild_stamp = v_stamp, rebuild_after = v_after, rebuild_done = 0,
            rebuild_total = v_total, rebuild_started_at = pg_catalog.now(),
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
        -- makes a commit lost in a crash cost only its batch again.
        PERFORM pg_catalog.set_config('enable_seqscan', 'off', true);
        PERFORM pg_catalog.set_config('synchronous_commit', 'off', true);
        v_in_batch := 0;
        v_batch_at := pg_catalog.clock_timestamp();
        LOOP
            v_next := least(
                (SELECT min(sr.conversation_id) FROM compaction.source_runs AS sr
                 WHERE sr.conversation_id > v_after),
                (SELECT min(cs.conversation_id) FROM compaction.conversation_state AS cs
                 WHERE cs.conversation_id > v_after));
            EXIT WHEN v_next IS NULL;
            PERFORM compaction.rederive_conversation(v_next);
            v_after := v_next;
            v_in_batch := v_in_batch + 1;
            EXIT WHEN v_in_batch >= p_batch
                   OR pg_catalog.clock_timestamp() - v_batch_at >= interval '20 milliseconds';
        END LOOP;
        EXIT WHEN v_in_batch = 0;
        v_done := v_done + v_in_batch;
        UPDATE compaction.source_tracking
        SET rebuild_after = v_after, rebuild_done = v_done,
            rebuild_updated_at = pg_catalog.clock_timestamp();
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
    'Repair and upgrade step: re-derives every conversation in id order, committing at most p_batch conversations or 20 ms of work at a time, resuming after the last committed one when the source is unchanged (p_restart: start over), then puts the derived state in use; CALL outside a transaction block';

CREATE OR REPLACE FUNCTION compaction.stamp_derived_state(p_stamp text)
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

CALL compaction.assign_ownership();
