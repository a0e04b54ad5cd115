-- pycompactor stored logic, section 3 continued: claims of several ranges of one
-- conversation in one call (claim_targets, claim_next_targets), each range answered as
-- compaction.claim (30_claims.sql) would answer it.

-- Claims of several ranges of one conversation in one call, for a worker
-- with that many model calls free. Each range is answered exactly as compaction.claim
-- would answer it, had the ranges been claimed one after another in the order given, at
-- one instant: the same checks in the contract's order, the same writes, one row per
-- range. The conversation is locked and judged once for the whole batch, where a claim
-- per range judges it each time (from the views, on Citus or an untracked source, that
-- judgement is most of a claim's cost). The first admission_full ends the batch: the
-- ranges after it are not tried and get no row. p_source_message_ids holds one row of
-- ids per range (a two-dimensional array, ranges by ids).
CREATE FUNCTION compaction.claim_targets(
    p_conversation_id    text,
    p_scope              text,
    p_from_pairs         int[],
    p_source_message_ids text[],
    p_source_hashes      text[],
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
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
    v_bound        text;  -- what bound_caller_transaction set
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_lease      timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                     THEN v_now + p_lease
                                     ELSE compaction.lease_end(p_lease, v_now) END;
    v_n          int := coalesce(pg_catalog.cardinality(p_from_pairs), 0);
    v_oversized  text;
    v_accepts    boolean;
    v_refusals   text[] := '{}';
    v_judge      int[] := '{}';
    v_from       int[];
    v_target_ids text[];
    v_settled    text[] := '{}';
    v_settled_job bigint[] := '{}';
    v_open       boolean := false;
    v_locked     boolean := false;
    v_pre        text;
    v_pre_job    bigint;
    v_hashes     text[];
    v_at         int;
    v_reason     text;
    v_answer     record;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    IF v_n = 0 THEN
        RETURN;
    END IF;
    -- A batch is what a worker's free model calls can take: a few ranges, never a
    -- conversation's history held under its lock at once.
    IF v_n > 100 THEN
        RAISE EXCEPTION 'claim_targets takes at most 100 ranges a call, got %', v_n
            USING ERRCODE = 'CP020';
    END IF;
    IF pg_catalog.array_ndims(p_from_pairs) <> 1
       OR pg_catalog.array_ndims(p_source_message_ids) IS DISTINCT FROM 2
       OR pg_catalog.array_length(p_source_message_ids, 1) <> v_n
       OR pg_catalog.array_ndims(p_source_hashes) IS DISTINCT FROM 1
       OR pg_catalog.cardinality(p_source_hashes) <> v_n THEN
        RAISE EXCEPTION 'claim_targets needs, for each of its % ranges, one row of source ids and one hash', v_n
            USING ERRCODE = 'CP020',
                  HINT = 'p_source_message_ids is a two-dimensional array: one row of 20 ids per range.';
    END IF;

    -- The checks before the conversation's lock, per range, in the contract's order.
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    FOR i IN 1 .. v_n LOOP
        v_reason := CASE
            WHEN p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] IS NULL
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] < 0
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] % 10 <> 0
                THEN 'invalid_range'
            WHEN NOT compaction.valid_source_ids(ARRAY(
                     SELECT pg_catalog.unnest(p_source_message_ids[
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])))
                THEN 'invalid_source_ids'
            WHEN v_accepts IS NOT TRUE THEN 'prompt_version_closed'
        END;
        v_refusals := v_refusals || v_reason;
        IF v_reason IS NULL THEN
            v_judge := v_judge || p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        END IF;
    END LOOP;

    IF pg_catalog.cardinality(v_judge) > 0 THEN
        -- One judgement for the batch, before the conversation's lock as in claim: which
        -- of its ranges are targets now, with their current ids (one row of 20 per
        -- target) and hashes. Judged again under the lock where an erasure's tombstone
        -- is (as in claim).
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
        INTO v_from, v_target_ids, v_hashes
        FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        -- The lock only when some range could be claimed, as
        -- far as the judgement and the committed state tell (claim_settled); otherwise
        -- every range is refused without it (a refused claim holds nothing).
        FOR i IN 1 .. v_n LOOP
            v_pre := NULL;
            v_pre_job := NULL;
            v_at := pg_catalog.array_position(
                v_from, p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1]);
            IF v_refusals[i] IS NULL AND v_at IS NOT NULL AND NOT v_open
               AND compaction.valid_source_hash(
                       p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1])
               AND v_hashes[v_at] IS NOT DISTINCT FROM
                       p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1]
               AND ARRAY(SELECT pg_catalog.unnest(v_target_ids[v_at:v_at][:]))
                   IS NOT DISTINCT FROM
                   ARRAY(SELECT pg_catalog.unnest(p_source_message_ids[
                             pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                             pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])) THEN
                SELECT c.reason, c.job_id INTO v_pre, v_pre_job
                FROM compaction.claim_settled(
                    p_conversation_id, p_scope,
                    p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1],
                    p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1],
                    p_model, p_prompt_version, v_now) AS c;
                v_open := v_pre IS NULL;
            END IF;
            v_settled := v_settled || v_pre;
            v_settled_job := v_settled_job || v_pre_job;
        END LOOP;
    END IF;
    IF v_open THEN
        v_locked := true;
        -- The conversation's engine rows are ours until commit (claim's statement).
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        v_bound := compaction.bound_caller_transaction();
        IF EXISTS (SELECT 1 FROM compaction.event_log AS e
                   WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
            SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
            INTO v_from, v_target_ids, v_hashes
            FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        END IF;
    END IF;

    FOR i IN 1 .. v_n LOOP
        IF v_refusals[i] IS NOT NULL THEN
            RETURN QUERY
            SELECT p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1], false,
                   v_refusals[i], NULL::bigint, NULL::int, NULL::timestamptz;
            CONTINUE;
        END IF;
        -- Without the lock: the refusals the committed state gave (claim_range answers
        -- the rest, not_eligible and source_mismatch, before any write).
        IF NOT v_locked AND v_settled[i] IS NOT NULL THEN
            RETURN QUERY
            SELECT p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1], false,
                   v_settled[i], v_settled_job[i], NULL::int, NULL::timestamptz;
            CONTINUE;
        END IF;
        from_pair := p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        v_at := pg_catalog.array_position(v_from, from_pair);
        v_answer := compaction.claim_range(
            p_conversation_id, p_scope, from_pair,
            ARRAY(SELECT pg_catalog.unnest(p_source_message_ids[
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])),
            p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1],
            p_model, p_prompt_version, p_worker, v_now, v_lease,
            v_at IS NOT NULL,
            CASE WHEN v_at IS NOT NULL
                 THEN ARRAY(SELECT pg_catalog.unnest(v_target_ids[v_at:v_at][:])) END,
            v_hashes[v_at]);
        claimed := v_answer.claimed;
        reason := v_answer.reason;
        job_id := v_answer.job_id;
        attempt := v_answer.attempt;
        lease_expires_at := v_answer.lease_expires_at;
        RETURN NEXT;
        -- No slot was free: the rest of the batch would find none either.
        EXIT WHEN reason = 'admission_full';
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_targets(text, text, int[], text[], text[], text, text, text, interval, timestamptz) IS
    'Claims several ranges of one conversation under one lock and one judgement, each answered as compaction.claim would answer it in the order given (one row per range; the first admission_full ends the batch); for a worker with that many model calls free';

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
    v_bound        text;  -- what bound_caller_transaction set
    v_now       timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                    ELSE compaction.caller_now(p_now) END;
    v_lease     timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                    THEN v_now + p_lease
                                    ELSE compaction.lease_end(p_lease, v_now) END;
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
    v_open      boolean;
    v_pre       text;
    v_pre_job   bigint;
    v_settled   text[];
    v_settled_job bigint[];
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
        SELECT pv.accepts_new_jobs INTO v_accepts
        FROM compaction.prompt_versions AS pv
        WHERE pv.prompt_version = p_prompt_version;
        -- The lock only when some target could be claimed, as
        -- far as the committed state tells (claim_settled); otherwise every target tried
        -- is refused without it (a refused claim holds nothing).
        v_open := false;
        v_settled := '{}';
        v_settled_job := '{}';
        FOR k IN 1 .. coalesce(pg_catalog.cardinality(v_from), 0) LOOP
            v_pre := NULL;
            v_pre_job := NULL;
            IF NOT v_done[k] AND NOT v_open AND v_accepts IS TRUE
               AND compaction.valid_source_hash(v_hashes[k])
               AND compaction.valid_source_ids(ARRAY(SELECT pg_catalog.unnest(v_ids[k:k][:]))) THEN
                SELECT c.reason, c.job_id INTO v_pre, v_pre_job
                FROM compaction.claim_settled(p_conversation_id, p_scope, v_from[k],
                                              v_hashes[k], p_model, p_prompt_version,
                                              v_now) AS c;
                v_open := v_pre IS NULL;
            END IF;
            v_settled := v_settled || v_pre;
            v_settled_job := v_settled_job || v_pre_job;
        END LOOP;
        EXIT WHEN NOT v_open;
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        v_bound := compaction.bound_caller_transaction();
        v_locked := true;
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
            ELSIF NOT v_locked AND v_settled[k] IS NOT NULL THEN
                -- The refusal the committed state gave, without the lock.
                claimed := false;
                reason := v_settled[k];
                job_id := v_settled_job[k];
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
