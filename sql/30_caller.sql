-- pycompactor stored logic, section 3 continued: what every call on an attempt shares
-- (the tables are in 29_jobs.sql). Owns the per-conversation lock that claims (30_claims,
-- 30_claims_targets), fencing (30_fencing), reaping (32_reaping.sql) and imports
-- (33_import.sql) take first, and the checks of the caller (contract §6): its login
-- (caller_is_privileged), its clock (caller_now), its lease (lease_end, lease_fits), its
-- identifiers (oversized_identifier) and its reasons (checked_reason).

-- One row per conversation the engine has worked on, whose row lock every writer of that
-- conversation's engine rows takes first. Until then the lock was a
-- transaction-scoped advisory lock keyed by hashtext(conversation_id); but any login can
-- take any advisory lock, and one that held a conversation's key stalled its claims and
-- completions and made reap pass it over. Locking a row needs UPDATE on its table, which
-- no role but the owner holds (the engine's functions run as the owner). The lock writes
-- no new row version; the row itself is written once per conversation.
CREATE TABLE compaction.conversation_locks (
    conversation_id text NOT NULL,
    CONSTRAINT conversation_locks_pkey PRIMARY KEY (conversation_id)
);
COMMENT ON TABLE compaction.conversation_locks IS
    'Internal: one row per conversation the engine has worked on; its row lock serialises that conversation''s engine writers (only the owner can lock it)';

-- Serialises every writer of one conversation's engine rows (claim, complete, fail,
-- heartbeat, import_summary, erase_conversation) until commit: the first writer inserts
-- the conversation's row, every later one locks it (ON CONFLICT DO UPDATE locks the row
-- it meets even when its WHERE is false, and writes no new version). One statement, as
-- the advisory lock was; transaction-scoped, so PgBouncer-safe. At REPEATABLE READ a row
-- inserted after the snapshot is a serialization failure, like any engine row. PL/pgSQL
-- with no SET clause keeps the statement's plan for the session; every name is
-- qualified, and only the owner (the engine's definer functions) may execute it. claim
-- and fence, once per cycle each, run the statement itself rather than call this.
CREATE FUNCTION compaction.lock_conversation(p_conversation_id text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
END
$$;
COMMENT ON FUNCTION compaction.lock_conversation(text) IS
    'Internal: locks the conversation''s row of compaction.conversation_locks until commit (inserting it the first time), serialising that conversation''s engine writers';

-- The same lock, if free: reap passes over a conversation whose writer is at work (its
-- fenced call settles any expiry of the attempt it holds) instead of queueing behind it.
-- Only the engine's functions can hold the row, so only an engine writer makes reap pass.
-- Claims and imports write a conversation's row before its jobs; a conversation without one (jobs the owner
-- inserted by hand) gets it here, so that reap never passes it over for good.
CREATE FUNCTION compaction.try_lock_conversation(p_conversation_id text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $$
BEGIN
    PERFORM 1
    FROM compaction.conversation_locks AS l
    WHERE l.conversation_id OPERATOR(pg_catalog.=) p_conversation_id
    FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        RETURN true;
    END IF;
    IF EXISTS (SELECT 1 FROM compaction.conversation_locks AS l
               WHERE l.conversation_id OPERATOR(pg_catalog.=) p_conversation_id) THEN
        RETURN false;
    END IF;
    PERFORM compaction.lock_conversation(p_conversation_id);
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.try_lock_conversation(text) IS
    'Internal: takes lock_conversation''s row lock if it is free (true; writing the conversation''s row if it has none), else returns false at once';

-- A conversation's lock is held until the caller's transaction ends, and the caller may
-- be an application that calls claim or fence inside its own transaction. Where the caller
-- set no bound, the transaction gets one (transaction_timeout where the server has it,
-- PostgreSQL 17 on; idle_in_transaction_session_timeout on every server), so a caller that
-- forgets its transaction open cannot hold a conversation for long (docs/security.md).
-- Every taker of the lock on a caller's behalf assigns this right after taking it. SQL
-- with no SET clause, so that an assignment inlines it and PL/pgSQL evaluates it as a
-- simple expression: as cheap as the two IFs written out (a PERFORM of it cost 0.8% of a
-- claim -> complete cycle's instructions). CASE keeps set_config from running unless its
-- setting is unset (and from naming transaction_timeout where it does not exist).
CREATE FUNCTION compaction.bound_caller_transaction()
RETURNS text
LANGUAGE sql
VOLATILE
AS $$
    SELECT pg_catalog.concat_ws(',',
        CASE WHEN pg_catalog.current_setting('transaction_timeout', true) OPERATOR(pg_catalog.=) '0'
             THEN pg_catalog.set_config('transaction_timeout', '60s', true) END,
        CASE WHEN pg_catalog.current_setting('idle_in_transaction_session_timeout') OPERATOR(pg_catalog.=) '0'
             THEN pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true) END)
$$;
COMMENT ON FUNCTION compaction.bound_caller_transaction() IS
    'Internal: gives the caller''s transaction a 60 s transaction_timeout (PostgreSQL 17 on) and idle_in_transaction_session_timeout where the caller set none, so a conversation''s lock is never held for long by a forgotten transaction; returns the values it set, comma-separated (empty when none)';

-- Whether the session's login stands for the engine's owner: a superuser or a member of
-- compaction_owner. session_user, not current_user: inside the SECURITY DEFINER
-- functions current_user is always the owner. Asked only off the usual path (a given
-- p_now, a fenced call from another login than the claimer's).
CREATE FUNCTION compaction.caller_is_privileged()
RETURNS boolean
LANGUAGE sql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles AS r
                   WHERE r.rolname = session_user AND r.rolsuper)
        OR pg_catalog.pg_has_role(session_user, 'compaction_owner', 'MEMBER')
$$;
COMMENT ON FUNCTION compaction.caller_is_privileged() IS
    'Internal: true when the session''s login is a superuser or a member of compaction_owner';

-- The server owns time (contract §6): p_now exists for tests and repairs by a superuser or
-- the owner. The worker's calls call it only for a given p_now, and
-- lease_end only for a lease lease_fits does not take: a call of a function with a SET clause
-- saves and restores the settings, which costs more than either rule.
CREATE FUNCTION compaction.caller_now(p_now timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_now IS NULL THEN
        RETURN pg_catalog.now();
    END IF;
    IF NOT compaction.caller_is_privileged() THEN
        RAISE EXCEPTION 'p_now is honoured only for a superuser or a member of compaction_owner'
            USING ERRCODE = 'CP025',
                  HINT = 'Omit p_now: the server''s clock decides leases and finish times.';
    END IF;
    IF NOT pg_catalog.isfinite(p_now) THEN
        RAISE EXCEPTION 'p_now must be a finite time, got %', p_now USING ERRCODE = 'CP022';
    END IF;
    RETURN p_now;
END
$$;
COMMENT ON FUNCTION compaction.caller_now(timestamptz) IS
    'Internal: now(), or p_now when the session user is a superuser or a member of compaction_owner (else CP025; a non-finite p_now is CP022)';

-- The longest identifiers the engine takes from a caller, in UTF-8 bytes.
-- They become index keys (jobs_identity_key holds conversation, scope and model
-- together, and a btree entry must fit in a third of a page, 2704 bytes: these limits
-- leave room for the hash and the rest even when nothing compresses), so a longer one
-- used to fail deep inside an insert (54000, index row requires N bytes); the worker's
-- name is kept with every attempt and event. NULL when every argument fits (NULL fits), else the
-- message naming the first one over its limit. One expression with no SET clause, so it
-- inlines into its callers. The number is cast to text, not joined to it by anytextcat,
-- which is STABLE: an IMMUTABLE SQL function whose body calls a STABLE one is not
-- inlined, and was parsed and planned again in every claim (7% of a claim -> complete
-- cycle's instructions).
CREATE FUNCTION compaction.oversized_identifier(p_conversation_id text, p_scope text,
                                                p_model text DEFAULT NULL,
                                                p_worker text DEFAULT NULL)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT CASE
               WHEN pg_catalog.octet_length(p_conversation_id) OPERATOR(pg_catalog.>) 1024
                   THEN 'a conversation id may be at most 1024 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_conversation_id)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_scope) OPERATOR(pg_catalog.>) 1024
                   THEN 'a scope may be at most 1024 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_scope)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_model) OPERATOR(pg_catalog.>) 256
                   THEN 'a model may be at most 256 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_model)::pg_catalog.text
               WHEN pg_catalog.octet_length(p_worker) OPERATOR(pg_catalog.>) 256
                   THEN 'a worker name may be at most 256 bytes (UTF-8), got '
                        OPERATOR(pg_catalog.||) pg_catalog.octet_length(p_worker)::pg_catalog.text
           END
$$;
COMMENT ON FUNCTION compaction.oversized_identifier(text, text, text, text) IS
    'Internal: NULL when the conversation id (at most 1024 bytes), scope (1024), model (256) and worker name (256) fit, else the message naming the first one over its limit (callers raise CP020)';

-- A lease is bounded by its effect, on the clock: it must end 1 second to
-- 1 day after now. Intervals compare with 30-day months and 24-hour days, so a bound on
-- the interval itself let '10000 years -3599999 days' (144 years, on the clock) pass as a
-- day. The callers test the usual lease in line (lease_fits: a number of
-- seconds, or a day and some time, whose end is within bounds), and call this only for
-- the rest: it answers the end, or raises (CP023, or p_errcode) for any lease whose end
-- is before now + 1 second, after now + 1 day (or 24 hours, whichever is later: a day
-- can be 23 or 25 hours across a change of clocks), or off the calendar.
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

-- The usual lease, tested in line by the functions that take one (no call): a lease whose
-- interval has no months and at most one day (so that adding it cannot leave the
-- calendar) and whose end lies within bounds. Any other lease goes to lease_end.
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

-- Reasons reach the auditor, who never sees content: a code, never free text.
CREATE FUNCTION compaction.checked_reason(p_reason text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_reason IS NULL OR p_reason !~ '^[a-z][a-z0-9_]{0,63}$' THEN
        RAISE EXCEPTION 'a reason must be a code matching ^[a-z][a-z0-9_]{0,63}$ (e.g. http_error), not free text'
            USING ERRCODE = 'CP024';
    END IF;
    RETURN p_reason;
END
$$;
COMMENT ON FUNCTION compaction.checked_reason(text) IS
    'Internal: p_reason if it is a code (^[a-z][a-z0-9_]{0,63}$), else CP024; the value is never echoed in the error';
