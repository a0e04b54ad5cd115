"""Admission slots updated HOT: an attempt keeps its slot (attempts.slot), the slots lose
their holder indexes, settings.admission_high_water bounds the look above a lowered
max_running.

Revision ID: 0026_hot_admission
Revises: 0025_lean_pairs
Create Date: 2026-12-03
"""

from pycompactor.schema import run_delta

revision = "0026_hot_admission"
down_revision = "0025_lean_pairs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0026_hot_admission.up.sql")


def downgrade() -> None:
    run_delta("0026_hot_admission.down.sql")
