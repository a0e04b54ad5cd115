"""A claim -> complete cycle does less for the same rows: complete writes a new summary's
first verdict and frees its slot itself, fence drops its own definer settings, the
helpers that check p_now, p_lease and p_stats are called only when there is something to
check, claim reads the range itself, and the CHECKs of jobs and admission are one call
each.

Revision ID: 0045_lighter_claim_cycle
Revises: 0044_runs_found_by_hash_alone
Create Date: 2026-12-05
"""

from pycompactor.schema import run_delta

revision = "0045_lighter_claim_cycle"
down_revision = "0044_runs_found_by_hash_alone"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("0045_lighter_claim_cycle.up.sql")


def downgrade() -> None:
    run_delta("0045_lighter_claim_cycle.down.sql")
