"""remat: train PyTorch models whose activations do not fit in memory.

For each tensor autograd saves for backward, remat keeps it, moves it to host memory or disk
until backward, or drops it and rebuilds it in backward, with gradients bit-identical to a
plain run.
"""

from . import hf as hf
from . import pipe as pipe
from . import policies as policies
from . import store as store
from ._state import disable_checkpointing as disable_checkpointing
from ._state import is_checkpointing as is_checkpointing
from ._state import is_recomputing as is_recomputing
from .checkpoint import checkpoint as checkpoint
from .errors import CheckpointError as CheckpointError
from .errors import NoPlanFits as NoPlanFits
from .errors import RematError as RematError
from .explain import SavedTensorReport as SavedTensorReport
from .explain import explain as explain
from .graph import region as region
from .graph import tag as tag
from .modules import apply as apply
from .modules import checkpoint_sequential as checkpoint_sequential
from .modules import checkpoint_wrapper as checkpoint_wrapper
from .modules import unapply as unapply
from .offload_model import OffloadModel as OffloadModel
from .planning import Plan as Plan
from .planning import fit as fit
from .planning import plan as plan
from .store import offload as offload
from .track import MemoryReport as MemoryReport
from .track import MemoryTracker as MemoryTracker

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "MemoryReport",
    "MemoryTracker",
    "NoPlanFits",
    "OffloadModel",
    "Plan",
    "RematError",
    "SavedTensorReport",
    "apply",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "disable_checkpointing",
    "explain",
    "fit",
    "hf",
    "is_checkpointing",
    "is_recomputing",
    "offload",
    "pipe",
    "plan",
    "policies",
    "region",
    "store",
    "tag",
    "unapply",
]
