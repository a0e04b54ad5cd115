"""Fidelity measures (pycompactor.quality.fidelity): a reader asks the summary the replies'
questions. Hand-made English and Chinese cases, extractive-2 on the demo sample, and the
replies-summarise-themselves property over corpus ranges."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycompactor.cli.sample import sample_turns
from pycompactor.corpus import build_corpus
from pycompactor.models import Pair
from pycompactor.quality.fidelity import (
    MASK,
    MAX_QUESTION_WORDS,
    Score,
    attribution,
    invented,
    lead_terms,
    qualifier_scope,
    questions,
    scores,
    without_labels,
    words,
)
from pycompactor.quality.qualifiers import QUALIFIERS_EN_V2, QUALIFIERS_ZH_V2, scope_qualifiers
from pycompactor.summarizers.extractive2 import Extractive2Summarizer
from pycompactor.summarizers.outcomes import Reply

FUNDS = {"Lotus Asia Growth": "0.29", "Northwind Global Equity": "0.43",
         "Harbor Bond Index": "0.50", "Cedar Dividend": "0.64", "Maple Income": "0.18"}
FEES_EN = [f"{fund} charges an ongoing fee of {fee}% per year and no entry fee."
           for fund, fee in FUNDS.items()]
FUNDS_ZH = {"莲花亚洲成长基金": "0.29", "北风全球股票基金": "0.43", "港湾债券指数基金": "0.50",
            "雪松红利基金": "0.64", "枫叶收益基金": "0.18"}
FEES_ZH = [f"{fund}的管理费为每年 {fee}%，不收申购费。" for fund, fee in FUNDS_ZH.items()]
NAV_EN = ("On 2026-10-09 the NAV of Harbor Bond Index was 10.37 USD. That figure is dated "
          "2026-10-09; it is not the current NAV, which needs a fresh quote.")
NAV_ZH = "截至 2026-10-23，雪松红利基金的单位净值为 11.11。请注意这是历史净值，不是当前净值。"


def rotate_figures(text: str, order: list[str]) -> str:
    """Every figure of `order` replaced by the next one: each line states another's."""
    following = {f: order[(i + 1) % len(order)] for i, f in enumerate(order)}
    return re.sub(r"[0-9]+(?:\.[0-9]+)?", lambda m: following.get(m.group(0), m.group(0)), text)


# --------------------------------------------------------------------------- words


def test_words_drop_stopwords_and_pair_chinese_characters() -> None:
    assert words("The fund's NAV on 2026-10-09 was 10.37 USD") == {
        "fund", "nav", "2026-10-09", "10.37", "usd"}
    assert words("管理费 0.29%") == {"管", "理", "费", "管理", "理费", "0.29"}
    # A qualifier is never a stopword: it belongs to the question of a figure.
    assert {"no", "not", "only"} <= words("no entry fee, not current, only once")


def test_scope_qualifiers_cover_hedges_superlatives_and_time_scope() -> None:
    for word in ("unlikely", "may", "might", "smallest", "largest", "minimum", "maximum",
                 "as of", "until", "since"):
        assert word in QUALIFIERS_EN_V2
    for word in ("不太可能", "可能", "最小", "最大", "截至", "以来"):
        assert word in QUALIFIERS_ZH_V2
    assert scope_qualifiers("CPU usage is unlikely to add up to exactly 100%.") == {
        "unlikely", "up to", "exactly"}
    assert scope_qualifiers("The smallest accepted key size is 512 bits.") == {"smallest"}
    assert scope_qualifiers("这不太可能发生，最小值为 512。") == {"不太可能", "最小"}


# --------------------------------------------------------------------------- attribution


@pytest.mark.parametrize("replies", [[*FEES_EN, NAV_EN], [*FEES_ZH, NAV_ZH]],
                         ids=["en", "zh"])
def test_the_replies_summarising_themselves_score_one(replies: list[str]) -> None:
    figures_, caveats = scores(replies, "\n".join(replies))
    assert figures_.total >= len(FUNDS)
    assert figures_.ratio == 1.0
    assert caveats.total >= 2
    assert caveats.ratio == 1.0


@pytest.mark.parametrize("replies", [[*FEES_EN, NAV_EN], [*FEES_ZH, NAV_ZH]],
                         ids=["en", "zh"])
def test_an_empty_ish_summary_scores_zero(replies: list[str]) -> None:
    for summary in ("Summary.", "摘要。", ""):
        figures_, caveats = scores(replies, summary)
        assert figures_.total > 0
        assert figures_.kept == 0
        assert figures_.ratio == 0.0
        assert caveats.total > 0
        assert caveats.kept == 0


@pytest.mark.parametrize(("replies", "fees"), [(FEES_EN, list(FUNDS.values())),
                                                (FEES_ZH, list(FUNDS_ZH.values()))],
                         ids=["en", "zh"])
def test_shuffled_figures_score_zero_attribution(replies: list[str], fees: list[str]) -> None:
    shuffled = "\n".join(rotate_figures(r, fees) for r in replies)
    assert set(re.findall(r"[0-9.]+%", shuffled)) == {f"{f}%" for f in fees}
    score = attribution(replies, shuffled)
    assert score.total == len(fees)
    assert score.kept == 0


def test_anonymous_fee_lines_keep_no_figure_and_named_ones_all() -> None:
    anonymous = "\n".join(f"an ongoing fee of {fee}% per year and no entry"
                          for fee in FUNDS.values())
    assert attribution(FEES_EN, anonymous) == Score(0, len(FUNDS))
    named = "\n".join(f"{fund}: ongoing fee {fee}% a year" for fund, fee in FUNDS.items())
    assert attribution(FEES_EN, named) == Score(len(FUNDS), len(FUNDS))


def test_anonymous_chinese_fee_lines_keep_no_figure_and_named_ones_all() -> None:
    anonymous = "\n".join(f"管理费为每年 {fee}%" for fee in FUNDS_ZH.values())
    assert attribution(FEES_ZH, anonymous) == Score(0, len(FUNDS_ZH))
    named = "\n".join(f"{fund}：管理费 {fee}%" for fund, fee in FUNDS_ZH.items())
    assert attribution(FEES_ZH, named) == Score(len(FUNDS_ZH), len(FUNDS_ZH))


def test_one_line_naming_two_funds_gives_each_its_own_figure() -> None:
    summary = ("Lotus Asia Growth 0.29% a year, Northwind Global Equity 0.43% a year.\n"
               "Harbor Bond Index: ongoing fee 0.50%, Cedar Dividend: ongoing fee 0.64%, "
               "Maple Income: ongoing fee 0.18%.")
    assert attribution(FEES_EN, summary).ratio == 1.0
    # A fund and a bare figure hold under half the question's weight: 0.64% of what?
    assert attribution(FEES_EN, "Cedar Dividend 0.64%.") == Score(0, len(FUNDS))
    # Two funds named, the figures swapped: the nearest figure is the wrong one.
    swapped = "Lotus Asia Growth fee 0.43% a year, Northwind Global Equity fee 0.29% a year."
    found = {q.expected: q.answer for q in questions(FEES_EN, swapped) if q.kind == "figure"}
    assert found["0.29"] == "0.43"
    assert found["0.43"] == "0.29"


def test_questions_the_replies_cannot_answer_are_left_out() -> None:
    # Two replies ask the same question with different answers: neither counts.
    replies = ["The default is 10MB.", "The default is 64MB.",
               "Harbor Bond Index charges 0.50% a year."]
    found = questions(replies, "\n".join(replies))
    assert [(q.kind, q.expected) for q in found] == [("figure", "0.50")]
    assert found[0].question == f"Harbor Bond Index charges {MASK}% a year."


#: One reply listing four entries, each stating its default in a sentence of its own that
#: does not name the entry (the PostgreSQL documentation's shape).
ENTRIES: dict[str, str] = {"page_hit": "1", "page_miss": "2", "page_dirty": "20",
                           "limit": "200"}
ENTRY_REPLY = "Resource Consumption:\n\n" + "\n\n".join(
    f"- vacuum_cost_{name} (integer): The estimated cost charged for {name}. "
    f"The default value is {value}." for name, value in ENTRIES.items())


def test_an_entry_s_sentence_is_asked_under_the_entry_s_term() -> None:
    """"The default value is 2." is a statement about vacuum_cost_page_miss: four entries'
    defaults are four questions, and lines that drop the term answer none of them."""
    found = [q for q in questions([ENTRY_REPLY], ENTRY_REPLY) if q.kind == "figure"]
    assert sorted(q.expected for q in found) == sorted(ENTRIES.values())
    assert all(q.kept for q in found)
    bare = "\n".join(f"Default value is {value}." for value in ENTRIES.values())
    assert attribution([ENTRY_REPLY], bare) == Score(0, len(ENTRIES))
    # A summary line carries one entry after another, each opened by its term.
    named = "b) Resource Consumption: " + " ".join(
        f"vacuum_cost_{name}: default {value}." for name, value in ENTRIES.items())
    assert attribution([ENTRY_REPLY], named) == Score(len(ENTRIES), len(ENTRIES))


def test_a_statement_is_found_only_with_its_subject() -> None:
    """The same caveat stated of two entries is two facts: written under one entry, it
    says nothing of the other."""
    replies = ["- shared_buffers (integer): Sets the memory. This parameter can only be "
               "set at server start.\n- wal_level (enum): Sets the WAL detail. This "
               "parameter can only be set at server start."]
    assert qualifier_scope(replies, replies[0]) == Score(2, 2)
    one = "a) shared_buffers: This parameter can only be set at server start."
    assert qualifier_scope(replies, one) == Score(1, 2)
    both = one + " wal_level: This parameter can only be set at server start."
    assert qualifier_scope(replies, both) == Score(2, 2)


def test_a_figure_of_a_name_answers_no_question() -> None:
    """"PostgreSQL 15.2" in a line's lead names what the line is about: the figure it
    answers is the one its statement gives (2013), and "IPv6SendRA=" asks nothing about
    6, while a note in the lead ("since Linux 3.3") is a fact."""
    replies = ["PostgreSQL 15.2 was released on 2023-02-09; relevant entries:\n"
               "- Fix build on Microsoft Visual Studio 2013.\n"
               "- Allow libpq to accept messages exceeding 30000 bytes.",
               "IPv6SendRA=: Whether to send Router Advertisements on a link.\n"
               "gid=gid (since Linux 3.3): Specifies the group that may read it."]
    summary = ("a) PostgreSQL 15.2: Fix build on Microsoft Visual Studio 2013. Allow libpq "
               "to accept messages exceeding 30000 bytes.\nb) gid=gid (since Linux 3.3): "
               "Specifies group that may read it.")
    found = {q.expected: q.answer for q in questions(replies, summary) if q.kind == "figure"}
    assert found == {"15.2": None, "2023-02-09": None, "2013": "2013", "30000": "30000",
                     "3.3": "3.3"}


def test_a_lead_names_an_entry_when_it_looks_like_a_name() -> None:
    assert lead_terms("d) Connections and Authentication: ssl_ciphers: Only TLS 1.2.") \
        == ("ssl_ciphers",)
    assert lead_terms("- bgwriter_delay (integer): Specifies the delay.") == \
        ("bgwriter_delay (integer)",)
    assert lead_terms("UMask=: Controls the mask.") == ("UMask=",)
    for nothing in ("Valid values are currently: TLSv1, TLSv1.1.", "Understood: a horizon.",
                    "Step 1: install it.", "2026-10-09: the NAV was 10.37 USD."):
        assert lead_terms(nothing) == (), nothing


# --------------------------------------------------------------------------- qualifier scope


def test_a_nav_whose_caveat_was_dropped_fails_qualifier_scope() -> None:
    replies = [NAV_EN, *FEES_EN]
    dropped = "On 2026-10-09 the NAV of Harbor Bond Index was 10.37 USD."
    by = {q.expected: q for q in questions(replies, dropped) if q.kind == "qualifier"}
    assert not by["not"].kept
    assert by["not"].found is None
    assert by["not"].question == f"it is {MASK} the current NAV, which needs a fresh quote."
    kept = ("On 2026-10-09 the NAV of Harbor Bond Index was 10.37 USD; "
            "it is not the current NAV, which needs a fresh quote.")
    by = {q.expected: q for q in questions(replies, kept) if q.kind == "qualifier"}
    assert by["not"].kept
    # The caveat's words without the word "not" keep nothing.
    lost = "It is the current NAV, which needs a fresh quote."
    assert qualifier_scope([NAV_EN], lost) == Score(0, qualifier_scope([NAV_EN], NAV_EN).total)


def test_a_sentence_wrapped_across_lines_is_one_question() -> None:
    """A docstring's hard wrap does not cut a question in two: the question is the whole
    sentence, and the half before the wrap does not answer it."""
    wrapped = ("If you use this argument\nyou may not use the Popen constructor's stdin"
               " argument, as it will be used\ninternally.")
    (question,) = [q for q in questions([wrapped], wrapped) if q.expected == "not"]
    assert question.source == ("If you use this argument you may not use the Popen "
                               "constructor's stdin argument, as it will be used internally.")
    assert question.kept
    half = "you may not use the Popen constructor's stdin argument, as it will be used"
    # ("not" and "may"): the words the half keeps still find the question.
    assert qualifier_scope([wrapped], half) == Score(2, 2)
    other = "If you use this argument, use the Popen constructor's stdin."
    assert qualifier_scope([wrapped], other) == Score(0, 2)


def test_a_chinese_caveat_keeps_its_scope_or_not() -> None:
    dropped = {q.expected: q.kept
               for q in questions([NAV_ZH], "截至 2026-10-23，雪松红利基金单位净值 11.11")
               if q.kind == "qualifier"}
    assert dropped == {"截至": True, "不是": False}
    kept = "截至 2026-10-23，雪松红利基金单位净值 11.11，是历史净值，不是当前净值"
    assert qualifier_scope([NAV_ZH], kept) == Score(2, 2)
    # Without the fund the dated NAV answers no question, and a bare "not the current
    # NAV" holds under half of its sentence's words (which NAV is historical?).
    assert qualifier_scope([NAV_ZH], "截至 2026-10-23 单位净值 11.11。不是当前净值") == Score(0, 2)


def test_a_hedge_and_a_superlative_must_survive() -> None:
    replies = ["CPU usage is unlikely to add up to exactly 100% on a busy host.",
               "The smallest accepted key size is 512 bits."]
    kept = qualifier_scope(replies, "\n".join(replies))
    assert kept.ratio == 1.0
    cut = qualifier_scope(replies, "CPU usage adds up to 100% on a busy host.\n"
                                   "Accepted key size is 512 bits.")
    assert cut.kept < kept.kept
    lost = {q.expected for q in questions(replies, "CPU usage adds up to 100% on a busy host.\n"
                                                   "Accepted key size is 512 bits.")
            if q.kind == "qualifier" and not q.kept}
    assert {"unlikely", "smallest", "exactly"} <= lost


# --------------------------------------------------------------------------- invented


def test_labels_equal_to_reply_ids_are_not_invented_figures() -> None:
    labels = [f"a{i}" for i in range(10)]
    summary = "[a3] Lotus Asia Growth 0.29%. [a4, a7] Northwind 0.43%."
    assert invented(FEES_EN, summary, labels) == frozenset()
    assert invented(FEES_EN, summary) == {"3", "4", "7"}
    assert without_labels("[a3] x [b3] [a3, zz]", labels) == "  x [b3] [a3, zz]"
    assert invented(FEES_EN, "Lotus Asia Growth 0.30% [a3]", labels) == {"0.30"}
    assert invented(FEES_EN, "\n".join(FEES_EN), labels) == frozenset()
    # The reader reads a label as no words: "[a2]" beside a fund is not its figure 2.
    labelled = "\n".join(f"[a{i}] {fund} ongoing fee {fee}% a year"
                         for i, (fund, fee) in enumerate(FUNDS.items()))
    assert attribution(FEES_EN, labelled, labels) == Score(len(FUNDS), len(FUNDS))
    assert attribution(FEES_EN, labelled).kept < len(FUNDS)


# --------------------------------------------------------------------------- extractive-2


def test_extractive2_on_the_demo_sample_loses_what_the_fees_are_about() -> None:
    turns = sample_turns()[:10]
    pairs = [Pair(i, f"r{i}", f"u{i}", u, f"a{i}", a) for i, (u, a) in enumerate(turns)]
    outcome = Extractive2Summarizer().summarize(pairs)
    assert isinstance(outcome, Reply)
    replies = [p.assistant_content for p in pairs]
    found = questions(replies, outcome.text)
    figures_ = [q for q in found if q.kind == "figure"]
    assert figures_
    assert sum(q.kept for q in figures_) < len(figures_)
    fees = {q.expected: q.kept for q in figures_ if "ongoing fee" in q.source}
    assert fees["0.29"] is False
    assert fees["0.43"] is False
    caveat = [q for q in found if q.kind == "qualifier" and "current NAV" in q.source]
    assert caveat
    assert not any(q.kept for q in caveat)
    assert invented(replies, outcome.text) == frozenset()


# --------------------------------------------------------------------------- property


@pytest.fixture(scope="module")
def corpus_ranges() -> list[list[str]]:
    corpus = build_corpus(seed=3, conversations=6)
    return [[a for _, a in c.pairs[k : k + 10]]
            for c in corpus for k in range(0, len(c.pairs) - 29, 10)]


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_replies_summarising_themselves_score_one_on_the_corpus(
        corpus_ranges: list[list[str]], data: st.DataObject) -> None:
    replies = data.draw(st.sampled_from(corpus_ranges))
    figures_, caveats = scores(replies, "\n".join(replies))
    assert figures_.total > 0
    assert figures_.ratio == 1.0
    assert caveats.total == 0 or caveats.ratio == 1.0
    assert invented(replies, "\n".join(replies)) == frozenset()


def test_a_blob_on_one_line_asks_no_question_but_may_answer() -> None:
    blob = ", ".join(f'"key{i}": {i}' for i in range(MAX_QUESTION_WORDS))
    replies = [blob, "Harbor Bond Index charges 0.50% a year."]
    assert [q.expected for q in questions(replies, "\n".join(replies))] == ["0.50"]
    assert attribution(replies, blob).kept == 0
