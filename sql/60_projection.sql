-- pycompactor stored logic, section 6: reads behind projection (Python pycompactor.projection).
--
-- project_history plans from metadata and reads text only for what it includes: the
-- eligible pairs come from compaction.indexed_pairs (ids and byte lengths, no text),
-- projection_summaries returns every summary's binding and whether its source is current
-- (compared with the derived ranges, no hashing at read time), and projection_texts
-- returns the texts of the messages and summaries named. All run as the engine owner
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
    -- derived state that is a comparison per summary; judged from the views it costs one
    -- hash per distinct range that has summaries, computed first, in a statement of its
    -- own (DESIGN §11: no engine function nested in a query on distributed tables).
    IF NOT v_derived THEN
        SELECT pg_catalog.array_agg(DISTINCT s.from_pair) INTO v_ranges
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id AND s.scope = p_scope;
        SELECT pg_catalog.array_agg(f.from_pair ORDER BY f.from_pair),
               pg_catalog.array_agg(c.source_message_ids ORDER BY f.from_pair),
               pg_catalog.array_agg(c.source_hash ORDER BY f.from_pair)
        INTO v_from, v_ids, v_hashes
        FROM pg_catalog.unnest(v_ranges) AS f (from_pair)
        CROSS JOIN LATERAL compaction.current_range(p_conversation_id, f.from_pair) AS c
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
        SELECT u.from_pair, ARRAY(SELECT pg_catalog.unnest(v_ids[u.k::int:u.k::int][1:20])),
               u.source_hash
        FROM ROWS FROM (pg_catalog.unnest(v_from), pg_catalog.unnest(v_hashes))
             WITH ORDINALITY AS u (from_pair, source_hash, k)
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

CREATE FUNCTION compaction.projection_texts(
    p_conversation_id text, p_message_ids text[], p_summary_ids bigint[])
RETURNS TABLE (message_id text, summary_id bigint, content text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        -- By primary key, one probe per id (OFFSET 0 keeps the probe a probe on a table
        -- without statistics): only the rows named are read, however long the
        -- conversation.
        SELECT m.message_id, NULL::bigint, m.content
        FROM pg_catalog.unnest(p_message_ids) AS i (message_id)
        CROSS JOIN LATERAL (
            SELECT sm.message_id, sm.content
            FROM compaction.source_messages AS sm
            WHERE sm.conversation_id = p_conversation_id AND sm.message_id = i.message_id
            OFFSET 0) AS m
        UNION ALL
        SELECT NULL::text, s.summary_id, s.summary
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.summary_id = ANY (p_summary_ids);
END
$$;
COMMENT ON FUNCTION compaction.projection_texts(text, text[], bigint[]) IS
    'Texts of the named messages and summaries of one conversation (what a projection includes), one row each';
