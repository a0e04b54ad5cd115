"""A queue that leases instead of deleting: dequeue leases, ack removes, scopes apart.

Revision ID: 0005_queue_leases
Revises: 0004_attempt_stats
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0005_queue_leases"
down_revision = "0004_attempt_stats"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0005_queue_leases.up.sql")


def downgrade() -> None:
    run_delta("0005_queue_leases.down.sql")
