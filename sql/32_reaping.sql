-- pycompactor stored logic, section 3c: reaping.
--
-- reap turns running attempts whose lease ran out into failed (lease_expired) attempts
-- and puts their conversations back on the queue (31_queue.sql), so the one retry the
-- contract allows happens without a sweep. claim and the fenced calls reap the identity
-- they touch themselves (30_claims.sql, 30_fencing.sql).
--
-- contract §11: no statement spans conversations with a row lock. reap finds the
-- conversations with expired attempts by a plain read, then settles each one by
-- statements that address that conversation alone (reap_conversation), under its lock,
-- passing over a conversation whose lock is taken (as the row locks' SKIP LOCKED did).

CREATE FUNCTION compaction.reap_conversation(p_conversation_id text, p_now timestamptz)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bound        text;  -- what bound_caller_transaction set
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
    v_bound := compaction.bound_caller_transaction();
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
        -- The scopes first, then enqueue: one statement each (contract §11).
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

CREATE FUNCTION compaction.reap(p_now timestamptz DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
DECLARE
    v_now          timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                       ELSE compaction.caller_now(p_now) END;
    v_conversation text;
    v_count        int := 0;
BEGIN
    -- In conversation order (a reaper only ever tries a lock, so none waits anyway).
    FOR v_conversation IN
        SELECT DISTINCT a.conversation_id
        FROM compaction.attempts AS a
        WHERE a.state = 'running' AND a.lease_expires_at <= v_now
        ORDER BY 1
    LOOP
        v_count := v_count + compaction.reap_conversation(v_conversation, v_now);
    END LOOP;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION compaction.reap(timestamptz) IS
    'Marks running attempts whose lease expired at p_now failed (lease_expired) and re-queues their conversations; returns how many';
