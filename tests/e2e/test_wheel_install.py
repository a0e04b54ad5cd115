"""A fresh `pip install .` into a new virtualenv can migrate: the SQL ships in the wheel."""

from __future__ import annotations

import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parents[2]


def test_fresh_install_migrates_from_package_data(
    tmp_path: Path, new_database: Callable[..., str]
) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         str(REPO)],
        capture_output=True, text=True, check=False, timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]

    # Run from an unrelated directory, so nothing can be found through the checkout.
    where = subprocess.run(
        [str(python), "-c", "from pycompactor import schema; print(schema.data_dir())"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout.strip()
    assert Path(where).name == "_data"
    assert not Path(where).is_relative_to(REPO)
    # The prompt ships too, and still matches its pinned hash.
    subprocess.run(
        [str(python), "-c", "from pycompactor.summarizer import load_prompt; load_prompt()"],
        check=True, cwd=tmp_path,
    )

    dsn = new_database()
    migrate = subprocess.run(
        [str(env_dir / "bin" / "pycompactor"), "migrate", "--dsn", dsn],
        capture_output=True, text=True, check=False, cwd=tmp_path, timeout=120,
    )
    assert migrate.returncode == 0, migrate.stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM compaction.alembic_version").fetchone() == (1,)
        assert conn.execute(
            "SELECT to_regprocedure('compaction.plan_targets(text)') IS NOT NULL"
        ).fetchone() == (True,)
    assert sys.executable != str(python)
