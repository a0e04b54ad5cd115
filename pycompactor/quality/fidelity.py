"""Fidelity: does a summary still answer the questions its replies answer?

Counting digits that survive (pycompactor.quality.figures) cannot tell "Lotus Asia Growth charges
0.29% a year" from five lines "an ongoing fee of X% per year" that name no fund. The
measures here ask the summary the question each reply sentence answers, as a reader
would, and check the answer (docs/evaluate.md defines them in prose):

* **sentences** are pycompactor.quality.qualifiers' `statements` (a summary line is a
  sentence too), a reply's read with its hard line wraps undone (`unwrap`); the summary's
  bracketed reply labels (`[a3]`, the replies' ids) are read as no words;
* **words** of a sentence: its figures (contract §8), its other words lowercased minus a
  few English stopwords, and for Chinese text every character and every pair of adjacent
  characters (a reader matches Chinese without word boundaries); plus the words of its
  **subject**, the term the entry it belongs to opens with: a sentence that opens with a
  term that looks like a name and a colon ("- vacuum_cost_page_miss (integer): …",
  "b) Resource Consumption: ssl_ciphers: …") names what the sentences after it on its
  line are about, so "The default value is 2." there asks about vacuum_cost_page_miss's
  default, and only a sentence holding a word of that subject answers it;
* a **question** is a reply sentence with one thing masked: a figure (attribution) or a
  qualifier of the scope set (qualifier scope). Each of its words weighs its rarity among
  the reply sentences, `ln(1 + N / df)`, so "Northwind" decides and "fee" barely counts;
* the **reader** scores every candidate sentence by the weight of the question's words it
  holds, and keeps the best (ties included) when it holds at least `MIN_SHARE` of the
  question's weight. For a figure it reads the answer from the best sentences: the
  figures a sentence offers are those the question does not already name; with several,
  each matched word votes with its weight for the offered figure nearest to it (one of
  its own clause first), and the most voted wins. The answer is that figure when every
  best sentence gives the same one, and none otherwise (five equally good lines with
  five different figures answer nothing);
* a question **counts** only when the reader, given the reply sentences themselves, finds
  the right answer: the replies summarising themselves score 1.0 by construction;
* **invented** figures are the summary's figures no reply holds (contract §8).

`attribution`, `qualifier_scope` and `scores` count; `questions` lists every question
with the summary sentence the reader found (the evaluation's worst-range listing). Pure
functions over strings: no database, no clock (the questions a range's replies ask are
remembered, since an evaluation reads the same replies once per model and target).
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

from pycompactor.quality.figures import FIGURE, figures
from pycompactor.quality.qualifiers import qualifier_spans, statements, unwrap

#: The share of a question's weight the best sentence must hold for the reader to take it
#: as the place that answers the question: below half, it shares fewer of the question's
#: (rarity-weighted) words than it misses, and answers another question.
MIN_SHARE: Final = 0.5

#: A reply "sentence" of more words than this (a table, a log or a JSON blob on one line)
#: states no fact a reader asks about as one question: it asks none, though it may still
#: answer. The bound also keeps the reader linear on hostile input.
MAX_QUESTION_WORDS: Final = 400

#: Function words that say nothing about what a figure is (never a qualifier: "no",
#: "not", "only", "as of" must stay words of a question).
STOPWORDS_EN: Final = frozenset({
    "a", "an", "the", "of", "to", "in", "on", "at", "for", "by", "with", "and", "or",
    "is", "are", "was", "were", "be", "been", "being", "it", "its", "this", "that",
    "these", "those", "as", "from", "per", "which", "who", "there", "their", "then",
    "so", "if", "into", "than", "can", "will", "would", "has", "have", "had", "do",
    "does", "did", "you", "your", "we", "our", "i", "s",
})
#: Chinese particles that join words without telling what they are.
STOPWORDS_ZH: Final = frozenset({"的", "了", "是", "在", "和", "与", "及", "为", "这", "其"})

#: What stands for the masked figure or qualifier in a question as shown to people.
MASK: Final = "▢"

_CJK: Final = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_TOKEN: Final = re.compile(
    rf"(?P<fig>{FIGURE.pattern})"
    rf"|(?P<cjk>[{_CJK}]+)"
    rf"|(?P<word>(?:(?![{_CJK}])[^\W\d_])+(?:'(?:(?![{_CJK}])[^\W\d_])+)*)"
)
_CLAUSE_END: Final = re.compile(r",(?=\s)|[;，；、]")
_LINES: Final = re.compile(r"[\n\r]+")
# A sentence's lead: after a list marker or a summary's reply label, one or more terms of
# at most four words, each followed by a colon ("- vacuum_cost_page_miss (integer): …",
# "d) Connections and Authentication: ssl_ciphers: …"). A term names an entry when it looks
# like a name (a letter, and a mark or an inner capital), so "Understood: a 10-year
# horizon", "Valid values are currently: …", "Step 1:" and a date name nothing.
_MARKER: Final = re.compile(r"(?:[-*•]\s+|・\s*|[a-j]\)\s+)?")
_TERM: Final = re.compile(r"([^\s:：]{1,60}(?: [^\s:：]{1,30}){0,3})[:：]\s")
_NAME_LIKE: Final = re.compile(r"[=._/()\[\]<>\-]|[a-z][A-Z]")
_LETTER: Final = re.compile(r"[^\W\d_]")
_NOTE: Final = re.compile(r"\([^()]*\)")
_LABEL: Final = re.compile(r"\[([^\[\]]*)\]")
_LABEL_SEP: Final = re.compile(r"\s*,\s*")
# Scores within this of the best tie: sums of the same floats in another order.
_EPSILON: Final = 1e-9


@dataclass(frozen=True, slots=True)
class Score:
    """How many of the questions the replies answer the summary still answers."""

    kept: int
    total: int

    @property
    def ratio(self) -> float | None:
        """kept / total, or None when the replies answer no such question."""
        return self.kept / self.total if self.total else None


# --------------------------------------------------------------------------- words


@dataclass(frozen=True, slots=True)
class _Token:
    text: str
    start: int
    figure: bool


def _tokens(sentence: str) -> list[_Token]:
    """The words of a sentence with their offsets (see the module docstring)."""
    out: list[_Token] = []
    for m in _TOKEN.finditer(sentence):
        kind = m.lastgroup
        if kind == "fig":
            out.append(_Token(m.group(0), m.start(), True))
        elif kind == "cjk":
            run, at = m.group(0), m.start()
            for i, char in enumerate(run):
                if char not in STOPWORDS_ZH:
                    out.append(_Token(char, at + i, False))
                if i + 1 < len(run):
                    out.append(_Token(run[i : i + 2], at + i, False))
        else:
            word = m.group(0).lower().removesuffix("'s")
            if word not in STOPWORDS_EN:
                out.append(_Token(word, m.start(), False))
    return out


def words(sentence: str) -> frozenset[str]:
    """The distinct words of a sentence, as the reader matches them."""
    return frozenset(t.text for t in _tokens(sentence))


@dataclass(frozen=True, slots=True)
class _Sentence:
    text: str
    tokens: tuple[_Token, ...]
    #: Its own words and its subject's (`context`).
    words: frozenset[str]
    figures: frozenset[str]
    qualifiers: frozenset[str]
    #: The words of the term its line's entry opened with (`_subjects`).
    context: frozenset[str]


def _sentence(text: str, context: frozenset[str] = frozenset(), lead_end: int = 0) -> _Sentence:
    """A sentence read under `context`. A figure of its lead (before `lead_end`) is part
    of a name ("d) PostgreSQL 15.2: Fix build on Visual Studio 2013.", "IPv6SendRA=: …")
    and answers no question, though it stays a word; one in a parenthesis of the lead
    ("gid=gid (since Linux 3.3): …") is a fact like any other."""
    tokens = tuple(_tokens(text))
    own = frozenset(t.text for t in tokens)
    noted = [m.span() for m in _NOTE.finditer(text, 0, lead_end)] if lead_end else []
    return _Sentence(text, tokens, own | context,
                     frozenset(t.text for t in tokens if t.figure and (
                         t.start >= lead_end or any(a < t.start < b for a, b in noted))),
                     frozenset(q for _, _, q in qualifier_spans(text)), context)


def _subjects(text: str) -> Iterator[_Sentence]:
    """The sentences of a text, each with the term of the entry it belongs to: a
    sentence that opens with a term that looks like a name and a colon ("-
    vacuum_cost_page_miss (integer): The estimated cost …", "UMask=: …", "b) Resource
    Consumption: ssl_ciphers: …") names what the sentences after it on its line are
    about, until the next such sentence, so "The default value is 2." is read as a
    statement about vacuum_cost_page_miss, as a reader of the line reads it, and five
    "default value" sentences of five entries are five different questions."""
    for line in _LINES.split(text):
        context: frozenset[str] = frozenset()
        for s in statements(line):
            named, lead_end = _lead(s)
            if named:
                context = frozenset().union(*map(words, named))
            yield _sentence(s, context, lead_end)


def lead_terms(sentence: str) -> tuple[str, ...]:
    """The terms a sentence opens with that name an entry, in order: "ssl_ciphers" of
    "d) Connections and Authentication: ssl_ciphers: Only …" (see `_subjects`)."""
    return _lead(sentence)[0]


def _lead(sentence: str) -> tuple[tuple[str, ...], int]:
    """lead_terms, and where the last of them ends (0 without one)."""
    marker = _MARKER.match(sentence)
    at = marker.end() if marker else 0
    found, end = [], 0
    while (term := _TERM.match(sentence, at)) is not None:
        if _NAME_LIKE.search(term.group(1)) and _LETTER.search(term.group(1)):
            found.append(term.group(1))
            end = term.end(1)
        at = term.end()
    return tuple(found), end


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Sentences a reader looks through, indexed by word (a question scores only the
    sentences that share a word with it)."""

    sentences: tuple[_Sentence, ...]
    by_word: Mapping[str, tuple[int, ...]]


def _candidates(texts: Iterable[str]) -> _Candidates:
    found = tuple(s for text in texts for s in _subjects(text))
    index: dict[str, list[int]] = {}
    for i, s in enumerate(found):
        for w in s.words:
            index.setdefault(w, []).append(i)
    return _Candidates(found, {w: tuple(ids) for w, ids in index.items()})


def _weights(source: _Candidates) -> dict[str, float]:
    """Each word's rarity among the reply sentences: ln(1 + N / df)."""
    n = len(source.sentences)
    return {w: math.log1p(n / len(ids)) for w, ids in source.by_word.items()}


# --------------------------------------------------------------------------- the reader


@dataclass(frozen=True, slots=True)
class _Question:
    words: frozenset[str]
    weight: float
    #: The words of its sentence's subject: a sentence that answers it must hold one of
    #: them (a fact is found with its subject).
    subject: frozenset[str] = frozenset()


def _best(question: _Question, candidates: _Candidates, weights: Mapping[str, float],
          keep: Callable[[_Sentence], bool]) -> list[_Sentence]:
    """The candidates (those `keep` accepts) that score best for the question, if they
    hold MIN_SHARE of its weight; in text order."""
    scores: dict[int, float] = {}
    for w in sorted(question.words):
        for i in candidates.by_word.get(w, ()):
            scores[i] = scores.get(i, 0.0) + weights[w]
    subject = question.subject
    scored = [(i, v) for i, v in scores.items() if keep(candidates.sentences[i])
              and (not subject or not subject.isdisjoint(candidates.sentences[i].words))]
    if question.weight <= 0 or not scored:
        return []
    top = max(v for _, v in scored)
    if top + _EPSILON < MIN_SHARE * question.weight:
        return []
    return [candidates.sentences[i] for i, v in sorted(scored) if v >= top - _EPSILON]


def _clauses(text: str) -> Callable[[int], int]:
    """The clause of a character offset: clauses end at a comma before a space (not the
    comma of 1,200), at `;`, and at Chinese `，；、`."""
    ends = [m.start() for m in _CLAUSE_END.finditer(text)]
    return lambda offset: bisect.bisect_right(ends, offset)


def _offered(question: _Question, sentence: _Sentence, weights: Mapping[str, float]) -> str | None:
    """The figure a sentence gives as the answer, None when it singles out none."""
    offered = sorted(sentence.figures - question.words)
    if len(offered) <= 1:
        return offered[0] if offered else None
    clause = _clauses(sentence.text)
    offered_set = set(offered)
    figure_at = sorted((t.start, t.text) for t in sentence.tokens if t.text in offered_set)
    starts = [p for p, _ in figure_at]
    occurrences: dict[str, list[int]] = {}
    for t in sentence.tokens:
        occurrences.setdefault(t.text, []).append(t.start)
    votes = dict.fromkeys(offered, 0.0)
    for w in sorted(question.words & occurrences.keys()):
        # The occurrence of the word nearest to an offered figure votes for that figure,
        # a figure of its own clause first ("A: fee 0.29%, B: fee 0.43%"); a word as
        # near to two figures votes for neither. Clauses are intervals, so the nearest
        # figure of any occurrence is its neighbour on the left or on the right.
        nearest: tuple[bool, int] | None = None
        winners: set[str] = set()
        for at in occurrences[w]:
            i = bisect.bisect_left(starts, at)
            for p, f in figure_at[max(i - 1, 0) : i + 1]:
                key = (clause(at) != clause(p), abs(at - p))
                if nearest is None or key < nearest:
                    nearest, winners = key, {f}
                elif key == nearest:
                    winners.add(f)
        if len(winners) == 1:
            votes[winners.pop()] += weights[w]
    top = max(votes.values())
    most = [f for f, v in votes.items() if v >= top - _EPSILON]
    return most[0] if len(most) == 1 and top > 0 else None


def _answer(question: _Question, candidates: _Candidates,
            weights: Mapping[str, float]) -> tuple[str | None, _Sentence | None]:
    """The reader's figure for a question, and the sentence it read it from: only a
    sentence offering a figure the question does not name can answer it."""
    best = _best(question, candidates, weights,
                 lambda c: not c.figures <= question.words)
    if not best:
        return None, None
    answers = {_offered(question, s, weights) for s in best}
    if len(answers) != 1:
        return None, best[0]
    return answers.pop(), best[0]


# --------------------------------------------------------------------------- questions


@dataclass(frozen=True, slots=True)
class Question:
    """One question the replies answer, and what the summary answers to it."""

    kind: Literal["figure", "qualifier"]
    #: The reply sentence with the expected figure or qualifier masked as MASK.
    question: str
    #: The figure the reader must find, or the qualifier the sentence it finds must carry.
    expected: str
    #: The reply sentence the question comes from.
    source: str
    #: The summary sentence the reader found (the first of a tie), None if none qualified.
    found: str | None
    #: For a figure, the figure the reader read (None: none, or ambiguous).
    answer: str | None
    kept: bool

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "question": self.question, "expected": self.expected,
                "source": self.source, "found": self.found, "answer": self.answer,
                "kept": self.kept}


def _masked(text: str, spans: Iterable[tuple[int, int]]) -> str:
    out, at = [], 0
    for start, end in sorted(spans):
        out.append(text[at:start])
        out.append(MASK)
        at = end
    out.append(text[at:])
    return "".join(out)


def _question(words_: Iterable[str], weights: Mapping[str, float],
              subject: frozenset[str] = frozenset()) -> _Question:
    ws = frozenset(words_)
    return _Question(ws, sum(weights[w] for w in sorted(ws)), subject & ws)


@dataclass(frozen=True, slots=True)
class _Asked:
    """A question the replies answer: what the summary is asked."""

    kind: Literal["figure", "qualifier"]
    question: _Question
    expected: str
    masked: str
    source: str


def _figures_asked(source: _Candidates, weights: Mapping[str, float]) -> Iterator[_Asked]:
    seen: set[tuple[frozenset[str], str]] = set()
    for s in source.sentences:
        if len(s.tokens) > MAX_QUESTION_WORDS:
            continue
        for f in sorted(s.figures):
            question = _question((w for w in s.words if w != f), weights, s.context)
            if (question.words, f) in seen:
                continue
            seen.add((question.words, f))
            if _answer(question, source, weights)[0] != f:
                continue  # the replies themselves do not answer it unambiguously
            spans = [(t.start, t.start + len(f)) for t in s.tokens if t.text == f]
            yield _Asked("figure", question, f, _masked(s.text, spans), s.text)


def _qualifier_found(question: _Question, candidates: _Candidates,
                     weights: Mapping[str, float], qualifier: str) -> tuple[bool, _Sentence | None]:
    """Whether the sentence(s) the reader finds carry the qualifier (all of a tie must:
    the reader cannot tell which one it is), and the first of them."""
    best = _best(question, candidates, weights, lambda c: True)
    carries = bool(best) and all(qualifier in s.qualifiers for s in best)
    return carries, (best[0] if best else None)


def _qualifiers_asked(source: _Candidates, weights: Mapping[str, float]) -> Iterator[_Asked]:
    seen: set[tuple[frozenset[str], str]] = set()
    for s in source.sentences:
        if len(s.tokens) > MAX_QUESTION_WORDS:
            continue
        spans = qualifier_spans(s.text)
        for q in sorted(s.qualifiers):
            masked = _masked(s.text, [(a, b) for a, b, q2 in spans if q2 == q])
            question = _question((w for w in words(masked.replace(MASK, " ")) | s.context
                                  if w in weights), weights, s.context)
            if (question.words, q) in seen:
                continue
            seen.add((question.words, q))
            if not _qualifier_found(question, source, weights, q)[0]:
                continue  # the replies' own best sentence for it does not carry it
            yield _Asked("qualifier", question, q, masked, s.text)


@functools.lru_cache(maxsize=256)
def _asked(replies: tuple[str, ...]) -> tuple[Mapping[str, float], tuple[_Asked, ...]]:
    """The questions the replies answer, and their words' weights. Remembered: an
    evaluation asks the same replies once per model and target (the corpus holds about
    250 target ranges)."""
    source = _candidates(unwrap(r) for r in replies)
    weights = _weights(source)
    asked = (*_figures_asked(source, weights), *_qualifiers_asked(source, weights))
    return MappingProxyType(weights), asked


def _read(asked: _Asked, summary: _Candidates, weights: Mapping[str, float]) -> Question:
    if asked.kind == "figure":
        answer, found = _answer(asked.question, summary, weights)
        kept = answer == asked.expected
    else:
        answer = None
        kept, found = _qualifier_found(asked.question, summary, weights, asked.expected)
    return Question(asked.kind, asked.masked, asked.expected, asked.source,
                    None if found is None else found.text, answer, kept)


def questions(replies: Sequence[str], summary: str,
              labels: Sequence[str] = ()) -> tuple[Question, ...]:
    """Every question the replies answer (figures first, then qualifiers, in reply
    order), each with what the reader finds in the summary. Bracketed `labels` (the
    replies' ids) are read as no words: `[a3]` names a reply, not the figure 3."""
    weights, asked = _asked(tuple(replies))
    target = _candidates([without_labels(summary, labels)])
    return tuple(_read(a, target, weights) for a in asked)


def _tally(found: Iterable[Question], kind: str) -> Score:
    mine = [q for q in found if q.kind == kind]
    return Score(sum(1 for q in mine if q.kept), len(mine))


def scores(replies: Sequence[str], summary: str,
           labels: Sequence[str] = ()) -> tuple[Score, Score]:
    """(attribution, qualifier scope) at once."""
    found = questions(replies, summary, labels)
    return _tally(found, "figure"), _tally(found, "qualifier")


def attribution(replies: Sequence[str], summary: str, labels: Sequence[str] = ()) -> Score:
    """Figures the reader still finds for the questions the replies answer."""
    return scores(replies, summary, labels)[0]


def qualifier_scope(replies: Sequence[str], summary: str,
                    labels: Sequence[str] = ()) -> Score:
    """Qualifiers the summary sentence the reader finds still carries."""
    return scores(replies, summary, labels)[1]


# --------------------------------------------------------------------------- invented


def without_labels(summary: str, labels: Iterable[str]) -> str:
    """The summary with its bracketed reply labels removed: `[a3]`, or `[a3, a4]` when
    every item is one of `labels` (other brackets stay, figures and all)."""
    known = set(labels)

    def drop(m: re.Match[str]) -> str:
        items = _LABEL_SEP.split(m.group(1).strip())
        return " " if items and all(i in known for i in items) else m.group(0)

    return _LABEL.sub(drop, summary) if known else summary


def invented(replies: Sequence[str], summary: str, labels: Sequence[str] = ()) -> frozenset[str]:
    """Figures of the summary that no reply holds (contract §8), reply labels aside."""
    held: set[str] = set()
    for reply in replies:
        held |= figures(reply)
    return frozenset(figures(without_labels(summary, labels)) - held)
