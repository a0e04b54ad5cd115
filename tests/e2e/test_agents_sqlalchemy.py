"""Keeping the SDK's own tables: SQLAlchemySession + the recipe + ProjectingSession, end to end.

The OpenAI Agents SDK's real `SQLAlchemySession` (the `postgresql+psycopg` async dialect)
writes three conversations of 45, 60 and 12 turns through the SDK's real `Runner`
(model calls through the real openai client to the loopback server of
tests/modelserver.py), every fourth turn with a function call, its output and an interim
assistant message, questions and answers in Chinese (the SDK stores them `\\uXXXX`-escaped).
Then, as a user would: `pycompactor install-recipe agents-sqlalchemy`; `check-source`
is clean (contract, every lookup indexed, derived state in use); a queue worker finds
nothing queued and says why; the next turn through `ProjectingSession` queues its
conversation, the worker compacts it, and the turn after sends the summary blocks and
the user messages verbatim; `--sweep` compacts the rest; editing an old item's JSON
makes its summary `stale_source`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.extensions.memory import SQLAlchemySession
from agents.memory import Session
from openai import AsyncOpenAI
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from pycompactor import db
from pycompactor.integrations.sdk_storage import ProjectingSession
from pycompactor.projection import marker_line
from pycompactor.summarizers.openai_compatible import load_prompt
from tests.e2e.cli import run_cli
from tests.modelserver import (
    ModelServer,
    RecordedRequest,
    ScriptedResponse,
    serving,
    stop,
    tool_call,
)
from tests.workerkit import events_named, run_worker_cli, worker_env

Conn = psycopg.Connection[Any]
AGENT_MODEL = "agent-model-1"
WORKER_MODEL = "test-model-7"
TURNS = {"conv-a": 45, "conv-b": 60, "conv-c": 12}
_QUESTION = re.compile(r"^Q\[(conv-[a-z])\]-(\d{3})")


def question(conversation: str, i: int) -> str:
    tool = " (use the tool)" if i % 4 == 3 else ""
    return f"Q[{conversation}]-{i:03d}: 基金 F{i} 的净值是多少？{tool}"


def answer(conversation: str, i: int) -> str:
    return (f"A[{conversation}]-{i:03d}: 基金 F{i} 的净值为 {10 + i}.25 元"
            f"（2026-03-{i % 28 + 1:02d}），晨星评级 {i % 5 + 1} 星。")


def interim(conversation: str, i: int) -> str:
    return f"I[{conversation}]-{i:03d}: 让我查一下。"


def is_summarizer(request: RecordedRequest) -> bool:
    messages = request.json["messages"]
    return bool(messages) and messages[0] == {"role": "system", "content": load_prompt()}


def respond(request: RecordedRequest) -> ScriptedResponse:
    payload = request.json
    if is_summarizer(request):
        return stop("SUMMARY: ten NAV answers of funds, each dated, none current.")
    assert payload["model"] == AGENT_MODEL
    users = [m for m in payload["messages"] if m["role"] == "user"]
    text = users[-1]["content"]
    text = text if isinstance(text, str) else text[0]["text"]
    match = _QUESTION.match(text)
    assert match is not None, text
    conversation, i = match.group(1), int(match.group(2))
    if payload["messages"][-1]["role"] == "tool":
        return stop(answer(conversation, i))
    if "(use the tool)" in text:
        return tool_call(interim(conversation, i))
    return stop(answer(conversation, i))


@function_tool
def lookup_nav(fund: int) -> str:
    """Look up a fund's NAV."""
    return f"基金 F{fund} 的净值：12.50"


@pytest.fixture
def server() -> Iterator[ModelServer]:
    yield from serving(respond)


@pytest.fixture(autouse=True)
def no_tracing() -> None:
    set_tracing_disabled(True)  # the SDK would export traces over the network


def sqlalchemy_url(dsn: str) -> str:
    parts = dict(item.split("=", 1) for item in dsn.split())
    return (f"postgresql+psycopg://{parts['user']}@{parts['host']}:{parts['port']}"
            f"/{parts['dbname']}")


def make_agent(client: AsyncOpenAI) -> Agent[Any]:
    return Agent(name="fund-research", instructions="You are a fund research assistant.",
                 model=OpenAIChatCompletionsModel(model=AGENT_MODEL, openai_client=client),
                 tools=[lookup_nav])


def sdk_session(conversation: str, engine: AsyncEngine) -> SQLAlchemySession:
    return SQLAlchemySession(conversation, engine=engine, create_tables=True)


async def _turns(dsn: str, server: ModelServer, plan: list[tuple[str, int]], *,
                 wrapped: bool) -> None:
    """Run the turns through the real Runner, on SQLAlchemySession (wrapped or not)."""
    engine = create_async_engine(sqlalchemy_url(dsn))
    client = AsyncOpenAI(base_url=server.base_url, api_key="sk-agent-test")
    sessions: dict[str, Session] = {}
    try:
        agent = make_agent(client)
        for conversation, i in plan:
            if conversation not in sessions:
                inner = sdk_session(conversation, engine)
                sessions[conversation] = (ProjectingSession(inner, dsn=dsn) if wrapped
                                          else inner)
            result = await Runner.run(agent, question(conversation, i),
                                      session=sessions[conversation])
            assert result.final_output == answer(conversation, i)
    finally:
        for session in sessions.values():
            if isinstance(session, ProjectingSession):
                await session.aclose()
        await client.close()
        await engine.dispose()


def agent_requests(server: ModelServer) -> list[dict[str, Any]]:
    return [r.json for r in server.requests if not is_summarizer(r)]


def summaries_of(conn: Conn, conversation: str) -> dict[int, str]:
    rows = conn.execute("SELECT from_pair, summary FROM compaction.summaries"
                        " WHERE conversation_id = %s ORDER BY from_pair",
                        (conversation,)).fetchall()
    return {int(r[0]): str(r[1]) for r in rows}


def test_sdk_tables_recipe_wrapper_worker_and_stale_edit(
        conn: Conn, dsn: str, server: ModelServer) -> None:
    # 1. The SDK writes history on its own (no pycompactor yet), interleaving sessions.
    longest = max(TURNS.values())
    plan = [(c, i) for i in range(longest) for c, n in TURNS.items() if i < n]
    asyncio.run(_turns(dsn, server, plan, wrapped=False))
    stored = conn.execute("SELECT message_data FROM public.agent_messages"
                          " WHERE session_id = 'conv-a' ORDER BY id").fetchall()
    assert "\\u57fa\\u91d1" in stored[0][0]  # 基金, escaped as the SDK writes it
    kinds = [json.loads(r[0]).get("type", "message") for r in stored]
    assert kinds.count("function_call") == kinds.count("function_call_output") == 11

    # 2. One command installs the recipe; check-source is clean.
    result = run_cli("install-recipe", "agents-sqlalchemy", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    result = run_cli("check-source", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["problems"] == []
    assert report["derived_state"] == "in_use"
    assert [(lk["lookup"], lk["uses_index"]) for lk in report["lookups"]] == [
        ("runs_by_conversation", True), ("run_by_id", True), ("messages_by_run", True),
        ("message_by_id", True), ("message_before", True)]
    assert {s["conversation_id"]: (s["runs"], s["pairs"], s["excluded"])
            for s in report["samples"]} == {c: (n, n, {}) for c, n in TURNS.items()}

    # The pairs are the questions and final answers, decoded; tool traffic is not.
    pairs = db.eligible_pairs(conn, "conv-a")
    assert [(p.user_content, p.assistant_content) for p in pairs] == [
        (question("conv-a", i), answer("conv-a", i)) for i in range(45)]
    roles = [r[0] for r in conn.execute(
        "SELECT role FROM compaction.source_messages WHERE conversation_id = 'conv-a'"
        " ORDER BY seq LIMIT 7")]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    run_3 = [r[0] for r in conn.execute(
        "SELECT role FROM compaction.source_messages WHERE run_id = %s ORDER BY seq",
        (pairs[3].run_id,))]
    assert run_3 == ["user", "assistant_interim", "sdk_item", "sdk_item", "assistant"]

    # 3. The SDK queued nothing: a queue worker claims nothing and says why.
    env = worker_env(dsn, server.base_url)
    code, events, stderr = run_worker_cli("--once", "--model", WORKER_MODEL,
                                          "--log-format", "json", env=env)
    assert code == 0, stderr
    [hint] = events_named(events, "idle_hint")
    assert (hint["reason"], hint["conversation_id"]) == ("targets_not_queued", "conv-a")
    assert list(events_named(events, "claimed")) == []

    # 4. One turn through the wrapper queues conv-a; the worker compacts it (46 pairs:
    # ranges 0-9 and 10-19); the next turn sends those blocks and the user messages.
    asyncio.run(_turns(dsn, server, [("conv-a", 45)], wrapped=True))
    code, events, stderr = run_worker_cli("--once", "--model", WORKER_MODEL,
                                          "--log-format", "json", env=env)
    assert code == 0, stderr
    assert sorted(e["from_pair"] for e in events_named(events, "completed")) == [0, 10]
    done = summaries_of(conn, "conv-a")
    assert sorted(done) == [0, 10]

    asyncio.run(_turns(dsn, server, [("conv-a", 46)], wrapped=True))
    request = agent_requests(server)[-1]
    history = [(m["role"], m["content"]) for m in request["messages"][1:]]
    expected: list[tuple[str, str]] = []
    for start in (0, 10):
        expected += [("user", question("conv-a", i)) for i in range(start, start + 10)]
        expected.append(("assistant", f"{marker_line(start, start + 9)}\n{done[start]}"))
    expected += [turn for i in range(20, 46) for turn in (("user", question("conv-a", i)),
                                                          ("assistant", answer("conv-a", i)))]
    expected.append(("user", question("conv-a", 46)))
    assert history == expected
    body = json.dumps(request, ensure_ascii=False)
    for i in range(20):
        assert answer("conv-a", i) not in body
        assert interim("conv-a", i) not in body

    # 5. --sweep compacts conversations nothing queued: conv-b's 60 pairs, 4 ranges.
    code, events, stderr = run_worker_cli("--once", "--sweep", "--model", WORKER_MODEL,
                                          "--log-format", "json", env=env)
    assert code == 0, stderr
    assert sorted(summaries_of(conn, "conv-b")) == [0, 10, 20, 30]
    assert summaries_of(conn, "conv-c") == {}

    # 6. Editing an old item's JSON in the SDK's table makes its range's summary stale.
    conn.execute(
        "UPDATE public.agent_messages"
        " SET message_data = jsonb_set(message_data::jsonb, '{content,0,text}',"
        "                              to_jsonb('基金 F3：已更正'::text))::text"
        " WHERE id = %s", (int(pairs[3].assistant_message_id),))
    result = run_cli("project", "conv-a", "--budget-bytes", "1000000", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    projection = json.loads(result.stdout)
    assert [(r["from_pair"], r["reason"]) for r in projection["rejected_summaries"]] == [
        (0, "stale_source")]
    assert [p["placement"] for p in projection["pairs"][:20]] == ["raw"] * 10 + [
        "summarized"] * 10
    assert ("assistant", "基金 F3：已更正") in [
        (m["role"], m["content"]) for m in projection["messages"]]
    assert conn.execute("SELECT count(*) FROM compaction.verify_conversation('conv-a')"
                        ).fetchone() == (0,)


def test_projecting_session_writes_through_and_queues(conn: Conn, dsn: str) -> None:
    """add_items, pop_item and clear_session reach the SDK's tables and queue the
    conversation; get_items projects (with `limit`, the newest items)."""

    async def scenario() -> tuple[list[Any], list[Any], Any, list[Any], list[Any]]:
        engine = create_async_engine(sqlalchemy_url(dsn))
        try:
            inner = sdk_session("conv-w", engine)
            await inner.add_items([{"role": "user", "content": "before"}])  # creates tables
            result = run_cli("install-recipe", "agents-sqlalchemy", "--dsn", dsn)
            assert result.returncode == 0, result.stderr
            conn.execute("DELETE FROM compaction.queue")
            session = ProjectingSession(inner, dsn=dsn, budget_bytes=10_000)
            assert isinstance(session, Session)
            assert session.session_id == "conv-w"
            try:
                await session.add_items([
                    {"role": "assistant", "content": "答案一"},
                    {"role": "user", "content": "问题二"},
                    {"type": "reasoning", "id": "rs_1", "summary": []},
                    {"id": "__fake_id__", "type": "message", "role": "assistant",
                     "status": "completed",
                     "content": [{"type": "output_text", "text": "答案二", "annotations": []}]},
                ])
                queued = conn.execute("SELECT conversation_id FROM compaction.queue"
                                      ).fetchall()
                everything = await session.get_items()
                newest = await session.get_items(limit=2)
                popped = await session.pop_item()
                after_pop = await session.get_items()
                await session.clear_session()
                cleared = await session.get_items()
            finally:
                await session.aclose()
            assert queued == [("conv-w",)]
            assert [m["content"] for m in after_pop] == ["before", "答案一"]  # type: ignore[typeddict-item]
            return everything, newest, popped, cleared, await inner.get_items()
        finally:
            await engine.dispose()

    everything, newest, popped, cleared, stored = asyncio.run(scenario())
    assert everything == [{"role": "user", "content": "before"},
                          {"role": "assistant", "content": "答案一"},
                          {"role": "user", "content": "问题二"},
                          {"role": "assistant", "content": "答案二"}]
    assert newest == everything[-2:]
    assert popped["content"][0]["text"] == "答案二"
    assert cleared == []
    assert stored == []
    assert conn.execute("SELECT count(*) FROM compaction.queue WHERE conversation_id = 'conv-w'"
                        ).fetchone() == (1,)
