"""An attempt's change is recorded from the rows its writer holds (no re-reads).

Revision ID: 0017_lean_cycle
Revises: 0016_inlined_rules
Create Date: 2026-12-02
"""

from pycompactor.schema import run_delta

revision = "0017_lean_cycle"
down_revision = "0016_inlined_rules"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0017_lean_cycle.up.sql")


def downgrade() -> None:
    run_delta("0017_lean_cycle.down.sql")
