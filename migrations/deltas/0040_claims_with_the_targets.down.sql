-- 0040_claims_with_the_targets, downgrade: the worker looks with worker_targets and claims
-- with claim_targets again.

DROP FUNCTION compaction.claim_next_targets(text, text, int, text, text, text, interval, timestamptz);
