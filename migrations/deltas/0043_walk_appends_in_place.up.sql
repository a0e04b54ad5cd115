-- 0043_walk_appends_in_place: a projection's one statement does less for the same rows.
-- projection_read's walk collects the ids of the texts it sends one at a time, growing
-- its lists in place: it concatenated them (`v || slice`, `v || x || y`), which copies
-- the whole list at each step, the square of the texts a projection includes (about a
-- fifth of the statement at 1 MiB). And it reads the texts in its own statement, where
-- it called projection_texts, whose statement of its own stored each text row twice more
-- (a tenth at 1 MiB). distribute_on_citus changes in a comment only.

CREATE OR REPLACE FUNCTION compaction.projection_read(
    p_conversation_id text, p_scope text, p_pairs int, p_budget_bytes bigint,
    p_marker_bytes int)
RETURNS TABLE (
    derived               boolean,
    pair_count            int,
    first_pair            int,
    user_message_ids      text[],
    assistant_message_ids text[],
    user_bytes            int[],
    assistant_bytes       int[],
    summary_ids           bigint[],
    summary_from_pairs    int[],
    summary_reasons       text[],
    summary_bytes         int[],
    message_id            text,
    summary_id            bigint,
    content               text
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    f             record;
    -- The frame's arrays as variables of their own: PL/pgSQL subscripts those in place,
    -- where a record's field would be copied whole at every subscript.
    v_users       text[];
    v_assistants  text[];
    v_user_sizes  int[];
    v_sizes       int[];
    v_froms       int[];
    v_reasons     text[];
    v_ids         bigint[];
    v_bytes       int[];
    v_first       int;
    v_wanted      bigint := p_pairs;
    v_given       bigint;
    v_finished    boolean;
    v_remaining   bigint;
    v_index       int;
    v_start       int;
    v_at          int;
    v_chosen      int;
    v_cost        bigint;
    v_dropped     int := -1;
    v_message_ids text[] := '{}';
    v_summary_ids bigint[] := '{}';
BEGIN
    IF p_budget_bytes IS NULL OR p_budget_bytes < 0 THEN
        RAISE EXCEPTION 'p_budget_bytes must be 0 or more, got %', p_budget_bytes
            USING ERRCODE = 'CP020';
    END IF;
    IF p_marker_bytes IS NULL OR p_marker_bytes < 0 THEN
        RAISE EXCEPTION 'p_marker_bytes must be 0 or more, got %', p_marker_bytes
            USING ERRCODE = 'CP020';
    END IF;
    LOOP
        SELECT * INTO f FROM compaction.projection_frame(p_conversation_id, p_scope, v_wanted::int);
        v_users := f.user_message_ids;
        v_assistants := f.assistant_message_ids;
        v_user_sizes := f.user_bytes;
        v_sizes := f.assistant_bytes;
        v_froms := f.summary_from_pairs;
        v_reasons := f.summary_reasons;
        v_ids := f.summary_ids;
        v_bytes := f.summary_bytes;
        v_first := f.first_pair;
        v_remaining := p_budget_bytes;
        v_dropped := -1;
        v_message_ids := '{}';
        v_summary_ids := '{}';
        v_finished := true;
        -- Newest first. The verdicts come in from_pair order, so one cursor (v_chosen)
        -- moving down them finds each range's chosen summary (reason NULL, with its size).
        v_chosen := coalesce(pg_catalog.array_length(v_ids, 1), 0);
        v_index := f.pair_count - 1;
        WHILE v_index >= 0 LOOP
            IF v_index < v_first THEN
                v_finished := false;  -- the walk needs pairs older than the frame's
                EXIT;
            END IF;
            v_start := v_index - v_index % 10;
            WHILE v_chosen > 0 AND (v_froms[v_chosen] > v_start
                                    OR v_reasons[v_chosen] IS NOT NULL) LOOP
                v_chosen := v_chosen - 1;
            END LOOP;
            IF v_chosen > 0 AND v_froms[v_chosen] = v_start AND v_bytes[v_chosen] IS NOT NULL
               AND v_dropped <> v_start THEN
                -- The block: the range's user messages, then the summary message (marker
                -- line with the two pair numbers, newline, summary).
                v_at := v_start - v_first + 1;
                v_cost := p_marker_bytes::bigint + pg_catalog.length(v_start::text)
                          + pg_catalog.length((v_start + 9)::text) + 1 + v_bytes[v_chosen] + 16;
                FOR v_k IN v_at .. v_at + 9 LOOP
                    v_cost := v_cost + v_user_sizes[v_k] + 16;
                END LOOP;
                IF v_cost <= v_remaining THEN
                    v_remaining := v_remaining - v_cost;
                    -- One id at a time (revision 0043): `v := array_append(v, x)` grows
                    -- the variable in place, where `v || slice` or `v || x || y` copied
                    -- the whole list at every step (the square of the texts: a fifth of
                    -- a 1 MiB projection's statement).
                    FOR v_k IN v_at .. v_at + 9 LOOP
                        v_message_ids := pg_catalog.array_append(v_message_ids, v_users[v_k]);
                    END LOOP;
                    v_summary_ids := pg_catalog.array_append(v_summary_ids, v_ids[v_chosen]);
                    v_index := v_start - 1;
                    CONTINUE;
                END IF;
                v_dropped := v_start;  -- it does not fit: this range's raw pairs instead
            END IF;
            v_at := v_index - v_first + 1;
            v_cost := v_user_sizes[v_at]::bigint + v_sizes[v_at] + 32;
            EXIT WHEN v_cost > v_remaining;
            v_remaining := v_remaining - v_cost;
            v_message_ids := pg_catalog.array_append(v_message_ids, v_users[v_at]);
            v_message_ids := pg_catalog.array_append(v_message_ids, v_assistants[v_at]);
            v_index := v_index - 1;
        END LOOP;
        EXIT WHEN v_finished;
        -- Read further back, in this statement's snapshot: as many pairs as the whole
        -- budget would take at the rate it was spent, a quarter more, at least twice as
        -- many, in whole ranges (the driver's _next_read). The frame reaches pair 0 in
        -- the end, where every walk finishes.
        -- In numeric: the budget may be as large as a bigint. At least 10 more than
        -- given, so a frame of no pairs (p_pairs 0) steps back too.
        v_given := f.pair_count - v_first;
        v_wanted := least(greatest(2 * v_given, v_given + 10,
                                   pg_catalog.ceil(v_given::numeric * p_budget_bytes * 5
                                                   / (4 * greatest(p_budget_bytes - v_remaining, 1)))),
                          2147483640)::bigint;
        v_wanted := least(v_wanted + (10 - v_wanted % 10) % 10, 2147483640);
    END LOOP;
    RETURN QUERY SELECT f.derived, f.pair_count, f.first_pair, f.user_message_ids,
                        f.assistant_message_ids, f.user_bytes, f.assistant_bytes,
                        f.summary_ids, f.summary_from_pairs, f.summary_reasons,
                        f.summary_bytes, NULL::text, NULL::bigint, NULL::text;
    RETURN QUERY
        SELECT NULL::boolean, NULL::int, NULL::int, NULL::text[], NULL::text[], NULL::int[],
               NULL::int[], NULL::bigint[], NULL::int[], NULL::text[], NULL::int[],
               t.message_id, t.summary_id, t.content
        -- projection_texts' query, written out (revision 0043): through that function's
        -- statement of its own each text row was stored twice more (a tenth of a 1 MiB
        -- projection). Not shared as an inlined SQL function: no SQL-language function
        -- may read distributed tables, whose parameters Citus cannot plan (the rules in
        -- docs/operations.md, "Scaling out with Citus").
        FROM (SELECT m.message_id, NULL::bigint AS summary_id, m.content
              FROM pg_catalog.unnest(v_message_ids) AS i (message_id)
              CROSS JOIN LATERAL (
                  SELECT sm.message_id, sm.content
                  FROM compaction.source_messages AS sm
                  WHERE sm.conversation_id = p_conversation_id
                    AND sm.message_id = i.message_id
                  OFFSET 0) AS m
              UNION ALL
              SELECT NULL::text, s.summary_id, s.summary
              FROM compaction.summaries AS s
              WHERE s.conversation_id = p_conversation_id
                AND s.summary_id = ANY (v_summary_ids)) AS t;
END
$$;
COMMENT ON FUNCTION compaction.projection_read(text, text, int, bigint, int) IS
    'A projection''s reads in one statement: first projection_frame''s row for the newest p_pairs pairs or, when the budget walk gets past them, for as many more as it needs (text columns NULL), then (message_id, summary_id, content) of each message and summary the walk includes (frame columns NULL). p_marker_bytes: UTF-8 bytes of the summary marker line without its pair numbers';

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
    -- Revision 0042: from every table, not only the reference tables. A host's own
    -- tables tracked while the engine ran on one node keep their triggers when Citus
    -- distributes them, and every write to them then fails on the shards ("could not
    -- create distributed plan"); attach_source_tracking refuses on Citus from now on.
    FOR v_trigger IN
        SELECT t.tgname, t.tgrelid::regclass AS rel
        FROM pg_catalog.pg_trigger AS t
        WHERE t.tgfoid IN ('compaction.track_source_changes()'::regprocedure,
                           'compaction.source_enqueue()'::regprocedure)
          AND NOT t.tgisinternal
        ORDER BY t.tgrelid, t.tgname
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
    -- Revision 0038: a judgement's question to every shard of the messages runs on one
    -- connection per node. Its tasks are index probes of a few runs each; with more
    -- connections the executor opened new ones to the workers in most judgements (14 ms
    -- against 9.6 ms for a conversation of 100 runs on the loopback cluster, and the
    -- drain of `make bench-citus` took 7.4-9.2 s against 5.6-5.8 s).
    ALTER FUNCTION compaction.judge_runs(text, text[])
        SET citus.max_adaptive_executor_pool_size = 1;
    -- Revision 0041: judged from the views (always, on Citus) projection_read sends the
    -- texts in its own statement (through projection_texts until revision 0043), whose
    -- queries Citus can plan only with the values bound; on one node it forces generic
    -- plans.
    ALTER FUNCTION compaction.projection_read(text, text, int, bigint, int)
        RESET plan_cache_mode;
    CALL compaction.place_audit_views();
    CALL compaction.place_view_grants();
END
$$;
COMMENT ON PROCEDURE compaction.distribute_on_citus() IS
    'Citus: detaches the change-tracking and queue triggers from every table, distributes every engine table as compaction.citus_tables() says, then places the audit views and the reader''s and worker''s grants (run once, as a superuser, on the coordinator)';

-- On a distributed database projection_read plans with its values bound (revision 0041,
-- distribute_on_citus): the replacement above gave it back its SET clauses.
DO $$
BEGIN
    IF compaction.engine_distributed() THEN
        ALTER FUNCTION compaction.projection_read(text, text, int, bigint, int)
            RESET plan_cache_mode;
    END IF;
END
$$;

CALL compaction.assign_ownership();
