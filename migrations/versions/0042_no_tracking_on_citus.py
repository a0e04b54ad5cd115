"""The change-tracking triggers never run on Citus: attach_source_tracking refuses there,
distribute_on_citus detaches them from every table, and complete and import_summary
write no verdict row where no derived state is kept.

Revision ID: 0042_no_tracking_on_citus
Revises: 0041_frame_judged_from_views
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0042_no_tracking_on_citus"
down_revision = "0041_frame_judged_from_views"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0042_no_tracking_on_citus.up.sql")


def downgrade() -> None:
    run_delta("0042_no_tracking_on_citus.down.sql")
