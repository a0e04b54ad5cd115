-- pycompactor stored logic, section 3b: what the worker reads (Python pycompactor.worker).
--
-- A worker pass asks which targets of a conversation are worth a claim and, after a
-- claim, the ten replies the model summarises. Both read derived state and the 10
-- messages of a claimed range, never the rest of the conversation's text, and no user text
-- at all: the model is given assistant replies only (contract §8).

CREATE FUNCTION compaction.worker_targets(
    p_conversation_id text, p_scope text, p_model text, p_prompt_version text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_from   int[];
    v_ids    text[];
    v_hashes text[];
BEGIN
    -- The targets first, then which of them hold a summary: one statement each (docs/contract.md
    -- §11). The ids travel as one row of 20 per target.
    SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
           pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
           pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
    INTO v_from, v_ids, v_hashes
    FROM compaction.plan_targets(p_conversation_id) AS t;
    RETURN QUERY
    SELECT t.from_pair, t.from_pair + 9,
           ARRAY(SELECT pg_catalog.unnest(v_ids[t.k::int:t.k::int][1:20])), t.source_hash,
           EXISTS (SELECT 1
                   FROM compaction.jobs AS j
                   JOIN compaction.job_summaries AS s
                     ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
                   WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
                     AND j.from_pair = t.from_pair AND j.source_hash = t.source_hash
                     AND j.model = p_model AND j.prompt_version = p_prompt_version)
    FROM ROWS FROM (pg_catalog.unnest(v_from), pg_catalog.unnest(v_hashes))
         WITH ORDINALITY AS t (from_pair, source_hash, k)
    ORDER BY t.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.worker_targets(text, text, text, text) IS
    'The targets of plan_targets with whether that identity (scope, model, prompt version) already holds a completed summary, so a worker claims only what is left';

CREATE FUNCTION compaction.range_replies(
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
    v_derived boolean;
    v_ids     text[];
    v_hash    text;
BEGIN
    IF p_source_hash IS NULL THEN
        RETURN;
    END IF;
    -- Judged from the views (on a source without tracking), the range's current ids cost
    -- a judgment of the whole conversation, which the claim made a moment before; on
    -- Citus, the derived range costs a read of every shard first (derived_state_serves
    -- asks the record of foreign messages), which the claim made too. The claim bound
    -- the range to the 20 ids its job keeps: the replies are read with the hash of those
    -- ids' texts as they are now, in one statement (one snapshot, one query to the node
    -- that holds the conversation), and returned only when it is the claimed hash, so the
    -- model still never sees text the hash does not cover. A range that moved with its
    -- texts unchanged is not noticed here; its summary is then judged stale_source, as
    -- any summary of a range that moved after it was written. With no job of that hash,
    -- the current range.
    v_derived := CASE WHEN compaction.engine_distributed() THEN false
                      ELSE compaction.derived_state_serves(p_conversation_id) END;
    IF NOT v_derived THEN
        SELECT j.source_message_ids INTO v_ids
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.from_pair = p_from_pair
          AND j.source_hash = p_source_hash
        LIMIT 1;
        IF v_ids IS NOT NULL THEN
            RETURN QUERY
            WITH m AS (
                -- Each message looked up on its own, as range_hash does.
                SELECT u.ord, u.message_id, s.role, s.content
                FROM pg_catalog.unnest(v_ids) WITH ORDINALITY AS u (message_id, ord)
                CROSS JOIN LATERAL (
                    SELECT sm.role, sm.content FROM compaction.source_messages AS sm
                    WHERE sm.conversation_id = p_conversation_id
                      AND sm.message_id = u.message_id
                    OFFSET 0) AS s)
            SELECT (p_from_pair + m.ord / 2 - 1)::int, m.message_id, m.content
            FROM m
            WHERE m.ord % 2 = 0 AND m.role = 'assistant'
              -- range_hash's rule, over the rows this statement read
              AND (SELECT CASE WHEN count(*) = 20 THEN
                              pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                                  pg_catalog.int4send(pg_catalog.octet_length(h.message_id))
                                  || pg_catalog.convert_to(h.message_id, 'UTF8')
                                  || pg_catalog.int4send(pg_catalog.octet_length(h.content))
                                  || pg_catalog.convert_to(h.content, 'UTF8'),
                                  ''::bytea ORDER BY h.ord)), 'hex')
                          END
                   FROM m AS h) = p_source_hash
            ORDER BY m.ord;
            RETURN;
        END IF;
    END IF;
    -- Only while the range is what the claim bound: a range edited after the claim
    -- returns no rows, so the model never summarises text the hash does not cover. The
    -- range first, then the texts: one statement each (contract §11). With the derived
    -- state in use the range is current_range's read of compaction.ranges, made here:
    -- current_range would ask derived_state_current again.
    IF v_derived THEN
        SELECT r.source_message_ids, r.source_hash INTO v_ids, v_hash
        FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
    ELSE
        SELECT r.source_message_ids, r.source_hash INTO v_ids, v_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    END IF;
    IF v_hash IS DISTINCT FROM p_source_hash THEN
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
    'The 10 assistant replies of range from_pair (pair_index, message id, text), only while their texts hash to the source hash given: the range''s current hash, or (judged from the views, and on Citus) that of the ids of the job claimed with that hash; no user text';
