"""A connection that dies inside a pipelined engine call: the caller gets the error, and
nothing else reaches stderr (psycopg's "error ignored terminating <Pipeline>" warning
would break the CLI's one-line errors and the worker's one-event-per-line log)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from pycompactor import cli, db
from pycompactor.errors import PycompactorError
if sys.argv[2] == "quiet":
    cli.quiet_driver_warnings()
conn = db.connect(sys.argv[1])
# the server ends this session between two calls (a restart, an operator, a pooler)
with db.connect(sys.argv[1]) as other:
    other.execute("SELECT pg_terminate_backend(%s, 10000)", (conn.info.backend_pid,))
try:
    db.eligible_pairs(conn, "c")  # a bound call: its statements go in a pipeline
except PycompactorError as exc:
    print(type(exc).__name__)
"""


def run(dsn: str, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, dsn, mode], capture_output=True,
                          text=True, check=True, timeout=60)


def test_pipeline_warning_stays_off_stderr(dsn: str) -> None:
    loud = run(dsn, "loud")
    # the reproduction: without the CLI's set-up psycopg does print the warning
    assert "error ignored terminating" in loud.stderr
    quiet = run(dsn, "quiet")
    assert quiet.stdout.strip() in {"DatabaseUnavailable", "PycompactorError"}, quiet.stdout
    assert quiet.stderr == ""
