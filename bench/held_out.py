"""Held-out text: conversations the summarizers were not tuned on, as `evaluate` JSONL.

The evaluation corpus (pycompactor.corpus) is what extractive-3 was built against, so its
numbers say how well the model fits that corpus. This builds another set from public
reference text already on the machine: the entries of a few man pages (one option or
file a reply, "UMask=: Controls …") and the docstrings of the Python standard library
("os.path.join: Join …"). Reference entries are what a user's own history often quotes,
and they are hard in other ways: defaults stated apart from their option, man section
numbers that look like figures, long caveat lists.

    python -m bench.held_out --out held-out.jsonl
    pycompactor evaluate --jsonl held-out.jsonl --compare baseline/whole-sentences@0.4

What it holds depends on the machine (which man pages are installed, which Python), so
its numbers are quoted with the machine and the command (docs/evaluate.md).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

from pycompactor.corpus import CorpusConversation, write_jsonl

#: Man pages whose entries are replies: (page, section).
MAN_PAGES: Final = (
    ("ssh_config", "5"), ("sshd_config", "5"), ("systemd.exec", "5"),
    ("systemd.service", "5"), ("systemd.network", "5"), ("proc", "5"), ("apt.conf", "5"),
    ("bash", "1"), ("tar", "1"), ("rsync", "1"), ("grep", "1"), ("find", "1"),
    ("wget", "1"), ("curl", "1"), ("ps", "1"), ("top", "1"), ("journalctl", "1"),
    ("postgres", "1"), ("pg_dump", "1"), ("psql", "1"),
)
#: Standard-library modules whose public docstrings are replies.
MODULES: Final = (
    "os", "shutil", "subprocess", "json", "re", "datetime", "collections", "itertools",
    "functools", "pathlib", "socket", "ssl", "asyncio", "logging", "argparse", "tarfile",
    "zipfile", "sqlite3", "http.client", "urllib.request", "threading", "decimal",
    "statistics", "random", "math", "time", "calendar", "textwrap", "typing", "unittest",
    "inspect", "pickle", "heapq", "bisect", "hashlib", "secrets", "base64", "csv",
    "configparser", "tempfile", "glob", "uuid", "ipaddress", "locale", "gzip", "lzma",
    "struct", "queue", "select", "signal", "codecs", "difflib", "copy", "enum",
    "dataclasses", "contextlib", "io", "platform", "sys", "traceback", "warnings", "zlib",
    "smtplib", "fractions", "operator", "timeit", "tracemalloc", "gc", "ast", "shlex",
    "zoneinfo", "graphlib",
)
#: Replies shorter than this define nothing worth a question.
MIN_REPLY: Final = 150
#: Pairs a conversation: long enough for several target ranges (contract §5's window).
PAIRS: Final = 60

_TERM: Final = re.compile(r"^ {7}\S")
_BODY: Final = re.compile(r"^ {8,}\S")
_OVERSTRIKE: Final = re.compile(r".\x08")


def man_entries(page: str, section: str) -> list[tuple[str, str]]:
    """A man page's entries as (term, "term: body"); none when the page is missing."""
    env = dict(os.environ, MANWIDTH="2000")
    done = subprocess.run(["man", "-P", "cat", section, page], capture_output=True,
                          text=True, env=env, check=False)
    entries: list[tuple[str, list[str]]] = []
    for line in _OVERSTRIKE.sub("", done.stdout).splitlines():
        if _TERM.match(line):
            if entries and not entries[-1][1] and len(line.strip()) < 80:
                entries[-1] = (f"{entries[-1][0]} {line.strip()}", [])  # a term's 2nd line
            else:
                entries.append((line.strip(), []))
        elif _BODY.match(line) and entries:
            entries[-1][1].append(line.strip())
        elif not line.strip() and entries and entries[-1][1]:
            entries[-1][1].append("\n")
    out = []
    for term, body in entries:
        text = " ".join(body).replace(" \n ", "\n").replace("\n ", "\n").strip()
        if len(text) >= MIN_REPLY:
            out.append((term, f"{term}: {text}"))
    return out


def docstring_entries(modules: Sequence[str] = MODULES) -> list[tuple[str, str]]:
    """Public docstrings of the standard library as (name, "name: docstring"), each once."""
    seen: set[str] = set()
    out = []
    for name in modules:
        with warnings.catch_warnings():  # deprecated aliases (typing.io) warn when read
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            docs = [(attr, inspect.getdoc(getattr(module, attr, None)))
                    for attr in sorted(a for a in dir(module) if not a.startswith("_"))]
        for attr, doc in docs:
            if doc and len(doc) >= 2 * MIN_REPLY and doc not in seen:
                seen.add(doc)
                out.append((f"{name}.{attr}", f"{name}.{attr}: {doc}"))
    return out


def conversations(*, man: bool = True) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(conversation id, [(user, assistant), ...]): the user asks about each entry, the
    reply is the entry. Without `man`, only the docstrings (a machine without man pages)."""
    sources = [(f"man-{page}", man_entries(page, section))
               for page, section in (MAN_PAGES if man else ())]
    sources.append(("python", docstring_entries()))
    for prefix, entries in sources:
        for start in range(0, len(entries) - PAIRS + 1, PAIRS):
            yield f"{prefix}-{start}", [(f"What does {term} do?", text)
                                        for term, text in entries[start : start + PAIRS]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.held_out", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    args = parser.parse_args(argv)
    found = [CorpusConversation(cid, "en", tuple(pairs))
             for cid, pairs in conversations(man=shutil.which("man") is not None)]
    write_jsonl(found, args.out)  # the corpus's own format, which evaluate --jsonl reads
    print(f"{args.out}: {len(found)} conversations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
