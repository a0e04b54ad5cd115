-- Revision 0007_worker_surface, down: back to 0006's surface. The admission slots become
-- one row per held slot again; the checks on stored times and reasons are dropped.

DROP TRIGGER prompt_versions_guard ON compaction.prompt_versions;
DROP FUNCTION compaction.prompt_versions_guard();
DROP FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text);
DROP FUNCTION compaction.fail(bigint, int, text, timestamptz, text);
DROP FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text);
DROP FUNCTION compaction.fence(bigint, int, timestamptz, text);

CREATE FUNCTION compaction.fence(p_job_id bigint, p_attempt int, p_now timestamptz)
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
    SELECT j.conversation_id INTO v_conversation_id
    FROM compaction.jobs AS j
    WHERE j.job_id = p_job_id;
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
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz) IS
    'Internal: locks attempt (job_id, attempt) and returns it, first failing it (lease_expired) if its lease ran out; NULL if unknown';

CREATE FUNCTION compaction.complete(
    p_job_id          bigint,
    p_attempt         int,
    p_summary         text,
    p_finish_reason   text,
    p_tool_call_count int,
    p_response_id     text DEFAULT NULL,
    p_now             timestamptz DEFAULT NULL,
    p_stats           jsonb DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text, summary_id bigint)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now        timestamptz := coalesce(p_now, pg_catalog.now());
    v_attempt    compaction.attempts;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    v_stats := compaction.attempt_stats(p_stats);
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now);
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
    ELSIF p_finish_reason IS DISTINCT FROM 'stop' THEN
        v_problem := 'not_stopped';
    ELSIF p_tool_call_count IS DISTINCT FROM 0 THEN
        v_problem := 'tool_calls';
    ELSE
        v_problem := compaction.summary_problem(p_summary);
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
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off';

CREATE FUNCTION compaction.fail(
    p_job_id  bigint,
    p_attempt int,
    p_reason  text,
    p_now     timestamptz DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := coalesce(p_now, pg_catalog.now());
    v_attempt compaction.attempts;
BEGIN
    IF p_reason IS NULL OR p_reason = '' OR p_reason IN ('completed', 'lease_expired') THEN
        RAISE EXCEPTION 'fail needs a reason other than completed or lease_expired'
            USING ERRCODE = 'CP020';
    END IF;
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now);
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
COMMENT ON FUNCTION compaction.fail(bigint, int, text, timestamptz) IS
    'Records attempt (job_id, attempt) failed with the worker''s reason (e.g. http_error, timeout); lease_lost if fenced off';

CREATE FUNCTION compaction.heartbeat(
    p_job_id  bigint,
    p_attempt int,
    p_lease   interval DEFAULT '5 minutes',
    p_now     timestamptz DEFAULT NULL)
RETURNS TABLE (ok boolean, lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := coalesce(p_now, pg_catalog.now());
    v_attempt compaction.attempts;
BEGIN
    IF p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'heartbeat needs a positive lease' USING ERRCODE = 'CP020';
    END IF;
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now);
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET lease_expires_at = v_now + p_lease
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    RETURN QUERY SELECT true, v_now + p_lease;
END
$$;
COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease; ok = false if fenced off (lease_lost)';

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
    v_now         timestamptz := coalesce(p_now, pg_catalog.now());
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_job_id      bigint;
    v_failed      int;
    v_attempt     int;
    v_max_running int;
    v_in_flight   bigint;
    v_lease       timestamptz;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL OR p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker, and a positive lease'
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

    -- Admission: taken last, only by a claim about to admit, so refusals never queue on
    -- it; held to commit, so the count below is exact across concurrent claimers.
    PERFORM pg_catalog.pg_advisory_xact_lock(1129316352, 2);
    SELECT s.max_running INTO v_max_running FROM compaction.settings AS s;
    SELECT count(*) INTO v_in_flight
    FROM compaction.admission AS ad
    WHERE ad.lease_expires_at > v_now;
    IF v_in_flight >= coalesce(v_max_running, 8) THEN
        RETURN QUERY SELECT false, 'admission_full'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    v_lease := v_now + p_lease;
    BEGIN
        IF v_job_id IS NULL THEN
            INSERT INTO compaction.jobs
                (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
                 model, prompt_version, created_at)
            VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                    p_source_message_ids, p_source_hash, p_model, p_prompt_version, v_now)
            RETURNING job_id INTO v_job_id;
        END IF;
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, v_now, v_lease);
    EXCEPTION WHEN unique_violation THEN
        -- Only reachable when the caller's snapshot predates a concurrent winner
        -- (REPEATABLE READ): the unique indexes decide, the loser gets a refusal row.
        RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END;
    RETURN QUERY SELECT true, 'claimed'::text, v_job_id, v_attempt, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, or returns the first refusal reason (see DESIGN §6)';

CREATE OR REPLACE FUNCTION compaction.reap(p_now timestamptz DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now   timestamptz := coalesce(p_now, pg_catalog.now());
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
    IF p_conversation_id IS NULL OR NOT compaction.has_content(p_reason) THEN
        RAISE EXCEPTION 'erase_conversation needs a conversation id and a reason'
            USING ERRCODE = 'CP020';
    END IF;
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
    DELETE FROM compaction.admission AS ad WHERE ad.conversation_id = p_conversation_id;
    DELETE FROM compaction.attempts AS a WHERE a.conversation_id = p_conversation_id;
    DELETE FROM compaction.jobs AS j WHERE j.conversation_id = p_conversation_id;
    DELETE FROM compaction.queue AS q WHERE q.conversation_id = p_conversation_id;
    RETURN v_summaries;
END
$$;
COMMENT ON FUNCTION compaction.erase_conversation(text, text) IS
    'Erasure requests (owner/admin only): removes a conversation''s jobs, attempts, summaries and queue entries, never source rows; leaves a content-free tombstone event; returns summaries removed';

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
           a.finished_at - a.started_at AS duration,
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

DROP FUNCTION compaction.reply_problem(text, text, int);
DROP FUNCTION compaction.checked_reason(text);
DROP FUNCTION compaction.checked_lease(interval);
DROP FUNCTION compaction.caller_now(timestamptz);

ALTER TABLE compaction.audit_events
    DROP CONSTRAINT audit_events_reason_is_code,
    DROP CONSTRAINT audit_events_times_finite;
ALTER TABLE compaction.attempts
    DROP CONSTRAINT attempts_times_valid,
    DROP CONSTRAINT attempts_reason_is_code;

DROP TRIGGER settings_resize_admission ON compaction.settings;
DROP FUNCTION compaction.settings_resize_admission();
DROP TRIGGER attempts_track_admission ON compaction.attempts;
CREATE TABLE compaction.admission_0006 AS
SELECT ad.holder_conversation_id AS conversation_id, ad.holder_job_id AS job_id,
       ad.holder_attempt AS attempt, ad.lease_expires_at
FROM compaction.admission AS ad
WHERE ad.holder_conversation_id IS NOT NULL;
DROP TABLE compaction.admission;
CREATE TABLE compaction.admission (
    conversation_id  text NOT NULL,
    job_id           bigint NOT NULL,
    attempt          int NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    CONSTRAINT admission_pkey PRIMARY KEY (conversation_id, job_id)
);
COMMENT ON TABLE compaction.admission IS
    'Internal: one row per running attempt with its lease, counted by claim to enforce settings.max_running';
-- claim counts the unexpired leases: lease_expires_at > now.
CREATE INDEX admission_lease_idx ON compaction.admission (lease_expires_at);
INSERT INTO compaction.admission (conversation_id, job_id, attempt, lease_expires_at)
SELECT a.conversation_id, a.job_id, a.attempt, a.lease_expires_at
FROM compaction.admission_0006 AS a;
DROP TABLE compaction.admission_0006;
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
BEGIN
    IF NEW.state = 'running' THEN
        INSERT INTO compaction.admission AS ad (conversation_id, job_id, attempt, lease_expires_at)
        VALUES (NEW.conversation_id, NEW.job_id, NEW.attempt, NEW.lease_expires_at)
        ON CONFLICT (conversation_id, job_id) DO UPDATE
            SET attempt = EXCLUDED.attempt, lease_expires_at = EXCLUDED.lease_expires_at;
    ELSE
        DELETE FROM compaction.admission AS ad
        WHERE ad.conversation_id = NEW.conversation_id
          AND ad.job_id = NEW.job_id
          AND ad.attempt = NEW.attempt;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.attempts_track_admission() IS
    'Trigger: mirrors running attempts and their leases into compaction.admission';

CREATE TRIGGER attempts_track_admission
    AFTER INSERT OR UPDATE ON compaction.attempts
    FOR EACH ROW EXECUTE FUNCTION compaction.attempts_track_admission();
ALTER TABLE compaction.attempts ENABLE ALWAYS TRIGGER attempts_track_admission;

ALTER TABLE compaction.settings DROP CONSTRAINT settings_max_running_bounded;

CALL compaction.assign_ownership();

REVOKE TRUNCATE ON compaction.admission FROM compaction_owner;
GRANT EXECUTE ON FUNCTION
    compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb),
    compaction.fail(bigint, int, text, timestamptz),
    compaction.heartbeat(bigint, int, interval, timestamptz)
TO compaction_worker;
