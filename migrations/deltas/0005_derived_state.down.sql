-- Delta 0005_derived_state, down: back to judging every call from the views (0003).

DROP TRIGGER runs_track_insert ON compaction_source.runs;
DROP TRIGGER runs_track_update ON compaction_source.runs;
DROP TRIGGER runs_track_delete ON compaction_source.runs;
DROP TRIGGER runs_track_truncate ON compaction_source.runs;
DROP TRIGGER messages_track_insert ON compaction_source.messages;
DROP TRIGGER messages_track_update ON compaction_source.messages;
DROP TRIGGER messages_track_delete ON compaction_source.messages;
DROP TRIGGER messages_track_truncate ON compaction_source.messages;
DROP FUNCTION compaction.attach_source_tracking(regclass, text, text);
DROP FUNCTION compaction.detach_source_tracking(regclass);
DROP FUNCTION compaction.track_source_changes();
DROP PROCEDURE compaction.rebuild_derived_state(int);
DROP FUNCTION compaction.stamp_derived_state(text);
DROP FUNCTION compaction.rederive_conversation(text);
DROP FUNCTION compaction.verify_conversation(text);
DROP FUNCTION compaction.rederive(text, text[]);
DROP FUNCTION compaction.worker_targets(text, text, text, text);
DROP FUNCTION compaction.range_replies(text, int, text);
DROP FUNCTION compaction.projection_summaries(text, text);

CREATE OR REPLACE FUNCTION compaction.claim(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now         timestamptz := coalesce(p_now, pg_catalog.now());
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_job_id      bigint;
    v_failed      int;
    v_attempt     int;
    v_max_running int;
    v_in_flight   bigint;
    v_lease       timestamptz;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL OR p_lease IS NULL OR p_lease <= interval '0' THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker, and a positive lease'
            USING ERRCODE = 'CP020';
    END IF;

    -- Checks in the contract's order; the first failing one is the answer.
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN
        RETURN QUERY SELECT false, 'invalid_range'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT compaction.valid_source_ids(p_source_message_ids) THEN
        RETURN QUERY SELECT false, 'invalid_source_ids'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    IF v_accepts IS NOT TRUE THEN
        RETURN QUERY SELECT false, 'prompt_version_closed'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    -- From here on the conversation's engine rows are ours until commit.
    PERFORM compaction.lock_conversation(p_conversation_id);

    -- Whether the range is a target needs only the number of pairs (no text); the hash
    -- is then computed for this one range, reading its 20 messages and nothing else.
    SELECT count(*),
           ARRAY(SELECT pg_catalog.unnest(array_agg(
               ARRAY[i.user_message_id, i.assistant_message_id] ORDER BY i.pair_index)
               FILTER (WHERE i.pair_index BETWEEN p_from_pair AND p_from_pair + 9)))
    INTO v_pairs, v_target_ids
    FROM compaction.indexed_pairs(p_conversation_id) AS i;
    IF NOT compaction.is_target(p_from_pair, v_pairs) THEN
        RETURN QUERY SELECT false, 'not_eligible'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    v_target_hash := compaction.range_hash(v_target_ids);
    IF NOT compaction.valid_source_hash(p_source_hash)
       OR v_target_hash IS DISTINCT FROM p_source_hash
       OR v_target_ids IS DISTINCT FROM p_source_message_ids THEN
        RETURN QUERY SELECT false, 'source_mismatch'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;

    IF v_job_id IS NULL THEN
        v_attempt := 1;
    ELSE
        -- Reap this identity: an expired attempt is a failed attempt.
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = v_now
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
          AND a.state = 'running' AND a.lease_expires_at <= v_now;

        IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                   WHERE s.conversation_id = p_conversation_id AND s.job_id = v_job_id) THEN
            RETURN QUERY SELECT false, 'already_completed'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        IF EXISTS (SELECT 1 FROM compaction.attempts AS a
                   WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
                     AND a.state = 'running') THEN
            RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        SELECT count(*) INTO v_failed
        FROM compaction.attempts AS a
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
        IF v_failed >= 2 THEN
            RETURN QUERY SELECT false, 'attempts_exhausted'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        v_attempt := v_failed + 1;
    END IF;

    -- Admission: taken last, only by a claim about to admit, so refusals never queue on
    -- it; held to commit, so the count below is exact across concurrent claimers.
    PERFORM pg_catalog.pg_advisory_xact_lock(1129316352, 2);
    SELECT s.max_running INTO v_max_running FROM compaction.settings AS s;
    SELECT count(*) INTO v_in_flight
    FROM compaction.admission AS ad
    WHERE ad.lease_expires_at > v_now;
    IF v_in_flight >= coalesce(v_max_running, 8) THEN
        RETURN QUERY SELECT false, 'admission_full'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    v_lease := v_now + p_lease;
    BEGIN
        IF v_job_id IS NULL THEN
            INSERT INTO compaction.jobs
                (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
                 model, prompt_version, created_at)
            VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                    p_source_message_ids, p_source_hash, p_model, p_prompt_version, v_now)
            RETURNING job_id INTO v_job_id;
        END IF;
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, v_now, v_lease);
    EXCEPTION WHEN unique_violation THEN
        -- Only reachable when the caller's snapshot predates a concurrent winner
        -- (REPEATABLE READ): the unique indexes decide, the loser gets a refusal row.
        RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END;
    RETURN QUERY SELECT true, 'claimed'::text, v_job_id, v_attempt, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, or returns the first refusal reason (see DESIGN §6)';

CREATE OR REPLACE FUNCTION compaction.indexed_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_message_id      text,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT (row_number() OVER w - 1)::int,
           j.run_id, j.user_message_id, j.user_bytes, j.assistant_message_id, j.assistant_bytes
    FROM compaction.judge_runs(p_conversation_id) AS j
    WHERE j.reason IS NULL
    WINDOW w AS (ORDER BY j.user_seq, j.user_message_id)
    ORDER BY j.user_seq, j.user_message_id
$$;
COMMENT ON FUNCTION compaction.indexed_pairs(text) IS
    'Eligible pairs of a conversation without their text: pair_index, run and message ids, UTF-8 byte lengths (what planning and projection need before reading any text)';

CREATE OR REPLACE FUNCTION compaction.plan_targets(p_conversation_id text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    WITH pairs AS (
        SELECT i.pair_index / 10 * 10 AS from_pair,
               i.pair_index,
               i.user_message_id,
               i.assistant_message_id,
               count(*) OVER () AS n_pairs
        FROM compaction.indexed_pairs(p_conversation_id) AS i
    ),
    ranges AS (
        SELECT p.from_pair,
               -- unnest of the 10x2 array walks it row by row: [u0, a0, u1, a1, ...]
               ARRAY(SELECT pg_catalog.unnest(array_agg(
                   ARRAY[p.user_message_id, p.assistant_message_id] ORDER BY p.pair_index)))
                   AS source_message_ids
        FROM pairs AS p
        WHERE compaction.is_target(p.from_pair, p.n_pairs)
        GROUP BY p.from_pair
    )
    SELECT r.from_pair::int, (r.from_pair + 9)::int, r.source_message_ids,
           compaction.range_hash(r.source_message_ids)
    FROM ranges AS r
    ORDER BY r.from_pair
$$;
COMMENT ON FUNCTION compaction.plan_targets(text) IS
    'Ranges of 10 pairs the fixed window policy makes targets now (N >= 10k + 30), with their 20 source ids [u0, a0, ..., u9, a9] and source hash';

CREATE OR REPLACE FUNCTION compaction.source_hash(p_conversation_id text, p_from_pair int)
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT CASE WHEN count(*) = 10 THEN
               compaction.range_hash(ARRAY(SELECT pg_catalog.unnest(array_agg(
                   ARRAY[i.user_message_id, i.assistant_message_id] ORDER BY i.pair_index))))
           END
    FROM compaction.indexed_pairs(p_conversation_id) AS i
    WHERE p_from_pair >= 0
      AND p_from_pair % 10 = 0
      AND i.pair_index BETWEEN p_from_pair AND p_from_pair + 9
$$;
COMMENT ON FUNCTION compaction.source_hash(text, int) IS
    'SHA-256 (lowercase hex) binding pairs from_pair..from_pair+9 (ids and texts of both sides); NULL unless all 10 pairs exist and from_pair is a non-negative multiple of 10';

DROP FUNCTION compaction.current_range(text, int);
DROP FUNCTION compaction.judged_pairs(text);
DROP FUNCTION compaction.judge_runs(text, text[]);
CREATE FUNCTION compaction.judge_runs(p_conversation_id text)
RETURNS TABLE (
    run_id               text,
    run_status           text,
    reason               text,
    user_message_id      text,
    user_seq             bigint,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    -- A lateral aggregate per run: the messages of each run are fetched by the run_id
    -- index, so the cost follows this conversation's size, never the table's.
    WITH per_run AS (
        SELECT r.run_id,
               r.status AS run_status,
               m.*
        FROM compaction.source_runs AS r
        CROSS JOIN LATERAL (
            SELECT count(*) FILTER (WHERE sm.role = 'user') AS n_user,
                   count(*) FILTER (WHERE sm.role = 'assistant') AS n_assistant,
                   coalesce(bool_or(sm.conversation_id IS DISTINCT FROM p_conversation_id),
                            false) AS foreign_message,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'user'))[1] AS user_message_id,
                   (array_agg(sm.seq) FILTER (WHERE sm.role = 'user'))[1] AS user_seq,
                   bool_and(compaction.has_content(sm.content)) FILTER (WHERE sm.role = 'user')
                       AS user_has_content,
                   max(pg_catalog.octet_length(sm.content)) FILTER (WHERE sm.role = 'user')
                       AS user_bytes,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_message_id,
                   (array_agg(sm.status) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_status,
                   bool_and(compaction.has_content(sm.content)) FILTER (WHERE sm.role = 'assistant')
                       AS assistant_has_content,
                   max(pg_catalog.octet_length(sm.content)) FILTER (WHERE sm.role = 'assistant')
                       AS assistant_bytes
            FROM compaction.source_messages AS sm
            WHERE sm.run_id = r.run_id
              AND sm.role IN ('user', 'assistant')
        ) AS m
        WHERE r.conversation_id = p_conversation_id
    )
    SELECT p.run_id,
           p.run_status,
           CASE
               WHEN p.run_status IS NULL
                 OR p.run_status NOT IN ('completed', 'partial', 'clarify_pending')
                   THEN 'run_status'
               WHEN p.foreign_message THEN 'foreign_message'
               WHEN p.n_user = 0 THEN 'no_user_message'
               WHEN p.n_user > 1 THEN 'multiple_user_messages'
               WHEN p.n_assistant = 0 THEN 'no_assistant_message'
               WHEN p.n_assistant > 1 THEN 'multiple_assistant_messages'
               WHEN p.assistant_status IS DISTINCT FROM 'completed' THEN 'assistant_not_completed'
               WHEN NOT p.user_has_content THEN 'empty_user_content'
               WHEN NOT p.assistant_has_content THEN 'empty_assistant_content'
           END,
           p.user_message_id,
           p.user_seq,
           p.user_bytes::int,
           p.assistant_message_id,
           p.assistant_bytes::int
    FROM per_run AS p
$$;
COMMENT ON FUNCTION compaction.judge_runs(text) IS
    'Internal: every run of a conversation with the first eligibility rule it breaks (NULL when it forms a pair), its pair''s ids and UTF-8 byte lengths; no text';

CREATE FUNCTION compaction.projection_summaries(p_conversation_id text, p_scope text)
RETURNS TABLE (
    summary_id         bigint,
    from_pair          int,
    to_pair            int,
    source_message_ids text[],
    source_hash        text,
    prompt_version     text,
    projectable        boolean,
    completed_at       timestamptz,
    summary_bytes      int
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.summary_id,
           s.from_pair,
           s.to_pair,
           s.source_message_ids,
           s.source_hash,
           s.prompt_version,
           -- A version missing from prompt_versions is never projected.
           COALESCE(v.projectable, false),
           s.completed_at,
           pg_catalog.octet_length(s.summary)
    FROM compaction.summaries AS s
    LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = s.prompt_version
    WHERE s.conversation_id = p_conversation_id
      AND s.scope = p_scope
    ORDER BY s.from_pair, s.summary_id
$$;
COMMENT ON FUNCTION compaction.projection_summaries(text, text) IS
    'Completed summaries of a conversation and scope without their text: source binding, version, whether it is projectable, completed_at, UTF-8 byte length';

CREATE FUNCTION compaction.projection_range_hashes(
    p_from_pairs int[], p_source_message_ids text[])
RETURNS TABLE (from_pair int, range_hash text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- p_source_message_ids[i:i] is row i, [u0, a0, ..., u9, a9]; unnest flattens it.
    SELECT f.from_pair,
           compaction.range_hash(ARRAY(
               SELECT pg_catalog.unnest(p_source_message_ids[f.ord::int : f.ord::int])))
    FROM pg_catalog.unnest(p_from_pairs) WITH ORDINALITY AS f (from_pair, ord)
    ORDER BY f.ord
$$;
COMMENT ON FUNCTION compaction.projection_range_hashes(int[], text[]) IS
    'Current source hash of each range named by its first pair and its 20 current source ids (row i of the 2-D array), reading only those messages; NULL where the ids are not 20 messages found once each';

DROP FUNCTION compaction.derived_state_status();
DROP FUNCTION compaction.derived_state_current();
DROP FUNCTION compaction.source_stamp();
DROP TABLE compaction.source_tracking;
DROP TABLE compaction.ranges;
DROP TABLE compaction.pairs;
DROP TABLE compaction.conversation_state;

CALL compaction.assign_ownership();

GRANT EXECUTE ON FUNCTION
    compaction.projection_summaries(text, text),
    compaction.projection_range_hashes(int[], text[])
TO compaction_worker, compaction_reader;
