"""Invented figures: complete's p_stats takes figures_invented, kept with the attempt and
shown by compaction.audit_jobs.

Revision ID: 0048_figures_invented
Revises: 0047_settled_run_before_messages
Create Date: 2026-12-07
"""

from pycompactor.schema import run_delta

revision = "0048_figures_invented"
down_revision = "0047_settled_run_before_messages"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0048_figures_invented.up.sql")


def downgrade() -> None:
    run_delta("0048_figures_invented.down.sql")
