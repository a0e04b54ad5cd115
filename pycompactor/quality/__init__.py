"""The measures of what a summary kept (pure functions of text: no model, no database).

* `figures`: which figures of the replies a summary kept, and which it invented (contract
  §8); the worker's figure gates.
* `qualifiers`: the words that change what a figure means, and the sentence splitter.
* `fidelity`: whether a summary still answers the questions its replies answer.
* `charts`: the SVG charts of `pycompactor evaluate --html` and docs/evaluate.md.

`pycompactor.evaluation` sums them over conversations; `pycompactor.corpus` is what they
are measured on.
"""
