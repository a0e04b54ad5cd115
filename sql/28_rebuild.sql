-- pycompactor stored logic, section 2b continued: rebuilding the whole derived state
-- (rebuild_derived_state, stamp_derived_state and the view rebuild_progress).

-- Every conversation, in conversation id order, then the stamp that puts the derived
-- state in use. Writes during the rebuild are tracked; while the derived state is not in
-- use, a write to a conversation the rebuild has not reached (or, before a rebuild starts,
-- a write through a trigger attached since the stamp) is left to it
-- (compaction.defer_to_rebuild). The stamp is set only if the source stamp did not change
-- while the rebuild ran. Call it outside a transaction block:
-- CALL compaction.rebuild_derived_state();
--
-- It scales and resumes. The next conversation is one index probe (the
-- least id after the last one done, among the source's runs and the derived state's
-- conversations), never a selection over every run; a transaction derives at most
-- p_batch conversations and commits once it has held their rows for 20 ms, so a host
-- write waits at most about that long for a conversation the rebuild holds; each commit
-- moves the resume point in compaction.source_tracking, so a cancelled rebuild (or one
-- that failed) continues after the last conversation it committed, as long as the
-- source stamp is the same. Progress with a rate and an ETA: NOTICEs about once a
-- second, and the view compaction.rebuild_progress. Each conversation is re-derived by
-- compaction.rederive_conversation(id), which addresses that conversation alone (docs/contract.md
-- §11).
--
-- Before a commit moves the resume point past a batch, the rebuild takes
-- source_tracking's row FOR UPDATE, so it waits for the writers that left a conversation
-- of the batch to it; a conversation one of them created was invisible to the ordered
-- reads, so the resume point moves only up to the first such conversation, and the next
-- batch derives it. The last commit stamps the derived state under that lock. A TRUNCATE
-- under way clears the resume point (the trigger, 25_tracking.sql): the rebuild then
-- fails at its next commit.
--
-- The rebuild never waits for a writer long while it holds a batch. A
-- writer's transaction may hold one conversation (or source_tracking's row, having left a
-- conversation to the rebuild) and then ask for a conversation the batch holds; had the
-- rebuild waited for the writer meanwhile, PostgreSQL would break the deadlock after
-- deadlock_timeout by failing whichever began waiting first, often the writer. So a
-- conversation a writer holds, or whose conversation_state row a writer is creating (its
-- first tracked write since the tracking was attached), ends the batch before it; and
-- the lock on source_tracking is waited for at most 100 ms: past that, the batch is
-- rolled back, the rebuild waits holding nothing, and derives the batch again. Two
-- rebuilds may run at once (each process of a deploy runs `pycompactor migrate`): the
-- shared resume point only moves forward, and one that finds the derived state put in
-- use by the other returns.
CREATE PROCEDURE compaction.rebuild_derived_state(p_batch int DEFAULT 100,
                                                  p_restart boolean DEFAULT false)
LANGUAGE plpgsql
-- No SET clause: a procedure with one cannot COMMIT. Every name below is qualified.
AS $$
DECLARE
    v_stamp     text;
    v_after     text;
    v_from      text;
    v_next      text;
    v_batch     text[];
    v_held      text;
    v_missed    text;
    v_gave_way  boolean := false;
    v_lock_wait text;
    v_placed    int;
    v_busy      boolean;
    v_done      bigint;
    v_total     bigint;
    v_resumed   bigint;
    v_began     timestamptz := pg_catalog.clock_timestamp();
    v_batch_at  timestamptz;
    v_noted_at  timestamptz := pg_catalog.clock_timestamp();
    v_rate      double precision;
BEGIN
    IF p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION 'rebuild_derived_state needs a batch size of at least 1' USING ERRCODE = 'CP020';
    END IF;
    v_stamp := compaction.source_stamp();
    IF v_stamp IS NULL THEN
        RAISE EXCEPTION 'the source is not tracked: some table behind compaction.source_runs / compaction.source_messages has no enabled-always track_source_changes trigger for INSERT, UPDATE, DELETE and TRUNCATE'
            USING ERRCODE = 'CP021',
                  HINT = 'Attach the tracking triggers (docs/integrating.md); without them the engine judges from the views on each call.';
    END IF;
    SELECT st.rebuild_after, st.rebuild_done, st.rebuild_total INTO v_after, v_done, v_total
    FROM compaction.source_tracking AS st
    WHERE st.rebuild_stamp = v_stamp AND NOT coalesce(p_restart, false);
    IF v_after IS NULL THEN
        -- A new rebuild: how many conversations, counted once (the ETA's denominator).
        v_after := '';
        v_done := 0;
        SELECT count(*) INTO v_total
        FROM (SELECT DISTINCT sr.conversation_id FROM compaction.source_runs AS sr) AS c;
        -- The shared resume point never moves back under one source stamp:
        -- another rebuild may be under way, and a writer must not leave it a
        -- conversation it has derived already (see the batch's end).
        UPDATE compaction.source_tracking AS st
        SET rebuild_stamp = v_stamp,
            rebuild_after = CASE WHEN st.rebuild_stamp = v_stamp THEN st.rebuild_after
                                 ELSE v_after END,
            rebuild_done = 0, rebuild_total = v_total, rebuild_started_at = pg_catalog.now(),
            rebuild_updated_at = pg_catalog.now();
        COMMIT;
        RAISE NOTICE 'derived state: rebuilding about % conversations', v_total;
    ELSE
        RAISE NOTICE 'derived state: resuming after conversation % (% of about % done)',
            v_after, v_done, v_total;
    END IF;
    v_resumed := v_done;
    LOOP
        -- Per transaction: every lookup of a re-derivation is by key (as in the tracking
        -- trigger), and fresh expression indexes may lack statistics; the resume point
        -- makes a commit lost in a crash cost only its batch again. JIT off as in every
        -- writer: with sequential scans priced out, the one-row UPDATE of
        -- the resume point costs above jit_above_cost and compiled for 35-90 ms at each
        -- commit, 60% of a rebuild's time. Generic plans, as the tracking trigger forces:
        -- re-derivation's statements are planned for one conversation at
        -- a time, and a custom plan for each conversation cost more to make than to run
        -- (about a tenth of a first rebuild at 200,000 messages).
        PERFORM pg_catalog.set_config('enable_seqscan', 'off', true);
        PERFORM pg_catalog.set_config('jit', 'off', true);
        -- On Citus, custom plans: it plans statements on distributed tables only with
        -- their values bound (contract §11).
        PERFORM pg_catalog.set_config(
            'plan_cache_mode',
            CASE WHEN pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NULL
                 THEN 'force_generic_plan' ELSE 'force_custom_plan' END,
            true);
        PERFORM pg_catalog.set_config('synchronous_commit', 'off', true);
        -- On Citus each transaction of the rebuild runs as the engine's owner: Citus
        -- refuses a user the placements another user wrote in the same transaction, and
        -- the derivation writes as the owner (SECURITY DEFINER). Reset at each commit.
        IF pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL
           AND CURRENT_USER <> 'compaction_owner'
           AND pg_catalog.pg_has_role('compaction_owner', 'MEMBER') THEN
            PERFORM pg_catalog.set_config('role', 'compaction_owner', true);
        END IF;
        IF v_gave_way THEN
            -- The last batch gave way (below): wait for the writers it waited for while
            -- holding nothing, then derive it again.
            PERFORM FROM compaction.source_tracking AS st WHERE st.singleton FOR UPDATE;
            COMMIT;
            v_gave_way := false;
            CONTINUE;
        END IF;
        v_from := v_after;
        v_batch := '{}';
        v_placed := 0;
        v_batch_at := pg_catalog.clock_timestamp();
        LOOP
            -- The next conversation in key order, as the first row of an ordered read:
            -- over a view that is not one table (the Agents SDK recipe's runs come from
            -- its messages) min() aggregated every row after the resume point at each
            -- step, a rebuild quadratic in the conversations.
            -- The messages' conversations too, since a conversation with
            -- no run may hold foreign messages (compaction.foreign_messages).
            v_next := least(
                (SELECT sr.conversation_id FROM compaction.source_runs AS sr
                 WHERE sr.conversation_id > v_after
                 ORDER BY sr.conversation_id LIMIT 1),
                (SELECT sm.conversation_id FROM compaction.source_messages AS sm
                 WHERE sm.conversation_id > v_after
                 ORDER BY sm.conversation_id LIMIT 1),
                (SELECT cs.conversation_id FROM compaction.conversation_state AS cs
                 WHERE cs.conversation_id > v_after
                 ORDER BY cs.conversation_id LIMIT 1));
            EXIT WHEN v_next IS NULL;
            -- A conversation a writer holds ends the batch before it: the
            -- next transaction waits for it holding nothing, so the writer may go on to a
            -- conversation of this batch without a deadlock, which PostgreSQL would
            -- resolve by failing whichever of the two began waiting first.
            IF pg_catalog.cardinality(v_batch) = 0 THEN
                NULL;  -- the first of a transaction: waiting for it holds nothing
            ELSIF EXISTS (SELECT FROM compaction.conversation_state AS cs
                          WHERE cs.conversation_id = v_next) THEN
                PERFORM FROM compaction.conversation_state AS cs
                WHERE cs.conversation_id = v_next
                FOR NO KEY UPDATE SKIP LOCKED;
                EXIT WHEN NOT FOUND;
            ELSE
                -- No committed row (a conversation written before the tracking was
                -- attached): its first tracked write may be creating the row now,
                -- unseen, and inserting it would wait for that writer. Insert it without
                -- waiting, in a subtransaction; at most 32 a batch, well under the 64 a
                -- backend's snapshot entry holds before every snapshot taken anywhere
                -- must look subtransactions up.
                EXIT WHEN v_placed >= 32;
                v_placed := v_placed + 1;
                v_busy := false;
                v_lock_wait := pg_catalog.current_setting('lock_timeout');
                PERFORM pg_catalog.set_config('lock_timeout', '1ms', true);
                BEGIN
                    INSERT INTO compaction.conversation_state AS cs
                        (conversation_id, pair_count, generation)
                    VALUES (v_next, 0, 1)
                    ON CONFLICT (conversation_id) DO NOTHING;
                EXCEPTION WHEN lock_not_available THEN
                    v_busy := true;
                END;
                PERFORM pg_catalog.set_config('lock_timeout', v_lock_wait, true);
                EXIT WHEN v_busy;
            END IF;
            PERFORM compaction.rederive_conversation(v_next);
            v_after := v_next;
            v_batch := v_batch || v_next;
            EXIT WHEN pg_catalog.cardinality(v_batch) >= p_batch
                   OR pg_catalog.clock_timestamp() - v_batch_at >= interval '20 milliseconds';
        END LOOP;
        -- The writers that left a conversation of this batch (or, at the end, any after
        -- it) to the rebuild have ended once this lock is had; see the comment above. A
        -- writer that holds it may be waiting for a conversation of the batch: past 100
        -- ms (well below deadlock_timeout, 1 s by default) the batch gives way, undone,
        -- rather than let PostgreSQL fail the writer.
        v_lock_wait := pg_catalog.current_setting('lock_timeout');
        PERFORM pg_catalog.set_config('lock_timeout', '100ms', true);
        BEGIN
            SELECT st.rebuild_stamp INTO v_held
            FROM compaction.source_tracking AS st
            WHERE st.singleton
            FOR UPDATE;
        EXCEPTION WHEN lock_not_available THEN
            v_gave_way := true;
        END;
        IF v_gave_way THEN
            ROLLBACK;
            v_after := v_from;
            CONTINUE;
        END IF;
        PERFORM pg_catalog.set_config('lock_timeout', v_lock_wait, true);
        IF v_held IS DISTINCT FROM v_stamp THEN
            -- Another rebuild under the same source (a second `pycompactor migrate` of a
            -- deploy) derived every conversation and stamped: this one's work is done.
            IF v_held IS NULL AND compaction.derived_state_current()
               AND (SELECT st.stamp FROM compaction.source_tracking AS st) = v_stamp THEN
                COMMIT;
                RAISE NOTICE 'derived state: in use, put there by another rebuild (% conversations this run)',
                    v_done - v_resumed + pg_catalog.cardinality(v_batch);
                RETURN;
            END IF;
            RAISE EXCEPTION 'the source was truncated, or a rebuild under changed source views started, while this rebuild ran; run it again'
                USING ERRCODE = 'CP021';
        END IF;
        -- Two statements, so that the batch's end bounds the index scan: with the bound
        -- in an OR, a repair over a populated derived state read every conversation after
        -- the batch at each commit.
        IF v_next IS NULL THEN
            SELECT cs.conversation_id INTO v_missed
            FROM compaction.conversation_state AS cs
            WHERE cs.conversation_id > v_from
              AND cs.conversation_id <> ALL (v_batch)
            ORDER BY cs.conversation_id
            LIMIT 1;
        ELSE
            SELECT cs.conversation_id INTO v_missed
            FROM compaction.conversation_state AS cs
            WHERE cs.conversation_id > v_from AND cs.conversation_id <= v_after
              AND cs.conversation_id <> ALL (v_batch)
            ORDER BY cs.conversation_id
            LIMIT 1;
        END IF;
        IF v_missed IS NOT NULL THEN
            -- Up to the conversation before it: the next batch starts with it.
            v_batch := ARRAY(SELECT b.id FROM pg_catalog.unnest(v_batch) AS b (id)
                             WHERE b.id < v_missed);
            v_after := coalesce((SELECT max(b.id) FROM pg_catalog.unnest(v_batch) AS b (id)),
                                v_from);
        END IF;
        v_done := v_done + pg_catalog.cardinality(v_batch);
        -- Every conversation derived: stamped below, under this lock.
        EXIT WHEN v_next IS NULL AND v_missed IS NULL;
        -- Forward only: a rebuild ahead of this one has derived the conversations up to
        -- its point, and a writer must find them past the resume point, not left to a
        -- rebuild that another's stamp may end first.
        -- The time as a value: Citus updates a reference table with no volatile function.
        v_batch_at := pg_catalog.clock_timestamp();
        UPDATE compaction.source_tracking AS st
        SET rebuild_after = GREATEST(st.rebuild_after, v_after), rebuild_done = v_done,
            rebuild_updated_at = v_batch_at
        WHERE st.singleton;
        COMMIT;
        IF pg_catalog.clock_timestamp() - v_noted_at >= interval '1 second' THEN
            v_noted_at := pg_catalog.clock_timestamp();
            v_rate := (v_done - v_resumed)
                      / greatest(extract(epoch FROM v_noted_at - v_began), 0.001);
            RAISE NOTICE 'derived state: % of about % conversations, % a second, about % s left',
                v_done, v_total, round(v_rate::numeric, 1),
                round((greatest(v_total - v_done, 0) / greatest(v_rate, 0.001))::numeric);
        END IF;
    END LOOP;
    v_rate := (v_done - v_resumed)
              / greatest(extract(epoch FROM pg_catalog.clock_timestamp() - v_began), 0.001);
    RAISE NOTICE 'derived state: % conversations (% this run, % a second)',
        v_done, v_done - v_resumed, round(v_rate::numeric, 1);
    PERFORM compaction.stamp_derived_state(v_stamp);
    COMMIT;
END
$$;
COMMENT ON PROCEDURE compaction.rebuild_derived_state(int, boolean) IS
    'Repair and upgrade step: re-derives every conversation in id order, committing at most p_batch conversations or 20 ms of work at a time and never waiting for a writer long while it holds them, resuming after the last committed one when the source is unchanged (p_restart: start over), then puts the derived state in use; CALL outside a transaction block';

-- What a stamp names, as source_tracking records it: the oids of its objects, and by
-- name the tables its tracking triggers are on (a table's oid differs on every Citus
-- node; its name does not). Read into a variable before the UPDATE of source_tracking:
-- on Citus a write to a reference table may not read the catalog in the same statement.
CREATE FUNCTION compaction.stamped_oids(p_stamp text)
RETURNS oid[]
LANGUAGE sql
IMMUTABLE
AS $$
    SELECT ARRAY(SELECT pg_catalog.split_part(o.item, ':', 1)::oid
                 FROM pg_catalog.unnest(pg_catalog.string_to_array(p_stamp, ',')) AS o (item))
$$;
COMMENT ON FUNCTION compaction.stamped_oids(text) IS
    'Internal: the oids of the objects a source stamp (compaction.source_stamp) names';

CREATE FUNCTION compaction.stamped_tables(p_stamp text)
RETURNS text[]
LANGUAGE sql
STABLE
AS $$
    SELECT ARRAY(SELECT DISTINCT tg.tgrelid::regclass::text
                 FROM pg_catalog.pg_trigger AS tg
                 WHERE tg.tgfoid = 'compaction.track_source_changes()'::regprocedure
                   AND tg.oid OPERATOR(pg_catalog.=) ANY (compaction.stamped_oids(p_stamp))
                 ORDER BY 1)
$$;
COMMENT ON FUNCTION compaction.stamped_tables(text) IS
    'Internal: by name, the tables whose tracking triggers a source stamp (compaction.source_stamp) names';

CREATE FUNCTION compaction.stamp_derived_state(p_stamp text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_tables text[];
BEGIN
    -- A view re-pointed or a trigger disabled while the rebuild ran: the rows derived
    -- before that may be stale, so the derived state stays out of use.
    IF p_stamp IS NULL OR p_stamp IS DISTINCT FROM compaction.source_stamp() THEN
        RAISE EXCEPTION 'the source views or tracking triggers changed during the rebuild; run it again'
            USING ERRCODE = 'CP021';
    END IF;
    v_tables := compaction.stamped_tables(p_stamp);
    UPDATE compaction.source_tracking
    SET stamp = p_stamp,
        object_oids = compaction.stamped_oids(p_stamp),
        tracked_tables = v_tables,
        stamped_at = pg_catalog.now(),
        rebuild_stamp = NULL, rebuild_after = NULL, rebuild_done = NULL,
        rebuild_total = NULL, rebuild_started_at = NULL, rebuild_updated_at = NULL;
    RETURN true;
END
$$;
COMMENT ON FUNCTION compaction.stamp_derived_state(text) IS
    'Internal: last step of rebuild_derived_state: puts the derived state in use under the given source stamp, unless the source changed meanwhile';

CREATE VIEW compaction.rebuild_progress AS
    SELECT st.rebuild_done AS done,
           st.rebuild_total AS total,
           st.rebuild_after AS resume_after,
           st.rebuild_started_at AS started_at,
           st.rebuild_updated_at AS updated_at,
           st.rebuild_stamp = compaction.source_stamp() AS resumable,
           CASE WHEN st.rebuild_updated_at > st.rebuild_started_at THEN
               st.rebuild_done / extract(epoch FROM st.rebuild_updated_at - st.rebuild_started_at)
           END AS per_second,
           CASE WHEN st.rebuild_updated_at > st.rebuild_started_at AND st.rebuild_done > 0 THEN
               (st.rebuild_updated_at - st.rebuild_started_at)
               * (greatest(st.rebuild_total - st.rebuild_done, 0)::double precision / st.rebuild_done)
           END AS eta
    FROM compaction.source_tracking AS st
    WHERE st.rebuild_stamp IS NOT NULL;
COMMENT ON VIEW compaction.rebuild_progress IS
    'A rebuild under way or stopped: conversations done of about total, the resume point, whether a CALL compaction.rebuild_derived_state() now continues from it, the rate over its life (per second) and the time left at that rate; no row when none is under way';
