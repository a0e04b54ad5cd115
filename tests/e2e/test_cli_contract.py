"""The command-line contract, for every subcommand: `--help` with examples, a bad argument
is argparse's usage plus one error line and exit 2, and `--json` output is valid JSON of
the shape documented in docs/cli.md (the shapes are read from that file, so the
documentation cannot drift from the output)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION
from tests.e2e.cli import run_cli
from tests.history import History

Conn = psycopg.Connection[Any]
DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
COMMANDS = ("migrate", "worker", "plan", "project", "audit", "check-source", "install-recipe",
            "import",
            "evaluate", "demo")


def documented_shapes() -> dict[str, Any]:
    blocks = re.findall(r"```json shape=(\S+)\n(.*?)```", DOC.read_text(encoding="utf-8"),
                        flags=re.DOTALL)
    return {name: json.loads(body) for name, body in blocks}


def _scalar_ok(kind: str, value: object) -> bool:
    if kind == "null":
        return value is None
    if kind == "timestamp":
        return isinstance(value, str) and datetime.fromisoformat(value).tzinfo is not None
    types: dict[str, type | tuple[type, ...]] = {"str": str, "bool": bool, "float": (int, float)}
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float" and isinstance(value, bool):
        return False
    return isinstance(value, types[kind])


def mismatches(shape: Any, value: Any, path: str = "$") -> list[str]:
    """Where `value` breaks `shape` (empty: it conforms)."""
    if isinstance(shape, dict) and list(shape) == ["str"]:  # an object with any keys
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {value!r}"]
        return [m for k, v in value.items()
                for m in mismatches("str", k, f"{path}.<key>") + mismatches(
                    shape["str"], v, f"{path}.{k}")]
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {value!r}"]
        if set(value) != set(shape):
            return [f"{path}: keys {sorted(value)} != documented {sorted(shape)}"]
        return [m for k in shape for m in mismatches(shape[k], value[k], f"{path}.{k}")]
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        return [m for i, v in enumerate(value) for m in mismatches(shape[0], v, f"{path}[{i}]")]
    kinds = [k.strip() for k in shape.split("|")]
    if not any(_scalar_ok(k, value) for k in kinds):
        return [f"{path}: {value!r} is not {shape}"]
    return []


def test_mismatches_catches_what_it_should() -> None:
    shape = {"a": "int", "b": ["str | null"], "c": {"str": "int"}, "t": "timestamp"}
    good = {"a": 1, "b": ["x", None], "c": {"k": 2}, "t": "2026-01-01T00:00:00+00:00"}
    assert mismatches(shape, good) == []
    for bad in ({**good, "a": True}, {**good, "b": [1]}, {**good, "c": {"k": "v"}},
                {**good, "t": "2026-01-01"}, {k: v for k, v in good.items() if k != "a"},
                {**good, "extra": 1}):
        assert mismatches(shape, bad), bad


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_usage_options_and_examples(command: str) -> None:
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: pycompactor {command}")
    assert "\nexamples:\n" in result.stdout
    assert f"  pycompactor {command}" in result.stdout.split("\nexamples:\n", 1)[1]
    assert "--debug" in result.stdout


# What a command needs before an unknown option is the first problem argparse reports.
REQUIRED = {"plan": ["conv"], "project": ["conv", "--budget-bytes", "1"],
            "install-recipe": ["agents-sqlalchemy"], "evaluate": ["--database"],
            "import": ["history.jsonl"]}
BAD_ARGUMENTS = [
    ("migrate", ["--to"], "argument --to: expected one argument"),
    ("worker", ["--model", OFFLINE_MODEL, "--concurrency", "0"],
     "argument --concurrency: expected a number of at least 1, got 0"),
    ("worker", ["--model", OFFLINE_MODEL, "--metrics-port", "70000"],
     "argument --metrics-port: expected a TCP port (0-65535), got 70000"),
    ("worker", ["--model", OFFLINE_MODEL, "--min-figure-retention", "1.5"],
     "argument --min-figure-retention: expected a share between 0 and 1, got 1.5"),
    ("worker", ["--model", OFFLINE_MODEL, "--min-figure-retention", "most"],
     "argument --min-figure-retention: expected a share between 0 and 1, got 'most'"),
    ("worker", ["--model", OFFLINE_MODEL, "--api", "completions"],
     "argument --api: invalid choice: 'completions'"),
    ("worker", ["--model", OFFLINE_MODEL, "--conversation", "c", "--sweep"],
     "argument --sweep: not allowed with argument --conversation"),
    ("plan", [], "the following arguments are required: CONVERSATION"),
    ("project", ["conv", "--budget-bytes", "-5"],
     "argument --budget-bytes: expected a number of at least 0, got -5"),
    ("audit", ["--view", "everything"], "argument --view: invalid choice: 'everything'"),
    ("audit", ["--view", "queue", "--conversation", "c"],
     "--conversation does not apply to --view queue"),
    ("check-source", ["--sample", "none"], "argument --sample: expected a whole number"),
    ("install-recipe", ["django"], "argument recipe: invalid choice: 'django'"),
    ("evaluate", [], "one of the arguments --corpus --jsonl --database is required"),
    ("evaluate", ["--corpus", "--database"],
     "argument --database: not allowed with argument --corpus"),
    ("evaluate", ["--database", "--api", "completions"],
     "argument --api: invalid choice: 'completions'"),
    ("evaluate", ["--database", "--limit", "0"],
     "argument --limit: expected a number of at least 1, got 0"),
    ("demo", ["now"], "unrecognized arguments: now"),
    ("import", [], "the following arguments are required: FILE"),
    ("import", ["h.jsonl", "--batch-size", "0"],
     "argument --batch-size: expected a number of at least 1, got 0"),
    ("worker", ["--model", OFFLINE_MODEL, "--temperature", "3"],
     "argument --temperature: expected a temperature from 0 to 2, got 3"),
    ("worker", ["--model", OFFLINE_MODEL, "--max-output-tokens", "-1"],
     "argument --max-output-tokens: expected a number of at least 0, got -1"),
    # Values the parser must refuse itself (exit 2), not pass on to fail after it (exit 1,
    # a ValueError) or to reach a part of the system that cannot use them.
    ("worker", ["--model", OFFLINE_MODEL, "--statement-timeout-seconds", "1e-9"],
     "argument --statement-timeout-seconds: expected 0.001 to 2.14748e+06 seconds"),
    ("worker", ["--model", OFFLINE_MODEL, "--lock-timeout-seconds", "0.0004"],
     "argument --lock-timeout-seconds: expected 0.001 to 2.14748e+06 seconds"),
    ("worker", ["--model", OFFLINE_MODEL, "--lock-timeout-seconds", "3e9"],
     "argument --lock-timeout-seconds: expected 0.001 to 2.14748e+06 seconds"),
    ("worker", ["--model", OFFLINE_MODEL, "--concurrency", "99999999999"],
     "argument --concurrency: expected a number of at most 10000, got 99999999999"),
    ("worker", ["--model", OFFLINE_MODEL, "--concurrency", "10001"],
     "argument --concurrency: expected a number of at most 10000, got 10001"),
    ("worker", ["--model", OFFLINE_MODEL, "--poll-seconds", "1e300"],
     "argument --poll-seconds: expected at most 86400 seconds, got 1e300"),
    ("worker", ["--model", OFFLINE_MODEL, "--drain-seconds", "1e300"],
     "argument --drain-seconds: expected at most 86400 seconds, got 1e300"),
    ("audit", ["--limit", "99999999999"],
     "argument --limit: expected a number of at most 2147483647, got 99999999999"),
] + [(command, [*REQUIRED.get(command, []), "--no-such-option"],
       "unrecognized arguments: --no-such-option") for command in COMMANDS]


@pytest.mark.parametrize(("command", "args", "message"), BAD_ARGUMENTS,
                         ids=[f"{c}-{'-'.join(a) or 'none'}" for c, a, _ in BAD_ARGUMENTS])
def test_bad_argument_is_usage_plus_one_error_line_and_exit_2(
        command: str, args: list[str], message: str) -> None:
    result = run_cli(command, *args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.rstrip("\n").split("\n")
    assert lines[0].startswith(f"usage: pycompactor {command}")
    # Only the last line is an error; the lines before it are the (wrapped) usage.
    assert lines[-1].startswith(f"pycompactor {command}: error: ")
    assert message in lines[-1], lines[-1]
    assert [line for line in lines if ": error:" in line] == [lines[-1]]
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), lines
    assert "Traceback" not in result.stderr


@pytest.fixture
def rich_database(conn: Conn, dsn: str) -> str:
    """Something in every audit view: two summaries by a worker pass, an import, an
    exhausted identity, and a stale summary."""
    seeded = History(conn).pairs("conv-a", 40)
    History(conn).pairs("conv-b", 30)
    result = run_cli("worker", "--once", "--conversation", "conv-a", "--model", OFFLINE_MODEL,
                     "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    [target] = db.plan_targets(conn, "conv-b")
    db.import_summary(conn, "conv-b", "other", 0, target.source_message_ids,
                      target.source_hash, "legacy", PROMPT_VERSION, "Imported.",
                      datetime.now(UTC))
    for _ in range(2):
        claim = db.claim(conn, "conv-b", "default", 0, target.source_message_ids,
                         target.source_hash, "flaky-model", PROMPT_VERSION, "test")
        assert claim.claimed
        assert claim.job_id is not None
        assert claim.attempt is not None
        db.fail(conn, claim.job_id, claim.attempt, "timeout")
    conn.execute("UPDATE compaction_source.messages SET content = 'edited' WHERE message_id = %s",
                 (seeded[2].assistant_message_id,))
    return dsn


JSON_COMMANDS = [
    ("plan", ["plan", "conv-a"]),
    ("project", ["project", "conv-a", "--budget-bytes", "2000"]),
    ("check-source", ["check-source"]),
    ("audit-jobs", ["audit"]),
    ("audit-stale", ["audit", "--view", "stale"]),
    ("audit-exhausted", ["audit", "--view", "exhausted"]),
    ("audit-events", ["audit", "--view", "events", "--limit", "100"]),
    ("audit-queue", ["audit", "--view", "queue"]),
    ("audit-models", ["audit", "--view", "models"]),
    ("evaluate", ["evaluate", "--database"]),
    ("import", ["import", "IMPORT_FILE"]),
]


def test_json_output_has_the_documented_shape(rich_database: str, tmp_path: Path) -> None:
    shapes = documented_shapes()
    assert set(shapes) == {name for name, _ in JSON_COMMANDS}
    export = tmp_path / "history.jsonl"
    export.write_text(json.dumps({"conversation_id": "imported", "pairs": [
        {"user": "q", "assistant": "a"}]}) + "\n", encoding="utf-8")
    for name, args in JSON_COMMANDS:
        args = [str(export) if a == "IMPORT_FILE" else a for a in args]
        result = run_cli(*args, "--json", "--dsn", rich_database)
        assert result.returncode == 0, (name, result.stderr)
        value = json.loads(result.stdout)
        assert value, f"{name}: empty output exercises no shape"
        assert mismatches(shapes[name], value) == [], name
    # Every placement and several rejection reasons occurred, so the shapes were exercised.
    projection = json.loads(run_cli("project", "conv-a", "--budget-bytes", "2000", "--json",
                                    "--dsn", rich_database).stdout)
    assert {p["placement"] for p in projection["pairs"]} >= {"raw", "omitted"}
    kinds = {e["kind"] for e in json.loads(run_cli(
        "audit", "--view", "events", "--json", "--limit", "100", "--dsn", rich_database).stdout)}
    assert kinds == {"claim", "completion", "failure", "import"}
