"""`pycompactor demo`: the whole pipeline on a throwaway cluster, with nothing to configure.

Starts a private PostgreSQL from the installed server binaries, migrates it, loads the
45-pair sample conversation and shows what the engine decides. The cluster is removed on
exit, Ctrl-C included.
"""

from __future__ import annotations

from pycompactor import db, schema
from pycompactor.cli import render_table
from pycompactor.cluster import ThrowawayCluster
from pycompactor.hashing import source_hash
from pycompactor.sample import CONVERSATION_ID, load_sample


def run_demo() -> int:
    print("starting a throwaway PostgreSQL cluster ...", flush=True)
    with ThrowawayCluster() as cluster:
        print(f"migrating {cluster.dsn} ...", flush=True)
        schema.upgrade(cluster.dsn)
        with db.connect(cluster.dsn) as conn:
            n = load_sample(conn)
            print(f"loaded conversation {CONVERSATION_ID!r}: {n} runs\n")
            pairs = db.eligible_pairs(conn, CONVERSATION_ID)
            user_bytes = sum(len(p.user_content.encode()) for p in pairs)
            assistant_bytes = sum(len(p.assistant_content.encode()) for p in pairs)
            chars = sum(len(p.user_content) + len(p.assistant_content) for p in pairs)
            print(f"eligible pairs: {len(pairs)} ({chars} characters, "
                  f"{user_bytes + assistant_bytes} UTF-8 bytes)")
            targets = db.plan_targets(conn, CONVERSATION_ID)
            rows = []
            for t in targets:
                python_hash = source_hash(pairs[t.from_pair : t.to_pair + 1])
                rows.append((f"{t.from_pair}-{t.to_pair}", t.source_hash[:16] + "...",
                             "yes" if python_hash == t.source_hash else "NO"))
            print("\nplan (at least 30 pairs before the first target, the newest 20 kept raw):")
            print(render_table(["pairs", "source_hash", "python hash agrees"], rows))
    print("\nthrowaway cluster stopped and removed")
    return 0
