-- pycompactor stored logic, section 6: reads behind projection (Python pycompactor.projection).
--
-- project_history plans from metadata and reads text only for what it includes: the
-- eligible pairs come from compaction.indexed_pairs (ids and byte lengths, no text),
-- projection_summaries returns every summary's binding and whether its source is current
-- (compared with the derived ranges, no hashing at read time), and projection_texts
-- returns the texts of the messages and summaries named. All run as the engine owner
-- (SECURITY DEFINER): the source views run with their owner's rights anyway, and the
-- summaries sit behind engine tables.
--
-- This file holds the summaries' verdicts and texts and the owner's model preference;
-- the frame reads (judged_frame, projection_frame, projection_read) are in
-- 61_projection_read.sql.

-- The owner's model preference (contract §9) as a number, higher
-- preferred, like the version's rank: among a range's valid summaries of one version, a
-- model named earlier in settings.projection_models before one named later, named before
-- unnamed (0). SQL, immutable and without SET clauses, so the planner inlines it into
-- the window orders of judge_summaries and judged_frame.
CREATE FUNCTION compaction.model_preference(p_model text, p_models text[])
RETURNS int
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT coalesce(pg_catalog.cardinality(p_models) + 1
                    - pg_catalog.array_position(p_models, p_model), 0)
$$;
COMMENT ON FUNCTION compaction.model_preference(text, text[]) IS
    'Internal: a model''s rank in the owner''s projection preference, higher preferred: cardinality + 1 - its position in p_models, 0 when not named (contract §9)';

CREATE FUNCTION compaction.projection_summaries(p_conversation_id text, p_scope text)
RETURNS TABLE (
    summary_id         bigint,
    from_pair          int,
    to_pair            int,
    source_message_ids text[],
    source_hash        text,
    prompt_version     text,
    projectable        boolean,
    completed_at       timestamptz,
    summary_bytes      int,
    source_current     boolean,
    version_rank       int,
    model_rank         int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_derived boolean := compaction.derived_state_serves(p_conversation_id);
    v_ranges  int[];
    v_from    int[];
    v_ids     text[];
    v_hashes  text[];
    v_models  text[] := (SELECT st.projection_models FROM compaction.settings AS st);
BEGIN
    -- source_current: the range exists now with exactly the stored ids and hash. From the
    -- derived state that is a comparison per summary. Judged from the views, one call
    -- of current_ranges judges the conversation once for every summarized range
    -- (not current_range per range, a whole judgement each, whose cost grew with the
    -- square of the conversation's length), in a
    -- statement of its own (contract §11: no engine function nested in a query on
    -- distributed tables).
    IF NOT v_derived THEN
        SELECT pg_catalog.array_agg(DISTINCT s.from_pair) INTO v_ranges
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id AND s.scope = p_scope;
    END IF;
    IF v_ranges IS NOT NULL THEN
        SELECT pg_catalog.array_agg(c.from_pair ORDER BY c.from_pair),
               ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(
                   c.source_message_ids ORDER BY c.from_pair))),
               pg_catalog.array_agg(c.source_hash ORDER BY c.from_pair)
        INTO v_from, v_ids, v_hashes
        FROM compaction.current_ranges(p_conversation_id, v_ranges) AS c
        WHERE c.source_hash IS NOT NULL;
    END IF;
    RETURN QUERY
    WITH summaries AS (
        SELECT s.summary_id, s.from_pair, s.to_pair, s.source_message_ids, s.source_hash,
               s.prompt_version, s.model, s.completed_at,
               pg_catalog.octet_length(s.summary) AS bytes
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.scope = p_scope
    ), now_ranges AS (
        SELECT r.from_pair, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        WHERE v_derived AND r.conversation_id = p_conversation_id
          AND r.from_pair IN (SELECT x.from_pair FROM summaries AS x)
        UNION ALL
        SELECT u.from_pair, g.ids, u.source_hash
        FROM ROWS FROM (pg_catalog.unnest(v_from), pg_catalog.unnest(v_hashes))
             WITH ORDINALITY AS u (from_pair, source_hash, k)
        JOIN compaction.id_ranges(v_ids) AS g ON g.k = u.k
        WHERE NOT v_derived
    )
    SELECT s.summary_id,
           s.from_pair,
           s.to_pair,
           s.source_message_ids,
           s.source_hash,
           s.prompt_version,
           -- A version missing from prompt_versions is never projected.
           COALESCE(v.projectable, false),
           s.completed_at,
           s.bytes,
           coalesce(n.source_message_ids = s.source_message_ids
                    AND n.source_hash = s.source_hash, false),
           -- Preference among a range's projectable summaries: the
           -- version's number after '@', higher first; -1 for a version without one.
           coalesce(pg_catalog.substring(s.prompt_version, '@([0-9]{1,9})$')::int, -1),
           -- Then the owner's model preference, higher first.
           compaction.model_preference(s.model, v_models)
    FROM summaries AS s
    LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = s.prompt_version
    LEFT JOIN now_ranges AS n ON n.from_pair = s.from_pair
    ORDER BY s.from_pair, s.summary_id;
END
$$;
COMMENT ON FUNCTION compaction.projection_summaries(text, text) IS
    'Completed summaries of a conversation and scope without their text: source binding, version, whether it is projectable, completed_at, UTF-8 byte length, whether its source is current, the version''s rank (the number after @, -1 without one; higher is preferred) and the model''s rank in settings.projection_models (higher is preferred, 0 when not named)';

CREATE FUNCTION compaction.projection_texts(
    p_conversation_id text, p_message_ids text[], p_summary_ids bigint[])
RETURNS TABLE (message_id text, summary_id bigint, content text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
        -- By primary key, one probe per id (OFFSET 0 keeps the probe a probe on a table
        -- without statistics): only the rows named are read, however long the
        -- conversation.
        SELECT m.message_id, NULL::bigint, m.content
        FROM pg_catalog.unnest(p_message_ids) AS i (message_id)
        CROSS JOIN LATERAL (
            SELECT sm.message_id, sm.content
            FROM compaction.source_messages AS sm
            WHERE sm.conversation_id = p_conversation_id AND sm.message_id = i.message_id
            OFFSET 0) AS m
        UNION ALL
        SELECT NULL::text, s.summary_id, s.summary
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.summary_id = ANY (p_summary_ids);
END
$$;
COMMENT ON FUNCTION compaction.projection_texts(text, text[], bigint[]) IS
    'Texts of the named messages and summaries of one conversation (what a projection includes), one row each';

-- Summary verdicts: the rules of contract §9 that do not depend on the
-- budget, in the order it gives. pycompactor.projection.select_summaries is the in-memory
-- twin. Judged against the derived ranges; compaction.summary_verdicts keeps the result.
CREATE FUNCTION compaction.judge_summaries(p_conversation_id text, p_summary_ids bigint[])
RETURNS TABLE (summary_id bigint, scope text, from_pair int, reason text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_models text[] := (SELECT st.projection_models FROM compaction.settings AS st);
BEGIN
    RETURN QUERY
    WITH stored AS (
        SELECT js.summary_id, j.scope, j.from_pair, js.completed_at,
               -- The owner's model preference, higher preferred.
               compaction.model_preference(j.model, v_models) AS model_rank,
               coalesce(v.projectable, false) AS projectable,
               -- The version's number after '@', higher preferred; -1 without one.
               coalesce(pg_catalog.substring(j.prompt_version, '@([0-9]{1,9})$')::int, -1)
                   AS version_rank,
               -- Current: the range exists now with exactly the stored ids and hash.
               coalesce(r.source_hash = j.source_hash
                        AND r.source_message_ids = j.source_message_ids, false) AS current
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = j.prompt_version
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = j.from_pair
        WHERE js.conversation_id = p_conversation_id
          AND (p_summary_ids IS NULL OR js.summary_id = ANY (p_summary_ids))
    ), judged AS (
        SELECT s.summary_id, s.scope, s.from_pair, s.version_rank, s.model_rank,
               s.completed_at,
               CASE WHEN NOT s.projectable THEN 'version_not_projectable'
                    WHEN NOT s.current THEN 'stale_source' END AS reason
        FROM stored AS s
    )
    SELECT j.summary_id, j.scope, j.from_pair,
           CASE WHEN j.reason IS NULL
                     AND pg_catalog.row_number() OVER (
                             PARTITION BY j.scope, j.from_pair, j.reason IS NULL
                             ORDER BY j.version_rank DESC, j.model_rank DESC,
                                      j.completed_at DESC, j.summary_id DESC) > 1
                THEN 'superseded' ELSE j.reason END
    FROM judged AS j;
END
$$;
COMMENT ON FUNCTION compaction.judge_summaries(text, bigint[]) IS
    'Internal: the verdict on each named summary of a conversation (every summary when NULL) against the derived ranges: NULL for the one its range uses in its scope, else version_not_projectable, stale_source or superseded (contract §9, in that order); name every summary of a range together';

-- Called wherever a range or a summary is written: the tracking paths (the ranges they
-- wrote or deleted), complete and import_summary (the new summary, with the others of its
-- range, which it may supersede), rederive_conversation (all).
CREATE FUNCTION compaction.rederive_summary_verdicts(
    p_conversation_id text, p_from_pairs int[], p_new_summary_id bigint DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_from_pairs int[] := p_from_pairs;
    v_from       int;
    v_ids        bigint[];
    v_scopes     text[];
    v_froms      int[];
    v_reasons    text[];
    v_scope      text;
    v_reason     text;
BEGIN
    IF p_new_summary_id IS NOT NULL THEN
        -- complete and import_summary write derived state here: like the tracking paths,
        -- they take the conversation's conversation_state row first (sql/25_tracking.sql),
        -- so a source write that re-judges the same range waits for this transaction and
        -- then sees its summary, or this one waits and then judges the range as written.
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (p_conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        -- The common case: the first summary of its range in its scope has no other to be
        -- preferred to, so its verdict is judge_summaries' first two rules alone (written
        -- here again; verify_conversation compares the result with judge_summaries). Read,
        -- then written by key: as one INSERT ... SELECT, Citus sent the statement to every
        -- shard of the verdicts; on one node the two statements cost what the one did.
        SELECT j.scope, j.from_pair,
               CASE WHEN NOT coalesce(pv.projectable, false) THEN 'version_not_projectable'
                    WHEN NOT coalesce(r.source_hash = j.source_hash
                                      AND r.source_message_ids = j.source_message_ids,
                                      false)
                        THEN 'stale_source' END
        INTO v_scope, v_from, v_reason
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        LEFT JOIN compaction.prompt_versions AS pv ON pv.prompt_version = j.prompt_version
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = j.from_pair
        WHERE js.conversation_id = p_conversation_id AND js.summary_id = p_new_summary_id
          AND NOT EXISTS (SELECT 1 FROM compaction.summary_verdicts AS o
                          WHERE o.conversation_id = p_conversation_id
                            AND o.from_pair = j.from_pair AND o.scope = j.scope);
        IF FOUND THEN
            INSERT INTO compaction.summary_verdicts
                (conversation_id, summary_id, scope, from_pair, reason)
            VALUES (p_conversation_id, p_new_summary_id, v_scope, v_from, v_reason);
            RETURN;
        END IF;
        -- Provisional, so the judgment below finds it with its range's other summaries.
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT p_conversation_id, js.summary_id, j.scope, j.from_pair, 'stale_source'
        FROM compaction.job_summaries AS js
        JOIN compaction.jobs AS j
          ON j.conversation_id = js.conversation_id AND j.job_id = js.job_id
        WHERE js.conversation_id = p_conversation_id AND js.summary_id = p_new_summary_id
        RETURNING v.from_pair INTO v_from;
        v_from_pairs := coalesce(v_from_pairs, '{}') || v_from;
    END IF;
    IF v_from_pairs IS NULL THEN
        DELETE FROM compaction.summary_verdicts AS v WHERE v.conversation_id = p_conversation_id;
    ELSE
        SELECT pg_catalog.array_agg(v.summary_id) INTO v_ids
        FROM compaction.summary_verdicts AS v
        WHERE v.conversation_id = p_conversation_id AND v.from_pair = ANY (v_from_pairs);
        IF v_ids IS NULL THEN
            RETURN;  -- no summary of those ranges: nothing to judge (the common case)
        END IF;
        DELETE FROM compaction.summary_verdicts AS v
        WHERE v.conversation_id = p_conversation_id AND v.summary_id = ANY (v_ids);
    END IF;
    -- The judgment first, then the rows: one statement each (contract §11).
    SELECT pg_catalog.array_agg(j.summary_id), pg_catalog.array_agg(j.scope),
           pg_catalog.array_agg(j.from_pair), pg_catalog.array_agg(j.reason)
    INTO v_ids, v_scopes, v_froms, v_reasons
    FROM compaction.judge_summaries(p_conversation_id, v_ids) AS j;
    INSERT INTO compaction.summary_verdicts (conversation_id, summary_id, scope, from_pair, reason)
    SELECT p_conversation_id, u.summary_id, u.scope, u.from_pair, u.reason
    FROM ROWS FROM (pg_catalog.unnest(v_ids), pg_catalog.unnest(v_scopes),
                    pg_catalog.unnest(v_froms), pg_catalog.unnest(v_reasons))
         AS u (summary_id, scope, from_pair, reason);
END
$$;
COMMENT ON FUNCTION compaction.rederive_summary_verdicts(text, int[], bigint) IS
    'Internal: re-judges the summaries of the listed ranges of a conversation (every summary when NULL) into compaction.summary_verdicts, first adding p_new_summary_id''s row when given (not on Citus, where no derived state is kept)';

-- The owner's model preference (contract §9). The verdicts it
-- decides are derived state, so setting it re-judges every conversation that has a
-- verdict, each under its conversation_state row as complete and import_summary take it
-- (sql/25_tracking.sql): a completion that judged its range with the old preference
-- commits before its conversation is re-judged here, and one that waits for this
-- transaction judges with the new one. A conversation without a verdict has no summary
-- to order, and the first summary of a range has none to be preferred to. Slow on a
-- large database (every summary is judged once), and meant to be: it is a rare decision
-- of the owner's. On Citus no verdict is stored and nothing is re-judged.
CREATE FUNCTION compaction.set_projection_models(p_models text[])
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_conversation text;
    v_count        int := 0;
BEGIN
    IF p_models IS NULL
       OR pg_catalog.array_ndims(p_models) > 1
       OR pg_catalog.array_position(p_models, NULL) IS NOT NULL
       OR pg_catalog.cardinality(p_models) > 100
       OR EXISTS (SELECT FROM pg_catalog.unnest(p_models) AS m (model)
                  WHERE NOT compaction.has_content(m.model))
       OR (SELECT count(DISTINCT m.model) FROM pg_catalog.unnest(p_models) AS m (model))
          <> pg_catalog.cardinality(p_models) THEN
        RAISE EXCEPTION 'p_models must list at most 100 distinct model names, none NULL or blank, got %',
            p_models
            USING ERRCODE = 'CP020',
                  HINT = 'Name models as workers record them, e.g. ARRAY[''gpt-4o-mini'']; ''{}'' for no preference.';
    END IF;
    UPDATE compaction.settings AS st
    SET projection_models = p_models
    WHERE st.singleton;
    FOR v_conversation IN
        SELECT DISTINCT v.conversation_id FROM compaction.summary_verdicts AS v ORDER BY 1
    LOOP
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (v_conversation, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        PERFORM compaction.rederive_summary_verdicts(v_conversation, NULL);
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION compaction.set_projection_models(text[]) IS
    'Sets the owner''s model preference for projection (settings.projection_models, contract §9: among a range''s valid summaries of one version, a model named earlier before one named later, named before unnamed; ''{}'' for none) and re-judges the stored verdicts; returns how many conversations were re-judged (owner only)';

CREATE FUNCTION compaction.projection_models()
RETURNS text[]
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT st.projection_models FROM compaction.settings AS st
$$;
COMMENT ON FUNCTION compaction.projection_models() IS
    'The owner''s model preference for projection (settings.projection_models; empty when none): model names only, no content';
