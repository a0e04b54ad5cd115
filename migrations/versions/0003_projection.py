"""Projection reads: pair and summary metadata without text, then only the texts needed.

Revision ID: 0003_projection
Revises: 0002_core
Create Date: 2026-11-30
"""

from pycompactor.schema import run_delta

revision = "0003_projection"
down_revision = "0002_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0003_projection.up.sql")


def downgrade() -> None:
    run_delta("0003_projection.down.sql")
