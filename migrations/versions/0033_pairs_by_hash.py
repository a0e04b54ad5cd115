"""compaction.pairs finds a Run's pair by its conversation and a hash of its run id; its
primary key is (conversation_id, pair_index), which was unique already. The B-tree on
(conversation_id, run_id) it replaces was 29% of the derived state's size.

Revision ID: 0033_pairs_by_hash
Revises: 0032_checks_compiled_once
Create Date: 2026-12-04
"""

from pycompactor.schema import run_delta

revision = "0033_pairs_by_hash"
down_revision = "0032_checks_compiled_once"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0033_pairs_by_hash.up.sql")


def downgrade() -> None:
    run_delta("0033_pairs_by_hash.down.sql")
