"""Qualifier retention (pycompactor.quality.qualifiers): what counts as a qualified fact."""

from __future__ import annotations

from pycompactor.quality.qualifiers import qualified_facts, qualifier_stats, qualifiers, unwrap


def test_phrases_before_words_and_contractions_as_not() -> None:
    assert qualifiers("It is no longer supported as of 15.4") == {"no longer", "as of"}
    assert qualifiers("This doesn't apply.") == {"not"}
    assert qualifiers("Notably, nothing changed") == set()


def test_chinese_longest_first() -> None:
    assert qualifiers("该参数不再默认开启") == {"不再"}
    assert qualifiers("仅在 15.3 之后") == {"仅"}


def test_facts_share_a_sentence_and_figures_stay_whole() -> None:
    text = "Version 10.37 is no longer supported. Version 11 is fine."
    assert qualified_facts(text) == {("10.37", "no longer")}


def test_retention_counts_facts_stated_whole() -> None:
    replies = ["The limit is only 8 connections. It was not 16 before 2026-10-09."]
    kept = qualifier_stats(replies, "Only 8 connections. It was not 16.")
    assert (kept.total, kept.kept) == (3, 2)
    split = qualifier_stats(replies, "8 connections. Only. Not 16.")
    assert (split.total, split.kept) == (3, 1)
    assert qualifier_stats(["no figures, not one"], "x").retention is None


def test_unwrap_joins_a_wrapped_sentence_and_leaves_lists_and_code_alone() -> None:
    wrapped = "By default, stdout and stderr are not captured, and those attributes\nwill be None."
    assert unwrap(wrapped) == ("By default, stdout and stderr are not captured, and those"
                               " attributes will be None.")
    # A list's items, a sentence's end and a capital start a line of their own.
    listed = "Options:\n- first item\n- second item\nDone here.\nNext line."
    assert unwrap(listed) == listed
    # A fenced code block keeps its lines: "x = 1" and "y = 2" are two statements.
    code = "Set it like this\nfor example:\n```python\nx = 1\ny = 2\nprint(x)\nfoo()\n```\nok"
    assert unwrap(code) == ("Set it like this for example:\n```python\nx = 1\ny = 2\n"
                            "print(x)\nfoo()\n```\nok")
    assert unwrap("a\n```\nb = 1\nc\n") == "a\n```\nb = 1\nc\n"  # unclosed: to the end
