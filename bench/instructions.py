"""Benchmark 8: the claim -> complete cycle in CPU instructions, which no other load moves.

Cycles per second move with the machine: the same code measured 0.46x and 0.36x of
its floor on two days, and a change worth 10% disappears in that noise. Valgrind's
callgrind counts the instructions a program executes, the same for the same binary,
data and statements whatever else the machine is doing, so this profile counts what one
cycle costs the server in instructions, for each of benchmark 1's three cycles:

* pycompactor: `compaction.claim`, then `compaction.complete`;
* the floor: the contract's rows in two plain statements (bench/claims.py);
* plain SQL: a job row inserted, then updated with a result row.

The database is prepared as for benchmark 1, on a cluster of its own, then the server is
stopped and each cycle runs in single-user mode (`postgres --single`, one backend, no
network) under callgrind, on two copies of the data directory: one runs W cycles, the
other the same W and M more. The difference over M is the cost of one cycle after
warm-up, with start-up, catalog caches and first plans cancelled out. Each statement is
an EXECUTE of a statement prepared at the start, as the driver's are; the engine's and
the floor's completion find their job by key (the client has it from the claim's answer).
Commits cost their instructions here, not their WAL flush: that is benchmark 1's part.
Beside the instructions, the WAL each cycle writes (the insert position before and after
the cycles): at 8 connections the cycle waits on WAL flushes, and the bytes per commit
are what a design that writes less saves there.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from bench import claims
from bench.common import BenchCluster, Sizes
from pycompactor.cli.cluster import ThrowawayCluster
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION

DATABASE = "bench_instructions"


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _ids(ids: Sequence[str]) -> str:
    return "ARRAY[" + ",".join(_literal(i) for i in ids) + "]::text[]"


_PREPARE = {
    "pycompactor": f"""
PREPARE cycle_claim(text, int, text[], text) AS
    SELECT claimed FROM compaction.claim($1, 'default', $2, $3, $4, {_literal(claims.MODEL)},
                                         {_literal(PROMPT_VERSION)}, 'bench-0')
PREPARE cycle_complete(text, text) AS
    SELECT ok FROM compaction.complete(
        (SELECT j.job_id FROM compaction.jobs AS j WHERE j.conversation_id = $1), 1, $2,
        'stop', 0, p_conversation_id => $1)
""",
    "plain": f"""
PREPARE cycle_claim(text) AS
    {claims._BASELINE_START.replace('%(key)s', '$1').replace('%(worker)s', "'bench-0'")}
PREPARE cycle_complete(text, text) AS
    {claims._BASELINE_FINISH.replace('%(key)s', '$1').replace('%(summary)s', '$2')}
""",
}


def _floor_prepare() -> str:
    """The floor's two statements with positional parameters; complete finds its job."""
    claim = (claims._FLOOR_CLAIM
             .replace("%(c)s", "$1").replace("%(f)s", "$2").replace("%(ids)s", "$3")
             .replace("%(h)s", "$4").replace("%(model)s", _literal(claims.MODEL))
             .replace("%(prompt_version)s", _literal(PROMPT_VERSION))
             .replace("%(w)s", "'bench-0'"))
    complete = (claims._FLOOR_COMPLETE
                .replace("%(j)s", "(SELECT j.job_id FROM bench.floor_jobs AS j"
                                  " WHERE j.conversation_id = $1)")
                .replace("%(c)s", "$1").replace("%(s)s", "$2").replace("%(f)s", "0"))
    # Single-user mode ends a statement at a newline followed by a blank line: none inside.
    flat = [re.sub(r"\n\s*\n", "\n", s.strip()) for s in (claim, complete)]
    return (f"PREPARE cycle_claim(text, int, text[], text) AS\n    {flat[0]}\n"
            f"PREPARE cycle_complete(text, text) AS\n    {flat[1]}\n")


def _script(kind: str, items: Sequence[Any]) -> str:
    """The prepared statements, then one claim and one completion per item."""
    prepare = _floor_prepare() if kind == "floor" else _PREPARE[kind]
    # In single-user mode (-j) a statement ends at a semicolon followed by an empty line.
    head = ";\n\n".join(s.strip() for s in re.split(r"\n(?=PREPARE )", prepare.strip()))
    lines = [head + ";\n", f"SELECT pg_catalog.pg_current_wal_insert_lsn() AS {_WAL_MARK};\n"]
    summary = _literal(claims.SUMMARY)
    for item in items:
        if kind == "plain":
            lines.append(f"EXECUTE cycle_claim({_literal(item)});\n")
            lines.append(f"EXECUTE cycle_complete({_literal(item)}, {summary});\n")
        else:
            lines.append(f"EXECUTE cycle_claim({_literal(item.conversation_id)},"
                         f" {item.from_pair}, {_ids(item.source_message_ids)},"
                         f" {_literal(item.source_hash)});\n")
            lines.append(f"EXECUTE cycle_complete({_literal(item.conversation_id)},"
                         f" {summary});\n")
    lines.append(f"SELECT pg_catalog.pg_current_wal_insert_lsn() AS {_WAL_MARK};\n")
    return "\n".join(lines)


_WAL_MARK = "wal_position"


def _wal_written(output: str) -> int:
    """Bytes of WAL between the two positions the script printed."""
    marks = re.findall(rf'{_WAL_MARK} = "([0-9A-F]+)/([0-9A-F]+)"', output)
    if len(marks) != 2:
        raise RuntimeError(f"expected two WAL positions in the output, found {len(marks)}")
    start, end = ((int(high, 16) << 32) | int(low, 16) for high, low in marks)
    return end - start


def _instructions(cluster: ThrowawayCluster, valgrind: str, data: Path, script: Path,
                  out: Path) -> tuple[int, str]:
    postgres = cluster.bindir / "postgres"
    output = cluster.run_as_server([valgrind, "--tool=callgrind", f"--callgrind-out-file={out}",
                         str(postgres), "--single", "-j", "-D", str(data), DATABASE],
                        stdin=script)
    totals = re.search(r"^(?:totals|summary): (\d+)", out.read_text(), re.MULTILINE)
    if totals is None:
        raise RuntimeError(f"callgrind wrote no totals to {out}")
    return int(totals.group(1)), output


def run(sizes: Sizes) -> dict[str, Any]:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return {"skipped": "valgrind is not installed (Debian package valgrind)"}
    warm, measured = sizes.instruction_cycles
    n = warm + measured
    with BenchCluster() as bench:
        cluster = bench.cluster
        assert cluster.root is not None
        dsn = bench.new_database("instructions")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(claims.BASELINE_DDL)
            conn.execute(claims._FLOOR_DDL)
        targets = claims.prepare_ranges(dsn, sizes, 2 * n)
        work: dict[str, Sequence[Any]] = {
            "pycompactor": targets[:n],
            "floor": targets[n:],
            "plain": [f"plain-{i}" for i in range(n)],
        }
        dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        with psycopg.connect(bench.dsn_for("postgres"), autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{dbname}" RENAME TO {DATABASE}')
        data = cluster.root / "data"
        cluster.run_as_server([str(cluster.bindir / "pg_ctl"), "stop", "-w", "-m", "fast",
                               "-D", str(data)])
        scratch = Path(tempfile.mkdtemp(prefix="instructions-", dir=cluster.root))
        if cluster.user is not None:
            entry = pwd.getpwnam(cluster.user)
            os.chown(scratch, entry.pw_uid, entry.pw_gid)
        per_cycle: dict[str, int] = {}
        wal_per_cycle: dict[str, int] = {}
        for kind, items in work.items():
            totals = []
            wal = []
            for label, count in (("short", warm), ("long", n)):
                copy = scratch / f"{kind}-{label}"
                cluster.run_as_server(["cp", "-a", str(data), str(copy)])
                script = scratch / f"{kind}-{label}.sql"
                script.write_text(_script(kind, items[:count]), encoding="utf-8")
                os.chmod(script, 0o644)
                total, output = _instructions(cluster, valgrind, copy, script,
                                              scratch / f"{kind}-{label}.callgrind")
                expected = 2 * count
                # A claim or completion that went through answers true (pycompactor) or
                # with its row's id (the floor); plain SQL answers nothing.
                answered = len(re.findall(
                    r'1: (?:claimed = "t"|ok = "t"|job_id = "\d+"|summary_id = "\d+")', output))
                if kind != "plain" and answered != expected:
                    raise RuntimeError(f"{kind}: {answered} of {expected} statements answered"
                                       " true; the cycles did not run as prepared")
                if "ERROR:" in output:
                    error = output[output.index("ERROR:"):].splitlines()[0]
                    raise RuntimeError(f"{kind}: {error}")
                totals.append(total)
                wal.append(_wal_written(output))
                shutil.rmtree(copy, ignore_errors=True)
            per_cycle[kind] = round((totals[1] - totals[0]) / measured)
            wal_per_cycle[kind] = round((wal[1] - wal[0]) / measured)
    return {
        "cycles": {"warm_up": warm, "measured": measured},
        "instructions_per_cycle": per_cycle,
        "wal_bytes_per_cycle": wal_per_cycle,
        "pycompactor_vs_plain": per_cycle["pycompactor"] / per_cycle["plain"],
        "floor_vs_plain": per_cycle["floor"] / per_cycle["plain"],
        "pycompactor_vs_floor": per_cycle["pycompactor"] / per_cycle["floor"],
    }
