-- 0032_checks_compiled_once: the rules a CHECK constraint calls are PL/pgSQL.
-- PostgreSQL prepares a table's CHECK expressions again in every statement that writes
-- the table, and an SQL function inlined there has its body parsed each time:
-- summary_problem (job_summaries) and valid_source_hash (jobs) were parsed once per
-- claim -> complete cycle each, 6.1% of its instructions. PL/pgSQL compiles a body once
-- per session. valid_source_hash tests its characters with ltrim instead of a regular
-- expression, whose 64-fold repetition cost about 75,000 instructions per call (claim
-- and the CHECK: twice a cycle). Both answer exactly as before (same results, NULL
-- included), so no stored row is checked again and no constraint changes: the CHECKs
-- name the functions by oid, which CREATE OR REPLACE keeps.

CREATE OR REPLACE FUNCTION compaction.valid_source_hash(p_source_hash text)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    -- What '^[0-9a-f]{64}$' matches: 64 bytes, every one of them in the set (a character
    -- outside it, multibyte or not, is left by ltrim).
    RETURN p_source_hash IS NOT NULL
       AND pg_catalog.octet_length(p_source_hash) OPERATOR(pg_catalog.=) 64
       AND pg_catalog.ltrim(p_source_hash, '0123456789abcdef') OPERATOR(pg_catalog.=) '';
END
$$;
COMMENT ON FUNCTION compaction.valid_source_hash(text) IS
    'Internal: true when the text is 64 lowercase hexadecimal characters (a SHA-256 in hex)';

CREATE OR REPLACE FUNCTION compaction.summary_problem(p_summary text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
PARALLEL SAFE
AS $$
BEGIN
    RETURN CASE
               WHEN NOT compaction.has_content(p_summary) THEN 'empty'
               -- characters, not bytes: 6,000 four-byte emoji are a valid summary
               WHEN pg_catalog.char_length(p_summary) OPERATOR(pg_catalog.>) 6000 THEN 'too_long'
           END;
END
$$;
COMMENT ON FUNCTION compaction.summary_problem(text) IS
    'Internal: NULL for a valid summary text, else empty (NULL or whitespace only) or too_long (over 6,000 characters)';

CALL compaction.assign_ownership();
