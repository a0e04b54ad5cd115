"""`pycompactor evaluate`: what a summarizer would buy and lose on a set of conversations.

This module owns the command: where the conversations come from (the corpus, a JSONL
file, or a live database read through the source views in one READ ONLY transaction),
and how the report is shown (a readable table, `--json`, a self-contained HTML file with
inline SVG charts). The measuring is `pycompactor.evaluation`'s; the summarizer is built
by the command line exactly as the worker's. Nothing is written anywhere but the HTML
file asked for: no summary, no job, no row.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import psycopg

from pycompactor import db
from pycompactor.cli.argtypes import positive_int
from pycompactor.cli.render import print_json
from pycompactor.errors import SchemaNotMigrated, UsageError
from pycompactor.evaluation import (
    BUDGETS_KIB,
    DEFAULT_BUDGETS,
    ConversationResult,
    EvalConversation,
    EvalPair,
    RangeResult,
    Report,
    Totals,
    conversation_from_texts,
    evaluate,
    guess_language,
)
from pycompactor.quality import charts
from pycompactor.quality.fidelity import Question
from pycompactor.summarizers.baseline import (
    BASELINE_CAVEATS_MODEL,
    BASELINE_MODELS,
    BaselineSummarizer,
)
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from pycompactor.summarizers.extractive3 import DEFAULT_TARGET as EXTRACTIVE3_TARGET
from pycompactor.summarizers.extractive3 import EXTRACTIVE3_MODEL
from pycompactor.summarizers.openai_compatible import (
    FirstCallGuard,
    OpenAISummarizer,
    Summarizer,
    make_summarizer,
)

if TYPE_CHECKING:
    from rich.console import Group

# rich is imported where a table is drawn: building the command line's parser imports
# this module, and --json needs no rich at all.

EVALUATE_EXAMPLES: Final = (
    "  pycompactor evaluate --jsonl history.jsonl\n"
    "  pycompactor evaluate --corpus --limit 10 --html report.html\n"
    "  pycompactor evaluate --corpus --compare pycompactor/extractive-2@0.5 \\\n"
    "    --compare baseline/whole-sentences@0.35 --html report.html\n"
    "  pycompactor evaluate --database --dsn postgresql://reader@db/agent --limit 200 \\\n"
    "    --model gpt-4.1-mini --api responses --json\n"
    "\n"
    "Read-only: it writes no summary, no job, nothing (a compaction_reader login is\n"
    "enough for --database). environment: PYCOMPACTOR_DSN (--dsn), PYCOMPACTOR_MODEL\n"
    "(--model), OPENAI_BASE_URL (--base-url) and OPENAI_API_KEY."
)

#: The model when neither --model nor PYCOMPACTOR_MODEL names one: offline, no server.
DEFAULT_MODEL: Final = EXTRACTIVE3_MODEL
#: Columns of the readable table: wide enough for every measure of a range on one line.
TABLE_WIDTH: Final = 184
#: Conversations read from a live database unless --limit says otherwise.
DEFAULT_LIMIT: Final = 100
# Histogram bins: compression is a ratio that can pass 1 (a summary longer than its
# replies); retention lies in [0, 1], with 1.0 (all kept) in the last bin.
_COMPRESSION_EDGES: Final = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5)
_RETENTION_EDGES: Final = (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.01)


def add_evaluate_arguments(p: argparse.ArgumentParser) -> None:
    """The source and output arguments (the model's are the worker's, added by cli)."""
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", action="store_true",
                        help="the built-in evaluation corpus (English and Chinese)")
    source.add_argument("--jsonl", type=Path, metavar="FILE",
                        help='conversations, one JSON object a line: {"conversation_id", '
                             '"language", "pairs": [{"user", "assistant"}, ...]} oldest first')
    source.add_argument("--database", action="store_true",
                        help="a live database (--dsn), read through the source views in one "
                             "READ ONLY transaction; a compaction_reader login is enough")
    p.add_argument("--conversation", action="append", metavar="ID",
                   help="with --database: only this conversation (repeatable)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help=f"with --database: the first N conversations in id order "
                        f"(default: {DEFAULT_LIMIT}); with --corpus: N conversations "
                        "(default: the corpus's own size)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="with --corpus: the corpus seed (default: 0)")
    p.add_argument("--compare", action="append", default=[], metavar="MODEL[@R]",
                   type=parse_compare,
                   help="also evaluate this model on the same ranges, side by side "
                        "(repeatable); @R sets an offline model's target share of the "
                        "replies' bytes (default: --extractive-target); "
                        f"{' and '.join(BASELINE_MODELS)} are naive whole-sentence "
                        "selection, the baseline")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--html", type=Path, default=None, metavar="FILE",
                   help="also write a self-contained HTML report with charts to FILE")


# --------------------------------------------------------------------------- sources


def read_jsonl(path: Path) -> tuple[EvalConversation, ...]:
    """Conversations of a JSONL file (the corpus's `write_jsonl` format); a malformed
    line is a UsageError naming its number."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read --jsonl {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--jsonl {path} is not UTF-8 text") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(_conversation(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(
                f"{path}:{number}: expected {{\"conversation_id\", \"language\", "
                f"\"pairs\": [{{\"user\", \"assistant\"}}]}} ({exc})") from None
    return tuple(out)


def _conversation(data: Any) -> EvalConversation:
    if not isinstance(data, dict):
        raise TypeError("not a JSON object")
    conversation_id, language, pairs = data["conversation_id"], data["language"], data["pairs"]
    if not isinstance(conversation_id, str) or not isinstance(language, str):
        raise TypeError("conversation_id and language must be strings")
    if not isinstance(pairs, list):
        raise TypeError("pairs must be a list")
    texts = []
    for pair in pairs:
        user, assistant = pair["user"], pair["assistant"]
        if not isinstance(user, str) or not isinstance(assistant, str):
            raise TypeError("user and assistant must be strings")
        texts.append((user, assistant))
    return conversation_from_texts(conversation_id, language, texts)


def read_corpus(seed: int = 0, conversations: int | None = None,
                ) -> tuple[EvalConversation, ...]:
    """The evaluation corpus (`pycompactor.corpus`; its own default size unless
    `conversations` is given). It is parsed from installed documentation on first use,
    so it is imported only when asked for."""
    from pycompactor import corpus

    return tuple(conversation_from_texts(c.conversation_id, c.language, c.pairs)
                 for c in corpus.build_corpus(seed=seed, conversations=conversations))


@dataclass(frozen=True, slots=True)
class StoredByModel:
    """What one model's stored summaries of the conversations read are to the next Run
    (`evaluate --database`): how many, how many the projection uses, how many another
    model's or a newer one supersedes, how many are stale or of a version never used."""

    model: str
    summaries: int
    used: int
    superseded: int
    not_usable: int
    #: Its place in compaction.settings.projection_models (1 first), None when not named.
    projection_preference: int | None

    def to_dict(self) -> dict[str, object]:
        return {"model": self.model, "summaries": self.summaries, "used": self.used,
                "superseded": self.superseded, "not_usable": self.not_usable,
                "projection_preference": self.projection_preference}


def stored_by_model(conn: db.Connection, conversation_ids: Sequence[str]) -> list[StoredByModel]:
    """Per model, the verdicts on the stored summaries of the conversations (scope
    default), with the owner's preference (docs/projection.md, "superseded")."""
    preference = db.projection_models(conn)
    counts: dict[str, list[int]] = {}
    for cid in conversation_ids:
        for model, verdict in db.summary_verdicts_by_model(conn, cid):
            row = counts.setdefault(model, [0, 0, 0, 0])
            row[0] += 1
            row[1 if verdict is None else 2 if verdict == "superseded" else 3] += 1
    return [StoredByModel(model, row[0], row[1], row[2], row[3],
                          preference.index(model) + 1 if model in preference else None)
            for model, row in sorted(counts.items(),
                                     key=lambda kv: (kv[0] not in preference,
                                                     preference.index(kv[0])
                                                     if kv[0] in preference else 0, kv[0]))]


def read_database(dsn: str | None, conversation_ids: Sequence[str] | None = None, *,
                  limit: int = DEFAULT_LIMIT, warnings: list[str] | None = None,
                  stored: list[StoredByModel] | None = None) -> tuple[EvalConversation, ...]:
    """Eligible pairs of a live database's conversations (the given ids, else the first
    `limit` of compaction.source_runs in id order), read with the engine's read
    functions in one READ ONLY, REPEATABLE READ transaction: one consistent snapshot,
    and a transaction the server itself refuses to write in. Closed before any model
    call (contract §11). A given id the source holds no run of is added to `warnings`."""
    with db.connect(dsn, read_only=True) as conn:
        # The same first words as every other command on an unmigrated database, not a
        # missing relation's (which would point at check-source).
        if not db.engine_schema_present(conn):
            raise SchemaNotMigrated()
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.transaction():
            ids = (list(dict.fromkeys(conversation_ids)) if conversation_ids
                   else db.conversations_after(conn, "", limit))
            found = [(cid, db.eligible_pairs(conn, cid)) for cid in ids]
            if stored is not None:
                stored.extend(stored_by_model(conn, ids))
            if conversation_ids and warnings is not None:
                warnings.extend(
                    f"the source holds no runs for conversation {cid!r}; is the id right?"
                    for cid, pairs in found if not pairs and not db.source_holds(conn, cid))
    return tuple(
        EvalConversation(cid, guess_language(p.assistant_content for p in pairs), tuple(
            EvalPair(p.pair_index, p.user_message_id, p.user_content,
                     p.assistant_message_id, p.assistant_content) for p in pairs))
        for cid, pairs in found
    )


def load_conversations(args: argparse.Namespace, warnings: list[str] | None = None,
                       stored: list[StoredByModel] | None = None,
                       ) -> tuple[str, tuple[EvalConversation, ...]]:
    """(a name for the source, its conversations) from the command's arguments; what
    deserves a warning (an unknown --conversation) is added to `warnings`."""
    if args.conversation and not args.database:
        raise UsageError("--conversation applies to --database only")
    if args.limit is not None and args.jsonl is not None:
        raise UsageError("--limit applies to --database and --corpus only")
    if args.jsonl is not None:
        return f"jsonl:{args.jsonl.name}", read_jsonl(args.jsonl)
    if args.corpus:
        return f"corpus:seed={args.seed}", read_corpus(args.seed, args.limit)
    return "database", read_database(args.dsn, args.conversation,
                                     limit=args.limit or DEFAULT_LIMIT, warnings=warnings,
                                     stored=stored)


@dataclass(frozen=True, slots=True)
class Contender:
    """One summarizer's report, named as the frontier chart and the side-by-side table
    show it: the model, with `@R` for an offline model's target."""

    label: str
    report: Report


def parse_compare(spec: str) -> tuple[str, float | None]:
    """`MODEL` or `MODEL@R` (R above 0 to 1) of --compare (an argparse type)."""
    model, at, target = spec.rpartition("@")
    if not at:
        return spec, None
    problem = f"expected MODEL or MODEL@R, R a share above 0 and at most 1, got {spec!r}"
    try:
        share = float(target)
    except ValueError:
        raise argparse.ArgumentTypeError(problem) from None
    if not model or not 0.0 < share <= 1.0:
        raise argparse.ArgumentTypeError(problem)
    return model, share


def targeted(model: str) -> bool:
    """Whether a model writes to a target share of bytes (offline, other than the
    extractive-1 summarizer, which fills the contract's 6,000 characters)."""
    return model in BASELINE_MODELS or (model.startswith("pycompactor/")
                                        and model != OFFLINE_MODEL)


def label(model: str, target: float) -> str:
    return f"{model}@{target:g}" if targeted(model) else model


def compare_summarizer(model: str, target: float, args: argparse.Namespace) -> Summarizer:
    """The summarizer --compare names, built with the command's model options."""
    if model in BASELINE_MODELS:
        return BaselineSummarizer(target, caveats_first=model == BASELINE_CAVEATS_MODEL)
    return make_summarizer(model, base_url=getattr(args, "base_url", None),
                           timeout_seconds=args.timeout_seconds, api=args.api,
                           extractive_target=target)


def run_evaluate(args: argparse.Namespace, summarizer: Summarizer, api: str | None) -> int:
    """The command: 0 when it measured something, 1 when every range's call failed
    (the report still printed). Warnings go to stderr and, with --json, into the
    report's `warnings`."""
    warnings: list[str] = []
    # With --database: what each model already stored is to the next Run.
    stored: list[StoredByModel] = []
    source, conversations = load_conversations(args, warnings, stored)
    for warning in warnings:
        print(f"pycompactor: warning: {warning}", file=sys.stderr)
    # A remote model whose first call cannot connect stops the run with one line naming
    # the URL (ModelUnreachable), rather than reporting every range connection_error.
    summarizer = FirstCallGuard(summarizer)
    compare: list[tuple[str, float | None]] = args.compare
    done = 0
    total = len(conversations) * (1 + len(compare))

    def progress(result: ConversationResult) -> None:
        # A model takes seconds a range: on a terminal, say how far it got.
        nonlocal done
        done += 1
        end = "\n" if done == total else ""
        print(f"\revaluated {done}/{total} conversations "
              f"({result.conversation_id})\x1b[K", end=end, file=sys.stderr, flush=True)

    def run(model: Summarizer, model_api: str | None) -> Report:
        return evaluate(conversations, model, source=source, api=model_api,
                        budgets=DEFAULT_BUDGETS,
                        progress=progress if sys.stderr.isatty() else None)

    report = run(summarizer, api)
    primary = Contender(label(summarizer.model, args.extractive_target), report)
    others = []
    for model, target in compare:
        # Without @R: the first model's target, else the default offline model's.
        share = target if target is not None else (
            args.extractive_target if args.extractive_target is not None
            else EXTRACTIVE3_TARGET)
        other = compare_summarizer(model, share, args)
        try:
            other_api = args.api if isinstance(other, OpenAISummarizer) else None
            others.append(Contender(label(model, share), run(other, other_api)))
        finally:
            other.close()
    if args.html is not None:
        args.html.write_text(html_report(report, label=primary.label, compared=others),
                             encoding="utf-8")
    if args.json:
        print_json({**report_json(primary, others), "warnings": warnings,
                    "stored_by_model": [m.to_dict() for m in stored]})
    else:
        from rich.console import Console
        from rich.text import Text

        console = Console(highlight=False, emoji=False, width=TABLE_WIDTH)
        console.print(readable(report, label=primary.label, compared=others))
        if stored:
            console.print(_table(
                "Summaries already stored for these conversations, per model (what the next"
                " Run gets from them; projection_preference: compaction.settings."
                "projection_models)", STORED_HEADERS,
                [(m.model, m.projection_preference or "-", m.summaries, m.used, m.superseded,
                  m.not_usable) for m in stored], right=STORED_HEADERS[1:]))
        if args.html is not None:
            console.print(Text(f"HTML report written to {args.html}"))
    ranges = report.ranges
    if ranges and all(r.failure is not None for r in ranges):
        reasons = sorted({r.failure for r in ranges if r.failure is not None})
        print(f"pycompactor: every one of the {len(ranges)} ranges failed "
              f"({', '.join(reasons)}); nothing was measured", file=sys.stderr)
        return 1
    return 0


def report_json(primary: Contender, compared: Sequence[Contender] = ()) -> dict[str, Any]:
    """What --json prints: the report (Report.to_dict), its label, the frontier (every
    summarizer's pooled compression, attribution and qualifier scope), and each compared
    summarizer pooled, with its summaries of the report's worst ranges."""
    worst = primary.report.worst()
    return {
        **primary.report.to_dict(),
        "label": primary.label,
        "frontier": [frontier_point(c) for c in (primary, *compared)],
        "compared": [{
            "label": c.label, "model": c.report.model, "api": c.report.api,
            "overall": c.report.overall.to_dict(),
            "by_language": {k: v.to_dict() for k, v in c.report.by_language().items()},
            "reach": [r.to_dict() for r in c.report.reach],
            "worst": [_beside(c.report, cid, r) for cid, r in worst],
        } for c in compared],
    }


def frontier_point(c: Contender) -> dict[str, Any]:
    overall = c.report.overall
    return {"label": c.label, "model": c.report.model, "compression": overall.compression,
            "attribution": overall.attribution, "qualifier_scope": overall.qualifier_scope,
            "figure_retention": overall.figure_retention,
            "invented_figures": overall.invented_figures}


def _range_of(report: Report, conversation_id: str, from_pair: int) -> RangeResult | None:
    for c in report.conversations:
        if c.conversation_id == conversation_id:
            return next((r for r in c.ranges if r.from_pair == from_pair), None)
    return None


def _beside(report: Report, conversation_id: str, worst: RangeResult) -> dict[str, Any]:
    """Another summarizer's summary of one of the primary's worst ranges."""
    r = _range_of(report, conversation_id, worst.from_pair)
    return {"conversation_id": conversation_id, "from_pair": worst.from_pair,
            "summary": None if r is None else r.summary,
            "attribution": None if r is None else r.attribution,
            "qualifier_scope": None if r is None else r.qualifier_scope}


# --------------------------------------------------------------------------- rendering


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _kept(kept: int | None, total: int) -> str:
    return "-" if kept is None else f"{kept}/{total}"


def _tokens(input_tokens: int | None, output_tokens: int | None) -> str:
    if input_tokens is None and output_tokens is None:
        return "-"
    return f"{input_tokens if input_tokens is not None else '-'}/" \
           f"{output_tokens if output_tokens is not None else '-'}"


def _table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]],
           right: Sequence[str] = ()) -> Group:
    """A heading and a rich table of literal text, as the demo shows its tables."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    out = Table(box=box.SIMPLE_HEAD)
    for header in headers:
        out.add_column(Text(header), justify="right" if header in right else "left",
                       no_wrap=True, overflow="ellipsis", min_width=len(header))
    for row in rows:
        out.add_row(*(Text("" if v is None else str(v)) for v in row))
    return Group(Text(""), Text(title, style="bold"), out)


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def range_rows(report: Report) -> list[tuple[object, ...]]:
    return [
        (c.conversation_id, c.language, f"{r.from_pair}-{r.to_pair}", r.replies_bytes,
         "-" if r.summary_bytes is None else r.summary_bytes, _ratio(r.compression),
         _kept(r.figures_kept, r.figures_total), _kept(r.qualifiers_kept, r.qualifiers_total),
         _kept(r.attribution_kept, r.attribution_total), _kept(r.scope_kept, r.scope_total),
         _count(r.invented_figures),
         _tokens(r.input_tokens, r.output_tokens), f"{r.seconds:.2f}", r.failure or "")
        for c in report.conversations for r in c.ranges
    ]


def totals_rows(report: Report) -> list[tuple[object, ...]]:
    def row(name: str, t: Totals) -> tuple[object, ...]:
        return (name, t.ranges, t.failed, t.replies_bytes, t.summary_bytes,
                _ratio(t.compression), _pct(t.figure_retention), _pct(t.qualifier_retention),
                _pct(t.attribution), _pct(t.qualifier_scope), t.invented_figures,
                _tokens(t.input_tokens, t.output_tokens), f"{t.seconds:.2f}")

    return [*(row(lang, t) for lang, t in report.by_language().items()),
            row("all", report.overall)]


def reach_rows(report: Report) -> list[tuple[object, ...]]:
    return [(f"{r.budget_bytes // 1024} KiB", r.conversations, r.pairs, r.compacted,
             r.raw_only, f"{r.gain:+d}", r.ceiling) for r in report.reach]


RANGE_HEADERS: Final = ("conversation", "lang", "pairs", "reply bytes", "summary bytes",
                        "compression", "figures", "qualifiers", "attribution", "scope",
                        "invented", "tokens in/out", "seconds", "failure")
TOTALS_HEADERS: Final = ("language", "ranges", "failed", "reply bytes", "summary bytes",
                         "compression", "figure retention", "qualifier retention",
                         "attribution", "qualifier scope", "invented", "tokens in/out",
                         "seconds")
STORED_HEADERS: Final = ("model", "preference", "summaries", "used", "superseded",
                         "stale or not projectable")
SIDE_HEADERS: Final = ("summarizer", "ranges", "failed", "compression", "median",
                       "attribution", "scope", "figures", "qualifiers", "invented",
                       "seconds")
LOST_HEADERS: Final = ("range", "question the replies answer", "expected",
                       "the summary line the reader finds", "it reads")


def _median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def side_rows(contenders: Sequence[Contender]) -> list[tuple[object, ...]]:
    """One row per summarizer, pooled over the same ranges."""
    rows: list[tuple[object, ...]] = []
    for c in contenders:
        t = c.report.overall
        median = _median([r.compression for r in c.report.ranges if r.compression is not None])
        rows.append((c.label, t.ranges, t.failed, _ratio(t.compression), _ratio(median),
                     _pct(t.attribution), _pct(t.qualifier_scope), _pct(t.figure_retention),
                     _pct(t.qualifier_retention), t.invented_figures, f"{t.seconds:.2f}"))
    return rows


def _lost_row(where: str, q: Question) -> tuple[object, ...]:
    return (where, q.question, q.expected, q.found or "(none)",
            q.answer or ("-" if q.kind == "figure" else "lost its qualifier"))


def lost_rows(report: Report, *, per_range: int = 3) -> list[tuple[object, ...]]:
    """The worst ranges' first lost questions: what the replies say beside what the
    summary line the reader finds says."""
    rows = []
    for conversation_id, r in report.worst():
        where = (f"{conversation_id} {r.from_pair}-{r.to_pair}: attribution "
                 f"{_kept(r.attribution_kept, r.attribution_total)}, scope "
                 f"{_kept(r.scope_kept, r.scope_total)}")
        rows += [_lost_row(where if i == 0 else "", q) for i, q in enumerate(r.lost[:per_range])]
    return rows
REACH_HEADERS: Final = ("budget", "conversations", "pairs", "reached with compaction",
                        "reached raw only", "gain", "at most (1-byte summaries)")


def _wrapped_table(title: str, headers: Sequence[str],
                   rows: Sequence[Sequence[object]]) -> Group:
    """A heading and a table of literal text whose long cells wrap (sentences)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    out = Table(box=box.SIMPLE_HEAD)
    for header in headers:
        out.add_column(Text(header), overflow="fold")
    for row in rows:
        out.add_row(*(Text("" if v is None else str(v)) for v in row))
    return Group(Text(""), Text(title, style="bold"), out)


def readable(report: Report, *, max_range_rows: int | None = None, label: str | None = None,
             compared: Sequence[Contender] = ()) -> Group:
    """The default output: per range (the first `max_range_rows` if given), pooled per
    language and overall, reach, the worst ranges' lost questions, and the compared
    summarizers side by side."""
    from rich.console import Group
    from rich.text import Text

    n_ranges = len(report.ranges)
    api = f", {report.api} API" if report.api else ""
    rows = range_rows(report)
    more = ""
    if max_range_rows is not None and len(rows) > max_range_rows:
        more = f"; the first {max_range_rows} of {len(rows)}, --json lists all"
        rows = rows[:max_range_rows]
    return Group(
        Text(f"pycompactor evaluate: model {report.model}{api}, source {report.source}: "
             f"{len(report.conversations)} conversations, {n_ranges} target ranges "
             "(nothing was written)", style="bold"),
        _table("Per range (compression = summary bytes / the ten replies' bytes; figures, "
               f"qualifiers, attribution and scope: kept/total{more})", RANGE_HEADERS, rows,
               right=RANGE_HEADERS[3:13]),
        _table("Pooled (ratios of sums over the summarized ranges)", TOTALS_HEADERS,
               totals_rows(report), right=TOTALS_HEADERS[1:]),
        _table("History the next Run sees: pairs reached under each budget, with the "
               "summaries, with the raw-only projection (newest pairs only), and at most, "
               "with summaries of one byte (the user messages and the newest pairs still "
               "take their bytes)",
               REACH_HEADERS, reach_rows(report), right=REACH_HEADERS[1:]),
        _wrapped_table("The worst ranges (lowest attribution; the first questions each "
                       "summary does not answer; --json and --html show them whole)",
                       LOST_HEADERS, lost_rows(report)),
        *([_table("Side by side, on the same ranges (compression pooled and median; "
                  "attribution, qualifier scope, figure and qualifier retention pooled; "
                  "docs/evaluate.md defines each)", SIDE_HEADERS,
                  side_rows([Contender(label or report.model, report), *compared]),
                  right=SIDE_HEADERS[1:])] if compared else []),
    )


def readable_text(report: Report, *, width: int = TABLE_WIDTH,
                  max_range_rows: int | None = None) -> str:
    """The readable report as plain text (no styling), lines without trailing blanks."""
    import io

    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=width, highlight=False, emoji=False, color_system=None,
            force_terminal=False).print(readable(report, max_range_rows=max_range_rows))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()).strip("\n")


def frontier_chart(contenders: Sequence[Contender], *, standalone: bool = False) -> str:
    """Compression against attribution, one point per summarizer and target, a model's
    targets joined: a team picks its target by looking."""
    models = list(dict.fromkeys(c.report.model for c in contenders))
    colour = {m: charts.PALETTE[i % len(charts.PALETTE)] for i, m in enumerate(models)}
    points = [charts.Point(c.report.model, c.label, c.report.overall.compression or 0.0,
                           c.report.overall.attribution or 0.0, colour[c.report.model])
              for c in contenders]
    return charts.scatter("Frontier: attribution against compression (pooled)", points,
                          x_label="compression (summary bytes / reply bytes)",
                          y_label="attribution", standalone=standalone)


def report_charts(report: Report, *, standalone: bool = False, label: str | None = None,
                  compared: Sequence[Contender] = ()) -> dict[str, str]:
    """The report's charts as SVG text, by name: the frontier (this summarizer and the
    compared ones), compression, retention and attribution distributions over the
    summarized ranges, and reach against budget."""
    done = [r for r in report.ranges if r.failure is None]
    n = max(len(report.conversations), 1)
    reach = report.reach
    return {
        "frontier": frontier_chart([Contender(label or report.model, report), *compared],
                                   standalone=standalone),
        "compression": charts.histogram(
            "Compression per range (summary bytes / reply bytes)",
            [r.compression for r in done if r.compression is not None], _COMPRESSION_EDGES,
            x_label="compression (lower is smaller)", standalone=standalone),
        "figure-retention": charts.histogram(
            "Figure retention per range",
            [r.figure_retention for r in done if r.figure_retention is not None],
            _RETENTION_EDGES, x_label="figures kept / figures in the replies",
            last_label="1 (all)", standalone=standalone),
        "qualifier-retention": charts.histogram(
            "Qualifier retention per range",
            [r.qualifier_retention for r in done if r.qualifier_retention is not None],
            _RETENTION_EDGES, x_label="qualified facts kept / in the replies",
            colour=charts.ORANGE, last_label="1 (all)", standalone=standalone),
        "attribution": charts.histogram(
            "Attribution per range",
            [r.attribution for r in done if r.attribution is not None],
            _RETENTION_EDGES, x_label="questions answered with the right figure / asked",
            last_label="1 (all)", standalone=standalone),
        "reach": charts.bar_chart(
            "Pairs the next Run sees, per conversation (mean)",
            [f"{k} KiB" for k in (r.budget_bytes // 1024 for r in reach)],
            [charts.Series("with compaction", tuple(r.compacted / n for r in reach),
                           charts.BLUE),
             charts.Series("raw only (newest pairs)", tuple(r.raw_only / n for r in reach),
                           charts.ORANGE),
             charts.Series("at most (1-byte summaries)", tuple(r.ceiling / n for r in reach),
                           charts.PALETTE[4])],
            x_label="history budget", y_label="pairs", standalone=standalone),
    }


_CSS: Final = """
body { font-family: sans-serif; margin: 2em; color: #1a1a1a; max-width: 1200px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
table.beside td { text-align: left; vertical-align: top; max-width: 40em; }
pre { white-space: pre-wrap; font-size: 12px; margin: 0; }
dt { font-weight: bold; margin-top: 0.5em; }
"""


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "\n".join("<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in row) + "</tr>"
                     for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}\n</tbody></table>"


def _html_text(text: str | None) -> str:
    return "<i>(none)</i>" if text is None else f"<pre>{escape(text)}</pre>"


def html_worst(report: Report, label: str, compared: Sequence[Contender] = ()) -> str:
    """The worst ranges whole: the ten replies beside each summarizer's summary (all
    text escaped), then the questions the summary does not answer."""
    out = []
    for conversation_id, r in report.worst():
        head = "".join(f"<th>{escape(h)}</th>"
                       for h in ("the ten replies", label, *(c.label for c in compared)))
        others = [_range_of(c.report, conversation_id, r.from_pair) for c in compared]
        cells = [_html_text("\n\n".join(r.replies)), _html_text(r.summary),
                 *(_html_text(None if o is None else o.summary) for o in others)]
        out.append(
            f"<h3>{escape(conversation_id)}, pairs {r.from_pair}-{r.to_pair}: attribution "
            f"{escape(_kept(r.attribution_kept, r.attribution_total))}, qualifier scope "
            f"{escape(_kept(r.scope_kept, r.scope_total))}, invented "
            f"{escape(_count(r.invented_figures))}, compression "
            f"{escape(_ratio(r.compression))}</h3>\n"
            f'<table class="beside"><thead><tr>{head}</tr></thead><tbody><tr>'
            + "".join(f"<td>{c}</td>" for c in cells) + "</tr></tbody></table>\n"
            + _html_table(LOST_HEADERS[1:], [_lost_row("", q)[1:] for q in r.lost]))
    return "\n".join(out) or "<p>No range asks a question (no summarized range holds a " \
                             "figure or a qualifier).</p>"


def html_report(report: Report, *, generated: datetime | None = None,
                label: str | None = None, compared: Sequence[Contender] = ()) -> str:
    """One self-contained HTML page: the tables and inline SVG charts; no script, no
    style sheet, font or image from anywhere else, so it opens offline."""
    when = (generated or datetime.now(UTC)).isoformat(timespec="seconds")
    api = f", {report.api} API" if report.api else ""
    primary = label or report.model
    svgs = "\n".join(f'<figure id="{name}">{svg}</figure>' for name, svg in report_charts(
        report, label=primary, compared=compared).items())
    side = _html_table(SIDE_HEADERS, side_rows([Contender(primary, report), *compared]))
    budgets = ", ".join(f"{k} KiB" for k in BUDGETS_KIB)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pycompactor evaluate: {escape(report.model)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>pycompactor evaluate</h1>
<p>Model <b>{escape(report.model)}</b>{escape(api)}, source {escape(report.source)}:
{len(report.conversations)} conversations, {len(report.ranges)} target ranges.
Generated {escape(when)}. Nothing was written to any database.</p>
<h2>Charts</h2>
<div class="charts">
{svgs}
</div>
<h2>Side by side</h2>
{side}
<h2>Pooled</h2>
{_html_table(TOTALS_HEADERS, totals_rows(report))}
<h2>History the next Run sees ({escape(budgets)})</h2>
{_html_table(REACH_HEADERS, reach_rows(report))}
<h2>Definitions</h2>
<dl>
<dt>compression</dt><dd>UTF-8 bytes of the summary / UTF-8 bytes of the range's ten
assistant replies (below 1: smaller).</dd>
<dt>figure retention</dt><dd>distinct figures (contract §8: numbers, dates, amounts) of the
ten replies that the summary holds verbatim, over all of them.</dd>
<dt>qualifier retention</dt><dd>distinct qualified facts (a figure and a qualifier such as
"not", "only", "no longer", "不再", "仅" in one sentence) of the replies that some sentence
of the summary states whole, over all of them.</dd>
<dt>attribution</dt><dd>each reply sentence with a figure asks a question: the sentence
with that figure masked. A reader looks for the question's words in the summary (rare
words weigh more) and reads the figure of the best sentence; the figure is kept when the
reader finds it, and only it (five equal lines with five figures keep none). Questions the
replies themselves do not answer unambiguously are not asked.</dd>
<dt>qualifier scope</dt><dd>the same for a qualifier ("not", "only", "unlikely",
"smallest", "as of", "不", "最小", ...): the summary sentence the reader finds by the
qualifier's own sentence must carry it.</dd>
<dt>invented</dt><dd>figures of the summary that no reply holds (labels equal to a reply's
id aside).</dd>
<dt>reach</dt><dd>pairs of the conversation that reach the next Run under the budget
(user message verbatim; reply raw or summarized), by the projection's rules, against the
raw-only projection (newest pairs only); at most: the same with every summary one byte
long, what no summary of these ranges can pass (a block still carries its ten user
messages, and the newest pairs travel raw).</dd>
</dl>
<h2>The worst ranges, summary beside source</h2>
{html_worst(report, primary, compared)}
<h2>Per range</h2>
{_html_table(RANGE_HEADERS, range_rows(report))}
</body>
</html>
"""
