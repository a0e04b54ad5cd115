"""range_replies reads a claimed range's replies by the ids of its job, with the hash of
their texts, instead of judging the conversation again when the derived state is not in
use (always on Citus).

Revision ID: 0037_replies_from_the_claim
Revises: 0036_one_query_per_conversation
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0037_replies_from_the_claim"
down_revision = "0036_one_query_per_conversation"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0037_replies_from_the_claim.up.sql")


def downgrade() -> None:
    run_delta("0037_replies_from_the_claim.down.sql")
