"""The package's layering, read from its own source (no database needed).

- No import cycle between pycompactor's modules, counting imports inside functions and
  under TYPE_CHECKING too: a newcomer can draw the layers from memory.
- The folders are floors (docs/architecture.md): `quality` (the measures of a summary)
  stands on the vocabulary alone (`errors`, `hashing`, `models`); `summarizers` on
  `quality` and the vocabulary; `cli` (the command line) is the top, imported by
  `python -m pycompactor` alone.
- SQL text lives in the SQL layer only: `db` (engine calls, with `dbcall`, its call
  machinery, and `dbread`, its audit/report/setup reads), `store` (writes to the
  reference tables), `schema` (applying migrations) and `recipes` (source recipes, SQL
  files with their installer). Every other module calls their typed functions.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pycompactor

PACKAGE = Path(pycompactor.__file__).parent
SQL_LAYER = {"pycompactor.db", "pycompactor.dbcall", "pycompactor.dbread",
             "pycompactor.store", "pycompactor.schema", "pycompactor.recipes"}
# A statement as the driver would send it: a string that starts with a keyword that
# starts SQL, in capitals, followed by what such a statement has next. (Prose that
# mentions SQL, e.g. an error message telling the DBA what to run, does not start so.)
SQL = re.compile(r"^\s*(SELECT\s+[\w*(]|INSERT\s+INTO|UPDATE\s+\w+\.\w+\s+SET|DELETE\s+FROM|"
                 r"CREATE\s+(OR\s+REPLACE\s+)?(TABLE|VIEW|FUNCTION|INDEX)|EXPLAIN\s*\(|"
                 r"SET\s+TRANSACTION|CALL\s+\w+\.|WITH\s+\w+\s+AS\s*\()")


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules `name` imports anywhere in its source."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base in known:
                found.add(base)
            # `from pycompactor import db` imports the module pycompactor.db
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> Iterator[list[str]]:
    """Every elementary cycle's first sighting (depth-first, deterministic order)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> Iterator[list[str]]:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                yield [*stack[stack.index(target):], target]
            elif target not in state:
                yield from visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            yield from visit(node)


def test_no_import_cycle() -> None:
    found = modules()
    # The package root only re-exports the public API; it imports, nobody imports it.
    graph = {name: imports_of(name, path, set(found)) - {"pycompactor"}
             for name, path in found.items()}
    assert list(cycles(graph)) == []


#: The modules every floor may stand on: what the engine's results, errors and hashes are.
VOCABULARY = {"pycompactor.errors", "pycompactor.hashing", "pycompactor.models"}
#: Each lower folder, and what outside itself it may import.
FLOORS = {
    "pycompactor.quality": VOCABULARY,
    "pycompactor.summarizers": VOCABULARY | {"pycompactor.quality"},
}


def in_folder(name: str, folder: str) -> bool:
    return name == folder or name.startswith(folder + ".")


def test_the_folders_are_floors() -> None:
    found = modules()
    imports = {name: imports_of(name, path, set(found)) - {"pycompactor"}
               for name, path in found.items()}
    offenders = [f"{name} imports {target}"
                 for folder, allowed in FLOORS.items()
                 for name in sorted(imports) if in_folder(name, folder)
                 for target in sorted(imports[name])
                 if not in_folder(target, folder)
                 and not any(in_folder(target, ok) for ok in allowed)]
    offenders += [f"{name} imports {target}"
                  for name in sorted(imports)
                  if not in_folder(name, "pycompactor.cli") and name != "pycompactor.__main__"
                  for target in sorted(imports[name]) if in_folder(target, "pycompactor.cli")]
    assert offenders == []
    # The rule sees the folders it names.
    assert all(any(in_folder(name, folder) for name in found) for folder in FLOORS)
    assert "pycompactor.cli.commands" in found


def test_the_cycle_check_finds_a_cycle() -> None:
    assert list(cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()})) == [
        ["a", "b", "c", "a"]]


def sql_strings(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                                | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings and SQL.search(node.value):
            yield node.lineno, node.value[:60]


def test_no_sql_outside_the_sql_layer() -> None:
    offenders = [f"{name}:{line}: {text!r}"
                 for name, path in modules().items()
                 if not any(name == layer or name.startswith(layer + ".")
                            for layer in SQL_LAYER)
                 for line, text in sql_strings(path)]
    assert offenders == []


def test_the_sql_check_sees_sql() -> None:
    for statement in ("SELECT compaction.enqueue(%s)", "INSERT INTO t VALUES (1)",
                      "EXPLAIN (FORMAT JSON) x", "SET TRANSACTION READ ONLY",
                      "UPDATE compaction_source.messages SET content = 'x'",
                      "CALL compaction.rebuild_derived_state()"):
        assert SQL.search(statement), statement
    for prose in ("Select the newest", "grant it SELECT.", "an UPDATE of a row",
                  "not rebuilt (CALL compaction.rebuild_derived_state() when ready)"):
        assert not SQL.search(prose), prose


def test_every_project_sqlstate_has_its_exception_class() -> None:
    """Each CP code the stored logic raises maps to one class of pycompactor.errors, so a
    caller catches it by name (a code reused for another meaning shows up here as one
    class whose docstring no longer fits: keep one meaning per code)."""
    from pycompactor import errors
    from pycompactor.schema import sql_files

    raised = {code for path in sql_files()
              for code in re.findall(r"ERRCODE = '(CP\d{3})'", path.read_text(encoding="utf-8"))}
    assert raised - set(errors._BY_SQLSTATE) == set()
