"""A Run written in a state that pairs before any of its messages is not judged: the
tracking's no-change test counts a Run with no user message as one that cannot pair.

Revision ID: 0047_settled_run_before_messages
Revises: 0046_versions_known_without_lock
Create Date: 2026-12-06
"""

from pycompactor.schema import run_delta

revision = "0047_settled_run_before_messages"
down_revision = "0046_versions_known_without_lock"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0047_settled_run_before_messages.up.sql")


def downgrade() -> None:
    run_delta("0047_settled_run_before_messages.down.sql")
