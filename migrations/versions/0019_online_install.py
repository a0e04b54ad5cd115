"""Installing onto a large live database without stalling it: attach waits briefly, the
rebuild walks conversations by key, commits small batches and resumes.

Revision ID: 0019_online_install
Revises: 0018_worker_boundary
Create Date: 2026-12-02
"""

from pycompactor.schema import run_delta

revision = "0019_online_install"
down_revision = "0018_worker_boundary"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0019_online_install.up.sql")


def downgrade() -> None:
    run_delta("0019_online_install.down.sql")
