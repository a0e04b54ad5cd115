"""`pycompactor worker --model pycompactor/extractive-2 --extractive-target R`: the flag, its
variable, and a real pass through the command line."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor.corpus import build_corpus
from pycompactor.summarizers.extractive2 import EXTRACTIVE2_MODEL
from tests.e2e.cli import run_cli
from tests.history import History
from tests.workerkit import attempts, run_worker_cli, summaries, worker_env

Conn = psycopg.Connection[Any]


def test_help_documents_the_model_flag_and_variable() -> None:
    result = run_cli("worker", "--help")
    assert "--extractive-target R" in result.stdout
    assert "PYCOMPACTOR_EXTRACTIVE_TARGET" in result.stdout
    assert "pycompactor/extractive-2" in " ".join(result.stdout.split())


@pytest.mark.parametrize(("flag", "env"), [("0", None), ("1.5", None), ("x", None),
                                           (None, "0"), (None, "-1")])
def test_a_bad_target_is_a_usage_error(flag: str | None, env: str | None) -> None:
    args = ["worker", "--model", EXTRACTIVE2_MODEL, "--dsn", "postgresql:///nowhere"]
    if flag is not None:
        args += ["--extractive-target", flag]
    result = run_cli(*args, env={"PYCOMPACTOR_EXTRACTIVE_TARGET": env} if env else None)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.rstrip("\n").split("\n")
    assert lines[-1].startswith("pycompactor worker: error:")
    assert "extractive-target" in lines[-1]
    assert "Traceback" not in result.stderr


def test_a_pass_at_the_flag_target(conn: Conn, dsn: str) -> None:
    history = History(conn)
    pairs = build_corpus(seed=1, conversations=1)[0].pairs[:30]
    for user, assistant in pairs:
        history.pair("conv-e2", user, assistant)
    replies_bytes = sum(len(a.encode("utf-8")) for _, a in pairs[:10])
    code, _events, stderr = run_worker_cli(
        "--model", EXTRACTIVE2_MODEL, "--once", "--extractive-target", "0.2",
        env=worker_env(dsn))
    assert code == 0, stderr
    assert [(a.state, a.model) for a in attempts(conn)] == [("completed", EXTRACTIVE2_MODEL)]
    [(_, from_pair, summary)] = summaries(conn)
    assert from_pair == 0
    assert 0 < len(summary.encode("utf-8")) <= 0.2 * replies_bytes
