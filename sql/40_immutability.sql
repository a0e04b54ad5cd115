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
-- while that mark names the row's conversation (compaction.erasing). The
-- guards read their own row and that setting, never another table (contract §11), so they
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
    -- Whether the job holds a summary would need another table (contract §11): an identity
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
    -- Who claimed it never changes (the fence lets that login alone finish it),
    -- nor the admission slot it took (the slot is freed by that key),
    -- nor its claim event.
    IF OLD.state = 'running'
       AND (NEW.conversation_id, NEW.job_id, NEW.attempt, NEW.worker, NEW.started_at,
            NEW.claimed_by, NEW.slot, NEW.claim_event_id, NEW.claim_recorded_at,
            NEW.claim_xact_id)
           IS NOT DISTINCT FROM
           (OLD.conversation_id, OLD.job_id, OLD.attempt, OLD.worker, OLD.started_at,
            OLD.claimed_by, OLD.slot, OLD.claim_event_id, OLD.claim_recorded_at,
            OLD.claim_xact_id) THEN
        IF NEW.state IN ('completed', 'failed') THEN
            -- The end's event, stamped here so that every way an attempt
            -- ends records it, as an event_log row was written: an id of the log's
            -- sequence, the clock now and this transaction. The guard reads and writes
            -- its own row only (contract §11).
            NEW.finish_event_id := pg_catalog.nextval('compaction.audit_events_event_id_seq');
            NEW.finish_recorded_at := pg_catalog.clock_timestamp();
            NEW.finish_xact_id := pg_catalog.pg_current_xact_id();
            RETURN NEW;
        END IF;
        IF NEW.state = 'running'
           AND (NEW.reason, NEW.finished_at, NEW.finish_reason, NEW.tool_call_count,
                NEW.response_id, NEW.summary_chars, NEW.input_tokens, NEW.output_tokens,
                NEW.figures_total, NEW.figures_kept, NEW.finish_event_id,
                NEW.finish_recorded_at, NEW.finish_xact_id, NEW.figures_invented)
               IS NOT DISTINCT FROM
               (OLD.reason, OLD.finished_at, OLD.finish_reason, OLD.tool_call_count,
                OLD.response_id, OLD.summary_chars, OLD.input_tokens, OLD.output_tokens,
                OLD.figures_total, OLD.figures_kept, OLD.finish_event_id,
                OLD.finish_recorded_at, OLD.finish_xact_id, OLD.figures_invented) THEN
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

-- Prompt versions: rows are added by migrations; a version is never
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

-- The derived state is a cache of the source: emptied by TRUNCATE it would
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
-- The record of foreign messages, derived state like the others.
CREATE TRIGGER foreign_messages_truncate_guard
    BEFORE TRUNCATE ON compaction.foreign_messages
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.foreign_messages ENABLE ALWAYS TRIGGER foreign_messages_truncate_guard;

-- Emptied, the conversations' lock rows would be written again by the next
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
    -- The events the erased attempts record stay in the log, as they are
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
