"""`pycompactor/extractive-2`: offline, deterministic, compressed to a target, plain text.

Properties over any input the source can hold, then its quality goals (compression,
figures and qualified facts kept, time per range, history reach) measured on the
evaluation corpus (docs/corpus.md), then one real worker pass against the test cluster.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bench.quality import density
from pycompactor.cli.evaluate import read_corpus
from pycompactor.cli.sample import sample_turns
from pycompactor.corpus import CorpusConversation, build_corpus
from pycompactor.errors import UsageError
from pycompactor.evaluation import DEFAULT_BUDGETS, evaluate
from pycompactor.models import Pair
from pycompactor.quality.figures import figure_stats, figures
from pycompactor.quality.qualifiers import qualifier_stats
from pycompactor.quality.qualifiers import sentences as qualifier_sentences
from pycompactor.summarizers.extractive import MAX_SUMMARY_CHARS, ExtractiveSummarizer
from pycompactor.summarizers.extractive2 import (
    DEFAULT_TARGET,
    EXTRACTIVE2_MODEL,
    TARGET_TOO_SMALL,
    Extractive2Summarizer,
    extract,
    fact_clauses,
    target_bytes,
)
from pycompactor.summarizers.openai_compatible import make_summarizer
from pycompactor.summarizers.outcomes import Reply
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.process import Worker, WorkerConfig
from tests.history import History
from tests.workerkit import StringLog, complete_verdict

Conn = psycopg.Connection[Any]
ASCII_WS = " \t\n\r\f\v"


def pairs_of(texts: list[str]) -> list[Pair]:
    return [Pair(i, f"r{i}", f"u{i}", f"user {i}", f"msg-{i}", t) for i, t in enumerate(texts)]


def size(text: str) -> int:
    return len(text.encode("utf-8"))


def valid_for_complete(text: str) -> bool:
    """contract §6/§8: non-empty, a character other than ASCII whitespace, <= 6,000 chars."""
    return bool(text.strip(ASCII_WS)) and len(text) <= MAX_SUMMARY_CHARS


def figure_sentences_fit(replies: list[str], target: float) -> bool:
    """The sentences holding figures, each once and a separator each, within the target."""
    held = {s for r in replies for s in qualifier_sentences(r) if figures(s)}
    return (sum(size(s) + 1 for s in held) <= target_bytes(replies, target) + 1
            and sum(len(s) + 1 for s in held) <= MAX_SUMMARY_CHARS + 1)


# --- properties ----------------------------------------------------------------------

_word = st.sampled_from(["the", "fund", "not", "no longer", "only", "except", "instead",
                         "NAV", "基金", "不再", "仅", "净值", "release", "fix", "🙂", "é"])
_number = st.one_of(
    st.integers(0, 10**9).map(str),
    st.builds(lambda a, b: f"{a}.{b:02d}", st.integers(0, 999), st.integers(0, 99)),
    st.dates().map(lambda d: d.isoformat()),
)
_end = st.sampled_from([". ", "! ", "? ", "。", "！", "？", "\n", "; ", "\n- "])
_sentence = st.builds(lambda ws, e: " ".join(ws) + e,
                      st.lists(st.one_of(_word, _number), min_size=1, max_size=14), _end)
_filler = st.builds(lambda n: "This sentence is ordinary commentary without any figure. " * n,
                    st.integers(0, 30))
_reply = st.builds(lambda parts, filler: filler + "".join(parts) + filler,
                   st.lists(_sentence, min_size=1, max_size=8), _filler)
# Any text the source can hold: no NUL, no lone surrogate, at least one character other
# than ASCII whitespace (contract §3); control characters, CJK, emoji, NBSP, U+3000.
_any_text = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1, max_size=3000,
).filter(lambda t: bool(t.strip(ASCII_WS)))
_odd = st.sampled_from(["\u00a0", "\u3000", "\u200b", "x", "7", "🙂", "\x01\x02", "。",
                        "- ", "...", "1.2.3.4.5.6.7.8.9", "基" * 5000, "9" * 20000])
_replies = st.lists(st.one_of(_reply, _any_text, _odd), min_size=10, max_size=10)
_targets = st.one_of(st.just(DEFAULT_TARGET), st.floats(0.001, 1.0))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_replies, _targets)
def test_deterministic_within_target_and_valid(replies: list[str], target: float) -> None:
    first = extract(replies, target)
    assert extract(list(replies), target) == first
    assert first.target_bytes == int(target * sum(size(r) for r in replies))
    assert valid_for_complete(first.text)
    assert "\x00" not in first.text
    if first.over_target is None:
        assert size(first.text) <= first.target_bytes
    else:
        # The only reason: the target is below one character of the replies.
        assert first.over_target == TARGET_TOO_SMALL
        assert len(first.text) == 1
        assert size(first.text) > first.target_bytes


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_reply, min_size=10, max_size=10), _targets)
def test_every_figure_kept_when_the_figures_fit(replies: list[str], target: float) -> None:
    summary = extract(replies, target).text
    stats = figure_stats(pairs_of(replies), summary)
    fit = figure_sentences_fit(replies, target)
    event(f"figure sentences fit: {fit}")
    if fit:
        assert stats.kept == stats.total
        # ... and each with the qualifiers of its sentence.
        qualified = qualifier_stats(replies, summary)
        assert qualified.kept == qualified.total


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_reply, min_size=10, max_size=10), st.floats(0.001, 0.35))
def test_every_figure_kept_when_the_fact_clauses_fit(replies: list[str], target: float) -> None:
    clauses = fact_clauses(replies)
    fit = (sum(size(c) + 1 for c in clauses) <= target_bytes(replies, target) + 1
           and sum(len(c) + 1 for c in clauses) <= MAX_SUMMARY_CHARS + 1)
    event(f"fact clauses fit: {fit}")
    summary = extract(replies, target).text
    if fit:
        stats = figure_stats(pairs_of(replies), summary)
        assert stats.kept == stats.total
        qualified = qualifier_stats(replies, summary)
        assert qualified.kept == qualified.total
    # Each clause states its figures, with its sentence's qualifiers, in one sentence.
    for clause in clauses:
        assert len(qualifier_sentences(clause)) == 1


def test_figures_that_cannot_fit_are_lost_within_the_target() -> None:
    replies = [f"Version {i}.{j} shipped on 2026-0{1 + i % 9}-{10 + j}." for i in range(10)
               for j in range(1)]
    result = extract(replies, 0.2)
    assert size(result.text) <= result.target_bytes
    assert result.over_target is None
    stats = figure_stats(pairs_of(replies), result.text)
    assert 0 < stats.kept < stats.total  # the worker's figures_lost gate sees this


def test_plain_text_without_labels_in_reply_order() -> None:
    replies = [f"Release 15.{i} shipped on 2026-02-{10 + i}. It is not a major release."
               + " Filler words here." * 8 for i in range(10)]
    text = extract(replies).text
    assert "msg-" not in text
    assert "[" not in text
    positions = [text.index(f"15.{i} ") for i in range(10)]
    assert positions == sorted(positions)
    # A sentence repeated by several replies is written once.
    assert text.count("Filler words here.") <= 1


def test_a_qualifier_stays_with_its_fact() -> None:
    filler = "Some general remarks follow here without numbers. " * 12
    replies = [filler + "The setting no longer defaults to 128MB; it is only 64MB as of 15.3. "
               + filler for _ in range(9)] + [filler + "Correction: it was 15.4, not 15.3."]
    text = extract(replies).text
    assert "no longer defaults to 128MB;" in text
    assert "it is only 64MB as of 15.3." in text
    assert "Correction: it was 15.4, not 15.3." in text
    qualified = qualifier_stats(replies, text)
    assert qualified.kept == qualified.total == 9


def test_the_target_is_a_ceiling_and_facts_are_cut_from_the_prose() -> None:
    prose = ("The planner weighs every candidate path by its estimated cost and chooses the"
             " cheapest one it can find within the time it is given. ")
    replies = [prose * 6 + f"After a long and careful review of the workload the team agreed"
               f" that the pool should not exceed {20 + i} connections per node in release"
               f" 15.{i}, which was discussed at length in the meeting notes. " + prose * 6
               for i in range(10)]
    total = sum(size(r) for r in replies)
    result = extract(replies)
    # Far below the 35% ceiling: the facts and a little context, not prose to fill it.
    assert size(result.text) <= 0.06 * total
    assert figure_stats(pairs_of(replies), result.text).kept == 20
    qualified = qualifier_stats(replies, result.text)
    assert qualified.kept == qualified.total == 20
    # The clause is cut around its figures; the qualifier stays in the figures' sentence.
    assert "which was discussed at length" not in result.text
    assert "not exceed 20 connections per node in release 15.0" in result.text
    # The context allowance: the lead sentence at the default, none at 0 (the facts alone).
    assert prose.strip() in result.text
    facts_only = extract(replies, context=0.0).text
    assert prose.strip() not in facts_only
    assert size(facts_only) < size(result.text)
    with pytest.raises(ValueError, match="context"):
        extract(replies, context=1.5)
    outcome = Extractive2Summarizer(context=0.0).summarize(pairs_of(replies))
    assert isinstance(outcome, Reply)
    assert outcome.text == facts_only
    with pytest.raises(ValueError, match="context"):
        Extractive2Summarizer(context=-0.1)


def test_short_figure_dense_replies_keep_their_figures() -> None:
    """The demo's pairs 10-39: four figures in three short sentences per reply."""
    turns = sample_turns()
    for start in (10, 20, 30):
        replies = [a for _, a in turns[start:start + 10]]
        result = extract(replies)
        assert size(result.text) <= result.target_bytes
        stats = figure_stats(pairs_of(replies), result.text)
        assert stats.kept == stats.total > 25
        qualified = qualifier_stats(replies, result.text)
        assert qualified.kept == qualified.total


def test_huge_and_empty_ish_inputs() -> None:
    huge = extract(["digits 12345 and more " * 50_000] * 10)
    assert valid_for_complete(huge.text)
    assert huge.over_target is None
    assert size(huge.text) <= huge.target_bytes
    for odd in ("\u3000", "\u00a0", "\u200b", "🙂", "x"):
        result = extract([odd] * 10)
        assert result.text == odd or (result.text.strip() and odd.strip() == odd)
        assert valid_for_complete(result.text)


def test_target_option() -> None:
    replies = [f"In 15.{i} the limit is {i * 100} connections, not {i * 10}. "
               + " ".join(f"Plain filler {j} of {i} to be dropped when short." for j in range(20))
               for i in range(10)]
    total = sum(size(r) for r in replies)
    for target in (0.1, 0.2, 0.35, 0.5):
        assert size(extract(replies, target).text) <= target * total
    # A ceiling, not an amount to fill: once the facts fit, a larger target adds nothing;
    # a tighter one cuts the clauses tighter.
    assert extract(replies, 0.5).text == extract(replies, 0.35).text
    assert size(extract(replies, 0.05).text) < size(extract(replies, 0.35).text)
    with pytest.raises(ValueError, match="target"):
        extract(replies, 0.0)
    summarizer = make_summarizer(EXTRACTIVE2_MODEL, extractive_target=0.2)
    assert isinstance(summarizer, Extractive2Summarizer)
    assert summarizer.target == 0.2
    assert summarizer.model == EXTRACTIVE2_MODEL
    with pytest.raises(UsageError, match="--extractive-target"):
        make_summarizer(EXTRACTIVE2_MODEL, extractive_target=0.0)
    assert isinstance(make_summarizer("pycompactor/extractive-1"), ExtractiveSummarizer)


def test_summarizer_returns_a_normal_stop(conn: Conn) -> None:
    outcome = Extractive2Summarizer().summarize(pairs_of(["Only 3 of 4 nodes. " * 20] * 10))
    assert isinstance(outcome, Reply)
    assert (outcome.finish_reason, outcome.tool_call_count) == ("stop", 0)
    assert complete_verdict(conn, outcome) == "completed"
    with pytest.raises(ValueError, match="exactly 10 pairs"):
        Extractive2Summarizer().summarize(pairs_of(["x"] * 9))


# --- the quality goals, on the evaluation corpus ---------------------------------------


@pytest.fixture(scope="module")
def corpus_ranges() -> list[list[str]]:
    """The replies of every range the window policy makes a target (contract §4)."""
    corpus: tuple[CorpusConversation, ...] = build_corpus(seed=0)
    return [[a for _, a in c.pairs[k:k + 10]]
            for c in corpus for k in range(0, len(c.pairs) - 29, 10)]


def test_goals_on_the_corpus(corpus_ranges: list[list[str]]) -> None:
    compression: list[float] = []
    figures_kept = figures_total = facts_kept = facts_total = 0
    millis: list[float] = []
    for replies in corpus_ranges:
        # CPU time: the goal is the summarizer's cost, not the load of a shared machine.
        start = time.process_time()
        summary = extract(replies).text
        millis.append((time.process_time() - start) * 1000)
        compression.append(size(summary) / sum(size(r) for r in replies))
        f = figure_stats(pairs_of(replies), summary)
        figures_kept, figures_total = figures_kept + f.kept, figures_total + f.total
        q = qualifier_stats(replies, summary)
        facts_kept, facts_total = facts_kept + q.kept, facts_total + q.total
    assert len(corpus_ranges) >= 150
    assert statistics.median(compression) <= 0.35
    assert max(compression) <= 0.35
    assert figures_kept >= 0.98 * figures_total
    assert facts_kept >= 0.9 * facts_total
    assert statistics.median(millis) <= 50
    assert sorted(millis)[round(0.95 * (len(millis) - 1))] <= 50


def test_reach_goal_on_the_corpus() -> None:
    """History reach at 64 KiB: at least 1.8x the pairs the raw-only projection sees, and
    the summarized region at least 2.5x as many pairs per KiB as raw (bench/quality.py's
    measures, by pycompactor.evaluation)."""
    conversations = read_corpus(seed=0)
    report = evaluate(conversations, Extractive2Summarizer(), source="corpus",
                      budgets=DEFAULT_BUDGETS)
    at_64 = next(t for t in report.reach if t.budget_bytes == 64 * 1024)
    assert at_64.compacted >= 1.8 * at_64.raw_only
    assert density(conversations, report)["ratio"] >= 2.5
    assert report.overall.failed == 0


def test_chinese_ranges_compress_too(corpus_ranges: list[list[str]]) -> None:
    chinese = [r for r in corpus_ranges if "手册页" in r[0]]
    assert chinese
    for replies in chinese:
        summary = extract(replies).text
        assert 0 < size(summary) <= 0.35 * sum(size(r) for r in replies)
        stats = figure_stats(pairs_of(replies), summary)
        assert stats.kept == stats.total


# --- a real worker pass ------------------------------------------------------------------


def test_worker_pass_with_extractive2_beside_extractive1(conn: Conn, dsn: str) -> None:
    corpus = build_corpus(seed=0, conversations=1)
    history = History(conn)
    for user, assistant in corpus[0].pairs[:30]:
        history.pair("conv-corpus", user, assistant)
    replies = [a for _, a in corpus[0].pairs[:10]]

    def one_pass(summarizer: Any, **options: Any) -> dict[str, int]:
        config = WorkerConfig(model=summarizer.model, dsn=dsn, once=True,
                              conversation="conv-corpus", log_format="json", **options)
        log = StringLog()
        return Worker(config, summarizer, log=EventLog("json", stream=log)).run().outcomes

    assert one_pass(Extractive2Summarizer(), min_figure_retention=1.0) == {"completed": 1}
    assert one_pass(ExtractiveSummarizer()) == {"completed": 1}
    rows = conn.execute(
        "SELECT j.model, s.summary, a.figures_total, a.figures_kept"
        " FROM compaction.summaries s"
        " JOIN compaction.jobs j USING (conversation_id, job_id)"
        " JOIN compaction.audit_jobs a ON a.job_id = j.job_id"
        " WHERE s.conversation_id = 'conv-corpus' ORDER BY j.model").fetchall()
    assert [r[0] for r in rows] == ["pycompactor/extractive-1", EXTRACTIVE2_MODEL]
    (_, one, _, _), (_, two, total, kept) = rows
    assert two == extract(replies).text
    assert size(two) <= DEFAULT_TARGET * sum(size(r) for r in replies)
    assert kept == total > 0
    assert "[conv-corpus:" in one
    assert "[conv-corpus:" not in two
