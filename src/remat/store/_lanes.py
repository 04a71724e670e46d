"""Copy lanes: an ordered queue of copies that runs beside the computation.

The host tier moves bytes between an accelerator and host memory without stalling the step:
copies go onto a *lane* and overlap with compute; an event says when one has finished. On
CUDA a lane is a side stream; on the CPU it is one worker thread. Both follow the same rules,
so the host tier's logic (ordering, bounds, buffer reuse, prefetch) runs and is tested on a
machine without an accelerator.

Rules every lane keeps:

1. Copies on one lane run in the order they were queued.
2. A copy starts only after the work queued on the computation before ``copy`` was called
   (so it reads the finished value of its source).
3. A tensor a queued copy reads or writes is not reused by the allocator before the copy has
   finished (pytorch/pytorch#106360: freeing the source of a side-stream copy on the main
   stream lets the caching allocator hand its memory out while the copy still reads it).
4. ``Done.wait()`` blocks the host until the copy finished; ``Done.join()`` makes the
   computation wait for it, without blocking the host where the device allows.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

__all__: list[str] = []


class Done(Protocol):
    """The completion of one queued copy."""

    def query(self) -> bool: ...

    def wait(self) -> None: ...

    def join(self) -> None: ...


class Lane(Protocol):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Done: ...


# -- CUDA (and other accelerators with streams) ----------------------------------------------


class _EventDone:
    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def query(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()

    def join(self) -> None:
        torch.cuda.current_stream(self.event.device).wait_event(self.event)


class StreamLane:
    """A CUDA side stream. Rule 2 by ``wait_stream``; rule 3 by ``record_stream``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Done:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        # Tell the caching allocator that this stream uses both tensors: their memory is not
        # handed out again until the copy has run, whichever stream frees them.
        for t in (dst, src):
            if t.device.type == "cuda":
                t.record_stream(self.stream)
        return _EventDone(event)


# -- CPU: one worker thread --------------------------------------------------------------------


class _FutureDone:
    __slots__ = ("future",)

    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()

    join = wait  # on the CPU the computation is the host thread


class ThreadLane:
    """A worker thread that runs copies one after another (rule 1).

    Rule 2 holds because CPU operators have finished when they return; rule 3 because the
    queued job references both tensors until it has run. The thread holds no reference to the
    lane, and stops when the lane is garbage collected or ``close`` is called.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(
            target=_work, args=(self._jobs,), name="remat-copy-lane", daemon=True
        )
        self._thread.start()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Done:
        future: Future[None] = Future()
        self._jobs.put((lambda: _copy(dst, src), future))
        return _FutureDone(future)

    def close(self) -> None:
        self._jobs.put(None)

    def __del__(self) -> None:
        self._jobs.put(None)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _work(jobs: queue.SimpleQueue[tuple[Callable[[], None], Future[None]] | None]) -> None:
    while (job := jobs.get()) is not None:
        run, future = job
        try:
            run()
        except BaseException as error:  # handed to whoever waits on it
            future.set_exception(error)
        else:
            future.set_result(None)
        del run, future, job


def lane_for(device: torch.device) -> Lane:
    """The lane that moves bytes between ``device`` and host memory."""
    if device.type == "cuda":
        return StreamLane(device)
    if device.type == "cpu":
        return ThreadLane()
    raise NotImplementedError(f"no copy lane for device type {device.type!r}")
