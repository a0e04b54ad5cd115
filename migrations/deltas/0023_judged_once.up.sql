-- 0023_judged_once: judging from the views (the derived state not in use: before the
-- install's rebuild has finished, after a view was re-pointed, always on Citus) cost a
-- projection, and the audit of stale summaries, a whole judgement of the conversation
-- per summarized range: projection_summaries called current_range once per range, and
-- stale_summaries source_hash, and each call judged every run again. At 10,000 pairs a
-- projection took 81 s on one node and 585 s on Citus. compaction.current_ranges (new)
-- answers for many ranges with one judgement and one statement of hashes
-- (compaction.range_hashes, new); projection_summaries and stale_summaries call it once
-- per conversation, and plan_targets hashes its targets in one statement too. Same
-- signatures, comments and grants for the three it replaces.

-- Revision 0023: the hashes of many ranges of one conversation in one statement, with
-- range_hash's rule for each (NULL unless its 20 ids are found exactly once). The callers
-- that judge from the views (projection_summaries, plan_targets) needed one hash per range,
-- and a call of range_hash per range read the same rows in as many statements: under
-- Citus, as many queries from the coordinator. p_message_ids holds the ranges' ids in
-- the order of p_from_pairs, 20 each [u0, a0, ..., u9, a9]; a range none of whose ids is
-- found is not returned.
CREATE FUNCTION compaction.range_hashes(p_conversation_id text, p_from_pairs int[],
                                        p_message_ids text[])
RETURNS TABLE (from_pair int, source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF coalesce(pg_catalog.cardinality(p_message_ids), 0)
       <> 20 * coalesce(pg_catalog.cardinality(p_from_pairs), 0) THEN
        RAISE EXCEPTION 'range_hashes needs 20 ids per range: % ranges, % ids',
                pg_catalog.cardinality(p_from_pairs), pg_catalog.cardinality(p_message_ids)
            USING ERRCODE = 'CP020';
    END IF;
    RETURN QUERY
        SELECT p_from_pairs[(g.k + 1)::int],
               CASE WHEN count(*) = 20 THEN
                   pg_catalog.encode(pg_catalog.sha256(pg_catalog.string_agg(
                       pg_catalog.int4send(pg_catalog.octet_length(g.id))
                       || pg_catalog.convert_to(g.id, 'UTF8')
                       || pg_catalog.int4send(pg_catalog.octet_length(m.content))
                       || pg_catalog.convert_to(m.content, 'UTF8'),
                       ''::bytea ORDER BY g.ord)), 'hex')
               END
        FROM (SELECT (i.ord - 1) / 20 AS k, i.ord, i.id
              FROM pg_catalog.unnest(p_message_ids) WITH ORDINALITY AS i (id, ord)) AS g
        JOIN compaction.source_messages AS m
          ON m.conversation_id = p_conversation_id AND m.message_id = g.id
        GROUP BY g.k;
END
$$;
COMMENT ON FUNCTION compaction.range_hashes(text, int[], text[]) IS
    'Internal: range_hash of many ranges of one conversation in one statement (p_message_ids: 20 ids per range, in the order of p_from_pairs)';

-- Revision 0023: current_range for many ranges of one conversation. From the derived
-- state, one read of the ranges asked for; judged from the views, one judgement and one
-- statement of hashes for all of them, where a call of current_range per range judged
-- the whole conversation each time (a projection or an audit of stale summaries cost the
-- square of the history). Each range asked for whose 10 pairs exist now, with its 20
-- ids and hash (NULL, as range_hash's, when its messages are not all found once).
CREATE FUNCTION compaction.current_ranges(p_conversation_id text, p_from_pairs int[])
RETURNS TABLE (from_pair int, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_from int[];
    v_ids  text[];
BEGIN
    IF compaction.derived_state_current() THEN
        RETURN QUERY
        SELECT r.from_pair, r.source_message_ids, r.source_hash
        FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair = ANY (p_from_pairs)
        ORDER BY r.from_pair;
        RETURN;
    END IF;
    -- v_ids: each complete range's 20 ids [u0, a0, ..., u9, a9], in v_from's order; then
    -- their hashes, one statement each (DESIGN §11).
    SELECT pg_catalog.array_agg(c.from_pair ORDER BY c.from_pair),
           ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(c.ids ORDER BY c.from_pair)))
    INTO v_from, v_ids
    FROM (SELECT (j.pair_index / 10 * 10)::int AS from_pair,
                 ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(
                     ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)))
                     AS ids
          FROM compaction.judged_pairs(p_conversation_id) AS j
          WHERE j.pair_index / 10 * 10 = ANY (p_from_pairs)
          GROUP BY j.pair_index / 10 * 10
          HAVING count(*) = 10) AS c;
    RETURN QUERY
    SELECT u.from_pair, v_ids[(u.k::int - 1) * 20 + 1 : u.k::int * 20], h.source_hash
    FROM ROWS FROM (pg_catalog.unnest(v_from)) WITH ORDINALITY AS u (from_pair, k)
    LEFT JOIN compaction.range_hashes(p_conversation_id, v_from, v_ids) AS h
      ON h.from_pair = u.from_pair
    ORDER BY u.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.current_ranges(text, int[]) IS
    'Internal: current_range for many ranges of one conversation (one judgement from the views, or one read of the derived state): each range asked for whose 10 pairs exist, with its 20 current source ids and hash';

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
    -- derived state that is a comparison per summary. Judged from the views, one call
    -- of current_ranges judges the conversation once for every summarized range
    -- (revision 0023: current_range per range before, a whole judgement each, so a
    -- projection's cost grew with the square of the conversation's length), in a
    -- statement of its own (DESIGN §11: no engine function nested in a query on
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
        SELECT u.from_pair, v_ids[(u.k::int - 1) * 20 + 1 : u.k::int * 20], u.source_hash
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
DECLARE
    v_from int[];
    v_ids  text[];
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
    -- Judged from the views: the targets' ids, then all their hashes in one statement
    -- (revision 0023; range_hash per target before).
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
                   AS ids
        FROM pairs AS p
        WHERE compaction.is_target(p.from_pair, p.n_pairs)
        GROUP BY p.from_pair
    )
    SELECT pg_catalog.array_agg(r.from_pair::int ORDER BY r.from_pair),
           ARRAY(SELECT pg_catalog.unnest(pg_catalog.array_agg(r.ids ORDER BY r.from_pair)))
    INTO v_from, v_ids
    FROM ranges AS r;
    RETURN QUERY
    SELECT u.from_pair, u.from_pair + 9, v_ids[(u.k::int - 1) * 20 + 1 : u.k::int * 20],
           h.source_hash
    FROM ROWS FROM (pg_catalog.unnest(v_from)) WITH ORDINALITY AS u (from_pair, k)
    LEFT JOIN compaction.range_hashes(p_conversation_id, v_from, v_ids) AS h
      ON h.from_pair = u.from_pair
    ORDER BY u.from_pair;
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
    v_cid     text;
    v_from    int[];
    v_hashes  text[];
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
        -- The current hashes of every summarized range of a conversation at once: from
        -- the views, one judgement of the conversation (revision 0023: source_hash per
        -- range before, a whole judgement each). One statement each (DESIGN §11).
        IF v_cid IS DISTINCT FROM v_summary.cid THEN
            v_cid := v_summary.cid;
            v_from := ARRAY(SELECT DISTINCT j.from_pair
                            FROM compaction.job_summaries AS s
                            JOIN compaction.jobs AS j
                              ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id
                            WHERE s.conversation_id = v_cid);
            SELECT pg_catalog.array_agg(c.from_pair), pg_catalog.array_agg(c.source_hash)
            INTO v_from, v_hashes
            FROM compaction.current_ranges(v_cid, v_from) AS c;
        END IF;
        v_hash := v_hashes[pg_catalog.array_position(v_from, v_summary.fp)];
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

CALL compaction.assign_ownership();
