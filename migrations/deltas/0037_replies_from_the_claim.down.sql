-- 0037_replies_from_the_claim, downgrade: range_replies as revision 0013 left it (the
-- current range, judged from the views when the derived state is not in use).

CREATE OR REPLACE FUNCTION compaction.range_replies(
    p_conversation_id text, p_from_pair int, p_source_hash text)
RETURNS TABLE (pair_index int, assistant_message_id text, assistant_content text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_ids  text[];
    v_hash text;
BEGIN
    -- Only while the range is what the claim bound: a range edited after the claim
    -- returns no rows, so the model never summarises text the hash does not cover. The
    -- range first, then the texts: one statement each (DESIGN §11).
    SELECT r.source_message_ids, r.source_hash INTO v_ids, v_hash
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    IF v_hash IS DISTINCT FROM p_source_hash OR p_source_hash IS NULL THEN
        RETURN;
    END IF;
    -- source_message_ids is [u0, a0, ..., u9, a9]: the replies sit at the even positions.
    RETURN QUERY
    SELECT (p_from_pair + u.ord / 2 - 1)::int, m.message_id, m.content
    FROM pg_catalog.unnest(v_ids) WITH ORDINALITY AS u (message_id, ord)
    JOIN compaction.source_messages AS m
      ON m.conversation_id = p_conversation_id AND m.message_id = u.message_id
     AND m.role = 'assistant'
    WHERE u.ord % 2 = 0
    ORDER BY u.ord;
END
$$;
COMMENT ON FUNCTION compaction.range_replies(text, int, text) IS
    'The 10 assistant replies of range from_pair (pair_index, message id, text), only while the range''s current source hash equals the one given; no user text';

CALL compaction.assign_ownership();
