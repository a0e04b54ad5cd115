-- 0014_projection_frame: a projection costs what it includes, not what the history holds
-- (issue 11). compaction.summary_verdicts keeps every completed summary's verdict against
-- the current ranges (re-judged by the tracking paths when they write a range, and by
-- complete and import_summary); compaction.projection_frame reads the newest pairs'
-- metadata and every verdict in one statement. verify_conversation checks the verdicts,
-- rederive_conversation rebuilds them, erase_conversation removes them.

-- Revision 0014: every completed summary's verdict as projection_frame reads it, kept
-- with the ranges it depends on (re-judged whenever a range is written, and when a summary
-- of its range completes or is imported), so a projection reads one index entry per
-- summary instead of comparing every summary's 20 ids and hash with its range.
CREATE TABLE compaction.summary_verdicts (
    conversation_id text NOT NULL,
    summary_id      bigint NOT NULL,
    scope           text NOT NULL,
    from_pair       int NOT NULL,
    -- NULL: the summary its range uses in its scope (projectable, source current, and
    -- preferred among such); else the first reason of DESIGN §9 that applies.
    reason          text,
    CONSTRAINT summary_verdicts_pkey PRIMARY KEY (conversation_id, summary_id),
    CONSTRAINT summary_verdicts_reason_valid
        CHECK (reason IN ('version_not_projectable', 'stale_source', 'superseded'))
);
COMMENT ON TABLE compaction.summary_verdicts IS
    'Derived state: every completed summary''s verdict against the current ranges (reason NULL for the one each range uses in its scope, else version_not_projectable, stale_source or superseded)';
-- A projection reads a conversation's verdicts in (from_pair, summary_id) order for one
-- scope; re-judging finds a range's summaries by from_pair.
CREATE INDEX summary_verdicts_range_idx
    ON compaction.summary_verdicts (conversation_id, from_pair, scope, summary_id) INCLUDE (reason);
CREATE UNIQUE INDEX summary_verdicts_one_chosen
    ON compaction.summary_verdicts (conversation_id, scope, from_pair) WHERE reason IS NULL;

CREATE TRIGGER summary_verdicts_truncate_guard
    BEFORE TRUNCATE ON compaction.summary_verdicts
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.truncate_guard();
ALTER TABLE compaction.summary_verdicts ENABLE ALWAYS TRIGGER summary_verdicts_truncate_guard;

CREATE FUNCTION compaction.judge_summaries(p_conversation_id text, p_summary_ids bigint[])
RETURNS TABLE (summary_id bigint, scope text, from_pair int, reason text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH stored AS (
        SELECT js.summary_id, j.scope, j.from_pair, js.completed_at,
               coalesce(v.projectable, false) AS projectable,
               -- The version's number after '@', higher preferred; -1 without one.
               coalesce(pg_catalog.substring(j.prompt_version, '@([0-9]{1,9})$')::int, -1)
                   AS version_rank,
               -- Current: the range exists now with exactly the stored ids and hash.
               coalesce(r.source_hash = j.source_hash
                        AND r.source_message_ids = j.source_message_ids, false) AS current
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = j.prompt_version
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = j.from_pair
        WHERE js.conversation_id = p_conversation_id
          AND (p_summary_ids IS NULL OR js.summary_id = ANY (p_summary_ids))
    ), judged AS (
        SELECT s.summary_id, s.scope, s.from_pair, s.version_rank, s.completed_at,
               CASE WHEN NOT s.projectable THEN 'version_not_projectable'
                    WHEN NOT s.current THEN 'stale_source' END AS reason
        FROM stored AS s
    )
    SELECT j.summary_id, j.scope, j.from_pair,
           CASE WHEN j.reason IS NULL
                     AND pg_catalog.row_number() OVER (
                             PARTITION BY j.scope, j.from_pair, j.reason IS NULL
                             ORDER BY j.version_rank DESC, j.completed_at DESC,
                                      j.summary_id DESC) > 1
                THEN 'superseded' ELSE j.reason END
    FROM judged AS j;
END
$$;
COMMENT ON FUNCTION compaction.judge_summaries(text, bigint[]) IS
    'Internal: the verdict on each named summary of a conversation (every summary when NULL) against the derived ranges: NULL for the one its range uses in its scope, else version_not_projectable, stale_source or superseded (DESIGN §9, in that order); name every summary of a range together';

CREATE FUNCTION compaction.rederive_summary_verdicts(
    p_conversation_id text, p_from_pairs int[], p_new_summary_id bigint DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_from_pairs int[] := p_from_pairs;
    v_from       int;
    v_ids        bigint[];
    v_scopes     text[];
    v_froms      int[];
    v_reasons    text[];
BEGIN
    IF p_new_summary_id IS NOT NULL THEN
        -- complete and import_summary write derived state here: like the tracking paths,
        -- they take the conversation's conversation_state row first (sql/25_tracking.sql),
        -- so a source write that re-judges the same range waits for this transaction and
        -- then sees its summary, or this one waits and then judges the range as written.
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (p_conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        -- The common case, in one statement: the first summary of its range in its scope
        -- has no other to be preferred to, so its verdict is judge_summaries' first two
        -- rules alone (written here again; verify_conversation compares the result with
        -- judge_summaries).
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT p_conversation_id, js.summary_id, j.scope, j.from_pair,
               CASE WHEN NOT coalesce(pv.projectable, false) THEN 'version_not_projectable'
                    WHEN NOT coalesce(r.source_hash = j.source_hash
                                      AND r.source_message_ids = j.source_message_ids, false)
                        THEN 'stale_source' END
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        LEFT JOIN compaction.prompt_versions AS pv ON pv.prompt_version = j.prompt_version
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = j.from_pair
        WHERE js.conversation_id = p_conversation_id AND js.summary_id = p_new_summary_id
          AND NOT EXISTS (SELECT 1 FROM compaction.summary_verdicts AS o
                          WHERE o.conversation_id = p_conversation_id
                            AND o.from_pair = j.from_pair AND o.scope = j.scope);
        IF FOUND THEN
            RETURN;
        END IF;
        -- Provisional, so the judgment below finds it with its range's other summaries.
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT p_conversation_id, js.summary_id, j.scope, j.from_pair, 'stale_source'
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        WHERE js.conversation_id = p_conversation_id AND js.summary_id = p_new_summary_id
        RETURNING v.from_pair INTO v_from;
        v_from_pairs := coalesce(v_from_pairs, '{}') || v_from;
    END IF;
    IF v_from_pairs IS NULL THEN
        DELETE FROM compaction.summary_verdicts AS v WHERE v.conversation_id = p_conversation_id;
    ELSE
        SELECT pg_catalog.array_agg(v.summary_id) INTO v_ids
        FROM compaction.summary_verdicts AS v
        WHERE v.conversation_id = p_conversation_id AND v.from_pair = ANY (v_from_pairs);
        IF v_ids IS NULL THEN
            RETURN;  -- no summary of those ranges: nothing to judge (the common case)
        END IF;
        DELETE FROM compaction.summary_verdicts AS v
        WHERE v.conversation_id = p_conversation_id AND v.summary_id = ANY (v_ids);
    END IF;
    -- The judgment first, then the rows: one statement each (DESIGN §11).
    SELECT pg_catalog.array_agg(j.summary_id), pg_catalog.array_agg(j.scope),
           pg_catalog.array_agg(j.from_pair), pg_catalog.array_agg(j.reason)
    INTO v_ids, v_scopes, v_froms, v_reasons
    FROM compaction.judge_summaries(p_conversation_id, v_ids) AS j;
    INSERT INTO compaction.summary_verdicts (conversation_id, summary_id, scope, from_pair, reason)
    SELECT p_conversation_id, u.summary_id, u.scope, u.from_pair, u.reason
    FROM ROWS FROM (pg_catalog.unnest(v_ids), pg_catalog.unnest(v_scopes),
                    pg_catalog.unnest(v_froms), pg_catalog.unnest(v_reasons))
         AS u (summary_id, scope, from_pair, reason);
END
$$;
COMMENT ON FUNCTION compaction.rederive_summary_verdicts(text, int[], bigint) IS
    'Internal: re-judges the summaries of the listed ranges of a conversation (every summary when NULL) into compaction.summary_verdicts, first adding p_new_summary_id''s row when given';

CREATE FUNCTION compaction.projection_frame(p_conversation_id text, p_scope text, p_pairs int)
RETURNS TABLE (
    derived               boolean,
    pair_count            int,
    first_pair            int,
    user_message_ids      text[],
    assistant_message_ids text[],
    user_bytes            int[],
    assistant_bytes       int[],
    summary_ids           bigint[],
    summary_from_pairs    int[],
    summary_reasons       text[],
    summary_bytes         int[]
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One plan for every call: the statements are lookups by key whatever the conversation,
-- and planning them afresh cost more than running them.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_count int;
    v_first int;
BEGIN
    IF p_pairs IS NULL OR p_pairs < 0 THEN
        RAISE EXCEPTION 'p_pairs must be 0 or more, got %', p_pairs USING ERRCODE = 'CP020';
    END IF;
    IF NOT compaction.derived_state_current() THEN
        RETURN QUERY SELECT false, NULL::int, NULL::int, NULL::text[], NULL::text[],
                            NULL::int[], NULL::int[], NULL::bigint[], NULL::int[],
                            NULL::text[], NULL::int[];
        RETURN;
    END IF;
    SELECT cs.pair_count INTO v_count
    FROM compaction.conversation_state AS cs
    WHERE cs.conversation_id = p_conversation_id;
    v_count := coalesce(v_count, 0);
    v_first := greatest(0, v_count - p_pairs);
    v_first := v_first - v_first % 10;
    RETURN QUERY
    WITH suffix AS (
        SELECT pg_catalog.array_agg(p.user_message_id ORDER BY p.pair_index) AS users,
               pg_catalog.array_agg(p.assistant_message_id ORDER BY p.pair_index) AS assistants,
               pg_catalog.array_agg(p.user_bytes ORDER BY p.pair_index) AS user_sizes,
               pg_catalog.array_agg(p.assistant_bytes ORDER BY p.pair_index) AS assistant_sizes
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id AND p.pair_index >= v_first
    ), verdicts AS (
        -- One sort for the four arrays: they take the rows in the subquery's order (an
        -- ORDER BY in each aggregate sorted them four times, the most costly part of the
        -- call on a long conversation). The driver checks the order all the same.
        SELECT pg_catalog.array_agg(o.summary_id) AS ids,
               pg_catalog.array_agg(o.from_pair) AS froms,
               pg_catalog.array_agg(o.reason) AS reasons,
               pg_catalog.array_agg(o.bytes) AS sizes
        FROM (SELECT v.summary_id, v.from_pair, v.reason,
                     CASE WHEN v.reason IS NULL AND v.from_pair >= v_first THEN
                         (SELECT pg_catalog.octet_length(js.summary)
                          FROM compaction.job_summaries AS js
                          WHERE js.conversation_id = p_conversation_id
                            AND js.summary_id = v.summary_id) END AS bytes
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
              ORDER BY v.from_pair, v.summary_id) AS o
    )
    SELECT true, v_count, v_first,
           coalesce(x.users, '{}'), coalesce(x.assistants, '{}'),
           coalesce(x.user_sizes, '{}'), coalesce(x.assistant_sizes, '{}'),
           coalesce(y.ids, '{}'), coalesce(y.froms, '{}'), coalesce(y.reasons, '{}'),
           coalesce(y.sizes, '{}')
    FROM suffix AS x CROSS JOIN verdicts AS y;
END
$$;
COMMENT ON FUNCTION compaction.projection_frame(text, text, int) IS
    'What a projection plans from while the derived state is in use, in one row: the pair count, the metadata of the newest p_pairs pairs (from first_pair, whole ranges; no text), and every summary of the conversation and scope with its reason (version_not_projectable, stale_source, superseded; NULL for the one chosen per range) and, for the chosen ones the pairs reach, its UTF-8 byte length; derived = false (nothing else) when the derived state is not in use';

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
AS $$
#variable_conflict use_column
DECLARE
    v_now        timestamptz := compaction.caller_now(p_now);
    v_attempt    compaction.attempts;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    v_stats := compaction.attempt_stats(p_stats);
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
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
          AND a.attempt = p_attempt;
        PERFORM compaction.record_attempt_change(v_attempt.conversation_id, p_job_id, p_attempt);
        RETURN QUERY SELECT false, v_problem, NULL::bigint;
        RETURN;
    END IF;

    INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
    VALUES (v_attempt.conversation_id, p_job_id, p_attempt, p_summary, v_now)
    RETURNING summary_id INTO v_summary_id;
    PERFORM compaction.rederive_summary_verdicts(v_attempt.conversation_id, '{}', v_summary_id);
    UPDATE compaction.attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = v_now,
        finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
        input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    PERFORM compaction.record_attempt_change(v_attempt.conversation_id, p_job_id, p_attempt);
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off';

CREATE OR REPLACE FUNCTION compaction.import_summary(
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
    -- Written here, not by a trigger on job_summaries (DESIGN §11).
    INSERT INTO compaction.audit_events
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

CREATE OR REPLACE FUNCTION compaction.rederive_runs(
    p_conversation_id text, p_run_ids text[], p_pair_count int)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_fresh compaction.pairs[];
    v_stale compaction.pairs[];
    v_last  text;
    v_after boolean;
    v_new   int;
BEGIN
    -- In one statement: the pairs these runs form now (pair_index is set below), the
    -- rows they had, and whether every new pair comes after the last pair.
    WITH fresh AS (
        SELECT j.run_id, j.user_seq, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes
        FROM compaction.judge_runs(p_conversation_id, p_run_ids) AS j
        WHERE j.reason IS NULL
    )
    SELECT (SELECT coalesce(array_agg(ROW(p_conversation_id, f.run_id, 0, f.user_seq,
                                          f.user_message_id, f.user_bytes,
                                          f.assistant_message_id,
                                          f.assistant_bytes)::compaction.pairs), '{}')
            FROM fresh AS f),
           (SELECT coalesce(array_agg(p), '{}')
            FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id AND p.run_id = ANY (p_run_ids)),
           l.user_message_id,
           NOT EXISTS (SELECT 1 FROM fresh AS f
                       WHERE NOT CASE WHEN l.user_seq IS NULL THEN
                                          f.user_seq IS NULL
                                          AND f.user_message_id > l.user_message_id
                                      ELSE f.user_seq IS NULL OR f.user_seq > l.user_seq
                                           OR (f.user_seq = l.user_seq
                                               AND f.user_message_id > l.user_message_id)
                                 END)
    INTO v_fresh, v_stale, v_last, v_after
    FROM (SELECT) AS one
    LEFT JOIN compaction.pairs AS l
      ON l.conversation_id = p_conversation_id AND l.pair_index = p_pair_count - 1;
    IF pg_catalog.cardinality(v_fresh) = 0 AND pg_catalog.cardinality(v_stale) = 0 THEN
        RETURN;  -- the runs touched form no pair, before or after: nothing derived changes
    END IF;

    IF pg_catalog.cardinality(v_stale) > 0
       OR NOT (p_pair_count = 0 OR (v_last IS NOT NULL AND v_after)) THEN
        PERFORM compaction.rederive_general(p_conversation_id, p_run_ids, v_fresh, v_stale,
                                            p_pair_count);
        RETURN;
    END IF;

    -- Appending.
    v_new := p_pair_count + pg_catalog.cardinality(v_fresh);
    WITH added AS (
        INSERT INTO compaction.pairs
            (conversation_id, run_id, pair_index, user_seq, user_message_id, user_bytes,
             assistant_message_id, assistant_bytes)
        SELECT p_conversation_id, f.run_id,
               p_pair_count + (pg_catalog.row_number() OVER (ORDER BY f.user_seq, f.user_message_id))::int - 1,
               f.user_seq, f.user_message_id, f.user_bytes, f.assistant_message_id,
               f.assistant_bytes
        FROM pg_catalog.unnest(v_fresh) AS f
        RETURNING 1
    )
    UPDATE compaction.conversation_state AS cs
    SET pair_count = v_new
    WHERE cs.conversation_id = p_conversation_id;
    IF v_new / 10 > p_pair_count / 10 THEN
        -- The ranges the new pairs complete, each hashed from its 20 messages.
        INSERT INTO compaction.ranges AS r
            (conversation_id, from_pair, source_message_ids, source_hash)
        SELECT p_conversation_id, w.from_pair, w.ids, compaction.range_hash(p_conversation_id, w.ids)
        FROM (SELECT g.from_pair,
                     ARRAY(SELECT u.id
                           FROM compaction.pairs AS p
                           CROSS JOIN LATERAL pg_catalog.unnest(
                               ARRAY[p.user_message_id, p.assistant_message_id])
                               WITH ORDINALITY AS u (id, ord)
                           WHERE p.conversation_id = p_conversation_id
                             AND p.pair_index BETWEEN g.from_pair AND g.from_pair + 9
                           ORDER BY p.pair_index, u.ord) AS ids
              FROM pg_catalog.generate_series(p_pair_count / 10 * 10, v_new - 10, 10)
                  AS g (from_pair)) AS w
        ON CONFLICT (conversation_id, from_pair) DO UPDATE
            SET source_message_ids = EXCLUDED.source_message_ids,
                source_hash = EXCLUDED.source_hash;
        -- A range completed again may make its summaries current again.
        PERFORM compaction.rederive_summary_verdicts(
            p_conversation_id,
            ARRAY(SELECT pg_catalog.generate_series(p_pair_count / 10 * 10, v_new - 10, 10)));
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.rederive_runs(text, text[], int) IS
    'Internal: with the conversation_state row held, judges the runs named and appends their new pairs at the end, or hands the change to rederive_general';

CREATE OR REPLACE FUNCTION compaction.rederive_general(
    p_conversation_id text, p_run_ids text[], p_fresh compaction.pairs[],
    p_stale compaction.pairs[], p_pair_count int)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Not the generic plans of its caller: how many pairs follow the changed position decides
-- these plans, and a generic plan scanned the whole conversation's pairs.
SET plan_cache_mode = auto
AS $$
DECLARE
    v_runs     text[] := p_run_ids;
    v_fresh    compaction.pairs[] := p_fresh;
    v_stale    compaction.pairs[] := p_stale;
    v_moved    compaction.pairs[];
    v_from_seq bigint;
    v_from_id  text;
    v_base     int;
    v_count    int := p_pair_count;
    v_ranges   int[];
BEGIN
    -- Sizes and the assistant side change in place; the position (seq, user id) cannot.
    UPDATE compaction.pairs AS p
    SET user_bytes = f.user_bytes,
        assistant_message_id = f.assistant_message_id,
        assistant_bytes = f.assistant_bytes
    FROM pg_catalog.unnest(v_fresh) AS f
    WHERE p.conversation_id = p_conversation_id AND p.run_id = f.run_id
      AND p.user_seq IS NOT DISTINCT FROM f.user_seq AND p.user_message_id = f.user_message_id
      AND (p.user_bytes, p.assistant_message_id, p.assistant_bytes)
          IS DISTINCT FROM (f.user_bytes, f.assistant_message_id, f.assistant_bytes);

    -- The earliest position where a pair appeared, vanished or moved (pair order is
    -- (seq, message_id), NULL seq last, as in judged_pairs).
    WITH diff AS (
        SELECT s.user_seq AS old_seq, s.user_message_id AS old_id,
               f.user_seq AS new_seq, f.user_message_id AS new_id
        FROM pg_catalog.unnest(v_stale) AS s
        FULL JOIN pg_catalog.unnest(v_fresh) AS f ON f.run_id = s.run_id
        WHERE s.run_id IS NULL OR f.run_id IS NULL
           OR s.user_seq IS DISTINCT FROM f.user_seq OR s.user_message_id <> f.user_message_id
    ), keys AS (
        SELECT d.old_seq AS seq, d.old_id AS id FROM diff AS d WHERE d.old_id IS NOT NULL
        UNION ALL
        SELECT d.new_seq, d.new_id FROM diff AS d WHERE d.new_id IS NOT NULL
    )
    SELECT k.seq, k.id INTO v_from_seq, v_from_id
    FROM keys AS k
    ORDER BY k.seq, k.id
    LIMIT 1;

    IF FOUND THEN
        -- Pairs before that position keep their numbers: continue after the last of them.
        IF v_from_seq IS NULL THEN
            SELECT p.pair_index INTO v_base
            FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id
              AND (p.user_seq IS NOT NULL OR p.user_message_id < v_from_id)
            ORDER BY p.user_seq DESC, p.user_message_id DESC
            LIMIT 1;
        ELSE
            SELECT p.pair_index INTO v_base
            FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id
              AND (p.user_seq, p.user_message_id) < (v_from_seq, v_from_id)
            ORDER BY p.user_seq DESC, p.user_message_id DESC
            LIMIT 1;
        END IF;
        v_base := coalesce(v_base + 1, 0);

        -- Everything from that position on is numbered anew (delete, then insert: the
        -- unique pair_index never sees two rows on one number). Two statements, so each
        -- is a range scan of pairs_order_idx.
        IF v_from_seq IS NULL THEN
            WITH gone AS (
                DELETE FROM compaction.pairs AS p
                WHERE p.conversation_id = p_conversation_id
                  AND p.user_seq IS NULL AND p.user_message_id >= v_from_id
                RETURNING p.*
            )
            SELECT coalesce(array_agg(g), '{}') INTO v_moved
            FROM gone AS g
            WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_runs) AS r (run_id)
                              WHERE r.run_id = g.run_id);
        ELSE
            WITH gone AS (
                DELETE FROM compaction.pairs AS p
                WHERE p.conversation_id = p_conversation_id
                  AND ((p.user_seq, p.user_message_id) >= (v_from_seq, v_from_id)
                       OR p.user_seq IS NULL)
                RETURNING p.*
            )
            SELECT coalesce(array_agg(g), '{}') INTO v_moved
            FROM gone AS g
            WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_runs) AS r (run_id)
                              WHERE r.run_id = g.run_id);
        END IF;
        INSERT INTO compaction.pairs AS p
            (conversation_id, run_id, pair_index, user_seq, user_message_id, user_bytes,
             assistant_message_id, assistant_bytes)
        SELECT p_conversation_id, x.run_id,
               v_base + (pg_catalog.row_number() OVER (ORDER BY x.user_seq, x.user_message_id))::int - 1,
               x.user_seq, x.user_message_id, x.user_bytes, x.assistant_message_id,
               x.assistant_bytes
        FROM (SELECT m.* FROM pg_catalog.unnest(v_moved) AS m
              UNION ALL
              SELECT f.* FROM pg_catalog.unnest(v_fresh) AS f
              WHERE NOT EXISTS (SELECT 1 FROM compaction.pairs AS q
                                WHERE q.conversation_id = p_conversation_id
                                  AND q.run_id = f.run_id)) AS x;
        SELECT coalesce(max(p.pair_index) + 1, 0) INTO v_count
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id;
        v_ranges := ARRAY(SELECT pg_catalog.generate_series(v_base / 10 * 10, v_count - 10, 10));
    ELSE
        v_ranges := '{}';
    END IF;

    -- Ranges to look at: those re-numbered above, and those holding a touched pair (its
    -- text may have changed). Only ranges whose ids changed or that hold a touched pair
    -- are hashed again, each from its 20 messages.
    v_ranges := v_ranges || ARRAY(
        SELECT p.pair_index / 10 * 10
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id
          AND p.run_id IN (SELECT f.run_id FROM pg_catalog.unnest(v_fresh) AS f));
    WITH wanted AS (
        SELECT DISTINCT w.from_pair,
               w.from_pair IN (SELECT p.pair_index / 10 * 10
                               FROM compaction.pairs AS p
                               WHERE p.conversation_id = p_conversation_id
                                 AND p.run_id IN (SELECT f.run_id
                                                  FROM pg_catalog.unnest(v_fresh) AS f))
                   AS touched
        FROM pg_catalog.unnest(v_ranges) AS w (from_pair)
        WHERE w.from_pair + 10 <= v_count
    ), present AS (
        SELECT w.from_pair, w.touched,
               ARRAY(SELECT u.id
                     FROM compaction.pairs AS p
                     CROSS JOIN LATERAL pg_catalog.unnest(
                         ARRAY[p.user_message_id, p.assistant_message_id])
                         WITH ORDINALITY AS u (id, ord)
                     WHERE p.conversation_id = p_conversation_id
                       AND p.pair_index BETWEEN w.from_pair AND w.from_pair + 9
                     ORDER BY p.pair_index, u.ord) AS ids
        FROM wanted AS w
    )
    INSERT INTO compaction.ranges AS r (conversation_id, from_pair, source_message_ids, source_hash)
    SELECT p_conversation_id, c.from_pair, c.ids, compaction.range_hash(p_conversation_id, c.ids)
    FROM present AS c
    WHERE c.touched
       OR NOT EXISTS (SELECT 1 FROM compaction.ranges AS o
                      WHERE o.conversation_id = p_conversation_id
                        AND o.from_pair = c.from_pair
                        AND o.source_message_ids = c.ids)
    ON CONFLICT (conversation_id, from_pair) DO UPDATE
        SET source_message_ids = EXCLUDED.source_message_ids,
            source_hash = EXCLUDED.source_hash;
    WITH gone AS (
        DELETE FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair > v_count - 10
        RETURNING r.from_pair
    )
    SELECT v_ranges || coalesce(pg_catalog.array_agg(g.from_pair), '{}') INTO v_ranges
    FROM gone AS g;
    -- The summaries of every range written or deleted above are judged again.
    PERFORM compaction.rederive_summary_verdicts(p_conversation_id, v_ranges);
    UPDATE compaction.conversation_state AS cs
    SET pair_count = v_count
    WHERE cs.conversation_id = p_conversation_id AND cs.pair_count <> v_count;
END
$$;
COMMENT ON FUNCTION compaction.rederive_general(text, text[], compaction.pairs[], compaction.pairs[], int) IS
    'Internal: the general path of rederive (a pair changed, vanished or moved): renumbers from the earliest changed position and re-hashes the ranges affected';

CREATE OR REPLACE FUNCTION compaction.rederive_conversation(p_conversation_id text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    IF p_conversation_id IS NULL THEN
        RAISE EXCEPTION 'rederive_conversation needs a conversation id' USING ERRCODE = 'CP020';
    END IF;
    PERFORM compaction.rederive(p_conversation_id, NULL);
    PERFORM compaction.rederive_summary_verdicts(p_conversation_id, NULL);
END
$$;
COMMENT ON FUNCTION compaction.rederive_conversation(text) IS
    'Repair: re-derives one conversation''s pairs, ranges and summary verdicts from the source views (e.g. after writes with the tracking triggers disabled)';

CREATE OR REPLACE FUNCTION compaction.verify_conversation(p_conversation_id text)
RETURNS TABLE (problem text, detail text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_ids     bigint[];
    v_scopes  text[];
    v_froms   int[];
    v_reasons text[];
BEGIN
    -- Every summary judged now against the derived ranges (checked against the views
    -- below): the verdicts the derived state must hold.
    SELECT pg_catalog.array_agg(j.summary_id), pg_catalog.array_agg(j.scope),
           pg_catalog.array_agg(j.from_pair), pg_catalog.array_agg(j.reason)
    INTO v_ids, v_scopes, v_froms, v_reasons
    FROM compaction.judge_summaries(p_conversation_id, NULL) AS j;
    RETURN QUERY
        WITH judged AS (
            SELECT j.* FROM compaction.judged_pairs(p_conversation_id) AS j
        ), stored AS (
            SELECT p.* FROM compaction.pairs AS p WHERE p.conversation_id = p_conversation_id
        ), judged_ranges AS (
            SELECT g.from_pair, g.ids, compaction.range_hash(p_conversation_id, g.ids) AS hash
            FROM (SELECT j.pair_index / 10 * 10 AS from_pair,
                         ARRAY(SELECT pg_catalog.unnest(array_agg(
                             ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)))
                             AS ids
                  FROM judged AS j
                  GROUP BY j.pair_index / 10 * 10
                  HAVING count(*) = 10) AS g
        ), stored_ranges AS (
            SELECT r.* FROM compaction.ranges AS r WHERE r.conversation_id = p_conversation_id
        ), counts AS (
            SELECT (SELECT count(*) FROM judged) AS judged,
                   (SELECT cs.pair_count FROM compaction.conversation_state AS cs
                    WHERE cs.conversation_id = p_conversation_id) AS stored
        )
        SELECT 'pair_count'::text,
               pg_catalog.format('judged %s pairs, derived state has %s', c.judged,
                                 coalesce(c.stored::text, 'no row'))
        FROM counts AS c
        WHERE c.judged <> coalesce(c.stored, 0)
        UNION ALL
        SELECT CASE WHEN s.run_id IS NULL THEN 'pair_missing'
                    WHEN j.run_id IS NULL THEN 'pair_extra'
                    ELSE 'pair_differs' END,
               pg_catalog.format('run %s: judged %s, derived %s',
                                 coalesce(j.run_id, s.run_id),
                                 CASE WHEN j.run_id IS NULL THEN 'no pair' ELSE pg_catalog.format(
                                     'pair %s (seq %s, user %s %s bytes, assistant %s %s bytes)',
                                     j.pair_index, j.user_seq, j.user_message_id, j.user_bytes,
                                     j.assistant_message_id, j.assistant_bytes) END,
                                 CASE WHEN s.run_id IS NULL THEN 'no pair' ELSE pg_catalog.format(
                                     'pair %s (seq %s, user %s %s bytes, assistant %s %s bytes)',
                                     s.pair_index, s.user_seq, s.user_message_id, s.user_bytes,
                                     s.assistant_message_id, s.assistant_bytes) END)
        FROM judged AS j
        FULL JOIN stored AS s ON s.run_id = j.run_id
        WHERE (j.pair_index, j.user_seq, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes)
              IS DISTINCT FROM
              (s.pair_index, s.user_seq, s.user_message_id, s.user_bytes,
               s.assistant_message_id, s.assistant_bytes)
        UNION ALL
        SELECT CASE WHEN s.from_pair IS NULL THEN 'range_missing'
                    WHEN j.from_pair IS NULL THEN 'range_extra'
                    WHEN j.ids IS DISTINCT FROM s.source_message_ids THEN 'range_ids_differ'
                    ELSE 'range_hash_differs' END,
               pg_catalog.format('pairs %s-%s: judged hash %s, derived hash %s',
                                 coalesce(j.from_pair, s.from_pair),
                                 coalesce(j.from_pair, s.from_pair) + 9,
                                 coalesce(j.hash, 'none'), coalesce(s.source_hash, 'none'))
        FROM judged_ranges AS j
        FULL JOIN stored_ranges AS s ON s.from_pair = j.from_pair
        WHERE (j.ids, j.hash) IS DISTINCT FROM (s.source_message_ids, s.source_hash)
        UNION ALL
        SELECT CASE WHEN s.summary_id IS NULL THEN 'verdict_missing'
                    WHEN j.summary_id IS NULL THEN 'verdict_extra'
                    ELSE 'verdict_differs' END,
               pg_catalog.format('summary %s (scope %s, pairs %s-%s): judged %s, derived %s',
                                 coalesce(j.summary_id, s.summary_id),
                                 coalesce(j.scope, s.scope),
                                 coalesce(j.from_pair, s.from_pair),
                                 coalesce(j.from_pair, s.from_pair) + 9,
                                 CASE WHEN j.summary_id IS NULL THEN 'no summary'
                                      ELSE coalesce(j.reason, 'used') END,
                                 CASE WHEN s.summary_id IS NULL THEN 'no verdict'
                                      ELSE coalesce(s.reason, 'used') END)
        FROM ROWS FROM (pg_catalog.unnest(v_ids), pg_catalog.unnest(v_scopes),
                        pg_catalog.unnest(v_froms), pg_catalog.unnest(v_reasons))
             AS j (summary_id, scope, from_pair, reason)
        FULL JOIN (SELECT v.* FROM compaction.summary_verdicts AS v
                   WHERE v.conversation_id = p_conversation_id) AS s
          ON s.summary_id = j.summary_id
        WHERE (j.scope, j.from_pair, j.reason) IS DISTINCT FROM (s.scope, s.from_pair, s.reason)
        ORDER BY 1, 2;
END
$$;
COMMENT ON FUNCTION compaction.verify_conversation(text) IS
    'Recomputes one conversation from the source views and returns one row per difference from the derived state: pairs, ranges and summary verdicts (no rows: consistent); ids, counts, hashes and reasons only';

CREATE OR REPLACE FUNCTION compaction.erase_conversation(p_conversation_id text, p_reason text)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_jobs      int;
    v_attempts  int;
    v_summaries int;
BEGIN
    IF p_conversation_id IS NULL THEN
        RAISE EXCEPTION 'erase_conversation needs a conversation id' USING ERRCODE = 'CP020';
    END IF;
    -- The tombstone outlives what it erases and the auditor reads it: a code, not text.
    PERFORM compaction.checked_reason(p_reason);
    PERFORM compaction.lock_conversation(p_conversation_id);

    SELECT count(*) INTO v_jobs FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id;
    SELECT count(*) INTO v_attempts FROM compaction.attempts AS a
    WHERE a.conversation_id = p_conversation_id;
    SELECT count(*) INTO v_summaries FROM compaction.job_summaries AS s
    WHERE s.conversation_id = p_conversation_id;

    -- The tombstone comes first. It holds ids, counts, the reason and the time, never
    -- text of the erased rows.
    INSERT INTO compaction.audit_events
        (conversation_id, kind, occurred_at, reason, erased_jobs, erased_attempts, erased_summaries)
    VALUES (p_conversation_id, 'erasure', pg_catalog.now(), p_reason, v_jobs, v_attempts, v_summaries);

    -- The mark the delete guards look for, as SET LOCAL statements: Citus carries those
    -- (and only those) to the nodes that run the deletes, once told to.
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_extension AS e WHERE e.extname = 'citus') THEN
        EXECUTE 'SET LOCAL citus.propagate_set_commands = local';
    END IF;
    EXECUTE pg_catalog.format('SET LOCAL compaction.erasing = %L', p_conversation_id);
    DELETE FROM compaction.job_summaries AS s WHERE s.conversation_id = p_conversation_id;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
        lease_expires_at = NULL
    WHERE ad.holder_conversation_id = p_conversation_id;
    DELETE FROM compaction.attempts AS a WHERE a.conversation_id = p_conversation_id;
    DELETE FROM compaction.jobs AS j WHERE j.conversation_id = p_conversation_id;
    DELETE FROM compaction.queue AS q WHERE q.conversation_id = p_conversation_id;
    DELETE FROM compaction.summary_verdicts AS v WHERE v.conversation_id = p_conversation_id;
    -- The rest of the caller's transaction is guarded again.
    EXECUTE 'SET LOCAL compaction.erasing = ''''';
    RETURN v_summaries;
END
$$;
COMMENT ON FUNCTION compaction.erase_conversation(text, text) IS
    'Erasure requests (owner/admin only): removes a conversation''s jobs, attempts, summaries and queue entries, never source rows; leaves a content-free tombstone event (p_reason a code, else CP024); returns summaries removed';

CREATE OR REPLACE FUNCTION compaction.citus_tables()
RETURNS TABLE (table_name text, placement text, step int)
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    -- In distribution order: reference tables first (distributed tables refer to them),
    -- then each distributed table after the tables its foreign keys name.
    VALUES ('compaction.settings', 'reference', 1),
           ('compaction.prompt_versions', 'reference', 2),
           ('compaction.admission', 'reference', 3),
           ('compaction.source_tracking', 'reference', 4),
           ('compaction_source.conversations', 'distributed', 5),
           ('compaction_source.runs', 'distributed', 6),
           ('compaction_source.messages', 'distributed', 7),
           ('compaction.jobs', 'distributed', 8),
           ('compaction.attempts', 'distributed', 9),
           ('compaction.job_summaries', 'distributed', 10),
           ('compaction.audit_events', 'distributed', 11),
           ('compaction.queue', 'distributed', 12),
           ('compaction.conversation_state', 'distributed', 13),
           ('compaction.pairs', 'distributed', 14),
           ('compaction.ranges', 'distributed', 15),
           ('compaction.summary_verdicts', 'distributed', 16)
$$;
COMMENT ON FUNCTION compaction.citus_tables() IS
    'Every engine table with its Citus placement (distributed by conversation_id, co-located, or reference) in the order compaction.distribute_on_citus() applies them';

CALL compaction.assign_ownership();
REVOKE TRUNCATE ON compaction.summary_verdicts FROM compaction_owner;
GRANT EXECUTE ON FUNCTION compaction.projection_frame(text, text, int)
TO compaction_worker, compaction_reader;

-- Every summary stored so far gets its verdict (the rebuild that `pycompactor migrate`
-- runs at head does it again, with the rest of the derived state).
DO $$
DECLARE
    v_conversation text;
BEGIN
    FOR v_conversation IN
        SELECT DISTINCT js.conversation_id FROM compaction.job_summaries AS js
    LOOP
        PERFORM compaction.rederive_summary_verdicts(v_conversation, NULL);
    END LOOP;
END
$$;
