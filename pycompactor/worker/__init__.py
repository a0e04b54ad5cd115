"""`pycompactor worker`: the process that turns compaction targets into summaries (docs/cli.md).

* `process`: the `Worker` and `run_worker`: its threads, the model calls outside any
  transaction (contract §11), the figure gates and the fenced completion (contract §6, §8).
* `claim`: the claiming side, the loop of passes: finding work (the queue, one
  conversation or the sweep), reaping, claiming targets, settling queue entries.
* `types`: what the worker is configured with (`WorkerConfig`) and reports.
* `connections`: its database connections, and which errors a reconnect may cure.
* `eventlog`: its event log, with every secret masked.
"""

from pycompactor.worker.process import Worker, run_worker
from pycompactor.worker.types import JobResult, WorkerConfig, WorkerReport

__all__ = ["JobResult", "Worker", "WorkerConfig", "WorkerReport", "run_worker"]
