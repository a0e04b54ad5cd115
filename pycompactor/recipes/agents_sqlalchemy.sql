-- pycompactor source recipe: the OpenAI Agents SDK's SQLAlchemySession tables.
--
-- The SDK (agents.extensions.memory.SQLAlchemySession) keeps one row per session item in
-- {messages}(id serial, session_id, message_data text JSON, created_at): no run id, no
-- per-row status, non-ASCII escaped as \uXXXX. This file re-points the two source views
-- at that table, creates the indexes the engine's lookups through them need, and attaches
-- the change-tracking triggers. pycompactor.recipes.install_agents_sqlalchemy() formats
-- it (identifiers only, through psycopg.sql) and runs it step by step, each step starting
-- at a "-- step:" line: on a live table no step may hold the application's writes for
-- longer than a few tens of milliseconds.
--
-- Runs are derived, not stored: a run is a user message item and every item after it up
-- to the next user message item of the session; its id is the user item's id. Within a
-- run the last assistant message item is the answer (role 'assistant'), earlier ones are
-- 'assistant_interim'; function calls, their outputs, reasoning and every other non-message
-- item are 'sdk_item' (none is part of a pair). A run is 'completed' once it holds an
-- assistant message item. seq is the row id (the SDK orders by created_at, id; created_at
-- is the writing transaction's start, so id order is the same for one session's writes).
--
-- Every derivation is a LATERAL lookup through an index, never a window function over
-- the table: the engine asks for one conversation, one run or a few message ids, and a
-- window over every session's rows would be computed whole for each of those questions
-- (`pycompactor check-source` times and EXPLAINs them).

-- What an SDK item is, from its JSON. The role of a message item (NULL for any other
-- item): IMMUTABLE, so the role index below can hold it; plain SQL, so the planner
-- inlines it.
CREATE OR REPLACE FUNCTION {role_fn}(p_item text)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT CASE WHEN coalesce(p_item::jsonb ->> 'type', 'message') = 'message'
                THEN p_item::jsonb ->> 'role' END
$$;
COMMENT ON FUNCTION {role_fn}(text) IS
    'pycompactor recipe (Agents SDK SQLAlchemySession): the role of a message item, NULL for any other item';

-- The text of a message item's content parts: its text (or refusal) parts joined by
-- newlines, as PycompactorSession stores them.
CREATE OR REPLACE FUNCTION {parts_fn}(p_content jsonb)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT coalesce((
        SELECT string_agg(coalesce(
                   CASE WHEN jsonb_typeof(e.part -> 'text') = 'string'
                        THEN e.part ->> 'text' END,
                   CASE WHEN jsonb_typeof(e.part -> 'refusal') = 'string'
                        THEN e.part ->> 'refusal' END), E'\n' ORDER BY e.ord)
        FROM jsonb_array_elements(p_content) WITH ORDINALITY AS e (part, ord)
        WHERE jsonb_typeof(e.part -> 'text') = 'string'
           OR jsonb_typeof(e.part -> 'refusal') = 'string'), '')
$$;
COMMENT ON FUNCTION {parts_fn}(jsonb) IS
    'pycompactor recipe (Agents SDK SQLAlchemySession): the text and refusal parts of a message item''s content, joined by newlines';

-- The text of an item (already parsed): a message's string content, or its text (or
-- refusal) parts joined by newlines, as PycompactorSession stores them; any other item
-- is its JSON. jsonb decodes the \uXXXX escapes the SDK writes. No subquery here, so the
-- planner inlines it into the view: an SQL function it must call costs more per item than
-- reading the item. A content of one part (what the SDK writes for an answer) is read in
-- place; more parts go through {parts_fn}, which must aggregate.
CREATE OR REPLACE FUNCTION {content_fn}(p_item jsonb)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN coalesce(p_item ->> 'type', 'message') <> 'message' OR p_item ->> 'role' IS NULL
            THEN p_item::text
        WHEN jsonb_typeof(p_item -> 'content') = 'string'
            THEN p_item ->> 'content'
        WHEN jsonb_typeof(p_item -> 'content') = 'array' THEN
            CASE WHEN jsonb_array_length(p_item -> 'content') = 1 THEN
                     coalesce(CASE WHEN jsonb_typeof(p_item -> 'content' -> 0 -> 'text') = 'string'
                                   THEN p_item -> 'content' -> 0 ->> 'text' END,
                              CASE WHEN jsonb_typeof(p_item -> 'content' -> 0 -> 'refusal') = 'string'
                                   THEN p_item -> 'content' -> 0 ->> 'refusal' END,
                              '')
                 ELSE {parts_fn}(p_item -> 'content')
            END
        ELSE ''
    END
$$;
COMMENT ON FUNCTION {content_fn}(jsonb) IS
    'pycompactor recipe (Agents SDK SQLAlchemySession): the text of a message item (string or text parts), the JSON of any other item';

-- step: indexes. One statement at a time, outside a transaction block: CONCURRENTLY, so
-- the SDK's writes go on while each index builds (a plain CREATE INDEX holds them for the
-- whole build).
--
-- The lookups, each an index probe or range scan:
-- * a session's runs, the run a message belongs to (the last user item at or before it),
--   the next run's start, a later assistant item in the run: (session_id, role, id);
-- * a run's items, from its user item up to the next run's start: (session_id, id)
--   (the role index would read every role of the session for that range);
-- * a run or a message by its text id (the engine's ids are text), with the role, so
--   "is this a user item" is answered from the index: (id::text, role);
-- * the item just before an append's first new item, newest first by the views' seq
--   (the tracking's question which run an append may have cut short): (session_id,
--   id::bigint). The integer id's order is the same, but the planner orders by the
--   expression the view shows, and without this index it sorted the whole session,
--   every item's run worked out, on every append (12 ms at 740 items, growing with the
--   session).
CREATE INDEX CONCURRENTLY IF NOT EXISTS {role_idx}
    ON {messages} (session_id, {role_fn}(message_data), id);
CREATE INDEX CONCURRENTLY IF NOT EXISTS {session_idx}
    ON {messages} (session_id, id);
CREATE INDEX CONCURRENTLY IF NOT EXISTS {id_idx}
    ON {messages} ((id::text), {role_fn}(message_data));
CREATE INDEX CONCURRENTLY IF NOT EXISTS {seq_idx}
    ON {messages} (session_id, (id::bigint));
-- Statistics on the indexed role expression: without them the planner guesses how many
-- items are user items, and may read a session's items whole where one probe would do.
-- ANALYZE takes no lock that blocks reads or writes.
ANALYZE {messages};

-- step: views. One transaction: the views change together.

-- The views run with their owner's rights (compaction_owner).
GRANT USAGE ON SCHEMA {schema} TO compaction_owner;
GRANT SELECT ON {messages} TO compaction_owner;
GRANT EXECUTE ON FUNCTION {role_fn}(text), {parts_fn}(jsonb), {content_fn}(jsonb)
    TO compaction_owner;

-- The runs: each user item with the id of the session's next user item, where its run
-- ends. Both source views read runs here (a plain view: the planner inlines it, and the
-- engine's tracking check follows it to the messages table). Listing conversations in
-- order (the worker's --sweep, the derived-state rebuild, check-source's samples) walks
-- the role index, where the role is already computed: no item's JSON is parsed for it.
CREATE OR REPLACE VIEW {runs_view} AS
    SELECT u.id, u.session_id, nu.next_id
    FROM {messages} AS u
    CROSS JOIN LATERAL (
        SELECT coalesce(min(n.id), 9223372036854775807) AS next_id
        FROM {messages} AS n
        WHERE n.session_id = u.session_id AND {role_fn}(n.message_data) = 'user'
          AND n.id > u.id
    ) AS nu
    WHERE {role_fn}(u.message_data) = 'user';
COMMENT ON VIEW {runs_view} IS
    'pycompactor recipe (Agents SDK SQLAlchemySession): each user item (a run) with the id of the next user item of its session';
GRANT SELECT ON {runs_view} TO compaction_owner;

-- A run per user item, completed once it holds an assistant message item.
CREATE OR REPLACE VIEW compaction.source_runs AS
    SELECT u.id::text AS run_id,
           u.session_id::text AS conversation_id,
           CASE WHEN EXISTS (SELECT 1 FROM {messages} AS a
                             WHERE a.session_id = u.session_id
                               AND {role_fn}(a.message_data) = 'assistant'
                               AND a.id > u.id AND a.id < u.next_id)
                THEN 'completed' ELSE 'in_progress' END AS status
    FROM {runs_view} AS u;

-- Each item, with the run it belongs to: the last user item of its session at or before
-- it (none for items before the session's first user item: a LEFT JOIN). The join keeps
-- both directions open to the planner: from a message (by id, by conversation) to its
-- run's user item by one backward index probe (the equality on u.id), and, when the run
-- id is given (the outer join then becomes an inner one), from the run's user item to its
-- items by a range scan up to the next run's start.
CREATE OR REPLACE VIEW compaction.source_messages AS
    SELECT m.id::text AS message_id,
           m.session_id::text AS conversation_id,
           u.id::text AS run_id,
           r.role,
           d.item_status AS status,
           d.item_content AS content,
           m.id::bigint AS seq
    FROM {messages} AS m
    -- Each item's JSON parsed once, and its role, status and text computed once (OFFSET 0
    -- keeps the planner from copying these expressions into every place that uses them:
    -- judging a run reads role and content several times per item).
    CROSS JOIN LATERAL (
        SELECT CASE WHEN coalesce(x.j ->> 'type', 'message') = 'message'
                    THEN x.j ->> 'role' END AS item_role,
               coalesce(x.j ->> 'status', 'completed') AS item_status,
               {content_fn}(x.j) AS item_content
        FROM (SELECT m.message_data::jsonb AS j OFFSET 0) AS x
        OFFSET 0
    ) AS d
    LEFT JOIN {runs_view} AS u
      ON u.session_id = m.session_id AND m.id >= u.id AND m.id < u.next_id
     AND u.id = (SELECT max(p.id) FROM {messages} AS p
                 WHERE p.session_id = m.session_id AND {role_fn}(p.message_data) = 'user'
                   AND p.id <= m.id)
    -- The role in the run, once per item: an assistant message followed by another in
    -- its run is interim.
    CROSS JOIN LATERAL (
        SELECT CASE d.item_role
                   WHEN 'assistant' THEN
                       CASE WHEN EXISTS (SELECT 1 FROM {messages} AS l
                                         WHERE l.session_id = m.session_id
                                           AND {role_fn}(l.message_data) = 'assistant'
                                           AND l.id > m.id AND l.id < u.next_id)
                            THEN 'assistant_interim' ELSE 'assistant' END
                   ELSE coalesce(d.item_role, 'sdk_item')
               END AS role
        OFFSET 0
    ) AS r;

COMMENT ON VIEW compaction.source_runs IS
    'Source contract: runs(run_id text, conversation_id text, status text); re-pointed by the pycompactor recipe for the Agents SDK SQLAlchemySession tables';
COMMENT ON VIEW compaction.source_messages IS
    'Source contract: messages(message_id, conversation_id, run_id, role, status, content text; seq bigint); re-pointed by the pycompactor recipe for the Agents SDK SQLAlchemySession tables';

-- step: tracking. Its own transaction: attach_source_tracking waits at most 50 ms at a
-- time for the table's lock, and nothing else is held meanwhile.
--
-- Keep the engine's derived state exact in the writing transaction. The table has no run
-- column (runs are derived); naming its message id column lets an append (the SDK's
-- add_items) re-derive only the runs of its new items. pop_item and clear_session
-- (deletes) re-derive the session.
SELECT compaction.attach_source_tracking({messages_literal}::regclass, 'session_id', '', 'id');
