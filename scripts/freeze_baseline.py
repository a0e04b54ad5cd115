"""`make freeze-baseline`: at the 0.1.0 release, write the baseline revision's up delta.

Until 0.1.0 is released the baseline revision (`0_1_0_baseline`) applies sql/ itself:
a change to the stored logic edits sql/ and adds no revision. The commit that releases
0.1.0 runs this script once: it writes sql/'s files, concatenated in the order and form
`pycompactor.schema.apply_current_definition` applies them, into
migrations/deltas/0_1_0_baseline.up.sql. From then on the revision runs that file, it is
frozen like every released revision, and a change adds a revision after the baseline.
The script refuses to write over a frozen baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SQL = REPO / "sql"
REVISION = "0_1_0_baseline"
DELTA = REPO / "migrations" / "deltas" / f"{REVISION}.up.sql"

HEADER = (
    f"-- Delta {REVISION}, upgrade: the whole schema of pycompactor 0.1.0, sql/ verbatim\n"
    "-- as of the release, written by scripts/freeze_baseline.py. Frozen: never edited.\n"
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
    parser.parse_args()
    if DELTA.exists():
        print(f"{DELTA.relative_to(REPO)} exists: the baseline is frozen; add a revision "
              "after it (README.md, \"Changing the schema\")", file=sys.stderr)
        return 1
    DELTA.write_text(baseline_text(), encoding="utf-8")
    print(f"wrote {DELTA.relative_to(REPO)} from {len(list(SQL.glob('*.sql')))} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
