"""Benchmark 7: what a summary buys and loses, on the evaluation corpus (issue 28).

Every offline summarizer summarizes every target range of the corpus (the window policy's
ranges, as the worker would) and is measured by `pycompactor.evaluation`, the code
`pycompactor evaluate` runs:

- compression per range (summary UTF-8 bytes / the ten replies' bytes): median, p95, max;
- figure and qualifier retention, pooled over every range;
- density: beyond the raw tail, how many pairs a KiB of the summarized region carries
  against the same pairs sent raw (the cost of the projection, DESIGN §9: a summary
  block is its ten user messages, the marker line and the summary; 16 bytes a message);
- reach at 8, 16, 32 and 64 KiB: pairs the next Run sees with the summaries over pairs
  the raw-only projection (newest pairs only) sees, pooled over conversations;
- wall-clock milliseconds per range (p50, p95, max).

No database: the evaluation plans the projection with the engine's own pure planner.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.common import Sizes
from pycompactor.evaluate import read_corpus
from pycompactor.evaluation import (
    DEFAULT_BUDGETS,
    EvalConversation,
    Report,
    evaluate,
)
from pycompactor.extractive import OFFLINE_MODEL
from pycompactor.extractive2 import EXTRACTIVE2_MODEL
from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.projection import marker_line, message_cost, utf8_len
from pycompactor.summarizer import make_summarizer

MODELS = (OFFLINE_MODEL, EXTRACTIVE2_MODEL)
#: Messages of a summary block besides the ten user messages: the one summary message.
_SUMMARY_MESSAGES = 1


def _quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by the nearest rank (no interpolation: a value that occurred)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def density(conversations: Sequence[EvalConversation], report: Report) -> dict[str, Any]:
    """Pairs per KiB of the summarized region against the same pairs sent raw (pure).

    Over every summarized range: the raw cost of its ten pairs and the cost of its
    summary block, each as the projection counts bytes; the ratio of the two sums is how
    many more pairs a KiB carries summarized than raw.
    """
    by_id = {c.conversation_id: c for c in conversations}
    raw_bytes = block_bytes = pairs = 0
    for result in report.conversations:
        source = by_id[result.conversation_id].pairs
        for r in result.ranges:
            if r.summary_bytes is None:
                continue
            block = source[r.from_pair : r.from_pair + PAIRS_PER_RANGE]
            users = sum(message_cost(p.user_content) for p in block)
            raw_bytes += users + sum(message_cost(p.assistant_content) for p in block)
            # The summary message: marker line, newline, summary text, plus 16.
            block_bytes += (users + utf8_len(marker_line(r.from_pair, r.to_pair)) + 1
                            + r.summary_bytes + 16 * _SUMMARY_MESSAGES)
            pairs += PAIRS_PER_RANGE
    return {
        "summarized_pairs": pairs,
        "raw_pairs_per_kib": pairs * 1024 / raw_bytes if raw_bytes else None,
        "summarized_pairs_per_kib": pairs * 1024 / block_bytes if block_bytes else None,
        "ratio": raw_bytes / block_bytes if block_bytes else None,
    }


def measure(conversations: Sequence[EvalConversation], model: str) -> dict[str, Any]:
    """One summarizer on the corpus: every measure of the module docstring."""
    report = evaluate(conversations, make_summarizer(model), source="corpus",
                      budgets=DEFAULT_BUDGETS, clock=time.perf_counter)
    done = [r for r in report.ranges if r.failure is None]
    ratios = [r.compression for r in done if r.compression is not None]
    millis = [r.seconds * 1000 for r in report.ranges]
    overall = report.overall
    return {
        "model": model,
        "conversations": len(report.conversations),
        "pairs": sum(c.pairs for c in report.conversations),
        "ranges": len(report.ranges),
        "failed": overall.failed,
        "compression": {
            "median": statistics.median(ratios) if ratios else None,
            "p95": _quantile(ratios, 0.95),
            "max": max(ratios, default=None),
            "pooled": overall.compression,
        },
        "figures": {"total": overall.figures_total, "kept": overall.figures_kept,
                    "retention": overall.figure_retention},
        "qualifiers": {"total": overall.qualifiers_total, "kept": overall.qualifiers_kept,
                       "retention": overall.qualifier_retention},
        "density": density(conversations, report),
        "reach": [{"budget_bytes": t.budget_bytes, "compacted": t.compacted,
                   "raw_only": t.raw_only,
                   "ratio": t.compacted / t.raw_only if t.raw_only else None}
                  for t in report.reach],
        "ms_per_range": {"p50": _quantile(millis, 0.5), "p95": _quantile(millis, 0.95),
                         "max": max(millis, default=None)},
        "by_language": {lang: {"ranges": t.ranges, "compression": t.compression,
                               "figure_retention": t.figure_retention,
                               "qualifier_retention": t.qualifier_retention}
                        for lang, t in report.by_language().items()},
    }


def run(sizes: Sizes) -> dict[str, Any]:
    conversations = read_corpus(seed=0, conversations=sizes.quality_conversations)
    return {"seed": 0, "models": [measure(conversations, m) for m in MODELS]}
