"""Figures kept (DESIGN.md §8): the definition, p_stats from the worker, the retention gate.

The seeded range of tests.workerkit (conv-1, pairs 0-9) holds exactly 30 distinct figures:
`0`..`9` (reply numbers, fund names F0..F9, the `1` of `conv-1`, star ratings 1..5),
`10.25`..`19.25` (NAVs) and `2026-03-01`..`2026-03-10` (dates).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from pycompactor import db
from pycompactor.eventlog import EventLog
from pycompactor.extractive import ExtractiveSummarizer, extractive_summary
from pycompactor.figures import FigureStats, figure_stats, figures
from pycompactor.summarizer import OpenAISummarizer
from pycompactor.worker import Worker, WorkerConfig
from tests.driver.conftest import make_pairs
from tests.history import History
from tests.modelserver import ModelServer, stop
from tests.workerkit import MODEL, StringLog, events_named, seed, summaries

Conn = psycopg.Connection[Any]

NAVS = [f"{10 + i}.25" for i in range(10)]
DATES = [f"2026-03-{i + 1:02d}" for i in range(10)]
SMALL = [str(i) for i in range(10)]
ALL_30 = set(NAVS) | set(DATES) | set(SMALL)


def stats_row(conn: Conn) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(
        "SELECT attempt, state, reason, input_tokens, output_tokens, figures_total,"
        " figures_kept FROM compaction.audit_jobs ORDER BY job_id, attempt").fetchall()]


def run_chat_worker(dsn: str, base_url: str, **options: Any) -> StringLog:
    log = StringLog()
    with OpenAISummarizer(MODEL, base_url=base_url, api_key="k",
                          timeout_seconds=10) as summarizer:
        config = WorkerConfig(model=MODEL, dsn=dsn, once=True, log_format="json", **options)
        Worker(config, summarizer, log=EventLog("json", stream=log)).run()
    return log


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- the definition ------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("NAV 10.37 on 2026-10-09, 1,200 units, fee 0.36%", {"10.37", "2026-10-09", "1,200",
                                                         "0.36"}),
    ("at 14:30 on 9/10 the ratio was 3/4", {"14:30", "9/10", "3/4"}),
    ("1.2.3.4 then 5-6-7", {"1.2.3.4", "5-6-7"}),
    ("a trailing separator 12. or 12, or 7- is not part of it", {"12", "7"}),
    ("double separators 1..2 and 3,-4 split", {"1", "2", "3", "4"}),
    ("F0 and v2 and x86", {"0", "2", "86"}),
    ("no figures here, only words", set()),
    ("full-width ３ and Arabic-Indic ٣ are not ASCII digits", set()),
])
def test_a_figure_is_a_maximal_match(text: str, expected: set[str]) -> None:
    assert figures(text) == expected


def test_kept_means_verbatim_as_a_whole_figure() -> None:
    pairs = make_pairs(["NAV 10 on 2026-10-09, 1,200 units"] + ["no numbers"] * 9)
    assert figure_stats(pairs, "2010 and 2026-10 and 1,200,000") == FigureStats(3, 0)
    assert figure_stats(pairs, "NAV 10; 1,200 units (2026-10-09).") == FigureStats(3, 3)
    # Distinct figures: a figure repeated across replies counts once.
    repeated = make_pairs(["7 and 7.5"] * 10)
    assert figure_stats(repeated, "7.5") == FigureStats(2, 1)
    assert figure_stats(make_pairs(["none"] * 10), "42") == FigureStats(0, 0)


@pytest.mark.parametrize(("total", "kept", "ratio", "below"), [
    (10, 7, 0.7, False),   # 0.7 * 10 is 7.000000000000001 in floating point: still passes
    (10, 6, 0.7, True),
    (30, 15, 0.5, False),
    (30, 14, 0.5, True),
    (30, 30, 1.0, False),
    (30, 29, 1.0, True),
    (30, 0, 0.0, False),   # 0 turns the gate off
    (0, 0, 1.0, False),    # a range without figures always passes
    (3, 1, 0.34, True),
    (3, 1, 0.33, False),
])
def test_retention_threshold_is_exact(total: int, kept: int, ratio: float,
                                      below: bool) -> None:
    assert FigureStats(total, kept).below(ratio) is below


# --- the worker reports figures and usage in p_stats -------------------------------------


def test_chat_reply_figures_and_usage_reach_the_audit(conn: Conn, dsn: str,
                                                      model_server: ModelServer) -> None:
    seed(conn, "conv-1", 30)
    text = f"NAVs {NAVS[0]}, {NAVS[1]} and {NAVS[2]} on {DATES[0]}; fund F9 led."
    model_server.enqueue(stop(text, usage=(1834, 212)))
    log = run_chat_worker(dsn, model_server.base_url)
    assert stats_row(conn) == [(1, "completed", "completed", 1834, 212, 30, 5)]
    [done] = events_named(log.events(), "completed")
    assert (done["figures_total"], done["figures_kept"], done["input_tokens"],
            done["output_tokens"]) == (30, 5, 1834, 212)


def test_a_server_without_usage_still_gets_figures(conn: Conn, dsn: str,
                                                   model_server: ModelServer) -> None:
    seed(conn, "conv-1", 30)
    model_server.enqueue(stop("Nothing numeric survived.", usage=None))
    run_chat_worker(dsn, model_server.base_url)
    assert stats_row(conn) == [(1, "completed", "completed", None, None, 30, 0)]


def test_extractive_keeps_every_figure_of_an_ordinary_range(conn: Conn, dsn: str) -> None:
    seed(conn, "conv-1", 30)
    log = StringLog()
    config = WorkerConfig(model="pycompactor/extractive-1", dsn=dsn, once=True,
                          log_format="json", min_figure_retention=1.0)
    Worker(config, ExtractiveSummarizer(), log=EventLog("json", stream=log)).run()
    assert stats_row(conn) == [(1, "completed", "completed", None, None, 30, 30)]
    [(_, _, text)] = summaries(conn)
    assert figures(text) >= ALL_30


def test_extractive_cut_sentences_never_split_a_figure() -> None:
    """A reply too long for its share is cut, but never inside a figure."""
    long_reply = ("word " * 700) + "on 2026-10-09 the NAV was 10.37 " + ("filler " * 700)
    pairs = make_pairs([long_reply] * 10)
    for limit in range(300, 700, 7):
        summary = extractive_summary(pairs, limit)
        assert len(summary) <= limit
        assert figures(summary) <= {"2026-10-09", "10.37"} | figures(
            "".join(f"[asst-msg-{i}]" for i in range(10))), (limit, summary)


# --- the retention gate ----------------------------------------------------------------


def test_gate_fails_below_and_passes_at_the_threshold(conn: Conn, dsn: str,
                                                      model_server: ModelServer) -> None:
    """0.5 of 30 figures is 15: keeping 14 fails (figures_lost), keeping 15 completes."""
    seed(conn, "conv-1", 30)
    fourteen = " ".join(NAVS + DATES[:4])
    fifteen = " ".join(NAVS + DATES[:5])
    lost_before = sample("pycompactor_worker_figures_lost_total")
    ratio_before = sample("pycompactor_worker_figure_retention_ratio_count")
    model_server.enqueue(stop(fourteen))
    log = run_chat_worker(dsn, model_server.base_url, min_figure_retention=0.5)
    # fail() records the reason only: the counts are in the worker's log.
    assert stats_row(conn) == [(1, "failed", "figures_lost", None, None, None, None)]
    [failed] = events_named(log.events(), "failed")
    assert (failed["reason"], failed["figures_total"], failed["figures_kept"]) == (
        "figures_lost", 30, 14)
    assert summaries(conn) == []
    assert sample("pycompactor_worker_figures_lost_total") == lost_before + 1

    model_server.enqueue(stop(fifteen))
    run_chat_worker(dsn, model_server.base_url, min_figure_retention=0.5)
    assert stats_row(conn)[1] == (2, "completed", "completed", 1, 1, 30, 15)
    assert sample("pycompactor_worker_figures_lost_total") == lost_before + 1
    assert sample("pycompactor_worker_figure_retention_ratio_count") == ratio_before + 2
    assert sample("pycompactor_worker_figure_retention_ratio_bucket", le="0.5") >= 2


def test_gate_never_fails_a_range_without_figures(conn: Conn, dsn: str,
                                                  model_server: ModelServer) -> None:
    h = History(conn)
    for _ in range(30):
        h.pair("conv-words", user="what happened", assistant="nothing numeric happened")
    model_server.enqueue(stop("Nothing numeric happened, ten times."))
    ratio_before = sample("pycompactor_worker_figure_retention_ratio_count")
    run_chat_worker(dsn, model_server.base_url, min_figure_retention=1.0)
    assert stats_row(conn) == [(1, "completed", "completed", 1, 1, 0, 0)]
    # No ratio exists for a range without figures.
    assert sample("pycompactor_worker_figure_retention_ratio_count") == ratio_before


def test_gate_leaves_the_databases_reasons_alone(conn: Conn, dsn: str,
                                                 model_server: ModelServer) -> None:
    """A truncated reply that also lost figures is not_stopped, with its counts stored."""
    seed(conn, "conv-1", 30)
    from tests.modelserver import length
    model_server.enqueue(length(f"only {NAVS[0]}"))
    run_chat_worker(dsn, model_server.base_url, min_figure_retention=0.9)
    assert stats_row(conn) == [(1, "failed", "not_stopped", 1, 1, 30, 1)]


def test_worker_config_refuses_a_ratio_outside_0_to_1() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="between 0 and 1"):
            WorkerConfig(model=MODEL, min_figure_retention=bad)


def test_db_complete_passes_stats_through(conn: Conn) -> None:
    """The Python API: db.complete(stats=...) is p_stats."""
    from tests.sql.engine import GOOD, T0, claim, target
    t = target(conn, "c1")
    result = claim(conn, "c1", t)
    assert result.job_id is not None
    assert db.complete(conn, result.job_id, 1, GOOD, "stop", 0, now=T0,
                       stats={"figures_total": 4, "figures_kept": 2}).ok
    assert stats_row(conn) == [(1, "completed", "completed", None, None, 4, 2)]
