-- pycompactor stored logic, section 3: jobs, attempts, summaries, claims and completion.
-- The queue (31_queue.sql), reaping (32_reaping.sql) and imports (33_import.sql) follow.
--
-- Layout. An identity (conversation_id, scope, from_pair, to_pair, source_hash, model,
-- prompt_version) is one row of compaction.jobs, made by its first claim or by an import,
-- and never changed. Each claim of it appends one row to compaction.attempts (at most
-- two: attempts_at_most_two). A completed summary is one row of compaction.job_summaries
-- (one per identity: job_summaries_one_per_identity), written by complete() or
-- import_summary(). compaction.summaries is the public view over them.
--
-- Concurrency. Every writer of one conversation's rows first locks that conversation's
-- row of compaction.conversation_locks until commit (lock_conversation; an advisory lock
-- until revision 0018, which any login could take), so a claim's checks and inserts see
-- a settled state; the partial unique index attempts_one_running and the
-- unique index job_summaries_one_per_identity remain the final word if a caller runs
-- at REPEATABLE READ and the lock's guarantee weakens. Admission is a semaphore of rows:
-- compaction.admission holds slots 1..10000, of which claims use 1..settings.max_running,
-- and an admitting claim takes a free slot with FOR UPDATE SKIP LOCKED, so claims admit in parallel, the
-- count is exact at READ COMMITTED, and at REPEATABLE READ or SERIALIZABLE a claim whose
-- snapshot missed another's slot update gets a serialization failure instead of a second
-- admission. A small global table: a reference table under Citus.
--
-- Time and inputs. The server owns time: p_now is honoured only for a superuser or a
-- member of compaction_owner (caller_now); leases lie within 1 second..1 day
-- by their end, lease_fits and lease_end); reasons that reach the auditor are codes (checked_reason); identifiers
-- that become index keys are bounded (oversized_identifier, revision 0018).
--
-- Ownership (revision 0018). An attempt belongs to the login that claimed it
-- (attempts.claimed_by, session_user inside claim): complete, fail and heartbeat from any
-- other login, the owner and superusers aside, answer lease_lost and change nothing
-- (fence).
--
-- Citus (contract §11, revision 0013): conversation_id leads every primary key, unique index
-- and foreign key between per-conversation tables (jobs, attempts, job_summaries, queue,
-- event_log); their ids come from plain sequences, which Citus gives each node a range
-- of, and nothing orders by them; no trigger on them touches another row: the admission
-- slots and the log's rows are written by the functions below, and an attempt's guard
-- stamps only its own row.

-- ---------------------------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------------------------

CREATE TABLE compaction.settings (
    singleton   boolean NOT NULL DEFAULT true,
    max_running int NOT NULL DEFAULT 8,
    -- Revision 0026, internal: no unexpired attempt holds a slot above it (see
    -- settings_high_water below). Kept by the engine, never set by hand.
    admission_high_water int NOT NULL DEFAULT 0,
    -- Revision 0048: the owner's model preference among a range's valid summaries
    -- (contract §9), set through compaction.set_projection_models, which also
    -- re-judges the verdicts it decides.
    projection_models text[] NOT NULL DEFAULT '{}',
    CONSTRAINT settings_pkey PRIMARY KEY (singleton),
    -- With the primary key, at most one row can exist.
    CONSTRAINT settings_single_row CHECK (singleton),
    CONSTRAINT settings_max_running_not_negative CHECK (max_running >= 0),
    -- One admission slot row per unit: a typo must not create a billion of them.
    CONSTRAINT settings_max_running_bounded CHECK (max_running <= 10000),
    -- A NULL element would name no model (set_projection_models also refuses repeats).
    CONSTRAINT settings_projection_models_named CHECK (
        pg_catalog.array_position(projection_models, NULL) IS NULL
        AND pg_catalog.cardinality(projection_models) <= 100)
);
COMMENT ON TABLE compaction.settings IS
    'Engine settings, a single row: max_running caps running (unexpired) attempts across the database (default 8); projection_models orders a range''s valid summaries by model (set with set_projection_models); admission_high_water is the engine''s own';
COMMENT ON COLUMN compaction.settings.projection_models IS
    'The owner''s model preference for projection (contract §9): among a range''s valid summaries of one prompt version, a model named earlier before one named later, named before unnamed; empty by default; set with compaction.set_projection_models';
COMMENT ON COLUMN compaction.settings.admission_high_water IS
    'Internal (revision 0026): no unexpired attempt holds an admission slot above this; at least max_running, raised with it, lowered only by a claim that found the slots above max_running free';

-- Where claims look for attempts admitted before max_running was lowered (revision 0026).
-- Until then an index on the slots' holders answered "the highest held slot", and kept
-- every slot update from being HOT: each claim and each finished attempt wrote three
-- index entries (docs/benchmarks.md). Now the settings row remembers the highest
-- max_running since the slots above the current one were last found free; a claim that
-- finds them free again lowers it (claim), under the transaction-local mark
-- compaction.lowering_high_water, the only way it goes down.
CREATE FUNCTION compaction.settings_high_water()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'UPDATE'
       AND pg_catalog.current_setting('compaction.lowering_high_water', true)
           IS DISTINCT FROM 'on' THEN
        NEW.admission_high_water := GREATEST(NEW.admission_high_water,
                                             OLD.admission_high_water, OLD.max_running);
    END IF;
    NEW.admission_high_water := GREATEST(NEW.admission_high_water, NEW.max_running);
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION compaction.settings_high_water() IS
    'Trigger: keeps settings.admission_high_water at least max_running and never lowers it, except inside a claim that found the slots above max_running free';
CREATE TRIGGER settings_high_water
    BEFORE INSERT OR UPDATE ON compaction.settings
    FOR EACH ROW EXECUTE FUNCTION compaction.settings_high_water();
-- Also for session_replication_role = replica: a replicated max_running still raises it.
ALTER TABLE compaction.settings ENABLE ALWAYS TRIGGER settings_high_water;
INSERT INTO compaction.settings (singleton, max_running) VALUES (true, 8);

CREATE TABLE compaction.prompt_versions (
    prompt_version   text NOT NULL,
    input_kind       text NOT NULL,
    projectable      boolean NOT NULL,
    accepts_new_jobs boolean NOT NULL,
    CONSTRAINT prompt_versions_pkey PRIMARY KEY (prompt_version),
    CONSTRAINT prompt_versions_input_kind_valid CHECK (input_kind IN ('mixed', 'assistant_only'))
);
COMMENT ON TABLE compaction.prompt_versions IS
    'Known prompt versions: input kind, whether their summaries may be projected, whether claims may start new jobs with them';
-- A migration that adds a version also writes it into compaction.job_rules_hold, which
-- holds every job to these versions (revision 0046: no foreign key locks their rows).
INSERT INTO compaction.prompt_versions (prompt_version, input_kind, projectable, accepts_new_jobs)
VALUES ('conversation-compaction@1', 'mixed', false, false),
       ('conversation-compaction@2', 'assistant_only', true, false),
       ('conversation-compaction@3', 'assistant_only', true, true);

-- Shape rules shared by claim (refusal reasons), import_summary (errors) and the tables'
-- CHECK constraints (last line of defence against direct writes by the owner).
--
-- The small rules below run on every claim and completion, in both the functions and the
-- CHECK constraints. Revision 0016: they carry no SET clause, so that the planner inlines
-- the SQL ones into their callers' expressions (as has_content and is_target, sql/
-- 20_pairs.sql), instead of planning each body again in every transaction; every name,
-- operators included, is schema-qualified, so no search_path can change what they mean.
-- valid_source_ids needs a subquery, which rules inlining out: PL/pgSQL keeps its plan
-- for the session instead.
--
-- Revision 0032: the rules a CHECK constraint calls are PL/pgSQL (attempt_rules_hold
-- already was). PostgreSQL prepares a table's CHECK expressions again in every statement
-- that writes the table, and an SQL function inlined there has its body parsed each time:
-- summary_problem and valid_source_hash, inlined into the CHECKs of job_summaries and
-- jobs, were 6.1% of a claim -> complete cycle's instructions (docs/benchmarks.md).
-- PL/pgSQL compiles a body once per session. valid_source_hash also tests its characters
-- with ltrim instead of a regular expression: the pattern's 64-fold repetition cost about
-- 75,000 instructions a call, twice a cycle, where the test below costs a few thousand.
CREATE FUNCTION compaction.valid_source_ids(p_source_message_ids text[])
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    RETURN p_source_message_ids IS NOT NULL
       AND pg_catalog.array_ndims(p_source_message_ids) OPERATOR(pg_catalog.=) 1
       AND pg_catalog.cardinality(p_source_message_ids) OPERATOR(pg_catalog.=) 20
       AND pg_catalog.array_position(p_source_message_ids, NULL::pg_catalog.text) IS NULL
       AND (SELECT pg_catalog.count(DISTINCT i.id)
            FROM pg_catalog.unnest(p_source_message_ids) AS i (id)) OPERATOR(pg_catalog.=) 20;
END
$$;
COMMENT ON FUNCTION compaction.valid_source_ids(text[]) IS
    'Internal: true when the array holds exactly 20 distinct non-null ids (one dimension)';

CREATE FUNCTION compaction.valid_source_hash(p_source_hash text)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    -- What '^[0-9a-f]{64}$' matches: 64 bytes, every one of them in the set (a character
    -- outside it, multibyte or not, is left by ltrim).
    RETURN p_source_hash IS NOT NULL
       AND pg_catalog.octet_length(p_source_hash) OPERATOR(pg_catalog.=) 64
       AND pg_catalog.ltrim(p_source_hash, '0123456789abcdef') OPERATOR(pg_catalog.=) '';
END
$$;
COMMENT ON FUNCTION compaction.valid_source_hash(text) IS
    'Internal: true when the text is 64 lowercase hexadecimal characters (a SHA-256 in hex)';

-- NULL when the text is an acceptable summary, else the reason it is not.
CREATE FUNCTION compaction.summary_problem(p_summary text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    RETURN CASE
               WHEN NOT compaction.has_content(p_summary) THEN 'empty'
               -- characters, not bytes: 6,000 four-byte emoji are a valid summary
               WHEN pg_catalog.char_length(p_summary) OPERATOR(pg_catalog.>) 6000 THEN 'too_long'
           END;
END
$$;
COMMENT ON FUNCTION compaction.summary_problem(text) IS
    'Internal: NULL for a valid summary text, else empty (NULL or whitespace only) or too_long (over 6,000 characters)';

-- complete()'s verdict on a model reply, in the contract's order (contract §6): complete
-- records it, and the worker asks it before --min-figure-retention (only a reply that
-- complete would accept can fail that gate), so Python keeps no copy of the rule.
CREATE FUNCTION compaction.reply_problem(p_summary text, p_finish_reason text,
                                         p_tool_call_count int)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    -- IS DISTINCT FROM, with the operator named: a NULL is neither 'stop' nor 0.
    SELECT CASE
               WHEN NOT coalesce(p_finish_reason OPERATOR(pg_catalog.=) 'stop', false)
                   THEN 'not_stopped'
               WHEN NOT coalesce(p_tool_call_count OPERATOR(pg_catalog.=) 0, false)
                   THEN 'tool_calls'
               ELSE compaction.summary_problem(p_summary)
           END
$$;
COMMENT ON FUNCTION compaction.reply_problem(text, text, int) IS
    'NULL when complete() would accept this reply, else its reason: not_stopped, tool_calls, empty or too_long (checked in that order)';

-- Every rule of a jobs row (the CHECK jobs_rules, revision 0045), as attempt_rules_hold
-- is the attempts': one CHECK whose stored form a claim's insert reads and plans, where
-- five did (about 1% of a claim -> complete cycle's instructions, docs/benchmarks.md). A
-- broken rule is the check_violation of its own name, as when each was a CHECK of its own,
-- and the first of them in the order PostgreSQL checked those (by name):
-- jobs_model_not_empty, jobs_range_valid (from_pair a multiple of 10 from 0, to_pair
-- from_pair + 9), jobs_scope_not_empty, jobs_source_hash_valid, jobs_source_ids_valid.
-- Last, as the foreign key it replaces was checked after the CHECKs (revision 0046), a
-- version compaction.prompt_versions does not hold is that key's foreign_key_violation
-- (23503, jobs_prompt_version_fkey), so a caller sees the error it saw before. The key's
-- check locked the version's row FOR KEY SHARE at every claim, and concurrent claims all
-- lock the same row: each overlap made a MultiXact, whose ids a database spends for good
-- (783 per 1,000 claims at 8 connections, docs/benchmarks.md). The lock guarded against a
-- delete or a change of key that prompt_versions_guard refuses anyway, for the owner
-- too. So the versions are written out here: a version is added by a migration only, and
-- that migration replaces this function with the version added
-- (tests/sql/test_prompt_versions.py holds the two to the same versions). Written out,
-- not read from prompt_versions: the CHECK also runs on Citus shards, where a query of a
-- reference table inside it would be a distributed query of its own. A rule passes when
-- it is NULL, as a CHECK does. PL/pgSQL with no SET clause and every name qualified, as
-- the rules it calls.
CREATE FUNCTION compaction.job_rules_hold(
    p_from_pair int, p_to_pair int, p_source_message_ids text[], p_source_hash text,
    p_scope text, p_model text, p_prompt_version text)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
DECLARE
    v_rule text;
BEGIN
    v_rule := CASE
        WHEN (p_model OPERATOR(pg_catalog.<>) '') IS FALSE THEN 'jobs_model_not_empty'
        WHEN (p_from_pair OPERATOR(pg_catalog.>=) 0
              AND (p_from_pair OPERATOR(pg_catalog.%) 10) OPERATOR(pg_catalog.=) 0
              AND p_to_pair OPERATOR(pg_catalog.=) (p_from_pair OPERATOR(pg_catalog.+) 9)) IS FALSE
            THEN 'jobs_range_valid'
        WHEN (p_scope OPERATOR(pg_catalog.<>) '') IS FALSE THEN 'jobs_scope_not_empty'
        WHEN compaction.valid_source_hash(p_source_hash) IS FALSE THEN 'jobs_source_hash_valid'
        WHEN compaction.valid_source_ids(p_source_message_ids) IS FALSE THEN 'jobs_source_ids_valid'
    END;
    IF v_rule IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "jobs" violates check constraint "%"', v_rule
            USING ERRCODE = 'check_violation', CONSTRAINT = v_rule, TABLE = 'jobs',
                  SCHEMA = 'compaction';
    END IF;
    IF (p_prompt_version OPERATOR(pg_catalog.=) ANY ('{conversation-compaction@1,'
            'conversation-compaction@2,conversation-compaction@3}'::text[])) IS FALSE THEN
        RAISE EXCEPTION 'insert or update on table "jobs" violates foreign key constraint "jobs_prompt_version_fkey"'
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'jobs_prompt_version_fkey',
                  TABLE = 'jobs', SCHEMA = 'compaction',
                  DETAIL = pg_catalog.format(
                      'Key (prompt_version)=(%s) is not present in table "prompt_versions".',
                      p_prompt_version),
                  HINT = 'A prompt version is added by a migration, which writes it into compaction.job_rules_hold too.';
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.job_rules_hold(int, int, text[], text, text, text, text) IS
    'Internal: the CHECK jobs_rules; true when every rule of a jobs row holds, else the check_violation (23514) named after the broken rule (jobs_model_not_empty, jobs_range_valid, jobs_scope_not_empty, jobs_source_hash_valid, jobs_source_ids_valid), or for a version compaction.prompt_versions does not hold the foreign_key_violation (23503) jobs_prompt_version_fkey';

-- Ids are unique, never ordered: under Citus each node draws from its own range.
CREATE SEQUENCE compaction.jobs_job_id_seq AS bigint;
CREATE TABLE compaction.jobs (
    conversation_id    text NOT NULL,
    job_id             bigint NOT NULL DEFAULT pg_catalog.nextval('compaction.jobs_job_id_seq'),
    scope              text NOT NULL,
    from_pair          int NOT NULL,
    to_pair            int NOT NULL,
    source_message_ids text[] NOT NULL,
    source_hash        text NOT NULL,
    model              text NOT NULL,
    prompt_version     text NOT NULL,
    created_at         timestamptz NOT NULL,
    CONSTRAINT jobs_pkey PRIMARY KEY (conversation_id, job_id),
    CONSTRAINT jobs_identity_key
        UNIQUE (conversation_id, scope, from_pair, source_hash, model, prompt_version)
);
COMMENT ON TABLE compaction.jobs IS
    'One row per compaction identity (conversation, scope, range, source hash, model, prompt version) with its 20 source ids; immutable';
ALTER SEQUENCE compaction.jobs_job_id_seq OWNED BY compaction.jobs.job_id;
-- NOT VALID (revision 0045): every row written before it was checked by the five CHECKs
-- this one replaces (and, until revision 0046, by the foreign key on prompt_version its
-- last rule replaces), and jobs are immutable, so a scan under the migration's lock would
-- find nothing; every new row is checked.
ALTER TABLE compaction.jobs
    ADD CONSTRAINT jobs_rules CHECK (compaction.job_rules_hold(
        from_pair, to_pair, source_message_ids, source_hash, scope, model,
        prompt_version)) NOT VALID;
-- complete/fail/heartbeat are addressed by job_id alone (the fencing token is
-- (job_id, attempt)); this finds the job's conversation, then everything is keyed by it.
CREATE INDEX jobs_job_id_idx ON compaction.jobs (job_id);

-- The event log (contract §10) is the view compaction.audit_events (sql/50_audit.sql). Since
-- revision 0027 an attempt's own row records its two events, the claim and the end
-- (claim_* and finish_* columns below: the event id, the clock when it was written, the
-- writing transaction), so a claim -> complete cycle writes no event row; this table,
-- audit_events until then (its constraints, index, sequence and guards keep that name),
-- holds the rest: imports, erasures, the events of the attempts an erasure removes, and
-- every event written before 0027.
CREATE SEQUENCE compaction.audit_events_event_id_seq AS bigint;
CREATE TABLE compaction.event_log (
    conversation_id  text NOT NULL,
    event_id         bigint NOT NULL DEFAULT pg_catalog.nextval('compaction.audit_events_event_id_seq'),
    kind             text NOT NULL,
    occurred_at      timestamptz NOT NULL,
    -- The log's order (revision 0013): the clock when the event was written, which the
    -- engine does only while it holds the conversation, so one conversation's events
    -- follow each other exactly; event_id breaks ties and is unique, not an order.
    recorded_at      timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    -- Identifies the writing transaction (until revision 0013 the erasure guard matched
    -- the tombstone's against its own; kept for the record).
    xact_id          xid8 NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    scope            text,
    from_pair        int,
    to_pair          int,
    job_id           bigint,
    attempt          int,
    reason           text,
    worker           text,
    model            text,
    prompt_version   text,
    source_hash      text,
    summary_id       bigint,
    summary_chars    int,
    erased_jobs      int,
    erased_attempts  int,
    erased_summaries int,
    CONSTRAINT audit_events_pkey PRIMARY KEY (conversation_id, event_id),
    CONSTRAINT audit_events_kind_valid CHECK (
        kind IN ('claim', 'completion', 'failure', 'lease_expiry', 'import', 'erasure'))
);
COMMENT ON TABLE compaction.event_log IS
    'Internal: the events no attempt row records (import, erasure; the events of erased attempts; every event written before revision 0027), append-only; read them through compaction.audit_events';
ALTER SEQUENCE compaction.audit_events_event_id_seq OWNED BY compaction.event_log.event_id;
-- Revision 0007, NOT VALID for the same reason as the attempts' checks: the log is
-- append-only, earlier entries keep what they recorded.
ALTER TABLE compaction.event_log
    ADD CONSTRAINT audit_events_reason_is_code CHECK (reason ~ '^[a-z][a-z0-9_]{0,63}$') NOT VALID,
    ADD CONSTRAINT audit_events_times_finite CHECK (pg_catalog.isfinite(occurred_at)) NOT VALID;
-- The DBA reads the log newest first across conversations.
CREATE INDEX audit_events_recorded_at_idx ON compaction.event_log (recorded_at, event_id);

-- Every rule of an attempt row (the CHECK attempts_rules, revision 0021). A broken rule
-- is reported as the check_violation of its own name, as when each was a CHECK of its
-- own: attempts_at_most_two (bounded retries: the first attempt and one retry, never a
-- third), attempts_state_valid, attempts_finished_iff_terminal,
-- attempts_reason_matches_state, attempts_stats_valid (complete()'s p_stats, contract §6:
-- non-negative counts, NULL when not reported; figures_invented since revision 0048),
-- attempts_times_valid (stored times are
-- the server's, finite and ordered: revision 0007) and attempts_reason_is_code (the
-- auditor reads reasons and never sees content). A rule passes when it is NULL, as a
-- CHECK does. PL/pgSQL with no SET clause and every name qualified: the session keeps its
-- plan, and no search_path changes what it means.
CREATE FUNCTION compaction.attempt_rules_hold(
    p_attempt int, p_state text, p_reason text, p_started_at timestamptz,
    p_lease_expires_at timestamptz, p_finished_at timestamptz, p_input_tokens int,
    p_output_tokens int, p_figures_total int, p_figures_kept int, p_figures_invented int)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
DECLARE
    v_rule text;
BEGIN
    v_rule := CASE
        WHEN (p_attempt OPERATOR(pg_catalog.>=) 1 AND p_attempt OPERATOR(pg_catalog.<=) 2) IS FALSE
            THEN 'attempts_at_most_two'
        WHEN (p_state OPERATOR(pg_catalog.=) ANY (ARRAY['running', 'completed', 'failed'])) IS FALSE
            THEN 'attempts_state_valid'
        WHEN ((p_state OPERATOR(pg_catalog.=) 'running') OPERATOR(pg_catalog.=) (p_finished_at IS NULL)) IS FALSE
            THEN 'attempts_finished_iff_terminal'
        WHEN (CASE p_state
                  WHEN 'running' THEN p_reason IS NULL
                  WHEN 'completed' THEN p_reason OPERATOR(pg_catalog.=) 'completed'
                  ELSE p_reason IS NOT NULL AND p_reason OPERATOR(pg_catalog.<>) ''
              END) IS FALSE
            THEN 'attempts_reason_matches_state'
        WHEN (p_input_tokens OPERATOR(pg_catalog.>=) 0 AND p_output_tokens OPERATOR(pg_catalog.>=) 0
              AND p_figures_total OPERATOR(pg_catalog.>=) 0
              AND p_figures_kept OPERATOR(pg_catalog.>=) 0
              AND p_figures_kept OPERATOR(pg_catalog.<=) p_figures_total
              AND (p_figures_kept IS NULL OR p_figures_total IS NOT NULL)
              AND p_figures_invented OPERATOR(pg_catalog.>=) 0) IS FALSE
            THEN 'attempts_stats_valid'
        WHEN (pg_catalog.isfinite(p_started_at) AND pg_catalog.isfinite(p_lease_expires_at)
              AND (p_finished_at IS NULL
                   OR (pg_catalog.isfinite(p_finished_at)
                       AND p_finished_at OPERATOR(pg_catalog.>=) p_started_at))) IS FALSE
            THEN 'attempts_times_valid'
        WHEN (p_reason OPERATOR(pg_catalog.~) '^[a-z][a-z0-9_]{0,63}$') IS FALSE
            THEN 'attempts_reason_is_code'
    END;
    IF v_rule IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "attempts" violates check constraint "%"', v_rule
            USING ERRCODE = 'check_violation', CONSTRAINT = v_rule, TABLE = 'attempts',
                  SCHEMA = 'compaction';
    END IF;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.attempt_rules_hold(int, text, text, timestamptz, timestamptz, timestamptz, int, int, int, int, int) IS
    'Internal: the CHECK attempts_rules; true when every rule of an attempt row holds, else the check_violation (23514) named after the broken rule (attempts_at_most_two, attempts_state_valid, attempts_finished_iff_terminal, attempts_reason_matches_state, attempts_stats_valid, attempts_times_valid, attempts_reason_is_code)';

CREATE TABLE compaction.attempts (
    conversation_id  text NOT NULL,
    job_id           bigint NOT NULL,
    attempt          int NOT NULL,
    state            text NOT NULL,
    reason           text,
    worker           text NOT NULL,
    started_at       timestamptz NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    finished_at      timestamptz,
    finish_reason    text,
    tool_call_count  int,
    response_id      text,
    summary_chars    int,
    input_tokens     int,
    output_tokens    int,
    figures_total    int,
    figures_kept     int,
    -- The login that claimed the attempt (session_user inside claim, revision 0018): the
    -- fenced calls refuse any other login (contract §6), so knowing (job_id, attempt) is not
    -- enough to finish or renew it. NULL on attempts claimed before 0018: those only the
    -- owner or a superuser can finish (their leases run out; the range is claimed again).
    claimed_by       text,
    -- The admission slot the attempt took (revision 0026), freed by that key when it ends
    -- (unless a later claim took the slot over after this lease ran out). NULL on attempts
    -- that ended before 0026.
    slot             int,
    -- The attempt's events (revision 0027; NULL on attempts claimed before it, whose claim
    -- event is in compaction.event_log): the claim's, written with the row, and the
    -- end's, stamped by attempts_guard when the attempt leaves running. Each is an id
    -- from the log's sequence, the clock when it was written (the log's order) and the
    -- writing transaction, as an event_log row has them.
    claim_event_id     bigint DEFAULT pg_catalog.nextval('compaction.audit_events_event_id_seq'),
    claim_recorded_at  timestamptz DEFAULT pg_catalog.clock_timestamp(),
    claim_xact_id      xid8 DEFAULT pg_catalog.pg_current_xact_id(),
    finish_event_id    bigint,
    finish_recorded_at timestamptz,
    finish_xact_id     xid8,
    -- Figures of the summary that none of the ten replies holds, as the worker reported
    -- them to complete (contract §8, revision 0048); NULL when not reported.
    figures_invented   int,
    CONSTRAINT attempts_pkey PRIMARY KEY (conversation_id, job_id, attempt),
    CONSTRAINT attempts_job_fkey FOREIGN KEY (conversation_id, job_id)
        REFERENCES compaction.jobs (conversation_id, job_id)
);
COMMENT ON TABLE compaction.attempts IS
    'Append-only attempt log: one row per claim of an identity (at most 2); only running -> completed | failed (and lease renewal) ever changes';
COMMENT ON COLUMN compaction.attempts.figures_invented IS
    'Figures of the summary that none of the ten replies holds, as reported to complete in p_stats (contract §8); NULL when not reported';
-- The rules of an attempt row, one CHECK (revision 0021). PostgreSQL rebuilds a table's
-- CHECK expressions from their stored form in every statement that writes a row, and
-- attempts are written twice per cycle: their seven CHECKs were about 12% of a claim ->
-- complete cycle's instructions (docs/benchmarks.md); one call of attempt_rules_hold
-- costs under half of that. NOT VALID because attempts are append-only history: rows
-- written before revision 0007 may hold an infinite time or a free-text reason, and keep
-- what they recorded (the audit views cope with them); every new or changed row is
-- checked, and the five rules older than 0007 held for every row when they were folded in.
ALTER TABLE compaction.attempts
    ADD CONSTRAINT attempts_rules CHECK (compaction.attempt_rules_hold(
        attempt, state, reason, started_at, lease_expires_at, finished_at,
        input_tokens, output_tokens, figures_total, figures_kept, figures_invented)) NOT VALID;
-- The final word on exclusivity: one running attempt per identity, whatever the callers do.
CREATE UNIQUE INDEX attempts_one_running
    ON compaction.attempts (conversation_id, job_id) WHERE state = 'running';

-- Admission: a semaphore of rows. Slots 1..10000 always exist (the bound on max_running,
-- revision 0013: no trigger resizes them); claims use slots 1..settings.max_running. A
-- running attempt holds one slot with a copy of its lease; a free slot has no holder, and
-- a slot whose holder's lease ran out counts as free (expired attempts never count
-- against admission). Not per conversation: under Citus a reference table. Revision
-- 0026: its only index is the primary key on slot, which no update changes, and its pages
-- are half empty, so taking, renewing and freeing a slot are HOT updates that write no
-- index entry; a slot is found by number (attempts.slot), the overflow after a lowered
-- max_running by settings.admission_high_water.
CREATE TABLE compaction.admission (
    slot                   int NOT NULL,
    holder_conversation_id text,
    holder_job_id          bigint,
    holder_attempt         int,
    lease_expires_at       timestamptz,
    CONSTRAINT admission_pkey PRIMARY KEY (slot),
    CONSTRAINT admission_slot_positive CHECK (slot >= 1),
    -- A holder is all four columns or none. Revision 0045: one call instead of three
    -- comparisons, a shorter form for each update of a slot to read and plan (the two a
    -- claim -> complete cycle makes cost 0.8% fewer instructions, docs/benchmarks.md).
    CONSTRAINT admission_holder_complete CHECK (
        pg_catalog.num_nulls(holder_conversation_id, holder_job_id, holder_attempt,
                             lease_expires_at) OPERATOR(pg_catalog.=) ANY ('{0,4}'::int[]))
) WITH (fillfactor = 50);
COMMENT ON TABLE compaction.admission IS
    'Internal: admission slots 1..10000; a running attempt holds one (with its lease), claim takes a free one among 1..settings.max_running or refuses admission_full';
INSERT INTO compaction.admission (slot)
SELECT g.slot FROM pg_catalog.generate_series(1, 10000) AS g (slot);

CREATE SEQUENCE compaction.job_summaries_summary_id_seq AS bigint;
CREATE TABLE compaction.job_summaries (
    conversation_id text NOT NULL,
    summary_id      bigint NOT NULL DEFAULT pg_catalog.nextval('compaction.job_summaries_summary_id_seq'),
    job_id          bigint NOT NULL,
    attempt         int,
    summary         text NOT NULL,
    completed_at    timestamptz NOT NULL,
    CONSTRAINT job_summaries_pkey PRIMARY KEY (conversation_id, summary_id),
    -- One completed summary per identity, ever (an identity is one jobs row).
    CONSTRAINT job_summaries_one_per_identity UNIQUE (conversation_id, job_id),
    CONSTRAINT job_summaries_job_fkey FOREIGN KEY (conversation_id, job_id)
        REFERENCES compaction.jobs (conversation_id, job_id),
    -- attempt is NULL for an imported summary (no attempt produced it here).
    CONSTRAINT job_summaries_attempt_fkey FOREIGN KEY (conversation_id, job_id, attempt)
        REFERENCES compaction.attempts (conversation_id, job_id, attempt),
    CONSTRAINT job_summaries_summary_valid CHECK (compaction.summary_problem(summary) IS NULL)
);
COMMENT ON TABLE compaction.job_summaries IS
    'Completed summaries, one per identity, immutable; attempt is NULL for imports (read them through compaction.summaries)';
ALTER SEQUENCE compaction.job_summaries_summary_id_seq OWNED BY compaction.job_summaries.summary_id;

-- ---------------------------------------------------------------------------------------
-- Claims and completion
-- ---------------------------------------------------------------------------------------

-- One row per conversation the engine has worked on, whose row lock every writer of that
-- conversation's engine rows takes first (revision 0018). Until then the lock was a
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
-- Claims and imports write a conversation's row before its jobs, and revision 0018 wrote
-- one for every conversation that had jobs; a conversation without one (jobs the owner
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
-- the owner. The worker's calls call it only for a given p_now (revision 0045), and
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

-- The longest identifiers the engine takes from a caller, in UTF-8 bytes (revision
-- 0018). They become index keys (jobs_identity_key holds conversation, scope and model
-- together, and a btree entry must fit in a third of a page, 2704 bytes: these limits
-- leave room for the hash and the rest even when nothing compresses), so a longer one
-- used to fail deep inside an insert (54000, index row requires N bytes); the worker's
-- name is kept with every attempt and event. NULL when every argument fits (NULL fits), else the
-- message naming the first one over its limit. One expression with no SET clause, so it
-- inlines into its callers (revision 0016), which it did only from revision 0021: the
-- number was joined to the text by anytextcat, which is STABLE, and an IMMUTABLE SQL
-- function whose body calls a STABLE one is not inlined; it was parsed and planned again
-- in every claim (7% of a claim -> complete cycle's instructions). Casting the number to
-- text makes every call in it immutable.
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

-- A lease is bounded by its effect, on the clock (revision 0049): it must end 1 second to
-- 1 day after now. Intervals compare with 30-day months and 24-hour days, so a bound on
-- the interval itself let '10000 years -3599999 days' (144 years, on the clock) pass as a
-- day (issue 62). The callers test the usual lease in line (lease_fits: a number of
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

-- What follows an attempt's end (contract §11: written by the engine's functions, not by
-- triggers on its tables, so that every statement addresses one conversation's rows or a
-- global table): its admission slot back, by number (revision 0026), unless another claim
-- took the slot over after the lease ran out. Called right after the write that ended
-- it, under the conversation's lock, with the attempt row that write returned. Until
-- revision 0027 this was record_attempt_change, which also wrote the attempt's event: the
-- attempt row records its own now (attempts_guard stamps the end).
CREATE FUNCTION compaction.release_slot(p_conversation_id text, p_attempt compaction.attempts)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_attempt.state IS DISTINCT FROM 'running' AND p_attempt.slot IS NOT NULL THEN
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.slot = p_attempt.slot AND ad.holder_conversation_id = p_conversation_id
          AND ad.holder_job_id = p_attempt.job_id AND ad.holder_attempt = p_attempt.attempt;
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.release_slot(text, compaction.attempts) IS
    'Internal: given an attempt row of a conversation as just written, frees the admission slot it holds once it ended (unless another claim took the slot over)';

-- After max_running was lowered, the claim that finds no unexpired attempt in a slot
-- above it brings admission_high_water down to max_running, so the claims after it skip
-- the look above (revision 0026). Not while a claim that read the higher max_running is
-- taking one of those slots: each slot in the range is locked here, SKIP LOCKED, and only
-- if every one was free and lockable does the high water go down; a slot being taken is
-- locked by its taker until commit, and one taken since is not free on its newest
-- version. A taker whose read of max_running was older than the lowering holds its
-- lock until commit, so either this sees it or it was done before. The mark is what the
-- trigger settings_high_water lets lower it, as SET LOCAL statements that Citus carries
-- to the nodes.
CREATE FUNCTION compaction.lower_high_water(p_max_running int, p_high_water int,
                                            p_now timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_free int;
BEGIN
    SELECT count(*) INTO v_free
    FROM (SELECT 1
          FROM compaction.admission AS ad
          WHERE ad.slot > p_max_running AND ad.slot <= p_high_water
            AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= p_now)
          FOR UPDATE SKIP LOCKED) AS f;
    IF v_free < p_high_water - p_max_running THEN
        RETURN;
    END IF;
    IF compaction.engine_distributed() THEN
        EXECUTE 'SET LOCAL citus.propagate_set_commands = local';
    END IF;
    EXECUTE 'SET LOCAL compaction.lowering_high_water = on';
    UPDATE compaction.settings AS s
    SET admission_high_water = p_max_running
    WHERE s.max_running = p_max_running AND s.admission_high_water = p_high_water;
    EXECUTE 'SET LOCAL compaction.lowering_high_water = off';
END
$$;
COMMENT ON FUNCTION compaction.lower_high_water(int, int, timestamptz) IS
    'Internal: sets settings.admission_high_water to p_max_running when every admission slot in (p_max_running, p_high_water] is free and lockable (called by claim)';

-- Revision 0049 (issue 62): what the committed state already answers for a claim of an
-- identity, read without any lock: already_completed (a summary, for good),
-- already_running (an attempt whose lease is live) or attempts_exhausted (two attempts,
-- for good), in claim_range's order; NULL when only a claim under the conversation's lock
-- can tell (no job yet, a retry, admission) or must write (an expired attempt, which the
-- claim reaps on its way, contract §6). Each answer is what claim_range would give
-- at the moment of the read, so claim, claim_targets and claim_next_targets answer these
-- refusals without taking the lock: a refused claim holds nothing, whatever its caller's
-- transaction does next. No SET clause, as claim_range: owner-only, under its callers'
-- settings.
CREATE FUNCTION compaction.claim_settled(
    p_conversation_id text,
    p_scope           text,
    p_from_pair       int,
    p_source_hash     text,
    p_model           text,
    p_prompt_version  text,
    p_now             timestamptz,
    OUT reason        text,
    OUT job_id        bigint)
RETURNS record
LANGUAGE plpgsql
STABLE
AS $$
DECLARE
    v_job_id  bigint;
    v_live    boolean;
    v_expired boolean;
    v_count   int;
BEGIN
    SELECT j.job_id INTO v_job_id
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;
    job_id := v_job_id;
    IF v_job_id IS NULL THEN
        RETURN;
    END IF;
    SELECT coalesce(pg_catalog.bool_or(a.state = 'running' AND a.lease_expires_at > p_now),
                    false),
           coalesce(pg_catalog.bool_or(a.state = 'running' AND a.lease_expires_at <= p_now),
                    false),
           pg_catalog.count(*)
    INTO v_live, v_expired, v_count
    FROM compaction.attempts AS a
    WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
    IF v_expired THEN
        RETURN;  -- the claim reaps it, under the lock
    END IF;
    reason := CASE WHEN EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                                WHERE s.conversation_id = p_conversation_id
                                  AND s.job_id = v_job_id) THEN 'already_completed'
                   WHEN v_live THEN 'already_running'
                   WHEN v_count >= 2 THEN 'attempts_exhausted' END;
END
$$;
COMMENT ON FUNCTION compaction.claim_settled(text, text, int, text, text, text, timestamptz) IS
    'Internal: the refusal the committed state already gives a claim of this identity (already_completed, already_running, attempts_exhausted) and its job, read without a lock; NULL when only a claim under the conversation''s lock can tell';

-- Revision 0038: a claim once the range has been judged (p_is_target: the window policy
-- makes it a target now; p_target_ids and p_target_hash: its current ids and hash), under
-- the conversation's lock, which the caller holds: the checks from not_eligible on, in the
-- contract's order, and the writes. compaction.claim judges one range, claim_targets a
-- batch of one conversation's ranges at once; both answer through here.
CREATE FUNCTION compaction.claim_range(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_now                timestamptz,
    p_lease_expires_at   timestamptz,
    p_is_target          boolean,
    p_target_ids         text[],
    p_target_hash        text,
    OUT claimed          boolean,
    OUT reason           text,
    OUT job_id           bigint,
    OUT attempt          int,
    OUT lease_expires_at timestamptz)
RETURNS record
LANGUAGE plpgsql
VOLATILE
-- No SET clause and no SECURITY DEFINER: only the owner may execute it, and it runs
-- inside claim and claim_targets, under their rights, search_path and planner settings
-- (every lookup by key, whatever the tables' statistics when first planned). Either
-- would cost each claim a second change of settings.
AS $$
#variable_conflict use_column
DECLARE
    v_job         compaction.jobs;
    v_job_id      bigint;
    v_attempt_row compaction.attempts;
    v_failed      int;
    v_attempt     int;
    v_max_running int;
    v_high_water  int;
    v_slot        int;
    v_overflow    boolean := false;
    v_room        boolean := true;
    v_expired     compaction.attempts;
BEGIN
    IF p_is_target IS NOT TRUE THEN
        claimed := false;
        reason := 'not_eligible';
        RETURN;
    END IF;
    IF NOT compaction.valid_source_hash(p_source_hash)
       OR p_target_hash IS DISTINCT FROM p_source_hash
       OR p_target_ids IS DISTINCT FROM p_source_message_ids THEN
        claimed := false;
        reason := 'source_mismatch';
        RETURN;
    END IF;

    SELECT j.* INTO v_job
    FROM compaction.jobs AS j
    WHERE j.conversation_id = p_conversation_id AND j.scope = p_scope
      AND j.from_pair = p_from_pair AND j.source_hash = p_source_hash
      AND j.model = p_model AND j.prompt_version = p_prompt_version;
    v_job_id := v_job.job_id;

    IF v_job_id IS NULL THEN
        v_attempt := 1;
    ELSE
        -- Reap this identity: an expired attempt is a failed attempt.
        FOR v_expired IN
            UPDATE compaction.attempts AS a
            SET state = 'failed', reason = 'lease_expired', finished_at = p_now
            WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
              AND a.state = 'running' AND a.lease_expires_at <= p_now
            RETURNING a.*
        LOOP
            PERFORM compaction.release_slot(p_conversation_id, v_expired);
        END LOOP;

        IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
                   WHERE s.conversation_id = p_conversation_id AND s.job_id = v_job_id) THEN
            claimed := false;
            reason := 'already_completed';
            job_id := v_job_id;
            RETURN;
        END IF;
        -- The job id is no secret (revision 0018): the running attempt belongs to the
        -- login that claimed it, and only that login can finish or renew it.
        IF EXISTS (SELECT 1 FROM compaction.attempts AS a
                   WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id
                     AND a.state = 'running') THEN
            claimed := false;
            reason := 'already_running';
            job_id := v_job_id;
            RETURN;
        END IF;
        SELECT count(*) INTO v_failed
        FROM compaction.attempts AS a
        WHERE a.conversation_id = p_conversation_id AND a.job_id = v_job_id;
        IF v_failed >= 2 THEN
            claimed := false;
            reason := 'attempts_exhausted';
            job_id := v_job_id;
            RETURN;
        END IF;
        v_attempt := v_failed + 1;
    END IF;

    -- Admission last, so refusals never touch it: a free slot (no holder, or a holder
    -- whose lease ran out), locked to commit. SKIP LOCKED lets concurrent claims take
    -- different slots instead of queueing on one lock; a slot being taken by an
    -- uncommitted claim is as good as taken. Under REPEATABLE READ or SERIALIZABLE a
    -- slot another claim took after this snapshot raises a serialization failure.
    SELECT s.max_running, s.admission_high_water INTO v_max_running, v_high_water
    FROM compaction.settings AS s;
    -- Slots above max_running are held only by attempts admitted before it was lowered,
    -- and none above admission_high_water, so the usual case (the two equal) costs
    -- nothing. While any live holder is there, the free slots below do not tell the
    -- count: claims serialise on the live holders above (the no-op update also makes a
    -- claim whose snapshot missed another's fail at REPEATABLE READ) and count every
    -- live holder.
    IF v_high_water > v_max_running THEN
        UPDATE compaction.admission AS ad
        SET lease_expires_at = ad.lease_expires_at
        WHERE ad.slot > v_max_running AND ad.slot <= v_high_water
          AND ad.lease_expires_at > p_now;
        v_overflow := FOUND;
        IF NOT v_overflow THEN
            PERFORM compaction.lower_high_water(v_max_running, v_high_water, p_now);
        END IF;
    END IF;
    -- Counted only while the overflow lasts. As one condition with NOT v_overflow, the
    -- count was a parameterised subquery that PL/pgSQL planned again at every claim (its
    -- custom plan, with v_overflow false, pruned the count, so a generic plan never won).
    IF v_overflow THEN
        SELECT count(*) < v_max_running INTO v_room
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_high_water AND ad.lease_expires_at > p_now;
    END IF;
    IF v_room THEN
        SELECT ad.slot INTO v_slot
        FROM compaction.admission AS ad
        WHERE ad.slot <= v_max_running
          AND (ad.lease_expires_at IS NULL OR ad.lease_expires_at <= p_now)
        ORDER BY ad.slot
        LIMIT 1
        FOR UPDATE SKIP LOCKED;
    END IF;
    IF v_slot IS NULL THEN
        claimed := false;
        reason := 'admission_full';
        job_id := v_job_id;
        RETURN;
    END IF;

    -- The unique indexes are the final word. At READ COMMITTED the conversation lock has
    -- already ordered competing claims, so no conflict arises; at REPEATABLE READ a
    -- conflict with a winner this snapshot cannot see is a serialization failure (ON
    -- CONFLICT's rule), never a second running attempt. No subtransaction needed.
    IF v_job_id IS NULL THEN
        INSERT INTO compaction.jobs
            (conversation_id, scope, from_pair, to_pair, source_message_ids, source_hash,
             model, prompt_version, created_at)
        VALUES (p_conversation_id, p_scope, p_from_pair, p_from_pair + 9,
                p_source_message_ids, p_source_hash, p_model, p_prompt_version, p_now)
        ON CONFLICT DO NOTHING
        RETURNING * INTO v_job;
        v_job_id := v_job.job_id;
    END IF;
    IF v_job_id IS NOT NULL THEN
        -- The attempt belongs to this login from now on (the fence compares).
        INSERT INTO compaction.attempts
            (conversation_id, job_id, attempt, state, worker, started_at, lease_expires_at,
             claimed_by, slot)
        VALUES (p_conversation_id, v_job_id, v_attempt, 'running', p_worker, p_now, p_lease_expires_at,
                session_user, v_slot)
        ON CONFLICT DO NOTHING
        RETURNING * INTO v_attempt_row;
    END IF;
    IF v_job_id IS NULL OR NOT FOUND THEN
        claimed := false;
        reason := 'already_running';
        job_id := v_job_id;
        RETURN;
    END IF;
    UPDATE compaction.admission AS ad
    SET holder_conversation_id = p_conversation_id, holder_job_id = v_job_id,
        holder_attempt = v_attempt, lease_expires_at = p_lease_expires_at
    WHERE ad.slot = v_slot;
    claimed := true;
    reason := 'claimed';
    job_id := v_job_id;
    attempt := v_attempt;
    lease_expires_at := p_lease_expires_at;
END
$$;
COMMENT ON FUNCTION compaction.claim_range(text, text, int, text[], text, text, text, text, timestamptz, timestamptz, boolean, text[], text) IS
    'Internal: the checks of a claim from not_eligible on, and its writes, for a range already judged, under the conversation''s lock its caller (claim, claim_targets) holds';

CREATE FUNCTION compaction.claim(
    p_conversation_id    text,
    p_scope              text,
    p_from_pair          int,
    p_source_message_ids text[],
    p_source_hash        text,
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- Every lookup in this call is by key. A worker's connection lives for hours, and a plan
-- cached while the engine's tables were still small (a new deployment, a first backlog)
-- would scan them instead, at a cost that grows with every job until autovacuum's ANALYZE
-- has them planned again (revision 0017 measured a claim -> complete cycle at less than
-- half its speed after 1,600 cycles on one connection). With sequential scans disabled
-- the first plans are the index plans, and they hold whatever the tables' size; jit off,
-- since the disabled scans' cost would cross jit_above_cost and compile on every call.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- Revision 0045: caller_now and lease_end are called only when they have
    -- something to check (a given p_now, a lease out of range); each call carries a SET
    -- clause, whose save and restore of the settings cost more than the rule.
    v_now         timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                      ELSE compaction.caller_now(p_now) END;
    v_lease       timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                      THEN v_now + p_lease
                                      ELSE compaction.lease_end(p_lease, v_now) END;
    v_accepts     boolean;
    v_pairs       bigint;
    v_target_ids  text[];
    v_target_hash text;
    v_is_target   boolean;
    v_answer      record;
    v_settled     record;
    v_oversized   text;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;

    -- Checks in the contract's order; the first failing one is the answer.
    IF p_from_pair IS NULL OR p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN
        RETURN QUERY SELECT false, 'invalid_range'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    IF NOT compaction.valid_source_ids(p_source_message_ids) THEN
        RETURN QUERY SELECT false, 'invalid_source_ids'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    IF v_accepts IS NOT TRUE THEN
        RETURN QUERY SELECT false, 'prompt_version_closed'::text, NULL::bigint, NULL::int, NULL::timestamptz;
        RETURN;
    END IF;

    -- The range as it is now, from the derived state (no message text read): the pair
    -- count decides whether it is a target, the stored ids and hash whether it matches.
    -- Read before the conversation's lock (revision 0038): the lock orders the engine's
    -- writers of the conversation, and none of them changes its history, so the answer
    -- is the same either side of it; judged from the views (Citus, an untracked source)
    -- it is most of a claim's time, which the conversation's other writers no longer wait
    -- for. With the derived state in use, current_range's read is made here (revision
    -- 0045, as range_replies does): the call of a set-returning definer function cost
    -- more than its one statement.
    IF compaction.derived_state_serves(p_conversation_id) THEN
        SELECT coalesce((SELECT cs.pair_count::bigint FROM compaction.conversation_state AS cs
                         WHERE cs.conversation_id = p_conversation_id), 0),
               r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM (SELECT 1) AS one
        LEFT JOIN compaction.ranges AS r
          ON r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair;
    ELSE
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
    END IF;
    v_is_target := compaction.is_target(p_from_pair, v_pairs);

    -- Revision 0049 (issue 62): a claim the judgement or the committed state already
    -- refuses takes no lock (claim_range answers not_eligible and source_mismatch before
    -- any write; claim_settled the refusals of an identity's state), so no refused call
    -- holds the conversation, whatever its caller's transaction does next.
    IF v_is_target IS NOT TRUE OR NOT compaction.valid_source_hash(p_source_hash)
       OR v_target_hash IS DISTINCT FROM p_source_hash
       OR v_target_ids IS DISTINCT FROM p_source_message_ids THEN
        v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                           p_source_message_ids, p_source_hash, p_model,
                                           p_prompt_version, p_worker, v_now, v_lease,
                                           v_is_target, v_target_ids, v_target_hash);
        RETURN QUERY SELECT false, v_answer.reason, NULL::bigint, NULL::int,
                            NULL::timestamptz;
        RETURN;
    END IF;
    v_settled := compaction.claim_settled(p_conversation_id, p_scope, p_from_pair,
                                          p_source_hash, p_model, p_prompt_version, v_now);
    IF v_settled.reason IS NOT NULL THEN
        RETURN QUERY SELECT false, v_settled.reason, v_settled.job_id, NULL::int,
                            NULL::timestamptz;
        RETURN;
    END IF;

    -- From here on the conversation's engine rows are ours until commit: the statement of
    -- lock_conversation, written out here and in fence (revision 0018), where a call per
    -- cycle would cost as much as the row lock itself.
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (p_conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
    -- where the caller set no bound, the transaction gets one (transaction_timeout where
    -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
    -- server), so a caller that forgets its transaction open cannot hold a conversation
    -- for long (docs/security.md).
    IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
        PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
    END IF;
    IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
        PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
    END IF;
    -- The one writer under the lock that follows a change of history is an erasure (its
    -- history deleted before it or with it): a conversation with an erasure's tombstone
    -- is judged again, under the lock, so that no claim lands after an erasure on
    -- history it judged before.
    IF EXISTS (SELECT 1 FROM compaction.event_log AS e
               WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
        SELECT r.pair_count, r.source_message_ids, r.source_hash
        INTO v_pairs, v_target_ids, v_target_hash
        FROM compaction.current_range(p_conversation_id, p_from_pair) AS r;
        v_is_target := compaction.is_target(p_from_pair, v_pairs);
    END IF;
    -- An assignment, not a query: a claim -> complete cycle costs 1.0% more
    -- instructions than with the checks written out in claim (a query over the call,
    -- 1.6%).
    v_answer := compaction.claim_range(p_conversation_id, p_scope, p_from_pair,
                                       p_source_message_ids, p_source_hash, p_model,
                                       p_prompt_version, p_worker, v_now, v_lease,
                                       v_is_target, v_target_ids, v_target_hash);
    claimed := v_answer.claimed;
    reason := v_answer.reason;
    job_id := v_answer.job_id;
    attempt := v_answer.attempt;
    lease_expires_at := v_answer.lease_expires_at;
    RETURN NEXT;
END
$$;
COMMENT ON FUNCTION compaction.claim(text, text, int, text[], text, text, text, text, interval, timestamptz) IS
    'Claims one attempt of an identity for a worker with a lease, bound to the calling login, or returns the first refusal reason (see contract §6)';


-- Revision 0038: claims of several ranges of one conversation in one call, for a worker
-- with that many model calls free. Each range is answered exactly as compaction.claim
-- would answer it, had the ranges been claimed one after another in the order given, at
-- one instant: the same checks in the contract's order, the same writes, one row per
-- range. The conversation is locked and judged once for the whole batch, where a claim
-- per range judges it each time (from the views, on Citus or an untracked source, that
-- judgement is most of a claim's cost). The first admission_full ends the batch: the
-- ranges after it are not tried and get no row. p_source_message_ids holds one row of
-- ids per range (a two-dimensional array, ranges by ids).
CREATE FUNCTION compaction.claim_targets(
    p_conversation_id    text,
    p_scope              text,
    p_from_pairs         int[],
    p_source_message_ids text[],
    p_source_hashes      text[],
    p_model              text,
    p_prompt_version     text,
    p_worker             text,
    p_lease              interval DEFAULT '5 minutes',
    p_now                timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- As claim's: every lookup by key, whatever the tables' statistics when first planned.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_lease      timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                     THEN v_now + p_lease
                                     ELSE compaction.lease_end(p_lease, v_now) END;
    v_n          int := coalesce(pg_catalog.cardinality(p_from_pairs), 0);
    v_oversized  text;
    v_accepts    boolean;
    v_refusals   text[] := '{}';
    v_judge      int[] := '{}';
    v_from       int[];
    v_target_ids text[];
    v_settled    text[] := '{}';
    v_settled_job bigint[] := '{}';
    v_open       boolean := false;
    v_locked     boolean := false;
    v_pre        text;
    v_pre_job    bigint;
    v_hashes     text[];
    v_at         int;
    v_reason     text;
    v_answer     record;
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    IF v_n = 0 THEN
        RETURN;
    END IF;
    -- A batch is what a worker's free model calls can take: a few ranges, never a
    -- conversation's history held under its lock at once.
    IF v_n > 100 THEN
        RAISE EXCEPTION 'claim_targets takes at most 100 ranges a call, got %', v_n
            USING ERRCODE = 'CP020';
    END IF;
    IF pg_catalog.array_ndims(p_from_pairs) <> 1
       OR pg_catalog.array_ndims(p_source_message_ids) IS DISTINCT FROM 2
       OR pg_catalog.array_length(p_source_message_ids, 1) <> v_n
       OR pg_catalog.array_ndims(p_source_hashes) IS DISTINCT FROM 1
       OR pg_catalog.cardinality(p_source_hashes) <> v_n THEN
        RAISE EXCEPTION 'claim_targets needs, for each of its % ranges, one row of source ids and one hash', v_n
            USING ERRCODE = 'CP020',
                  HINT = 'p_source_message_ids is a two-dimensional array: one row of 20 ids per range.';
    END IF;

    -- The checks before the conversation's lock, per range, in the contract's order.
    SELECT pv.accepts_new_jobs INTO v_accepts
    FROM compaction.prompt_versions AS pv
    WHERE pv.prompt_version = p_prompt_version;
    FOR i IN 1 .. v_n LOOP
        v_reason := CASE
            WHEN p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] IS NULL
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] < 0
              OR p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1] % 10 <> 0
                THEN 'invalid_range'
            WHEN NOT compaction.valid_source_ids(ARRAY(
                     SELECT pg_catalog.unnest(p_source_message_ids[
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                         pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])))
                THEN 'invalid_source_ids'
            WHEN v_accepts IS NOT TRUE THEN 'prompt_version_closed'
        END;
        v_refusals := v_refusals || v_reason;
        IF v_reason IS NULL THEN
            v_judge := v_judge || p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        END IF;
    END LOOP;

    IF pg_catalog.cardinality(v_judge) > 0 THEN
        -- One judgement for the batch, before the conversation's lock as in claim: which
        -- of its ranges are targets now, with their current ids (one row of 20 per
        -- target) and hashes. Judged again under the lock where an erasure's tombstone
        -- is (as in claim).
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
        INTO v_from, v_target_ids, v_hashes
        FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        -- Revision 0049 (issue 62): the lock only when some range could be claimed, as
        -- far as the judgement and the committed state tell (claim_settled); otherwise
        -- every range is refused without it (a refused claim holds nothing).
        FOR i IN 1 .. v_n LOOP
            v_pre := NULL;
            v_pre_job := NULL;
            v_at := pg_catalog.array_position(
                v_from, p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1]);
            IF v_refusals[i] IS NULL AND v_at IS NOT NULL AND NOT v_open
               AND compaction.valid_source_hash(
                       p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1])
               AND v_hashes[v_at] IS NOT DISTINCT FROM
                       p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1]
               AND ARRAY(SELECT pg_catalog.unnest(v_target_ids[v_at:v_at][:]))
                   IS NOT DISTINCT FROM
                   ARRAY(SELECT pg_catalog.unnest(p_source_message_ids[
                             pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                             pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])) THEN
                SELECT c.reason, c.job_id INTO v_pre, v_pre_job
                FROM compaction.claim_settled(
                    p_conversation_id, p_scope,
                    p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1],
                    p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1],
                    p_model, p_prompt_version, v_now) AS c;
                v_open := v_pre IS NULL;
            END IF;
            v_settled := v_settled || v_pre;
            v_settled_job := v_settled_job || v_pre_job;
        END LOOP;
    END IF;
    IF v_open THEN
        v_locked := true;
        -- The conversation's engine rows are ours until commit (claim's statement).
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
        -- where the caller set no bound, the transaction gets one (transaction_timeout where
        -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
        -- server), so a caller that forgets its transaction open cannot hold a conversation
        -- for long (docs/security.md).
        IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
            PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
        END IF;
        IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
            PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
        END IF;
        IF EXISTS (SELECT 1 FROM compaction.event_log AS e
                   WHERE e.conversation_id = p_conversation_id AND e.kind = 'erasure') THEN
            SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
                   pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair)
            INTO v_from, v_target_ids, v_hashes
            FROM compaction.target_ranges(p_conversation_id, v_judge) AS t;
        END IF;
    END IF;

    FOR i IN 1 .. v_n LOOP
        IF v_refusals[i] IS NOT NULL THEN
            RETURN QUERY
            SELECT p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1], false,
                   v_refusals[i], NULL::bigint, NULL::int, NULL::timestamptz;
            CONTINUE;
        END IF;
        -- Without the lock: the refusals the committed state gave (claim_range answers
        -- the rest, not_eligible and source_mismatch, before any write).
        IF NOT v_locked AND v_settled[i] IS NOT NULL THEN
            RETURN QUERY
            SELECT p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1], false,
                   v_settled[i], v_settled_job[i], NULL::int, NULL::timestamptz;
            CONTINUE;
        END IF;
        from_pair := p_from_pairs[pg_catalog.array_lower(p_from_pairs, 1) + i - 1];
        v_at := pg_catalog.array_position(v_from, from_pair);
        v_answer := compaction.claim_range(
            p_conversation_id, p_scope, from_pair,
            ARRAY(SELECT pg_catalog.unnest(p_source_message_ids[
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1 :
                      pg_catalog.array_lower(p_source_message_ids, 1) + i - 1][:])),
            p_source_hashes[pg_catalog.array_lower(p_source_hashes, 1) + i - 1],
            p_model, p_prompt_version, p_worker, v_now, v_lease,
            v_at IS NOT NULL,
            CASE WHEN v_at IS NOT NULL
                 THEN ARRAY(SELECT pg_catalog.unnest(v_target_ids[v_at:v_at][:])) END,
            v_hashes[v_at]);
        claimed := v_answer.claimed;
        reason := v_answer.reason;
        job_id := v_answer.job_id;
        attempt := v_answer.attempt;
        lease_expires_at := v_answer.lease_expires_at;
        RETURN NEXT;
        -- No slot was free: the rest of the batch would find none either.
        EXIT WHEN reason = 'admission_full';
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_targets(text, text, int[], text[], text[], text, text, text, interval, timestamptz) IS
    'Claims several ranges of one conversation under one lock and one judgement, each answered as compaction.claim would answer it in the order given (one row per range; the first admission_full ends the batch); for a worker with that many model calls free';

-- Revision 0040: a worker's look at a conversation and its first claims, in one call. The
-- conversation's targets, judged once, each with whether this identity already holds a
-- summary (what worker_targets answers), and up to p_limit claims among those that do
-- not, tried in target order, each answered as compaction.claim would answer it for the
-- ids and hash just judged: a range refused for itself gives its turn to the next, and
-- the first admission_full or prompt_version_closed ends the claims. A worker calls it
-- with its free model calls as p_limit: where it called worker_targets and then
-- claim_targets, the conversation is judged once instead of twice (on Citus and an
-- untracked source, from the views: most of a claim's cost). The targets not tried come
-- back with claimed NULL, with their ids and hash, for claim_targets once model calls
-- are free; with p_limit 0 this is worker_targets, and takes no lock.
CREATE FUNCTION compaction.claim_next_targets(
    p_conversation_id text,
    p_scope           text,
    p_limit           int,
    p_model           text,
    p_prompt_version  text,
    p_worker          text,
    p_lease           interval DEFAULT '5 minutes',
    p_now             timestamptz DEFAULT NULL)
RETURNS TABLE (from_pair int, to_pair int, source_message_ids text[], source_hash text,
               completed boolean, claimed boolean, reason text, job_id bigint,
               attempt int, lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
-- As claim's: every lookup by key, whatever the tables' statistics when first planned.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now       timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                    ELSE compaction.caller_now(p_now) END;
    v_lease     timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                    THEN v_now + p_lease
                                    ELSE compaction.lease_end(p_lease, v_now) END;
    v_oversized text;
    v_accepts   boolean;
    v_from      int[];
    v_ids       text[];
    v_hashes    text[];
    v_done      boolean[];
    v_claims    int := 0;
    v_ended     boolean := false;
    v_locked    boolean := false;
    v_answer    record;
    v_open      boolean;
    v_pre       text;
    v_pre_job   bigint;
    v_settled   text[];
    v_settled_job bigint[];
BEGIN
    IF p_conversation_id IS NULL OR p_scope IS NULL OR p_scope = '' OR p_model IS NULL
       OR p_model = '' OR p_worker IS NULL THEN
        RAISE EXCEPTION 'claim_next_targets needs a conversation, a non-empty scope, model and worker'
            USING ERRCODE = 'CP020';
    END IF;
    v_oversized := compaction.oversized_identifier(p_conversation_id, p_scope, p_model, p_worker);
    IF v_oversized IS NOT NULL THEN
        RAISE EXCEPTION '%', v_oversized USING ERRCODE = 'CP020';
    END IF;
    -- As claim_targets: a batch is what a worker's free model calls can take.
    IF p_limit IS NULL OR p_limit < 0 OR p_limit > 100 THEN
        RAISE EXCEPTION 'claim_next_targets claims 0 to 100 ranges a call, got %',
                coalesce(p_limit::text, 'NULL')
            USING ERRCODE = 'CP020';
    END IF;

    -- The look is worker_targets' answer, judged before the conversation's lock as in
    -- claim. With a claim to try, the conversation's engine rows are then ours until
    -- commit (claim's statement), and it is looked at again under the lock where an
    -- erasure's tombstone is (as in claim). Nothing to claim, no lock.
    LOOP
        SELECT pg_catalog.array_agg(t.from_pair ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_message_ids ORDER BY t.from_pair),
               pg_catalog.array_agg(t.source_hash ORDER BY t.from_pair),
               pg_catalog.array_agg(t.completed ORDER BY t.from_pair)
        INTO v_from, v_ids, v_hashes, v_done
        FROM compaction.worker_targets(p_conversation_id, p_scope, p_model,
                                       p_prompt_version) AS t;
        EXIT WHEN v_locked OR p_limit = 0 OR NOT coalesce(false = ANY (v_done), false);
        SELECT pv.accepts_new_jobs INTO v_accepts
        FROM compaction.prompt_versions AS pv
        WHERE pv.prompt_version = p_prompt_version;
        -- Revision 0049 (issue 62): the lock only when some target could be claimed, as
        -- far as the committed state tells (claim_settled); otherwise every target tried
        -- is refused without it (a refused claim holds nothing).
        v_open := false;
        v_settled := '{}';
        v_settled_job := '{}';
        FOR k IN 1 .. coalesce(pg_catalog.cardinality(v_from), 0) LOOP
            v_pre := NULL;
            v_pre_job := NULL;
            IF NOT v_done[k] AND NOT v_open AND v_accepts IS TRUE
               AND compaction.valid_source_hash(v_hashes[k])
               AND compaction.valid_source_ids(ARRAY(SELECT pg_catalog.unnest(v_ids[k:k][:]))) THEN
                SELECT c.reason, c.job_id INTO v_pre, v_pre_job
                FROM compaction.claim_settled(p_conversation_id, p_scope, v_from[k],
                                              v_hashes[k], p_model, p_prompt_version,
                                              v_now) AS c;
                v_open := v_pre IS NULL;
            END IF;
            v_settled := v_settled || v_pre;
            v_settled_job := v_settled_job || v_pre_job;
        END LOOP;
        EXIT WHEN NOT v_open;
        INSERT INTO compaction.conversation_locks AS l (conversation_id)
        VALUES (p_conversation_id)
        ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
            WHERE false;
        -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
        -- where the caller set no bound, the transaction gets one (transaction_timeout where
        -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
        -- server), so a caller that forgets its transaction open cannot hold a conversation
        -- for long (docs/security.md).
        IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
            PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
        END IF;
        IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
            PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
        END IF;
        v_locked := true;
        EXIT WHEN NOT EXISTS (SELECT 1 FROM compaction.event_log AS e
                              WHERE e.conversation_id = p_conversation_id
                                AND e.kind = 'erasure');
    END LOOP;

    FOR k IN 1 .. coalesce(pg_catalog.cardinality(v_from), 0) LOOP
        from_pair := v_from[k];
        to_pair := v_from[k] + 9;
        source_message_ids := ARRAY(SELECT pg_catalog.unnest(v_ids[k:k][:]));
        source_hash := v_hashes[k];
        completed := v_done[k];
        claimed := NULL;
        reason := NULL;
        job_id := NULL;
        attempt := NULL;
        lease_expires_at := NULL;
        IF NOT completed AND v_claims < p_limit AND NOT v_ended THEN
            -- claim's checks in the contract's order. The range is a target with exactly
            -- these ids and this hash: never not_eligible, and source_mismatch only where
            -- its texts could not be hashed (no valid hash).
            IF NOT compaction.valid_source_ids(source_message_ids) THEN
                claimed := false;
                reason := 'invalid_source_ids';
            ELSIF v_accepts IS NOT TRUE THEN
                claimed := false;
                reason := 'prompt_version_closed';
            ELSIF NOT v_locked AND v_settled[k] IS NOT NULL THEN
                -- The refusal the committed state gave, without the lock (revision 0049).
                claimed := false;
                reason := v_settled[k];
                job_id := v_settled_job[k];
            ELSE
                v_answer := compaction.claim_range(
                    p_conversation_id, p_scope, from_pair, source_message_ids, source_hash,
                    p_model, p_prompt_version, p_worker, v_now, v_lease,
                    true, source_message_ids, source_hash);
                claimed := v_answer.claimed;
                reason := v_answer.reason;
                job_id := v_answer.job_id;
                attempt := v_answer.attempt;
                lease_expires_at := v_answer.lease_expires_at;
            END IF;
            v_claims := v_claims + claimed::int;
            -- A range refused for itself (another worker's attempt running, attempts
            -- exhausted) gives its turn to the next target; no slot free, or a closed
            -- prompt version, would refuse every target after it too.
            v_ended := reason IN ('admission_full', 'prompt_version_closed');
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
COMMENT ON FUNCTION compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz) IS
    'The conversation''s targets, each with whether this identity holds a summary (as worker_targets), and up to p_limit claims among those without one, tried in order, each answered as compaction.claim would answer it (claimed NULL: not tried; the first admission_full or prompt_version_closed ends the claims): a worker''s look and first claims under one judgement';

-- The fencing step shared by complete, fail and heartbeat: locks the conversation and the
-- attempt row, and answers whether (job_id, attempt) is still running with a live lease.
-- An expired, unreaped attempt is marked failed (lease_expired) on the way. A given
-- p_conversation_id must name the job's conversation (else the job is not found: the
-- caller answers lease_lost); it lets a distributed database route the call. The job's
-- row comes back with the attempt's (revision 0017), so the caller records the attempt's
-- change without reading either again. An attempt belongs to the login that claimed it
-- (revision 0018, contract §6): to any other login, the owner and superusers aside, the
-- attempt is unknown (the caller answers lease_lost) and nothing changes, not even an
-- expiry. Revision 0049: that is asked before the conversation's lock, so a refused call
-- takes no lock at all; the usual call costs one more read of the attempt by key.
-- Revision 0045: no SECURITY DEFINER and no SET clause, as claim_range: only the owner
-- may execute it, and it runs inside its three callers, definers with this search_path,
-- where saving and restoring the settings around each call cost more than the comparison.
CREATE FUNCTION compaction.fence(p_job_id bigint, p_attempt int, p_now timestamptz,
                                 p_conversation_id text,
                                 OUT attempt_row compaction.attempts,
                                 OUT job_row compaction.jobs)
RETURNS record
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    v_claimed_by text;
BEGIN
    IF p_conversation_id IS NULL THEN
        SELECT j.* INTO job_row
        FROM compaction.jobs AS j
        WHERE j.job_id = p_job_id;
    ELSE
        SELECT j.* INTO job_row
        FROM compaction.jobs AS j
        WHERE j.conversation_id = p_conversation_id AND j.job_id = p_job_id;
    END IF;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- Who claimed the attempt, read before any lock (revision 0049, issue 62): it never
    -- changes (attempts_guard), so a call refused for another login, or for an attempt
    -- that does not exist, answers without taking the conversation's lock, and a caller
    -- that keeps its transaction open after a refusal holds nothing of another's.
    SELECT a.claimed_by INTO v_claimed_by
    FROM compaction.attempts AS a
    WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_claimed_by IS DISTINCT FROM session_user
       AND NOT compaction.caller_is_privileged() THEN
        job_row := NULL;
        RETURN;
    END IF;
    -- lock_conversation's statement (written out, as in claim).
    INSERT INTO compaction.conversation_locks AS l (conversation_id)
    VALUES (job_row.conversation_id)
    ON CONFLICT (conversation_id) DO UPDATE SET conversation_id = l.conversation_id
        WHERE false;
    -- Revision 0049 (issue 62): the caller's transaction holds this lock until it ends;
    -- where the caller set no bound, the transaction gets one (transaction_timeout where
    -- the server has it, PostgreSQL 17 on; idle_in_transaction_session_timeout on every
    -- server), so a caller that forgets its transaction open cannot hold a conversation
    -- for long (docs/security.md).
    IF pg_catalog.current_setting('transaction_timeout', true) = '0' THEN
        PERFORM pg_catalog.set_config('transaction_timeout', '60s', true);
    END IF;
    IF pg_catalog.current_setting('idle_in_transaction_session_timeout') = '0' THEN
        PERFORM pg_catalog.set_config('idle_in_transaction_session_timeout', '60s', true);
    END IF;
    SELECT a.* INTO attempt_row
    FROM compaction.attempts AS a
    WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- Only a superuser's or the owner's p_now can be this early (caller_now).
    IF attempt_row.state = 'running' AND p_now < attempt_row.started_at THEN
        RAISE EXCEPTION 'p_now % is before attempt % of job % started (%)',
                p_now, p_attempt, p_job_id, attempt_row.started_at
            USING ERRCODE = 'CP022';
    END IF;
    IF attempt_row.state = 'running' AND attempt_row.lease_expires_at <= p_now THEN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = 'lease_expired', finished_at = p_now
        WHERE a.conversation_id = job_row.conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt
        RETURNING a.* INTO attempt_row;
        PERFORM compaction.release_slot(job_row.conversation_id, attempt_row);
    END IF;
END
$$;
COMMENT ON FUNCTION compaction.fence(bigint, int, timestamptz, text) IS
    'Internal: locks attempt (job_id, attempt) of the given conversation (or the job''s) and returns it with its job, first failing it (lease_expired) if its lease ran out; attempt_row NULL if unknown or claimed by another login (owner and superusers aside)';

-- complete()'s p_stats (contract §6): NULL, or an object whose keys are among
-- input_tokens, output_tokens, figures_total, figures_kept, figures_invented (revision
-- 0048), each a non-negative integer
-- (JSON number without fraction or exponent, below 2^31), figures_kept only with
-- figures_total and never above it. Anything else is CP020. The counts come back in the
-- matching columns of an attempts row (the other columns NULL).
CREATE FUNCTION compaction.attempt_stats(p_stats jsonb)
RETURNS compaction.attempts
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_stats compaction.attempts;
    v_key   text;
    v_value jsonb;
BEGIN
    IF p_stats IS NULL THEN
        RETURN v_stats;
    END IF;
    IF pg_catalog.jsonb_typeof(p_stats) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'p_stats must be a JSON object or NULL, got a JSON %',
                pg_catalog.jsonb_typeof(p_stats)
            USING ERRCODE = 'CP020';
    END IF;
    FOR v_key, v_value IN SELECT e.key, e.value FROM pg_catalog.jsonb_each(p_stats) AS e LOOP
        IF v_key NOT IN ('input_tokens', 'output_tokens', 'figures_total', 'figures_kept',
                         'figures_invented') THEN
            RAISE EXCEPTION 'p_stats: unknown key % (known: input_tokens, output_tokens, figures_total, figures_kept, figures_invented)',
                    pg_catalog.quote_literal(pg_catalog.left(v_key, 64))
                USING ERRCODE = 'CP020';
        END IF;
        IF pg_catalog.jsonb_typeof(v_value) IS DISTINCT FROM 'number'
           OR v_value::text !~ '^(0|[1-9][0-9]{0,9})$' THEN
            RAISE EXCEPTION 'p_stats: % must be a non-negative integer', v_key
                USING ERRCODE = 'CP020';
        END IF;
        IF v_value::text::bigint > 2147483647 THEN
            RAISE EXCEPTION 'p_stats: % must be below 2^31', v_key USING ERRCODE = 'CP020';
        END IF;
    END LOOP;
    v_stats.input_tokens := (p_stats ->> 'input_tokens')::int;
    v_stats.output_tokens := (p_stats ->> 'output_tokens')::int;
    v_stats.figures_total := (p_stats ->> 'figures_total')::int;
    v_stats.figures_kept := (p_stats ->> 'figures_kept')::int;
    v_stats.figures_invented := (p_stats ->> 'figures_invented')::int;
    IF v_stats.figures_kept IS NOT NULL
       AND (v_stats.figures_total IS NULL OR v_stats.figures_kept > v_stats.figures_total) THEN
        RAISE EXCEPTION 'p_stats: figures_kept needs figures_total and must not exceed it'
            USING ERRCODE = 'CP020';
    END IF;
    RETURN v_stats;
END
$$;
COMMENT ON FUNCTION compaction.attempt_stats(jsonb) IS
    'Internal: validates complete()''s p_stats (CP020 unless NULL or an object of non-negative integer counts) and returns them as attempt columns';

CREATE FUNCTION compaction.complete(
    p_job_id          bigint,
    p_attempt         int,
    p_summary         text,
    p_finish_reason   text,
    p_tool_call_count int,
    p_response_id     text DEFAULT NULL,
    p_now             timestamptz DEFAULT NULL,
    p_stats           jsonb DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text, summary_id bigint)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- caller_now only for a given p_now (revision 0045, as in claim).
    v_now        timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                     ELSE compaction.caller_now(p_now) END;
    v_fenced     record;
    v_attempt    compaction.attempts;
    v_job        compaction.jobs;
    v_summary_id bigint;
    v_problem    text;
    v_stats      compaction.attempts;
BEGIN
    -- The fields the worker chooses reach the auditor (audit_jobs), who never sees
    -- content (revision 0049, issue 62): a finish reason is a code (at most 64 bytes:
    -- stop, length, incomplete:max_output_tokens, ...), a response id an id (at most 200
    -- bytes of letters, digits and _ . : -), a tool-call count never negative; anything
    -- else is an error that changes nothing, before the fence. Tested with ltrim rather
    -- than a regular expression, as valid_source_hash is (revision 0032): the usual
    -- 'stop' costs one comparison.
    IF p_finish_reason IS DISTINCT FROM 'stop' AND p_finish_reason IS NOT NULL
       AND NOT (pg_catalog.octet_length(p_finish_reason) <= 64
                AND pg_catalog.ltrim(pg_catalog.left(p_finish_reason, 1),
                                     'abcdefghijklmnopqrstuvwxyz') = ''
                AND pg_catalog.ltrim(p_finish_reason,
                                     'abcdefghijklmnopqrstuvwxyz0123456789_.:-') = '') THEN
        RAISE EXCEPTION 'p_finish_reason must be a code: ^[a-z][a-z0-9_.:-]{0,63}$ (e.g. stop, length), not free text'
            USING ERRCODE = 'CP020';
    END IF;
    IF p_response_id IS NOT NULL
       AND NOT (pg_catalog.octet_length(p_response_id) BETWEEN 1 AND 200
                AND pg_catalog.ltrim(p_response_id,
                        'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-')
                    = '') THEN
        RAISE EXCEPTION 'p_response_id must be an id: 1 to 200 letters, digits or _ . : - (got % bytes of something else)',
                pg_catalog.octet_length(p_response_id)
            USING ERRCODE = 'CP020';
    END IF;
    IF p_tool_call_count < 0 THEN
        RAISE EXCEPTION 'p_tool_call_count must not be negative' USING ERRCODE = 'CP020';
    END IF;
    -- p_stats first: a bad one is an error that changes nothing (not even an expiry).
    -- Without p_stats, v_stats is what attempt_stats answers for NULL: every column NULL.
    IF p_stats IS NOT NULL THEN
        v_stats := compaction.attempt_stats(p_stats);
    END IF;
    v_fenced := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    v_attempt := v_fenced.attempt_row;
    v_job := v_fenced.job_row;
    IF v_attempt.state = 'completed' THEN
        -- Idempotent for the same token and the same text (a lost reply re-sent); any
        -- other text for a completed attempt is a stale writer: lease_lost.
        SELECT s.summary_id INTO v_summary_id
        FROM compaction.job_summaries AS s
        WHERE s.conversation_id = v_attempt.conversation_id AND s.job_id = p_job_id
          AND s.attempt = p_attempt AND s.summary = p_summary;
        IF FOUND THEN
            RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
        ELSE
            RETURN QUERY SELECT false, 'lease_lost'::text, NULL::bigint;
        END IF;
        RETURN;
    END IF;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, 'lease_lost'::text, NULL::bigint;
        RETURN;
    END IF;

    IF EXISTS (SELECT 1 FROM compaction.job_summaries AS s
               WHERE s.conversation_id = v_attempt.conversation_id AND s.job_id = p_job_id) THEN
        v_problem := 'already_completed';
    ELSE
        v_problem := compaction.reply_problem(p_summary, p_finish_reason, p_tool_call_count);
    END IF;

    IF v_problem IS NOT NULL THEN
        UPDATE compaction.attempts AS a
        SET state = 'failed', reason = v_problem, finished_at = v_now,
            finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
            response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
            input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
            figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept,
            figures_invented = v_stats.figures_invented
        WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
          AND a.attempt = p_attempt
        RETURNING a.* INTO v_attempt;
        PERFORM compaction.release_slot(v_attempt.conversation_id, v_attempt);
        RETURN QUERY SELECT false, v_problem, NULL::bigint;
        RETURN;
    END IF;

    INSERT INTO compaction.job_summaries (conversation_id, job_id, attempt, summary, completed_at)
    VALUES (v_attempt.conversation_id, p_job_id, p_attempt, p_summary, v_now)
    RETURNING summary_id INTO v_summary_id;
    -- The new summary's verdict (revision 0045): the common case, the first summary of
    -- its range in its scope, is written here from the job row fence returned, as
    -- rederive_summary_verdicts' first statement writes it from a read of the job (and
    -- under the same conversation_state row, taken first); that function judges the rest,
    -- where the range already has a verdict. Its call, a definer with two SET clauses, and
    -- its reads of the summary and the job were 2.9% of a claim -> complete cycle's
    -- instructions (docs/benchmarks.md). Not on Citus, where no derived state is kept.
    IF pg_catalog.current_setting('citus.version', true) IS NULL
       OR NOT compaction.engine_distributed() THEN
        INSERT INTO compaction.conversation_state AS cs (conversation_id, pair_count, generation)
        VALUES (v_attempt.conversation_id, 0, 1)
        ON CONFLICT (conversation_id) DO UPDATE SET generation = cs.generation + 1;
        INSERT INTO compaction.summary_verdicts AS v
            (conversation_id, summary_id, scope, from_pair, reason)
        SELECT v_attempt.conversation_id, v_summary_id, v_job.scope, v_job.from_pair,
               CASE WHEN NOT coalesce((SELECT pv.projectable
                                       FROM compaction.prompt_versions AS pv
                                       WHERE pv.prompt_version = v_job.prompt_version), false)
                        THEN 'version_not_projectable'
                    WHEN NOT coalesce((SELECT r.source_hash = v_job.source_hash
                                              AND r.source_message_ids = v_job.source_message_ids
                                       FROM compaction.ranges AS r
                                       WHERE r.conversation_id = v_attempt.conversation_id
                                         AND r.from_pair = v_job.from_pair), false)
                        THEN 'stale_source' END
        WHERE NOT EXISTS (SELECT 1 FROM compaction.summary_verdicts AS o
                          WHERE o.conversation_id = v_attempt.conversation_id
                            AND o.from_pair = v_job.from_pair AND o.scope = v_job.scope);
        IF NOT FOUND THEN
            PERFORM compaction.rederive_summary_verdicts(v_attempt.conversation_id, '{}',
                                                         v_summary_id);
        END IF;
    END IF;
    UPDATE compaction.attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = v_now,
        finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
        response_id = p_response_id, summary_chars = pg_catalog.char_length(p_summary),
        input_tokens = v_stats.input_tokens, output_tokens = v_stats.output_tokens,
        figures_total = v_stats.figures_total, figures_kept = v_stats.figures_kept,
        figures_invented = v_stats.figures_invented
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    RETURNING a.* INTO v_attempt;
    -- release_slot's statement, written out (revision 0045): the call of a definer with a
    -- SET clause cost more than the update (1.0% of a cycle's instructions).
    IF v_attempt.slot IS NOT NULL THEN
        UPDATE compaction.admission AS ad
        SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
            lease_expires_at = NULL
        WHERE ad.slot = v_attempt.slot AND ad.holder_conversation_id = v_attempt.conversation_id
          AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    END IF;
    RETURN QUERY SELECT true, 'completed'::text, v_summary_id;
END
$$;
COMMENT ON FUNCTION compaction.complete(bigint, int, text, text, int, text, timestamptz, jsonb, text) IS
    'Records the result of attempt (job_id, attempt) with its p_stats (token usage, figures kept and invented; finish reason a code, response id an id of at most 200 bytes, else CP020): a completed summary, or the attempt failed with not_stopped, tool_calls, empty, too_long, already_completed; lease_lost if fenced off or claimed by another login';

CREATE FUNCTION compaction.fail(
    p_job_id  bigint,
    p_attempt int,
    p_reason  text,
    p_now     timestamptz DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                  ELSE compaction.caller_now(p_now) END;
    v_fenced  record;
    v_attempt compaction.attempts;
BEGIN
    PERFORM compaction.checked_reason(p_reason);
    IF p_reason IN ('completed', 'lease_expired') THEN
        RAISE EXCEPTION 'fail needs a reason other than completed or lease_expired'
            USING ERRCODE = 'CP020';
    END IF;
    v_fenced := compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id);
    v_attempt := v_fenced.attempt_row;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, 'lease_lost'::text;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET state = 'failed', reason = p_reason, finished_at = v_now
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt
    RETURNING a.* INTO v_attempt;
    PERFORM compaction.release_slot(v_attempt.conversation_id, v_attempt);
    RETURN QUERY SELECT true, 'failed'::text;
END
$$;
COMMENT ON FUNCTION compaction.fail(bigint, int, text, timestamptz, text) IS
    'Records attempt (job_id, attempt) failed with the worker''s reason code (e.g. http_error, timeout; CP024 unless ^[a-z][a-z0-9_]{0,63}$); lease_lost if fenced off or claimed by another login';

CREATE FUNCTION compaction.heartbeat(
    p_job_id  bigint,
    p_attempt int,
    p_lease   interval DEFAULT '5 minutes',
    p_now     timestamptz DEFAULT NULL,
    p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, lease_expires_at timestamptz)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
-- Key lookups only: plans that outlive a young table keep using the indexes (as claim).
SET jit = off
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := CASE WHEN p_now IS NULL THEN pg_catalog.now()
                                  ELSE compaction.caller_now(p_now) END;
    v_lease   timestamptz := CASE WHEN compaction.lease_fits(p_lease, v_now)
                                  THEN v_now + p_lease
                                  ELSE compaction.lease_end(p_lease, v_now) END;
    v_attempt compaction.attempts;
BEGIN
    v_attempt := (compaction.fence(p_job_id, p_attempt, v_now, p_conversation_id)).attempt_row;
    IF v_attempt.state IS DISTINCT FROM 'running' THEN
        RETURN QUERY SELECT false, NULL::timestamptz;
        RETURN;
    END IF;
    UPDATE compaction.attempts AS a
    SET lease_expires_at = v_lease
    WHERE a.conversation_id = v_attempt.conversation_id AND a.job_id = p_job_id
      AND a.attempt = p_attempt;
    -- The slot carries a copy of the lease: a renewed attempt keeps counting.
    UPDATE compaction.admission AS ad
    SET lease_expires_at = v_lease
    WHERE ad.slot = v_attempt.slot AND ad.holder_conversation_id = v_attempt.conversation_id
      AND ad.holder_job_id = p_job_id AND ad.holder_attempt = p_attempt;
    RETURN QUERY SELECT true, v_lease;
END
$$;
COMMENT ON FUNCTION compaction.heartbeat(bigint, int, interval, timestamptz, text) IS
    'Renews the lease of running attempt (job_id, attempt) to now + p_lease (ending 1 second..1 day from now, else CP023); ok = false if fenced off or claimed by another login (lease_lost)';

-- ---------------------------------------------------------------------------------------
-- The public view of completed summaries
-- ---------------------------------------------------------------------------------------

CREATE VIEW compaction.summaries AS
    SELECT s.summary_id,
           j.conversation_id,
           j.scope,
           j.from_pair,
           j.to_pair,
           j.source_message_ids,
           j.source_hash,
           j.model,
           j.prompt_version,
           s.summary,
           s.completed_at,
           CASE WHEN s.attempt IS NOT NULL THEN s.job_id END AS job_id,
           s.attempt IS NULL AS imported
    FROM compaction.job_summaries AS s
    JOIN compaction.jobs AS j
      ON j.conversation_id = s.conversation_id AND j.job_id = s.job_id;
COMMENT ON VIEW compaction.summaries IS
    'Every completed summary with its identity and source binding; job_id is NULL for imported summaries';
