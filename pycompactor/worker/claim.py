"""The claiming side of the worker: the loop of passes, finding work (the queue, one
conversation, or the sweep), reaping, the idle hint, settling queue entries, and per
conversation the claim and its answers. `Worker` in `pycompactor.worker` inherits it;
running an attempt and recording it stay there."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Concatenate

from pycompactor import db, metrics
from pycompactor.errors import (
    DatabaseTimeout,
    LockTimeout,
    PycompactorError,
)
from pycompactor.models import QueuedConversation, RangeClaim
from pycompactor.summarizers.openai_compatible import (
    PROMPT_VERSION,
)
from pycompactor.worker.connections import Connections, is_transient
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.types import (
    _DB_BACKOFF_MAX,
    _DB_BACKOFF_START,
    _HINT_PROBE_CONVERSATIONS,
    _IDLE_START_SECONDS,
    _RETRY_LATER,
    Candidate,
    ClaimedJob,
    Params,
    Result,
    WorkerConfig,
)


class _Claiming:
    """The claiming loop of `pycompactor.worker.Worker` (a base class of it): passes,
    reaping, the idle hint, finding work (queue, one conversation, sweep), settling queue
    entries, and per conversation the claim and its answers."""

    if TYPE_CHECKING:
        # What the loop uses of the Worker (defined there).
        config: WorkerConfig
        _pool: Connections
        _log: EventLog
        _slots: threading.BoundedSemaphore
        _counts_lock: threading.Lock
        _passes: int
        _refused: Counter[str]
        _hinted: bool
        _last_reap: float
        _queue_lease: timedelta
        _seen_targets: int
        _sweep_after: str
        _unsettled: list[QueuedConversation]
        _warned: bool

        @property
        def stopping(self) -> bool: ...
        def _sleep(self, seconds: float) -> None: ...
        def _take_slot(self) -> bool: ...
        def _release_slots(self, count: int) -> None: ...
        def _start(self, job: ClaimedJob, lease_expires_at: datetime | None) -> None: ...
        def _warn_if_unknown(self, conversation_id: str) -> None: ...
        def _db(self, call: Callable[Concatenate[db.Connection, Params], Result],
                *args: Params.args, **kwargs: Params.kwargs) -> Result: ...

    def _loop(self) -> None:
        idle = _IDLE_START_SECONDS
        db_backoff = _DB_BACKOFF_START
        while not self.stopping:
            # Dequeue only when a local slot is free: work taken off the queue should not
            # wait in this process while other workers idle.
            if not self._take_slot():
                break
            self._slots.release()  # only this thread claims, so the slot stays free
            try:
                busy = self._pass()
            except PycompactorError as exc:
                if not is_transient(exc):
                    raise
                self._log.emit("db_error", error=str(exc), retry_in_seconds=db_backoff)
                self._pool.close_all()
                self._sleep(db_backoff)
                db_backoff = min(db_backoff * 2, _DB_BACKOFF_MAX)
                continue
            db_backoff = _DB_BACKOFF_START
            if busy:
                idle = _IDLE_START_SECONDS
            else:
                self._sleep(idle)
                idle = min(idle * 2, max(self.config.poll_seconds, _IDLE_START_SECONDS))

    # -- one pass ----------------------------------------------------------------------

    def _pass(self) -> bool:
        """Reap, find conversations, claim what is claimable. True if anything was claimed
        without hitting global admission (the loop then goes again without backing off)."""
        cfg = self.config
        with self._counts_lock:
            self._passes += 1
        self._release(list(self._unsettled))
        self._reap()
        claimed = 0
        examined = 0
        throttled = False
        for conversation_id, entries in self._work():
            examined += 1
            if self.stopping or throttled:
                self._release(entries)
                continue
            n, admission_full = self._process(conversation_id)
            self._ack(entries)
            claimed += n
            throttled = throttled or admission_full
        if cfg.conversation is not None and not self._seen_targets and not self._warned:
            # Asked only when --conversation gave nothing to look at: a pass that found
            # targets costs no statement more.
            self._warned = True
            self._warn_if_unknown(cfg.conversation)
        if (examined == 0 and not self._hinted and not self.stopping
                and cfg.conversation is None and not cfg.sweep):
            self._hinted = True
            self._hint_unqueued()
        return claimed > 0 and not throttled and not cfg.once

    def _hint_unqueued(self) -> None:
        """Nothing was queued: say why when a conversation has targets nothing queued."""
        cfg = self.config
        try:
            found = self._db(db.unqueued_targets, cfg.scope, cfg.model, PROMPT_VERSION,
                             _HINT_PROBE_CONVERSATIONS)
            if found is not None:
                self._log.emit(
                    "idle_hint", reason="targets_not_queued", scope=cfg.scope,
                    conversation_id=found[0], targets=found[1],
                    hint="the queue is empty but this conversation has targets without a"
                         " summary: nothing queued it. Call"
                         " compaction.enqueue(conversation_id) after each settled Run (the"
                         " SDK session wrappers do), or run the worker with --sweep")
        except PycompactorError as exc:
            # A lost connection is reported like any other (the loop logs db_error and
            # reconnects), not swallowed with the hint; anything else only costs the hint.
            if is_transient(exc):
                raise
            return

    def _reap(self) -> None:
        # Claims reap the identity they touch; this catches the rest (and re-queues a dead
        # worker's conversation), at most once per poll interval or tenth of our lease in
        # loop mode: passes can be many per second when busy, and other workers' leases
        # may be shorter than ours.
        now = time.monotonic()
        every = min(self.config.lease.total_seconds() / 10, self.config.poll_seconds)
        if not self.config.once and now - self._last_reap < every:
            return
        self._last_reap = now
        reaped = self._db(db.reap)
        if reaped:
            self._log.emit("reaped", count=reaped)

    def _work(self) -> Iterator[tuple[str, list[QueuedConversation]]]:
        """Conversations to examine, each with the queue entries it came from (to ack)."""
        cfg = self.config
        if cfg.conversation is not None:
            yield cfg.conversation, []
            return
        if cfg.sweep:
            yield from self._sweep()
            return
        seen: set[tuple[str, str]] = set()
        while not self.stopping:
            limit = min(cfg.batch_size if cfg.once else cfg.concurrency, db.DEQUEUE_LIMIT)
            # Only this worker's scope: other scopes' entries are never touched.
            batch = self._db(db.dequeue, limit, scope=cfg.scope, lease=self._queue_lease)
            metrics.dequeued(len(batch), _oldest_age(batch, self._queue_lease))
            if not batch:
                return
            self._unsettled.extend(batch)
            for i, entry in enumerate(batch):
                key = (entry.conversation_id, entry.scope)
                if key in seen or self.stopping:
                    # Back where this pass started (our own put-backs): the pass is over.
                    self._release(batch[i:])
                    return
                seen.add(key)
                yield entry.conversation_id, [entry]
            if not cfg.once:
                return  # loop mode: one batch per pass, so the reaper and backoff run

    def _sweep(self) -> Iterator[tuple[str, list[QueuedConversation]]]:
        """--sweep: every conversation of source_runs in id order, a page per statement.

        With --once, the whole walk; in the loop, one page per pass from where the last
        one stopped (wrapping around), so a full sweep is slow and spread out.
        """
        cfg = self.config
        while not self.stopping:
            page = self._db(db.conversations_after, self._sweep_after, cfg.batch_size)
            self._sweep_after = page[-1] if len(page) == cfg.batch_size else ""
            for conversation_id in page:
                if self.stopping:
                    return
                yield conversation_id, []
            if not cfg.once or not self._sweep_after:
                return

    def _release(self, entries: Sequence[QueuedConversation]) -> None:
        """Give leased entries back unexamined, in their original place."""
        self._end_leases(entries, db.release)

    def _ack(self, entries: Sequence[QueuedConversation]) -> None:
        """The conversation was examined: acknowledge its entries (an enqueue made during
        the lease, ours or new history's, keeps the entry waiting)."""
        self._end_leases(entries, db.ack)

    def _end_leases(self, entries: Sequence[QueuedConversation],
                    call: Callable[[db.Connection, QueuedConversation], object]) -> None:
        # lease_lost answers need nothing: the lease ran out and the entry is another
        # worker's (or gone).
        for entry in entries:
            try:
                self._db(call, entry)
            except DatabaseTimeout as exc:
                # A writer holds the entry in a long transaction: leave it leased; the
                # lease runs out and a later pass examines the conversation again.
                self._log.emit("target_skipped", conversation_id=entry.conversation_id,
                               outcome="skipped",
                               reason="lock_timeout" if isinstance(exc, LockTimeout)
                               else "statement_timeout", error=str(exc))
            self._settled([entry])

    def _settled(self, entries: Sequence[QueuedConversation]) -> None:
        for entry in entries:
            with contextlib.suppress(ValueError):
                self._unsettled.remove(entry)

    def _process(self, conversation_id: str) -> tuple[int, bool]:
        """Examine one conversation and claim its claimable targets; (claimed, throttled).

        The look and the first claims are one call (`claim_next_targets`, one judgement of
        the conversation): it claims up to as many targets as there are model calls free
        now (none: the look alone), passing over a range refused for itself. What it did
        not try waits for free model calls and goes in `claim_targets` batches."""
        cfg = self.config
        free = self._free_slots()
        try:
            targets = self._db(db.claim_next_targets, conversation_id, cfg.scope, free,
                               cfg.model, PROMPT_VERSION, cfg.worker_id, lease=cfg.lease)
        except DatabaseTimeout as exc:
            self._release_slots(free)
            self._skipped(conversation_id, None, exc)
            return 0, False
        except BaseException:
            self._release_slots(free)
            raise
        self._seen_targets += len(targets)
        remaining: list[Candidate] = []
        answered: list[tuple[Candidate, RangeClaim]] = []
        for target in targets:
            if target.completed:
                metrics.target_skipped("already_completed")
                self._log.emit("target_skipped", conversation_id=conversation_id,
                               from_pair=target.from_pair, outcome="skipped",
                               reason="already_completed")
                continue
            candidate = Candidate(conversation_id, target.from_pair,
                                  target.source_message_ids, target.source_hash)
            if target.claimed is None or target.reason is None:
                remaining.append(candidate)
            else:
                answered.append((candidate, RangeClaim(
                    target.from_pair, target.claimed, target.reason, target.job_id,
                    target.attempt, target.lease_expires_at)))
        # A claimed range keeps one of the slots taken; the rest go back.
        self._release_slots(free - sum(1 for _, answer in answered if answer.claimed))
        claimed, requeue, admission_full = self._answer(conversation_id, answered,
                                                        slot_each=False)
        while remaining:
            if admission_full or not self._take_slot():
                requeue = True  # stopping or throttled before every target was tried
                break
            # One claim call for as many targets as there are model calls free: the
            # database locks and judges the conversation once for all of them.
            batch = [remaining.pop(0)]
            while (remaining and len(batch) < db.CLAIM_BATCH_LIMIT and not self.stopping
                   and self._slots.acquire(blocking=False)):
                batch.append(remaining.pop(0))
            try:
                results = self._db(
                    db.claim_targets, conversation_id, cfg.scope,
                    [(c.from_pair, c.source_message_ids, c.source_hash) for c in batch],
                    cfg.model, PROMPT_VERSION, cfg.worker_id, lease=cfg.lease,
                )
            except DatabaseTimeout as exc:
                # A hung session holds this conversation's lock (or the database is
                # overloaded): give up the conversation for this pass, keep it queued.
                self._release_slots(len(batch))
                self._skipped(conversation_id, batch[0].from_pair, exc)
                requeue = True
                break
            except BaseException:
                self._release_slots(len(batch))
                raise
            if len(results) < len(batch):
                # The first admission_full ends a batch: the targets after it were not
                # tried, and their slots go back.
                self._release_slots(len(batch) - len(results))
                requeue = True
            for candidate, result in zip(batch, results, strict=False):
                if result.from_pair != candidate.from_pair:
                    raise RuntimeError(
                        f"claim_targets answered range {result.from_pair} for range"
                        f" {candidate.from_pair}: the schema and this package disagree")
            n, again, full = self._answer(conversation_id, list(zip(batch, results,
                                                                     strict=False)))
            claimed += n
            requeue = requeue or again
            admission_full = admission_full or full
        # No re-queue after a successful claim: if this process dies mid-call, the reaper
        # expires the attempt and puts the conversation back on the queue itself.
        if requeue:
            self._enqueue(conversation_id)
        return claimed, admission_full

    def _free_slots(self) -> int:
        """Take every model call free now, without waiting (at most a claim batch)."""
        taken = 0
        while (taken < db.CLAIM_BATCH_LIMIT and not self.stopping
               and self._slots.acquire(blocking=False)):
            taken += 1
        return taken

    def _answer(self, conversation_id: str, answers: Sequence[tuple[Candidate, RangeClaim]],
                *, slot_each: bool = True) -> tuple[int, bool, bool]:
        """Start each claimed attempt (it keeps its slot) and log each refusal, giving its
        slot back when each answer holds one (`slot_each`); (claimed, worth a later pass,
        admission_full)."""
        cfg = self.config
        claimed = 0
        requeue = False
        admission_full = False
        for candidate, result in answers:
            if not result.claimed:
                if slot_each:
                    self._slots.release()
                with self._counts_lock:
                    self._refused[result.reason] += 1
                metrics.claim_refused(result.reason)
                self._log.emit("claim_refused", conversation_id=conversation_id,
                               from_pair=candidate.from_pair, job_id=result.job_id,
                               outcome="refused", reason=result.reason)
                requeue = requeue or result.reason in _RETRY_LATER
                admission_full = admission_full or result.reason == "admission_full"
                continue
            assert result.job_id is not None
            assert result.attempt is not None
            job = ClaimedJob(conversation_id, cfg.scope, candidate.from_pair,
                             result.job_id, result.attempt, candidate.source_hash)
            self._start(job, result.lease_expires_at)
            claimed += 1
        return claimed, requeue, admission_full

    def _skipped(self, conversation_id: str, from_pair: int | None,
                 exc: DatabaseTimeout) -> None:
        reason = "lock_timeout" if isinstance(exc, LockTimeout) else "statement_timeout"
        metrics.target_skipped(reason)
        self._log.emit("target_skipped", conversation_id=conversation_id, from_pair=from_pair,
                       outcome="skipped", reason=reason, error=str(exc))
        if from_pair is None:
            self._enqueue(conversation_id)  # a later pass examines it again

    def _enqueue(self, conversation_id: str) -> None:
        self._db(db.enqueue, conversation_id, self.config.scope)



def _oldest_age(batch: Sequence[QueuedConversation], lease: timedelta) -> float:
    """Seconds the oldest leased entry had waited, by the server's clock (dequeue set
    every lease_expires_at to its now() + lease); 0 for an empty batch."""
    if not batch:
        return 0.0
    return max(((e.lease_expires_at - lease) - e.enqueued_at).total_seconds() for e in batch)
