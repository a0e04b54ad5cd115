-- 0021_cheaper_checks: two costs every claim -> complete cycle paid for nothing
-- (measured in instructions, docs/benchmarks.md).
--
-- oversized_identifier was never inlined: its body joined a number to text with
-- anytextcat, which is STABLE, and PostgreSQL inlines an IMMUTABLE SQL function only
-- when everything it calls is immutable; every claim parsed and planned it again (7% of
-- the cycle). The number is now cast to text.
--
-- attempts' seven CHECKs were rebuilt from their stored form by each of the two
-- statements per cycle that write an attempt (12% of the cycle). They are one CHECK now,
-- attempts_rules, calling attempt_rules_hold, which raises the check_violation of the
-- broken rule's own name. NOT VALID, as two of the seven were: rows written before
-- revision 0007 may break those two; the other five held for every row (they were
-- validated CHECKs until now), so nothing is re-read.

CREATE OR REPLACE FUNCTION compaction.oversized_identifier(p_conversation_id text, p_scope text,
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
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_conversation_id)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_scope) OPERATOR(pg_catalog.>) 1024
                   THEN 'a scope may be at most 1024 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_scope)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_model) OPERATOR(pg_catalog.>) 256
                   THEN 'a model may be at most 256 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_model)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_worker) OPERATOR(pg_catalog.>) 256
                   THEN 'a worker name may be at most 256 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_worker)::pg_catalog.text
           END
$$;

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

ALTER TABLE compaction.attempts
    DROP CONSTRAINT attempts_at_most_two,
    DROP CONSTRAINT attempts_state_valid,
    DROP CONSTRAINT attempts_finished_iff_terminal,
    DROP CONSTRAINT attempts_reason_matches_state,
    DROP CONSTRAINT attempts_stats_valid,
    DROP CONSTRAINT attempts_times_valid,
    DROP CONSTRAINT attempts_reason_is_code,
    ADD CONSTRAINT attempts_rules CHECK (compaction.attempt_rules_hold(
        attempt, state, reason, started_at, lease_expires_at, finished_at,
        input_tokens, output_tokens, figures_total, figures_kept)) NOT VALID;

CALL compaction.assign_ownership();
