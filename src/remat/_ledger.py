"""The books of ``remat.MemoryTracker``: every storage an operator allocates, until it is
freed; see NOTE [ Counting storages ] in ``track.py``."""

from __future__ import annotations

import array
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _state
from ._aten import FRESH_ALIASES, op_info
from ._dispatch import EagerMode

__all__: list[str] = []

OUTSIDE = "<outside>"
BACKWARD = "<backward>"
RECOMPUTE = "<recompute>"
INPUT = "<input>"

# What a storage holds, for telling activations from model state.
_ACTIVATION, _PARAMETER, _BUFFER, _GRADIENT, _OPTIMIZER = range(5)
_MODEL_STATE = frozenset({_PARAMETER, _BUFFER, _GRADIENT, _OPTIMIZER})


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


class _AllocationMode(EagerMode):
    """Enters each storage an operator creates; see [ Counting storages ]."""

    def __init__(self, ledger: _Ledger) -> None:
        super().__init__()
        self.ledger = ledger
        self._names: dict[torch._ops.OpOverload, str] = {}

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
        info = op_info(func)
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
