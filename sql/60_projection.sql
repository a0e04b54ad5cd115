-- pycompactor stored logic, section 6: reads behind projection (Python pycompactor.projection).
--
-- project_history plans from metadata and then reads only the texts it includes, so the
-- text it ships grows with the budget, not with the conversation: projection_pairs and
-- projection_summaries return no message or summary text, projection_texts returns the
-- texts of the messages and summaries named. Eligibility stays in compaction.eligible_pairs
-- (judge_runs); these functions only reshape its result. All run as the engine owner
-- (SECURITY DEFINER): the source views run with their owner's rights anyway, and the
-- summaries sit behind engine tables.

CREATE FUNCTION compaction.projection_pairs(p_conversation_id text, p_scope text)
RETURNS TABLE (
    pair_index           int,
    user_message_id      text,
    assistant_message_id text,
    user_bytes           int,
    assistant_bytes      int,
    range_hash           text
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH pairs AS (
        SELECT i.pair_index, i.user_message_id, i.user_bytes,
               i.assistant_message_id, i.assistant_bytes
        FROM compaction.indexed_pairs(p_conversation_id) AS i
    ),
    -- Only ranges that a stored summary of this scope claims need their hash recomputed.
    claimed AS (
        SELECT DISTINCT s.from_pair
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.scope = p_scope
    ),
    -- The §5 hash, as compaction.source_hash computes it, but over this one scan of the
    -- pairs (source_hash would judge every run again for each range).
    hashes AS (
        SELECT c.from_pair,
               compaction.range_hash(ARRAY(SELECT pg_catalog.unnest(array_agg(
                   ARRAY[p.user_message_id, p.assistant_message_id] ORDER BY p.pair_index))))
                   AS range_hash
        FROM claimed AS c
        JOIN pairs AS p ON p.pair_index / 10 * 10 = c.from_pair
        GROUP BY c.from_pair
        HAVING count(*) = 10
    )
    SELECT p.pair_index,
           p.user_message_id,
           p.assistant_message_id,
           p.user_bytes,
           p.assistant_bytes,
           h.range_hash
    FROM pairs AS p
    LEFT JOIN hashes AS h ON h.from_pair = p.pair_index
    ORDER BY p.pair_index
$$;
COMMENT ON FUNCTION compaction.projection_pairs(text, text) IS
    'Eligible pairs without text: ids, UTF-8 byte lengths, and on the first pair of each complete range that a summary of the scope claims, its current source hash';

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

CREATE FUNCTION compaction.projection_texts(
    p_conversation_id text, p_message_ids text[], p_summary_ids bigint[])
RETURNS TABLE (message_id text, summary_id bigint, content text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- By primary key: only the rows named are read, however long the conversation.
    SELECT m.message_id, NULL::bigint, m.content
    FROM compaction.source_messages AS m
    WHERE m.message_id = ANY (p_message_ids)
      AND m.conversation_id = p_conversation_id
    UNION ALL
    SELECT NULL::text, s.summary_id, s.summary
    FROM compaction.summaries AS s
    WHERE s.conversation_id = p_conversation_id
      AND s.summary_id = ANY (p_summary_ids)
$$;
COMMENT ON FUNCTION compaction.projection_texts(text, text[], bigint[]) IS
    'Texts of the named messages and summaries of one conversation (what a projection includes), one row each';
