-- 0016_inlined_rules: the small rules on every claim and completion cost what they do
-- (issue 11). valid_source_hash, summary_problem, reply_problem, conversation_lock_key,
-- lock_conversation and try_lock_conversation lose their SET clause, so the planner inlines
-- them into their callers (every name in them is schema-qualified, so no search_path can
-- change what they mean); valid_source_ids, which needs a subquery, becomes PL/pgSQL and
-- keeps its plan for the session. Each SQL body used to be planned again in every
-- transaction that called it. Same rules, same results.
--
-- And a fix: reply_problem runs with its caller's rights, and its body calls
-- summary_problem and has_content, which the worker could not execute, so a worker
-- running as a compaction_worker login failed its own --min-figure-retention check of
-- any stopped reply.

CREATE OR REPLACE FUNCTION compaction.valid_source_ids(p_source_message_ids text[])
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    RETURN p_source_message_ids IS NOT NULL
       AND pg_catalog.array_ndims(p_source_message_ids) OPERATOR(pg_catalog.=) 1
       AND pg_catalog.cardinality(p_source_message_ids) OPERATOR(pg_catalog.=) 20
       AND pg_catalog.array_position(p_source_message_ids, NULL::pg_catalog.text) IS NULL
       AND (SELECT pg_catalog.count(DISTINCT i.id)
            FROM pg_catalog.unnest(p_source_message_ids) AS i (id)) OPERATOR(pg_catalog.=) 20;
END
$$;

CREATE OR REPLACE FUNCTION compaction.valid_source_hash(p_source_hash text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT p_source_hash IS NOT NULL AND p_source_hash OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$'
$$;

CREATE OR REPLACE FUNCTION compaction.summary_problem(p_summary text)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT CASE
               WHEN NOT compaction.has_content(p_summary) THEN 'empty'
               -- characters, not bytes: 6,000 four-byte emoji are a valid summary
               WHEN pg_catalog.char_length(p_summary) OPERATOR(pg_catalog.>) 6000 THEN 'too_long'
           END
$$;

CREATE OR REPLACE FUNCTION compaction.reply_problem(p_summary text, p_finish_reason text,
                                         p_tool_call_count int)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    -- IS DISTINCT FROM, with the operator named: a NULL is neither 'stop' nor 0.
    SELECT CASE
               WHEN NOT coalesce(p_finish_reason OPERATOR(pg_catalog.=) 'stop', false)
                   THEN 'not_stopped'
               WHEN NOT coalesce(p_tool_call_count OPERATOR(pg_catalog.=) 0, false)
                   THEN 'tool_calls'
               ELSE compaction.summary_problem(p_summary)
           END
$$;

CREATE OR REPLACE FUNCTION compaction.conversation_lock_key(p_conversation_id text)
RETURNS int
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT CASE WHEN pg_catalog.hashtext(p_conversation_id) OPERATOR(pg_catalog.>=) 0
                 AND pg_catalog.hashtext(p_conversation_id) OPERATOR(pg_catalog.<=) 15
                THEN -1 OPERATOR(pg_catalog.-) pg_catalog.hashtext(p_conversation_id)
                ELSE pg_catalog.hashtext(p_conversation_id) END
$$;

CREATE OR REPLACE FUNCTION compaction.lock_conversation(p_conversation_id text)
RETURNS void
LANGUAGE sql
VOLATILE
AS $$
    SELECT pg_catalog.pg_advisory_xact_lock(
               1129316352, compaction.conversation_lock_key(p_conversation_id))
$$;

CREATE OR REPLACE FUNCTION compaction.try_lock_conversation(p_conversation_id text)
RETURNS boolean
LANGUAGE sql
VOLATILE
AS $$
    SELECT pg_catalog.pg_try_advisory_xact_lock(
               1129316352, compaction.conversation_lock_key(p_conversation_id))
$$;

GRANT EXECUTE ON FUNCTION compaction.summary_problem(text), compaction.has_content(text)
TO compaction_worker;
