"""pycompactor: cross-run conversation compaction for AI agents, enforced inside PostgreSQL.

The database owns eligibility, the window policy, claims and immutability; this package
hashes sources, projects history under a byte budget, calls the model and runs workers.
"""

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
