"""Two models, one database: the owner's model preference decides which valid summary of
a range the next Run gets (docs/contract.md §9, compaction.settings.projection_models)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pycompactor import db, project_history
from pycompactor.errors import InvalidArgument, PycompactorError, wrap_exceptions
from pycompactor.models import Pair
from pycompactor.projection import StoredSummary, model_preference, project_pairs
from tests.history import History
from tests.sql.conftest import LoginRole, connect_as
from tests.sql.test_projection import BIG, T0, V3, import_summary

Conn = psycopg.Connection[Any]
A, B = "model-a", "model-b"


def claim_and_complete(conn: Conn, conversation_id: str, from_pair: int, model: str,
                       text: str) -> int:
    """A @3 summary of the current target by `model`, through claim and complete (what a
    worker running that model does)."""
    target = next(t for t in db.plan_targets(conn, conversation_id) if t.from_pair == from_pair)
    claim = conn.execute(
        "SELECT claimed, reason, job_id, attempt FROM compaction.claim("
        "%s, 'default', %s, %s, %s, %s, %s, 'test-worker')",
        (conversation_id, from_pair, target.source_message_ids, target.source_hash, model, V3),
    ).fetchone()
    assert claim is not None
    assert claim[0], claim
    done = conn.execute(
        "SELECT ok, reason, summary_id FROM compaction.complete(%s, %s, %s, 'stop', 0)",
        (claim[2], claim[3], text),
    ).fetchone()
    assert done is not None
    assert done[0], done
    summary_id: int = done[2]
    return summary_id


def set_models(conn: Conn, models: list[str]) -> int:
    row = conn.execute("SELECT compaction.set_projection_models(%s::text[])",
                       (models,)).fetchone()
    assert row is not None
    count: int = row[0]
    return count


def view(conn: Conn, conversation_id: str) -> tuple[list[tuple[int, int | None]],
                                                    list[tuple[int, str]]]:
    """(first pair of each range, summary used) and (summary, reason) of the rejected."""
    projection = project_history(conn, conversation_id, budget_bytes=BIG)
    used = [(p.pair_index, p.summary_id) for p in projection.pairs if p.pair_index % 10 == 0]
    return used, [(r.summary_id, r.reason) for r in projection.rejected_summaries]


def assert_judged_alike(conn: Conn, conversation_id: str) -> None:
    """The stored verdicts (projection_frame), the judgement from the views
    (judged_frame) and a recomputation (verify_conversation) agree."""
    frames = [conn.execute(
        f"SELECT summary_ids, summary_reasons FROM compaction.{call}").fetchone()
        for call in (f"projection_frame('{conversation_id}', 'default', 1000000)",
                     f"judged_frame('{conversation_id}', 'default')")]
    assert frames[0] == frames[1]
    assert conn.execute("SELECT * FROM compaction.verify_conversation(%s)",
                        (conversation_id,)).fetchall() == []


def test_the_preferred_model_is_used_where_it_has_a_valid_summary(conn: Conn) -> None:
    History(conn).pairs("ab", 40)
    a0 = claim_and_complete(conn, "ab", 0, A, "A on 0-9")
    a10 = claim_and_complete(conn, "ab", 10, A, "A on 10-19")
    # The A/B trial: model B summarizes range 0 only, later than A.
    b0 = claim_and_complete(conn, "ab", 0, B, "B on 0-9")
    assert conn.execute("SELECT compaction.projection_models()").fetchone() == ([],)

    # No preference (the default): the latest wins, as before.
    assert view(conn, "ab") == ([(0, b0), (10, a10), (20, None), (30, None)],
                                [(a0, "superseded")])
    assert_judged_alike(conn, "ab")

    # The owner prefers A: the trial leaves the next Run's history as A made it.
    assert set_models(conn, [A]) == 1
    assert conn.execute("SELECT compaction.projection_models()").fetchone() == ([A],)
    assert view(conn, "ab") == ([(0, a0), (10, a10), (20, None), (30, None)],
                                [(b0, "superseded")])
    assert_judged_alike(conn, "ab")
    text = [m["content"] for m in project_history(conn, "ab", budget_bytes=BIG).messages]
    assert any(t.endswith("\nA on 0-9") for t in text)
    assert not any("B on 0-9" in t for t in text)

    # B preferred: B where it has a summary, A's where B has none (named or not).
    for models in ([B, A], [B]):
        set_models(conn, models)
        assert view(conn, "ab") == ([(0, b0), (10, a10), (20, None), (30, None)],
                                    [(a0, "superseded")])
        assert_judged_alike(conn, "ab")

    # A summary completed under the preference is judged by it at once.
    b10 = claim_and_complete(conn, "ab", 10, B, "B on 10-19")
    assert view(conn, "ab") == ([(0, b0), (10, b10), (20, None), (30, None)],
                                [(a0, "superseded"), (a10, "superseded")])
    assert_judged_alike(conn, "ab")


def test_version_comes_before_the_model_and_the_model_before_the_time(conn: Conn) -> None:
    pairs = History(conn).pairs("vm", 30)
    v2_preferred = import_summary(conn, "vm", pairs, 0, version="conversation-compaction@2",
                                  model=A, completed_at=T0 + timedelta(days=9))
    v3_old = import_summary(conn, "vm", pairs, 0, model=B, completed_at=T0)
    v3_new = import_summary(conn, "vm", pairs, 0, model="model-c",
                            completed_at=T0 + timedelta(days=1))
    set_models(conn, [A, B])
    # @3 before @2 whatever the model; among @3, the named B before the newer, unnamed C.
    assert view(conn, "vm") == ([(0, v3_old), (10, None), (20, None)],
                                sorted([(v2_preferred, "superseded"), (v3_new, "superseded")]))
    assert_judged_alike(conn, "vm")

    # The in-memory twin (project_pairs) orders the same way, given each model's rank.
    stored = conn.execute(
        "SELECT summary_id, from_pair, to_pair, source_message_ids, source_hash, prompt_version,"
        " model, completed_at, summary FROM compaction.summaries WHERE conversation_id = 'vm'"
        " ORDER BY summary_id").fetchall()
    ranks = dict(conn.execute("SELECT summary_id, version_rank"
                              " FROM compaction.projection_summaries('vm', 'default')").fetchall())
    summaries = [StoredSummary(s[0], s[1], s[2], tuple(s[3]), s[4], s[5], True, ranks[s[0]],
                               s[7], s[8], model_rank=model_preference(s[6], [A, B]))
                 for s in stored]
    in_memory = project_pairs(
        [Pair(i, p.run_id, p.user_message_id, p.user_content, p.assistant_message_id,
              p.assistant_content) for i, p in enumerate(pairs)],
        summaries, budget_bytes=BIG)
    assert [(r.summary_id, r.reason) for r in in_memory.rejected_summaries] == view(conn, "vm")[1]
    assert in_memory.to_dict() == project_history(conn, "vm", budget_bytes=BIG).to_dict()
    # The engine's rank is the twin's.
    assert [r[0] for r in conn.execute(
        "SELECT model_rank FROM compaction.projection_summaries('vm', 'default')"
        " ORDER BY summary_id")] == [model_preference(m, [A, B]) for m in (A, B, "model-c")]


@pytest.mark.parametrize("models", [None, [A, A], [A, None], [A, " \t"], ["m"] * 101])
def test_a_bad_preference_is_refused_and_nothing_changes(conn: Conn,
                                                         models: list[str | None] | None) -> None:
    set_models(conn, [B])
    with pytest.raises(InvalidArgument, match="p_models"), wrap_exceptions():
        conn.execute("SELECT compaction.set_projection_models(%s::text[])", (models,))
    assert conn.execute("SELECT compaction.projection_models()").fetchone() == ([B],)


def test_only_the_owner_sets_the_preference_and_every_role_reads_it(
        conn: Conn, login_role: LoginRole) -> None:
    for role in ("compaction_worker", "compaction_reader", "compaction_auditor"):
        with connect_as(login_role(role)) as other:
            assert other.execute("SELECT compaction.projection_models()").fetchone() == ([],)
            with pytest.raises(PycompactorError), wrap_exceptions():
                other.execute("SELECT compaction.set_projection_models('{x}')")
    with connect_as(login_role("compaction_owner")) as owner:
        assert owner.execute("SELECT compaction.set_projection_models('{x}')").fetchone() == (0,)
