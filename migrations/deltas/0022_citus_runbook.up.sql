-- 0022_citus_runbook: on Citus, the auditor reads every audit view and an application's
-- own transaction may enqueue the conversations it wrote (issue 29).
--
-- The audit views over engine tables become facades over body views (*_rows); on a
-- distributed database they read through definer functions (read_audit_*), because
-- Citus runs a view's shard queries with the caller's rights. The queue leaves the
-- conversation co-location group: a transaction that wrote history with the
-- application's login could not then enqueue (the owner's) on co-located placements.
-- verify_conversation judges the conversation before it reads the derived state, so
-- that it runs on Citus.

CREATE VIEW compaction.audit_jobs_rows AS
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           j.created_at,
           a.attempt,
           a.state,
           a.reason,
           a.worker,
           a.started_at,
           a.lease_expires_at,
           a.finished_at,
           -- Rows written before revision 0007 may hold infinite times; no stored
           -- state may make this view fail.
           CASE WHEN pg_catalog.isfinite(a.finished_at) AND pg_catalog.isfinite(a.started_at)
                THEN a.finished_at - a.started_at END AS duration,
           a.finish_reason,
           a.tool_call_count,
           a.response_id,
           a.summary_chars,
           s.summary_id,
           false AS imported,
           a.input_tokens,
           a.output_tokens,
           a.figures_total,
           a.figures_kept,
           a.claimed_by
    FROM compaction.jobs AS j
    JOIN compaction.attempts AS a
      ON a.conversation_id = j.conversation_id AND a.job_id = j.job_id
    LEFT JOIN compaction.job_summaries AS s
      ON s.conversation_id = a.conversation_id AND s.job_id = a.job_id AND s.attempt = a.attempt
    UNION ALL
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           j.created_at,
           NULL::int,
           'imported'::text,
           NULL::text,
           NULL::text,
           NULL::timestamptz,
           NULL::timestamptz,
           s.completed_at,
           NULL::interval,
           NULL::text,
           NULL::int,
           NULL::text,
           pg_catalog.char_length(s.summary),
           s.summary_id,
           true,
           NULL::int,
           NULL::int,
           NULL::int,
           NULL::int,
           NULL::text
    FROM compaction.jobs AS j
    JOIN compaction.job_summaries AS s
      ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
    WHERE s.attempt IS NULL;
COMMENT ON VIEW compaction.audit_jobs_rows IS
    'Internal: the body of compaction.audit_jobs (granted to nobody)';

CREATE VIEW compaction.audit_exhausted_rows AS
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           max(a.reason) FILTER (WHERE a.attempt = 1) AS first_reason,
           max(a.reason) FILTER (WHERE a.attempt = 2) AS second_reason,
           max(a.finished_at) AS exhausted_at
    FROM compaction.jobs AS j
    JOIN compaction.attempts AS a
      ON a.conversation_id = j.conversation_id AND a.job_id = j.job_id
    WHERE a.state = 'failed'
      AND NOT EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                      WHERE s.conversation_id = j.conversation_id AND s.job_id = j.job_id)
    GROUP BY j.conversation_id, j.scope, j.from_pair, j.to_pair, j.job_id, j.source_hash,
             j.model, j.prompt_version
    HAVING count(*) >= 2;
COMMENT ON VIEW compaction.audit_exhausted_rows IS
    'Internal: the body of compaction.audit_exhausted (granted to nobody)';

CREATE VIEW compaction.audit_queue_rows AS
    SELECT q.scope,
           count(*) FILTER (WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS queued,
           count(*) FILTER (WHERE q.leased_until > pg_catalog.now()) AS leased,
           count(*) FILTER (WHERE q.leased_until <= pg_catalog.now()) AS expired_leases,
           min(q.enqueued_at) FILTER (
               WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS oldest_queued_at,
           pg_catalog.now() - min(q.enqueued_at) FILTER (
               WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS oldest_queued_age
    FROM compaction.queue AS q
    GROUP BY q.scope;
COMMENT ON VIEW compaction.audit_queue_rows IS
    'Internal: the body of compaction.audit_queue (granted to nobody)';

CREATE FUNCTION compaction.read_audit_jobs()
RETURNS TABLE (
        conversation_id text, scope text, from_pair int, to_pair int, job_id bigint,
        source_hash text, model text, prompt_version text, created_at timestamptz,
        attempt int, state text, reason text, worker text, started_at timestamptz,
        lease_expires_at timestamptz, finished_at timestamptz, duration interval,
        finish_reason text, tool_call_count int, response_id text, summary_chars int,
        summary_id bigint, imported boolean, input_tokens int, output_tokens int,
        figures_total int, figures_kept int, claimed_by text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_jobs_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_jobs() IS
    'Internal: the rows of audit_jobs with the owner''s rights (what the view reads on Citus)';

CREATE FUNCTION compaction.read_audit_exhausted()
RETURNS TABLE (
        conversation_id text, scope text, from_pair int, to_pair int, job_id bigint,
        source_hash text, model text, prompt_version text, first_reason text,
        second_reason text, exhausted_at timestamptz)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_exhausted_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_exhausted() IS
    'Internal: the rows of audit_exhausted with the owner''s rights (what the view reads on Citus)';

CREATE FUNCTION compaction.read_audit_queue()
RETURNS TABLE (
        scope text, queued bigint, leased bigint, expired_leases bigint,
        oldest_queued_at timestamptz, oldest_queued_age interval)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_queue_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_queue() IS
    'Internal: the rows of audit_queue with the owner''s rights (what the view reads on Citus)';

CREATE OR REPLACE VIEW compaction.audit_jobs AS SELECT * FROM compaction.audit_jobs_rows;
CREATE OR REPLACE VIEW compaction.audit_exhausted AS SELECT * FROM compaction.audit_exhausted_rows;
CREATE OR REPLACE VIEW compaction.audit_queue AS SELECT * FROM compaction.audit_queue_rows;

GRANT EXECUTE ON FUNCTION compaction.read_audit_jobs(), compaction.read_audit_exhausted(),
                          compaction.read_audit_queue()
TO compaction_auditor;

-- verify_conversation judges first, then compares: it runs on Citus too.
CREATE OR REPLACE FUNCTION compaction.verify_conversation(p_conversation_id text)
RETURNS TABLE (problem text, detail text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_ids     bigint[];
    v_scopes  text[];
    v_froms   int[];
    v_reasons text[];
    v_judged  jsonb;
    v_ranges  jsonb;
BEGIN
    -- Every summary judged now against the derived ranges (checked against the views
    -- below): the verdicts the derived state must hold.
    SELECT pg_catalog.array_agg(j.summary_id), pg_catalog.array_agg(j.scope),
           pg_catalog.array_agg(j.from_pair), pg_catalog.array_agg(j.reason)
    INTO v_ids, v_scopes, v_froms, v_reasons
    FROM compaction.judge_summaries(p_conversation_id, NULL) AS j;
    -- The pairs judged from the views and the full ranges' hashes, each in a statement
    -- that reads no engine table (revision 0022): on Citus a statement that reads a
    -- distributed table runs on the shard, where these functions cannot run theirs.
    SELECT coalesce(pg_catalog.jsonb_agg(pg_catalog.to_jsonb(j)), '[]')
    INTO v_judged
    FROM compaction.judged_pairs(p_conversation_id) AS j;
    SELECT coalesce(pg_catalog.jsonb_agg(pg_catalog.jsonb_build_object(
               'from_pair', g.from_pair, 'ids', g.ids,
               'hash', compaction.range_hash(p_conversation_id, g.ids))), '[]')
    INTO v_ranges
    FROM (SELECT j.pair_index / 10 * 10 AS from_pair,
                 ARRAY(SELECT pg_catalog.unnest(array_agg(
                     ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)))
                     AS ids
          FROM pg_catalog.jsonb_to_recordset(v_judged)
               AS j (pair_index int, user_message_id text, assistant_message_id text)
          GROUP BY j.pair_index / 10 * 10
          HAVING count(*) = 10) AS g;
    RETURN QUERY
        WITH judged AS (
            SELECT j.*
            FROM pg_catalog.jsonb_to_recordset(v_judged)
                 AS j (pair_index int, run_id text, user_seq bigint, user_message_id text,
                       user_bytes int, assistant_message_id text, assistant_bytes int)
        ), stored AS (
            SELECT p.* FROM compaction.pairs AS p WHERE p.conversation_id = p_conversation_id
        ), judged_ranges AS (
            SELECT r.from_pair, r.ids, r.hash
            FROM pg_catalog.jsonb_to_recordset(v_ranges) AS r (from_pair int, ids text[], hash text)
        ), stored_ranges AS (
            SELECT r.* FROM compaction.ranges AS r WHERE r.conversation_id = p_conversation_id
        ), counts AS (
            SELECT (SELECT count(*) FROM judged) AS judged,
                   (SELECT cs.pair_count FROM compaction.conversation_state AS cs
                    WHERE cs.conversation_id = p_conversation_id) AS stored
        )
        SELECT 'pair_count'::text,
               pg_catalog.format('judged %s pairs, derived state has %s', c.judged,
                                 coalesce(c.stored::text, 'no row'))
        FROM counts AS c
        WHERE c.judged <> coalesce(c.stored, 0)
        UNION ALL
        SELECT CASE WHEN s.run_id IS NULL THEN 'pair_missing'
                    WHEN j.run_id IS NULL THEN 'pair_extra'
                    ELSE 'pair_differs' END,
               pg_catalog.format('run %s: judged %s, derived %s',
                                 coalesce(j.run_id, s.run_id),
                                 CASE WHEN j.run_id IS NULL THEN 'no pair' ELSE pg_catalog.format(
                                     'pair %s (seq %s, user %s %s bytes, assistant %s %s bytes)',
                                     j.pair_index, j.user_seq, j.user_message_id, j.user_bytes,
                                     j.assistant_message_id, j.assistant_bytes) END,
                                 CASE WHEN s.run_id IS NULL THEN 'no pair' ELSE pg_catalog.format(
                                     'pair %s (seq %s, user %s %s bytes, assistant %s %s bytes)',
                                     s.pair_index, s.user_seq, s.user_message_id, s.user_bytes,
                                     s.assistant_message_id, s.assistant_bytes) END)
        FROM judged AS j
        FULL JOIN stored AS s ON s.run_id = j.run_id
        WHERE (j.pair_index, j.user_seq, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes)
              IS DISTINCT FROM
              (s.pair_index, s.user_seq, s.user_message_id, s.user_bytes,
               s.assistant_message_id, s.assistant_bytes)
        UNION ALL
        SELECT CASE WHEN s.from_pair IS NULL THEN 'range_missing'
                    WHEN j.from_pair IS NULL THEN 'range_extra'
                    WHEN j.ids IS DISTINCT FROM s.source_message_ids THEN 'range_ids_differ'
                    ELSE 'range_hash_differs' END,
               pg_catalog.format('pairs %s-%s: judged hash %s, derived hash %s',
                                 coalesce(j.from_pair, s.from_pair),
                                 coalesce(j.from_pair, s.from_pair) + 9,
                                 coalesce(j.hash, 'none'), coalesce(s.source_hash, 'none'))
        FROM judged_ranges AS j
        FULL JOIN stored_ranges AS s ON s.from_pair = j.from_pair
        WHERE (j.ids, j.hash) IS DISTINCT FROM (s.source_message_ids, s.source_hash)
        UNION ALL
        SELECT CASE WHEN s.summary_id IS NULL THEN 'verdict_missing'
                    WHEN j.summary_id IS NULL THEN 'verdict_extra'
                    ELSE 'verdict_differs' END,
               pg_catalog.format('summary %s (scope %s, pairs %s-%s): judged %s, derived %s',
                                 coalesce(j.summary_id, s.summary_id),
                                 coalesce(j.scope, s.scope),
                                 coalesce(j.from_pair, s.from_pair),
                                 coalesce(j.from_pair, s.from_pair) + 9,
                                 CASE WHEN j.summary_id IS NULL THEN 'no summary'
                                      ELSE coalesce(j.reason, 'used') END,
                                 CASE WHEN s.summary_id IS NULL THEN 'no verdict'
                                      ELSE coalesce(s.reason, 'used') END)
        FROM ROWS FROM (pg_catalog.unnest(v_ids), pg_catalog.unnest(v_scopes),
                        pg_catalog.unnest(v_froms), pg_catalog.unnest(v_reasons))
             AS j (summary_id, scope, from_pair, reason)
        FULL JOIN (SELECT v.* FROM compaction.summary_verdicts AS v
                   WHERE v.conversation_id = p_conversation_id) AS s
          ON s.summary_id = j.summary_id
        WHERE (j.scope, j.from_pair, j.reason) IS DISTINCT FROM (s.scope, s.from_pair, s.reason)
        ORDER BY 1, 2;
END
$$;
DROP FUNCTION compaction.citus_tables();
CREATE FUNCTION compaction.citus_tables()
RETURNS TABLE (table_name text, placement text, step int, colocation text)
LANGUAGE sql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    -- In distribution order: reference tables first (distributed tables refer to them),
    -- then each distributed table after the tables its foreign keys name. The queue is
    -- distributed apart from the other tables (revision 0022): an application's
    -- transaction that writes its history, with its own login, and then calls
    -- compaction.enqueue (the owner's) may not touch placements co-located with the ones
    -- it wrote as another user, and no statement joins the queue with another table.
    VALUES ('compaction.settings', 'reference', 1, NULL),
           ('compaction.prompt_versions', 'reference', 2, NULL),
           ('compaction.admission', 'reference', 3, NULL),
           ('compaction.source_tracking', 'reference', 4, NULL),
           ('compaction_source.conversations', 'distributed', 5, 'conversation'),
           ('compaction_source.runs', 'distributed', 6, 'conversation'),
           ('compaction_source.messages', 'distributed', 7, 'conversation'),
           ('compaction.jobs', 'distributed', 8, 'conversation'),
           ('compaction.attempts', 'distributed', 9, 'conversation'),
           ('compaction.job_summaries', 'distributed', 10, 'conversation'),
           ('compaction.audit_events', 'distributed', 11, 'conversation'),
           ('compaction.queue', 'distributed', 12, 'queue'),
           ('compaction.conversation_state', 'distributed', 13, 'conversation'),
           ('compaction.pairs', 'distributed', 14, 'conversation'),
           ('compaction.ranges', 'distributed', 15, 'conversation'),
           ('compaction.summary_verdicts', 'distributed', 16, 'conversation'),
           ('compaction.conversation_locks', 'distributed', 17, 'conversation')
$$;
COMMENT ON FUNCTION compaction.citus_tables() IS
    'Every engine table with its Citus placement (distributed by conversation_id, or reference), the order compaction.distribute_on_citus() applies them in, and the co-location group of a distributed table (conversation, or queue alone)';

-- The audit views over engine tables are facades (sql/50_audit.sql): over their bodies
-- on one node, through the definer functions read_audit_* once the tables are
-- distributed. Called by distribute_on_citus and by every migration that changes an
-- audit view, so that an upgrade keeps each database's form.
CREATE PROCEDURE compaction.place_audit_views()
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_distributed boolean := false;
BEGIN
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition
                                WHERE logicalrelid = ''compaction.jobs''::regclass)'
            INTO v_distributed;
    END IF;
    IF v_distributed THEN
        CREATE OR REPLACE VIEW compaction.audit_jobs AS
            SELECT * FROM compaction.read_audit_jobs();
        CREATE OR REPLACE VIEW compaction.audit_exhausted AS
            SELECT * FROM compaction.read_audit_exhausted();
        CREATE OR REPLACE VIEW compaction.audit_queue AS
            SELECT * FROM compaction.read_audit_queue();
    ELSE
        CREATE OR REPLACE VIEW compaction.audit_jobs AS
            SELECT * FROM compaction.audit_jobs_rows;
        CREATE OR REPLACE VIEW compaction.audit_exhausted AS
            SELECT * FROM compaction.audit_exhausted_rows;
        CREATE OR REPLACE VIEW compaction.audit_queue AS
            SELECT * FROM compaction.audit_queue_rows;
    END IF;
END
$$;
COMMENT ON PROCEDURE compaction.place_audit_views() IS
    'Migration and Citus step: points the audit views at their bodies (one node) or at the definer functions read_audit_* (Citus, where a view''s shard queries run with the caller''s rights)';

CREATE OR REPLACE PROCEDURE compaction.distribute_on_citus()
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_table   record;
    v_trigger record;
    v_first     text;
    v_fk        record;
    v_restore   text[] := '{}';
    v_statement text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_extension AS e WHERE e.extname = 'citus') THEN
        RAISE EXCEPTION 'Citus is not installed in database %', pg_catalog.current_database()
            USING ERRCODE = 'CP020', HINT = 'CREATE EXTENSION citus; on the coordinator first.';
    END IF;
    -- The guards and truncate triggers only read their own row: safe on shards, but Citus
    -- wants to be told so.
    IF pg_catalog.current_setting('citus.enable_unsafe_triggers', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'citus.enable_unsafe_triggers must be on for the engine''s row guards'
            USING ERRCODE = 'CP020',
                  HINT = 'ALTER SYSTEM SET citus.enable_unsafe_triggers = on on every node, then reload.';
    END IF;
    -- The source tables' statement triggers (change tracking, DESIGN §2, and the queue)
    -- read transition tables, which Citus does not give triggers on shards: detached.
    -- The engine then judges from the views on the node that holds each conversation
    -- (exact, slower), and writers call compaction.enqueue (or workers run --sweep).
    FOR v_trigger IN
        SELECT t.tgname, t.tgrelid::regclass AS rel
        FROM pg_catalog.pg_trigger AS t
        WHERE t.tgrelid IN (pg_catalog.to_regclass('compaction_source.runs'),
                            pg_catalog.to_regclass('compaction_source.messages'))
          AND t.tgfoid IN ('compaction.track_source_changes()'::regprocedure,
                           'compaction.source_enqueue()'::regprocedure)
    LOOP
        EXECUTE pg_catalog.format('DROP TRIGGER %I ON %s', v_trigger.tgname, v_trigger.rel);
    END LOOP;
    -- Foreign keys go first and come back last: Citus distributes a table only when no
    -- local table refers to it, and turns a local table that refers to a reference table
    -- into a Citus-local one (dropping views on it) instead of leaving it for later.
    -- Sequential mode lets the same transaction add them back on the shards.
    EXECUTE 'SET LOCAL citus.multi_shard_modify_mode = sequential';
    FOR v_fk IN
        SELECT c.conrelid::regclass AS rel, c.conname, pg_catalog.pg_get_constraintdef(c.oid) AS def
        FROM pg_catalog.pg_constraint AS c
        WHERE c.contype = 'f'
          AND c.conrelid IN (SELECT ct.table_name::regclass FROM compaction.citus_tables() AS ct)
        ORDER BY c.conrelid, c.conname
    LOOP
        v_restore := v_restore || pg_catalog.format('ALTER TABLE %s ADD CONSTRAINT %I %s',
                                                    v_fk.rel, v_fk.conname, v_fk.def);
        EXECUTE pg_catalog.format('ALTER TABLE %s DROP CONSTRAINT %I', v_fk.rel, v_fk.conname);
    END LOOP;
    FOR v_table IN SELECT ct.table_name, ct.placement, ct.step, ct.colocation
                   FROM compaction.citus_tables() AS ct ORDER BY ct.step LOOP
        IF v_table.placement = 'reference' THEN
            EXECUTE 'SELECT create_reference_table($1)' USING v_table.table_name::regclass;
        ELSE
            -- With the first table of its group; the first of the conversation group
            -- joins the host's own tables of the default group, the queue joins none.
            v_first := (SELECT ct.table_name FROM compaction.citus_tables() AS ct
                        WHERE ct.colocation = v_table.colocation AND ct.step < v_table.step
                        ORDER BY ct.step LIMIT 1);
            EXECUTE 'SELECT create_distributed_table($1, ''conversation_id'', colocate_with => $2)'
                USING v_table.table_name::regclass,
                      coalesce(v_first, CASE v_table.colocation WHEN 'queue' THEN 'none'
                                                                ELSE 'default' END);
        END IF;
    END LOOP;
    FOREACH v_statement IN ARRAY v_restore LOOP
        EXECUTE v_statement;
    END LOOP;
    -- judge_runs keeps one generic plan on a single node (planning per call costs more
    -- than running); Citus can plan its queries only with the values bound.
    ALTER FUNCTION compaction.judge_runs(text, text[]) RESET plan_cache_mode;
    CALL compaction.place_audit_views();
END
$$;
COMMENT ON PROCEDURE compaction.distribute_on_citus() IS
    'Citus: detaches the source tables'' statement triggers and distributes every engine table as compaction.citus_tables() says (run once, as a superuser, on the coordinator)';

-- A database distributed before this revision: the queue leaves the conversation group
-- (Citus changes only its metadata: the queue's shards stay where they are) and the
-- audit views read through the definer functions.
DO $$
BEGIN
    IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition AS p
                   WHERE p.logicalrelid = 'compaction.queue'::regclass) THEN
            EXECUTE 'SELECT update_distributed_table_colocation(''compaction.queue'', colocate_with => ''none'')';
        END IF;
    END IF;
END
$$;
CALL compaction.place_audit_views();

CALL compaction.assign_ownership();
