"""The schema of pycompactor 0.1.0 in one revision.

Until 0.1.0 is released this revision applies sql/ itself, the current definition, so
the schema has one text and no copy of it to keep equal. The release freezes it: `make
freeze-baseline` (scripts/freeze_baseline.py) writes sql/ as it is then into
migrations/deltas/0_1_0_baseline.up.sql, and from then on this revision runs that file
and never changes, and every change is a new revision after it
(tests/migrations/test_baseline.py refuses a revision after an unfrozen baseline). A
database stamped with a revision from before the baseline (the 0001-0047 series of the
unreleased development history) is refused before any migration runs
(pycompactor.schema.refuse_unknown_revision).

Revision ID: 0_1_0_baseline
Revises:
Create Date: 2026-12-06
"""

from pycompactor.schema import delta_path, run_definition, run_delta

revision = "0_1_0_baseline"
down_revision = None
branch_labels = None
depends_on = None

FROZEN = "0_1_0_baseline.up.sql"


def upgrade() -> None:
    if delta_path(FROZEN).exists():
        run_delta(FROZEN)
    else:
        run_definition()


def downgrade() -> None:
    run_delta("0_1_0_baseline.down.sql")
