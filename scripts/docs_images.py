"""`make docs-images`: the evaluate report's table and charts shown in README.md and
docs/evaluate.md, regenerated from a real run (the offline model on the corpus).

Writes docs/images/evaluate-*.svg (standalone SVG, written by the package's own chart
code: no browser needed) and replaces the table between the `evaluate-table` markers of
docs/evaluate.md with the same run's text.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pycompactor.cli.evaluate import (
    DEFAULT_MODEL,
    Contender,
    read_corpus,
    readable_text,
    report_charts,
)
from pycompactor.evaluation import evaluate
from pycompactor.quality import charts
from pycompactor.summarizers.baseline import BaselineSummarizer
from pycompactor.summarizers.openai_compatible import make_summarizer

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
DOC = REPO / "docs" / "evaluate.md"
TABLE = re.compile(r"(<!-- evaluate-table:begin -->\n```text\n).*?"
                   r"(\n```\n<!-- evaluate-table:end -->)", re.DOTALL)
#: The targets at which the frontier chart shows naive whole-sentence selection.
BASELINE_TARGETS = (0.2, 0.3, 0.4, 0.5, 0.6)
#: Per-range rows shown in the images (the full run has hundreds; the pooled and reach
#: tables below them cover every range).
RANGE_ROWS = 12


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/docs_images.py")
    parser.add_argument("--model", default=None,
                        help="model id (default: the offline summarizer evaluate defaults to)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    summarizer = make_summarizer(args.model or DEFAULT_MODEL)
    conversations = read_corpus(args.seed)
    source = f"corpus:seed={args.seed}"
    report = evaluate(conversations, summarizer, source=source)
    # The frontier chart shows the model beside the baseline it must beat.
    baseline = [Contender(f"{b.model}@{t:g}", evaluate(conversations, b, source=source))
                for t in BASELINE_TARGETS for b in (BaselineSummarizer(t),)]
    # Timings vary from run to run and machine to machine; the images show them as run.
    text = readable_text(report, max_range_rows=RANGE_ROWS)
    IMAGES.mkdir(parents=True, exist_ok=True)
    written = []
    for name, svg in report_charts(report, standalone=True, compared=baseline).items():
        path = IMAGES / f"evaluate-{name}.svg"
        path.write_text(charts.xml_file(svg), encoding="utf-8")
        written.append(path)
    table = IMAGES / "evaluate-table.svg"
    table.write_text(charts.xml_file(charts.text_image(
        text.splitlines(), title="pycompactor evaluate --corpus", standalone=True)),
        encoding="utf-8")
    written.append(table)
    doc = DOC.read_text(encoding="utf-8")
    if not TABLE.search(doc):
        print(f"{DOC}: no evaluate-table markers", file=sys.stderr)
        return 1
    DOC.write_text(TABLE.sub(lambda m: m.group(1) + text + m.group(2), doc), encoding="utf-8")
    for path in [*written, DOC]:
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
