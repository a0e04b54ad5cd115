"""A corpus of realistic agent conversations, built from public text no one here wrote.

The evaluation (`pycompactor evaluate --corpus`), the benchmarks and the summarizer's
goal tests need conversations whose replies look like a research agent's: long, dense
with versions, dates, CVE numbers and defaults, full of qualifiers ("no longer", "only",
"except", "instead", "not"), sometimes correcting an earlier reply. Text the team wrote
would fit whatever the summarizer does well, so the text comes from two Debian packages
(docs/corpus.md has their versions, licences and the recipe):

- `postgresql-doc-15`: the PostgreSQL 15 release notes (every minor release, its date, its
  fixes and CVEs) and the server configuration chapter (each parameter, its default and
  limits), as HTML;
- `manpages-zh`: the Chinese manual pages, for the Chinese conversations.

The recipe mimics an agent answering about one release or one topic at a time: a short
user question made from an item's title, and a 1-3 KB reply that composes several items
of that release or topic, verbatim, after a one-line lead naming the release and its date.
Now and then a reply corrects an earlier one, restating the source's own fact with the
release it belongs to. Everything random comes from one `random.Random(seed)`, and files
are read in sorted order, so a seed gives the same corpus for the same package versions.

`python -m pycompactor.corpus --seed 0 --out corpus.jsonl` writes it as JSON lines.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import html
import json
import random
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from pycompactor.errors import CorpusTextMissing

#: Where the two Debian packages put the text (their `dpkg -L`).
POSTGRESQL_DOC_PACKAGE: Final = "postgresql-doc-15"
POSTGRESQL_HTML: Final = Path("/usr/share/doc/postgresql-doc-15/html")
ZH_MAN_PACKAGE: Final = "manpages-zh"
ZH_MAN: Final = Path("/usr/share/man/zh_CN")

DEFAULT_CONVERSATIONS: Final = 40
#: Every this many conversations, one is Chinese (4 of the default 40).
ZH_EVERY: Final = 10
MIN_PAIRS: Final = 40
MAX_PAIRS: Final = 120
#: Reply sizes in UTF-8 bytes, as long as a research agent's replies.
MIN_REPLY_BYTES: Final = 1000
MAX_REPLY_BYTES: Final = 3000
#: Share of replies (after the first few) that correct an earlier reply.
CORRECTION_RATE: Final = 0.06


@dataclass(frozen=True, slots=True)
class CorpusConversation:
    """One conversation of the corpus: (user message, assistant reply) pairs, oldest first."""

    conversation_id: str
    language: str  # "en" or "zh"
    pairs: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class _Item:
    """One unit of source text: a release-note entry, a parameter, a man-page section."""

    title: str  # what a user would ask about
    body: str  # the text a reply quotes


@dataclass(frozen=True, slots=True)
class _Group:
    """Items about one release or one topic, and the lead line a reply about it opens with."""

    lead: str
    subject: str  # "PostgreSQL 15.10", "the Memory settings", "tar"
    items: tuple[_Item, ...]
    release: str | None = None  # "15.10": release groups, which corrections cite
    date: str | None = None
    kind: str = "release"  # release, config, manual or man: how users ask about it


# --- reading the PostgreSQL HTML ----------------------------------------------------------

_TAG: Final = re.compile(r"<[^>]+>")
_WS: Final = re.compile(r"\s+")
_COMMIT_LINK: Final = re.compile(r'<a class="ulink" href="https://postgr\.es/c/[^"]*"[^>]*>§</a>')
# "(Tom Lane, Noah Misch)" ending an entry's title: the authors, which no reply repeats.
_AUTHORS: Final = re.compile(r"\s*\((?:[^()0-9]|\([^()]*\))*\)\s*$")
_PARAGRAPH: Final = re.compile(r"<p>(.*?)</p>", re.DOTALL)
_RELEASE_TITLE: Final = re.compile(r'<h2 class="title"[^>]*>E\.\d+\.\s*Release\s+([0-9.]+)</h2>')
_RELEASE_DATE: Final = re.compile(r"Release date:\s*</strong>\s*([0-9-]+)")
_GUC: Final = re.compile(
    r'<dt id="GUC-[^"]*"><span class="term">(.*?)</span></dt><dd>(.*?)</dd>', re.DOTALL
)
_CHAPTER_TITLE: Final = re.compile(r'<h2 class="title"[^>]*>[0-9.]+\s+([^<]+)</h2>')


def _text(fragment: str) -> str:
    return _WS.sub(" ", html.unescape(_TAG.sub("", fragment))).strip()


def _paragraphs(fragment: str) -> list[str]:
    return [t for t in (_text(p) for p in _PARAGRAPH.findall(fragment)) if t]


def _release_groups(page: str) -> list[_Group]:
    title = _RELEASE_TITLE.search(page)
    date = _RELEASE_DATE.search(page)
    if title is None or date is None:
        return []
    release, released = title.group(1), date.group(1)
    page = _COMMIT_LINK.sub("", page)
    items: list[_Item] = []
    # After the release date: the first "Migration to Version" is the page's contents.
    migration = page.find("Migration to Version", date.end())
    changes = page.find('<div class="itemizedlist">', migration)
    if migration >= 0 and changes > migration:
        text = " ".join(_paragraphs(page[migration:changes]))
        if text:
            items.append(_Item(f"upgrading to {release}", text))
    # Entries nest in the major release's notes: each <li> keeps its text up to the next
    # <li> or </li>, so a nested list's parent and children are separate entries.
    for chunk in page.split('<li class="listitem">')[1:]:
        chunk = re.split(r"</li>|<ul", chunk, maxsplit=1)[0]
        paragraphs = _paragraphs(chunk)
        if not paragraphs:
            continue
        head = _AUTHORS.sub("", paragraphs[0]).rstrip(" .")
        if len(head) < 12:
            continue
        body = " ".join([head + ".", *paragraphs[1:]])
        items.append(_Item(head, body))
    if not items:
        return []
    major = "." not in release
    lead = (f"PostgreSQL {release} was released on {released}; "
            + ("its release notes say:" if major else "the relevant entries of its notes:"))
    return [_Group(lead, f"PostgreSQL {release}", tuple(items), release, released)]


def _config_groups(page: str) -> list[_Group]:
    chapter = _CHAPTER_TITLE.search(page)
    items = []
    for term, description in _GUC.findall(_COMMIT_LINK.sub("", page)):
        name = _text(term)
        body = " ".join(_paragraphs(description))
        if body:
            items.append(_Item(name.split(" (")[0], f"{name}: {body}"))
    if not items:
        return []
    topic = _text(chapter.group(1)) if chapter else "server configuration"
    lead = f"From the PostgreSQL 15 documentation, {topic}:"
    return [_Group(lead, f"the {topic} settings", tuple(items), kind="config")]


_SECTION_TITLE: Final = re.compile(r'<h[234] class="title"[^>]*>(?:[0-9.]+\s+)?([^<]+)</h[234]>')
#: Manual chapters an agent quotes for operational questions: sizes, limits, intervals.
_CHAPTERS: Final = ("wal-*.html", "routine-*.html", "kernel-resources.html", "storage-*.html",
                    "datatype-*.html", "hot-standby.html", "warm-standby.html",
                    "upgrading.html", "limits.html", "monitoring-stats.html")

_ADMONITIONS: Final = frozenset({"Note", "Tip", "Warning", "Caution", "Important"})


def _chapter_groups(page: str) -> list[_Group]:
    """One group per manual page: its paragraphs, each titled by its section's heading."""
    headings = list(_SECTION_TITLE.finditer(page))
    items: list[_Item] = []
    topic = title = ""
    for n, heading in enumerate(headings):
        end = headings[n + 1].start() if n + 1 < len(headings) else len(page)
        # A note or tip box belongs to the section around it.
        if _text(heading.group(1)) not in _ADMONITIONS:
            title = _text(heading.group(1))
            topic = topic or title
        items += [_Item(title, p) for p in _paragraphs(page[heading.end():end])
                  if len(p) >= 80 and not p.endswith(":")]  # no lead-in to a code block
    if not items or not topic:
        return []
    return [_Group(f"From the PostgreSQL 15 documentation, {topic}:", topic, tuple(items),
                   kind="manual")]


# The parsed sources, once per process: every seed reads the same text.
@functools.lru_cache(maxsize=4)
def _postgresql_groups(root: Path) -> tuple[_Group, ...]:
    releases = sorted(root.glob("release-15*.html"))
    configs = sorted(root.glob("runtime-config-*.html"))
    if not releases or not configs:
        raise CorpusTextMissing(
            f"the corpus needs the PostgreSQL release notes in {root}: install the Debian "
            f"package {POSTGRESQL_DOC_PACKAGE} (apt-get install {POSTGRESQL_DOC_PACKAGE})"
        )
    groups: list[_Group] = []
    for path in releases:
        groups += _release_groups(path.read_text(encoding="utf-8"))
    for path in configs:
        groups += _config_groups(path.read_text(encoding="utf-8"))
    for path in sorted({p for pattern in _CHAPTERS for p in root.glob(pattern)}):
        groups += _chapter_groups(path.read_text(encoding="utf-8"))
    return tuple(groups)


# --- reading the Chinese manual pages ---------------------------------------------------

_ROFF_ESCAPES: Final = re.compile(r"\\f(?:\(..|\[[^]]*\]|.)|\\\(..|\\[&|^%]|\\\*\(..|\\\*.")
_ROFF_TEXT_MACROS: Final = frozenset(
    {"B", "I", "BR", "RB", "IR", "RI", "BI", "IB", "SM", "SB", "TP", "IP", "HP", "TQ"}
)
_ROFF_BREAKS: Final = frozenset({"PP", "LP", "P", "IP", "TP", "HP", "sp", "br"})
_SKIPPED_SECTIONS: Final = ("总览", "概述", "SYNOPSIS", "名字", "名称", "NAME", "作者",
                            "AUTHOR", "参见", "另见", "SEE ALSO", "版权", "COPYRIGHT", "跋",
                            "[中文版维护人]", "[中文版最新更新]",
                            "《中国Linux论坛man手册页翻译计划》")
_CJK: Final = re.compile(r"[\u4e00-\u9fff]")


def _roff_line(line: str) -> str:
    line = line.replace("\\-", "-").replace("\\e", "\\").replace('\\"', "")
    return _ROFF_ESCAPES.sub("", line).replace("\\", "")


def _man_sections(source: str) -> list[tuple[str, str]]:
    """(section title, text) of a man page, paragraphs joined by newlines."""
    sections: list[tuple[str, str]] = []
    title: str | None = None
    paragraphs: list[str] = []
    current: list[str] = []

    def flush_paragraph() -> None:
        if current:
            paragraphs.append(_WS.sub(" ", " ".join(current)).strip())
            current.clear()

    def flush_section() -> None:
        flush_paragraph()
        if title is not None:
            text = "\n".join(p for p in paragraphs if p)
            if text:
                sections.append((title, text))
        paragraphs.clear()

    for raw in source.splitlines():
        if raw.startswith(("'", ".\\\"", '.\\"')):
            continue
        if raw.startswith("."):
            macro, _, rest = raw[1:].partition(" ")
            if macro in ("SH", "SS"):
                flush_section()
                title = _roff_line(rest).strip().strip('"').strip()
                continue
            if macro in _ROFF_BREAKS:
                flush_paragraph()
            if macro in _ROFF_TEXT_MACROS and rest.strip():
                current.append(_roff_line(rest).replace('"', "").strip())
            continue
        text = _roff_line(raw).strip()
        if text:
            current.append(text)
        else:
            flush_paragraph()
    flush_section()
    return sections


@functools.lru_cache(maxsize=4)
def _zh_groups(root: Path) -> tuple[_Group, ...]:
    pages = sorted(root.glob("man[1-8]/*.gz"))
    if not pages:
        raise CorpusTextMissing(
            f"the corpus needs the Chinese manual pages in {root}: install the Debian "
            f"package {ZH_MAN_PACKAGE} (apt-get install {ZH_MAN_PACKAGE})"
        )
    groups: list[_Group] = []
    for path in pages:
        command = path.name.split(".")[0]
        source = gzip.decompress(path.read_bytes()).decode("utf-8", errors="ignore")
        items = [
            _Item(f"{command} 的{title}", text)
            for title, text in _man_sections(source)
            if title not in _SKIPPED_SECTIONS and len(_CJK.findall(text)) >= 20
        ]
        if sum(len(i.body.encode()) for i in items) >= 3 * MIN_REPLY_BYTES:
            groups.append(_Group(f"关于 {command}，手册页是这样说的：", command, tuple(items),
                                 kind="man"))
    return tuple(groups)


# --- composing conversations --------------------------------------------------------------

_EN_QUESTIONS: Final = (
    "What changed in {subject} about {title}?",
    "Does {subject} fix {title}?",
    "Can you summarize {subject}, starting with {title}?",
    "Anything I should know in {subject}? I care about {title}.",
    "Which entries of {subject} matter for us, e.g. {title}?",
    "And {title}?",
    "What about {title}?",
)
_EN_CONFIG_QUESTIONS: Final = (
    "What does {title} do, and what is its default?",
    "Should we change {title}?",
    "Explain {title} and the related settings.",
    "What are the limits of {title}?",
)
_EN_MANUAL_QUESTIONS: Final = (
    "How does {title} work?",
    "Tell me about {title}.",
    "What should I know about {title}?",
    "Any limits or caveats with {title}?",
)
_ZH_QUESTIONS: Final = (
    "{title}是什么？",
    "能讲讲{title}吗？",
    "{title}有什么要注意的？",
    "再说说{title}。",
)


def _clip(text: str, limit: int) -> str:
    """The longest run of whole sentences of text within limit UTF-8 bytes (or "")."""
    if len(text.encode()) <= limit:
        return text
    out = ""
    # A full stop ends a sentence only before whitespace: "Table 9.91" and "10.37" are
    # one figure each (split there, they came back as "9. 91").
    for sentence in re.split(r"(?<=[.!?])\s+|(?<=[。！？])\s*", text):
        candidate = (out + " " + sentence).strip() if out and not out.endswith(
            tuple("。！？")) else out + sentence
        if len(candidate.encode()) > limit:
            break
        out = candidate
    return out


def _reply(lead: str, bodies: Sequence[str], language: str) -> str:
    bullet = "- " if language == "en" else "・"
    return lead + "\n\n" + "\n\n".join(bullet + b for b in bodies)


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _short(title: str, words: int = 9) -> str:
    split = title.split()
    return " ".join(split[:words]) + ("…" if len(split) > words else "")


class _Composer:
    """Consumes the items of one group at a time, moving to another group when done."""

    def __init__(self, rng: random.Random, groups: Sequence[_Group], language: str) -> None:
        self.rng = rng
        self.groups = groups
        self.language = language
        self.order = list(range(len(groups)))
        rng.shuffle(self.order)
        self.group_at = 0
        self.item_at = 0
        # What earlier replies stated: (group, item, index of the pair).
        self.said: list[tuple[_Group, _Item, int]] = []
        self.pairs: list[tuple[str, str]] = []
        self.dates = {g.release: g.date for g in groups if g.release and g.date}

    def _next_group(self) -> None:
        self.group_at = (self.group_at + 1) % len(self.order)
        # Conversations about one topic start at different entries of it.
        self.item_at = self.rng.randrange(max(1, len(self.group.items) // 2))

    @property
    def group(self) -> _Group:
        return self.groups[self.order[self.group_at]]

    def conversation(self, length: int) -> tuple[tuple[str, str], ...]:
        for index in range(length):
            self.pairs.append(self._pair(index))
        return tuple(self.pairs)

    def _pair(self, index: int) -> tuple[str, str]:
        if self.language == "en" and index >= 5 and self.rng.random() < CORRECTION_RATE:
            stated = [s for s in self.said if s[0].release and "." in s[0].release]
            if stated:
                correction = self._correction(*self.rng.choice(stated))
                if correction is not None:
                    return correction
        # A new topic now and then, as users change subject; else carry on with this one.
        if self.item_at >= len(self.group.items) or self.rng.random() < 0.15:
            self._next_group()
        return self._answer()

    def _answer(self) -> tuple[str, str]:
        target = self.rng.randint(MIN_REPLY_BYTES + 200, MAX_REPLY_BYTES - 100)
        group = self.group
        bodies: list[str] = []
        first: _Item | None = None
        while True:
            if self.item_at >= len(group.items):
                if _size(_reply(group.lead, bodies, self.language)) >= MIN_REPLY_BYTES:
                    break
                # Too little left of this topic for a reply: start the next one instead.
                self._next_group()
                group, bodies, first = self.group, [], None
                continue
            item = group.items[self.item_at]
            room = MAX_REPLY_BYTES - _size(_reply(group.lead, [*bodies, ""], self.language))
            body = _clip(item.body, room)
            if not body:
                if bodies:
                    break
                self.item_at += 1  # a first sentence longer than a whole reply
                continue
            self.item_at += 1
            bodies.append(body)
            self.said.append((group, item, len(self.pairs)))
            first = first or item
            if _size(_reply(group.lead, bodies, self.language)) >= target:
                break
        assert first is not None
        return self._question(group, first), _reply(group.lead, bodies, self.language)

    def _question(self, group: _Group, item: _Item) -> str:
        if self.language == "zh":
            template = self.rng.choice(_ZH_QUESTIONS)
        elif group.kind == "config":
            template = self.rng.choice(_EN_CONFIG_QUESTIONS)
        elif group.kind == "manual":
            template = self.rng.choice(_EN_MANUAL_QUESTIONS)
        else:
            template = self.rng.choice(_EN_QUESTIONS)
        return template.format(subject=group.subject, title=_short(item.title))

    def _correction(self, group: _Group, item: _Item, said_at: int) -> tuple[str, str] | None:
        """A reply correcting the release an earlier reply gave for its entries, or None.

        The earlier reply is rewritten to name the neighbouring release (and that
        release's date): the slip an agent makes when reading several notes at once. The
        correction restates the source's release and date, and the entry. None when that
        earlier reply was already rewritten or would outgrow a reply.
        """
        assert group.release is not None
        assert group.date is not None
        major, minor = group.release.split(".")
        wrong = f"{major}.{int(minor) + 1}"
        if wrong not in self.dates:
            wrong = f"{major}.{int(minor) - 1}"
        user, earlier = self.pairs[said_at]
        wrong_lead = group.lead.replace(group.release, wrong, 1).replace(
            group.date, self.dates.get(wrong, ""), 1)
        if (wrong not in self.dates or not earlier.startswith(group.lead)
                or _size(earlier) - _size(group.lead) + _size(wrong_lead) > MAX_REPLY_BYTES):
            return None
        self.pairs[said_at] = (user, wrong_lead + earlier[len(group.lead):])
        question = self.rng.choice((
            f"Wait, which release fixed {_short(item.title, 7)}?",
            f"Are you sure about {wrong}?",
            "Can you double-check that last release number?",
        ))
        head = (f"Correction: I listed these entries under PostgreSQL {wrong}, released "
                f"{self.dates[wrong]}; that is incorrect. They are from {group.release}, "
                f"released {group.date}, not {wrong}.")
        room = MAX_REPLY_BYTES - _size(head) - 4
        bodies = [_clip(item.body, room)]
        # Restate the neighbouring entries of that release, as the agent re-reads them.
        for other in group.items:
            if _size(_reply(head, bodies, "en")) >= MIN_REPLY_BYTES + 200:
                break
            if other is item:
                continue
            room = MAX_REPLY_BYTES - _size(_reply(head, [*bodies, ""], "en"))
            clipped = _clip(other.body, room)
            if clipped:
                bodies.append(clipped)
        return question, _reply(head, bodies, "en")


def build_corpus(
    *,
    seed: int = 0,
    conversations: int | None = None,
    postgresql_html: Path = POSTGRESQL_HTML,
    zh_man: Path = ZH_MAN,
) -> tuple[CorpusConversation, ...]:
    """The corpus for a seed: `conversations` conversations (default 40), one in ten Chinese.

    Raises CorpusTextMissing naming the Debian package whose text is not installed
    (`postgresql_html` and `zh_man` say where to look).
    """
    count = DEFAULT_CONVERSATIONS if conversations is None else conversations
    if count < 0:
        raise ValueError(f"conversations must be >= 0, got {count}")
    en_groups = _postgresql_groups(Path(postgresql_html))
    zh_groups = _zh_groups(Path(zh_man))
    rng = random.Random(seed)
    out: list[CorpusConversation] = []
    for n in range(count):
        language = "zh" if n % ZH_EVERY == ZH_EVERY - 1 else "en"
        composer = _Composer(rng, en_groups if language == "en" else zh_groups, language)
        pairs = composer.conversation(rng.randint(MIN_PAIRS, MAX_PAIRS))
        out.append(CorpusConversation(f"corpus-{seed}-{n:03d}-{language}", language, pairs))
    return tuple(out)


# --- JSON lines --------------------------------------------------------------------------


def write_jsonl(corpus: Iterable[CorpusConversation], path: str | Path) -> None:
    """One conversation per line:
    {"conversation_id": ..., "language": ..., "pairs": [{"user": ..., "assistant": ...}, ...]}.
    """
    with Path(path).open("w", encoding="utf-8", newline="\n") as f:
        for c in corpus:
            record = {
                "conversation_id": c.conversation_id,
                "language": c.language,
                "pairs": [{"user": u, "assistant": a} for u, a in c.pairs],
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> tuple[CorpusConversation, ...]:
    """The conversations write_jsonl wrote (blank lines are ignored)."""
    out = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            out.append(CorpusConversation(
                str(record["conversation_id"]),
                str(record["language"]),
                tuple((str(p["user"]), str(p["assistant"])) for p in record["pairs"]),
            ))
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pycompactor.corpus",
        description="Write the evaluation corpus (docs/corpus.md) as JSON lines.",
    )
    parser.add_argument("--seed", type=int, default=0, help="the corpus seed (default: 0)")
    parser.add_argument("--conversations", type=int, default=None, metavar="N",
                        help=f"how many conversations (default: {DEFAULT_CONVERSATIONS})")
    parser.add_argument("--out", required=True, metavar="FILE.jsonl", help="where to write it")
    args = parser.parse_args(argv)
    try:
        corpus = build_corpus(seed=args.seed, conversations=args.conversations)
    except CorpusTextMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_jsonl(corpus, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
