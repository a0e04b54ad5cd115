"""Throwaway PostgreSQL clusters from the installed server binaries (for `pycompactor demo`).

initdb refuses to run as root, so when the process is root the cluster's files and
server belong to the unprivileged `postgres` OS user (override with PYCOMPACTOR_PG_USER).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from pycompactor.errors import PycompactorError, ServerBinariesMissing


def find_bindir() -> Path:
    """Directory with initdb and pg_ctl: PYCOMPACTOR_PG_BINDIR, PATH, then Debian's layout."""
    candidates: list[Path] = []
    if os.environ.get("PYCOMPACTOR_PG_BINDIR"):
        candidates.append(Path(os.environ["PYCOMPACTOR_PG_BINDIR"]))
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        versions = sorted(
            (p for p in debian.iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
            reverse=True,
        )
        candidates.extend(v / "bin" for v in versions)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    raise ServerBinariesMissing()


def server_user() -> str | None:
    """The OS user to run the server as: None when we are not root."""
    if os.geteuid() != 0:
        return None
    name = os.environ.get("PYCOMPACTOR_PG_USER", "postgres")
    try:
        pwd.getpwnam(name)
    except KeyError:
        raise PycompactorError(
            f"running as root, but OS user {name!r} (to run PostgreSQL as) does not exist; "
            "create it or set PYCOMPACTOR_PG_USER"
        ) from None
    return name


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayCluster:
    """initdb + pg_ctl start on loopback in a temp directory; stop() removes every trace."""

    def __init__(self, bindir: Path | None = None, *, durable: bool = False) -> None:
        self.bindir = bindir or find_bindir()
        # The demo and tests trade crash safety for speed (fsync off); benchmarks need the
        # production settings, where every commit waits for its WAL flush.
        self.durable = durable
        self.user = server_user()
        self.port = 0
        self.root: Path | None = None

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> None:
        assert self.root is not None
        result = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            cwd=self.root,
            user=self.user,
            group=None if self.user is None else pwd.getpwnam(self.user).pw_gid,
            extra_groups=None if self.user is None else [],
            env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise PycompactorError(
                f"{args[0]} failed: {detail[-1] if detail else 'exit ' + str(result.returncode)}"
            )

    def start(self) -> str:
        self.root = Path(tempfile.mkdtemp(prefix="pycompactor-cluster-"))
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self.port = free_port()
        data = self.root / "data"
        durability = (
            "-c fsync=on -c synchronous_commit=on -c full_page_writes=on"
            if self.durable else "-c fsync=off"
        )
        self._run("initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                  "--locale=C.UTF-8", "--no-sync")
        self._run(
            "pg_ctl", "start", "-w", "-D", str(data), "-l", str(self.root / "server.log"),
            "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 {durability}",
        )
        return self.dsn

    def restart(self) -> None:
        """pg_ctl restart -m fast: sessions are cut, in-flight transactions roll back, and
        the server comes back on the same port with the same options (postmaster.opts)."""
        assert self.root is not None, "cluster not started"
        self._run("pg_ctl", "restart", "-w", "-m", "fast", "-D", str(self.root / "data"),
                  "-l", str(self.root / "server.log"))

    def stop(self) -> None:
        if self.root is None:
            return
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(PycompactorError):
                self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(data))
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def __enter__(self) -> ThrowawayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
