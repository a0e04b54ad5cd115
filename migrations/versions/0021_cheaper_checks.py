"""Cheaper checks: oversized_identifier inlines, and attempts' seven CHECKs are one.

Revision ID: 0021_cheaper_checks
Revises: 0020_rebuild_without_jit
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0021_cheaper_checks"
down_revision = "0020_rebuild_without_jit"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0021_cheaper_checks.up.sql")


def downgrade() -> None:
    run_delta("0021_cheaper_checks.down.sql")
