"""An A/B trial in one database, as an operator runs it: two workers with two models
summarize one conversation; the owner's preference decides what the next Run gets, and
`pycompactor audit --view models` shows the preference and each model's work."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from pycompactor import db
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from pycompactor.summarizers.extractive2 import EXTRACTIVE2_MODEL
from tests.e2e.cli import run_cli
from tests.history import History

Conn = psycopg.Connection[Any]


def summaries_used(dsn: str) -> tuple[dict[int, int | None], dict[int, str]]:
    result = run_cli("project", "ab", "--budget-bytes", "10000000", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    projection = json.loads(result.stdout)
    return ({p["pair_index"]: p["summary_id"] for p in projection["pairs"]
             if p["pair_index"] % 10 == 0},
            {r["summary_id"]: r["reason"] for r in projection["rejected_summaries"]})


def test_two_models_and_the_owner_preference(conn: Conn, dsn: str) -> None:
    History(conn).pairs("ab", 30)
    for model in (OFFLINE_MODEL, EXTRACTIVE2_MODEL):  # the incumbent, then the trial
        result = run_cli("worker", "--once", "--conversation", "ab", "--model", model,
                         "--dsn", dsn)
        assert result.returncode == 0, result.stderr
    ids = dict(conn.execute("SELECT model, summary_id FROM compaction.summaries"
                            " WHERE conversation_id = 'ab'").fetchall())
    incumbent, trial = ids[OFFLINE_MODEL], ids[EXTRACTIVE2_MODEL]

    # Without a preference the trial's newer summary is what the next Run gets.
    assert summaries_used(dsn) == ({0: trial, 10: None, 20: None}, {incumbent: "superseded"})

    assert db.set_projection_models(conn, [OFFLINE_MODEL]) == 1
    assert summaries_used(dsn) == ({0: incumbent, 10: None, 20: None}, {trial: "superseded"})

    models = json.loads(run_cli("audit", "--view", "models", "--json", "--dsn", dsn).stdout)
    assert [(m["model"], m["projection_preference"], m["completed"]) for m in models] == [
        (OFFLINE_MODEL, 1, 1), (EXTRACTIVE2_MODEL, None, 1)]
    # evaluate --database says what each model's stored summaries are to the next Run.
    evaluated = run_cli("evaluate", "--database", "--json", "--dsn", dsn)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["stored_by_model"] == [
        {"model": OFFLINE_MODEL, "summaries": 1, "used": 1, "superseded": 0, "not_usable": 0,
         "projection_preference": 1},
        {"model": EXTRACTIVE2_MODEL, "summaries": 1, "used": 0, "superseded": 1,
         "not_usable": 0, "projection_preference": None}]
    table = run_cli("audit", "--view", "models", "--dsn", dsn)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0] == (
        "projection preference (compaction.settings.projection_models): "
        f"{OFFLINE_MODEL} (named earlier first, then unnamed models)")
