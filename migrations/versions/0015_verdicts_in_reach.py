"""projection_frame: every rejected verdict, and the chosen ones within the reach only.

Revision ID: 0015_verdicts_in_reach
Revises: 0014_projection_frame
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0015_verdicts_in_reach"
down_revision = "0014_projection_frame"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0015_verdicts_in_reach.up.sql")


def downgrade() -> None:
    run_delta("0015_verdicts_in_reach.down.sql")
