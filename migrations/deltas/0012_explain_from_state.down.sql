-- Revision 0012_explain_from_state, down: explain_runs judges every run again.

CREATE OR REPLACE FUNCTION compaction.explain_runs(p_conversation_id text)
RETURNS TABLE (run_id text, run_status text, eligible boolean, reason text)
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
    SELECT j.run_id, j.run_status, j.reason IS NULL, j.reason
    FROM compaction.judge_runs(p_conversation_id) AS j
    ORDER BY j.reason IS NULL, j.user_seq NULLS FIRST, j.run_id
$$;
COMMENT ON FUNCTION compaction.explain_runs(text) IS
    'Every run of a conversation with whether it forms a pair and, if not, the first rule it breaks (no message text)';

CALL compaction.assign_ownership();
