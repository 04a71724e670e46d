"""The cost model, calibrated by measurement: what each option of a block holds and needs,
and what the chain of blocks peaks at.

NOTE [ Measured memory ]

Memory is measured, not assumed: on CPU by the allocator events of ``torch.profiler``
(``profile_memory=True``; see ``bench/measure.py``), on CUDA by the caching allocator's
counters. On CPU, points in time are marked by allocating and freeing a byte tensor of a size
no real tensor has (``_Marks``): the running sum just before a marker's allocation is the live
memory there. On CUDA a mark reads the allocated bytes (the level there) and the peak since
the mark before (the peak of the stretch it closes), then resets the peak (``_CounterMarks``).
The allocator's accounting is done on the host as each tensor is allocated and freed, in
program order, so a mark needs no device synchronization; its figures are the allocator's
rounded block sizes, as the measured step's peak (``peak_bytes``) is.

1. One block alone, per option: ``kept`` is the memory live after its forward (its output
   and what it holds for backward), ``backward`` the peak during its backward (with the
   output's gradient), ``forward`` the peak during its forward, each above the level before
   its forward. Under a loop's autocast, ``cached`` is what leaving the forward's context
   frees: the cast weights autocast's cache held that the block does not keep (see NOTE
   [ Planning under autocast ] in ``_autocast.py``).
2. The whole plain step, with markers at each block's forward start and end and at the
   start of each block's backward: the plain step's peak, each block's kept bytes in the chain,
   the peak of each block's backward, the peak before the last block's backward starts
   (forward and the head) and after the first block's backward (the tail).

The chain model is then ``peak = max(H + sum_j K_j, max_i (E_i + sum_{j<i} K_j + B_i), tail)``
with ``K_j = K_chain_j + kept(o_j) - kept(plain)`` and ``B_i = backward(o_i)``; ``H``, each
``E_i`` (what else is live at block i's backward) and ``tail`` come from the plain step, so
that the model reproduces the plain step's peak at every block's backward.
Time is the plain step plus, per block, the measured extra of its option (paired medians of one
block's forward and backward, the option against plain).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ._autocast import loop_forward
from .profile import (
    first_tensor,
    fresh_inputs,
    grad_outputs,
    side_inputs,
    synchronize,
    timed,
    used_elsewhere,
)

__all__: list[str] = []

_MARK = 1_000_003  # an odd byte count; marker k allocates _MARK + 2 * k bytes

Mark = Callable[[str], None]  # ``mark(name)``: the point of a measured step named ``name``


@dataclass
class Timeline:
    """Live bytes at each mark and the peak from each mark to the next, above the start."""

    levels: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)  # from the mark to the next one
    order: list[str] = field(default_factory=list)
    peak: int = 0

    def enter(self, name: str, live: int) -> None:
        """Mark ``name`` at ``live`` bytes: a name seen before (a block called twice) keeps
        its first level, and the peak of every stretch it starts."""
        self.levels.setdefault(name, live)
        self.peaks[name] = max(self.peaks.get(name, live), live)
        self.order.append(name)


class _Marks:
    """Marks points of a step on the CPU: each one an allocation of a size of its own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.names: list[str] = []

    def __call__(self, name: str) -> None:
        size = _MARK + 2 * len(self.names)
        self.names.append(name)
        marker = torch.empty(size, dtype=torch.uint8, device=self.device)
        del marker


class Counters(Protocol):
    """An allocator's counters: the bytes allocated now and at most since the last reset."""

    def allocated(self) -> int: ...

    def peak(self) -> int: ...

    def reset_peak(self) -> None: ...


class _CudaCounters:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class _CounterMarks:
    """Marks points of a step from an allocator's counters (see [ Measured memory ])."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.line = Timeline()
        self.current: str | None = None
        self.base = counters.allocated()
        counters.reset_peak()

    def __call__(self, name: str) -> None:
        self._close()
        self.current = name
        self.line.enter(name, self.counters.allocated() - self.base)
        self.counters.reset_peak()

    def _close(self) -> None:
        """The peak of the stretch since the last mark goes to that mark, and to the step's."""
        peak = self.counters.peak() - self.base
        self.line.peak = max(self.line.peak, peak)
        if self.current is not None:
            self.line.peaks[self.current] = max(self.line.peaks[self.current], peak)

    def finish(self) -> Timeline:
        self._close()
        return self.line


def counter_timeline(step: Callable[[Mark], Any], counters: Counters) -> Timeline:
    """Run ``step(mark)``, marking points from ``counters`` (see [ Measured memory ])."""
    marks = _CounterMarks(counters)
    with _collector_held():
        step(marks)
    return marks.finish()


@contextlib.contextmanager
def _collector_held() -> Iterator[None]:
    """The collector is held off during a measured step: a collection inside it would run
    finalizers of earlier work whose frees count in the step. (Collecting first costs more
    than the step in a large process: the test suite took three times as long.)"""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def timeline(step: Callable[[Mark], Any], device: torch.device) -> Timeline:
    """Run ``step(mark)`` and measure it: under the CPU allocator's event log, or from the
    CUDA allocator's counters (see [ Measured memory ])."""
    if device.type == "cuda":
        synchronize(device)
        line = counter_timeline(step, _CudaCounters(device))
        synchronize(device)
        return line
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    marks = _Marks(device)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _collector_held():
        with _without_kineto_notices(), warnings.catch_warnings():
            # torch 2.11 warns that a profiler keeps the events of its last cycle only: this
            # one has one cycle.
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
            prof.start()
        try:
            step(marks)
        finally:
            with _without_kineto_notices():
                prof.stop()
    profiler: Any = prof.profiler  # its kineto results are set once it has stopped
    events = [e for e in profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    sizes = {_MARK + 2 * k: name for k, name in enumerate(marks.names)}
    out = Timeline()
    live = 0
    current: str | None = None
    for event in events:
        if event.device_type() != DeviceType.CPU:
            continue
        n = event.nbytes()
        if abs(n) in sizes:
            if n > 0:
                current = sizes[n]
                out.enter(current, live)
            continue
        live += n
        out.peak = max(out.peak, live)
        if current is not None:
            out.peaks[current] = max(out.peaks[current], live)
    return out


# A notice that libkineto writes to the process's stderr, e.g.
# ``USDT:2026-11-25 01:12:18 29666:29666 SyncActivityProfilerHandler.cpp:52] profiler_start``.
_KINETO_NOTICE = re.compile(rb"(?:USDT|STAGE|INFO):\d{4}-\d\d-\d\d [\d:.]+ \d+:\d+ [\w.]+:\d+\] ")


@contextlib.contextmanager
def _without_kineto_notices() -> Iterator[None]:
    """Leave out the notices libkineto writes to file descriptor 2 as a profiler starts and
    stops (two lines per start and stop, dozens per plan, none of them the user's); whatever
    else is written there meanwhile (kineto's warnings and errors, other threads) is written
    back after. Only the profiler's start and stop run inside: no user code."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no standard error to write to
        yield
        return
    with tempfile.TemporaryFile() as written:
        os.dup2(written.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            written.seek(0)
            kept = [
                line for line in written.read().splitlines(True) if not _KINETO_NOTICE.match(line)
            ]
            if kept:
                os.write(2, b"".join(kept))


def peak_bytes(step: Callable[[], Any], device: torch.device) -> int:
    """The peak live bytes of ``step()`` above the level before it: the CPU allocator's events,
    or the CUDA allocator's peak counter."""
    return timeline(lambda mark: step(), device).peak


@dataclass(frozen=True)
class Measured:
    """One option of one block type, measured alone (see [ Measured memory ] 1)."""

    kept: int
    backward: int
    seconds: float  # extra seconds of a forward and backward over the plain block


class Memory(NamedTuple):
    """One block's memory, measured alone (see :func:`measure_memory`)."""

    kept: int
    backward: int
    left: int
    forward: int
    cached: int  # held by autocast's cache until its forward's context ends, not kept
    side: int = 0  # bytes of its side inputs it holds after its forward (see ``side_inputs``)


def measure_memory(
    block: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]], device: torch.device
) -> Memory:
    """The bytes of ``block`` as it is set up (a warm-up run first): held after forward
    (``kept``), the peak in backward (``backward``), what is still held after its backward,
    inside the same backward (``left``: beyond the output, its gradient and the input's
    gradient), and the peak during forward (``forward``), each above the level before
    forward. ``left`` may be negative: a plain block frees its input. The block reads its
    inputs as results of an op, as in a chain, not as leaves: a graph engine holds such
    inputs, and what it replayed, until the backward ends.

    ``side`` is what the block holds of its side inputs (:func:`side_inputs`) after its
    forward, found in the warm-up run: their storages still in use once the caller's references
    are gone. In the measured run the caller holds them, as a model's forward holds a mask it
    passes to every block, so ``kept`` leaves them out."""
    sizes: list[int] = []
    held: list[int] = []

    def run(mark: Mark | None) -> None:
        leaves = fresh_inputs(inputs)
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: t * 1 if t.requires_grad else t, leaves
        )
        tracked = [
            t for t in pytree.tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        side = [t.untyped_storage() for t in side_inputs(leaves)] if mark is None else []
        torch.manual_seed(0)
        if mark is not None:
            mark("start")
        with loop_forward():
            outs = grad_outputs(block(*args, **kwargs))
            # The inputs go before the mark: an input the option does not hold (one it wrote to
            # disk) is freed in a chain as the next block starts, inside the context, so it
            # counts in ``kept``, never in ``cached``.
            del args, kwargs
            if mark is not None:
                mark("cast")
        if side:
            del leaves
            held.append(sum(s.nbytes() for s in side if used_elsewhere(s)))
            del side
        if mark is not None:
            mark("forward")
        grads = [torch.ones_like(o) for o in outs]
        if tracked and mark is not None:

            def done(g: torch.Tensor) -> None:
                mark("inputs")
                sizes.append(g.untyped_storage().nbytes())

            tracked[0].register_hook(done)  # type: ignore[no-untyped-call]
        torch.autograd.backward(outs, grads)
        if mark is not None:
            mark("end")
        sizes.append(sum(t.untyped_storage().nbytes() for t in (*outs, *grads)))
        del outs, grads

    run(None)
    line = timeline(run, device)
    start = line.levels["start"]
    left = 0
    if "inputs" in line.levels:
        left = line.levels["inputs"] - start - sum(sizes)
    backward = max(line.peaks["forward"], line.peaks.get("inputs", 0)) - start
    kept = line.levels["forward"] - start
    forward = max(line.peaks["start"], line.peaks["cast"]) - start
    cached = line.levels["cast"] - line.levels["forward"]
    return Memory(kept, backward, left, forward, cached, held[0] if held else 0)


def measure_seconds(
    block: nn.Module,
    plain: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    device: torch.device,
    repeats: int = 5,
) -> float:
    """Median extra seconds of ``block``'s forward and backward over ``plain``'s, in pairs
    that alternate which runs first; on an accelerator, each to the end of its work there."""

    def once(m: nn.Module) -> float:
        args, kwargs = fresh_inputs(inputs)
        torch.manual_seed(0)

        def run() -> None:
            with loop_forward():
                outs = grad_outputs(m(*args, **kwargs))
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

        return timed(run, device)

    return paired_extra(lambda: once(block), lambda: once(plain), repeats)


def paired_extra(first: Callable[[], float], second: Callable[[], float], pairs: int) -> float:
    """The median of ``first() - second()`` (each returns the seconds it took) over ``pairs``
    pairs that alternate which runs first, after a warm-up run of each; at least zero."""
    first()
    second()
    diffs = []
    for r in range(pairs):
        if r % 2:
            a = first()
            b = second()
        else:
            b = second()
            a = first()
        diffs.append(a - b)
    return max(statistics.median(diffs), 0.0)


@dataclass
class PlainStep:
    """The whole plain step, measured (see [ Measured memory ] 2)."""

    peak: int
    kept: list[int]  # each block's kept bytes in the chain
    backward_peaks: list[int]  # each block's backward peak, above the step's start
    forward_peaks: list[int]  # each block's forward peak, above the step's start
    prefix: list[int]  # live bytes before each block's forward, above the first one's
    head: int  # the peak before the last block's backward starts
    # The peak to the end of the forward and the loss, inside the loop's autocast (where its
    # cache still holds the cast weights); at most ``head``.
    forward_head: int
    tail: int  # the peak after the first block's backward
    # ``head`` and ``forward_head`` from the last block's forward end on, past the tensors the
    # model's forward frees as it returns (see [ Side inputs ] in ``solve.py``).
    head_after: int
    forward_head_after: int
    seconds: float  # the median of ``samples``
    samples: list[float] = field(default_factory=list)  # seconds of each timed plain step


def time_plain_steps(
    model: nn.Module, step: Callable[..., Any], device: torch.device, repeats: int
) -> list[float]:
    """Seconds of ``repeats`` plain steps, each from zeroed gradients, to the end of its work
    on ``device``."""
    seconds = []
    for _ in range(repeats):
        zero_grads(model)
        seconds.append(timed(step, device))
    zero_grads(model)
    return seconds


def measure_plain_step(
    model: nn.Module,
    paths: list[str],
    step: Callable[..., Any],
    device: torch.device,
    repeats: int = 3,
) -> PlainStep:
    """Mark each block call's forward and backward in one plain step and measure them;
    ``step`` calls its argument where the forward and the loss end. ``paths`` holds the path
    of each block call in forward order: a block the forward calls several times (weights
    shared across depth) is there once per call, and each call is marked as a block of its own.
    """
    modules = {p: model.get_submodule(p) for p in paths}
    marks: list[Mark] = []
    handles = []
    calls = [0]  # the block calls the forward made so far in the marked step
    n = len(paths)

    def pre(module: nn.Module, args: Any) -> None:
        if marks and calls[0] < n:
            marks[0](f"fs{calls[0]}")

    def post(module: nn.Module, args: Any, out: Any) -> None:
        if not marks or calls[0] >= n:
            return  # calls past the forward's (a recompute in backward) are not marked
        i = calls[0]
        calls[0] += 1
        marks[0](f"fe{i}")
        t = first_tensor(out)

        def grad_hook(g: torch.Tensor) -> None:
            if marks:
                marks[0](f"bs{i}")

        t.register_hook(grad_hook)  # type: ignore[no-untyped-call]

    for m in modules.values():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))

    def run(mark: Mark) -> None:
        marks.append(mark)
        calls[0] = 0
        try:
            step(lambda: mark("forward_end"))
        finally:
            marks.clear()

    try:
        step()
        zero_grads(model)
        line = timeline(run, device)
    finally:
        for h in handles:
            h.remove()
    base = 0
    level0 = line.levels[f"fs{0}"]
    kept = [line.levels[f"fe{i}"] - line.levels[f"fs{i}"] for i in range(n)]
    prefix = [line.levels[f"fs{i}"] - level0 for i in range(n)]
    order = line.order
    # Backward segments run from one block's bs mark to the next mark in order.
    backward_peaks = []
    for i in range(n):
        backward_peaks.append(line.peaks[f"bs{i}"] - base)
    head = max(line.peaks[name] for name in order[: order.index(f"bs{n - 1}")])
    head = max(head, line.levels[f"bs{n - 1}"])
    # Before the first mark: the part of forward before the first block.
    head = max(head, level0)
    ended = order.index("forward_end")
    forward_head = max(
        [level0, line.levels["forward_end"], *(line.peaks[m] for m in order[:ended])]
    )
    last = order.index(f"fe{n - 1}")
    backward = order.index(f"bs{n - 1}")
    head_after = max([line.levels[f"bs{n - 1}"], *(line.peaks[m] for m in order[last:backward])])
    forward_head_after = max(
        [line.levels["forward_end"], *(line.peaks[m] for m in order[last:ended])]
    )
    tail_marks = order[order.index(f"bs{0}") + 1 :]
    tail = max((line.peaks[name] for name in tail_marks), default=0)
    seconds = time_plain_steps(model, step, device, repeats)
    return PlainStep(
        peak=line.peak,
        kept=kept,
        backward_peaks=backward_peaks,
        forward_peaks=[line.peaks[f"fs{i}"] for i in range(n)],
        prefix=prefix,
        head=head,
        forward_head=min(forward_head, head),
        tail=tail,
        head_after=head_after,
        forward_head_after=min(forward_head_after, head_after),
        seconds=statistics.median(seconds),
        samples=seconds,
    )


def zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
