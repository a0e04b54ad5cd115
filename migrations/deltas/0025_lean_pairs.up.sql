-- 0025_lean_pairs: the derived state without pairs_order_idx, a fifth of its size
-- (138 MB of 650 MB at 2M messages, docs/operations.md). It served one search,
-- re-derivation's last pair before a changed position in (seq, message_id) order;
-- pair_index follows that order, so rederive_general walks pairs_pair_index_key
-- down from the end instead, over the pairs it renumbers anyway, and deletes what it
-- renumbers by pair_index. Dropping the index takes compaction.pairs' ACCESS EXCLUSIVE
-- lock for as long as removing its catalog entries does.

CREATE OR REPLACE FUNCTION compaction.rederive_general(
    p_conversation_id text, p_run_ids text[], p_fresh compaction.pairs[],
    p_stale compaction.pairs[], p_pair_count int)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Not the generic plans of its caller: how many pairs follow the changed position decides
-- these plans, and a generic plan scanned the whole conversation's pairs.
SET plan_cache_mode = auto
AS $$
DECLARE
    v_runs     text[] := p_run_ids;
    v_fresh    compaction.pairs[] := p_fresh;
    v_stale    compaction.pairs[] := p_stale;
    v_moved    compaction.pairs[];
    v_from_seq bigint;
    v_from_id  text;
    v_base     int;
    v_count    int := p_pair_count;
    v_ranges   int[];
BEGIN
    -- Sizes and the assistant side change in place; the position (seq, user id) cannot.
    UPDATE compaction.pairs AS p
    SET user_bytes = f.user_bytes,
        assistant_message_id = f.assistant_message_id,
        assistant_bytes = f.assistant_bytes
    FROM pg_catalog.unnest(v_fresh) AS f
    WHERE p.conversation_id = p_conversation_id AND p.run_id = f.run_id
      AND p.user_seq IS NOT DISTINCT FROM f.user_seq AND p.user_message_id = f.user_message_id
      AND (p.user_bytes, p.assistant_message_id, p.assistant_bytes)
          IS DISTINCT FROM (f.user_bytes, f.assistant_message_id, f.assistant_bytes);

    -- The earliest position where a pair appeared, vanished or moved (pair order is
    -- (seq, message_id), NULL seq last, as in judged_pairs).
    WITH diff AS (
        SELECT s.user_seq AS old_seq, s.user_message_id AS old_id,
               f.user_seq AS new_seq, f.user_message_id AS new_id
        FROM pg_catalog.unnest(v_stale) AS s
        FULL JOIN pg_catalog.unnest(v_fresh) AS f ON f.run_id = s.run_id
        WHERE s.run_id IS NULL OR f.run_id IS NULL
           OR s.user_seq IS DISTINCT FROM f.user_seq OR s.user_message_id <> f.user_message_id
    ), keys AS (
        SELECT d.old_seq AS seq, d.old_id AS id FROM diff AS d WHERE d.old_id IS NOT NULL
        UNION ALL
        SELECT d.new_seq, d.new_id FROM diff AS d WHERE d.new_id IS NOT NULL
    )
    SELECT k.seq, k.id INTO v_from_seq, v_from_id
    FROM keys AS k
    ORDER BY k.seq, k.id
    LIMIT 1;

    IF FOUND THEN
        -- Pairs before that position keep their numbers: continue after the last of them.
        -- The stored pairs are numbered in (seq, message_id) order (only sizes and the
        -- assistant side changed above), so the last pair before the position is the
        -- first one met walking pair_index down from the end (revision 0025: no index of
        -- its own on (seq, message_id), which was a fifth of the derived state); the walk
        -- passes the pairs that are renumbered below anyway.
        SELECT p.pair_index INTO v_base
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id
          AND CASE WHEN v_from_seq IS NULL
                   THEN p.user_seq IS NOT NULL OR p.user_message_id < v_from_id
                   ELSE (p.user_seq, p.user_message_id) < (v_from_seq, v_from_id) END
        ORDER BY p.pair_index DESC
        LIMIT 1;
        v_base := coalesce(v_base + 1, 0);

        -- Everything from that position on is numbered anew (delete, then insert: the
        -- unique pair_index never sees two rows on one number).
        WITH gone AS (
            DELETE FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id AND p.pair_index >= v_base
            RETURNING p.*
        )
        SELECT coalesce(array_agg(g), '{}') INTO v_moved
        FROM gone AS g
        WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_runs) AS r (run_id)
                          WHERE r.run_id = g.run_id);
        INSERT INTO compaction.pairs AS p
            (conversation_id, run_id, pair_index, user_seq, user_message_id, user_bytes,
             assistant_message_id, assistant_bytes)
        SELECT p_conversation_id, x.run_id,
               v_base + (pg_catalog.row_number() OVER (ORDER BY x.user_seq, x.user_message_id))::int - 1,
               x.user_seq, x.user_message_id, x.user_bytes, x.assistant_message_id,
               x.assistant_bytes
        FROM (SELECT m.* FROM pg_catalog.unnest(v_moved) AS m
              UNION ALL
              SELECT f.* FROM pg_catalog.unnest(v_fresh) AS f
              WHERE NOT EXISTS (SELECT 1 FROM compaction.pairs AS q
                                WHERE q.conversation_id = p_conversation_id
                                  AND q.run_id = f.run_id)) AS x;
        SELECT coalesce(max(p.pair_index) + 1, 0) INTO v_count
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id;
        v_ranges := ARRAY(SELECT pg_catalog.generate_series(v_base / 10 * 10, v_count - 10, 10));
    ELSE
        v_ranges := '{}';
    END IF;

    -- Ranges to look at: those re-numbered above, and those holding a touched pair (its
    -- text may have changed). Only ranges whose ids changed or that hold a touched pair
    -- are hashed again, each from its 20 messages.
    v_ranges := v_ranges || ARRAY(
        SELECT p.pair_index / 10 * 10
        FROM compaction.pairs AS p
        WHERE p.conversation_id = p_conversation_id
          AND p.run_id IN (SELECT f.run_id FROM pg_catalog.unnest(v_fresh) AS f));
    WITH wanted AS (
        SELECT DISTINCT w.from_pair,
               w.from_pair IN (SELECT p.pair_index / 10 * 10
                               FROM compaction.pairs AS p
                               WHERE p.conversation_id = p_conversation_id
                                 AND p.run_id IN (SELECT f.run_id
                                                  FROM pg_catalog.unnest(v_fresh) AS f))
                   AS touched
        FROM pg_catalog.unnest(v_ranges) AS w (from_pair)
        WHERE w.from_pair + 10 <= v_count
    ), present AS (
        SELECT w.from_pair, w.touched,
               ARRAY(SELECT u.id
                     FROM compaction.pairs AS p
                     CROSS JOIN LATERAL pg_catalog.unnest(
                         ARRAY[p.user_message_id, p.assistant_message_id])
                         WITH ORDINALITY AS u (id, ord)
                     WHERE p.conversation_id = p_conversation_id
                       AND p.pair_index BETWEEN w.from_pair AND w.from_pair + 9
                     ORDER BY p.pair_index, u.ord) AS ids
        FROM wanted AS w
    )
    INSERT INTO compaction.ranges AS r (conversation_id, from_pair, source_message_ids, source_hash)
    SELECT p_conversation_id, c.from_pair, c.ids, compaction.range_hash(p_conversation_id, c.ids)
    FROM present AS c
    WHERE c.touched
       OR NOT EXISTS (SELECT 1 FROM compaction.ranges AS o
                      WHERE o.conversation_id = p_conversation_id
                        AND o.from_pair = c.from_pair
                        AND o.source_message_ids = c.ids)
    ON CONFLICT (conversation_id, from_pair) DO UPDATE
        SET source_message_ids = EXCLUDED.source_message_ids,
            source_hash = EXCLUDED.source_hash;
    WITH gone AS (
        DELETE FROM compaction.ranges AS r
        WHERE r.conversation_id = p_conversation_id AND r.from_pair > v_count - 10
        RETURNING r.from_pair
    )
    SELECT v_ranges || coalesce(pg_catalog.array_agg(g.from_pair), '{}') INTO v_ranges
    FROM gone AS g;
    -- The summaries of every range written or deleted above are judged again.
    PERFORM compaction.rederive_summary_verdicts(p_conversation_id, v_ranges);
    UPDATE compaction.conversation_state AS cs
    SET pair_count = v_count
    WHERE cs.conversation_id = p_conversation_id AND cs.pair_count <> v_count;
END
$$;

-- One statement of its own: Citus sends a distributed table's DROP INDEX to the nodes
-- as the text of the statement that ran it, which must not hold several commands.
DO $$
BEGIN
    EXECUTE 'DROP INDEX compaction.pairs_order_idx';
END
$$;

CALL compaction.assign_ownership();
