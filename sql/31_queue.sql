-- pycompactor stored logic, section 3b: the work queue.
--
-- One entry per (conversation, scope) whose history changed and that no worker has
-- finished examining: filled by enqueue, by the reference tables' statement triggers and
-- by reap (32_reaping.sql); leased by dequeue, removed by ack, given back by release.
-- Liveness comes from the leases, never from a held lock (contract §11).

-- The work queue. dequeue leases entries (hidden until leased_until, identified by
-- lease_token) instead of removing them; ack removes an entry once its worker has
-- examined the conversation, unless an enqueue landed during the lease (requeued_at),
-- in which case the entry becomes visible again at that time. A lease that simply runs
-- out (a dead worker) makes the entry visible again at its original enqueued_at: no
-- reaper needed. One entry per (conversation, scope): each scope keeps its own order.
CREATE TABLE compaction.queue (
    conversation_id text NOT NULL,
    scope           text NOT NULL,
    enqueued_at     timestamptz NOT NULL,
    leased_until    timestamptz,
    lease_token     uuid,
    requeued_at     timestamptz,
    CONSTRAINT queue_pkey PRIMARY KEY (conversation_id, scope),
    CONSTRAINT queue_lease_complete CHECK ((leased_until IS NULL) = (lease_token IS NULL)),
    CONSTRAINT queue_requeued_only_when_leased
        CHECK (requeued_at IS NULL OR lease_token IS NOT NULL),
    -- The server's clock writes these; finite, so the audit view's ages never fail.
    CONSTRAINT queue_times_finite CHECK (
        pg_catalog.isfinite(enqueued_at)
        AND (leased_until IS NULL OR pg_catalog.isfinite(leased_until))
        AND (requeued_at IS NULL OR pg_catalog.isfinite(requeued_at)))
);
COMMENT ON TABLE compaction.queue IS
    'Conversations (per scope) with history no worker has finished examining: filled by enqueue, leased by dequeue, removed by ack';
-- dequeue walks one scope's entries oldest first.
CREATE INDEX queue_scope_enqueued_at_idx ON compaction.queue (scope, enqueued_at, conversation_id);


-- The three writers of queue entries (enqueue, the source tables' trigger, reap) share
-- one upsert: a new entry is inserted; an entry under a lease is marked requeued_at (the
-- first time only), so the acknowledgement of a worker that examined the conversation
-- before this write keeps the entry; any other existing entry is only locked (ON
-- CONFLICT DO UPDATE locks the row even when its WHERE is false; no new row version).
-- The lock lasts until the writer commits: dequeue skips a locked entry and ack waits
-- for it, so no worker examines and acknowledges a conversation whose new history it
-- cannot see yet.
CREATE FUNCTION compaction.enqueue(p_conversation_id text, p_scope text DEFAULT 'default')
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
    IF compaction.oversized_identifier(p_conversation_id, p_scope) IS NOT NULL THEN
        RAISE EXCEPTION '%', compaction.oversized_identifier(p_conversation_id, p_scope)
            USING ERRCODE = 'CP020';
    END IF;
    INSERT INTO compaction.queue AS q (conversation_id, scope, enqueued_at)
    VALUES (p_conversation_id, p_scope, pg_catalog.now())
    ON CONFLICT (conversation_id, scope) DO UPDATE SET requeued_at = EXCLUDED.enqueued_at
        WHERE q.lease_token IS NOT NULL AND q.requeued_at IS NULL;
END
$$;
COMMENT ON FUNCTION compaction.enqueue(text, text) IS
    'Marks a conversation (per scope) as having new history for the worker; cheap and idempotent; an entry under a lease survives its acknowledgement; CP020 for a conversation id or scope over 1024 bytes';

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
    v_token     uuid;
    v_taken     int := 0;
BEGIN
    IF p_scope IS NULL OR p_scope = '' THEN
        RAISE EXCEPTION 'dequeue needs a non-empty scope' USING ERRCODE = 'CP020';
    END IF;
    -- At most 1,000 a call: one call used to hide a whole scope's queue
    -- from every other worker for the lease.
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 1000 THEN
        RAISE EXCEPTION 'dequeue takes a limit between 1 and 1000 entries, got %',
                coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'CP020';
    END IF;
    -- Bounded by when it ends, on the clock (as the attempts' leases):
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
CREATE FUNCTION compaction.source_enqueue()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Nothing to do when this transaction already holds the queue entry of every
    -- conversation the statement wrote (an earlier statement inserted, requeued or locked
    -- it, outside any subtransaction: its lock lasts until commit, so nobody else changes
    -- it) and the upsert below would not update it: it would find that row and change
    -- nothing. An agent's later statements per Run end here. Each conversation's entry is
    -- looked up on its own key (OFFSET 0 keeps each NOT EXISTS a subplan per row): as an
    -- anti-join, planned on a queue without statistics, it read every entry through the
    -- index on (scope, enqueued_at) at each statement.
    IF TG_OP = 'INSERT' THEN
        IF NOT EXISTS (SELECT 1 FROM new_rows AS n
                       WHERE n.conversation_id IS NOT NULL
                         AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                         WHERE q.conversation_id = n.conversation_id
                                           AND q.scope = 'default'
                                           AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                           AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                         OFFSET 0)) THEN
            RETURN NULL;
        END IF;
    ELSIF TG_OP = 'DELETE' THEN
        IF NOT EXISTS (SELECT 1 FROM old_rows AS o
                       WHERE o.conversation_id IS NOT NULL
                         AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                         WHERE q.conversation_id = o.conversation_id
                                           AND q.scope = 'default'
                                           AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                           AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                         OFFSET 0)) THEN
            RETURN NULL;
        END IF;
    ELSIF NOT EXISTS (SELECT 1
                      FROM (SELECT n.conversation_id FROM new_rows AS n
                            UNION ALL
                            SELECT o.conversation_id FROM old_rows AS o) AS c
                      WHERE c.conversation_id IS NOT NULL
                        AND NOT EXISTS (SELECT 1 FROM compaction.queue AS q
                                        WHERE q.conversation_id = c.conversation_id
                                          AND q.scope = 'default'
                                          AND pg_catalog.pg_current_xact_id()::xid IN (q.xmin, q.xmax)
                                          AND (q.lease_token IS NULL OR q.requeued_at IS NOT NULL)
                                        OFFSET 0)) THEN
        RETURN NULL;
    END IF;

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

CREATE TRIGGER runs_enqueue_insert
    AFTER INSERT ON compaction_source.runs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER runs_enqueue_update
    AFTER UPDATE ON compaction_source.runs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER runs_enqueue_delete
    AFTER DELETE ON compaction_source.runs
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER messages_enqueue_insert
    AFTER INSERT ON compaction_source.messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER messages_enqueue_update
    AFTER UPDATE ON compaction_source.messages
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
CREATE TRIGGER messages_enqueue_delete
    AFTER DELETE ON compaction_source.messages
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION compaction.source_enqueue();
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_enqueue_insert;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_enqueue_update;
ALTER TABLE compaction_source.runs ENABLE ALWAYS TRIGGER runs_enqueue_delete;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_enqueue_insert;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_enqueue_update;
ALTER TABLE compaction_source.messages ENABLE ALWAYS TRIGGER messages_enqueue_delete;
