"""The read path on a hot standby: a real streaming replica of the test cluster.

pg_basebackup copies the running test cluster into a new directory (with a replication
slot, `-R` writes standby.signal and primary_conninfo), a second server starts on it as
a hot standby on another port, and the tests compact on the primary, wait until the
standby has replayed the primary's WAL position (polled with a deadline), and check
that `project_history`, the `plan`/`project`/`audit` commands and the Agents SDK
session's read connection give on the standby exactly what they give on the primary. A
standby refuses every write and every temporary object, so working there is the proof
that the read path needs neither. The standby and its slot are removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor import aproject_history, db, project_history
from pycompactor.cli.cluster import free_port, server_user
from pycompactor.integrations.openai_agents import PycompactorSession
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from tests.conftest import wait_until_accepting
from tests.e2e.cli import run_cli
from tests.history import History
from tests.workerkit import attempts, run_worker_cli, seed, worker_env

Conn = psycopg.Connection[Any]
REPLAY_DEADLINE_SECONDS = 60.0


@dataclass(frozen=True)
class Standby:
    primary_dsn: str
    dsn: str
    port: int


def _run_as_server_user(*command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    user = server_user()
    result = subprocess.run(
        list(command), cwd=cwd, capture_output=True, text=True, check=False, timeout=300,
        user=user, group=None if user is None else pwd.getpwnam(user).pw_gid,
        extra_groups=None if user is None else [],
        env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
    )
    assert result.returncode == 0, (command, result.stdout, result.stderr)
    return result


def _dbname(dsn: str) -> str:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert isinstance(name, str)
    return name


@pytest.fixture
def standby(postgresql_proc: PostgreSQLExecutor, pg_bindir: Path, pg_workdir: Path,
            admin_dsn: str, dsn: str) -> Iterator[Standby]:
    """A hot standby of the test cluster, streaming from it, for this test only."""
    with psycopg.connect(admin_dsn) as admin:
        settings: dict[str, str] = dict(admin.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN"
            " ('wal_level', 'max_wal_senders', 'max_connections')").fetchall())
    # What streaming needs from the primary (PostgreSQL's defaults; the fixture keeps them).
    assert settings["wal_level"] in {"replica", "logical"}, settings
    assert int(settings["max_wal_senders"]) >= 2, settings
    slot = f"pycompactor_test_{uuid.uuid4().hex[:8]}"
    datadir = pg_workdir / f"standby-{slot}"
    port = free_port()
    pg_ctl = str(pg_bindir / "pg_ctl")
    started = False
    try:
        # -R: standby.signal plus primary_conninfo/primary_slot_name; a permanent slot so
        # the primary keeps the WAL the standby has not received yet.
        _run_as_server_user(
            str(pg_bindir / "pg_basebackup"), "-h", postgresql_proc.host,
            "-p", str(postgresql_proc.port), "-U", "postgres", "-D", str(datadir),
            "-X", "stream", "-R", "--checkpoint=fast", "-C", "-S", slot, "--no-sync",
            cwd=pg_workdir)
        # A hot standby needs at least the primary's max_connections.
        _run_as_server_user(
            pg_ctl, "start", "-w", "-D", str(datadir), "-l", str(datadir / "standby.log"),
            "-o", f"-p {port} -k {pg_workdir} -c listen_addresses=127.0.0.1"
                  f" -c hot_standby=on -c max_connections={settings['max_connections']}",
            cwd=pg_workdir)
        started = True
        standby_dsn = f"host=127.0.0.1 port={port} user=postgres dbname={_dbname(dsn)}"
        wait_until_accepting(standby_dsn)
        with psycopg.connect(standby_dsn) as conn:
            assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        yield Standby(dsn, standby_dsn, port)
    finally:
        if started:
            _run_as_server_user(pg_ctl, "stop", "-w", "-m", "fast", "-D", str(datadir),
                                cwd=pg_workdir)
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_drop_replication_slot(slot_name) FROM"
                          " pg_replication_slots WHERE slot_name = %s", (slot,))
        shutil.rmtree(datadir, ignore_errors=True)
    assert not datadir.exists()


def wait_for_replay(standby: Standby) -> str:
    """Until the standby has replayed everything the primary has written so far."""
    with psycopg.connect(standby.primary_dsn, autocommit=True) as primary:
        row = primary.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        target = str(row[0])
    deadline = time.monotonic() + REPLAY_DEADLINE_SECONDS
    with psycopg.connect(standby.dsn, autocommit=True) as replica:
        while True:
            done = replica.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn",
                                   (target,)).fetchone()
            if done == (True,):
                return target
            assert time.monotonic() < deadline, f"standby did not replay {target} in time"
            time.sleep(0.05)  # replay progress of another server: polled, with a deadline


def compacted(conn: Conn, dsn: str) -> None:
    """45 pairs of conv-r, compacted on the primary by a worker pass: two summaries."""
    seed(conn, "conv-r", 45)
    code, _events, stderr = run_worker_cli("--model", OFFLINE_MODEL, "--once",
                                           env=worker_env(dsn))
    assert code == 0, stderr
    assert [(a.from_pair, a.state) for a in attempts(conn)] == [(0, "completed"),
                                                               (10, "completed")]


def test_projection_on_the_standby_equals_the_primary(
        conn: Conn, dsn: str, standby: Standby) -> None:
    compacted(conn, dsn)
    wait_for_replay(standby)
    placements: dict[int, list[str]] = {}
    with psycopg.connect(dsn, autocommit=True) as primary, \
            psycopg.connect(standby.dsn, autocommit=True) as replica:
        # Budgets where history is partly omitted, where a summary does not fit, and
        # where everything fits.
        for budget in (2_000, 6_000, 9_000, 1_000_000):
            on_primary = project_history(primary, "conv-r", budget_bytes=budget).to_dict()
            on_replica = project_history(replica, "conv-r", budget_bytes=budget).to_dict()
            assert on_replica == on_primary, budget
            assert on_primary["messages"], budget
            placements[budget] = [p["placement"] for p in on_primary["pairs"]]
    assert placements[1_000_000] == ["summarized"] * 20 + ["raw"] * 25
    assert "omitted" in placements[2_000]


def test_async_projection_on_the_standby_equals_the_primary(
        conn: Conn, dsn: str, standby: Standby) -> None:
    """aproject_history runs on a hot standby (read-only transactions, nothing written,
    no temporary objects) and gives what project_history gives on the primary."""
    compacted(conn, dsn)
    wait_for_replay(standby)

    async def on_replica(budget: int) -> dict[str, Any]:
        async with await psycopg.AsyncConnection.connect(standby.dsn,
                                                         autocommit=True) as replica:
            return (await aproject_history(replica, "conv-r", budget_bytes=budget)).to_dict()

    with psycopg.connect(dsn, autocommit=True) as primary:
        for budget in (2_000, 6_000, 1_000_000):
            expected = project_history(primary, "conv-r", budget_bytes=budget).to_dict()
            assert asyncio.run(on_replica(budget)) == expected, budget


def test_cli_read_commands_on_the_standby(conn: Conn, dsn: str, standby: Standby) -> None:
    compacted(conn, dsn)
    wait_for_replay(standby)
    for command in (["plan", "conv-r", "--json"],
                    ["project", "conv-r", "--budget-bytes", "8000", "--json"],
                    ["audit", "--json"],
                    ["audit", "--view", "events", "--json", "--limit", "100"],
                    ["audit", "--view", "stale", "--json"]):
        on_primary = run_cli(*command, "--dsn", dsn)
        on_replica = run_cli(*command, "--dsn", standby.dsn)
        assert on_replica.returncode == 0, (command, on_replica.stderr)
        assert on_primary.returncode == 0, (command, on_primary.stderr)
        assert json.loads(on_replica.stdout) == json.loads(on_primary.stdout), command
    # The readable tables too.
    for command in (["plan", "conv-r"], ["project", "conv-r", "--budget-bytes", "8000"],
                    ["audit"]):
        on_replica = run_cli(*command, "--dsn", standby.dsn)
        assert on_replica.returncode == 0, (command, on_replica.stderr)
        assert on_replica.stdout == run_cli(*command, "--dsn", dsn).stdout


def test_the_standby_refuses_writes_so_the_read_path_has_none(
        conn: Conn, dsn: str, standby: Standby) -> None:
    """The control: the same calls that work above would fail there if they wrote."""
    compacted(conn, dsn)
    wait_for_replay(standby)
    with psycopg.connect(standby.dsn, autocommit=True) as replica:
        for statement in ("CREATE TEMP TABLE t (x int)",
                          "SELECT compaction.enqueue('conv-r')"):
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                replica.execute(statement)
    worker = run_cli("worker", "--model", OFFLINE_MODEL, "--once", "--dsn", standby.dsn)
    assert worker.returncode == 1
    assert "read-only" in worker.stderr


def test_sdk_session_reads_from_the_replica_and_writes_to_the_primary(
        conn: Conn, dsn: str, standby: Standby) -> None:
    compacted(conn, dsn)
    wait_for_replay(standby)
    reads: list[str] = []

    def read_connect() -> psycopg.Connection[Any]:
        reads.append(standby.dsn)
        return db.connect(standby.dsn, read_only=True)

    async def turn() -> tuple[list[Any], list[Any]]:
        with PycompactorSession("conv-r", dsn=dsn, read_connect=read_connect,
                                budget_bytes=1_000_000) as session:
            before = await session.get_items()
            assert session.last_read_from == "replica"
            # A write goes to the primary; the next read waits for the replica to
            # replay it, so the session sees its own turn.
            await session.add_items([{"role": "user", "content": "QUESTION-045"},
                                     {"role": "assistant", "content": "ANSWER-045"}])
            after = await session.get_items()
            assert session.last_read_from == "replica"
            return before, after

    before, after = asyncio.run(turn())
    assert reads == [standby.dsn]  # one read connection, to the standby
    with psycopg.connect(dsn, autocommit=True) as primary:
        expected = list(project_history(primary, "conv-r", budget_bytes=1_000_000).messages)
    assert after == expected
    assert after[-2:] == [{"role": "user", "content": "QUESTION-045"},
                          {"role": "assistant", "content": "ANSWER-045"}]
    assert after[:-2] == before
    # The read_dsn form of the same session.
    with PycompactorSession("conv-r", dsn=dsn, read_dsn=standby.dsn,
                            budget_bytes=1_000_000) as session:
        assert asyncio.run(session.get_items()) == expected


def test_history_written_after_the_standby_started_reaches_it(
        conn: Conn, dsn: str, standby: Standby) -> None:
    """Streaming, not just the base backup: a conversation written afterwards is there."""
    History(conn).pairs("conv-late", 12)
    wait_for_replay(standby)
    with contextlib.closing(psycopg.connect(standby.dsn, autocommit=True)) as replica:
        assert len(db.eligible_pairs(replica, "conv-late")) == 12


def test_projecting_session_reads_from_the_replica_and_writes_to_the_primary(
        conn: Conn, dsn: str, standby: Standby) -> None:
    """The wrapper that keeps the SDK's own tables (SQLAlchemySession behind the recipe):
    get_items on the standby once it has replayed the session's last write; the SDK's
    writes and the enqueue on the primary."""
    from agents.extensions.memory import SQLAlchemySession
    from sqlalchemy.ext.asyncio import create_async_engine

    from pycompactor.integrations.sdk_storage import ProjectingSession
    from pycompactor.recipes import install_agents_sqlalchemy
    from tests.e2e.test_agents_sqlalchemy import sqlalchemy_url

    async def scenario() -> tuple[list[Any], list[Any], str, str]:
        engine = create_async_engine(sqlalchemy_url(dsn))
        try:
            inner = SQLAlchemySession("conv-sdk", engine=engine, create_tables=True)
            await inner.add_items([{"role": "user", "content": "QUESTION-1"},
                                   {"role": "assistant", "content": "ANSWER-1"}])
            install_agents_sqlalchemy(conn)
            wait_for_replay(standby)
            session = ProjectingSession(inner, dsn=dsn, read_dsn=standby.dsn,
                                        budget_bytes=1_000_000)
            try:
                before = await session.get_items()
                first = session.last_read_from
                # The SDK writes to the primary; the next read waits for the standby to
                # replay it (and the enqueue after it), so the session sees its own turn.
                await session.add_items([{"role": "user", "content": "QUESTION-2"},
                                         {"role": "assistant", "content": "ANSWER-2"}])
                after = await session.get_items()
                second = session.last_read_from
            finally:
                await session.aclose()
            return before, after, first, second
        finally:
            await engine.dispose()

    before, after, first, second = asyncio.run(scenario())
    assert (first, second) == ("replica", "replica")
    assert before == [{"role": "user", "content": "QUESTION-1"},
                      {"role": "assistant", "content": "ANSWER-1"}]
    assert after == [*before, {"role": "user", "content": "QUESTION-2"},
                     {"role": "assistant", "content": "ANSWER-2"}]
    assert conn.execute("SELECT conversation_id FROM compaction.queue").fetchall() == [
        ("conv-sdk",)]
