"""A cheaper cycle: oversized_identifier inlines, attempts' seven CHECKs are one, and claim
plans its admission condition once.

Revision ID: 0021_cheaper_cycle
Revises: 0020_rebuild_without_jit
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0021_cheaper_cycle"
down_revision = "0020_rebuild_without_jit"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0021_cheaper_cycle.up.sql")


def downgrade() -> None:
    run_delta("0021_cheaper_cycle.down.sql")
