"""The event log derived from the attempts' own rows: an attempt records its claim and
its end (claim_* and finish_* columns), compaction.audit_events is a view over them and
compaction.event_log (the table it was: imports, erasures, earlier events).

Revision ID: 0027_attempt_events
Revises: 0026_hot_admission
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0027_attempt_events"
down_revision = "0026_hot_admission"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0027_attempt_events.up.sql")


def downgrade() -> None:
    run_delta("0027_attempt_events.down.sql")
