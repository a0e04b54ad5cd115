-- 0048_figures_invented, undone: p_stats without figures_invented, the column dropped.

DROP VIEW compaction.audit_jobs;
DROP FUNCTION compaction.read_audit_jobs();
DROP VIEW compaction.audit_jobs_rows;

CREATE VIEW compaction.audit_jobs_rows AS
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
COMMENT ON VIEW compaction.audit_jobs_rows IS
    'Internal: the body of compaction.audit_jobs (granted to nobody)';

CREATE FUNCTION compaction.read_audit_jobs()
RETURNS TABLE (
        conversation_id text, scope text, from_pair int, to_pair int, job_id bigint,
        source_hash text, model text, prompt_version text, created_at timestamptz,
        attempt int, state text, reason text, worker text, started_at timestamptz,
        lease_expires_at timestamptz, finished_at timestamptz, duration interval,
        finish_reason text, tool_call_count int, response_id text, summary_chars int,
        summary_id bigint, imported boolean, input_tokens int, output_tokens int,
        figures_total int, figures_kept int, claimed_by text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_jobs_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_jobs() IS
    'Internal: the rows of audit_jobs with the owner''s rights (what the view reads on Citus)';

CREATE VIEW compaction.audit_jobs AS SELECT * FROM compaction.audit_jobs_rows;

COMMENT ON VIEW compaction.audit_jobs IS
    'Audit: every job with each attempt (state, reason, worker, lease, duration, finish metadata, token usage and figures kept as reported to complete, NULL when not reported, and the login that claimed it) and imported summaries as state imported; no text';

GRANT SELECT ON compaction.audit_jobs TO compaction_auditor;
GRANT EXECUTE ON FUNCTION compaction.read_audit_jobs() TO compaction_auditor;
CALL compaction.place_audit_views();

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
    -- it), nor the admission slot it took (revision 0026: the slot is freed by that key),
    -- nor its claim event (revision 0027).
    IF OLD.state = 'running'
       AND (NEW.conversation_id, NEW.job_id, NEW.attempt, NEW.worker, NEW.started_at,
            NEW.claimed_by, NEW.slot, NEW.claim_event_id, NEW.claim_recorded_at,
            NEW.claim_xact_id)
           IS NOT DISTINCT FROM
           (OLD.conversation_id, OLD.job_id, OLD.attempt, OLD.worker, OLD.started_at,
            OLD.claimed_by, OLD.slot, OLD.claim_event_id, OLD.claim_recorded_at,
            OLD.claim_xact_id) THEN
        IF NEW.state IN ('completed', 'failed') THEN
            -- The end's event (revision 0027), stamped here so that every way an attempt
            -- ends records it, as an event_log row was written: an id of the log's
            -- sequence, the clock now and this transaction. The guard reads and writes
            -- its own row only (DESIGN §11).
            NEW.finish_event_id := pg_catalog.nextval('compaction.audit_events_event_id_seq');
            NEW.finish_recorded_at := pg_catalog.clock_timestamp();
            NEW.finish_xact_id := pg_catalog.pg_current_xact_id();
            RETURN NEW;
        END IF;
        IF NEW.state = 'running'
           AND (NEW.reason, NEW.finished_at, NEW.finish_reason, NEW.tool_call_count,
                NEW.response_id, NEW.summary_chars, NEW.input_tokens, NEW.output_tokens,
                NEW.figures_total, NEW.figures_kept, NEW.finish_event_id,
                NEW.finish_recorded_at, NEW.finish_xact_id)
               IS NOT DISTINCT FROM
               (OLD.reason, OLD.finished_at, OLD.finish_reason, OLD.tool_call_count,
                OLD.response_id, OLD.summary_chars, OLD.input_tokens, OLD.output_tokens,
                OLD.figures_total, OLD.figures_kept, OLD.finish_event_id,
                OLD.finish_recorded_at, OLD.finish_xact_id) THEN
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'compaction.attempts: only running -> completed | failed may change (job % attempt % is %)',
            OLD.job_id, OLD.attempt, OLD.state
        USING ERRCODE = 'CP011';
END
$$;
COMMENT ON FUNCTION compaction.attempts_guard() IS
    'Trigger: attempts are append-only except running -> completed | failed (stamping the end''s event) and lease renewal (never the claiming login, the slot nor the claim event); DELETE only inside erase_conversation';

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
    -- caller_now only for a given p_now (revision 0045, as in claim).
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_fenced     record;
    v_attempt    compaction.attempts;
    v_job        compaction.jobs;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
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
    -- The new summary's verdict (revision 0045): the common case, the first summary of
    -- its range in its scope, is written here from the job row fence returned, as
    -- rederive_summary_verdicts' first statement writes it from a read of the job (and
    -- under the same conversation_state row, taken first); that function judges the rest,
    -- where the range already has a verdict. Its call, a definer with two SET clauses, and
    -- its reads of the summary and the job were 2.9% of a claim -> complete cycle's
    -- instructions (docs/benchmarks.md). Not on Citus, where no derived state is kept.
    IF pg_catalog.current_setting('citus.version', true) IS NULL
       OR NOT compaction.engine_distributed() THEN
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
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    RETURNING a.* INTO v_attempt;
    -- release_slot's statement, written out (revision 0045): the call of a definer with a
    -- SET clause cost more than the update (1.0% of a cycle's instructions).
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
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off or claimed by another login';

CREATE OR REPLACE FUNCTION compaction.attempt_stats(p_stats jsonb)
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

ALTER TABLE compaction.attempts DROP CONSTRAINT attempts_rules;
DROP FUNCTION compaction.attempt_rules_hold(int, text, text, timestamptz, timestamptz, timestamptz, int, int, int, int, int);

CREATE FUNCTION compaction.attempt_rules_hold(
    p_attempt int, p_state text, p_reason text, p_started_at timestamptz,
    p_lease_expires_at timestamptz, p_finished_at timestamptz, p_input_tokens int,
    p_output_tokens int, p_figures_total int, p_figures_kept int)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
DECLARE
    v_rule text;
BEGIN
    v_rule := CASE
        WHEN (p_attempt OPERATOR(pg_catalog.>=) 1 AND p_attempt OPERATOR(pg_catalog.<=) 2) IS FALSE
            THEN 'attempts_at_most_two'
        WHEN (p_state OPERATOR(pg_catalog.=) ANY (ARRAY['running', 'completed', 'failed'])) IS FALSE
            THEN 'attempts_state_valid'
        WHEN ((p_state OPERATOR(pg_catalog.=) 'running') OPERATOR(pg_catalog.=) (p_finished_at IS NULL)) IS FALSE
            THEN 'attempts_finished_iff_terminal'
        WHEN (CASE p_state
                  WHEN 'running' THEN p_reason IS NULL
                  WHEN 'completed' THEN p_reason OPERATOR(pg_catalog.=) 'completed'
                  ELSE p_reason IS NOT NULL AND p_reason OPERATOR(pg_catalog.<>) ''
              END) IS FALSE
            THEN 'attempts_reason_matches_state'
        WHEN (p_input_tokens OPERATOR(pg_catalog.>=) 0 AND p_output_tokens OPERATOR(pg_catalog.>=) 0
              AND p_figures_total OPERATOR(pg_catalog.>=) 0
              AND p_figures_kept OPERATOR(pg_catalog.>=) 0
              AND p_figures_kept OPERATOR(pg_catalog.<=) p_figures_total
              AND (p_figures_kept IS NULL OR p_figures_total IS NOT NULL)) IS FALSE
            THEN 'attempts_stats_valid'
        WHEN (pg_catalog.isfinite(p_started_at) AND pg_catalog.isfinite(p_lease_expires_at)
              AND (p_finished_at IS NULL
                   OR (pg_catalog.isfinite(p_finished_at)
                       AND p_finished_at OPERATOR(pg_catalog.>=) p_started_at))) IS FALSE
            THEN 'attempts_times_valid'
        WHEN (p_reason OPERATOR(pg_catalog.~) '^[a-z][a-z0-9_]{0,63}$') IS FALSE
            THEN 'attempts_reason_is_code'
    END;
    IF v_rule IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "attempts" violates check constraint "%"', v_rule
            USING ERRCODE = 'check_violation', CONSTRAINT = v_rule, TABLE = 'attempts',
                  SCHEMA = 'compaction';
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.attempt_rules_hold(int, text, text, timestamptz, timestamptz, timestamptz, int, int, int, int) IS
    'Internal: the CHECK attempts_rules; true when every rule of an attempt row holds, else the check_violation (23514) named after the broken rule (attempts_at_most_two, attempts_state_valid, attempts_finished_iff_terminal, attempts_reason_matches_state, attempts_stats_valid, attempts_times_valid, attempts_reason_is_code)';

ALTER TABLE compaction.attempts DROP COLUMN figures_invented;
ALTER TABLE compaction.attempts
    ADD CONSTRAINT attempts_rules CHECK (compaction.attempt_rules_hold(
        attempt, state, reason, started_at, lease_expires_at, finished_at,
        input_tokens, output_tokens, figures_total, figures_kept)) NOT VALID;


CALL compaction.assign_ownership();
