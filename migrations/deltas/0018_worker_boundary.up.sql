-- 0018_worker_boundary: what a worker role can reach, and what a role without engine
-- grants can (issue 30).
--
-- An attempt belongs to the login that claimed it: claim stores session_user with the
-- attempt (attempts.claimed_by), and complete, fail and heartbeat from any other login,
-- the owner and superusers aside, answer lease_lost and change nothing. Knowing
-- (job_id, attempt) is no longer enough. Attempts claimed before this revision have no
-- login: only the owner or a superuser can finish them, and their leases run out.
--
-- A conversation's engine writers serialise on a row lock of the new table
-- compaction.conversation_locks instead of the advisory lock (1129316352,
-- hashtext(conversation_id)), which any login could take to stall that conversation's
-- claims and completions and make reap pass it over. Locking a row needs UPDATE on it:
-- only the owner has that. One row per conversation, written here for every
-- conversation that has jobs (reap finds the rows of those with attempts) and by the
-- first claim or import of any other.
--
-- Bounds: dequeue leases at most 1000 entries a call; a conversation id and a scope may
-- be at most 1024 bytes each, a model and a worker name 256 (CP020, naming the limit),
-- instead of failing deep in an index (54000).

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

INSERT INTO compaction.conversation_locks (conversation_id)
SELECT DISTINCT j.conversation_id FROM compaction.jobs AS j;

CREATE OR REPLACE FUNCTION compaction.lock_conversation(p_conversation_id text)
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

CREATE OR REPLACE FUNCTION compaction.try_lock_conversation(p_conversation_id text)
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

DROP FUNCTION compaction.conversation_lock_key(text);

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

CREATE OR REPLACE FUNCTION compaction.caller_now(p_now timestamptz)
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
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_conversation_id)
               WHEN pg_catalog.octet_length(p_scope) OPERATOR(pg_catalog.>) 1024
                   THEN 'a scope may be at most 1024 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_scope)
               WHEN pg_catalog.octet_length(p_model) OPERATOR(pg_catalog.>) 256
                   THEN 'a model may be at most 256 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_model)
               WHEN pg_catalog.octet_length(p_worker) OPERATOR(pg_catalog.>) 256
                   THEN 'a worker name may be at most 256 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_worker)
           END
$$;
COMMENT ON FUNCTION compaction.oversized_identifier(text, text, text, text) IS
    'Internal: NULL when the conversation id (at most 1024 bytes), scope (1024), model (256) and worker name (256) fit, else the message naming the first one over its limit (callers raise CP020)';

-- The login that claimed each attempt (see claim and fence); it never changes.
ALTER TABLE compaction.attempts ADD COLUMN claimed_by text;
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
    -- Who claimed it never changes (revision 0018: the fence lets that login alone finish it).
    IF OLD.state = 'running'
       AND (NEW.conversation_id, NEW.job_id, NEW.attempt, NEW.worker, NEW.started_at,
            NEW.claimed_by)
           IS NOT DISTINCT FROM
           (OLD.conversation_id, OLD.job_id, OLD.attempt, OLD.worker, OLD.started_at,
            OLD.claimed_by)
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
    'Trigger: attempts are append-only except running -> completed | failed and lease renewal (never the claiming login); DELETE only inside erase_conversation';

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
    v_slot        int;
    v_overflow    boolean := false;
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
    SELECT s.max_running INTO v_max_running FROM compaction.settings AS s;
    -- Slots above max_running are held only by attempts admitted before it was lowered.
    -- While any is, the free slots below do not tell the count: claims serialise on the
    -- live holders above (the no-op update also makes a claim whose snapshot missed
    -- another's fail at REPEATABLE READ) and count every live holder. The highest held
    -- slot is one step down admission_held_idx, so the usual case costs nothing.
    IF (SELECT max(ad.slot) FROM compaction.admission AS ad
        WHERE ad.holder_conversation_id IS NOT NULL) > v_max_running THEN
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
        RETURNING * INTO v_job;
        v_job_id := v_job.job_id;
    END IF;
    IF v_job_id IS NOT NULL THEN
        -- The attempt belongs to this login from now on (the fence compares).
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at,
             claimed_by)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, v_now, v_lease,
                session_user)
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

COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off or claimed by another login';

COMMENT ON FUNCTION compaction.fail(bigint, int, text, timestamptz, text) IS
    'Records attempt (job_id, attempt) failed with the worker''s reason code (e.g. http_error, timeout; CP024 unless ^[a-z][a-z0-9_]{0,63}$); lease_lost if fenced off or claimed by another login';

COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (1 second..1 day, else CP023); ok = false if fenced off or claimed by another login (lease_lost)';

CREATE OR REPLACE FUNCTION compaction.enqueue(p_conversation_id text, p_scope text DEFAULT 'default')
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

CREATE OR REPLACE FUNCTION compaction.dequeue(
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

CREATE OR REPLACE FUNCTION compaction.citus_tables()
RETURNS TABLE (table_name text, placement text, step int)
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    -- In distribution order: reference tables first (distributed tables refer to them),
    -- then each distributed table after the tables its foreign keys name.
    VALUES ('compaction.settings', 'reference', 1),
           ('compaction.prompt_versions', 'reference', 2),
           ('compaction.admission', 'reference', 3),
           ('compaction.source_tracking', 'reference', 4),
           ('compaction_source.conversations', 'distributed', 5),
           ('compaction_source.runs', 'distributed', 6),
           ('compaction_source.messages', 'distributed', 7),
           ('compaction.jobs', 'distributed', 8),
           ('compaction.attempts', 'distributed', 9),
           ('compaction.job_summaries', 'distributed', 10),
           ('compaction.audit_events', 'distributed', 11),
           ('compaction.queue', 'distributed', 12),
           ('compaction.conversation_state', 'distributed', 13),
           ('compaction.pairs', 'distributed', 14),
           ('compaction.ranges', 'distributed', 15),
           ('compaction.summary_verdicts', 'distributed', 16),
           ('compaction.conversation_locks', 'distributed', 17)
$$;
COMMENT ON FUNCTION compaction.citus_tables() IS
    'Every engine table with its Citus placement (distributed by conversation_id, co-located, or reference) in the order compaction.distribute_on_citus() applies them';

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
COMMENT ON VIEW compaction.audit_jobs IS
    'Audit: every job with each attempt (state, reason, worker, lease, duration, finish metadata, token usage and figures kept as reported to complete, NULL when not reported, and the login that claimed it) and imported summaries as state imported; no text';

-- Emptied, the lock rows would be written again by the next claim, but reap would pass
-- over conversations with expired attempts until then.
CREATE TRIGGER conversation_locks_truncate_guard
    BEFORE TRUNCATE ON compaction.conversation_locks
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.conversation_locks ENABLE ALWAYS TRIGGER conversation_locks_truncate_guard;

CALL compaction.assign_ownership();
REVOKE TRUNCATE ON compaction.conversation_locks FROM compaction_owner;
