"""Claim storms: many processes, each on its own connection, released by one barrier.

Exact outcome counts, no sleeps: a multiprocessing.Barrier releases every claimer at
once, and each process keeps its own connection across rounds.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.models import Target
from tests.history import History
from tests.sql.engine import LEASE, MODEL, T0, V3

pytestmark = pytest.mark.slow

#: one claim to make: (conversation_id, scope, target, p_now offset in leases)
Task = tuple[str, str, Target, int]

_CTX = mp.get_context("fork")


def _claimer(dsn: str, barrier: Any, tasks: Any, results: Any, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            batch: list[Task] | None = tasks.get()
            if batch is None:
                return
            barrier.wait(timeout=60)
            out = []
            for conversation_id, scope, t, leases in batch:
                r = db.claim(conn, conversation_id, scope, t.from_pair, t.source_message_ids,
                             t.source_hash, MODEL, V3, name, now=T0 + LEASE * leases)
                out.append((conversation_id, scope, r.reason))
            results.put(out)


class Storm:
    """n claimer processes; run() hands each its batch and releases them together."""

    def __init__(self, dsn: str, n: int) -> None:
        self.barrier = _CTX.Barrier(n)
        self.results: Any = _CTX.Queue()
        self.queues: list[Any] = [_CTX.Queue() for _ in range(n)]
        self.processes = [
            _CTX.Process(target=_claimer, args=(dsn, self.barrier, q, self.results, f"w{i}"),
                         daemon=True)
            for i, q in enumerate(self.queues)
        ]
        for p in self.processes:
            p.start()

    def run(self, batches: list[list[Task]]) -> list[tuple[str, str, str]]:
        assert len(batches) == len(self.queues)
        for q, batch in zip(self.queues, batches, strict=True):
            q.put(batch)
        out: list[tuple[str, str, str]] = []
        for _ in batches:
            out.extend(self.results.get(timeout=120))
        return out

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for p in self.processes:
            p.join(timeout=30)
            assert p.exitcode == 0


@pytest.fixture
def storm32(dsn: str) -> Iterator[Storm]:
    storm = Storm(dsn, 32)
    yield storm
    storm.close()


def _targets(conn: psycopg.Connection[Any], n: int) -> list[tuple[str, Target]]:
    history = History(conn)
    out = []
    for i in range(n):
        conversation_id = f"storm-{i}"
        history.pairs(conversation_id, 30)
        out.append((conversation_id, db.plan_targets(conn, conversation_id)[0]))
    return out


def test_claim_storm(conn: psycopg.Connection[Any], storm32: Storm) -> None:
    conn.execute("UPDATE compaction.settings SET max_running = 10000")
    targets = _targets(conn, 16)
    rng = random.Random(42)
    for rep in range(5):
        # 32 claimers, one identity: exactly one wins, 31 get already_running
        conversation_id, t = targets[0]
        scope = f"one-{rep}"
        results = storm32.run([[(conversation_id, scope, t, 0)] for _ in range(32)])
        assert Counter(r for _, _, r in results) == {"claimed": 1, "already_running": 31}

        # 16 identities x 8 claimers: each process claims 4 identities in its own order
        scope = f"many-{rep}"
        claims = [(c, scope, t, 0) for c, t in targets for _ in range(8)]
        rng.shuffle(claims)
        batches = [claims[i::32] for i in range(32)]
        results = storm32.run(batches)
        per_identity = Counter((c, s) for c, s, r in results if r == "claimed")
        assert len(per_identity) == 16
        assert set(per_identity.values()) == {1}
        assert Counter(r for _, _, r in results) == {"claimed": 16, "already_running": 112}
    running = conn.execute(
        "SELECT count(*), count(DISTINCT (conversation_id, job_id)) FROM compaction.attempts"
        " WHERE state = 'running'").fetchone()
    assert running == (5 * 17, 5 * 17)


def test_admission_storm(conn: psycopg.Connection[Any], dsn: str) -> None:
    conn.execute("UPDATE compaction.settings SET max_running = 3")
    targets = _targets(conn, 10)
    storm = Storm(dsn, 10)
    try:
        for rep in range(5):
            # fresh identities (scope per round); the earlier rounds' attempts are still
            # running but their leases expired at this round's clock: they do not count
            results = storm.run([[(c, f"round-{rep}", t, rep)] for c, t in targets])
            assert Counter(r for _, _, r in results) \
                == {"claimed": 3, "admission_full": 7}, f"round {rep}"
    finally:
        storm.close()
    assert conn.execute(
        "SELECT count(*) FROM compaction.attempts WHERE state = 'running'"
        " AND lease_expires_at > %s", (T0 + LEASE * 4,)).fetchone() == (3,)
