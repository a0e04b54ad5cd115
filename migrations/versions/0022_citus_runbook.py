"""Citus as a DBA runs it: the auditor reads every audit view through definer functions,
and the queue is distributed apart so an application's transaction may enqueue.

Revision ID: 0022_citus_runbook
Revises: 0021_cheaper_cycle
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0022_citus_runbook"
down_revision = "0021_cheaper_cycle"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0022_citus_runbook.up.sql")


def downgrade() -> None:
    run_delta("0022_citus_runbook.down.sql")
