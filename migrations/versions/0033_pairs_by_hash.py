"""compaction.pairs finds a Run's pair through a hash index on run_id; its primary key is
(conversation_id, pair_index), which was unique already. A third of the derived state's
size was the B-tree on (conversation_id, run_id).

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
