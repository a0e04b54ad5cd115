-- 0032_checks_compiled_once, downgrade: the SQL rules of revision 0016, inlined into
-- the CHECKs that call them.

CREATE OR REPLACE FUNCTION compaction.valid_source_hash(p_source_hash text)
RETURNS boolean
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT p_source_hash IS NOT NULL AND p_source_hash OPERATOR(pg_catalog.~) '^[0-9a-f]{64}$'
$$;
COMMENT ON FUNCTION compaction.valid_source_hash(text) IS
    'Internal: true when the text is 64 lowercase hexadecimal characters (a SHA-256 in hex)';

CREATE OR REPLACE FUNCTION compaction.summary_problem(p_summary text)
RETURNS text
LANGUAGE sql
IMMUTABLE
PARALLEL SAFE
AS $$
    SELECT CASE
               WHEN NOT compaction.has_content(p_summary) THEN 'empty'
               -- characters, not bytes: 6,000 four-byte emoji are a valid summary
               WHEN pg_catalog.char_length(p_summary) OPERATOR(pg_catalog.>) 6000 THEN 'too_long'
           END
$$;
COMMENT ON FUNCTION compaction.summary_problem(text) IS
    'Internal: NULL for a valid summary text, else empty (NULL or whitespace only) or too_long (over 6,000 characters)';

CALL compaction.assign_ownership();
