"""A connection that dies inside a pipelined engine call: the caller gets the error, and
nothing else reaches stderr (psycopg's "error ignored terminating <Pipeline>" warning
would break the CLI's one-line errors and the worker's one-event-per-line log)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from pycompactor import db
from pycompactor.cli import commands as cli
from pycompactor.worker.connections import is_transient
from pycompactor.errors import PycompactorError
if sys.argv[2] == "quiet":
    cli.quiet_driver_warnings()
conn = db.connect(sys.argv[1])
# the server ends this session between two calls (a restart, an operator, a pooler)
with db.connect(sys.argv[1]) as other:
    other.execute("SELECT pg_terminate_backend(%s, 10000)", (conn.info.backend_pid,))
try:
    if sys.argv[3] == "bound":
        db.eligible_pairs(conn, "c")  # its statements go in a pipeline
    else:
        db.plan_targets(conn, "c")  # one simple query
except PycompactorError as exc:
    print(type(exc).__name__, "transient" if is_transient(exc) else "final")
"""


def run(dsn: str, mode: str, form: str = "bound") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, dsn, mode, form],
                          capture_output=True, text=True, check=True, timeout=60)


# The server's notice of the termination (57P01) arrives first, or the closed socket.
LOST = {"DatabaseUnavailable transient", "PycompactorError transient"}


def test_pipeline_warning_stays_off_stderr(dsn: str) -> None:
    loud = run(dsn, "loud")
    # the reproduction: without the CLI's set-up psycopg does print the warning
    assert "error ignored terminating" in loud.stderr
    quiet = run(dsn, "quiet")
    assert quiet.stdout.strip() in LOST, quiet.stdout
    assert quiet.stderr == ""


def test_an_inline_call_on_a_dead_connection_raises_and_prints_nothing(dsn: str) -> None:
    """An inline call opens no pipeline: it raises the connection's loss, which the worker
    retries on a new connection, with nothing on stderr even without the CLI's set-up."""
    for mode in ("loud", "quiet"):
        result = run(dsn, mode, "inline")
        assert result.stdout.strip() in LOST, result.stdout
        assert result.stderr == ""
