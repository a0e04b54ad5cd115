"""Judging from the views costs one judgement per projection: projection_summaries and
plan_targets hash their ranges in one statement.

Revision ID: 0023_judged_once
Revises: 0022_citus_runbook
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0023_judged_once"
down_revision = "0022_citus_runbook"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0023_judged_once.up.sql")


def downgrade() -> None:
    run_delta("0023_judged_once.down.sql")
