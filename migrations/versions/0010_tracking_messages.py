"""Tracking by message id for host tables whose runs the views derive (appends re-derive one run).

Revision ID: 0010_tracking_messages
Revises: 0009_projection_rank
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0010_tracking_messages"
down_revision = "0009_projection_rank"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0010_tracking_messages.up.sql")


def downgrade() -> None:
    run_delta("0010_tracking_messages.down.sql")
