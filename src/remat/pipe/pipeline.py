"""The GPipe schedule in one process: clock cycles of (micro-batch, partition) tasks.

NOTE [ Pipeline clock cycles ]

With ``m`` micro-batches and ``n`` partitions, clock ``k`` runs every task ``(i, j)`` with
``i + j = k``: partition ``j`` works on micro-batch ``i`` while partition ``j + 1`` works on
micro-batch ``i - 1`` (GPipe, Huang et al., 2019). ``m = 4, n = 3``:

    clock         0       1       2       3       4       5
    partition 0   (0,0)   (1,0)   (2,0)   (3,0)
    partition 1           (0,1)   (1,1)   (2,1)   (3,1)
    partition 2                   (0,2)   (1,2)   (2,2)   (3,2)

Each task of a clock, in ``Pipeline.fence`` and ``Pipeline.compute``:

    batches[i-1] ──(output of partition j)──> ...
          │ [1] fork
          v
    batches[i] ──[1] join──[2] copy to devices[j]──[3] partition j ──> batches[i]
                                                  (a region if i < checkpoint_stop,
                                                   under task (i, j)'s skip tracker)

[1] ``depend``: a phony forked from micro-batch ``i - 1`` where it leaves partition ``j`` is
    joined to micro-batch ``i`` where it enters partition ``j``. In backward, micro-batch
    ``i - 1`` enters partition ``j`` only after micro-batch ``i`` has gone through it, so every
    partition sees micro-batches ``m - 1, ..., 0`` in that order, and no partition holds the
    recomputed activations of two micro-batches at once.
[2] the micro-batch moves to partition ``j``'s device (autograd copies its gradient back).
[3] partition ``j`` runs. With checkpointing it runs in remat's region engine
    (``remat.checkpoint``): what it saves for backward is dropped and rebuilt in backward,
    the region's input is the one tensor it keeps. Skip tensors that leave the partition go
    through portals (NOTE [ Life of a tensor through a portal ] in ``skip/portal.py``).

A parameter used by ``m`` micro-batches receives ``m`` gradients; by [1] (and, on CPU, by
autograd running nodes newest first) they arrive in the order ``m - 1, ..., 0``, the order a
plain model run on the same micro-batches, outputs concatenated, gives in one backward. That is
the reference that gradients equal bit for bit.

The tasks of a clock run one after another on the calling thread. On accelerators kernels are
asynchronous, so partitions on different devices overlap as far as the launches allow; there
are no worker threads and no side copy streams (torchgpipe has both).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn

from ..checkpoint import RegionOptions, run_region
from .dependency import depend
from .microbatch import Batch, TensorOrTensors, check_output
from .skip.layout import Key, SkipLayout
from .skip.portal import Portal
from .skip.tracker import SkipTrackerThroughPortals, use_skip_tracker

__all__: list[str] = []

CheckpointMode = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[CheckpointMode, ...] = ("always", "except_last", "never")


def checkpoint_stop(mode: CheckpointMode, chunks: int) -> int:
    """Micro-batches ``0 .. stop - 1`` are checkpointed."""
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """The tasks ``(micro-batch, partition)`` of each clock; see NOTE [ Pipeline clock cycles ]."""
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def run_partition(
    partition: nn.Sequential,
    tracker: SkipTrackerThroughPortals,
    atomic: bool,
    width: int,
    *inputs: torch.Tensor,
) -> tuple[TensorOrTensors, torch.Tensor | None]:
    """One task's work, the same in forward and in the recompute: the partition under the
    task's skip tracker. ``inputs``: the micro-batch's ``width`` tensors, then the skips'
    phony if it has one (NOTE [ The skips' phony ] in ``skip/tracker.py``); returns the
    partition's output and the skips' phony for the next task."""
    values = inputs[:width]
    tracker.phony = inputs[width] if len(inputs) > width else None
    try:
        with use_skip_tracker(tracker):
            out: TensorOrTensors = partition(values[0] if atomic else values)
        return out, tracker.phony
    finally:
        # Skips stashed and popped inside the partition are popped by now, unless the run
        # raised or a recompute stopped early; a tensor left behind would keep, through its
        # grad_fn, the region that keeps this tracker (NOTE [ Which portals a tracker keeps ]).
        # So would the phony, which descends from this task's PortalBlue nodes.
        tracker.tensors.clear()
        tracker.phony = None


class Pipeline:
    """Runs micro-batches through partitions in clock cycles."""

    def __init__(
        self,
        partitions: list[nn.Sequential],
        devices: list[torch.device],
        layout: SkipLayout,
        options: RegionOptions,
    ) -> None:
        self.partitions = partitions
        self.devices = devices
        self.layout = layout
        self.options = options

    def run(self, batches: list[Batch], stop: int) -> None:
        """Replace each micro-batch by the last partition's output for it."""
        # Per micro-batch, the portals stashed and not popped yet (NOTE [ Which portals a
        # tracker keeps ] in skip/tracker.py). All are popped when the forward ends; after one
        # that raised, those left would keep their tensors, and the regions that stashed them,
        # alive for good.
        waiting: list[dict[Key, Portal]] = [{} for _ in batches]
        # Per micro-batch, the skips' phony (NOTE [ The skips' phony ] in skip/tracker.py).
        phonies: list[torch.Tensor | None] = [None for _ in batches]
        try:
            for schedule in clock_cycles(len(batches), len(self.partitions)):
                self.fence(batches, schedule)
                self.compute(batches, schedule, waiting, phonies, stop)
        finally:
            for portals in waiting:
                portals.clear()

    def fence(self, batches: list[Batch], schedule: list[tuple[int, int]]) -> None:
        for i, j in schedule:
            if i != 0 and j != 0:
                depend(batches[i - 1], batches[i])  # [1]
            device = self.devices[j]
            batch = batches[i]
            if any(t.device != device for t in batch):
                moved = tuple(t.to(device) for t in batch)  # [2]
                batches[i] = Batch(moved[0] if batch.atomic else moved)

    def compute(
        self,
        batches: list[Batch],
        schedule: list[tuple[int, int]],
        waiting: list[dict[Key, Portal]],
        phonies: list[torch.Tensor | None],
        stop: int,
    ) -> None:
        for i, j in schedule:  # [3]
            batch = batches[i]
            inputs = batch.tensors
            phony = phonies[i]
            if phony is not None:
                inputs = (*inputs, phony.to(self.devices[j]))
            tracker = SkipTrackerThroughPortals(self.layout, i < stop, waiting[i])
            function = functools.partial(
                run_partition, self.partitions[j], tracker, batch.atomic, len(batch)
            )
            if i < stop:
                out, phonies[i] = run_region(function, inputs, {}, self.options)
            else:
                out, phonies[i] = function(*inputs)
            if not isinstance(out, torch.Tensor):
                out = check_output(out, self.where(j))
            batches[i] = Batch(out)

    def where(self, j: int) -> str:
        """Partition ``j`` and its last layer, for errors about what it returned."""
        name, layer = list(self.partitions[j].named_children())[-1]
        return f"partition {j}, whose last layer is {name!r} ({type(layer).__name__}),"
