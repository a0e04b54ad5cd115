"""Token usage and figures kept per attempt: complete(p_stats), audit_jobs columns.

Revision ID: 0004_attempt_stats
Revises: 0003_projection
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0004_attempt_stats"
down_revision = "0003_projection"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0004_attempt_stats.up.sql")


def downgrade() -> None:
    run_delta("0004_attempt_stats.down.sql")
