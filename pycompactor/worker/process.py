"""`pycompactor worker`: turns compaction targets into immutable summaries, surviving crashes.

This module owns the worker process: finding work (the queue, one conversation, or a slow
sweep of every conversation), process-local admission (`--concurrency`), the
claim -> model call -> complete/fail cycle with its heartbeats, and graceful shutdown
(what it logs goes through `eventlog`, its connections through `connections`). The
database owns every state transition; the worker
only moves data between the database and the model (STYLE.md):

* a claim commits on its own (autocommit: each `db.*` call is one statement) before the
  model is called, and no transaction is open while the call runs (contract §11);
* the result goes back through `complete` (a Reply: the database judges not_stopped,
  tool_calls, empty, too_long) or `fail` (a Failure: its reason), fenced by the token
  (job_id, attempt): a worker whose lease was lost is refused, never believed;
* a pass looks at each conversation and claims in one call, `claim_next_targets` (one
  lock and one judgement of the conversation): its targets (ids, hash, and whether that
  identity already holds a completed summary: those are skipped without a claim), the
  first of the rest claimed, as many as it has model calls free, each answered as
  `claim` answers it; targets left over go in `claim_targets` batches as model calls
  come free. Only then does it read each claimed range's 10 assistant replies with
  `range_replies`, which returns them only while their texts hash to the claimed source
  hash (the range's current hash; judged from the views, that of the
  ids the claimed job keeps, with no second judgment of the conversation). The model
  therefore summarizes exactly the claimed source, and a worker reads no other message
  text (never user text). A range edited between the claim and that read returns no
  replies: the attempt is failed `source_moved` without a model call (its identity,
  bound to the old hash, is no longer a target anyway).

Queue discipline. `compaction.dequeue` leases entries of the worker's scope (hidden from
other workers for the lease, the worker's --lease-seconds) instead of removing them. Once
the worker has examined a conversation (planned it and tried a claim of each target) it
acknowledges the entry (`ack`), which removes it unless an enqueue landed during the
lease (new history, or the worker's own put-back below): then the entry waits again. An
entry the worker did not examine (shutdown, global admission full, a pass cut short) is
released in its original place. A worker killed (SIGKILL) while holding entries loses
nothing: their leases run out and they become visible again in their original order;
the attempts it had claimed expire and `reap` re-queues their conversations. The worker
puts a conversation back (`enqueue`) only when work is left that a later pass can do:
after a claim refused for a transient reason (admission_full, or not_eligible /
source_mismatch: the source moved between the look and a later batch's claim), after a
timed-out examination, and after a failed first attempt (a later pass makes attempt 2).

Nothing queued. A host whose writes do not queue conversations (re-pointed views without
calls to `enqueue`) leaves a queue worker idle while targets wait. The first pass of a
run that finds the queue empty therefore looks at the first few conversations of the
source, and if one has a target without a summary it logs `idle_hint` once (enqueue
after each settled Run, the session wrappers do it, or run with --sweep).

The claiming loop (passes, finding work, the claims and their answers) lives in
`pycompactor.worker.claim` (`Worker` inherits it), the configuration, reason codes and
results in `pycompactor.worker.types`; this module keeps the Worker itself: stopping,
the database calls, running an attempt, recording it, heartbeats and the drain. Every
name of the two is re-exported here (see `__all__`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime
from types import FrameType
from typing import Any, Concatenate, Final

from pycompactor import db, metrics
from pycompactor.errors import (
    LogLost,
    ModelUnreachable,
    PycompactorError,
    TransactionConflict,
)
from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.models import QueuedConversation, RangeReply
from pycompactor.quality.figures import (
    figure_stats,
    invented_figures,
)
from pycompactor.summarizers.openai_compatible import (
    Summarizer,
    unreachable,
)
from pycompactor.summarizers.outcomes import Failure, ModelOutcome, Reply
from pycompactor.worker.claim import (
    _Claiming,
    _oldest_age,
)
from pycompactor.worker.connections import Connections, is_transient
from pycompactor.worker.eventlog import EventLog, secrets_of
from pycompactor.worker.types import (
    _DB_BACKOFF_MAX,
    _DB_BACKOFF_START,
    _HINT_PROBE_CONVERSATIONS,
    _IDLE_START_SECONDS,
    _RETRY_LATER,
    _TICK,
    FIGURES_INVENTED,
    FIGURES_LOST,
    INTERRUPTED,
    SOURCE_MOVED,
    SOURCE_UNREADABLE,
    WORKER_ERROR,
    Candidate,
    ClaimedJob,
    Figures,
    JobResult,
    Params,
    Result,
    WorkerConfig,
    WorkerReport,
    default_worker_id,
)

#: Every name this module offers: the Worker and its run and, re-exported so that
#: `pycompactor.worker.process` stays the one place to import them from, the claiming
#: loop of `pycompactor.worker.claim` and the configuration and results of
#: `pycompactor.worker.types`.
__all__ = [
    "FIGURES_INVENTED",
    "FIGURES_LOST",
    "INTERRUPTED",
    "SOURCE_MOVED",
    "SOURCE_UNREADABLE",
    "WORKER_ERROR",
    "_CONFLICT_PAUSE",
    "_CONFLICT_RETRIES",
    "_DB_BACKOFF_MAX",
    "_DB_BACKOFF_START",
    "_ENDING_SECONDS",
    "_HINT_PROBE_CONVERSATIONS",
    "_IDLE_START_SECONDS",
    "_RETRY_LATER",
    "_TICK",
    "Candidate",
    "ClaimedJob",
    "Figures",
    "JobResult",
    "Params",
    "Result",
    "Worker",
    "WorkerConfig",
    "WorkerReport",
    "_Claiming",
    "_Running",
    "_ms_since",
    "_oldest_age",
    "default_worker_id",
    "reply_stats",
    "run_worker",
]

# A call the server rolled back for a concurrent transaction (TransactionConflict) is
# sent again at once, alone, up to this many times, after a short random pause that
# doubles each time (so two colliding workers do not collide again in step).
_CONFLICT_RETRIES: Final = 8
_CONFLICT_PAUSE: Final = 0.01
# How long a call that ends an attempt (at shutdown) keeps trying once `_db` gave up.
_ENDING_SECONDS: Final = 5.0


# --- the worker ------------------------------------------------------------------------


class _Running:
    """A claimed attempt in flight. `state` moves calling -> recording -> done, or
    calling -> interrupted (the drain ran out; the main thread recorded the failure)."""

    def __init__(self, job: ClaimedJob) -> None:
        self.job = job
        self.started = time.monotonic()
        self.state = "calling"
        #: Set once complete or fail answered for it (whatever came after).
        self.recorded = False
        self.lock = threading.Lock()
        self.done = threading.Event()


class Worker(_Claiming):
    """One worker process's engine; `run()` returns when the pass (or the loop) is over."""

    def __init__(self, config: WorkerConfig, summarizer: Summarizer, *,
                 connect: Callable[[], db.Connection] | None = None,
                 log: EventLog | None = None) -> None:
        if summarizer.model != config.model:
            raise ValueError(f"summarizer is for {summarizer.model!r}, not {config.model!r}")
        self.config = config
        self._summarizer = summarizer
        self._pool = Connections(
            connect or (lambda: db.connect(config.dsn, timeouts=config.timeouts)))
        self._log = log or EventLog(config.log_format, secrets=secrets_of(config.dsn))
        self._slots = threading.BoundedSemaphore(config.concurrency)
        self._running: dict[tuple[int, int], _Running] = {}
        self._running_lock = threading.Lock()
        self._closing = threading.Event()
        # Set by signal handlers: a plain attribute, because a handler that took a lock
        # the interrupted main thread holds would deadlock.
        self._signals = 0
        self._stop_noticed = False
        self._drain_deadline: float | None = None
        self._last_reap = -float("inf")
        self._sweep_after = ""
        self._hinted = False
        # Leased entries not yet acknowledged or released. If a database error cuts a pass
        # short they are released first thing on reconnect (else their leases run out).
        self._unsettled: list[QueuedConversation] = []
        # Entry leases: the attempt lease (WorkerConfig keeps it within db.LEASE_BOUNDS).
        self._queue_lease = config.lease
        self._passes = 0
        self._claimed = 0
        self._refused: Counter[str] = Counter()
        self._outcomes: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        # The first model call's outcome decides whether the server is there at all
        # (`unreachable`): if not, the worker stops and `run` raises this.
        self._first_call_seen = False
        # Targets claim_next_targets has shown, and whether --conversation was checked.
        self._seen_targets = 0
        self._warned = False
        self._unreachable: ModelUnreachable | None = None

    # -- stopping ------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop claiming and drain (what SIGTERM/SIGINT do, and a broken log); a second
        request skips the drain.

        Safe to call from a signal handler: it only bumps a counter.
        """
        self._signals += 1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request_stop()

    @property
    def stopping(self) -> bool:
        # A log that can no longer be written stops the worker as SIGTERM does: it claims
        # nothing more, drains what it holds (recorded `interrupted` if the drain runs
        # out), gives back its queue entries, and `run` then raises LogLost. Working on
        # unlogged, e.g. under `worker 2>&1 | head -1`, would leave an operator blind.
        requested = self._signals > 0 or self._log.broken
        if requested and not self._stop_noticed:
            self._stop_noticed = True
            self._drain_deadline = time.monotonic() + self.config.drain_seconds
            self._log.emit("stopping", in_flight=len(self._running),
                           drain_seconds=self.config.drain_seconds)
        if self._signals > 1:
            self._drain_deadline = time.monotonic()
        return requested

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, _TICK))

    def _take_slot(self) -> bool:
        """Wait for a free local slot (process-local admission); False when stopping."""
        while not self.stopping:
            if self._slots.acquire(timeout=_TICK):
                if not self.stopping:
                    return True
                # The attempt that freed the slot may also have stopped us (its result's
                # log line found the log broken): claim nothing more.
                self._slots.release()
        return False

    def _release_slots(self, count: int) -> None:
        for _ in range(count):
            self._slots.release()

    # -- running ---------------------------------------------------------------------

    def run(self) -> WorkerReport:
        """One pass (`once`) or passes until stopped; then drain. Returns the totals, or
        raises LogLost (after the same orderly stop) when the log could not be written."""
        cfg = self.config
        # Connected, migrated and permitted before the start is announced: a worker that
        # cannot start says exactly one thing (why), not "started" and then why.
        with self._pool.get() as conn:
            db.check_worker_access(conn)
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, self._on_signal)
        source = ("conversation" if cfg.conversation is not None
                  else "sweep" if cfg.sweep else "queue")
        self._log.emit("started", worker=cfg.worker_id, model=cfg.model,
                       api=getattr(self._summarizer, "api", None), scope=cfg.scope,
                       mode="once" if cfg.once else "loop", source=source,
                       conversation_id=cfg.conversation, concurrency=cfg.concurrency,
                       lease_seconds=cfg.lease.total_seconds(),
                       timeout_seconds=cfg.timeout_seconds,
                       min_figure_retention=cfg.min_figure_retention,
                       max_invented_figures=cfg.max_invented_figures, pid=os.getpid())
        heartbeats = threading.Thread(target=self._heartbeat_loop, name="heartbeat",
                                      daemon=True)
        heartbeats.start()
        try:
            if cfg.once:
                self._pass()
            else:
                self._loop()
        finally:
            self._finish_jobs()
            with contextlib.suppress(PycompactorError):
                self._release(list(self._unsettled))
            self._closing.set()
            heartbeats.join(timeout=5)
            self._pool.close_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        report = self.report()
        self._log.emit("stopped", passes=report.passes, claimed=report.claimed,
                       refused=report.refused, outcomes=report.outcomes)
        if self._log.broken:
            raise LogLost()
        if self._unreachable is not None:
            raise self._unreachable
        return report

    def _warn_if_unknown(self, conversation_id: str) -> None:
        """Say so when the source has no run of --conversation's id: a mistyped id would
        otherwise pass as a conversation with nothing to do."""
        with self._pool.get() as conn:
            known = db.source_holds(conn, conversation_id)
        if not known:
            self._log.emit("warning", conversation_id=conversation_id,
                           warning="the source holds no runs for this conversation;"
                                   " is the id right?")

    def report(self) -> WorkerReport:
        with self._counts_lock:
            return WorkerReport(self._passes, self._claimed, dict(self._refused),
                                dict(self._outcomes))

    def _db(self, call: Callable[Concatenate[db.Connection, Params], Result],
            *args: Params.args, **kwargs: Params.kwargs) -> Result:
        """One database call on a pooled connection.

        A call the server rolled back because of a concurrent transaction (a serialization
        failure under SERIALIZABLE or REPEATABLE READ, or a deadlock) changed nothing and
        left its connection usable: it alone is sent again, after a short pause, so a
        conflict costs that one call a retry, never the pass (logged `db_retry`). Other
        errors, and a conflict that outlasts the retries, propagate as before.
        """
        for retry in range(1, _CONFLICT_RETRIES + 1):
            try:
                with self._pool.get() as conn:
                    return call(conn, *args, **kwargs)
            except TransactionConflict as exc:
                pause = random.uniform(0, _CONFLICT_PAUSE * 2 ** retry)
                self._log.emit("db_retry", call=getattr(call, "__name__", "call"),
                               sqlstate=exc.sqlstate, retry=retry, error=str(exc),
                               retry_in_seconds=round(pause, 3))
                time.sleep(pause)
        with self._pool.get() as conn:
            return call(conn, *args, **kwargs)

    def _ending(self, call: Callable[Concatenate[db.Connection, Params], Result],
                *args: Params.args, **kwargs: Params.kwargs) -> Result:
        """A call that ends what this worker holds (an attempt at shutdown): when `_db`'s
        retries give up on transient trouble, it tries again for a few seconds more
        rather than leave the attempt running until its lease runs out."""
        deadline = time.monotonic() + _ENDING_SECONDS
        pause = 0.05
        while True:
            try:
                return self._db(call, *args, **kwargs)
            except PycompactorError as exc:
                if not is_transient(exc) or time.monotonic() + pause >= deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    # -- claimed attempts ----------------------------------------------------------------

    def _start(self, job: ClaimedJob, lease_expires_at: datetime | None) -> None:
        running = _Running(job)
        with self._running_lock:
            self._running[(job.job_id, job.attempt)] = running
        with self._counts_lock:
            self._claimed += 1
        metrics.claimed()
        self._log.emit("claimed", job_id=job.job_id, attempt=job.attempt,
                       conversation_id=job.conversation_id, from_pair=job.from_pair,
                       lease_expires_at=lease_expires_at)
        # Daemon: a model call still hanging after the drain must not keep the process
        # alive; its attempt is already recorded `interrupted` by then.
        threading.Thread(target=self._run_job, args=(running,), daemon=True,
                         name=f"job-{job.job_id}-{job.attempt}").start()

    def _run_job(self, running: _Running) -> None:
        job = running.job
        started = running.started
        try:
            outcome, replies = self._summarize(job)
            if replies:  # the model was called
                self._first_outcome(outcome)
            outcome, figures = self._judge_figures(replies, outcome)
            with running.lock:
                if running.state != "calling":
                    return  # interrupted: the main thread has recorded it
                running.state = "recording"
            result = self._record(job, outcome, started, figures)
            running.recorded = True
            self._finished(result, outcome, figures)
            if job.attempt == 1 and result.outcome != "completed":
                # The retry (attempt 2) belongs to a later pass, never this one. Nothing
                # else puts the conversation back (no attempt of it is running for reap to
                # find): the put-back keeps trying through a restart.
                with contextlib.suppress(PycompactorError):
                    self._ending(db.enqueue, job.conversation_id, self.config.scope)
        except Exception as exc:
            self._log.emit("job_error", job_id=job.job_id, attempt=job.attempt,
                           conversation_id=job.conversation_id, from_pair=job.from_pair,
                           error=f"{type(exc).__name__}: {exc}")
            # Whatever gave up (a call's retries, a bug), the attempt is ours: end it,
            # rather than leave it running until its lease runs out.
            self._end_after_error(running, exc)
        finally:
            with running.lock:
                if running.state == "recording":
                    running.state = "done"
            with self._running_lock:
                self._running.pop((job.job_id, job.attempt), None)
            running.done.set()
            self._slots.release()

    def _first_outcome(self, outcome: ModelOutcome) -> None:
        """After the process's first model call: a server it could not connect to stops
        the worker (the attempt is recorded failed as any other)."""
        with self._counts_lock:
            if self._first_call_seen:
                return
            self._first_call_seen = True
        error = unreachable(self._summarizer, outcome)
        if error is not None:
            self._unreachable = error
            self.request_stop()

    def _end_after_error(self, running: _Running, exc: Exception) -> None:
        """Record an attempt failed (`worker_error`) after its thread raised: unless the
        main thread has recorded it already (interrupted) or its result was recorded."""
        with running.lock:
            if running.recorded or running.state in ("interrupted", "done"):
                return
            running.state = "recording"
        failure = Failure(WORKER_ERROR, f"{type(exc).__name__}: {exc}")
        try:
            result = self._record(running.job, failure, running.started)
        except Exception as again:  # logged: the lease is the last resort
            self._log.emit("job_error", job_id=running.job.job_id,
                           attempt=running.job.attempt,
                           conversation_id=running.job.conversation_id,
                           error=f"{type(again).__name__}: {again}")
            return
        self._finished(result, failure)

    def _summarize(self, job: ClaimedJob) -> tuple[ModelOutcome, list[RangeReply]]:
        """Read the claimed range's replies (only while its hash is the claimed one), then
        call the model; every problem is a Failure, never an exception."""
        try:
            replies = self._db(db.range_replies, job.conversation_id, job.from_pair,
                               job.source_hash)
        except PycompactorError as exc:
            return Failure(SOURCE_UNREADABLE, f"{type(exc).__name__}: {exc}"), []
        if len(replies) != PAIRS_PER_RANGE:
            return Failure(SOURCE_MOVED, "the range changed after the claim"), []
        try:
            # Outside any transaction: this thread holds no connection here.
            with metrics.model_call(self.config.model):
                return self._summarizer.summarize(replies), replies
        except Exception as exc:  # a summarizer bug is still just a failed attempt
            return Failure(WORKER_ERROR, f"{type(exc).__name__}: {exc}"), replies

    def _judge_figures(self, replies: Sequence[RangeReply], outcome: ModelOutcome,
                       ) -> tuple[ModelOutcome, Figures | None]:
        """Count the figures a reply kept and invented (contract §8), and apply
        --max-invented-figures, then --min-figure-retention.

        Only a reply the database would accept can fail a gate: a truncated or empty
        reply keeps its own reason (not_stopped, empty, ...), judged by `complete`.
        """
        if not isinstance(outcome, Reply):
            return outcome, None
        figures = Figures(figure_stats(replies, outcome.text),
                          len(invented_figures(replies, outcome.text)))
        metrics.figures_counted(figures.stats)
        allowed = self.config.max_invented_figures
        threshold = self.config.min_figure_retention
        if figures.invented > allowed and self._acceptable(outcome):
            metrics.figures_invented()
            # The count only: the figures themselves are summary text, kept out of logs.
            return Failure(FIGURES_INVENTED,
                           f"states {figures.invented} figures no reply holds, more than "
                           f"the {allowed} --max-invented-figures allows",
                           input_tokens=outcome.input_tokens,
                           output_tokens=outcome.output_tokens), figures
        if figures.stats.below(threshold) and self._acceptable(outcome):
            metrics.figures_lost()
            return Failure(FIGURES_LOST, f"kept {figures.stats.kept} of "
                                         f"{figures.stats.total} figures, "
                                         f"below {threshold:g} of them",
                           input_tokens=outcome.input_tokens,
                           output_tokens=outcome.output_tokens), figures
        return outcome, figures

    def _acceptable(self, reply: Reply) -> bool:
        """Whether `complete` would accept the reply (the database's rule, asked). When
        the database cannot be asked (its retries gave up), the gate's own failure is
        recorded: failing an attempt is always safe, and it is never left running."""
        try:
            return self._db(db.reply_problem, reply.text, reply.finish_reason,
                            reply.tool_call_count) is None
        except PycompactorError:
            return True

    def _record(self, job: ClaimedJob, outcome: ModelOutcome, started: float,
                figures: Figures | None = None) -> JobResult:
        """complete (Reply) or fail (Failure) with the fencing token, retrying DB trouble
        until the lease would have run out anyway."""
        give_up = started + self.config.lease.total_seconds()
        backoff = 0.2
        while True:
            try:
                with self._pool.get() as conn:
                    if isinstance(outcome, Reply):
                        done = db.complete(conn, job.job_id, job.attempt, outcome.text,
                                           outcome.finish_reason, outcome.tool_call_count,
                                           response_id=outcome.response_id,
                                           stats=reply_stats(outcome, figures),
                                           conversation_id=job.conversation_id)
                        # ok=False is the database's verdict: not_stopped, tool_calls, ...
                        completed, reason, summary_id = done.ok, done.reason, done.summary_id
                    else:
                        failed = db.fail(conn, job.job_id, job.attempt, outcome.reason,
                                         conversation_id=job.conversation_id)
                        # ok=True means "recorded failed"; ok=False means fenced off.
                        completed, summary_id = False, None
                        reason = outcome.reason if failed.ok else failed.reason
                break
            except PycompactorError as exc:
                if not is_transient(exc) or time.monotonic() + backoff >= give_up:
                    return JobResult(job, "result_lost", f"{type(exc).__name__}: {exc}",
                                     None, _ms_since(started))
                # Re-sent with the same token and text: if the lost call had committed,
                # complete answers with the same summary_id (idempotent), else it records
                # it now; fail is fenced the same way.
                self._log.emit("record_retry", job_id=job.job_id, attempt=job.attempt,
                               conversation_id=job.conversation_id, from_pair=job.from_pair,
                               error=str(exc), retry_in_seconds=backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        outcome_name = ("lease_lost" if reason == "lease_lost"
                        else "completed" if completed else "failed")
        return JobResult(job, outcome_name, reason, summary_id, _ms_since(started))

    def _finished(self, result: JobResult, outcome: ModelOutcome | None,
                  figures: Figures | None = None) -> None:
        with self._counts_lock:
            self._outcomes[result.outcome] += 1
        metrics.attempt_finished(result.outcome, result.reason)
        job = result.job
        event = {"completed": "completed", "failed": "failed"}.get(result.outcome, result.outcome)
        fields: dict[str, object] = {
            "job_id": job.job_id, "attempt": job.attempt,
            "conversation_id": job.conversation_id, "from_pair": job.from_pair,
            "outcome": result.outcome, "reason": result.reason,
            "summary_id": result.summary_id, "latency_ms": result.latency_ms,
        }
        if isinstance(outcome, Failure):
            if outcome.detail:
                fields["detail"] = outcome.detail[:300]
            fields.update(input_tokens=outcome.input_tokens,
                          output_tokens=outcome.output_tokens)
        elif isinstance(outcome, Reply):
            fields.update(finish_reason=outcome.finish_reason,
                          tool_call_count=outcome.tool_call_count,
                          response_id=outcome.response_id, summary_chars=len(outcome.text),
                          input_tokens=outcome.input_tokens,
                          output_tokens=outcome.output_tokens)
        if figures is not None:
            fields.update(figures_total=figures.stats.total, figures_kept=figures.stats.kept,
                          figures_invented=figures.invented)
        self._log.emit(event, **fields)

    def _heartbeat_loop(self) -> None:
        """Renew every in-flight attempt's lease every third of a lease."""
        interval = self.config.lease.total_seconds() / 3
        while not self._closing.wait(interval):
            with self._running_lock:
                calling = [r for r in self._running.values() if r.state == "calling"]
            for running in calling:
                job = running.job
                try:
                    beat = self._db(db.heartbeat, job.job_id, job.attempt,
                                    lease=self.config.lease,
                                    conversation_id=job.conversation_id)
                except PycompactorError as exc:
                    self._log.emit("heartbeat_error", job_id=job.job_id, attempt=job.attempt,
                                   conversation_id=job.conversation_id, error=str(exc))
                    break  # try again next tick, with a fresh connection
                if not beat.ok:
                    # Fenced off (reaped or recorded elsewhere): the call may finish, but
                    # complete will be refused with lease_lost; nothing to do but say so.
                    self._log.emit("heartbeat_refused", job_id=job.job_id,
                                   attempt=job.attempt, conversation_id=job.conversation_id,
                                   from_pair=job.from_pair, reason="lease_lost")

    def _finish_jobs(self) -> None:
        """Wait for in-flight attempts; once stopping, only until the drain deadline, then
        record the ones still calling the model as failed (`interrupted`)."""
        while True:
            with self._running_lock:
                pending = list(self._running.values())
            if not pending:
                return
            if self.stopping and self._drain_deadline is not None \
                    and time.monotonic() >= self._drain_deadline:
                break
            pending[0].done.wait(_TICK)
        recording = []
        for running in pending:
            with running.lock:
                if running.state != "calling":
                    recording.append(running)
                    continue
                running.state = "interrupted"
            self._interrupt(running)
        # Attempts already writing their result get a short grace to finish it.
        grace = time.monotonic() + 5.0
        for running in recording:
            running.done.wait(max(0.0, grace - time.monotonic()))

    def _interrupt(self, running: _Running) -> None:
        job = running.job
        try:
            failed = self._ending(db.fail, job.job_id, job.attempt, INTERRUPTED,
                                  conversation_id=job.conversation_id)
            result = JobResult(job, "interrupted" if failed.ok else failed.reason,
                               INTERRUPTED if failed.ok else failed.reason, None,
                               _ms_since(running.started))
        except PycompactorError as exc:
            # The lease will expire and the reaper record it; say why it was not ours.
            result = JobResult(job, "result_lost", str(exc), None, _ms_since(running.started))
        self._finished(result, None)
        if job.attempt == 1:
            with contextlib.suppress(PycompactorError):
                self._enqueue(job.conversation_id)


def reply_stats(reply: Reply, figures: Figures | None) -> dict[str, int]:
    """complete's p_stats: the figures (always, for a reply) and the usage reported."""
    stats: dict[str, int] = {}
    if figures is not None:
        stats.update(figures_total=figures.stats.total, figures_kept=figures.stats.kept,
                     figures_invented=figures.invented)
    if reply.input_tokens is not None:
        stats["input_tokens"] = reply.input_tokens
    if reply.output_tokens is not None:
        stats["output_tokens"] = reply.output_tokens
    return stats


def _ms_since(started: float) -> int:
    return round((time.monotonic() - started) * 1000)


def run_worker(config: WorkerConfig, summarizer: Summarizer, *,
               connect: Callable[[], db.Connection] | None = None,
               log: EventLog | None = None) -> WorkerReport:
    """Run a worker to completion (one pass with `once`, else until SIGTERM/SIGINT)."""
    return Worker(config, summarizer, connect=connect, log=log).run()
