"""The graph engine: record a region's ATen ops, replay only what backward needs.

In forward, a ``TorchDispatchMode`` records each operator of the region as a node: the op, its
arguments as references to earlier node results, region inputs or constants, the module it ran
in, and, for random ops, the generator state it consumed. A policy decides per op whether its
result is kept. Autograd's saved tensors are packed as references to node results; in backward,
unpacking one replays the smallest set of recorded ops it depends on, never the Python around
them, and intermediates live only while a pending saved tensor still needs them. The design
follows the op-graph checkpointing note behind ``references/graph-based-ac.txt``.

NOTE [ Replay identity ]

A tensor seen in forward is identified by its TensorImpl and its version counter:

1. an op's new result gets a reference ``Ref(node, k)`` at the version it was created with;
2. an op that writes a tensor in place (``bernoulli_``, ``div_``, ``out=``) produces a new
   state of it: the tensor's reference becomes ``Ref(write_node, ("w", position))`` at the new
   version, and the write node takes the old state as its argument;
3. a tensor read at another version than the one its reference was made at (it was written
   through a view or another alias since) is *stale*: it cannot be rebuilt from its reference,
   so it is held as it is, and copied before any later write to its storage reaches it;
4. a tensor made outside the region is *external*: region inputs come back through the
   region's saved inputs (Rule 2 of the nesting note in ``checkpoint.py``); others
   (parameters, captured tensors) are held, and their version is checked when replayed;
5. an op that writes an external tensor (BatchNorm statistics) runs on a snapshot of it taken
   in forward, in forward state, so a replay never writes live tensors and reads what the op
   read then.

NOTE [ Life of a replayed tensor ]

1. forward: a node whose decision is *save* keeps its results; others keep none.
2. region exit: kept results that no saved tensor can reach are dropped.
3. first unpack in a backward (graph task ``g``): the cone of every saved tensor still alive is
   computed, with a use count per result: one per consuming node in the cone, one per slot.
4. unpack of slot ``s``: the missing part of its cone is replayed in recording order; each
   result is cached while its use count is positive and dropped when it reaches zero; the
   slot's tensor is handed to autograd and its count decremented.
5. a backward that never asks for a slot leaves nothing cached: the counts belong to ``g``,
   and go when ``g`` ends.
6. random ops replay with the generator state they drew from. Of consecutive random ops that
   a replay runs, only the first keeps its state (5,056 bytes for the CPU generator, as much as
   a region of ``torch.utils.checkpoint`` keeps); each later one starts where the one before it
   left the generator, so it is replayed after that one.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import _state
from ._aten import cached_op_info, op_info
from .errors import CheckpointError, RematError
from .policies import Decision, OpContext, as_decision, must_save_reason, resolve

__all__: list[str] = []

# A result index; ("w", position) for a written argument; ("l", index, item) in a list result.
Key = int | tuple[str, int] | tuple[str, int, int]


class Ref(NamedTuple):
    """A tensor state in the recorded graph: result ``key`` of node ``node``."""

    node: int
    key: Key


@dataclass(frozen=True)
class _Input:
    index: int  # position among the region's tensor inputs


@dataclass
class _External:
    """A tensor from outside the region, held; its version is checked at replay. When the
    region later writes it in place, ``snapshot`` holds the state this read saw."""

    tensor: torch.Tensor
    version: int
    snapshot: torch.Tensor | None = None


@dataclass(frozen=True)
class _Meta:
    """A tensor argument an op reads only for its metadata (``empty_like(x)``): replayed as a
    meta-device tensor with the same shape, strides and dtype, so the cone stops here."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def stand_in(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")


# Ops that read their first tensor argument for its metadata only.
_METADATA_ONLY = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)


@dataclass
class _Held:
    """A tensor held by reference (stale read or kept result); copied before it is written."""

    tensor: torch.Tensor


@dataclass
class Node:
    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    module: str
    decision: Decision
    writes: tuple[tuple[int, str], ...]
    # (generator, state before the op) for a random op; the state is None when the op follows
    # another random op of the replay, ``after``, and starts where that one left the generator.
    rng: list[tuple[Any, torch.Tensor | None]] | None = None
    after: int | None = None
    feeds: bool = False  # a later random op starts where this one leaves the generator
    kept: dict[Key, _Held] = field(default_factory=dict)
    refs: tuple[Ref, ...] = ()  # every reference among the arguments, repeats included


class _Packed:
    """What autograd holds for one tensor saved in a graph region."""

    __slots__ = ("__weakref__", "ref")

    def __init__(self, ref: Ref | _Input | _Held) -> None:
        self.ref = ref


class _Entry(NamedTuple):
    """How a tensor alive in forward is known: its reference, at which version, which object."""

    ref: Ref | _Input
    version: int
    tensor: weakref.ref[torch.Tensor]


def _key(t: torch.Tensor) -> int:
    return int(t._cdata)


def _storage(t: torch.Tensor) -> int | None:
    if t.layout is not torch.strided:
        return None
    return int(t.untyped_storage()._cdata)


class Graph:
    """The recorded ops of one forward run of a graph-engine region."""

    def __init__(self, policies: list[Any], inputs: list[torch.Tensor]) -> None:
        self.policies = policies
        self.nodes: list[Node] = []
        # TensorImpl address -> how that tensor is known; see [ Replay identity ].
        self.current: dict[int, _Entry] = {}
        self.input_node: Any = None
        for i, t in enumerate(inputs):
            if _key(t) not in self.current:
                self.current[_key(t)] = _Entry(_Input(i), t._version, weakref.ref(t))
        self.held: dict[int, list[_Held]] = {}  # storage -> values held by reference
        self.packed: list[weakref.ref[_Packed]] = []
        self.uses: dict[int, dict[Ref, int]] = {}  # graph task -> remaining uses
        self.cache: dict[int, dict[Ref, torch.Tensor]] = {}
        self.ran: dict[int, set[int]] = {}
        self.modules: list[str] = [""]
        self.in_attention = 0
        self.externals: dict[int, list[_External]] = {}
        self._refs: list[Ref] = []
        # Arguments of the last few ops, for remat.tag, which follows the op it names.
        self.recent: collections.deque[tuple[int, tuple[Any, ...], dict[str, Any]]] = (
            collections.deque(maxlen=8)
        )
        self.inputs_cache: dict[int, tuple[torch.Tensor, ...]] = {}
        self.rng_after: dict[int, dict[int, list[tuple[Any, torch.Tensor | None]]]] = {}
        self.paused = False  # the engine's own bookkeeping ops are not the region's

    def lookup(self, t: torch.Tensor) -> _Entry | None:
        """The entry for ``t`` if it is the tensor the entry was made for (addresses recur)."""
        entry = self.current.get(_key(t))
        return entry if entry is not None and entry.tensor() is t else None

    # -- recording ---------------------------------------------------------------------------

    def hold(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        storage = _storage(t)
        if storage is not None:
            self.held.setdefault(storage, []).append(held)
        return held

    def _before_write(self, t: torch.Tensor) -> None:
        # Copy-on-write for values held by reference: see [ Replay identity ] 3.
        storage = _storage(t)
        if storage is not None and storage in self.held:
            for held in self.held.pop(storage):
                held.tensor = held.tensor.clone()

    def arg(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        entry = self.lookup(value)
        if entry is not None and entry.version == value._version:
            if isinstance(entry.ref, Ref):
                self._refs.append(entry.ref)
            return entry.ref
        if entry is not None:  # stale
            return self.hold(value.detach())
        external = _External(value, value._version)
        self.externals.setdefault(_key(value), []).append(external)
        return external

    def record(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        info = cached_op_info().get(func) or op_info(func)
        facts = _FACTS.get(func) or _learn(func)
        refs = self._refs = []
        node_args = _map(self.arg, args)
        node_kwargs = {k: _map(self.arg, v) for k, v in kwargs.items()} if kwargs else {}
        if facts.metadata_only and isinstance(args[0], torch.Tensor):
            like = args[0]
            meta = _Meta(tuple(like.shape), tuple(like.stride()), like.dtype, like.device)
            node_args = (meta, *node_args[1:])
            refs = list(_refs_in((node_args, node_kwargs)))
        # Writes to external tensors run on snapshots, in forward and in replay alike.
        for position, name in info.writes:
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor):
                recorded = node_args[position] if position < len(args) else node_kwargs[name]
                if isinstance(recorded, _External):
                    snapshot = _Held(target.detach().clone())
                    # Earlier reads of this state replay from the snapshot (see [ Replay
                    # identity ] 5), since the live tensor moves on.
                    for read in self.externals.get(_key(target), ()):
                        if read.version == target._version and read.snapshot is None:
                            read.snapshot = snapshot.tensor
                    if position < len(args):
                        node_args = (*node_args[:position], snapshot, *node_args[position + 1 :])
                    else:
                        node_kwargs = {**node_kwargs, name: snapshot}
                else:
                    self._before_write(target)
        rng = _capture_rng(func, args, kwargs) if facts.random else None
        out = func(*args, **kwargs)
        index = len(self.nodes)
        module = self.modules[-1]
        decision = self._decide(func, args, kwargs, out, module, facts.must_save)
        node = Node(func, node_args, node_kwargs, module, decision, info.writes, rng)
        node.refs = tuple(refs)
        self.recent.append((index, args, kwargs))
        self.nodes.append(node)
        if type(out) is torch.Tensor and not info.writes:  # the common case: one new result
            self._bind(out, Ref(index, 0), node, False)
            return out
        # Autograd bumps the version of each written tensor after this returns: bind the
        # written states at the version they will have when the next op reads them.
        written = {
            _key(t): position
            for position, name in info.writes
            if isinstance(
                t := args[position] if position < len(args) else kwargs.get(name), torch.Tensor
            )
        }
        results = out if isinstance(out, (tuple, list)) else (out,)
        for k, result in enumerate(results):
            if isinstance(result, torch.Tensor):
                self._bind(result, Ref(index, k), node, _key(result) in written)
                written.pop(_key(result), None)
            elif isinstance(result, (tuple, list)):
                for j, t in enumerate(result):
                    if isinstance(t, torch.Tensor):
                        self._bind(t, Ref(index, ("l", k, j)), node, _key(t) in written)
        for position, name in info.writes:
            target = args[position] if position < len(args) else kwargs.get(name)
            if (
                isinstance(target, torch.Tensor)
                and _key(target) in written
                and self.lookup(target) is not None
            ):
                self._bind(target, Ref(index, ("w", position)), node, True)
        return out

    def _bind(self, t: torch.Tensor, ref: Ref, node: Node, written: bool) -> None:
        self.current[_key(t)] = _Entry(ref, t._version + written, weakref.ref(t))
        if node.decision.save:
            node.kept[ref.key] = self.hold(t.detach())

    def _decide(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        module: str,
        reason: str | None,
    ) -> Decision:
        ctx = OpContext(module=module, in_attention=self.in_attention > 0, outputs=(func, out))
        if len(self.policies) == 1:
            policy = self.policies[0]
            decision = as_decision(policy(ctx, func, *args, **kwargs), policy, func)
        else:
            decisions = [as_decision(p(ctx, func, *args, **kwargs), p, func) for p in self.policies]
            decision = resolve(decisions, func, module)
        if reason is not None:
            if decision is Decision.MUST_RECOMPUTE:
                raise RematError(
                    f"remat: a policy says MUST_RECOMPUTE for {func} in module "
                    f"{module or '(top)'}, which cannot be replayed safely: {reason}. Return "
                    "PREFER_RECOMPUTE (it yields to saving here) or MUST_SAVE for it."
                )
            return Decision.MUST_SAVE
        return decision

    def retag(self, t: torch.Tensor, name: str) -> None:
        """``remat.tag``: ask the policies again about the op behind ``t``, with its name."""
        entry = self.lookup(t)
        if entry is None or not isinstance(entry.ref, Ref):
            return
        node = self.nodes[entry.ref.node]
        ctx = OpContext(module=node.module, tags=frozenset({name}))
        call = next((c for c in self.recent if c[0] == entry.ref.node), None)
        args, kwargs = (call[1], call[2]) if call is not None else ((), {})
        decisions = [
            as_decision(p(ctx, node.op, *args, **kwargs), p, node.op) for p in self.policies
        ]
        decision = resolve(decisions, node.op, node.module)
        if decision.save and not node.decision.save:
            node.decision = decision
            node.kept[entry.ref.key] = self.hold(t.detach())

    # -- packing -------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> _Packed:
        entry = self.lookup(t)
        if entry is not None and entry.version == t._version:
            packed = _Packed(entry.ref)
        else:
            self.paused = True
            try:
                packed = _Packed(self.hold(t.detach()))
            finally:
                self.paused = False
        self.packed.append(weakref.ref(packed))
        observer = _state.state.observer
        if observer is not None:
            saved = (
                isinstance(packed.ref, Ref) and packed.ref.key in self.nodes[packed.ref.node].kept
            )
            decision: _state.Decision = (
                "recompute" if isinstance(packed.ref, Ref) and not saved else "keep"
            )
            observer.saved(t, decision, "graph engine")
        return packed

    def finish(self) -> None:
        """Region exit: drop kept results that no saved tensor can reach."""
        alive = set(self._alive_refs())
        cone, kept = self._cone(alive)
        reached = alive | kept
        replayed = set(cone)
        previous: int | None = None  # the last random op, in recording order
        for index, node in enumerate(self.nodes):
            node.kept = {k: v for k, v in node.kept.items() if Ref(index, k) in reached}
            if index not in replayed:  # never replayed: its arguments and RNG state can go
                if node.rng is not None:
                    previous = None  # it drew numbers that a replay will not draw
                node.args, node.kwargs, node.rng, node.refs = (), {}, None, ()
                continue
            if node.rng is None:
                continue
            # See [ Life of a replayed tensor ] 6: consecutive random ops of the replay keep
            # one generator state, that of the first.
            prior = self.nodes[previous] if previous is not None else None
            if prior is not None and [g for g, _ in prior.rng or ()] == [g for g, _ in node.rng]:
                node.rng = [(g, None) for g, _ in node.rng]
                node.after, prior.feeds = previous, True
            previous = index
        self.current = {}
        self.held = {}
        self.externals = {}
        self.recent.clear()

    def _alive_refs(self) -> Iterator[Ref]:
        for ref in self.packed:
            packed = ref()
            if packed is not None and isinstance(packed.ref, Ref):
                yield packed.ref

    def _cone(
        self, roots: Iterable[Ref], done: set[int] | None = None
    ) -> tuple[list[int], set[Ref]]:
        """The nodes to replay to rebuild ``roots`` (ascending), skipping ``done``, and the
        kept results they read."""
        seen: set[int] = set()
        kept: set[Ref] = set()
        stack = list(roots)
        while stack:
            r = stack.pop()
            node = self.nodes[r.node]
            if r.key in node.kept:
                kept.add(r)
                continue
            if r.node in seen or (done is not None and r.node in done):
                continue
            seen.add(r.node)
            stack.extend(node.refs)
        return sorted(seen), kept

    # -- replay ----------------------------------------------------------------------------------

    def unpack(self, packed: _Packed) -> torch.Tensor:
        ref = packed.ref
        if isinstance(ref, _Held):
            return ref.tensor
        task = torch._C._current_graph_task_id()
        outside = task == -1
        if outside:
            task = next(_outside_backward)
        if task not in self.uses:
            self._count_uses(task)
            if not outside:
                # What a backward leaves cached (slots it never asked for) goes when it ends.
                torch.autograd.Variable._execution_engine.queue_callback(
                    functools.partial(self._end, task)
                )
        if isinstance(ref, _Input):
            value = self._input(ref.index, task)
        else:
            value = self._materialize(ref, task)
            self._use(ref, task)
        if outside:
            self._end(task)
        return value

    def _input(self, index: int, task: int) -> torch.Tensor:
        """A region input, unpacked once per backward (an enclosing region lets each saved
        tensor be read once per backward)."""
        inputs = self.inputs_cache.get(task)
        if inputs is None:
            inputs = self.inputs_cache[task] = tuple(self.input_node.saved_tensors)
        return inputs[index]

    def _end(self, task: int) -> None:
        self.uses.pop(task, None)
        self.cache.pop(task, None)
        self.ran.pop(task, None)
        self.inputs_cache.pop(task, None)
        self.rng_after.pop(task, None)

    def _count_uses(self, task: int, roots: list[Ref] | None = None) -> None:
        uses: dict[Ref, int] = {}
        alive = list(self._alive_refs()) if roots is None else roots
        for ref in alive:
            uses[ref] = uses.get(ref, 0) + 1
        for index in self._cone(alive)[0]:
            for a in self.nodes[index].refs:
                uses[a] = uses.get(a, 0) + 1
        self.uses[task] = uses
        self.cache[task] = {}
        self.ran[task] = set()

    def _use(self, ref: Ref, task: int) -> None:
        uses = self.uses[task]
        uses[ref] -= 1
        if uses[ref] <= 0:
            self.cache[task].pop(ref, None)

    def _value(self, ref: Ref, task: int) -> torch.Tensor | None:
        kept = self.nodes[ref.node].kept.get(ref.key)
        if kept is not None:
            return kept.tensor
        return self.cache[task].get(ref)

    def _materialize(self, ref: Ref, task: int) -> torch.Tensor:
        value = self._value(ref, task)
        if value is not None:
            return value
        cache, ran = self.cache[task], self.ran[task]
        if ref.node in ran:
            # Read a second time in this backward (a custom Function reading ctx.saved_tensors
            # twice): rebuild it on its own, with counts for its cone only.
            again = next(_outside_backward)
            self._count_uses(again, [ref])
            self.inputs_cache[again] = self.inputs_cache.get(task) or tuple(
                self.input_node.saved_tensors
            )
            try:
                return self._materialize(ref, again)
            finally:
                self._end(again)
        with _replaying():
            for index in self._to_run(ref, ran):
                ran.add(index)
                self._run(index, self.nodes[index], task, cache)
        value = self._value(ref, task)
        if value is None:
            raise CheckpointError(
                f"remat: replay did not rebuild {ref} ({self.nodes[ref.node].op})."
            )
        return value

    def _to_run(self, ref: Ref, ran: set[int]) -> list[int]:
        """The cone of ``ref`` not yet run, with the random ops whose end state it needs."""
        nodes = set(self._cone([ref], ran)[0])
        pending = [i for i in nodes if self.nodes[i].after is not None]
        while pending:
            before = self.nodes[pending.pop()].after
            if before is None or before in ran or before in nodes:
                continue
            node = self.nodes[before]
            extra = set(self._cone(node.refs, ran)[0]) | {before}
            nodes |= extra
            pending.extend(i for i in extra if self.nodes[i].after is not None)
        return sorted(nodes)

    def _shared(self, ref: Ref, t: torch.Tensor, task: int) -> bool:
        """Whether writing ``t`` in place would change a value something else still needs."""
        uses = self.uses[task]
        if uses.get(ref, 0) > 1 or ref.key in self.nodes[ref.node].kept:
            return True
        storage = _storage(t)
        return any(
            other != ref and uses.get(other, 0) > 0 and _storage(value) == storage
            for other, value in self.cache[task].items()
        )

    def _run(self, index: int, node: Node, task: int, cache: dict[Ref, torch.Tensor]) -> None:
        uses = self.uses[task]
        written: set[int | str] = {p for p, _ in node.writes} | {n for _, n in node.writes}

        def resolve_arg(value: Any, position: int | str | None = None) -> Any:
            if isinstance(value, Ref):
                t = self._value(value, task)
                if t is None:
                    raise CheckpointError(
                        f"remat: replaying {node.op} in {node.module or '(top)'} needs a result "
                        f"of {self.nodes[value.node].op} that is gone."
                    )
                if position in written and self._shared(value, t, task):
                    t = t.clone()  # another consumer still needs the state before this write
                return t
            if isinstance(value, _Input):
                t = self._input(value.index, task)
                return t.clone() if position in written else t  # never write a live input
            if isinstance(value, _Meta):
                return value.stand_in()
            if isinstance(value, _External):
                if value.snapshot is not None:
                    return value.snapshot
                if value.tensor._version != value.version:
                    raise CheckpointError(
                        f"remat: {node.op} in {node.module or '(top)'} read a tensor from outside "
                        "the region that was modified in place after the forward pass; its "
                        "recomputed result would differ. Keep it unmodified until backward, or "
                        "save this op's result (MUST_SAVE)."
                    )
                return value.tensor
            if isinstance(value, _Held):
                return value.tensor.clone() if position in written else value.tensor
            return value

        args = tuple(
            resolve_arg(a, i) if isinstance(a, _RECORDED) else _map_recorded(resolve_arg, a)
            for i, a in enumerate(node.args)
        )
        if node.args and isinstance(node.args[0], _Meta) and node.kwargs.get("device") is None:
            # The op made its result where its argument lived, not on the meta stand-in.
            node_kwargs_device = {"device": node.args[0].device}
        else:
            node_kwargs_device = {}
        kwargs = {
            k: resolve_arg(v, k) if isinstance(v, _RECORDED) else _map_recorded(resolve_arg, v)
            for k, v in node.kwargs.items()
        }
        states = node.rng
        if node.after is not None and states is not None:
            states = self.rng_after[task].pop(node.after)
        with _replay_rng(states):
            out = node.op(*args, **kwargs, **node_kwargs_device)
            if node.feeds and states is not None:
                self.rng_after.setdefault(task, {})[index] = [(g, g.get_state()) for g, _ in states]
        results = out if isinstance(out, (tuple, list)) else (out,)
        for k, result in enumerate(results):
            if isinstance(result, torch.Tensor):
                cache[Ref(index, k)] = result
            elif isinstance(result, (tuple, list)):
                for j, t in enumerate(result):
                    cache[Ref(index, ("l", k, j))] = t
        for position, name in node.writes:
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor):
                cache[Ref(index, ("w", position))] = target
        for a in node.refs:
            self._use(a, task)
        for r in [r for r in cache if r.node == index and uses.get(r, 0) <= 0]:
            del cache[r]


_outside_backward = itertools.count(-2, -1)


def _refs_in(tree: Any) -> Iterator[Ref]:
    if isinstance(tree, Ref):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _refs_in(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _refs_in(item)


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to the tensors in an op argument (tensors, lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        mapped = [
            fn(v)
            if isinstance(v, torch.Tensor)
            else _map(fn, v)
            if isinstance(v, (tuple, list))
            else v
            for v in value
        ]
        return mapped if isinstance(value, list) else tuple(mapped)
    return value


_RECORDED = (Ref, _Input, _External, _Held, _Meta)


class _OpFacts(NamedTuple):
    metadata_only: bool
    random: bool
    must_save: str | None


_FACTS: dict[torch._ops.OpOverload, _OpFacts] = {}


def _learn(func: torch._ops.OpOverload) -> _OpFacts:
    facts = _FACTS[func] = _OpFacts(
        metadata_only=func.overloadpacket.__name__ in _METADATA_ONLY,
        random=torch.Tag.nondeterministic_seeded in func.tags,
        must_save=must_save_reason(func),
    )
    return facts


def _map_recorded(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, _RECORDED):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_recorded(fn, v) for v in value)
    return value


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


@contextlib.contextmanager
def _replaying() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def _capture_rng(
    func: Any, args: Any, kwargs: dict[str, Any]
) -> list[tuple[Any, torch.Tensor | None]] | None:
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    generator = kwargs.get("generator")
    if generator is not None:
        return [(generator, generator.get_state())]
    devices = {t.device for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    device = kwargs.get("device")
    if device is not None:
        devices.add(torch.device(device))
    states: list[tuple[Any, torch.Tensor | None]] = []
    for d in devices or {torch.device("cpu")}:
        generator = torch.default_generator if d.type == "cpu" else _device_generator(d)
        states.append((generator, generator.get_state()))
    return states


def _device_generator(device: torch.device) -> Any:
    module = getattr(torch, device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


@contextlib.contextmanager
def _replay_rng(states: list[tuple[Any, torch.Tensor | None]] | None) -> Iterator[None]:
    if states is None:
        yield
        return
    current = [(g, g.get_state()) for g, _ in states]
    try:
        for generator, state in states:
            if state is None:
                raise CheckpointError("remat: a random op was replayed before the one it follows.")
            generator.set_state(state)
        yield
    finally:
        for generator, state in current:
            generator.set_state(state)


class _AttentionScope(TorchFunctionMode):
    """Counts how deep the region is inside ``scaled_dot_product_attention`` calls."""

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.graph.in_attention += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.graph.in_attention -= 1


class Recorder(TorchDispatchMode):
    """Records every op of a graph-engine region into its :class:`Graph`."""

    def __init__(self, graph: Graph) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.graph.paused:
            return func(*args, **(kwargs or {}))
        return self.graph.record(func, args, kwargs or {})


@contextlib.contextmanager
def _module_names(graph: Graph, names: dict[int, str]) -> Iterator[None]:
    """Keep ``graph.modules`` as the stack of module names being run, on this thread."""
    thread = threading.get_ident()

    def pre(module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() == thread:
            graph.modules.append(names.get(id(module), type(module).__name__))

    def post(module: torch.nn.Module, args: Any, out: Any) -> None:
        if threading.get_ident() == thread and len(graph.modules) > 1:
            graph.modules.pop()

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(pre),
        torch.nn.modules.module.register_module_forward_hook(post, always_call=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def recording(
    policy: Any,
    inputs: list[torch.Tensor],
    module_names: dict[int, str] | None = None,
    offload_inputs: bool = False,
    root: str = "",
) -> Iterator[None]:
    """A graph-engine region around a block of code; see the notes above.

    ``inputs`` are the region's tensor inputs, saved so that an enclosing region manages them;
    ``module_names`` maps ``id(module)`` to the name to report for ops run inside it.
    """
    from .checkpoint import _host_offload, _SaveInputs

    active = _state.state.graph
    if active is not None:
        # Nested graph regions share the outer recording; their policy joins the stack.
        active.policies.append(policy)
        try:
            yield
        finally:
            active.policies.pop()
        return
    graph = Graph([policy], inputs)
    graph.modules = [root]  # the module whose forward the region is, if any
    dummy = torch.empty(0, requires_grad=True)
    _state.state.saving_region_inputs = True
    try:
        with _host_offload() if offload_inputs else contextlib.nullcontext():
            graph.input_node = _SaveInputs.apply(dummy, *inputs).grad_fn  # type: ignore[no-untyped-call]
    finally:
        _state.state.saving_region_inputs = False
    _state.state.graph = graph
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(graph.pack, graph.unpack))
            stack.enter_context(_state.checkpointing())
            stack.enter_context(_module_names(graph, module_names or {}))
            stack.enter_context(_AttentionScope(graph))
            stack.enter_context(Recorder(graph))
            yield
    finally:
        _state.state.graph = None
    graph.finish()


def tag(t: torch.Tensor, name: str) -> torch.Tensor:
    """Name ``t`` for policies such as ``remat.policies.save_tagged(name)``; returns ``t``.

    Inside a graph-engine region the policies are asked again about the op that produced ``t``,
    now with ``ctx.tags == {name}``; outside one, nothing happens.
    """
    if not isinstance(t, torch.Tensor) or not isinstance(name, str):
        raise RematError(
            f"remat.tag: expected (tensor, name: str), got ({type(t).__name__}, "
            f"{type(name).__name__})."
        )
    graph = _state.state.graph
    if graph is not None:
        graph.retag(t, name)
    return t


@contextlib.contextmanager
def region(*, policy: Any) -> Iterator[None]:
    """Run a block of code as a graph-engine region with ``policy``.

    ::

        with remat.region(policy=remat.policies.save_matmuls):
            h = block(x)

    Tensors the block reads from outside are held as they are (the region has no inputs to
    hand to an enclosing region); under ``torch.no_grad()`` and inside
    :func:`~remat.disable_checkpointing` the block runs plainly.
    """
    if not callable(policy):
        raise RematError(
            f"remat.region: policy must be a callable (ctx, op, *args, **kwargs) -> Decision, "
            f"got {type(policy).__name__}; see remat.policies."
        )
    if not torch.is_grad_enabled() or _state.state.disabled:
        yield
        return
    with recording(policy, []):
        yield
