"""judge_runs finds the runs it is given by run id, and asks whether they have messages
in another conversation about them as given: under its generic plan, both reads had
scanned every run of a large conversation where conversations are small on average.

Revision ID: 0034_named_runs_asked_as_named
Revises: 0033_pairs_by_hash
Create Date: 2026-12-04
"""

from pycompactor.schema import run_delta

revision = "0034_named_runs_asked_as_named"
down_revision = "0033_pairs_by_hash"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0034_named_runs_asked_as_named.up.sql")


def downgrade() -> None:
    run_delta("0034_named_runs_asked_as_named.down.sql")
