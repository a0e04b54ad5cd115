"""The evaluation's pure metrics (no database, no model server): compression, retention,
the window, and reach against hand-computed projections."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from pycompactor.cli.evaluate import html_report, report_charts
from pycompactor.evaluation import (
    DEFAULT_BUDGETS,
    EvalConversation,
    EvalPair,
    RangeResult,
    Reach,
    Report,
    compression,
    conversation_from_texts,
    evaluate,
    guess_language,
    measure_range,
    reach,
    reply_problem,
    target_ranges,
    totals,
)
from pycompactor.hashing import source_hash
from pycompactor.projection import StoredSummary, marker_line, project_pairs
from pycompactor.quality import charts
from pycompactor.summarizers.extractive import ExtractiveSummarizer
from pycompactor.summarizers.openai_compatible import OpenAISummarizer
from pycompactor.summarizers.outcomes import Failure, Reply
from tests.modelserver import ModelServer, http_error, length, stop

# CJK on both sides, so every cost below is UTF-8 bytes, not characters: a user message
# of 28 characters is 84 bytes (cost 100 with the 16 of a message), a reply of 62
# characters is 184 bytes (cost 200): 300 a pair.
USER = "问" * 28
REPLY = "答" * 61 + "a"
PAIR_COST = 300


def cjk_pairs(n: int) -> list[EvalPair]:
    return [EvalPair(i, f"u{i}", USER, f"a{i}", REPLY) for i in range(n)]


def summary_of(size: int) -> str:
    return "s" * size


def test_the_pairs_cost_what_the_comment_says() -> None:
    assert len(USER.encode()) + 16 + len(REPLY.encode()) + 16 == PAIR_COST
    # The marker lines the projection puts first in a summary message (contract §9).
    assert len(marker_line(0, 9).encode()) == 55
    assert len(marker_line(10, 19).encode()) == 57


@pytest.mark.parametrize(("n", "ranges"), [
    (0, ()), (29, ()), (30, (0,)), (39, (0,)), (40, (0, 10)), (55, (0, 10, 20)),
])
def test_target_ranges_follow_the_window_policy(n: int, ranges: tuple[int, ...]) -> None:
    assert target_ranges(n) == ranges


def test_compression_counts_utf8_bytes() -> None:
    assert compression(["abcd"], "ab") == 0.5
    # Two characters of 3 bytes each against one: a third of the characters would be
    # 0.5 of them, but 3 of 6 bytes is also 0.5; with ASCII in the summary it is not.
    assert compression(["你好"], "好") == 0.5
    assert compression(["你好"], "ab") == pytest.approx(2 / 6)
    assert compression(["ab", "cd"], "abcdabcd") == 2.0
    with pytest.raises(ValueError, match="undefined"):
        compression(["", ""], "x")


def test_measure_range_counts_figures_and_qualified_facts() -> None:
    replies = [f"Fund F{i} is no longer at 1.{i}5 since 2026-10-0{i}." for i in range(9)]
    replies.append("费用不再是0.75%。仅剩0.2。")
    pairs = [EvalPair(i, f"u{i}", "q", f"a{i}", r) for i, r in enumerate(replies)]
    summary = "Fund F1 is no longer at 1.15. 费用不再是0.75%。"
    result = measure_range(pairs, summary, seconds=1.5)
    replies_bytes = sum(len(r.encode()) for r in replies)
    assert (result.from_pair, result.to_pair) == (0, 9)
    assert result.replies_bytes == replies_bytes
    assert result.summary_bytes == len(summary.encode())
    assert result.compression == len(summary.encode()) / replies_bytes
    # Figures: 0..8, 1.05..1.85, 2026-10-00..08, 0.75, 0.2 (distinct); kept: 1, 1.15, 0.75.
    assert (result.figures_total, result.figures_kept) == (9 + 9 + 9 + 2, 3)
    # Qualified facts: each English reply's three figures with "no longer"; Chinese:
    # (0.75, 不再), (0.2, 仅). Kept: (1, no longer), (1.15, no longer), (0.75, 不再).
    assert (result.qualifiers_total, result.qualifiers_kept) == (27 + 2, 3)
    assert result.figure_retention == 3 / 29
    assert result.seconds == 1.5
    failed = measure_range(pairs, None, failure="timeout")
    assert (failed.summary_bytes, failed.figures_kept, failed.compression,
            failed.figure_retention, failed.failure) == (None, None, None, None, "timeout")
    assert failed.figures_total == 29
    with pytest.raises(ValueError, match="exactly 10"):
        measure_range(pairs[:9], summary)


def test_measure_range_asks_the_replies_questions_of_the_summary() -> None:
    funds = ["Lotus Asia Growth", "Northwind Global Equity", "Harbor Bond Index",
             "Cedar Dividend", "Maple Income"]
    replies = [f"{fund} charges an ongoing fee of 0.{i + 2}9% per year and no entry fee."
               for i, fund in enumerate(funds)]
    replies += [f"Background {w} without a number, never mind."
                for w in ("one", "two", "three", "four", "five")]
    pairs = [EvalPair(i, f"u{i}", "q", f"a{i}", r) for i, r in enumerate(replies)]
    named = "\n".join(f"[a{i}] {fund}: ongoing fee 0.{i + 2}9% a year, no entry fee"
                      for i, fund in enumerate(funds))
    result = measure_range(pairs, named)
    assert (result.attribution_total, result.attribution_kept) == (5, 5)
    assert result.attribution == 1.0
    assert result.invented == ()  # [a0]..[a4] are the replies' ids, not figures
    anonymous = "\n".join(f"an ongoing fee of 0.{i + 2}9% per year and no entry"
                          for i in range(5))
    lost = measure_range(pairs, anonymous)
    assert (lost.attribution_kept, lost.figures_kept) == (0, 5)  # every digit, no answer
    assert [q.expected for q in lost.lost if q.kind == "figure"] == [
        "0.29", "0.39", "0.49", "0.59", "0.69"]
    # Five "no", five "without", five "never": the background's caveats are gone.
    assert lost.scope_total == 15
    assert lost.scope_kept is not None
    assert lost.scope_kept <= 5
    invented = measure_range(pairs, "Lotus Asia Growth charges 0.30% a year.")
    assert invented.invented == ("0.30",)
    assert invented.invented_figures == 1
    failed = measure_range(pairs, None, failure="timeout")
    assert (failed.attribution_total, failed.attribution_kept, failed.invented) == (5, None,
                                                                                   None)
    assert failed.to_dict()["invented"] == []


def test_worst_ranges_lowest_attribution_first_with_their_text() -> None:
    report = sample_report()
    worst = report.worst()
    assert worst
    ratios = [r.attribution if r.attribution is not None else 1.0 for _, r in worst]
    assert ratios == sorted(ratios)
    data = report.to_dict()["worst"]
    assert [(w["conversation_id"], w["from_pair"]) for w in data] == [
        (cid, r.from_pair) for cid, r in worst]
    _first_id, first = worst[0]
    assert data[0]["summary"] == first.summary
    assert len(data[0]["replies"]) == 10
    assert all(not q["kept"] for q in data[0]["lost"])


def test_the_worst_ranges_are_escaped_beside_their_source() -> None:
    replies = [f"<b>Fund & F{i}</b> charges <i>0.{i}5%</i> a year, never more." for i in range(31)]
    conversation = conversation_from_texts("c<1>", "en", [(f"q{i}", r)
                                                          for i, r in enumerate(replies)])
    report = evaluate([conversation], ExtractiveSummarizer(), source="test")
    page = html_report(report)
    assert "<b>Fund" not in page
    assert "&lt;b&gt;Fund &amp; F" in page
    assert "c&lt;1&gt;" in page
    assert "c<1>" not in page
    assert "The worst ranges, summary beside source" in page


def test_reply_problem_applies_the_completion_rules_in_order() -> None:
    assert reply_problem(Reply("ok", "stop", 0)) is None
    assert reply_problem(Failure("timeout")) == "timeout"
    assert reply_problem(Reply("ok", "length", 1)) == "not_stopped"
    assert reply_problem(Reply("ok", "stop", 1)) == "tool_calls"
    assert reply_problem(Reply(" \t\n", "stop", 0)) == "empty"
    assert reply_problem(Reply("\u3000", "stop", 0)) is None  # content, as §3 says
    assert reply_problem(Reply("x" * 6000, "stop", 0)) is None
    assert reply_problem(Reply("x" * 6001, "stop", 0)) == "too_long"


def reach_at(pairs: Sequence[EvalPair], summaries: dict[int, str], budget: int) -> Reach:
    [one] = reach(pairs, summaries, [budget])
    return one


def test_reach_a_summary_block_buys_older_pairs() -> None:
    pairs = cjk_pairs(30)
    block = 10 * 100 + (55 + 1 + 100 + 16)  # ten user messages, marker + summary message
    budget = 20 * PAIR_COST + block
    got = reach_at(pairs, {0: summary_of(100)}, budget)
    # With the summary: pairs 20-29 raw (6,000 bytes), then the whole block of 0-9 fits
    # exactly. Raw only: 20 pairs and three more of 300 in the block's 1,172 bytes.
    assert got == Reach(budget, compacted=30, summarized=10, raw_only=23,
                        compacted_bytes=budget, raw_only_bytes=23 * PAIR_COST, ceiling=30)
    assert got.gain == 7


def test_reach_a_block_that_does_not_fit_falls_back_to_raw_pairs() -> None:
    pairs = cjk_pairs(30)
    budget = 20 * PAIR_COST + 3 * PAIR_COST + 50  # 1,172 for the block: 50 short of it
    got = reach_at(pairs, {0: summary_of(100)}, budget)
    assert got == Reach(budget, compacted=23, summarized=0, raw_only=23,
                        compacted_bytes=23 * PAIR_COST, raw_only_bytes=23 * PAIR_COST,
                        ceiling=23)
    # Not even a one-byte summary's block (1,073 bytes) fits in the 950 left after the
    # newest 20 pairs: no summary could have reached further, which the ceiling says.


def test_reach_raw_only_can_reach_more_than_compaction() -> None:
    """A summary longer than its replies (an extractive one of short replies) still
    fits and is used, and leaves less room for older pairs than the raw pairs would."""
    pairs = cjk_pairs(40)
    long_summary = summary_of(3000)  # the ten replies are 1,840 bytes
    block = 10 * 100 + (57 + 1 + 3000 + 16)  # 4,074
    budget = 20 * PAIR_COST + block + PAIR_COST
    got = reach_at(pairs, {10: long_summary}, budget)
    # Compaction: 20-39 raw, the block of 10-19, then pair 9 raw (0-9 has no summary).
    # Raw only: 10,374 bytes hold 34 pairs of 300.
    assert (got.compacted, got.summarized, got.raw_only) == (31, 10, 34)
    assert got.gain == -3


def test_reach_under_a_budget_smaller_than_one_pair() -> None:
    got = reach_at(cjk_pairs(30), {0: summary_of(100)}, PAIR_COST - 1)
    assert (got.compacted, got.raw_only, got.compacted_bytes) == (0, 0, 0)


def test_reach_agrees_with_the_projection_itself() -> None:
    """The same rules as the engine's projection: project_pairs (which renders the
    messages and recomputes every source hash) reaches the same pairs."""
    pairs = [EvalPair(i, f"u{i}", f"question {i} " + "字" * (i % 7 * 13),
                      f"a{i}", f"answer {i} " + "x" * (i * 37 % 300)) for i in range(47)]
    summaries = {0: "first block " * 20, 10: "第二块" * 90}
    stored = [
        StoredSummary(from_pair + 1, from_pair, from_pair + 9,
                      tuple(m for p in pairs[from_pair:from_pair + 10]
                            for m in (p.user_message_id, p.assistant_message_id)),
                      source_hash(pairs[from_pair:from_pair + 10]),
                      "conversation-compaction@3", True, 3, datetime(2026, 1, 1, tzinfo=UTC),
                      text)
        for from_pair, text in summaries.items()
    ]
    smallest = [dataclasses.replace(s, summary="-") for s in stored]
    for budget in itertools.chain(range(0, 20_000, 457), DEFAULT_BUDGETS):
        projection = project_pairs(pairs, stored, budget_bytes=budget)
        raw = project_pairs(pairs, [], budget_bytes=budget)
        got = reach_at(pairs, summaries, budget)
        assert got.compacted == len(pairs) - projection.pairs.omitted, budget
        assert got.raw_only == len(pairs) - raw.pairs.omitted, budget
        ceiling = project_pairs(pairs, smallest, budget_bytes=budget)
        assert got.ceiling == len(pairs) - ceiling.pairs.omitted, budget
        assert got.ceiling >= got.compacted
        assert got.compacted_bytes == projection.used_bytes
        assert got.summarized == sum(p.placement == "summarized" for p in projection.pairs)


def test_reach_refuses_a_summary_of_no_range() -> None:
    with pytest.raises(ValueError, match="no range"):
        reach(cjk_pairs(15), {10: "x"})


def test_totals_pool_ratios_of_sums() -> None:
    def result(replies: int, summary: int | None, ft: int, fk: int | None,
               tokens: int | None) -> RangeResult:
        return RangeResult(0, 9, replies, summary, ft, fk, 2, None if fk is None else 1,
                           tokens, tokens, 0.5, None if summary is not None else "timeout")

    pooled = totals([result(1000, 250, 10, 9, 100), result(3000, 250, 30, 27, None),
                     result(500, None, 7, None, None)])
    assert (pooled.ranges, pooled.failed) == (3, 1)
    assert pooled.compression == 500 / 4000  # not the mean of 0.25 and 0.083
    assert pooled.figure_retention == 36 / 40
    assert pooled.qualifier_retention == 2 / 4
    assert (pooled.input_tokens, pooled.output_tokens) == (100, 100)
    assert pooled.seconds == 1.5
    none = totals([result(1000, 250, 0, 0, None)])
    assert (none.figure_retention, none.input_tokens) == (None, None)


def test_guess_language() -> None:
    assert guess_language(["基金的费用不再是1.5%。"]) == "zh"
    assert guess_language(["The fee is no longer 1.5%."]) == "en"
    assert guess_language(["2026-10-09 1.5%"]) == "other"


def sample_report() -> Report:
    en = conversation_from_texts("en-1", "en", [
        (f"question {i}", f"Fund F{i} is no longer at {i}.25 on 2026-10-{i % 28 + 1:02d}. "
         "Background text without numbers, kept only while it fits.")
        for i in range(45)])
    zh = conversation_from_texts("zh-1", "zh", [
        (f"问题 {i}", f"基金{i}的费用不再是{i}.5%，仅在2026年10月{i % 28 + 1}日之前有效。")
        for i in range(31)])
    return evaluate([en, zh], ExtractiveSummarizer(), source="test")


def test_evaluate_summarizes_every_target_range_and_measures_it() -> None:
    report = sample_report()
    assert [c.conversation_id for c in report.conversations] == ["en-1", "zh-1"]
    en, zh = report.conversations
    assert [(r.from_pair, r.to_pair) for r in en.ranges] == [(0, 9), (10, 19)]
    assert [(r.from_pair, r.to_pair) for r in zh.ranges] == [(0, 9)]
    assert all(r.failure is None and r.figure_retention == 1.0 for r in report.ranges)
    assert [r.budget_bytes for r in en.reach] == list(DEFAULT_BUDGETS)
    assert set(report.by_language()) == {"en", "zh"}
    data = report.to_dict()
    assert set(data) == {"model", "api", "source", "budgets", "overall", "by_language",
                         "reach", "worst", "conversations"}
    assert data["model"] == "pycompactor/extractive-1"
    assert data["overall"]["ranges"] == 3
    assert [r["pairs"] for r in data["reach"]] == [76] * 4


def test_charts_and_html_are_self_contained() -> None:
    report = sample_report()
    svgs = report_charts(report)
    assert set(svgs) == {"frontier", "compression", "figure-retention",
                         "qualifier-retention", "attribution", "reach"}
    page = html_report(report)
    assert page.count("<svg") == 6
    for outside in ("http://", "https://", "<script", "@import", "<link", "url("):
        assert outside not in page
    standalone = report_charts(report, standalone=True)["reach"]
    assert 'xmlns="http://www.w3.org/2000/svg"' in standalone
    assert charts.xml_file(standalone).startswith("<?xml")


def test_histogram_puts_every_value_in_a_bin() -> None:
    svg = charts.histogram("t", [0.0, 0.05, 0.5, 0.99, 1.0, 7.0], (0.0, 0.5, 1.0, 2.0),
                           x_label="x")
    # Bins [0, 0.5), [0.5, 1.0), >= 1.0: 2, 2 and 2 values (7.0 lands in the last).
    assert svg.count("<rect x=") == 3
    assert [part.split("</title>")[0].rsplit(": ", 1)[1]
            for part in svg.split("<title>ranges, ")[1:]] == ["2", "2", "2"]
    with pytest.raises(ValueError, match="increasing"):
        charts.histogram("t", [], (1.0, 1.0), x_label="x")


def test_conversation_from_texts_numbers_pairs() -> None:
    conversation = conversation_from_texts("c", "en", [("q0", "r0"), ("q1", "r1")])
    assert conversation == EvalConversation("c", "en", (
        EvalPair(0, "u0", "q0", "a0", "r0"), EvalPair(1, "u1", "q1", "a1", "r1")))


def test_a_failed_range_is_reported_and_reaches_raw(model_server: ModelServer) -> None:
    """Through the real openai client: range 0-9 gets a cut-off reply (not_stopped), range
    10-19 an HTTP 400, range 20-29 a summary with usage. Failed ranges have no summary,
    so the walk takes their raw pairs, and their tokens still count."""
    model_server.enqueue(length(), http_error(400), stop("Short.", usage=(900, 7)))
    conversation = EvalConversation("c", "zh", tuple(cjk_pairs(50)))
    with OpenAISummarizer("m", base_url=model_server.base_url, api_key="k",
                          retry_backoff_seconds=0) as summarizer:
        report = evaluate([conversation], summarizer, source="test", api="chat",
                          budgets=[1_000_000])
    first, second, third = report.ranges
    assert (first.failure, first.summary_bytes, first.figures_kept) == ("not_stopped", None,
                                                                        None)
    assert (first.input_tokens, first.output_tokens) == (1, 1)  # the server's default usage
    assert (second.failure, second.input_tokens) == ("http_400", None)
    assert (third.failure, third.summary_bytes, third.input_tokens) == (None, 6, 900)
    [reach_all] = report.conversations[0].reach
    assert (reach_all.compacted, reach_all.summarized) == (50, 10)  # only 20-29 summarized
    overall = report.overall
    assert (overall.ranges, overall.failed, overall.summary_bytes) == (3, 2, 6)
    assert (overall.input_tokens, overall.output_tokens) == (901, 8)
    assert report.to_dict()["api"] == "chat"


def test_scatter_joins_a_series_and_labels_every_point() -> None:
    points = [charts.Point("m", "m@0.2", 0.2, 0.5, charts.BLUE),
              charts.Point("m", "m@0.4", 0.4, 0.9, charts.BLUE),
              charts.Point("<b>", "<b>@0.3", 0.3, 0.7, charts.ORANGE)]
    svg = charts.scatter("t", points, x_label="x", y_label="y")
    assert svg.count("<circle") == 3 + 2  # the points, and a legend mark per series
    assert svg.count("<polyline") == 1  # only the series of two points is joined
    assert "&lt;b&gt;@0.3" in svg
    assert "<b>" not in svg
