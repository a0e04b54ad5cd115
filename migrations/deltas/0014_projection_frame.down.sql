-- 0014_projection_frame, undone: drivers before it read through indexed_pairs and
-- projection_summaries.
DROP FUNCTION compaction.projection_frame(text, text, int);
