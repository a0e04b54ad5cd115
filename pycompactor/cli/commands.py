"""The `pycompactor` command line: the commands, their arguments and exit codes.

Argument types live in `argtypes`, tables and JSON in `render`; the audit command in
`audit`.

Exit codes: 0 success, 1 runtime failure (one line on stderr; --debug adds the
traceback), 2 bad argument (argparse's usage line plus one error line), 141 stdout's
reader went away (nothing on stderr, as a Unix tool ends on SIGPIPE).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pycompactor import __version__, db
from pycompactor.cli.argtypes import (
    budget_bytes,
    concurrency,
    database_timeout,
    invented_figures_allowed,
    lease_seconds,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    retention_ratio,
    temperature,
)
from pycompactor.cli.audit import AUDIT_EXAMPLES, add_audit_arguments, cmd_audit
from pycompactor.cli.render import placement_runs, print_json, render_table
from pycompactor.errors import PycompactorError, SchemaNotMigrated, about_database
from pycompactor.worker.eventlog import redact, secrets_of

if TYPE_CHECKING:
    from pycompactor.summarizers.openai_compatible import Summarizer

Handler = Callable[[argparse.Namespace], int]


def cmd_migrate(args: argparse.Namespace) -> int:
    from pycompactor import schema  # alembic and SQLAlchemy load only for this command
    from pycompactor.cli.source import unmapped_sdk_tables

    dsn = db.resolve_dsn(args.dsn)
    # Reached first as every other command reaches it, so a bad DSN or an unreachable
    # server reads the same here (alembic's own connection wraps the driver's errors).
    db.connect(dsn).close()
    schema.upgrade(dsn, args.to, progress=lambda line: print(line, file=sys.stderr),
                   from_scratch=args.from_scratch)
    print(f"compaction schema at revision {schema.current_revision(dsn)}")
    # A hint, after the migration succeeded: it never turns that into a failure.
    with contextlib.suppress(PycompactorError), db.connect(dsn, read_only=True) as conn:
        for hint in unmapped_sdk_tables(conn):
            print(f"next: {hint}", file=sys.stderr)
    return 0


def warn_if_unknown(conn: db.Connection, conversation_id: str) -> None:
    """Say on stderr when the source has no run of the conversation: a mistyped id
    otherwise reads as an empty conversation (the exit status stays 0, contract §9)."""
    if not db.source_holds(conn, conversation_id):
        print(f"pycompactor: warning: the source holds no runs for conversation"
              f" {conversation_id!r}; is the id right?", file=sys.stderr)


def cmd_plan(args: argparse.Namespace) -> int:
    from pycompactor.cli.plan import target_states

    # Read-only transactions: plan, project and audit also run on a hot standby.
    with db.connect(args.dsn, read_only=True) as conn:
        targets = db.plan_targets(conn, args.conversation)
        n_pairs = len(db.eligible_pairs(conn, args.conversation)) if not args.json else None
        planned, attempts_visible = target_states(conn, args.conversation, args.scope,
                                                  targets)
        if not targets:
            warn_if_unknown(conn, args.conversation)
    if args.json:
        print_json([
            {
                "from_pair": p.target.from_pair,
                "to_pair": p.target.to_pair,
                "source_message_ids": p.target.source_message_ids,
                "source_hash": p.target.source_hash,
                "state": p.state,
            }
            for p in planned
        ])
        return 0
    print(f"conversation {args.conversation}: {n_pairs} eligible pairs, {len(targets)} targets")
    if planned:
        print(render_table(
            ["pairs", "state", "first source id", "last source id", "source_hash"],
            [(f"{p.target.from_pair}-{p.target.to_pair}", p.state,
              p.target.source_message_ids[0], p.target.source_message_ids[-1],
              p.target.source_hash) for p in planned],
        ))
        if not attempts_visible:
            print("(running, failed and exhausted attempts show as not_summarized: this role"
                  " may not read compaction.audit_jobs; compaction_auditor may)")
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from pycompactor.projection import project_history

    with db.connect(args.dsn, read_only=True) as conn:
        projection = project_history(conn, args.conversation, budget_bytes=args.budget_bytes,
                                     scope=args.scope)
        if not projection.pairs:
            warn_if_unknown(conn, args.conversation)
    if projection.pairs and not projection.messages:
        # Exit 0 all the same (contract §9): an empty history is a valid answer,
        # but rarely the one meant.
        print(f"pycompactor: warning: a budget of {projection.budget_bytes} bytes takes none"
              f" of the {len(projection.pairs)} eligible pairs (the newest pair alone costs"
              " more); every pair is omitted", file=sys.stderr)
    if args.json:
        print_json(projection.to_dict())
        return 0
    print(f"conversation {args.conversation} (scope {args.scope}): "
          f"{len(projection.pairs)} eligible pairs, {len(projection.messages)} messages, "
          f"{projection.used_bytes} of {projection.budget_bytes} bytes used")
    # One row per run of pairs with the same placement; --json lists every pair.
    runs = placement_runs(projection.pairs)
    if runs:
        print(render_table(
            ["pairs", "placement", "summary_id"],
            [(f"{a}-{b}" if a != b else f"{a}", placement, summary_id)
             for a, b, placement, summary_id in runs],
        ))
    if projection.rejected_summaries:
        print("rejected summaries:")
        print(render_table(
            ["summary_id", "pairs", "reason"],
            [(r.summary_id, f"{r.from_pair}-{r.from_pair + 9}", r.reason)
             for r in projection.rejected_summaries],
        ))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from pycompactor.cli.importer import import_file, render, terminal_progress

    with db.connect(args.dsn) as conn:
        if not db.engine_schema_present(conn):
            raise SchemaNotMigrated()
        report = import_file(conn, args.file, scope=args.scope, batch_size=args.batch_size,
                             progress=terminal_progress if sys.stderr.isatty() else None)
    if args.json:
        print_json(report.to_dict())
    else:
        print(render(report))
    return 0


def cmd_install_recipe(args: argparse.Namespace) -> int:
    from pycompactor.recipes import install_agents_sqlalchemy

    with db.connect(args.dsn) as conn:
        result = install_agents_sqlalchemy(
            conn, schema=args.schema, sessions_table=args.sessions_table,
            messages_table=args.messages_table, rebuild=not args.no_rebuild)
    rebuilt = ("rebuilt" if result.rebuilt
               else "not rebuilt (CALL compaction.rebuild_derived_state() when ready)")
    print(f"source views now read {result.messages_table} (recipe {result.recipe});"
          f" tracking attached; derived state {rebuilt}")
    print("next: pycompactor check-source")
    return 0


def cmd_check_source(args: argparse.Namespace) -> int:
    from pycompactor.cli.source import check_source

    with db.connect(args.dsn) as conn:
        report = check_source(conn, args.conversation, args.sample)
    if args.fix:
        # Only the statements, one a line, for psql (each outside a transaction block).
        for statement in report.fixes:
            print(statement)
    elif args.json:
        print_json(report.to_dict())
    else:
        for problem in report.problems:
            print(f"problem: {problem}")
        if report.fixes:
            print("fix (one statement at a time, outside a transaction block;"
                  " `check-source --fix` prints just these):")
            for statement in report.fixes:
                print(f"  {statement}")
        if report.derived_state is not None:  # the views match the contract
            print("source views match the contract")
            if report.derived_state_note is not None:
                print(f"derived state: {report.derived_state_note}")
            if report.lookups:
                print(render_table(
                    ["lookup", "view.column", "ms", "index"],
                    [(r.lookup, f"{r.view}.{r.column}",
                      "timed out" if r.milliseconds is None else f"{r.milliseconds:.1f}",
                      "yes" if r.uses_index else "NO")
                     for r in report.lookups],
                ))
            if report.samples:
                print(render_table(
                    ["conversation", "runs", "pairs", "excluded runs (reason: count)"],
                    [(s.conversation_id, s.runs, s.pairs,
                      ", ".join(f"{k}: {v}" for k, v in s.excluded.items()) or "-")
                     for s in report.samples],
                ))
    return 0 if report.ok else 1


def cmd_worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from pycompactor.errors import LogLost
    from pycompactor.worker.eventlog import EventLog, secrets_of
    from pycompactor.worker.process import WorkerConfig, run_worker

    summarizer = build_summarizer(args, args.worker_parser)
    model = summarizer.model
    config = WorkerConfig(
        model=model, dsn=args.dsn, scope=args.scope, once=args.once,
        conversation=args.conversation, sweep=args.sweep, concurrency=args.concurrency,
        lease=timedelta(seconds=args.lease_seconds), poll_seconds=args.poll_seconds,
        drain_seconds=args.drain_seconds, timeout_seconds=args.timeout_seconds,
        log_format=args.log_format, min_figure_retention=args.min_figure_retention,
        max_invented_figures=args.max_invented_figures,
        timeouts=db.Timeouts(lock=timedelta(seconds=args.lock_timeout_seconds),
                             statement=timedelta(seconds=args.statement_timeout_seconds)),
    )
    log = EventLog(args.log_format, secrets=secrets_of(args.dsn))
    server = None
    try:
        if args.metrics_port is not None:
            from pycompactor import metrics

            server = metrics.serve(args.metrics_port, args.metrics_address)
            log.emit("metrics_listening", address=server.address, port=server.port)
        run_worker(config, summarizer, log=log)
    except LogLost:
        return 1  # the log was stderr: nothing is left to say it on
    finally:
        if server is not None:
            server.close()
        summarizer.close()
    return 0


def add_model_arguments(p: argparse.ArgumentParser, *, default: str | None = None) -> None:
    """The model's arguments, the same for every command that calls a summarizer (worker,
    evaluate); `default` is the model when neither --model nor PYCOMPACTOR_MODEL gives one."""
    from pycompactor.summarizers.openai_compatible import (
        DEFAULT_MAX_OUTPUT_TOKENS,
        DEFAULT_TEMPERATURE,
    )

    fallback = ("" if default is None
                else f"; default: {default}, which needs no server")
    # A command with a default model (evaluate) records nothing: its model is only called.
    what = "model id recorded on each job" if default is None else "model to evaluate"
    p.add_argument("--model", default=None, metavar="MODEL",
                   help=f"{what} (env: PYCOMPACTOR_MODEL); "
                        "pycompactor/extractive-3 (or the older -1 and -2) selects an "
                        f"offline summarizer{fallback}")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="the OpenAI-compatible server, e.g. http://127.0.0.1:8080/v1 for a "
                        "local llama-server (env: OPENAI_BASE_URL; docs/models.md)")
    p.add_argument("--max-output-tokens", type=non_negative_int, metavar="N",
                   default=os.environ.get("PYCOMPACTOR_MAX_OUTPUT_TOKENS",
                                          str(DEFAULT_MAX_OUTPUT_TOKENS)),
                   help="output limit sent with each request (max_tokens, or "
                        "max_output_tokens with --api responses); 0 sends none "
                        "(env: PYCOMPACTOR_MAX_OUTPUT_TOKENS; default: "
                        f"{DEFAULT_MAX_OUTPUT_TOKENS}, room for a 6,000-character summary)")
    p.add_argument("--temperature", type=temperature, metavar="T",
                   default=os.environ.get("PYCOMPACTOR_TEMPERATURE",
                                          str(DEFAULT_TEMPERATURE)),
                   help="sampling temperature, 0 to 2, or 'none' to send none; dropped for "
                        "a model that refuses it (env: PYCOMPACTOR_TEMPERATURE; default: "
                        f"{DEFAULT_TEMPERATURE:g})")
    p.add_argument("--api", choices=("chat", "responses"), default="chat",
                   help="OpenAI API to call: chat (Chat Completions, default) or responses "
                        "(the Responses API); the offline summarizer calls neither")
    p.add_argument("--timeout-seconds", type=positive_float, default=120.0, metavar="S",
                   help="deadline of one model call, transport retry included (default: 120)")
    p.add_argument("--extractive-target", type=retention_ratio, metavar="R",
                   default=os.environ.get("PYCOMPACTOR_EXTRACTIVE_TARGET"),
                   help="pycompactor/extractive-2 and -3 only: summaries of at most R x the "
                        "UTF-8 bytes of their ten replies, above 0 to 1 "
                        "(env: PYCOMPACTOR_EXTRACTIVE_TARGET; default: the model's own, "
                        "0.4 for extractive-3, 0.35 for extractive-2)")
    p.set_defaults(default_model=default)


def build_summarizer(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Summarizer:
    """The summarizer the model arguments (add_model_arguments) name; a missing model or
    a bad model argument is a usage error of `parser`."""
    from pycompactor.errors import UsageError
    from pycompactor.summarizers.openai_compatible import DEFAULT_OFFLINE_MODEL, make_summarizer

    model = args.model if args.model is not None else os.environ.get("PYCOMPACTOR_MODEL", "")
    model = model or args.default_model or ""
    if not model:
        parser.error("no model given; pass --model or set PYCOMPACTOR_MODEL "
                     f"({DEFAULT_OFFLINE_MODEL} needs no server)")
    try:
        summarizer = make_summarizer(model, base_url=args.base_url,
                                     timeout_seconds=args.timeout_seconds, api=args.api,
                                     extractive_target=args.extractive_target,
                                     max_output_tokens=args.max_output_tokens or None,
                                     temperature=args.temperature)
    except UsageError as exc:
        parser.error(str(exc))
    # The target the model writes to, so a report names it (its own default when not given).
    target = getattr(summarizer, "target", None)
    if args.extractive_target is None and isinstance(target, float):
        args.extractive_target = target
    return summarizer


def cmd_evaluate(args: argparse.Namespace) -> int:
    from pycompactor.cli.evaluate import run_evaluate
    from pycompactor.summarizers.openai_compatible import OpenAISummarizer

    summarizer = build_summarizer(args, args.command_parser)
    try:
        # An offline summarizer calls no API: the report names none.
        return run_evaluate(args, summarizer,
                            args.api if isinstance(summarizer, OpenAISummarizer) else None)
    finally:
        summarizer.close()


def cmd_demo(args: argparse.Namespace) -> int:
    from pycompactor.cli.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pycompactor",
        description="Cross-run conversation compaction for AI agents, enforced inside PostgreSQL.",
        epilog="Connection: --dsn, else PYCOMPACTOR_DSN, else libpq's PG* variables.",
    )
    parser.add_argument("--version", action="version", version=f"pycompactor {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dsn", default=None,
        help="libpq connection string or URI (env: PYCOMPACTOR_DSN; PG* variables apply)",
    )
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Handler, help_: str, examples: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, parents=[common], help=help_, description=help_,
            epilog="examples:\n" + examples,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        # The subcommand's own parser reports arguments it does not know (see main).
        p.set_defaults(handler=handler, command_parser=p)
        return p

    p = add("migrate", cmd_migrate, "apply the engine's migrations (idempotent, concurrency-safe)",
            "  pycompactor migrate --dsn postgresql://admin@db/agent\n"
            "  PYCOMPACTOR_DSN=postgresql:///agent pycompactor migrate")
    p.add_argument("--to", default="head", metavar="REVISION",
                   help="target revision (default: head)")
    p.add_argument("--from-scratch", action="store_true",
                   help="first DROP schemas compaction and compaction_source with everything"
                        " in them, the reference history included (a throwaway database, or"
                        " one from before the 0.1.0 baseline; docs/operations.md)")

    p = add("plan", cmd_plan,
            "show the ranges the window policy makes targets now, and where each stands",
            "  pycompactor plan conv-42\n  pycompactor plan conv-42 --json\n"
            "  pycompactor plan conv-42 --scope support")
    p.add_argument("conversation", metavar="CONVERSATION")
    p.add_argument("--scope", default="default", metavar="S",
                   help="summary lane whose summaries and attempts the states show"
                        " (default: default)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")

    p = add("project", cmd_project,
            "show the history the next Run gets under a UTF-8 byte budget, and why",
            "  pycompactor project conv-42 --budget-bytes 65536\n"
            "  pycompactor project conv-42 --budget-bytes 65536 --scope support --json")
    p.add_argument("conversation", metavar="CONVERSATION")
    p.add_argument("--budget-bytes", type=budget_bytes, required=True, metavar="N",
                   help="message bytes allowed: UTF-8 bytes of each content + 16 per message")
    p.add_argument("--scope", default="default", metavar="S",
                   help="summary lane to use (default: default)")
    p.add_argument("--json", action="store_true",
                   help="print Projection.to_dict() as JSON for scripts")

    p = add("check-source", cmd_check_source,
            "check the source views against the contract; show excluded runs and why",
            "  pycompactor check-source\n"
            "  pycompactor check-source --conversation conv-42 --json\n"
            "  pycompactor check-source --fix | psql \"$PYCOMPACTOR_DSN\"")
    p.add_argument("--conversation", action="append", metavar="ID",
                   help="sample this conversation (repeatable; default: the first --sample ids)")
    p.add_argument("--sample", type=positive_int, default=5, metavar="N",
                   help="how many conversations to sample (default: 5)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON for scripts")
    out.add_argument("--fix", action="store_true",
                     help="print only the statements that fix the problems (CREATE INDEX"
                          " CONCURRENTLY, ANALYZE; on Citus DROP TRIGGER), one a line, for psql")

    p = add("install-recipe", cmd_install_recipe,
            "point the source views at a known agent schema: views, indexes, tracking",
            "  pycompactor install-recipe agents-sqlalchemy\n"
            "  pycompactor install-recipe agents-sqlalchemy --schema app"
            " --messages-table agent_messages")
    p.add_argument("recipe", choices=["agents-sqlalchemy"],
                   help="agents-sqlalchemy: the OpenAI Agents SDK's SQLAlchemySession tables")
    p.add_argument("--schema", default="public", metavar="S",
                   help="schema of the tables (default: public)")
    p.add_argument("--sessions-table", default="agent_sessions", metavar="T",
                   help="sessions table (default: agent_sessions)")
    p.add_argument("--messages-table", default="agent_messages", metavar="T",
                   help="messages table (default: agent_messages)")
    p.add_argument("--no-rebuild", action="store_true",
                   help="do not derive the existing history now (the engine judges from the"
                        " views until CALL compaction.rebuild_derived_state())")

    p = add("import", cmd_import,
            "load your own history (JSON lines) into the reference tables and queue it",
            "  pycompactor import history.jsonl       # the evaluate --jsonl form\n"
            "  pycompactor import sessions.jsonl      # Agents SDK items per session\n"
            "  pycompactor import history.jsonl --json\n"
            "\n"
            "One conversation a line: {\"conversation_id\", \"pairs\": [{\"user\","
            " \"assistant\"}, ...]}\n"
            "or {\"conversation_id\", \"items\": [...]} (docs/import.md). The file is checked\n"
            "whole first; each conversation is written in one transaction, ids already\n"
            "there are skipped, and the reference tables are analyzed at the end.")
    p.add_argument("file", type=Path, metavar="FILE", help="the JSON lines file")
    p.add_argument("--scope", default="default", metavar="S",
                   help="summary lane to queue the conversations for (default: default)")
    p.add_argument("--batch-size", type=positive_int, default=1000, metavar="N",
                   help="rows per INSERT statement (default: 1000)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")

    p = add("audit", cmd_audit,
            "show jobs, stale summaries, exhausted identities or the event log (metadata only)",
            AUDIT_EXAMPLES)
    add_audit_arguments(p)

    p = add("worker", cmd_worker,
            "claim compaction targets, summarize them outside any transaction, record results",
            "  PYCOMPACTOR_MODEL=pycompactor/extractive-1 pycompactor worker --once\n"
            "  OPENAI_BASE_URL=http://llm:8000/v1 OPENAI_API_KEY=... \\\n"
            "    pycompactor worker --model gpt-4o-mini --concurrency 8 --log-format json\n"
            "  pycompactor worker --once --conversation conv-42 --model pycompactor/extractive-1\n"
            "  pycompactor worker --sweep --model gpt-4o-mini   # hosts that cannot call enqueue\n"
            "  pycompactor worker --model pycompactor/extractive-1 --metrics-port 9464\n"
            "  pycompactor worker --model gpt-4.1-mini --api responses --min-figure-retention 0.9\n"
            "\n"
            "environment: PYCOMPACTOR_DSN (--dsn), PYCOMPACTOR_MODEL (--model), OPENAI_BASE_URL\n"
            "and OPENAI_API_KEY (the OpenAI-compatible server; any key for servers without\n"
            "auth). SIGTERM/SIGINT: stop claiming, drain, record unfinished calls `interrupted`.")
    p.set_defaults(worker_parser=p)
    add_model_arguments(p)
    p.add_argument("--once", action="store_true",
                   help="one pass: claim each target claimable now, process them, exit 0")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--conversation", default=None, metavar="ID",
                       help="only this conversation (default: conversations from the queue)")
    where.add_argument("--sweep", action="store_true",
                       help="walk every conversation of compaction.source_runs, a page at a "
                            "time (for hosts that cannot call compaction.enqueue)")
    p.add_argument("--scope", default="default", metavar="S",
                   help="summary lane to compact (default: default)")
    p.add_argument("--concurrency", type=concurrency, default=4, metavar="N",
                   help="model calls in flight in this process, 1 to 10000 (default: 4); "
                        "compaction.settings.max_running bounds all workers together")
    p.add_argument("--poll-seconds", type=positive_float, default=5.0, metavar="S",
                   help="longest wait between queue polls when idle (default: 5)")
    p.add_argument("--drain-seconds", type=non_negative_float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, how long in-flight calls may finish (default: 30)")
    p.add_argument("--lease-seconds", type=lease_seconds, default=300.0, metavar="S",
                   help="advanced: lease of a claimed attempt, renewed every third of it, "
                        "and of each queue entry taken, 1 to 86400 (default: 300); a "
                        "crashed worker's attempts and entries come back after this")
    # String defaults go through `type`, so a bad environment value is a usage error.
    p.add_argument("--lock-timeout-seconds", type=database_timeout, metavar="S",
                   default=os.environ.get("PYCOMPACTOR_LOCK_TIMEOUT_SECONDS", "5"),
                   help="give up a database lock wait after S seconds and leave that target "
                        "for a later pass (env: PYCOMPACTOR_LOCK_TIMEOUT_SECONDS; default: 5)")
    p.add_argument("--statement-timeout-seconds", type=database_timeout, metavar="S",
                   default=os.environ.get("PYCOMPACTOR_STATEMENT_TIMEOUT_SECONDS", "60"),
                   help="cancel any database statement after S seconds "
                        "(env: PYCOMPACTOR_STATEMENT_TIMEOUT_SECONDS; default: 60)")
    p.add_argument("--min-figure-retention", type=retention_ratio, metavar="R",
                   default=os.environ.get("PYCOMPACTOR_MIN_FIGURE_RETENTION", "0"),
                   help="fail an attempt (reason figures_lost) whose summary keeps fewer than "
                        "R x the distinct figures (numbers, dates, amounts) of its ten replies; "
                        "0 to 1 (env: PYCOMPACTOR_MIN_FIGURE_RETENTION; default: 0 = off)")
    p.add_argument("--max-invented-figures", type=invented_figures_allowed, metavar="N",
                   default=os.environ.get("PYCOMPACTOR_MAX_INVENTED_FIGURES", "0"),
                   help="fail an attempt (reason figures_invented) whose summary states more "
                        "than N distinct figures that none of its ten replies holds "
                        "(bracketed reply ids aside); 0 to 6000 "
                        "(env: PYCOMPACTOR_MAX_INVENTED_FIGURES; default: 0)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="stderr log: key=value text (default) or one JSON object per line")
    p.add_argument("--metrics-port", type=port_number, default=None, metavar="PORT",
                   help="serve Prometheus metrics over HTTP on this port (0: any free port, "
                        "logged as metrics_listening); default: no endpoint")
    p.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDR",
                   help="address the metrics endpoint binds (default: 127.0.0.1; "
                        "0.0.0.0 for a Prometheus on another host)")

    add_evaluate_command(add)

    add("demo", cmd_demo,
        "start a throwaway PostgreSQL, migrate, load a sample conversation and show the plan",
        "  pycompactor demo")
    return parser


def add_evaluate_command(add: Callable[[str, Handler, str, str], argparse.ArgumentParser],
                         ) -> None:
    from pycompactor.cli.evaluate import DEFAULT_MODEL, EVALUATE_EXAMPLES, add_evaluate_arguments

    p = add("evaluate", cmd_evaluate,
            "measure what a summarizer buys and loses on conversations, writing nothing: "
            "compression, figure and qualifier retention, history reach per budget",
            EVALUATE_EXAMPLES)
    add_evaluate_arguments(p)
    add_model_arguments(p, default=DEFAULT_MODEL)


def quiet_driver_warnings() -> None:
    """Keep psycopg's own warnings off stderr (logging's last-resort handler).

    When a connection dies inside a pipeline, psycopg logs "error ignored terminating
    <Pipeline>" besides raising the error we handle; on stderr that line would break the
    one-line errors and the worker's one-event-per-line log. An application that
    configures logging still receives the records (they propagate to its handlers).
    """
    logging.getLogger("psycopg").addHandler(logging.NullHandler())


#: A command whose reader went away (`pycompactor audit | head`) ends as a Unix tool
#: killed by SIGPIPE reports it to the shell: 128 + 13, nothing on stderr.
EXIT_PIPE_CLOSED = 141


def run_to_pipe(handler: Handler, args: argparse.Namespace) -> int:
    """Run a command that writes its result to stdout, ending quietly (EXIT_PIPE_CLOSED)
    when stdout's reader has gone away. The worker writes its log to stderr instead and
    is not run here."""
    try:
        code = handler(args)
        sys.stdout.flush()  # a closed pipe shows here rather than at the interpreter's exit
    except BrokenPipeError:
        # What is still buffered goes nowhere: the interpreter flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE_CLOSED
    return code


def main(argv: Sequence[str] | None = None) -> int:
    quiet_driver_warnings()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # parse_args would have the top-level parser say so, with the top-level usage;
        # the subcommand's usage is the one that helps.
        command_parser: argparse.ArgumentParser = args.command_parser
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    handler: Handler = args.handler
    try:
        return handler(args) if args.command == "worker" else run_to_pipe(handler, args)
    except KeyboardInterrupt:
        print("pycompactor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line, never a traceback unless asked
        # Drivers quote a malformed DSN, password and all (libpq, SQLAlchemy): mask it.
        secrets = secrets_of(getattr(args, "dsn", None))
        if args.debug:
            print(redact(traceback.format_exc(), secrets), file=sys.stderr, end="")
        message = str(exc) if isinstance(exc, PycompactorError) else f"{type(exc).__name__}: {exc}"
        message = redact(message, secrets)
        line = message.splitlines()[0] if message else type(exc).__name__
        target = (db.describe_target(getattr(args, "dsn", None)) if args.command != "demo"
                  else None)
        if target is not None and about_database(exc):
            # Name the database: without --dsn, libpq's defaults chose one the user may
            # never have meant (the local socket, a database named after the user).
            line = f"{line.rstrip('.')} ({target})"
        print(f"pycompactor: error: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
