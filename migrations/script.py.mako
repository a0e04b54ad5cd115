"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from pycompactor.schema import run_delta

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_delta("${up_revision}.up.sql")


def downgrade() -> None:
    run_delta("${up_revision}.down.sql")
