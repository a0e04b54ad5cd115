-- Delta 0003_projection (frozen once released): sql/60_projection.sql and the 0003
-- additions to 90_roles.sql, as of the projection.

-- ==== sql/60_projection.sql ====
-- pycompactor stored logic, section 6: reads behind projection (Python pycompactor.projection).
--
-- project_history plans from metadata and reads text only where the plan needs it, so
-- its cost grows with the budget, not with the conversation: the eligible pairs come from
-- compaction.indexed_pairs (ids and byte lengths, no text), projection_summaries returns
-- no summary text, projection_range_hashes recomputes the source hash of just the ranges
-- the walk can reach, and projection_texts returns the texts of the messages and summaries
-- named. Eligibility stays in compaction.judge_runs. All run as the engine owner
-- (SECURITY DEFINER): the source views run with their owner's rights anyway, and the
-- summaries sit behind engine tables.

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

-- The §5 hash of the ranges named, each by its 20 current source ids (one row of a
-- two-dimensional array per range): range_hash reads those 20 messages by primary key and
-- nothing else, so the cost follows the number of ranges asked for, never the
-- conversation's length. The caller takes the ids from compaction.indexed_pairs in the
-- same snapshot.
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

-- ==== sql/90_roles.sql (0003 additions) ====
CALL compaction.assign_ownership();
-- Projection (revision 0003_projection): what `pycompactor project` needs, read-only.
-- Pairs come from compaction.indexed_pairs, granted with the read functions of §3–5.
GRANT EXECUTE ON FUNCTION
    compaction.projection_summaries(text, text),
    compaction.projection_range_hashes(int[], text[]),
    compaction.projection_texts(text, text[], bigint[])
TO compaction_worker, compaction_reader;
