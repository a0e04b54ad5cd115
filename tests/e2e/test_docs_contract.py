"""The documentation holds what it cites: every relative link and anchor of README.md and
docs/*.md resolves inside the repository, no page cites a design file the repository does
not hold, and docs/contract.md states the installed schema's signatures and every project
SQLSTATE the SQL raises."""

from __future__ import annotations

import inspect
import re
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import pycompactor
from pycompactor.errors import EngineError

REPO = Path(__file__).resolve().parents[2]
CONTRACT = REPO / "docs" / "contract.md"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# The contract's SQL functions (sections 2 to 7): each must appear in docs/contract.md with
# its full signature.
CONTRACT_FUNCTIONS = {
    "verify_conversation", "eligible_pairs", "plan_targets", "source_hash", "claim",
    "complete", "fail", "heartbeat", "reap", "enqueue", "erase_conversation",
    "import_summary",
}
CONTRACT_PYTHON: dict[str, Callable[..., Any]] = {
    "source_hash": pycompactor.source_hash,
    "project_history": pycompactor.project_history,
}

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _blank(match: re.Match[str]) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str) -> str:
    """The text with fenced blocks and code spans blanked (their line breaks kept): what
    they hold is quoted, not cited or linked."""
    return INLINE_CODE.sub(_blank, FENCE.sub(_blank, text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, punctuation other than
    hyphens and underscores dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    # Only fenced blocks are blanked: a heading's code span is part of its anchor.
    for match in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$",
                             FENCE.sub(_blank, page.read_text("utf-8")),
                             re.MULTILINE):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def test_every_relative_link_and_anchor_resolves() -> None:
    broken: list[str] = []
    for page in PAGES:
        text = page.read_text("utf-8")
        for match in LINK.finditer(prose(text)):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # https:, mailto: ... point outside the repository
            path_part, _, anchor = target.partition("#")
            where = f"{page.relative_to(REPO)}:{line_of(text, match.start())}: {target}"
            resolved = (page.parent / path_part).resolve() if path_part else page
            if not resolved.is_relative_to(REPO) or not resolved.exists():
                broken.append(f"{where} (no such file in the repository)")
            elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
                broken.append(f"{where} (no heading with that anchor)")
    assert broken == [], "\n".join(broken)


def test_pages_cite_the_contract_they_hold() -> None:
    """No page cites a DESIGN file (the repository holds none), and every section sign
    outside docs/contract.md is a link into it."""
    contract_link = re.compile(r"\[[^\]]*\]\(\s*(?:\.\./)?(?:docs/)?contract\.md#[^)]*\)")
    citations = []
    for page in PAGES:
        text = prose(page.read_text("utf-8"))
        if page != CONTRACT:
            text = contract_link.sub(lambda m: " " * len(m.group(0)), text)
        citations += [f"{page.relative_to(REPO)}:{line_of(text, m.start())}: {m.group(0)}"
                      for m in re.finditer(r"\bDESIGN\b[^\n]{0,12}" if page == CONTRACT
                                           else r"\bDESIGN\b[^\n]{0,12}|§[^\n]{0,12}", text)]
    assert citations == [], (
        "cite the contract as a link to its section in docs/contract.md:\n" + "\n".join(citations))


def sql_signatures(text: str) -> dict[str, tuple[str, str]]:
    """`compaction.name(arguments) -> result` in the fenced blocks of a page."""
    found: dict[str, tuple[str, str]] = {}
    for block in FENCE.finditer(text):
        code = block.group(0)
        for start in re.finditer(r"compaction\.(\w+)\(", code):
            arguments, rest = balanced(code, start.end())
            arrow = re.match(r"\s*->\s*", rest)
            if arrow is None:
                continue
            rest = rest[arrow.end():]
            if rest.upper().startswith("TABLE("):
                columns, _ = balanced(rest, len("TABLE("))
                result = f"TABLE({columns})"
            else:
                result = rest.splitlines()[0].strip()
            assert start.group(1) not in found, f"{start.group(1)} is given twice"
            found[start.group(1)] = (" ".join(arguments.split()), " ".join(result.split()))
    return found


def balanced(text: str, after_open: int) -> tuple[str, str]:
    """The text up to the parenthesis closing the one just before `after_open`, and what
    follows it."""
    depth = 1
    for i in range(after_open, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[after_open:i], text[i + 1:]
    raise AssertionError(f"unbalanced parentheses after {text[:after_open]!r}")


def test_contract_signatures_are_the_installed_ones(conn: psycopg.Connection[Any]) -> None:
    documented = sql_signatures(CONTRACT.read_text("utf-8"))
    assert documented.keys() >= CONTRACT_FUNCTIONS, (
        f"docs/contract.md lacks {sorted(CONTRACT_FUNCTIONS - documented.keys())}")
    # The server normalises both sides: each documented signature becomes a function of a
    # scratch schema, and its catalogued arguments (names, types, defaults) and result
    # must read exactly like the installed function's.
    conn.execute("CREATE SCHEMA contract_doc")
    wrong: list[str] = []
    for name, (arguments, result) in sorted(documented.items()):
        # The page is what is under test: its text becomes DDL on a throwaway database.
        ddl = f"({arguments}) RETURNS {result}"
        conn.execute(sql.SQL("CREATE FUNCTION contract_doc.{}{} LANGUAGE plpgsql AS "
                             "'BEGIN END'").format(sql.Identifier(name), sql.SQL(ddl)))
        row = conn.execute(
            """SELECT pg_get_function_arguments(doc.oid), pg_get_function_result(doc.oid),
                      pg_get_function_arguments(real.oid), pg_get_function_result(real.oid),
                      (SELECT string_agg(format('%%s(%%s) -> %%s', p.proname,
                                                pg_get_function_arguments(p.oid),
                                                pg_get_function_result(p.oid)), '; ')
                       FROM pg_proc AS p
                       WHERE p.pronamespace = 'compaction'::regnamespace
                         AND p.proname = %(name)s)
               FROM pg_proc AS doc
               LEFT JOIN pg_proc AS real ON real.oid = to_regprocedure(
                   format('compaction.%%I(%%s)', doc.proname, oidvectortypes(doc.proargtypes)))
               WHERE doc.pronamespace = 'contract_doc'::regnamespace
                 AND doc.proname = %(name)s""",
            {"name": name},
        ).fetchone()
        assert row is not None
        doc_arguments, doc_result, real_arguments, real_result, installed = row
        if (doc_arguments, doc_result) != (real_arguments, real_result):
            wrong.append(f"{name}: docs/contract.md says ({doc_arguments}) -> {doc_result}; "
                         f"installed: {installed}")
    assert wrong == [], "\n".join(wrong)


def python_signature(function: Callable[..., Any]) -> str:
    """The signature as the page writes it: names, `*` and defaults, no annotations."""
    parts: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is parameter.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        default = "" if parameter.default is parameter.empty else f"={parameter.default!r}"
        parts.append(parameter.name + default)
    return ", ".join(parts)


@pytest.mark.parametrize("name", sorted(CONTRACT_PYTHON))
def test_contract_python_signatures_are_the_package_ones(name: str) -> None:
    written = set(re.findall(rf"`pycompactor\.{name}\(([^)`]*)\)`",
                             CONTRACT.read_text("utf-8")))
    assert written == {python_signature(CONTRACT_PYTHON[name])}, written


def test_contract_names_every_sqlstate_the_sql_raises() -> None:
    raised = {
        code
        for path in sorted((REPO / "sql").glob("*.sql"))
        for code in re.findall(r"ERRCODE\s*=\s*'(CP[0-9A-Z]{3})'", path.read_text("utf-8"))
    }
    assert raised, "no project SQLSTATE found in sql/: the pattern is out of date"
    table = dict(re.findall(r"^\| `(CP[0-9A-Z]{3})` \| `(\w+)` \| \S",
                            CONTRACT.read_text("utf-8"), re.MULTILINE))
    assert table.keys() == raised, (
        f"undocumented: {sorted(raised - table.keys())}; "
        f"documented but never raised: {sorted(table.keys() - raised)}")
    mapped = {cls.sqlstate: cls.__name__ for cls in EngineError.__subclasses__()}
    assert {code: mapped.get(code) for code in table} == table
