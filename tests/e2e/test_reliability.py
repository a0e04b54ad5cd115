"""Faults under load: database restarts, and a connection cut while `complete` commits.

Restarting a cluster breaks every connection to it, so the tests that restart or
reconfigure the server run on a throwaway cluster of their own (module-scoped), never on
the session cluster other tests share. Synchronisation is on threading events set by
the scripted model server, the workers' JSON logs and the database state; never sleeps.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pycompactor import db, schema
from pycompactor.cli.cluster import ThrowawayCluster
from pycompactor.errors import PycompactorError, from_driver
from pycompactor.worker.connections import Connections
from tests.history import History
from tests.modelserver import ModelServer, RecordedRequest, ScriptedResponse, hang, stop
from tests.workerkit import (
    MODEL,
    WorkerProcess,
    attempts,
    events_named,
    seed,
    source_digest,
    summaries,
    wait_for,
    worker_env,
)

Conn = psycopg.Connection[Any]


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[ThrowawayCluster]:
    with ThrowawayCluster() as cluster:
        yield cluster


@pytest.fixture
def own_dsn(own_cluster: ThrowawayCluster) -> str:
    """A fresh migrated database on the throwaway cluster."""
    name = f"r_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(own_cluster.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = own_cluster.dsn.replace("dbname=postgres", f"dbname={name}")
    schema.upgrade(dsn)
    return dsn


def _audit_kinds(conn: Conn) -> Counter[str]:
    return Counter(k for (k,) in conn.execute("SELECT kind FROM compaction.audit_events"))


# --- 1. database restarts ---------------------------------------------------------------


class RestartingModel:
    """Answers every request, but request number N of each threshold (and every request
    after it) waits until the test has restarted the database: the restart then always
    hits claimed attempts whose model call is in flight."""

    def __init__(self, thresholds: tuple[int, ...]) -> None:
        self.thresholds = thresholds
        self.reached = [threading.Event() for _ in thresholds]
        self.restarted = [threading.Event() for _ in thresholds]
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, request: RecordedRequest) -> ScriptedResponse:
        with self._lock:
            self.count += 1
            n = self.count
        for i, threshold in enumerate(self.thresholds):
            if n >= threshold and not self.restarted[i].is_set():
                self.reached[i].set()
                self.restarted[i].wait(120)
        # The call's number in letters: a summary stating a figure no reply holds fails
        # (figures_invented, contract §8), and this test is about restarts.
        return stop(f"Summary number {''.join(chr(ord('a') + int(d)) for d in str(n))}.")

    def release_all(self) -> None:
        for event in self.restarted:
            event.set()


def test_four_workers_survive_two_database_restarts(own_cluster: ThrowawayCluster,
                                                    own_dsn: str) -> None:
    """4 worker processes over 40 conversations while the cluster restarts twice (fast
    mode, in-flight model calls each time): workers reconnect with bounded backoff and
    finish; every target completed (or exhausted: at most 2 attempts); never two
    summaries for an identity; no attempt left running past its lease."""
    lease = 4.0
    with psycopg.connect(own_dsn, autocommit=True) as conn:
        h = History(conn)
        for c in range(40):
            h.pairs(f"conv-{c:02d}", 30)
        before = source_digest(conn)
        start_time = conn.execute("SELECT pg_postmaster_start_time()").fetchone()

    model = RestartingModel((8, 24))
    server = ModelServer(handler=model)
    server.start()
    env = worker_env(own_dsn, server.base_url)
    workers = [WorkerProcess("--model", MODEL, "--concurrency", "2", "--poll-seconds", "0.2",
                             "--lease-seconds", str(lease), env=env) for _ in range(4)]
    try:
        # A worker announces its start once connected (contract §12): one that cannot reach
        # the database at start exits. The restarts hit workers that are running.
        for w in workers:
            w.wait_event("started", timeout=60)
        for reached, restarted in zip(model.reached, model.restarted, strict=True):
            assert reached.wait(90), [w.stderr[-2000:] for w in workers]
            own_cluster.restart()
            restarted.set()
        with psycopg.connect(own_dsn, autocommit=True) as conn:
            def settled() -> bool:
                rows = conn.execute(
                    "SELECT count(*) FILTER (WHERE s.summary_id IS NOT NULL"
                    "   OR (SELECT count(*) FROM compaction.attempts a WHERE"
                    "       a.conversation_id = j.conversation_id AND a.job_id = j.job_id"
                    "       AND a.state = 'failed') = 2),"
                    " (SELECT count(*) FROM compaction.attempts WHERE state = 'running')"
                    " FROM compaction.jobs j LEFT JOIN compaction.job_summaries s"
                    "   USING (conversation_id, job_id)").fetchone()
                assert rows is not None
                return bool(rows[0] == 40 and rows[1] == 0)

            wait_for(settled, timeout=120, what="every target settled, nothing running")
        for w in workers:
            w.proc.send_signal(signal.SIGTERM)
        codes = [w.wait() for w in workers]
    finally:
        model.release_all()
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        server.stop()
    logs = [w.stderr[-3000:] for w in workers]
    assert codes == [0, 0, 0, 0], logs
    assert server.errors == []

    with psycopg.connect(own_dsn, autocommit=True) as conn:
        # Two restarts really happened.
        assert conn.execute("SELECT pg_postmaster_start_time()").fetchone() != start_time
        rows = attempts(conn)
        by_identity = Counter((a.job_id) for a in rows)
        assert len(by_identity) == 40
        assert max(by_identity.values()) <= 2
        completed = {a.job_id for a in rows if a.state == "completed"}
        exhausted = {j for j, n in by_identity.items()
                     if n == 2 and j not in completed}
        assert len(completed) + len(exhausted) == 40
        got = summaries(conn)
        assert len(got) == len(completed)
        assert len({(c, f) for c, f, _ in got}) == len(got)  # never two per identity
        assert not [a for a in rows if a.state == "running"]
        # Attempts the restarts orphaned were expired by the reaper soon after their lease.
        late = conn.execute(
            "SELECT count(*) FROM compaction.attempts WHERE reason = 'lease_expired'"
            " AND finished_at > lease_expires_at + interval '20 seconds'").fetchone()
        assert late == (0,)
        assert source_digest(conn) == before
        kinds = _audit_kinds(conn)
        assert kinds["claim"] == len(rows)
        assert kinds["completion"] == len(completed)
    events = [e for w in workers for e in w.events()]
    # The restarts hit the workers, and they came back with bounded backoff.
    assert list(events_named(events, "db_error")) or list(events_named(events,
                                                                       "record_retry"))
    assert all(e["retry_in_seconds"] <= 30 for e in events_named(events, "db_error"))
    assert len(list(events_named(events, "completed"))) == len(completed)


# --- 2. the connection cut during complete ----------------------------------------------



def _backend_waiting(admin: Conn, dbname: str, wait_event: str, query: str) -> int | None:
    row = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s"
        " AND application_name = 'pycompactor' AND wait_event = %s AND query LIKE %s",
        (dbname, wait_event, query)).fetchone()
    return None if row is None else int(row[0])


def _pid_when_waiting(admin: Conn, dbname: str, wait_event: str, query: str) -> int:
    """The worker backend waiting on `wait_event` in a statement LIKE `query`."""
    found: list[int] = []

    def waiting() -> bool:
        pid = _backend_waiting(admin, dbname, wait_event, query)
        if pid is not None:
            found.append(pid)
        return pid is not None

    wait_for(waiting, timeout=30, what=f"complete waiting on {wait_event}")
    return found[0]


def _call_failing_with(pool: Connections, error: psycopg.Error) -> db.Connection:
    """Lend a connection to a call that fails with the server's `error` (as db wraps it);
    the connection lent."""
    lent: list[db.Connection] = []
    with pytest.raises(PycompactorError), pool.get() as conn:  # noqa: PT012
        lent.append(conn)
        raise from_driver(error) from error
    return lent[0]


@pytest.mark.parametrize("server_error", [
    psycopg.errors.AdminShutdown, psycopg.errors.IdleSessionTimeout,
    psycopg.errors.ConnectionFailure])
def test_a_call_that_lost_its_session_never_lends_its_connection_again(
        dsn: str, server_error: type[psycopg.Error]) -> None:
    """A call that ended in an error saying the server ended the session drops its
    connection, even when libpq has not read the socket's end yet (the connection still
    looks usable): lent again, it would fail the next call, the record_retry's re-send
    included."""
    pool = Connections(lambda: db.connect(dsn))
    with pool.get() as first:
        pass
    assert _call_failing_with(pool, server_error("the session ended")) is first
    assert first.closed
    with pool.get() as conn:
        assert conn is not first
        assert conn.execute("SELECT 1").fetchone() == (1,)
        second = conn
    # A statement cancelled by its timeout leaves the session usable: it is lent again.
    cancelled = psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
    assert _call_failing_with(pool, cancelled) is second
    with pool.get() as conn:
        assert conn is second
    pool.close_all()


def test_backend_terminated_while_complete_waits(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """complete's backend is terminated while it waits for the conversation's lock (held
    by a second session): the worker re-sends complete with the same (job_id, attempt)
    on a new connection; the summary is recorded once, the model called once."""
    seed(conn, "conv-1", 30)
    before = source_digest(conn)
    model_server.enqueue(hang(stop("Summary after the cut.")))
    proc = WorkerProcess("--once", "--model", MODEL, "--lock-timeout-seconds", "60",
                         env=worker_env(dsn, model_server.base_url))
    with proc, psycopg.connect(dsn) as holder:
        assert model_server.hanging.wait(30), proc.stderr
        holder.execute("SELECT compaction.lock_conversation('conv-1')")
        model_server.release()
        # lock_conversation takes a row lock: the waiter waits for the holder's transaction
        pid = _pid_when_waiting(conn, conn.info.dbname, "transactionid",
                                "%compaction.complete(%")
        assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        holder.rollback()  # the hung session goes away; the re-send gets the lock
        assert proc.wait() == 0, proc.stderr
    events = proc.events()
    [done] = events_named(events, "completed")
    # Every re-send carries the fencing token of the one claim. How many there are is the
    # client's timing: the server's FATAL may be read before the socket's end or with it.
    retries = list(events_named(events, "record_retry"))
    assert retries, events
    assert {(r["job_id"], r["attempt"]) for r in retries} == {
        (done["job_id"], done["attempt"])}, events
    [row] = attempts(conn, "conv-1")
    assert (row.attempt, row.state) == (1, "completed")
    assert summaries(conn, "conv-1") == [("conv-1", 0, "Summary after the cut.")]
    summary_id = conn.execute("SELECT summary_id FROM compaction.summaries").fetchone()
    assert summary_id == (done["summary_id"],)
    assert len(model_server.requests) == 1
    assert _audit_kinds(conn) == Counter({"claim": 1, "completion": 1})

    # complete is idempotent for the same token and text, and refuses any other text.
    again = db.complete(conn, done["job_id"], 1, "Summary after the cut.", "stop", 0)
    assert (again.ok, again.reason, again.summary_id) == (True, "completed", done["summary_id"])
    other = db.complete(conn, done["job_id"], 1, "A different summary.", "stop", 0)
    assert (other.ok, other.reason, other.summary_id) == (False, "lease_lost", None)
    assert summaries(conn, "conv-1") == [("conv-1", 0, "Summary after the cut.")]
    assert _audit_kinds(conn) == Counter({"claim": 1, "completion": 1})
    assert [(a.attempt, a.state) for a in attempts(conn, "conv-1")] == [(1, "completed")]
    assert source_digest(conn) == before


def _wait_until_commits_wait_for_a_standby(admin: Conn) -> None:
    """pg_reload_conf() only signals: commits wait for the standby once the new setting
    has reached every process (the checkpointer publishes it). A worker call is one round
    trip, so complete may commit before that unless we wait: probe with a committed
    write of our own until it is seen waiting (SyncRep), then cancel that wait (its
    commit stands; the server logs the cancel, not a termination)."""
    with psycopg.connect(admin.info.dsn, autocommit=True) as probe:
        pid = probe.info.backend_pid

        def waits() -> bool:
            writer = threading.Thread(
                target=probe.execute, args=("INSERT INTO sync_probe VALUES (1)",))
            writer.start()
            try:
                for _ in range(20):
                    if _backend_waiting_pid(admin, pid, "SyncRep"):
                        admin.execute("SELECT pg_cancel_backend(%s)", (pid,))
                        return True
                    if not writer.is_alive():
                        return False
                    writer.join(0.05)
                return False
            finally:
                writer.join(30)

        wait_for(waits, timeout=30, what="commits waiting for the synchronous standby")


def _backend_waiting_pid(admin: Conn, pid: int, wait_event: str) -> bool:
    row = admin.execute("SELECT wait_event = %s FROM pg_stat_activity WHERE pid = %s",
                        (wait_event, pid)).fetchone()
    return bool(row and row[0])


def test_commit_landed_but_reply_lost(own_cluster: ThrowawayCluster, own_dsn: str,
                                      model_server: ModelServer) -> None:
    """The backend dies after complete's COMMIT is durable locally but before the worker
    hears back (it waits for a synchronous standby that never comes, and is terminated
    there): the worker re-sends complete and gets the same summary_id."""
    admin_dsn = own_cluster.dsn
    with psycopg.connect(own_dsn, autocommit=True) as conn, \
            psycopg.connect(admin_dsn, autocommit=True) as admin:
        seed(conn, "conv-1", 30)
        model_server.enqueue(hang(stop("Committed before the cut.")))
        proc = WorkerProcess("--once", "--model", MODEL,
                             env=worker_env(own_dsn, model_server.base_url))
        try:
            with proc:
                assert model_server.hanging.wait(30), proc.stderr
                # From now on every commit waits for a standby that does not exist.
                admin.execute("CREATE TABLE IF NOT EXISTS sync_probe (x int)")
                admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'no_such_standby'")
                admin.execute("SELECT pg_reload_conf()")
                _wait_until_commits_wait_for_a_standby(admin)
                model_server.release()
                # The only writer now: complete's transaction, committing at the Sync
                # that ends its pipeline (the activity still shows complete's statement).
                pid = _pid_when_waiting(admin, conn.info.dbname, "SyncRep",
                                        "%compaction.complete(%")
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
                admin.execute("SELECT pg_reload_conf()")
                assert proc.wait() == 0, proc.stderr
        finally:
            admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
            admin.execute("SELECT pg_reload_conf()")
        events = proc.events()
        assert list(events_named(events, "record_retry")), proc.stderr
        [done] = events_named(events, "completed")
        [(summary_id, text)] = conn.execute(
            "SELECT summary_id, summary FROM compaction.summaries").fetchall()
        assert (done["summary_id"], text) == (summary_id, "Committed before the cut.")
        assert [(a.attempt, a.state) for a in attempts(conn, "conv-1")] == [(1, "completed")]
        assert _audit_kinds(conn) == Counter({"claim": 1, "completion": 1})
        assert len(model_server.requests) == 1
    # The first COMMIT was durable before the cut: the server said so as it died.
    assert own_cluster.root is not None
    log = Path(own_cluster.root / "server.log").read_text(errors="replace")
    assert ("canceling the wait for synchronous replication and terminating connection"
            " due to administrator command") in log
    assert "already committed locally" in log


# --- 3. the log stream breaks -----------------------------------------------------------


class LogPipeWorker:
    """`pycompactor worker` whose stderr (its log) is a pipe the test reads as `head -1`
    does: the first line, then the read end is closed while the worker still runs."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pycompactor", "worker", "--log-format", "json", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stderr is not None
        self.first_line = self.proc.stderr.readline()

    def close_log(self) -> None:
        assert self.proc.stderr is not None
        self.proc.stderr.close()

    def __enter__(self) -> LogPipeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_sigterm_after_the_log_pipe_closed_records_interrupted(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """The reader of the worker's log goes away (`worker ... 2>&1 | head -1`) while the
    model call hangs; then SIGTERM. The worker still drains and records the attempt
    `interrupted` (docs/cli.md), and exits 1: its log is lost, which is a failure."""
    seed(conn, "conv-d", 30)
    model_server.enqueue(hang(stop("Never recorded.")))
    with LogPipeWorker("--once", "--conversation", "conv-d", "--model", MODEL,
                       "--drain-seconds", "0.5",
                       env=worker_env(dsn, model_server.base_url)) as worker:
        assert json.loads(worker.first_line)["event"] == "started"
        assert model_server.hanging.wait(30)  # claimed: the model call is in flight
        worker.close_log()
        worker.proc.send_signal(signal.SIGTERM)
        assert worker.proc.wait(timeout=60) == 1
    [row] = attempts(conn, "conv-d")
    assert (row.attempt, row.state, row.reason) == (1, "failed", "interrupted")
    assert summaries(conn, "conv-d") == []


def test_a_worker_whose_log_pipe_closed_finishes_what_it_holds_and_exits_1(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """Two targets, one model call at a time; the log's reader goes away during the first
    call, which then completes. Writing that result's event finds the pipe broken: the
    worker claims nothing more (the second target is put back on the queue), its heartbeats
    stop with it, and it exits 1 by itself, never hanging on to a claim."""
    seed(conn, "conv-d", 40)
    model_server.enqueue(hang(stop("Completed while the log was gone.")))
    with LogPipeWorker("--once", "--conversation", "conv-d", "--model", MODEL,
                       "--concurrency", "1",
                       env=worker_env(dsn, model_server.base_url)) as worker:
        assert json.loads(worker.first_line)["event"] == "started"
        assert model_server.hanging.wait(30)
        worker.close_log()
        model_server.release()
        assert worker.proc.wait(timeout=60) == 1
    assert [(a.from_pair, a.attempt, a.state) for a in attempts(conn, "conv-d")] == [
        (0, 1, "completed")]
    assert summaries(conn, "conv-d") == [("conv-d", 0, "Completed while the log was gone.")]
    assert [e.conversation_id for e in db.dequeue(conn, 10)] == ["conv-d"]
    assert len(model_server.requests) == 1
