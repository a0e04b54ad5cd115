"""compaction.claim_next_targets: a worker's look at a conversation and its first claims
under one judgement of the conversation (worker_targets, then claim_targets, judged it
twice).

Revision ID: 0040_claims_with_the_targets
Revises: 0039_message_keys_one_by_one
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0040_claims_with_the_targets"
down_revision = "0039_message_keys_one_by_one"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0040_claims_with_the_targets.up.sql")


def downgrade() -> None:
    run_delta("0040_claims_with_the_targets.down.sql")
