-- 0016_inlined_rules, undone: the rules as revision 0015 left them (SQL functions with
-- SET search_path).

CREATE OR REPLACE FUNCTION compaction.valid_source_ids(p_source_message_ids text[])
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p_source_message_ids IS NOT NULL
       AND pg_catalog.array_ndims(p_source_message_ids) = 1
       AND pg_catalog.cardinality(p_source_message_ids) = 20
       AND pg_catalog.array_position(p_source_message_ids, NULL) IS NULL
       AND (SELECT count(DISTINCT i.id) FROM pg_catalog.unnest(p_source_message_ids) AS i (id)) = 20
$$;

CREATE OR REPLACE FUNCTION compaction.valid_source_hash(p_source_hash text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT p_source_hash IS NOT NULL AND p_source_hash OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$'
$$;

CREATE OR REPLACE FUNCTION compaction.summary_problem(p_summary text)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
               WHEN NOT compaction.has_content(p_summary) THEN 'empty'
               -- characters, not bytes: 6,000 four-byte emoji are a valid summary
               WHEN pg_catalog.char_length(p_summary) > 6000 THEN 'too_long'
           END
$$;

CREATE OR REPLACE FUNCTION compaction.reply_problem(p_summary text, p_finish_reason text,
                                         p_tool_call_count int)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
               WHEN p_finish_reason IS DISTINCT FROM 'stop' THEN 'not_stopped'
               WHEN p_tool_call_count IS DISTINCT FROM 0 THEN 'tool_calls'
               ELSE compaction.summary_problem(p_summary)
           END
$$;

CREATE OR REPLACE FUNCTION compaction.conversation_lock_key(p_conversation_id text)
RETURNS int
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN k.h BETWEEN 0 AND 15 THEN -1 - k.h ELSE k.h END
    FROM (SELECT pg_catalog.hashtext(p_conversation_id) AS h) AS k
$$;

CREATE OR REPLACE FUNCTION compaction.lock_conversation(p_conversation_id text)
RETURNS void
LANGUAGE sql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_catalog.pg_advisory_xact_lock(
               1129316352, compaction.conversation_lock_key(p_conversation_id))
$$;

CREATE OR REPLACE FUNCTION compaction.try_lock_conversation(p_conversation_id text)
RETURNS boolean
LANGUAGE sql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_catalog.pg_try_advisory_xact_lock(
               1129316352, compaction.conversation_lock_key(p_conversation_id))
$$;

REVOKE EXECUTE ON FUNCTION compaction.summary_problem(text), compaction.has_content(text)
FROM compaction_worker;
