"""Keep a recompute from writing to tensors that outlive it.

NOTE [ State mutates once ]

A region's forward pass may write to tensors that live outside it: BatchNorm and InstanceNorm
update ``running_mean``, ``running_var`` and ``num_batches_tracked``, a module may count its
calls in a buffer, a function may ``copy_`` into a cache. Re-running the region in backward
would apply those writes a second time; PyTorch's own checkpoint does (pytorch/pytorch#96136).

:class:`WriteGuard` is a ``TorchDispatchMode`` active only during a recompute. It tells tensors
apart by storage:

1. A storage is *fresh* when an operator run under the guard created it (a result that is not
   an alias of an argument, see ``_aten.OpInfo.fresh``). Views of it share the storage and are
   fresh too.
2. Every other storage is *external*: region inputs, parameters, buffers, globals.
3. An operator that writes an external tensor runs on a copy of it instead. The copy receives
   the write and is dropped; the external tensor keeps the value the forward pass left.

So no class needs a special case: whatever the region wrote in forward, in whatever module, is
written exactly once. The one blind spot: a storage created without any ATen operator (e.g.
``torch.from_numpy`` of an array made inside the region) counts as external, so writes to it
during the recompute are not applied.

NOTE [ When the guard runs ]

The guard is a dispatch mode: it costs Python on every operator of the recompute, as much as the
kernels of a transformer block of small tensors. Most regions write nothing that outlives them,
and their recompute needs no guard. A region's recompute runs unguarded when all three hold:

1. *The cheap check saw no write.* :class:`Reachable` lists the tensors the region can reach
   before its forward pass runs: its tensor arguments and the tensors nested in its other
   arguments; the parameters, buffers and tensor attributes (plain or in a list, tuple or dict)
   of every module among its arguments, the function itself, the ``self`` of a bound method,
   the arguments of a ``functools.partial``, closure cells and default arguments; the tensors
   and modules among the globals the function's code (and each such module's ``forward``)
   loads, in its body or in code it defines (a comprehension, a lambda); and the tensors in
   lists, tuples and dicts in any of those places. Every ATen write to a tensor, through any
   view or ``detach()`` alias of it, bumps the version counter they share; so the region
   wrote one of them exactly when one of their versions differs after its forward pass.
   Fresh tensors the region made itself are not listed: writing them again in the recompute
   is what the recompute is for. (``t.data`` is an alias with a counter of its own: a write
   through it is one of the hidden writes of 2.)
2. *The function showed no hidden write.* A tensor reached another way (an attribute of a
   plain object, a global that a helper function writes, a write through ``.data``) is
   invisible to 1. So the first recompute of each function (the module, for a module or its
   bound method) and of each module among the arguments runs guarded anyway, and if the guard
   redirects a write that 1 did not see, they are guarded in every later recompute. A write
   hidden from 1 is thus never applied twice by a function whose first recompute showed it;
   a function that hides a write only on some later call (a data-dependent branch) is the
   case left open, which ``remat.is_recomputing()`` closes.
3. *The recompute wrote none of the listed tensors either* (checked after it; a recompute that
   writes where its forward did not diverged, and raises). The list is the forward pass's, held
   weakly until the recompute, with the recompute's own arguments added: what a region reaches
   is walked once per call, not twice.

Checking 1 costs one version read per listed tensor per forward pass (a dozen for a transformer
block), against one Python call per operator of the recompute that it saves.

A guarded recompute is not always the program the forward pass ran: under a Python dispatch
mode, composite ops that test for tensor subclasses take their subclass path (``F.ctc_loss``
keeps its length tensors as tensors, and saves other tensors). A first recompute whose saved
tensors differ from the forward's, and which showed that the function writes nothing (so
none of 1-3 needs the guard from then on), runs again unguarded, as every later recompute
will, and the determinism check applies to that run (``_Frame._recompute``).

NOTE [ Writes undone ]

A region that does write state it reaches (a block with BatchNorm writes its running statistics
in every training step) would need the guard in every recompute. It does not when the guard's
effect can be had after the fact: let the recompute write the state, then put back what it
overwrote. That gives what the guard gives when

4. *the recompute writes only state it reaches and can put back*: tensors that 1 lists, need no
   gradient and share no storage with the region's inputs, holding at most ``UNDO_LIMIT``
   bytes in all. :class:`Undo` copies all of them (whether the forward pass was seen to write
   them or not: BatchNorm's kernels write ``running_mean`` and ``running_var`` without bumping
   their version counters, only ``num_batches_tracked`` shows the write) before the recompute
   and copies them back after it, whether it ran to the end, stopped early or raised, and sets
   their version counters back, so that autograd's check of a tensor saved after the forward
   pass's write still passes and nothing after the step can tell the recompute ran;
5. *it reads no state after writing it*, or it starts from a snapshot (see [ State read,
   then written ]). Under the guard an op that reads a written tensor sees the value the
   forward pass left; once the write has landed it would see the written one. A guarded
   recompute notes every op that takes an argument whose storage an earlier op of the same
   recompute wrote (``WriteGuard.reread``; a second write counts). BatchNorm with a
   ``momentum`` passes: ``num_batches_tracked`` is written and never read.

Both are learnt as 2 is: from the guarded first recompute of the function (and of each module
among its arguments) whose forward pass wrote, which notes writes outside the state of 4
(``WriteGuard.hidden``) and reads after writes. The case left open is the one 2 leaves: a
function that does either only on some later call, which ``remat.is_recomputing()`` closes.
The cost is two copies of the state per recompute (BatchNorm's: three small tensors), each one
foreach copy per device.

NOTE [ State read, then written ]

A region may read state and then update it in the same forward pass: a running normaliser
subtracts ``self.mean`` and then moves it, an EMA codebook quantises with ``self.codebook``
and then updates it, a block scales by ``self.step`` and then counts the step, BatchNorm with
``momentum=None`` divides by the count it has just incremented. By backward the forward
pass's write has landed, so a recompute that reads the live state builds other activations
than the forward pass did, and the gradients are wrong with no error (torch's checkpoint
does this). Neither the guard nor an undo helps: both start the recompute from the state as
the forward pass left it.

So the recompute starts from the state as the forward pass found it:

1. *Snapshot.* A forward pass keyed like [ When the guard runs ] 2 copies the state it
   reaches (the tensors of [ Writes undone ] 4, at most ``UNDO_LIMIT`` bytes) before it runs,
   when the function has not had a guarded recompute yet or one showed it reading state that
   the region writes. The copy is an :class:`Undo`, held by the call until its recompute.
2. *Replay.* The recompute copies the live state (another ``Undo``), loads the snapshot, runs
   with its writes landing on the state (the guard, when it runs, redirects only writes
   outside the state), and puts the live state and its versions back. Every read, before or
   after a write, sees what the forward pass saw, and the state ends as it was.
3. *Learning.* A guarded recompute notes the storages it reads (arguments an op does not
   write; view ops read no values, the ops on the view do) and those written, by the forward
   pass (its versions moved) or by the recompute itself. A storage both read and written sets
   ``WriteGuard.reads_written``, and the function's later forward passes snapshot. Without a
   snapshot (state over ``UNDO_LIMIT``, or the data-dependent case that 2 of [ When the guard
   runs ] leaves open), a read before the write is ``WriteGuard.stale`` and the recompute
   raises rather than build other activations.

The guarded recompute also gives ``_reads.Reads`` the tensors it read (``WriteGuard.read``),
so that a buffer written in place between forward and backward by something outside the
region raises, as plain autograd does for the tensors it saved. The cost falls on the
functions that write state: a BatchNorm block with a ``momentum`` snapshots once, in its first
forward pass; one that reads its state back, in every forward pass.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._ambient import GeneratorStates, generator_key, is_default_generator
from ._aten import OpInfo, copy_with_layout, op_info
from ._aten import storage_key as _storage_key
from ._dispatch import EagerMode

__all__: list[str] = []

# What every module's ``__dict__`` holds besides its own attributes: no tensors but those of
# ``_parameters`` and ``_buffers``, which ``_visit_module`` reads directly.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


# Where a walk records what it finds: tensors by id, the modules and functions walked by id, and
# the generators by the C++ generator they wrap (one generator may have several Python objects).
_Found = dict[int, torch.Tensor]
_Seen = dict[int, Any]
_Generators = dict[int, torch.Generator]


class Reachable:
    """The tensors a region can reach and their versions; see [ When the guard runs ] 1.

    ``own``: the tensors the function itself reaches, as :meth:`own_refs` of an earlier
    ``Reachable`` of the same function returned them; the function is not walked again. A
    recompute checks what its forward pass listed ([ When the guard runs ] 3): one walk per
    region call instead of two.
    """

    __slots__ = ("generators", "n_own", "tensors", "versions", "walked")

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: Any,
        own: list[weakref.ref[torch.Tensor]] | None = None,
    ) -> None:
        found: _Found = {}
        seen: _Seen = {}
        generators: _Generators = {}
        if own is None:
            _visit_function(function, found, seen, generators)
        else:
            for ref in own:
                t = ref()
                if t is not None:  # a tensor that died cannot be written
                    found[id(t)] = t
        self.n_own = len(found)
        for value in args:
            _visit(value, found, seen, generators, 2)
        for value in kwargs.values():
            _visit(value, found, seen, generators, 2)
        self.tensors = list(found.values())
        try:
            self.versions = [t._version for t in self.tensors]
        except RuntimeError:  # an inference tensor: see ``_without_inference``
            self._without_inference()
        # The ``torch.Generator`` objects found in the same places, but PyTorch's default
        # ones, which ``_ambient`` replays: see [ Explicit generators ] in _ambient.py.
        self.generators = [g for g in generators.values() if not is_default_generator(g)]
        # The modules and functions walked (the function's own only when ``own`` is None), by
        # id: ``_reads.Reads`` notes the modules' state after a forward pass.
        self.walked = seen

    def _without_inference(self) -> None:
        """Leave out the tensors made under ``torch.inference_mode`` (a table, a buffer): they
        have no version counter, and nothing outside inference mode can write them."""
        own = [t for t in self.tensors[: self.n_own] if not t.is_inference()]
        rest = [t for t in self.tensors[self.n_own :] if not t.is_inference()]
        self.n_own, self.tensors = len(own), own + rest
        self.versions = [t._version for t in self.tensors]

    def own_refs(self) -> list[weakref.ref[torch.Tensor]]:
        """Weak references to the tensors the function reaches (not through its arguments):
        held from a forward pass to its recompute, they keep nothing alive."""
        return [weakref.ref(t) for t in self.tensors[: self.n_own]]

    def written(self) -> bool:
        """Whether any listed tensor was written since this object was made."""
        return any(t._version != v for t, v in zip(self.tensors, self.versions, strict=True))

    def changed(self) -> list[torch.Tensor]:
        """The listed tensors written since this object was made."""
        return [t for t, v in zip(self.tensors, self.versions, strict=True) if t._version != v]


def generators_in(*values: Any) -> list[torch.Generator]:
    """The explicit generators that ``values`` reach, found as :class:`Reachable` finds them
    (see [ Explicit generators ] in _ambient.py)."""
    found: _Found = {}
    seen: _Seen = {}
    generators: _Generators = {}
    for value in values:
        _visit(value, found, seen, generators, 2)
    return [g for g in generators.values() if not is_default_generator(g)]


def _visit(value: Any, found: _Found, seen: _Seen, generators: _Generators, depth: int) -> None:
    """Record the tensors in ``value``: itself, the modules' state, containers ``depth`` deep;
    and the generators in the same places."""
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, nn.Module):
        _visit_module(value, found, seen, generators)
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            _visit(item, found, seen, generators, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            _visit(item, found, seen, generators, depth - 1)
    elif type(value) is torch.Generator:  # ``isinstance`` runs a metaclass hook: slow
        generators[generator_key(value)] = value


def _visit_module(root: nn.Module, found: _Found, seen: _Seen, generators: _Generators) -> None:
    """Parameters, buffers and tensor attributes of ``root`` and its submodules, and what their
    ``forward`` functions reach."""
    stack = [root]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen[id(module)] = module
        state = module.__dict__
        for t in state["_parameters"].values():
            if t is not None:
                found[id(t)] = t
        for t in state["_buffers"].values():
            if t is not None:
                found[id(t)] = t
        stack.extend(m for m in state["_modules"].values() if m is not None)
        if len(state) > len(_MODULE_INTERNALS):  # else it holds nothing but the internals
            for name in state.keys() - _MODULE_INTERNALS:
                attribute = state[name]
                if (
                    isinstance(attribute, (torch.Tensor, list, tuple, dict))
                    or type(attribute) is torch.Generator
                ):
                    _visit(attribute, found, seen, generators, 1)
        _visit_code(type(module).forward, found, seen, generators)


def _visit_function(function: Any, found: _Found, seen: _Seen, generators: _Generators) -> None:
    if isinstance(function, functools.partial):
        for value in (*function.args, *function.keywords.values()):
            _visit(value, found, seen, generators, 2)
        function = function.func
    if isinstance(function, types.MethodType):
        _visit(function.__self__, found, seen, generators, 2)
        function = function.__func__
    if isinstance(function, nn.Module):
        _visit_module(function, found, seen, generators)
    else:
        _visit_code(function, found, seen, generators)


def _visit_code(function: Any, found: _Found, seen: _Seen, generators: _Generators) -> None:
    """The tensors a Python function's closure and defaults hold, and the tensors, modules and
    generators its code names as globals (global containers are left to [ When the guard
    runs ] 2)."""
    if type(function) is not types.FunctionType or id(function) in seen:
        return
    seen[id(function)] = function
    for cell in function.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell raises
            _visit(cell.cell_contents, found, seen, generators, 2)
    for value in function.__defaults__ or ():
        _visit(value, found, seen, generators, 2)
    names = function.__globals__
    for name in _global_names(function.__code__):
        value = names.get(name)
        if isinstance(value, (torch.Tensor, nn.Module)) or type(value) is torch.Generator:
            _visit(value, found, seen, generators, 0)


# Code object id -> (the code object, kept alive so that its id is not reused; the names it
# loads as globals).
_GLOBALS_OF: dict[int, tuple[types.CodeType, tuple[str, ...]]] = {}
_GLOBALS_OF_LIMIT = 4096  # code objects remembered; past it, the table starts again


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` loads as globals, in its own body and in the code it defines
    (comprehensions, lambdas, nested functions). A code object never changes, so neither
    does the answer; attribute and method names, which ``co_names`` holds too, are left out."""
    entry = _GLOBALS_OF.get(id(code))
    if entry is not None and entry[0] is code:
        return entry[1]
    names: dict[str, None] = {}
    stack = [code]
    while stack:
        current = stack.pop()
        for instruction in dis.get_instructions(current):
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                names[instruction.argval] = None
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    if len(_GLOBALS_OF) >= _GLOBALS_OF_LIMIT:
        _GLOBALS_OF.clear()
    _GLOBALS_OF[id(code)] = (code, tuple(names))
    return tuple(names)


# Functions and modules whose first recompute ran guarded: ``True`` if the guard redirected a
# write that ``Reachable`` did not see (see [ When the guard runs ] 2).
_verified: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
# Functions and modules whose recomputes may write and be undone: ``True`` while every guarded
# recompute of a forward pass that wrote showed only undoable writes (see [ Writes undone ]).
_undoable: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
# Functions and modules whose guarded recomputes read state that the region writes: ``True``
# once one did (see [ State read, then written ]); absent until one ran.
_reads_written: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def identities(function: Any, args: tuple[Any, ...]) -> list[Any]:
    """What [ When the guard runs ] 2 keys a region on: its function (the module, for a module
    or its bound method; the function inside a ``functools.partial``) and the modules among its
    arguments and the partial's; ``None`` for what cannot be referenced weakly."""
    bound: list[Any] = []
    while isinstance(function, functools.partial):
        bound.extend((*function.args, *function.keywords.values()))
        function = function.func
    if isinstance(function, types.MethodType) and isinstance(function.__self__, nn.Module):
        function = function.__self__
    keys = [function]
    for value in (*bound, *args):
        if isinstance(value, (list, tuple)):
            keys.extend(v for v in value if isinstance(v, nn.Module))
        elif isinstance(value, nn.Module):
            keys.append(value)
    return [k if _weakly_referenceable(k) else None for k in keys]


def _weakly_referenceable(value: Any) -> bool:
    try:
        weakref.ref(value)
    except TypeError:
        return False
    return True


def needs_guard(keys: list[Any]) -> bool:
    """Whether a recompute keyed ``keys`` runs guarded though its forward pass wrote nothing it
    reaches: one of them was never recomputed guarded, or hid a write before."""
    return any(key is None or _verified.get(key, True) for key in keys)


def verified(keys: list[Any], hid_write: bool) -> None:
    """Remember what a guarded recompute keyed ``keys`` showed."""
    for key in keys:
        if key is not None:
            _verified[key] = _verified.get(key, False) or hid_write


def wants_snapshot(keys: list[Any]) -> bool:
    """Whether a forward pass keyed ``keys`` snapshots the state it reaches ([ State read,
    then written ]): one of them was never recomputed guarded, or read state it writes."""
    return any(key is None or _reads_written.get(key, True) for key in keys)


def may_undo(keys: list[Any]) -> bool:
    """Whether a recompute keyed ``keys`` may write and have its writes undone: guarded
    recomputes showed that it is safe ([ Writes undone ] 4 and 5)."""
    return all(key is not None and _undoable.get(key, False) for key in keys)


def learned_undo(keys: list[Any], guard: WriteGuard) -> None:
    """Remember whether a guarded recompute keyed ``keys``, whose forward pass wrote, showed
    writes that can be undone: to its state only, and none read back unless the writes
    landed on the snapshot of [ State read, then written ]."""
    ok = guard.hidden == 0 and (guard.lands or not guard.reread)
    for key in keys:
        if key is not None:
            _undoable[key] = _undoable.get(key, True) and ok


def learned_reads(keys: list[Any], guard: WriteGuard) -> None:
    """Remember whether a guarded recompute keyed ``keys`` read state that the region writes
    ([ State read, then written ])."""
    for key in keys:
        if key is not None:
            _reads_written[key] = _reads_written.get(key, False) or guard.reads_written


def _state(tensors: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The ``tensors`` a recompute could write and undo ([ Writes undone ] 4): those that need
    no gradient and have a plain storage that none of ``inputs`` shares."""
    arguments = {_storage_key(t) for t in inputs}
    return [
        t
        for t in tensors
        if not t.requires_grad and (key := _storage_key(t)) is not None and key not in arguments
    ]


def undoable(written: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    """Whether the forward pass's ``written`` tensors can be undone ([ Writes undone ] 4)."""
    return _set_versions is not None and len(_state(written, inputs)) == len(written)


UNDO_LIMIT = 1 << 20  # the most bytes of state a recompute copies to undo its writes


def undo_state(reach: Reachable, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The state a recompute may write and have undone: the tensors of :func:`_state` among
    those ``reach`` lists; ``None`` when their storages hold more than :data:`UNDO_LIMIT`
    bytes."""
    state = _state(reach.tensors, inputs)
    sizes = {_storage_key(t): t.untyped_storage().nbytes() for t in state}
    return state if sum(sizes.values()) <= UNDO_LIMIT else None


class Undo:
    """Copies of the storages of ``tensors`` and their versions, put back by :meth:`close`."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.versions = [t._version for t in tensors]
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            storage = t.untyped_storage()
            storages.setdefault(int(storage._cdata), storage)
        # Each storage as a byte tensor, copied by operators: a storage's own ``clone``
        # allocates outside any operator, where ``remat.MemoryTracker`` cannot see it.
        self.wholes = [
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            for storage in storages.values()
        ]
        self.copies = _copied(self.wholes)

    def load(self) -> None:
        """Put the copied values back in the storages, leaving the versions as they are."""
        if self.wholes:
            with torch.no_grad():
                torch._foreach_copy_(self.wholes, self.copies)

    def close(self) -> None:
        """Put the copied values and versions back."""
        self.load()
        assert _set_versions is not None  # see ``undoable``
        _set_versions(self.tensors, self.versions)


def _copied(wholes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the byte tensors ``wholes``: views of one allocation per device, filled by
    one foreach copy. A BatchNorm block's state is six small storages, and on a GPU a launch
    per storage to copy it, and another to put it back, were most of what its undo cost."""
    slots: dict[torch.device, list[int]] = {}
    for i, whole in enumerate(wholes):
        slots.setdefault(whole.device, []).append(i)
    copies: list[torch.Tensor] = list(wholes)
    for device, indices in slots.items():
        sizes = [wholes[i].numel() for i in indices]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        views = torch.split(flat, sizes)
        torch._foreach_copy_(list(views), [wholes[i] for i in indices])
        for i, view in zip(indices, views, strict=True):
            copies[i] = view
    return copies


def _version_setter() -> Callable[[list[torch.Tensor], list[int]], None] | None:
    """Sets tensors' version counters: ``torch._C._autograd._unsafe_set_version_counter``,
    which takes sequences since torch 2.5 and one tensor before; ``None`` where it is missing."""
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:
        return None
    probe = torch.zeros(())
    try:
        setter((probe,), (0,))
    except TypeError:

        def one_by_one(tensors: list[torch.Tensor], versions: list[int]) -> None:
            for t, v in zip(tensors, versions, strict=True):
                setter(t, v)

        return one_by_one

    def all_at_once(tensors: list[torch.Tensor], versions: list[int]) -> None:
        setter(tuple(tensors), tuple(versions))

    return all_at_once


_set_versions = _version_setter()


class WriteGuard(EagerMode):
    """Redirect writes to external tensors onto throwaway copies; see [ State mutates once ].

    ``generators``: the explicit generators the recompute replays (with their states); a
    random op that draws from another one (not a default generator) is noted in ``unlisted``
    ([ Explicit generators ] 3 in _ambient.py). ``None``: nothing is replayed, and the first
    random op of the recompute is noted in ``drew`` ([ Random ops not replayed ] there).

    ``lands``: writes to the storages of ``expected`` land instead of going to copies (an
    ``Undo`` puts them back after the recompute, which started from the forward pass's
    snapshot: [ State read, then written ]). ``state``: the tensors the region reaches, and
    ``written``: those the forward pass was seen to write. Reads of their storages that the
    forward pass or the recompute also writes set ``reads_written``; a read before the write
    is noted in ``stale``, unless writes land."""

    def __init__(
        self,
        expected: list[torch.Tensor] | None = None,
        generators: GeneratorStates | None = None,
        *,
        lands: bool = False,
        state: list[torch.Tensor] | None = None,
        written: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.lands = lands
        self._written_before = {_storage_key(t) for t in written or ()} - {None}
        self._state = {_storage_key(t) for t in (*(state or ()), *(written or ()))} - {None}
        self.reads_written = False
        self.stale: torch.Tensor | None = None
        self.landed = 0
        # External storages read before this recompute wrote them, with the tensor read.
        self._read_unwritten: dict[int, torch.Tensor] = {}
        self._listed = None if generators is None else {generator_key(g) for g, _ in generators}
        self.unlisted: torch.Generator | None = None
        self.drew: torch._ops.OpOverload | None = None
        self._fresh: set[int] = set()
        self.redirected = 0
        # The storages a write may go to and be undone (``None``: not known), the writes to
        # others (``hidden``), and whether an op read a storage an earlier op wrote.
        self._expected = None if expected is None else {_storage_key(t) for t in expected} - {None}
        self.hidden = 0
        self._written: set[int] = set()
        self.reread = False
        # The ids of the tensors the ops took as arguments they do not write: what
        # ``_reads.Reads.learn`` keeps of the state the region reads.
        self.read: set[int] = set()
        # Autograd bumps the version of a tensor an op writes, even though the write went to a
        # copy: the versions to set back on exit, so that the recompute leaves none changed.
        self._versions: dict[int, tuple[torch.Tensor, int]] = {}

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        # Storages read before being written, by the forward pass or later in the recompute:
        # the forward pass read them before its write landed ([ State read, then written ]).
        stale = self._read_unwritten.keys() & (self._written | self._written_before) & self._state
        if stale:
            self.reads_written = True
            if not self.lands:
                self.stale = self._read_unwritten[min(stale)]
        if self._versions and _set_versions is not None:
            tensors, versions = zip(*self._versions.values(), strict=True)
            _set_versions(list(tensors), list(versions))

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        info = op_info(func)
        generator, listed = kwargs.get("generator"), self._listed
        if generator is not None and listed is not None:
            self._note_generator(generator, listed)
        elif listed is None and info.random and self.drew is None:
            self.drew = func
        if self._written and not self.reread:
            self.reread = any(self._storage_written(v) for v in (*args, *kwargs.values()))
        self._note_reads(info, args, kwargs)
        if info.writes:
            args, kwargs = self._redirect(info.writes, args, kwargs)
        out = func(*args, **kwargs)
        if info.any_fresh:
            if type(out) is torch.Tensor:
                key = _storage_key(out)
                if key is not None:
                    self._fresh.add(key)
            else:
                self._register(out, info.fresh)
        return out

    def _note_generator(self, generator: torch.Generator, listed: set[int]) -> None:
        if (
            self.unlisted is None
            and generator_key(generator) not in listed
            and not is_default_generator(generator)
        ):
            self.unlisted = generator

    def _note_reads(self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The written arguments, by position and name; most ops write none.
        skip = {key for write in info.writes for key in write} if info.writes else ()
        tensors: list[torch.Tensor] = []
        for items in (enumerate(args), kwargs.items()):
            for where, value in items:
                if isinstance(value, torch.Tensor):
                    if where not in skip:
                        tensors.append(value)
                elif isinstance(value, (list, tuple)) and where not in skip:
                    tensors.extend(v for v in value if isinstance(v, torch.Tensor))
        self.read.update(map(id, tensors))
        if info.view_of is not None:  # a view reads no values: the ops on it do
            return
        for t in tensors:
            key = _storage_key(t)
            if key is not None and key not in self._fresh:
                if key in self._written and key in self._state:
                    self.reads_written = True
                else:
                    self._read_unwritten.setdefault(key, t)

    def _is_external(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        key = _storage_key(value)
        return key is not None and key not in self._fresh

    def _redirect(
        self, writes: tuple[tuple[int, str], ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        new_args: list[Any] | None = None
        for position, name in writes:
            if position < len(args):
                value = args[position]
                if self._is_external(value) and not self._landed(value):
                    if new_args is None:
                        new_args = list(args)
                    new_args[position] = self._copy(value)
            elif (
                name in kwargs
                and self._is_external(kwargs[name])
                and not self._landed(kwargs[name])
            ):
                kwargs = {**kwargs, name: self._copy(kwargs[name])}
        return (tuple(new_args) if new_args is not None else args), kwargs

    def _landed(self, t: torch.Tensor) -> bool:
        """Whether a write to ``t`` lands (see ``lands``), noted as written if so."""
        if not self.lands:
            return False
        key = _storage_key(t)
        if key is None or self._expected is None or key not in self._expected:
            return False
        self._written.add(key)
        self.landed += 1
        return True

    def _storage_written(self, value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return any(self._storage_written(v) for v in value)
        return isinstance(value, torch.Tensor) and _storage_key(value) in self._written

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        self.redirected += 1
        self._versions.setdefault(id(t), (t, t._version))
        key = _storage_key(t)
        if key is not None:
            self._written.add(key)
        if self._expected is not None and key not in self._expected:
            self.hidden += 1
        copy = copy_with_layout(t)
        key = _storage_key(copy)
        if key is not None:
            self._fresh.add(key)
        return copy

    def _register(self, out: Any, fresh: tuple[bool, ...]) -> None:
        results = out if isinstance(out, (tuple, list)) and len(fresh) != 1 else (out,)
        for result, is_fresh in zip(results, fresh, strict=False):
            if not is_fresh:
                continue
            for t in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(t, torch.Tensor):
                    key = _storage_key(t)
                    if key is not None:
                        self._fresh.add(key)
