-- pycompactor stored logic, section 9 (last): ownership and privileges.
--
-- Engine objects belong to the NOLOGIN role compaction_owner (alembic's version table
-- excepted: it belongs to whoever migrates). Nobody holds EXECUTE through PUBLIC; each
-- role gets exactly what its job needs (docs/security.md).

CREATE PROCEDURE compaction.assign_ownership()
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_object record;
BEGIN
    EXECUTE 'ALTER SCHEMA compaction OWNER TO compaction_owner';
    EXECUTE 'ALTER SCHEMA compaction_source OWNER TO compaction_owner';
    FOR v_object IN
        SELECT c.oid::regclass AS name,
               CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind
        FROM pg_catalog.pg_class AS c
        WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
          AND c.relkind IN ('r', 'p', 'v', 'S')
          AND c.oid IS DISTINCT FROM pg_catalog.to_regclass('compaction.alembic_version')
          -- sequences owned by a column follow their table
          AND NOT (c.relkind = 'S' AND EXISTS (
                SELECT 1 FROM pg_catalog.pg_depend AS d
                WHERE d.objid = c.oid AND d.deptype IN ('a', 'i')))
    LOOP
        EXECUTE pg_catalog.format('ALTER %s %s OWNER TO compaction_owner', v_object.kind, v_object.name);
    END LOOP;
    FOR v_object IN
        SELECT p.oid::regprocedure AS name,
               CASE p.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END AS kind
        FROM pg_catalog.pg_proc AS p
        WHERE p.pronamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)
    LOOP
        EXECUTE pg_catalog.format('ALTER %s %s OWNER TO compaction_owner', v_object.kind, v_object.name);
        EXECUTE pg_catalog.format('REVOKE ALL ON %s %s FROM PUBLIC', v_object.kind, v_object.name);
    END LOOP;
END
$$;
COMMENT ON PROCEDURE compaction.assign_ownership() IS
    'Migration step: hands every engine object to compaction_owner and revokes EXECUTE from PUBLIC (run by each migration)';

CALL compaction.assign_ownership();

GRANT USAGE ON SCHEMA compaction TO compaction_worker, compaction_reader, compaction_auditor;

GRANT EXECUTE ON FUNCTION
    compaction.indexed_pairs(text),
    compaction.eligible_pairs(text),
    compaction.range_hash(text, text[]),
    compaction.plan_targets(text),
    compaction.source_hash(text, int),
    compaction.explain_runs(text)
TO compaction_worker, compaction_reader;

GRANT SELECT ON compaction.source_runs, compaction.source_messages
TO compaction_worker, compaction_reader;

-- Metadata only: which runs form pairs and why not, never their text.
GRANT EXECUTE ON FUNCTION compaction.explain_runs(text) TO compaction_auditor;

-- Database core. The worker drives claims through functions only;
-- it holds no INSERT, UPDATE or DELETE on any engine table.
GRANT EXECUTE ON FUNCTION
    compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz),
    compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text),
    compaction.fail(bigint, int, text, timestamptz, text),
    compaction.heartbeat(bigint, int, interval, timestamptz, text),
    compaction.reap(timestamptz),
    compaction.enqueue(text, text),
    compaction.reply_problem(text, text, int)
TO compaction_worker;
-- A batch of one conversation's claims under one judgement.
GRANT EXECUTE ON FUNCTION
    compaction.claim_targets(text, text, int[], text[], text[], text, text, text, interval, timestamptz)
TO compaction_worker;
-- A worker's look at a conversation and its first claims in one call.
GRANT EXECUTE ON FUNCTION
    compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz)
TO compaction_worker;
-- reply_problem is no definer: the worker runs its body with its own rights, and that
-- body calls these two (without them the worker's own check of a stopped reply,
-- --min-figure-retention, would be refused EXECUTE on summary_problem). Pure functions
-- of their argument: they read nothing.
GRANT EXECUTE ON FUNCTION compaction.summary_problem(text), compaction.has_content(text)
TO compaction_worker;

GRANT SELECT ON compaction.prompt_versions TO compaction_worker, compaction_reader;
GRANT SELECT ON compaction.summaries TO compaction_reader;

-- Metadata only. audit_stale_summaries reads stale_summaries(), and a function inside a
-- view runs with the caller's EXECUTE privilege: it and source_hash return hashes and
-- ids, never text.
GRANT SELECT ON compaction.audit_jobs, compaction.audit_stale_summaries,
                compaction.audit_exhausted, compaction.audit_events
TO compaction_auditor;
GRANT EXECUTE ON FUNCTION compaction.source_hash(text, int), compaction.stale_summaries()
TO compaction_auditor;
-- What the facades read on Citus: the rows their views show, no more.
GRANT EXECUTE ON FUNCTION compaction.read_audit_jobs(), compaction.read_audit_exhausted(),
                          compaction.read_audit_queue(), compaction.read_audit_events()
TO compaction_auditor;

-- TRUNCATE is refused by triggers as well; not even the owner holds the privilege.
REVOKE TRUNCATE ON compaction.jobs, compaction.attempts, compaction.job_summaries,
                   compaction.event_log, compaction.admission, compaction.queue,
                   compaction.settings, compaction.prompt_versions
FROM compaction_owner;

-- Projection: what `pycompactor project` needs, read-only.
-- Pairs come from compaction.indexed_pairs, granted with the read functions of §3–5.
GRANT EXECUTE ON FUNCTION
    compaction.projection_summaries(text, text),
    compaction.projection_texts(text, text[], bigint[]),
    compaction.projection_frame(text, text, int),
    compaction.projection_read(text, text, int, bigint, int)
TO compaction_worker, compaction_reader;
-- The owner's model preference, names only (shown by `pycompactor audit`
-- and `evaluate`); only the owner sets it (compaction.set_projection_models).
GRANT EXECUTE ON FUNCTION compaction.projection_models()
TO compaction_worker, compaction_reader, compaction_auditor;

-- Derived state. The worker plans from it and reads a claimed range's
-- replies; the auditor may prove it against the views (ids, counts and hashes only).
-- Re-derivation and the rebuild are the owner's; a host attaching the tracking trigger to
-- its own tables is granted EXECUTE on compaction.track_source_changes() by the owner
-- (docs/integrating.md).
GRANT EXECUTE ON FUNCTION
    compaction.worker_targets(text, text, text, text),
    compaction.range_replies(text, int, text)
TO compaction_worker;
GRANT EXECUTE ON FUNCTION compaction.verify_conversation(text) TO compaction_auditor;
GRANT EXECUTE ON FUNCTION compaction.derived_state_status()
TO compaction_worker, compaction_reader, compaction_auditor;
REVOKE TRUNCATE ON compaction.conversation_state, compaction.pairs, compaction.ranges,
                   compaction.summary_verdicts, compaction.source_tracking
FROM compaction_owner;
-- The record of foreign messages, derived state like the others.
REVOKE TRUNCATE ON compaction.foreign_messages FROM compaction_owner;
-- No role but the owner holds any privilege on the conversations' lock
-- rows, so no role without engine grants can lock one (docs/security.md).
REVOKE TRUNCATE ON compaction.conversation_locks FROM compaction_owner;

-- Leased queue: the worker leases entries of its scope and
-- acknowledges (or releases) them; the auditor sees the queue per scope, never an id.
GRANT EXECUTE ON FUNCTION
    compaction.dequeue(text, int, interval),
    compaction.ack(text, text, uuid),
    compaction.release(text, text, uuid)
TO compaction_worker;
GRANT SELECT ON compaction.audit_queue TO compaction_auditor;
