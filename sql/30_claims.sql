-- pycompactor stored logic, section 3 continued: claims (contract §6; the tables are in
-- 29_jobs.sql). Owns compaction.claim with claim_settled and claim_range. The lock and
-- the caller's checks it uses are in 30_caller.sql, the admission slots' release and high
-- water in 30_admission.sql; claims of several ranges are in 30_claims_targets.sql.

-- What the committed state already answers for a claim of an
-- identity, read without any lock: already_completed (a summary, for good),
-- already_running (an attempt whose lease is live) or attempts_exhausted (two attempts,
-- for good), in claim_range's order; NULL when only a claim under the conversation's lock
-- can tell (no job yet, a retry, admission) or must write (an expired attempt, which the
-- claim reaps on its way, contract §6). Each answer is what claim_range would give
-- at the moment of the read, so claim, claim_targets and claim_next_targets answer these
-- refusals without taking the lock: a refused claim holds nothing, whatever its caller's
-- transaction does next. No SET clause, as claim_range: owner-only, under its callers'
-- settings.
CREATE FUNCTION compaction.claim_settled(
    p_conversation_id text,
    p_scope           text,
    p_from_pair       int,
    p_source_hash     text,
    p_model           text,
    p_prompt_version  text,
    p_now             timestamptz,
    OUT reason        text,
    OUT job_id        bigint)
RETURNS record
LANGUAGE plpgsql
STABLE
AS $$
DECLARE
    v_job_id  bigint;
    v_live    boolean;
    v_expired boolean;
    v_count   int;
BEGIN
    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;
    job_id := v_job_id;
    IF v_job_id IS NULL THEN
        RETURN;
    END IF;
    SELECT coalesce(pg_catalog.bool_or(a.state = 'running' AND a.lease_expires_at > p_now),
                    false),
           coalesce(pg_catalog.bool_or(a.state = 'running' AND a.lease_expires_at <= p_now),
                    false),
           pg_catalog.count(*)
    INTO v_live, v_expired, v_count
    FROM compaction.attempts AS a
    WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
    IF v_expired THEN
        RETURN;  -- the claim reaps it, under the lock
    END IF;
    reason := CASE WHEN EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                                WHERE s.conversation_id = p_conversation_id
                                  AND s.job_id = v_job_id) THEN 'already_completed'
                   WHEN v_live THEN 'already_running'
                   WHEN v_count >= 2 THEN 'attempts_exhausted' END;
END
$$;
COMMENT ON FUNCTION compaction.claim_settled(text, text, int, text, text, text, timestamptz) IS
    'Internal: the refusal the committed state already gives a claim of this identity (already_completed, already_running, attempts_exhausted) and its job, read without a lock; NULL when only a claim under the conversation''s lock can tell';

-- A claim once the range has been judged (p_is_target: the window policy
-- makes it a target now; p_target_ids and p_target_hash: its current ids and hash), under
-- the conversation's lock, which the caller holds: the checks from not_eligible on, in the
-- contract's order, and the writes. compaction.claim judges one range, claim_targets a
-- batch of one conversation's ranges at once; both answer through here. p_matched: the
-- caller has already found, from these very arguments, that the range is a target and
-- its ids and hash the given ones, the hash well-formed (claim does before its lock, and
-- passes it when nothing made it judge again under the lock), so the checks of
-- not_eligible and source_mismatch are not made twice: made again, with
-- valid_source_hash's second call, they were 0.9% of a claim -> complete cycle's
-- instructions.
CREATE FUNCTION compaction.claim_range(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_now                timestamptz,
    p_lease_expires_at   timestamptz,
    p_is_target          boolean,
    p_target_ids         text[],
    p_target_hash        text,
    p_matched            boolean DEFAULT false,
    OUT claimed          boolean,
    OUT reason           text,
    OUT job_id           bigint,
    OUT attempt          int,
    OUT lease_expires_at timestamptz)
RETURNS record
LANGUAGE plpgsql
VOLATILE
-- No SET clause and no SECURITY DEFINER: only the owner may execute it, and it runs
-- inside claim and claim_targets, under their rights, search_path and planner settings
-- (every lookup by key, whatever the tables' statistics when first planned). Either
-- would cost each claim a second change of settings.
AS $$
#variable_conflict use_column
DECLARE
    v_job_id      bigint;
    v_failed      int;
    v_attempt     int;
    v_max_running int;
    v_high_water  int;
    v_slot        int;
    v_overflow    boolean := false;
    v_room        boolean := true;
    v_expired     compaction.attempts;
BEGIN
    IF p_matched IS NOT TRUE THEN
        IF p_is_target IS NOT TRUE THEN
            claimed := false;
            reason := 'not_eligible';
            RETURN;
        END IF;
        IF NOT compaction.valid_source_hash(p_source_hash)
           OR p_target_hash IS DISTINCT FROM p_source_hash
           OR p_target_ids IS DISTINCT FROM p_source_message_ids THEN
            claimed := false;
            reason := 'source_mismatch';
            RETURN;
        END IF;
    END IF;

    -- The job id alone, here and from the inserts below: at every run a statement's plan
    -- describes each column it returns (a type lookup apiece), and these read or
    -- returned whole rows for one column (1.1% of a claim -> complete cycle's
    -- instructions).
    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;

    IF v_job_id IS NULL THEN
        v_attempt := 1;
    ELSE
        -- Reap this identity: an expired attempt is a failed attempt.
        FOR v_expired IN
            UPDATE compaction.attempts AS a
            SET state = 'failed', reason = 'lease_expired', finished_at = p_now
            WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
              AND a.state = 'running' AND a.lease_expires_at <= p_now
            RETURNING a.*
        LOOP
            PERFORM compaction.release_slot(p_conversation_id, v_expired);
        END LOOP;

        IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                   WHERE s.conversation_id = p_conversation_id AND s.job_id = v_job_id) THEN
            claimed := false;
            reason := 'already_completed';
            job_id := v_job_id;
            RETURN;
        END IF;
        -- The job id is no secret: the running attempt belongs to the
        -- login that claimed it, and only that login can finish or renew it.
        IF EXISTS (SELECT 1 FROM compaction.attempts AS a
                   WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
                     AND a.state = 'running') THEN
            claimed := false;
            reason := 'already_running';
            job_id := v_job_id;
            RETURN;
        END IF;
        SELECT count(*) INTO v_failed
        FROM compaction.attempts AS a
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
        IF v_failed >= 2 THEN
            claimed := false;
            reason := 'attempts_exhausted';
            job_id := v_job_id;
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
          AND ad.lease_expires_at > p_now;
        v_overflow := FOUND;
        IF NOT v_overflow THEN
            PERFORM compaction.lower_high_water(v_max_running, v_high_water, p_now);
        END IF;
    END IF;
    -- Counted only while the overflow lasts. As one condition with NOT v_overflow, the
    -- count was a parameterised subquery that PL/pgSQL planned again at every claim (its
    -- custom plan, with v_overflow false, pruned the count, so a generic plan never won).
    IF v_overflow THEN
        SELECT count(*) < v_max_running INTO v_room
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_high_water AND ad.lease_expires_at > p_now;
    END IF;
    IF v_room THEN
        SELECT ad.slot INTO v_slot
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_max_running
          AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= p_now)
        ORDER BY ad.slot
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
    END IF;
    IF v_slot IS NULL THEN
        claimed := false;
        reason := 'admission_full';
        job_id := v_job_id;
        RETURN;
    END IF;

    -- The unique indexes are the final word. At READ COMMITTED the conversation lock has
    -- already ordered competing claims, so no conflict arises; at REPEATABLE READ a
    -- conflict with a winner this snapshot cannot see is a serialization failure (ON
    -- CONFLICT's rule), never a second running attempt. No subtransaction needed.
    IF v_job_id IS NULL THEN
        INSERT INTO compaction.jobs AS j
            (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
             model, prompt_version, created_at)
        VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                p_source_message_ids, p_source_hash, p_model, p_prompt_version, p_now)
        ON CONFLICT DO NOTHING
        RETURNING j.job_id INTO v_job_id;
    END IF;
    IF v_job_id IS NOT NULL THEN
        -- The attempt belongs to this login from now on (the fence compares).
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at,
             claimed_by, slot)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, p_now, p_lease_expires_at,
                session_user, v_slot)
        ON CONFLICT DO NOTHING;
    END IF;
    IF v_job_id IS NULL OR NOT FOUND THEN
        claimed := false;
        reason := 'already_running';
        job_id := v_job_id;
        RETURN;
    END IF;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = p_conversation_id, holder_job_id = v_job_id,
        holder_attempt = v_attempt, lease_expires_at = p_lease_expires_at
    WHERE ad.slot = v_slot;
    claimed := true;
    reason := 'claimed';
    job_id := v_job_id;
    attempt := v_attempt;
    lease_expires_at := p_lease_expires_at;
END
$$;
COMMENT ON FUNCTION compaction.claim_range(text, text, int, text[], text, text, text, text, timestamptz, timestamptz, boolean, text[], text, boolean) IS
    'Internal: the checks of a claim from not_eligible on, and its writes, for a range already judged, under the conversation''s lock its caller (claim, claim_targets) holds';

CREATE FUNCTION compaction.claim(
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
-- has them planned again (a claim -> complete cycle was measured at less than
-- half its speed after 1,600 cycles on one connection). With sequential scans disabled
-- the first plans are the index plans, and they hold whatever the tables' size; jit off,
-- since the disabled scans' cost would cross jit_above_cost and compile on every call.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_bound        text;  -- what bound_caller_transaction set
    -- caller_now and lease_end are called only when they have
    -- something to check (a given p_now, a lease out of range); each call carries a SET
    -- clause, whose save and restore of the settings cost more than the rule.
    v_now         timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                      ELSE compaction.caller_now(p_now) END;
    v_lease       timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                      THEN v_now + p_lease
                                      ELSE compaction.lease_end(p_lease, v_now) END;
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_is_target   boolean;
    v_answer      record;
    v_settled     record;
    v_job_id      bigint;
    v_matched     boolean := true;  -- as judged before the lock (claim_range's p_matched)
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

    -- The range as it is now, from the derived state (no message text read): the pair
    -- count decides whether it is a target, the stored ids and hash whether it matches.
    -- Read before the conversation's lock: the lock orders the engine's
    -- writers of the conversation, and none of them changes its history, so the answer
    -- is the same either side of it; judged from the views (Citus, an untracked source)
    -- it is most of a claim's time, which the conversation's other writers no longer wait
    -- for. With the derived state in use, current_range's read is made here (as
    -- range_replies does): the call of a set-returning definer function cost
    -- more than its one statement.
    -- The identity's job is read in the same statement, with the same snapshot, and
    -- claim_settled asked only when there is one: the usual claim, an identity's first,
    -- has none, and claim_settled's call and its own read of the job were 0.7% of a
    -- claim -> complete cycle's instructions. A subquery, not a join: a join's node cost
    -- more than the statement it saved.
    IF compaction.derived_state_serves(p_conversation_id) THEN
        SELECT coalesce((SELECT cs.pair_count::bigint FROM compaction.conversation_state AS cs
                         WHERE cs.conversation_id = p_conversation_id), 0),
               r.source_message_ids, r.source_hash,
               (SELECT j.job_id FROM compaction.jobs AS j
                WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
                  AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
                  AND j.model = p_model AND j.prompt_version = p_prompt_version)
        INTO v_pairs, v_target_ids, v_target_hash, v_job_id
        FROM (SELECT 1) AS one
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
    ELSE
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
        -- A statement of its own: under Citus a read of the shards cannot call an engine
        -- reader (current_range).
        SELECT j.job_id INTO v_job_id
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
          AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
          AND j.model = p_model AND j.prompt_version = p_prompt_version;
    END IF;
    v_is_target := compaction.is_target(p_from_pair, v_pairs);

    -- A claim the judgement or the committed state already
    -- refuses takes no lock (claim_range answers not_eligible and source_mismatch before
    -- any write; claim_settled the refusals of an identity's state), so no refused call
    -- holds the conversation, whatever its caller's transaction does next.
    IF v_is_target IS NOT TRUE OR NOT compaction.valid_source_hash(p_source_hash)
       OR v_target_hash IS DISTINCT FROM p_source_hash
       OR v_target_ids IS DISTINCT FROM p_source_message_ids THEN
        v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                           p_source_message_ids, p_source_hash, p_model,
                                           p_prompt_version, p_worker, v_now, v_lease,
                                           v_is_target, v_target_ids, v_target_hash);
        RETURN QUERY SELECT false, v_answer.reason, NULL::bigint, NULL::int,
                            NULL::timestamptz;
        RETURN;
    END IF;
    IF v_job_id IS NOT NULL THEN
        v_settled := compaction.claim_settled(p_conversation_id, p_scope, p_from_pair,
                                              p_source_hash, p_model, p_prompt_version, v_now);
        IF v_settled.reason IS NOT NULL THEN
            RETURN QUERY SELECT false, v_settled.reason, v_settled.job_id, NULL::int,
                                NULL::timestamptz;
            RETURN;
        END IF;
    END IF;

    -- From here on the conversation's engine rows are ours until commit: the statement of
    -- lock_conversation, written out here and in fence, where a call per
    -- cycle would cost as much as the row lock itself.
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    v_bound := compaction.bound_caller_transaction();
    -- The one writer under the lock that follows a change of history is an erasure (its
    -- history deleted before it or with it): a conversation with an erasure's tombstone
    -- is judged again, under the lock, so that no claim lands after an erasure on
    -- history it judged before.
    IF EXISTS (SELECT 1 FROM compaction.event_log AS e
               WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
        v_is_target := compaction.is_target(p_from_pair, v_pairs);
        v_matched := false;
    END IF;
    -- An assignment, not a query: a claim -> complete cycle costs 1.0% more
    -- instructions than with the checks written out in claim (a query over the call,
    -- 1.6%).
    v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                       p_source_message_ids, p_source_hash, p_model,
                                       p_prompt_version, p_worker, v_now, v_lease,
                                       v_is_target, v_target_ids, v_target_hash,
                                       v_matched);
    claimed := v_answer.claimed;
    reason := v_answer.reason;
    job_id := v_answer.job_id;
    attempt := v_answer.attempt;
    lease_expires_at := v_answer.lease_expires_at;
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, bound to the calling login, or returns the first refusal reason (see contract §6)';
