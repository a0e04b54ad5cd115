"""Database core: jobs, attempts, summaries, claims, fencing, admission, immutability, audit.

Revision ID: 0002_core
Revises: 0001_foundation
Create Date: 2026-11-30
"""

from pycompactor.schema import run_delta

revision = "0002_core"
down_revision = "0001_foundation"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0002_core.up.sql")


def downgrade() -> None:
    run_delta("0002_core.down.sql")
