"""The README's quickstart Python runs as written against a database the worker compacted,
and its install lines name only what this checkout builds (test_wheel_install.py runs the
documented line)."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import psycopg

from pycompactor.summarizers.extractive import OFFLINE_MODEL
from tests.e2e.cli import run_cli
from tests.history import History

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def console_commands(text: str) -> list[str]:
    """Every command of the page's console blocks, split at `&&`, comments dropped."""
    return [
        command.strip()
        for block in re.findall(r"```console\n(.*?)```", text, re.DOTALL)
        for line in block.splitlines() if line.startswith("$ ")
        for command in line[2:].split(" #", 1)[0].split("&&")
    ]


def documented_wheel() -> str:
    """The wheel `make wheel` builds, as the README names it: dist/ and pyproject's version."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]
    return f"dist/pycompactor-{project['version']}-py3-none-any.whl"


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


def test_install_lines_name_only_what_the_checkout_builds() -> None:
    """pycompactor is not on PyPI: `pip install pycompactor` would fail, or install whoever
    takes the name. Each documented install is the wheel `make wheel` builds, after it."""
    commands = console_commands(README.read_text(encoding="utf-8"))
    installs = [i for i, command in enumerate(commands) if command.startswith("pip install")]
    assert installs, "the README documents no pip install"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"][
        "optional-dependencies"].keys()
    wheel = documented_wheel()
    for i in installs:
        targets = [a for a in shlex.split(commands[i])[2:] if not a.startswith("-")]
        assert targets, commands[i]
        for target in targets:
            named = re.fullmatch(re.escape(wheel) + r"(?:\[([\w,]+)\])?", target)
            assert named, f"README installs {target!r}; only {wheel} (make wheel) exists"
            assert set((named.group(1) or "").split(",")) - {""} <= extras, target
        assert "make wheel" in commands[:i], f"{commands[i]!r} comes before any make wheel"
    listed = subprocess.run(["make", "-C", str(REPO), "help"], capture_output=True, text=True,
                            check=True, timeout=60)
    assert re.search(r"^\s*make wheel\s", listed.stdout, re.MULTILINE), listed.stdout
