"""Derived state kept by the engine: pairs, ranges and hashes maintained by tracking triggers.

Revision ID: 0005_derived_state
Revises: 0004_attempt_stats
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0005_derived_state"
down_revision = "0004_attempt_stats"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0005_derived_state.up.sql")


def downgrade() -> None:
    run_delta("0005_derived_state.down.sql")
