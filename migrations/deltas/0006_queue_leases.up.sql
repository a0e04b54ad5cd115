-- Revision 0006_queue_leases: a queue that leases instead of deleting.
--
-- dequeue(p_scope, p_limit, p_lease) leases the oldest visible entries of one scope and
-- returns a lease token each; ack removes an examined entry unless an enqueue landed
-- during the lease; release ends a lease without acknowledging; an expired lease makes
-- its entry visible again in its original place. enqueue, the source trigger and reap
-- mark a leased entry requeued instead of doing nothing. audit_queue shows the queue
-- per scope to the auditor.

ALTER TABLE compaction.queue
    ADD COLUMN leased_until timestamptz,
    ADD COLUMN lease_token uuid,
    ADD COLUMN requeued_at timestamptz,
    ADD CONSTRAINT queue_lease_complete CHECK ((leased_until IS NULL) = (lease_token IS NULL)),
    ADD CONSTRAINT queue_requeued_only_when_leased
        CHECK (requeued_at IS NULL OR lease_token IS NOT NULL),
    ADD CONSTRAINT queue_times_finite CHECK (
        pg_catalog.isfinite(enqueued_at)
        AND (leased_until IS NULL OR pg_catalog.isfinite(leased_until))
        AND (requeued_at IS NULL OR pg_catalog.isfinite(requeued_at)));
COMMENT ON TABLE compaction.queue IS
    'Conversations (per scope) with history no worker has finished examining: filled by enqueue, leased by dequeue, removed by ack';
DROP INDEX compaction.queue_enqueued_at_idx;
CREATE INDEX queue_scope_enqueued_at_idx ON compaction.queue (scope, enqueued_at, conversation_id);

DROP FUNCTION compaction.dequeue(int);

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

-- The three writers of queue entries (enqueue, the source tables' trigger, reap) share
-- one upsert: a new entry is inserted; an entry under a lease is marked requeued_at (the
-- first time only), so the acknowledgement of a worker that examined the conversation
-- before this write keeps the entry; any other existing entry is only locked (ON
-- CONFLICT DO UPDATE locks the row even when its WHERE is false; no new row version).
-- The lock lasts until the writer commits: dequeue skips a locked entry and ack waits
-- for it, so no worker examines and acknowledges a conversation whose new history it
-- cannot see yet.
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
    INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
    VALUES (p_conversation_id, p_scope, pg_catalog.now())
    ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
        WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
END
$$;
COMMENT ON FUNCTION compaction.enqueue(text, text) IS
    'Marks a conversation (per scope) as having new history for the worker; cheap and idempotent; an entry under a lease survives its acknowledgement';

CREATE FUNCTION compaction.dequeue(
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

CREATE FUNCTION compaction.ack(p_conversation_id text, p_scope text, p_lease_token uuid)
RETURNS TABLE (ok boolean, reason text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_lease_token IS NULL THEN
        RAISE EXCEPTION 'ack needs a conversation id, a non-empty scope and a lease token'
            USING ERRCODE = 'CP020';
    END IF;
    -- Examined and nothing new since the lease: done. A writer enqueueing this entry
    -- right now holds its row; the DELETE waits for it and re-checks requeued_at.
    DELETE FROM compaction.queue AS q
    WHERE q.conversation_id = p_conversation_id AND q.scope = p_scope
      AND q.lease_token = p_lease_token AND q.requeued_at IS NULL;
    IF FOUND THEN
        RETURN QUERY SELECT true, 'acknowledged'::text;
        RETURN;
    END IF;
    -- New history arrived during the lease: the newer enqueue wins, and the entry waits
    -- again from the moment it arrived.
    UPDATE compaction.queue AS q
    SET enqueued_at = q.requeued_at, leased_until = NULL, lease_token = NULL,
        requeued_at = NULL
    WHERE q.conversation_id = p_conversation_id AND q.scope = p_scope
      AND q.lease_token = p_lease_token AND q.requeued_at IS NOT NULL;
    IF FOUND THEN
        RETURN QUERY SELECT true, 'requeued'::text;
        RETURN;
    END IF;
    RETURN QUERY SELECT false, 'lease_lost'::text;
END
$$;
COMMENT ON FUNCTION compaction.ack(text, text, uuid) IS
    'Acknowledges a leased entry once its conversation was examined: removes it (acknowledged), or keeps it visible if an enqueue landed during the lease (requeued); lease_lost if the token is no longer the entry''s';

CREATE FUNCTION compaction.release(p_conversation_id text, p_scope text, p_lease_token uuid)
RETURNS TABLE (ok boolean, reason text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_lease_token IS NULL THEN
        RAISE EXCEPTION 'release needs a conversation id, a non-empty scope and a lease token'
            USING ERRCODE = 'CP020';
    END IF;
    UPDATE compaction.queue AS q
    SET leased_until = NULL, lease_token = NULL, requeued_at = NULL
    WHERE q.conversation_id = p_conversation_id AND q.scope = p_scope
      AND q.lease_token = p_lease_token;
    IF FOUND THEN
        RETURN QUERY SELECT true, 'released'::text;
    ELSE
        RETURN QUERY SELECT false, 'lease_lost'::text;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.release(text, text, uuid) IS
    'Ends a lease without acknowledging (the worker did not examine the conversation): the entry is visible again in its original place; lease_lost if the token is no longer the entry''s';

-- Writes to the reference history enqueue the conversations they touch (scope
-- 'default'), once per statement, so a bulk COPY costs one INSERT here.
CREATE OR REPLACE FUNCTION compaction.source_enqueue()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- The upsert of compaction.enqueue, for every conversation the statement wrote, in
    -- one sorted statement: concurrent bulk writers take queue row locks in one order.
    IF TG_OP = 'INSERT' THEN
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT n.conversation_id, 'default', pg_catalog.now()
        FROM new_rows AS n
        WHERE n.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT o.conversation_id, 'default', pg_catalog.now()
        FROM old_rows AS o
        WHERE o.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    ELSE
        INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
        SELECT DISTINCT c.conversation_id, 'default', pg_catalog.now()
        FROM (SELECT n.conversation_id FROM new_rows AS n
              UNION ALL
              SELECT o.conversation_id FROM old_rows AS o) AS c
        WHERE c.conversation_id IS NOT NULL
        ORDER BY 1
        ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
            WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION compaction.source_enqueue() IS
    'Trigger: enqueues (scope default) every conversation whose reference runs or messages a statement wrote';


-- Both ages use the server's clock; queue times are finite (queue_times_finite).
CREATE VIEW compaction.audit_queue AS
    SELECT q.scope,
           count(*) FILTER (WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS queued,
           count(*) FILTER (WHERE q.leased_until > pg_catalog.now()) AS leased,
           count(*) FILTER (WHERE q.leased_until <= pg_catalog.now()) AS expired_leases,
           min(q.enqueued_at) FILTER (
               WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS oldest_queued_at,
           pg_catalog.now() - min(q.enqueued_at) FILTER (
               WHERE q.leased_until IS NULL OR q.leased_until <= pg_catalog.now())
               AS oldest_queued_age
    FROM compaction.queue AS q
    GROUP BY q.scope;
COMMENT ON VIEW compaction.audit_queue IS
    'Audit: the work queue per scope: entries waiting (queued, of which expired_leases were leased by a worker that did not finish), entries under a live lease (leased), and the oldest waiting entry''s enqueue time and age';

CALL compaction.assign_ownership();

GRANT EXECUTE ON FUNCTION
    compaction.dequeue(text, int, interval),
    compaction.ack(text, text, uuid),
    compaction.release(text, text, uuid)
TO compaction_worker;
GRANT SELECT ON compaction.audit_queue TO compaction_auditor;
