-- Delta 0001_foundation (frozen once released): sql/00_schema, 10_source, 20_pairs and 90_roles as of 0.1.0.

-- ==== sql/00_schema.sql ====
-- pycompactor stored logic, section 0: preconditions, roles and schemas.
--
-- The files in sql/ are the complete current definition of the engine, applied in
-- file-name order. Alembic revisions under migrations/ apply the same state as a
-- series of frozen deltas; tests/migrations proves both paths build identical catalogs.
--
-- Project SQLSTATEs (class CP), mapped to Python in pycompactor/errors.py:
--   CP001  database is not UTF8-encoded
--   CP002  invalid range (from_pair negative or not a multiple of 10)
--   CP003  invalid source ids (not exactly 20 distinct non-null ids)
--   CP004  invalid source hash (not 64 lowercase hex characters)
--   CP005  invalid summary (not_stopped, tool_calls, empty or too_long)
--   CP006  a completed summary already exists for this identity
--   CP007  unknown prompt version
--   CP010  immutable row: completed summaries and their identity never change
--   CP011  append-only table: rows can be added, never changed or removed
--   CP012  TRUNCATE refused on an engine table
--   CP020  invalid argument to an engine function

-- Byte budgets, hashes and the whitespace rule are defined on UTF-8; any other server
-- encoding would silently change what a hash or a byte count means.
DO $$
BEGIN
    IF pg_catalog.current_setting('server_encoding') <> 'UTF8' THEN
        RAISE EXCEPTION 'pycompactor needs a UTF8-encoded database; % is %',
            pg_catalog.current_database(), pg_catalog.current_setting('server_encoding')
            USING ERRCODE = 'CP001',
                  HINT = 'Create the database with ENCODING ''UTF8'' (and a UTF-8 locale or TEMPLATE template0).';
    END IF;
END
$$;

-- Roles are cluster-wide: another database of the same cluster may have created them
-- already, possibly at this very moment, so creation tolerates losing that race.
DO $$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['compaction_owner', 'compaction_worker',
                                  'compaction_reader', 'compaction_auditor']
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = v_role) THEN
            BEGIN
                EXECUTE pg_catalog.format('CREATE ROLE %I NOLOGIN', v_role);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
END
$$;

-- The migration runner creates schema compaction before the first revision, because
-- alembic keeps its version table inside it.
CREATE SCHEMA IF NOT EXISTS compaction;
COMMENT ON SCHEMA compaction IS
    'pycompactor engine: cross-run conversation compaction (tables are internal; functions and views are the interface)';

CREATE SCHEMA compaction_source;
COMMENT ON SCHEMA compaction_source IS
    'pycompactor reference history tables for greenfield use; hosts may re-point compaction.source_* views elsewhere';

-- Advisory locks are transaction-scoped only (PgBouncer transaction pooling) and use
-- the two-key form with the project class 1129316352 (0x43500000, 'CP' << 24 >> 8):
--   (1129316352, 1)  migrations: serialises concurrent `pycompactor migrate` runs

-- ==== sql/10_source.sql ====
-- pycompactor stored logic, section 1: the source contract.
--
-- The engine reads history only through compaction.source_runs and
-- compaction.source_messages. By default they select from the reference tables below;
-- a host re-points them at its own tables with CREATE OR REPLACE VIEW (docs/integrating.md).

CREATE TABLE compaction_source.conversations (
    conversation_id text NOT NULL,
    CONSTRAINT conversations_pkey PRIMARY KEY (conversation_id)
);
COMMENT ON TABLE compaction_source.conversations IS
    'Reference history: one row per durable conversation thread';

CREATE TABLE compaction_source.runs (
    run_id          text NOT NULL,
    conversation_id text NOT NULL,
    status          text NOT NULL,
    created_at      timestamptz,
    CONSTRAINT runs_pkey PRIMARY KEY (run_id),
    CONSTRAINT runs_conversation_fkey FOREIGN KEY (conversation_id)
        REFERENCES compaction_source.conversations (conversation_id)
);
COMMENT ON TABLE compaction_source.runs IS
    'Reference history: one row per Run (execution of one request); status completed, partial or clarify_pending can form a pair';

-- eligible_pairs starts from one conversation's runs.
CREATE INDEX runs_conversation_idx ON compaction_source.runs (conversation_id);

CREATE TABLE compaction_source.messages (
    message_id      text NOT NULL,
    conversation_id text NOT NULL,
    run_id          text,
    role            text NOT NULL,
    status          text NOT NULL,
    content         text NOT NULL,
    seq             bigint NOT NULL,
    created_at      timestamptz,
    CONSTRAINT messages_pkey PRIMARY KEY (message_id),
    CONSTRAINT messages_run_fkey FOREIGN KEY (run_id)
        REFERENCES compaction_source.runs (run_id)
);
COMMENT ON TABLE compaction_source.messages IS
    'Reference history: messages of all roles; seq orders them within a conversation';

-- eligible_pairs gathers every message of a run, whatever conversation it was filed under.
CREATE INDEX messages_run_idx ON compaction_source.messages (run_id);
-- Reading a conversation in order (newest-first projection, check-source samples).
CREATE INDEX messages_conversation_seq_idx
    ON compaction_source.messages (conversation_id, seq, message_id);

CREATE VIEW compaction.source_runs AS
    SELECT r.run_id, r.conversation_id, r.status
    FROM compaction_source.runs AS r;
COMMENT ON VIEW compaction.source_runs IS
    'Source contract: runs(run_id text, conversation_id text, status text); re-point with CREATE OR REPLACE VIEW';

CREATE VIEW compaction.source_messages AS
    SELECT m.message_id, m.conversation_id, m.run_id, m.role, m.status, m.content, m.seq
    FROM compaction_source.messages AS m;
COMMENT ON VIEW compaction.source_messages IS
    'Source contract: messages(message_id, conversation_id, run_id, role, status, content text; seq bigint); re-point with CREATE OR REPLACE VIEW';

-- ==== sql/20_pairs.sql ====
-- pycompactor stored logic, section 2: eligible pairs, the window policy, source binding.
--
-- The read functions run as the engine owner (SECURITY DEFINER): the source views run
-- with their owner's rights anyway, and the audit views must be able to recompute a hash
-- for a role that may never read message text itself. They switch JIT off: they are
-- short OLTP statements, and on freshly loaded, unanalyzed tables a misestimated function
-- scan would otherwise cross jit_above_cost and spend 100x the query's time compiling.

-- Shared by eligibility (content rule of pairs) and summary validation: content means a
-- character other than the six ASCII whitespace characters, so NBSP, U+3000 and
-- zero-width characters count as content. The prefix test decides almost every text from
-- its first characters, and substr() detoasts only that slice of a large message.
CREATE FUNCTION compaction.has_content(p_text text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
-- No SET clause, so the planner can inline it into the per-message aggregate of
-- judge_runs (20,000 calls for a 10,000-pair conversation). Every name, operators
-- included, is schema-qualified, so no search_path can change what it means.
AS $$
    SELECT p_text IS NOT NULL
       AND (pg_catalog.btrim(pg_catalog.substr(p_text, 1, 64),
                             E' \t\n\r\f' OPERATOR(pg_catalog.||) pg_catalog.chr(11))
                OPERATOR(pg_catalog.<>) ''
            OR pg_catalog.btrim(p_text, E' \t\n\r\f' OPERATOR(pg_catalog.||) pg_catalog.chr(11))
                OPERATOR(pg_catalog.<>) '')
$$;
COMMENT ON FUNCTION compaction.has_content(text) IS
    'True when the text has a character other than space, \t, \n, \r, \f, \v (NULL is no content)';

-- The fixed window (DESIGN §4) in one place: range k is a target iff 10k + 30 <= N, so
-- at least 30 pairs precede the first target and the newest 20 are never in one.
CREATE FUNCTION compaction.is_target(p_from_pair int, p_pairs bigint)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT p_from_pair OPERATOR(pg_catalog.>=) 0
       AND p_from_pair OPERATOR(pg_catalog.%) 10 OPERATOR(pg_catalog.=) 0
       AND p_from_pair::bigint OPERATOR(pg_catalog.+) 30 OPERATOR(pg_catalog.<=) p_pairs
$$;
COMMENT ON FUNCTION compaction.is_target(int, bigint) IS
    'The window policy: true when the range starting at from_pair is a compaction target among N eligible pairs (from_pair a non-negative multiple of 10 and from_pair + 30 <= N)';

-- One verdict per run of the conversation. The single place where §3's rules live:
-- indexed_pairs keeps the runs with no reason, explain_runs shows the reasons. It returns
-- no message text (byte lengths come from the varlena header without detoasting), so
-- judging a long conversation does not read its text.
CREATE FUNCTION compaction.judge_runs(p_conversation_id text)
RETURNS TABLE (
    run_id               text,
    run_status           text,
    reason               text,
    user_message_id      text,
    user_seq             bigint,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
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
                   bool_and(compaction.has_content(sm.content)) FILTER (WHERE sm.role = 'user')
                       AS user_has_content,
                   max(pg_catalog.octet_length(sm.content)) FILTER (WHERE sm.role = 'user')
                       AS user_bytes,
                   (array_agg(sm.message_id) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_message_id,
                   (array_agg(sm.status) FILTER (WHERE sm.role = 'assistant'))[1]
                       AS assistant_status,
                   bool_and(compaction.has_content(sm.content)) FILTER (WHERE sm.role = 'assistant')
                       AS assistant_has_content,
                   max(pg_catalog.octet_length(sm.content)) FILTER (WHERE sm.role = 'assistant')
                       AS assistant_bytes
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
               WHEN NOT p.user_has_content THEN 'empty_user_content'
               WHEN NOT p.assistant_has_content THEN 'empty_assistant_content'
           END,
           p.user_message_id,
           p.user_seq,
           p.user_bytes::int,
           p.assistant_message_id,
           p.assistant_bytes::int
    FROM per_run AS p
$$;
COMMENT ON FUNCTION compaction.judge_runs(text) IS
    'Internal: every run of a conversation with the first eligibility rule it breaks (NULL when it forms a pair), its pair''s ids and UTF-8 byte lengths; no text';

CREATE FUNCTION compaction.indexed_pairs(p_conversation_id text)
RETURNS TABLE (
    pair_index           int,
    run_id               text,
    user_message_id      text,
    user_bytes           int,
    assistant_message_id text,
    assistant_bytes      int
)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT (row_number() OVER w - 1)::int,
           j.run_id, j.user_message_id, j.user_bytes, j.assistant_message_id, j.assistant_bytes
    FROM compaction.judge_runs(p_conversation_id) AS j
    WHERE j.reason IS NULL
    WINDOW w AS (ORDER BY j.user_seq, j.user_message_id)
    ORDER BY j.user_seq, j.user_message_id
$$;
COMMENT ON FUNCTION compaction.indexed_pairs(text) IS
    'Eligible pairs of a conversation without their text: pair_index, run and message ids, UTF-8 byte lengths (what planning and projection need before reading any text)';

-- Texts are fetched by message id for the pairs asked for only; the run and role are
-- matched too, so a host view with a duplicated message id cannot graft a stranger's text.
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
SET jit = off
AS $$
    SELECT i.pair_index, i.run_id, i.user_message_id, u.content, i.assistant_message_id, a.content
    FROM compaction.indexed_pairs(p_conversation_id) AS i
    JOIN compaction.source_messages AS u
      ON u.message_id = i.user_message_id AND u.run_id = i.run_id AND u.role = 'user'
    JOIN compaction.source_messages AS a
      ON a.message_id = i.assistant_message_id AND a.run_id = i.run_id AND a.role = 'assistant'
    ORDER BY i.pair_index
$$;
COMMENT ON FUNCTION compaction.eligible_pairs(text) IS
    'Settled user/assistant pairs of a conversation, ordered by the user message (seq, message_id); pair_index is 0-based';

CREATE FUNCTION compaction.explain_runs(p_conversation_id text)
RETURNS TABLE (run_id text, run_status text, eligible boolean, reason text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT j.run_id, j.run_status, j.reason IS NULL, j.reason
    FROM compaction.judge_runs(p_conversation_id) AS j
    ORDER BY j.reason IS NULL, j.user_seq NULLS FIRST, j.run_id
$$;
COMMENT ON FUNCTION compaction.explain_runs(text) IS
    'Every run of a conversation with whether it forms a pair and, if not, the first rule it breaks (no message text)';

-- enc(s) = 4-byte big-endian length of UTF-8(s), then UTF-8(s); the database is UTF8,
-- so convert_to(..., 'UTF8') is the text's own bytes. The hash of a range is the SHA-256
-- of enc(u0 id) enc(u0 text) enc(a0 id) enc(a0 text) ... enc(a9 text).
CREATE FUNCTION compaction.range_hash(p_message_ids text[])
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    -- p_message_ids is [u0, a0, ..., u9, a9]: the hash input walks it two by two.
    SELECT CASE WHEN pg_catalog.cardinality(p_message_ids) = 20
                 AND count(*) = 20 THEN
               pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                   pg_catalog.int4send(pg_catalog.octet_length(ids.id))
                   || pg_catalog.convert_to(ids.id, 'UTF8')
                   || pg_catalog.int4send(pg_catalog.octet_length(m.content))
                   || pg_catalog.convert_to(m.content, 'UTF8'),
                   ''::bytea ORDER BY ids.ord)), 'hex')
           END
    FROM pg_catalog.unnest(p_message_ids) WITH ORDINALITY AS ids (id, ord)
    JOIN compaction.source_messages AS m ON m.message_id = ids.id
$$;
COMMENT ON FUNCTION compaction.range_hash(text[]) IS
    'Source hash of a range given its 20 current source ids [u0, a0, ..., u9, a9], reading only those messages; NULL unless all 20 are found exactly once';

CREATE FUNCTION compaction.plan_targets(p_conversation_id text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    WITH pairs AS (
        SELECT i.pair_index / 10 * 10 AS from_pair,
               i.pair_index,
               i.user_message_id,
               i.assistant_message_id,
               count(*) OVER () AS n_pairs
        FROM compaction.indexed_pairs(p_conversation_id) AS i
    ),
    ranges AS (
        SELECT p.from_pair,
               -- unnest of the 10x2 array walks it row by row: [u0, a0, u1, a1, ...]
               ARRAY(SELECT pg_catalog.unnest(array_agg(
                   ARRAY[p.user_message_id, p.assistant_message_id] ORDER BY p.pair_index)))
                   AS source_message_ids
        FROM pairs AS p
        WHERE compaction.is_target(p.from_pair, p.n_pairs)
        GROUP BY p.from_pair
    )
    SELECT r.from_pair::int, (r.from_pair + 9)::int, r.source_message_ids,
           compaction.range_hash(r.source_message_ids)
    FROM ranges AS r
    ORDER BY r.from_pair
$$;
COMMENT ON FUNCTION compaction.plan_targets(text) IS
    'Ranges of 10 pairs the fixed window policy makes targets now (N >= 10k + 30), with their 20 source ids [u0, a0, ..., u9, a9] and source hash';

CREATE FUNCTION compaction.source_hash(p_conversation_id text, p_from_pair int)
RETURNS text
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT CASE WHEN count(*) = 10 THEN
               compaction.range_hash(ARRAY(SELECT pg_catalog.unnest(array_agg(
                   ARRAY[i.user_message_id, i.assistant_message_id] ORDER BY i.pair_index))))
           END
    FROM compaction.indexed_pairs(p_conversation_id) AS i
    WHERE p_from_pair >= 0
      AND p_from_pair % 10 = 0
      AND i.pair_index BETWEEN p_from_pair AND p_from_pair + 9
$$;
COMMENT ON FUNCTION compaction.source_hash(text, int) IS
    'SHA-256 (lowercase hex) binding pairs from_pair..from_pair+9 (ids and texts of both sides); NULL unless all 10 pairs exist and from_pair is a non-negative multiple of 10';

-- ==== sql/90_roles.sql ====
-- pycompactor stored logic, section 9 (last): ownership and privileges.
--
-- Engine objects belong to the NOLOGIN role compaction_owner (alembic's version table
-- excepted: it belongs to whoever migrates). Nobody holds EXECUTE through PUBLIC; each
-- role gets exactly what its job needs (docs/security.md).

CREATE PROCEDURE compaction.assign_ownership()
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_object record;
BEGIN
    EXECUTE 'ALTER SCHEMA compaction OWNER TO compaction_owner';
    EXECUTE 'ALTER SCHEMA compaction_source OWNER TO compaction_owner';
    FOR v_object IN
        SELECT c.oid::regclass AS name,
               CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind
        FROM pg_catalog.pg_class AS c
        WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
          AND c.relkind IN ('r', 'p', 'v', 'S')
          AND c.oid IS DISTINCT FROM pg_catalog.to_regclass('compaction.alembic_version')
          -- sequences owned by a column follow their table
          AND NOT (c.relkind = 'S' AND EXISTS (
                SELECT 1 FROM pg_catalog.pg_depend AS d
                WHERE d.objid = c.oid AND d.deptype IN ('a', 'i')))
    LOOP
        EXECUTE pg_catalog.format('ALTER %s %s OWNER TO compaction_owner', v_object.kind, v_object.name);
    END LOOP;
    FOR v_object IN
        SELECT p.oid::regprocedure AS name,
               CASE p.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END AS kind
        FROM pg_catalog.pg_proc AS p
        WHERE p.pronamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
    LOOP
        EXECUTE pg_catalog.format('ALTER %s %s OWNER TO compaction_owner', v_object.kind, v_object.name);
        EXECUTE pg_catalog.format('REVOKE ALL ON %s %s FROM PUBLIC', v_object.kind, v_object.name);
    END LOOP;
END
$$;
COMMENT ON PROCEDURE compaction.assign_ownership() IS
    'Migration step: hands every engine object to compaction_owner and revokes EXECUTE from PUBLIC (run by each migration)';

CALL compaction.assign_ownership();

GRANT USAGE ON SCHEMA compaction TO compaction_worker, compaction_reader, compaction_auditor;

GRANT EXECUTE ON FUNCTION
    compaction.indexed_pairs(text),
    compaction.eligible_pairs(text),
    compaction.range_hash(text[]),
    compaction.plan_targets(text),
    compaction.source_hash(text, int),
    compaction.explain_runs(text)
TO compaction_worker, compaction_reader;

GRANT SELECT ON compaction.source_runs, compaction.source_messages
TO compaction_worker, compaction_reader;

-- Metadata only: which runs form pairs and why not, never their text.
GRANT EXECUTE ON FUNCTION compaction.explain_runs(text) TO compaction_auditor;
