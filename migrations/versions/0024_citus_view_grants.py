"""On Citus the reader reads compaction.summaries and both the reader and the worker read
the source views: each holds SELECT on what its views read there.

Revision ID: 0024_citus_view_grants
Revises: 0023_judged_once
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0024_citus_view_grants"
down_revision = "0023_judged_once"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0024_citus_view_grants.up.sql")


def downgrade() -> None:
    run_delta("0024_citus_view_grants.down.sql")
