-- 0027_attempt_events, downgrade: every event an attempt row records is written to the
-- log (ids, times and transactions as they were) before the columns go, and the log is
-- the table compaction.audit_events again.

INSERT INTO compaction.event_log
    (conversation_id, event_id, kind, occurred_at, recorded_at, xact_id, scope, from_pair,
     to_pair, job_id, attempt, reason, worker, model, prompt_version, source_hash,
     summary_id, summary_chars, erased_jobs, erased_attempts, erased_summaries)
SELECT e.conversation_id, e.event_id, e.kind, e.occurred_at, e.recorded_at, e.xact_id,
       e.scope, e.from_pair, e.to_pair, e.job_id, e.attempt, e.reason, e.worker, e.model,
       e.prompt_version, e.source_hash, e.summary_id, e.summary_chars, e.erased_jobs,
       e.erased_attempts, e.erased_summaries
FROM compaction.attempt_events AS e;

DROP VIEW compaction.audit_events;
DROP FUNCTION compaction.read_audit_events();
DROP VIEW compaction.audit_events_rows;
DROP VIEW compaction.attempt_events;

CREATE FUNCTION compaction.record_attempt_change(p_conversation_id text,
                                                 p_attempt compaction.attempts,
                                                 p_job compaction.jobs,
                                                 p_summary_id bigint DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- An engine bug, never a caller's: the event would name another job's identity.
    IF p_attempt.conversation_id IS DISTINCT FROM p_conversation_id
       OR p_job.conversation_id IS DISTINCT FROM p_conversation_id
       OR p_attempt.job_id IS DISTINCT FROM p_job.job_id THEN
        RAISE EXCEPTION 'record_attempt_change: attempt % of job % is not of job % of conversation %',
                p_attempt.attempt, p_attempt.job_id, p_job.job_id, p_conversation_id
            USING ERRCODE = 'XX000';
    END IF;
    INSERT INTO compaction.audit_events
        (conversation_id, kind, occurred_at, scope, from_pair, to_pair, job_id, attempt,
         reason, worker, model, prompt_version, source_hash, summary_id, summary_chars)
    VALUES (p_conversation_id,
            CASE
                WHEN p_attempt.state = 'running' THEN 'claim'
                WHEN p_attempt.state = 'completed' THEN 'completion'
                WHEN p_attempt.reason = 'lease_expired' THEN 'lease_expiry'
                ELSE 'failure'
            END,
            CASE WHEN p_attempt.state = 'running' THEN p_attempt.started_at
                 ELSE p_attempt.finished_at END,
            p_job.scope, p_job.from_pair, p_job.to_pair, p_attempt.job_id, p_attempt.attempt,
            p_attempt.reason, p_attempt.worker, p_job.model, p_job.prompt_version,
            p_job.source_hash, p_summary_id, p_attempt.summary_chars);
    IF p_attempt.state IS DISTINCT FROM 'running' AND p_attempt.slot IS NOT NULL THEN
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.slot = p_attempt.slot AND ad.holder_conversation_id = p_conversation_id
          AND ad.holder_job_id = p_attempt.job_id AND ad.holder_attempt = p_attempt.attempt;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.record_attempt_change(text, compaction.attempts, compaction.jobs, bigint) IS
    'Internal: given an attempt row of a conversation as just written and its job, writes the audit event of the attempt''s state (claim, completion with p_summary_id, failure, lease_expiry) and frees its admission slot once it ended';

CREATE OR REPLACE FUNCTION compaction.attempts_guard()
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
    -- it), nor the admission slot it took (revision 0026: the slot is freed by that key).
    IF OLD.state = 'running'
       AND (NEW.conversation_id, NEW.job_id, NEW.attempt, NEW.worker, NEW.started_at,
            NEW.claimed_by, NEW.slot)
           IS NOT DISTINCT FROM
           (OLD.conversation_id, OLD.job_id, OLD.attempt, OLD.worker, OLD.started_at,
            OLD.claimed_by, OLD.slot)
       AND (NEW.state IN ('completed', 'failed')
            OR (NEW.state = 'running'
                AND (NEW.reason, NEW.finished_at, NEW.finish_reason, NEW.tool_call_count,
                     NEW.response_id, NEW.summary_chars, NEW.input_tokens, NEW.output_tokens,
                     NEW.figures_total, NEW.figures_kept)
                    IS NOT DISTINCT FROM
                    (OLD.reason, OLD.finished_at, OLD.finish_reason, OLD.tool_call_count,
                     OLD.response_id, OLD.summary_chars, OLD.input_tokens, OLD.output_tokens,
                     OLD.figures_total, OLD.figures_kept))) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'compaction.attempts: only running -> completed | failed may change (job % attempt % is %)',
            OLD.job_id, OLD.attempt, OLD.state
        USING ERRCODE = 'CP011';
END
$$;
COMMENT ON FUNCTION compaction.attempts_guard() IS
    'Trigger: attempts are append-only except running -> completed | failed and lease renewal (never the claiming login nor the slot); DELETE only inside erase_conversation';

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
    v_now         timestamptz := compaction.caller_now(p_now);
    v_lease       timestamptz := v_now + compaction.checked_lease(p_lease);
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
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

    -- From here on the conversation's engine rows are ours until commit: the statement of
    -- lock_conversation, written out here and in fence (revision 0018), where a call per
    -- cycle would cost as much as the row lock itself.
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;

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
            SET state = 'failed', reason = 'lease_expired', finished_at = v_now
            WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
              AND a.state = 'running' AND a.lease_expires_at <= v_now
            RETURNING a.*
        LOOP
            PERFORM compaction.record_attempt_change(p_conversation_id, v_expired, v_job);
        END LOOP;

        IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                   WHERE s.conversation_id = p_conversation_id AND s.job_id = v_job_id) THEN
            RETURN QUERY SELECT false, 'already_completed'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        -- The job id is no secret (revision 0018): the running attempt belongs to the
        -- login that claimed it, and only that login can finish or renew it.
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
          AND ad.lease_expires_at > v_now;
        v_overflow := FOUND;
        IF NOT v_overflow THEN
            PERFORM compaction.lower_high_water(v_max_running, v_high_water, v_now);
        END IF;
    END IF;
    -- Counted only while the overflow lasts. As one condition with NOT v_overflow, the
    -- count was a parameterised subquery that PL/pgSQL planned again at every claim (its
    -- custom plan, with v_overflow false, pruned the count, so a generic plan never won).
    IF v_overflow THEN
        SELECT count(*) < v_max_running INTO v_room
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_high_water AND ad.lease_expires_at > v_now;
    END IF;
    IF v_room THEN
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
        RETURNING * INTO v_job;
        v_job_id := v_job.job_id;
    END IF;
    IF v_job_id IS NOT NULL THEN
        -- The attempt belongs to this login from now on (the fence compares).
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at,
             claimed_by, slot)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, v_now, v_lease,
                session_user, v_slot)
        ON CONFLICT DO NOTHING
        RETURNING * INTO v_attempt_row;
    END IF;
    IF v_job_id IS NULL OR NOT FOUND THEN
        RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = p_conversation_id, holder_job_id = v_job_id,
        holder_attempt = v_attempt, lease_expires_at = v_lease
    WHERE ad.slot = v_slot;
    PERFORM compaction.record_attempt_change(p_conversation_id, v_attempt_row, v_job);
    RETURN QUERY SELECT true, 'claimed'::text, v_job_id, v_attempt, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, bound to the calling login, or returns the first refusal reason (see DESIGN §6)';

CREATE OR REPLACE FUNCTION compaction.fence(p_job_id bigint, p_attempt int, p_now timestamptz,
                                 p_conversation_id text,
                                 OUT attempt_row compaction.attempts,
                                 OUT job_row compaction.jobs)
RETURNS record
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
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
        PERFORM compaction.record_attempt_change(job_row.conversation_id, attempt_row, job_row);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz, text) IS
    'Internal: locks attempt (job_id, attempt) of the given conversation (or the job''s) and returns it with its job, first failing it (lease_expired) if its lease ran out; attempt_row NULL if unknown or claimed by another login (owner and superusers aside)';

CREATE OR REPLACE FUNCTION compaction.complete(
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
    v_now        timestamptz := compaction.caller_now(p_now);
    v_fenced     record;
    v_attempt    compaction.attempts;
    v_job        compaction.jobs;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    v_stats := compaction.attempt_stats(p_stats);
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
        PERFORM compaction.record_attempt_change(v_attempt.conversation_id, v_attempt, v_job);
        RETURN QUERY SELECT false, v_problem, NULL::bigint;
        RETURN;
    END IF;

    INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
    VALUES (v_attempt.conversation_id, p_job_id, p_attempt, p_summary, v_now)
    RETURNING summary_id INTO v_summary_id;
    PERFORM compaction.rederive_summary_verdicts(v_attempt.conversation_id, '{}', v_summary_id);
    UPDATE compaction.attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = v_now,
        finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
        input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    RETURNING a.* INTO v_attempt;
    PERFORM compaction.record_attempt_change(v_attempt.conversation_id, v_attempt, v_job,
                                             v_summary_id);
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off or claimed by another login';

CREATE OR REPLACE FUNCTION compaction.fail(
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
    v_now     timestamptz := compaction.caller_now(p_now);
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
    PERFORM compaction.record_attempt_change(v_attempt.conversation_id, v_attempt,
                                             v_fenced.job_row);
    RETURN QUERY SELECT true, 'failed'::text;
END
$$;
COMMENT ON FUNCTION compaction.fail(bigint, int, text, timestamptz, text) IS
    'Records attempt (job_id, attempt) failed with the worker''s reason code (e.g. http_error, timeout; CP024 unless ^[a-z][a-z0-9_]{0,63}$); lease_lost if fenced off or claimed by another login';

CREATE OR REPLACE FUNCTION compaction.reap_conversation(p_conversation_id text, p_now timestamptz)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_expired compaction.attempts;
    v_job     compaction.jobs;
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
        SELECT j.* INTO v_job
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.job_id = v_expired.job_id;
        PERFORM compaction.record_attempt_change(p_conversation_id, v_expired, v_job);
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

CREATE OR REPLACE FUNCTION compaction.import_summary(
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
    -- Written here, not by a trigger on job_summaries (DESIGN §11).
    INSERT INTO compaction.audit_events
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

    -- The tombstone comes first. It holds ids, counts, the reason and the time, never
    -- text of the erased rows.
    INSERT INTO compaction.audit_events
        (conversation_id, kind, occurred_at, reason, erased_jobs, erased_attempts, erased_summaries)
    VALUES (p_conversation_id, 'erasure', pg_catalog.now(), p_reason, v_jobs, v_attempts, v_summaries);

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

CREATE OR REPLACE FUNCTION compaction.citus_tables()
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
           ('compaction.audit_events', 'distributed', 11, 'conversation'),
           ('compaction.queue', 'distributed', 12, 'queue'),
           ('compaction.conversation_state', 'distributed', 13, 'conversation'),
           ('compaction.pairs', 'distributed', 14, 'conversation'),
           ('compaction.ranges', 'distributed', 15, 'conversation'),
           ('compaction.summary_verdicts', 'distributed', 16, 'conversation'),
           ('compaction.conversation_locks', 'distributed', 17, 'conversation')
$$;
COMMENT ON FUNCTION compaction.citus_tables() IS
    'Every engine table with its Citus placement (distributed by conversation_id, or reference), the order compaction.distribute_on_citus() applies them in, and the co-location group of a distributed table (conversation, or queue alone)';

CREATE OR REPLACE PROCEDURE compaction.place_audit_views()
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
    ELSE
        CREATE OR REPLACE VIEW compaction.audit_jobs AS
            SELECT * FROM compaction.audit_jobs_rows;
        CREATE OR REPLACE VIEW compaction.audit_exhausted AS
            SELECT * FROM compaction.audit_exhausted_rows;
        CREATE OR REPLACE VIEW compaction.audit_queue AS
            SELECT * FROM compaction.audit_queue_rows;
    END IF;
END
$$;
COMMENT ON PROCEDURE compaction.place_audit_views() IS
    'Migration and Citus step: points the audit views at their bodies (one node) or at the definer functions read_audit_* (Citus, where a view''s shard queries run with the caller''s rights)';

DROP FUNCTION compaction.release_slot(text, compaction.attempts);

DO $$
BEGIN
    EXECUTE 'ALTER TABLE compaction.attempts
                 DROP COLUMN claim_event_id,
                 DROP COLUMN claim_recorded_at,
                 DROP COLUMN claim_xact_id,
                 DROP COLUMN finish_event_id,
                 DROP COLUMN finish_recorded_at,
                 DROP COLUMN finish_xact_id';
END
$$;
DO $$
BEGIN
    EXECUTE 'ALTER TABLE compaction.event_log RENAME TO audit_events';
END
$$;
-- PostgreSQL 18: the NOT NULL constraints' names of a table made audit_events.
DO $$
DECLARE
    v_name text;
BEGIN
    FOR v_name IN
        SELECT c.conname FROM pg_catalog.pg_constraint AS c
        WHERE c.conrelid = 'compaction.audit_events'::regclass AND c.contype = 'n'
          AND c.conname LIKE 'event\_log\_%'
        ORDER BY 1
    LOOP
        EXECUTE pg_catalog.format('ALTER TABLE compaction.audit_events RENAME CONSTRAINT %I TO %I',
                                  v_name, 'audit_events_' || pg_catalog.substr(v_name, 11));
    END LOOP;
END
$$;
COMMENT ON TABLE compaction.audit_events IS
    'Append-only event log, one row per state change (claim, completion, failure, lease_expiry, import, erasure), in (recorded_at, event_id) order; metadata only, never text';
GRANT SELECT ON compaction.audit_events TO compaction_auditor;
CALL compaction.assign_ownership();
CALL compaction.place_audit_views();
