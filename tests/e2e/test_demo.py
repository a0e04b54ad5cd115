"""`pycompactor demo` runs with nothing but the server binaries and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.e2e.cli import run_cli


def leftovers() -> tuple[set[str], set[str]]:
    """Temp cluster directories, and running postgres processes started from them."""
    dirs = {p.name for p in Path(tempfile.gettempdir()).glob("pycompactor-cluster-*")}
    procs = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "pycompactor-cluster-" in cmdline:
                procs.add(proc.name)
    return dirs, procs


def test_demo_exits_0_and_cleans_up() -> None:
    before = leftovers()
    result = run_cli("demo", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "eligible pairs: 45" in result.stdout
    assert "0-9" in result.stdout
    assert "10-19" in result.stdout
    assert leftovers() == before


def test_demo_cleans_up_on_ctrl_c() -> None:
    before = leftovers()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pycompactor", "demo"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    # Interrupt once the cluster exists (the demo says so before migrating).
    for line in proc.stdout:
        if line.startswith("migrating"):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert leftovers() == before
