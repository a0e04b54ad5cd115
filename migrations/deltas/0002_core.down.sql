-- Delta 0002_core, downgrade: drops exactly what 0002_core.up.sql added, restoring the
-- 0001_foundation state (grants on 0001 objects included). Never touches source rows.
REVOKE EXECUTE ON FUNCTION compaction.source_hash(text, int) FROM compaction_auditor;

DROP VIEW compaction.audit_exhausted;
DROP VIEW compaction.audit_stale_summaries;
DROP VIEW compaction.audit_jobs;
DROP VIEW compaction.summaries;

DROP TRIGGER messages_enqueue_delete ON compaction_source.messages;
DROP TRIGGER messages_enqueue_update ON compaction_source.messages;
DROP TRIGGER messages_enqueue_insert ON compaction_source.messages;
DROP TRIGGER runs_enqueue_delete ON compaction_source.runs;
DROP TRIGGER runs_enqueue_update ON compaction_source.runs;
DROP TRIGGER runs_enqueue_insert ON compaction_source.runs;

DROP FUNCTION compaction.erase_conversation(text, text);
DROP FUNCTION compaction.import_summary(text, text, int, text[], text, text, text, text, timestamptz);
DROP FUNCTION compaction.dequeue(int);
DROP FUNCTION compaction.enqueue(text, text);
DROP FUNCTION compaction.reap(timestamptz);
DROP FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz);
DROP FUNCTION compaction.fail(bigint, int, text, timestamptz);
DROP FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz);
DROP FUNCTION compaction.fence(bigint, int, timestamptz);
DROP FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz);
DROP FUNCTION compaction.lock_conversation(text);

-- Tables take their triggers with them; the trigger functions go after.
DROP TABLE compaction.audit_events;
DROP TABLE compaction.queue;
DROP TABLE compaction.job_summaries;
DROP TABLE compaction.admission;
DROP TABLE compaction.attempts;
DROP TABLE compaction.jobs;
DROP TABLE compaction.prompt_versions;
DROP TABLE compaction.settings;

DROP FUNCTION compaction.source_enqueue();
DROP FUNCTION compaction.truncate_guard();
DROP FUNCTION compaction.audit_events_guard();
DROP FUNCTION compaction.attempts_guard();
DROP FUNCTION compaction.job_summaries_guard();
DROP FUNCTION compaction.jobs_guard();
DROP FUNCTION compaction.erasing(text);
DROP FUNCTION compaction.job_summaries_record_import();
DROP FUNCTION compaction.attempts_record_event();
DROP FUNCTION compaction.attempts_track_admission();
DROP FUNCTION compaction.summary_problem(text);
DROP FUNCTION compaction.valid_source_hash(text);
DROP FUNCTION compaction.valid_source_ids(text[]);
