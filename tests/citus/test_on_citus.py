"""The engine on a real Citus cluster (make test-citus): distributed as documented, then
the single-node suite's worker, storm, fencing, projection, erasure and audit tests, run
unchanged against the distributed database (the fixtures in tests/citus/conftest.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

Conn = psycopg.Connection[Any]


def test_tables_are_placed_as_citus_tables_says(conn: Conn) -> None:
    placed = dict(conn.execute(
        "SELECT logicalrelid::regclass::text,"
        " CASE partmethod WHEN 'h' THEN 'distributed' WHEN 'n' THEN 'reference' END"
        " FROM pg_dist_partition").fetchall())
    wanted = dict(conn.execute(
        "SELECT table_name, placement FROM compaction.citus_tables()").fetchall())
    assert placed == wanted
    # The conversation group and the queue's own, as citus_tables() says.
    groups = conn.execute(
        "SELECT ct.colocation, count(DISTINCT p.colocationid), count(*)"
        " FROM pg_dist_partition AS p"
        " JOIN compaction.citus_tables() AS ct ON ct.table_name = p.logicalrelid::regclass::text"
        " WHERE p.partmethod = 'h' GROUP BY ct.colocation ORDER BY 1").fetchall()
    assert groups == [("conversation", 1, 13), ("queue", 1, 1)]
    apart = conn.execute(
        "SELECT count(DISTINCT colocationid) FROM pg_dist_partition WHERE partmethod = 'h'"
    ).fetchone()
    assert apart == (2,)


APP = "app_writer"


def _history_sql(conversation_id: str, runs: int = 35) -> str:
    return (
        "INSERT INTO compaction_source.conversations (conversation_id)"
        f" VALUES ('{conversation_id}');"
        " INSERT INTO compaction_source.runs (conversation_id, run_id, status)"
        f" SELECT '{conversation_id}', '{conversation_id}-r' || i, 'completed'"
        f" FROM generate_series(1, {runs}) AS i;"
        " INSERT INTO compaction_source.messages"
        " (conversation_id, message_id, run_id, role, status, content, seq)"
        f" SELECT '{conversation_id}', '{conversation_id}-m' || i || r, '{conversation_id}-r' || i,"
        " CASE r WHEN 'u' THEN 'user' ELSE 'assistant' END, 'completed',"
        " 'turn ' || i || r, i * 2 + (r = 'a')::int"
        f" FROM generate_series(1, {runs}) AS i, unnest(ARRAY['u', 'a']) AS r;")


def test_the_application_enqueues_in_the_transaction_that_writes_its_history(
        conn: Conn, dsn: str) -> None:
    """docs/operations.md: writers of history call compaction.enqueue, in the transaction
    that writes the Run, with the application's own login and only the documented grant.
    Conversations on both workers, an enqueue before and after the writes, one commit."""
    from tests.citus.conftest import runbook_block

    conn.execute(
        f"DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{APP}') THEN"
        f" CREATE ROLE {APP} LOGIN; END IF; END $$")
    conn.execute(f"GRANT USAGE ON SCHEMA compaction_source TO {APP};"
                 f" GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA compaction_source TO {APP}")
    (grant,) = runbook_block("sql", "-- the application's login")
    conn.execute(grant.replace(" TO app;", f" TO {APP};"))
    conversations = [f"app-{i}" for i in range(6)]
    placed = {conn.execute(
        "SELECT nodeport FROM pg_dist_shard_placement"
        " WHERE shardid = get_shard_id_for_distribution_column('compaction.jobs', %s::text)",
        (c,)).fetchone() for c in conversations}
    assert len(placed) == 2, "the conversations should live on both workers"
    app_dsn = psycopg.conninfo.make_conninfo(dsn, user=APP)
    with psycopg.connect(app_dsn) as app:
        with app.transaction():
            app.execute("SELECT compaction.enqueue(%s)", (conversations[0],))
            for cid in conversations:
                app.execute(_history_sql(cid))
                app.execute("SELECT compaction.enqueue(%s)", (cid,))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            app.execute("SELECT * FROM compaction.plan_targets('app-0')")
    queued = conn.execute("SELECT conversation_id FROM compaction.queue ORDER BY 1").fetchall()
    assert queued == [(c,) for c in conversations]
    for cid in conversations:
        targets = conn.execute("SELECT from_pair FROM compaction.plan_targets(%s)",
                               (cid,)).fetchall()
        assert targets == [(0,)]  # 35 pairs: one range before the window


# The single-node suite's tests, unchanged, on the distributed database. Each gets a
# database of its own on all three nodes (tests/citus/conftest.py).
# Claims, refusals, retries, fencing and leases:
# The worker process end to end, against the scripted model server:
from tests.e2e.test_worker import (  # noqa: E402, F401
    test_crashed_worker_is_recovered_by_another,
    test_four_workers_fifty_conversations,
    test_request_carries_only_the_ten_assistant_replies,
)

# The audit views, and every recipe of docs/audit.md, as the auditor:
from tests.sql.test_audit import (  # noqa: E402, F401
    test_audit_cli_runs_as_auditor,
    test_audit_views,
    test_docs_audit_queries_run,
)

# A worker's look with its first claims, raced.
from tests.sql.test_claim_next_targets import (  # noqa: E402, F401
    test_concurrent_looks_claim_each_range_once_within_admission,
)

# A worker's batches of claims, raced. (The test that compares a batch
# with claims one by one rolls each back in one transaction, which Citus refuses when
# the superuser reads placements the owner's functions wrote in it.)
from tests.sql.test_claim_targets import (  # noqa: E402, F401
    test_concurrent_batches_claim_each_range_once_within_admission,
)
from tests.sql.test_claims import (  # noqa: E402, F401
    test_admission_full,
    test_claim_then_complete,
    test_expired_unreaped_attempt_is_failed_by_the_fenced_call,
    test_heartbeat_extends_the_lease,
    test_reaped_attempt_is_fenced_off,
    test_refusal_order,
    test_retry_keeps_job_id,
    test_unknown_token_is_lease_lost,
)

# Imports and erasure:
from tests.sql.test_import_erase import (  # noqa: E402, F401
    test_claim_on_imported_identity_is_already_completed,
    test_erase_conversation,
    test_erasure_exempts_only_its_own_conversation_and_transaction,
)

# Projection: Case B (a changed source makes a summary stale), Case C (a block that does
# not fit falls back to raw pairs), versions, a stale summary beyond the budget's reach:
from tests.sql.test_projection import (  # noqa: E402, F401
    test_block_that_does_not_fit_falls_back_to_raw,
    test_case_b_changed_source_makes_the_summary_stale,
    test_stale_summary_beyond_reach_is_stale_source,
    test_versions_one_never_two_used_three_wins,
)

# The reader's and the worker's views (Citus runs a view's shard queries with the
# caller's rights):
from tests.sql.test_roles import (  # noqa: E402, F401
    test_reader_and_worker_read_their_views,
    test_reader_reads_summaries_and_versions_only,
)

# Storms of real processes, exact outcomes; admission exact:
from tests.sql.test_storm import storm32, test_admission_storm, test_claim_storm  # noqa: E402, F401


def test_erasure_outside_a_transaction_block_is_refused_and_changes_nothing(
        conn: Conn) -> None:
    """On Citus the erasure mark reaches the shards only from inside a transaction block
    (docs/operations.md): a bare autocommit call is refused by the guards, and nothing
    changes. db.erase_conversation opens the block itself (test_erase_conversation)."""
    from tests.sql.test_import_erase import populate

    populate(conn, "c1")
    tables = ("jobs", "attempts", "job_summaries", "audit_events", "queue")

    def counts() -> list[Any]:
        return [conn.execute(f"SELECT count(*) FROM compaction.{t}").fetchone()
                for t in tables]

    before = counts()
    with pytest.raises(psycopg.Error) as refused:
        conn.execute("SELECT compaction.erase_conversation('c1', 'gdpr_request')")
    assert refused.value.sqlstate == "CP010"
    assert counts() == before
    with conn.transaction():
        erased = conn.execute(
            "SELECT compaction.erase_conversation('c1', 'gdpr_request')").fetchone()
    assert erased == (2,)


def test_check_source_says_the_derived_state_is_in_use_on_citus(
        conn: Conn, dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The tracking triggers stay attached on Citus, so the derived state is in
    use there; with one detached, check-source names the table to attach them to."""
    from pycompactor import cli
    from tests.sql.test_import_erase import populate

    populate(conn, "c1")
    assert cli.main(["check-source", "--dsn", dsn]) == 0
    out = capsys.readouterr().out
    assert "derived state: in use" in out
    conn.execute("SELECT compaction.detach_source_tracking('compaction_source.runs')")
    conn.execute("DROP TRIGGER runs_track_insert ON compaction_source.runs")
    assert cli.main(["check-source", "--dsn", dsn]) == 0
    out = capsys.readouterr().out
    assert "not in use on Citus" in out
    assert "tables without them: compaction_source.runs" in out
    assert "attach_source_tracking" in out


def test_bench_citus_smoke(tmp_path: Any) -> None:
    """`make bench-citus` at tiny sizes: both setups drain every range and project, and
    the report states each goal (the numbers at these sizes mean nothing)."""
    import json
    import os

    from bench import scale_out

    pg_config = os.environ["PYCOMPACTOR_CITUS_PG_CONFIG"]
    assert scale_out.main(["--pg-config", pg_config, "--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "scale_out.json").read_text(encoding="utf-8"))
    for setup in ("single_node", "citus"):
        assert results[setup]["drain"]["ranges"] == results[setup]["drain"]["claimed"] > 0
        assert (results[setup]["long_drain"]["ranges"]
                == results[setup]["long_drain"]["claimed"] == 4)  # 60 pairs: ranges 0-30
        assert set(results[setup]["projection"]["p50_ms"]) == {"40", "100", "200"}
        assert results[setup]["derived_state"] == "in_use"
        assert results[setup]["appends"]["tracked_ms"] > 0
        assert results[setup]["appends"]["untracked_ms"] > 0
        assert results[setup]["cycles"]["claim_complete_ms"] > 0
        assert results[setup]["cycles"]["audit_stale_summaries_ms"] > 0
        assert set(results[setup]["probe"]["every_shard_ms"]) == {"colocated", "per_worker"}
        assert set(results[setup]["probe"]["range_calls_ms"]) == {
            "judge_runs", "current_range", "worker_targets", "range_replies", "admission_write"}
    # The probe's tables on Citus: as many shards as the history's (the runbook's count),
    # and one per worker.
    assert results["shard_count"] == scale_out.RUNBOOK_SHARD_COUNT
    assert results["citus"]["probe"]["shards"] == {
        "colocated": scale_out.RUNBOOK_SHARD_COUNT, "per_worker": 2}
    for setup in ("single_node", "citus"):
        assert results[setup]["probe"]["foreign_question_ms"] > 0
    # The premise of Citus's design here (docs/operations.md): a trigger on a shard keeps
    # its own conversation's rows, and Citus refuses it anything that reaches further.
    outcomes = results["citus"]["probe"]["shard_triggers"]["outcomes"]
    assert outcomes["write its own conversation's row of a co-located table"] == "ok"
    for reach in ("read every shard of a co-located table",
                  "write another conversation's row, on another node"):
        assert outcomes[reach].startswith("refused: "), outcomes
    assert results["single_node"]["probe"]["shard_triggers"] is None
    assert set(results["goals"]) == {
        "drain_citus_over_single", "drain_met", "long_drain_citus_over_single",
        "long_drain_met", "projection_citus_over_single",
        "projection_met", "projection_large_over_small_citus", "projection_scaling_met",
        "append_tracked_over_untracked_citus", "append_met", "audit_citus_over_single",
        "audit_met"}
    report = (tmp_path / "scale_out.md").read_text(encoding="utf-8")
    assert "| drain:" in report
    assert "| drain: one conversation of 60 pairs, 4 ranges" in report
    assert ("a read of every shard of an empty table, co-located with the history"
            f" ({scale_out.RUNBOOK_SHARD_COUNT} shards)") in report
    assert "cross-conversation question, as every read asks it first" in report
    assert "| tracked / untracked append |" in report
    assert "| read every shard of a co-located table | refused: " in report


def _remote_commands(conn: Conn, query: str) -> tuple[list[Any], list[str]]:
    """The query's rows and the commands Citus sent the workers to answer it."""
    notices: list[str] = []

    def keep(diagnostic: psycopg.errors.Diagnostic) -> None:
        if diagnostic.message_primary and diagnostic.message_primary.startswith("issuing "):
            notices.append(diagnostic.message_primary)

    conn.add_notice_handler(keep)
    try:
        with conn.transaction():
            conn.execute("SET LOCAL citus.log_remote_commands = on")
            rows = conn.execute(query).fetchall()
    finally:
        conn.remove_notice_handler(keep)
    return rows, notices


def test_judging_a_conversation_sends_no_intermediate_result_and_no_read_by_run_id(
        conn: Conn) -> None:
    """Every call that judges a conversation from the views (always on Citus) starts from
    judge_runs. Its verdicts are one query of one conversation, sent whole
    to the node that holds it, and a conversation of up to 256 runs asks the question
    across conversations (contract §3) with its runs as a value. Otherwise Citus reads every
    shard of the runs by run id for the named-runs branch, and sends the conversation's
    runs to every worker as an intermediate result first: 81 commands for 100 runs."""
    conn.execute(_history_sql("judged", runs=100))
    conn.execute(_history_sql("judged-large", runs=300))
    # A reply filed under the small conversation names one of the large one's runs.
    conn.execute("INSERT INTO compaction_source.messages"
                 " (conversation_id, message_id, run_id, role, status, content, seq)"
                 " VALUES ('judged', 'stray', 'judged-large-r7', 'assistant', 'completed',"
                 " 'filed elsewhere', 1000)")
    shards = message_shards(conn)
    rows, issued = _remote_commands(
        conn, "SELECT run_id, reason FROM compaction.judge_runs('judged')")
    assert len(rows) == 100
    assert {reason for _, reason in rows} == {None}
    assert not [c for c in issued if c.startswith("issuing COPY")], issued
    assert not [c for c in issued if "ANY (NULL::text[])" in c], issued
    # The runs, the question on every shard of the messages, the verdicts (and the
    # transactions around them).
    queries = [c for c in issued if c.startswith("issuing SELECT")]
    assert len(queries) == 1 + shards + 1, issued
    # Above 256 runs the question keeps its subquery, and still finds the reply filed
    # elsewhere.
    rows, issued = _remote_commands(
        conn, "SELECT run_id, reason FROM compaction.judge_runs('judged-large')"
              " WHERE reason IS NOT NULL")
    assert rows == [("judged-large-r7", "foreign_message")]
    assert not [c for c in issued if "ANY (NULL::text[])" in c], issued


def test_the_replies_of_a_claimed_range_are_two_queries_to_its_node(conn: Conn) -> None:
    """After a claim, range_replies reads the replies by the ids of the
    claimed job, with the hash of their texts, in two queries to the node that holds the
    conversation (the job's ids, then the texts and their hash), and nothing else: not
    judging the conversation again, and not the derived range, whose use asks the record
    of foreign messages on every shard first (the claim asked both a moment before). A
    text edited since the claim still withholds every reply."""
    from pycompactor import db

    conn.execute(_history_sql("replied", runs=100))
    target = db.plan_targets(conn, "replied")[2]
    assert db.claim(conn, "replied", "default", target.from_pair, target.source_message_ids,
                    target.source_hash, "test-model", "conversation-compaction@3",
                    "w").claimed
    query = ("SELECT pair_index, assistant_message_id, assistant_content"
             f" FROM compaction.range_replies('replied', {target.from_pair},"
             f" '{target.source_hash}')")
    rows, issued = _remote_commands(conn, query)
    assert [r[1] for r in rows] == target.source_message_ids[1::2]
    assert [r[0] for r in rows] == list(range(target.from_pair, target.from_pair + 10))
    queries = [c for c in issued if c.startswith(("issuing SELECT", "issuing WITH"))]
    assert len(queries) == 2, issued
    assert every_shard(issued) == 0, issued
    assert not [c for c in issued if c.startswith("issuing COPY")], issued
    conn.execute("UPDATE compaction_source.messages SET content = content || '!'"
                 " WHERE conversation_id = 'replied' AND message_id = %s",
                 (target.source_message_ids[6],))
    assert conn.execute(query).fetchall() == []


def function_settings(c: Conn, signature: str, prefix: str) -> list[str]:
    """The SET clauses of one engine function whose names start with `prefix`."""
    row = c.execute("SELECT proconfig FROM pg_proc WHERE oid = %s::regprocedure",
                    (signature,)).fetchone()
    assert row is not None
    return [s for s in (row[0] or []) if s.startswith(prefix)]


def message_shards(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM pg_dist_shard"
                       " WHERE logicalrelid = 'compaction_source.messages'::regclass"
                       ).fetchone()
    assert row is not None
    return int(row[0])


def every_shard(issued: list[str]) -> int:
    """How often the cross-conversation question went out, one command per shard: judged
    from the views, of the messages of these runs filed under another conversation; with
    the derived state in use, of the record of foreign messages, read whole."""
    return sum(1 for c in issued if "(conversation_id IS DISTINCT FROM" in c
               or "FROM compaction.foreign_messages_" in c)


def test_a_batch_of_claims_asks_every_shard_once(conn: Conn) -> None:
    """Four claims of one conversation, one by one, judge it four times
    from the views, each judgement with a question to every shard of the messages; the
    same four ranges in one claim_targets call ask it once."""
    from pycompactor import db

    shards = message_shards(conn)

    issued_one_by_one: list[str] = []
    conn.execute(_history_sql("one-by-one", runs=100))
    for t in db.plan_targets(conn, "one-by-one")[:4]:
        rows, issued = _remote_commands(
            conn, "SELECT claimed FROM compaction.claim('one-by-one', 'default',"
                  f" {t.from_pair}, ARRAY{t.source_message_ids!r}, '{t.source_hash}',"
                  " 'test-model', 'conversation-compaction@3', 'w')")
        assert rows == [(True,)]
        issued_one_by_one += issued
    conn.execute(_history_sql("batched", runs=100))
    targets = db.plan_targets(conn, "batched")[:4]
    ids = ", ".join(f"ARRAY{t.source_message_ids!r}" for t in targets)
    hashes = ", ".join(f"'{t.source_hash}'" for t in targets)
    rows, issued_batch = _remote_commands(
        conn, "SELECT from_pair, claimed FROM compaction.claim_targets('batched', 'default',"
              f" ARRAY{[t.from_pair for t in targets]!r}, ARRAY[{ids}], ARRAY[{hashes}],"
              " 'test-model', 'conversation-compaction@3', 'w')")
    assert rows == [(t.from_pair, True) for t in targets]
    assert every_shard(issued_one_by_one) == 4 * shards, issued_one_by_one
    assert every_shard(issued_batch) == shards, issued_batch


def test_a_look_and_its_claims_ask_every_shard_once(conn: Conn) -> None:
    """worker_targets and then claim_targets judge a conversation twice, each
    judgement with a question to every shard of the messages; claim_next_targets, which
    looks and claims the same four ranges, asks it once."""
    from pycompactor import db

    shards = message_shards(conn)

    conn.execute(_history_sql("two-calls", runs=100))
    rows, looked = _remote_commands(
        conn, "SELECT from_pair, source_message_ids, source_hash FROM"
              " compaction.worker_targets('two-calls', 'default', 'test-model',"
              " 'conversation-compaction@3')")
    targets = rows[:4]
    ids = ", ".join(f"ARRAY{list(t[1])!r}" for t in targets)
    hashes = ", ".join(f"'{t[2]}'" for t in targets)
    rows, claimed = _remote_commands(
        conn, "SELECT from_pair, claimed FROM compaction.claim_targets('two-calls', 'default',"
              f" ARRAY{[t[0] for t in targets]!r}, ARRAY[{ids}], ARRAY[{hashes}],"
              " 'test-model', 'conversation-compaction@3', 'w')")
    assert rows == [(t[0], True) for t in targets]
    conn.execute(_history_sql("one-call", runs=100))
    rows, issued = _remote_commands(
        conn, "SELECT from_pair, claimed FROM compaction.claim_next_targets('one-call',"
              " 'default', 4, 'test-model', 'conversation-compaction@3', 'w')")
    assert [r for r in rows if r[1] is not None] == [(t[0], True) for t in targets]
    assert db.plan_targets(conn, "one-call")[4:] != []
    assert every_shard(looked) + every_shard(claimed) == 2 * shards
    assert every_shard(issued) == shards, issued


def test_a_judgement_asks_every_shard_on_one_connection_per_node(conn: Conn) -> None:
    """distribute_on_citus sets judge_runs' executor to one connection per node (a
    judgement's question to every shard is index probes; more connections cost more to
    open than they save), and the judgement stands with it."""
    def pool(c: Conn) -> list[str]:
        return function_settings(c, "compaction.judge_runs(text, text[], boolean)", "citus.")

    assert pool(conn) == ["citus.max_adaptive_executor_pool_size=1"]
    conn.execute(_history_sql("pooled", runs=40))
    assert conn.execute("SELECT count(*) FROM compaction.judge_runs('pooled')"
                        " WHERE reason IS NULL").fetchone() == (40,)


def test_a_projection_on_citus_is_one_statement_planned_with_its_values(conn: Conn) -> None:
    """Judged from the views, a projection is projection_read's one statement on Citus
    too, its texts written out in it, which Citus plans only with the values bound:
    distribute_on_citus resets projection_read's plan_cache_mode (it forces generic plans
    on one node), and the projection stays the same past the five calls after which a
    plan may turn generic."""
    from pycompactor import db, project_history

    def planning(c: Conn) -> list[str]:
        return function_settings(c, "compaction.projection_read(text, text, int, bigint, int)",
                                 "plan_cache_mode")

    assert planning(conn) == []
    conn.execute(_history_sql("framed", runs=40))
    [target] = [t for t in db.plan_targets(conn, "framed") if t.from_pair == 0]
    conn.execute("SELECT compaction.import_summary('framed', 'default', 0, %s, %s, 'm',"
                 " 'conversation-compaction@3', 'summary of 0', now())",
                 (target.source_message_ids, target.source_hash))
    # Read from the derived state (projection_frame planned with its values
    # too), then judged from the views once the tracking is disabled.
    assert function_settings(conn, "compaction.projection_frame(text, text, int)",
                             "plan_cache_mode") == ["plan_cache_mode=force_custom_plan"]
    first = project_history(conn, "framed", budget_bytes=1_000_000).to_dict()
    assert [p["placement"] for p in first["pairs"]] == ["summarized"] * 10 + ["raw"] * 30
    for derived, frame_start in ((True, 20), (False, 0)):
        if not derived:
            conn.execute("ALTER TABLE compaction_source.messages"
                         " DISABLE TRIGGER messages_track_update")
        for _ in range(8):
            assert project_history(conn, "framed", budget_bytes=1_000_000).to_dict() == first
        [frame] = conn.execute("SELECT derived, pair_count, first_pair, summary_ids"
                               " FROM compaction.projection_frame('framed', 'default', 20)"
                               ).fetchall()
        assert frame[:3] == (derived, 40, frame_start)
        assert len(frame[3]) == (0 if derived else 1)  # the derived frame starts past it


def test_tracking_attaches_to_a_distributed_host_table(conn: Conn) -> None:
    """attach_source_tracking works on Citus: the triggers reach the shards and the
    table's writes go on."""
    conn.execute("CREATE TABLE public.turns (thread_id text, turn_id text, status text,"
                 " PRIMARY KEY (thread_id, turn_id))")
    conn.execute("SELECT create_distributed_table('public.turns', 'thread_id',"
                 " colocate_with => 'compaction.jobs')")
    conn.execute("SELECT compaction.attach_source_tracking('public.turns'::regclass,"
                 " 'thread_id', 'turn_id')")
    assert conn.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid ="
                        " 'public.turns'::regclass AND NOT tgisinternal"
                        " AND tgenabled = 'A'").fetchone() == (4,)
    conn.execute("INSERT INTO public.turns VALUES ('t1', 'r1', 'completed')")
    conn.execute("UPDATE public.turns SET status = 'partial'")
    assert conn.execute("SELECT status FROM public.turns").fetchone() == ("partial",)


def test_a_table_tracked_on_one_node_keeps_its_triggers_when_the_engine_is_distributed(
        citus_nodes: dict[str, Any]) -> None:
    """A host that ran on one node tracked its own tables (docs/integrating.md).
    distribute_on_citus keeps the tracking triggers (the derived state
    stays in use) and detaches only the queue's, and the host's table, distributed afterwards as
    documented, takes writes with them."""
    from tests.citus.conftest import create_distributed_database, drop_distributed_database

    def track_a_host_table(dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("CREATE TABLE public.turns (thread_id text, turn_id text,"
                      " status text, PRIMARY KEY (thread_id, turn_id))")
            c.execute("SELECT compaction.attach_source_tracking('public.turns'::regclass,"
                      " 'thread_id', 'turn_id')")
            assert c.execute("SELECT count(*) FROM pg_trigger WHERE tgrelid ="
                             " 'public.turns'::regclass AND NOT tgisinternal").fetchone() == (4,)

    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        dsn = create_distributed_database(citus_nodes, name,
                                          before_distributing=track_a_host_table)
        with psycopg.connect(dsn, autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM pg_trigger WHERE tgfoid ="
                             " 'compaction.source_enqueue()'::regprocedure").fetchone() == (0,)
            assert c.execute("SELECT count(*) FROM pg_trigger WHERE tgfoid ="
                             " 'compaction.track_source_changes()'::regprocedure").fetchone() \
                == (12,)  # the reference tables' eight and the host table's four
            c.execute("SELECT create_distributed_table('public.turns', 'thread_id',"
                      " colocate_with => 'compaction.jobs')")
            c.execute("INSERT INTO public.turns VALUES ('t1', 'r1', 'completed')")
            c.execute("UPDATE public.turns SET status = 'partial'")
            assert c.execute("SELECT status FROM public.turns").fetchone() == ("partial",)
            assert c.execute("SELECT compaction.derived_state_status()").fetchone() \
                == ("in_use",)
    finally:
        drop_distributed_database(citus_nodes, name)


def test_check_source_names_queue_triggers_on_a_distributed_table(
        conn: Conn, dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A queue trigger made by hand on a distributed table (it writes the queue, placed
    apart from the conversation's shards): check-source names the table and the statement
    that drops it; once dropped, check-source is content."""
    from pycompactor import cli
    from tests.sql.test_import_erase import populate

    populate(conn, "c1")
    conn.execute("CREATE TRIGGER hand_queued AFTER INSERT ON compaction_source.runs"
                 " REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT"
                 " EXECUTE FUNCTION compaction.source_enqueue()")
    assert cli.main(["check-source", "--dsn", dsn]) == 1
    out = capsys.readouterr().out
    assert "compaction_source.runs is distributed by Citus but carries the engine's queue" in out
    assert "DROP TRIGGER hand_queued ON compaction_source.runs;" in out
    # --fix prints just the statement, for psql
    assert cli.main(["check-source", "--dsn", dsn, "--fix"]) == 1
    (statement,) = capsys.readouterr().out.splitlines()
    assert statement == "DROP TRIGGER hand_queued ON compaction_source.runs;"
    conn.execute(statement)
    conn.execute("INSERT INTO compaction_source.runs (conversation_id, run_id, status)"
                 " VALUES ('c1', 'r-hand', 'running')")
    assert cli.main(["check-source", "--dsn", dsn]) == 0
    assert "derived state: in use" in capsys.readouterr().out


def test_completions_write_their_verdicts_on_citus(conn: Conn) -> None:
    """The derived state is kept on Citus, so a completed or imported summary
    gets its verdict row there as on one node, and verify_conversation is clean."""
    from tests.sql.test_import_erase import populate

    populate(conn, "c1")
    assert conn.execute("SELECT count(*) FROM compaction.job_summaries").fetchone() == (2,)
    assert conn.execute("SELECT count(*) FROM compaction.summary_verdicts"
                        " WHERE reason IS NULL").fetchone() == (2,)
    assert conn.execute("SELECT * FROM compaction.verify_conversation('c1')").fetchall() == []


def _verify_all(conn: Conn) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for (cid,) in conn.execute("SELECT DISTINCT conversation_id FROM compaction_source.runs"
                               " ORDER BY 1").fetchall():
        problems = conn.execute("SELECT * FROM compaction.verify_conversation(%s)",
                                (cid,)).fetchall()
        if problems:
            found[cid] = problems
    return found


def test_tracking_on_citus_stays_exact_through_a_drain_an_erasure_and_a_repair(
        conn: Conn, dsn: str) -> None:
    """With the tracking attached on Citus, a worker's drain leaves every
    conversation verified clean, with every summary used; an edit makes a summary stale at
    once (Case B); an erasure leaves the other conversations clean; the repair path
    (rederive_conversation) and a whole rebuild run there."""
    from pycompactor import cli
    from tests.history import History

    h = History(conn)
    for c in range(4):
        h.pairs(f"drain-{c}", 45)
    assert cli.main(["worker", "--once", "--sweep", "--model", "pycompactor/extractive-1",
                     "--dsn", dsn]) == 0
    assert conn.execute("SELECT count(*) FROM compaction.job_summaries").fetchone() == (8,)
    assert _verify_all(conn) == {}
    assert conn.execute("SELECT count(*) FROM compaction.summary_verdicts"
                        " WHERE reason IS NULL").fetchone() == (8,)
    # Case B: an edited reply in range 0 makes its summary stale, at once.
    conn.execute("UPDATE compaction_source.messages SET content = content || ' (edited)'"
                 " WHERE conversation_id = 'drain-1' AND role = 'assistant'"
                 " AND seq = (SELECT min(seq) FROM compaction_source.messages"
                 "            WHERE conversation_id = 'drain-1' AND role = 'assistant')")
    assert conn.execute("SELECT reason FROM compaction.summary_verdicts"
                        " WHERE conversation_id = 'drain-1' AND from_pair = 0").fetchone() \
        == ("stale_source",)
    assert _verify_all(conn) == {}
    with conn.transaction():
        conn.execute("SELECT compaction.erase_conversation('drain-2', 'gdpr_request')")
    assert _verify_all(conn) == {}
    # The repair path: a derived row lost (as a superuser may) is found and restored.
    conn.execute("DELETE FROM compaction.ranges WHERE conversation_id = 'drain-3'"
                 " AND from_pair = 10")
    assert "range_missing" in [p for p, _ in conn.execute(
        "SELECT * FROM compaction.verify_conversation('drain-3')").fetchall()]
    conn.execute("SELECT compaction.rederive_conversation('drain-3')")
    assert _verify_all(conn) == {}
    conn.execute("CALL compaction.rebuild_derived_state(2, true)")
    assert conn.execute("SELECT compaction.derived_state_status()").fetchone() == ("in_use",)
    assert _verify_all(conn) == {}


def test_writes_through_a_worker_node_keep_the_derived_state_exact(
        conn: Conn, dsn: str, citus_nodes: dict[str, Any]) -> None:
    """Citus takes writes on any node. Sent to a worker, a Run and an edit fire the
    tracking in a client session there, where Citus hides the shards from pg_class: the
    trigger still tells its shard's table, so the Run's pair is counted at once and the
    edited reply makes its summary stale at once (Case B), through either worker (one
    holds the conversation's shards, the other sends the write on)."""
    from pycompactor import cli
    from tests.conftest import make_dsn
    from tests.history import History

    History(conn).pairs("via-worker", 45)
    assert cli.main(["worker", "--once", "--sweep", "--model", "pycompactor/extractive-1",
                     "--dsn", dsn]) == 0
    assert conn.execute("SELECT count(*) FROM compaction.summary_verdicts"
                        " WHERE conversation_id = 'via-worker' AND reason IS NULL"
                        ).fetchone() == (2,)
    database = conn.info.dbname
    for n, node in enumerate(("worker1", "worker2")):
        with psycopg.connect(make_dsn(citus_nodes[node], database), autocommit=True) as w:
            History(w).pair("via-worker")
            w.execute("UPDATE compaction_source.messages SET content = content || ' (edited)'"
                      " WHERE message_id = (SELECT message_id FROM compaction_source.messages"
                      "   WHERE conversation_id = 'via-worker' AND role = 'assistant'"
                      "   ORDER BY seq OFFSET %s LIMIT 1)", (10 * n,))
        assert conn.execute("SELECT pair_count FROM compaction.conversation_state"
                            " WHERE conversation_id = 'via-worker'").fetchone() == (46 + n,)
        assert conn.execute("SELECT reason FROM compaction.summary_verdicts"
                            " WHERE conversation_id = 'via-worker' AND from_pair = %s",
                            (10 * n,)).fetchone() == ("stale_source",)
    assert conn.execute("SELECT compaction.derived_state_status()").fetchone() == ("in_use",)
    assert _verify_all(conn) == {}


def test_a_table_named_like_a_shard_is_its_own_table(conn: Conn) -> None:
    """The tracking trigger asks which distributed table its table is a shard of: one
    whose name only ends like a shard's (a shard id, quoted or not) is itself, however
    long its number (one past a bigint failed the trigger). A shard itself is read as its
    distributed table's in test_writes_through_a_worker_node_keep_the_derived_state_exact."""
    shard = conn.execute("SELECT min(shardid) FROM pg_dist_shard").fetchone()
    assert shard is not None
    for name in (f"events_{shard[0]}", "events_12345678901234567890",
                 f'"My Events_{shard[0]}"'):
        conn.execute(f"CREATE TABLE public.{name} (id int)")
        assert conn.execute(f"SELECT compaction.distributed_relation('public.{name}'::regclass)"
                            f" = 'public.{name}'::regclass").fetchone() == (True,)


# Contract §3 with the tracking attached on Citus: C and D each own a run R-r, a message
# naming R-r filed under E (no run R-r) breaks both, deleting it restores both; a Run
# created after its foreign message; a deleted Run; one statement over several
# conversations; the repair of the record. (Not a message moved by UPDATE of its
# conversation: Citus refuses to change a row's distribution column.) Each in both modes
# (derived state, and the tracking disabled: judged from the views).
from tests.sql.test_foreign_messages import (  # noqa: E402, F401
    mode,
    test_a_run_created_after_its_foreign_message_takes_it_over,
    test_a_run_deleted_under_its_messages_makes_them_foreign,
    test_a_run_id_in_two_conversations_is_a_pair_in_each_until_a_foreign_message_names_it,
    test_one_statement_across_conversations,
    test_reads_judge_only_a_conversation_a_foreign_message_names_from_the_views,
    test_verify_names_a_foreign_message_the_record_lacks_and_a_repair_restores_it,
)


def test_the_runbook_on_nodes_that_ask_every_login_for_a_password(pg_workdir: Any) -> None:
    """docs/operations.md on nodes whose pg_hba.conf asks every login for a password
    (scram-sha-256, over TCP and the unix socket): the runbook's blocks, in order, with
    its password steps (3b, 8), as the documented superuser `admin`; then the
    application's login writes history and enqueues, a worker pass runs as the
    `compactor` login, the auditor reads the audit views, and the derived state verifies
    clean. A login without its password is refused."""
    from pycompactor import cli
    from tests.citus.conftest import localise, runbook, started_nodes
    from tests.conftest import make_dsn

    with started_nodes(pg_workdir, "scram-") as nodes:
        def dsn_of(name: str, user: str, password: str | None, via_socket: bool = False
                   ) -> str:
            node = nodes[name]
            dsn = make_dsn(node, "agent", user=user)
            if via_socket:
                dsn = dsn.replace(f"host={node.host}", f"host={node.unixsocketdir}")
            return dsn if password is None else f"{dsn} password={password}"

        for node in nodes.values():
            with psycopg.connect(make_dsn(node, "postgres"), autocommit=True) as c:
                c.execute("CREATE ROLE admin SUPERUSER LOGIN")
                c.execute("CREATE DATABASE agent OWNER admin TEMPLATE template0"
                          " ENCODING 'UTF8'")
        # the nodes trust loopback until step 3b is done
        passwords: dict[str, str | None] = {"admin": None}
        ran = []
        for lang, body in runbook():
            where = body.splitlines()[0] if body else ""
            if lang == "console" and body.startswith("$ pycompactor migrate --dsn "):
                assert cli.main(["migrate", "--dsn", dsn_of("coordinator", "admin",
                                                            passwords["admin"])]) == 0
                ran.append("migrate")
                continue
            if lang != "sql":
                continue
            if where.startswith(("-- on every node", "-- every login by password: on every")):
                targets = list(nodes)
            elif where.startswith(("-- on the coordinator",
                                   "-- every login by password: on the coordinator")):
                targets = ["coordinator"]
            else:
                continue
            for name in targets:
                with psycopg.connect(dsn_of(name, "admin", passwords["admin"]),
                                     autocommit=True) as c:
                    c.execute(localise(body, nodes))
            ran.append(where)
            if where.startswith("-- every login by password: on every") \
                    and passwords["admin"] is None:
                # Step 3b done: the documented lines of step 2 take effect.
                hba = "\n".join(localise(b, nodes) for kind, b in runbook()
                                if kind == "text" and b.startswith(("host  all  compaction",
                                                                    "host   all  all")))
                for node in nodes.values():
                    path = Path(node.datadir) / "pg_hba.conf"
                    path.write_text(hba + "\n", encoding="utf-8")
                    with psycopg.connect(make_dsn(node, "postgres", user="admin")
                                         + " dbname=agent password=admin-password",
                                         autocommit=True) as c:
                        c.execute("SELECT pg_reload_conf()")
                        assert c.execute("SELECT count(*) FROM pg_hba_file_rules"
                                         " WHERE error IS NOT NULL").fetchone() == (0,)
                passwords["admin"] = "admin-password"
        assert len(ran) == 9, ran  # 3, 3b, 4, migrate, 6 (twice), 7, 8 (twice)
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn_of("coordinator", "app", None)).close()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(dsn_of("worker1", "admin", None, via_socket=True)).close()
        psycopg.connect(dsn_of("worker1", "admin", "admin-password", via_socket=True)).close()
        admin = dsn_of("coordinator", "admin", "admin-password")
        with psycopg.connect(admin, autocommit=True) as c:
            (grant,) = [b for kind, b in runbook()
                        if kind == "sql" and b.startswith("-- the application's login")]
            c.execute(grant)
            c.execute("GRANT USAGE ON SCHEMA compaction_source TO app;"
                      " GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA compaction_source TO app")
            assert c.execute("SELECT compaction.derived_state_status()").fetchone() \
                == ("in_use",)
        conversations = ["pw-0", "pw-1", "pw-2"]
        with (psycopg.connect(dsn_of("coordinator", "app", "app-password")) as app,
              app.transaction()):
            for cid in conversations:
                app.execute(_history_sql(cid))
                app.execute("SELECT compaction.enqueue(%s)", (cid,))
        compactor = dsn_of("coordinator", "compactor", "compactor-password")
        assert cli.main(["worker", "--once", "--model", "pycompactor/extractive-1",
                         "--dsn", compactor]) == 0
        with psycopg.connect(dsn_of("coordinator", "auditor", "auditor-password"),
                             autocommit=True) as auditor:
            assert auditor.execute("SELECT count(*) FROM compaction.audit_jobs"
                                   " WHERE state = 'completed'").fetchone() == (3,)
        with psycopg.connect(admin, autocommit=True) as c:
            for cid in conversations:
                assert c.execute("SELECT * FROM compaction.verify_conversation(%s)",
                                 (cid,)).fetchall() == []
            assert c.execute("SELECT count(*) FROM compaction.summary_verdicts"
                             " WHERE reason IS NULL").fetchone() == (3,)


def test_a_worker_killed_mid_call_leaves_the_derived_state_exact(
        conn: Conn, dsn: str, model_server: Any) -> None:
    """A crashed worker (killed with SIGKILL while its model call hangs,
    recovered by another) with the tracking attached on Citus, then every conversation
    verified clean and every summary used."""
    test_crashed_worker_is_recovered_by_another(conn, dsn, model_server)
    assert _verify_all(conn) == {}
    assert conn.execute("SELECT count(*) FROM compaction.summary_verdicts"
                        " WHERE reason IS NULL").fetchone() == (2,)
