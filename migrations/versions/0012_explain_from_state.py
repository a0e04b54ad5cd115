"""explain_runs from the derived state while it is current: only runs without a pair are judged.

Revision ID: 0012_explain_from_state
Revises: 0011_nested_views
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0012_explain_from_state"
down_revision = "0011_nested_views"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0012_explain_from_state.up.sql")


def downgrade() -> None:
    run_delta("0012_explain_from_state.down.sql")
