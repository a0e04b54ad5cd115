-- 0040_claims_with_the_targets: compaction.claim_next_targets, a worker's look at a
-- conversation (its targets, as worker_targets answers them) and its first claims (as
-- claim_targets answers them) under one judgement of the conversation, where the worker
-- judged it once to look and again to claim. Judged from the views (Citus, an untracked
-- source) a judgement is most of what a claim costs. Adds a function only.

-- A worker's look at a conversation and its first claims, in one call. The
-- conversation's targets, judged once, each with whether this identity already holds a
-- summary (what worker_targets answers), and up to p_limit claims among those that do
-- not, tried in target order, each answered as compaction.claim would answer it for the
-- ids and hash just judged: a range refused for itself gives its turn to the next, and
-- the first admission_full or prompt_version_closed ends the claims. A worker calls it
-- with its free model calls as p_limit: where it called worker_targets and then
-- claim_targets, the conversation is judged once instead of twice (on Citus and an
-- untracked source, from the views: most of a claim's cost). The targets not tried come
-- back with claimed NULL, with their ids and hash, for claim_targets once model calls
-- are free; with p_limit 0 this is worker_targets, and takes no lock.
CREATE FUNCTION compaction.claim_next_targets(
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

GRANT EXECUTE ON FUNCTION
    compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz)
TO compaction_worker;

CALL compaction.assign_ownership();
