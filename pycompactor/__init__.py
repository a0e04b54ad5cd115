"""pycompactor: cross-run conversation compaction for AI agents, enforced inside PostgreSQL.

The database owns eligibility, the window policy, claims and immutability; this package
hashes sources, projects history under a byte budget, calls the model and runs workers.
"""

# metrics: the projection counters observe project_history from the package's import
# on, so an agent that exposes Prometheus metrics shows them with no set-up of its own.
from pycompactor import metrics as _metrics  # noqa: F401
from pycompactor.errors import PycompactorError
from pycompactor.hashing import source_hash
from pycompactor.models import Pair, RunVerdict, Target
from pycompactor.projection import Projection, aproject_history, project_history

__all__ = [
    "Pair",
    "Projection",
    "PycompactorError",
    "RunVerdict",
    "Target",
    "aproject_history",
    "project_history",
    "source_hash",
]
__version__ = "0.1.0"
