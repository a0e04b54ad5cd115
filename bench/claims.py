"""Benchmark 1: the claim -> complete cycle against a plain-SQL cycle of the same shape.

K connections (one thread each, started together by a barrier) loop over ranges prepared
beforehand. pycompactor's cycle is `compaction.claim` then `compaction.complete` (two
autocommit statements, two commits). The baseline is what an application without the
guarantees would write: INSERT a job row with a unique key (commit), then UPDATE it and
INSERT a result row (one statement, one commit). Same connections, same number of
statements and commits, so the ratio is the server-side cost of the checks, the locks
and the audit trail.

A third cycle measures the floor the design sets: the rows a claim and a completion must
write (a job with its 20 ids, an attempt and its transition, which record the two audit
events, an admission slot taken and given back by number, a summary, its verdict), read
against the range's current ids and hash, each call one plain statement of writable CTEs
into copies of the engine's tables (their keys, indexes and CHECKs; no foreign keys,
triggers, refusal paths, fencing or timeouts). No implementation of this design writes
less, so its ratio to the baseline bounds what the claim cycle can reach here.

A fourth cycle measures the floor of a far leaner design (a floor that a design sets can
be moved by the design, so the claim goals are weighed against it too), the leanest we
found room for: one row per attempt, which carries its job's identity (the 20 ids and
the hash) and its admission slot (unique among running attempts, so no slot table),
inserted by the claim; the completion updates it with the summary. No job row, no
summary row, no verdict: two row writes a cycle, where the plain SQL cycle writes three.
Its keys are the engine's (identity, one running attempt per identity, one completed per
identity) and the copied attempt table's CHECK. A design of that shape would still pay
its checks (fencing, ownership, eligibility, source, versions, admission) on top of
this.

A fifth cycle measures what those checks cost at the least: a sketch of an engine on the
lean design's row. Its claim and completion are PL/pgSQL functions with the
contract's signatures, each one statement that reads what the checks read (the prompt
version, the settings, the range and the conversation's pair count, the identity's earlier
attempts) and writes only when they hold, answering with the contract's reason when they
do not. Every liberty it takes makes it faster than an engine can be: no conversation
lock, no SECURITY DEFINER or SET clause, no immutability trigger, no reaping, a random
slot in place of exact admission (a taken one is drawn again), and a plain execute in
place of the driver's call with its timeouts. Its ratio to plain SQL is therefore an
upper bound for any engine of that shape.

Each K also counts the MultiXact ids pycompactor's cycles spend: a row that two
transactions lock at once takes one, and the ids are spent for good (running low forces
aggressive vacuums of every table). A claim does not lock its prompt version's row (a
foreign key's check would), so that concurrent claims do not spend one most of the time.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from bench.common import (
    REPETITIONS,
    Conn,
    Sizes,
    drain_queue,
    median,
    ratio,
    rotated,
    seed_conversations,
    text_pool,
    vacuum_analyze,
)
from pycompactor import db
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION

MODEL = "bench/fake-model"
# The fake summary a model would have written: ~1 KB, mixed scripts.
SUMMARY = text_pool(11, 1, 1024)[0]
# The lean floor's slots (see _LEAN_CLAIM); seeded, so runs draw alike.
_SLOTS = random.Random(32)

BASELINE_DDL = """
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE bench.plain_jobs (
    job_key     text PRIMARY KEY,
    state       text NOT NULL,
    worker      text NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz
);
CREATE TABLE bench.plain_results (
    job_key text PRIMARY KEY,
    summary text NOT NULL
);
"""
# The contract's rows (see the module docstring), in copies of the engine's tables.
# The attempt row records its events (its claim_* columns take their defaults, the
# completion stamps finish_*): no event row.
_FLOOR_TABLES = ("jobs", "attempts", "admission", "job_summaries", "summary_verdicts")
_FLOOR_DDL = "".join(
    f"CREATE TABLE bench.floor_{t} (LIKE compaction.{t} INCLUDING ALL);\n"
    for t in _FLOOR_TABLES
) + (
    # LIKE copies no storage parameters; the engine's slots leave room for HOT updates.
    "ALTER TABLE bench.floor_admission SET (fillfactor = 50);\n"
    "INSERT INTO bench.floor_admission (slot) SELECT pg_catalog.generate_series(1, 10000);\n")
# The lean design's one row per attempt: the engine's attempt columns, its job's
# identity and the summary; its slot unique among running attempts.
_LEAN_DDL = """
CREATE TABLE bench.lean_attempts (LIKE compaction.attempts INCLUDING ALL);
ALTER TABLE bench.lean_attempts
    ADD COLUMN scope text NOT NULL, ADD COLUMN from_pair int NOT NULL,
    ADD COLUMN to_pair int NOT NULL, ADD COLUMN source_message_ids text[] NOT NULL,
    ADD COLUMN source_hash text NOT NULL, ADD COLUMN model text NOT NULL,
    ADD COLUMN prompt_version text NOT NULL, ADD COLUMN created_at timestamptz NOT NULL,
    ADD COLUMN summary text;
CREATE UNIQUE INDEX lean_attempts_identity ON bench.lean_attempts
    (conversation_id, scope, from_pair, source_hash, model, prompt_version, attempt);
CREATE UNIQUE INDEX lean_attempts_one_completed ON bench.lean_attempts
    (conversation_id, scope, from_pair, source_hash, model, prompt_version)
    WHERE state = 'completed';
CREATE UNIQUE INDEX lean_attempts_slot ON bench.lean_attempts (slot) WHERE state = 'running';
"""
# The lean engine sketch (see the module docstring): the lean row, found by job_id alone as
# complete is addressed (contract §6), and the two calls with the contract's signatures.
_SKETCH_DDL = """
CREATE TABLE bench.sketch_attempts (LIKE bench.lean_attempts INCLUDING ALL);
CREATE INDEX sketch_attempts_job_id ON bench.sketch_attempts (job_id);
CREATE FUNCTION bench.sketch_claim(
    p_conversation_id text, p_scope text, p_from_pair int, p_source_message_ids text[],
    p_source_hash text, p_model text, p_prompt_version text, p_worker text,
    p_lease interval DEFAULT '5 minutes', p_now timestamptz DEFAULT NULL)
RETURNS TABLE (claimed boolean, reason text, job_id bigint, attempt int,
               lease_expires_at timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH version AS (
        SELECT v.accepts_new_jobs FROM compaction.prompt_versions AS v
        WHERE v.prompt_version = p_prompt_version),
    target AS (
        SELECT r.source_message_ids = p_source_message_ids
               AND r.source_hash = p_source_hash AS same_source
        FROM compaction.ranges AS r
        JOIN compaction.conversation_state AS s ON s.conversation_id = r.conversation_id
        WHERE r.conversation_id = p_conversation_id AND r.from_pair = p_from_pair
          AND p_from_pair + 30 <= s.pair_count),
    prior AS (
        SELECT max(a.attempt) AS attempts, bool_or(a.state = 'completed') AS completed,
               bool_or(a.state = 'running') AS running, max(a.job_id) AS job_id
        FROM bench.sketch_attempts AS a
        WHERE a.conversation_id = p_conversation_id AND a.scope = p_scope
          AND a.from_pair = p_from_pair AND a.source_hash = p_source_hash
          AND a.model = p_model AND a.prompt_version = p_prompt_version),
    admitted AS (
        INSERT INTO bench.sketch_attempts AS a (conversation_id, job_id, attempt, state,
            worker, started_at, lease_expires_at, slot, claimed_by, scope, from_pair,
            to_pair, source_message_ids, source_hash, model, prompt_version, created_at)
        SELECT p_conversation_id,
               coalesce(prior.job_id, nextval('compaction.jobs_job_id_seq')),
               coalesce(prior.attempts, 0) + 1, 'running', p_worker, now(), now() + p_lease,
               1 + floor(random() * settings.max_running)::int, session_user, p_scope,
               p_from_pair, p_from_pair + 9, p_source_message_ids, p_source_hash, p_model,
               p_prompt_version, now()
        FROM prior, version, target, compaction.settings AS settings
        WHERE p_now IS NULL AND p_lease BETWEEN interval '1 second' AND interval '1 day'
          AND version.accepts_new_jobs AND target.same_source
          AND prior.completed IS NOT TRUE AND prior.running IS NOT TRUE
          AND coalesce(prior.attempts, 0) < 2
        ON CONFLICT (slot) WHERE state = 'running' DO NOTHING
        RETURNING a.job_id, a.attempt, a.lease_expires_at)
    SELECT admitted.job_id IS NOT NULL,
           CASE WHEN admitted.job_id IS NOT NULL THEN 'claimed'
                WHEN p_from_pair < 0 OR p_from_pair % 10 <> 0 THEN 'invalid_range'
                WHEN cardinality(p_source_message_ids) <> 20
                     OR array_position(p_source_message_ids, NULL) IS NOT NULL
                     OR (SELECT count(DISTINCT i) FROM unnest(p_source_message_ids) AS i) <> 20
                    THEN 'invalid_source_ids'
                WHEN (SELECT v.accepts_new_jobs FROM version AS v) IS NOT TRUE
                    THEN 'prompt_version_closed'
                WHEN NOT EXISTS (SELECT FROM target) THEN 'not_eligible'
                WHEN NOT (SELECT t.same_source FROM target AS t) THEN 'source_mismatch'
                WHEN prior.completed THEN 'already_completed'
                WHEN prior.running THEN 'already_running'
                WHEN prior.attempts >= 2 THEN 'attempts_exhausted'
                ELSE 'slot_taken' END,
           admitted.job_id, admitted.attempt, admitted.lease_expires_at
    FROM prior LEFT JOIN admitted ON true;
END
$$;
CREATE FUNCTION bench.sketch_complete(
    p_job_id bigint, p_attempt int, p_summary text, p_finish_reason text,
    p_tool_call_count int, p_response_id text DEFAULT NULL, p_now timestamptz DEFAULT NULL,
    p_stats jsonb DEFAULT NULL, p_conversation_id text DEFAULT NULL)
RETURNS TABLE (ok boolean, reason text, summary_id bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH problem AS (
        SELECT CASE WHEN p_finish_reason IS DISTINCT FROM 'stop' THEN 'not_stopped'
                    WHEN p_tool_call_count IS DISTINCT FROM 0 THEN 'tool_calls'
                    ELSE compaction.summary_problem(p_summary) END AS reason),
    finished AS (
        UPDATE bench.sketch_attempts AS a
        SET state = CASE WHEN problem.reason IS NULL THEN 'completed' ELSE 'failed' END,
            reason = coalesce(problem.reason, 'completed'), finished_at = now(),
            finish_reason = p_finish_reason, tool_call_count = p_tool_call_count,
            response_id = p_response_id,
            summary = CASE WHEN problem.reason IS NULL THEN p_summary END,
            summary_chars = length(p_summary),
            finish_event_id = nextval('compaction.audit_events_event_id_seq'),
            finish_recorded_at = clock_timestamp(), finish_xact_id = pg_current_xact_id()
        FROM problem
        WHERE a.job_id = p_job_id AND a.attempt = p_attempt
          AND (p_conversation_id IS NULL OR a.conversation_id = p_conversation_id)
          AND a.state = 'running' AND a.lease_expires_at > now()
          AND a.claimed_by = session_user AND p_now IS NULL AND p_stats IS NULL
        RETURNING a.reason, a.job_id)
    SELECT coalesce(finished.reason = 'completed', false), coalesce(finished.reason, 'lease_lost'),
           CASE WHEN finished.reason = 'completed' THEN finished.job_id END
    FROM problem LEFT JOIN finished ON true;
END
$$;
"""
_SKETCH_CLAIM = (
    "SELECT claimed, reason, job_id, attempt FROM bench.sketch_claim("
    "p_conversation_id => %(c)s::text, p_scope => 'default'::text, p_from_pair => %(f)s::int,"
    " p_source_message_ids => %(ids)s::text[], p_source_hash => %(h)s::text,"
    " p_model => %(model)s::text, p_prompt_version => %(prompt_version)s::text,"
    " p_worker => %(w)s::text)"
)
_SKETCH_COMPLETE = (
    "SELECT ok, reason FROM bench.sketch_complete(p_job_id => %(j)s::bigint,"
    " p_attempt => %(a)s::int, p_summary => %(s)s::text, p_finish_reason => 'stop'::text,"
    " p_tool_call_count => 0::int)"
)
# A slot drawn at random among max_running (1,000 here): the cheapest search there is;
# a taken one is drawn again (ON CONFLICT on the running slots' index).
_LEAN_CLAIM = """
WITH attempt AS (
    INSERT INTO bench.lean_attempts (conversation_id, job_id, attempt, state, worker,
        started_at, lease_expires_at, slot, scope, from_pair, to_pair, source_message_ids,
        source_hash, model, prompt_version, created_at)
    SELECT r.conversation_id, nextval('compaction.jobs_job_id_seq'), 1, 'running', %(w)s,
           now(), now() + interval '5 minutes', %(slot)s, 'default', r.from_pair,
           r.from_pair + 9, r.source_message_ids, r.source_hash, %(model)s,
           %(prompt_version)s, now()
    FROM compaction.ranges AS r
    WHERE r.conversation_id = %(c)s AND r.from_pair = %(f)s
      AND r.source_hash = %(h)s AND r.source_message_ids = %(ids)s::text[]
    ON CONFLICT (slot) WHERE state = 'running' DO NOTHING
    RETURNING job_id)
SELECT attempt.job_id, pg_advisory_xact_lock(1129316352, hashtext(%(c)s)) FROM attempt
"""
_LEAN_COMPLETE = """
UPDATE bench.lean_attempts AS a
SET state = 'completed', reason = 'completed', finished_at = now(), summary = %(s)s::text,
    summary_chars = length(%(s)s::text),
    finish_event_id = nextval('compaction.audit_events_event_id_seq'),
    finish_recorded_at = clock_timestamp(), finish_xact_id = pg_current_xact_id()
WHERE a.conversation_id = %(c)s AND a.job_id = %(j)s AND a.attempt = 1
  AND a.state = 'running' AND a.lease_expires_at > now()
RETURNING a.job_id, pg_advisory_xact_lock(1129316352, hashtext(%(c)s))
"""
_FLOOR_CLAIM = """
WITH job AS (
    INSERT INTO bench.floor_jobs (conversation_id, scope, from_pair, to_pair,
                                  source_message_ids, source_hash, model, prompt_version,
                                  created_at)
    SELECT r.conversation_id, 'default', r.from_pair, r.from_pair + 9, r.source_message_ids,
           r.source_hash, %(model)s, %(prompt_version)s, now()
    FROM compaction.ranges AS r
    WHERE r.conversation_id = %(c)s AND r.from_pair = %(f)s
      AND r.source_hash = %(h)s AND r.source_message_ids = %(ids)s::text[]
    RETURNING *),
slot AS (
    SELECT f.slot FROM bench.floor_admission AS f
    WHERE f.slot <= 1000 AND f.lease_expires_at IS NULL
    ORDER BY f.slot LIMIT 1 FOR UPDATE SKIP LOCKED),
attempt AS (
    INSERT INTO bench.floor_attempts (conversation_id, job_id, attempt, state, worker,
                                      started_at, lease_expires_at, slot)
    SELECT job.conversation_id, job.job_id, 1, 'running', %(w)s, now(),
           now() + interval '5 minutes', slot.slot
    FROM job, slot RETURNING *),
taken AS (
    UPDATE bench.floor_admission AS ad
    SET holder_conversation_id = a.conversation_id, holder_job_id = a.job_id,
        holder_attempt = a.attempt, lease_expires_at = a.lease_expires_at
    FROM attempt AS a
    WHERE ad.slot = a.slot)
-- The conversation's lock is taken for its cost; the engine takes it before the reads.
SELECT job.job_id, pg_advisory_xact_lock(1129316352, hashtext(%(c)s)) FROM job
"""
_FLOOR_COMPLETE = """
WITH reply AS (SELECT %(s)s::text AS summary),
attempt AS (
    UPDATE bench.floor_attempts AS a
    SET state = 'completed', reason = 'completed', finished_at = now(),
        summary_chars = length(reply.summary),
        finish_event_id = nextval('compaction.audit_events_event_id_seq'),
        finish_recorded_at = clock_timestamp(), finish_xact_id = pg_current_xact_id()
    FROM reply
    WHERE a.conversation_id = %(c)s AND a.job_id = %(j)s AND a.attempt = 1
      AND a.state = 'running' AND a.lease_expires_at > now()
    RETURNING *),
summary AS (
    INSERT INTO bench.floor_job_summaries (conversation_id, job_id, attempt, summary,
                                           completed_at)
    SELECT a.conversation_id, a.job_id, a.attempt, reply.summary, a.finished_at
    FROM attempt AS a, reply
    RETURNING *),
verdict AS (
    INSERT INTO bench.floor_summary_verdicts (conversation_id, summary_id, scope,
                                              from_pair, reason)
    SELECT s.conversation_id, s.summary_id, 'default', %(f)s, NULL FROM summary AS s),
freed AS (
    UPDATE bench.floor_admission AS ad
    SET holder_conversation_id = NULL, holder_job_id = NULL, holder_attempt = NULL,
        lease_expires_at = NULL
    FROM attempt AS a
    WHERE ad.slot = a.slot AND ad.holder_conversation_id = a.conversation_id
      AND ad.holder_job_id = a.job_id AND ad.holder_attempt = a.attempt)
SELECT s.summary_id, pg_advisory_xact_lock(1129316352, hashtext(%(c)s)) FROM summary AS s
"""
_BASELINE_START = (
    "INSERT INTO bench.plain_jobs (job_key, state, worker, started_at)"
    " VALUES (%(key)s, 'running', %(worker)s, now())"
)
_BASELINE_FINISH = (
    "WITH done AS (UPDATE bench.plain_jobs SET state = 'completed', finished_at = now()"
    "              WHERE job_key = %(key)s RETURNING job_key)"
    " INSERT INTO bench.plain_results (job_key, summary) SELECT job_key, %(summary)s FROM done"
)


@dataclass(frozen=True, slots=True)
class Range:
    conversation_id: str
    from_pair: int
    source_message_ids: list[str]
    source_hash: str


def pycompactor_cycle(conn: Conn, item: Range, worker: str) -> None:
    claimed = db.claim(conn, item.conversation_id, "default", item.from_pair,
                       item.source_message_ids, item.source_hash, MODEL, PROMPT_VERSION,
                       worker)
    if not claimed.claimed or claimed.job_id is None or claimed.attempt is None:
        raise RuntimeError(f"claim refused ({claimed.reason}): the prepared range is not"
                           " claimable, so the benchmark would measure refusals")
    done = db.complete(conn, claimed.job_id, claimed.attempt, SUMMARY, "stop", 0)
    if not done.ok:
        raise RuntimeError(f"complete refused: {done.reason}")


def _claim_params(item: Range, worker: str) -> dict[str, Any]:
    """The parameters of the floors' and the sketch's claim statements."""
    return {"c": item.conversation_id, "f": item.from_pair, "h": item.source_hash,
            "ids": item.source_message_ids, "model": MODEL,
            "prompt_version": PROMPT_VERSION, "w": worker}


def _floor_cycle(conn: Conn, item: Range, worker: str) -> None:
    job = conn.execute(_FLOOR_CLAIM, _claim_params(item, worker)).fetchone()
    if job is None:
        raise RuntimeError("floor cycle: the prepared range is not current")
    done = conn.execute(_FLOOR_COMPLETE, {"c": item.conversation_id, "j": job[0],
                                          "f": item.from_pair, "s": SUMMARY}).fetchone()
    if done is None:
        raise RuntimeError("floor cycle: the attempt was not running")


def _lean_cycle(conn: Conn, item: Range, worker: str) -> None:
    params = _claim_params(item, worker)
    for _ in range(100):
        job = conn.execute(_LEAN_CLAIM, {**params, "slot": _SLOTS.randint(1, 1000)}).fetchone()
        if job is not None:
            break
    else:
        raise RuntimeError("lean floor cycle: the prepared range is not current")
    done = conn.execute(_LEAN_COMPLETE, {"c": item.conversation_id, "j": job[0],
                                         "s": SUMMARY}).fetchone()
    if done is None:
        raise RuntimeError("lean floor cycle: the attempt was not running")


def _sketch_cycle(conn: Conn, item: Range, worker: str) -> None:
    params = _claim_params(item, worker)
    for _ in range(100):
        row = conn.execute(_SKETCH_CLAIM, params).fetchone()
        assert row is not None
        claimed, reason, job_id, attempt = row
        if claimed:
            break
        if reason != "slot_taken":
            raise RuntimeError(f"lean engine sketch: claim refused ({reason})")
    else:
        raise RuntimeError("lean engine sketch: no free slot in 100 draws")
    done = conn.execute(_SKETCH_COMPLETE, {"j": job_id, "a": attempt, "s": SUMMARY}).fetchone()
    if done is None or not done[0]:
        raise RuntimeError(f"lean engine sketch: complete refused ({done})")


def baseline_cycle(conn: Conn, key: str, worker: str) -> None:
    conn.execute(_BASELINE_START, {"key": key, "worker": worker})
    cur = conn.execute(_BASELINE_FINISH, {"key": key, "summary": SUMMARY})
    if cur.rowcount != 1:
        raise RuntimeError("baseline cycle lost its row")


def _run_parallel(connections: Sequence[Conn], work: Sequence[Sequence[Any]],
                  cycle: Callable[[Conn, Any, str], None]) -> float:
    """Each connection runs its own list of items; returns wall seconds for all of them."""
    barrier = threading.Barrier(len(connections) + 1)
    errors: list[BaseException] = []

    def loop(index: int) -> None:
        conn = connections[index]
        worker = f"bench-{index}"
        barrier.wait()
        try:
            for item in work[index]:
                cycle(conn, item, worker)
        except BaseException as exc:  # surfaced to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True)
               for i in range(len(connections))]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return elapsed


def _next_multixact(conn: Conn) -> int:
    """The server's next MultiXact id, read without a checkpoint (mxid_age counts from
    it). A row locked by two transactions at once takes a MultiXact id; the ids are spent
    for good, and running low on them forces aggressive vacuums of every table."""
    row = conn.execute("SELECT pg_catalog.mxid_age('1'::xid) + 1").fetchone()
    assert row is not None
    return int(row[0])


def _split(items: Sequence[Any], k: int) -> list[list[Any]]:
    return [list(items[i::k]) for i in range(k)]


def prepare_ranges(dsn: str, sizes: Sizes, count: int) -> list[Range]:
    """`count` conversations, each with one claimable range, and those ranges."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Admission is not what is measured: K connections never exceed K running
        # attempts, but leave headroom so a slow commit never turns into a refusal.
        conn.execute("UPDATE compaction.settings SET max_running = 1000")
        # Many conversations of 35 pairs: each has exactly one target (range 0), and K
        # connections never meet on one conversation's advisory lock.
        seed_conversations(conn, "claim-", 0, count, sizes.claim_pairs,
                           user_pool=text_pool(1, 16, 200),
                           assistant_pool=text_pool(2, 32, 600))
        drain_queue(conn)
        # Statistics first: planned without them, judge_runs scans instead of probing.
        vacuum_analyze(dsn)
        targets = [
            Range(str(c), int(f), list(ids), str(h))
            for c, f, ids, h in conn.execute(
                "SELECT c.conversation_id, t.from_pair, t.source_message_ids, t.source_hash"
                " FROM compaction_source.conversations c,"
                "      compaction.plan_targets(c.conversation_id) t"
                " ORDER BY c.conversation_id").fetchall()
        ]
    if len(targets) != count:
        raise RuntimeError(f"expected {count} targets, planned {len(targets)}")
    return targets


def run(dsn: str, sizes: Sizes) -> dict[str, Any]:
    ks = sizes.claim_connections
    per_k = sizes.claim_warmup + REPETITIONS * sizes.claim_cycles
    n_breakdown = max(2, sizes.claim_cycles // 4)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(BASELINE_DDL)
        conn.execute(_FLOOR_DDL)
        conn.execute(_LEAN_DDL)
        conn.execute(_SKETCH_DDL)
    # Each K takes per_k ranges for pycompactor, per_k for the floor, per_k for the lean
    # floor and per_k for the lean engine sketch.
    targets = prepare_ranges(dsn, sizes, 4 * per_k * len(ks) + n_breakdown)

    results: list[dict[str, Any]] = []
    keys = iter(range(10**9))
    for index, k in enumerate(ks):
        mine = targets[4 * index * per_k:(4 * index + 1) * per_k]
        floors = targets[(4 * index + 1) * per_k:(4 * index + 2) * per_k]
        leans = targets[(4 * index + 2) * per_k:(4 * index + 3) * per_k]
        sketches = targets[(4 * index + 3) * per_k:(4 * index + 4) * per_k]
        connections = [psycopg.connect(dsn, autocommit=True, application_name="bench-claims")
                       for _ in range(k)]
        try:
            # Warm-up: caches, plans and connections, for both cycles.
            _run_parallel(connections, _split(mine[:sizes.claim_warmup], k), pycompactor_cycle)
            _run_parallel(connections,
                          _split([f"warm-{next(keys)}" for _ in range(sizes.claim_warmup)], k),
                          baseline_cycle)
            _run_parallel(connections, _split(floors[:sizes.claim_warmup], k), _floor_cycle)
            _run_parallel(connections, _split(leans[:sizes.claim_warmup], k), _lean_cycle)
            _run_parallel(connections, _split(sketches[:sizes.claim_warmup], k), _sketch_cycle)
            ours: list[float] = []
            plain: list[float] = []
            floor: list[float] = []
            lean: list[float] = []
            sketch: list[float] = []
            multixacts = 0
            for rep in range(REPETITIONS):
                start = sizes.claim_warmup + rep * sizes.claim_cycles
                batch = mine[start:start + sizes.claim_cycles]
                sides: list[tuple[list[float], Sequence[Any], Callable[[Conn, Any, str], None]]]
                sides = [
                    (ours, batch, pycompactor_cycle),
                    (plain, [f"job-{next(keys)}" for _ in range(sizes.claim_cycles)],
                     baseline_cycle),
                    (floor, floors[start:start + sizes.claim_cycles], _floor_cycle),
                    (lean, leans[start:start + sizes.claim_cycles], _lean_cycle),
                    (sketch, sketches[start:start + sizes.claim_cycles], _sketch_cycle),
                ]
                for sink, items, cycle in rotated(sides, rep):
                    mine_now = sink is ours
                    before = _next_multixact(connections[0]) if mine_now else 0
                    seconds = _run_parallel(connections, _split(items, k), cycle)
                    if mine_now:
                        multixacts += _next_multixact(connections[0]) - before
                    sink.append(len(items) / seconds)
        finally:
            for conn in connections:
                conn.close()
        results.append({
            "connections": k,
            "cycles_per_rep": sizes.claim_cycles,
            "pycompactor_cycles_per_s": ours,
            "baseline_cycles_per_s": plain,
            "pycompactor_median": median(ours),
            "baseline_median": median(plain),
            "ratio": ratio(median(ours), median(plain)),
            "floor_cycles_per_s": floor,
            "floor_median": median(floor),
            "floor_ratio": ratio(median(floor), median(plain)),
            "ratio_to_floor": ratio(median(ours), median(floor)),
            "lean_floor_cycles_per_s": lean,
            "lean_floor_median": median(lean),
            "lean_floor_ratio": ratio(median(lean), median(plain)),
            "sketch_cycles_per_s": sketch,
            "sketch_median": median(sketch),
            "sketch_ratio": ratio(median(sketch), median(plain)),
            "multixacts_per_1000_cycles": round(
                multixacts * 1000 / (REPETITIONS * sizes.claim_cycles)),
        })
    return {"runs": results, "breakdown": _breakdown(dsn, targets[-n_breakdown:])}


def _breakdown(dsn: str, items: Sequence[Range]) -> dict[str, Any]:
    """p50 ms of each statement of both cycles on one connection, and of plan_targets alone
    (what claim re-derives to check the range is a current target with that source)."""
    timings: dict[str, list[float]] = {}

    def clock(name: str, started: float) -> None:
        timings.setdefault(name, []).append((time.perf_counter() - started) * 1000)

    with psycopg.connect(dsn, autocommit=True, application_name="bench-claims") as conn:
        for n, item in enumerate(items):
            started = time.perf_counter()
            conn.execute("SELECT count(*) FROM compaction.plan_targets(%s)",
                         (item.conversation_id,)).fetchone()
            clock("plan_targets", started)
            started = time.perf_counter()
            claimed = db.claim(conn, item.conversation_id, "default", item.from_pair,
                               item.source_message_ids, item.source_hash, MODEL,
                               PROMPT_VERSION, "bench-breakdown")
            clock("claim", started)
            if claimed.job_id is None or claimed.attempt is None:
                raise RuntimeError(f"claim refused ({claimed.reason})")
            started = time.perf_counter()
            db.complete(conn, claimed.job_id, claimed.attempt, SUMMARY, "stop", 0)
            clock("complete", started)
            started = time.perf_counter()
            conn.execute(_BASELINE_START, {"key": f"breakdown-{n}", "worker": "bench"})
            clock("baseline_insert", started)
            started = time.perf_counter()
            conn.execute(_BASELINE_FINISH, {"key": f"breakdown-{n}", "summary": SUMMARY})
            clock("baseline_update_insert", started)
    return {"connections": 1, "cycles": len(items),
            "p50_ms": {name: median(v) for name, v in timings.items()}}
