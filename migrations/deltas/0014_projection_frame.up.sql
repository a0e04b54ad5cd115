-- 0014_projection_frame: compaction.projection_frame, the projection's one read while the
-- derived state is in use (the newest pairs' metadata and every summary's verdict), so a
-- projection costs what it includes rather than what the history holds (issue 11).

-- The projection's one read while the derived state is in use (revision 0014): what the
-- walk needs from the newest pairs back, and the verdict on every summary, in one
-- statement, so a projection costs two round trips (this, then projection_texts) and
-- grows with the budget rather than with the history. Pair metadata comes only for the
-- newest p_pairs pairs (rounded to whole ranges); Python asks again for more when its walk
-- gets past them. Every summary of the conversation and scope is judged here, in the
-- order of DESIGN §9 (version_not_projectable, stale_source, superseded), and the one
-- chosen per range has reason NULL; pycompactor.projection.select_summaries is the
-- in-memory twin. summary_bytes is given for the chosen summaries the pairs reach only.
-- derived is false (and nothing else is returned) while the derived state is not in use:
-- the caller then reads through indexed_pairs and projection_summaries, which judge from
-- the views.
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
    ), stored AS (
        SELECT js.summary_id, j.from_pair, js.completed_at,
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
        WHERE js.conversation_id = p_conversation_id AND j.scope = p_scope
    ), judged AS (
        SELECT s.summary_id, s.from_pair, s.version_rank, s.completed_at,
               CASE WHEN NOT s.projectable THEN 'version_not_projectable'
                    WHEN NOT s.current THEN 'stale_source' END AS reason
        FROM stored AS s
    ), chosen AS (
        SELECT j.summary_id, j.from_pair,
               CASE WHEN j.reason IS NULL
                         AND pg_catalog.row_number() OVER (
                                 PARTITION BY j.from_pair, j.reason IS NULL
                                 ORDER BY j.version_rank DESC, j.completed_at DESC,
                                          j.summary_id DESC) > 1
                    THEN 'superseded' ELSE j.reason END AS reason
        FROM judged AS j
    ), verdicts AS (
        SELECT pg_catalog.array_agg(c.summary_id ORDER BY c.from_pair, c.summary_id) AS ids,
               pg_catalog.array_agg(c.from_pair ORDER BY c.from_pair, c.summary_id) AS froms,
               pg_catalog.array_agg(c.reason ORDER BY c.from_pair, c.summary_id) AS reasons,
               pg_catalog.array_agg(
                   CASE WHEN c.reason IS NULL AND c.from_pair >= v_first THEN
                       (SELECT pg_catalog.octet_length(js.summary)
                        FROM compaction.job_summaries AS js
                        WHERE js.conversation_id = p_conversation_id
                          AND js.summary_id = c.summary_id) END
                   ORDER BY c.from_pair, c.summary_id) AS sizes
        FROM chosen AS c
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

CALL compaction.assign_ownership();
GRANT EXECUTE ON FUNCTION compaction.projection_frame(text, text, int)
TO compaction_worker, compaction_reader;
