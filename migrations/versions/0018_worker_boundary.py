"""An attempt belongs to the login that claimed it; only engine roles lock a conversation.

Revision ID: 0018_worker_boundary
Revises: 0017_lean_cycle
Create Date: 2026-12-02
"""

from pycompactor.schema import run_delta

revision = "0018_worker_boundary"
down_revision = "0017_lean_cycle"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0018_worker_boundary.up.sql")


def downgrade() -> None:
    run_delta("0018_worker_boundary.down.sql")
