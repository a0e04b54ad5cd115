"""The worker-callable surface as a security boundary: server time, leases, reason codes, admission.

Revision ID: 0007_worker_surface
Revises: 0006_queue_leases
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0007_worker_surface"
down_revision = "0006_queue_leases"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0007_worker_surface.up.sql")


def downgrade() -> None:
    run_delta("0007_worker_surface.down.sql")
