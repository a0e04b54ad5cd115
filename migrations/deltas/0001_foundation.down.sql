-- Delta 0001_foundation, downgrade. Schema compaction stays (it holds alembic's
-- version table) and the cluster-wide roles stay (other databases may use them).
DROP PROCEDURE compaction.assign_ownership();
DROP FUNCTION compaction.source_hash(text, int);
DROP FUNCTION compaction.plan_targets(text);
DROP FUNCTION compaction.range_hash(text[]);
DROP FUNCTION compaction.explain_runs(text);
DROP FUNCTION compaction.eligible_pairs(text);
DROP FUNCTION compaction.indexed_pairs(text);
DROP FUNCTION compaction.judge_runs(text);
DROP FUNCTION compaction.is_target(int, bigint);
DROP FUNCTION compaction.has_content(text);
DROP VIEW compaction.source_messages;
DROP VIEW compaction.source_runs;
DROP TABLE compaction_source.messages;
DROP TABLE compaction_source.runs;
DROP TABLE compaction_source.conversations;
DROP SCHEMA compaction_source;
COMMENT ON SCHEMA compaction IS NULL;
