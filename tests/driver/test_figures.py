"""Figures kept (contract §8): the definition, p_stats from the worker, the retention gate.

The seeded range of tests.workerkit (conv-1, pairs 0-9) holds exactly 30 distinct figures:
`0`..`9` (reply numbers, fund names F0..F9, the `1` of `conv-1`, star ratings 1..5),
`10.25`..`19.25` (NAVs) and `2026-03-01`..`2026-03-10` (dates).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from pycompactor import db, project_history
from pycompactor.quality.figures import (
    FigureStats,
    figure_stats,
    figures,
    invented_figures,
    without_labels,
)
from pycompactor.summarizers.extractive import ExtractiveSummarizer, extractive_summary
from pycompactor.summarizers.extractive2 import Extractive2Summarizer
from pycompactor.summarizers.openai_compatible import OpenAISummarizer
from pycompactor.summarizers.outcomes import Reply
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.process import Worker, WorkerConfig
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


def invented_row(conn: Conn) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(
        "SELECT attempt, state, reason, figures_invented FROM compaction.audit_jobs"
        " ORDER BY job_id, attempt").fetchall()]


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


# --- invented figures (contract §8, revised) --------------------------------------------


def test_a_figure_no_reply_holds_is_invented() -> None:
    pairs = make_pairs(["NAV 10.37 on 2026-10-09, 1,200 units"] + ["no numbers"] * 9)
    assert invented_figures(pairs, "NAV 10.37 on 2026-10-09, 1,200 units") == frozenset()
    assert invented_figures(pairs, "NAV 10.38 on 2026-10-09") == {"10.38"}
    # Whole figures, as for kept: a part or an extension of a reply's figure is not held.
    assert invented_figures(pairs, "1,200,000 units in 2010") == {"1,200,000", "2010"}
    assert invented_figures(pairs, "NAV 10 or 37") == {"10", "37"}
    assert invented_figures(pairs, "") == frozenset()


def test_labels_equal_to_the_replies_ids_are_not_figures() -> None:
    """make_pairs' replies are asst-msg-0 .. asst-msg-9: `[asst-msg-7]` is the attribution
    the prompt asks for, not a figure; the same digits outside a label, or a bracketed
    id that is no reply's, are."""
    pairs = make_pairs(["no numbers"] * 10)
    assert invented_figures(pairs, "[asst-msg-7] said nothing. [asst-msg-0] either.") \
        == frozenset()
    assert invented_figures(pairs, "asst-msg-7 said nothing") == {"7"}
    assert invented_figures(pairs, "[asst-msg-17] said nothing") == {"17"}
    assert invented_figures(pairs, "[asst-msg-7, asst-msg-8]") == {"7", "8"}
    # A label is replaced by a space: its neighbours never join into one figure.
    assert without_labels(pairs, "12[asst-msg-3]34") == "12 34"
    assert invented_figures(pairs, "12[asst-msg-3]34") == {"12", "34"}


def test_ids_with_pattern_characters_are_labels_too() -> None:
    pairs = [replace(p, assistant_message_id=f"a.{i}+(x)")
             for i, p in enumerate(make_pairs(["none"] * 10))]
    assert invented_figures(pairs, "[a.3+(x)] nothing") == frozenset()
    assert invented_figures(pairs, "[a*3+(x)] nothing") == {"3"}


def test_the_offline_summarizers_invent_no_figure() -> None:
    """contract §8: the offline summarizers never invent one (their labels aside)."""
    samples = [make_pairs(), make_pairs([f"Cut here {i}.5-{i} and 1,2{i}0,000 or 10.{i}7 then "
                          + "word " * 300 + f"2026-10-{i:02d}" for i in range(10)])]
    for pairs in samples:
        for summarizer in (ExtractiveSummarizer(), Extractive2Summarizer()):
            reply = summarizer.summarize(pairs)
            assert isinstance(reply, Reply)
            assert invented_figures(pairs, reply.text) == frozenset()


def test_a_summary_quoting_a_figure_no_reply_holds_fails_and_stays_raw(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """The default allows no invented figure: the attempt fails figures_invented through
    `fail`, nothing is stored, and the next Run sees pairs 0-9 raw."""
    seed(conn, "conv-1", 30)
    invented_before = sample("pycompactor_worker_figures_invented_total")
    model_server.enqueue(stop(f"NAVs {NAVS[0]} and 99.99 on {DATES[0]}.", usage=(900, 80)))
    log = run_chat_worker(dsn, model_server.base_url)
    assert invented_row(conn) == [(1, "failed", "figures_invented", None)]
    assert summaries(conn) == []
    [failed] = events_named(log.events(), "failed")
    assert (failed["reason"], failed["figures_invented"], failed["figures_kept"],
            failed["input_tokens"]) == ("figures_invented", 1, 2, 900)
    assert "99.99" not in failed["detail"]  # the count, never the summary's text
    assert sample("pycompactor_worker_figures_invented_total") == invented_before + 1
    projection = project_history(conn, "conv-1", budget_bytes=1_000_000)
    assert [p.placement for p in projection.pairs][:10] == ["raw"] * 10
    assert projection.rejected_summaries.reason_counts() == {}


def test_labels_of_the_range_complete_and_the_audit_shows_zero(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """seed's replies are conv-1-a000 .. conv-1-a009: their labels hold `1` and `007`,
    which no reply holds as a figure; as labels they are not figures."""
    seed(conn, "conv-1", 30)
    model_server.enqueue(stop(f"[conv-1-a007] NAV {NAVS[7]} on {DATES[7]}. "
                              f"[conv-1-a000] NAV {NAVS[0]}."))
    log = run_chat_worker(dsn, model_server.base_url)
    assert invented_row(conn) == [(1, "completed", "completed", 0)]
    [done] = events_named(log.events(), "completed")
    assert done["figures_invented"] == 0
    # A label of another range's reply is a figure the range does not hold.
    model_server.enqueue(stop(f"[conv-1-a017] NAV {NAVS[7]}."))
    seed(conn, "conv-2", 30)
    run_chat_worker(dsn, model_server.base_url, conversation="conv-2")
    assert invented_row(conn)[1] == (1, "failed", "figures_invented", None)


def test_max_invented_figures_lets_that_many_through(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    seed(conn, "conv-1", 30)
    model_server.enqueue(stop(f"NAV {NAVS[0]}, then 99.99 and 42.42."))
    run_chat_worker(dsn, model_server.base_url, max_invented_figures=1)
    assert invented_row(conn) == [(1, "failed", "figures_invented", None)]
    model_server.enqueue(stop(f"NAV {NAVS[0]}, then 99.99."))
    log = run_chat_worker(dsn, model_server.base_url, max_invented_figures=1)
    assert invented_row(conn) == [(1, "failed", "figures_invented", None),
                                  (2, "completed", "completed", 1)]
    [started] = events_named(log.events(), "started")
    assert started["max_invented_figures"] == 1


def test_the_invented_gate_leaves_the_databases_reasons_alone(
        conn: Conn, dsn: str, model_server: ModelServer) -> None:
    """A truncated reply that also invents a figure is not_stopped, with its count kept."""
    seed(conn, "conv-1", 30)
    from tests.modelserver import length
    model_server.enqueue(length("only 99.99"))
    run_chat_worker(dsn, model_server.base_url)
    assert invented_row(conn) == [(1, "failed", "not_stopped", 1)]


@pytest.mark.parametrize("bad", [-1, 6001, True, 1.5])
def test_worker_config_refuses_a_bad_allowance(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_invented_figures"):
        WorkerConfig(model=MODEL, max_invented_figures=bad)


@pytest.mark.parametrize(("stats", "stored"), [
    ({"figures_invented": 0}, 0),
    ({"figures_total": 3, "figures_kept": 2, "figures_invented": 7}, 7),
    ({"figures_total": 3}, None),
])
def test_complete_takes_figures_invented(conn: Conn, stats: dict[str, int],
                                         stored: int | None) -> None:
    seed(conn, "conv-1", 30)
    job = claim_first(conn)
    done = db.complete(conn, job[0], job[1], "a summary", "stop", 0, stats=stats,
                       conversation_id="conv-1")
    assert done.ok
    assert invented_row(conn) == [(1, "completed", "completed", stored)]


@pytest.mark.parametrize("value", ["-1", "1.5", "\"3\"", "2147483648", "null"])
def test_complete_refuses_a_bad_figures_invented(conn: Conn, value: str) -> None:
    seed(conn, "conv-1", 30)
    job = claim_first(conn)
    with pytest.raises(psycopg.Error) as info:
        conn.execute("SELECT * FROM compaction.complete(%s, %s, 'a summary', 'stop', 0,"
                     " p_stats => %s::jsonb)",
                     (job[0], job[1], f'{{"figures_invented": {value}}}'))
    assert info.value.sqlstate == "CP020"
    assert invented_row(conn) == [(1, "running", None, None)]


def claim_first(conn: Conn) -> tuple[int, int]:
    [t] = db.plan_targets(conn, "conv-1")
    result = db.claim(conn, "conv-1", "default", t.from_pair, t.source_message_ids,
                      t.source_hash, MODEL, "conversation-compaction@3", "w")
    assert result.claimed
    assert result.job_id is not None
    assert result.attempt is not None
    return result.job_id, result.attempt


def test_the_offline_summarizers_invent_no_figure_on_the_corpus() -> None:
    """Every range of the evaluation corpus (real text: PostgreSQL's documentation and
    Chinese man pages), both offline models at their defaults: nothing invented, so the
    worker's default gate never fails them."""
    from pycompactor.corpus import build_corpus
    from pycompactor.models import Pair

    checked = 0
    for conversation in build_corpus(seed=0, conversations=12):
        for start in range(0, len(conversation.pairs) - 9, 10):
            pairs = [Pair(pair_index=start + i, run_id=f"r{start + i}",
                          user_message_id=f"{conversation.conversation_id}-u{start + i}",
                          user_content=user,
                          assistant_message_id=f"{conversation.conversation_id}-a{start + i}",
                          assistant_content=reply)
                     for i, (user, reply) in enumerate(conversation.pairs[start:start + 10])]
            for summarizer in (ExtractiveSummarizer(), Extractive2Summarizer()):
                reply = summarizer.summarize(pairs)
                assert isinstance(reply, Reply)
                assert invented_figures(pairs, reply.text) == frozenset(), (
                    conversation.conversation_id, start, summarizer.model)
            checked += 1
    assert checked >= 12
