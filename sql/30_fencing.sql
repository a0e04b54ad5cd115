-- pycompactor stored logic, section 3 continued: fencing (contract §6). Owns fence, the
-- step complete, fail and heartbeat (30_completion.sql) take before they write: the
-- attempt must still be running, with a live lease, claimed by this login.

-- The fencing step shared by complete, fail and heartbeat: locks the conversation and the
-- attempt row, and answers whether (job_id, attempt) is still running with a live lease.
-- An expired, unreaped attempt is marked failed (lease_expired) on the way. A given
-- p_conversation_id must name the job's conversation (else the job is not found: the
-- caller answers lease_lost); it lets a distributed database route the call. The job's
-- row comes back with the attempt's, so the caller records the attempt's
-- change without reading either again. Of a live attempt, attempt_row holds the columns
-- the callers and this function use (conversation_id, job_id, attempt, state,
-- started_at, lease_expires_at, slot), the rest NULL; an attempt this call expired
-- comes back whole. An attempt belongs to the login that claimed it
-- (contract §6): to any other login, the owner and superusers aside, the
-- attempt is unknown (the caller answers lease_lost) and nothing changes, not even an
-- expiry. That is asked before the conversation's lock, so a refused call
-- takes no lock at all; the usual call costs one more read of the attempt by key.
-- No SECURITY DEFINER and no SET clause, as claim_range: only the owner
-- may execute it, and it runs inside its three callers, definers with this search_path,
-- where saving and restoring the settings around each call cost more than the comparison.
CREATE FUNCTION compaction.fence(p_job_id bigint, p_attempt int, p_now timestamptz,
                                 p_conversation_id text,
                                 OUT attempt_row compaction.attempts,
                                 OUT job_row compaction.jobs)
RETURNS record
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_bound        text;  -- what bound_caller_transaction set
    v_claimed_by text;
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
    -- Who claimed the attempt, read before any lock: it never
    -- changes (attempts_guard), so a call refused for another login, or for an attempt
    -- that does not exist, answers without taking the conversation's lock, and a caller
    -- that keeps its transaction open after a refusal holds nothing of another's.
    SELECT a.claimed_by INTO v_claimed_by
    FROM compaction.attempts AS a
    WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_claimed_by IS DISTINCT FROM session_user
       AND NOT compaction.caller_is_privileged() THEN
        job_row := NULL;
        RETURN;
    END IF;
    -- lock_conversation's statement (written out, as in claim).
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (job_row.conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    v_bound := compaction.bound_caller_transaction();
    -- The columns used, not the row: at every run the plan describes each column it
    -- returns (a type lookup apiece, in the scan and in the row lock), and the row has
    -- 26 (0.9% of a claim -> complete cycle's instructions).
    SELECT a.conversation_id, a.job_id, a.attempt, a.state, a.started_at,
           a.lease_expires_at, a.slot
    INTO attempt_row.conversation_id, attempt_row.job_id, attempt_row.attempt,
         attempt_row.state, attempt_row.started_at, attempt_row.lease_expires_at,
         attempt_row.slot
    FROM compaction.attempts AS a
    WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    FOR UPDATE;
    IF NOT FOUND THEN
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
        PERFORM compaction.release_slot(job_row.conversation_id, attempt_row);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz, text) IS
    'Internal: locks attempt (job_id, attempt) of the given conversation (or the job''s) and returns it (its key, state, start, lease and slot; whole if this call expired it) with its job, first failing it (lease_expired) if its lease ran out; attempt_row NULL if unknown or claimed by another login (owner and superusers aside)';
