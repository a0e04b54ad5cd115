-- pycompactor stored logic, section 3: jobs, attempts, summaries, claims and completion.
-- This file holds the tables, the rules their CHECKs call and the view
-- compaction.summaries. Then, a file per concern: admission (30_admission.sql), what every
-- call on an attempt shares (30_caller.sql), claims (30_claims.sql, 30_claims_targets.sql),
-- complete, fail and heartbeat (30_completion.sql) and their fencing (30_fencing.sql). The
-- queue (31_queue.sql), reaping (32_reaping.sql) and imports (33_import.sql) follow.
--
-- Layout. An identity (conversation_id, scope, from_pair, to_pair, source_hash, model,
-- prompt_version) is one row of compaction.jobs, made by its first claim or by an import,
-- and never changed. Each claim of it appends one row to compaction.attempts (at most
-- two: attempts_at_most_two). A completed summary is one row of compaction.job_summaries
-- (one per identity: job_summaries_one_per_identity), written by complete() or
-- import_summary(). compaction.summaries is the public view over them.
--
-- Concurrency. Every writer of one conversation's rows first locks that conversation's
-- row of compaction.conversation_locks until commit (lock_conversation; not an advisory
-- lock, which any login could take), so a claim's checks and inserts see
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
-- that become index keys are bounded (oversized_identifier).
--
-- Ownership. An attempt belongs to the login that claimed it
-- (attempts.claimed_by, session_user inside claim): complete, fail and heartbeat from any
-- other login, the owner and superusers aside, answer lease_lost and change nothing
-- (fence).
--
-- Citus (contract §11): conversation_id leads every primary key, unique index
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
    -- Internal: no unexpired attempt holds a slot above it (see
    -- settings_high_water below). Kept by the engine, never set by hand.
    admission_high_water int NOT NULL DEFAULT 0,
    -- The owner's model preference among a range's valid summaries
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
    'Internal: no unexpired attempt holds an admission slot above this; at least max_running, raised with it, lowered only by a claim that found the slots above max_running free';

-- Where claims look for attempts admitted before max_running was lowered.
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
-- holds every job to these versions (no foreign key, which would lock their rows).
INSERT INTO compaction.prompt_versions (prompt_version, input_kind, projectable, accepts_new_jobs)
VALUES ('conversation-compaction@1', 'mixed', false, false),
       ('conversation-compaction@2', 'assistant_only', true, false),
       ('conversation-compaction@3', 'assistant_only', true, true);

-- Shape rules shared by claim (refusal reasons), import_summary (errors) and the tables'
-- CHECK constraints (last line of defence against direct writes by the owner).
--
-- The small rules below run on every claim and completion, in both the functions and the
-- CHECK constraints. They carry no SET clause, so that the planner inlines
-- the SQL ones into their callers' expressions (as has_content and is_target, sql/
-- 20_pairs.sql), instead of planning each body again in every transaction; every name,
-- operators included, is schema-qualified, so no search_path can change what they mean.
-- valid_source_ids needs a subquery, which rules inlining out: PL/pgSQL keeps its plan
-- for the session instead.
--
-- The rules a CHECK constraint calls are PL/pgSQL (attempt_rules_hold
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

-- Every rule of a jobs row (the CHECK jobs_rules), as attempt_rules_hold
-- is the attempts': one CHECK whose stored form a claim's insert reads and plans, where
-- five did (about 1% of a claim -> complete cycle's instructions, docs/benchmarks.md). A
-- broken rule is the check_violation of its own name, as when each was a CHECK of its own,
-- and the first of them in the order PostgreSQL checked those (by name):
-- jobs_model_not_empty, jobs_range_valid (from_pair a multiple of 10 from 0, to_pair
-- from_pair + 9), jobs_scope_not_empty, jobs_source_hash_valid, jobs_source_ids_valid.
-- Last, as the foreign key it replaces was checked after the CHECKs, a
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
-- NOT VALID: every row written before it was checked by the five CHECKs
-- this one replaces (and by the foreign key on prompt_version its last rule
-- replaces), and jobs are immutable, so a scan under the migration's lock would
-- find nothing; every new row is checked.
ALTER TABLE compaction.jobs
    ADD CONSTRAINT jobs_rules CHECK (compaction.job_rules_hold(
        from_pair, to_pair, source_message_ids, source_hash, scope, model,
        prompt_version)) NOT VALID;
-- complete/fail/heartbeat are addressed by job_id alone (the fencing token is
-- (job_id, attempt)); this finds the job's conversation, then everything is keyed by it.
CREATE INDEX jobs_job_id_idx ON compaction.jobs (job_id);

-- The event log (contract §10) is the view compaction.audit_events (sql/50_audit.sql). An
-- attempt's own row records its two events, the claim and the end
-- (claim_* and finish_* columns below: the event id, the clock when it was written, the
-- writing transaction), so a claim -> complete cycle writes no event row; this table
-- (its constraints, index, sequence and guards keep its first name, audit_events) holds
-- the rest: imports, erasures and the events of the attempts an erasure removes.
CREATE SEQUENCE compaction.audit_events_event_id_seq AS bigint;
CREATE TABLE compaction.event_log (
    conversation_id  text NOT NULL,
    event_id         bigint NOT NULL DEFAULT pg_catalog.nextval('compaction.audit_events_event_id_seq'),
    kind             text NOT NULL,
    occurred_at      timestamptz NOT NULL,
    -- The log's order: the clock when the event was written, which the
    -- engine does only while it holds the conversation, so one conversation's events
    -- follow each other exactly; event_id breaks ties and is unique, not an order.
    recorded_at      timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    -- Identifies the writing transaction (kept for the record).
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
    'Internal: the events no attempt row records (import, erasure; the events of erased attempts; every event a development version wrote before attempts recorded their own), append-only; read them through compaction.audit_events';
ALTER SEQUENCE compaction.audit_events_event_id_seq OWNED BY compaction.event_log.event_id;
-- NOT VALID for the same reason as the attempts' checks: the log is
-- append-only, earlier entries keep what they recorded.
ALTER TABLE compaction.event_log
    ADD CONSTRAINT audit_events_reason_is_code CHECK (reason ~ '^[a-z][a-z0-9_]{0,63}$') NOT VALID,
    ADD CONSTRAINT audit_events_times_finite CHECK (pg_catalog.isfinite(occurred_at)) NOT VALID;
-- The DBA reads the log newest first across conversations.
CREATE INDEX audit_events_recorded_at_idx ON compaction.event_log (recorded_at, event_id);

-- Every rule of an attempt row (the CHECK attempts_rules). A broken rule
-- is reported as the check_violation of its own name, as when each was a CHECK of its
-- own: attempts_at_most_two (bounded retries: the first attempt and one retry, never a
-- third), attempts_state_valid, attempts_finished_iff_terminal,
-- attempts_reason_matches_state, attempts_stats_valid (complete()'s p_stats, contract §6:
-- non-negative counts, NULL when not reported),
-- attempts_times_valid (stored times are
-- the server's, finite and ordered) and attempts_reason_is_code (the
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
    -- The login that claimed the attempt (session_user inside claim): the
    -- fenced calls refuse any other login (contract §6), so knowing (job_id, attempt) is not
    -- enough to finish or renew it. NULL only on attempts no claim wrote: those only the
    -- owner or a superuser can finish (their leases run out; the range is claimed again).
    claimed_by       text,
    -- The admission slot the attempt took, freed by that key when it ends
    -- (unless a later claim took the slot over after this lease ran out). NULL once it
    -- has ended without a slot to free.
    slot             int,
    -- The attempt's events (NULL on an attempt whose claim event is in
    -- compaction.event_log): the claim's, written with the row, and the
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
    -- them to complete (contract §8); NULL when not reported.
    figures_invented   int,
    CONSTRAINT attempts_pkey PRIMARY KEY (conversation_id, job_id, attempt),
    CONSTRAINT attempts_job_fkey FOREIGN KEY (conversation_id, job_id)
        REFERENCES compaction.jobs (conversation_id, job_id)
);
COMMENT ON TABLE compaction.attempts IS
    'Append-only attempt log: one row per claim of an identity (at most 2); only running -> completed | failed (and lease renewal) ever changes';
COMMENT ON COLUMN compaction.attempts.figures_invented IS
    'Figures of the summary that none of the ten replies holds, as reported to complete in p_stats (contract §8); NULL when not reported';
-- The rules of an attempt row, one CHECK. PostgreSQL rebuilds a table's
-- CHECK expressions from their stored form in every statement that writes a row, and
-- attempts are written twice per cycle: their seven CHECKs were about 12% of a claim ->
-- complete cycle's instructions (docs/benchmarks.md); one call of attempt_rules_hold
-- costs under half of that. NOT VALID because attempts are append-only history: rows
-- a development version wrote may hold an infinite time or a free-text reason, and keep
-- what they recorded (the audit views cope with them); every new or changed row is
-- checked.
ALTER TABLE compaction.attempts
    ADD CONSTRAINT attempts_rules CHECK (compaction.attempt_rules_hold(
        attempt, state, reason, started_at, lease_expires_at, finished_at,
        input_tokens, output_tokens, figures_total, figures_kept, figures_invented)) NOT VALID;
-- The final word on exclusivity: one running attempt per identity, whatever the callers do.
CREATE UNIQUE INDEX attempts_one_running
    ON compaction.attempts (conversation_id, job_id) WHERE state = 'running';

-- Admission: a semaphore of rows. Slots 1..10000 always exist (the bound on max_running:
-- no trigger resizes them); claims use slots 1..settings.max_running. A
-- running attempt holds one slot with a copy of its lease; a free slot has no holder, and
-- a slot whose holder's lease ran out counts as free (expired attempts never count
-- against admission). Not per conversation: under Citus a reference table.
-- Its only index is the primary key on slot, which no update changes, and its pages
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
    -- A holder is all four columns or none. One call instead of three
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
