-- pycompactor stored logic, section 3d: imports.
--
-- import_summary records a summary made by an earlier system under the same shape rules
-- (29_jobs.sql) and the same immutability (40_immutability.sql); it never requires the
-- source to be current: a stale import is simply never projected.


CREATE FUNCTION compaction.import_summary(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_summary            text,
    p_completed_at       timestamptz)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
DECLARE
    v_job_id     bigint;
    v_summary_id bigint;
    v_problem    text;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_completed_at IS NULL THEN
        RAISE EXCEPTION 'import_summary needs a conversation, a non-empty scope and model, and completed_at'
            USING ERRCODE = 'CP020';
    END IF;
    IF compaction.oversized_identifier(p_conversation_id, p_scope, p_model) IS NOT NULL THEN
        RAISE EXCEPTION '%', compaction.oversized_identifier(p_conversation_id, p_scope, p_model)
            USING ERRCODE = 'CP020';
    END IF;
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN
        RAISE EXCEPTION 'invalid range: from_pair % is not a non-negative multiple of 10', p_from_pair
            USING ERRCODE = 'CP002';
    END IF;
    IF NOT compaction.valid_source_ids(p_source_message_ids) THEN
        RAISE EXCEPTION 'invalid source ids: a range needs exactly 20 distinct non-null message ids'
            USING ERRCODE = 'CP003';
    END IF;
    IF NOT compaction.valid_source_hash(p_source_hash) THEN
        RAISE EXCEPTION 'invalid source hash: expected 64 lowercase hexadecimal characters'
            USING ERRCODE = 'CP004';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM compaction.prompt_versions AS pv
                   WHERE pv.prompt_version = p_prompt_version) THEN
        RAISE EXCEPTION 'unknown prompt version %', p_prompt_version
            USING ERRCODE = 'CP007';
    END IF;
    v_problem := compaction.summary_problem(p_summary);
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid summary: %', v_problem
            USING ERRCODE = 'CP005';
    END IF;

    PERFORM compaction.lock_conversation(p_conversation_id);

    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;
    BEGIN
        IF v_job_id IS NULL THEN
            INSERT INTO compaction.jobs
                (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
                 model, prompt_version, created_at)
            VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                    p_source_message_ids, p_source_hash, p_model, p_prompt_version,
                    p_completed_at)
            RETURNING job_id INTO v_job_id;
        END IF;
        INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
        VALUES (p_conversation_id, v_job_id, NULL, p_summary, p_completed_at)
        RETURNING summary_id INTO v_summary_id;
    EXCEPTION WHEN unique_violation THEN
        RAISE EXCEPTION 'a completed summary already exists for this identity (conversation %, scope %, pairs %-%)',
                p_conversation_id, p_scope, p_from_pair, p_from_pair + 9
            USING ERRCODE = 'CP006';
    END;
    PERFORM compaction.rederive_summary_verdicts(p_conversation_id, '{}', v_summary_id);
    -- Written here, not by a trigger on job_summaries (contract §11); no attempt row records
    -- an import, so the log does.
    INSERT INTO compaction.event_log
        (conversation_id, kind, occurred_at, scope, from_pair, to_pair, job_id,
         model, prompt_version, source_hash, summary_id, summary_chars)
    VALUES (p_conversation_id, 'import', p_completed_at, p_scope, p_from_pair,
            p_from_pair + 9, v_job_id, p_model, p_prompt_version, p_source_hash,
            v_summary_id, pg_catalog.char_length(p_summary));
    RETURN v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.import_summary(text, text, int, text[], text, text, text, text, timestamptz) IS
    'Records a completed summary made by an earlier system (any known prompt version; source need not be current); returns its summary_id';
