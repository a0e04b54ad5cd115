"""Alembic environment of pycompactor.

The version table lives in schema `compaction` (compaction.alembic_version), so it never
collides with a host application's own public.alembic_version. All revisions run in one
transaction, serialised by a transaction-scoped advisory lock.

Programmatic use passes the DSN in config.attributes["dsn"]; the alembic command line
takes `-x dsn=...` or PYCOMPACTOR_DSN. Either way, a database stamped with a revision
this package does not know (one from before the 0.1.0 baseline) is refused before any
migration runs.
"""

from __future__ import annotations

import os

from alembic import context

from pycompactor import schema
from pycompactor.errors import PycompactorError

config = context.config
# pycompactor's own callers (schema.upgrade, `pycompactor migrate`) pass the DSN here and
# report errors themselves.
programmatic = "dsn" in config.attributes
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
        try:
            schema.prepare_migration(
                connection, from_scratch=bool(config.attributes.get("from_scratch")))
            schema.refuse_unknown_revision(connection, context.script)
        except PycompactorError as exc:
            if programmatic:
                raise
            # alembic's command line prints a traceback for anything but its own errors;
            # the refusal is one line that names the way out.
            raise SystemExit(f"pycompactor: error: {exc}") from exc
        context.run_migrations()
