"""Applying the stored logic: alembic upgrades/downgrades and the current definition in sql/.

The SQL and the alembic environment ship inside the wheel (pycompactor/_data); in a
checkout they are read from the repository's own sql/ and migrations/ directories.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy
import sqlalchemy.exc
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.pool import NullPool

from pycompactor.errors import NotUtf8Database, PycompactorError, from_driver, wrap_exceptions

#: Two-key advisory lock class of the project (see sql/00_schema.sql).
LOCK_CLASS = 1129316352
MIGRATION_LOCK_KEY = 1
VERSION_TABLE = "alembic_version"
VERSION_TABLE_SCHEMA = "compaction"


def data_dir() -> Path:
    """Directory holding sql/ and migrations/ (installed package data, else the checkout)."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "_data", package.parent):
        if (candidate / "sql").is_dir() and (candidate / "migrations" / "env.py").is_file():
            return candidate
    raise PycompactorError(
        "pycompactor's SQL files are missing from the installation; reinstall the package"
    )


def sql_files() -> list[Path]:
    """The current definition, in the order it is applied."""
    return sorted((data_dir() / "sql").glob("*.sql"))


def delta_path(name: str) -> Path:
    return data_dir() / "migrations" / "deltas" / name


def make_engine(dsn: str) -> sqlalchemy.Engine:
    """A SQLAlchemy engine over psycopg that takes a libpq DSN or URI as psycopg does."""
    return sqlalchemy.create_engine(
        "postgresql+psycopg://",
        # client_encoding keeps text decodable even on a SQL_ASCII server, so the
        # encoding check below can refuse it with a readable message.
        creator=lambda: psycopg.connect(dsn, client_encoding="UTF8"),
        poolclass=NullPool,
    )


def alembic_config(dsn: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(data_dir() / "migrations"))
    config.attributes["dsn"] = dsn
    return config


def prepare_migration(connection: sqlalchemy.Connection) -> None:
    """Run first inside the migration transaction: refuse non-UTF8, serialise migrators.

    The advisory lock is transaction-scoped, so concurrent `migrate` processes queue here
    and the later ones find the version table already at head: a no-op.
    """
    encoding = connection.exec_driver_sql("SHOW server_encoding").scalar_one()
    if encoding != "UTF8":
        raise NotUtf8Database(
            f"pycompactor needs a UTF8-encoded database, this one is {encoding}; "
            "create it with ENCODING 'UTF8'"
        )
    connection.exec_driver_sql(
        f"SELECT pg_catalog.pg_advisory_xact_lock({LOCK_CLASS}, {MIGRATION_LOCK_KEY})"
    )
    connection.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {VERSION_TABLE_SCHEMA}")


def run_delta(name: str) -> None:
    """Execute one SQL delta file inside the running alembic revision.

    The file goes to psycopg without parameters, so `%` and `:name` in SQL text are
    sent verbatim (SQLAlchemy's text() would treat `:name` as a bind parameter).
    """
    from alembic import op

    raw: Any = op.get_bind().connection.dbapi_connection
    with raw.cursor() as cursor:
        execute_file(cursor, delta_path(name))


def execute_file(cursor: psycopg.Cursor[Any], path: Path) -> None:
    """Send one SQL file as a single parameterless simple query (`%`, `:name` stay verbatim)."""
    cursor.execute(path.read_text(encoding="utf-8").encode("utf-8"))


@contextlib.contextmanager
def _quiet_alembic() -> Iterator[None]:
    with contextlib.redirect_stdout(io.StringIO()):
        yield


@contextlib.contextmanager
def _wrap_sqlalchemy() -> Iterator[None]:
    """SQLAlchemy wraps the driver's errors in its own (`OperationalError:
    (psycopg.OperationalError) ...`): unwrap them into the hierarchy, so a migration's
    errors read as every other command's."""
    try:
        yield
    except sqlalchemy.exc.DBAPIError as exc:
        if isinstance(exc.orig, psycopg.Error):
            raise from_driver(exc.orig) from exc.orig
        raise


def upgrade(dsn: str, revision: str = "head",
            progress: Callable[[str], None] | None = None) -> None:
    """Apply the migrations up to `revision`; at head, also put the derived state in use.

    The back-fill of the derived state runs after alembic has committed, one batch of
    conversations per transaction (never one transaction holding every conversation),
    reporting each batch to `progress`.
    """
    with wrap_exceptions(), _wrap_sqlalchemy(), _quiet_alembic():
        command.upgrade(alembic_config(dsn), revision)
    if revision == "head":
        rebuild_derived_state(dsn, progress=progress, only_if_stale=True)


def rebuild_derived_state(dsn: str, *, progress: Callable[[str], None] | None = None,
                          only_if_stale: bool = False) -> bool:
    """Re-derive every conversation and put the derived state in use; True if it ran.

    Skipped (False) when the source views read tables without tracking triggers: the
    engine then judges from the views on each call (docs/integrating.md), or, with
    `only_if_stale`, when the derived state is already in use.
    """
    with wrap_exceptions(), psycopg.connect(dsn, autocommit=True) as conn:
        state = conn.execute(
            "SELECT pg_catalog.to_regprocedure('compaction.derived_state_current()') IS NOT NULL"
        ).fetchone()
        if state is None or not state[0]:
            return False  # a revision before derived state
        row = conn.execute(
            "SELECT compaction.source_stamp() IS NOT NULL, compaction.derived_state_current()"
        ).fetchone()
        assert row is not None
        tracked, current = row
        if not tracked or (only_if_stale and current):
            return False
        if progress is not None:
            report = progress

            def forward(diag: psycopg.errors.Diagnostic) -> None:
                if diag.message_primary:
                    report(diag.message_primary)

            conn.add_notice_handler(forward)
        conn.execute("CALL compaction.rebuild_derived_state()")
    return True


def downgrade(dsn: str, revision: str = "base") -> None:
    with wrap_exceptions(), _wrap_sqlalchemy(), _quiet_alembic():
        command.downgrade(alembic_config(dsn), revision)


def heads() -> list[str]:
    return list(ScriptDirectory.from_config(alembic_config("")).get_heads())


def current_revision(dsn: str) -> str | None:
    """The revision the database is at (None before the first migration)."""
    engine = make_engine(dsn)
    with wrap_exceptions(), _wrap_sqlalchemy(), engine.connect() as connection:
        context = MigrationContext.configure(
            connection,
            opts={"version_table": VERSION_TABLE, "version_table_schema": VERSION_TABLE_SCHEMA},
        )
        return context.get_current_revision()


def apply_current_definition(conn: psycopg.Connection[Any]) -> None:
    """Build the engine from sql/ directly (the reference the migrations are checked against)."""
    with wrap_exceptions(), conn.transaction(), conn.cursor() as cursor:
        for path in sql_files():
            execute_file(cursor, path)
