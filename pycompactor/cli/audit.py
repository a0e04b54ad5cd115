"""`pycompactor audit`: the audit views as readable tables or JSON (metadata only).

Every view it shows is readable by compaction_auditor, so a DBA can run it under that
role; none of them holds message or summary text.
"""

from __future__ import annotations

import argparse

from pycompactor import db
from pycompactor.cli.argtypes import positive_int
from pycompactor.cli.render import cell, jsonable, print_json, render_table
from pycompactor.models import AuditReport

#: The columns shown as a table (--json prints every column of the view).
TABLE_COLUMNS: dict[str, list[str]] = {
    "jobs": ["conversation_id", "scope", "pairs", "job_id", "model", "prompt_version",
             "attempt", "state", "reason", "worker", "started_at", "duration", "summary_id",
             "figures_kept", "figures_invented", "input_tokens", "output_tokens"],
    "stale": ["summary_id", "conversation_id", "scope", "pairs", "prompt_version", "imported",
              "staleness", "completed_at"],
    "exhausted": ["conversation_id", "scope", "pairs", "job_id", "model", "prompt_version",
                  "first_reason", "second_reason", "exhausted_at"],
    "events": ["event_id", "occurred_at", "kind", "conversation_id", "scope", "pairs",
               "job_id", "attempt", "reason", "summary_id"],
    "queue": ["scope", "queued", "leased", "expired_leases", "oldest_queued_at",
              "oldest_queued_age"],
    "models": ["model", "projection_preference", "jobs", "completed", "imported",
               "failed_attempts", "running", "input_tokens", "output_tokens", "figures_kept",
               "figures_total"],
}

AUDIT_EXAMPLES = (
    "  pycompactor audit                              # jobs and their attempts\n"
    "  pycompactor audit --view stale                 # summaries whose source changed\n"
    "  pycompactor audit --view exhausted --json\n"
    "  pycompactor audit --view events --limit 20 --conversation conv-42\n"
    "  pycompactor audit --view queue                 # queued, leased, oldest age per scope\n"
    "  pycompactor audit --view models                # per model, and the projection preference\n"
)


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--view", choices=[*db.AUDIT_VIEWS, *db.AUDIT_REPORTS],
                        default="jobs",
                        help="jobs (default): jobs with attempts; stale: summaries whose source"
                             " changed; exhausted: identities with 2 failed attempts; events:"
                             " the event log; queue: the work queue per scope (entries"
                             " waiting, leased, the oldest one's age); models: per model,"
                             " its jobs, summaries, failed attempts, tokens and figures, and"
                             " its place in the owner's projection preference")
    parser.add_argument("--conversation", metavar="ID", default=None,
                        help="only this conversation (not with --view queue)")
    parser.add_argument("--limit", type=positive_int, default=50, metavar="N",
                        help="newest N rows (default: 50)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


def render(view: str, report: AuditReport) -> str:
    columns = TABLE_COLUMNS[view]
    if not report.rows:
        return f"{report.view}: no rows"
    return render_table(columns, [[cell(row, c) for c in columns] for row in report.rows])


def cmd_audit(args: argparse.Namespace) -> int:
    if args.view in db.AUDIT_VIEWS_PER_SCOPE and args.conversation is not None:
        parser: argparse.ArgumentParser = args.command_parser
        parser.error(f"--conversation does not apply to --view {args.view} (one row per scope)")
    with db.connect(args.dsn, read_only=True) as conn:
        if args.view == "models":
            report = db.audit_models(conn, conversation_id=args.conversation)
            preference = db.projection_models(conn)
        else:
            report = db.audit(conn, args.view, conversation_id=args.conversation,
                              limit=args.limit)
    if args.json:
        print_json([{k: jsonable(v) for k, v in row.items()} for row in report.rows])
        return 0
    if args.view == "models":
        # The rule the preference feeds (docs/contract.md §9), said where it is shown.
        print("projection preference (compaction.settings.projection_models): "
              + (", ".join(preference) + " (named earlier first, then unnamed models)"
                 if preference else "none (a range's latest valid summary is used)"))
    print(render(args.view, report))
    return 0
