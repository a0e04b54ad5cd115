"""A throwaway PgBouncer on loopback in front of a test cluster (Debian's `pgbouncer`).

PgBouncer refuses to run as root, so when the suite runs as root (as CI does) it runs as
the same unprivileged OS user as the cluster, with its config, auth file, log and pid
file in a temp directory that user owns. It runs in the foreground as our child and is
stopped (SIGTERM, then SIGKILL) by `stop()`. A missing binary is a failure, never a
skip: `make test` (scripts/prepare) installs the package or stops first.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import psycopg

from pycompactor.cli.cluster import free_port, server_user

#: Where Debian puts it; PATH is tried first.
DEBIAN_PGBOUNCER = "/usr/sbin/pgbouncer"


def find_pgbouncer() -> str:
    found = shutil.which("pgbouncer") or (
        DEBIAN_PGBOUNCER if os.path.isfile(DEBIAN_PGBOUNCER)
        and os.access(DEBIAN_PGBOUNCER, os.X_OK) else None)
    if found is None:
        raise AssertionError("pgbouncer is not installed: apt-get install pgbouncer "
                             "(make test and .ci/run do this, through scripts/prepare)")
    return found


def _quote(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


class PgBouncer:
    """pool_mode = transaction by default; `users` maps user name to password (auth_file)."""

    def __init__(self, server_host: str, server_port: int, *, auth_type: str = "trust",
                 users: Mapping[str, str] | None = None, pool_mode: str = "transaction",
                 default_pool_size: int = 20) -> None:
        self.server_host = server_host
        self.server_port = server_port
        self.auth_type = auth_type
        self.users = dict(users or {"postgres": ""})
        self.pool_mode = pool_mode
        self.default_pool_size = default_pool_size
        self.port = 0
        self.root: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.user = server_user()

    def dsn(self, dbname: str, user: str = "postgres", password: str | None = None) -> str:
        dsn = f"host=127.0.0.1 port={self.port} user={user} dbname={dbname}"
        return dsn if password is None else f"{dsn} password={password}"

    @property
    def log(self) -> str:
        assert self.root is not None
        path = self.root / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> PgBouncer:
        self.root = Path(tempfile.mkdtemp(prefix="pycompactor-pgbouncer-"))
        self.port = free_port()
        (self.root / "userlist.txt").write_text(
            "".join(f"{_quote(u)} {_quote(p)}\n" for u, p in self.users.items()))
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={self.server_host} port={self.server_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            f"auth_type = {self.auth_type}\n"
            f"auth_file = {self.root / 'userlist.txt'}\n"
            f"pool_mode = {self.pool_mode}\n"
            f"default_pool_size = {self.default_pool_size}\n"
            "max_client_conn = 500\n"
            # Hand out the most recently used server connection first (LIFO), so which
            # server a client gets is predictable in the tests.
            "server_round_robin = 0\n"
            f"logfile = {self.root / 'pgbouncer.log'}\n"
            f"pidfile = {self.root / 'pgbouncer.pid'}\n"
        )
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.proc = subprocess.Popen(
            [find_pgbouncer(), str(self.root / "pgbouncer.ini")],
            cwd=self.root,
            user=self.user,
            group=None if self.user is None else pwd.getpwnam(self.user).pw_gid,
            extra_groups=None if self.user is None else [],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 20.0) -> None:
        """Poll until PgBouncer accepts a client and reaches the server (deadline)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        first_user = next(iter(self.users))
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"pgbouncer exited {self.proc.returncode}:\n{self.log}")
            try:
                with psycopg.connect(self.dsn("postgres", first_user, self.users[first_user]
                                              or None), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"pgbouncer did not come up:\n{self.log}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> PgBouncer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
