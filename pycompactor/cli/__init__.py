"""The `pycompactor` command line (docs/cli.md).

* `main`: the parser, the small commands and the exit codes (`pycompactor.cli:main` is
  the installed script; `python -m pycompactor` runs it too).
* `argtypes`: the arguments' types; `render`: tables and JSON.
* One module per larger command: `audit`, `plan`, `source` (check-source), `importer`
  (import), `evaluate`, `demo` (with `sample`, its conversation, and `cluster`, the
  throwaway PostgreSQL it runs on, which the tests use too).
"""

from pycompactor.cli.main import main

__all__ = ["main"]
