"""The owner's model preference among a range's valid summaries: a second model tried on
the same database changes the next Run's history only where the preference lets it.

Revision ID: 0048_projection_models
Revises: 0047_settled_run_before_messages
Create Date: 2026-12-06
"""

from pycompactor.schema import run_delta

revision = "0048_projection_models"
down_revision = "0047_settled_run_before_messages"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0048_projection_models.up.sql")


def downgrade() -> None:
    run_delta("0048_projection_models.down.sql")
