"""Thread-local flags that say whether code runs inside a checkpointed region.

Each flag lives in a :class:`threading.local`, so two threads training side by side never see
each other's regions, and each is set by a context manager that restores the previous value in
``finally``, so an exception escaping a region leaves the flags as they were.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Protocol

import torch

from .errors import RematError

__all__ = ["disable_checkpointing", "is_checkpointing", "is_recomputing"]


Decision = Literal["keep", "recompute", "offload"]


class SaveObserver(Protocol):
    """Told of each tensor that remat's own saved-tensor hooks take over (see ``explain``)."""

    def saved(self, t: torch.Tensor, decision: Decision, how: str) -> None: ...


class _State(threading.local):
    def __init__(self) -> None:
        self.checkpointing = False
        self.recomputing = False
        self.disabled = False
        # Set while a region saves its inputs, so that outer hooks can tell them apart.
        self.saving_region_inputs = False
        self.observer: SaveObserver | None = None
        # The graph-engine region recording on this thread, if any.
        self.graph: Any = None
        # The innermost ``remat.offload`` block on this thread, if any.
        self.offload: Any = None


state = _State()


def refuse_transforms(what: str) -> None:
    """Raise inside a ``torch.func`` transform (``vmap``, ``grad``, ``jvp``...): a recompute
    runs in backward, outside the transform that made the region's tensors, and functorch does
    not run saved-tensor hooks under its ``grad``. One C call when none is active."""
    if torch._C._functorch.maybe_current_level() is None:
        return
    transform = torch._C._functorch.peek_interpreter_stack()
    kind = transform.key().name.lower() if transform is not None else "a transform"
    raise RematError(
        f"remat: {what} cannot run inside torch.func.{kind}: remat rebuilds a region's "
        "tensors in backward, outside the transform that made them, and torch.func does not "
        "support the saved-tensor hooks remat uses. Run the region plainly under the transform "
        "(wrap that call in `with remat.disable_checkpointing():`, which keeps what it saves), "
        "or differentiate with torch.autograd (loss.backward(), torch.autograd.grad) instead."
    )


# Ids for reads of saved tensors outside any backward: a fresh negative one each time.
_made_up_tasks = itertools.count(-2, -1)


def made_up_task() -> int:
    """A graph-task id no backward will ever have."""
    return next(_made_up_tasks)


def backward_task() -> tuple[int, bool]:
    """The running backward's graph-task id, and whether there is none (the id is made up).

    Both engines keep what they rebuild per graph task; a made-up task lasts one unpack.
    """
    task = torch._C._current_graph_task_id()
    if task == -1:
        return made_up_task(), True
    return task, False


def when_backward_ends(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def forget_when_backward_ends(forget: Callable[[int], None], task: int) -> None:
    """Call the bound method ``forget(task)`` when the running backward finishes, if its object
    is still alive then. The callback holds the object weakly: a region's state (its inputs, what
    it rebuilt) goes as soon as the graph drops it, not when the whole backward ends."""
    method = weakref.WeakMethod(forget)

    def callback() -> None:
        bound = method()
        if bound is not None:
            bound(task)

    when_backward_ends(callback)


def is_checkpointing() -> bool:
    """Whether the calling code runs in the forward pass of a checkpointed region.

    It is ``False`` while a region is being recomputed in backward (see :func:`is_recomputing`)
    and outside every region.
    """
    return state.checkpointing


def is_recomputing() -> bool:
    """Whether the calling code is being re-run in backward to rebuild dropped tensors.

    Use it to keep side effects from happening twice::

        class Counter(nn.Module):
            def forward(self, x):
                if not remat.is_recomputing():
                    self.calls += 1
                return x
    """
    return state.recomputing


@contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Run every region entered inside this block plainly: nothing dropped, nothing recomputed.

    Useful for evaluation with gradients, or to compare against a plain run of the same code.
    """
    previous = state.disabled
    state.disabled = True
    try:
        yield
    finally:
        state.disabled = previous


class checkpointing:
    """Mark the code inside as the forward pass of a region (``value=True``) or not.

    A class rather than a ``contextmanager`` generator: it is entered on every region call."""

    __slots__ = ("previous", "value")

    def __init__(self, value: bool = True) -> None:
        self.value = value
        self.previous = False

    def __enter__(self) -> None:
        self.previous = state.checkpointing
        state.checkpointing = self.value

    def __exit__(self, *exc: object) -> None:
        state.checkpointing = self.previous


class frame_saves:
    """Mark the code inside as saving to a region-engine frame (its forward pass or its
    recompute): a graph-engine region opened inside does not join a graph-engine region
    outside (whose policy has no say over what the frame saves), so it saves its inputs in
    forward as it does in the recompute, where no outer recording is open."""

    __slots__ = ("previous",)

    def __init__(self) -> None:
        self.previous: Any = None

    def __enter__(self) -> None:
        self.previous, state.graph = state.graph, None

    def __exit__(self, *exc: object) -> None:
        state.graph = self.previous


class recomputing:
    """Mark the code inside as a recompute (and not a region's forward pass). Regions inside
    run as they ran in the forward pass, where checkpointing was on: a backward run under
    :func:`disable_checkpointing` does not turn them plain."""

    __slots__ = ("previous",)

    def __init__(self) -> None:
        self.previous = (False, False, False)

    def __enter__(self) -> None:
        self.previous = (state.checkpointing, state.recomputing, state.disabled)
        state.checkpointing, state.recomputing, state.disabled = False, True, False

    def __exit__(self, *exc: object) -> None:
        state.checkpointing, state.recomputing, state.disabled = self.previous
