"""The API key and the database password never appear in logs, errors or --json output.

Every command runs as a subprocess with a DSN carrying a password (a LOGIN role of its
own; the test cluster trusts loopback, so the password travels but is not checked) and
OPENAI_API_KEY set to a marker, on success and error paths: a model server that echoes
the key back in its error bodies, an unreachable server, malformed DSNs (libpq quotes
them), and a wrong password (checked by a PgBouncer with md5 auth). All captured
output is searched for both markers.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor.cli.cluster import free_port
from tests.e2e.cli import run_cli
from tests.history import History
from tests.modelserver import ModelServer, RecordedRequest, ScriptedResponse, raw, stop
from tests.pgbouncer import PgBouncer
from tests.workerkit import worker_env

Conn = psycopg.Connection[Any]

API_KEY = "sk-API-KEY-MARKER-7f3a9c1e"
PASSWORD = "DB-PASSWORD-MARKER-b5d2e8"


@pytest.fixture
def secret_role(conn: Conn) -> Iterator[str]:
    """A LOGIN role with a password and the three engine roles."""
    name = f"secret_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE compaction_worker,"
                         " compaction_reader, compaction_auditor").format(
                             sql.Identifier(name), sql.Literal(PASSWORD)))
    yield name
    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _echo_key(request: RecordedRequest) -> ScriptedResponse:
    """A server that quotes the caller's key back in its errors (some do)."""
    replies = json.loads(request.json["messages"][1]["content"])["assistant_replies"]
    key = request.headers.get("authorization", "")
    body = json.dumps({"error": {"message": f"Incorrect API key provided: {key}",
                                 "type": "invalid_request_error", "code": "invalid_api_key"}})
    if replies[0]["assistant_message_id"].startswith("conv-401"):
        return raw(body.encode(), status=401)
    if replies[0]["assistant_message_id"].startswith("conv-500"):
        return raw(body.encode(), status=500)
    return stop("A summary.")


def _assert_clean(outputs: list[tuple[str, str]]) -> None:
    for label, text in outputs:
        for secret in (API_KEY, PASSWORD, quote(PASSWORD)):
            assert secret not in text, f"{label} leaked {secret!r}:\n{text}"


def test_secrets_never_printed(conn: Conn, dsn: str, secret_role: str,
                               postgresql_proc: PostgreSQLExecutor) -> None:
    h = History(conn)
    for name in ("conv-ok", "conv-401", "conv-500"):
        h.pairs(name, 30)
    dbname = str(conninfo_to_dict(dsn)["dbname"])
    host, port = postgresql_proc.host, postgresql_proc.port
    secret_dsn = f"host={host} port={port} user={secret_role} password={PASSWORD} dbname={dbname}"
    nowhere = free_port()  # nothing listens here
    outputs: list[tuple[str, str]] = []

    def run(label: str, *args: str, env: dict[str, str], code: int = 0) -> str:
        result = run_cli(*args, env=env)
        outputs.append((label, result.stdout + result.stderr))
        assert result.returncode == code, (label, result.stdout, result.stderr)
        return result.stdout + result.stderr

    with ModelServer(handler=_echo_key) as server:
        env = worker_env(secret_dsn, server.base_url, OPENAI_API_KEY=API_KEY)
        log = run("worker json", "worker", "--once", "--log-format", "json",
                  "--model", "gpt-test", env=env)
        events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        failed = {e["conversation_id"]: e for e in events if e["event"] == "failed"}
        assert failed["conv-401"]["reason"] == "http_401"
        assert failed["conv-500"]["reason"] == "http_500"
        # The server did echo the key: the log shows where it was masked.
        assert "***" in failed["conv-401"]["detail"]
        assert [e["conversation_id"] for e in events if e["event"] == "completed"] == [
            "conv-ok"]
        log = run("worker text", "worker", "--once", "--sweep", "--log-format", "text",
                  "--model", "gpt-test", env=env)
        assert " failed " in log  # the retries (attempt 2) failed again, echoing the key
        assert all(r.headers["authorization"] == f"Bearer {API_KEY}" for r in server.requests)

    env = worker_env(secret_dsn, OPENAI_API_KEY=API_KEY)
    run("plan json", "plan", "conv-ok", "--json", env=env)
    run("plan text", "plan", "conv-ok", env=env)
    run("project json", "project", "conv-ok", "--budget-bytes", "100000", "--json", env=env)
    run("audit json", "audit", "--json", env=env)
    run("audit events", "audit", "--view", "events", "--json", env=env)
    run("check-source", "check-source", "--json", env=env)

    # Error paths: unreachable server, with the password in the DSN or in PGPASSWORD.
    unreachable = f"host=127.0.0.1 port={nowhere} user={secret_role} password={PASSWORD}"
    for args in (("plan", "conv-ok", "--json"), ("audit", "--json"),
                 ("worker", "--once", "--log-format", "json", "--model", "gpt-test"),
                 ("migrate",), ("plan", "conv-ok", "--debug")):
        out = run(f"unreachable {args[0]}", *args,
                  env=worker_env(unreachable, OPENAI_API_KEY=API_KEY), code=1)
        assert "pycompactor: error:" in out
    run("PGPASSWORD", "plan", "conv-ok", env={
        **worker_env(f"host=127.0.0.1 port={nowhere} user={secret_role}"),
        "PGPASSWORD": PASSWORD}, code=1)
    # Malformed DSNs, which libpq and SQLAlchemy quote back in their errors.
    for malformed in (f"postgresql://{secret_role}:%zz{PASSWORD}@127.0.0.1:{nowhere}/db",
                      f"postgresql://{secret_role}:{PASSWORD}@[::1/{dbname}"):
        commands: list[tuple[str, ...]] = [
            ("plan", "conv-ok"), ("migrate",), ("audit", "--json", "--debug"),
            ("worker", "--once", "--model", "pycompactor/extractive-1")]
        for command in commands:
            out = run(f"malformed {command[0]}", *command,
                      env=worker_env(malformed, OPENAI_API_KEY=API_KEY), code=1)
            assert "***" in out  # the message is kept, the password masked

    # A wrong password, refused by a pooler that checks it (md5 against its auth file).
    with PgBouncer(host, port, auth_type="md5",
                   users={secret_role: "the-right-password"}) as bouncer:
        wrong = bouncer.dsn(dbname, secret_role, PASSWORD)
        for args in (("plan", "conv-ok", "--json"),
                     ("worker", "--once", "--log-format", "json", "--model", "gpt-test")):
            out = run(f"wrong password {args[0]}", *args,
                      env=worker_env(wrong, OPENAI_API_KEY=API_KEY), code=1)
            assert "password authentication failed" in out
    _assert_clean(outputs)
