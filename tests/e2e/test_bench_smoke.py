"""`make bench` in smoke mode: every benchmark runs end to end and writes its report.

Benchmarks are not timed tests: nothing here looks at a number's size, only that the
run finishes, the JSON has the expected shape and the markdown table is written to the
directory given by --out (never to docs/benchmarks.md or bench/results/); and that
`make bench-record` puts a full run's tables, and only a full run's, between the markers
of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.record import BEGIN, END, RecordError, record

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_smoke_runs_and_writes_json(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    data = json.loads((tmp_path / "latest.json").read_text(encoding="utf-8"))
    assert set(data) == {"meta", "seconds", "targets", "claim_cycle", "projection",
                         "finding_work", "hashing", "writing", "sdk_source", "statements",
                         "quality", "instructions"}
    assert data["meta"]["mode"] == "smoke"
    assert data["meta"]["settings"]["fsync"] == "on"
    assert data["meta"]["settings"]["synchronous_commit"] == "on"
    assert data["meta"]["settings"]["full_page_writes"] == "on"
    assert [r["connections"] for r in data["claim_cycle"]["runs"]] == [1, 2, 8]
    for run in data["claim_cycle"]["runs"]:
        assert {"pycompactor_median", "baseline_median", "ratio", "floor_median",
                "floor_ratio", "ratio_to_floor", "lean_floor_median",
                "lean_floor_ratio", "sketch_median", "sketch_ratio"} <= set(run)
        assert len(run["floor_cycles_per_s"]) == 3
        assert len(run["lean_floor_cycles_per_s"]) == 3
        assert run["lean_floor_median"] > 0
        assert len(run["sketch_cycles_per_s"]) == 3
        assert run["sketch_median"] > 0
        # No claim locks a row another claim locks too: a row every claim shared (the
        # prompt version's) would spend a MultiXact id at each overlap.
        assert run["multixacts_per_1000_cycles"] == 0
    assert data["writing"]["verify_problems"] == 0
    assert data["writing"]["crowd"] > 0
    assert data["writing"]["rederive_whole_s"] > 0
    assert {"engine_p50_ms", "plain_p50_ms", "ratio_p50"} <= set(data["writing"]["append"])
    assert {"engine_p50_ms", "plain_p50_ms", "ratio_p50"} <= set(
        data["writing"]["append_settled_first"])
    cells = data["projection"]["cells"]
    assert len(cells) == 9
    assert all(c["used_bytes"] <= c["budget_bytes"] for c in cells)
    assert {"pycompactor_p50_ms", "pycompactor_p95_ms", "bare_p50_ms", "ratio_p50",
            "statements_alone_p50_ms", "statements_alone_ratio_p50"} <= set(cells[0])
    # The replayed statements: one projection_read call serves each cell.
    assert all(c["engine_statements"] == 1 for c in cells)
    assert {"idle", "busy", "after_busy"} <= set(data["finding_work"])
    assert {"python", "python_ascii", "sql"} <= set(data["hashing"])
    assert set(data["sdk_source"]["ratio_p50"]) == {"plan", "project_64k", "check_source"}
    assert data["sdk_source"]["sdk"]["check_source_ok"] is True
    assert data["sdk_source"]["sdk"]["derived_state"] == "in_use"
    # The quality section: the offline summarizers measured on the same corpus ranges.
    quality = data["quality"]
    assert [m["model"] for m in quality["models"]] == ["pycompactor/extractive-1",
                                                      "pycompactor/extractive-2",
                                                      "pycompactor/extractive-3"]
    for model in quality["models"]:
        assert model["ranges"] > 0
        assert model["failed"] == 0
        assert [r["budget_bytes"] for r in model["reach"]] == [8192, 16384, 32768, 65536]
        assert {"median", "p95", "max", "pooled"} <= set(model["compression"])
        assert model["density"]["ratio"] is not None
        assert {"p50", "p95", "max"} <= set(model["ms_per_range"])
    assert len({m["ranges"] for m in quality["models"]}) == 1
    for model in quality["models"]:
        assert {"total", "kept", "ratio"} <= set(model["attribution"])
        assert {"total", "kept", "ratio"} <= set(model["qualifier_scope"])
        assert model["invented_figures"] == 0  # the offline summarizers never invent one
    assert sum(t["name"].startswith("extractive-2 on the corpus") for t in data["targets"]) == 6
    # The frontier: the model and naive whole-sentence selection at every target,
    # in the same run, on the same ranges.
    frontier = quality["frontier"]
    assert frontier["model"] == "pycompactor/extractive-3"
    assert frontier["targets"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    for series in ("points", "baseline", "baseline_caveats_first"):
        assert [p["target"] for p in frontier[series]] == frontier["targets"]
        for p in frontier[series]:
            assert p["ranges"] == quality["models"][0]["ranges"]
            assert {"compression_median", "attribution", "qualifier_scope", "figure_retention",
                    "invented_figures", "ms_per_range", "reach_64k"} <= set(p)
    assert all(p["compression_median"] <= p["target"] for p in frontier["baseline"])
    # The reach no summarizer passes: one-byte summaries reach at least what any does.
    for model in quality["models"]:
        for r in model["reach"]:
            assert r["ceiling"] >= r["compacted"]
            assert r["ceiling"] >= r["raw_only"]
    assert len(frontier["above_baseline"]) == 6
    assert sum(t["name"].startswith("pycompactor/extractive-3 on the corpus, default target")
               for t in data["targets"]) == 7
    # The statement profile: each operation's time split by pg_stat_statements, the
    # engine's own statements nested under the calls the client sent.
    profile = data["statements"]
    for part in (profile["claim_cycle"], profile["plain_cycle"],
                 profile["projection"]["pycompactor"], profile["projection"]["bare"],
                 profile["append"]):
        assert part["operations"] == 5
        assert part["client_ms"] >= part["top_level_exec_ms"] > 0
        # One thread: the process's CPU time in the operations is within their wall time.
        assert 0 < part["client_cpu_ms"] <= part["client_ms"]
        # The server's CPU, read from /proc (in ticks: a few operations may take none).
        assert part["server_cpu_ms"] is not None
        assert part["server_cpu_ms"] >= 0
        assert any(s["toplevel"] for s in part["statements"])
    nested = {s["query"] for s in profile["claim_cycle"]["statements"] if not s["toplevel"]}
    assert any("INSERT INTO compaction.jobs" in q for q in nested)
    # The cycle in instructions: each of the three cycles ran, and the engine's costs more
    # than the rows alone, which cost more than plain SQL's.
    counts = data["instructions"]["instructions_per_cycle"]
    assert counts["pycompactor"] > counts["floor"] > counts["plain"] > 0
    wal = data["instructions"]["wal_bytes_per_cycle"]
    assert wal["pycompactor"] > wal["plain"] > 0
    # Fifteen engine targets, six quality goals, eight fidelity goals.
    assert len(data["targets"]) == 29
    assert all({"name", "measured", "target", "met"} <= set(t) for t in data["targets"])

    table = (tmp_path / "latest.md").read_text(encoding="utf-8")
    assert "(smoke run)" in table
    assert f"Command: `python -m bench.run --smoke --out {tmp_path}`." in table
    assert "| target | measured | goal | met |" in table
    assert "Where the time goes" in table
    assert "Instructions per claim -> complete cycle (callgrind" in table
    assert "The frontier on the same ranges" in table


def test_bench_record_replaces_the_block_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\nprose\n\n{BEGIN}\n\nthe old run\n\n{END}\n\nmore prose\n",
                    encoding="utf-8")
    results = tmp_path / "latest.md"
    results.write_text("\n## 2026-12-06T09:26:39+00:00 (full run)\n\n| target |\n",
                       encoding="utf-8")
    record(results, page)
    expected = (f"# Benchmarks\n\nprose\n\n{BEGIN}\n\n## 2026-12-06T09:26:39+00:00"
                f" (full run)\n\n| target |\n\n{END}\n\nmore prose\n")
    assert page.read_text(encoding="utf-8") == expected
    record(results, page)  # recording the same run again changes nothing
    assert page.read_text(encoding="utf-8") == expected


@pytest.mark.parametrize("mode", ["smoke run", "full run, only claim_cycle"])
def test_bench_record_refuses_a_partial_run(tmp_path: Path, mode: str) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text(f"{BEGIN}\nkept\n{END}\n", encoding="utf-8")
    results = tmp_path / "latest.md"
    results.write_text(f"## 2026-12-06T09:26:39+00:00 ({mode})\n", encoding="utf-8")
    with pytest.raises(RecordError, match="not from a full run"):
        record(results, page)
    assert page.read_text(encoding="utf-8") == f"{BEGIN}\nkept\n{END}\n"


def test_the_results_page_holds_one_recorded_run() -> None:
    """docs/benchmarks.md carries the markers once, around one full run's tables, named by
    its date, machine and command."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1
    assert text.count(END) == 1
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert len(re.findall(r"^## \S+ \(full run\)$", block, re.MULTILINE)) == 1
    assert "Machine: " in block
    assert "Command: `make bench`." in block


@pytest.mark.slow
def test_bench_scale_runs_every_install_step(tmp_path: Path) -> None:
    """`make bench-scale` at a tiny size: every documented install step runs beside the
    application's appends, the derived state ends in use and exact, the report is written."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--messages", "2000", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = json.loads((tmp_path / "scale.json").read_text(encoding="utf-8"))
    assert run["messages"] == 2000
    assert {s.get("block") for s in run["steps"]} >= {
        "grants-and-indexes", "statistics", "repoint", "tracking", "rebuild"}
    assert any("CONCURRENTLY" in s["step"] for s in run["steps"])
    install = [s for s in run["steps"] if "block" in s]
    assert all(0 <= s["over_3x_baseline_p99"] <= s["appends"] for s in install)
    assert run["steps"][0]["appends"] > 0  # the application ran during the baseline
    assert run["append_errors"] == []
    assert run["derived_state"] == "in_use"
    assert run["verify_problems_in_20_threads"] == 0
    assert run["rebuild"]["messages_per_s"] > 0
    assert run["derived_bytes_per_message"] > 0
    assert {"longest_stall_ms", "longest_stall_ok", "worst_p99_over_baseline",
            "derived_share_ok", "rebuild_per_million_ratio_to_smallest",
            "most_appends_over_3x_in_a_step"} <= set(run["goals"])
    assert "| step | s | app appends |" in (tmp_path / "scale.md").read_text(encoding="utf-8")
