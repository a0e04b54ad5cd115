"""`make baseline`: write the baseline revision's up delta from sql/.

Until 0.1.0 is released the whole schema is one revision, `0_1_0_baseline`, whose up
delta is the current definition in sql/, written by this script: a change to the stored
logic edits sql/ and runs `make baseline` (no new revision). The delta is sql/'s files
concatenated in the order and the form `pycompactor.schema.apply_current_definition`
applies them (file-name order, each file verbatim), so the catalog-equality test of
tests/migrations compares two builds of the same text. The down delta is written by hand:
it removes what the baseline created, whatever sql/ holds.

Once 0.1.0 is released the baseline is frozen like every other revision: this script
then refuses to run (RELEASED below), and a change adds a revision after the baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SQL = REPO / "sql"
REVISION = "0_1_0_baseline"
DELTA = REPO / "migrations" / "deltas" / f"{REVISION}.up.sql"
#: Set to True in the commit that releases 0.1.0: from then on the baseline never changes.
RELEASED = False

HEADER = (
    f"-- Delta {REVISION}, upgrade: the whole schema of pycompactor 0.1.0, sql/ verbatim.\n"
    "-- Written by scripts/build_baseline.py (`make baseline`); until 0.1.0 is released it is\n"
    "-- regenerated from sql/, never edited by hand. From the release on it is frozen.\n"
)


def baseline_text() -> str:
    parts = [HEADER]
    for path in sorted(SQL.glob("*.sql")):
        text = path.read_text(encoding="utf-8")
        parts.append(f"\n-- ==== sql/{path.name} ====\n")
        parts.append(text if text.endswith("\n") else text + "\n")
    return "".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the delta differs from sql/")
    args = parser.parse_args()
    text = baseline_text()
    current = DELTA.read_text(encoding="utf-8") if DELTA.exists() else ""
    if args.check:
        if current != text:
            print(f"{DELTA.relative_to(REPO)} differs from sql/; run `make baseline`",
                  file=sys.stderr)
            return 1
        return 0
    if RELEASED:
        print("0.1.0 is released: its baseline is frozen; add a revision after it "
              "(README.md, \"Changing the schema\")", file=sys.stderr)
        return 1
    if current != text:
        DELTA.write_text(text, encoding="utf-8")
        print(f"wrote {DELTA.relative_to(REPO)} from {len(list(SQL.glob('*.sql')))} files")
    else:
        print(f"{DELTA.relative_to(REPO)} already equals sql/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
