"""The rules a CHECK constraint calls are compiled once per session: summary_problem and
valid_source_hash are PL/pgSQL (PostgreSQL re-prepares CHECK expressions in every
statement that writes a table, and parsed their SQL bodies each time), and
valid_source_hash tests its characters without a regular expression.

Revision ID: 0032_checks_compiled_once
Revises: 0031_rebuild_gives_way
Create Date: 2026-12-04
"""

from pycompactor.schema import run_delta

revision = "0032_checks_compiled_once"
down_revision = "0031_rebuild_gives_way"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0032_checks_compiled_once.up.sql")


def downgrade() -> None:
    run_delta("0032_checks_compiled_once.down.sql")
