"""Citus: the schema follows DESIGN §11 (keys, sequences, events and admission by functions).

Revision ID: 0013_citus
Revises: 0012_explain_from_state
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0013_citus"
down_revision = "0012_explain_from_state"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0013_citus.up.sql")


def downgrade() -> None:
    run_delta("0013_citus.down.sql")
