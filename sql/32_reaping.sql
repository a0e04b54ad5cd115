-- pycompactor stored logic, section 3c: reaping.
--
-- reap turns running attempts whose lease ran out into failed (lease_expired) attempts
-- and puts their conversations back on the queue (31_queue.sql), so the one retry the
-- contract allows happens without a sweep. claim and the fenced calls reap the identity
-- they touch themselves (30_claims.sql).

CREATE FUNCTION compaction.reap(p_now timestamptz DEFAULT NULL)
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
