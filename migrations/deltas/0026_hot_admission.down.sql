-- 0026_hot_admission, downgrade: the slots' holder indexes back, and slots freed by their
-- holder again. A held slot keeps its holder columns, which is all 0025 reads.

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

CREATE OR REPLACE FUNCTION compaction.record_attempt_change(p_conversation_id text,
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
    IF p_attempt.state IS DISTINCT FROM 'running' THEN
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.holder_conversation_id = p_conversation_id
          AND ad.holder_job_id = p_attempt.job_id AND ad.holder_attempt = p_attempt.attempt;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.record_attempt_change(text, compaction.attempts, compaction.jobs, bigint) IS
    'Internal: given an attempt row of a conversation as just written and its job, writes the audit event of the attempt''s state (claim, completion with p_summary_id, failure, lease_expiry) and frees its admission slot once it ended';

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
    -- Counted only while the overflow lasts. As one condition with NOT v_overflow, the
    -- count was a parameterised subquery that PL/pgSQL planned again at every claim (its
    -- custom plan, with v_overflow false, pruned the count, so a generic plan never won).
    IF v_overflow THEN
        SELECT count(*) < v_max_running INTO v_room
        FROM compaction.admission AS ad
        WHERE ad.lease_expires_at > v_now;
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

CREATE OR REPLACE FUNCTION compaction.heartbeat(
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
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := compaction.caller_now(p_now);
    v_lease   timestamptz := v_now + compaction.checked_lease(p_lease);
    v_attempt compaction.attempts;
BEGIN
    v_attempt := (compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id)).attempt_row;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET lease_expires_at = v_lease
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    -- The slot carries a copy of the lease: a renewed attempt keeps counting.
    UPDATE compaction.admission AS ad
    SET lease_expires_at = v_lease
    WHERE ad.holder_conversation_id = v_attempt.conversation_id
      AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    RETURN QUERY SELECT true, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (1 second..1 day, else CP023); ok = false if fenced off or claimed by another login (lease_lost)';

DROP FUNCTION compaction.lower_high_water(int, int, timestamptz);
DO $$
BEGIN
    EXECUTE 'DROP TRIGGER settings_high_water ON compaction.settings';
END
$$;
DROP FUNCTION compaction.settings_high_water();
DO $$
BEGIN
    EXECUTE 'ALTER TABLE compaction.settings DROP COLUMN admission_high_water';
END
$$;
COMMENT ON TABLE compaction.settings IS
    'Engine settings, a single row: max_running caps running (unexpired) attempts across the database (default 8)';

DO $$
BEGIN
    EXECUTE 'ALTER TABLE compaction.attempts DROP COLUMN slot';
END
$$;
DO $$
BEGIN
    EXECUTE 'ALTER TABLE compaction.admission RESET (fillfactor)';
END
$$;
DO $$
BEGIN
    EXECUTE 'CREATE UNIQUE INDEX admission_holder_key
                 ON compaction.admission (holder_conversation_id, holder_job_id)
                 WHERE holder_conversation_id IS NOT NULL';
END
$$;
DO $$
BEGIN
    EXECUTE 'CREATE INDEX admission_held_idx ON compaction.admission (slot)
                 WHERE holder_conversation_id IS NOT NULL';
END
$$;

CALL compaction.assign_ownership();
