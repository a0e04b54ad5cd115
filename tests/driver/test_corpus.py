"""The evaluation corpus (pycompactor.corpus, docs/corpus.md): real text, seeded, JSON lines."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from pycompactor.corpus import (
    MAX_REPLY_BYTES,
    MIN_REPLY_BYTES,
    POSTGRESQL_HTML,
    CorpusConversation,
    build_corpus,
    main,
    read_jsonl,
    write_jsonl,
)
from pycompactor.errors import CorpusTextMissing, UsageError
from pycompactor.quality.figures import figures
from pycompactor.quality.qualifiers import qualified_facts

_CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
def corpus() -> tuple[CorpusConversation, ...]:
    return build_corpus(seed=0)


def test_same_seed_same_corpus_other_seed_other_corpus() -> None:
    assert build_corpus(seed=7, conversations=3) == build_corpus(seed=7, conversations=3)
    assert build_corpus(seed=7, conversations=3) != build_corpus(seed=8, conversations=3)


def test_default_shape(corpus: tuple[CorpusConversation, ...]) -> None:
    assert len(corpus) == 40
    assert len({c.conversation_id for c in corpus}) == 40
    assert all(40 <= len(c.pairs) <= 120 for c in corpus)
    languages = [c.language for c in corpus]
    assert set(languages) == {"en", "zh"}
    assert 3 <= languages.count("zh") <= 8
    assert len(build_corpus(seed=0, conversations=2)) == 2


def test_replies_are_long_and_questions_short(corpus: tuple[CorpusConversation, ...]) -> None:
    replies = [a for c in corpus for _, a in c.pairs]
    sizes = [len(a.encode("utf-8")) for a in replies]
    assert min(sizes) >= MIN_REPLY_BYTES == 1000
    assert max(sizes) <= MAX_REPLY_BYTES == 3000
    assert 1500 <= statistics.median(sizes) <= 2600
    users = [u for c in corpus for u, _ in c.pairs]
    assert max(len(u) for u in users) <= 160
    assert statistics.median(len(u) for u in users) <= 90
    # Real text, not one item repeated: most replies are distinct.
    assert len(set(replies)) >= 0.6 * len(replies)


def test_chinese_conversations_are_chinese(corpus: tuple[CorpusConversation, ...]) -> None:
    for c in corpus:
        cjk = sum(len(_CJK.findall(a)) for _, a in c.pairs)
        if c.language == "zh":
            assert all(_CJK.search(u) for u, _ in c.pairs)
            assert cjk >= 200 * len(c.pairs)
        else:
            assert cjk == 0


def test_figures_qualifiers_and_corrections(corpus: tuple[CorpusConversation, ...]) -> None:
    english = [a for c in corpus if c.language == "en" for _, a in c.pairs]
    assert sum(bool(figures(a)) for a in english) >= 0.9 * len(english)
    assert sum(bool(qualified_facts(a)) for a in english) >= 0.3 * len(english)
    for phrase in ("no longer", "instead", "only", "except", "not "):
        assert sum(phrase in a for a in english) >= 20, phrase
    # Release numbers, dates and CVE numbers of the release notes.
    text = "\n".join(english)
    assert re.search(r"\b15\.1[0-9]\b", text)
    assert re.search(r"\b20[2-9][0-9]-[01][0-9]-[0-3][0-9]\b", text)
    assert "CVE-20" in text
    corrections = [a for a in english if a.startswith("Correction:")]
    assert len(corrections) >= 0.02 * len(english)
    zh = "\n".join(a for c in corpus if c.language == "zh" for _, a in c.pairs)
    assert any(q in zh for q in ("不", "只", "仅", "没有"))


def test_clipping_never_splits_a_figure(corpus: tuple[CorpusConversation, ...]) -> None:
    """A reply clipped to its size keeps "Table 9.91" and "Section 20.5.1" whole: split at
    every full stop they came back as "9. 91", figures the source never gave."""
    english = "\n".join(a for c in corpus if c.language == "en" for _, a in c.pairs)
    assert re.search(r"\b(?:Section|Table|Chapter) \d+\. \d", english) is None
    assert re.search(r"\bSection \d+\.\d+", english)


def test_a_correction_corrects_what_an_earlier_reply_said(
        corpus: tuple[CorpusConversation, ...]) -> None:
    head = re.compile(r"Correction: I listed these entries under PostgreSQL (15\.\d+), released "
                      r"(\d{4}-\d\d-\d\d); that is incorrect\. They are from (15\.\d+), "
                      r"released (\d{4}-\d\d-\d\d), not (15\.\d+)\.\n\n- ([^\n]{1,40})")
    seen = 0
    for c in corpus:
        for n, (_, reply) in enumerate(c.pairs):
            if not reply.startswith("Correction:"):
                continue
            match = head.match(reply)
            assert match, reply[:300]
            wrong, wrong_date, right, right_date, again, entry = match.groups()
            assert wrong == again != right
            assert abs(int(wrong.split(".")[1]) - int(right.split(".")[1])) == 1
            # The wrong release is named, with its own date, by an earlier reply that
            # lists the entry: the stale claim the correction retracts.
            assert any(a.startswith(f"PostgreSQL {wrong} was released on {wrong_date};")
                       and entry in a for _, a in c.pairs[:n])
            # Both dates are the release notes' own.
            for release, date in ((right, right_date), (wrong, wrong_date)):
                page = POSTGRESQL_HTML / f"release-{release.replace('.', '-')}.html"
                assert re.search(rf"Release date:\s*</strong>\s*{date}", page.read_text())
            seen += 1
    assert seen >= 50


def test_jsonl_round_trip(tmp_path: Path) -> None:
    corpus = build_corpus(seed=3, conversations=4)
    path = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 4
    first = json.loads(lines[0])
    assert list(first) == ["conversation_id", "language", "pairs"]
    assert list(first["pairs"][0]) == ["user", "assistant"]
    assert read_jsonl(path) == corpus


def test_module_writes_the_corpus(tmp_path: Path) -> None:
    out = tmp_path / "c.jsonl"
    assert main(["--seed", "0", "--conversations", "3", "--out", str(out)]) == 0
    assert read_jsonl(out) == build_corpus(seed=0, conversations=3)


def test_missing_text_names_the_package(tmp_path: Path) -> None:
    with pytest.raises(CorpusTextMissing, match="apt-get install postgresql-doc-15"):
        build_corpus(conversations=1, postgresql_html=tmp_path)
    with pytest.raises(CorpusTextMissing, match="apt-get install manpages-zh"):
        build_corpus(conversations=1, zh_man=tmp_path)
    assert issubclass(CorpusTextMissing, UsageError)
