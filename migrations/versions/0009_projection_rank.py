"""The preference among a range's summaries from the database: projection_summaries ranks versions.

Revision ID: 0009_projection_rank
Revises: 0008_write_costs
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0009_projection_rank"
down_revision = "0008_write_costs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0009_projection_rank.up.sql")


def downgrade() -> None:
    run_delta("0009_projection_rank.down.sql")
