"""projection_frame: the newest pairs and every summary's verdict in one statement.

Revision ID: 0014_projection_frame
Revises: 0013_citus
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0014_projection_frame"
down_revision = "0013_citus"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0014_projection_frame.up.sql")


def downgrade() -> None:
    run_delta("0014_projection_frame.down.sql")
