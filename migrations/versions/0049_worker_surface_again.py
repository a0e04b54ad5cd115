"""The worker surface, second pass (issue 62): leases bounded by when they end, refused
calls that lock nothing, bounded worker-chosen fields, tracking on the source's tables.

Revision ID: 0049_worker_surface_again
Revises: 0048_figures_invented
Create Date: 2026-12-07
"""

from pycompactor.schema import run_delta

revision = "0049_worker_surface_again"
down_revision = "0048_figures_invented"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0049_worker_surface_again.up.sql")


def downgrade() -> None:
    run_delta("0049_worker_surface_again.down.sql")
