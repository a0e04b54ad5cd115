-- pycompactor stored logic, section 5: audit views.
--
-- compaction_auditor reads these and compaction.audit_events (the event log table) and
-- nothing else: metadata only (ids, ranges, hashes, models, versions, states, reasons,
-- times, lengths), never message or summary text. Recipes: docs/audit.md.

CREATE VIEW compaction.audit_jobs AS
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
           -- Rows written before revision 0007 may hold infinite times; no stored
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
           a.figures_kept
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
           NULL::int
    FROM compaction.jobs AS j
    JOIN compaction.job_summaries AS s
      ON s.conversation_id = j.conversation_id AND s.job_id = j.job_id
    WHERE s.attempt IS NULL;
COMMENT ON VIEW compaction.audit_jobs IS
    'Audit: every job with each attempt (state, reason, worker, lease, duration, finish metadata, token usage and figures kept as reported to complete, NULL when not reported) and imported summaries as state imported; no text';

CREATE VIEW compaction.audit_stale_summaries AS
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

CREATE VIEW compaction.audit_exhausted AS
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
COMMENT ON VIEW compaction.audit_exhausted IS
    'Audit: identities whose two attempts both failed (claims answer attempts_exhausted), with both reasons';

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
