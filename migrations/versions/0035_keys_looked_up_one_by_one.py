"""Lookups that name a few keys of one conversation look each key up on its own: under
generic plans they had read every run, pair, message or queue entry of a large
conversation wherever conversations are small on average.

Revision ID: 0035_keys_looked_up_one_by_one
Revises: 0034_named_runs_asked_as_named
Create Date: 2026-12-04
"""

from pycompactor.schema import run_delta

revision = "0035_keys_looked_up_one_by_one"
down_revision = "0034_named_runs_asked_as_named"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0035_keys_looked_up_one_by_one.up.sql")


def downgrade() -> None:
    run_delta("0035_keys_looked_up_one_by_one.down.sql")
