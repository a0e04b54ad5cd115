"""`pycompactor demo`: the whole pipeline on a throwaway cluster, with nothing to configure.

This module owns the demo's story and how it is shown. It starts a private PostgreSQL
from the installed server binaries, migrates it, loads the 45-pair sample conversation,
compacts it with one pass of the real worker (`pycompactor/extractive-3`, in process, no
network), and shows as tables: the plan, the jobs and attempts (`compaction.audit_jobs`),
the summaries, the projection manifest pair by pair under a budget that leaves history
raw, summarized and omitted, bytes before and after, and what compaction buys the next
Run: how many pairs it sees with the summaries and with raw history alone in the same
bytes, and what each summary kept (`pycompactor evaluate`'s measures). Then it edits an old message
(pair 3) and shows the projection refusing the now stale summary (the article's Case B).

The demo checks its own story: if the engine decided anything else, it fails (exit 1)
instead of showing a wrong picture. The cluster is removed on exit, Ctrl-C included.
On a terminal a live progress display runs while it works; otherwise (a pipe, a test)
each step is one plain line and nothing is animated or coloured.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

from rich import box
from rich.console import Console, Group
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from pycompactor import db, schema, store
from pycompactor.cli.cluster import ThrowawayCluster, describe
from pycompactor.cli.render import cell, placement_runs
from pycompactor.cli.sample import CONVERSATION_ID, load_sample
from pycompactor.errors import PycompactorError
from pycompactor.evaluation import measure_range, reach, totals
from pycompactor.hashing import source_hash
from pycompactor.models import Pair
from pycompactor.projection import (
    OMITTED,
    RAW,
    STALE_SOURCE,
    SUMMARIZED,
    Projection,
    marker_line,
    message_cost,
    project_history,
)
from pycompactor.summarizers.extractive3 import (
    DEFAULT_TARGET,
    EXTRACTIVE3_MODEL,
    Extractive3Summarizer,
)
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION
from pycompactor.worker.eventlog import EventLog
from pycompactor.worker.process import Worker, WorkerConfig

#: The pair whose user message the demo edits to make the summary of pairs 0-9 stale.
EDITED_PAIR = 3
#: A budget everything fits in (the sample is about 20 KB).
UNLIMITED = 10_000_000


def make_console() -> Console:
    """stdout; without a terminal, 120 columns (rich would use 80) and no styling."""
    console = Console(highlight=False, emoji=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(highlight=False, emoji=False, width=120)
    return console


class Steps:
    """The progress display: a spinner per step on a terminal, one line per step otherwise."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._progress: Progress | None = None
        if console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(finished_text="[green]done[/]"),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=console,
            )

    def __enter__(self) -> Steps:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        started = time.monotonic()
        if self._progress is None:
            # Printed before the work starts, so a reader (or a test) sees where it is.
            self.console.print(Text(f"{label} ..."))
            yield
            self.console.print(Text(f"  done in {time.monotonic() - started:.1f} s"))
            return
        task = self._progress.add_task(Text(label).plain, total=1)
        yield
        self._progress.update(task, completed=1)


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]],
          *, right: Sequence[str] = ()) -> Group:
    """A heading line and a rich table; every cell is literal text (ids and markers hold
    brackets that rich would read as markup), cut with an ellipsis rather than wrapped."""
    out = Table(box=box.SIMPLE_HEAD)
    for header in headers:
        out.add_column(Text(header), justify="right" if header in right else "left",
                       no_wrap=True, overflow="ellipsis", min_width=len(header))
    for row in rows:
        out.add_row(*(Text("" if value is None else str(value)) for value in row))
    return Group(Text(""), Text(title, style="bold"), out)


def preview(text: str, width: int = 48) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def utf8(text: str) -> int:
    return len(text.encode("utf-8"))


def check(condition: bool, what: str) -> None:
    """The demo verifies what it shows: a wrong outcome is an error, not a pretty table."""
    if not condition:
        raise PycompactorError(f"demo: expected {what}")


def run_demo(console: Console | None = None) -> int:
    console = console or make_console()
    started = time.monotonic()
    console.print(Text("pycompactor demo: cross-run compaction on a throwaway PostgreSQL, "
                       "offline model, nothing to configure", style="bold"))
    cluster = ThrowawayCluster()
    with Steps(console) as steps:
        try:
            with steps.step("starting a throwaway PostgreSQL cluster: "
                            + describe(cluster.source_bindir)):
                cluster.start()
            with steps.step(f"migrating the cluster in {cluster.root} ({cluster.dsn})"):
                schema.upgrade(cluster.dsn)
            with db.connect(cluster.dsn) as conn:
                _story(conn, cluster.dsn, console, steps)
        finally:
            with steps.step("stopping the throwaway cluster"):
                cluster.stop()
    console.print(Text(f"throwaway cluster stopped and removed; demo took "
                       f"{time.monotonic() - started:.1f} s"))
    return 0


def _story(conn: db.Connection, dsn: str, console: Console, steps: Steps) -> None:
    with steps.step(f"loading the sample conversation {CONVERSATION_ID!r}"):
        load_sample(conn)
    pairs = db.eligible_pairs(conn, CONVERSATION_ID)
    chars = sum(len(p.user_content) + len(p.assistant_content) for p in pairs)
    raw_bytes = sum(utf8(p.user_content) + utf8(p.assistant_content) for p in pairs)
    console.print(Text(f"eligible pairs: {len(pairs)} ({chars} characters, {raw_bytes} UTF-8 "
                       "bytes: the Chinese replies take 3 bytes a character)"))
    console.print(table(
        "A few turns of the sample", ["pair", "user message", "assistant reply"],
        [(p.pair_index, preview(p.user_content, 44), preview(p.assistant_content, 56))
         for p in (pairs[0], pairs[1], pairs[EDITED_PAIR], pairs[12])],
    ))

    _show_plan(conn, console, pairs)
    _compact(conn, dsn, console, steps)
    summaries = _show_summaries(conn, console, pairs)
    _show_projections(conn, console, pairs, summaries)
    _case_b(conn, console, steps, pairs, summaries)


def _show_plan(conn: db.Connection, console: Console, pairs: Sequence[Pair]) -> None:
    targets = db.plan_targets(conn, CONVERSATION_ID)
    check([(t.from_pair, t.to_pair) for t in targets] == [(0, 9), (10, 19)],
          "targets 0-9 and 10-19 for 45 pairs")
    rows = []
    for t in targets:
        agrees = source_hash(pairs[t.from_pair : t.to_pair + 1]) == t.source_hash
        check(agrees, "the Python source hash to equal the SQL one")
        rows.append((f"{t.from_pair}-{t.to_pair}", t.source_message_ids[0],
                     t.source_message_ids[-1], t.source_hash[:16] + "…", "yes"))
    console.print(table(
        "Plan: compaction.plan_targets (30 pairs before the first target, 10 per target, "
        "the newest 20 never)",
        ["pairs", "first source id", "last source id", "source_hash", "Python hash agrees"],
        rows,
    ))


def _compact(conn: db.Connection, dsn: str, console: Console, steps: Steps) -> None:
    log = io.StringIO()
    with steps.step(f"compacting: one worker pass with {EXTRACTIVE3_MODEL} (claim, summarize "
                    "outside any transaction, complete)"):
        # One slot: the two ranges are claimed and completed in order, so job and summary
        # ids are the same on every run (the tables and the text below name them).
        worker = Worker(WorkerConfig(model=EXTRACTIVE3_MODEL, dsn=dsn, once=True,
                                     concurrency=1, log_format="json"),
                        Extractive3Summarizer(), log=EventLog("json", log))
        report = worker.run()
        # The worker turns SIGINT into a graceful drain; the demo still stops on Ctrl-C.
        if worker.stopping:
            raise KeyboardInterrupt
    check(report.outcomes == {"completed": 2}, f"two completed attempts, got {report.outcomes}")
    jobs = db.audit(conn, "jobs", conversation_id=CONVERSATION_ID)
    columns = ["pairs", "job_id", "attempt", "state", "reason", "duration", "summary_id",
               "figures_kept", "input_tokens", "output_tokens"]
    rows = sorted(jobs.rows, key=lambda r: r["from_pair"])
    check(all(r["figures_total"] is not None and r["figures_kept"] is not None for r in rows),
          "figures reported for both ranges")
    console.print(table(
        f"Jobs and attempts: compaction.audit_jobs (model {EXTRACTIVE3_MODEL}, prompt "
        f"{PROMPT_VERSION}; the pass claimed {report.claimed} and logged "
        f"{len(log.getvalue().splitlines())} events)",
        columns,
        [[cell(row, c) if c not in ("input_tokens", "output_tokens") or row[c] is not None
          else "-" for c in columns] for row in rows],
    ))
    console.print(Text(
        "figures_kept: distinct figures (numbers, dates, amounts) of the ten replies that "
        "the summary holds verbatim, of all of them. extractive-3 writes at most "
        f"{DEFAULT_TARGET:.2f} of the replies' bytes: whole sentences of one reply each, "
        "without articles, caveats and corrections first, each reply's line labelled a)-j) "
        "and opened by what the reply is about. A summary that cannot state every figure "
        "within the target loses some, and a worker with --min-figure-retention R fails it "
        "(figures_lost). input_tokens/output_tokens: the usage an OpenAI-compatible API "
        "reports; the offline summarizer calls no model, so it has none (-)."))


def _show_summaries(conn: db.Connection, console: Console,
                    pairs: Sequence[Pair]) -> dict[int, tuple[int, str]]:
    """Completed summaries by from_pair: (summary_id, text)."""
    summaries = {f: (i, s) for f, i, s in db.summaries(conn, CONVERSATION_ID)}
    check(sorted(summaries) == [0, 10], "summaries of pairs 0-9 and 10-19")
    table_rows = []
    for from_pair, (summary_id, text) in summaries.items():
        block = pairs[from_pair : from_pair + 10]
        raw = sum(message_cost(p.user_content) + message_cost(p.assistant_content)
                  for p in block)
        summarized = (sum(message_cost(p.user_content) for p in block)
                      + message_cost(f"{marker_line(from_pair, from_pair + 9)}\n{text}"))
        table_rows.append((f"{from_pair}-{from_pair + 9}", summary_id, len(text), utf8(text),
                           raw, summarized, f"{100 * (summarized - raw) / raw:+.0f}%"))
    console.print(table(
        "Summaries (the model saw only the 10 assistant replies; the 10 user messages travel "
        "verbatim)",
        ["pairs", "summary_id", "chars", "bytes", "raw pairs cost", "summary block cost",
         "change"],
        table_rows, right=["summary_id", "chars", "bytes", "raw pairs cost",
                           "summary block cost", "change"],
    ))
    console.print(Text("cost = UTF-8 bytes + 16 per message. The summary replaces the ten "
                       "replies only: the ten user messages still cost what they did, so a "
                       "block shrinks less than its summary."))
    # Whole: what the next Run reads instead of replies 0-9 is the product, and the two
    # failures the article names (a dated NAV read as current, a dropped instruction)
    # are checked by reading it.
    console.print(Text("Summary of pairs 0-9 (line a) stands for reply 0, b) for reply 1, "
                       "...):", style="bold"))
    for line in summaries[0][1].split("\n"):
        console.print(Text("  " + line))
    return summaries


def _manifest_rows(projection: Projection, pairs: Sequence[Pair]) -> list[tuple[object, ...]]:
    """One row per pair with the bytes it contributes (a block's summary on its last pair)."""
    summary_costs: dict[int, int] = {}
    for message in projection.messages:
        if message["role"] == "assistant" and message["content"].startswith(
                "[pycompactor summary"):
            last = int(message["content"].split("\n", 1)[0].rstrip("]").split("–")[-1])
            summary_costs[last] = message_cost(message["content"])
    rows: list[tuple[object, ...]] = []
    for entry, pair in zip(projection.pairs, pairs, strict=True):
        if entry.placement == RAW:
            cost = message_cost(pair.user_content) + message_cost(pair.assistant_content)
        elif entry.placement == SUMMARIZED:
            cost = message_cost(pair.user_content) + summary_costs.get(entry.pair_index, 0)
        else:
            cost = 0
        rows.append((entry.pair_index, entry.placement, entry.summary_id, cost,
                     preview(pair.user_content, 52)))
    return rows


def _grouped(projection: Projection) -> list[tuple[str, str, object]]:
    """Consecutive pairs with the same placement and summary as one row."""
    return [(f"{a}-{b}", placement, summary_id)
            for a, b, placement, summary_id in placement_runs(projection.pairs)]


def _show_projections(conn: db.Connection, console: Console, pairs: Sequence[Pair],
                      summaries: dict[int, tuple[int, str]]) -> None:
    full = project_history(conn, CONVERSATION_ID, budget_bytes=UNLIMITED)
    check([p.placement for p in full.pairs] == [SUMMARIZED] * 20 + [RAW] * 25,
          "pairs 0-19 summarized and 20-44 raw with room for everything")
    # A budget with room for everything but the oldest block: the walk keeps 20-44 raw,
    # uses the summary of 10-19, cannot fit 0-9's block nor pair 9 raw, and stops.
    oldest_block = sum(message_cost(m["content"]) for m in full.messages[:11])
    budget = full.used_bytes - oldest_block
    tight = project_history(conn, CONVERSATION_ID, budget_bytes=budget)
    check([p.placement for p in tight.pairs] == [OMITTED] * 10 + [SUMMARIZED] * 10 + [RAW] * 25,
          "omitted 0-9, summarized 10-19 and raw 20-44 under the tight budget")
    console.print(table(
        f"Projection manifest for the next Run, budget {budget} bytes "
        f"(project_history; {tight.used_bytes} bytes used, {len(tight.messages)} messages)",
        ["pair", "placement", "summary_id", "bytes", "user message"],
        _manifest_rows(tight, pairs), right=["pair", "summary_id", "bytes"],
    ))
    console.print(Text("bytes: what the pair adds to the projection; a block's summary message "
                       "is counted on its last pair."))
    console.print(table(
        "Summaries not in that projection", ["summary_id", "pairs", "reason"],
        [(r.summary_id, f"{r.from_pair}-{r.from_pair + 9}", r.reason)
         for r in tight.rejected_summaries],
    ))
    raw_cost = sum(message_cost(p.user_content) + message_cost(p.assistant_content)
                   for p in pairs)

    def share(used: int) -> str:
        return f"{100 * used / raw_cost:.0f}%"

    console.print(table(
        "Bytes before and after (cost = UTF-8 bytes + 16 per message)",
        ["history sent to the next Run", "messages", "bytes", "of raw"],
        [
            (f"all {len(pairs)} pairs raw (before)", 2 * len(pairs), raw_cost, "100%"),
            ("projection with room for everything (after)", len(full.messages),
             full.used_bytes, share(full.used_bytes)),
            (f"projection under a {budget}-byte budget", len(tight.messages), tight.used_bytes,
             share(tight.used_bytes)),
        ],
        right=["messages", "bytes", "of raw"],
    ))
    _show_gain(console, pairs, summaries, (tight, full))


def _show_gain(console: Console, pairs: Sequence[Pair], summaries: dict[int, tuple[int, str]],
               projections: Sequence[Projection]) -> None:
    """What compaction buys, measured by `pycompactor evaluate`'s own functions: at the
    demo's budgets (the tight one above, and just the room the compacted history takes),
    the pairs the next Run sees with the summaries and with the raw-only projection
    (newest pairs only), and what each summary kept."""
    texts = {from_pair: text for from_pair, (_, text) in summaries.items()}
    budgets = [p.used_bytes if p.budget_bytes == UNLIMITED else p.budget_bytes
               for p in projections]
    reached = reach(pairs, texts, budgets)
    for gain, projection in zip(reached, projections, strict=True):
        check(gain.compacted == len(pairs) - projection.pairs.omitted
              and gain.compacted_bytes == projection.used_bytes,
              "the evaluation's reach to agree with the projection the engine made")
    tight, room = reached
    check(room.compacted == len(pairs) > room.raw_only,
          "raw history to miss pairs in the bytes the compacted history takes")
    console.print(table(
        "What compaction buys the next Run: pairs of history it sees (the measure of "
        "pycompactor evaluate)",
        ["budget (bytes)", "with compaction", "of them summarized", "raw only (newest pairs)",
         "gain"],
        [(g.budget_bytes, f"{g.compacted} of {len(pairs)}", g.summarized,
          f"{g.raw_only} of {len(pairs)}", f"{g.gain:+d}") for g in reached],
        right=["budget (bytes)", "of them summarized", "gain"],
    ))
    kept = [measure_range(pairs[f : f + 10], text) for f, text in sorted(texts.items())]
    console.print(table(
        "What a reader finds in the summaries (pycompactor evaluate's measures, "
        "docs/evaluate.md): attribution, each figure found by the question its sentence "
        "answers; qualifier scope, each 'not', 'only', 'as of', 'unlikely', '不', '仅' ... "
        "still in the sentence that question finds",
        ["pairs", "reply bytes", "summary bytes", "compression", "attribution",
         "qualifier scope", "figures kept", "invented"],
        [(f"{r.from_pair}-{r.to_pair}", r.replies_bytes, r.summary_bytes,
          f"{r.compression:.2f}" if r.compression is not None else "-",
          f"{r.attribution_kept}/{r.attribution_total}",
          f"{r.scope_kept}/{r.scope_total}",
          f"{r.figures_kept}/{r.figures_total}", r.invented_figures) for r in kept],
        right=["reply bytes", "summary bytes", "compression", "invented"],
    ))
    pooled = totals(kept)
    console.print(Text(
        f"In {room.budget_bytes} bytes the next Run sees all {room.compacted} pairs with "
        f"compaction, {room.raw_only} without ({room.gain:+d}); in {tight.budget_bytes} "
        f"bytes, {tight.compacted} against {tight.raw_only} ({tight.gain:+d}). The price: "
        f"a reader finds {pooled.attribution_kept} of {pooled.attribution_total} figures "
        f"by their question and {pooled.scope_kept} of {pooled.scope_total} qualifiers in "
        f"their scope; the summaries invent {pooled.invented_figures} figures. A summary "
        "buys pairs only where it is smaller than the replies it stands for. `pycompactor "
        "evaluate` measures both on your own history and model."))


def _case_b(conn: db.Connection, console: Console, steps: Steps, pairs: Sequence[Pair],
            summaries: dict[int, tuple[int, str]]) -> None:
    edited = pairs[EDITED_PAIR]
    new_text = edited.user_content.replace("费用", "费用和赎回费", 1)
    if new_text == edited.user_content:
        new_text = edited.user_content + " (edited)"
    with steps.step(f"Case B: editing the user message of pair {EDITED_PAIR}, an old message "
                    "inside the summarized range 0-9"):
        store.edit_message(conn, edited.user_message_id, new_text)
    console.print(table(
        f"Edited message {edited.user_message_id}", ["", "content"],
        [("before", edited.user_content), ("after", new_text)],
    ))
    after = project_history(conn, CONVERSATION_ID, budget_bytes=UNLIMITED)
    stale_id = summaries[0][0]
    check([(r.summary_id, r.reason) for r in after.rejected_summaries]
          == [(stale_id, STALE_SOURCE)], "the summary of pairs 0-9 refused as stale_source")
    check([p.placement for p in after.pairs[:10]] == [RAW] * 10, "pairs 0-9 back to raw")
    console.print(table(
        "Projection after the edit (room for everything): the stale summary is refused, "
        "pairs 0-9 go back to their original messages",
        ["pairs", "placement", "summary_id"], _grouped(after),
    ))
    console.print(table(
        "Refused summaries", ["summary_id", "pairs", "reason"],
        [(r.summary_id, f"{r.from_pair}-{r.from_pair + 9}", r.reason)
         for r in after.rejected_summaries],
    ))
    stale = db.audit(conn, "stale", conversation_id=CONVERSATION_ID)
    columns = ["summary_id", "pairs", "prompt_version", "staleness", "completed_at"]
    console.print(table(
        "compaction.audit_stale_summaries (what a DBA sees)", columns,
        [[cell(row, c) for c in columns] for row in stale.rows],
    ))
    console.print(Text("The stored summary itself never changes (it is immutable); it is "
                       "simply never projected again. The edit enqueued the conversation, so "
                       "the next worker pass summarizes the new source of pairs 0-9 under a "
                       "new identity."))
