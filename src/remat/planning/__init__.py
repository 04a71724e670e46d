"""The planner: a memory budget in, the fastest exact plan out (``remat.plan``).

See ``planner.py`` for the steps, and the notes in ``profile.py``, ``cost.py`` and
``solve.py`` for how each is done.
"""

from ._plan import Plan as Plan
from .planner import fit as fit
from .planner import plan as plan

__all__ = ["Plan", "fit", "plan"]
