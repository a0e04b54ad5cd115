-- pycompactor stored logic, section 1: the source contract.
--
-- The engine reads history only through compaction.source_runs and
-- compaction.source_messages. By default they select from the reference tables below;
-- a host re-points them at its own tables with CREATE OR REPLACE VIEW (docs/integrating.md).

CREATE TABLE compaction_source.conversations (
    conversation_id text NOT NULL,
    CONSTRAINT conversations_pkey PRIMARY KEY (conversation_id)
);
COMMENT ON TABLE compaction_source.conversations IS
    'Reference history: one row per durable conversation thread';

CREATE TABLE compaction_source.runs (
    run_id          text NOT NULL,
    conversation_id text NOT NULL,
    status          text NOT NULL,
    created_at      timestamptz,
    -- conversation_id leads every key (contract §11): under Citus these tables are
    -- distributed by it, co-located with the engine's per-conversation tables.
    CONSTRAINT runs_pkey PRIMARY KEY (conversation_id, run_id),
    CONSTRAINT runs_conversation_fkey FOREIGN KEY (conversation_id)
        REFERENCES compaction_source.conversations (conversation_id)
);
COMMENT ON TABLE compaction_source.runs IS
    'Reference history: one row per Run (execution of one request); status completed, partial or clarify_pending can form a pair';

-- The tracking triggers find runs by id alone (which conversation a changed message's run
-- is in); the primary key leads with conversation_id (contract §11).
CREATE INDEX runs_run_idx ON compaction_source.runs (run_id);

CREATE TABLE compaction_source.messages (
    message_id      text NOT NULL,
    conversation_id text NOT NULL,
    run_id          text,
    role            text NOT NULL,
    status          text NOT NULL,
    content         text NOT NULL,
    seq             bigint NOT NULL,
    created_at      timestamptz,
    -- No foreign key to runs: one by run_id alone cannot exist once the
    -- table is distributed by conversation_id, and one by (conversation_id, run_id) would
    -- forbid what contract §3 defines, a run's message filed under another conversation
    -- (the run is then no pair). A dangling run_id forms no pair either.
    CONSTRAINT messages_pkey PRIMARY KEY (conversation_id, message_id)
);
COMMENT ON TABLE compaction_source.messages IS
    'Reference history: messages of all roles; seq orders them within a conversation';

-- Judging a run reads its messages in its conversation (run_id, conversation_id), and
-- asks by run_id alone whether any was filed under another conversation.
CREATE INDEX messages_run_idx ON compaction_source.messages (run_id, conversation_id);
-- Reading a conversation in order (newest-first projection, check-source samples).
CREATE INDEX messages_conversation_seq_idx
    ON compaction_source.messages (conversation_id, seq, message_id);

CREATE VIEW compaction.source_runs AS
    SELECT r.run_id, r.conversation_id, r.status
    FROM compaction_source.runs AS r;
COMMENT ON VIEW compaction.source_runs IS
    'Source contract: runs(run_id text, conversation_id text, status text); re-point with CREATE OR REPLACE VIEW';

CREATE VIEW compaction.source_messages AS
    SELECT m.message_id, m.conversation_id, m.run_id, m.role, m.status, m.content, m.seq
    FROM compaction_source.messages AS m;
COMMENT ON VIEW compaction.source_messages IS
    'Source contract: messages(message_id, conversation_id, run_id, role, status, content text; seq bigint); re-point with CREATE OR REPLACE VIEW';
