-- 0049_worker_surface_again: the worker surface, second pass (issue 62).
--
-- * A lease is bounded by its effect, on the clock: it must end 1 second to 1 day after
--   now (compaction.lease_fits in line, compaction.lease_end for the rest), in claim,
--   claim_targets, claim_next_targets, heartbeat and dequeue. Intervals compare with
--   30-day months, which let '10000 years -3599999 days' (144 years) pass as a day.
--   compaction.checked_lease is gone.
-- * A refused call takes no lock: fence reads the attempt's claiming login before it
--   locks the conversation, and the claims answer the refusals the committed state gives
--   (compaction.claim_settled) without the lock. A transaction that took a conversation's
--   lock gets idle_in_transaction_session_timeout (and, from PostgreSQL 17,
--   transaction_timeout) of 60 s where its caller set none (fence, claim, claim_targets,
--   claim_next_targets, reap_conversation).
-- * complete takes a finish reason that is a code, a response id of at most 200 bytes of
--   an id's characters and a tool-call count that is not negative (else CP020).
-- * The tracking triggers act only on tables the source views read
--   (compaction.source_reads): one attached to a scratch table does nothing.

CREATE FUNCTION compaction.lease_end(p_lease interval, p_now timestamptz,
                                     p_errcode text DEFAULT 'CP023')
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_end timestamptz;
BEGIN
    BEGIN
        IF p_now + p_lease >= p_now + interval '1 second'
           AND p_now + p_lease <= GREATEST(p_now + interval '1 day',
                                           p_now + interval '24 hours') THEN
            v_end := p_now + p_lease;
        END IF;
    EXCEPTION WHEN datetime_field_overflow THEN
        v_end := NULL;  -- an end off the calendar is no lease
    END;
    IF v_end IS NULL AND p_errcode = 'CP020' THEN
        RAISE EXCEPTION 'a lease between 1 second and 1 day is needed, counted by when it ends: % from % is not',
                coalesce(p_lease::text, 'NULL'), p_now
            USING ERRCODE = 'CP020';
    ELSIF v_end IS NULL THEN
        RAISE EXCEPTION 'a lease between 1 second and 1 day is needed, counted by when it ends: % from % is not',
                coalesce(p_lease::text, 'NULL'), p_now
            USING ERRCODE = 'CP023';
    END IF;
    RETURN v_end;
END
$$;
COMMENT ON FUNCTION compaction.lease_end(interval, timestamptz, text) IS
    'Internal: p_now + p_lease when that ends 1 second to 1 day after p_now (on the clock, not by comparing intervals), else CP023 (or p_errcode)';

CREATE FUNCTION compaction.lease_fits(p_lease interval, p_now timestamptz)
RETURNS boolean
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$
    SELECT CASE
               WHEN p_lease OPERATOR(pg_catalog.>=) '00:00:01'::pg_catalog.interval
                    AND p_lease OPERATOR(pg_catalog.<=) '1 day'::pg_catalog.interval
                    AND pg_catalog.date_part('year', p_lease) OPERATOR(pg_catalog.=) 0
                    AND pg_catalog.date_part('month', p_lease) OPERATOR(pg_catalog.=) 0
                    AND pg_catalog.date_part('day', p_lease) OPERATOR(pg_catalog.>=) 0
                    AND pg_catalog.date_part('day', p_lease) OPERATOR(pg_catalog.<=) 1
               THEN (p_now OPERATOR(pg_catalog.+) p_lease)
                        OPERATOR(pg_catalog.>=) (p_now OPERATOR(pg_catalog.+) '00:00:01'::pg_catalog.interval)
                    AND (p_now OPERATOR(pg_catalog.+) p_lease)
                        OPERATOR(pg_catalog.<=) (p_now OPERATOR(pg_catalog.+) '1 day'::pg_catalog.interval)
               ELSE false
           END
$$;
COMMENT ON FUNCTION compaction.lease_fits(interval, timestamptz) IS
    'Internal: true for a usual lease (no months, at most a day and some time) that ends 1 second to 1 day after p_now; the rest is for lease_end';

CREATE FUNCTION compaction.claim_settled(
    p_conversation_id text,
    p_scope           text,
    p_from_pair       int,
    p_source_hash     text,
    p_model           text,
    p_prompt_version  text,
    p_now             timestamptz,
    OUT reason        text,
    OUT job_id        bigint)
RETURNS record
LANGUAGE plpgsql
STABLE
AS $$
DECLARE
    v_job_id  bigint;
    v_live    boolean;
    v_expired boolean;
    v_count   int;
BEGIN
    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;
    job_id := v_job_id;
    IF v_job_id IS NULL THEN
        RETURN;
    END IF;
    SELECT coalesce(pg_catalog.bool_or(a.state = 'running' AND a.lease_expires_at > p_now),
                    false),
           coalesce(pg_catalog.bool_or(a.state = 'running' AND a.lease_expires_at <= p_now),
                    false),
           pg_catalog.count(*)
    INTO v_live, v_expired, v_count
    FROM compaction.attempts AS a
    WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
    IF v_expired THEN
        RETURN;  -- the claim reaps it, under the lock
    END IF;
    reason := CASE WHEN EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                                WHERE s.conversation_id = p_conversation_id
                                  AND s.job_id = v_job_id) THEN 'already_completed'
                   WHEN v_live THEN 'already_running'
                   WHEN v_count >= 2 THEN 'attempts_exhausted' END;
END
$$;
COMMENT ON FUNCTION compaction.claim_settled(text, text, int, text, text, text, timestamptz) IS
    'Internal: the refusal the committed state already gives a claim of this identity (already_completed, already_running, attempts_exhausted) and its job, read without a lock; NULL when only a claim under the conversation''s lock can tell';

CREATE FUNCTION compaction.source_reads(p_relid oid)
RETURNS boolean
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    WITH RECURSIVE rules AS (
        SELECT rw.oid, rw.ev_class
        FROM pg_catalog.pg_rewrite AS rw
        WHERE rw.ev_class IN (pg_catalog.to_regclass('compaction.source_runs'),
                              pg_catalog.to_regclass('compaction.source_messages'))
        UNION
        SELECT rw.oid, rw.ev_class
        FROM rules AS ru
        JOIN pg_catalog.pg_depend AS d
          ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = ru.oid
        JOIN pg_catalog.pg_class AS v ON v.oid = d.refobjid AND v.relkind = 'v'
        JOIN pg_catalog.pg_rewrite AS rw ON rw.ev_class = v.oid
        WHERE d.refclassid = 'pg_catalog.pg_class'::regclass
          AND d.deptype = 'n'
          AND d.refobjid <> ru.ev_class
    )
    SELECT EXISTS (
        SELECT 1
        FROM rules AS ru
        JOIN pg_catalog.pg_depend AS d
          ON d.classid = 'pg_catalog.pg_rewrite'::regclass AND d.objid = ru.oid
        WHERE d.refclassid = 'pg_catalog.pg_class'::regclass
          AND d.deptype = 'n'
          AND d.refobjid = p_relid)
$$;
COMMENT ON FUNCTION compaction.source_reads(oid) IS
    'Internal: true when the source views (through any depth of views) read this table: the only tables whose tracking triggers act';

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
SET jit = off
-- Every lookup in this call is by key. A worker's connection lives for hours, and a plan
-- cached while the engine's tables were still small (a new deployment, a first backlog)
-- would scan them instead, at a cost that grows with every job until autovacuum's ANALYZE
-- has them planned again (revision 0017 measured a claim -> complete cycle at less than
-- half its speed after 1,600 cycles on one connection). With sequential scans disabled
-- the first plans are the index plans, and they hold whatever the tables' size; jit off,
-- since the disabled scans' cost would cross jit_above_cost and compile on every call.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- Revision 0045: caller_now and lease_end are called only when they have
    -- something to check (a given p_now, a lease out of range); each call carries a SET
    -- clause, whose save and restore of the settings cost more than the rule.
    v_now         timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                      ELSE compaction.caller_now(p_now) END;
    v_lease       timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                      THEN v_now + p_lease
                                      ELSE compaction.lease_end(p_lease, v_now) END;
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_is_target   boolean;
    v_answer      record;
    v_settled     record;
    v_oversized   text;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
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

    -- The range as it is now, from the derived state (no message text read): the pair
    -- count decides whether it is a target, the stored ids and hash whether it matches.
    -- Read before the conversation's lock (revision 0038): the lock orders the engine's
    -- writers of the conversation, and none of them changes its history, so the answer
    -- is the same either side of it; judged from the views (Citus, an untracked source)
    -- it is most of a claim's time, which the conversation's other writers no longer wait
    -- for. With the derived state in use, current_range's read is made here (revision
    -- 0045, as range_replies does): the call of a set-returning definer function cost
    -- more than its one statement.
    IF compaction.derived_state_current() THEN
        SELECT coalesce((SELECT cs.pair_count::bigint FROM compaction.conversation_state AS cs
                         WHERE cs.conversation_id = p_conversation_id), 0),
               r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM (SELECT 1) AS one
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
    ELSE
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    END IF;
    v_is_target := compaction.is_target(p_from_pair, v_pairs);

    -- Revision 0049 (issue 62): a claim the judgement or the committed state already
    -- refuses takes no lock (claim_range answers not_eligible and source_mismatch before
    -- any write; claim_settled the refusals of an identity's state), so no refused call
    -- holds the conversation, whatever its caller's transaction does next.
    IF v_is_target IS NOT TRUE OR NOT compaction.valid_source_hash(p_source_hash)
       OR v_target_hash IS DISTINCT FROM p_source_hash
       OR v_target_ids IS DISTINCT FROM p_source_message_ids THEN
        v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                           p_source_message_ids, p_source_hash, p_model,
                                           p_prompt_version, p_worker, v_now, v_lease,
                                           v_is_target, v_target_ids, v_target_hash);
        RETURN QUERY SELECT false, v_answer.reason, NULL::bigint, NULL::int,
                            NULL::timestamptz;
        RETURN;
    END IF;
    v_settled := compaction.claim_settled(p_conversation_id, p_scope, p_from_pair,
                                          p_source_hash, p_model, p_prompt_version, v_now);
    IF v_settled.reason IS NOT NULL THEN
        RETURN QUERY SELECT false, v_settled.reason, v_settled.job_id, NULL::int,
                            NULL::timestamptz;
        RETURN;
    END IF;

    -- From here on the conversation's engine rows are ours until commit: the statement of
    -- lock_conversation, written out here and in fence (revision 0018), where a call per
    -- cycle would cost as much as the row lock itself.
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
    -- where the caller set no bound, the transaction gets one (transaction_timeout where
    -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
    -- server), so a caller that forgets its transaction open cannot hold a conversation
    -- for long (docs/security.md).
    IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
        PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
    END IF;
    IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
        PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
    END IF;
    -- The one writer under the lock that follows a change of history is an erasure (its
    -- history deleted before it or with it): a conversation with an erasure's tombstone
    -- is judged again, under the lock, so that no claim lands after an erasure on
    -- history it judged before.
    IF EXISTS (SELECT 1 FROM compaction.event_log AS e
               WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
        v_is_target := compaction.is_target(p_from_pair, v_pairs);
    END IF;
    -- An assignment, not a query: a claim -> complete cycle costs 1.0% more
    -- instructions than with the checks written out in claim (a query over the call,
    -- 1.6%).
    v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                       p_source_message_ids, p_source_hash, p_model,
                                       p_prompt_version, p_worker, v_now, v_lease,
                                       v_is_target, v_target_ids, v_target_hash);
    claimed := v_answer.claimed;
    reason := v_answer.reason;
    job_id := v_answer.job_id;
    attempt := v_answer.attempt;
    lease_expires_at := v_answer.lease_expires_at;
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, bound to the calling login, or returns the first refusal reason (see DESIGN §6)';

CREATE OR REPLACE FUNCTION compaction.claim_targets(
    p_conversation_id    text,
    p_scope              text,
    p_from_pairs         int[],
    p_source_message_ids text[],
    p_source_hashes      text[],
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- As claim's: every lookup by key, whatever the tables' statistics when first planned.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_lease      timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                     THEN v_now + p_lease
                                     ELSE compaction.lease_end(p_lease, v_now) END;
    v_n          int := coalesce(pg_catalog.cardinality(p_from_pairs), 0);
    v_oversized  text;
    v_accepts    boolean;
    v_refusals   text[] := '{}';
    v_judge      int[] := '{}';
    v_from       int[];
    v_target_ids text[];
    v_settled    text[] := '{}';
    v_settled_job bigint[] := '{}';
    v_open       boolean := false;
    v_locked     boolean := false;
    v_pre        text;
    v_pre_job    bigint;
    v_hashes     text[];
    v_at         int;
    v_reason     text;
    v_answer     record;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    IF v_n = 0 THEN
        RETURN;
    END IF;
    -- A batch is what a worker's free model calls can take: a few ranges, never a
    -- conversation's history held under its lock at once.
    IF v_n > 100 THEN
        RAISE EXCEPTION 'claim_targets takes at most 100 ranges a call, got %', v_n
            USING ERRCODE = 'CP020';
    END IF;
    IF pg_catalog.array_ndims(p_from_pairs) <> 1
       OR pg_catalog.array_ndims(p_source_message_ids) IS DISTINCT FROM 2
       OR pg_catalog.array_length(p_source_message_ids, 1) <> v_n
       OR pg_catalog.array_ndims(p_source_hashes) IS DISTINCT FROM 1
       OR pg_catalog.cardinality(p_source_hashes) <> v_n THEN
        RAISE EXCEPTION 'claim_targets needs, for each of its % ranges, one row of source ids and one hash', v_n
            USING ERRCODE = 'CP020',
                  HINT = 'p_source_message_ids is a two-dimensional array: one row of 20 ids per range.';
    END IF;

    -- The checks before the conversation's lock, per range, in the contract's order.
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    FOR i IN 1 .. v_n LOOP
        v_reason := CASE
            WHEN p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] IS NULL
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] < 0
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] % 10 <> 0
                THEN 'invalid_range'
            WHEN NOT compaction.valid_source_ids(ARRAY(
                     SELECT pg_catalog.unnest(p_source_message_ids[
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])))
                THEN 'invalid_source_ids'
            WHEN v_accepts IS NOT TRUE THEN 'prompt_version_closed'
        END;
        v_refusals := v_refusals || v_reason;
        IF v_reason IS NULL THEN
            v_judge := v_judge || p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        END IF;
    END LOOP;

    IF pg_catalog.cardinality(v_judge) > 0 THEN
        -- One judgement for the batch, before the conversation's lock as in claim: which
        -- of its ranges are targets now, with their current ids (one row of 20 per
        -- target) and hashes. Judged again under the lock where an erasure's tombstone
        -- is (as in claim).
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
        INTO v_from, v_target_ids, v_hashes
        FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        -- Revision 0049 (issue 62): the lock only when some range could be claimed, as
        -- far as the judgement and the committed state tell (claim_settled); otherwise
        -- every range is refused without it (a refused claim holds nothing).
        FOR i IN 1 .. v_n LOOP
            v_pre := NULL;
            v_pre_job := NULL;
            v_at := pg_catalog.array_position(
                v_from, p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1]);
            IF v_refusals[i] IS NULL AND v_at IS NOT NULL AND NOT v_open
               AND compaction.valid_source_hash(
                       p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1])
               AND v_hashes[v_at] IS NOT DISTINCT FROM
                       p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1]
               AND ARRAY(SELECT pg_catalog.unnest(v_target_ids[v_at:v_at][:]))
                   IS NOT DISTINCT FROM
                   ARRAY(SELECT pg_catalog.unnest(p_source_message_ids[
                             pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                             pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])) THEN
                SELECT c.reason, c.job_id INTO v_pre, v_pre_job
                FROM compaction.claim_settled(
                    p_conversation_id, p_scope,
                    p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1],
                    p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1],
                    p_model, p_prompt_version, v_now) AS c;
                v_open := v_pre IS NULL;
            END IF;
            v_settled := v_settled || v_pre;
            v_settled_job := v_settled_job || v_pre_job;
        END LOOP;
    END IF;
    IF v_open THEN
        v_locked := true;
        -- The conversation's engine rows are ours until commit (claim's statement).
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
        -- where the caller set no bound, the transaction gets one (transaction_timeout where
        -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
        -- server), so a caller that forgets its transaction open cannot hold a conversation
        -- for long (docs/security.md).
        IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
            PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
        END IF;
        IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
            PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
        END IF;
        IF EXISTS (SELECT 1 FROM compaction.event_log AS e
                   WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
            SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
            INTO v_from, v_target_ids, v_hashes
            FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        END IF;
    END IF;

    FOR i IN 1 .. v_n LOOP
        IF v_refusals[i] IS NOT NULL THEN
            RETURN QUERY
            SELECT p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1], false,
                   v_refusals[i], NULL::bigint, NULL::int, NULL::timestamptz;
            CONTINUE;
        END IF;
        -- Without the lock: the refusals the committed state gave (claim_range answers
        -- the rest, not_eligible and source_mismatch, before any write).
        IF NOT v_locked AND v_settled[i] IS NOT NULL THEN
            RETURN QUERY
            SELECT p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1], false,
                   v_settled[i], v_settled_job[i], NULL::int, NULL::timestamptz;
            CONTINUE;
        END IF;
        from_pair := p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        v_at := pg_catalog.array_position(v_from, from_pair);
        v_answer := compaction.claim_range(
            p_conversation_id, p_scope, from_pair,
            ARRAY(SELECT pg_catalog.unnest(p_source_message_ids[
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])),
            p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1],
            p_model, p_prompt_version, p_worker, v_now, v_lease,
            v_at IS NOT NULL,
            CASE WHEN v_at IS NOT NULL
                 THEN ARRAY(SELECT pg_catalog.unnest(v_target_ids[v_at:v_at][:])) END,
            v_hashes[v_at]);
        claimed := v_answer.claimed;
        reason := v_answer.reason;
        job_id := v_answer.job_id;
        attempt := v_answer.attempt;
        lease_expires_at := v_answer.lease_expires_at;
        RETURN NEXT;
        -- No slot was free: the rest of the batch would find none either.
        EXIT WHEN reason = 'admission_full';
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_targets(text, text, int[], text[], text[], text, text, text, interval, timestamptz) IS
    'Claims several ranges of one conversation under one lock and one judgement, each answered as compaction.claim would answer it in the order given (one row per range; the first admission_full ends the batch); for a worker with that many model calls free';

CREATE OR REPLACE FUNCTION compaction.claim_next_targets(
    p_conversation_id text,
    p_scope           text,
    p_limit           int,
    p_model           text,
    p_prompt_version  text,
    p_worker          text,
    p_lease           interval DEFAULT '5 minutes',
    p_now             timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean, claimed boolean, reason text, job_id bigint,
               attempt int, lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- As claim's: every lookup by key, whatever the tables' statistics when first planned.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now       timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                    ELSE compaction.caller_now(p_now) END;
    v_lease     timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                    THEN v_now + p_lease
                                    ELSE compaction.lease_end(p_lease, v_now) END;
    v_oversized text;
    v_accepts   boolean;
    v_from      int[];
    v_ids       text[];
    v_hashes    text[];
    v_done      boolean[];
    v_claims    int := 0;
    v_ended     boolean := false;
    v_locked    boolean := false;
    v_answer    record;
    v_open      boolean;
    v_pre       text;
    v_pre_job   bigint;
    v_settled   text[];
    v_settled_job bigint[];
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_next_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    -- As claim_targets: a batch is what a worker's free model calls can take.
    IF p_limit IS NULL OR p_limit < 0 OR p_limit > 100 THEN
        RAISE EXCEPTION 'claim_next_targets claims 0 to 100 ranges a call, got %',
                coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'CP020';
    END IF;

    -- The look is worker_targets' answer, judged before the conversation's lock as in
    -- claim. With a claim to try, the conversation's engine rows are then ours until
    -- commit (claim's statement), and it is looked at again under the lock where an
    -- erasure's tombstone is (as in claim). Nothing to claim, no lock.
    LOOP
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair),
               pg_catalog.array_agg(t.completed ORDER BY t.from_pair)
        INTO v_from, v_ids, v_hashes, v_done
        FROM compaction.worker_targets(p_conversation_id, p_scope, p_model,
                                       p_prompt_version) AS t;
        EXIT WHEN v_locked OR p_limit = 0 OR NOT coalesce(false = ANY (v_done), false);
        SELECT pv.accepts_new_jobs INTO v_accepts
        FROM compaction.prompt_versions AS pv
        WHERE pv.prompt_version = p_prompt_version;
        -- Revision 0049 (issue 62): the lock only when some target could be claimed, as
        -- far as the committed state tells (claim_settled); otherwise every target tried
        -- is refused without it (a refused claim holds nothing).
        v_open := false;
        v_settled := '{}';
        v_settled_job := '{}';
        FOR k IN 1 .. coalesce(pg_catalog.cardinality(v_from), 0) LOOP
            v_pre := NULL;
            v_pre_job := NULL;
            IF NOT v_done[k] AND NOT v_open AND v_accepts IS TRUE
               AND compaction.valid_source_hash(v_hashes[k])
               AND compaction.valid_source_ids(ARRAY(SELECT pg_catalog.unnest(v_ids[k:k][:]))) THEN
                SELECT c.reason, c.job_id INTO v_pre, v_pre_job
                FROM compaction.claim_settled(p_conversation_id, p_scope, v_from[k],
                                              v_hashes[k], p_model, p_prompt_version,
                                              v_now) AS c;
                v_open := v_pre IS NULL;
            END IF;
            v_settled := v_settled || v_pre;
            v_settled_job := v_settled_job || v_pre_job;
        END LOOP;
        EXIT WHEN NOT v_open;
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
        -- where the caller set no bound, the transaction gets one (transaction_timeout where
        -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
        -- server), so a caller that forgets its transaction open cannot hold a conversation
        -- for long (docs/security.md).
        IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
            PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
        END IF;
        IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
            PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
        END IF;
        v_locked := true;
        EXIT WHEN NOT EXISTS (SELECT 1 FROM compaction.event_log AS e
                              WHERE e.conversation_id = p_conversation_id
                                AND e.kind = 'erasure');
    END LOOP;

    FOR k IN 1 .. coalesce(pg_catalog.cardinality(v_from), 0) LOOP
        from_pair := v_from[k];
        to_pair := v_from[k] + 9;
        source_message_ids := ARRAY(SELECT pg_catalog.unnest(v_ids[k:k][:]));
        source_hash := v_hashes[k];
        completed := v_done[k];
        claimed := NULL;
        reason := NULL;
        job_id := NULL;
        attempt := NULL;
        lease_expires_at := NULL;
        IF NOT completed AND v_claims < p_limit AND NOT v_ended THEN
            -- claim's checks in the contract's order. The range is a target with exactly
            -- these ids and this hash: never not_eligible, and source_mismatch only where
            -- its texts could not be hashed (no valid hash).
            IF NOT compaction.valid_source_ids(source_message_ids) THEN
                claimed := false;
                reason := 'invalid_source_ids';
            ELSIF v_accepts IS NOT TRUE THEN
                claimed := false;
                reason := 'prompt_version_closed';
            ELSIF NOT v_locked AND v_settled[k] IS NOT NULL THEN
                -- The refusal the committed state gave, without the lock (revision 0049).
                claimed := false;
                reason := v_settled[k];
                job_id := v_settled_job[k];
            ELSE
                v_answer := compaction.claim_range(
                    p_conversation_id, p_scope, from_pair, source_message_ids, source_hash,
                    p_model, p_prompt_version, p_worker, v_now, v_lease,
                    true, source_message_ids, source_hash);
                claimed := v_answer.claimed;
                reason := v_answer.reason;
                job_id := v_answer.job_id;
                attempt := v_answer.attempt;
                lease_expires_at := v_answer.lease_expires_at;
            END IF;
            v_claims := v_claims + claimed::int;
            -- A range refused for itself (another worker's attempt running, attempts
            -- exhausted) gives its turn to the next target; no slot free, or a closed
            -- prompt version, would refuse every target after it too.
            v_ended := reason IN ('admission_full', 'prompt_version_closed');
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz) IS
    'The conversation''s targets, each with whether this identity holds a summary (as worker_targets), and up to p_limit claims among those without one, tried in order, each answered as compaction.claim would answer it (claimed NULL: not tried; the first admission_full or prompt_version_closed ends the claims): a worker''s look and first claims under one judgement';

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
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                  ELSE compaction.caller_now(p_now) END;
    v_lease   timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                  THEN v_now + p_lease
                                  ELSE compaction.lease_end(p_lease, v_now) END;
    v_attempt compaction.attempts;
BEGIN
    v_attempt := (compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id)).attempt_row;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET lease_expires_at = v_lease
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    -- The slot carries a copy of the lease: a renewed attempt keeps counting.
    UPDATE compaction.admission AS ad
    SET lease_expires_at = v_lease
    WHERE ad.slot = v_attempt.slot AND ad.holder_conversation_id = v_attempt.conversation_id
      AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    RETURN QUERY SELECT true, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (ending 1 second..1 day from now, else CP023); ok = false if fenced off or claimed by another login (lease_lost)';

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
    v_token     uuid;
    v_taken     int := 0;
BEGIN
    IF p_scope IS NULL OR p_scope = '' THEN
        RAISE EXCEPTION 'dequeue needs a non-empty scope' USING ERRCODE = 'CP020';
    END IF;
    -- At most 1,000 a call (revision 0018): one call used to hide a whole scope's queue
    -- from every other worker for the lease.
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 1000 THEN
        RAISE EXCEPTION 'dequeue takes a limit between 1 and 1000 entries, got %',
                coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'CP020';
    END IF;
    -- Bounded by when it ends, on the clock (revision 0049, as the attempts' leases):
    -- intervals compare with 30-day months, which let a lease of years pass as a day.
    v_until := CASE WHEN compaction.lease_fits(p_lease, v_now) THEN v_now + p_lease
                    ELSE compaction.lease_end(p_lease, v_now, 'CP020') END;
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
        -- The token is drawn first: Citus takes no volatile function into an UPDATE of
        -- a distributed table.
        v_token := pg_catalog.gen_random_uuid();
        RETURN QUERY
        UPDATE compaction.queue AS q
        SET leased_until = v_until, lease_token = v_token, requeued_at = NULL
        WHERE q.conversation_id = v_candidate.conversation_id AND q.scope = p_scope
        RETURNING q.conversation_id, q.scope, q.enqueued_at, q.lease_token, q.leased_until;
        v_taken := v_taken + 1;
        EXIT WHEN v_taken >= p_limit;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.dequeue(text, int, interval) IS
    'Leases up to p_limit (1 to 1000, else CP020) visible entries of one scope, oldest first, for p_lease (1 second to 1 day, server clock); concurrent workers get disjoint entries; returns each lease_token';

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
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- caller_now only for a given p_now (revision 0045, as in claim).
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_fenced     record;
    v_attempt    compaction.attempts;
    v_job        compaction.jobs;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- The fields the worker chooses reach the auditor (audit_jobs), who never sees
    -- content (revision 0049, issue 62): a finish reason is a code (at most 64 bytes:
    -- stop, length, incomplete:max_output_tokens, ...), a response id an id (at most 200
    -- bytes of letters, digits and _ . : -), a tool-call count never negative; anything
    -- else is an error that changes nothing, before the fence. Tested with ltrim rather
    -- than a regular expression, as valid_source_hash is (revision 0032): the usual
    -- 'stop' costs one comparison.
    IF p_finish_reason IS DISTINCT FROM 'stop' AND p_finish_reason IS NOT NULL
       AND NOT (pg_catalog.octet_length(p_finish_reason) <= 64
                AND pg_catalog.ltrim(pg_catalog.left(p_finish_reason, 1),
                                     'abcdefghijklmnopqrstuvwxyz') = ''
                AND pg_catalog.ltrim(p_finish_reason,
                                     'abcdefghijklmnopqrstuvwxyz0123456789_.:-') = '') THEN
        RAISE EXCEPTION 'p_finish_reason must be a code: ^[a-z][a-z0-9_.:-]{0,63}$ (e.g. stop, length), not free text'
            USING ERRCODE = 'CP020';
    END IF;
    IF p_response_id IS NOT NULL
       AND NOT (pg_catalog.octet_length(p_response_id) BETWEEN 1 AND 200
                AND pg_catalog.ltrim(p_response_id,
                        'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-')
                    = '') THEN
        RAISE EXCEPTION 'p_response_id must be an id: 1 to 200 letters, digits or _ . : - (got % bytes of something else)',
                pg_catalog.octet_length(p_response_id)
            USING ERRCODE = 'CP020';
    END IF;
    IF p_tool_call_count < 0 THEN
        RAISE EXCEPTION 'p_tool_call_count must not be negative' USING ERRCODE = 'CP020';
    END IF;
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    -- Without p_stats, v_stats is what attempt_stats answers for NULL: every column NULL.
    IF p_stats IS NOT NULL THEN
        v_stats := compaction.attempt_stats(p_stats);
    END IF;
    v_fenced := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    v_attempt := v_fenced.attempt_row;
    v_job := v_fenced.job_row;
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
            figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept,
            figures_invented = v_stats.figures_invented
        WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt
        RETURNING a.* INTO v_attempt;
        PERFORM compaction.release_slot(v_attempt.conversation_id, v_attempt);
        RETURN QUERY SELECT false, v_problem, NULL::bigint;
        RETURN;
    END IF;

    INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
    VALUES (v_attempt.conversation_id, p_job_id, p_attempt, p_summary, v_now)
    RETURNING summary_id INTO v_summary_id;
    -- The new summary's verdict (revision 0045): the common case, the first summary of
    -- its range in its scope, is written here from the job row fence returned, as
    -- rederive_summary_verdicts' first statement writes it from a read of the job (and
    -- under the same conversation_state row, taken first); that function judges the rest,
    -- where the range already has a verdict. Its call, a definer with two SET clauses, and
    -- its reads of the summary and the job were 2.9% of a claim -> complete cycle's
    -- instructions (docs/benchmarks.md). Not on Citus, where no derived state is kept.
    IF pg_catalog.current_setting('citus.version', true) IS NULL
       OR NOT compaction.engine_distributed() THEN
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (v_attempt.conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT v_attempt.conversation_id, v_summary_id, v_job.scope, v_job.from_pair,
               CASE WHEN NOT coalesce((SELECT pv.projectable
                                       FROM compaction.prompt_versions AS pv
                                       WHERE pv.prompt_version = v_job.prompt_version), false)
                        THEN 'version_not_projectable'
                    WHEN NOT coalesce((SELECT r.source_hash = v_job.source_hash
                                              AND r.source_message_ids = v_job.source_message_ids
                                       FROM compaction.ranges AS r
                                       WHERE r.conversation_id = v_attempt.conversation_id
                                         AND r.from_pair = v_job.from_pair), false)
                        THEN 'stale_source' END
        WHERE NOT EXISTS (SELECT 1 FROM compaction.summary_verdicts AS o
                          WHERE o.conversation_id = v_attempt.conversation_id
                            AND o.from_pair = v_job.from_pair AND o.scope = v_job.scope);
        IF NOT FOUND THEN
            PERFORM compaction.rederive_summary_verdicts(v_attempt.conversation_id, '{}',
                                                         v_summary_id);
        END IF;
    END IF;
    UPDATE compaction.attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = v_now,
        finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
        input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept,
        figures_invented = v_stats.figures_invented
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    RETURNING a.* INTO v_attempt;
    -- release_slot's statement, written out (revision 0045): the call of a definer with a
    -- SET clause cost more than the update (1.0% of a cycle's instructions).
    IF v_attempt.slot IS NOT NULL THEN
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.slot = v_attempt.slot AND ad.holder_conversation_id = v_attempt.conversation_id
          AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    END IF;
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures kept and invented; finish reason a code, response id an id of at most 200 bytes, else CP020): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off or claimed by another login';

CREATE OR REPLACE FUNCTION compaction.fence(p_job_id bigint, p_attempt int, p_now timestamptz,
                                 p_conversation_id text,
                                 OUT attempt_row compaction.attempts,
                                 OUT job_row compaction.jobs)
RETURNS record
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_claimed_by text;
BEGIN
    IF p_conversation_id IS NULL THEN
        SELECT j.* INTO job_row
        FROM compaction.jobs AS j
        WHERE j.job_id = p_job_id;
    ELSE
        SELECT j.* INTO job_row
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.job_id = p_job_id;
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- Who claimed the attempt, read before any lock (revision 0049, issue 62): it never
    -- changes (attempts_guard), so a call refused for another login, or for an attempt
    -- that does not exist, answers without taking the conversation's lock, and a caller
    -- that keeps its transaction open after a refusal holds nothing of another's.
    SELECT a.claimed_by INTO v_claimed_by
    FROM compaction.attempts AS a
    WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_claimed_by IS DISTINCT FROM session_user
       AND NOT compaction.caller_is_privileged() THEN
        job_row := NULL;
        RETURN;
    END IF;
    -- lock_conversation's statement (written out, as in claim).
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (job_row.conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
    -- where the caller set no bound, the transaction gets one (transaction_timeout where
    -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
    -- server), so a caller that forgets its transaction open cannot hold a conversation
    -- for long (docs/security.md).
    IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
        PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
    END IF;
    IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
        PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
    END IF;
    SELECT a.* INTO attempt_row
    FROM compaction.attempts AS a
    WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- Only a superuser's or the owner's p_now can be this early (caller_now).
    IF attempt_row.state = 'running' AND p_now < attempt_row.started_at THEN
        RAISE EXCEPTION 'p_now % is before attempt % of job % started (%)',
                p_now, p_attempt, p_job_id, attempt_row.started_at
            USING ERRCODE = 'CP022';
    END IF;
    IF attempt_row.state = 'running' AND attempt_row.lease_expires_at <= p_now THEN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = p_now
        WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt
        RETURNING a.* INTO attempt_row;
        PERFORM compaction.release_slot(job_row.conversation_id, attempt_row);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz, text) IS
    'Internal: locks attempt (job_id, attempt) of the given conversation (or the job''s) and returns it with its job, first failing it (lease_expired) if its lease ran out; attempt_row NULL if unknown or claimed by another login (owner and superusers aside)';

CREATE OR REPLACE FUNCTION compaction.reap_conversation(p_conversation_id text, p_now timestamptz)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_expired compaction.attempts;
    v_jobs    bigint[] := '{}';
    v_scope   text;
BEGIN
    -- A conversation whose writer holds its lock right now is passed over: a fenced call
    -- settles the expiry of the attempt it holds itself, a claim reaps the identity it
    -- touches, and the next reap comes back for the rest. Two reapers never wait on each
    -- other either.
    IF NOT compaction.try_lock_conversation(p_conversation_id) THEN
        RETURN 0;
    END IF;
    -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
    -- where the caller set no bound, the transaction gets one (transaction_timeout where
    -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
    -- server), so a caller that forgets its transaction open cannot hold a conversation
    -- for long (docs/security.md).
    IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
        PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
    END IF;
    IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
        PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
    END IF;
    -- Under the lock the state and lease are read again, so nothing is reaped twice.
    FOR v_expired IN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = p_now
        WHERE a.conversation_id = p_conversation_id
          AND a.state = 'running' AND a.lease_expires_at <= p_now
        RETURNING a.*
    LOOP
        PERFORM compaction.release_slot(p_conversation_id, v_expired);
        v_jobs := v_jobs || v_expired.job_id;
    END LOOP;
    IF pg_catalog.cardinality(v_jobs) > 0 THEN
        -- The expired attempt's worker is gone and can no longer nudge anyone: put the
        -- conversation back on the queue (enqueue's upsert: an entry leased right now is
        -- marked requeued, so the acknowledgement of a worker that examined it before
        -- this expiry keeps it), so the one retry the contract allows happens without a
        -- sweep.
        -- The scopes first, then enqueue: one statement each (DESIGN §11).
        FOREACH v_scope IN ARRAY ARRAY(SELECT DISTINCT j.scope
                                       FROM compaction.jobs AS j
                                       WHERE j.conversation_id = p_conversation_id
                                         AND j.job_id = ANY (v_jobs)
                                       ORDER BY 1)
        LOOP
            PERFORM compaction.enqueue(p_conversation_id, v_scope);
        END LOOP;
    END IF;
    RETURN pg_catalog.cardinality(v_jobs);
END
$$;
COMMENT ON FUNCTION compaction.reap_conversation(text, timestamptz) IS
    'Internal: reap for one conversation, under its lock; returns how many attempts it marked lease_expired';

CREATE OR REPLACE FUNCTION compaction.track_source_changes()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- One cached plan per statement: the transition tables and the runs' key lookups plan
-- the same for every write, and a custom plan per statement cost more than running it.
SET plan_cache_mode = force_generic_plan
-- Every lookup here (and in the rederive functions it calls) is by key. A generic plan
-- made while the tables were still small would scan them instead, and a long transaction
-- (a bulk import into a new database: no ANALYZE in between) would pay for that on every
-- statement, quadratically.
SET enable_seqscan = off
AS $$
DECLARE
    v_conversation_column text := TG_ARGV[0];
    v_run_column          text := nullif(TG_ARGV[1], '');
    v_conversations       text[] := '{}';
    v_runs                text[] := '{}';
    v_conversation        text;
    v_run_ids             text[];
    v_elsewhere           boolean;
    v_count               int;
    v_unchanged           boolean;
    v_touched             record;
    v_message_ids         text[];
    v_first_seq           bigint;
    v_first_id            text;
    v_runs_known          boolean := v_run_column IS NOT NULL;
BEGIN
    IF TG_LEVEL <> 'STATEMENT' OR TG_WHEN <> 'AFTER' OR TG_NARGS NOT IN (2, 3)
       OR v_conversation_column IS NULL THEN
        RAISE EXCEPTION 'track_source_changes must be an AFTER ... FOR EACH STATEMENT trigger with two or three arguments: the conversation id column, the run id column (or ''''), and for a table without a run column optionally its message id column'
            USING ERRCODE = 'CP020';
    END IF;
    -- Only on a table the source views read (revision 0049, issue 62): a trigger its
    -- owner attached to a scratch table does nothing. While the derived state is in use,
    -- the source's tables are those whose tracking triggers it was stamped with (two
    -- lookups by key); otherwise, and for a TRUNCATE, the views are walked.
    IF NOT coalesce((SELECT tg.oid = ANY (st.object_oids)
                     FROM pg_catalog.pg_trigger AS tg, compaction.source_tracking AS st
                     WHERE st.singleton AND tg.tgrelid = TG_RELID AND tg.tgname = TG_NAME
                       AND st.object_oids IS NOT NULL), false)
       AND NOT compaction.source_reads(TG_RELID) THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        -- No transition table says what went: stop trusting the derived state until a
        -- rebuild (every function judges from the views meanwhile, exact and slower).
        -- A rebuild's resume point goes too (revision 0030): the conversations before it
        -- lost rows no trigger re-derived, so the next rebuild starts over, and one under
        -- way fails at its next commit instead of putting them in use.
        UPDATE compaction.source_tracking
        SET stamp = NULL, object_oids = NULL, stamped_at = NULL,
            rebuild_stamp = NULL, rebuild_after = NULL, rebuild_done = NULL,
            rebuild_total = NULL, rebuild_started_at = NULL, rebuild_updated_at = NULL;
        RETURN NULL;
    END IF;

    -- The columns named by the arguments, as text (the form the views expose them in).
    -- Static statements over the transition tables keep their plans across calls, where
    -- dynamic SQL would be planned again for every statement of the host. Columns named
    -- conversation_id and run_id (the reference tables) are read directly: plpgsql plans
    -- a statement only when it first runs, per table, so these never meet a table
    -- without them; other names go through the row as jsonb.
    IF v_conversation_column = 'conversation_id' AND v_run_column = 'run_id' THEN
        IF TG_OP = 'INSERT' THEN
            SELECT coalesce(array_agg(n.conversation_id::text), '{}'),
                   coalesce(array_agg(n.run_id::text), '{}')
            INTO v_conversations, v_runs
            FROM new_rows AS n;
        ELSIF TG_OP = 'DELETE' THEN
            SELECT coalesce(array_agg(o.conversation_id::text), '{}'),
                   coalesce(array_agg(o.run_id::text), '{}')
            INTO v_conversations, v_runs
            FROM old_rows AS o;
        ELSE
            SELECT coalesce(array_agg(r.conversation_id), '{}'), coalesce(array_agg(r.run_id), '{}')
            INTO v_conversations, v_runs
            FROM (SELECT n.conversation_id::text, n.run_id::text FROM new_rows AS n
                  UNION ALL
                  SELECT o.conversation_id::text, o.run_id::text FROM old_rows AS o)
                AS r (conversation_id, run_id);
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM new_rows AS n
        CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(n) AS fields) AS j;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM old_rows AS o
        CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(o) AS fields) AS j;
    ELSE
        SELECT coalesce(array_agg(j.fields ->> v_conversation_column), '{}'),
               coalesce(array_agg(j.fields ->> v_run_column), '{}')
        INTO v_conversations, v_runs
        FROM (SELECT pg_catalog.to_jsonb(n) AS fields FROM new_rows AS n
              UNION ALL
              SELECT pg_catalog.to_jsonb(o) FROM old_rows AS o) AS j;
    END IF;

    v_conversation := v_conversations[1];

    -- A table without a run column (its runs are derived by the views, as in the Agents
    -- SDK recipe) that names its message id column: an INSERT into one conversation
    -- touches the runs the view gives the new messages, and the run of the message just
    -- before the earliest of them (an insert can cut that run short). An append then
    -- re-derives its own run, not the whole conversation. Updates and deletes re-derive
    -- the conversation: the run a message left cannot be known once it has left. When
    -- the view shows none of the new messages, or one without a seq, the same.
    -- Each new message is looked up by its id on its own (revision 0039, as revision
    -- 0035 does for the runs): asked as "these ids of this conversation", the generic
    -- plan priced the ids as ten and read the conversation's prefix of an index instead,
    -- every entry of a long conversation twice an insert (in a 30,000-item session of
    -- the Agents SDK's table, an append 4.5 ms against 2.2 ms at 600 items).
    IF NOT v_runs_known AND TG_NARGS = 3 AND TG_OP = 'INSERT'
       AND v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        v_message_ids := ARRAY(SELECT j.fields ->> TG_ARGV[2]
                               FROM new_rows AS n
                               CROSS JOIN LATERAL (SELECT pg_catalog.to_jsonb(n) AS fields) AS j);
        SELECT sm.seq, sm.message_id INTO v_first_seq, v_first_id
        FROM pg_catalog.unnest(v_message_ids) AS k (message_id)
        CROSS JOIN LATERAL (
            SELECT s.seq, s.message_id
            FROM compaction.source_messages AS s
            WHERE s.message_id = k.message_id AND s.conversation_id = v_conversation
            OFFSET 0) AS sm
        ORDER BY sm.seq NULLS FIRST, sm.message_id
        LIMIT 1;
        IF v_first_seq IS NOT NULL THEN
            v_runs := ARRAY(
                SELECT sm.run_id
                FROM pg_catalog.unnest(v_message_ids) AS k (message_id)
                CROSS JOIN LATERAL (
                    SELECT s.run_id
                    FROM compaction.source_messages AS s
                    WHERE s.message_id = k.message_id AND s.conversation_id = v_conversation
                    OFFSET 0) AS sm
                UNION
                (SELECT sp.run_id
                 FROM compaction.source_messages AS sp
                 WHERE sp.conversation_id = v_conversation
                   AND (sp.seq, sp.message_id) < (v_first_seq, v_first_id)
                 ORDER BY sp.seq DESC, sp.message_id DESC
                 LIMIT 1));
            v_runs_known := true;
        END IF;
    END IF;

    -- The common statement (an agent's single-row writes): its rows name one conversation
    -- and every run they name belongs to it now. A lookup of those runs decides that,
    -- where the general grouping below costs several times as much to start.
    IF v_conversation IS NOT NULL AND v_conversation = ALL (v_conversations) THEN
        IF NOT v_runs_known THEN
            PERFORM compaction.rederive(v_conversation, NULL, TG_RELID);
            RETURN NULL;
        END IF;
        v_run_ids := pg_catalog.array_remove(v_runs, NULL);
        IF pg_catalog.cardinality(v_run_ids) = 0 THEN
            RETURN NULL;  -- rows of no run: no pair can change
        ELSIF pg_catalog.cardinality(v_run_ids) > 2 THEN
            v_run_ids := ARRAY(SELECT DISTINCT r.run_id
                               FROM pg_catalog.unnest(v_run_ids) AS r (run_id));
        END IF;
        -- Whether a touched run lives in another conversation and, for a later statement
        -- of a transaction that already holds this conversation's conversation_state row
        -- (see rederive), rederive's no-change question and the pair count, in one
        -- statement: its snapshot is taken after the lock was, so it sees what rederive
        -- would see. An agent's second and third statements per Run end here.
        SELECT EXISTS (SELECT 1 FROM compaction.source_runs AS sr
                       WHERE sr.run_id = ANY (v_run_ids)
                         AND sr.conversation_id <> v_conversation),
               cs.pair_count,
               CASE WHEN cs.pair_count IS NOT NULL THEN
                   -- rederive's no-change test, word for word
                   NOT EXISTS (SELECT 1
                               FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                               CROSS JOIN LATERAL (
                                   SELECT 1 FROM compaction.source_runs AS sr
                                   WHERE sr.run_id = k.run_id
                                     AND sr.conversation_id = v_conversation
                                     AND sr.status IN ('completed', 'partial', 'clarify_pending')
                                     AND EXISTS (SELECT 1
                                                 FROM compaction.source_messages AS sm
                                                 WHERE sm.run_id = k.run_id
                                                   AND sm.role = 'user')
                                   OFFSET 0) AS r)
                   AND NOT EXISTS (SELECT 1
                                   FROM pg_catalog.unnest(v_run_ids) AS k (run_id)
                                   CROSS JOIN LATERAL (
                                       -- the conversation as a filter: see rederive
                                       -- (revision 0044)
                                       SELECT 1 FROM compaction.pairs AS p
                                       WHERE pg_catalog.hashtext(p.run_id)
                                             = pg_catalog.hashtext(k.run_id)
                                         AND p.run_id = k.run_id
                                         AND (p.conversation_id = v_conversation) IS TRUE
                                       OFFSET 0) AS q)
               END
        INTO v_elsewhere, v_count, v_unchanged
        FROM (SELECT) AS one
        LEFT JOIN compaction.conversation_state AS cs
          ON cs.conversation_id = v_conversation
         AND cs.xmin = pg_catalog.pg_current_xact_id()::xid;
        IF NOT v_elsewhere THEN
            IF v_count IS NULL THEN
                PERFORM compaction.rederive(v_conversation, v_run_ids, TG_RELID);
            ELSIF v_unchanged THEN
                NULL;
            ELSIF EXISTS (SELECT 1 FROM compaction.source_tracking AS st
                          WHERE st.singleton
                            AND (st.rebuild_after < v_conversation
                                 OR (st.rebuild_after IS NULL
                                     AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger AS t
                                                     WHERE t.tgrelid = TG_RELID
                                                       AND t.oid = ANY (st.object_oids)))))
                  AND compaction.defer_to_rebuild(v_conversation) THEN
                NULL;  -- left to the rebuild (compaction.rederive's test)
            ELSE
                PERFORM compaction.rederive_runs(v_conversation, v_run_ids, v_count);
            END IF;
            RETURN NULL;
        END IF;
    END IF;

    -- Each touched conversation once, in a fixed order (concurrent bulk writers lock
    -- conversation_state rows in one order), with the runs it must look at: the runs
    -- named by the rows, under the conversation the rows name and under the conversation
    -- the run belongs to now (a message filed under another conversation still counts
    -- against its run's).
    FOR v_touched IN
        WITH touched AS (
            SELECT t.conversation_id, t.run_id
            FROM ROWS FROM (pg_catalog.unnest(v_conversations), pg_catalog.unnest(v_runs))
                AS t (conversation_id, run_id)
        )
        SELECT t.conversation_id,
               array_agg(DISTINCT t.run_id) FILTER (WHERE t.run_id IS NOT NULL) AS run_ids
        FROM (SELECT c.conversation_id, c.run_id FROM touched AS c
              UNION
              SELECT sr.conversation_id, sr.run_id
              FROM compaction.source_runs AS sr
              WHERE sr.run_id IN (SELECT c.run_id FROM touched AS c)) AS t
        WHERE t.conversation_id IS NOT NULL
        GROUP BY t.conversation_id
        ORDER BY t.conversation_id
    LOOP
        IF v_run_column IS NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, NULL, TG_RELID);
        ELSIF v_touched.run_ids IS NOT NULL THEN
            PERFORM compaction.rederive(v_touched.conversation_id, v_touched.run_ids, TG_RELID);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.track_source_changes() IS
    'Trigger (AFTER ... FOR EACH STATEMENT, transition tables new_rows/old_rows; arguments: conversation id column, run id column or ''''): keeps the derived state of the conversations a statement touched';

DROP FUNCTION compaction.checked_lease(interval);



CALL compaction.assign_ownership();
