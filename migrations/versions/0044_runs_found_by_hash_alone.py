"""compaction.pairs finds a Run's pair through a B-tree on the hash of its run id alone,
where the index it replaces also held the conversation's id in every entry (about 34
bytes a message where ids are uuids); the lookups of one run's pair filter on the
conversation, so they plan on that index whatever the statistics say.

Revision ID: 0044_runs_found_by_hash_alone
Revises: 0043_walk_appends_in_place
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0044_runs_found_by_hash_alone"
down_revision = "0043_walk_appends_in_place"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0044_runs_found_by_hash_alone.up.sql")


def downgrade() -> None:
    run_delta("0044_runs_found_by_hash_alone.down.sql")
