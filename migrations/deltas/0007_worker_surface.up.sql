-- Revision 0007_worker_surface: the worker-callable surface as a security boundary.
--
-- The server owns time (caller_now: p_now only for a superuser or compaction_owner),
-- leases lie within 1 second..1 day (checked_lease), reasons are codes (checked_reason),
-- stored times are finite and ordered, complete/fail/heartbeat take the job's
-- conversation, prompt versions are frozen except closing accepts_new_jobs, audit_jobs
-- copes with any stored time, and admission becomes slot rows taken with FOR UPDATE SKIP
-- LOCKED: exact at every isolation level, and claims no longer queue on one global lock.

ALTER TABLE compaction.settings
    ADD CONSTRAINT settings_max_running_bounded CHECK (max_running <= 10000);

-- Admission: from one row per running attempt to slots 1..max_running. The running
-- attempts keep their leases and take slots in lease order; more of them than
-- max_running keep slots above it until they end.
DROP TRIGGER attempts_track_admission ON compaction.attempts;
CREATE TABLE compaction.admission_0007 AS
SELECT pg_catalog.row_number() OVER (ORDER BY ad.lease_expires_at, ad.conversation_id, ad.job_id)::int AS slot,
       ad.conversation_id, ad.job_id, ad.attempt, ad.lease_expires_at
FROM compaction.admission AS ad;
DROP TABLE compaction.admission;
-- Admission: a semaphore of rows, slots 1..settings.max_running (kept by the settings
-- trigger). A running attempt holds one slot with a copy of its lease; a free slot has no
-- holder, and a slot whose holder's lease ran out counts as free (expired attempts never
-- count against admission). Not per conversation: under Citus a reference table.
CREATE TABLE compaction.admission (
    slot                   int NOT NULL,
    holder_conversation_id text,
    holder_job_id          bigint,
    holder_attempt         int,
    lease_expires_at       timestamptz,
    CONSTRAINT admission_pkey PRIMARY KEY (slot),
    CONSTRAINT admission_slot_positive CHECK (slot >= 1),
    CONSTRAINT admission_holder_complete CHECK (
        (holder_conversation_id IS NULL) = (holder_job_id IS NULL)
        AND (holder_conversation_id IS NULL) = (holder_attempt IS NULL)
        AND (holder_conversation_id IS NULL) = (lease_expires_at IS NULL))
);
COMMENT ON TABLE compaction.admission IS
    'Internal: admission slots 1..settings.max_running; a running attempt holds one (with its lease), claim takes a free one or refuses admission_full';
-- One slot per identity; the attempts trigger finds a finished attempt's slot by it.
CREATE UNIQUE INDEX admission_holder_key
    ON compaction.admission (holder_conversation_id, holder_job_id)
    WHERE holder_conversation_id IS NOT NULL;
INSERT INTO compaction.admission
    (slot, holder_conversation_id, holder_job_id, holder_attempt, lease_expires_at)
SELECT a.slot, a.conversation_id, a.job_id, a.attempt, a.lease_expires_at
FROM compaction.admission_0007 AS a;
INSERT INTO compaction.admission (slot)
SELECT g.slot
FROM compaction.settings AS s, pg_catalog.generate_series(1, s.max_running) AS g (slot)
ON CONFLICT (slot) DO NOTHING;
DROP TABLE compaction.admission_0007;
CREATE TRIGGER admission_truncate_guard
    BEFORE TRUNCATE ON compaction.admission
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.admission ENABLE ALWAYS TRIGGER admission_truncate_guard;

CREATE OR REPLACE FUNCTION compaction.attempts_track_admission()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_slot int;
BEGIN
    IF NEW.state = 'running' THEN
        UPDATE compaction.admission AS ad
        SET lease_expires_at = NEW.lease_expires_at
        WHERE ad.holder_conversation_id = NEW.conversation_id
          AND ad.holder_job_id = NEW.job_id AND ad.holder_attempt = NEW.attempt;
    ELSE
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.holder_conversation_id = NEW.conversation_id
          AND ad.holder_job_id = NEW.job_id AND ad.holder_attempt = NEW.attempt
        RETURNING ad.slot INTO v_slot;
        -- A slot above a lowered max_running goes with its last holder.
        IF v_slot > (SELECT s.max_running FROM compaction.settings AS s) THEN
            DELETE FROM compaction.admission AS ad WHERE ad.slot = v_slot;
        END IF;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.attempts_track_admission() IS
    'Trigger: copies a running attempt''s renewed lease into its admission slot and frees the slot when the attempt ends (dropping it if above max_running)';

CREATE TRIGGER attempts_track_admission
    AFTER UPDATE ON compaction.attempts
    FOR EACH ROW
    WHEN (OLD.state = 'running')
    EXECUTE FUNCTION compaction.attempts_track_admission();
ALTER TABLE compaction.attempts ENABLE ALWAYS TRIGGER attempts_track_admission;

CREATE FUNCTION compaction.settings_resize_admission()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_move   record;
    v_holder compaction.admission;
BEGIN
    LOCK TABLE compaction.admission IN EXCLUSIVE MODE;
    INSERT INTO compaction.admission (slot)
    SELECT g.slot FROM pg_catalog.generate_series(1, NEW.max_running) AS g (slot)
    ON CONFLICT (slot) DO NOTHING;
    FOR v_move IN
        WITH above AS (
            SELECT ad.slot, pg_catalog.row_number() OVER (ORDER BY ad.slot) AS n
            FROM compaction.admission AS ad
            WHERE ad.slot > NEW.max_running AND ad.lease_expires_at > pg_catalog.now()
        ), free AS (
            SELECT ad.slot, pg_catalog.row_number() OVER (ORDER BY ad.slot) AS n
            FROM compaction.admission AS ad
            WHERE ad.slot <= NEW.max_running
              AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= pg_catalog.now())
        )
        SELECT above.slot AS from_slot, free.slot AS to_slot
        FROM above JOIN free USING (n)
    LOOP
        -- Out of the old slot first: one slot per identity (admission_holder_key).
        DELETE FROM compaction.admission AS ad WHERE ad.slot = v_move.from_slot
        RETURNING ad.* INTO v_holder;
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = v_holder.holder_conversation_id,
            holder_job_id = v_holder.holder_job_id, holder_attempt = v_holder.holder_attempt,
            lease_expires_at = v_holder.lease_expires_at
        WHERE ad.slot = v_move.to_slot;
    END LOOP;
    DELETE FROM compaction.admission AS ad
    WHERE ad.slot > NEW.max_running
      AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= pg_catalog.now());
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.settings_resize_admission() IS
    'Trigger: keeps admission slots 1..max_running, moving running attempts below a lowered limit where they fit';

CREATE TRIGGER settings_resize_admission
    AFTER UPDATE OF max_running ON compaction.settings
    FOR EACH ROW
    WHEN (NEW.max_running IS DISTINCT FROM OLD.max_running)
    EXECUTE FUNCTION compaction.settings_resize_admission();
ALTER TABLE compaction.settings ENABLE ALWAYS TRIGGER settings_resize_admission;

ALTER TABLE compaction.attempts
    ADD CONSTRAINT attempts_times_valid CHECK (
        pg_catalog.isfinite(started_at) AND pg_catalog.isfinite(lease_expires_at)
        AND (finished_at IS NULL OR (pg_catalog.isfinite(finished_at) AND finished_at >= started_at)))
        NOT VALID,
    ADD CONSTRAINT attempts_reason_is_code CHECK (reason ~ '^[a-z][a-z0-9_]{0,63}$') NOT VALID;

ALTER TABLE compaction.audit_events
    ADD CONSTRAINT audit_events_reason_is_code CHECK (reason ~ '^[a-z][a-z0-9_]{0,63}$') NOT VALID,
    ADD CONSTRAINT audit_events_times_finite CHECK (pg_catalog.isfinite(occurred_at)) NOT VALID;

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
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles AS r
                   WHERE r.rolname = session_user AND r.rolsuper)
       AND NOT pg_catalog.pg_has_role(session_user, 'compaction_owner', 'MEMBER') THEN
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

CREATE FUNCTION compaction.reply_problem(p_summary text, p_finish_reason text,
                                         p_tool_call_count int)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
               WHEN p_finish_reason IS DISTINCT FROM 'stop' THEN 'not_stopped'
               WHEN p_tool_call_count IS DISTINCT FROM 0 THEN 'tool_calls'
               ELSE compaction.summary_problem(p_summary)
           END
$$;
COMMENT ON FUNCTION compaction.reply_problem(text, text, int) IS
    'NULL when complete() would accept this reply, else its reason: not_stopped, tool_calls, empty or too_long (checked in that order)';

DROP FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb);
DROP FUNCTION compaction.fail(bigint, int, text, timestamptz);
DROP FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz);
DROP FUNCTION compaction.fence(bigint, int, timestamptz);

CREATE OR REPLACE FUNCTION compaction.claim(
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
AS $$
#variable_conflict use_column
DECLARE
    v_now         timestamptz := compaction.caller_now(p_now);
    v_lease       timestamptz := v_now + compaction.checked_lease(p_lease);
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_job_id      bigint;
    v_failed      int;
    v_attempt     int;
    v_max_running int;
    v_slot        int;
    v_overflow    boolean := false;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
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

    -- From here on the conversation's engine rows are ours until commit.
    PERFORM compaction.lock_conversation(p_conversation_id);

    -- The range as it is now, from the derived state (no message text read): the pair
    -- count decides whether it is a target, the stored ids and hash whether it matches.
    SELECT r.pair_count, r.source_message_ids, r.source_hash
    INTO v_pairs, v_target_ids, v_target_hash
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    IF NOT compaction.is_target(p_from_pair, v_pairs) THEN
        RETURN QUERY SELECT false, 'not_eligible'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT compaction.valid_source_hash(p_source_hash)
       OR v_target_hash IS DISTINCT FROM p_source_hash
       OR v_target_ids IS DISTINCT FROM p_source_message_ids THEN
        RETURN QUERY SELECT false, 'source_mismatch'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;

    IF v_job_id IS NULL THEN
        v_attempt := 1;
    ELSE
        -- Reap this identity: an expired attempt is a failed attempt.
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = v_now
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
          AND a.state = 'running' AND a.lease_expires_at <= v_now;

        IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                   WHERE s.conversation_id = p_conversation_id AND s.job_id = v_job_id) THEN
            RETURN QUERY SELECT false, 'already_completed'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        IF EXISTS (SELECT 1 FROM compaction.attempts AS a
                   WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
                     AND a.state = 'running') THEN
            RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        SELECT count(*) INTO v_failed
        FROM compaction.attempts AS a
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
        IF v_failed >= 2 THEN
            RETURN QUERY SELECT false, 'attempts_exhausted'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        v_attempt := v_failed + 1;
    END IF;

    -- Admission last, so refusals never touch it: a free slot (no holder, or a holder
    -- whose lease ran out), locked to commit. SKIP LOCKED lets concurrent claims take
    -- different slots instead of queueing on one lock; a slot being taken by an
    -- uncommitted claim is as good as taken. Under REPEATABLE READ or SERIALIZABLE a
    -- slot another claim took after this snapshot raises a serialization failure.
    SELECT s.max_running INTO v_max_running FROM compaction.settings AS s;
    -- Slots above max_running exist only while attempts admitted before it was lowered
    -- still hold them (settings_resize_admission could not fit them below; a slot above
    -- is dropped when its holder ends). Then the free slots below do not tell the count:
    -- claims serialise on the live ones (the no-op update also makes a claim whose
    -- snapshot missed another's fail at REPEATABLE READ) and count every live holder.
    -- max(slot) is one step down the primary key, so the usual case costs nothing.
    IF (SELECT max(ad.slot) FROM compaction.admission AS ad) > v_max_running THEN
        UPDATE compaction.admission AS ad
        SET lease_expires_at = ad.lease_expires_at
        WHERE ad.slot > v_max_running AND ad.lease_expires_at > v_now;
        v_overflow := FOUND;
    END IF;
    IF NOT v_overflow OR (SELECT count(*) FROM compaction.admission AS ad
                          WHERE ad.lease_expires_at > v_now) < v_max_running THEN
        SELECT ad.slot INTO v_slot
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_max_running
          AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= v_now)
        ORDER BY ad.slot
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
    END IF;
    IF v_slot IS NULL THEN
        RETURN QUERY SELECT false, 'admission_full'::text, v_job_id, NULL::int, NULL::timestamptz;
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
                p_source_message_ids, p_source_hash, p_model, p_prompt_version, v_now)
        ON CONFLICT DO NOTHING
        RETURNING job_id INTO v_job_id;
    END IF;
    IF v_job_id IS NOT NULL THEN
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, v_now, v_lease)
        ON CONFLICT DO NOTHING;
    END IF;
    IF v_job_id IS NULL OR NOT FOUND THEN
        RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = p_conversation_id, holder_job_id = v_job_id,
        holder_attempt = v_attempt, lease_expires_at = v_lease
    WHERE ad.slot = v_slot;
    RETURN QUERY SELECT true, 'claimed'::text, v_job_id, v_attempt, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, or returns the first refusal reason (see DESIGN §6)';

CREATE FUNCTION compaction.fence(p_job_id bigint, p_attempt int, p_now timestamptz,
                                 p_conversation_id text)
RETURNS compaction.attempts
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_conversation_id text;
    v_attempt         compaction.attempts;
BEGIN
    IF p_conversation_id IS NULL THEN
        SELECT j.conversation_id INTO v_conversation_id
        FROM compaction.jobs AS j
        WHERE j.job_id = p_job_id;
    ELSE
        SELECT j.conversation_id INTO v_conversation_id
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.job_id = p_job_id;
    END IF;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM compaction.lock_conversation(v_conversation_id);
    SELECT a.* INTO v_attempt
    FROM compaction.attempts AS a
    WHERE a.conversation_id = v_conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Only a superuser's or the owner's p_now can be this early (caller_now).
    IF v_attempt.state = 'running' AND p_now < v_attempt.started_at THEN
        RAISE EXCEPTION 'p_now % is before attempt % of job % started (%)',
                p_now, p_attempt, p_job_id, v_attempt.started_at
            USING ERRCODE = 'CP022';
    END IF;
    IF v_attempt.state = 'running' AND v_attempt.lease_expires_at <= p_now THEN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = p_now
        WHERE a.conversation_id = v_conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt
        RETURNING a.* INTO v_attempt;
    END IF;
    RETURN v_attempt;
END
$$;
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz, text) IS
    'Internal: locks attempt (job_id, attempt) of the given conversation (or the job''s) and returns it, first failing it (lease_expired) if its lease ran out; NULL if unknown';

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
AS $$
#variable_conflict use_column
DECLARE
    v_now        timestamptz := compaction.caller_now(p_now);
    v_attempt    compaction.attempts;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    v_stats := compaction.attempt_stats(p_stats);
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
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
          AND a.attempt = p_attempt;
        RETURN QUERY SELECT false, v_problem, NULL::bigint;
        RETURN;
    END IF;

    INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
    VALUES (v_attempt.conversation_id, p_job_id, p_attempt, p_summary, v_now)
    RETURNING summary_id INTO v_summary_id;
    UPDATE compaction.attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = v_now,
        finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
        input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off';

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
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := compaction.caller_now(p_now);
    v_attempt compaction.attempts;
BEGIN
    PERFORM compaction.checked_reason(p_reason);
    IF p_reason IN ('completed', 'lease_expired') THEN
        RAISE EXCEPTION 'fail needs a reason other than completed or lease_expired'
            USING ERRCODE = 'CP020';
    END IF;
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, 'lease_lost'::text;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET state = 'failed', reason = p_reason, finished_at = v_now
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    RETURN QUERY SELECT true, 'failed'::text;
END
$$;
COMMENT ON FUNCTION compaction.fail(bigint, int, text, timestamptz, text) IS
    'Records attempt (job_id, attempt) failed with the worker''s reason code (e.g. http_error, timeout; CP024 unless ^[a-z][a-z0-9_]{0,63}$); lease_lost if fenced off';

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
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := compaction.caller_now(p_now);
    v_lease   timestamptz := v_now + compaction.checked_lease(p_lease);
    v_attempt compaction.attempts;
BEGIN
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET lease_expires_at = v_lease
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    RETURN QUERY SELECT true, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (1 second..1 day, else CP023); ok = false if fenced off (lease_lost)';

CREATE OR REPLACE FUNCTION compaction.reap(p_now timestamptz DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now   timestamptz := compaction.caller_now(p_now);
    v_count int;
BEGIN
    -- SKIP LOCKED: an attempt locked right now is being completed, failed or renewed by
    -- its own fenced call, which settles its expiry itself; two reapers never deadlock.
    WITH expired AS (
        SELECT a.conversation_id, a.job_id, a.attempt
        FROM compaction.attempts AS a
        WHERE a.state = 'running' AND a.lease_expires_at <= v_now
        ORDER BY a.conversation_id, a.job_id
        FOR UPDATE SKIP LOCKED
    )
    , failed AS (
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = v_now
        FROM expired AS e
        WHERE a.conversation_id = e.conversation_id AND a.job_id = e.job_id
          AND a.attempt = e.attempt
        RETURNING a.conversation_id, a.job_id
    ), requeued AS (
        -- The expired attempt's worker is gone and can no longer nudge anyone: put the
        -- conversation back on the queue, so the one retry the contract allows happens
        -- without a sweep and without workers re-queueing every claim just in case.
        -- Like enqueue: an entry leased right now is marked requeued, so the
        -- acknowledgement of a worker that examined it before this expiry keeps it.
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT f.conversation_id, j.scope, pg_catalog.now()
        FROM failed AS f
        JOIN compaction.jobs AS j ON j.conversation_id = f.conversation_id AND j.job_id = f.job_id
        ORDER BY 1, 2
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL
    )
    SELECT count(*) INTO v_count FROM failed;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION compaction.reap(timestamptz) IS
    'Marks running attempts whose lease expired at p_now failed (lease_expired) and re-queues their conversations; returns how many';

CREATE OR REPLACE FUNCTION compaction.erase_conversation(p_conversation_id text, p_reason text)
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

    -- The tombstone comes first: it is what lets the guards pass these deletes. It holds
    -- ids, counts, the reason and the time, never text of the erased rows.
    INSERT INTO compaction.audit_events
        (conversation_id, kind, occurred_at, reason, erased_jobs, erased_attempts, erased_summaries)
    VALUES (p_conversation_id, 'erasure', pg_catalog.now(), p_reason, v_jobs, v_attempts, v_summaries);

    DELETE FROM compaction.job_summaries AS s WHERE s.conversation_id = p_conversation_id;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
        lease_expires_at = NULL
    WHERE ad.holder_conversation_id = p_conversation_id;
    DELETE FROM compaction.admission AS ad
    WHERE ad.slot > (SELECT s.max_running FROM compaction.settings AS s)
      AND ad.holder_conversation_id IS NULL;
    DELETE FROM compaction.attempts AS a WHERE a.conversation_id = p_conversation_id;
    DELETE FROM compaction.jobs AS j WHERE j.conversation_id = p_conversation_id;
    DELETE FROM compaction.queue AS q WHERE q.conversation_id = p_conversation_id;
    RETURN v_summaries;
END
$$;
COMMENT ON FUNCTION compaction.erase_conversation(text, text) IS
    'Erasure requests (owner/admin only): removes a conversation''s jobs, attempts, summaries and queue entries, never source rows; leaves a content-free tombstone event (p_reason a code, else CP024); returns summaries removed';

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

CREATE OR REPLACE VIEW compaction.audit_jobs AS
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
           a.figures_kept
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
           NULL::int
    FROM compaction.jobs AS j
    JOIN compaction.job_summaries AS s
      ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
    WHERE s.attempt IS NULL;
COMMENT ON VIEW compaction.audit_jobs IS
    'Audit: every job with each attempt (state, reason, worker, lease, duration, finish metadata, token usage and figures kept as reported to complete, NULL when not reported) and imported summaries as state imported; no text';

CALL compaction.assign_ownership();

REVOKE TRUNCATE ON compaction.admission FROM compaction_owner;
GRANT EXECUTE ON FUNCTION
    compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text),
    compaction.fail(bigint, int, text, timestamptz, text),
    compaction.heartbeat(bigint, int, interval, timestamptz, text),
    compaction.reply_problem(text, text, int)
TO compaction_worker;
