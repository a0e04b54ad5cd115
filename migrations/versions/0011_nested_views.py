"""Source views may read views: source_stamp follows plain views through any depth.

Revision ID: 0011_nested_views
Revises: 0010_tracking_messages
Create Date: 2026-12-01
"""

from pycompactor.schema import run_delta

revision = "0011_nested_views"
down_revision = "0010_tracking_messages"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0011_nested_views.up.sql")


def downgrade() -> None:
    run_delta("0011_nested_views.down.sql")
