"""The README's quickstart Python runs as written against a database the worker compacted."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from pycompactor.extractive import OFFLINE_MODEL
from tests.e2e.cli import run_cli
from tests.history import History

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_python_runs(conn: psycopg.Connection[Any], dsn: str) -> None:
    quickstart = README.read_text(encoding="utf-8").split("## Quickstart", 1)[1]
    [code] = re.findall(r"```python\n(.*?)```", quickstart.split("\n## ", 1)[0], re.DOTALL)
    History(conn).pairs("conv-42", 30)
    worker = run_cli("worker", "--once", "--model", OFFLINE_MODEL, "--dsn", dsn)
    assert worker.returncode == 0, worker.stderr
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=60, env={"PYCOMPACTOR_DSN": dsn,
                                                          "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert ast.literal_eval(result.stdout.strip()) == ["summarized"] * 10 + ["raw"] * 20
