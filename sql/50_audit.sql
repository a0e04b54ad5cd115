-- pycompactor stored logic, section 5: audit views.
--
-- compaction_auditor reads these and nothing else: metadata only (ids, ranges, hashes, models, versions, states, reasons,
-- times, lengths), never message or summary text. Recipes: docs/audit.md.
--
-- Each audit view over engine tables is a facade over a body view of the same name with
-- `_rows` (the logic, granted to nobody) that compaction.place_audit_views() points at
-- the body directly on one node, where a DBA's filter reaches the body's indexes, and
-- through a definer function on Citus (read_audit_*), where a view's shard queries run
-- with the caller's rights and the auditor holds none on the tables.

CREATE VIEW compaction.audit_jobs_rows AS
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           j.created_at,
           a.attempt,
           a.state,
           a.reason,
           a.worker,
           a.started_at,
           a.lease_expires_at,
           a.finished_at,
           -- Rows a development version wrote may hold infinite times; no stored
           -- state may make this view fail.
           CASE WHEN pg_catalog.isfinite(a.finished_at) AND pg_catalog.isfinite(a.started_at)
                THEN a.finished_at - a.started_at END AS duration,
           a.finish_reason,
           a.tool_call_count,
           a.response_id,
           a.summary_chars,
           s.summary_id,
           false AS imported,
           a.input_tokens,
           a.output_tokens,
           a.figures_total,
           a.figures_kept,
           a.claimed_by,
           -- Last, so that the view only grows (a DBA's views over it stay).
           a.figures_invented
    FROM compaction.jobs AS j
    JOIN compaction.attempts AS a
      ON a.conversation_id = j.conversation_id AND a.job_id = j.job_id
    LEFT JOIN compaction.job_summaries AS s
      ON s.conversation_id = a.conversation_id AND s.job_id = a.job_id AND s.attempt = a.attempt
    UNION ALL
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           j.created_at,
           NULL::int,
           'imported'::text,
           NULL::text,
           NULL::text,
           NULL::timestamptz,
           NULL::timestamptz,
           s.completed_at,
           NULL::interval,
           NULL::text,
           NULL::int,
           NULL::text,
           pg_catalog.char_length(s.summary),
           s.summary_id,
           true,
           NULL::int,
           NULL::int,
           NULL::int,
           NULL::int,
           NULL::text,
           NULL::int
    FROM compaction.jobs AS j
    JOIN compaction.job_summaries AS s
      ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
    WHERE s.attempt IS NULL;
COMMENT ON VIEW compaction.audit_jobs_rows IS
    'Internal: the body of compaction.audit_jobs (granted to nobody)';

-- Computed where the source views are (contract §11). A view that called
-- source_hash per row would, under Citus, be pushed down to the shards on the workers,
-- which have no source views; this function reads the summaries' bindings, then asks
-- source_hash once per range on the node it runs on.
-- While the derived state is in use, the summaries of every conversation it serves are
-- compared with its ranges in one statement (a co-located join, one task per shard on
-- Citus), and the record of foreign messages is read once for the whole audit: asking
-- derived_state_serves per conversation read it again for each (on Citus, every shard
-- each time). A conversation one of whose pairs' runs that record names is judged from
-- the views, as every conversation is while the derived state is not in use.
CREATE FUNCTION compaction.stale_summaries()
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
    v_derived boolean := compaction.derived_state_current();
    v_named   text[];
    v_keys    int[];
    -- the conversations judged from the views although the derived state is in use
    v_apart   text[] := '{}';
BEGIN
    IF v_derived THEN
        -- derived_state_serves' question, asked once for every conversation
        SELECT pg_catalog.array_agg(DISTINCT f.run_id) INTO v_named
        FROM compaction.foreign_messages AS f;
        IF v_named IS NOT NULL THEN
            v_keys := ARRAY(SELECT pg_catalog.hashtext(k.run_id)
                            FROM pg_catalog.unnest(v_named) AS k (run_id));
            v_apart := ARRAY(SELECT DISTINCT p.conversation_id
                             FROM compaction.pairs AS p
                             WHERE pg_catalog.hashtext(p.run_id) = ANY (v_keys)
                               AND p.run_id = ANY (v_named));
        END IF;
        -- current_ranges' answer from the derived state: the range's stored hash, none
        -- when the range is not complete now
        RETURN QUERY
        SELECT s.summary_id, j.conversation_id, j.scope, j.from_pair, j.to_pair,
               CASE WHEN s.attempt IS NOT NULL THEN j.job_id END,
               s.attempt IS NULL, j.model, j.prompt_version, s.completed_at,
               j.source_hash, r.source_hash,
               CASE WHEN r.source_hash IS NULL THEN 'range_incomplete'
                    ELSE 'source_changed' END
        FROM compaction.job_summaries AS s
        JOIN compaction.jobs AS j
          ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = j.conversation_id AND r.from_pair = j.from_pair
        WHERE r.source_hash IS DISTINCT FROM j.source_hash
          AND NOT (j.conversation_id = ANY (v_apart))
        ORDER BY j.conversation_id, j.from_pair, s.summary_id;
        -- None judged apart (the common answer): the loop's read of every shard spared.
        IF pg_catalog.cardinality(v_apart) = 0 THEN
            RETURN;
        END IF;
    END IF;
    FOR v_summary IN
        SELECT s.summary_id AS sid, j.conversation_id AS cid, j.scope AS sc,
               j.from_pair AS fp, j.to_pair AS tp,
               CASE WHEN s.attempt IS NOT NULL THEN j.job_id END AS jid,
               s.attempt IS NULL AS imp, j.model AS mo, j.prompt_version AS pv,
               s.completed_at AS ca, j.source_hash AS sh
        FROM compaction.job_summaries AS s
        JOIN compaction.jobs AS j
          ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id
        WHERE NOT v_derived OR j.conversation_id = ANY (v_apart)
        ORDER BY j.conversation_id, j.from_pair, s.summary_id
    LOOP
        -- The current hashes of every summarized range of a conversation at once: from
        -- the views, one judgement of the conversation (not source_hash per
        -- range, a whole judgement each). One statement each (contract §11).
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
COMMENT ON FUNCTION compaction.stale_summaries() IS
    'Internal: the rows of audit_stale_summaries (completed summaries whose range''s current hash differs from the stored one)';

CREATE VIEW compaction.audit_stale_summaries AS
    SELECT st.summary_id, st.conversation_id, st.scope, st.from_pair, st.to_pair, st.job_id,
           st.imported, st.model, st.prompt_version, st.completed_at, st.stored_hash,
           st.current_hash, st.staleness
    FROM compaction.stale_summaries() AS st;
COMMENT ON VIEW compaction.audit_stale_summaries IS
    'Audit: completed summaries whose source changed since (hash recomputed in SQL) or whose range no longer has 10 pairs';

CREATE VIEW compaction.audit_exhausted_rows AS
    SELECT j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.job_id,
           j.source_hash,
           j.model,
           j.prompt_version,
           max(a.reason) FILTER (WHERE a.attempt = 1) AS first_reason,
           max(a.reason) FILTER (WHERE a.attempt = 2) AS second_reason,
           max(a.finished_at) AS exhausted_at
    FROM compaction.jobs AS j
    JOIN compaction.attempts AS a
      ON a.conversation_id = j.conversation_id AND a.job_id = j.job_id
    WHERE a.state = 'failed'
      AND NOT EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                      WHERE s.conversation_id = j.conversation_id AND s.job_id = j.job_id)
    GROUP BY j.conversation_id, j.scope, j.from_pair, j.to_pair, j.job_id, j.source_hash,
             j.model, j.prompt_version
    HAVING count(*) >= 2;
COMMENT ON VIEW compaction.audit_exhausted_rows IS
    'Internal: the body of compaction.audit_exhausted (granted to nobody)';

-- Both ages use the server's clock; queue times are finite (queue_times_finite).
CREATE VIEW compaction.audit_queue_rows AS
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
COMMENT ON VIEW compaction.audit_queue_rows IS
    'Internal: the body of compaction.audit_queue (granted to nobody)';

-- The event log (contract §10): the events the attempt rows record (each
-- attempt's claim, and its end as the completion, failure or lease expiry it was), and
-- compaction.event_log, which holds the rest (imports, erasures, the events of erased
-- attempts). An attempt's event columns are set once
-- (the claim's with the row, the end's by attempts_guard) and never change after, nor do
-- its job's, nor the summary a completion wrote: a row of this view never changes, and
-- erase_conversation moves its attempts' rows into event_log before it deletes them.
-- The columns are event_log's; an attempt's event shows what the row written at that
-- moment held (no reason nor size at the claim; the summary written, at a completion).
CREATE VIEW compaction.attempt_events AS
    SELECT a.conversation_id,
           a.claim_event_id AS event_id,
           'claim'::text AS kind,
           a.started_at AS occurred_at,
           a.claim_recorded_at AS recorded_at,
           a.claim_xact_id AS xact_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           a.job_id,
           a.attempt,
           NULL::text AS reason,
           a.worker,
           j.model,
           j.prompt_version,
           j.source_hash,
           NULL::bigint AS summary_id,
           NULL::int AS summary_chars,
           NULL::int AS erased_jobs,
           NULL::int AS erased_attempts,
           NULL::int AS erased_summaries
    FROM compaction.attempts AS a
    JOIN compaction.jobs AS j
      ON j.conversation_id = a.conversation_id AND j.job_id = a.job_id
    WHERE a.claim_event_id IS NOT NULL
    UNION ALL
    SELECT a.conversation_id,
           a.finish_event_id,
           CASE WHEN a.state = 'completed' THEN 'completion'
                WHEN a.reason = 'lease_expired' THEN 'lease_expiry'
                ELSE 'failure' END,
           a.finished_at,
           a.finish_recorded_at,
           a.finish_xact_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           a.job_id,
           a.attempt,
           a.reason,
           a.worker,
           j.model,
           j.prompt_version,
           j.source_hash,
           s.summary_id,
           a.summary_chars,
           NULL::int,
           NULL::int,
           NULL::int
    FROM compaction.attempts AS a
    JOIN compaction.jobs AS j
      ON j.conversation_id = a.conversation_id AND j.job_id = a.job_id
    LEFT JOIN compaction.job_summaries AS s
      ON s.conversation_id = a.conversation_id AND s.job_id = a.job_id AND s.attempt = a.attempt
    WHERE a.finish_event_id IS NOT NULL;
COMMENT ON VIEW compaction.attempt_events IS
    'Internal: the events the attempt rows record (claim; completion, failure or lease_expiry), in event_log''s columns (granted to nobody)';

CREATE VIEW compaction.audit_events_rows AS
    SELECT l.conversation_id, l.event_id, l.kind, l.occurred_at, l.recorded_at, l.xact_id,
           l.scope, l.from_pair, l.to_pair, l.job_id, l.attempt, l.reason, l.worker,
           l.model, l.prompt_version, l.source_hash, l.summary_id, l.summary_chars,
           l.erased_jobs, l.erased_attempts, l.erased_summaries
    FROM compaction.event_log AS l
    UNION ALL
    SELECT * FROM compaction.attempt_events;
COMMENT ON VIEW compaction.audit_events_rows IS
    'Internal: the body of compaction.audit_events (granted to nobody)';

-- The definer functions the facades read through on Citus: the body with the owner's
-- rights, so its shard queries run as the owner (who may log in on the nodes), and a
-- caller's filter applies on the coordinator, after the body (a filter pushed into the
-- body's outer join as a constant is a query Citus cannot plan on PostgreSQL 15 and 16).
-- Their columns are spelled out: Citus takes a function that returns a view's row type
-- for a circular dependency of the view, and then refuses to change the view's owner.
CREATE FUNCTION compaction.read_audit_jobs()
RETURNS TABLE (
        conversation_id text, scope text, from_pair int, to_pair int, job_id bigint,
        source_hash text, model text, prompt_version text, created_at timestamptz,
        attempt int, state text, reason text, worker text, started_at timestamptz,
        lease_expires_at timestamptz, finished_at timestamptz, duration interval,
        finish_reason text, tool_call_count int, response_id text, summary_chars int,
        summary_id bigint, imported boolean, input_tokens int, output_tokens int,
        figures_total int, figures_kept int, claimed_by text, figures_invented int)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_jobs_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_jobs() IS
    'Internal: the rows of audit_jobs with the owner''s rights (what the view reads on Citus)';

CREATE FUNCTION compaction.read_audit_exhausted()
RETURNS TABLE (
        conversation_id text, scope text, from_pair int, to_pair int, job_id bigint,
        source_hash text, model text, prompt_version text, first_reason text,
        second_reason text, exhausted_at timestamptz)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_exhausted_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_exhausted() IS
    'Internal: the rows of audit_exhausted with the owner''s rights (what the view reads on Citus)';

CREATE FUNCTION compaction.read_audit_queue()
RETURNS TABLE (
        scope text, queued bigint, leased bigint, expired_leases bigint,
        oldest_queued_at timestamptz, oldest_queued_age interval)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_queue_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_queue() IS
    'Internal: the rows of audit_queue with the owner''s rights (what the view reads on Citus)';

CREATE FUNCTION compaction.read_audit_events()
RETURNS TABLE (
        conversation_id text, event_id bigint, kind text, occurred_at timestamptz,
        recorded_at timestamptz, xact_id xid8, scope text, from_pair int, to_pair int,
        job_id bigint, attempt int, reason text, worker text, model text,
        prompt_version text, source_hash text, summary_id bigint, summary_chars int,
        erased_jobs int, erased_attempts int, erased_summaries int)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
BEGIN
    RETURN QUERY SELECT * FROM compaction.audit_events_rows;
END
$$;
COMMENT ON FUNCTION compaction.read_audit_events() IS
    'Internal: the rows of audit_events with the owner''s rights (what the view reads on Citus)';

-- The facades, as one node has them (compaction.place_audit_views() chooses the form).
CREATE VIEW compaction.audit_jobs AS SELECT * FROM compaction.audit_jobs_rows;
COMMENT ON VIEW compaction.audit_jobs IS
    'Audit: every job with each attempt (state, reason, worker, lease, duration, finish metadata, token usage, figures kept and invented as reported to complete, NULL when not reported, and the login that claimed it) and imported summaries as state imported; no text';

CREATE VIEW compaction.audit_exhausted AS SELECT * FROM compaction.audit_exhausted_rows;
COMMENT ON VIEW compaction.audit_exhausted IS
    'Audit: identities whose two attempts both failed (claims answer attempts_exhausted), with both reasons';

CREATE VIEW compaction.audit_queue AS SELECT * FROM compaction.audit_queue_rows;
COMMENT ON VIEW compaction.audit_queue IS
    'Audit: the work queue per scope: entries waiting (queued, of which expired_leases were leased by a worker that did not finish), entries under a live lease (leased), and the oldest waiting entry''s enqueue time and age';

CREATE VIEW compaction.audit_events AS SELECT * FROM compaction.audit_events_rows;
COMMENT ON VIEW compaction.audit_events IS
    'Audit: the append-only event log, one row per state change (claim, completion, failure, lease_expiry, import, erasure), in (recorded_at, event_id) order; metadata only, never text';
-- Its rows never change (contract §10): the view is not updatable (a UNION), so an UPDATE or
-- DELETE is refused in every session, session_replication_role = replica included (an
-- INSTEAD OF trigger cannot be enabled ALWAYS, and under replica a disabled one would make
-- such a statement a silent no-op); event_log's guard refuses them on the table (CP011).
