"""`make bench`: the cost of pycompactor's guarantees, as ratios against plain SQL.

Starts a throwaway durable PostgreSQL (fsync, synchronous_commit and full_page_writes on),
migrates a template, runs the benchmarks (the engine's goals against plain SQL, the derived state's
writes, and the SDK recipe against the reference tables) each in its own database (a
fixed number of operations after a warm-up, 3 repetitions, medians), measures what the
offline summarizers buy and lose on the evaluation corpus (bench/quality.py), then profiles the
operations whose goals are ratios statement by statement in a second cluster with
pg_stat_statements (bench/statements.py), and writes `bench/results/latest.json` and its
markdown tables, `bench/results/latest.md` (both ignored by git: a run's numbers belong to
its machine). `make bench-record` (bench/record.py) copies a full run's tables into
docs/benchmarks.md when someone records a release's numbers.

    python -m bench.run                 # the full run (under ~15 minutes on 2 cores)
    python -m bench.run --smoke         # tiny sizes, seconds: checks that everything runs
    python -m bench.run --out DIR       # write DIR/latest.json and DIR/latest.md instead
    python -m bench.run --only quality  # the summary quality on the corpus alone (no database)
    python -m bench.run --only quality --quality-model pycompactor/extractive-2
                                        # the model whose frontier the quality section draws
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from bench import (
    claims,
    finding,
    hashing,
    instructions,
    projecting,
    quality,
    sdk_source,
    statements,
    writing,
)
from bench.common import FULL, REPETITIONS, SMOKE, BenchCluster, Sizes, cpu_model
from bench.report import markdown_table, targets

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS: dict[str, Callable[[str, Sizes], dict[str, Any]]] = {
    "claim_cycle": claims.run,
    "projection": projecting.run,
    "finding_work": finding.run,
    "hashing": hashing.run,
    "writing": writing.run,
    "sdk_source": sdk_source.run,
}
#: Need no database: what the offline summarizers buy and lose on the corpus.
OFFLINE: dict[str, Callable[[Sizes], dict[str, Any]]] = {
    "quality": quality.run,
}
#: Run last, in a cluster of its own: pg_stat_statements would tax the measured ones.
PROFILES: dict[str, Callable[[Sizes], dict[str, Any]]] = {
    "statements": statements.run,
    "instructions": instructions.run,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes: checks that every benchmark runs (numbers mean nothing)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write latest.json and latest.md into this directory instead of"
                             " bench/results/")
    parser.add_argument("--only", action="append",
                        choices=sorted([*BENCHMARKS, *OFFLINE, *PROFILES]), default=None,
                        help="run only this benchmark (repeatable)")
    parser.add_argument("--quality-model", default=quality.FRONTIER_MODEL, metavar="MODEL",
                        help="the offline model whose frontier (targets"
                             f" {', '.join(f'{t:g}' for t in quality.TARGETS)}) the quality"
                             " section measures against naive whole-sentence selection"
                             f" (default: {quality.FRONTIER_MODEL})")
    return parser.parse_args(argv)


def machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
            "platform": platform.platform()}


def command(argv: Sequence[str]) -> str:
    """How to run it again: `make bench` is this module without arguments."""
    return " ".join(["python -m bench.run", *argv]) if argv else "make bench"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the throwaway cluster is stopped and removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sizes = SMOKE if args.smoke else FULL
    out = args.out or ROOT / "bench" / "results"
    json_path, md_path = out / "latest.json", out / "latest.md"
    chosen = args.only or [*BENCHMARKS, *OFFLINE, *PROFILES]
    started = time.perf_counter()
    results: dict[str, Any] = {
        "meta": {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "mode": ("smoke" if sizes.smoke else "full")
                    + (f", only {', '.join(args.only)}" if args.only else ""),
            "repetitions": REPETITIONS,
            "machine": machine(),
            # What reproduces the run: docs/benchmarks.md names it beside the numbers.
            "command": command(argv if argv is not None else sys.argv[1:]),
        },
        "seconds": {},
    }
    with BenchCluster() as cluster:
        with psycopg.connect(cluster.dsn_for(cluster.TEMPLATE)) as conn:
            row = conn.execute("SELECT version()").fetchone()
        results["meta"]["postgresql"] = str(row[0]) if row else "unknown"
        results["meta"]["settings"] = cluster.settings()
        for name in (n for n in chosen if n in BENCHMARKS):
            print(f"bench: {name} ...", file=sys.stderr, flush=True)
            began = time.perf_counter()
            results[name] = BENCHMARKS[name](cluster.new_database(name), sizes)
            results["seconds"][name] = round(time.perf_counter() - began, 1)
            print(f"bench: {name} done in {results['seconds'][name]} s", file=sys.stderr,
                  flush=True)
    for name in (n for n in chosen if n in OFFLINE):
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        results[name] = (quality.run(sizes, args.quality_model) if name == "quality"
                         else OFFLINE[name](sizes))
        results["seconds"][name] = round(time.perf_counter() - began, 1)
        print(f"bench: {name} done in {results['seconds'][name]} s", file=sys.stderr,
              flush=True)
    for name in (n for n in chosen if n in PROFILES):
        print(f"bench: {name} (its own cluster) ...", file=sys.stderr, flush=True)
        began = time.perf_counter()
        results[name] = PROFILES[name](sizes)
        results["seconds"][name] = round(time.perf_counter() - began, 1)
        print(f"bench: {name} done in {results['seconds'][name]} s", file=sys.stderr,
              flush=True)
    results["seconds"]["total"] = round(time.perf_counter() - started, 1)
    results["targets"] = targets(results)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n",
                         encoding="utf-8")
    table = markdown_table(results)
    md_path.write_text(table, encoding="utf-8")
    print(table)
    print(f"bench: wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
