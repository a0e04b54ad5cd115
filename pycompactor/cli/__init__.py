"""The `pycompactor` command line (docs/cli.md).

* `commands`: the parser, the small commands and the exit codes. Its `main`, re-exported
  here, is the installed script (`pycompactor.cli:main`) and `python -m pycompactor`;
  the module is not named `main` so that this name stays the function.
* `argtypes`: the arguments' types; `render`: tables and JSON.
* One module per larger command: `audit`, `plan`, `source` (check-source), `importer`
  (import), `evaluate`, `demo` (with `sample`, its conversation, and `cluster`, the
  throwaway PostgreSQL it runs on, which the tests use too).
"""

from pycompactor.cli.commands import main

__all__ = ["main"]
