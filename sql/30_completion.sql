-- pycompactor stored logic, section 3 continued: the end of an attempt (contract §6).
-- Owns the reported statistics (attempt_stats), and complete, fail and heartbeat, each
-- fenced first (fence, 30_fencing.sql).

-- complete()'s p_stats (contract §6): NULL, or an object whose keys are among
-- input_tokens, output_tokens, figures_total, figures_kept, figures_invented,
-- each a non-negative integer
-- (JSON number without fraction or exponent, below 2^31), figures_kept only with
-- figures_total and never above it. Anything else is CP020. The counts come back in the
-- matching columns of an attempts row (the other columns NULL).
CREATE FUNCTION compaction.attempt_stats(p_stats jsonb)
RETURNS compaction.attempts
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_stats compaction.attempts;
    v_key   text;
    v_value jsonb;
BEGIN
    IF p_stats IS NULL THEN
        RETURN v_stats;
    END IF;
    IF pg_catalog.jsonb_typeof(p_stats) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'p_stats must be a JSON object or NULL, got a JSON %',
                pg_catalog.jsonb_typeof(p_stats)
            USING ERRCODE = 'CP020';
    END IF;
    FOR v_key, v_value IN SELECT e.key, e.value FROM pg_catalog.jsonb_each(p_stats) AS e LOOP
        IF v_key NOT IN ('input_tokens', 'output_tokens', 'figures_total', 'figures_kept',
                         'figures_invented') THEN
            RAISE EXCEPTION 'p_stats: unknown key % (known: input_tokens, output_tokens, figures_total, figures_kept, figures_invented)',
                    pg_catalog.quote_literal(pg_catalog.left(v_key, 64))
                USING ERRCODE = 'CP020';
        END IF;
        IF pg_catalog.jsonb_typeof(v_value) IS DISTINCT FROM 'number'
           OR v_value::text !~ '^(0|[1-9][0-9]{0,9})$' THEN
            RAISE EXCEPTION 'p_stats: % must be a non-negative integer', v_key
                USING ERRCODE = 'CP020';
        END IF;
        IF v_value::text::bigint > 2147483647 THEN
            RAISE EXCEPTION 'p_stats: % must be below 2^31', v_key USING ERRCODE = 'CP020';
        END IF;
    END LOOP;
    v_stats.input_tokens := (p_stats ->> 'input_tokens')::int;
    v_stats.output_tokens := (p_stats ->> 'output_tokens')::int;
    v_stats.figures_total := (p_stats ->> 'figures_total')::int;
    v_stats.figures_kept := (p_stats ->> 'figures_kept')::int;
    v_stats.figures_invented := (p_stats ->> 'figures_invented')::int;
    IF v_stats.figures_kept IS NOT NULL
       AND (v_stats.figures_total IS NULL OR v_stats.figures_kept > v_stats.figures_total) THEN
        RAISE EXCEPTION 'p_stats: figures_kept needs figures_total and must not exceed it'
            USING ERRCODE = 'CP020';
    END IF;
    RETURN v_stats;
END
$$;
COMMENT ON FUNCTION compaction.attempt_stats(jsonb) IS
    'Internal: validates complete()''s p_stats (CP020 unless NULL or an object of non-negative integer counts) and returns them as attempt columns';

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
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- caller_now only for a given p_now (as in claim).
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_fenced     record;
    v_attempt    compaction.attempts;
    v_job        compaction.jobs;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- The fields the worker chooses reach the auditor (audit_jobs), who never sees
    -- content: a finish reason is a code (at most 64 bytes:
    -- stop, length, incomplete:max_output_tokens, ...), a response id an id (at most 200
    -- bytes of letters, digits and _ . : -), a tool-call count never negative; anything
    -- else is an error that changes nothing, before the fence. Tested with ltrim rather
    -- than a regular expression, as valid_source_hash is: the usual
    -- 'stop' costs one comparison.
    IF p_finish_reason IS DISTINCT FROM 'stop' AND p_finish_reason IS NOT NULL
       AND NOT (pg_catalog.octet_length(p_finish_reason) <= 64
                AND pg_catalog.ltrim(pg_catalog.left(p_finish_reason, 1),
                                     'abcdefghijklmnopqrstuvwxyz') = ''
                AND pg_catalog.ltrim(p_finish_reason,
                                     'abcdefghijklmnopqrstuvwxyz0123456789_.:-') = '') THEN
        RAISE EXCEPTION 'p_finish_reason must be a code: ^[a-z][a-z0-9_.:-]{0,63}$ (e.g. stop, length), not free text'
            USING ERRCODE = 'CP020';
    END IF;
    IF p_response_id IS NOT NULL
       AND NOT (pg_catalog.octet_length(p_response_id) BETWEEN 1 AND 200
                AND pg_catalog.ltrim(p_response_id,
                        'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-')
                    = '') THEN
        RAISE EXCEPTION 'p_response_id must be an id: 1 to 200 letters, digits or _ . : - (got % bytes of something else)',
                pg_catalog.octet_length(p_response_id)
            USING ERRCODE = 'CP020';
    END IF;
    IF p_tool_call_count < 0 THEN
        RAISE EXCEPTION 'p_tool_call_count must not be negative' USING ERRCODE = 'CP020';
    END IF;
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    -- Without p_stats, v_stats is what attempt_stats answers for NULL: every column NULL.
    IF p_stats IS NOT NULL THEN
        v_stats := compaction.attempt_stats(p_stats);
    END IF;
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
            figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept,
            figures_invented = v_stats.figures_invented
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
    -- The new summary's verdict: the common case, the first summary of
    -- its range in its scope, is written here from the job row fence returned, as
    -- rederive_summary_verdicts' first statement writes it from a read of the job (and
    -- under the same conversation_state row, taken first); that function judges the rest,
    -- where the range already has a verdict. Its call, a definer with two SET clauses, and
    -- its reads of the summary and the job were 2.9% of a claim -> complete cycle's
    -- instructions (docs/benchmarks.md). On Citus (the derived state is kept
    -- there too), rederive_summary_verdicts writes it, in statements Citus keeps on the
    -- conversation's node.
    IF pg_catalog.current_setting('citus.version', true) IS NOT NULL
       AND compaction.engine_distributed() THEN
        PERFORM compaction.rederive_summary_verdicts(v_attempt.conversation_id, '{}',
                                                     v_summary_id);
    ELSE
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (v_attempt.conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT v_attempt.conversation_id, v_summary_id, v_job.scope, v_job.from_pair,
               CASE WHEN NOT coalesce((SELECT pv.projectable
                                       FROM compaction.prompt_versions AS pv
                                       WHERE pv.prompt_version = v_job.prompt_version), false)
                        THEN 'version_not_projectable'
                    WHEN NOT coalesce((SELECT r.source_hash = v_job.source_hash
                                              AND r.source_message_ids = v_job.source_message_ids
                                       FROM compaction.ranges AS r
                                       WHERE r.conversation_id = v_attempt.conversation_id
                                         AND r.from_pair = v_job.from_pair), false)
                        THEN 'stale_source' END
        WHERE NOT EXISTS (SELECT 1 FROM compaction.summary_verdicts AS o
                          WHERE o.conversation_id = v_attempt.conversation_id
                            AND o.from_pair = v_job.from_pair AND o.scope = v_job.scope);
        IF NOT FOUND THEN
            PERFORM compaction.rederive_summary_verdicts(v_attempt.conversation_id, '{}',
                                                         v_summary_id);
        END IF;
    END IF;
    UPDATE compaction.attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = v_now,
        finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
        input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept,
        figures_invented = v_stats.figures_invented
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    -- release_slot's statement, written out: the call of a definer with a
    -- SET clause cost more than the update (1.0% of a cycle's instructions). The slot is
    -- the one fence read (attempts_guard keeps it): the update returns nothing, where
    -- returning the row cost a type lookup per column at every run.
    IF v_attempt.slot IS NOT NULL THEN
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.slot = v_attempt.slot AND ad.holder_conversation_id = v_attempt.conversation_id
          AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    END IF;
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures kept and invented; finish reason a code, response id an id of at most 200 bytes, else CP020): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off or claimed by another login';

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
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                  ELSE compaction.caller_now(p_now) END;
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
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                  ELSE compaction.caller_now(p_now) END;
    v_lease   timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                  THEN v_now + p_lease
                                  ELSE compaction.lease_end(p_lease, v_now) END;
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
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (ending 1 second..1 day from now, else CP023); ok = false if fenced off or claimed by another login (lease_lost)';
