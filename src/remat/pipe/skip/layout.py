"""Where each skip connection starts and ends, by partition.

A skip stashed and popped in the same partition stays inside that partition's autograd graph
like any tensor. One that crosses partitions needs a portal in one process
(``portal.py``), and across processes it rides along the stages in between as an extra stage
input and output (``distributed.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .namespace import Namespace
from .skippable import Skippable

__all__: list[str] = []

Key = tuple[Namespace, str]


@dataclass(frozen=True)
class SkipLayout:
    """Partition that stashes and partition that pops each skip, keys in stash order."""

    num_partitions: int
    keys: tuple[Key, ...]
    stash_at: dict[Key, int]
    pop_at: dict[Key, int]

    def requires_portal(self, ns: Namespace, name: str) -> bool:
        """Whether the skip crosses partitions. A skip the layout does not list is stashed
        and popped by skippables nested in one layer (``verify_skippables`` refuses the
        others): it stays inside that layer's partition."""
        key = (ns, name)
        return key in self.stash_at and self.stash_at[key] != self.pop_at[key]

    def carried_into(self, j: int) -> list[Key]:
        """Skips that partition ``j`` receives from earlier partitions (it pops or passes them)."""
        return [k for k in self.keys if self.stash_at[k] < j <= self.pop_at[k]]

    def carried_out_of(self, j: int) -> list[Key]:
        """Skips that leave partition ``j`` for later ones (stashed here or passing through)."""
        return [k for k in self.keys if self.stash_at[k] <= j < self.pop_at[k]]


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    """The layout of a model already checked by :func:`verify_skippables`."""
    keys: list[Key] = []
    stash_at: dict[Key, int] = {}
    pop_at: dict[Key, int] = {}
    for j, partition in enumerate(partitions):
        for layer in partition:
            if not isinstance(layer, Skippable):
                continue
            for key in layer.poppable():
                pop_at[key] = j
            for key in layer.stashable():
                stash_at[key] = j
                keys.append(key)
    return SkipLayout(len(partitions), tuple(keys), stash_at, pop_at)
