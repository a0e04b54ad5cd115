-- 0046_versions_known_without_lock: a claim no longer locks its prompt version's row
-- (issue 32). The foreign key jobs_prompt_version_fkey locked the version's row of
-- compaction.prompt_versions FOR KEY SHARE at every claim and import, and concurrent
-- claims all lock the same row, so each overlap made a MultiXact. The CHECK jobs_rules
-- (compaction.job_rules_hold, now given the version) holds a job's version to the
-- versions it writes out, and raises that key's foreign_key_violation for any other.
-- prompt_versions_guard already refuses deleting a version or changing its key, which is
-- all the key's lock guarded against.

CREATE FUNCTION compaction.job_rules_hold(
    p_from_pair int, p_to_pair int, p_source_message_ids text[], p_source_hash text,
    p_scope text, p_model text, p_prompt_version text)
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
    IF (p_prompt_version OPERATOR(pg_catalog.=) ANY ('{conversation-compaction@1,'
            'conversation-compaction@2,conversation-compaction@3}'::text[])) IS FALSE THEN
        RAISE EXCEPTION 'insert or update on table "jobs" violates foreign key constraint "jobs_prompt_version_fkey"'
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'jobs_prompt_version_fkey',
                  TABLE = 'jobs', SCHEMA = 'compaction',
                  DETAIL = pg_catalog.format(
                      'Key (prompt_version)=(%s) is not present in table "prompt_versions".',
                      p_prompt_version),
                  HINT = 'A prompt version is added by a migration, which writes it into compaction.job_rules_hold too.';
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.job_rules_hold(int, int, text[], text, text, text, text) IS
    'Internal: the CHECK jobs_rules; true when every rule of a jobs row holds, else the check_violation (23514) named after the broken rule (jobs_model_not_empty, jobs_range_valid, jobs_scope_not_empty, jobs_source_hash_valid, jobs_source_ids_valid), or for a version compaction.prompt_versions does not hold the foreign_key_violation (23503) jobs_prompt_version_fkey';

-- Each ALTER TABLE its own statement, run by EXECUTE (Citus: see revision 0045). The new
-- jobs_rules is NOT VALID: every row was checked by the constraints it replaces.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE compaction.jobs DROP CONSTRAINT jobs_rules';
    EXECUTE 'ALTER TABLE compaction.jobs ADD CONSTRAINT jobs_rules CHECK ('
            'compaction.job_rules_hold(from_pair, to_pair, source_message_ids, source_hash,'
            ' scope, model, prompt_version)) NOT VALID';
    EXECUTE 'ALTER TABLE compaction.jobs DROP CONSTRAINT jobs_prompt_version_fkey';
END
$$;
DROP FUNCTION compaction.job_rules_hold(int, int, text[], text, text, text);

CALL compaction.assign_ownership();
