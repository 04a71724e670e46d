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

import array
import contextlib
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass, fields
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import _state
from ._aten import FRESH_ALIASES, cached_op_info, op_info
from .errors import RematError

__all__ = ["MemoryReport", "MemoryTracker", "ModelState", "TimelineSample"]

OUTSIDE = "<outside>"
BACKWARD = "<backward>"
RECOMPUTE = "<recompute>"
INPUT = "<input>"

# What a storage holds, for telling activations from model state.
_ACTIVATION, _PARAMETER, _BUFFER, _GRADIENT, _OPTIMIZER = range(5)
_MODEL_STATE = frozenset({_PARAMETER, _BUFFER, _GRADIENT, _OPTIMIZER})

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
class ModelState:
    """Bytes of the model's parameters, buffers and gradients, and of the optimizer's state.

    Each storage counts once (tied weights, views into one flat buffer).
    """

    params_bytes: int = 0
    buffers_bytes: int = 0
    grads_bytes: int = 0
    optimizer_state_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (
            self.params_bytes + self.buffers_bytes + self.grads_bytes + self.optimizer_state_bytes
        )


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


# -- books -----------------------------------------------------------------------------------


class _Record:
    """One storage the tracker knows of, for as long as it lives (and after, in the log)."""

    __slots__ = ("device", "kind", "module", "nbytes", "op", "pre_entry", "saved", "serial")

    def __init__(
        self, serial: int, nbytes: int, device: str, op: str, module: str, pre_entry: bool
    ) -> None:
        self.serial = serial
        self.nbytes = nbytes
        self.device = device
        self.op = op
        self.module = module
        self.pre_entry = pre_entry
        self.kind = _ACTIVATION
        self.saved = False


class _StorageRef(weakref.ref[torch.UntypedStorage]):
    """A weak reference to a storage that carries its key and record to the free callback."""

    __slots__ = ("key", "record")

    key: int
    record: _Record

    def __new__(
        cls, storage: torch.UntypedStorage, callback: Any, key: int, record: _Record
    ) -> _StorageRef:
        self = super().__new__(cls, storage, callback)
        self.key = key
        self.record = record
        return self

    def __init__(
        self, storage: torch.UntypedStorage, callback: Any, key: int, record: _Record
    ) -> None:
        super().__init__(storage, callback)  # type: ignore[call-arg]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind a plain strided tensor, or None for what the books leave out."""
    if t.layout is not torch.strided or t.is_meta or type(t) not in (torch.Tensor, nn.Parameter):
        return None
    return t.untyped_storage()


def _tensor_leaves(value: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensor_leaves(v, found)
    return found


class _Ledger:
    """Live bytes per device, the allocation log, the timeline and the saved-tensor totals."""

    def __init__(self, timeline: bool, max_samples: int) -> None:
        self.lock = threading.RLock()
        self.start = time.perf_counter()
        self.refs: dict[int, _StorageRef] = {}
        self.records: list[_Record] = []
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.peak_seconds: dict[str, float] = {}
        self.allocated: dict[str, int] = {}
        self.allocations: dict[str, int] = {}
        # Every change as (record serial, signed bytes), to replay with final classifications.
        self.log_serial: array.array[int] = array.array("q")
        self.log_delta: array.array[int] = array.array("q")
        self.samples: list[tuple[float, str, int, int, str, str]] | None = [] if timeline else None
        self.max_samples = max_samples
        self.dropped = 0
        self.modules: list[tuple[int, str]] = []
        self.saved_bytes = 0
        self.saved_param_bytes = 0
        self.saved_tensors = 0
        self.saved_by_module: dict[str, int] = {}
        self.saved_by_op: dict[str, int] = {}
        self.closed = False

    # -- storages ----------------------------------------------------------------------------

    def module(self) -> str:
        if _state.state.recomputing:
            return RECOMPUTE
        if self.modules:
            return self.modules[-1][1]
        return BACKWARD if torch._C._current_graph_task_id() != -1 else OUTSIDE

    def known(self, storage: torch.UntypedStorage) -> _Record | None:
        ref = self.refs.get(storage._cdata)
        return None if ref is None else ref.record

    def allocate(self, storage: torch.UntypedStorage, device: str, op: str) -> None:
        nbytes = storage.nbytes()
        with self.lock:
            # An empty storage is entered too: an out= operator or resize_ may grow it later.
            record = self._enter(storage, nbytes, device, op, self.module(), pre_entry=False)
            if nbytes:
                self.allocated[device] = self.allocated.get(device, 0) + nbytes
                self.allocations[device] = self.allocations.get(device, 0) + 1
                self._change(record, nbytes)

    def adopt(self, storage: torch.UntypedStorage, device: str, kind: int = _ACTIVATION) -> _Record:
        """Enter a storage from before entry, so that its free lowers the level."""
        with self.lock:
            ref = self.refs.get(storage._cdata)
            if ref is not None:
                record = ref.record
            else:
                nbytes = storage.nbytes()
                record = self._enter(storage, nbytes, device, INPUT, OUTSIDE, pre_entry=True)
            if kind != _ACTIVATION:
                record.kind = kind
            return record

    def _enter(
        self,
        storage: torch.UntypedStorage,
        nbytes: int,
        device: str,
        op: str,
        module: str,
        pre_entry: bool,
    ) -> _Record:
        record = _Record(len(self.records), nbytes, device, op, module, pre_entry)
        self.records.append(record)
        key = storage._cdata
        self.refs[key] = _StorageRef(storage, self._freed, key, record)
        return record

    def resized(self, record: _Record, nbytes: int) -> None:
        with self.lock:
            delta = nbytes - record.nbytes
            record.nbytes = nbytes
            if delta > 0:
                self.allocated[record.device] = self.allocated.get(record.device, 0) + delta
            self._change(record, delta)

    def _freed(self, ref: weakref.ref[torch.UntypedStorage]) -> None:
        assert isinstance(ref, _StorageRef)
        with self.lock:
            if self.closed:
                return
            if self.refs.get(ref.key) is ref:
                del self.refs[ref.key]
            if ref.record.nbytes:
                self._change(ref.record, -ref.record.nbytes)

    def _change(self, record: _Record, delta: int) -> None:
        device = record.device
        live = self.live[device] = self.live.get(device, 0) + delta
        self.log_serial.append(record.serial)
        self.log_delta.append(delta)
        now = time.perf_counter() - self.start
        if live > self.peak.get(device, 0):
            self.peak[device] = live
            self.peak_seconds[device] = now
        elif device not in self.peak:
            self.peak[device] = 0
            self.peak_seconds[device] = 0.0
        if self.samples is not None:
            if len(self.samples) < self.max_samples:
                self.samples.append((now, device, live, delta, record.op, record.module))
            else:
                self.dropped += 1

    # -- saved tensors -----------------------------------------------------------------------

    def saved(self, t: torch.Tensor) -> None:
        with self.lock:
            self.saved_tensors += 1
            storage = _storage(t)
            if storage is None:
                return
            record = self.known(storage)
            if record is None:
                record = self.adopt(storage, str(t.device))
            if isinstance(t, nn.Parameter):
                record.kind = _PARAMETER
            if record.saved:
                return
            record.saved = True
            nbytes = storage.nbytes()
            if record.kind in (_PARAMETER, _BUFFER):
                self.saved_param_bytes += nbytes
                return
            module = self.module()
            self.saved_bytes += nbytes
            self.saved_by_module[module] = self.saved_by_module.get(module, 0) + nbytes
            self.saved_by_op[record.op] = self.saved_by_op.get(record.op, 0) + nbytes

    # -- after exit --------------------------------------------------------------------------

    def activation_peaks(self) -> dict[str, int]:
        """Replay the log counting only storages that are not model state."""
        live: dict[str, int] = {}
        peak: dict[str, int] = {}
        records = self.records
        for serial, delta in zip(self.log_serial, self.log_delta, strict=True):
            record = records[serial]
            device = record.device
            if record.kind in _MODEL_STATE:
                peak.setdefault(device, 0)
                continue
            level = live[device] = live.get(device, 0) + delta
            if level > peak.get(device, 0):
                peak[device] = level
            else:
                peak.setdefault(device, 0)
        return peak

    def stop(self) -> None:
        """Stop counting: frees from now on happen after the region."""
        with self.lock:
            self.closed = True

    def release(self) -> None:
        """Forget every storage. Dropping the references drops their callbacks too."""
        with self.lock:
            self.refs.clear()
            self.records.clear()
            self.log_serial = array.array("q")
            self.log_delta = array.array("q")
            self.samples = None


# -- operators -------------------------------------------------------------------------------


class _AllocationMode(TorchDispatchMode):
    """Enters each storage an operator creates; see [ Counting storages ]."""

    def __init__(self, ledger: _Ledger) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ledger = ledger
        self._info = cached_op_info()
        self._names: dict[torch._ops.OpOverload, str] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Eager accounting only; without this, torch wraps every __torch_dispatch__ call in a
        # Dynamo-disabling frame, which costs more than the accounting.
        return False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        results = _tensor_leaves(out, [])
        if not results:
            return out
        ledger = self.ledger
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = _op_name(func)
        info = self._info.get(func) or op_info(func)
        inputs: set[int] | None = None
        for t in results:
            storage = _storage(t)
            if storage is None:
                continue
            record = ledger.known(storage)
            if record is not None:
                # A view, an in-place write or an out= result: the storage is not new, but
                # its contents are this operator's now, and its size may have changed.
                if info.writes and not record.pre_entry:
                    record.op = name
                nbytes = storage.nbytes()
                if nbytes != record.nbytes:
                    ledger.resized(record, nbytes)
                continue
            if inputs is None:
                # lift_fresh returns its argument, a tensor just made outside the dispatcher
                # (torch.tensor(data)): new to the program although it aliases an argument.
                fresh_alias = func._schema.name in FRESH_ALIASES
                inputs = set() if fresh_alias else self._argument_storages(args, kwargs)
            if storage._cdata in inputs:
                continue  # an alias of an argument made before entry
            ledger.allocate(storage, str(t.device), name)
        return out

    def _argument_storages(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
        """Keys of the arguments' storages; older ones are adopted, so their frees count."""
        keys: set[int] = set()
        ledger = self.ledger
        for t in _tensor_leaves((args, tuple(kwargs.values())), []):
            storage = _storage(t)
            if storage is None:
                continue
            keys.add(storage._cdata)
            if ledger.known(storage) is None:
                ledger.adopt(storage, str(t.device))
        return keys


def _op_name(func: torch._ops.OpOverload) -> str:
    packet = func.overloadpacket.__name__
    namespace = func.namespace
    return packet if namespace == "aten" else f"{namespace}::{packet}"


# -- model state -----------------------------------------------------------------------------


def _unique_storages(
    tensors: Iterable[torch.Tensor],
) -> dict[int, tuple[torch.UntypedStorage, str]]:
    found: dict[int, tuple[torch.UntypedStorage, str]] = {}
    for t in tensors:
        storage = _storage(t)
        if storage is not None:
            found.setdefault(storage._cdata, (storage, str(t.device)))
    return found


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    found: list[torch.Tensor] = []
    for state in optimizer.state.values():
        values = state.values() if isinstance(state, Mapping) else (state,)
        for value in values:
            _tensor_leaves(value, found)
    return found


class _ModelState:
    """The tensors of the model and optimizer given to the tracker, grouped by role."""

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        params: list[torch.Tensor] = list(model.parameters()) if model is not None else []
        if optimizer is not None:
            seen = {id(p) for p in params}
            for group in optimizer.param_groups:
                params.extend(p for p in group["params"] if id(p) not in seen)
        self.params = _unique_storages(params)
        buffers = _unique_storages(model.buffers() if model is not None else ())
        self.buffers = {k: v for k, v in buffers.items() if k not in self.params}
        grads = _unique_storages(p.grad for p in params if p.grad is not None)
        self.grads = {k: v for k, v in grads.items() if k not in self.params}
        taken = self.params.keys() | self.buffers.keys() | self.grads.keys()
        state = _unique_storages(_optimizer_tensors(optimizer))
        self.optimizer = {k: v for k, v in state.items() if k not in taken}

    def groups(self) -> tuple[tuple[int, dict[int, tuple[torch.UntypedStorage, str]]], ...]:
        return (
            (_PARAMETER, self.params),
            (_BUFFER, self.buffers),
            (_GRADIENT, self.grads),
            (_OPTIMIZER, self.optimizer),
        )

    def totals(self) -> ModelState:
        def total(group: dict[int, tuple[torch.UntypedStorage, str]]) -> int:
            return sum(storage.nbytes() for storage, _ in group.values())

        return ModelState(
            params_bytes=total(self.params),
            buffers_bytes=total(self.buffers),
            grads_bytes=total(self.grads),
            optimizer_state_bytes=total(self.optimizer),
        )

    def classify(self, ledger: _Ledger) -> None:
        """Mark the records of these storages, entering those from before entry."""
        for kind, group in self.groups():
            for storage, device in group.values():
                ledger.adopt(storage, device, kind)


# -- CUDA ------------------------------------------------------------------------------------


def _cuda_ready() -> bool:
    """Whether CUDA is in use in this process (asking does not initialise it)."""
    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


class _CudaAllocator:
    """``max_memory_allocated`` and ``memory_allocated`` deltas for every CUDA device.

    The caching allocator updates these counters on the host, when a block is handed out or
    returned, so they need no synchronisation (which would also create a context on every
    device it touches).
    """

    def __init__(self) -> None:
        self.base: dict[int, int] = {}
        if _cuda_ready():
            for index in range(torch.cuda.device_count()):
                self.base[index] = torch.cuda.memory_allocated(index)
                torch.cuda.reset_peak_memory_stats(index)

    def read(self, seen: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
        """Peak and end deltas for each device that was used or that the region allocated on."""
        peaks: dict[str, int] = {}
        ends: dict[str, int] = {}
        if not _cuda_ready():
            return peaks, ends
        seen = set(seen)
        for index in range(torch.cuda.device_count()):
            # A device first used inside the region had nothing allocated at entry.
            base = self.base.get(index, 0)
            peak = torch.cuda.max_memory_allocated(index) - base
            name = f"cuda:{index}"
            if peak > 0 or name in seen:
                peaks[name] = int(peak)
                ends[name] = int(torch.cuda.memory_allocated(index) - base)
        return peaks, ends


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
