"""A projection's one statement does less for the same rows: projection_read's walk
collects the ids of the texts it sends in place, where it copied the whole list at every
step (the square of the texts a projection includes), and reads the texts itself, where
projection_texts' statement of its own stored each text row twice more.

Revision ID: 0043_walk_appends_in_place
Revises: 0042_no_tracking_on_citus
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0043_walk_appends_in_place"
down_revision = "0042_no_tracking_on_citus"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0043_walk_appends_in_place.up.sql")


def downgrade() -> None:
    run_delta("0043_walk_appends_in_place.down.sql")
