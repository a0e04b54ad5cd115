"""The OpenAI Agents SDK session end to end: the SDK's real `Runner`, an OpenAI-compatible
server on loopback (tests/modelserver.py, chat completions), the real worker.

35 turns through the session make 35 settled runs; a worker pass summarizes pairs 0-9 (the
summarizer's request goes to the same server, which answers it with a recognisable
summary); the 36th request then holds the 10 original user messages of pairs 0-9, the
summary of pairs 0-9, and none of those pairs' raw assistant replies.
"""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.memory import Session
from openai import AsyncOpenAI
from psycopg import sql

from pycompactor import db
from pycompactor.errors import PermissionDenied
from pycompactor.integrations.openai_agents import PycompactorSession
from pycompactor.projection import marker_line
from pycompactor.summarizers.openai_compatible import load_prompt, make_summarizer
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.process import WorkerConfig, run_worker
from tests.modelserver import (
    ModelServer,
    RecordedRequest,
    ScriptedResponse,
    serving,
    stop,
    tool_call,
)
from tests.workerkit import MODEL, attempts, summaries

Conn = psycopg.Connection[Any]
AGENT_MODEL = "agent-model-1"
# No figure the replies do not hold (the worker refuses invented figures, contract §8).
SUMMARY = "SUMMARY of F0 to F9: the replies gave NAVs of those funds, each dated, none current."
TURNS = 35


def question(i: int) -> str:
    return f"QUESTION-{i:03d}: what was the NAV of fund F{i}?"


def answer(i: int) -> str:
    return f"ANSWER-{i:03d}: fund F{i} had a NAV of {10 + i}.25 USD on 2026-03-{i % 28 + 1:02d}."


def is_summarizer(request: RecordedRequest) -> bool:
    messages = request.json["messages"]
    return bool(messages) and messages[0] == {"role": "system", "content": load_prompt()}


def agent_requests(server: ModelServer) -> list[dict[str, Any]]:
    return [r.json for r in server.requests if not is_summarizer(r)]


def respond(request: RecordedRequest) -> ScriptedResponse:
    if is_summarizer(request):
        return stop(SUMMARY)
    payload = request.json
    assert payload["model"] == AGENT_MODEL
    last = payload["messages"][-1]
    if last["role"] == "tool":  # the tool test: answer after the tool's output
        return stop(f"FINAL after tool: {last['content']}")
    text = last["content"] if isinstance(last["content"], str) else last["content"][0]["text"]
    i = int(text.split(":", 1)[0].removeprefix("QUESTION-"))
    if "use the tool" in text:
        return tool_call("Let me look that up.")
    return stop(answer(i))


@pytest.fixture
def server() -> Iterator[ModelServer]:
    yield from serving(respond)


@pytest.fixture(autouse=True)
def no_tracing() -> None:
    # The SDK would export traces over the network.
    set_tracing_disabled(True)


def make_agent(client: AsyncOpenAI, **kwargs: Any) -> Agent[Any]:
    return Agent(name="fund-research", instructions="You are a fund research assistant.",
                 model=OpenAIChatCompletionsModel(model=AGENT_MODEL, openai_client=client),
                 **kwargs)


def test_36th_request_holds_user_messages_and_summary_of_pairs_0_to_9(
        conn: Conn, dsn: str, server: ModelServer) -> None:
    session = PycompactorSession("agent-conv", dsn=dsn, budget_bytes=200_000)
    assert isinstance(session, Session)  # the SDK's runtime-checkable protocol

    async def scenario() -> None:
        client = AsyncOpenAI(base_url=server.base_url, api_key="sk-agent-test")
        try:
            agent = make_agent(client)
            for i in range(TURNS):
                result = await Runner.run(agent, question(i), session=session)
                assert result.final_output == answer(i)
            # The real worker, in a thread (no transaction open across its model call).
            config = WorkerConfig(model=MODEL, dsn=dsn, once=True)
            summarizer = make_summarizer(MODEL, base_url=server.base_url, api_key="sk-w")
            try:
                report = await asyncio.to_thread(
                    run_worker, config, summarizer, log=EventLog("json", io.StringIO()))
            finally:
                summarizer.close()
            assert report.outcomes == {"completed": 1}
            result = await Runner.run(agent, question(TURNS), session=session)
            assert result.final_output == answer(TURNS)
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        session.close()

    # The source holds 36 settled runs, one pair each; the worker summarized 0-9 only.
    assert len(db.eligible_pairs(conn, "agent-conv")) == TURNS + 1
    assert [(a.from_pair, a.state) for a in attempts(conn, "agent-conv")] == [(0, "completed")]
    assert summaries(conn, "agent-conv") == [("agent-conv", 0, SUMMARY)]

    requests = agent_requests(server)
    assert len(requests) == TURNS + 1
    messages = requests[TURNS]["messages"]
    body = json.dumps(requests[TURNS], ensure_ascii=False)
    assert messages[0]["role"] == "system"
    history = [(m["role"], m["content"]) for m in messages[1:]]
    summary_message = ("assistant", f"{marker_line(0, 9)}\n{SUMMARY}")
    assert history == (
        [("user", question(i)) for i in range(10)]
        + [summary_message]
        + [turn for i in range(10, TURNS) for turn in (("user", question(i)),
                                                       ("assistant", answer(i)))]
        + [("user", question(TURNS))]
    )
    for i in range(10):
        assert answer(i) not in body  # no raw reply of pairs 0-9, anywhere in the request
    assert session.last_projection is not None
    assert [p.placement for p in session.last_projection.pairs[:10]] == ["summarized"] * 10
    # The 35th request, before the worker ran, still had every raw pair.
    assert answer(0) in json.dumps(requests[TURNS - 1])


def test_tool_calls_are_stored_but_not_part_of_pairs(
        conn: Conn, dsn: str, server: ModelServer) -> None:
    """A turn with a tool call: the SDK saves the input, then the model call's tool call and
    its output, then the final answer. Only the final answer forms the pair with the
    question; the tool items are kept (role sdk_item) and never replayed."""

    @function_tool
    def lookup_nav(fund: int) -> str:
        """Look up a fund's NAV."""
        return f"NAV of F{fund} is 12.50"

    session = PycompactorSession("agent-tools", dsn=dsn)

    async def scenario() -> list[Any]:
        client = AsyncOpenAI(base_url=server.base_url, api_key="sk-agent-test")
        try:
            agent = make_agent(client, tools=[lookup_nav])
            result = await Runner.run(agent, "QUESTION-000: use the tool", session=session,
                                      run_config=RunConfig(tracing_disabled=True))
            assert result.final_output == "FINAL after tool: NAV of F0 is 12.50"
            return await session.get_items()
        finally:
            await client.close()

    try:
        items = asyncio.run(scenario())
        rows = conn.execute(
            "SELECT role, status, content FROM compaction_source.messages"
            " WHERE conversation_id = 'agent-tools' ORDER BY seq").fetchall()
        assert [r[0] for r in rows] == ["user", "assistant_interim", "sdk_item", "sdk_item",
                                        "assistant"]
        assert json.loads(rows[2][2])["type"] == "function_call"
        assert json.loads(rows[3][2])["type"] == "function_call_output"
        [pair] = db.eligible_pairs(conn, "agent-tools")
        assert (pair.user_content, pair.assistant_content) == (
            "QUESTION-000: use the tool", "FINAL after tool: NAV of F0 is 12.50")
        assert items == [{"role": "user", "content": "QUESTION-000: use the tool"},
                         {"role": "assistant", "content": "FINAL after tool: NAV of F0 is 12.50"}]

        # pop_item takes the newest stored item back off: the answer. The run is no longer
        # settled (no pair), and the interim message does not take the answer's place.
        popped = asyncio.run(session.pop_item())
        assert popped == {"role": "assistant", "content": "FINAL after tool: NAV of F0 is 12.50"}
        assert db.eligible_pairs(conn, "agent-tools") == []
        assert asyncio.run(session.pop_item()) == json.loads(rows[3][2])

        asyncio.run(session.clear_session())
        assert asyncio.run(session.get_items()) == []
        assert asyncio.run(session.pop_item()) is None
        assert conn.execute("SELECT count(*) FROM compaction_source.runs"
                            " WHERE conversation_id = 'agent-tools'").fetchone() == (0,)
    finally:
        session.close()


def test_limit_returns_the_newest_items(conn: Conn, dsn: str) -> None:
    session = PycompactorSession("agent-limit", dsn=dsn)
    try:
        for i in range(3):
            asyncio.run(session.add_items([
                {"role": "user", "content": question(i)},
                {"type": "reasoning", "id": "rs_1", "summary": []},  # stored, never replayed
                {"type": "message", "role": "assistant", "status": "completed", "id": "x",
                 "content": [{"type": "output_text", "text": answer(i), "annotations": []}]},
            ]))
        everything = asyncio.run(session.get_items())
        assert [m["content"] for m in everything] == [  # type: ignore[typeddict-item]
            text for i in range(3) for text in (question(i), answer(i))]
        assert asyncio.run(session.get_items(limit=2)) == everything[-2:]
        assert asyncio.run(session.get_items(limit=0)) == []
    finally:
        session.close()


def test_documented_grants_are_enough_for_the_session(conn: Conn, dsn: str) -> None:
    """The agent role of docs/agents.md (compaction_reader plus DML on the reference
    tables) can store turns and project them; the triggers still queue the conversation."""
    role = f"agent_app_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN IN ROLE compaction_reader").format(
        sql.Identifier(role)))
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA compaction_source TO {}").format(
        sql.Identifier(role)))
    conn.execute(sql.SQL(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON compaction_source.conversations,"
        " compaction_source.runs, compaction_source.messages TO {}").format(sql.Identifier(role)))

    def connect() -> Conn:
        app = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
        app.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
        return app

    session = PycompactorSession("agent-grants", connect=connect)
    try:
        for i in range(2):
            asyncio.run(session.add_items([{"role": "user", "content": question(i)}]))
            asyncio.run(session.add_items([{"role": "assistant", "content": answer(i)}]))
        assert [m["content"] for m in asyncio.run(session.get_items())] == [  # type: ignore[typeddict-item]
            question(0), answer(0), question(1), answer(1)]
        assert asyncio.run(session.pop_item()) == {"role": "assistant", "content": answer(1)}
        with pytest.raises(PermissionDenied):
            _dequeue_as(connect)
        asyncio.run(session.clear_session())
        assert asyncio.run(session.get_items()) == []
    finally:
        session.close()
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert conn.execute("SELECT count(*) FROM compaction.queue"
                        " WHERE conversation_id = 'agent-grants'").fetchone() == (1,)


def _dequeue_as(connect: Callable[[], Conn]) -> None:
    """The agent's role is a reader: it cannot take work off the queue."""
    with connect() as app:
        db.dequeue(app, 1)
