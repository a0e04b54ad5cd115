-- Revision 0006_queue_leases, down: back to the deleting dequeue of 0002_core.
-- Leases are dropped: every entry becomes visible (dequeue removes it) again.

DROP VIEW compaction.audit_queue;
DROP FUNCTION compaction.release(text, text, uuid);
DROP FUNCTION compaction.ack(text, text, uuid);
DROP FUNCTION compaction.dequeue(text, int, interval);

CREATE OR REPLACE FUNCTION compaction.reap(p_now timestamptz DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now   timestamptz := coalesce(p_now, pg_catalog.now());
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
        INSERT INTO compaction.queue (conversation_id, scope, enqueued_at)
        SELECT DISTINCT f.conversation_id, j.scope, pg_catalog.now()
        FROM failed AS f
        JOIN compaction.jobs AS j ON j.conversation_id = f.conversation_id AND j.job_id = f.job_id
        ON CONFLICT (conversation_id, scope) DO NOTHING
    )
    SELECT count(*) INTO v_count FROM failed;
    RETURN v_count;
END
$$;
COMMENT ON FUNCTION compaction.reap(timestamptz) IS
    'Marks running attempts whose lease expired at p_now failed (lease_expired) and re-queues their conversations; returns how many';

CREATE OR REPLACE FUNCTION compaction.enqueue(p_conversation_id text, p_scope text DEFAULT 'default')
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' THEN
        RAISE EXCEPTION 'enqueue needs a conversation id and a non-empty scope'
            USING ERRCODE = 'CP020';
    END IF;
    -- Already queued: nothing to write (no row churn for a chatty host).
    INSERT INTO compaction.queue (conversation_id, scope, enqueued_at)
    VALUES (p_conversation_id, p_scope, pg_catalog.now())
    ON CONFLICT (conversation_id, scope) DO NOTHING;
END
$$;
COMMENT ON FUNCTION compaction.enqueue(text, text) IS
    'Marks a conversation (per scope) as having new history for the worker; cheap and idempotent';

CREATE FUNCTION compaction.dequeue(p_limit int DEFAULT 100)
RETURNS TABLE (conversation_id text, scope text, enqueued_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'dequeue needs a limit of at least 1' USING ERRCODE = 'CP020';
    END IF;
    -- SKIP LOCKED: concurrent workers take disjoint batches. An enqueue racing this
    -- delete waits for it and then re-inserts, so no new history is ever lost.
    RETURN QUERY
    WITH picked AS (
        SELECT q.conversation_id, q.scope
        FROM compaction.queue AS q
        ORDER BY q.enqueued_at, q.conversation_id, q.scope
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM compaction.queue AS q
    USING picked AS p
    WHERE q.conversation_id = p.conversation_id AND q.scope = p.scope
    RETURNING q.conversation_id, q.scope, q.enqueued_at;
END
$$;
COMMENT ON FUNCTION compaction.dequeue(int) IS
    'Takes (and removes) up to p_limit queued conversations, oldest first; concurrent workers get disjoint batches';

CREATE OR REPLACE FUNCTION compaction.source_enqueue()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        -- Sorted keys: concurrent bulk writers take queue row locks in one order.
        INSERT INTO compaction.queue (conversation_id, scope, enqueued_at)
        SELECT DISTINCT n.conversation_id, 'default', pg_catalog.now()
        FROM new_rows AS n
        WHERE n.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO NOTHING;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        INSERT INTO compaction.queue (conversation_id, scope, enqueued_at)
        SELECT DISTINCT o.conversation_id, 'default', pg_catalog.now()
        FROM old_rows AS o
        WHERE o.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.source_enqueue() IS
    'Trigger: enqueues (scope default) every conversation whose reference runs or messages a statement wrote';

DROP INDEX compaction.queue_scope_enqueued_at_idx;
CREATE INDEX queue_enqueued_at_idx ON compaction.queue (enqueued_at);
ALTER TABLE compaction.queue
    DROP CONSTRAINT queue_times_finite,
    DROP CONSTRAINT queue_requeued_only_when_leased,
    DROP CONSTRAINT queue_lease_complete,
    DROP COLUMN requeued_at,
    DROP COLUMN lease_token,
    DROP COLUMN leased_until;
COMMENT ON TABLE compaction.queue IS
    'Conversations (per scope) with history the worker has not looked at since; filled by enqueue, emptied by dequeue';

CALL compaction.assign_ownership();

GRANT EXECUTE ON FUNCTION compaction.dequeue(int) TO compaction_worker;
