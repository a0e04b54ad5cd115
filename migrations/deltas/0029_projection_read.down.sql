-- 0029_projection_read, downgrade: no one-statement projection; projection_frame's
-- aggregates of 0028.

DROP FUNCTION compaction.projection_read(text, text, int, bigint, int);

CREATE OR REPLACE FUNCTION compaction.projection_frame(p_conversation_id text, p_scope text, p_pairs int)
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
        -- ORDER BY in each aggregate sorted them four times). The driver checks the order
        -- all the same.
        SELECT pg_catalog.array_agg(o.summary_id) AS ids,
               pg_catalog.array_agg(o.from_pair) AS froms,
               pg_catalog.array_agg(o.reason) AS reasons,
               pg_catalog.array_agg(o.bytes) AS sizes
        FROM (SELECT v.summary_id, v.from_pair, v.reason, NULL::int AS bytes
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
                AND v.reason IS NOT NULL
              UNION ALL
              SELECT v.summary_id, v.from_pair, NULL::text,
                     (SELECT pg_catalog.octet_length(js.summary)
                      FROM compaction.job_summaries AS js
                      WHERE js.conversation_id = p_conversation_id
                        AND js.summary_id = v.summary_id)
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
                AND v.reason IS NULL AND v.from_pair >= v_first
              ORDER BY 2, 1) AS o
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
    'What a projection plans from while the derived state is in use, in one row: the pair count, the metadata of the newest p_pairs pairs (from first_pair, whole ranges; no text), every rejected summary of the conversation and scope with its reason (version_not_projectable, stale_source, superseded), and the chosen summary (reason NULL) of each range those pairs cover with its UTF-8 byte length; derived = false (nothing else) when the derived state is not in use';


CALL compaction.assign_ownership();
