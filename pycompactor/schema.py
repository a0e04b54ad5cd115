"""Applying the stored logic: alembic upgrades/downgrades and the current definition in sql/.

The SQL and the alembic environment ship inside the wheel (pycompactor/_data); in a
checkout they are read from the repository's own sql/ and migrations/ directories.
"""

from __future__ import annotations

import contextlib
import io
import re
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

from pycompactor.errors import (
    NotUtf8Database,
    PreBaselineRevision,
    PycompactorError,
    from_driver,
    wrap_exceptions,
)

#: Two-key advisory lock class of the project (see sql/00_schema.sql).
LOCK_CLASS = 1129316352
MIGRATION_LOCK_KEY = 1
VERSION_TABLE = "alembic_version"
VERSION_TABLE_SCHEMA = "compaction"
#: The first revision of the released history: the whole schema of 0.1.0.
BASELINE = "0_1_0_baseline"
#: The unreleased development history squashed into the baseline (0001_foundation to
#: 0047_settled_run_before_messages, and the 0048s of branches merged before the release).
#: Revisions after the baseline are named by their release (0_1_1_name), never like these.
PRE_BASELINE = re.compile(r"00[0-4][0-9]_\w+")


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


def alembic_config(dsn: str, *, from_scratch: bool = False) -> Config:
    config = Config()
    config.set_main_option("script_location", str(data_dir() / "migrations"))
    config.attributes["dsn"] = dsn
    config.attributes["from_scratch"] = from_scratch
    return config


def prepare_migration(connection: sqlalchemy.Connection, *, from_scratch: bool = False) -> None:
    """Run first inside the migration transaction: refuse non-UTF8, serialise migrators,
    and with `from_scratch` drop the engine's schemas so the migrations start from empty.

    The advisory lock is transaction-scoped, so concurrent `migrate` processes queue here
    and the later ones find the version table already at head: a no-op. Dropping in the
    same transaction as the migrations means a failed run leaves the old schemas in place.
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
    if from_scratch:
        # CASCADE: whatever the host built on the engine goes too (its tracking triggers,
        # a view over compaction.source_runs), and compaction_source's reference history.
        connection.exec_driver_sql("DROP SCHEMA IF EXISTS compaction_source CASCADE")
        connection.exec_driver_sql(f"DROP SCHEMA IF EXISTS {VERSION_TABLE_SCHEMA} CASCADE")
    connection.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {VERSION_TABLE_SCHEMA}")


def refuse_unknown_revision(connection: sqlalchemy.Connection, script: ScriptDirectory) -> None:
    """Refuse, before any migration runs, a database stamped with a revision this package
    does not know: one from before the 0.1.0 baseline (PreBaselineRevision, CP040), or one
    a newer pycompactor wrote. Alembic would otherwise fail deep in its revision map with
    "Can't locate revision", naming no way out.
    """
    table = f"{VERSION_TABLE_SCHEMA}.{VERSION_TABLE}"
    present = connection.exec_driver_sql(
        f"SELECT pg_catalog.to_regclass('{table}') IS NOT NULL").scalar_one()
    if not present:
        return
    stamped = [str(row[0]) for row in connection.exec_driver_sql(
        f"SELECT version_num FROM {table} ORDER BY version_num")]
    known = {revision.revision for revision in script.walk_revisions()}
    for revision in stamped:
        if revision in known:
            continue
        if PRE_BASELINE.fullmatch(revision):
            raise PreBaselineRevision(
                f"this database's compaction schema is at revision {revision}, from before"
                f" the 0.1.0 baseline, and no migration leads on from it (CP040): on a"
                f" throwaway database run `pycompactor migrate --from-scratch` (it drops"
                f" schemas compaction and compaction_source, the reference history"
                f" included), else move the history into a new database as docs/operations.md"
                f" says (\"Databases from before the 0.1.0 baseline\")")
        raise PycompactorError(
            f"this database's compaction schema is at revision {revision}, which this"
            f" pycompactor does not know: a newer version migrated it; install that version"
            f" or a later one")


def run_delta(name: str) -> None:
    """Execute one SQL delta file inside the running alembic revision.

    The file goes to psycopg without parameters, so `%` and `:name` in SQL text are
    sent verbatim (SQLAlchemy's text() would treat `:name` as a bind parameter).
    """
    from alembic import op

    raw: Any = op.get_bind().connection.dbapi_connection
    with raw.cursor() as cursor:
        execute_file(cursor, delta_path(name))


def run_definition() -> None:
    """Execute the current definition (sql/, in order) inside the running alembic
    revision: the 0.1.0 baseline's upgrade until the release freezes it into a delta."""
    from alembic import op

    raw: Any = op.get_bind().connection.dbapi_connection
    with raw.cursor() as cursor:
        for path in sql_files():
            execute_file(cursor, path)


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
            progress: Callable[[str], None] | None = None, *,
            from_scratch: bool = False) -> None:
    """Apply the migrations up to `revision`; at head, also put the derived state in use.

    `from_scratch` first drops schemas compaction and compaction_source with everything
    in them (the reference history included), in the migrations' transaction: for a
    throwaway database, or one stamped with a revision from before the baseline.

    The back-fill of the derived state runs after alembic has committed, one batch of
    conversations per transaction (never one transaction holding every conversation),
    reporting each batch to `progress`.
    """
    with wrap_exceptions(), _wrap_sqlalchemy(), _quiet_alembic():
        command.upgrade(alembic_config(dsn, from_scratch=from_scratch), revision)
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
