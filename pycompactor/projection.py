"""Projection for the next Run: source-checked summaries under a UTF-8 byte budget (contract §9).

Two layers:

* a pure, deterministic core over frozen dataclasses. `select_summaries` judges every
  stored summary from metadata (binding, version, whether its source is current): which
  one each range uses, and why each other one is not used; `_walk` decides, from pair
  *metadata* (ids and byte lengths), which newest suffix of history fits the budget;
  `plan_projection` runs both; `render_projection` turns the plan plus the few texts it
  names into chat messages. `project_pairs` runs them over in-memory pairs (judging each
  summary's source with `pycompactor.source_hash`); tests drive it without a database.
  The manifest (`Manifest`) and the rejections (`Rejections`) are sequences whose
  entries are made when read: a long conversation costs no object per pair or summary.
* a thin reading layer that feeds the core from PostgreSQL in one snapshot (so metadata
  and texts agree). One statement (`compaction.projection_read`) gives the newest
  pairs' metadata, every summary's verdict (while the engine keeps its derived state,
  judged when their ranges or they were written; otherwise judged from the views in
  that statement, with every pair) and the texts of what the engine's walk of them
  includes; the driver plans from the metadata itself (`_frame_step`) and renders if
  every text it needs came (`_one_read`). Otherwise (a text not sent) the reads run in
  one read-only repeatable-read transaction (`_projection_steps`): the frame, then only
  the texts the plan includes.
  With the derived state, the text read and shipped grows with the budget, not with the
  conversation (docs/projection.md, "Cost"). The reads are written once, driver-free;
  two small drivers run them, usually one round trip: `project_history` on a
  `psycopg.Connection`, `aproject_history` on a `psycopg.AsyncConnection`.

The vocabulary (constants, inputs, outputs) lives in `pycompactor.projection_types`, the
pure core in `pycompactor.projection_plan`, the reading layer here; every name of the two
is re-exported here (see `__all__`). The rules, the marker line and the manifest shape are
documented in docs/projection.md.
"""

from __future__ import annotations

from collections.abc import (
    AsyncIterator,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager, suppress
from itertools import pairwise
from typing import Any, Final

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from pycompactor import db
from pycompactor.errors import PycompactorError, wrap_exceptions
from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.projection_plan import (
    _BLOCK_OVERHEAD,
    _RAW_PAIR_OVERHEAD,
    _SUMMARIZED_RANGE,
    ChosenSummary,
    Selection,
    _block_cost,
    _Chosen,
    _Columns,
    _columns,
    _flat_ids,
    _plan,
    _preference,
    _range_ids,
    _summary_message_bytes,
    _Walk,
    _walk,
    block_cost,
    check_budget,
    model_preference,
    plan_projection,
    project_pairs,
    render_projection,
    select_summaries,
    summary_reason,
)
from pycompactor.projection_types import (
    _MARKER_BYTES,
    _MARKER_LINE_BYTES,
    _MAX_PAIRS_READ,
    DID_NOT_FIT,
    MAX_BUDGET_BYTES,
    MESSAGE_OVERHEAD_BYTES,
    OMITTED,
    RAW,
    STALE_SOURCE,
    SUMMARIZED,
    SUMMARY_MARKER,
    SUPERSEDED,
    VERSION_NOT_PROJECTABLE,
    ChatMessage,
    EntryT,
    HistoryChanged,
    Manifest,
    PairMeta,
    PairPlacement,
    Placement,
    Plan,
    PlanItem,
    Projection,
    RawItem,
    Reason,
    RejectedSummary,
    Rejections,
    SourcePair,
    StoredSummary,
    SummaryBinding,
    SummaryCandidate,
    SummaryItem,
    _binds_range,
    _Entries,
    marker_line,
    message_cost,
    source_is_current,
    summary_content,
    utf8_len,
)

#: Every name this module offers: its reading layer and, re-exported so that
#: `pycompactor.projection` stays the one place to import them from, the vocabulary of
#: `pycompactor.projection_types` and the pure core of `pycompactor.projection_plan`.
__all__ = [
    "DID_NOT_FIT",
    "MAX_BUDGET_BYTES",
    "MESSAGE_OVERHEAD_BYTES",
    "OMITTED",
    "RAW",
    "STALE_SOURCE",
    "SUMMARIZED",
    "SUMMARY_MARKER",
    "SUPERSEDED",
    "VERSION_NOT_PROJECTABLE",
    "_BLOCK_OVERHEAD",
    "_MARKER_BYTES",
    "_MARKER_LINE_BYTES",
    "_MAX_PAIRS_READ",
    "_OPEN",
    "_RAW_PAIR_OVERHEAD",
    "_REASONS",
    "_SUMMARIZED_RANGE",
    "ChatMessage",
    "ChosenSummary",
    "EntryT",
    "HistoryChanged",
    "Manifest",
    "PairMeta",
    "PairPlacement",
    "Placement",
    "Plan",
    "PlanItem",
    "Projection",
    "RawItem",
    "Reason",
    "RejectedSummary",
    "Rejections",
    "Selection",
    "SourcePair",
    "Steps",
    "StoredSummary",
    "SummaryBinding",
    "SummaryCandidate",
    "SummaryItem",
    "_Chosen",
    "_Columns",
    "_Entries",
    "_Read",
    "_Walk",
    "_aread_in_snapshot",
    "_aread_once",
    "_asnapshot",
    "_binds_range",
    "_block_cost",
    "_columns",
    "_finish",
    "_first_read",
    "_flat_ids",
    "_frame_step",
    "_next_read",
    "_observers",
    "_one_read",
    "_one_read_query",
    "_plan",
    "_preference",
    "_projection_steps",
    "_range_ids",
    "_read_in_snapshot",
    "_read_once",
    "_reason",
    "_snapshot",
    "_summary_message_bytes",
    "_texts",
    "_texts_query",
    "_walk",
    "aproject_history",
    "block_cost",
    "check_budget",
    "marker_line",
    "message_cost",
    "model_preference",
    "observe",
    "plan_projection",
    "project_history",
    "project_pairs",
    "render_projection",
    "select_summaries",
    "source_is_current",
    "summary_content",
    "summary_reason",
    "utf8_len",
]


# --------------------------------------------------------------------------- database


# The statements are db's (db.projection_*_query); all run in one snapshot (_snapshot).

#: Called with every projection this process makes. pycompactor.metrics registers its
#: counter when it is imported, so the refusals are counted where they happen (the
#: agent's process) while this module knows nothing of metrics.
_observers: list[Callable[[Projection], None]] = []


def observe(callback: Callable[[Projection], None]) -> None:
    """Call `callback` with every projection made in this process from now on."""
    _observers.append(callback)


#: The driver runs each yielded statement and sends back all its rows as tuples.
Steps = Generator[db.Query, list[tuple[Any, ...]], Plan]


def _first_read(budget: int) -> int:
    """How many of the newest pairs the first read asks for: enough for the budget when a
    pair costs about 1 KiB, in whole ranges, at least two ranges. The walk asks for more
    when it gets past them (rarely: summary blocks cost less than their raw pairs)."""
    wanted = max(2 * PAIRS_PER_RANGE, budget // 1024)
    return min(wanted + (-wanted) % PAIRS_PER_RANGE, _MAX_PAIRS_READ)


def _next_read(given: int, spent: int, budget: int) -> int:
    """How many of the newest pairs to ask for when the walk spent `spent` bytes over the
    `given` newest pairs and needs more: as many as the whole budget would take at the
    rate it was spent, a quarter more, and never fewer than twice as many, in whole
    ranges."""
    wanted = max(2 * given, -(-given * budget * 5 // (4 * max(spent, 1))))
    return min(wanted + (-wanted) % PAIRS_PER_RANGE, _MAX_PAIRS_READ)


def _frame_step(frame: Sequence[Any], budget: int) -> Plan | int:
    """What projection_frame's row (its first 11 columns) decides: the plan when the walk
    finished within its pairs; else how many of the newest pairs to read next. Judged
    from the views (the derived state out of use: `derived` false) the frame holds every
    pair, so the walk always finishes."""
    (_derived, count, first, users, assistants, user_sizes, assistant_sizes,
     summary_ids, from_pairs, reasons, sizes) = frame[:11]
    if users is None:
        raise PycompactorError("the engine gave no projection frame; run `pycompactor migrate`"
                               " to the version of this pycompactor")
    if not len(users) == len(assistants) == len(user_sizes) == len(assistant_sizes):
        raise PycompactorError("the engine gave a frame whose pair columns differ in length;"
                               " upgrade pycompactor to the version of the migrations")
    chosen = {f: _Chosen(sid, f, f + PAIRS_PER_RANGE - 1, size)
              for sid, f, reason, size in zip(summary_ids, from_pairs, reasons, sizes,
                                              strict=True)
              if reason is None and size is not None}
    walk = _walk(_Columns(users, assistants, user_sizes, assistant_sizes), first, chosen,
                 budget)
    if not walk.finished:
        return _next_read(count - first, budget - walk.remaining, budget)
    verdicts: Iterable[tuple[int, int, Reason | None]] = zip(
        summary_ids, from_pairs, map(_reason, reasons), strict=True)
    keys = list(zip(from_pairs, summary_ids, strict=True))
    if any(a > b for a, b in pairwise(keys)):
        verdicts = sorted(verdicts, key=lambda v: (v[1], v[0]))
    return _plan(walk, verdicts, budget)


def _projection_steps(conversation_id: str, budget: int, scope: str,
                      wanted: int | None = None) -> Steps:
    """The reads of a projection in a snapshot, driver-free: yields each statement,
    receives its rows, and returns the plan. `project_history` (psycopg.Connection) and
    `aproject_history` (psycopg.AsyncConnection) run the same steps, so both give the
    same projection. They run them when the one statement of `_one_read_query` did not
    give all a plan needs.

    One statement (compaction.projection_frame) gives the newest `wanted` pairs'
    metadata and every summary's verdict; if the walk gets past those pairs, it is asked
    again for as many as the rest of the budget may need (judged from the views, the
    frame holds every pair at once). No text is read here: the texts the plan includes
    are read by the driver (`_texts_query`).
    """
    wanted = _first_read(budget) if wanted is None else wanted
    while True:
        [frame] = yield db.projection_frame_query(conversation_id, scope, wanted)
        step = _frame_step(frame, budget)
        if isinstance(step, Plan):
            return step
        wanted = step


def _one_read_query(conversation_id: str, budget: int, scope: str) -> db.Query:
    """The usual projection's one statement (compaction.projection_read): the frame of
    the newest pairs and the texts of what the engine's walk of it includes."""
    return db.projection_read_query(conversation_id, scope, _first_read(budget), budget,
                                    _MARKER_BYTES)


#: A plan and the texts it names: message texts by id, summary texts by summary id.
_Read = tuple[Plan, dict[str, str], dict[int, str]]


def _one_read(rows: Sequence[Sequence[Any]], budget: int) -> _Read | int:
    """The plan and its texts from `_one_read_query`'s rows, when they hold every text the
    plan includes; else how many of the newest pairs the reads in a snapshot
    (`_projection_steps`) start from. The driver's walk decides: the engine's walk only
    chose which texts to send, so a text it did not send costs a second read, never a
    different projection."""
    step = _frame_step(rows[0], budget)
    if not isinstance(step, Plan):
        return step
    message_texts, summary_texts = _texts(rows[1:])
    if (all(m in message_texts for m in step.message_ids)
            and all(s in summary_texts for s in step.summary_ids)):
        return step, message_texts, summary_texts
    return _first_read(budget)


_REASONS: Final[dict[str | None, Reason | None]] = {
    None: None, VERSION_NOT_PROJECTABLE: VERSION_NOT_PROJECTABLE, STALE_SOURCE: STALE_SOURCE,
    SUPERSEDED: SUPERSEDED,
}


def _reason(value: str | None) -> Reason | None:
    """A verdict from projection_frame, checked against the reasons this module knows."""
    try:
        return _REASONS[value]
    except KeyError:
        raise PycompactorError(
            f"the engine gave an unknown summary verdict {value!r}; upgrade pycompactor "
            "to the version of the migrations") from None


def _texts_query(conversation_id: str, plan: Plan) -> db.Query | None:
    """The one statement reading the texts a plan includes (None when it includes none)."""
    if not plan.items:
        return None
    return db.projection_texts_query(conversation_id, plan.message_ids, plan.summary_ids)


def _texts(rows: Iterable[Sequence[Any]]) -> tuple[dict[str, str], dict[int, str]]:
    """Message and summary texts from rows ending in (message_id, summary_id, content):
    db.projection_texts_query's, or projection_read's text rows."""
    message_texts: dict[str, str] = {}
    summary_texts: dict[int, str] = {}
    for row in rows:
        message_id, summary_id, content = row[-3], row[-2], row[-1]
        if message_id is not None:
            message_texts[message_id] = content
        elif summary_id is not None:
            summary_texts[summary_id] = content
    return message_texts, summary_texts


def _finish(plan: Plan, message_texts: Mapping[str, str],
            summary_texts: Mapping[int, str]) -> Projection:
    """Render the plan with the texts read and tell the observers (pycompactor.metrics
    counts the refusals)."""
    projection = render_projection(plan, message_texts, summary_texts)
    for observer in _observers:
        observer(projection)
    return projection


_OPEN = (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)


@contextmanager
def _snapshot(conn: psycopg.Connection[Any]) -> Iterator[bool]:
    """One read-only repeatable-read transaction, unless the caller already has one.

    The plan is made from metadata and the texts are read afterwards; one snapshot keeps
    them consistent (render_projection still checks). Inside a caller's transaction its
    own isolation level applies. Transaction-scoped only, so PgBouncer pooling is fine.
    Yields True on an autocommit connection: the reads then open the transaction
    themselves (PROJECTION_BEGIN_SQL travels with the first read, PROJECTION_END_SQL with
    the texts) and pay no round trip for it; it is rolled back here if they fail.
    """
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        yield False
    elif not conn.autocommit:
        with conn.transaction():
            conn.execute(db.PROJECTION_SNAPSHOT_SQL)
            yield False
    else:
        try:
            yield True
        finally:
            if conn.info.transaction_status in _OPEN:
                with suppress(psycopg.Error):
                    conn.execute(db.PROJECTION_ABORT_SQL)


@asynccontextmanager
async def _asnapshot(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[bool]:
    """`_snapshot` on an async connection."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        yield False
    elif not conn.autocommit:
        async with conn.transaction():
            await conn.execute(db.PROJECTION_SNAPSHOT_SQL)
            yield False
    else:
        try:
            yield True
        finally:
            if conn.info.transaction_status in _OPEN:
                with suppress(psycopg.Error):
                    await conn.execute(db.PROJECTION_ABORT_SQL)


def project_history(
    conn: psycopg.Connection[Any],
    conversation_id: str,
    *,
    budget_bytes: int,
    scope: str = "default",
) -> Projection:
    """History for the next Run of a conversation under a UTF-8 byte budget (contract §9).

    Reads the newest pairs' metadata and every summary's verdict (whether a summary's
    source is current comes from the engine's derived state, or is judged from the
    views while that is out of use), plans, and renders only the texts the plan
    includes: usually one statement (compaction.projection_read, one round trip and one
    snapshot; on an autocommit connection no transaction of its own), text read in
    proportion to the budget, whatever the conversation's length. When that statement
    cannot give all the plan needs (a text the engine's walk did not send), the reads
    run again in one read-only snapshot.
    Every summary gets its reason (a stale one is `stale_source` whatever the budget).
    An unknown conversation gives an empty projection; a negative budget raises UsageError.
    """
    budget = check_budget(budget_bytes)
    db.check_client_encoding(conn)
    with wrap_exceptions():
        read = _read_once(conn, conversation_id, budget, scope)
        if isinstance(read, int):
            read = _read_in_snapshot(conn, conversation_id, budget, scope, read)
    return _finish(*read)


def _read_once(conn: psycopg.Connection[Any], conversation_id: str, budget: int,
               scope: str) -> _Read | int:
    """`_one_read_query` as one statement: its own snapshot on an autocommit connection,
    the caller's transaction inside one, else a transaction of ours closed at once."""
    query = _one_read_query(conversation_id, budget, scope)
    with conn.cursor(row_factory=tuple_row) as cur:
        if conn.autocommit or conn.info.transaction_status != pq.TransactionStatus.IDLE:
            cur.execute(*query)
            rows = cur.fetchall()
        else:
            with conn.transaction():
                cur.execute(*query)
                rows = cur.fetchall()
    return _one_read(rows, budget)


def _read_in_snapshot(conn: psycopg.Connection[Any], conversation_id: str, budget: int,
                      scope: str, wanted: int) -> _Read:
    """`_projection_steps` from `wanted` pairs, then the texts, in one snapshot: on an
    autocommit connection two round trips (BEGIN with the first read, COMMIT with the
    texts)."""
    steps = _projection_steps(conversation_id, budget, scope, wanted)
    text_rows: list[tuple[Any, ...]] = []
    with _snapshot(conn) as own, conn.cursor(row_factory=tuple_row) as cur:
        begin = own
        try:
            query = next(steps)
            while True:
                if begin:
                    with conn.pipeline():
                        conn.execute(db.PROJECTION_BEGIN_SQL)
                        cur.execute(*query)
                    begin = False
                else:
                    cur.execute(*query)
                query = steps.send(cur.fetchall())
        except StopIteration as done:
            plan: Plan = done.value
        texts = _texts_query(conversation_id, plan)
        if own:
            with conn.pipeline():
                if texts is not None:
                    cur.execute(*texts)
                conn.execute(db.PROJECTION_END_SQL)
        elif texts is not None:
            cur.execute(*texts)
        if texts is not None:
            text_rows = cur.fetchall()
    return (plan, *_texts(text_rows))


async def aproject_history(
    conn: psycopg.AsyncConnection[Any],
    conversation_id: str,
    *,
    budget_bytes: int,
    scope: str = "default",
) -> Projection:
    """`project_history` on a `psycopg.AsyncConnection`: the same statements, in one
    statement or in the same read-only snapshot, the same plan and rendering, so the
    same projection."""
    budget = check_budget(budget_bytes)
    db.check_client_encoding(conn)
    with wrap_exceptions():
        read = await _aread_once(conn, conversation_id, budget, scope)
        if isinstance(read, int):
            read = await _aread_in_snapshot(conn, conversation_id, budget, scope, read)
    return _finish(*read)


async def _aread_once(conn: psycopg.AsyncConnection[Any], conversation_id: str,
                      budget: int, scope: str) -> _Read | int:
    """`_read_once` on an async connection."""
    query = _one_read_query(conversation_id, budget, scope)
    async with conn.cursor(row_factory=tuple_row) as cur:
        if conn.autocommit or conn.info.transaction_status != pq.TransactionStatus.IDLE:
            await cur.execute(*query)
            rows = await cur.fetchall()
        else:
            async with conn.transaction():
                await cur.execute(*query)
                rows = await cur.fetchall()
    return _one_read(rows, budget)


async def _aread_in_snapshot(conn: psycopg.AsyncConnection[Any], conversation_id: str,
                             budget: int, scope: str, wanted: int) -> _Read:
    """`_read_in_snapshot` on an async connection."""
    steps = _projection_steps(conversation_id, budget, scope, wanted)
    text_rows: list[tuple[Any, ...]] = []
    async with _asnapshot(conn) as own, conn.cursor(row_factory=tuple_row) as cur:
        begin = own
        try:
            query = next(steps)
            while True:
                if begin:
                    async with conn.pipeline():
                        await conn.execute(db.PROJECTION_BEGIN_SQL)
                        await cur.execute(*query)
                    begin = False
                else:
                    await cur.execute(*query)
                query = steps.send(await cur.fetchall())
        except StopIteration as done:
            plan: Plan = done.value
        texts = _texts_query(conversation_id, plan)
        if own:
            async with conn.pipeline():
                if texts is not None:
                    await cur.execute(*texts)
                await conn.execute(db.PROJECTION_END_SQL)
        elif texts is not None:
            await cur.execute(*texts)
        if texts is not None:
            text_rows = await cur.fetchall()
    return (plan, *_texts(text_rows))
