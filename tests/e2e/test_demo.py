"""`pycompactor demo` runs with nothing but the server binaries and leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e.cli import run_cli

REPO = Path(__file__).resolve().parents[2]


def clusters() -> tuple[set[str], set[str]]:
    """Temp cluster directories, and those of them a running process was started from."""
    dirs = {p.name for p in Path(tempfile.gettempdir()).glob("pycompactor-cluster-*")}
    running = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            running.update(re.findall(r"pycompactor-cluster-[A-Za-z0-9_]+", cmdline))
    return dirs, running


def own_cluster(stdout: str) -> str:
    """The demo's cluster directory, as it says when migrating.

    Tests check that one, not every cluster on the machine: other processes (benchmarks,
    another test run) may start and remove their own meanwhile.
    """
    match = re.search(r"^migrating the cluster in \S*(pycompactor-cluster-[A-Za-z0-9_]+)",
                      stdout, re.MULTILINE)
    assert match is not None, stdout
    return match.group(1)


def assert_removed(cluster: str) -> None:
    dirs, running = clusters()
    assert cluster not in dirs
    assert cluster not in running


def rows(stdout: str) -> list[list[str]]:
    """Table rows as whitespace-split cells (the demo's tables are plain text off a TTY)."""
    return [line.split() for line in stdout.splitlines()]


def test_demo_exits_0_and_cleans_up() -> None:
    started = time.monotonic()
    result = run_cli("demo", timeout=300)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert elapsed < 60, elapsed
    assert_removed(own_cluster(out))
    # Readable without a terminal: no escape sequences, no progress bar redraws.
    assert "\x1b[" not in out
    assert "\r" not in out
    assert "eligible pairs: 45" in out
    table = rows(out)
    # The plan, with the Python hash agreeing with SQL's.
    assert any(r[:1] == ["0-9"] and r[-1] == "yes" for r in table)
    assert any(r[:1] == ["10-19"] and r[-1] == "yes" for r in table)
    # Jobs and attempts of the worker pass (extractive-3, offline).
    assert "compaction.audit_jobs (model pycompactor/extractive-3" in out
    assert sum(1 for r in table if r[2:5] == ["1", "completed", "completed"]) == 2
    # Figures kept (all 29 distinct figures of 0-9; of 10-19, whose short replies are all
    # facts, the whole sentences that fit 0.4 of their bytes) and the token columns (none:
    # no model was called).
    assert any(r[-3:] == ["figures_kept", "input_tokens", "output_tokens"] for r in table)
    jobs = [r for r in table if r[2:5] == ["1", "completed", "completed"]]
    assert [(r[0], r[-3:]) for r in jobs] == [("0-9", ["29/29", "-", "-"]),
                                              ("10-19", ["15/29", "-", "-"])]
    assert "whole sentences of one reply each" in " ".join(out.split())
    # The manifest pair by pair under the tight budget: 0-9 omitted, 10-19 summarized,
    # 20-44 raw; then the summary that did not fit.
    placements = {r[0]: r[1] for r in table
                  if len(r) >= 2 and r[0].isdigit() and r[1] in {"raw", "summarized", "omitted"}}
    assert [placements[str(i)] for i in range(45)] == (
        ["omitted"] * 10 + ["summarized"] * 10 + ["raw"] * 25)
    assert any(r[1:] == ["0-9", "did_not_fit"] for r in table)
    # Bytes before and after.
    assert any(r[:5] == ["all", "45", "pairs", "raw", "(before)"] for r in table)
    # What compaction buys, by the evaluation's measures: at the tight budget 35 pairs
    # against 30 raw; in the bytes the compacted history takes, all 45 against 37. And
    # what a reader finds: every figure of 0-9 by its question, every caveat in scope
    # (the two failures the article names do not happen), no figure invented.
    reach_rows = [r[1:] for r in table if len(r) == 9 and r[0].isdigit() and r[2] == "of"]
    assert reach_rows == [["35", "of", "45", "10", "30", "of", "45", "+5"],
                          ["45", "of", "45", "20", "37", "of", "45", "+8"]]
    kept = [r for r in table if len(r) == 8 and r[0] in {"0-9", "10-19"}]
    assert [(r[0], r[3], r[4], r[5], r[7]) for r in kept] == [
        ("0-9", "0.29", "26/26", "29/29", "0"), ("10-19", "0.35", "13/25", "3/14", "0")]
    said = " ".join(out.split())
    assert "the next Run sees all 45 pairs with compaction, 37 without (+8)" in said
    assert ("a reader finds 39 of 51 figures by their question and 32 of 43 qualifiers in "
            "their scope; the summaries invent 0 figures") in said
    # The summary of 0-9 says the NAV of 2026-10-09 is not the current one, and that no
    # default risk preference is inferred.
    assert ("b) On 2026-10-09 NAV of Harbor Bond Index was 10.37 USD. That figure is dated "
            "2026-10-09; it is not current NAV, which needs fresh quote.") in said
    assert "a) Understood: 10-year horizon, and I will not infer default risk preference." in said
    # Case B: the edited pair 3 makes the summary of 0-9 stale; 0-9 goes back to raw.
    # (The demo's worker pass has one slot: 0-9 is job 1 and summary 1, 10-19 is 2 and 2.)
    assert "after    Cedar Dividend 的费用和赎回费是多少？" in out
    assert ["0-9", "raw"] in table
    assert ["10-19", "summarized", "2"] in table
    assert ["1", "0-9", "stale_source"] in table
    assert any(r[:4] == ["1", "0-9", "conversation-compaction@3", "source_changed"]
               for r in table)
    assert out.rstrip().splitlines()[-1].startswith("throwaway cluster stopped and removed")


def test_make_demo_runs_the_demo() -> None:
    """`make demo` (acceptance 1) runs the same command: the Makefile's recipe, with this
    environment's pycompactor (DEMO_STAMP= skips the virtualenv a fresh clone gets)."""
    result = subprocess.run(
        ["make", "-s", "demo", "DEMO_STAMP=", f"BIN={Path(sys.executable).parent}"],
        cwd=REPO, capture_output=True, text=True, check=False, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "stale_source" in result.stdout
    assert result.stdout.rstrip().splitlines()[-1].startswith("throwaway cluster stopped")
    assert_removed(own_cluster(result.stdout))


def test_demo_cleans_up_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pycompactor", "demo"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    # Interrupt once the cluster exists (the demo says so before migrating). The demo is
    # paused meanwhile: the rest of it takes about a second, which a slow scan of /proc
    # on a loaded machine could outlast, and the SIGINT would then find it finished.
    for line in proc.stdout:
        if line.startswith("migrating"):
            proc.send_signal(signal.SIGSTOP)
            break
    cluster = own_cluster(line)
    dirs, running = clusters()
    assert cluster in dirs
    assert cluster in running
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "pycompactor: interrupted"
    assert_removed(cluster)
