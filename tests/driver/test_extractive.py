"""`pycompactor/extractive-1`: deterministic, offline, labelled, within 6,000 characters,
and keeping every number and date of the replies whenever they fit."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycompactor.cli.sample import sample_turns
from pycompactor.models import Pair
from pycompactor.summarizers.extractive import (
    MAX_SUMMARY_CHARS,
    ExtractiveSummarizer,
    extractive_summary,
    split_sentences,
)
from pycompactor.summarizers.openai_compatible import make_summarizer
from pycompactor.summarizers.outcomes import Reply
from tests.workerkit import complete_verdict

NUMBER = re.compile(r"\d+")
ROOT = Path(__file__).resolve().parents[2]


def pairs_of(texts: list[str], ids: list[str] | None = None) -> list[Pair]:
    ids = ids or [f"a{i}" for i in range(len(texts))]
    return [Pair(i, f"r{i}", f"u{i}", f"user {i}", ids[i], text) for i, text in enumerate(texts)]


def sample_pairs(offset: int = 0) -> list[Pair]:
    turns = sample_turns(offset + 10)[offset:]
    return [
        Pair(i, f"r{i}", f"u{i}", user, f"demo/run-{i + offset:03d}/a", assistant)
        for i, (user, assistant) in enumerate(turns)
    ]


def numbers(text: str) -> set[str]:
    return set(NUMBER.findall(text))


# --- sentences -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        ("One. Two! Three? Four", ["One.", "Two!", "Three?", "Four"]),
        ("NAV was 3.5 on 2026-10-02. Fee 0.25%.", ["NAV was 3.5 on 2026-10-02.", "Fee 0.25%."]),
        (
            "管理费为0.46%。截至2026-10-23，净值为14.81！对吗？",
            ["管理费为0.46%。", "截至2026-10-23，净值为14.81！", "对吗？"],
        ),
        ("他说：“好。”然后走了。", ["他说：“好。”", "然后走了。"]),
        ("真的？！是的", ["真的？！", "是的"]),
        ("- item 1\n- item 2\n\n  spaced   out  ", ["- item 1", "- item 2", "spaced out"]),
        ('He said "yes." Then left.', ['He said "yes."', "Then left."]),
        ("\u00a0", ["\u00a0"]),  # NBSP is content (§3), not whitespace
        (" \t\n ", []),
    ],
)
def test_split_sentences(text: str, sentences: list[str]) -> None:
    assert split_sentences(text) == sentences


# --- the summary ---------------------------------------------------------------------


def test_small_input_is_kept_whole_and_labelled_in_order() -> None:
    pairs = sample_pairs(10)
    summary = extractive_summary(pairs)
    lines = summary.split("\n")
    assert [line.split(" ", 1)[0] for line in lines] == [
        f"[{p.assistant_message_id}]" for p in pairs
    ]
    for pair, line in zip(pairs, lines, strict=True):
        for sentence in split_sentences(pair.assistant_content):
            assert sentence in line
    assert "[demo/run-013/a] Harbor Bond Index 的管理费为 0.46%，托管费为 0.05%。截至" in summary


def test_summarizer_returns_a_normal_stop(conn: psycopg.Connection[Any]) -> None:
    outcome = ExtractiveSummarizer().summarize(sample_pairs())
    assert isinstance(outcome, Reply)
    assert (outcome.finish_reason, outcome.tool_call_count) == ("stop", 0)
    assert complete_verdict(conn, outcome) == "completed"


def test_figures_and_dates_go_first_when_space_is_short() -> None:
    filler = "This is ordinary commentary without any figure at all. " * 40
    texts = [f"{filler}The NAV on 2026-10-0{i} was 1{i}.25 USD. {filler}" for i in range(10)]
    assert sum(map(len, texts)) > 5 * MAX_SUMMARY_CHARS
    summary = extractive_summary(pairs_of(texts))
    assert len(summary) <= MAX_SUMMARY_CHARS
    for i in range(10):
        assert f"The NAV on 2026-10-0{i} was 1{i}.25 USD." in summary


def test_named_entities_come_before_plain_sentences() -> None:
    plain = "it was a quiet week. " * 40
    texts = [plain + f"the report from Northwind Global Equity arrived {'x' * 20}. " + plain] * 10
    summary = extractive_summary(pairs_of(texts), limit=800)
    assert summary.count("Northwind Global Equity") == 10


def test_one_giant_sentence_per_reply_still_yields_every_label_and_figure() -> None:
    texts = [
        ("word " * 3000) + f"NAV 1{i}.5 on 2026-01-0{i} " + ("more " * 3000) for i in range(10)
    ]
    summary = extractive_summary(pairs_of(texts))
    assert len(summary) <= MAX_SUMMARY_CHARS
    for i in range(10):
        assert f"[a{i}] " in summary
        assert f"NAV 1{i}.5 on 2026-01-0{i}" in summary


def test_huge_ids_cannot_break_the_limit() -> None:
    ids = [f"{i}-" + "i" * 7000 for i in range(10)]
    summary = extractive_summary(pairs_of(["Short reply 1."] * 10, ids))
    assert 0 < len(summary) <= MAX_SUMMARY_CHARS


def test_deterministic_across_processes_and_hash_seeds() -> None:
    code = (
        "import sys\n"
        "from pycompactor.models import Pair\n"
        "from pycompactor.cli.sample import sample_turns\n"
        "from pycompactor.summarizers.extractive import extractive_summary\n"
        "pairs = [Pair(i, 'r', 'u', u, f'demo/run-{i + 20:03d}/a', a)\n"
        "         for i, (u, a) in enumerate(sample_turns(30)[20:])]\n"
        "sys.stdout.write(extractive_summary(pairs))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONIOENCODING": "utf-8"},
            capture_output=True,
            check=True,
            text=True,
            encoding="utf-8",
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {extractive_summary(sample_pairs(20))}


def test_offline_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the offline summarizer touched the network")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with closing(make_summarizer("pycompactor/extractive-1")) as summarizer:
        outcome = summarizer.summarize(sample_pairs())
    assert isinstance(outcome, Reply)
    assert outcome.text


def test_wrong_pair_count_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly 10 pairs"):
        ExtractiveSummarizer().summarize(sample_pairs()[:9])


# --- properties ------------------------------------------------------------------------

_word = st.sampled_from(
    ["fund", "NAV", "Harbor", "fee", "净值", "管理费", "the", "was", "on", "基金", "horizon"]
)
_number = st.one_of(
    st.integers(0, 10**9).map(str),
    st.builds(lambda a, b: f"{a}.{b:02d}", st.integers(0, 999), st.integers(0, 99)),
    st.dates().map(lambda d: d.isoformat()),
)
_end = st.sampled_from([". ", "! ", "? ", "。", "！", "？", "\n", "; "])
_sentence = st.builds(
    lambda words, end: " ".join(words) + end,
    st.lists(st.one_of(_word, _number), min_size=1, max_size=12),
    _end,
)
_reply = st.lists(_sentence, min_size=1, max_size=8).map("".join)
_replies = st.lists(_reply, min_size=10, max_size=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_replies)
def test_everything_kept_when_it_fits(texts: list[str]) -> None:
    pairs = pairs_of(texts)
    summary = extractive_summary(pairs)
    # The budget the summary needs to hold everything: per reply a label and a newline,
    # per sentence its text and one separator.
    needed = sum(
        len(f"[a{i}]") + 1 + sum(len(s) + 1 for s in split_sentences(t))
        for i, t in enumerate(texts)
    )
    fits = needed <= MAX_SUMMARY_CHARS
    if fits:
        for pair in pairs:
            for sentence in split_sentences(pair.assistant_content):
                assert sentence in summary
        assert numbers(summary) >= numbers("\n".join(texts))
    assert summary == extractive_summary(pairs)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _replies,
    st.lists(
        st.text(alphabet="abc xyz 基金,", min_size=0, max_size=4000), min_size=10, max_size=10
    ),
)
def test_numbers_survive_bulky_replies(texts: list[str], bulk: list[str]) -> None:
    """Huge digit-free padding around the figures: every number still fits, so it stays."""
    padded = [f"{b}. {t} {b}." for t, b in zip(texts, bulk, strict=True)]
    summary = extractive_summary(pairs_of(padded))
    assert len(summary) <= MAX_SUMMARY_CHARS
    digit_sentences = [s for t in padded for s in split_sentences(t) if NUMBER.search(s)]
    if sum(len(s) + 1 for s in digit_sentences) + 10 * len("[a0] ") <= MAX_SUMMARY_CHARS:
        assert numbers(summary) >= numbers("\n".join(texts))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(min_size=1, max_size=20_000), min_size=10, max_size=10))
def test_never_over_the_limit_and_never_empty(texts: list[str]) -> None:
    texts = [t if t.strip(" \t\n\r\f\v") else t + "x" for t in texts]  # eligible content
    summary = extractive_summary(pairs_of(texts))
    assert 0 < len(summary) <= MAX_SUMMARY_CHARS
    assert summary.strip(" \t\n\r\f\v")


def test_offline_path_does_not_import_openai() -> None:
    """Workers with --model pycompactor/extractive-1 skip the openai import altogether."""
    code = (
        "import sys\n"
        "from pycompactor.summarizers.openai_compatible import make_summarizer\n"
        "make_summarizer('pycompactor/extractive-1')\n"
        "sys.exit('openai' in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
