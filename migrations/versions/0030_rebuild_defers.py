"""The rebuild leaves no half-full indexes: while it runs and the derived state is not in
use, a tracked write to a conversation it has not reached is left to it; a TRUNCATE
clears its resume point.

Revision ID: 0030_rebuild_defers
Revises: 0029_projection_read
Create Date: 2026-12-04
"""

from pycompactor.schema import run_delta

revision = "0030_rebuild_defers"
down_revision = "0029_projection_read"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0030_rebuild_defers.up.sql")


def downgrade() -> None:
    run_delta("0030_rebuild_defers.down.sql")
