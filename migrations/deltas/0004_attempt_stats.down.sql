-- Delta 0004_attempt_stats, downgrade: restores the 0003_projection state (complete
-- without p_stats, audit_jobs and attempts without the four columns).

DROP VIEW compaction.audit_jobs;
CREATE VIEW compaction.audit_jobs AS
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
           false AS imported
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
           true
    FROM compaction.jobs AS j
    JOIN compaction.job_summaries AS s
      ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
    WHERE s.attempt IS NULL;
COMMENT ON VIEW compaction.audit_jobs IS
    'Audit: every job with each attempt (state, reason, worker, lease, duration, finish metadata) and imported summaries as state imported; no text';

GRANT SELECT ON compaction.audit_jobs TO compaction_auditor;

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
                     NEW.response_id, NEW.summary_chars)
                    IS NOT DISTINCT FROM
                    (OLD.reason, OLD.finished_at, OLD.finish_reason, OLD.tool_call_count,
                     OLD.response_id, OLD.summary_chars))) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'compaction.attempts: only running -> completed | failed may change (job % attempt % is %)',
            OLD.job_id, OLD.attempt, OLD.state
        USING ERRCODE = 'CP011';
END
$$;
COMMENT ON FUNCTION compaction.attempts_guard() IS
    'Trigger: attempts are append-only except running -> completed | failed and lease renewal; DELETE only inside erase_conversation';

DROP FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb);
CREATE FUNCTION compaction.complete(
    p_job_id          bigint,
    p_attempt         int,
    p_summary         text,
    p_finish_reason   text,
    p_tool_call_count int,
    p_response_id     text DEFAULT NULL,
    p_now             timestamptz DEFAULT NULL)
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
BEGIN
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
            response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary)
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
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary)
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz) IS
    'Records the result of attempt (job_id, attempt): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off';

DROP FUNCTION compaction.attempt_stats(jsonb);

ALTER TABLE compaction.attempts
    DROP CONSTRAINT attempts_stats_valid,
    DROP COLUMN figures_kept,
    DROP COLUMN figures_total,
    DROP COLUMN output_tokens,
    DROP COLUMN input_tokens;

CALL compaction.assign_ownership();
GRANT EXECUTE ON FUNCTION
    compaction.complete(bigint, int, text, text, int, text, timestamptz)
TO compaction_worker;
