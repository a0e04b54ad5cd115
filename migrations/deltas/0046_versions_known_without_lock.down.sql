-- 0046_versions_known_without_lock, downgrade: the foreign key on jobs.prompt_version
-- again, and jobs_rules without the version.

CREATE FUNCTION compaction.job_rules_hold(
    p_from_pair int, p_to_pair int, p_source_message_ids text[], p_source_hash text,
    p_scope text, p_model text)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
DECLARE
    v_rule text;
BEGIN
    v_rule := CASE
        WHEN (p_model OPERATOR(pg_catalog.<>) '') IS FALSE THEN 'jobs_model_not_empty'
        WHEN (p_from_pair OPERATOR(pg_catalog.>=) 0
              AND (p_from_pair OPERATOR(pg_catalog.%) 10) OPERATOR(pg_catalog.=) 0
              AND p_to_pair OPERATOR(pg_catalog.=) (p_from_pair OPERATOR(pg_catalog.+) 9)) IS FALSE
            THEN 'jobs_range_valid'
        WHEN (p_scope OPERATOR(pg_catalog.<>) '') IS FALSE THEN 'jobs_scope_not_empty'
        WHEN compaction.valid_source_hash(p_source_hash) IS FALSE THEN 'jobs_source_hash_valid'
        WHEN compaction.valid_source_ids(p_source_message_ids) IS FALSE THEN 'jobs_source_ids_valid'
    END;
    IF v_rule IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "jobs" violates check constraint "%"', v_rule
            USING ERRCODE = 'check_violation', CONSTRAINT = v_rule, TABLE = 'jobs',
                  SCHEMA = 'compaction';
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.job_rules_hold(int, int, text[], text, text, text) IS
    'Internal: the CHECK jobs_rules; true when every rule of a jobs row holds, else the check_violation (23514) named after the broken rule (jobs_model_not_empty, jobs_range_valid, jobs_scope_not_empty, jobs_source_hash_valid, jobs_source_ids_valid)';

-- Each ALTER TABLE its own statement, run by EXECUTE, for Citus (as the upgrade). The
-- foreign key is added valid, as it was: a scan of jobs, which every row passes (the
-- CHECK held each to a version of prompt_versions, and none is ever deleted).
DO $$
BEGIN
    EXECUTE 'ALTER TABLE compaction.jobs DROP CONSTRAINT jobs_rules';
    EXECUTE 'ALTER TABLE compaction.jobs ADD CONSTRAINT jobs_rules CHECK ('
            'compaction.job_rules_hold(from_pair, to_pair, source_message_ids, source_hash,'
            ' scope, model)) NOT VALID';
    EXECUTE 'ALTER TABLE compaction.jobs ADD CONSTRAINT jobs_prompt_version_fkey'
            ' FOREIGN KEY (prompt_version) REFERENCES compaction.prompt_versions (prompt_version)';
END
$$;
DROP FUNCTION compaction.job_rules_hold(int, int, text[], text, text, text, text);

CALL compaction.assign_ownership();
