"""A projection in one statement: compaction.projection_read gives the frame and the texts
the budget walk includes, one round trip and one snapshot; projection_frame's pair arrays
from one ordered read.

Revision ID: 0029_projection_read
Revises: 0028_rebuild_steps
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0029_projection_read"
down_revision = "0028_rebuild_steps"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0029_projection_read.up.sql")


def downgrade() -> None:
    run_delta("0029_projection_read.down.sql")
