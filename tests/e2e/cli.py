"""Running the installed `pycompactor` command as a subprocess, as users do."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping


def run_cli(*args: str, env: Mapping[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pycompactor", *args],
        capture_output=True, text=True, check=False, timeout=timeout,
        env={**os.environ, **(env or {})},
    )
