-- 0021_cheaper_checks, reversed: attempts' seven CHECKs as revision 0020 had them (the
-- five validated ones re-read the table), and oversized_identifier's earlier body.

ALTER TABLE compaction.attempts DROP CONSTRAINT attempts_rules;
DROP FUNCTION compaction.attempt_rules_hold(int, text, text, timestamptz, timestamptz,
                                            timestamptz, int, int, int, int);
ALTER TABLE compaction.attempts
    ADD CONSTRAINT attempts_at_most_two CHECK (attempt BETWEEN 1 AND 2),
    ADD CONSTRAINT attempts_state_valid CHECK (state IN ('running', 'completed', 'failed')),
    ADD CONSTRAINT attempts_finished_iff_terminal CHECK ((state = 'running') = (finished_at IS NULL)),
    ADD CONSTRAINT attempts_reason_matches_state CHECK (
        CASE state
            WHEN 'running' THEN reason IS NULL
            WHEN 'completed' THEN reason = 'completed'
            ELSE reason IS NOT NULL AND reason <> ''
        END),
    ADD CONSTRAINT attempts_stats_valid CHECK (
        input_tokens >= 0 AND output_tokens >= 0 AND figures_total >= 0
        AND figures_kept BETWEEN 0 AND figures_total
        AND (figures_kept IS NULL OR figures_total IS NOT NULL)),
    ADD CONSTRAINT attempts_times_valid CHECK (
        pg_catalog.isfinite(started_at) AND pg_catalog.isfinite(lease_expires_at)
        AND (finished_at IS NULL OR (pg_catalog.isfinite(finished_at) AND finished_at >= started_at)))
        NOT VALID,
    ADD CONSTRAINT attempts_reason_is_code CHECK (reason ~ '^[a-z][a-z0-9_]{0,63}$') NOT VALID;

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

CALL compaction.assign_ownership();
