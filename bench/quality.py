"""Benchmark 7: what a summary buys and loses, on the evaluation corpus (the summary-quality goals).

Every offline summarizer summarizes every target range of the corpus (the window policy's
ranges, as the worker would) and is measured by `pycompactor.evaluation`, the code
`pycompactor evaluate` runs:

- compression per range (summary UTF-8 bytes / the ten replies' bytes): median, p95, max;
- figure and qualifier retention, pooled over every range;
- density: beyond the raw tail, how many pairs a KiB of the summarized region carries
  against the same pairs sent raw (the cost of the projection, contract §9: a summary
  block is its ten user messages, the marker line and the summary; 16 bytes a message);
- reach at 8, 16, 32 and 64 KiB: pairs the next Run sees with the summaries over pairs
  the raw-only projection (newest pairs only) sees, pooled over conversations, and the
  same with every summary one byte long (the ceiling no summarizer passes);
- wall-clock milliseconds per range (p50, p95, max);
- attribution, qualifier scope and invented figures (pycompactor.quality.fidelity);
- what keeping every caveat would take: the share of the bytes the sentences holding a
  figure or a caveat take, and extractive-3 with the 6,000-character cap lifted;
- held-out text (bench.held_out: man pages, standard-library docstrings) the summarizers
  were not built on: the model beside naive selection at the model's own bytes.

Then the frontier: one model (`FRONTIER_MODEL` unless `run` is given
another) at each target of `TARGETS`, beside naive whole-sentence selection
(pycompactor.summarizers.baseline, plain and caveats first) at the same targets, in the same run:
median compression, attribution, qualifier scope, figure retention, invented figures,
ms per range and history reach at 64 KiB against the raw-only projection. A model point
is on or above the baseline's frontier when its attribution is at least the baseline
envelope's at its compression (`above_frontier`).

No database: the evaluation plans the projection with the engine's own pure planner.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.common import Sizes
from pycompactor.cli.evaluate import read_corpus
from pycompactor.evaluation import (
    DEFAULT_BUDGETS,
    EvalConversation,
    Report,
    conversation_from_texts,
    evaluate,
)
from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.projection import marker_line, message_cost, utf8_len
from pycompactor.quality.fidelity import scores
from pycompactor.summarizers.baseline import BaselineSummarizer
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from pycompactor.summarizers.extractive2 import EXTRACTIVE2_MODEL
from pycompactor.summarizers.extractive3 import EXTRACTIVE3_MODEL, fact_bytes, summarize_replies
from pycompactor.summarizers.openai_compatible import Summarizer, make_summarizer

MODELS = (OFFLINE_MODEL, EXTRACTIVE2_MODEL, EXTRACTIVE3_MODEL)
#: The offline model the frontier measures (the default offline model of evaluate).
FRONTIER_MODEL = EXTRACTIVE3_MODEL
#: The byte targets the frontier tries, for the model and the baseline alike.
TARGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
_REACH_BUDGET = 64 * 1024
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
    return _measures(conversations, report)


def _measures(conversations: Sequence[EvalConversation], report: Report) -> dict[str, Any]:
    done = [r for r in report.ranges if r.failure is None]
    ratios = [r.compression for r in done if r.compression is not None]
    millis = [r.seconds * 1000 for r in report.ranges]
    overall = report.overall
    return {
        "model": report.model,
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
        "attribution": {"total": overall.attribution_total, "kept": overall.attribution_kept,
                        "ratio": overall.attribution},
        "qualifier_scope": {"total": overall.scope_total, "kept": overall.scope_kept,
                            "ratio": overall.qualifier_scope},
        "invented_figures": overall.invented_figures,
        "density": density(conversations, report),
        "reach": [{"budget_bytes": t.budget_bytes, "compacted": t.compacted,
                   "raw_only": t.raw_only,
                   "ratio": t.compacted / t.raw_only if t.raw_only else None,
                   "ceiling": t.ceiling,
                   "ceiling_ratio": t.ceiling / t.raw_only if t.raw_only else None}
                  for t in report.reach],
        "ms_per_range": {"p50": _quantile(millis, 0.5), "p95": _quantile(millis, 0.95),
                         "max": max(millis, default=None)},
        "by_language": {lang: {"ranges": t.ranges, "compression": t.compression,
                               "figure_retention": t.figure_retention,
                               "qualifier_retention": t.qualifier_retention}
                        for lang, t in report.by_language().items()},
    }


def point(conversations: Sequence[EvalConversation], summarizer: Summarizer,
          target: float) -> dict[str, Any]:
    """One summarizer at one target: a point of the frontier."""
    report = evaluate(conversations, summarizer, source="corpus", budgets=(_REACH_BUDGET,),
                      clock=time.perf_counter)
    done = [r for r in report.ranges if r.failure is None]
    ratios = [r.compression for r in done if r.compression is not None]
    millis = [r.seconds * 1000 for r in report.ranges]
    overall = report.overall
    [reach] = report.reach
    return {
        "model": summarizer.model, "target": target, "ranges": overall.ranges,
        "failed": overall.failed,
        "compression_median": statistics.median(ratios) if ratios else None,
        "compression_pooled": overall.compression,
        "attribution": overall.attribution, "qualifier_scope": overall.qualifier_scope,
        "figure_retention": overall.figure_retention,
        "qualifier_retention": overall.qualifier_retention,
        "invented_figures": overall.invented_figures,
        "ms_per_range": {"p50": _quantile(millis, 0.5), "p95": _quantile(millis, 0.95)},
        "reach_64k": {"compacted": reach.compacted, "raw_only": reach.raw_only,
                      "ratio": reach.compacted / reach.raw_only if reach.raw_only else None},
    }


def envelope(points: Sequence[tuple[float, float]], x: float) -> float:
    """The baseline's frontier at compression x (pure): the best attribution reachable
    at or below x, interpolated linearly between measured points and from (0, 0), flat
    beyond the last point."""
    best: list[tuple[float, float]] = [(0.0, 0.0)]
    for px, py in sorted(points):
        best.append((px, max(py, best[-1][1])))
    if x >= best[-1][0]:
        return best[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(best):
        if x0 <= x <= x1:
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return 0.0


def above_frontier(model_point: dict[str, Any], baseline: Sequence[dict[str, Any]]) -> bool:
    """Whether a point lies on or above the baseline's frontier (attribution against
    median compression; a point without either is not)."""
    x, y = model_point["compression_median"], model_point["attribution"]
    known = [(b["compression_median"], b["attribution"]) for b in baseline
             if b["compression_median"] is not None and b["attribution"] is not None]
    if x is None or y is None:
        return False
    return bool(y >= envelope(known, x) - 1e-9)


def frontier(conversations: Sequence[EvalConversation], model: str = FRONTIER_MODEL,
             targets: Sequence[float] = TARGETS) -> dict[str, Any]:
    """The model and the naive baselines at every target, in one run; the baselines
    also at the bytes each model point actually spent (its pooled compression), so a
    model that writes far below its target is compared at its own size, not against a
    line drawn from the origin."""
    points = [point(conversations, make_summarizer(model, extractive_target=t), t)
              for t in targets]
    baseline = [point(conversations, BaselineSummarizer(t), t) for t in targets]
    caveats = [point(conversations, BaselineSummarizer(t, caveats_first=True), t)
               for t in targets]
    spent = sorted({round(p["compression_pooled"], 3) for p in points
                    if p["compression_pooled"]} - set(targets))
    matched = [point(conversations, BaselineSummarizer(min(t, 1.0), caveats_first=c), t)
               for t in spent for c in (False, True)]
    every = [*baseline, *caveats, *matched]
    return {"model": model, "targets": list(targets), "points": points,
            "baseline": baseline, "baseline_caveats_first": caveats,
            "baseline_at_model_bytes": matched,
            "above_baseline": [above_frontier(p, every) for p in points]}


#: Targets at which extractive-3 is also measured without the 6,000-character cap.
UNCAPPED_TARGETS = (0.4, 0.5)


def beyond_the_cap(report: Report) -> dict[str, Any]:
    """What keeping every caveat would take, on the report's ranges: the
    median share of the replies' bytes that the sentences holding a figure or a caveat
    take as extractive-3 writes them (and those holding a figure alone), and extractive-3
    at `UNCAPPED_TARGETS` with the 6,000-character cap of contract §6 lifted: not valid
    summaries, a measure of what the cap costs."""
    ranges = [r.replies for r in report.ranges]
    shares = [fact_bytes(rs) for rs in ranges]
    totals = [sum(len(r.encode("utf-8")) for r in rs) for rs in ranges]
    uncapped = []
    for target in UNCAPPED_TARGETS:
        kept = [0, 0, 0, 0]
        ratios = []
        for rs, total in zip(ranges, totals, strict=True):
            text = summarize_replies(rs, target, limit=10 * total)
            ratios.append(utf8_len(text) / total)
            attribution, scope = scores(rs, text)
            kept[0] += attribution.kept
            kept[1] += attribution.total
            kept[2] += scope.kept
            kept[3] += scope.total
        uncapped.append({"target": target, "compression_median": statistics.median(ratios),
                         "attribution": kept[0] / kept[1] if kept[1] else None,
                         "qualifier_scope": kept[2] / kept[3] if kept[3] else None})
    return {
        "fact_share_median": statistics.median(a / t for (a, _), t in zip(shares, totals,
                                                                           strict=True)),
        "figure_share_median": statistics.median(f / t for (_, f), t in zip(shares, totals,
                                                                            strict=True)),
        "uncapped": uncapped,
    }


def held_out(model: str = FRONTIER_MODEL) -> dict[str, Any] | None:
    """The model and naive selection at the model's pooled compression on held-out
    reference text (bench.held_out: man pages and standard-library docstrings), which the
    summarizers were not built on; None on a machine without man pages."""
    from bench import held_out as source

    if shutil.which("man") is None:
        return None
    conversations = [conversation_from_texts(cid, "en", pairs)
                     for cid, pairs in source.conversations()]
    mine = point(conversations, make_summarizer(model), 0.4)
    spent = round(mine["compression_pooled"], 3)
    return {"conversations": len(conversations), "model": mine,
            "baseline": point(conversations, BaselineSummarizer(spent), spent),
            "baseline_caveats_first": point(
                conversations, BaselineSummarizer(spent, caveats_first=True), spent)}


def run(sizes: Sizes, model: str = FRONTIER_MODEL) -> dict[str, Any]:
    """The offline summarizers at their default targets (the summary-quality measures,
    with attribution, qualifier scope and invented figures), then `model`'s frontier
    against the naive baseline, what keeping every caveat would take, and the same on
    held-out text."""
    conversations = read_corpus(seed=0, conversations=sizes.quality_conversations)
    models = [measure(conversations, m) for m in dict.fromkeys((*MODELS, model))]
    report = evaluate(conversations, make_summarizer(model), source="corpus",
                      budgets=(_REACH_BUDGET,))
    return {"seed": 0, "models": models, "frontier": frontier(conversations, model),
            "beyond_the_cap": beyond_the_cap(report),
            "held_out": held_out(model) if sizes.quality_conversations is None else None}
