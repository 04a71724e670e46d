"""Where offloaded saved tensors wait for backward: tiers, and the store in front of them.

``remat.offload`` sends what a block saves to a tier; ``OFFLOAD_HOST`` and ``OFFLOAD_DISK``
policy decisions send single op outputs of a graph-engine region there. See NOTE [ Life of an
offloaded tensor ] in ``_store.py`` for how a tensor goes and comes back, and the notes of
``host.py`` and ``disk.py`` for each tier.
"""

from ._store import Store as Store
from .disk import DiskStats as DiskStats
from .disk import DiskTier as DiskTier
from .host import HostStats as HostStats
from .host import HostTier as HostTier
from .scope import offload as offload
from .scope import tiers as tiers

__all__ = ["DiskStats", "DiskTier", "HostStats", "HostTier", "Store", "offload", "tiers"]
