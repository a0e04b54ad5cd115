-- 0013_citus down: back to 0012's layout.
DROP PROCEDURE compaction.distribute_on_citus();
DROP FUNCTION compaction.citus_tables();
CREATE OR REPLACE VIEW compaction.audit_stale_summaries AS
    SELECT s.summary_id,
           j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           CASE WHEN s.attempt IS NOT NULL THEN j.job_id END AS job_id,
           s.attempt IS NULL AS imported,
           j.model,
           j.prompt_version,
           s.completed_at,
           j.source_hash AS stored_hash,
           c.current_hash,
           CASE WHEN c.current_hash IS NULL THEN 'range_incomplete' ELSE 'source_changed' END
               AS staleness
    FROM compaction.job_summaries AS s
    JOIN compaction.jobs AS j
      ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id
    CROSS JOIN LATERAL (
        SELECT compaction.source_hash(j.conversation_id, j.from_pair) AS current_hash
    ) AS c
    WHERE c.current_hash IS DISTINCT FROM j.source_hash;
COMMENT ON VIEW compaction.audit_stale_summaries IS
    'Audit: completed summaries whose source changed since (hash recomputed in SQL) or whose range no longer has 10 pairs';

DROP FUNCTION compaction.stale_summaries();

CREATE FUNCTION compaction.attempts_track_admission()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_slot int;
BEGIN
    IF NEW.state = 'running' THEN
        UPDATE compaction.admission AS ad
        SET lease_expires_at = NEW.lease_expires_at
        WHERE ad.holder_conversation_id = NEW.conversation_id
          AND ad.holder_job_id = NEW.job_id AND ad.holder_attempt = NEW.attempt;
    ELSE
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.holder_conversation_id = NEW.conversation_id
          AND ad.holder_job_id = NEW.job_id AND ad.holder_attempt = NEW.attempt
        RETURNING ad.slot INTO v_slot;
        -- A slot above a lowered max_running goes with its last holder.
        IF v_slot > (SELECT s.max_running FROM compaction.settings AS s) THEN
            DELETE FROM compaction.admission AS ad WHERE ad.slot = v_slot;
        END IF;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.attempts_track_admission() IS
    'Trigger: copies a running attempt''s renewed lease into its admission slot and frees the slot when the attempt ends (dropping it if above max_running)';

CREATE FUNCTION compaction.settings_resize_admission()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_move   record;
    v_holder compaction.admission;
BEGIN
    LOCK TABLE compaction.admission IN EXCLUSIVE MODE;
    INSERT INTO compaction.admission (slot)
    SELECT g.slot FROM pg_catalog.generate_series(1, NEW.max_running) AS g (slot)
    ON CONFLICT (slot) DO NOTHING;
    FOR v_move IN
        WITH above AS (
            SELECT ad.slot, pg_catalog.row_number() OVER (ORDER BY ad.slot) AS n
            FROM compaction.admission AS ad
            WHERE ad.slot > NEW.max_running AND ad.lease_expires_at > pg_catalog.now()
        ), free AS (
            SELECT ad.slot, pg_catalog.row_number() OVER (ORDER BY ad.slot) AS n
            FROM compaction.admission AS ad
            WHERE ad.slot <= NEW.max_running
              AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= pg_catalog.now())
        )
        SELECT above.slot AS from_slot, free.slot AS to_slot
        FROM above JOIN free USING (n)
    LOOP
        -- Out of the old slot first: one slot per identity (admission_holder_key).
        DELETE FROM compaction.admission AS ad WHERE ad.slot = v_move.from_slot
        RETURNING ad.* INTO v_holder;
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = v_holder.holder_conversation_id,
            holder_job_id = v_holder.holder_job_id, holder_attempt = v_holder.holder_attempt,
            lease_expires_at = v_holder.lease_expires_at
        WHERE ad.slot = v_move.to_slot;
    END LOOP;
    DELETE FROM compaction.admission AS ad
    WHERE ad.slot > NEW.max_running
      AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= pg_catalog.now());
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.settings_resize_admission() IS
    'Trigger: keeps admission slots 1..max_running, moving running attempts below a lowered limit where they fit';

CREATE FUNCTION compaction.attempts_record_event()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_kind        text;
    v_occurred_at timestamptz;
BEGIN
    IF TG_OP = 'INSERT' THEN
        v_kind := 'claim';
        v_occurred_at := NEW.started_at;
    ELSIF OLD.state = 'running' AND NEW.state <> 'running' THEN
        v_kind := CASE
                      WHEN NEW.state = 'completed' THEN 'completion'
                      WHEN NEW.reason = 'lease_expired' THEN 'lease_expiry'
                      ELSE 'failure'
                  END;
        v_occurred_at := NEW.finished_at;
    ELSE
        RETURN NULL;  -- a lease renewal is not a state change
    END IF;
    INSERT INTO compaction.audit_events
        (conversation_id, kind, occurred_at, scope, from_pair, to_pair, job_id, attempt,
         reason, worker, model, prompt_version, source_hash, summary_id, summary_chars)
    SELECT j.conversation_id, v_kind, v_occurred_at, j.scope, j.from_pair, j.to_pair,
           j.job_id, NEW.attempt, NEW.reason, NEW.worker, j.model, j.prompt_version,
           j.source_hash,
           (SELECT s.summary_id FROM compaction.job_summaries AS s
            WHERE v_kind = 'completion'
              AND s.conversation_id = NEW.conversation_id AND s.job_id = NEW.job_id),
           NEW.summary_chars
    FROM compaction.jobs AS j
    WHERE j.conversation_id = NEW.conversation_id AND j.job_id = NEW.job_id;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.attempts_record_event() IS
    'Trigger: writes the audit event of a claim, completion, failure or lease expiry';

CREATE FUNCTION compaction.job_summaries_record_import()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO compaction.audit_events
        (conversation_id, kind, occurred_at, scope, from_pair, to_pair, job_id,
         model, prompt_version, source_hash, summary_id, summary_chars)
    SELECT j.conversation_id, 'import', NEW.completed_at, j.scope, j.from_pair, j.to_pair,
           j.job_id, j.model, j.prompt_version, j.source_hash, NEW.summary_id,
           pg_catalog.char_length(NEW.summary)
    FROM compaction.jobs AS j
    WHERE j.conversation_id = NEW.conversation_id AND j.job_id = NEW.job_id;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.job_summaries_record_import() IS
    'Trigger: writes the audit event of an imported summary';

CREATE FUNCTION compaction.range_hash(p_message_ids text[])
RETURNS text
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- plpgsql, not sql: PostgreSQL before 18 plans a SQL function's body again in every
-- statement that calls it (about 0.3 ms for this join, paid by each Run that completes a
-- range); plpgsql keeps the plan for the session.
AS $$
BEGIN
    -- p_message_ids is [u0, a0, ..., u9, a9]: the hash input walks it two by two.
    RETURN (
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
        JOIN compaction.source_messages AS m ON m.message_id = ids.id);
END
$$;
COMMENT ON FUNCTION compaction.range_hash(text[]) IS
    'Source hash of a range given its 20 current source ids [u0, a0, ..., u9, a9], reading only those messages; NULL unless all 20 are found exactly once';

CREATE OR REPLACE FUNCTION compaction.dequeue(
    p_scope text DEFAULT 'default',
    p_limit int DEFAULT 100,
    p_lease interval DEFAULT '5 minutes')
RETURNS TABLE (conversation_id text, scope text, enqueued_at timestamptz, lease_token uuid,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now       timestamptz := pg_catalog.now();
    v_until     timestamptz;
    v_candidate record;
    v_taken     int := 0;
BEGIN
    IF p_scope IS NULL OR p_scope = '' THEN
        RAISE EXCEPTION 'dequeue needs a non-empty scope' USING ERRCODE = 'CP020';
    END IF;
    IF p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'dequeue needs a limit of at least 1' USING ERRCODE = 'CP020';
    END IF;
    IF p_lease IS NULL OR p_lease < interval '1 second' OR p_lease > interval '1 day' THEN
        RAISE EXCEPTION 'dequeue needs a lease between 1 second and 1 day' USING ERRCODE = 'CP020';
    END IF;
    v_until := v_now + p_lease;
    -- Candidates are read without row locks (no statement here spans conversations with
    -- FOR UPDATE, so the queue can be distributed by conversation_id); each is then
    -- leased by statements that address its own row. Visible: never leased, or the
    -- lease ran out (its worker died): such an entry keeps its enqueued_at, so it comes
    -- back in its original place without any reaper.
    FOR v_candidate IN
        SELECT q.conversation_id
        FROM compaction.queue AS q
        WHERE q.scope = p_scope AND (q.leased_until IS NULL OR q.leased_until <= v_now)
        ORDER BY q.enqueued_at, q.conversation_id
    LOOP
        -- One row, SKIP LOCKED: an entry that another worker is leasing right now, or
        -- that a writer is enqueueing (its history is not committed yet), is left for a
        -- later dequeue rather than waited for. The visibility test is re-checked on the
        -- newest row version: a lease committed meanwhile makes this one lose and skip.
        PERFORM 1
        FROM compaction.queue AS q
        WHERE q.conversation_id = v_candidate.conversation_id AND q.scope = p_scope
          AND (q.leased_until IS NULL OR q.leased_until <= v_now)
        FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        RETURN QUERY
        UPDATE compaction.queue AS q
        SET leased_until = v_until, lease_token = pg_catalog.gen_random_uuid(),
            requeued_at = NULL
        WHERE q.conversation_id = v_candidate.conversation_id AND q.scope = p_scope
        RETURNING q.conversation_id, q.scope, q.enqueued_at, q.lease_token, q.leased_until;
        v_taken := v_taken + 1;
        EXIT WHEN v_taken >= p_limit;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.dequeue(text, int, interval) IS
    'Leases up to p_limit visible entries of one scope, oldest first, for p_lease (1 second to 1 day, server clock); concurrent workers get disjoint entries; returns each lease_token';

CREATE OR REPLACE FUNCTION compaction.current_range(p_conversation_id text, p_from_pair int)
RETURNS TABLE (pair_count bigint, source_message_ids text[], source_hash text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_pairs bigint;
    v_ids   text[];
BEGIN
    IF compaction.derived_state_current() THEN
        RETURN QUERY
        SELECT coalesce((SELECT cs.pair_count::bigint FROM compaction.conversation_state AS cs
                         WHERE cs.conversation_id = p_conversation_id), 0),
               r.source_message_ids, r.source_hash
        FROM (SELECT 1) AS one
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
        RETURN;
    END IF;
    -- Judged from the views: the number of pairs needs no text; the hash reads the
    -- range's 20 messages and nothing else.
    SELECT count(*),
           ARRAY(SELECT pg_catalog.unnest(array_agg(
               ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)
               FILTER (WHERE j.pair_index BETWEEN p_from_pair AND p_from_pair::bigint + 9)))
    INTO v_pairs, v_ids
    FROM compaction.judged_pairs(p_conversation_id) AS j;
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0
       OR pg_catalog.cardinality(v_ids) <> 20 THEN
        RETURN QUERY SELECT v_pairs, NULL::text[], NULL::text;
    ELSE
        RETURN QUERY SELECT v_pairs, v_ids, compaction.range_hash(v_ids);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.current_range(text, int) IS
    'Internal: the conversation''s pair count and, when pairs from_pair..from_pair+9 exist, their 20 current source ids and hash';

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
           compaction.range_hash(r.source_message_ids)
    FROM ranges AS r
    ORDER BY r.from_pair;
END
$$;
COMMENT ON FUNCTION compaction.plan_targets(text) IS
    'Ranges of 10 pairs the fixed window policy makes targets now (N >= 10k + 30), with their 20 source ids [u0, a0, ..., u9, a9] and source hash';

CREATE OR REPLACE FUNCTION compaction.rederive_runs(
    p_conversation_id text, p_run_ids text[], p_pair_count int)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_fresh compaction.pairs[];
    v_stale compaction.pairs[];
    v_last  text;
    v_after boolean;
    v_new   int;
BEGIN
    -- In one statement: the pairs these runs form now (pair_index is set below), the
    -- rows they had, and whether every new pair comes after the last pair.
    WITH fresh AS (
        SELECT j.run_id, j.user_seq, j.user_message_id, j.user_bytes,
               j.assistant_message_id, j.assistant_bytes
        FROM compaction.judge_runs(p_conversation_id, p_run_ids) AS j
        WHERE j.reason IS NULL
    )
    SELECT (SELECT coalesce(array_agg(ROW(p_conversation_id, f.run_id, 0, f.user_seq,
                                          f.user_message_id, f.user_bytes,
                                          f.assistant_message_id,
                                          f.assistant_bytes)::compaction.pairs), '{}')
            FROM fresh AS f),
           (SELECT coalesce(array_agg(p), '{}')
            FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id AND p.run_id = ANY (p_run_ids)),
           l.user_message_id,
           NOT EXISTS (SELECT 1 FROM fresh AS f
                       WHERE NOT CASE WHEN l.user_seq IS NULL THEN
                                          f.user_seq IS NULL
                                          AND f.user_message_id > l.user_message_id
                                      ELSE f.user_seq IS NULL OR f.user_seq > l.user_seq
                                           OR (f.user_seq = l.user_seq
                                               AND f.user_message_id > l.user_message_id)
                                 END)
    INTO v_fresh, v_stale, v_last, v_after
    FROM (SELECT) AS one
    LEFT JOIN compaction.pairs AS l
      ON l.conversation_id = p_conversation_id AND l.pair_index = p_pair_count - 1;
    IF pg_catalog.cardinality(v_fresh) = 0 AND pg_catalog.cardinality(v_stale) = 0 THEN
        RETURN;  -- the runs touched form no pair, before or after: nothing derived changes
    END IF;

    IF pg_catalog.cardinality(v_stale) > 0
       OR NOT (p_pair_count = 0 OR (v_last IS NOT NULL AND v_after)) THEN
        PERFORM compaction.rederive_general(p_conversation_id, p_run_ids, v_fresh, v_stale,
                                            p_pair_count);
        RETURN;
    END IF;

    -- Appending.
    v_new := p_pair_count + pg_catalog.cardinality(v_fresh);
    WITH added AS (
        INSERT INTO compaction.pairs
            (conversation_id, run_id, pair_index, user_seq, user_message_id, user_bytes,
             assistant_message_id, assistant_bytes)
        SELECT p_conversation_id, f.run_id,
               p_pair_count + (pg_catalog.row_number() OVER (ORDER BY f.user_seq, f.user_message_id))::int - 1,
               f.user_seq, f.user_message_id, f.user_bytes, f.assistant_message_id,
               f.assistant_bytes
        FROM pg_catalog.unnest(v_fresh) AS f
        RETURNING 1
    )
    UPDATE compaction.conversation_state AS cs
    SET pair_count = v_new
    WHERE cs.conversation_id = p_conversation_id;
    IF v_new / 10 > p_pair_count / 10 THEN
        -- The ranges the new pairs complete, each hashed from its 20 messages.
        INSERT INTO compaction.ranges AS r
            (conversation_id, from_pair, source_message_ids, source_hash)
        SELECT p_conversation_id, w.from_pair, w.ids, compaction.range_hash(w.ids)
        FROM (SELECT g.from_pair,
                     ARRAY(SELECT u.id
                           FROM compaction.pairs AS p
                           CROSS JOIN LATERAL pg_catalog.unnest(
                               ARRAY[p.user_message_id, p.assistant_message_id])
                               WITH ORDINALITY AS u (id, ord)
                           WHERE p.conversation_id = p_conversation_id
                             AND p.pair_index BETWEEN g.from_pair AND g.from_pair + 9
                           ORDER BY p.pair_index, u.ord) AS ids
              FROM pg_catalog.generate_series(p_pair_count / 10 * 10, v_new - 10, 10)
                  AS g (from_pair)) AS w
        ON CONFLICT (conversation_id, from_pair) DO UPDATE
            SET source_message_ids = EXCLUDED.source_message_ids,
                source_hash = EXCLUDED.source_hash;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.rederive_runs(text, text[], int) IS
    'Internal: with the conversation_state row held, judges the runs named and appends their new pairs at the end, or hands the change to rederive_general';

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
        IF v_from_seq IS NULL THEN
            SELECT p.pair_index INTO v_base
            FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id
              AND (p.user_seq IS NOT NULL OR p.user_message_id < v_from_id)
            ORDER BY p.user_seq DESC, p.user_message_id DESC
            LIMIT 1;
        ELSE
            SELECT p.pair_index INTO v_base
            FROM compaction.pairs AS p
            WHERE p.conversation_id = p_conversation_id
              AND (p.user_seq, p.user_message_id) < (v_from_seq, v_from_id)
            ORDER BY p.user_seq DESC, p.user_message_id DESC
            LIMIT 1;
        END IF;
        v_base := coalesce(v_base + 1, 0);

        -- Everything from that position on is numbered anew (delete, then insert: the
        -- unique pair_index never sees two rows on one number). Two statements, so each
        -- is a range scan of pairs_order_idx.
        IF v_from_seq IS NULL THEN
            WITH gone AS (
                DELETE FROM compaction.pairs AS p
                WHERE p.conversation_id = p_conversation_id
                  AND p.user_seq IS NULL AND p.user_message_id >= v_from_id
                RETURNING p.*
            )
            SELECT coalesce(array_agg(g), '{}') INTO v_moved
            FROM gone AS g
            WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_runs) AS r (run_id)
                              WHERE r.run_id = g.run_id);
        ELSE
            WITH gone AS (
                DELETE FROM compaction.pairs AS p
                WHERE p.conversation_id = p_conversation_id
                  AND ((p.user_seq, p.user_message_id) >= (v_from_seq, v_from_id)
                       OR p.user_seq IS NULL)
                RETURNING p.*
            )
            SELECT coalesce(array_agg(g), '{}') INTO v_moved
            FROM gone AS g
            WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(v_runs) AS r (run_id)
                              WHERE r.run_id = g.run_id);
        END IF;
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
    SELECT p_conversation_id, c.from_pair, c.ids, compaction.range_hash(c.ids)
    FROM present AS c
    WHERE c.touched
       OR NOT EXISTS (SELECT 1 FROM compaction.ranges AS o
                      WHERE o.conversation_id = p_conversation_id
                        AND o.from_pair = c.from_pair
                        AND o.source_message_ids = c.ids)
    ON CONFLICT (conversation_id, from_pair) DO UPDATE
        SET source_message_ids = EXCLUDED.source_message_ids,
            source_hash = EXCLUDED.source_hash;
    DELETE FROM compaction.ranges AS r
    WHERE r.conversation_id = p_conversation_id AND r.from_pair > v_count - 10;
    UPDATE compaction.conversation_state AS cs
    SET pair_count = v_count
    WHERE cs.conversation_id = p_conversation_id AND cs.pair_count <> v_count;
END
$$;
COMMENT ON FUNCTION compaction.rederive_general(text, text[], compaction.pairs[], compaction.pairs[], int) IS
    'Internal: the general path of rederive (a pair changed, vanished or moved): renumbers from the earliest changed position and re-hashes the ranges affected';

CREATE OR REPLACE FUNCTION compaction.judge_runs(p_conversation_id text, p_run_ids text[] DEFAULT NULL)
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
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One cached plan: a custom plan per call would cost more to plan than to run.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    -- A lateral aggregate per run: the messages of each run are fetched by the run_id
    -- index, so the cost follows this conversation's size, never the table's.
    WITH runs AS (
        -- Every run of the conversation, or only the runs named: re-derivation judges
        -- the runs a write touched by the run_id index, never the whole conversation.
        SELECT sr.run_id, sr.conversation_id, sr.status
        FROM compaction.source_runs AS sr
        WHERE p_run_ids IS NULL AND sr.conversation_id = p_conversation_id
        UNION ALL
        SELECT sr.run_id, sr.conversation_id, sr.status
        FROM compaction.source_runs AS sr
        WHERE sr.run_id = ANY (p_run_ids) AND sr.conversation_id = p_conversation_id
    ),
    per_run AS (
        SELECT r.run_id,
               r.status AS run_status,
               m.*
        FROM runs AS r
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
    FROM per_run AS p;
END
$$;
COMMENT ON FUNCTION compaction.judge_runs(text, text[]) IS
    'Internal: every run of a conversation (or only those named) with the first eligibility rule it breaks (NULL when it forms a pair), its pair''s ids and UTF-8 byte lengths; no text';

CREATE OR REPLACE FUNCTION compaction.eligible_pairs(p_conversation_id text)
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

CREATE OR REPLACE FUNCTION compaction.explain_runs(p_conversation_id text)
RETURNS TABLE (run_id text, run_status text, eligible boolean, reason text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF NOT compaction.derived_state_current() THEN
        RETURN QUERY
        SELECT j.run_id, j.run_status, j.reason IS NULL, j.reason
        FROM compaction.judge_runs(p_conversation_id) AS j
        ORDER BY j.reason IS NULL, j.user_seq NULLS FIRST, j.run_id;
        RETURN;
    END IF;
    RETURN QUERY
    WITH runs AS (
        SELECT sr.run_id, sr.status
        FROM compaction.source_runs AS sr
        WHERE sr.conversation_id = p_conversation_id
    ), paired AS (
        SELECT r.run_id, r.status, p.user_seq
        FROM runs AS r
        JOIN compaction.pairs AS p
          ON p.conversation_id = p_conversation_id AND p.run_id = r.run_id
    ), judged AS (
        SELECT j.run_id, j.run_status, j.reason, j.user_seq
        FROM compaction.judge_runs(
                 p_conversation_id,
                 ARRAY(SELECT r.run_id FROM runs AS r
                       WHERE r.run_id NOT IN (SELECT x.run_id FROM paired AS x))) AS j
    )
    SELECT v.run_id, v.run_status, v.reason IS NULL, v.reason
    FROM (SELECT x.run_id, x.status AS run_status, NULL::text AS reason, x.user_seq
          FROM paired AS x
          UNION ALL
          SELECT j.run_id, j.run_status, j.reason, j.user_seq
          FROM judged AS j) AS v
    ORDER BY v.reason IS NULL, v.user_seq NULLS FIRST, v.run_id;
END
$$;
COMMENT ON FUNCTION compaction.explain_runs(text) IS
    'Every run of a conversation with whether it forms a pair and, if not, the first rule it breaks (no message text)';

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
BEGIN
    -- source_current: the range exists now with exactly the stored ids and hash. From the
    -- derived state that is a comparison per summary; judged from the views it costs one
    -- hash per distinct range that has summaries.
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
        SELECT f.from_pair, c.source_message_ids, c.source_hash
        FROM (SELECT DISTINCT x.from_pair FROM summaries AS x) AS f
        CROSS JOIN LATERAL compaction.current_range(p_conversation_id, f.from_pair) AS c
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
COMMENT ON FUNCTION compaction.projection_summaries(text, text) IS
    'Completed summaries of a conversation and scope without their text: source binding, version, whether it is projectable, completed_at, UTF-8 byte length, whether its source is current, and the version''s rank (the number after @, -1 without one; higher is preferred)';

CREATE OR REPLACE FUNCTION compaction.claim(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now         timestamptz := compaction.caller_now(p_now);
    v_lease       timestamptz := v_now + compaction.checked_lease(p_lease);
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_job_id      bigint;
    v_failed      int;
    v_attempt     int;
    v_max_running int;
    v_slot        int;
    v_overflow    boolean := false;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;

    -- Checks in the contract's order; the first failing one is the answer.
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN
        RETURN QUERY SELECT false, 'invalid_range'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT compaction.valid_source_ids(p_source_message_ids) THEN
        RETURN QUERY SELECT false, 'invalid_source_ids'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    IF v_accepts IS NOT TRUE THEN
        RETURN QUERY SELECT false, 'prompt_version_closed'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    -- From here on the conversation's engine rows are ours until commit.
    PERFORM compaction.lock_conversation(p_conversation_id);

    -- The range as it is now, from the derived state (no message text read): the pair
    -- count decides whether it is a target, the stored ids and hash whether it matches.
    SELECT r.pair_count, r.source_message_ids, r.source_hash
    INTO v_pairs, v_target_ids, v_target_hash
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    IF NOT compaction.is_target(p_from_pair, v_pairs) THEN
        RETURN QUERY SELECT false, 'not_eligible'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT compaction.valid_source_hash(p_source_hash)
       OR v_target_hash IS DISTINCT FROM p_source_hash
       OR v_target_ids IS DISTINCT FROM p_source_message_ids THEN
        RETURN QUERY SELECT false, 'source_mismatch'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;

    IF v_job_id IS NULL THEN
        v_attempt := 1;
    ELSE
        -- Reap this identity: an expired attempt is a failed attempt.
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = v_now
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
          AND a.state = 'running' AND a.lease_expires_at <= v_now;

        IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                   WHERE s.conversation_id = p_conversation_id AND s.job_id = v_job_id) THEN
            RETURN QUERY SELECT false, 'already_completed'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        IF EXISTS (SELECT 1 FROM compaction.attempts AS a
                   WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
                     AND a.state = 'running') THEN
            RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        SELECT count(*) INTO v_failed
        FROM compaction.attempts AS a
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
        IF v_failed >= 2 THEN
            RETURN QUERY SELECT false, 'attempts_exhausted'::text, v_job_id, NULL::int, NULL::timestamptz;
            RETURN;
        END IF;
        v_attempt := v_failed + 1;
    END IF;

    -- Admission last, so refusals never touch it: a free slot (no holder, or a holder
    -- whose lease ran out), locked to commit. SKIP LOCKED lets concurrent claims take
    -- different slots instead of queueing on one lock; a slot being taken by an
    -- uncommitted claim is as good as taken. Under REPEATABLE READ or SERIALIZABLE a
    -- slot another claim took after this snapshot raises a serialization failure.
    SELECT s.max_running INTO v_max_running FROM compaction.settings AS s;
    -- Slots above max_running exist only while attempts admitted before it was lowered
    -- still hold them (settings_resize_admission could not fit them below; a slot above
    -- is dropped when its holder ends). Then the free slots below do not tell the count:
    -- claims serialise on the live ones (the no-op update also makes a claim whose
    -- snapshot missed another's fail at REPEATABLE READ) and count every live holder.
    -- max(slot) is one step down the primary key, so the usual case costs nothing.
    IF (SELECT max(ad.slot) FROM compaction.admission AS ad) > v_max_running THEN
        UPDATE compaction.admission AS ad
        SET lease_expires_at = ad.lease_expires_at
        WHERE ad.slot > v_max_running AND ad.lease_expires_at > v_now;
        v_overflow := FOUND;
    END IF;
    IF NOT v_overflow OR (SELECT count(*) FROM compaction.admission AS ad
                          WHERE ad.lease_expires_at > v_now) < v_max_running THEN
        SELECT ad.slot INTO v_slot
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_max_running
          AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= v_now)
        ORDER BY ad.slot
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
    END IF;
    IF v_slot IS NULL THEN
        RETURN QUERY SELECT false, 'admission_full'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    -- The unique indexes are the final word. At READ COMMITTED the conversation lock has
    -- already ordered competing claims, so no conflict arises; at REPEATABLE READ a
    -- conflict with a winner this snapshot cannot see is a serialization failure (ON
    -- CONFLICT's rule), never a second running attempt. No subtransaction needed.
    IF v_job_id IS NULL THEN
        INSERT INTO compaction.jobs
            (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
             model, prompt_version, created_at)
        VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                p_source_message_ids, p_source_hash, p_model, p_prompt_version, v_now)
        ON CONFLICT DO NOTHING
        RETURNING job_id INTO v_job_id;
    END IF;
    IF v_job_id IS NOT NULL THEN
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, v_now, v_lease)
        ON CONFLICT DO NOTHING;
    END IF;
    IF v_job_id IS NULL OR NOT FOUND THEN
        RETURN QUERY SELECT false, 'already_running'::text, v_job_id, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = p_conversation_id, holder_job_id = v_job_id,
        holder_attempt = v_attempt, lease_expires_at = v_lease
    WHERE ad.slot = v_slot;
    RETURN QUERY SELECT true, 'claimed'::text, v_job_id, v_attempt, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, or returns the first refusal reason (see DESIGN §6)';

CREATE OR REPLACE FUNCTION compaction.fence(p_job_id bigint, p_attempt int, p_now timestamptz,
                                 p_conversation_id text)
RETURNS compaction.attempts
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_conversation_id text;
    v_attempt         compaction.attempts;
BEGIN
    IF p_conversation_id IS NULL THEN
        SELECT j.conversation_id INTO v_conversation_id
        FROM compaction.jobs AS j
        WHERE j.job_id = p_job_id;
    ELSE
        SELECT j.conversation_id INTO v_conversation_id
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.job_id = p_job_id;
    END IF;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM compaction.lock_conversation(v_conversation_id);
    SELECT a.* INTO v_attempt
    FROM compaction.attempts AS a
    WHERE a.conversation_id = v_conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Only a superuser's or the owner's p_now can be this early (caller_now).
    IF v_attempt.state = 'running' AND p_now < v_attempt.started_at THEN
        RAISE EXCEPTION 'p_now % is before attempt % of job % started (%)',
                p_now, p_attempt, p_job_id, v_attempt.started_at
            USING ERRCODE = 'CP022';
    END IF;
    IF v_attempt.state = 'running' AND v_attempt.lease_expires_at <= p_now THEN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = p_now
        WHERE a.conversation_id = v_conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt
        RETURNING a.* INTO v_attempt;
    END IF;
    RETURN v_attempt;
END
$$;
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz, text) IS
    'Internal: locks attempt (job_id, attempt) of the given conversation (or the job''s) and returns it, first failing it (lease_expired) if its lease ran out; NULL if unknown';

CREATE OR REPLACE FUNCTION compaction.complete(
    p_job_id          bigint,
    p_attempt         int,
    p_summary         text,
    p_finish_reason   text,
    p_tool_call_count int,
    p_response_id     text DEFAULT NULL,
    p_now             timestamptz DEFAULT NULL,
    p_stats           jsonb DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text, summary_id bigint)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now        timestamptz := compaction.caller_now(p_now);
    v_attempt    compaction.attempts;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    v_stats := compaction.attempt_stats(p_stats);
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    IF v_attempt.state = 'completed' THEN
        -- Idempotent for the same token and the same text (a lost reply re-sent); any
        -- other text for a completed attempt is a stale writer: lease_lost.
        SELECT s.summary_id INTO v_summary_id
        FROM compaction.job_summaries AS s
        WHERE s.conversation_id = v_attempt.conversation_id AND s.job_id = p_job_id
          AND s.attempt = p_attempt AND s.summary = p_summary;
        IF FOUND THEN
            RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
        ELSE
            RETURN QUERY SELECT false, 'lease_lost'::text, NULL::bigint;
        END IF;
        RETURN;
    END IF;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, 'lease_lost'::text, NULL::bigint;
        RETURN;
    END IF;

    IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
               WHERE s.conversation_id = v_attempt.conversation_id AND s.job_id = p_job_id) THEN
        v_problem := 'already_completed';
    ELSE
        v_problem := compaction.reply_problem(p_summary, p_finish_reason, p_tool_call_count);
    END IF;

    IF v_problem IS NOT NULL THEN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = v_problem, finished_at = v_now,
            finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
            response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
            input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
            figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept
        WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt;
        RETURN QUERY SELECT false, v_problem, NULL::bigint;
        RETURN;
    END IF;

    INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
    VALUES (v_attempt.conversation_id, p_job_id, p_attempt, p_summary, v_now)
    RETURNING summary_id INTO v_summary_id;
    UPDATE compaction.attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = v_now,
        finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
        input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off';

CREATE OR REPLACE FUNCTION compaction.fail(
    p_job_id  bigint,
    p_attempt int,
    p_reason  text,
    p_now     timestamptz DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := compaction.caller_now(p_now);
    v_attempt compaction.attempts;
BEGIN
    PERFORM compaction.checked_reason(p_reason);
    IF p_reason IN ('completed', 'lease_expired') THEN
        RAISE EXCEPTION 'fail needs a reason other than completed or lease_expired'
            USING ERRCODE = 'CP020';
    END IF;
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, 'lease_lost'::text;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET state = 'failed', reason = p_reason, finished_at = v_now
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    RETURN QUERY SELECT true, 'failed'::text;
END
$$;
COMMENT ON FUNCTION compaction.fail(bigint, int, text, timestamptz, text) IS
    'Records attempt (job_id, attempt) failed with the worker''s reason code (e.g. http_error, timeout; CP024 unless ^[a-z][a-z0-9_]{0,63}$); lease_lost if fenced off';

CREATE OR REPLACE FUNCTION compaction.heartbeat(
    p_job_id  bigint,
    p_attempt int,
    p_lease   interval DEFAULT '5 minutes',
    p_now     timestamptz DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := compaction.caller_now(p_now);
    v_lease   timestamptz := v_now + compaction.checked_lease(p_lease);
    v_attempt compaction.attempts;
BEGIN
    v_attempt := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET lease_expires_at = v_lease
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    RETURN QUERY SELECT true, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (1 second..1 day, else CP023); ok = false if fenced off (lease_lost)';

CREATE OR REPLACE FUNCTION compaction.reap(p_now timestamptz DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now   timestamptz := compaction.caller_now(p_now);
    v_count int;
BEGIN
    -- SKIP LOCKED: an attempt locked right now is being completed, failed or renewed by
    -- its own fenced call, which settles its expiry itself; two reapers never deadlock.
    WITH expired AS (
        SELECT a.conversation_id, a.job_id, a.attempt
        FROM compaction.attempts AS a
        WHERE a.state = 'running' AND a.lease_expires_at <= v_now
        ORDER BY a.conversation_id, a.job_id
        FOR UPDATE SKIP LOCKED
    )
    , failed AS (
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = v_now
        FROM expired AS e
        WHERE a.conversation_id = e.conversation_id AND a.job_id = e.job_id
          AND a.attempt = e.attempt
        RETURNING a.conversation_id, a.job_id
    ), requeued AS (
        -- The expired attempt's worker is gone and can no longer nudge anyone: put the
        -- conversation back on the queue, so the one retry the contract allows happens
        -- without a sweep and without workers re-queueing every claim just in case.
        -- Like enqueue: an entry leased right now is marked requeued, so the
        -- acknowledgement of a worker that examined it before this expiry keeps it.
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT f.conversation_id, j.scope, pg_catalog.now()
        FROM failed AS f
        JOIN compaction.jobs AS j ON j.conversation_id = f.conversation_id AND j.job_id = f.job_id
        ORDER BY 1, 2
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL
    )
    SELECT count(*) INTO v_count FROM failed;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION compaction.reap(timestamptz) IS
    'Marks running attempts whose lease expired at p_now failed (lease_expired) and re-queues their conversations; returns how many';

CREATE OR REPLACE FUNCTION compaction.import_summary(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_summary            text,
    p_completed_at       timestamptz)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job_id     bigint;
    v_summary_id bigint;
    v_problem    text;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_completed_at IS NULL THEN
        RAISE EXCEPTION 'import_summary needs a conversation, a non-empty scope and model, and completed_at'
            USING ERRCODE = 'CP020';
    END IF;
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN
        RAISE EXCEPTION 'invalid range: from_pair % is not a non-negative multiple of 10', p_from_pair
            USING ERRCODE = 'CP002';
    END IF;
    IF NOT compaction.valid_source_ids(p_source_message_ids) THEN
        RAISE EXCEPTION 'invalid source ids: a range needs exactly 20 distinct non-null message ids'
            USING ERRCODE = 'CP003';
    END IF;
    IF NOT compaction.valid_source_hash(p_source_hash) THEN
        RAISE EXCEPTION 'invalid source hash: expected 64 lowercase hexadecimal characters'
            USING ERRCODE = 'CP004';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM compaction.prompt_versions AS pv
                   WHERE pv.prompt_version = p_prompt_version) THEN
        RAISE EXCEPTION 'unknown prompt version %', p_prompt_version
            USING ERRCODE = 'CP007';
    END IF;
    v_problem := compaction.summary_problem(p_summary);
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid summary: %', v_problem
            USING ERRCODE = 'CP005';
    END IF;

    PERFORM compaction.lock_conversation(p_conversation_id);

    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;
    BEGIN
        IF v_job_id IS NULL THEN
            INSERT INTO compaction.jobs
                (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
                 model, prompt_version, created_at)
            VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                    p_source_message_ids, p_source_hash, p_model, p_prompt_version,
                    p_completed_at)
            RETURNING job_id INTO v_job_id;
        END IF;
        INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
        VALUES (p_conversation_id, v_job_id, NULL, p_summary, p_completed_at)
        RETURNING summary_id INTO v_summary_id;
    EXCEPTION WHEN unique_violation THEN
        RAISE EXCEPTION 'a completed summary already exists for this identity (conversation %, scope %, pairs %-%)',
                p_conversation_id, p_scope, p_from_pair, p_from_pair + 9
            USING ERRCODE = 'CP006';
    END;
    RETURN v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.import_summary(text, text, int, text[], text, text, text, text, timestamptz) IS
    'Records a completed summary made by an earlier system (any known prompt version; source need not be current); returns its summary_id';

CREATE OR REPLACE FUNCTION compaction.erasing(p_conversation_id text)
RETURNS boolean
LANGUAGE sql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT 1
        FROM compaction.audit_events AS e
        WHERE e.conversation_id = p_conversation_id
          AND e.kind = 'erasure'
          AND e.xact_id = pg_catalog.pg_current_xact_id_if_assigned())
$$;
COMMENT ON FUNCTION compaction.erasing(text) IS
    'Internal: true inside the transaction of erase_conversation(p_conversation_id), after its tombstone was written';

CREATE OR REPLACE FUNCTION compaction.jobs_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' AND compaction.erasing(OLD.conversation_id) THEN
        RETURN OLD;
    END IF;
    IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
               WHERE s.conversation_id = OLD.conversation_id AND s.job_id = OLD.job_id) THEN
        RAISE EXCEPTION 'compaction.jobs: job % has a completed summary; its identity never changes (% refused)',
                OLD.job_id, TG_OP
            USING ERRCODE = 'CP010',
                  HINT = 'Erasure requests go through compaction.erase_conversation.';
    END IF;
    RAISE EXCEPTION 'compaction.jobs: identities are append-only (% of job % refused)', TG_OP, OLD.job_id
        USING ERRCODE = 'CP011',
              HINT = 'Erasure requests go through compaction.erase_conversation.';
END
$$;
COMMENT ON FUNCTION compaction.jobs_guard() IS
    'Trigger: refuses UPDATE and DELETE of identities (CP010 with a completed summary, else CP011) except inside erase_conversation';

CREATE OR REPLACE FUNCTION compaction.erase_conversation(p_conversation_id text, p_reason text)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_jobs      int;
    v_attempts  int;
    v_summaries int;
BEGIN
    IF p_conversation_id IS NULL THEN
        RAISE EXCEPTION 'erase_conversation needs a conversation id' USING ERRCODE = 'CP020';
    END IF;
    -- The tombstone outlives what it erases and the auditor reads it: a code, not text.
    PERFORM compaction.checked_reason(p_reason);
    PERFORM compaction.lock_conversation(p_conversation_id);

    SELECT count(*) INTO v_jobs FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id;
    SELECT count(*) INTO v_attempts FROM compaction.attempts AS a
    WHERE a.conversation_id = p_conversation_id;
    SELECT count(*) INTO v_summaries FROM compaction.job_summaries AS s
    WHERE s.conversation_id = p_conversation_id;

    -- The tombstone comes first: it is what lets the guards pass these deletes. It holds
    -- ids, counts, the reason and the time, never text of the erased rows.
    INSERT INTO compaction.audit_events
        (conversation_id, kind, occurred_at, reason, erased_jobs, erased_attempts, erased_summaries)
    VALUES (p_conversation_id, 'erasure', pg_catalog.now(), p_reason, v_jobs, v_attempts, v_summaries);

    DELETE FROM compaction.job_summaries AS s WHERE s.conversation_id = p_conversation_id;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
        lease_expires_at = NULL
    WHERE ad.holder_conversation_id = p_conversation_id;
    DELETE FROM compaction.admission AS ad
    WHERE ad.slot > (SELECT s.max_running FROM compaction.settings AS s)
      AND ad.holder_conversation_id IS NULL;
    DELETE FROM compaction.attempts AS a WHERE a.conversation_id = p_conversation_id;
    DELETE FROM compaction.jobs AS j WHERE j.conversation_id = p_conversation_id;
    DELETE FROM compaction.queue AS q WHERE q.conversation_id = p_conversation_id;
    RETURN v_summaries;
END
$$;
COMMENT ON FUNCTION compaction.erase_conversation(text, text) IS
    'Erasure requests (owner/admin only): removes a conversation''s jobs, attempts, summaries and queue entries, never source rows; leaves a content-free tombstone event (p_reason a code, else CP024); returns summaries removed';

CREATE OR REPLACE FUNCTION compaction.worker_targets(
    p_conversation_id text, p_scope text, p_model text, p_prompt_version text)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT t.from_pair, t.to_pair, t.source_message_ids, t.source_hash,
           EXISTS (SELECT 1
                   FROM compaction.jobs AS j
                   JOIN compaction.job_summaries AS s
                     ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
                   WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
                     AND j.from_pair = t.from_pair AND j.source_hash = t.source_hash
                     AND j.model = p_model AND j.prompt_version = p_prompt_version)
    FROM compaction.plan_targets(p_conversation_id) AS t
    ORDER BY t.from_pair
$$;
COMMENT ON FUNCTION compaction.worker_targets(text, text, text, text) IS
    'The targets of plan_targets with whether that identity (scope, model, prompt version) already holds a completed summary, so a worker claims only what is left';

CREATE OR REPLACE FUNCTION compaction.range_replies(
    p_conversation_id text, p_from_pair int, p_source_hash text)
RETURNS TABLE (pair_index int, assistant_message_id text, assistant_content text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    -- Only while the range is what the claim bound: a range edited after the claim
    -- returns no rows, so the model never summarises text the hash does not cover.
    -- source_message_ids is [u0, a0, ..., u9, a9]: the replies sit at the even positions.
    SELECT (p_from_pair + u.ord / 2 - 1)::int, m.message_id, m.content
    FROM compaction.current_range(p_conversation_id, p_from_pair) AS r
    CROSS JOIN LATERAL pg_catalog.unnest(r.source_message_ids)
        WITH ORDINALITY AS u (message_id, ord)
    JOIN compaction.source_messages AS m
      ON m.message_id = u.message_id AND m.role = 'assistant'
    WHERE r.source_hash = p_source_hash AND u.ord % 2 = 0
    ORDER BY u.ord
$$;
COMMENT ON FUNCTION compaction.range_replies(text, int, text) IS
    'The 10 assistant replies of range from_pair (pair_index, message id, text), only while the range''s current source hash equals the one given; no user text';

CREATE OR REPLACE FUNCTION compaction.projection_texts(
    p_conversation_id text, p_message_ids text[], p_summary_ids bigint[])
RETURNS TABLE (message_id text, summary_id bigint, content text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- By primary key: only the rows named are read, however long the conversation.
    SELECT m.message_id, NULL::bigint, m.content
    FROM compaction.source_messages AS m
    WHERE m.message_id = ANY (p_message_ids)
      AND m.conversation_id = p_conversation_id
    UNION ALL
    SELECT NULL::text, s.summary_id, s.summary
    FROM compaction.summaries AS s
    WHERE s.conversation_id = p_conversation_id
      AND s.summary_id = ANY (p_summary_ids)
$$;
COMMENT ON FUNCTION compaction.projection_texts(text, text[], bigint[]) IS
    'Texts of the named messages and summaries of one conversation (what a projection includes), one row each';

CREATE OR REPLACE FUNCTION compaction.verify_conversation(p_conversation_id text)
RETURNS TABLE (problem text, detail text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    WITH judged AS (
        SELECT j.* FROM compaction.judged_pairs(p_conversation_id) AS j
    ), stored AS (
        SELECT p.* FROM compaction.pairs AS p WHERE p.conversation_id = p_conversation_id
    ), judged_ranges AS (
        SELECT g.from_pair, g.ids, compaction.range_hash(g.ids) AS hash
        FROM (SELECT j.pair_index / 10 * 10 AS from_pair,
                     ARRAY(SELECT pg_catalog.unnest(array_agg(
                         ARRAY[j.user_message_id, j.assistant_message_id] ORDER BY j.pair_index)))
                         AS ids
              FROM judged AS j
              GROUP BY j.pair_index / 10 * 10
              HAVING count(*) = 10) AS g
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
    ORDER BY 1, 2
$$;
COMMENT ON FUNCTION compaction.verify_conversation(text) IS
    'Recomputes one conversation from the source views and returns one row per difference from the derived state (no rows: consistent); ids, counts and hashes only';

DROP FUNCTION compaction.reap_conversation(text, timestamptz);
DROP FUNCTION compaction.range_hash(text, text[]);
DROP FUNCTION compaction.record_attempt_change(text, bigint, int);
DROP FUNCTION compaction.try_lock_conversation(text);
CREATE OR REPLACE FUNCTION compaction.lock_conversation(p_conversation_id text)
RETURNS void
LANGUAGE sql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
    -- Keys 0..15 of the class are reserved for fixed locks (migrations, admission): a
    -- hash landing there moves to -1..-16, where it can only meet other conversations.
    SELECT pg_catalog.pg_advisory_xact_lock(
               1129316352, CASE WHEN k.h BETWEEN 0 AND 15 THEN -1 - k.h ELSE k.h END)
    FROM (SELECT pg_catalog.hashtext(p_conversation_id) AS h) AS k
$$;
COMMENT ON FUNCTION compaction.lock_conversation(text) IS
    'Internal: transaction-scoped advisory lock (1129316352, hashtext(conversation_id) moved off 0..15) serialising one conversation''s writers';
DROP FUNCTION compaction.conversation_lock_key(text);

CREATE TRIGGER attempts_track_admission
    AFTER UPDATE ON compaction.attempts
    FOR EACH ROW
    WHEN (OLD.state = 'running')
    EXECUTE FUNCTION compaction.attempts_track_admission();
ALTER TABLE compaction.attempts ENABLE ALWAYS TRIGGER attempts_track_admission;
CREATE TRIGGER settings_resize_admission
    AFTER UPDATE OF max_running ON compaction.settings
    FOR EACH ROW
    WHEN (NEW.max_running IS DISTINCT FROM OLD.max_running)
    EXECUTE FUNCTION compaction.settings_resize_admission();
ALTER TABLE compaction.settings ENABLE ALWAYS TRIGGER settings_resize_admission;
CREATE TRIGGER attempts_record_event
    AFTER INSERT OR UPDATE ON compaction.attempts
    FOR EACH ROW EXECUTE FUNCTION compaction.attempts_record_event();
ALTER TABLE compaction.attempts ENABLE ALWAYS TRIGGER attempts_record_event;
CREATE TRIGGER job_summaries_record_import
    AFTER INSERT ON compaction.job_summaries
    FOR EACH ROW WHEN (NEW.attempt IS NULL)
    EXECUTE FUNCTION compaction.job_summaries_record_import();
ALTER TABLE compaction.job_summaries ENABLE ALWAYS TRIGGER job_summaries_record_import;

-- Slots above max_running that nobody holds go (0012 kept slots 1..max_running).
DROP INDEX compaction.admission_held_idx;
DELETE FROM compaction.admission AS ad
WHERE ad.slot > (SELECT s.max_running FROM compaction.settings AS s)
  AND ad.holder_conversation_id IS NULL;
COMMENT ON TABLE compaction.admission IS
    'Internal: admission slots 1..settings.max_running; a running attempt holds one (with its lease), claim takes a free one or refuses admission_full';

DROP INDEX compaction.audit_events_recorded_at_idx;
CREATE INDEX audit_events_event_id_idx ON compaction.audit_events (event_id);
ALTER TABLE compaction.audit_events ALTER COLUMN recorded_at SET DEFAULT pg_catalog.now();
COMMENT ON TABLE compaction.audit_events IS
    'Append-only event log, one row per state change (claim, completion, failure, lease_expiry, import, erasure); metadata only, never text';

DO $$
DECLARE
    v_column record;
    v_next   bigint;
BEGIN
    FOR v_column IN
        SELECT * FROM (VALUES ('jobs', 'job_id'), ('job_summaries', 'summary_id'),
                              ('audit_events', 'event_id')) AS c (tbl, col)
    LOOP
        EXECUTE pg_catalog.format('SELECT coalesce(max(%I), 0) + 1 FROM compaction.%I',
                                  v_column.col, v_column.tbl) INTO v_next;
        EXECUTE pg_catalog.format('ALTER TABLE compaction.%I ALTER COLUMN %I DROP DEFAULT',
                                  v_column.tbl, v_column.col);
        EXECUTE pg_catalog.format('DROP SEQUENCE compaction.%I',
                                  v_column.tbl || '_' || v_column.col || '_seq');
        EXECUTE pg_catalog.format(
            'ALTER TABLE compaction.%I ALTER COLUMN %I ADD GENERATED ALWAYS AS IDENTITY (START WITH %s)',
            v_column.tbl, v_column.col, v_next);
    END LOOP;
END
$$;

CREATE INDEX runs_conversation_idx ON compaction_source.runs (conversation_id);
DROP INDEX compaction_source.runs_run_idx;
DROP INDEX compaction_source.messages_run_idx;
CREATE INDEX messages_run_idx ON compaction_source.messages (run_id);
ALTER TABLE compaction_source.runs DROP CONSTRAINT runs_pkey;
ALTER TABLE compaction_source.runs ADD CONSTRAINT runs_pkey PRIMARY KEY (run_id);
ALTER TABLE compaction_source.messages DROP CONSTRAINT messages_pkey;
ALTER TABLE compaction_source.messages ADD CONSTRAINT messages_pkey PRIMARY KEY (message_id);
ALTER TABLE compaction_source.messages
    ADD CONSTRAINT messages_run_fkey FOREIGN KEY (run_id)
        REFERENCES compaction_source.runs (run_id);

CALL compaction.assign_ownership();
GRANT EXECUTE ON FUNCTION compaction.range_hash(text[]) TO compaction_worker, compaction_reader;
