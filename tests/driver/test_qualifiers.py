"""Qualifier retention (pycompactor.quality.qualifiers): what counts as a qualified fact."""

from __future__ import annotations

from pycompactor.quality.qualifiers import (
    qualified_facts,
    qualifier_stats,
    qualifiers,
    sentences,
    statements,
    unwrap,
)


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


def test_statements_end_neither_after_an_abbreviation_nor_inside_parentheses() -> None:
    ipc = ("Different types of IPC objects (shared memory vs. semaphores, System V vs."
           " POSIX) are treated slightly differently by systemd.")
    assert statements(ipc + " Next one.") == [ipc, "Next one."]
    assert len(sentences(ipc)) == 3  # extractive-2's split, unchanged
    assert statements("Use e.g. a socket; or i.e. a pipe. Done.") == [
        "Use e.g. a socket;", "or i.e. a pipe.", "Done."]
    assert statements("Then (x; y) z. Also (a. b.) c.") == ["Then (x; y) z.", "Also (a. b.) c."]
    assert statements("2. Install it. Version 2. Done.") == [
        "2. Install it.", "Version 2.", "Done."]
    # A parenthesis that never closes on its line ends nothing early; a line break and
    # the Chinese ends still end a sentence.
    assert statements("(Broken (never closes. Then.\nNext (one.\nTwo) three.") == [
        "(Broken (never closes.", "Then.", "Next (one.", "Two) three."]
    assert statements("今天不是。明天是！ok.") == ["今天不是", "明天是", "ok."]
    # A parenthesis or a quote that closes on an end ends the statement before a capital.
    assert statements("A (Write %% for a literal %.) Note that it is (see 9.6.) for all.") == [
        "A (Write %% for a literal %.)", "Note that it is (see 9.6.) for all."]
    assert statements('He said "Stop." Then (it was done.) (A note.)') == [
        'He said "Stop."', "Then (it was done.)", "(A note.)"]
