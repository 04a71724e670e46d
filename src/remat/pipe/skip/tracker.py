"""The skip tracker: where stashed tensors wait until they are popped, per thread.

Outside a pipeline the current thread's :class:`SkipTracker` keeps them in a dictionary, so a
skippable model runs as a plain ``nn.Sequential``. A pipeline gives each micro-batch a
:class:`SkipTrackerThroughPortals` and installs it with :func:`use_skip_tracker` around every
partition it runs, the recompute of a checkpointed partition included; skips that cross
partitions then go through portals (see NOTE [ Life of a tensor through a portal ]).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import Tensor

from ..._state import is_recomputing
from ...errors import RematError
from ..dependency import fork, join
from ..microbatch import Batch
from .namespace import DEFAULT, Namespace
from .portal import Portal

if TYPE_CHECKING:
    from .layout import SkipLayout

__all__: list[str] = []

Key = tuple[Namespace, str]


def _label(ns: Namespace, name: str) -> str:
    return repr(name) if ns is DEFAULT else f"{name!r} in {ns!r}"


class SkipTracker:
    """Stashed skip tensors of one thread (or one micro-batch), by namespace and name."""

    def __init__(self) -> None:
        self.tensors: dict[Key, Tensor | None] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Tensor | None) -> None:
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Namespace, name: str) -> Tensor | None:
        try:
            return self.tensors.pop((ns, name))
        except KeyError:
            raise RematError(
                f"remat: skip {_label(ns, name)} is popped, but no earlier layer has stashed it "
                "in this forward. Run remat.pipe.verify_skippables(model) to see every wiring "
                "problem of the model."
            ) from None


class SkipTrackerThroughPortals(SkipTracker):
    """The tracker of one micro-batch in a :class:`~remat.pipe.Pipe`.

    ``checkpointed`` says whether the micro-batch's partitions run in checkpointed regions,
    which decides how many times a portal hands its tensor out.
    """

    def __init__(self, layout: SkipLayout, checkpointed: bool) -> None:
        super().__init__()
        self.layout = layout
        self.checkpointed = checkpointed
        self.portals: dict[Key, Portal] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Tensor | None) -> None:
        if not self.layout.requires_portal(ns, name):
            super().save(batch, ns, name, tensor)
            return
        key = (ns, name)
        if key in self.portals and is_recomputing():
            # Event [5]: the recompute of the stashing partition; the portal already gave its
            # tensor out, and the stashed tensor's gradient flows through the forward graph.
            return
        # Event [1]. A checkpointed micro-batch pops twice: in forward, and when the popping
        # partition is recomputed.
        portal = Portal(tensor, tensor_life=2 if self.checkpointed else 1, name=name)
        self.portals[key] = portal
        i = batch.find_tensor_idx()
        batch[i] = join(batch[i], portal.blue())

    def load(self, batch: Batch, ns: Namespace, name: str) -> Tensor | None:
        if not self.layout.requires_portal(ns, name):
            return super().load(batch, ns, name)
        i = batch.find_tensor_idx()
        batch[i], phony = fork(batch[i])
        return self.portals[(ns, name)].orange(phony)


class _Local(threading.local):
    def __init__(self) -> None:
        self.tracker: SkipTracker | None = None


_local = _Local()


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[None]:
    """Make ``tracker`` the current thread's skip tracker inside the block."""
    previous = _local.tracker
    _local.tracker = tracker
    try:
        yield
    finally:
        _local.tracker = previous


def current_skip_tracker() -> SkipTracker:
    """The current thread's skip tracker (a plain one, made on first use, outside pipelines)."""
    tracker = _local.tracker
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker
