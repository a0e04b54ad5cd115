"""The 0.1.0 baseline: one revision from empty to sql/, and back; a database stamped with
a revision from before it (the unreleased 0001-0047 series) is refused with one line that
names the way out, by `pycompactor migrate` and by alembic's own command line alike, and
`pycompactor migrate --from-scratch` is that way out."""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
import textwrap
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from bench.sdk_source import SDK_TABLES_DDL
from pycompactor import db, project_history, schema
from pycompactor.errors import PreBaselineRevision, PycompactorError
from pycompactor.recipes import install_agents_sqlalchemy
from tests.history import History
from tests.migrations.test_migrations import dump_schema, version_row

NewDatabase = Callable[..., str]
REPO = Path(__file__).resolve().parents[2]
PRE_BASELINE = "0047_settled_run_before_messages"


def stamped(new_database: NewDatabase, revision: str) -> str:
    """An empty database whose version table says `revision`, as alembic left it."""
    dsn = new_database()
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE SCHEMA compaction")
        conn.execute("CREATE TABLE compaction.alembic_version (version_num varchar(32)"
                     " NOT NULL, CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))")
        conn.execute("INSERT INTO compaction.alembic_version VALUES (%s)", (revision,))
    return dsn


def engine_relations(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_catalog.pg_class WHERE relnamespace ="
            " 'compaction'::regnamespace AND relname NOT LIKE 'alembic_version%'").fetchone()
    assert row is not None
    return int(row[0])


def test_the_baseline_is_the_only_revision_and_has_no_parent() -> None:
    assert schema.heads() == [schema.BASELINE]
    assert not schema.PRE_BASELINE.fullmatch(schema.BASELINE)


def test_a_revision_after_the_baseline_needs_the_baseline_frozen() -> None:
    """Until the release the baseline applies sql/ itself; a revision after it would then
    be applied on top of a baseline that already holds its change. So a second revision
    exists only beside the frozen delta `make freeze-baseline` writes at the release."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(schema.alembic_config(""))
    revisions = {r.revision for r in script.walk_revisions()}
    frozen = schema.delta_path("0_1_0_baseline.up.sql").exists()
    assert revisions == {schema.BASELINE} or frozen, revisions


def test_the_frozen_baseline_will_build_what_sql_describes(
        pg_bindir: Path, new_database: NewDatabase, tmp_path: Path) -> None:
    """What `make freeze-baseline` writes at the release, run as one delta, builds the
    catalog sql/ describes."""
    script = runpy.run_path(str(REPO / "scripts" / "freeze_baseline.py"))
    delta = tmp_path / "0_1_0_baseline.up.sql"
    delta.write_text(script["baseline_text"](), encoding="utf-8")
    frozen, direct = new_database(), new_database()
    with psycopg.connect(frozen) as conn, conn.cursor() as cursor:
        schema.execute_file(cursor, delta)
    with psycopg.connect(direct) as conn:
        schema.apply_current_definition(conn)
    assert dump_schema(pg_bindir, frozen) == dump_schema(pg_bindir, direct)


def test_a_pre_baseline_database_is_refused_and_left_as_it_was(
        new_database: NewDatabase) -> None:
    dsn = stamped(new_database, PRE_BASELINE)
    with pytest.raises(PreBaselineRevision, match=r"--from-scratch") as refused:
        schema.upgrade(dsn)
    assert refused.value.sqlstate == "CP040"
    assert PRE_BASELINE in str(refused.value)
    assert "\n" not in str(refused.value)
    assert version_row(dsn) == [(PRE_BASELINE,)]
    assert engine_relations(dsn) == 0
    with pytest.raises(PreBaselineRevision):
        schema.downgrade(dsn, "base")
    assert version_row(dsn) == [(PRE_BASELINE,)]


def test_a_revision_newer_than_the_package_is_refused_as_such(
        new_database: NewDatabase) -> None:
    dsn = stamped(new_database, "0_2_0_from_the_future")
    with pytest.raises(PycompactorError, match="a newer version migrated it") as refused:
        schema.upgrade(dsn)
    assert not isinstance(refused.value, PreBaselineRevision)


def test_cli_refuses_a_pre_baseline_database_with_one_line(new_database: NewDatabase) -> None:
    dsn = stamped(new_database, PRE_BASELINE)
    result = subprocess.run([sys.executable, "-m", "pycompactor", "migrate", "--dsn", dsn],
                            capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("pycompactor: error: ")
    for named in (PRE_BASELINE, "CP040", "pycompactor migrate --from-scratch",
                  "docs/operations.md"):
        assert named in result.stderr
    assert result.stdout == ""


def test_alembic_command_line_refuses_a_pre_baseline_database_with_one_line(
        new_database: NewDatabase) -> None:
    """Someone running alembic directly (migrations/alembic.ini) gets the same line."""
    dsn = stamped(new_database, PRE_BASELINE)
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(REPO / "migrations" / "alembic.ini"),
         "-x", f"dsn={dsn}", "upgrade", "head"],
        capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("pycompactor: error: ")
    assert PRE_BASELINE in line
    assert "--from-scratch" in line
    assert version_row(dsn) == [(PRE_BASELINE,)]


def test_from_scratch_rebuilds_a_pre_baseline_database_at_head(
        pg_bindir: Path, new_database: NewDatabase) -> None:
    """What a 0047 database held (engine objects, reference history) goes, and the
    database ends up as one migrated from empty."""
    reference = new_database()
    schema.upgrade(reference)
    dsn = new_database()
    schema.upgrade(dsn)
    with psycopg.connect(dsn) as conn:
        History(conn).pairs("conv-old", 25)
        conn.execute("UPDATE compaction.alembic_version SET version_num = %s", (PRE_BASELINE,))
    with pytest.raises(PreBaselineRevision):
        schema.upgrade(dsn)
    result = subprocess.run(
        [sys.executable, "-m", "pycompactor", "migrate", "--from-scratch", "--dsn", dsn],
        capture_output=True, text=True, check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"at revision {schema.BASELINE}" in result.stdout
    assert version_row(dsn) == [(schema.BASELINE,)]
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM compaction_source.runs").fetchone() == (0,)
    assert dump_schema(pg_bindir, dsn) == dump_schema(pg_bindir, reference)


def test_downgrade_to_base_leaves_a_hosts_tracked_tables_taking_writes(
        pg_bindir: Path, new_database: NewDatabase) -> None:
    """The host's tables the recipe tracks lose the engine's triggers with the engine,
    keep their rows and their writes; the roles stay, owning nothing here (the recipe's
    grants on the host's own objects are the host's); migrating again builds the same
    schema."""
    dsn = new_database()
    schema.upgrade(dsn)
    before = dump_schema(pg_bindir, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SDK_TABLES_DDL)
        install_agents_sqlalchemy(conn)
        conn.execute("INSERT INTO public.agent_sessions (session_id) VALUES ('s')")
        conn.execute("INSERT INTO public.agent_messages (session_id, message_data)"
                     " VALUES ('s', %s)", (json.dumps({"role": "user", "content": "Q"}),))
    schema.downgrade(dsn, "base")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_catalog.pg_trigger WHERE NOT tgisinternal AND tgrelid IN"
            " ('public.agent_sessions'::regclass, 'public.agent_messages'::regclass)"
        ).fetchone() == (0,)
        conn.execute("INSERT INTO public.agent_messages (session_id, message_data)"
                     " VALUES ('s', %s)", (json.dumps({"role": "assistant", "content": "A"}),))
        assert conn.execute("SELECT count(*) FROM public.agent_messages").fetchone() == (2,)
        assert conn.execute(
            "SELECT count(*) FROM pg_catalog.pg_shdepend AS d"
            " JOIN pg_catalog.pg_database AS db ON db.oid = d.dbid"
            " WHERE db.datname = current_database() AND d.deptype = 'o' AND d.refobjid IN"
            " (SELECT oid FROM pg_catalog.pg_roles WHERE rolname LIKE 'compaction\\_%')"
        ).fetchone() == (0,)
    schema.upgrade(dsn)
    assert dump_schema(pg_bindir, dsn) == before


def test_downgrade_to_base_stops_at_a_host_object_built_on_the_engine(
        new_database: NewDatabase) -> None:
    """Nothing is dropped with CASCADE: a host's view over an engine view stops the
    downgrade with PostgreSQL's error naming it, and nothing changes."""
    dsn = new_database()
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE VIEW public.host_runs AS SELECT * FROM compaction.source_runs")
    with pytest.raises(PycompactorError,
                       match=r"source_runs because other objects depend on it \(view host_runs"):
        schema.downgrade(dsn, "base")
    assert version_row(dsn) == [(schema.BASELINE,)]
    assert engine_relations(dsn) > 0


OPERATIONS = REPO / "docs" / "operations.md"


def documented_move() -> list[str]:
    """docs/operations.md's console blocks for moving a pre-baseline database's history,
    in order, as shell scripts (the `$ ` prompt taken off each command's first line)."""
    section = OPERATIONS.read_text(encoding="utf-8").split(
        "### Databases from before the 0.1.0 baseline", 1)[1].split("\n#", 1)[0]
    blocks = [textwrap.dedent(block) for block in re.findall(
        r"```console\n(.*?)\n\s*```", section, flags=re.DOTALL)]
    assert len(blocks) == 3, "docs/operations.md changed the steps of the move"
    return [re.sub(r"^\$ ", "", block, flags=re.MULTILINE) for block in blocks]


def test_the_documented_move_keeps_the_history_and_the_summaries(
        pg_bindir: Path, new_database: NewDatabase, tmp_path: Path) -> None:
    """The steps docs/operations.md gives for a pre-baseline database whose history lives
    in the reference tables, run as written: the new database holds the same history,
    the same derived state and the same summaries, projected as before."""
    old = new_database()
    schema.upgrade(old)
    with psycopg.connect(old) as conn:
        History(conn).pairs("conv-kept", 45)
        for target in db.plan_targets(conn, "conv-kept"):
            db.import_summary(conn, "conv-kept", "default", target.from_pair,
                              target.source_message_ids, target.source_hash, "m",
                              "conversation-compaction@3", f"summary {target.from_pair}",
                              datetime(2026, 12, 6, tzinfo=UTC))
        before = project_history(conn, "conv-kept", budget_bytes=8_000).to_dict()
        conn.execute("UPDATE compaction.alembic_version SET version_num = %s", (PRE_BASELINE,))
    assert [p["placement"] for p in before["pairs"]].count("summarized") == 20
    new = new_database()
    env = {**os.environ, "OLD": old, "NEW": new,
           "PATH": os.pathsep.join([str(pg_bindir), str(Path(sys.executable).parent),
                                    os.environ.get("PATH", "")])}
    for script in documented_move():
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path,
                                env=env, capture_output=True, text=True, check=False,
                                timeout=300)
        assert result.returncode == 0, (script, result.stderr)
    assert version_row(new) == [(schema.BASELINE,)]
    with psycopg.connect(new) as conn:
        assert conn.execute("SELECT * FROM compaction.verify_conversation('conv-kept')"
                            ).fetchall() == []
        assert conn.execute("SELECT count(*) FROM compaction.summaries").fetchone() == (2,)
        assert project_history(conn, "conv-kept", budget_bytes=8_000).to_dict() == before
