"""Soak: workers under a steady rain of faults; the invariants must hold at the end.

    python -m bench.soak                       # 2,000 conversations, 4 workers, 10 minutes
    python -m bench.soak --duration 120        # a quick run

A throwaway cluster, 2,000 conversations of 30 pairs (one target each), 4 `pycompactor
worker` processes (concurrency 2, so 8 model calls in flight, the default admission cap)
against a loopback chat-completions server whose latency is chosen so the work lasts
about the whole run: every fault hits work in flight. Every --fault-every seconds one
fault, in rotation: SIGKILL a worker (a replacement starts at once), terminate every
worker backend (pg_terminate_backend), restart the server (pg_ctl restart -m fast).
After the fault window the workers settle, without faults, until no target is left
queued or running (at least three leases, so killed workers' attempts expire and are
reaped by the survivors; at most --settle seconds), then get SIGTERM.

Prints completed / exhausted / pending (unqueued) / duplicates / stuck-running counts and
exits 1 unless duplicates, stuck-running and unqueued (a pending target neither queued nor
running: no worker would find it without --sweep) are all zero. Not a CI test
(docs/reliability.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psycopg

from pycompactor import schema
from pycompactor.cli.cluster import ThrowawayCluster
from tests.modelserver import ModelServer, RecordedRequest, ScriptedResponse, stop

MODEL = "soak-model"
FAULTS = ("kill_worker", "terminate_backends", "restart_server")


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    path: Path


class SlowModel:
    """Answers each request after a deterministic latency in [0.5, 1.5] x the mean."""

    def __init__(self, mean_seconds: float) -> None:
        self.mean = mean_seconds
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, request: RecordedRequest) -> ScriptedResponse:
        with self._lock:
            self.count += 1
            n = self.count
        # Simulated model latency, not synchronisation: the answer does not depend on it.
        time.sleep(self.mean * (0.5 + (n * 7919 % 101) / 100))
        return stop(f"Soak summary {n}: the replies compared fund NAVs and dates.")


def seed(conn: psycopg.Connection[Any], conversations: int) -> None:
    """conversations x 30 pairs in one statement per table; the trigger enqueues them."""
    conn.execute("""
        INSERT INTO compaction_source.conversations
        SELECT 'soak-' || lpad(c::text, 5, '0') FROM generate_series(1, %(n)s) c;
        INSERT INTO compaction_source.runs (run_id, conversation_id, status)
        SELECT 'soak-' || lpad(c::text, 5, '0') || '-r' || p, 'soak-' || lpad(c::text, 5, '0'),
               'completed'
        FROM generate_series(1, %(n)s) c, generate_series(1, 30) p;
        INSERT INTO compaction_source.messages
            (message_id, conversation_id, run_id, role, status, content, seq)
        SELECT 'soak-' || lpad(c::text, 5, '0') || '-' || role || p,
               'soak-' || lpad(c::text, 5, '0'), 'soak-' || lpad(c::text, 5, '0') || '-r' || p,
               role, 'completed',
               role || ' ' || p || ': fund F' || p || ' had a NAV of ' || (10 + p) || '.25 USD.',
               2 * p + (role = 'assistant')::int
        FROM generate_series(1, %(n)s) c, generate_series(1, 30) p,
             unnest(ARRAY['user', 'assistant']) role;
    """.replace("%(n)s", str(int(conversations))))


def start_worker(dsn: str, base_url: str, logdir: Path, n: int, lease: float) -> Worker:
    path = logdir / f"worker-{n:03d}.log"
    log = path.open("wb")
    env = {**os.environ, "PYCOMPACTOR_DSN": dsn, "OPENAI_BASE_URL": base_url,
           "OPENAI_API_KEY": "soak-key"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pycompactor", "worker", "--model", MODEL, "--concurrency",
         "2", "--lease-seconds", str(lease), "--poll-seconds", "0.5", "--log-format", "json"],
        stdout=subprocess.DEVNULL, stderr=log, env=env)
    return Worker(proc, log, path)


def counts(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    def one(query: str) -> int:
        row = conn.execute(query).fetchone()
        return int(row[0]) if row is not None else 0

    return {
        "targets": one("SELECT count(*) FROM compaction_source.conversations"),
        "completed": one("SELECT count(DISTINCT (conversation_id, job_id))"
                         " FROM compaction.job_summaries"),
        "exhausted": one("SELECT count(*) FROM compaction.audit_exhausted"),
        # Two summaries of one identity, or of one range at all (the source never changes
        # here, so one range is one identity).
        "duplicates": one("SELECT count(*) FROM (SELECT 1 FROM compaction.job_summaries"
                          " GROUP BY conversation_id, job_id HAVING count(*) > 1) d")
        + one("SELECT count(*) FROM (SELECT 1 FROM compaction.summaries"
              " GROUP BY conversation_id, scope, from_pair HAVING count(*) > 1) d"),
        "running": one("SELECT count(*) FROM compaction.attempts WHERE state = 'running'"),
        "stuck_running": one("SELECT count(*) FROM compaction.attempts"
                             " WHERE state = 'running' AND lease_expires_at < now()"),
        "queued": one("SELECT count(*) FROM compaction.queue"),
        # of which a worker holds right now (leased entries stay queued until acknowledged)
        "leased": one("SELECT count(*) FROM compaction.queue WHERE leased_until > now()"),
        "attempts": dict(Counter(
            f"{a}:{s}:{r}" for a, s, r in conn.execute(
                "SELECT attempt, state, coalesce(reason, '') FROM compaction.attempts"))),
    }


def pending(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(pending, of which neither queued nor running): targets not completed nor
    exhausted; the second kind no worker will find again without --sweep."""
    row = conn.execute("""
        SELECT count(*),
               count(*) FILTER (WHERE NOT EXISTS (
                   SELECT 1 FROM compaction.queue q WHERE q.conversation_id = c.conversation_id)
                 AND NOT EXISTS (
                   SELECT 1 FROM compaction.attempts a
                   WHERE a.conversation_id = c.conversation_id AND a.state = 'running'))
        FROM compaction_source.conversations c
        WHERE NOT EXISTS (SELECT 1 FROM compaction.job_summaries s
                          WHERE s.conversation_id = c.conversation_id)
          AND NOT EXISTS (SELECT 1 FROM compaction.audit_exhausted e
                          WHERE e.conversation_id = c.conversation_id)
    """).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0,
                        help="fault window in seconds (default: 600)")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--fault-every", type=float, default=30.0)
    parser.add_argument("--lease", type=float, default=10.0, help="worker --lease-seconds")
    parser.add_argument("--settle", type=float, default=300.0,
                        help="most seconds to let the workers finish after the faults")
    parser.add_argument("--model-latency", type=float, default=None,
                        help="mean seconds per model call (default: the work lasts the run)")
    args = parser.parse_args(argv)
    in_flight = 2 * args.workers
    latency = args.model_latency if args.model_latency is not None else max(
        0.05, 0.9 * in_flight * args.duration / args.conversations)
    min_settle = 3 * args.lease

    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {message}", flush=True)

    logdir = Path(tempfile.mkdtemp(prefix="pycompactor-soak-"))
    model = SlowModel(latency)
    with ThrowawayCluster() as cluster, ModelServer(handler=model) as server:
        dsn = cluster.dsn
        schema.upgrade(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            seed(conn, args.conversations)
        say(f"{args.conversations} conversations seeded; model latency ~{latency:.2f}s, "
            f"lease {args.lease}s, a fault every {args.fault_every}s for {args.duration}s; "
            f"logs in {logdir}")
        spawned = 0
        workers: list[Worker] = []
        for _ in range(args.workers):
            workers.append(start_worker(dsn, server.base_url, logdir, spawned, args.lease))
            spawned += 1
        faults: Counter[str] = Counter()
        deadline = time.monotonic() + args.duration
        next_fault = time.monotonic() + args.fault_every
        k = 0
        try:
            while time.monotonic() < deadline:
                time.sleep(max(0.0, min(next_fault, deadline) - time.monotonic()))
                if time.monotonic() >= deadline:
                    break
                fault = FAULTS[k % len(FAULTS)]
                if fault == "kill_worker":
                    victim = workers[k % len(workers)]
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait()
                    victim.log.close()
                    workers[k % len(workers)] = start_worker(dsn, server.base_url, logdir,
                                                             spawned, args.lease)
                    spawned += 1
                elif fault == "terminate_backends":
                    with psycopg.connect(dsn, autocommit=True) as conn:
                        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                     " WHERE application_name = 'pycompactor'")
                else:
                    cluster.restart()
                faults[fault] += 1
                k += 1
                with psycopg.connect(dsn, autocommit=True) as conn:
                    c = counts(conn)
                say(f"fault {k}: {fault}; completed {c['completed']}, exhausted "
                    f"{c['exhausted']}, running {c['running']}, queued {c['queued']}, "
                    f"model calls {model.count}")
                next_fault += args.fault_every
            say(f"fault window over; settling for {min_settle:.0f}s to {args.settle:.0f}s")
            settled_at = time.monotonic() + min_settle
            give_up = time.monotonic() + max(min_settle, args.settle)
            while time.monotonic() < give_up:
                time.sleep(1.0)  # polling the database state, not synchronising on time
                with psycopg.connect(dsn, autocommit=True) as conn:
                    waiting, unqueued = pending(conn)
                    running = counts(conn)["running"]
                if time.monotonic() >= settled_at and running == 0 and waiting == unqueued:
                    break
            say(f"settled: {waiting} pending ({unqueued} unqueued), {running} running")
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.proc.send_signal(signal.SIGTERM)
            codes = []
            for w in workers:
                try:
                    codes.append(w.proc.wait(timeout=60))
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    codes.append(w.proc.wait())
                w.log.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            result = counts(conn)
            result["pending"], result["unqueued"] = pending(conn)
        events: Counter[str] = Counter()
        for path in sorted(logdir.glob("worker-*.log")):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    events[json.loads(line).get("event", "?")] += 1
                except ValueError:
                    events["unparsed"] += 1
        result.update(faults=dict(faults), worker_exit_codes=codes, model_calls=model.count,
                      workers_started=spawned, events=dict(events),
                      seconds=round(time.monotonic() - started, 1))
    print(json.dumps(result, indent=1, sort_keys=True))
    print(f"completed {result['completed']} / exhausted {result['exhausted']} / pending "
          f"{result['pending']} (unqueued {result['unqueued']}) / duplicates "
          f"{result['duplicates']} / stuck-running {result['stuck_running']} "
          f"(running {result['running']})")
    ok = (result["duplicates"] == 0 and result["stuck_running"] == 0 and result["running"] == 0
          and result["unqueued"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
