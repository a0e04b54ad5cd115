"""judge_runs reads a whole conversation's run ids in a statement of their own before the
read across conversations by run id (on Citus no distributed subplan sent to every node).

Revision ID: 0030_foreign_runs_apart
Revises: 0029_projection_read
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0030_foreign_runs_apart"
down_revision = "0029_projection_read"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0030_foreign_runs_apart.up.sql")


def downgrade() -> None:
    run_delta("0030_foreign_runs_apart.down.sql")
