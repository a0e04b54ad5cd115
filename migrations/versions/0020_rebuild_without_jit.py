"""The rebuild without JIT: its resume point's one-row UPDATE no longer compiles at every
commit.

Revision ID: 0020_rebuild_without_jit
Revises: 0019_online_install
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0020_rebuild_without_jit"
down_revision = "0019_online_install"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0020_rebuild_without_jit.up.sql")


def downgrade() -> None:
    run_delta("0020_rebuild_without_jit.down.sql")
