-- pycompactor stored logic, section 3b: what the worker reads (Python pycompactor.worker).
--
-- A worker pass asks which targets of a conversation are worth a claim and, after a
-- claim, the ten replies the model summarises. Both read derived state and the 10
-- messages of a claimed range, never the rest of the conversation's text, and no user text
-- at all: the model is given assistant replies only (DESIGN §8).

CREATE FUNCTION compaction.worker_targets(
    p_conversation_id text, p_scope text, p_model text, p_prompt_version text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT t.from_pair, t.to_pair, t.source_message_ids, t.source_hash,
           EXISTS (SELECT 1
                   FROM compaction.jobs AS j
                   JOIN compaction.job_summaries AS s
                     ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
                   WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
                     AND j.from_pair = t.from_pair AND j.source_hash = t.source_hash
                     AND j.model = p_model AND j.prompt_version = p_prompt_version)
    FROM compaction.plan_targets(p_conversation_id) AS t
    ORDER BY t.from_pair
$$;
COMMENT ON FUNCTION compaction.worker_targets(text, text, text, text) IS
    'The targets of plan_targets with whether that identity (scope, model, prompt version) already holds a completed summary, so a worker claims only what is left';

CREATE FUNCTION compaction.range_replies(
    p_conversation_id text, p_from_pair int, p_source_hash text)
RETURNS TABLE (pair_index int, assistant_message_id text, assistant_content text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    -- Only while the range is what the claim bound: a range edited after the claim
    -- returns no rows, so the model never summarises text the hash does not cover.
    -- source_message_ids is [u0, a0, ..., u9, a9]: the replies sit at the even positions.
    SELECT (p_from_pair + u.ord / 2 - 1)::int, m.message_id, m.content
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS r
    CROSS JOIN LATERAL pg_catalog.unnest(r.source_message_ids)
        WITH ORDINALITY AS u (message_id, ord)
    JOIN compaction.source_messages AS m
      ON m.message_id = u.message_id AND m.role = 'assistant'
    WHERE r.source_hash = p_source_hash AND u.ord % 2 = 0
    ORDER BY u.ord
$$;
COMMENT ON FUNCTION compaction.range_replies(text, int, text) IS
    'The 10 assistant replies of range from_pair (pair_index, message id, text), only while the range''s current source hash equals the one given; no user text';
