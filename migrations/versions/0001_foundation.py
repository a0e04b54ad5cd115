"""Foundation: roles, schemas, source contract, eligible pairs, window policy, source hash.

Revision ID: 0001_foundation
Revises:
Create Date: 2026-11-29
"""

from pycompactor.schema import run_delta

revision = "0001_foundation"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0001_foundation.up.sql")


def downgrade() -> None:
    run_delta("0001_foundation.down.sql")
