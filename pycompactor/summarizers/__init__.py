"""The summarizers: what turns a range's ten assistant replies into a summary (contract §8).

* `openai_compatible`: the prompt (`prompts/`), the request to any OpenAI-compatible
  server, the `Summarizer` protocol every summarizer meets, and `make_summarizer`, which
  picks a summarizer by its model name.
* `extractive` (`pycompactor/extractive-1`, and `OfflineSummarizer`, the offline models'
  base), `extractive2`, `extractive3` (the default offline model): no model at all.
* `baseline`: naive whole-sentence selection, what an offline summarizer must beat.
* `outcomes`: what a model call came to, a `Reply` for the database or a `Failure`.
"""

from pycompactor.summarizers.openai_compatible import Summarizer, make_summarizer

__all__ = ["Summarizer", "make_summarizer"]
