"""Naive whole-sentence selection (pycompactor.summarizers.baseline): the bench's and evaluate's
baseline. Whole reply sentences, most facts per byte first, within the byte target."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycompactor.corpus import build_corpus
from pycompactor.evaluation import EvalPair, reply_problem
from pycompactor.quality.fidelity import attribution
from pycompactor.quality.qualifiers import statements, unwrap
from pycompactor.summarizers.baseline import (
    BASELINE_CAVEATS_MODEL,
    BASELINE_MODEL,
    BaselineSummarizer,
    select,
)

REPLIES = [
    "Lotus Asia Growth charges 0.29% a year. Background prose that states nothing else.",
    "It is not the current NAV. Northwind Global Equity charges 0.43% a year.",
]


def size(text: str) -> int:
    return len(text.encode("utf-8"))


def test_whole_sentences_with_a_fact_in_reply_order() -> None:
    summary = select(REPLIES, 1.0)
    assert summary.split("\n") == [
        "Lotus Asia Growth charges 0.29% a year.", "It is not the current NAV.",
        "Northwind Global Equity charges 0.43% a year."]
    assert attribution(REPLIES, summary).ratio == 1.0


def test_most_facts_per_byte_first_within_the_target() -> None:
    budget = size("Lotus Asia Growth charges 0.29% a year.") / sum(map(size, REPLIES))
    # Room for one sentence: the one with most facts per byte ("not": 1 fact in 26 bytes).
    assert select(REPLIES, budget) == "It is not the current NAV."
    assert select(REPLIES, 0.01) == ""
    with pytest.raises(ValueError, match="target"):
        select(REPLIES, 0.0)


def test_caveats_first() -> None:
    figures = "Fees 0.29%, 0.43% and 0.50% a year."
    caveat = "It is not the current NAV of the Lotus Asia Growth fund."
    replies = [figures, caveat]
    budget = size(caveat) / sum(map(size, replies))  # room for one of the two
    assert select(replies, budget) == figures  # three facts in fewer bytes
    assert select(replies, budget, caveats_first=True) == caveat


def test_as_a_summarizer() -> None:
    pairs = [EvalPair(i, f"u{i}", "q", f"a{i}", r) for i, r in enumerate(REPLIES * 5)]
    summarizer = BaselineSummarizer(0.5)
    assert summarizer.model == BASELINE_MODEL
    assert BaselineSummarizer(0.5, caveats_first=True).model == BASELINE_CAVEATS_MODEL
    outcome = summarizer.summarize(pairs)
    assert reply_problem(outcome) is None
    summarizer.close()


@pytest.fixture(scope="module")
def corpus_ranges() -> list[list[str]]:
    corpus = build_corpus(seed=5, conversations=4)
    return [[a for _, a in c.pairs[k : k + 10]]
            for c in corpus for k in range(0, len(c.pairs) - 29, 10)]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), target=st.sampled_from([0.05, 0.2, 0.35, 0.6]),
       caveats_first=st.booleans())
def test_within_target_whole_sentences_deterministic(
        corpus_ranges: list[list[str]], data: st.DataObject, target: float,
        caveats_first: bool) -> None:
    replies = data.draw(st.sampled_from(corpus_ranges))
    summary = select(replies, target, caveats_first=caveats_first)
    assert summary == select(replies, target, caveats_first=caveats_first)
    assert size(summary) <= target * sum(map(size, replies))
    assert len(summary) <= 6000
    whole = {s for r in replies for s in statements(unwrap(r))}
    assert all(line in whole for line in summary.split("\n") if summary)
