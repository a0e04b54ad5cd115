"""compaction.claim_targets: a worker's claims of one conversation under one lock and one
judgement, each answered as compaction.claim would answer it; claim and claim_targets
share compaction.claim_range, plan_targets and claim_targets compaction.target_ranges; a
claim judges before the conversation's lock; on Citus, judge_runs' question to every shard
runs on one connection per node.

Revision ID: 0038_claims_judged_once
Revises: 0037_replies_from_the_claim
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0038_claims_judged_once"
down_revision = "0037_replies_from_the_claim"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0038_claims_judged_once.up.sql")


def downgrade() -> None:
    run_delta("0038_claims_judged_once.down.sql")
