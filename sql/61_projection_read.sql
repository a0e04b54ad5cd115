-- pycompactor stored logic, section 6 continued: the reads a projection starts with
-- (judged_frame, projection_frame, projection_read); the summaries' verdicts and texts
-- they use are in 60_projection.sql.

-- projection_frame's row judged from the views (before an install's
-- rebuild has finished, after a source view is re-pointed, and always on Citus), from one
-- judgement of the conversation. The judgement reads every pair anyway, so the frame
-- holds them all (first_pair 0: a walk never reads again), and each summary of the scope
-- gets the verdict judge_summaries gives it from the derived state, in contract §9's
-- order, against the ranges judged here. Only the ranges whose current ids are those of
-- a projectable summary are hashed: the other summaries are not projectable or stale
-- whatever the texts say. (Reading the pairs through indexed_pairs and then the
-- verdicts' inputs through projection_summaries took two judgements, in four round
-- trips after projection_read's.) Each statement that calls
-- an engine function stands alone (contract §11); between statements the arrays are zipped
-- by unnest, never subscripted in a query, where a subscript walks a text[] from its
-- start.
CREATE FUNCTION compaction.judged_frame(p_conversation_id text, p_scope text)
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
    summary_bytes         int[]
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Not the generic plans of projection_frame, its caller: the functions this one calls
-- keep the planning they had when the driver called them (on Citus judge_runs has no
-- setting of its own, and Citus plans a query only with its values bound).
SET plan_cache_mode = auto
AS $$
#variable_conflict use_column
DECLARE
    v_users       text[];
    v_assistants  text[];
    v_user_sizes  int[];
    v_sizes       int[];
    -- The scope's summaries, in (from_pair, summary_id) order; v_stored_ids holds their
    -- 20 ids each (n x 20: a stored summary has exactly 20, jobs_valid_source_ids).
    v_summary_ids bigint[];
    v_froms       int[];
    v_stored_ids  text[];
    v_hashes      text[];
    v_projectable boolean[];
    v_ranks       int[];
    v_model_ranks int[];
    v_models      text[] := (SELECT st.projection_models FROM compaction.settings AS st);
    v_completed   timestamptz[];
    v_bytes       int[];
    -- Per summary, whether its range exists now with its 20 ids; the ranges to hash.
    v_same_ids    boolean[];
    v_hash_froms  int[];
    v_hash_ids    text[];
    v_now_froms   int[];
    v_now_hashes  text[];
BEGIN
    -- The one judgement: every eligible pair, in order.
    SELECT pg_catalog.array_agg(j.user_message_id), pg_catalog.array_agg(j.assistant_message_id),
           pg_catalog.array_agg(j.user_bytes), pg_catalog.array_agg(j.assistant_bytes)
    INTO v_users, v_assistants, v_user_sizes, v_sizes
    FROM (SELECT q.user_message_id, q.assistant_message_id, q.user_bytes, q.assistant_bytes
          FROM compaction.judged_pairs(p_conversation_id) AS q
          ORDER BY q.pair_index) AS j;
    -- The scope's summaries, what judge_summaries reads of them.
    SELECT pg_catalog.array_agg(s.summary_id), pg_catalog.array_agg(s.from_pair),
           pg_catalog.array_agg(s.source_message_ids), pg_catalog.array_agg(s.source_hash),
           pg_catalog.array_agg(s.projectable), pg_catalog.array_agg(s.version_rank),
           pg_catalog.array_agg(s.model_rank),
           pg_catalog.array_agg(s.completed_at), pg_catalog.array_agg(s.bytes)
    INTO v_summary_ids, v_froms, v_stored_ids, v_hashes, v_projectable, v_ranks,
         v_model_ranks, v_completed, v_bytes
    FROM (SELECT x.summary_id, x.from_pair, x.source_message_ids, x.source_hash,
                 coalesce(v.projectable, false) AS projectable,
                 -- The version's number after '@', higher preferred; -1 without one.
                 coalesce(pg_catalog.substring(x.prompt_version, '@([0-9]{1,9})$')::int, -1)
                     AS version_rank,
                 -- The owner's model preference, higher preferred.
                 compaction.model_preference(x.model, v_models) AS model_rank,
                 x.completed_at, pg_catalog.octet_length(x.summary) AS bytes
          FROM compaction.summaries AS x
          LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = x.prompt_version
          WHERE x.conversation_id = p_conversation_id AND x.scope = p_scope
          ORDER BY x.from_pair, x.summary_id) AS s;
    -- Which summaries' ranges exist now with their ids, and the ranges whose hash decides
    -- a verdict (a projectable summary's, with its ids), each once, with its 20 ids.
    WITH pairs AS (
        SELECT p.k - 1 AS pair_index, p.user_id, p.assistant_id
        FROM ROWS FROM (pg_catalog.unnest(v_users), pg_catalog.unnest(v_assistants))
             WITH ORDINALITY AS p (user_id, assistant_id, k)
    ), ranges AS (
        -- The current ids of the ranges that have summaries, only.
        SELECT (q.pair_index / 10 * 10)::int AS from_pair,
               pg_catalog.array_agg(x.id ORDER BY q.pair_index, x.n) AS ids
        FROM pairs AS q
        CROSS JOIN LATERAL (VALUES (1, q.user_id), (2, q.assistant_id)) AS x (n, id)
        WHERE (q.pair_index / 10 * 10)::int = ANY (v_froms)
        GROUP BY 1
        HAVING count(*) = 20
    ), compared AS MATERIALIZED (
        SELECT u.k, u.from_pair, u.projectable, r.ids,
               coalesce(r.ids = g.ids, false) AS same_ids
        FROM ROWS FROM (pg_catalog.unnest(v_froms), pg_catalog.unnest(v_projectable))
             WITH ORDINALITY AS u (from_pair, projectable, k)
        JOIN compaction.id_ranges(ARRAY(SELECT pg_catalog.unnest(v_stored_ids))) AS g
          ON g.k = u.k
        LEFT JOIN ranges AS r ON r.from_pair = u.from_pair
    ), hashed AS (
        SELECT DISTINCT ON (c.from_pair) c.from_pair, c.ids
        FROM compared AS c
        WHERE c.projectable AND c.same_ids
        ORDER BY c.from_pair
    )
    SELECT (SELECT pg_catalog.array_agg(c.same_ids ORDER BY c.k) FROM compared AS c),
           (SELECT pg_catalog.array_agg(h.from_pair ORDER BY h.from_pair) FROM hashed AS h),
           (SELECT pg_catalog.array_agg(e.id ORDER BY h.from_pair, e.n)
            FROM hashed AS h
            CROSS JOIN LATERAL pg_catalog.unnest(h.ids) WITH ORDINALITY AS e (id, n))
    INTO v_same_ids, v_hash_froms, v_hash_ids;
    SELECT pg_catalog.array_agg(h.from_pair), pg_catalog.array_agg(h.source_hash)
    INTO v_now_froms, v_now_hashes
    FROM compaction.range_hashes(p_conversation_id, v_hash_froms, v_hash_ids) AS h;
    -- The verdicts: judge_summaries' rule, against the ranges judged above.
    RETURN QUERY
    WITH judged AS (
        SELECT u.summary_id, u.from_pair, u.version_rank, u.model_rank, u.completed_at,
               u.bytes,
               CASE WHEN NOT u.projectable THEN 'version_not_projectable'
                    WHEN NOT coalesce(u.same_ids AND h.source_hash = u.source_hash, false)
                        THEN 'stale_source' END AS reason
        FROM ROWS FROM (pg_catalog.unnest(v_summary_ids), pg_catalog.unnest(v_froms),
                        pg_catalog.unnest(v_hashes), pg_catalog.unnest(v_projectable),
                        pg_catalog.unnest(v_ranks), pg_catalog.unnest(v_model_ranks),
                        pg_catalog.unnest(v_completed),
                        pg_catalog.unnest(v_bytes), pg_catalog.unnest(v_same_ids))
             AS u (summary_id, from_pair, source_hash, projectable, version_rank,
                   model_rank, completed_at, bytes, same_ids)
        LEFT JOIN ROWS FROM (pg_catalog.unnest(v_now_froms), pg_catalog.unnest(v_now_hashes))
             AS h (from_pair, source_hash) ON h.from_pair = u.from_pair
    ), verdicts AS (
        SELECT j.summary_id, j.from_pair,
               CASE WHEN j.reason IS NULL
                         AND pg_catalog.row_number() OVER (
                                 PARTITION BY j.from_pair, j.reason IS NULL
                                 ORDER BY j.version_rank DESC, j.model_rank DESC,
                                          j.completed_at DESC, j.summary_id DESC) > 1
                    THEN 'superseded' ELSE j.reason END AS reason,
               j.bytes
        FROM judged AS j
    ), listed AS (
        -- In (from_pair, summary_id) order, as projection_frame gives them; a size only
        -- for the summary a range uses.
        SELECT pg_catalog.array_agg(o.summary_id) AS ids,
               pg_catalog.array_agg(o.from_pair) AS froms,
               pg_catalog.array_agg(o.reason) AS reasons,
               pg_catalog.array_agg(o.bytes) AS sizes
        FROM (SELECT v.summary_id, v.from_pair, v.reason,
                     CASE WHEN v.reason IS NULL THEN v.bytes END AS bytes
              FROM verdicts AS v
              ORDER BY v.from_pair, v.summary_id) AS o
    )
    SELECT false, coalesce(pg_catalog.cardinality(v_users), 0), 0,
           coalesce(v_users, '{}'), coalesce(v_assistants, '{}'),
           coalesce(v_user_sizes, '{}'), coalesce(v_sizes, '{}'),
           coalesce(l.ids, '{}'), coalesce(l.froms, '{}'), coalesce(l.reasons, '{}'),
           coalesce(l.sizes, '{}')
    FROM listed AS l;
END
$$;
COMMENT ON FUNCTION compaction.judged_frame(text, text) IS
    'Internal: projection_frame''s row judged from the views in one judgement: every eligible pair (first_pair 0) and every summary''s verdict of the scope, derived = false';

-- projection_frame's row read from the derived state, for a caller that has asked
-- derived_state_serves in its snapshot: projection_frame, and projection_read, which asks
-- it once however many frames its walk reads (on Citus each asking reads the record of
-- foreign messages on every shard). No SECURITY DEFINER and no SET clause: only the
-- engine's owner may execute it, and it runs under its callers' settings.
CREATE FUNCTION compaction.derived_frame(p_conversation_id text, p_scope text, p_pairs int)
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
    summary_bytes         int[]
)
LANGUAGE plpgsql
STABLE
AS $$
#variable_conflict use_column
BEGIN
    -- The pair count and the frame in one statement: on Citus each statement is a round
    -- trip to the conversation's node.
    RETURN QUERY
    WITH bounds AS (
        SELECT c.n AS frame_count,
               greatest(0, c.n - p_pairs) - greatest(0, c.n - p_pairs) % 10 AS frame_first
        FROM (SELECT coalesce((SELECT cs.pair_count
                               FROM compaction.conversation_state AS cs
                               WHERE cs.conversation_id = p_conversation_id), 0) AS n) AS c
    ), suffix AS (
        -- The four arrays take the rows in the subquery's order, read in index order
        -- (an ORDER BY in each aggregate would sort them four times).
        SELECT pg_catalog.array_agg(p.user_message_id) AS users,
               pg_catalog.array_agg(p.assistant_message_id) AS assistants,
               pg_catalog.array_agg(p.user_bytes) AS user_sizes,
               pg_catalog.array_agg(p.assistant_bytes) AS assistant_sizes
        FROM (SELECT q.user_message_id, q.assistant_message_id, q.user_bytes, q.assistant_bytes
              FROM compaction.pairs AS q
              WHERE q.conversation_id = p_conversation_id
                AND q.pair_index >= (SELECT b.frame_first FROM bounds AS b)
              ORDER BY q.pair_index) AS p
    ), verdicts AS (
        -- One sort for the four arrays: they take the rows in the subquery's order (an
        -- ORDER BY in each aggregate sorted them four times). The driver checks the order
        -- all the same.
        SELECT pg_catalog.array_agg(o.summary_id) AS ids,
               pg_catalog.array_agg(o.from_pair) AS froms,
               pg_catalog.array_agg(o.reason) AS reasons,
               pg_catalog.array_agg(o.bytes) AS sizes
        FROM (SELECT v.summary_id, v.from_pair, v.reason, NULL::int AS bytes
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
                AND v.reason IS NOT NULL
              UNION ALL
              SELECT v.summary_id, v.from_pair, NULL::text,
                     (SELECT pg_catalog.octet_length(js.summary)
                      FROM compaction.job_summaries AS js
                      WHERE js.conversation_id = p_conversation_id
                        AND js.summary_id = v.summary_id)
              FROM compaction.summary_verdicts AS v
              WHERE v.conversation_id = p_conversation_id AND v.scope = p_scope
                AND v.reason IS NULL AND v.from_pair >= (SELECT b.frame_first FROM bounds AS b)
              ORDER BY 2, 1) AS o
    )
    SELECT true, b.frame_count, b.frame_first,
           coalesce(x.users, '{}'), coalesce(x.assistants, '{}'),
           coalesce(x.user_sizes, '{}'), coalesce(x.assistant_sizes, '{}'),
           coalesce(y.ids, '{}'), coalesce(y.froms, '{}'), coalesce(y.reasons, '{}'),
           coalesce(y.sizes, '{}')
    FROM bounds AS b CROSS JOIN suffix AS x CROSS JOIN verdicts AS y;
END
$$;
COMMENT ON FUNCTION compaction.derived_frame(text, text, int) IS
    'Internal: projection_frame''s row from the derived state, for a caller that found derived_state_serves true in its snapshot';

-- The projection's one read: what the walk needs from the newest pairs
-- back, and the verdicts it needs, in one statement, so a projection costs one round trip
-- (projection_read) and, while the derived state is in use, grows with the budget rather
-- than with the history. Pair metadata comes only for the newest p_pairs pairs (rounded
-- to whole ranges); the walk asks again for more when it gets past them. The verdicts
-- are every rejected summary's, wherever its range lies (contract §9: only
-- did_not_fit depends on the budget), and the chosen summaries' of the ranges those pairs
-- cover, with their byte length: a chosen summary beyond the walk's reach is not tried,
-- so not listed. They come in (from_pair, summary_id) order (the aggregates follow the
-- sorted subquery; the driver checks it and sorts if not). While the derived state is not
-- in use, the row is judged_frame's: derived is false, and every pair
-- and every verdict is given, judged from the views.
CREATE FUNCTION compaction.projection_frame(p_conversation_id text, p_scope text, p_pairs int)
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
    summary_bytes         int[]
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One plan for every call: the statements are lookups by key whatever the conversation,
-- and planning them afresh cost more than running them.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    IF p_pairs IS NULL OR p_pairs < 0 THEN
        RAISE EXCEPTION 'p_pairs must be 0 or more, got %', p_pairs USING ERRCODE = 'CP020';
    END IF;
    IF NOT compaction.derived_state_serves(p_conversation_id) THEN
        RETURN QUERY SELECT * FROM compaction.judged_frame(p_conversation_id, p_scope);
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM compaction.derived_frame(p_conversation_id, p_scope, p_pairs);
END
$$;
COMMENT ON FUNCTION compaction.projection_frame(text, text, int) IS
    'What a projection plans from, in one row: the pair count, the metadata of the newest p_pairs pairs (from first_pair, whole ranges; no text), every rejected summary of the conversation and scope with its reason (version_not_projectable, stale_source, superseded), and the chosen summary (reason NULL) of each range those pairs cover with its UTF-8 byte length; while the derived state is not in use, derived = false and every pair and verdict, judged from the views (first_pair 0)';

-- The projection in one statement: the frame, then the texts of what the
-- budget walk includes, so a projection is one round trip in one snapshot (the
-- statement's own: an autocommit caller needs no transaction for it). When the walk gets
-- past the frame's pairs, the frame is read again further back within the statement. The
-- walk here is pycompactor.projection._walk's twin (and the step back _next_read's), used
-- only to choose which texts to send: the driver walks the returned frame itself and, if
-- a text it needs is not among these, reads again in a snapshot of its own; so a
-- difference between the two walks costs a read, never a different projection (a test
-- holds them equal). p_marker_bytes is the UTF-8 size of the driver's summary marker line
-- without its two pair numbers: the rendering is the driver's, only its size is needed.
-- Judged from the views, the frame holds every pair, so the walk finishes
-- on the first frame and the whole projection is still this one statement.
CREATE FUNCTION compaction.projection_read(
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
    v_serves      boolean;
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
        IF NOT coalesce(v_serves, false) THEN
            SELECT * INTO f FROM compaction.projection_frame(p_conversation_id, p_scope, v_wanted::int);
            v_serves := f.derived;
        ELSE
            -- A step back: the derived state served the first frame in this snapshot.
            SELECT * INTO f FROM compaction.derived_frame(p_conversation_id, p_scope, v_wanted::int);
        END IF;
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
                    -- One id at a time: `v := array_append(v, x)` grows
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
        -- projection_texts' query, written out: through that function's
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
