"""Cheaper writes under the tracking triggers: short paths for no-change and appends.

Revision ID: 0008_write_costs
Revises: 0007_worker_surface
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0008_write_costs"
down_revision = "0007_worker_surface"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0008_write_costs.up.sql")


def downgrade() -> None:
    run_delta("0008_write_costs.down.sql")
