"""bench.held_out: held-out reference text as `evaluate` JSONL (docs/evaluate.md)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import held_out
from pycompactor.cli.evaluate import read_jsonl


def test_a_docstring_entry_names_its_term_first() -> None:
    entries = dict(held_out.docstring_entries(("json",)))
    assert entries["json.dumps"].startswith("json.dumps: Serialize ``obj`` to a JSON")


def test_the_conversations_are_evaluate_jsonl(tmp_path: Path) -> None:
    out = tmp_path / "held-out.jsonl"
    records = list(held_out.conversations(man=False))
    assert records
    assert all(len(pairs) == held_out.PAIRS for _, pairs in records)
    out.write_text("".join(
        json.dumps({"conversation_id": cid, "language": "en",
                    "pairs": [{"user": u, "assistant": a} for u, a in pairs]}) + "\n"
        for cid, pairs in records), encoding="utf-8")
    conversations = read_jsonl(out)
    assert [c.conversation_id for c in conversations] == [cid for cid, _ in records]
    first = conversations[0].pairs[0]
    assert first.user_content.startswith("What does ")
    assert first.assistant_content.split(":", 1)[0] in first.user_content


def test_a_missing_man_page_gives_no_entries() -> None:
    assert held_out.man_entries("no-such-page-anywhere", "5") == []
