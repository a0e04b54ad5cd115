"""The small rules on every claim and completion inline into their callers.

Revision ID: 0016_inlined_rules
Revises: 0015_verdicts_in_reach
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0016_inlined_rules"
down_revision = "0015_verdicts_in_reach"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0016_inlined_rules.up.sql")


def downgrade() -> None:
    run_delta("0016_inlined_rules.down.sql")
