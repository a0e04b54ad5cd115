-- Revision 0012_explain_from_state: explain_runs reads the derived state while it is
-- current: runs holding a pair there are eligible without being judged again; only the
-- others are judged, for their reasons. The output is the same.

CREATE OR REPLACE FUNCTION compaction.explain_runs(p_conversation_id text)
RETURNS TABLE (run_id text, run_status text, eligible boolean, reason text)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    IF NOT compaction.derived_state_current() THEN
        RETURN QUERY
        SELECT j.run_id, j.run_status, j.reason IS NULL, j.reason
        FROM compaction.judge_runs(p_conversation_id) AS j
        ORDER BY j.reason IS NULL, j.user_seq NULLS FIRST, j.run_id;
        RETURN;
    END IF;
    RETURN QUERY
    WITH runs AS (
        SELECT sr.run_id, sr.status
        FROM compaction.source_runs AS sr
        WHERE sr.conversation_id = p_conversation_id
    ), paired AS (
        SELECT r.run_id, r.status, p.user_seq
        FROM runs AS r
        JOIN compaction.pairs AS p
          ON p.conversation_id = p_conversation_id AND p.run_id = r.run_id
    ), judged AS (
        SELECT j.run_id, j.run_status, j.reason, j.user_seq
        FROM compaction.judge_runs(
                 p_conversation_id,
                 ARRAY(SELECT r.run_id FROM runs AS r
                       WHERE r.run_id NOT IN (SELECT x.run_id FROM paired AS x))) AS j
    )
    SELECT v.run_id, v.run_status, v.reason IS NULL, v.reason
    FROM (SELECT x.run_id, x.status AS run_status, NULL::text AS reason, x.user_seq
          FROM paired AS x
          UNION ALL
          SELECT j.run_id, j.run_status, j.reason, j.user_seq
          FROM judged AS j) AS v
    ORDER BY v.reason IS NULL, v.user_seq NULLS FIRST, v.run_id;
END
$$;
COMMENT ON FUNCTION compaction.explain_runs(text) IS
    'Every run of a conversation with whether it forms a pair and, if not, the first rule it breaks (no message text)';

CALL compaction.assign_ownership();
