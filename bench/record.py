"""`make bench-record`: put a full `make bench` run's tables into docs/benchmarks.md.

`make bench` writes its tables to bench/results/latest.md, which git ignores: a run's
numbers belong to its machine, and the page is not a log. When someone records a
release's numbers, this replaces what stands between the page's two markers with that
file, so the page always shows one run, named by its date, machine and command. A smoke
run or an `--only` run is refused: the page's ratios are a full run's.

    python -m bench.record                          # bench/results/latest.md -> docs/benchmarks.md
    python -m bench.record --results F --page P     # other files (the tests use these)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- bench-results:begin (make bench-record writes this block) -->"
END = "<!-- bench-results:end -->"
#: The heading bench/report.py gives a full run, and no other.
FULL_RUN = re.compile(r"^## \S+ \(full run\)$", re.MULTILINE)


class RecordError(Exception):
    """The results or the page are not what `make bench-record` can use."""


def record(results: Path, page: Path) -> None:
    """Replace the block between the page's markers with the results file's text."""
    if not results.is_file():
        raise RecordError(f"{results} is missing; run `make bench` first")
    table = results.read_text(encoding="utf-8").strip("\n")
    if not FULL_RUN.search(table):
        raise RecordError(f"{results} is not from a full run (a smoke or --only run);"
                          " run `make bench` without arguments")
    text = page.read_text(encoding="utf-8")
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise RecordError(f"{page} lacks its markers {BEGIN!r} ... {END!r} (once each)")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n\n{table}\n\n{END}{tail}", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.record",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "latest.md")
    parser.add_argument("--page", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    try:
        record(args.results, args.page)
    except RecordError as exc:
        print(f"bench.record: {exc}", file=sys.stderr)
        return 1
    print(f"bench.record: {args.page} now shows {args.results}'s run", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
