"""A table tracked by message id looks each new message up by its id on its own in
track_source_changes (as revision 0035 does for the runs): the generic plan read every
index entry of a long conversation twice an insert.

Revision ID: 0039_message_keys_one_by_one
Revises: 0038_claims_judged_once
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0039_message_keys_one_by_one"
down_revision = "0038_claims_judged_once"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0039_message_keys_one_by_one.up.sql")


def downgrade() -> None:
    run_delta("0039_message_keys_one_by_one.down.sql")
