"""Skip connections for pipelines: ``@skippable`` modules, namespaces, the tracker, portals.

The design follows torchgpipe (Kim et al., 2020, arXiv:2004.09910), whose skip tracker hands
skip tensors from one partition to a later one through portals hidden from autograd.
"""

from __future__ import annotations

__all__: list[str] = []
