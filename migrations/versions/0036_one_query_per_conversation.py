"""judge_runs asks Citus for one conversation in one query, sent whole to the node that
holds it: named runs are read apart, and a conversation of up to 256 runs asks the
cross-conversation question with its runs as a value.

Revision ID: 0036_one_query_per_conversation
Revises: 0035_keys_looked_up_one_by_one
Create Date: 2026-12-04
"""

from pycompactor.schema import run_delta

revision = "0036_one_query_per_conversation"
down_revision = "0035_keys_looked_up_one_by_one"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0036_one_query_per_conversation.up.sql")


def downgrade() -> None:
    run_delta("0036_one_query_per_conversation.down.sql")
