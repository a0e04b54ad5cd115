"""A queue that leases instead of deleting: dequeue leases, ack removes, scopes apart.

Revision ID: 0006_queue_leases
Revises: 0005_derived_state
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0006_queue_leases"
down_revision = "0005_derived_state"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0006_queue_leases.up.sql")


def downgrade() -> None:
    run_delta("0006_queue_leases.down.sql")
