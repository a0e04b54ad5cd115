-- Delta 0004_attempt_stats (frozen once released): token usage and figures kept per
-- attempt (DESIGN.md §6, §8, §10). complete() gains p_stats, validated by the new
-- compaction.attempt_stats and stored in four new columns of compaction.attempts, which
-- compaction.audit_jobs shows; attempts_guard keeps them unchanged on lease renewal.

ALTER TABLE compaction.attempts
    ADD COLUMN input_tokens int,
    ADD COLUMN output_tokens int,
    ADD COLUMN figures_total int,
    ADD COLUMN figures_kept int,
    ADD CONSTRAINT attempts_stats_valid CHECK (
        input_tokens >= 0 AND output_tokens >= 0 AND figures_total >= 0
        AND figures_kept BETWEEN 0 AND figures_total
        AND (figures_kept IS NULL OR figures_total IS NOT NULL));

-- ==== sql/30_claims.sql ====
-- complete()'s p_stats (DESIGN.md §6): NULL, or an object whose keys are among
-- input_tokens, output_tokens, figures_total, figures_kept, each a non-negative integer
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
        IF v_key NOT IN ('input_tokens', 'output_tokens', 'figures_total', 'figures_kept') THEN
            RAISE EXCEPTION 'p_stats: unknown key % (known: input_tokens, output_tokens, figures_total, figures_kept)',
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

DROP FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz);
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

-- ==== sql/40_immutability.sql ====
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
    IF OLD.state = 'running'
       AND (NEW.conversation_id, NEW.job_id, NEW.attempt, NEW.worker, NEW.started_at)
           IS NOT DISTINCT FROM
           (OLD.conversation_id, OLD.job_id, OLD.attempt, OLD.worker, OLD.started_at)
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
    'Trigger: attempts are append-only except running -> completed | failed and lease renewal; DELETE only inside erase_conversation';

-- ==== sql/50_audit.sql ====
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

-- ==== sql/90_roles.sql (0004 changes) ====
CALL compaction.assign_ownership();
GRANT EXECUTE ON FUNCTION
    compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb)
TO compaction_worker;
