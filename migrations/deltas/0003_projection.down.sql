-- Delta 0003_projection, downgrade: drops exactly what 0003_projection.up.sql added
-- (their grants go with them), restoring the 0002_core state.
DROP FUNCTION compaction.projection_texts(text, text[], bigint[]);
DROP FUNCTION compaction.projection_range_hashes(int[], text[]);
DROP FUNCTION compaction.projection_summaries(text, text);
