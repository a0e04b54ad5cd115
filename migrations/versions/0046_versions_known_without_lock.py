"""A claim no longer locks its prompt version's row: the versions a job may name are a
list that the CHECK jobs_rules holds it to, in place of the foreign key to
compaction.prompt_versions, whose lock every concurrent claim took on the same row.

Revision ID: 0046_versions_known_without_lock
Revises: 0045_lighter_claim_cycle
Create Date: 2026-12-06
"""

from pycompactor.schema import run_delta

revision = "0046_versions_known_without_lock"
down_revision = "0045_lighter_claim_cycle"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0046_versions_known_without_lock.up.sql")


def downgrade() -> None:
    run_delta("0046_versions_known_without_lock.down.sql")
