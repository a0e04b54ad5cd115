-- pycompactor stored logic, section 3 continued: admission (contract §6, admission_full;
-- the table compaction.admission and settings.admission_high_water are in 29_jobs.sql).
-- A claim takes a slot (30_claims.sql); this file owns giving it back when the attempt
-- ends (release_slot, called by fencing, completion and reaping) and bringing the high
-- water down after max_running was lowered (lower_high_water, called by claim).

-- What follows an attempt's end (contract §11: written by the engine's functions, not by
-- triggers on its tables, so that every statement addresses one conversation's rows or a
-- global table): its admission slot back, by number, unless another claim
-- took the slot over after the lease ran out. Called right after the write that ended
-- it, under the conversation's lock, with the attempt row that write returned. The
-- attempt row records its own events (attempts_guard stamps the end).
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
-- the look above. Not while a claim that read the higher max_running is
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
