"""The revised §3: a message belongs to its own conversation's run of its run id; a
foreign one (its conversation has no run of that id) is recorded per conversation, and
derived pairs judge each conversation by its own rows.

Revision ID: 0048_foreign_messages
Revises: 0047_settled_run_before_messages
Create Date: 2026-12-06
"""

from pycompactor.schema import run_delta

revision = "0048_foreign_messages"
down_revision = "0047_settled_run_before_messages"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0048_foreign_messages.up.sql")


def downgrade() -> None:
    run_delta("0048_foreign_messages.down.sql")
