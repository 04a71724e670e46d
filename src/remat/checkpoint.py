"""The region engine: drop what a function saves for backward, and re-run it to rebuild it.

``checkpoint(fn, *args)`` runs ``fn`` with saved-tensor hooks that keep, for each tensor
autograd wants to save, a small slot instead of the tensor. When backward first needs one of
them, the whole function runs again under the state the forward pass saw (random generators,
autocast, default device), the recompute fills the slots, and each tensor is handed to autograd
once. This is the design of ``torch.utils.checkpoint(use_reentrant=False)``, with three
differences: module state is never written twice (see ``_guard.py``), the random state of every
accelerator the region uses is replayed, and the recompute stops right after the last tensor that
is still needed, not after the last tensor ever saved.

NOTE [ Life of a saved tensor in a region ]

Events in order, for a tensor ``t`` that an op inside region R saves for backward:

1. forward, R's pack hook: autograd gets ``slot = _Slot(index=i)``; R's frame keeps a weak
   reference to the slot and, for the determinism check, ``t``'s shape, dtype and device.
   ``t`` itself is not referenced by remat and is freed as soon as the forward pass drops it.
2. backward asks for any slot of R for the first time in graph task ``g``: R's frame unpacks
   its inputs (which may recompute an enclosing region first, see Rule 2 of the nesting note)
   and re-runs ``fn``. The recompute's pack hook sees the same saves in the same order; the
   i-th is stored for slot i in ``recomputed[g]`` if slot i is still alive.
3. the recompute stops by raising ``_StopRecompute`` right after the highest slot index that is
   still alive (early stop), or runs to the end with ``early_stop=False``.
4. autograd unpacks slot i in task ``g``: the stored tensor is popped and returned, so the frame
   holds it no longer than autograd does (even with ``retain_graph=True``). It must not have
   been written since the recompute saved it: autograd skips its own check for a tensor a
   hook packed, and an op after the save may have written it in place (an intermediate the
   region wrote after an op saved it, which plain autograd refuses).
5. a slot that backward never unpacks (partial backward) dies with its graph node; its stored
   tensor goes with it, since ``recomputed[g]`` is keyed weakly on slots. What is left of
   ``recomputed[g]`` is dropped when ``g`` ends, by a callback that holds R's frame weakly:
   the frame, and the inputs it holds, go as soon as the graph drops R's nodes, not when the
   whole backward ends (a strong hold kept one region input per chain of regions alive).
6. another backward over the same graph (``retain_graph=True``) is a new task ``g'``: step 2
   runs again.

NOTE [ Nested regions ]

Rule 1. A tensor is managed by the innermost region that is active when it is saved.
Rule 2. A region's inputs are saved, through ``_SaveInputs``, by the region around it; so
        rebuilding an inner region's inputs recomputes the outer region first. The region
        holds the saver's output (``SavedInputs``), which keeps the saved tensors available
        while the region needs them.
Rule 3. A recompute starts as if no region were active; regions it meets are honoured.
Rule 4. A graph-engine region joins the recording of one around it (its policy on top of the
        stack), except inside a region-engine region between them (``_state.frame_saves``),
        remat's or ``torch.utils.checkpoint``'s non-reentrant one (its saved-tensor hooks on
        top, ``graph._in_torch_checkpoint``): there it records on its own and saves its
        inputs, in forward as in the recompute, where no outer recording is open, so the frame
        sees the same saved tensors in both.

NOTE [ Linked calls ]

A model that loops over its blocks (``for block in self.layers: x = block(x)``) has no one
function that runs several blocks, so ``checkpoint_sequential`` cannot take them, and a region
per block saves every block's input. :class:`LinkedCalls` makes consecutive calls one region,
one frame with one ``_Call`` per call, as long as each call's input is the previous call's
output. A call links to the previous one when one of its tensor arguments *is* a leaf of the
previous call's output (the same object) at the version it had when that call returned: then
nothing the caller did in between changed it, and re-running the previous call rebuilds it.
Such an argument is not saved; every other argument is, as a region saves its inputs. The
recompute runs the calls in order, each under the state its own forward pass saw (random
generators, autocast), and feeds each linked argument from the previous call's recomputed
output. A call whose generators are as the previous call left them (the caller drew nothing
in between, the usual case) keeps no copy of them: its replay continues from where the
previous call's replay left them, so a frame holds one generator state, as one region does.
So a frame of k calls saves its first call's input alone and recomputes all k calls once per
backward, as a ``checkpoint_sequential`` segment does.

A call that does not link (its input was changed in place, replaced by a forward hook, or
computed by the caller from the output) starts a new frame and saves its input: exact, with
more memory. Ops the caller runs between calls run outside the frame, their saved tensors
kept. The frame is reached weakly between calls, so an open frame whose graph is gone keeps
nothing alive. Under ``torch.no_grad()`` or ``disable_checkpointing()`` the calls run plainly
and break the chain; under ``torch.compile`` each call is a region of its own (see
``_compile.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from . import _state
from ._ambient import (
    Ambient,
    Generators,
    GeneratorStates,
    restoring_rng,
    set_generators,
    unlisted_generator,
    unreplayed_draw,
)
from ._cache import refuse_in_region
from ._dispatch import EagerMode
from ._guard import (
    UNDO_LIMIT,
    Reachable,
    Undo,
    WriteGuard,
    identities,
    learned_reads,
    learned_undo,
    may_undo,
    needs_guard,
    undo_state,
    undoable,
    verified,
    wants_snapshot,
)
from ._reads import Reads
from ._types import ContextFn
from .errors import CheckpointError, RematError, did_you_mean, saved_and_written
from .policies import Policy
from .policies import check as check_policy
from .store.scope import offload_hooks

__all__ = ["LinkedCalls", "RegionOptions", "checkpoint", "links"]

DeterminismCheck = Literal["default", "none"]
_DETERMINISM_CHECKS = ("default", "none")

_USUAL_CAUSES = (
    "Usual causes: the function reads global or Python-level state that changed between "
    "forward and backward (a flag, a cache, Python's `random`), appends to a key/value cache "
    "it was given (a Hugging Face layer called with use_cache=True: pass use_cache=False, or "
    "use remat.hf.enable, which drops the cache while training), takes a different branch the "
    "second time, or preserve_rng_state=False with random ops inside. Pass debug=True to see "
    "the operators of both runs."
)


class _StopRecompute(BaseException):
    """Raised from the recompute's pack hook once every needed tensor is rebuilt.

    A ``BaseException`` so that ``except Exception`` in user code does not swallow it.
    """


class _Slot:
    """What autograd holds in place of a tensor saved inside a region: its place in the
    region's saves, and the tensor saved (weakly) at the version it had then, which autograd
    checks for a tensor it saves itself and skips for one a hook packed."""

    __slots__ = ("__weakref__", "index", "tensor", "version")

    def __init__(self, index: int, t: torch.Tensor) -> None:
        self.index = index
        self.tensor = weakref.ref(t)
        self.version = t._version

    def check_unwritten(self) -> None:
        """Raise as autograd does if the saved tensor was written in place since (the
        region's output scaled in place after an op inside saved it): the recompute would
        give the value before the write, where plain autograd raises."""
        t = self.tensor()
        if t is not None and t._version != self.version:
            raise saved_and_written(
                f"saved tensor {self.index} of a region-engine region", t, self.version
            )


# A tensor the recompute saved, and its version then (``detach`` shares the counter, so
# writes the recompute makes after the save show).
_Rebuilt = tuple[torch.Tensor, int]


@dataclass(frozen=True)
class _Meta:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> _Meta:
        return cls(t.shape, t.dtype, t.device)

    def __str__(self) -> str:
        return f"shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}"


class _SaveInputs(torch.autograd.Function):
    """Saves a region's tensor inputs so that an enclosing region manages them (Rule 2)."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        # Autograd refuses to save a tensor made under ``torch.inference_mode``; nothing outside
        # inference mode can write one, so it is held as it is.
        ctx.inference = {i: t for i, t in enumerate(tensors) if t.is_inference()}
        ctx.save_for_backward(*(None if i in ctx.inference else t for i, t in enumerate(tensors)))
        ctx.like = dummy.dtype, dummy.device  # for its tangent (``jvp``)
        return dummy.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise AssertionError("remat: the input saver of a region is never differentiated")

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        # Forward-mode AD (``torch.autograd.forward_ad``) asks every function on the way; its
        # output is an empty tensor no result depends on, and its tangent an empty one.
        dtype, device = ctx.like
        return torch.zeros(0, dtype=dtype, device=device)


class _OpLog(EagerMode):
    """Records the operators a run executes, for ``debug=True``."""

    def __init__(self, ops: list[str] | None = None) -> None:
        super().__init__()
        self.ops: list[str] = [] if ops is None else ops
        self.paused = False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not self.paused:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def detach(self, t: torch.Tensor) -> torch.Tensor:
        """``t.detach()``, not logged: the recompute's pack hook detaches each saved tensor,
        which the forward pass does not, and would shift every operator after it."""
        self.paused = True
        try:
            return t.detach()
        finally:
            self.paused = False


class _Call:
    """One call of a function inside a frame: what its recompute needs to run it again."""

    __slots__ = (
        "ambient",
        "args",
        "function",
        "generators",
        "keys",
        "kwargs",
        "links",
        "reached",
        "reads",
        "saved_inputs",
        "snapshot",
        "tensor_args",
        "undoable",
        "writes",
        "wrote",
    )

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        ambient: Ambient,
        links: dict[int | str, int] | None = None,
    ) -> None:
        self.function = function
        # The arguments with their tensors replaced by None: the tensors live in `saved_inputs`,
        # where an enclosing region manages them. Other arguments are kept as they are, so that
        # a list or dict the function mutates is the same object in the recompute.
        self.args = tuple(None if isinstance(v, torch.Tensor) else v for v in args)
        self.kwargs = {k: None if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self.ambient = ambient
        # Arguments that are the previous call's output (see [ Linked calls ]): argument key ->
        # index of that tensor among the leaves of the previous call's output. Not saved.
        self.links = links or {}
        self.tensor_args: set[int | str] = {
            i for i, v in enumerate(args) if isinstance(v, torch.Tensor) and i not in self.links
        } | {k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in self.links}
        self.saved_inputs: SavedInputs | None = None
        # Whether the forward pass wrote a tensor it can reach, and whether the recompute may
        # write and undo instead of running guarded: see [ When the guard runs ] and
        # [ Writes undone ] in _guard.py.
        self.wrote = True
        self.undoable = False
        # The tensors the forward pass was seen to write, and the state it reached as it was
        # when it started, for a recompute to start from: [ State read, then written ].
        self.writes: list[torch.Tensor] = []
        self.snapshot: Undo | None = None
        # The tensors the function reached in the forward pass, held weakly (what its
        # recompute checks, [ When the guard runs ] 3); None when it was not walked.
        self.reached: list[weakref.ref[torch.Tensor]] | None = None
        # What the forward pass read from the modules, for the recompute to read again: see
        # [ A recompute reads what its forward pass read ] in _reads.py; None when not walked.
        self.reads: Reads | None = None
        # The explicit generators the function reaches, with their states when its forward
        # pass started: see [ Explicit generators ] in _ambient.py.
        self.generators: GeneratorStates = []
        self.keys = identities(function, args)

    def inputs(self, previous: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments of a recompute; ``previous``: the leaves of the previous call's
        recomputed output."""
        saved = iter(self.saved_inputs.tensors if self.saved_inputs is not None else ())

        def value(key: int | str, v: Any) -> Any:
            if key in self.links:
                index = self.links[key]
                t = previous[index] if index < len(previous) else None
                if not isinstance(t, torch.Tensor):
                    raise CheckpointError(
                        f"remat: the recompute of linked calls differs from their forward pass: "
                        f"the previous call's output has no tensor at leaf {index} this time. "
                        + _USUAL_CAUSES
                    )
                return t
            return next(saved) if key in self.tensor_args else v

        args = tuple(value(i, v) for i, v in enumerate(self.args))
        kwargs = {k: value(k, v) for k, v in self.kwargs.items()}
        return args, kwargs


class _Frame:
    """One forward run of one region (one call, or linked calls), and what its recomputes
    rebuilt.

    Held by the graph only (through the hooks stored with each slot), so it lives exactly as
    long as the part of the graph that may still need it.
    """

    def __init__(
        self,
        recompute_context: contextlib.AbstractContextManager[Any],
        early_stop: bool,
        check: bool,
        debug: bool,
    ) -> None:
        self.calls: list[_Call] = []
        self.recompute_context = recompute_context
        self.early_stop = _early_stop(early_stop)
        self.check = check
        self.slots: list[weakref.ref[_Slot]] = []
        self.metas: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        # Per graph task, each slot's recomputed tensor and the version it was saved at.
        self.recomputed: dict[int, weakref.WeakKeyDictionary[_Slot, _Rebuilt]] = {}
        self.forward_ops: list[str] | None = [] if debug else None

    # -- forward ---------------------------------------------------------------------------

    def run(
        self,
        call: _Call,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        forward_context: contextlib.AbstractContextManager[Any],
        offload_inputs: bool,
    ) -> Any:
        """Run ``call`` forward as part of this frame: save its inputs (all but its links)
        through autograd, and put a slot in place of everything it saves."""
        refuse_in_region(call.function, args, kwargs)  # see _cache.py
        items: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
        tensors = [v for k, v in items if k in call.tensor_args]
        # Tensors inside containers stay in their containers (the same objects in the
        # recompute), but are saved too, so that autograd's version check catches in-place
        # changes to them.
        nested = [
            v
            for v in pytree.tree_leaves(
                [a for a in (*args, *kwargs.values()) if not isinstance(a, torch.Tensor)]
            )
            if isinstance(v, torch.Tensor)
        ]
        saved = [*tensors, *nested]
        # A linked call whose one tensor argument is its link saves nothing: no node.
        call.saved_inputs = save_inputs(saved, offload_inputs) if saved else None
        self.calls.append(call)
        log = _OpLog(self.forward_ops) if self.forward_ops is not None else _NO_CONTEXT
        reach = Reachable(call.function, args, kwargs)
        recomputing = _state.state.recomputing
        reads = None if recomputing else Reads(reach)
        if reads is not None and any(map(is_lazy, reach.tensors)):
            raise _uninitialized(reads.modules)
        if reach.generators and call.ambient.replays_rng:
            call.generators = [(g, g.get_state()) for g in reach.generators]
        # Inside a recompute, a guard around this forward pass may hide its writes from the
        # version counters: then its own recompute is guarded too.
        if not recomputing and wants_snapshot(call.keys):
            state = undo_state(reach, saved)
            call.snapshot = Undo(state) if state else None
        with (
            torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack),
            _state.checkpointing(),
            _state.frame_saves(),
            forward_context,
            log,
        ):
            out = call.function(*args, **kwargs)
        if reads is not None:
            written = reach.changed()
            call.wrote = bool(written)
            call.writes = written
            call.undoable = call.wrote and undoable(written, saved)
            call.reached = reach.own_refs()
            # Arguments are checked where autograd saved them (or rebuilt, for links).
            arguments = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
            reads.forward_done(reach, call.reached, written, [*arguments, *nested])
            call.reads = reads
        call.ambient.check_forward_done()
        return out

    def pack(self, t: torch.Tensor) -> _Slot:
        slot = _Slot(len(self.slots), t)
        self.slots.append(weakref.ref(slot))
        if self.check:
            self.metas.append((t.shape, t.dtype, t.device))
        observer = _state.state.observer
        if observer is not None:
            observer.saved(t, "recompute", "region engine")
        return slot

    # -- backward --------------------------------------------------------------------------

    def unpack(self, slot: _Slot) -> torch.Tensor:
        slot.check_unwritten()
        task, outside = _state.backward_task()
        store = self.recomputed.get(task)
        if store is None:
            store = self._recompute(task)
            if not outside:
                # Rebuilt tensors that this backward never asks for go when it ends.
                _state.forget_when_backward_ends(self._forget, task)
        rebuilt = store.pop(slot, None)
        if outside:
            self._forget(task)
        if rebuilt is None:
            raise CheckpointError(
                f"remat: saved tensor {slot.index} of a checkpointed region was requested twice "
                "in one backward pass; the region engine hands each rebuilt tensor out once per "
                "backward, so that it lives no longer than autograd holds it. If a custom "
                "autograd.Function reads ctx.saved_tensors twice in its backward, read them "
                "once into local variables, or run the region on the graph engine (policy=)."
            )
        t, version = rebuilt
        # Written since the save. A version below it is the engine's own: a recompute sets back
        # the versions of the state it wrote (``_guard.py``); such state outlives the region,
        # and ``check_unwritten`` above checked its forward-pass version.
        if t._version > version:
            raise saved_and_written(
                f"saved tensor {slot.index} of a region-engine region", t, version
            )
        return t

    def _forget(self, task: int) -> None:
        self.recomputed.pop(task, None)

    def _recompute(
        self, task: int, again: bool = True
    ) -> weakref.WeakKeyDictionary[_Slot, _Rebuilt]:
        store: weakref.WeakKeyDictionary[_Slot, _Rebuilt] = weakref.WeakKeyDictionary()
        alive = [i for i, ref in enumerate(self.slots) if ref() is not None]
        if not alive:
            return store
        last_needed = alive[-1] if self.early_stop else len(self.slots) - 1
        count = 0
        mismatches: list[str] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            index = count
            count += 1
            # One alias serves both the slot and the recompute's own graph (which a backward
            # inside the function uses); a saved output holding itself would keep its grad_fn.
            detached = t.detach() if log is None else log.detach(t)
            if index < len(self.slots):
                if self.check and (t.shape, t.dtype, t.device) != self.metas[index]:
                    mismatches.append(
                        f"  saved tensor {index}: forward {_Meta(*self.metas[index])}, "
                        f"recompute {_Meta.of(t)}"
                    )
                slot = self.slots[index]()
                if slot is not None:
                    store[slot] = (detached, detached._version)
                if self.early_stop and index == last_needed:
                    raise _StopRecompute
            return detached

        log = _OpLog() if self.forward_ops is not None else None
        previous: list[Any] = []
        linked = len(self.calls) > 1
        learning = self._learning()
        try:
            with contextlib.ExitStack() as stack:
                if linked:  # a call may continue the generators where the last one left them
                    devices = {t: s for c in self.calls for t, s in c.ambient.device_rng}
                    stack.enter_context(restoring_rng(tuple(devices.items())))
                for call in self.calls:
                    args, kwargs = call.inputs(previous)
                    out, stopped = self._replay(call, args, kwargs, pack, log, not linked)
                    if stopped:
                        break
                    # The next call's links point into this output ([ Linked calls ]).
                    previous = pytree.tree_leaves(out) if linked else []
        except Exception as error:
            if mismatches:
                raise CheckpointError(self._mismatch_message(mismatches, count, log)) from error
            raise
        if mismatches or count < last_needed + 1:
            if again and learning and not self._learning():
                # The guard is a Python dispatch mode, and some composite ops take another
                # path under one (``F.ctc_loss`` saves other tensors): a first recompute that
                # differed under it, which showed the region writes nothing, runs again as
                # every later one will, without it, and is checked the same way.
                return self._recompute(task, again=False)
            raise CheckpointError(self._mismatch_message(mismatches, count, log))
        self.recomputed[task] = store
        return store

    def _learning(self) -> bool:
        """Whether a call's recompute runs guarded only to learn that it writes nothing (see
        [ When the guard runs ] in ``_guard.py``)."""
        return any(c.snapshot is None and not c.wrote and needs_guard(c.keys) for c in self.calls)

    def _replay(
        self,
        call: _Call,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        pack: Callable[[torch.Tensor], torch.Tensor],
        log: _OpLog | None,
        restore: bool = True,
    ) -> tuple[Any, bool]:
        """Run one call again under the state its forward pass saw; its output, and whether
        the pack hook stopped it early. ``restore``: put the caller's generators back after it
        (else the frame does, after its last call)."""
        # See NOTES [ When the guard runs ] and [ Writes undone ] in _guard.py.
        reach: Reachable | None = None
        undo: Undo | None = None
        guard: WriteGuard | None = None
        state: list[torch.Tensor] | None = None
        # The generators a guarded recompute may draw from: [ Explicit generators ] 3.
        listed = call.generators if call.ambient.replays_rng else None
        snapshot = call.snapshot
        if snapshot is not None:  # see [ State read, then written ] in _guard.py
            state = snapshot.tensors
            undo = Undo(state)
            if may_undo(call.keys):
                reach = Reachable(call.function, args, kwargs, call.reached)
            else:
                guard = WriteGuard(state, listed, lands=True, state=state, written=call.writes)
        elif call.wrote:
            if call.undoable:
                reach = Reachable(call.function, args, kwargs, call.reached)
                state = undo_state(reach, _tensors(args, kwargs))
            # Without a snapshot, only a region that reads none of the state it writes.
            if state is not None and may_undo(call.keys) and not wants_snapshot(call.keys):
                undo = Undo(state)
            else:
                reach = None
                guard = WriteGuard(state, listed, state=_alive(call.reached), written=call.writes)
        elif needs_guard(call.keys):
            guard = WriteGuard([], listed, state=_alive(call.reached))
        else:
            reach = Reachable(call.function, args, kwargs, call.reached)
        changed: list[torch.Tensor] = []
        out: Any = None
        stopped = False
        reads = call.reads
        bound = None
        if reads is not None:
            reads.check(call.keys)
            bound = reads.bind()
        drawn = set_generators(call.generators) if call.generators else None
        if snapshot is not None:
            snapshot.load()
        hooks = RemovableHandle.next_id  # see ``_drop_hooks_since``
        try:
            try:
                with (
                    torch.autograd.graph.saved_tensors_hooks(pack, _identity),
                    torch.enable_grad(),
                    _state.recomputing(),
                    _state.frame_saves(),
                    call.ambient.replay(restore),
                    guard if guard is not None else _NO_CONTEXT,
                    self.recompute_context,
                    log if log is not None else _NO_CONTEXT,
                ):
                    out = call.function(*args, **kwargs)
            finally:
                try:
                    if reach is not None:  # read before ``undo`` sets the versions back
                        changed.extend(reach.changed())
                finally:
                    if undo is not None:
                        undo.close()
                    if bound is not None:
                        Reads.unbind(bound)
                    if drawn is not None:
                        set_generators(drawn)
                    if RemovableHandle.next_id != hooks:
                        _drop_hooks_since(hooks, [*_tensors(args, kwargs), *_alive(call.reached)])
        except _StopRecompute:
            stopped = True
        if guard is not None and guard.unlisted is not None:
            raise unlisted_generator(guard.unlisted, "checkpointed region")
        if guard is not None and guard.drew is not None:
            raise unreplayed_draw(guard.drew, "checkpointed region")
        if guard is not None:
            if reads is not None:  # what it read, checked now and before every later recompute
                reads.learn(call.keys, guard.read)
                reads.check(call.keys)
            learned_reads(call.keys, guard)
            if guard.stale is not None:
                raise _stale_read(guard.stale, reads)
        if guard is not None and not call.wrote:
            verified(call.keys, guard.redirected + guard.landed > 0)
        elif guard is not None and state is not None:
            learned_undo(call.keys, guard)
        undone = {id(t) for t in undo.tensors} if undo is not None else set()
        if any(id(t) not in undone for t in changed):
            raise CheckpointError(
                "remat: the recompute of a checkpointed region wrote a tensor that outlives it "
                "(a parameter, buffer or input), which its forward pass did not write. "
                + _USUAL_CAUSES
            )
        return out, stopped

    def _mismatch_message(self, mismatches: list[str], count: int, log: _OpLog | None) -> str:
        lines = ["remat: the recompute of a checkpointed region differs from its forward pass."]
        if count < len(self.slots) and not mismatches:
            lines.append(
                f"  forward saved {len(self.slots)} tensors; the recompute saved only {count}."
            )
        lines.extend(mismatches)
        lines.append(_USUAL_CAUSES)
        if log is not None and self.forward_ops is not None:
            lines.append(_op_diff(self.forward_ops, log.ops))
        return "\n".join(lines)


# A context that does nothing; reentrant, so one instance serves every call.
_NO_CONTEXT = contextlib.nullcontext()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _op_diff(forward: list[str], recompute: list[str]) -> str:
    first = next(
        (i for i, (a, b) in enumerate(zip(forward, recompute, strict=False)) if a != b),
        min(len(forward), len(recompute)),
    )
    lo = max(0, first - 3)
    lines = [f"Operators from #{lo} (first difference at #{first}):"]
    for i in range(lo, first + 4):
        a = forward[i] if i < len(forward) else "-"
        b = recompute[i] if i < len(recompute) else "-"
        lines.append(f"  #{i:<5} forward {a:<40} recompute {b}")
    return "\n".join(lines)


# Arguments of torch's and fairscale's wrappers that remat's have no use for, and what to do
# with each when porting.
_PORTED = {
    "checkpoint_impl": (
        " torch's checkpoint_impl chooses between its reentrant and non-reentrant engines; "
        "remat's region engine is always non-reentrant: drop it."
    ),
    "checkpoint_fn": (
        " torch's checkpoint_fn replaces its checkpoint function; remat wraps with its own: "
        "drop it, and pass that function's options (policy=, context_fn=, ...) here."
    ),
    "maintain_forward_counter": (
        " fairscale's maintain_forward_counter counts forwards for its own checks; remat "
        "needs no counter (remat.is_recomputing() tells a recompute apart): drop it."
    ),
    "checkpoint_wrapper_fn": (
        " torch's apply_activation_checkpointing takes the wrapper to apply; remat.apply "
        "applies remat's: drop it, and pass the wrapper's options here."
    ),
    "auto_wrap_policy": (
        " torch's auto_wrap_policy selects modules by size or class; pass the class (or a "
        "predicate on (name, module)) as remat.apply's second argument instead."
    ),
}


def _contexts(context_fn: ContextFn) -> tuple[Any, Any]:
    """The two context managers ``context_fn`` returns, forward's and recompute's."""
    contexts = context_fn()
    if not (isinstance(contexts, tuple | list) and len(contexts) == 2):
        raise RematError(
            "remat: context_fn must return two context managers, the forward pass's and the "
            f"recompute's (as torch's checkpoint expects), got {type(contexts).__name__}. "
            "Return (forward_context, recompute_context); for the same one in both, return "
            "two of them."
        )
    return contexts[0], contexts[1]


@dataclass(frozen=True)
class RegionOptions:
    """The options of a region, validated once (see :func:`checkpoint` for their meaning)."""

    preserve_rng_state: bool = True
    context_fn: ContextFn | None = None
    determinism_check: DeterminismCheck = "default"
    early_stop: bool = True
    debug: bool = False
    policy: Policy | None = None

    @classmethod
    def parse(cls, caller: str, options: dict[str, Any]) -> RegionOptions:
        """Options from keyword arguments, raising a :class:`RematError` for any bad one."""
        names = (*(f.name for f in fields(cls)), "use_reentrant")
        unknown = [k for k in options if k not in names]
        if unknown:
            name = unknown[0]
            if name in _PORTED:  # an option of torch's or fairscale's wrapper, known here
                raise RematError(f"{caller}: {name}= is not an option of remat's.{_PORTED[name]}")
            raise RematError(
                f"{caller}: unknown option {name!r}{did_you_mean(name, names)}; "
                f"expected any of: {', '.join(names)}."
            )
        use_reentrant = options.pop("use_reentrant", None)
        if use_reentrant is not None and use_reentrant is not False:
            raise RematError(
                f"{caller}: use_reentrant={use_reentrant!r} is not supported; remat's region "
                "engine is always non-reentrant. Drop the argument."
            )
        self = cls(**options)
        for name in ("preserve_rng_state", "early_stop", "debug"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise RematError(
                    f"{caller}: {name} must be True or False, got {value!r} "
                    f"({type(value).__name__})."
                )
        if self.context_fn is not None and not callable(self.context_fn):
            raise RematError(
                f"{caller}: context_fn must be a callable returning two context managers "
                f"(forward, recompute), got {type(self.context_fn).__name__}."
            )
        if self.policy is not None:
            check_policy(self.policy, caller)
            region_only = [
                name
                for name, default in (
                    ("preserve_rng_state", True),
                    ("context_fn", None),
                    ("early_stop", True),
                    ("debug", False),
                )
                if getattr(self, name) != default
            ]
            if region_only:
                raise RematError(
                    f"{caller}: {', '.join(region_only)} "
                    f"{'apply' if len(region_only) > 1 else 'applies'} to the region engine, but a "
                    "policy selects the graph engine, which always replays random ops exactly "
                    "and rebuilds only what backward needs. Drop them or drop the policy."
                )
        if self.determinism_check not in _DETERMINISM_CHECKS:
            raise RematError(
                f"{caller}: determinism_check must be one of {_DETERMINISM_CHECKS}, got "
                f"{self.determinism_check!r}."
            )
        return self


def _options(
    preserve_rng_state: Any,
    context_fn: Any,
    determinism_check: Any,
    early_stop: Any,
    debug: Any,
    use_reentrant: Any,
    policy: Any,
) -> RegionOptions:
    """:func:`checkpoint`'s options, checked."""
    options = {
        "preserve_rng_state": preserve_rng_state,
        "context_fn": context_fn,
        "determinism_check": determinism_check,
        "early_stop": early_stop,
        "debug": debug,
        "use_reentrant": use_reentrant,
        "policy": policy,
    }
    return RegionOptions.parse("remat.checkpoint", options)


def _check_while_tracing(*options: Any) -> bool:
    """:func:`_options`'s checks for a region under ``torch.compile``: Dynamo calls a function
    marked so while it traces, with its arguments as the constants they are there, and puts
    its result in the graph, so a bad option raises (inside Dynamo's own error) and a good one
    costs nothing and breaks no graph."""
    _options(*options)
    return True


_checked_while_tracing: Callable[..., bool] = torch.compiler.assume_constant_result(  # type: ignore[no-untyped-call]
    _check_while_tracing
)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    context_fn: ContextFn | None = None,
    determinism_check: DeterminismCheck = "default",
    early_stop: bool = True,
    debug: bool = False,
    use_reentrant: bool | None = None,
    policy: Policy | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping what it saves for backward.

    What autograd saves inside the function is dropped and rebuilt in backward by running the
    function again, under the random state, autocast state and default device of the forward
    pass. Gradients are bit-identical to a plain run with deterministic kernels. Writes that the
    function makes to tensors outside it (BatchNorm running statistics, buffers, inputs) happen
    once, in forward, never again in the recompute.

    Args:
        function: what to run. Inputs and outputs may be any nesting of tuples, lists, dicts
            and non-tensor values.
        *args, **kwargs: its inputs. Keywords other than the options below go to ``function``.
        preserve_rng_state: replay the CPU and accelerator random generators in the recompute,
            so that dropout draws the same mask. Turn off only if the function is not random:
            a recompute that draws random numbers without it raises ``CheckpointError``
            (checked on each function's first recompute) rather than give other gradients.
        context_fn: returns two context managers; the forward pass runs under the first and
            the recompute under the second (the contract of ``torch.utils.checkpoint``, so
            ``create_selective_checkpoint_contexts`` works).
        determinism_check: ``"default"`` checks that the recompute rebuilds tensors of the same
            shape, dtype and device as the forward pass saved and raises
            :class:`~remat.CheckpointError` listing each one that differs; ``"none"`` skips it.
        early_stop: stop the recompute as soon as every saved tensor that backward can still
            ask for is rebuilt; inside torch's ``set_checkpoint_early_stop(False)`` it runs to
            the end, as torch's checkpoint does there.
        debug: record the operators of the forward pass and the recompute and show where they
            diverge when the determinism check fails.
        use_reentrant: accepted for drop-in use with ``torch.utils.checkpoint``; only ``False``
            (or leaving it out) is allowed.
        policy: decide per ATen op whether to save its output or recompute it (see
            :mod:`remat.policies`). A policy runs the function under the graph engine
            (``remat.graph``): its ops are recorded, and backward replays only the recorded
            ops that the tensor it needs depends on, never the Python around them.

    Under ``torch.no_grad()`` and inside :func:`~remat.disable_checkpointing` the function runs
    plainly. See the notes [ Life of a saved tensor in a region ] and [ Nested regions ] in this
    module for the rules it follows. Under ``torch.compile`` the region lowers to torch's
    checkpoint (a policy to a selective-checkpoint context), and a compiled ``function`` is
    recomputed as compiled; see ``_compile.py`` for what changes.

    Random ops and threads: the replay draws from the generator state that the forward pass
    captured, the state at region entry (without a policy) or before each random op (with
    one: consecutive random ops replay from the first one's state). That holds for PyTorch's
    default generators and for the ``torch.Generator`` objects the region reaches (see NOTE
    [ Explicit generators ] in ``_ambient.py``). PyTorch's default
    generators are shared by all threads of the process: if another thread draws from one
    between the capture and the region's draw (without a policy, anywhere in the region's
    forward pass; with one, between two random ops of the region), or while backward replays
    a random op, the replay draws other numbers than the forward pass did and the gradients
    are wrong, without an error (``torch.utils.checkpoint`` shares this race). Threads that
    draw random numbers while regions are alive should use their own ``torch.Generator``
    (``torch.rand(..., generator=g)``), or not draw between a region's forward pass and the
    end of its backward pass.
    """
    if torch.compiler.is_compiling():
        # Under Dynamo the region lowers to torch's checkpoint: [ Regions under torch.compile ].
        from ._compile import lower

        _checked_while_tracing(
            preserve_rng_state,
            context_fn,
            determinism_check,
            early_stop,
            debug,
            use_reentrant,
            policy,
        )
        return lower(
            function,
            args,
            kwargs,
            policy=policy,
            preserve_rng_state=preserve_rng_state,
            context_fn=context_fn,
        )
    if not callable(function):
        raise RematError(
            f"remat.checkpoint: expected a callable as first argument, got "
            f"{type(function).__name__}. Pass the function or module to run, then its inputs: "
            "remat.checkpoint(block, x)."
        )
    if policy is not None:
        _refuse_shadowed(function)
    options = _options(
        preserve_rng_state, context_fn, determinism_check, early_stop, debug, use_reentrant, policy
    )
    return run_region(function, args, kwargs, options)


def _early_stop(option: bool) -> bool:
    """The region's ``early_stop``, off inside ``torch.utils.checkpoint``'s
    ``set_checkpoint_early_stop(False)`` (code ported from torch's checkpoint turns it off
    there, so that the recompute runs the whole function, its hooks included)."""
    return (
        option
        and getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None) is not False
    )


def _refuse_shadowed(function: Callable[..., Any]) -> None:
    """Raise where ``policy=``, an option torch's checkpoint does not have, was given and
    ``function`` names a parameter so: ``torch.utils.checkpoint`` passes keywords it does not
    know on to the function, so code ported from it may mean the function's. (``early_stop=``
    is an option of torch's checkpoint too, which takes it as remat does.)"""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin: nothing to read
        return
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if "policy" in parameters and parameters["policy"].kind in named:
        raise RematError(
            "remat.checkpoint: policy= is an option of remat.checkpoint, and the function also "
            "takes a parameter 'policy' (torch.utils.checkpoint passes keywords it does not "
            "know on to the function). Pass the function's policy positionally or bind it "
            "with functools.partial(function, policy=...); remat's policy= then means remat's "
            "option."
        )


def run_region(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: RegionOptions,
    offload_inputs: bool = False,
    module_names: dict[int, str] | None = None,
    root: str = "",
) -> Any:
    """:func:`checkpoint` with validated options; ``offload_inputs`` keeps the region's inputs
    in host memory until backward."""
    if torch.compiler.is_compiling():
        from ._compile import lower

        return lower(
            function,
            args,
            kwargs,
            policy=options.policy,
            preserve_rng_state=options.preserve_rng_state,
            context_fn=options.context_fn,
            offload_inputs=offload_inputs,
            module=root,
        )
    if not torch.is_grad_enabled() or _state.state.disabled:
        return function(*args, **kwargs)
    _state.refuse_transforms("a checkpointed region")
    if _compiled(function):
        # See [ Compiled functions inside a region ] in _compile.py.
        from ._compile import CompiledRegion

        if options.policy is not None:
            raise RematError(
                "remat.checkpoint: a policy records the ATen ops a region runs in eager mode, "
                "and a compiled function hides them. Put the region inside the compiled code "
                "instead: torch.compile(remat.checkpoint_wrapper(block, policy=...)), or "
                "remat.checkpoint(block, x, policy=...) inside the compiled function."
            )
        function = CompiledRegion(function)
    if options.policy is not None:
        from .graph import recording

        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        with recording(options.policy, tensors, module_names, offload_inputs, root):
            return function(*args, **kwargs)

    forward_context, recompute_context = (
        _contexts(options.context_fn)
        if options.context_fn is not None
        else (contextlib.nullcontext(), contextlib.nullcontext())
    )
    frame = _Frame(
        recompute_context,
        early_stop=options.early_stop,
        check=options.determinism_check == "default",
        debug=options.debug,
    )
    call = _Call(function, args, kwargs, Ambient.capture(options.preserve_rng_state))
    return frame.run(call, args, kwargs, forward_context, offload_inputs)


def links(
    outputs: list[tuple[int, torch.Tensor, int]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[int | str, int]:
    """The arguments that are one of ``outputs`` (leaf index, tensor, its version when it was
    returned), the same object at the same version: argument key -> leaf index. See NOTE
    [ Linked calls ]."""
    by_id = {id(t): (i, version) for i, t, version in outputs}
    found: dict[int | str, int] = {}
    items: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    for key, v in items:
        known = by_id.get(id(v)) if isinstance(v, torch.Tensor) else None
        if known is not None and v._version == known[1]:
            found[key] = known[0]
    return found


@dataclass
class _Returned:
    """The last call of a chain, while the next call may link to it: its frame (weakly), its
    position, its output's tensor leaves (weakly, with their versions) and its generators as
    it left them."""

    frame: weakref.ref[_Frame]
    position: int
    leaves: list[tuple[int, weakref.ref[torch.Tensor], int]]
    generators: Generators | None

    def outputs(self) -> list[tuple[int, torch.Tensor, int]]:
        """The leaves still alive, for :func:`links`."""
        alive = [(i, ref(), version) for i, ref, version in self.leaves]
        return [(i, t, version) for i, t, version in alive if t is not None]


class LinkedCalls:
    """Consecutive calls of functions run as one region while each call's input is the previous
    call's output (see NOTE [ Linked calls ]).

    ``run(position, function, *args)`` runs the call at ``position`` (0 for the first of a
    chain); the call at ``position + 1`` links to it if it takes its output, and the chain ends
    after a call with ``last=True``. ``broken`` counts calls after the first that could not
    link and started a new region.
    """

    def __init__(self, options: RegionOptions | None = None) -> None:
        options = options or RegionOptions()
        if options.context_fn is not None or options.policy is not None:
            raise RematError(
                "remat: linked calls run on the region engine with one recompute context per "
                "chain; context_fn and policy are not supported. Drop them."
            )
        self.options = options
        self.broken = 0
        self._returned: _Returned | None = None  # the last call, while the next may link to it

    def run(
        self,
        position: int,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        last: bool = False,
    ) -> Any:
        """Call ``function(*args, **kwargs)`` as the ``position``-th call of a chain."""
        if torch.compiler.is_compiling():
            # Each call lowers to its own region: [ Regions under torch.compile ] 4.
            from ._compile import lower

            preserve = self.options.preserve_rng_state
            return lower(function, args, kwargs, policy=None, preserve_rng_state=preserve)
        returned, self._returned = self._returned, None
        frame = returned.frame() if returned is not None else None
        found: dict[int | str, int] = {}
        if returned is not None and frame is not None and position == returned.position + 1:
            found = links(returned.outputs(), args, kwargs)
        if not torch.is_grad_enabled() or _state.state.disabled:
            return function(*args, **kwargs)
        _state.refuse_transforms("a checkpointed region")
        # A previous call whose frame is gone saved nothing (a frozen block fed an input that
        # needs no gradient): there is nothing to link to, and nothing broke.
        gone = returned is not None and frame is None and position == returned.position + 1
        if position > 0 and not found and not gone:
            self.broken += 1
        if frame is None or not found:
            frame = _Frame(
                contextlib.nullcontext(),
                early_stop=self.options.early_stop,
                check=self.options.determinism_check == "default",
                debug=self.options.debug,
            )
        preserve = self.options.preserve_rng_state
        generators = Generators.capture() if preserve else None
        ended = returned.generators if returned is not None else None
        continues = False  # generators as the previous call left them: its replay leaves them so
        if found and generators is not None and ended is not None:
            continues = generators.same(ended)
        ambient = Ambient.capture(preserve, generators, continues)
        call = _Call(function, args, kwargs, ambient, found)
        out = frame.run(call, args, kwargs, _NO_CONTEXT, offload_inputs=False)
        if not last:
            leaves = enumerate(pytree.tree_leaves(out))
            self._returned = _Returned(
                weakref.ref(frame),
                position,
                [(i, weakref.ref(v), v._version) for i, v in leaves if isinstance(v, torch.Tensor)],
                Generators.capture() if preserve else None,
            )
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> LinkedCalls:
        return LinkedCalls(self.options)  # a copy shares no open chain

    def __getstate__(self) -> dict[str, Any]:
        # Nor does a pickle: a forward that stopped inside the chain (an early exit) leaves
        # its last call open, held by weak references, which do not pickle.
        return {**self.__dict__, "_returned": None}


def _drop_hooks_since(first: int, tensors: list[torch.Tensor]) -> None:
    """Remove the tensor hooks a recompute registered, from handle id ``first`` on, on
    ``tensors``, which outlive it (the region's inputs, the parameters it reached). A
    forward that registers a hook on one (``weight.register_hook(scale)``) registers it again
    when it runs as a recompute, and the hook would fire twice in this backward; hooks on
    the recompute's own results never fire (backward runs the forward pass's graph)."""
    for t in tensors:
        for hooks in (t._backward_hooks, t._post_accumulate_grad_hooks):
            if hooks:
                for key in [k for k in hooks if k >= first]:
                    del hooks[key]


def _alive(refs: list[weakref.ref[torch.Tensor]] | None) -> list[torch.Tensor]:
    return [t for ref in refs or () if (t := ref()) is not None]


def _uninitialized(modules: list[nn.Module]) -> RematError:
    lazy = {
        type(m).__name__
        for m in modules
        for t in (*m._parameters.values(), *m._buffers.values())
        if t is not None and is_lazy(t)
    }
    names = ", ".join(sorted(lazy)) or "a lazy tensor"
    return RematError(
        f"remat: a checkpointed region reaches a lazy module ({names}) whose parameters are "
        "not made yet. Its first forward pass makes them and draws their initial values, "
        "which a recompute cannot repeat. Run one forward pass first, under torch.no_grad() "
        "(where regions run plainly), as lazy modules need before an optimizer is built "
        "anyway."
    )


def _stale_read(t: torch.Tensor, reads: Reads | None) -> CheckpointError:
    what = reads.describe(t) if reads is not None else f"a tensor of shape {tuple(t.shape)}"
    return CheckpointError(
        f"remat: the recompute of a checkpointed region read {what} before writing it, as its "
        "forward pass did, but could not start from the value the forward pass read: the "
        "forward pass wrote it afterwards, and remat took no snapshot of the region's state (it "
        f"snapshots at most {UNDO_LIMIT} bytes, for regions seen to read state they write). "
        "The recompute would build other activations and the gradients would be wrong. Keep "
        "the module that reads and updates this state outside the checkpointed region."
    )


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among ``args`` and ``kwargs``, and those nested in them."""
    leaves = pytree.tree_leaves((args, kwargs))
    return [v for v in leaves if isinstance(v, torch.Tensor)]


def _compiled(function: Any) -> bool:
    """Whether ``function`` came from ``torch.compile`` (Dynamo is imported only if used)."""
    if "torch._dynamo" not in sys.modules:
        return False
    from ._compile import is_compiled

    return is_compiled(function)


class SavedInputs:
    """A region's tensor inputs, saved through autograd so that an enclosing region manages
    them (Rule 2 of [ Nested regions ]).

    It holds the saver's output, not only its ``grad_fn``: torch 2.11 frees a custom Function's
    saved tensors once its output is gone, even while the ``grad_fn`` object is referenced
    (torch 2.13 keeps them)."""

    __slots__ = ("_out",)

    def __init__(self, out: torch.Tensor) -> None:
        self._out = out

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        node: Any = self._out.grad_fn
        try:
            saved = node.saved_tensors
        except RuntimeError as error:  # autograd's version check
            if "modified by an inplace operation" not in str(error):
                raise
            raise CheckpointError(
                "remat: an input of a checkpointed region was modified by an inplace operation "
                "after the region saved it: inside the region (x.add_(1), an activation with "
                "inplace=True on the input), or by the caller before backward. The recompute "
                "starts from the inputs as the region got them, and that value is gone. Pass "
                "the region a copy (x.clone()) or write a new tensor instead (x = x + 1). "
                f"Autograd said: {error}"
            ) from None
        held = node.inference
        if not held:
            return tuple(saved)
        return tuple(held.get(i, t) for i, t in enumerate(saved))


def save_inputs(tensors: list[torch.Tensor], offload: bool) -> SavedInputs:
    """Save a region's tensor inputs through autograd (see :class:`SavedInputs`). With
    ``offload``, those on an accelerator wait in the host tier (see NOTE [ Life of an offloaded
    tensor ])."""
    dummy = torch.empty(0, requires_grad=True)
    _state.state.saving_region_inputs = True
    try:
        with offload_hooks("host") if offload else contextlib.nullcontext():
            out: torch.Tensor = _SaveInputs.apply(dummy, *tensors)  # type: ignore[no-untyped-call]
    finally:
        _state.state.saving_region_inputs = False
    return SavedInputs(out)
