"""Fixtures for driver tests: the scripted model server on loopback and ten sample pairs."""

from __future__ import annotations

import pytest

from pycompactor.models import Pair


def make_pairs(assistant_texts: list[str] | None = None) -> list[Pair]:
    """Ten pairs whose user texts carry a USER-SECRET marker the model must never see."""
    texts = assistant_texts or [
        f"Reply {i}: fund F{i} had a NAV of {10 + i}.25 USD on 2026-10-{i + 10:02d}."
        for i in range(10)
    ]
    return [
        Pair(
            pair_index=i,
            run_id=f"run-{i}",
            user_message_id=f"user-msg-{i}",
            user_content=f"USER-SECRET-{i:02d} my account number is 99{i}",
            assistant_message_id=f"asst-msg-{i}",
            assistant_content=text,
        )
        for i, text in enumerate(texts)
    ]


@pytest.fixture
def pairs() -> list[Pair]:
    return make_pairs()
