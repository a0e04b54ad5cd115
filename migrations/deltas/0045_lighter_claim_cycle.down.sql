-- 0045_lighter_claim_cycle, downgrade: the worker's calls and fence as revision 0044
-- left them, and the CHECKs of compaction.jobs and compaction.admission as they were.

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
    v_is_target   boolean;
    v_answer      record;
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
    -- Read before the conversation's lock (revision 0038): the lock orders the engine's
    -- writers of the conversation, and none of them changes its history, so the answer
    -- is the same either side of it; judged from the views (Citus, an untracked source)
    -- it is most of a claim's time, which the conversation's other writers no longer wait
    -- for.
    SELECT r.pair_count, r.source_message_ids, r.source_hash
    INTO v_pairs, v_target_ids, v_target_hash
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    v_is_target := compaction.is_target(p_from_pair, v_pairs);

    -- From here on the conversation's engine rows are ours until commit: the statement of
    -- lock_conversation, written out here and in fence (revision 0018), where a call per
    -- cycle would cost as much as the row lock itself.
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
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
    END IF;
    -- An assignment, not a query: a claim -> complete cycle costs 1.0% more
    -- instructions than with the checks written out in claim (a query over the call,
    -- 1.6%).
    v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                       p_source_message_ids, p_source_hash, p_model,
                                       p_prompt_version, p_worker, v_now, v_lease,
                                       v_is_target, v_target_ids, v_target_hash);
    claimed := v_answer.claimed;
    reason := v_answer.reason;
    job_id := v_answer.job_id;
    attempt := v_answer.attempt;
    lease_expires_at := v_answer.lease_expires_at;
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, bound to the calling login, or returns the first refusal reason (see DESIGN §6)';

CREATE OR REPLACE FUNCTION compaction.claim_targets(
    p_conversation_id    text,
    p_scope              text,
    p_from_pairs         int[],
    p_source_message_ids text[],
    p_source_hashes      text[],
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- As claim's: every lookup by key, whatever the tables' statistics when first planned.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now        timestamptz := compaction.caller_now(p_now);
    v_lease      timestamptz := v_now + compaction.checked_lease(p_lease);
    v_n          int := coalesce(pg_catalog.cardinality(p_from_pairs), 0);
    v_oversized  text;
    v_accepts    boolean;
    v_refusals   text[] := '{}';
    v_judge      int[] := '{}';
    v_from       int[];
    v_target_ids text[];
    v_hashes     text[];
    v_at         int;
    v_reason     text;
    v_answer     record;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    IF v_n = 0 THEN
        RETURN;
    END IF;
    -- A batch is what a worker's free model calls can take: a few ranges, never a
    -- conversation's history held under its lock at once.
    IF v_n > 100 THEN
        RAISE EXCEPTION 'claim_targets takes at most 100 ranges a call, got %', v_n
            USING ERRCODE = 'CP020';
    END IF;
    IF pg_catalog.array_ndims(p_from_pairs) <> 1
       OR pg_catalog.array_ndims(p_source_message_ids) IS DISTINCT FROM 2
       OR pg_catalog.array_length(p_source_message_ids, 1) <> v_n
       OR pg_catalog.array_ndims(p_source_hashes) IS DISTINCT FROM 1
       OR pg_catalog.cardinality(p_source_hashes) <> v_n THEN
        RAISE EXCEPTION 'claim_targets needs, for each of its % ranges, one row of source ids and one hash', v_n
            USING ERRCODE = 'CP020',
                  HINT = 'p_source_message_ids is a two-dimensional array: one row of 20 ids per range.';
    END IF;

    -- The checks before the conversation's lock, per range, in the contract's order.
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    FOR i IN 1 .. v_n LOOP
        v_reason := CASE
            WHEN p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] IS NULL
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] < 0
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] % 10 <> 0
                THEN 'invalid_range'
            WHEN NOT compaction.valid_source_ids(ARRAY(
                     SELECT pg_catalog.unnest(p_source_message_ids[
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])))
                THEN 'invalid_source_ids'
            WHEN v_accepts IS NOT TRUE THEN 'prompt_version_closed'
        END;
        v_refusals := v_refusals || v_reason;
        IF v_reason IS NULL THEN
            v_judge := v_judge || p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        END IF;
    END LOOP;

    IF pg_catalog.cardinality(v_judge) > 0 THEN
        -- One judgement for the batch, before the conversation's lock as in claim: which
        -- of its ranges are targets now, with their current ids (one row of 20 per
        -- target) and hashes. Judged again under the lock where an erasure's tombstone
        -- is (as in claim).
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
        INTO v_from, v_target_ids, v_hashes
        FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        -- The conversation's engine rows are ours until commit (claim's statement).
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        IF EXISTS (SELECT 1 FROM compaction.event_log AS e
                   WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
            SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
            INTO v_from, v_target_ids, v_hashes
            FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        END IF;
    END IF;

    FOR i IN 1 .. v_n LOOP
        IF v_refusals[i] IS NOT NULL THEN
            RETURN QUERY
            SELECT p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1], false,
                   v_refusals[i], NULL::bigint, NULL::int, NULL::timestamptz;
            CONTINUE;
        END IF;
        from_pair := p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        v_at := pg_catalog.array_position(v_from, from_pair);
        v_answer := compaction.claim_range(
            p_conversation_id, p_scope, from_pair,
            ARRAY(SELECT pg_catalog.unnest(p_source_message_ids[
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])),
            p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1],
            p_model, p_prompt_version, p_worker, v_now, v_lease,
            v_at IS NOT NULL,
            CASE WHEN v_at IS NOT NULL
                 THEN ARRAY(SELECT pg_catalog.unnest(v_target_ids[v_at:v_at][:])) END,
            v_hashes[v_at]);
        claimed := v_answer.claimed;
        reason := v_answer.reason;
        job_id := v_answer.job_id;
        attempt := v_answer.attempt;
        lease_expires_at := v_answer.lease_expires_at;
        RETURN NEXT;
        -- No slot was free: the rest of the batch would find none either.
        EXIT WHEN reason = 'admission_full';
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_targets(text, text, int[], text[], text[], text, text, text, interval, timestamptz) IS
    'Claims several ranges of one conversation under one lock and one judgement, each answered as compaction.claim would answer it in the order given (one row per range; the first admission_full ends the batch); for a worker with that many model calls free';

CREATE OR REPLACE FUNCTION compaction.claim_next_targets(
    p_conversation_id text,
    p_scope           text,
    p_limit           int,
    p_model           text,
    p_prompt_version  text,
    p_worker          text,
    p_lease           interval DEFAULT '5 minutes',
    p_now             timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean, claimed boolean, reason text, job_id bigint,
               attempt int, lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- As claim's: every lookup by key, whatever the tables' statistics when first planned.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now       timestamptz := compaction.caller_now(p_now);
    v_lease     timestamptz := v_now + compaction.checked_lease(p_lease);
    v_oversized text;
    v_accepts   boolean;
    v_from      int[];
    v_ids       text[];
    v_hashes    text[];
    v_done      boolean[];
    v_claims    int := 0;
    v_ended     boolean := false;
    v_locked    boolean := false;
    v_answer    record;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_next_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    -- As claim_targets: a batch is what a worker's free model calls can take.
    IF p_limit IS NULL OR p_limit < 0 OR p_limit > 100 THEN
        RAISE EXCEPTION 'claim_next_targets claims 0 to 100 ranges a call, got %',
                coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'CP020';
    END IF;

    -- The look is worker_targets' answer, judged before the conversation's lock as in
    -- claim. With a claim to try, the conversation's engine rows are then ours until
    -- commit (claim's statement), and it is looked at again under the lock where an
    -- erasure's tombstone is (as in claim). Nothing to claim, no lock.
    LOOP
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair),
               pg_catalog.array_agg(t.completed ORDER BY t.from_pair)
        INTO v_from, v_ids, v_hashes, v_done
        FROM compaction.worker_targets(p_conversation_id, p_scope, p_model,
                                       p_prompt_version) AS t;
        EXIT WHEN v_locked OR p_limit = 0 OR NOT coalesce(false = ANY (v_done), false);
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        v_locked := true;
        SELECT pv.accepts_new_jobs INTO v_accepts
        FROM compaction.prompt_versions AS pv
        WHERE pv.prompt_version = p_prompt_version;
        EXIT WHEN NOT EXISTS (SELECT 1 FROM compaction.event_log AS e
                              WHERE e.conversation_id = p_conversation_id
                                AND e.kind = 'erasure');
    END LOOP;

    FOR k IN 1 .. coalesce(pg_catalog.cardinality(v_from), 0) LOOP
        from_pair := v_from[k];
        to_pair := v_from[k] + 9;
        source_message_ids := ARRAY(SELECT pg_catalog.unnest(v_ids[k:k][:]));
        source_hash := v_hashes[k];
        completed := v_done[k];
        claimed := NULL;
        reason := NULL;
        job_id := NULL;
        attempt := NULL;
        lease_expires_at := NULL;
        IF NOT completed AND v_claims < p_limit AND NOT v_ended THEN
            -- claim's checks in the contract's order. The range is a target with exactly
            -- these ids and this hash: never not_eligible, and source_mismatch only where
            -- its texts could not be hashed (no valid hash).
            IF NOT compaction.valid_source_ids(source_message_ids) THEN
                claimed := false;
                reason := 'invalid_source_ids';
            ELSIF v_accepts IS NOT TRUE THEN
                claimed := false;
                reason := 'prompt_version_closed';
            ELSE
                v_answer := compaction.claim_range(
                    p_conversation_id, p_scope, from_pair, source_message_ids, source_hash,
                    p_model, p_prompt_version, p_worker, v_now, v_lease,
                    true, source_message_ids, source_hash);
                claimed := v_answer.claimed;
                reason := v_answer.reason;
                job_id := v_answer.job_id;
                attempt := v_answer.attempt;
                lease_expires_at := v_answer.lease_expires_at;
            END IF;
            v_claims := v_claims + claimed::int;
            -- A range refused for itself (another worker's attempt running, attempts
            -- exhausted) gives its turn to the next target; no slot free, or a closed
            -- prompt version, would refuse every target after it too.
            v_ended := reason IN ('admission_full', 'prompt_version_closed');
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz) IS
    'The conversation''s targets, each with whether this identity holds a summary (as worker_targets), and up to p_limit claims among those without one, tried in order, each answered as compaction.claim would answer it (claimed NULL: not tried; the first admission_full or prompt_version_closed ends the claims): a worker''s look and first claims under one judgement';

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
        PERFORM compaction.release_slot(v_attempt.conversation_id, v_attempt);
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
    PERFORM compaction.release_slot(v_attempt.conversation_id, v_attempt);
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off or claimed by another login';

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
        PERFORM compaction.release_slot(job_row.conversation_id, attempt_row);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz, text) IS
    'Internal: locks attempt (job_id, attempt) of the given conversation (or the job''s) and returns it with its job, first failing it (lease_expired) if its lease ran out; attempt_row NULL if unknown or claimed by another login (owner and superusers aside)';

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
    PERFORM compaction.release_slot(v_attempt.conversation_id, v_attempt);
    RETURN QUERY SELECT true, 'failed'::text;
END
$$;
COMMENT ON FUNCTION compaction.fail(bigint, int, text, timestamptz, text) IS
    'Records attempt (job_id, attempt) failed with the worker''s reason code (e.g. http_error, timeout; CP024 unless ^[a-z][a-z0-9_]{0,63}$); lease_lost if fenced off or claimed by another login';

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
    WHERE ad.slot = v_attempt.slot AND ad.holder_conversation_id = v_attempt.conversation_id
      AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    RETURN QUERY SELECT true, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (1 second..1 day, else CP023); ok = false if fenced off or claimed by another login (lease_lost)';
CREATE OR REPLACE FUNCTION compaction.reap(p_now timestamptz DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
DECLARE
    v_now          timestamptz := compaction.caller_now(p_now);
    v_conversation text;
    v_count        int := 0;
BEGIN
    -- In conversation order (a reaper only ever tries a lock, so none waits anyway).
    FOR v_conversation IN
        SELECT DISTINCT a.conversation_id
        FROM compaction.attempts AS a
        WHERE a.state = 'running' AND a.lease_expires_at <= v_now
        ORDER BY 1
    LOOP
        v_count := v_count + compaction.reap_conversation(v_conversation, v_now);
    END LOOP;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION compaction.reap(timestamptz) IS
    'Marks running attempts whose lease expired at p_now failed (lease_expired) and re-queues their conversations; returns how many';

-- Each ALTER TABLE its own statement, run by EXECUTE, for Citus (as the upgrade).
DO $$
BEGIN
    EXECUTE 'ALTER TABLE compaction.admission DROP CONSTRAINT admission_holder_complete';
    EXECUTE 'ALTER TABLE compaction.admission ADD CONSTRAINT admission_holder_complete CHECK ('
            '(holder_conversation_id IS NULL) = (holder_job_id IS NULL)'
            ' AND (holder_conversation_id IS NULL) = (holder_attempt IS NULL)'
            ' AND (holder_conversation_id IS NULL) = (lease_expires_at IS NULL))';
    EXECUTE 'ALTER TABLE compaction.jobs DROP CONSTRAINT jobs_rules';
    EXECUTE 'ALTER TABLE compaction.jobs ADD CONSTRAINT jobs_range_valid'
            ' CHECK (from_pair >= 0 AND from_pair % 10 = 0 AND to_pair = from_pair + 9)';
    EXECUTE 'ALTER TABLE compaction.jobs ADD CONSTRAINT jobs_source_ids_valid'
            ' CHECK (compaction.valid_source_ids(source_message_ids))';
    EXECUTE 'ALTER TABLE compaction.jobs ADD CONSTRAINT jobs_source_hash_valid'
            ' CHECK (compaction.valid_source_hash(source_hash))';
    EXECUTE 'ALTER TABLE compaction.jobs ADD CONSTRAINT jobs_scope_not_empty CHECK (scope <> '''')';
    EXECUTE 'ALTER TABLE compaction.jobs ADD CONSTRAINT jobs_model_not_empty CHECK (model <> '''')';
END
$$;

DROP FUNCTION compaction.job_rules_hold(int, int, text[], text, text, text);

CALL compaction.assign_ownership();
