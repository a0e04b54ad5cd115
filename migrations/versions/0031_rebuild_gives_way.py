"""The rebuild never waits for a writer long while it holds a batch: a conversation a writer
holds ends the batch, and the batch's wait for the writers that left conversations to it
gives way after 100 ms, so no application transaction deadlocks with it; two rebuilds
may run at once. Upgrades either released form of revision 0030 (rederive taking a
boolean, as first committed; or the trigger's table, as landed).

Revision ID: 0031_rebuild_gives_way
Revises: 0030_rebuild_defers
Create Date: 2026-12-04
"""

from pycompactor.schema import run_delta

revision = "0031_rebuild_gives_way"
down_revision = "0030_rebuild_defers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0031_rebuild_gives_way.up.sql")


def downgrade() -> None:
    run_delta("0031_rebuild_gives_way.down.sql")
