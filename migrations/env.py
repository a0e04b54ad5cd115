"""Alembic environment of pycompactor.

The version table lives in schema `compaction` (compaction.alembic_version), so it never
collides with a host application's own public.alembic_version. All revisions run in one
transaction, serialised by a transaction-scoped advisory lock.

Programmatic use passes the DSN in config.attributes["dsn"]; the alembic command line
takes `-x dsn=...` or PYCOMPACTOR_DSN.
"""

from __future__ import annotations

import os

from alembic import context

from pycompactor import schema

config = context.config
dsn = (
    config.attributes.get("dsn")
    or context.get_x_argument(as_dictionary=True).get("dsn")
    or os.environ.get("PYCOMPACTOR_DSN", "")
)

if context.is_offline_mode():
    raise SystemExit("pycompactor migrations need a live database; offline mode is not supported")

engine = schema.make_engine(dsn)
with engine.connect() as connection:
    context.configure(
        connection=connection,
        version_table=schema.VERSION_TABLE,
        version_table_schema=schema.VERSION_TABLE_SCHEMA,
        transactional_ddl=True,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        schema.prepare_migration(connection)
        context.run_migrations()
