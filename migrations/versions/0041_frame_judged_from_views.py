"""A projection judged from the views judges the conversation once, in one statement
(projection_frame gives judged_frame's row: every pair and every verdict), and the
callers that judge from the views cut their ranges' ids out of one array in one pass.

Revision ID: 0041_frame_judged_from_views
Revises: 0040_claims_with_the_targets
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0041_frame_judged_from_views"
down_revision = "0040_claims_with_the_targets"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0041_frame_judged_from_views.up.sql")


def downgrade() -> None:
    run_delta("0041_frame_judged_from_views.down.sql")
