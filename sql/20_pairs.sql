-- pycompactor stored logic, section 2: eligible pairs, the window policy, source binding.
--
-- All three read functions run as the engine owner (SECURITY DEFINER): the source views
-- run with their owner's rights anyway, and the audit views must be able to recompute a
-- hash for a role that may never read message text itself.

-- Shared by eligibility (content rule of pairs) and, later, by summary validation:
-- content means a character other than the six ASCII whitespace characters, so NBSP,
-- U+3000 and zero-width characters count as content.
CREATE FUNCTION compaction.has_content(p_text text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p_text IS NOT NULL
       AND pg_catalog.btrim(p_text, ' ' || pg_catalog.chr(9) || pg_catalog.chr(10)
                                || pg_catalog.chr(11) || pg_catalog.chr(12)
                                || pg_catalog.chr(13)) <> ''
$$;
COMMENT ON FUNCTION compaction.has_content(text) IS
    'True when the text has a character other than space, \t, \n, \r, \f, \v (NULL is no content)';

-- One verdict per run of the conversation. The single place where §3's rules live:
-- eligible_pairs keeps the runs with no reason, explain_runs shows the reasons.
CREATE FUNCTION compaction.judge_runs(p_conversation_id text)
RETURNS TABLE (
    run_id               text,
    run_status           text,
    reason               text,
    user_message_id      text,
    user_seq             bigint,
    user_content         text,
    assistant_message_id text,
    assistant_content    text
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- A lateral aggregate per run: the messages of each run are fetched by the run_id
    -- index, so the cost follows this conversation's size, never the table's.
    WITH per_run AS (
        SELECT r.run_id,
               r.status AS run_status,
               m.*
        FROM compaction.source_runs AS r
        CROSS JOIN LATERAL (
            SELECT count(*) FILTER (WHERE sm.role = 'user') AS n_user,
                   count(*) FILTER (WHERE sm.role = 'assistant') AS n_assistant,
                   coalesce(bool_or(sm.conversation_id IS DISTINCT FROM p_conversation_id),
                            false) AS foreign_message,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'user'))[1] AS user_message_id,
                   (array_agg(sm.seq) FILTER (WHERE sm.role = 'user'))[1] AS user_seq,
                   (array_agg(sm.content) FILTER (WHERE sm.role = 'user'))[1] AS user_content,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_message_id,
                   (array_agg(sm.status) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_status,
                   (array_agg(sm.content) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_content
            FROM compaction.source_messages AS sm
            WHERE sm.run_id = r.run_id
              AND sm.role IN ('user', 'assistant')
        ) AS m
        WHERE r.conversation_id = p_conversation_id
    )
    SELECT p.run_id,
           p.run_status,
           CASE
               WHEN p.run_status IS NULL
                 OR p.run_status NOT IN ('completed', 'partial', 'clarify_pending')
                   THEN 'run_status'
               WHEN p.foreign_message THEN 'foreign_message'
               WHEN p.n_user = 0 THEN 'no_user_message'
               WHEN p.n_user > 1 THEN 'multiple_user_messages'
               WHEN p.n_assistant = 0 THEN 'no_assistant_message'
               WHEN p.n_assistant > 1 THEN 'multiple_assistant_messages'
               WHEN p.assistant_status IS DISTINCT FROM 'completed' THEN 'assistant_not_completed'
               WHEN NOT compaction.has_content(p.user_content) THEN 'empty_user_content'
               WHEN NOT compaction.has_content(p.assistant_content) THEN 'empty_assistant_content'
           END,
           p.user_message_id,
           p.user_seq,
           p.user_content,
           p.assistant_message_id,
           p.assistant_content
    FROM per_run AS p
$$;
COMMENT ON FUNCTION compaction.judge_runs(text) IS
    'Internal: every run of a conversation with the first eligibility rule it breaks (NULL when it forms a pair), with its pair''s ids and texts';

CREATE FUNCTION compaction.eligible_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_message_id      text,
    user_content         text,
    assistant_message_id text,
    assistant_content    text
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT (row_number() OVER w - 1)::int,
           j.run_id, j.user_message_id, j.user_content,
           j.assistant_message_id, j.assistant_content
    FROM compaction.judge_runs(p_conversation_id) AS j
    WHERE j.reason IS NULL
    WINDOW w AS (ORDER BY j.user_seq, j.user_message_id)
    ORDER BY j.user_seq, j.user_message_id
$$;
COMMENT ON FUNCTION compaction.eligible_pairs(text) IS
    'Settled user/assistant pairs of a conversation, ordered by the user message (seq, message_id); pair_index is 0-based';

CREATE FUNCTION compaction.explain_runs(p_conversation_id text)
RETURNS TABLE (run_id text, run_status text, eligible boolean, reason text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT j.run_id, j.run_status, j.reason IS NULL, j.reason
    FROM compaction.judge_runs(p_conversation_id) AS j
    ORDER BY j.reason IS NULL, j.user_seq NULLS FIRST, j.run_id
$$;
COMMENT ON FUNCTION compaction.explain_runs(text) IS
    'Every run of a conversation with whether it forms a pair and, if not, the first rule it breaks (no message text)';

-- enc(s) = 4-byte big-endian length of UTF-8(s), then UTF-8(s); the database is UTF8,
-- so convert_to(..., 'UTF8') is the text's own bytes. The hash of a range is the SHA-256
-- of its ten pair_bytes concatenated in pair order.
CREATE FUNCTION compaction.pair_bytes(
    p_user_message_id text, p_user_content text,
    p_assistant_message_id text, p_assistant_content text)
RETURNS bytea
LANGUAGE sql
IMMUTABLE
STRICT
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_catalog.int4send(pg_catalog.octet_length(p_user_message_id))
        || pg_catalog.convert_to(p_user_message_id, 'UTF8')
        || pg_catalog.int4send(pg_catalog.octet_length(p_user_content))
        || pg_catalog.convert_to(p_user_content, 'UTF8')
        || pg_catalog.int4send(pg_catalog.octet_length(p_assistant_message_id))
        || pg_catalog.convert_to(p_assistant_message_id, 'UTF8')
        || pg_catalog.int4send(pg_catalog.octet_length(p_assistant_content))
        || pg_catalog.convert_to(p_assistant_content, 'UTF8')
$$;
COMMENT ON FUNCTION compaction.pair_bytes(text, text, text, text) IS
    'Internal: one pair''s share of the source hash input: enc(user id) enc(user text) enc(assistant id) enc(assistant text)';

CREATE FUNCTION compaction.plan_targets(p_conversation_id text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    WITH pairs AS (
        SELECT e.pair_index / 10 * 10 AS from_pair,
               e.pair_index,
               e.user_message_id,
               e.assistant_message_id,
               compaction.pair_bytes(e.user_message_id, e.user_content,
                                     e.assistant_message_id, e.assistant_content) AS bytes,
               count(*) OVER () AS n_pairs
        FROM compaction.eligible_pairs(p_conversation_id) AS e
    )
    SELECT p.from_pair::int,
           (p.from_pair + 9)::int,
           -- unnest of the 10x2 array walks it row by row: [u0, a0, u1, a1, ...]
           ARRAY(SELECT pg_catalog.unnest(array_agg(ARRAY[p.user_message_id, p.assistant_message_id]
                                                    ORDER BY p.pair_index))),
           pg_catalog.encode(pg_catalog.sha256(
               pg_catalog.string_agg(p.bytes, ''::bytea ORDER BY p.pair_index)), 'hex')
    FROM pairs AS p
    -- The newest 20 pairs never enter a target: range k qualifies iff 10k + 30 <= N.
    WHERE p.from_pair + 30 <= p.n_pairs
    GROUP BY p.from_pair
    ORDER BY p.from_pair
$$;
COMMENT ON FUNCTION compaction.plan_targets(text) IS
    'Ranges of 10 pairs the fixed window policy makes targets now (N >= 10k + 30), with their 20 source ids [u0, a0, ..., u9, a9] and source hash';

CREATE FUNCTION compaction.source_hash(p_conversation_id text, p_from_pair int)
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN count(*) = 10 THEN
               pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                   compaction.pair_bytes(p.user_message_id, p.user_content,
                                         p.assistant_message_id, p.assistant_content),
                   ''::bytea ORDER BY p.pair_index)), 'hex')
           END
    FROM compaction.eligible_pairs(p_conversation_id) AS p
    WHERE p_from_pair >= 0
      AND p_from_pair % 10 = 0
      AND p.pair_index BETWEEN p_from_pair AND p_from_pair + 9
$$;
COMMENT ON FUNCTION compaction.source_hash(text, int) IS
    'SHA-256 (lowercase hex) binding pairs from_pair..from_pair+9 (ids and texts of both sides); NULL unless all 10 pairs exist and from_pair is a non-negative multiple of 10';
