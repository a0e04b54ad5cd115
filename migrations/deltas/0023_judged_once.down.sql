-- 0023_judged_once, reversed: projection_summaries, plan_targets and stale_summaries as
-- revision 0022 had them (a judgement per summarized range; range_hash per target), and
-- neither current_ranges nor range_hashes.

CREATE OR REPLACE FUNCTION compaction.projection_summaries(p_conversation_id text, p_scope text)
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
    version_rank       int
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_derived boolean := compaction.derived_state_current();
    v_ranges  int[];
    v_from    int[];
    v_ids     text[];
    v_hashes  text[];
BEGIN
    -- source_current: the range exists now with exactly the stored ids and hash. From the
    -- derived state that is a comparison per summary; judged from the views it costs one
    -- hash per distinct range that has summaries, computed first, in a statement of its
    -- own (DESIGN §11: no engine function nested in a query on distributed tables).
    IF NOT v_derived THEN
        SELECT pg_catalog.array_agg(DISTINCT s.from_pair) INTO v_ranges
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id AND s.scope = p_scope;
        SELECT pg_catalog.array_agg(f.from_pair ORDER BY f.from_pair),
               pg_catalog.array_agg(c.source_message_ids ORDER BY f.from_pair),
               pg_catalog.array_agg(c.source_hash ORDER BY f.from_pair)
        INTO v_from, v_ids, v_hashes
        FROM pg_catalog.unnest(v_ranges) AS f (from_pair)
        CROSS JOIN LATERAL compaction.current_range(p_conversation_id, f.from_pair) AS c
        WHERE c.source_hash IS NOT NULL;
    END IF;
    RETURN QUERY
    WITH summaries AS (
        SELECT s.summary_id, s.from_pair, s.to_pair, s.source_message_ids, s.source_hash,
               s.prompt_version, s.completed_at, pg_catalog.octet_length(s.summary) AS bytes
        FROM compaction.summaries AS s
        WHERE s.conversation_id = p_conversation_id
          AND s.scope = p_scope
    ), now_ranges AS (
        SELECT r.from_pair, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        WHERE v_derived AND r.conversation_id = p_conversation_id
          AND r.from_pair IN (SELECT x.from_pair FROM summaries AS x)
        UNION ALL
        SELECT u.from_pair, ARRAY(SELECT pg_catalog.unnest(v_ids[u.k::int:u.k::int][1:20])),
               u.source_hash
        FROM ROWS FROM (pg_catalog.unnest(v_from), pg_catalog.unnest(v_hashes))
             WITH ORDINALITY AS u (from_pair, source_hash, k)
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
           -- Preference among a range's projectable summaries (revision 0009): the
           -- version's number after '@', higher first; -1 for a version without one.
           coalesce(pg_catalog.substring(s.prompt_version, '@([0-9]{1,9})$')::int, -1)
    FROM summaries AS s
    LEFT JOIN compaction.prompt_versions AS v ON v.prompt_version = s.prompt_version
    LEFT JOIN now_ranges AS n ON n.from_pair = s.from_pair
    ORDER BY s.from_pair, s.summary_id;
END
$$;

CREATE OR REPLACE FUNCTION compaction.plan_targets(p_conversation_id text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF compaction.derived_state_current() THEN
        RETURN QUERY
        SELECT r.from_pair, r.from_pair + 9, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        JOIN compaction.conversation_state AS cs ON cs.conversation_id = r.conversation_id
        WHERE r.conversation_id = p_conversation_id
          AND compaction.is_target(r.from_pair, cs.pair_count)
        ORDER BY r.from_pair;
        RETURN;
    END IF;
    RETURN QUERY
    WITH pairs AS (
        SELECT j.pair_index / 10 * 10 AS from_pair,
               j.pair_index,
               j.user_message_id,
               j.assistant_message_id,
               count(*) OVER () AS n_pairs
        FROM compaction.judged_pairs(p_conversation_id) AS j
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
           compaction.range_hash(p_conversation_id, r.source_message_ids)
    FROM ranges AS r
    ORDER BY r.from_pair;
END
$$;

CREATE OR REPLACE FUNCTION compaction.stale_summaries()
RETURNS TABLE (summary_id bigint, conversation_id text, scope text, from_pair int,
               to_pair int, job_id bigint, imported boolean, model text,
               prompt_version text, completed_at timestamptz, stored_hash text,
               current_hash text, staleness text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_summary record;
    v_key     text;
    v_hash    text;
BEGIN
    FOR v_summary IN
        SELECT s.summary_id AS sid, j.conversation_id AS cid, j.scope AS sc,
               j.from_pair AS fp, j.to_pair AS tp,
               CASE WHEN s.attempt IS NOT NULL THEN j.job_id END AS jid,
               s.attempt IS NULL AS imp, j.model AS mo, j.prompt_version AS pv,
               s.completed_at AS ca, j.source_hash AS sh
        FROM compaction.job_summaries AS s
        JOIN compaction.jobs AS j
          ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id
        ORDER BY j.conversation_id, j.from_pair, s.summary_id
    LOOP
        -- Summaries of one range share one hash.
        IF v_key IS DISTINCT FROM v_summary.cid || ':' || v_summary.fp THEN
            v_key := v_summary.cid || ':' || v_summary.fp;
            v_hash := compaction.source_hash(v_summary.cid, v_summary.fp);
        END IF;
        CONTINUE WHEN v_hash IS NOT DISTINCT FROM v_summary.sh;
        summary_id := v_summary.sid;
        conversation_id := v_summary.cid;
        scope := v_summary.sc;
        from_pair := v_summary.fp;
        to_pair := v_summary.tp;
        job_id := v_summary.jid;
        imported := v_summary.imp;
        model := v_summary.mo;
        prompt_version := v_summary.pv;
        completed_at := v_summary.ca;
        stored_hash := v_summary.sh;
        current_hash := v_hash;
        staleness := CASE WHEN v_hash IS NULL THEN 'range_incomplete' ELSE 'source_changed' END;
        RETURN NEXT;
    END LOOP;
END
$$;

DROP FUNCTION compaction.current_ranges(text, int[]);
DROP FUNCTION compaction.range_hashes(text, int[], text[]);

CALL compaction.assign_ownership();
