"""The shipped prompt is pinned: changing its text means a new prompt version."""

from __future__ import annotations

import hashlib

import pytest

from pycompactor.errors import PycompactorError
from pycompactor.summarizers import openai_compatible as summarizer
from pycompactor.summarizers.openai_compatible import (
    PROMPT_SHA256,
    PROMPT_VERSION,
    load_prompt,
    prompt_bytes,
)

# Written out here as well as in the code, so that editing the prompt and the constant
# together still fails this test. Do not update these: add conversation-compaction@4
# (a new file, a new row in compaction.prompt_versions) instead.
PINNED = {
    "conversation-compaction@3": (
        "2fb544ae95831184434c53a045d61803cd4dfda598c8bb260efd3b6ce048487f"
    ),
}


def test_prompt_version_is_the_only_one_for_new_jobs() -> None:
    assert PROMPT_VERSION == "conversation-compaction@3"


def test_prompt_text_is_pinned() -> None:
    data = prompt_bytes(PROMPT_VERSION)
    assert hashlib.sha256(data).hexdigest() == PINNED[PROMPT_VERSION] == PROMPT_SHA256
    assert load_prompt() == data.decode("utf-8")


def test_prompt_forbids_tools_and_user_reconstruction() -> None:
    text = load_prompt()
    assert "assistant_message_id" in text
    assert "no tool or function calls" in text
    assert "6000 characters" in text
    assert "the user's messages are deliberately withheld" in text


def test_an_edited_prompt_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    edited = prompt_bytes() + b"\nAlso add your own opinion.\n"
    monkeypatch.setattr(summarizer, "prompt_bytes", lambda version=PROMPT_VERSION: edited)
    with pytest.raises(PycompactorError, match="new prompt version"):
        load_prompt()
