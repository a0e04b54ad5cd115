-- 0019_online_install, undone: the rebuild and attach_source_tracking of revision 0018.

DROP VIEW compaction.rebuild_progress;
DROP PROCEDURE compaction.rebuild_derived_state(int, boolean);

-- Runs with the caller's rights (the host table's owner creates triggers on its table);
-- it needs EXECUTE on track_source_changes, which the engine's owner grants.
CREATE OR REPLACE FUNCTION compaction.attach_source_tracking(
    p_table regclass, p_conversation_column text, p_run_column text,
    p_message_column text DEFAULT NULL)
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
    PERFORM compaction.detach_source_tracking(p_table);
    FOREACH v_event IN ARRAY ARRAY['insert', 'update', 'delete', 'truncate'] LOOP
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
    'Attaches the change-tracking triggers (INSERT, UPDATE, DELETE, TRUNCATE) to a host table behind the source views, naming its conversation id and run id columns (or '''' and, optionally, its message id column, so an append re-derives only its run); then CALL compaction.rebuild_derived_state()';


-- Every conversation, in batches of one transaction each (no transaction holds every
-- conversation, progress is reported as NOTICEs), then the stamp that puts the derived
-- state in use. Writes during the rebuild are tracked as usual; the stamp is set only if
-- the source stamp did not change while the rebuild ran. Call it outside a transaction
-- block: CALL compaction.rebuild_derived_state();
CREATE PROCEDURE compaction.rebuild_derived_state(p_batch int DEFAULT 100)
LANGUAGE plpgsql
-- No SET clause: a procedure with one cannot COMMIT. Every name below is qualified.
AS $$
DECLARE
    v_stamp text;
    v_after text := '';
    v_batch text[];
    v_conversation text;
    v_done bigint := 0;
    v_total bigint;
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
    SELECT count(*) INTO v_total
    FROM (SELECT sr.conversation_id FROM compaction.source_runs AS sr
          UNION SELECT cs.conversation_id FROM compaction.conversation_state AS cs) AS c;
    LOOP
        v_batch := ARRAY(SELECT c.conversation_id
                         FROM (SELECT sr.conversation_id FROM compaction.source_runs AS sr
                               WHERE sr.conversation_id > v_after
                               UNION
                               SELECT cs.conversation_id FROM compaction.conversation_state AS cs
                               WHERE cs.conversation_id > v_after) AS c
                         ORDER BY c.conversation_id
                         LIMIT p_batch);
        EXIT WHEN pg_catalog.cardinality(v_batch) = 0;
        FOREACH v_conversation IN ARRAY v_batch LOOP
            PERFORM compaction.rederive_conversation(v_conversation);
        END LOOP;
        v_done := v_done + pg_catalog.cardinality(v_batch);
        v_after := v_batch[pg_catalog.cardinality(v_batch)];
        COMMIT;
        RAISE NOTICE 'derived state: % of % conversations', v_done, v_total;
    END LOOP;
    PERFORM compaction.stamp_derived_state(v_stamp);
    COMMIT;
END
$$;
COMMENT ON PROCEDURE compaction.rebuild_derived_state(int) IS
    'Repair and upgrade step: re-derives every conversation in batches (one transaction each), then puts the derived state in use; CALL outside a transaction block';

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
        stamped_at = pg_catalog.now();
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.stamp_derived_state(text) IS
    'Internal: last step of rebuild_derived_state: puts the derived state in use under the given source stamp, unless the source changed meanwhile';

ALTER TABLE compaction.source_tracking
    DROP COLUMN rebuild_stamp,
    DROP COLUMN rebuild_after,
    DROP COLUMN rebuild_done,
    DROP COLUMN rebuild_total,
    DROP COLUMN rebuild_started_at,
    DROP COLUMN rebuild_updated_at;
COMMENT ON TABLE compaction.source_tracking IS
    'Derived state: the source stamp (compaction.source_stamp()) the derived state was last rebuilt under, and the catalog rows it names; NULL until a rebuild';

CALL compaction.assign_ownership();
