"""The pure projection core (no database): selection, reasons, the walk, the budget."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pycompactor import Projection
from pycompactor.errors import UsageError
from pycompactor.hashing import source_hash, source_message_ids
from pycompactor.models import Pair
from pycompactor.projection import (
    SUMMARY_MARKER,
    HistoryChanged,
    Manifest,
    PairMeta,
    PairPlacement,
    RejectedSummary,
    Rejections,
    StoredSummary,
    SummaryCandidate,
    block_cost,
    marker_line,
    message_cost,
    plan_projection,
    project_pairs,
    render_projection,
)
from tests.history import raw_cost

V1, V2, V3 = (f"conversation-compaction@{n}" for n in (1, 2, 3))
# As compaction.prompt_versions and compaction.projection_summaries say (test data;
# tests/sql/test_projection.py checks the database's own answers).
PROJECTABLE = {V1: False, V2: True, V3: True}
RANK = {V1: 1, V2: 2, V3: 3}
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def make_pairs(n: int, user: str = "question {i}", assistant: str = "answer {i}") -> list[Pair]:
    return [
        Pair(i, f"r{i}", f"u{i}", user.format(i=i), f"a{i}", assistant.format(i=i))
        for i in range(n)
    ]


def summary_of(
    pairs: Sequence[Pair],
    from_pair: int,
    summary_id: int,
    *,
    version: str = V3,
    completed_at: datetime = T0,
    text: str | None = None,
) -> StoredSummary:
    block = pairs[from_pair : from_pair + 10]
    return StoredSummary(
        summary_id=summary_id,
        from_pair=from_pair,
        to_pair=from_pair + 9,
        source_message_ids=tuple(source_message_ids(block)),
        source_hash=source_hash(block),
        prompt_version=version,
        projectable=PROJECTABLE[version],
        version_rank=RANK[version],
        completed_at=completed_at,
        summary=text if text is not None else f"summary #{summary_id} of {from_pair}",
    )


def everything(pairs: Sequence[Pair], summaries: Sequence[StoredSummary] = ()) -> int:
    """A budget large enough for every pair raw and every summary block."""
    raw = raw_cost(pairs)
    return raw + sum(message_cost(marker_line(0, 9) + "\n" + s.summary) + 64 for s in summaries)


def placements(projection: Projection) -> list[tuple[str, int | None]]:
    return [(p.placement, p.summary_id) for p in projection.pairs]


def reasons(projection: Projection) -> dict[int, str]:
    return {r.summary_id: r.reason for r in projection.rejected_summaries}


# ----------------------------------------------------------------------------- examples


def test_marker_line_is_fixed_and_zero_based() -> None:
    assert (
        SUMMARY_MARKER == "[pycompactor summary of assistant replies, pairs {from_pair}–{to_pair}]"
    )
    assert marker_line(0, 9) == "[pycompactor summary of assistant replies, pairs 0–9]"
    assert marker_line(10, 19) == "[pycompactor summary of assistant replies, pairs 10–19]"


def test_cost_is_utf8_bytes_plus_16() -> None:
    assert message_cost("") == 16
    assert message_cost("é") == 18
    assert message_cost("你好") == 22
    assert message_cost("🙂") == 20


def test_everything_fits_raw_in_chat_order() -> None:
    pairs = make_pairs(3)
    projection = project_pairs(pairs, [], budget_bytes=10_000)
    assert projection.messages == (
        {"role": "user", "content": "question 0"},
        {"role": "assistant", "content": "answer 0"},
        {"role": "user", "content": "question 1"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "question 2"},
        {"role": "assistant", "content": "answer 2"},
    )
    assert placements(projection) == [("raw", None)] * 3
    assert projection.used_bytes == 3 * (10 + 8 + 32)
    assert projection.budget_bytes == 10_000


def test_exact_budget_boundary() -> None:
    pairs = make_pairs(2)
    pair_cost = message_cost("question 1") + message_cost("answer 1")
    exact = project_pairs(pairs, [], budget_bytes=pair_cost)
    assert placements(exact) == [("omitted", None), ("raw", None)]
    assert exact.used_bytes == pair_cost
    short = project_pairs(pairs, [], budget_bytes=pair_cost - 1)
    assert placements(short) == [("omitted", None), ("omitted", None)]
    assert short.messages == ()
    assert short.used_bytes == 0


def test_zero_budget_and_empty_conversation() -> None:
    pairs = make_pairs(12)
    summary = summary_of(pairs, 0, 1)
    projection = project_pairs(pairs, [summary], budget_bytes=0)
    assert projection.messages == ()
    assert placements(projection) == [("omitted", None)] * 12
    # Pair 11 does not fit, so the walk never reaches range 0: its summary was not tried.
    assert reasons(projection) == {}
    # With the two newest pairs in, the walk tries the block and drops it.
    tail = raw_cost(pairs[10:])
    reached = project_pairs(pairs, [summary], budget_bytes=tail)
    assert placements(reached) == [("omitted", None)] * 10 + [("raw", None)] * 2
    assert reasons(reached) == {1: "did_not_fit"}
    empty = project_pairs([], [], budget_bytes=0)
    assert empty.to_dict() == {
        "messages": [],
        "pairs": [],
        "rejected_summaries": [],
        "used_bytes": 0,
        "budget_bytes": 0,
    }


@pytest.mark.parametrize("bad", [-1, -100])
def test_negative_budget_is_a_usage_error(bad: int) -> None:
    with pytest.raises(UsageError, match="budget_bytes must be 0 or more"):
        project_pairs(make_pairs(1), [], budget_bytes=bad)


def test_non_integer_budget_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="whole number"):
        project_pairs(make_pairs(1), [], budget_bytes=True)
    with pytest.raises(UsageError, match="whole number"):
        project_pairs(make_pairs(1), [], budget_bytes=1.5)  # type: ignore[arg-type]


def test_valid_summary_block_then_newer_raw_pairs() -> None:
    pairs = make_pairs(12)
    summary = summary_of(pairs, 0, 7, text="两只基金的净值比较（上周）")
    projection = project_pairs(pairs, [summary], budget_bytes=10_000)
    assert placements(projection) == [("summarized", 7)] * 10 + [("raw", None)] * 2
    assert projection.rejected_summaries == ()
    messages = projection.messages
    assert [m["role"] for m in messages[:11]] == ["user"] * 10 + ["assistant"]
    assert [m["content"] for m in messages[:10]] == [f"question {i}" for i in range(10)]
    assert messages[10]["content"] == (
        "[pycompactor summary of assistant replies, pairs 0–9]\n两只基金的净值比较（上周）"
    )
    assert [m["content"] for m in messages[11:]] == [
        "question 10",
        "answer 10",
        "question 11",
        "answer 11",
    ]
    assert projection.used_bytes == sum(message_cost(m["content"]) for m in messages)


def test_stale_source_falls_back_to_raw() -> None:
    pairs = make_pairs(10)
    summary = summary_of(pairs, 0, 1)
    edited = [*pairs[:3], replace(pairs[3], assistant_content="answer 3, corrected"), *pairs[4:]]
    projection = project_pairs(edited, [summary], budget_bytes=10_000)
    assert reasons(projection) == {1: "stale_source"}
    assert placements(projection) == [("raw", None)] * 10
    assert "answer 3, corrected" in [m["content"] for m in projection.messages]


def test_changed_ids_are_stale_even_with_the_same_texts() -> None:
    pairs = make_pairs(10)
    summary = summary_of(pairs, 0, 1)
    renamed = [*pairs[:3], replace(pairs[3], user_message_id="u3-new"), *pairs[4:]]
    assert reasons(project_pairs(renamed, [summary], budget_bytes=10_000)) == {1: "stale_source"}


def test_summary_of_a_missing_range_is_stale() -> None:
    pairs = make_pairs(15)
    other = make_pairs(20)
    summary = summary_of(other, 10, 4)
    projection = project_pairs(pairs, [summary], budget_bytes=10_000)
    assert reasons(projection) == {4: "stale_source"}
    assert placements(projection) == [("raw", None)] * 15


def test_version_one_is_never_projected_and_reported_first() -> None:
    pairs = make_pairs(10)
    v1 = summary_of(pairs, 0, 1, version=V1)
    v1_stale = replace(summary_of(pairs, 0, 2, version=V1), source_hash="0" * 64)
    projection = project_pairs(pairs, [v1, v1_stale], budget_bytes=10_000)
    assert reasons(projection) == {1: "version_not_projectable", 2: "version_not_projectable"}
    assert placements(projection) == [("raw", None)] * 10


def test_version_three_wins_over_a_newer_version_two() -> None:
    pairs = make_pairs(10)
    v2 = summary_of(pairs, 0, 5, version=V2, completed_at=T0 + timedelta(days=3))
    v3 = summary_of(pairs, 0, 4, version=V3, completed_at=T0)
    projection = project_pairs(pairs, [v2, v3], budget_bytes=10_000)
    assert placements(projection) == [("summarized", 4)] * 10
    assert reasons(projection) == {5: "superseded"}


def test_version_two_is_used_alone() -> None:
    pairs = make_pairs(10)
    projection = project_pairs(pairs, [summary_of(pairs, 0, 5, version=V2)], budget_bytes=10_000)
    assert placements(projection) == [("summarized", 5)] * 10


def test_same_version_latest_completed_then_higher_id() -> None:
    pairs = make_pairs(10)
    older = summary_of(pairs, 0, 9, completed_at=T0)
    newer = summary_of(pairs, 0, 3, completed_at=T0 + timedelta(seconds=1))
    tie = summary_of(pairs, 0, 8, completed_at=T0)
    projection = project_pairs(pairs, [older, newer, tie], budget_bytes=10_000)
    assert placements(projection)[0] == ("summarized", 3)
    assert reasons(projection) == {8: "superseded", 9: "superseded"}
    projection = project_pairs(pairs, [older, tie], budget_bytes=10_000)
    assert placements(projection)[0] == ("summarized", 9)
    assert reasons(projection) == {8: "superseded"}


def test_stale_preferred_summary_lets_the_valid_one_through() -> None:
    pairs = make_pairs(10)
    v3_stale = replace(summary_of(pairs, 0, 2), source_hash="f" * 64)
    v2 = summary_of(pairs, 0, 1, version=V2)
    projection = project_pairs(pairs, [v3_stale, v2], budget_bytes=10_000)
    assert placements(projection)[0] == ("summarized", 1)
    assert reasons(projection) == {2: "stale_source"}


def test_block_too_big_falls_back_to_raw_pairs_newest_first() -> None:
    pairs = make_pairs(12)
    summary = summary_of(pairs, 0, 1, text="x" * 2000)
    tail = raw_cost(pairs[8:])
    projection = project_pairs(pairs, [summary], budget_bytes=tail)
    assert reasons(projection) == {1: "did_not_fit"}
    assert placements(projection) == [("omitted", None)] * 8 + [("raw", None)] * 4
    assert projection.messages[0] == {"role": "user", "content": "question 8"}
    assert projection.used_bytes == tail


def test_block_too_big_but_all_raw_pairs_fit_continues_older() -> None:
    pairs = make_pairs(20, user="q{i}", assistant="a{i}")
    summary = summary_of(pairs, 10, 1, text="y" * 500)
    raw_all = raw_cost(pairs)
    projection = project_pairs(pairs, [summary], budget_bytes=raw_all)
    assert reasons(projection) == {1: "did_not_fit"}
    assert placements(projection) == [("raw", None)] * 20


def test_walk_stops_at_the_first_thing_that_does_not_fit() -> None:
    # The small oldest pair would fit on its own, but history must stay contiguous.
    pairs = [
        Pair(0, "r0", "u0", "q", "a0", "a"),
        Pair(1, "r1", "u1", "long question " * 20, "a1", "long answer"),
        Pair(2, "r2", "u2", "question 2", "a2", "answer 2"),
    ]
    budget = message_cost("question 2") + message_cost("answer 2") + 40
    assert message_cost("q") + message_cost("a") <= 40
    projection = project_pairs(pairs, [], budget_bytes=budget)
    assert placements(projection) == [("omitted", None), ("omitted", None), ("raw", None)]


def test_unreached_summaries_get_every_reason_but_did_not_fit_from_metadata() -> None:
    # Budget 100 holds about two of the newest pairs: the walk cannot reach ranges 0-29,
    # yet every stale summary there is named stale_source (contract §9: only did_not_fit
    # depends on the budget). The valid summary range 0 would use was not tried: it is
    # not listed, and the one it is preferred to is superseded.
    pairs = make_pairs(40)
    valid = summary_of(pairs, 0, 1)
    older = summary_of(pairs, 0, 5, completed_at=T0 - timedelta(days=1))
    stale_hash = replace(summary_of(pairs, 10, 2), source_hash="a" * 64)
    stale_ids = replace(summary_of(pairs, 10, 4),
                        source_message_ids=summary_of(pairs, 10, 4).source_message_ids[::-1])
    v1 = summary_of(pairs, 20, 3, version=V1)
    projection = project_pairs(pairs, [valid, older, stale_hash, stale_ids, v1],
                               budget_bytes=100)
    assert reasons(projection) == {
        5: "superseded",
        2: "stale_source",
        4: "stale_source",
        3: "version_not_projectable",
    }
    assert [r.from_pair for r in projection.rejected_summaries] == [0, 10, 10, 20]


def test_stale_summary_is_stale_source_whatever_the_budget() -> None:
    pairs = make_pairs(40)
    stale = replace(summary_of(pairs, 20, 2), source_hash="a" * 64)
    valid = summary_of(pairs, 20, 3, version=V2)
    newest = pairs[30:]
    raw_30_39 = raw_cost(newest)
    # Just enough to pass pairs 30-39 raw: the walk reaches range 20.
    projection = project_pairs(pairs, [stale, valid], budget_bytes=raw_30_39)
    assert reasons(projection) == {2: "stale_source", 3: "did_not_fit"}
    # One byte less and range 20 is out of reach: still stale_source; the valid summary
    # was not tried, so it is not did_not_fit (nor listed).
    for budget in (raw_30_39 - 1, 0):
        projection = project_pairs(pairs, [stale, valid], budget_bytes=budget)
        assert reasons(projection) == {2: "stale_source"}


def metas(n: int, user_bytes: int = 34, assistant_bytes: int = 34) -> list[PairMeta]:
    """n pairs costing (34 + 16) + (34 + 16) = 100 bytes each by default."""
    return [PairMeta(i, f"u{i}", f"a{i}", user_bytes, assistant_bytes) for i in range(n)]


def candidate(pairs: Sequence[PairMeta], from_pair: int, summary_id: int, *,
              block: int, projectable: bool = True) -> SummaryCandidate:
    """A summary of pairs from_pair..+9 with the current ids whose block costs `block`."""
    ids = tuple(m for p in pairs[from_pair : from_pair + 10]
                for m in (p.user_message_id, p.assistant_message_id))
    base = SummaryCandidate(summary_id, from_pair, from_pair + 9, ids, "0" * 64, V3,
                            projectable, RANK[V3], T0, 0, True)
    summary = replace(base, summary_bytes=block - block_cost(base, pairs))
    assert block_cost(summary, pairs) == block
    return summary


def test_source_current_decides_stale_source_at_every_budget() -> None:
    pairs = metas(45)  # ranges 0-39 complete, pairs 40-44 raw only: 500 bytes
    summaries = [candidate(pairs, start, start + 1, block=700) for start in (0, 10, 20, 30)]
    stale = [replace(s, source_current=False) for s in summaries]
    incomplete = SummaryCandidate(99, 40, 49, ("y",) * 20, "0" * 64, V3, True, RANK[V3], T0,
                                  10, True)
    wrong_ids = replace(candidate(pairs, 0, 50, block=700), source_message_ids=("x",) * 20)
    for budget in (0, 499, 500, 1_200, 10**6):
        plan = plan_projection(pairs, [*stale, incomplete, wrong_ids], budget)
        assert {r.summary_id: r.reason for r in plan.rejected_summaries} == {
            1: "stale_source", 11: "stale_source", 21: "stale_source", 31: "stale_source",
            99: "stale_source", 50: "stale_source"}
        assert all(p.placement != "summarized" for p in plan.pairs)
        plan = plan_projection(pairs, summaries, budget)
        assert {r.reason for r in plan.rejected_summaries} <= {"did_not_fit"}
    # Everything fits: all four blocks are used.
    plan = plan_projection(pairs, summaries, 10**6)
    assert plan.rejected_summaries == ()
    assert plan.summary_ids == (1, 11, 21, 31)


def test_render_refuses_texts_that_changed_size_or_vanished() -> None:
    metas = [PairMeta(0, "u0", "a0", 1, 1)]
    plan = plan_projection(metas, [], 100)
    assert render_projection(plan, {"u0": "q", "a0": "a"}, {}).used_bytes == 34
    with pytest.raises(HistoryChanged):
        render_projection(plan, {"u0": "qq", "a0": "a"}, {})
    with pytest.raises(HistoryChanged):
        render_projection(plan, {"u0": "q"}, {})


def test_plan_needs_every_pair_in_order() -> None:
    with pytest.raises(ValueError, match="every eligible pair"):
        plan_projection([PairMeta(1, "u1", "a1", 1, 1)], [], 10)


def test_to_dict_has_exactly_the_contract_keys() -> None:
    pairs = make_pairs(10)
    projection = project_pairs(pairs, [summary_of(pairs, 0, 1, version=V1)], budget_bytes=70)
    data = projection.to_dict()
    assert list(data) == ["messages", "pairs", "rejected_summaries", "used_bytes", "budget_bytes"]
    assert data["pairs"][-1] == {"pair_index": 9, "placement": "raw", "summary_id": None}
    assert data["rejected_summaries"] == [
        {"summary_id": 1, "from_pair": 0, "reason": "version_not_projectable"}
    ]
    assert json.loads(json.dumps(data)) == data


# --------------------------------------------------------------------------- properties

# Multibyte on purpose (2-, 3- and 4-byte UTF-8), plus ASCII whitespace inside texts.
ALPHABET = st.sampled_from(list("ab z\t\néß你好净值🙂\u3000"))
USER_TEXT = st.text(ALPHABET, min_size=1, max_size=12).map(lambda s: "Q" + s)
ASSISTANT_TEXT = st.text(ALPHABET, min_size=1, max_size=40).map(lambda s: "A" + s)
SUMMARY_TAG = "§SUMMARY§"  # never produced by ALPHABET, so it marks summary text


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[Pair], list[StoredSummary], int]:
    n = draw(st.integers(0, 45))
    pairs = [
        Pair(i, f"r{i}", f"u{i}", draw(USER_TEXT), f"a{i}", draw(ASSISTANT_TEXT)) for i in range(n)
    ]
    summaries: list[StoredSummary] = []
    n_summaries = draw(st.integers(0, 8))
    for summary_id in draw(
        st.lists(st.integers(1, 10_000), min_size=n_summaries, max_size=n_summaries, unique=True)
    ):
        from_pair = 10 * draw(st.integers(0, max(0, n // 10)))
        source = pairs if from_pair + 10 <= n else make_pairs(from_pair + 10)
        summary = summary_of(
            source,
            from_pair,
            summary_id,
            version=draw(st.sampled_from([V1, V2, V3])),
            completed_at=T0 + timedelta(seconds=draw(st.integers(0, 3))),
            text=SUMMARY_TAG + draw(st.text(ALPHABET, min_size=0, max_size=80)),
        )
        staleness = draw(st.sampled_from(["fresh", "fresh", "hash", "ids"]))
        if staleness == "hash":
            summary = replace(summary, source_hash="0" * 64)
        elif staleness == "ids":
            summary = replace(summary, source_message_ids=summary.source_message_ids[::-1])
        summaries.append(summary)
    budget = draw(st.integers(0, everything(pairs, summaries)))
    return pairs, summaries, budget


@settings(max_examples=300, deadline=None)
@given(conversations())
def test_projection_properties(case: tuple[list[Pair], list[StoredSummary], int]) -> None:
    pairs, summaries, budget = case
    projection = project_pairs(pairs, summaries, budget_bytes=budget)
    messages = projection.messages

    # Never over budget; used_bytes is what the messages cost.
    assert projection.used_bytes == sum(message_cost(m["content"]) for m in messages)
    assert projection.used_bytes <= budget == projection.budget_bytes

    # Every eligible pair exactly once, in order; included pairs are a newest suffix.
    assert [p.pair_index for p in projection.pairs] == list(range(len(pairs)))
    included = [p.pair_index for p in projection.pairs if p.placement != "omitted"]
    assert included == list(range(len(pairs) - len(included), len(pairs)))

    # Maximal: the walk only stops on a pair that did not fit even raw.
    omitted = [p.pair_index for p in projection.pairs if p.placement == "omitted"]
    if omitted:
        stop = pairs[omitted[-1]]
        assert (
            message_cost(stop.user_content) + message_cost(stop.assistant_content)
            > budget - projection.used_bytes
        )

    # Every stored summary is used, or rejected with a reason, never both; or it is the
    # summary its range would use, beyond the walk's reach, and is not listed (contract §9:
    # did_not_fit is for a block that was tried and dropped).
    used = {p.summary_id for p in projection.pairs if p.summary_id is not None}
    rejected = {r.summary_id: r.reason for r in projection.rejected_summaries}
    assert used.isdisjoint(rejected)
    by_id = {s.summary_id: s for s in summaries}
    unlisted = {s.summary_id for s in summaries} - used - set(rejected)
    if unlisted:
        assert omitted
        unlimited = project_pairs(pairs, summaries, budget_bytes=everything(pairs, summaries))
        used_unlimited = {p.summary_id for p in unlimited.pairs if p.summary_id is not None}
        for summary_id in unlisted:
            assert by_id[summary_id].to_pair < omitted[-1]
            assert summary_id in used_unlimited
    for summary_id, reason in rejected.items():
        if reason == "did_not_fit":
            assert not omitted or by_id[summary_id].to_pair >= omitted[-1]
    for summary_id in used:
        summary = by_id[summary_id]
        assert summary.projectable
        block = pairs[summary.from_pair : summary.to_pair + 1]
        assert summary.source_hash == source_hash(block)
        assert tuple(source_message_ids(block)) == summary.source_message_ids

    # Messages replay the manifest: raw pairs verbatim, summary blocks with the 10 original
    # user texts verbatim and the marked summary in an assistant message.
    expected: list[tuple[str, str]] = []
    index = min(included, default=len(pairs))
    while index < len(pairs):
        entry = projection.pairs[index]
        if entry.placement == "raw":
            expected += [
                ("user", pairs[index].user_content),
                ("assistant", pairs[index].assistant_content),
            ]
            index += 1
        else:
            assert entry.summary_id is not None
            summary = by_id[entry.summary_id]
            assert index == summary.from_pair
            assert all(
                p.summary_id == summary.summary_id for p in projection.pairs[index : index + 10]
            )
            expected += [("user", p.user_content) for p in pairs[index : index + 10]]
            expected.append(("assistant", marker_line(index, index + 9) + "\n" + summary.summary))
            index += 10
    assert [(m["role"], m["content"]) for m in messages] == expected

    # Summary text never travels in a user message.
    assert not any(SUMMARY_TAG in m["content"] for m in messages if m["role"] == "user")

    # Deterministic, whatever order the summaries are given in.
    shuffled = list(summaries)
    random.Random(budget).shuffle(shuffled)
    again = project_pairs(pairs, shuffled, budget_bytes=budget)
    assert json.dumps(again.to_dict()) == json.dumps(projection.to_dict())

    # Every reason but did_not_fit is independent of the budget (contract §9): it is what
    # an independent check of each summary gives, at this budget and at any other.
    for summary_id, reason in rejected.items():
        assert reason == expected_reason(pairs, by_id[summary_id]) or (
            reason in ("superseded", "did_not_fit")
            and expected_reason(pairs, by_id[summary_id]) is None)
    for other_budget in (0, everything(pairs, summaries)):
        other = project_pairs(pairs, summaries, budget_bytes=other_budget)
        assert {r.summary_id: r.reason for r in other.rejected_summaries
                if r.reason in ("version_not_projectable", "stale_source", "superseded")} \
            == {sid: r for sid, r in rejected.items()
                if r in ("version_not_projectable", "stale_source", "superseded")}


def expected_reason(pairs: Sequence[Pair], summary: StoredSummary) -> str | None:
    """version_not_projectable or stale_source, judged independently; None if valid."""
    if not summary.projectable:
        return "version_not_projectable"
    block = pairs[summary.from_pair : summary.to_pair + 1]
    if (len(block) != 10 or summary.from_pair % 10
            or tuple(source_message_ids(block)) != summary.source_message_ids
            or source_hash(block) != summary.source_hash):
        return "stale_source"
    return None


def test_docs_worked_example() -> None:
    """The numbers of docs/projection.md's worked example."""
    pairs = make_pairs(12, user="Q{i}", assistant="A{i}")
    summaries = [
        summary_of(
            pairs, 0, 5, version=V2, completed_at=T0 + timedelta(days=8), text="older summary"
        ),
        summary_of(pairs, 0, 6, version=V1, text="mixed summary"),
        summary_of(pairs, 0, 7, version=V3, text="NAVs compared (last week's)"),
    ]
    assert len(marker_line(0, 9).encode()) == 55

    wide = project_pairs(pairs, summaries, budget_bytes=400)
    assert wide.used_bytes == 355
    assert placements(wide) == [("summarized", 7)] * 10 + [("raw", None)] * 2
    assert [m["content"] for m in wide.messages] == [
        *(f"Q{i}" for i in range(10)),
        "[pycompactor summary of assistant replies, pairs 0–9]\nNAVs compared (last week's)",
        "Q10",
        "A10",
        "Q11",
        "A11",
    ]
    assert reasons(wide) == {5: "superseded", 6: "version_not_projectable"}

    narrow = project_pairs(pairs, summaries, budget_bytes=200)
    assert narrow.used_bytes == 184
    assert placements(narrow) == [("omitted", None)] * 7 + [("raw", None)] * 5
    assert [(r.summary_id, r.reason) for r in narrow.rejected_summaries] == [
        (5, "superseded"),
        (6, "version_not_projectable"),
        (7, "did_not_fit"),
    ]

    tiny = project_pairs(pairs, summaries, budget_bytes=75)
    assert tiny.used_bytes == 38
    assert placements(tiny) == [("omitted", None)] * 11 + [("raw", None)]
    assert [(r.summary_id, r.reason) for r in tiny.rejected_summaries] == [
        (5, "superseded"),
        (6, "version_not_projectable"),
    ]


# --- the manifest and the rejections are sequences made on access -------------------------

def test_manifest_is_a_tuple_of_its_entries() -> None:
    included = (PairPlacement(3, "summarized", 9), PairPlacement(4, "raw", None))
    manifest = Manifest(3, included)
    entries = (PairPlacement(0, "omitted", None), PairPlacement(1, "omitted", None),
               PairPlacement(2, "omitted", None), *included)
    assert len(manifest) == 5
    assert manifest.omitted == 3
    assert tuple(manifest) == entries
    assert list(manifest) == list(entries)
    assert manifest == entries
    assert manifest == list(entries)
    assert entries == manifest
    assert manifest[0] == entries[0]
    assert manifest[-1] == entries[-1]
    assert manifest[3] == included[0]
    assert manifest[1:4] == entries[1:4]
    assert manifest[::-2] == entries[::-2]
    assert manifest == Manifest(3, included)
    assert hash(manifest) == hash(Manifest(3, included))
    assert manifest != Manifest(2, (PairPlacement(2, "raw", None), *included))
    assert manifest != entries[:-1]
    assert entries[2] in manifest
    assert manifest.index(entries[3]) == 3
    with pytest.raises(IndexError):
        manifest[5]
    with pytest.raises(IndexError):
        manifest[-6]


def test_manifest_refuses_entries_that_are_not_the_newest_included_suffix() -> None:
    with pytest.raises(ValueError, match="omitted must be 0 or more"):
        Manifest(-1)
    with pytest.raises(ValueError, match="after the omitted ones"):
        Manifest(2, (PairPlacement(3, "raw", None),))
    with pytest.raises(ValueError, match="none of them omitted"):
        Manifest(0, (PairPlacement(0, "omitted", None),))


def test_rejections_are_a_tuple_of_their_entries() -> None:
    rejections = Rejections([5, 6, 7], [0, 0, 10],
                            ["superseded", "stale_source", "did_not_fit"])
    entries = (RejectedSummary(5, 0, "superseded"), RejectedSummary(6, 0, "stale_source"),
               RejectedSummary(7, 10, "did_not_fit"))
    assert tuple(rejections) == entries
    assert rejections == entries
    assert rejections == list(entries)
    assert rejections[2] == entries[2]
    assert rejections[-1] == entries[-1]
    assert rejections[:2] == entries[:2]
    assert rejections.reason_counts() == {"superseded": 1, "stale_source": 1, "did_not_fit": 1}
    assert Rejections() == ()
    assert not Rejections()
    assert Rejections().reason_counts() == {}
    assert hash(rejections) == hash(Rejections([5, 6, 7], [0, 0, 10],
                                               ["superseded", "stale_source", "did_not_fit"]))
    with pytest.raises(ValueError, match="one entry each"):
        Rejections([1], [], [])
    with pytest.raises(IndexError):
        rejections[3]


def test_a_long_omitted_history_costs_no_entry_per_pair() -> None:
    """Ten thousand pairs, a budget for the newest two: the plan holds two entries."""
    metas = [PairMeta(i, f"u{i}", f"a{i}", 10, 10) for i in range(10_000)]
    plan = plan_projection(metas, [], 2 * (20 + 2 * 16))
    assert len(plan.pairs) == 10_000
    assert plan.pairs.omitted == 9_998
    # Kept as columns of the two included pairs; entries are made when read.
    assert (plan.pairs._placements, plan.pairs._summary_ids) == (("raw", "raw"), (None, None))
    assert plan.pairs[plan.pairs.omitted:] == (PairPlacement(9_998, "raw", None),
                                               PairPlacement(9_999, "raw", None))
    assert plan.pairs[123] == PairPlacement(123, "omitted", None)
