"""``remat.MemoryTracker``: what a region of a training step holds in memory, and why.

::

    with remat.MemoryTracker(model, optimizer=opt) as tracker:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    print(tracker.report().summary())

The report gives, per device, the peak of live bytes above the level at entry and a timeline of
every change; the bytes autograd saved for backward, by module and by producing operator; and
parameters, gradients and optimizer state at entry and exit, kept apart from activations.

NOTE [ Counting storages ]

On CPU there are no allocator statistics, so the tracker keeps its own books, storage by
storage:

1. A ``TorchDispatchMode`` sees every ATen operator. Each storage behind a result that is new
   (not already known, and not the storage of one of the operator's arguments) is an
   allocation: it is entered with ``untyped_storage().nbytes()`` bytes, keyed by the storage's
   address (``untyped_storage()._cdata``), with the operator and module that made it.
2. The tracker learns of the free from a weak reference to the storage's Python object, whose
   callback runs when the storage itself is destroyed. PyTorch keeps a storage's Python object
   alive exactly as long as the C++ storage, so the callback fires when the last holder lets go,
   whoever that is: a tensor, a view, or a shallow copy made in C++ that never gets a Python
   object (without hooks, autograd saves an operator's output as such a copy). Counting live
   tensor objects per storage would miss those copies and report frees early.
   The callback runs inside the storage's destructor, before its address can be reused, so a
   key never names two storages at once.
3. Storages that existed before entry are not counted when they appear; but when one the
   tracker knows of is freed inside the region, the live level drops by its size, as the
   allocator's would. It knows the parameters, buffers, gradients and optimizer state of the
   model and optimizer given, the older storages autograd saved, and those passed to an
   operator that returned a new storage or a view.
4. The tracker holds no tensor and no storage: only weak references, sizes and names.

Blind spots. Memory that a kernel allocates and frees before it returns (a contiguous copy of
an expanded argument inside ``mm``, a scratch buffer of LayerNorm's backward kernel) never
appears as an operator result: ``torch.profiler``'s memory events see it, the tracker does not,
so its peak can be lower than the profiler's by the scratch memory live at the peak. Tensors
made without an operator are not seen either: the random-generator states that remat keeps
to replay random operators (``torch.get_rng_state()``, 5,056 bytes each for the CPU
generator), Python numbers wrapped as tensors for one operator. ``torch.tensor(data)`` and
``torch.from_numpy`` are counted when they are lifted into the dispatcher. Tensor subclasses,
sparse and meta tensors are not counted, and older tensors freed without the tracker having
seen them do not lower the level. The books describe eager execution, not compiled graphs.

On CUDA the same books are kept, and the caching allocator is asked as well: at exit,
``max_memory_allocated - memory_allocated`` at entry is reported as ``allocator_peak_bytes``.
The allocator rounds every block up (to 512 bytes) and sees kernel workspaces, so its figure is
the larger. Peak statistics are reset on entry, which clobbers any outer measurement.

NOTE [ Model state apart from activations ]

Parameters, buffers and gradients of the model given, and the optimizer's state, are measured
at entry and exit. Every storage in the books is also classified: a gradient when autograd
stores it in ``.grad`` (a post-accumulate-grad hook on each parameter), optimizer state after
each ``optimizer.step()`` (a step post-hook), and once more at exit. Each change of the live
bytes is logged as (storage, bytes), so at exit the log is replayed leaving out model state:
``activation_peak_bytes`` is the peak of activations and temporaries alone, exactly, wherever
the gradients and optimizer state were allocated. Gradients of tensors that are not parameters
(``x.grad`` of an input) are activations here.

NOTE [ What counts as saved ]

An outermost ``saved_tensors_hooks`` pair sees each tensor autograd saves. Its storage counts
once however many views or saves share it, for as long as it lives (a later storage at the same
address counts again). Parameters and buffers of the model (and parameters of the optimizer)
are held anyway, so their saved bytes are reported apart, in ``saved_param_bytes``, not as
activations. Each saved storage is attributed to:

* the module whose forward was running when it was saved (innermost, qualified name as in
  ``model.named_modules()``; ``""`` for the model's own code, ``"<outside>"`` outside the model's
  forward, ``"<backward>"`` during backward, ``"<recompute>"`` in the recompute of a remat
  region);
* the operator that produced it: the last operator that allocated or wrote its storage before
  it was saved (so a dropout mask is the in-place operator that last wrote it, not the
  ``empty_like`` that made it; ``remat.explain`` uses the same rule). A saved view is the
  operator behind its storage; a storage from before entry is ``"<input>"``. The alternative,
  the operator whose autograd node saved it, cannot be read reliably from hooks: autograd saves
  an operator's inputs before the operator runs and its outputs after, and an
  ``autograd.Function`` saves after its whole forward, so "the last operator seen" is the
  previous operator for input saves.

Hooks nest, and the innermost pair wins: inside a ``remat.checkpoint`` region, remat's own hooks
take every save, so nothing saved inside a region reaches the tracker. That is what the region
holds: nothing, except its inputs, which it saves through an ``autograd.Function`` outside its
own hooks. So with every block of a model checkpointed, saved bytes are the blocks' inputs plus
what operators outside the blocks save. The recompute in backward is counted like any other
operator in the live bytes. The same holds for a region under a policy (the graph engine): the
results its policy keeps are held in the engine's records, not saved through the tracker's
hook, so they count in the live bytes and not in the saved bytes. A region with
``offload_to_cpu=True`` saves its inputs under remat's offload hooks, which are innermost too:
those inputs are not counted as saved.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, astuple, dataclass, fields
from types import TracebackType
from typing import Any

import torch
from torch import nn

from . import _state
from ._ledger import (
    _ACTIVATION,
    _GRADIENT,
    _OPTIMIZER,
    _AllocationMode,
    _CudaAllocator,
    _Ledger,
    _ModelState,
    _optimizer_tensors,
    _storage,
)
from ._ledger import ModelState as ModelState
from .errors import RematError

__all__ = ["MemoryReport", "MemoryTracker", "ModelState", "TimelineSample"]

_active_lock = threading.Lock()
_active: MemoryTracker | None = None


# -- report ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimelineSample:
    """One change of the live bytes on one device.

    ``op`` and ``module`` name the storage that appeared or disappeared: the operator that
    produced it (last allocated or wrote it) and the module that was running then;
    ``delta_bytes`` is positive for an allocation and negative for a free.
    """

    seconds: float
    device: str
    live_bytes: int
    delta_bytes: int
    op: str
    module: str


@dataclass(frozen=True)
class MemoryReport:
    """What a :class:`MemoryTracker` measured. Byte counts are per storage, never per view.

    Attributes:
        duration_seconds: wall time of the region.
        peak_bytes: per device, the highest live level above the level at entry.
        activation_peak_bytes: per device, the same peak counting only storages that are not
            parameters, buffers, gradients of parameters or optimizer state: activations and
            temporaries. Storages are classified as what they end up being, so a gradient
            counts as a gradient from its allocation on.
        end_bytes: per device, the live level at exit above the level at entry.
        allocated_bytes: per device, total bytes of storages allocated in the region.
        allocations: per device, how many storages were allocated in the region.
        peak_seconds: per device, seconds after entry when the peak was first reached.
        allocator_peak_bytes: per CUDA device, ``max_memory_allocated`` in the region minus
            ``memory_allocated`` at entry: the allocator's view of ``peak_bytes``.
        allocator_end_bytes: per CUDA device, ``memory_allocated`` at exit minus at entry.
        saved_bytes: bytes of storages saved for backward, excluding model parameters and
            buffers (see ``saved_param_bytes``). Inside remat regions only the regions' inputs
            are saved (see the note [ What counts as saved ] in ``remat.track``).
        saved_bytes_by_module: ``saved_bytes`` by the module that saved them.
        saved_bytes_by_op: ``saved_bytes`` by the operator that produced them.
        saved_param_bytes: bytes of model parameters and buffers saved for backward.
        saved_tensors: how many tensors reached the tracker's saved-tensor hook.
        state_at_entry, state_at_exit: parameters, buffers, gradients and optimizer state.
        timeline: every change of the live bytes, in order, unless recording was turned off
            or ``max_timeline_samples`` was reached.
        timeline_dropped: changes left out of ``timeline`` after it reached its limit.
    """

    duration_seconds: float
    peak_bytes: Mapping[str, int]
    activation_peak_bytes: Mapping[str, int]
    end_bytes: Mapping[str, int]
    allocated_bytes: Mapping[str, int]
    allocations: Mapping[str, int]
    peak_seconds: Mapping[str, float]
    allocator_peak_bytes: Mapping[str, int]
    allocator_end_bytes: Mapping[str, int]
    saved_bytes: int
    saved_bytes_by_module: Mapping[str, int]
    saved_bytes_by_op: Mapping[str, int]
    saved_param_bytes: int
    saved_tensors: int
    state_at_entry: ModelState
    state_at_exit: ModelState
    timeline: tuple[TimelineSample, ...]
    timeline_dropped: int

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device with a change of live bytes or an allocator figure, sorted."""
        return tuple(sorted({*self.peak_bytes, *self.allocator_peak_bytes}))

    def summary(self, top: int = 10) -> str:
        """A text table: peaks per device, model state, saved bytes by module and top ops."""
        lines = [f"remat.MemoryTracker: region of {self.duration_seconds:.3f} s"]
        header = ("device", "peak", "activation peak", "at exit", "allocated", "allocator peak")
        rows = [
            (
                device,
                _fmt(self.peak_bytes.get(device, 0)),
                _fmt(self.activation_peak_bytes.get(device, 0)),
                _fmt(self.end_bytes.get(device, 0)),
                f"{_fmt(self.allocated_bytes.get(device, 0))} in {self.allocations.get(device, 0)}",
                _fmt(self.allocator_peak_bytes[device])
                if device in self.allocator_peak_bytes
                else "-",
            )
            for device in self.devices
        ]
        lines += _table(header, rows or [("-", "0 B", "0 B", "0 B", "0 B in 0", "-")])
        lines.append("")
        lines += _table(
            ("model state", "at entry", "at exit"),
            [
                (name, _fmt(getattr(self.state_at_entry, f)), _fmt(getattr(self.state_at_exit, f)))
                for name, f in (
                    ("parameters", "params_bytes"),
                    ("buffers", "buffers_bytes"),
                    ("gradients", "grads_bytes"),
                    ("optimizer state", "optimizer_state_bytes"),
                )
            ],
        )
        lines.append("")
        lines.append(
            f"saved for backward: {_fmt(self.saved_bytes)} from {self.saved_tensors} saved "
            f"tensors (parameters saved, not counted: {_fmt(self.saved_param_bytes)})"
        )
        for title, table in (
            ("by module", self.saved_bytes_by_module),
            ("by operator", self.saved_bytes_by_op),
        ):
            ranked = _ranked(table)
            if not ranked:
                continue
            lines.append("")
            shares = [
                (name or "(model)", _fmt(b), _share(b, self.saved_bytes)) for name, b in ranked
            ]
            shown = shares if title == "by module" else shares[:top]
            lines += _table((f"saved {title}", "bytes", "share"), shown)
            if len(shown) < len(shares):
                lines.append(f"... {len(shares) - len(shown)} more")
        if self.timeline_dropped:
            lines.append("")
            lines.append(f"timeline: {self.timeline_dropped} changes left out after the limit")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_json(self) -> dict[str, Any]:
        """Every field as plain JSON types (dicts, lists, numbers, strings)."""
        out: dict[str, Any] = {"devices": list(self.devices)}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, ModelState):
                value = {**asdict(value), "total_bytes": value.total_bytes}
            elif f.name == "timeline":
                names = [g.name for g in fields(TimelineSample)]
                value = [dict(zip(names, astuple(s), strict=True)) for s in value]
            out[f.name] = value
        return out


def _fmt(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _ranked(table: Mapping[str, int]) -> list[tuple[str, int]]:
    return sorted(table.items(), key=lambda item: (-item[1], item[0]))


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: tuple[str, ...]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest)).rstrip()

    return [line(header), *(line(r) for r in rows)]


# -- tracker ---------------------------------------------------------------------------------


class MemoryTracker:
    """Measure the memory of a region of a training step; read it with :meth:`report`.

    Args:
        model: the model, for saved bytes by module and for its parameters, buffers and
            gradients. Forward hooks are registered on its modules on entry and removed on exit.
        optimizer: the optimizer, for its state.
        timeline: record every change of the live bytes (see :class:`TimelineSample`).
        max_timeline_samples: the most changes recorded; later ones are counted in
            ``timeline_dropped``. Peaks never depend on the timeline.

    Example::

        with remat.MemoryTracker(model, optimizer=opt) as tracker:
            loss_fn(model(x), y).backward()
            opt.step()
        report = tracker.report()
        print(report.summary())
        report.peak_bytes["cpu"], report.saved_bytes_by_module["blocks.0.attn"]

    Inside the region, :meth:`live_bytes` reads the current level. A tracker measures one
    region, on the thread that enters it (and autograd's threads, which inherit its state); one
    tracker is active at a time, so trackers do not nest. How storages are counted and what
    counts as saved: see the notes at the top of ``remat.track``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        timeline: bool = True,
        max_timeline_samples: int = 100_000,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise RematError(
                f"remat.MemoryTracker: model must be an nn.Module or None, got "
                f"{type(model).__name__}."
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise RematError(
                f"remat.MemoryTracker: optimizer must be a torch.optim.Optimizer or None, got "
                f"{type(optimizer).__name__}. Pass it by keyword: optimizer=opt."
            )
        if not isinstance(timeline, bool):
            raise RematError(
                f"remat.MemoryTracker: timeline must be True or False, got {timeline!r}."
            )
        if isinstance(max_timeline_samples, bool) or not isinstance(max_timeline_samples, int):
            raise RematError(
                "remat.MemoryTracker: max_timeline_samples must be an int, got "
                f"{type(max_timeline_samples).__name__}."
            )
        if max_timeline_samples < 0:
            raise RematError(
                f"remat.MemoryTracker: max_timeline_samples must be >= 0, got "
                f"{max_timeline_samples}."
            )
        self.model = model
        self.optimizer = optimizer
        self._timeline = timeline
        self._max_samples = max_timeline_samples
        self._ledger: _Ledger | None = None
        self._stack: contextlib.ExitStack | None = None
        self._entry: ModelState | None = None
        self._cuda: _CudaAllocator | None = None
        self._report: MemoryReport | None = None

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> MemoryTracker:
        global _active
        if self._ledger is not None:
            raise RematError(
                "remat.MemoryTracker: this tracker was already used; a tracker measures one "
                "region. Create a new MemoryTracker for each region."
            )
        with _active_lock:
            if _active is not None:
                raise RematError(
                    "remat.MemoryTracker: another MemoryTracker is already active; trackers do "
                    "not nest. Track the outer region only, and use the timeline (seconds, op, "
                    "module of each change) to see the inner part."
                )
            _active = self
        try:
            self._start()
        except BaseException:
            with _active_lock:
                _active = None
            raise
        return self

    def _start(self) -> None:
        state = _ModelState(self.model, self.optimizer)
        self._entry = state.totals()
        self._cuda = _CudaAllocator()
        ledger = self._ledger = _Ledger(self._timeline, self._max_samples)
        state.classify(ledger)
        with contextlib.ExitStack() as stack:
            if self.model is not None:
                _module_hooks(self.model, ledger, stack)
                _gradient_hooks(self.model, ledger, stack)
            if self.optimizer is not None:
                handle = self.optimizer.register_step_post_hook(
                    lambda opt, args, kwargs: _classify_optimizer(opt, ledger)
                )
                stack.callback(handle.remove)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_pack(ledger), _unpack))
            stack.enter_context(_AllocationMode(ledger))
            self._stack = stack.pop_all()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        global _active
        try:
            if self._stack is not None:
                self._stack.close()
            self._report = self._finish()
        finally:
            with _active_lock:
                _active = None

    def _finish(self) -> MemoryReport:
        ledger = self._ledger
        assert ledger is not None and self._entry is not None and self._cuda is not None
        ledger.stop()
        duration = time.perf_counter() - ledger.start
        allocator_peaks, allocator_ends = self._cuda.read(ledger.live)
        state = _ModelState(self.model, self.optimizer)
        state.classify(ledger)
        activation = ledger.activation_peaks()
        samples = ledger.samples or []
        ledger.release()
        return MemoryReport(
            duration_seconds=duration,
            peak_bytes=dict(sorted(ledger.peak.items())),
            activation_peak_bytes=dict(sorted(activation.items())),
            end_bytes=dict(sorted(ledger.live.items())),
            allocated_bytes=dict(sorted(ledger.allocated.items())),
            allocations=dict(sorted(ledger.allocations.items())),
            peak_seconds=dict(sorted(ledger.peak_seconds.items())),
            allocator_peak_bytes=allocator_peaks,
            allocator_end_bytes=allocator_ends,
            saved_bytes=ledger.saved_bytes,
            saved_bytes_by_module=dict(_ranked(ledger.saved_by_module)),
            saved_bytes_by_op=dict(_ranked(ledger.saved_by_op)),
            saved_param_bytes=ledger.saved_param_bytes,
            saved_tensors=ledger.saved_tensors,
            state_at_entry=self._entry,
            state_at_exit=state.totals(),
            timeline=tuple(TimelineSample(*s) for s in samples),
            timeline_dropped=ledger.dropped,
        )

    # -- reading -----------------------------------------------------------------------------

    def live_bytes(self, device: str | torch.device | None = None) -> int:
        """Bytes live now above the level at entry, on ``device`` or summed over devices."""
        if self._ledger is None:
            raise RematError("remat.MemoryTracker: live_bytes() is available once entered.")
        with self._ledger.lock:
            if device is None:
                return sum(self._ledger.live.values())
            return self._ledger.live.get(_device_name(torch.device(device)), 0)

    def report(self) -> MemoryReport:
        """What was measured; available after the ``with`` block."""
        if self._report is None:
            raise RematError(
                "remat.MemoryTracker: the report is ready after the with block ends; call "
                "tracker.report() after it (live_bytes() works inside)."
            )
        return self._report


def _device_name(device: torch.device) -> str:
    """``"cuda"`` names the current CUDA device, as tensors on it do: ``"cuda:0"``."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _pack(ledger: _Ledger) -> Any:
    def pack(t: torch.Tensor) -> torch.Tensor:
        ledger.saved(t)
        # A detached alias, not ``t`` itself: a saved output holding itself would keep its
        # own autograd node alive through the hook, a cycle no collector breaks.
        return t.detach()

    return pack


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _module_hooks(model: nn.Module, ledger: _Ledger, stack: contextlib.ExitStack) -> None:
    """Keep ``ledger.modules`` as the stack of modules whose forward is running.

    The pre-hook pushes, the post-hook (``always_call``, so it runs when forward raises) pops
    down to its own entry, so an entry left behind by a forward aborted without running hooks
    goes with its parent. A recompute of a remat region is skipped: nothing it saves reaches the
    tracker, and remat's early stop leaves modules without their post-hooks.
    """
    modules = ledger.modules
    state = _state.state

    def pre(module: nn.Module, args: Any, name: str) -> None:
        if not state.recomputing:
            modules.append((id(module), name))

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if state.recomputing:
            return
        key = id(module)
        for i in range(len(modules) - 1, -1, -1):
            if modules[i][0] == key:
                del modules[i:]
                return

    for name, module in model.named_modules():
        stack.callback(
            module.register_forward_pre_hook(
                lambda m, a, name=name: pre(m, a, name), prepend=True
            ).remove
        )
        stack.callback(module.register_forward_hook(post, always_call=True).remove)


def _gradient_hooks(model: nn.Module, ledger: _Ledger, stack: contextlib.ExitStack) -> None:
    """Mark each gradient as such when autograd stores it, even if it dies before exit."""

    def accumulated(p: torch.Tensor) -> None:
        if p.grad is not None:
            storage = _storage(p.grad)
            if storage is not None:
                ledger.adopt(storage, str(p.grad.device), _GRADIENT)

    for p in model.parameters():
        if p.requires_grad and p.is_leaf:
            handle = p.register_post_accumulate_grad_hook(accumulated)  # type: ignore[no-untyped-call]
            stack.callback(handle.remove)


def _classify_optimizer(optimizer: torch.optim.Optimizer, ledger: _Ledger) -> None:
    for t in _optimizer_tensors(optimizer):
        storage = _storage(t)
        if storage is not None:
            record = ledger.known(storage)
            if record is not None and record.kind == _ACTIVATION:
                record.kind = _OPTIMIZER
