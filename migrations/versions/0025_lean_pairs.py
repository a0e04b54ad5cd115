"""Leaner derived state: compaction.pairs without pairs_order_idx; re-derivation finds a
changed position by pair_index.

Revision ID: 0025_lean_pairs
Revises: 0024_citus_view_grants
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0025_lean_pairs"
down_revision = "0024_citus_view_grants"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0025_lean_pairs.up.sql")


def downgrade() -> None:
    run_delta("0025_lean_pairs.down.sql")
