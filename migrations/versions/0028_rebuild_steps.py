"""The rebuild steps to the next conversation by an ordered read of one row, not min():
linear over source views built from several rows of another table (the Agents SDK recipe).

Revision ID: 0028_rebuild_steps
Revises: 0027_attempt_events
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0028_rebuild_steps"
down_revision = "0027_attempt_events"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0028_rebuild_steps.up.sql")


def downgrade() -> None:
    run_delta("0028_rebuild_steps.down.sql")
