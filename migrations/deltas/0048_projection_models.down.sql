-- 0048_projection_models, downgrade: no model preference; a range's valid summaries
-- ordered by version, then the latest (revision 0047's definitions), verdicts re-judged.

DROP FUNCTION compaction.set_projection_models(text[]);
DROP FUNCTION compaction.projection_models();
DROP FUNCTION compaction.projection_summaries(text, text);
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
    summary_bytes      int,
    source_current     boolean,
    version_rank       int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_derived boolean := compaction.derived_state_current();
    v_ranges  int[];
    v_from    int[];
    v_ids     text[];
    v_hashes  text[];
BEGIN
    -- source_current: the range exists now with exactly the stored ids and hash. From the
    -- derived state that is a comparison per summary. Judged from the views, one call
    -- of current_ranges judges the conversation once for every summarized range
    -- (revision 0023: current_range per range before, a whole judgement each, so a
    -- projection's cost grew with the square of the conversation's length), in a
    -- statement of its own (DESIGN §11: no engine function nested in a query on
    -- distributed tables).
    IF NOT v_derived THEN
        SELECT pg_catalog.array_agg(DISTINCT s.from_pair) INTO v_ranges
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id AND s.scope = p_scope;
    END IF;
    IF v_ranges IS NOT NULL THEN
        SELECT pg_catalog.array_agg(c.from_pair ORDER BY c.from_pair),
               ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(
                   c.source_message_ids ORDER BY c.from_pair))),
               pg_catalog.array_agg(c.source_hash ORDER BY c.from_pair)
        INTO v_from, v_ids, v_hashes
        FROM compaction.current_ranges(p_conversation_id, v_ranges) AS c
        WHERE c.source_hash IS NOT NULL;
    END IF;
    RETURN QUERY
    WITH summaries AS (
        SELECT s.summary_id, s.from_pair, s.to_pair, s.source_message_ids, s.source_hash,
               s.prompt_version, s.completed_at, pg_catalog.octet_length(s.summary) AS bytes
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.scope = p_scope
    ), now_ranges AS (
        SELECT r.from_pair, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        WHERE v_derived AND r.conversation_id = p_conversation_id
          AND r.from_pair IN (SELECT x.from_pair FROM summaries AS x)
        UNION ALL
        SELECT u.from_pair, g.ids, u.source_hash
        FROM ROWS FROM (pg_catalog.unnest(v_from), pg_catalog.unnest(v_hashes))
             WITH ORDINALITY AS u (from_pair, source_hash, k)
        JOIN compaction.id_ranges(v_ids) AS g ON g.k = u.k
        WHERE NOT v_derived
    )
    SELECT s.summary_id,
           s.from_pair,
           s.to_pair,
           s.source_message_ids,
           s.source_hash,
           s.prompt_version,
           -- A version missing from prompt_versions is never projected.
           COALESCE(v.projectable, false),
           s.completed_at,
           s.bytes,
           coalesce(n.source_message_ids = s.source_message_ids
                    AND n.source_hash = s.source_hash, false),
           -- Preference among a range's projectable summaries (revision 0009): the
           -- version's number after '@', higher first; -1 for a version without one.
           coalesce(pg_catalog.substring(s.prompt_version, '@([0-9]{1,9})$')::int, -1)
    FROM summaries AS s
    LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = s.prompt_version
    LEFT JOIN now_ranges AS n ON n.from_pair = s.from_pair
    ORDER BY s.from_pair, s.summary_id;
END
$$;
COMMENT ON FUNCTION compaction.projection_summaries(text, text) IS
    'Completed summaries of a conversation and scope without their text: source binding, version, whether it is projectable, completed_at, UTF-8 byte length, whether its source is current, and the version''s rank (the number after @, -1 without one; higher is preferred)';

CREATE OR REPLACE FUNCTION compaction.judge_summaries(p_conversation_id text, p_summary_ids bigint[])
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

CREATE OR REPLACE FUNCTION compaction.judged_frame(p_conversation_id text, p_scope text)
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
-- Not the generic plans of projection_frame, its caller: the functions this one calls
-- keep the planning they had when the driver called them (on Citus judge_runs has no
-- setting of its own, and Citus plans a query only with its values bound).
SET plan_cache_mode = auto
AS $$
#variable_conflict use_column
DECLARE
    v_users       text[];
    v_assistants  text[];
    v_user_sizes  int[];
    v_sizes       int[];
    -- The scope's summaries, in (from_pair, summary_id) order; v_stored_ids holds their
    -- 20 ids each (n x 20: a stored summary has exactly 20, jobs_valid_source_ids).
    v_summary_ids bigint[];
    v_froms       int[];
    v_stored_ids  text[];
    v_hashes      text[];
    v_projectable boolean[];
    v_ranks       int[];
    v_completed   timestamptz[];
    v_bytes       int[];
    -- Per summary, whether its range exists now with its 20 ids; the ranges to hash.
    v_same_ids    boolean[];
    v_hash_froms  int[];
    v_hash_ids    text[];
    v_now_froms   int[];
    v_now_hashes  text[];
BEGIN
    -- The one judgement: every eligible pair, in order.
    SELECT pg_catalog.array_agg(j.user_message_id), pg_catalog.array_agg(j.assistant_message_id),
           pg_catalog.array_agg(j.user_bytes), pg_catalog.array_agg(j.assistant_bytes)
    INTO v_users, v_assistants, v_user_sizes, v_sizes
    FROM (SELECT q.user_message_id, q.assistant_message_id, q.user_bytes, q.assistant_bytes
          FROM compaction.judged_pairs(p_conversation_id) AS q
          ORDER BY q.pair_index) AS j;
    -- The scope's summaries, what judge_summaries reads of them.
    SELECT pg_catalog.array_agg(s.summary_id), pg_catalog.array_agg(s.from_pair),
           pg_catalog.array_agg(s.source_message_ids), pg_catalog.array_agg(s.source_hash),
           pg_catalog.array_agg(s.projectable), pg_catalog.array_agg(s.version_rank),
           pg_catalog.array_agg(s.completed_at), pg_catalog.array_agg(s.bytes)
    INTO v_summary_ids, v_froms, v_stored_ids, v_hashes, v_projectable, v_ranks,
         v_completed, v_bytes
    FROM (SELECT x.summary_id, x.from_pair, x.source_message_ids, x.source_hash,
                 coalesce(v.projectable, false) AS projectable,
                 -- The version's number after '@', higher preferred; -1 without one.
                 coalesce(pg_catalog.substring(x.prompt_version, '@([0-9]{1,9})$')::int, -1)
                     AS version_rank,
                 x.completed_at, pg_catalog.octet_length(x.summary) AS bytes
          FROM compaction.summaries AS x
          LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = x.prompt_version
          WHERE x.conversation_id = p_conversation_id AND x.scope = p_scope
          ORDER BY x.from_pair, x.summary_id) AS s;
    -- Which summaries' ranges exist now with their ids, and the ranges whose hash decides
    -- a verdict (a projectable summary's, with its ids), each once, with its 20 ids.
    WITH pairs AS (
        SELECT p.k - 1 AS pair_index, p.user_id, p.assistant_id
        FROM ROWS FROM (pg_catalog.unnest(v_users), pg_catalog.unnest(v_assistants))
             WITH ORDINALITY AS p (user_id, assistant_id, k)
    ), ranges AS (
        -- The current ids of the ranges that have summaries, only.
        SELECT (q.pair_index / 10 * 10)::int AS from_pair,
               pg_catalog.array_agg(x.id ORDER BY q.pair_index, x.n) AS ids
        FROM pairs AS q
        CROSS JOIN LATERAL (VALUES (1, q.user_id), (2, q.assistant_id)) AS x (n, id)
        WHERE (q.pair_index / 10 * 10)::int = ANY (v_froms)
        GROUP BY 1
        HAVING count(*) = 20
    ), compared AS MATERIALIZED (
        SELECT u.k, u.from_pair, u.projectable, r.ids,
               coalesce(r.ids = g.ids, false) AS same_ids
        FROM ROWS FROM (pg_catalog.unnest(v_froms), pg_catalog.unnest(v_projectable))
             WITH ORDINALITY AS u (from_pair, projectable, k)
        JOIN compaction.id_ranges(ARRAY(SELECT pg_catalog.unnest(v_stored_ids))) AS g
          ON g.k = u.k
        LEFT JOIN ranges AS r ON r.from_pair = u.from_pair
    ), hashed AS (
        SELECT DISTINCT ON (c.from_pair) c.from_pair, c.ids
        FROM compared AS c
        WHERE c.projectable AND c.same_ids
        ORDER BY c.from_pair
    )
    SELECT (SELECT pg_catalog.array_agg(c.same_ids ORDER BY c.k) FROM compared AS c),
           (SELECT pg_catalog.array_agg(h.from_pair ORDER BY h.from_pair) FROM hashed AS h),
           (SELECT pg_catalog.array_agg(e.id ORDER BY h.from_pair, e.n)
            FROM hashed AS h
            CROSS JOIN LATERAL pg_catalog.unnest(h.ids) WITH ORDINALITY AS e (id, n))
    INTO v_same_ids, v_hash_froms, v_hash_ids;
    SELECT pg_catalog.array_agg(h.from_pair), pg_catalog.array_agg(h.source_hash)
    INTO v_now_froms, v_now_hashes
    FROM compaction.range_hashes(p_conversation_id, v_hash_froms, v_hash_ids) AS h;
    -- The verdicts: judge_summaries' rule, against the ranges judged above.
    RETURN QUERY
    WITH judged AS (
        SELECT u.summary_id, u.from_pair, u.version_rank, u.completed_at, u.bytes,
               CASE WHEN NOT u.projectable THEN 'version_not_projectable'
                    WHEN NOT coalesce(u.same_ids AND h.source_hash = u.source_hash, false)
                        THEN 'stale_source' END AS reason
        FROM ROWS FROM (pg_catalog.unnest(v_summary_ids), pg_catalog.unnest(v_froms),
                        pg_catalog.unnest(v_hashes), pg_catalog.unnest(v_projectable),
                        pg_catalog.unnest(v_ranks), pg_catalog.unnest(v_completed),
                        pg_catalog.unnest(v_bytes), pg_catalog.unnest(v_same_ids))
             AS u (summary_id, from_pair, source_hash, projectable, version_rank,
                   completed_at, bytes, same_ids)
        LEFT JOIN ROWS FROM (pg_catalog.unnest(v_now_froms), pg_catalog.unnest(v_now_hashes))
             AS h (from_pair, source_hash) ON h.from_pair = u.from_pair
    ), verdicts AS (
        SELECT j.summary_id, j.from_pair,
               CASE WHEN j.reason IS NULL
                         AND pg_catalog.row_number() OVER (
                                 PARTITION BY j.from_pair, j.reason IS NULL
                                 ORDER BY j.version_rank DESC, j.completed_at DESC,
                                          j.summary_id DESC) > 1
                    THEN 'superseded' ELSE j.reason END AS reason,
               j.bytes
        FROM judged AS j
    ), listed AS (
        -- In (from_pair, summary_id) order, as projection_frame gives them; a size only
        -- for the summary a range uses.
        SELECT pg_catalog.array_agg(o.summary_id) AS ids,
               pg_catalog.array_agg(o.from_pair) AS froms,
               pg_catalog.array_agg(o.reason) AS reasons,
               pg_catalog.array_agg(o.bytes) AS sizes
        FROM (SELECT v.summary_id, v.from_pair, v.reason,
                     CASE WHEN v.reason IS NULL THEN v.bytes END AS bytes
              FROM verdicts AS v
              ORDER BY v.from_pair, v.summary_id) AS o
    )
    SELECT false, coalesce(pg_catalog.cardinality(v_users), 0), 0,
           coalesce(v_users, '{}'), coalesce(v_assistants, '{}'),
           coalesce(v_user_sizes, '{}'), coalesce(v_sizes, '{}'),
           coalesce(l.ids, '{}'), coalesce(l.froms, '{}'), coalesce(l.reasons, '{}'),
           coalesce(l.sizes, '{}')
    FROM listed AS l;
END
$$;
COMMENT ON FUNCTION compaction.judged_frame(text, text) IS
    'Internal: projection_frame''s row judged from the views in one judgement: every eligible pair (first_pair 0) and every summary''s verdict of the scope, derived = false';

DROP FUNCTION compaction.model_preference(text, text[]);
ALTER TABLE compaction.settings DROP COLUMN projection_models;
COMMENT ON TABLE compaction.settings IS
    'Engine settings, a single row: max_running caps running (unexpired) attempts across the database (default 8); admission_high_water is the engine''s own';

GRANT EXECUTE ON FUNCTION
    compaction.projection_summaries(text, text)
TO compaction_worker, compaction_reader;

-- The verdicts as the older order decides them.
DO $$
DECLARE
    v_conversation text;
BEGIN
    FOR v_conversation IN
        SELECT DISTINCT v.conversation_id FROM compaction.summary_verdicts AS v ORDER BY 1
    LOOP
        PERFORM compaction.rederive_summary_verdicts(v_conversation, NULL);
    END LOOP;
END
$$;

CALL compaction.assign_ownership();
