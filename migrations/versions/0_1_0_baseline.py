"""The schema of pycompactor 0.1.0 in one revision: sql/ as of the release.

Until 0.1.0 is released the up delta is regenerated from sql/ by `make baseline`
(scripts/build_baseline.py); from the release on it is frozen, and every change is a new
revision after this one. A database stamped with a revision from before the baseline (the
0001-0047 series of the unreleased development history) is refused before any migration
runs (pycompactor.schema.refuse_unknown_revision).

Revision ID: 0_1_0_baseline
Revises:
Create Date: 2026-12-06
"""

from pycompactor.schema import run_delta

revision = "0_1_0_baseline"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0_1_0_baseline.up.sql")


def downgrade() -> None:
    run_delta("0_1_0_baseline.down.sql")
