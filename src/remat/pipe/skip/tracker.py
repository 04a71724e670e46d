"""The skip tracker: where stashed tensors wait until they are popped, per thread.

Outside a pipeline the current thread's :class:`SkipTracker` keeps them in a dictionary, so a
skippable model runs as a plain ``nn.Sequential``. A pipeline gives each task (a micro-batch
in a partition) a :class:`SkipTrackerThroughPortals` and installs it with
:func:`use_skip_tracker` around the task's run and its recompute; skips that cross partitions
then go through portals (see NOTE [ Life of a tensor through a portal ]).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import Tensor

from ...errors import RematError
from ..dependency import fork, join, phony
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
    """The tracker of one task of a :class:`~remat.pipe.Pipe`: one micro-batch in one partition.

    ``checkpointed`` says whether the micro-batch's partitions run in checkpointed regions,
    which decides how many times a portal hands its tensor out. ``waiting`` holds the portals
    that the micro-batch's tasks stashed and no task has popped yet; the pipeline shares it
    between the micro-batch's tasks and empties it when its forward ends.

    NOTE [ Which portals a tracker keeps ]

    A checkpointed task's tracker lives as long as the task's region, whose frame keeps the
    function to recompute, and the region lives as long as the autograd nodes that saved
    tensors in it. A tensor stashed in the task leads through its ``grad_fn`` to those nodes.
    So if the tracker kept the portals of its own stashes (which keep the tensors), the region
    would keep itself alive through C++ autograd nodes, a reference cycle the garbage collector
    does not see: the skip tensors of a forward that is never backwarded would never be freed.
    A tracker keeps instead what its recompute needs: the portals it popped, which earlier
    tasks stashed (their tensors' graphs reach earlier regions only, never back to this one),
    and, for each skip it stashed, whether the micro-batch was joined to a phony that requires
    grad. A portal waits between stash and pop in ``waiting``, which every task's forward
    shares and nothing keeps after the pipeline's forward: by then every portal was popped,
    and after a forward that raised the pipeline drops the rest.

    NOTE [ The skips' phony ]

    PortalBlue's backward, which hands the skip tensor its gradient, runs only if backward
    reaches it from the pop: PortalOrange's phony input must descend from PortalBlue's phony.
    The micro-batch itself cannot always link them: between stash and pop it may be an integer
    tensor (token ids), or a tensor that lost its history (``torch.ones_like(x)``), and a phony
    joined to it or forked from it leads nowhere, so the gradient would be dropped silently.
    So each micro-batch also carries ``phony``, an empty tensor beside the micro-batch's own
    tensors: the stash joins PortalBlue's phony into it, the pipeline hands it from each task of
    the micro-batch to the next (an input and an output of each task's region, moved to each
    partition's device), and the pop of a skip whose PortalBlue exists forks from it and joins
    that fork into PortalOrange's phony input. The micro-batch is still joined and forked as
    well, as torchgpipe does: when it carries gradients, that keeps PortalBlue's backward after
    the popping partition's backward (NOTE [ Life of a tensor through a portal ]). Forks and
    joins save no tensor, so the phony changes nothing that a region saves; a pop's PortalOrange
    (and what the layers after it save) depends only on whether the stash's PortalBlue exists,
    which the portal remembers for the recompute.
    """

    def __init__(self, layout: SkipLayout, checkpointed: bool, waiting: dict[Key, Portal]) -> None:
        super().__init__()
        self.layout = layout
        self.checkpointed = checkpointed
        self.waiting = waiting
        self.popped: dict[Key, Portal] = {}
        self.stashed: dict[Key, bool] = {}
        # The skips' phony of the micro-batch while the task runs (NOTE [ The skips' phony ]);
        # run_partition sets it from the task's input. None until a stash needs one.
        self.phony: Tensor | None = None

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Tensor | None) -> None:
        if not self.layout.requires_portal(ns, name):
            super().save(batch, ns, name, tensor)
            return
        key = (ns, name)
        i = batch.find_tensor_idx()
        if key in self.stashed:
            # Event [5]: the recompute of the stashing partition; the portal already gave its
            # tensor out, and the stashed tensor's gradient flows through the forward graph.
            # The micro-batch is joined all the same, to a phony that requires grad when the
            # forward's did: the join makes the micro-batch require grad, and operators after
            # it save other tensors when an input requires grad (a product saves the factor
            # that needs no grad only then), so the recompute must see what forward saw.
            needs_grad = self.stashed[key]
            batch[i] = join(batch[i], phony(batch[i].device, requires_grad=needs_grad))
            return
        # Event [1]. A checkpointed micro-batch pops twice: in forward, and when the popping
        # partition is recomputed.
        portal = Portal(tensor, tensor_life=2 if self.checkpointed else 1, name=name)
        self.waiting[key] = portal
        blue = portal.blue()
        self.stashed[key] = blue.requires_grad
        batch[i] = join(batch[i], blue)
        if blue.requires_grad:
            self.phony = blue if self.phony is None else join(self.phony, blue)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Tensor | None:
        if not self.layout.requires_portal(ns, name):
            return super().load(batch, ns, name)
        key = (ns, name)
        portal = self.popped.get(key)
        if portal is None:  # forward; the recompute finds the portal here again
            portal = self.popped[key] = self.waiting.pop(key)
        i = batch.find_tensor_idx()
        batch[i], p = fork(batch[i])
        if portal.needs_grad:
            if self.phony is None:
                raise RematError(
                    f"remat: internal error: skip {_label(ns, name)} was stashed with a "
                    "gradient, but the micro-batch reached its pop without the skips' phony "
                    "(NOTE [ The skips' phony ] in remat/pipe/skip/tracker.py). Please report "
                    "this with the model."
                )
            self.phony, carried = fork(self.phony)
            p = join(p, carried)
        return portal.orange(p)


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
