"""The graph engine: record a region's ATen ops, replay only what backward needs.

In forward, a ``TorchDispatchMode`` records each operator of the region as a node: the op, its
arguments as references to earlier node results, region inputs or constants, the module it ran
in, and, for random ops, the generator state it consumed. A policy decides per op whether its
result is kept. Autograd's saved tensors are packed as references to node results; in backward,
unpacking one replays the smallest set of recorded ops it depends on, never the Python around
them, and intermediates live only while a pending saved tensor still needs them. The design
follows the op-graph checkpointing note behind ``references/graph-based-ac.txt``.

NOTE [ Replay identity ]

A tensor seen in forward is identified by its TensorImpl, its version counter and the address
of its data (``t.data = other`` gives the same TensorImpl other data at the same version: it
is then stale, as in rule 3):

1. an op's new result gets a reference ``Ref(node, k)`` at the version it was created with;
2. an op that writes a tensor in place (``bernoulli_``, ``div_``, ``out=``) produces a new
   state of it: the tensor's reference becomes ``Ref(write_node, ("w", position))`` at the new
   version, and the write node takes the old state as its argument. A functional op that
   writes an argument (``rrelu_with_noise`` fills ``noise``) leaves its version counter as
   it was, and autograd saved that argument before the write: the new state takes the same
   version, and what was saved of the old state is the new one (``_written_unseen``);
3. a tensor read at another version than the one its reference was made at (it was written
   through a view or another alias since) is *stale*: it cannot be rebuilt from its reference,
   so it is held as it is, and copied before any later write to its storage reaches it. An
   alias with a counter of its own (``h.data``) moves no version: a write through it makes
   the results on its storage unknown from then on, and what was saved of them held
   (``_aliases_of``), the results held until then, so a result whose last use was the
   write is settled too;
4. a tensor made outside the region is *external*: region inputs come back through the
   region's saved inputs (Rule 2 of the nesting note in ``checkpoint.py``); others
   (parameters, captured tensors) are held, and their version is checked when replayed;
5. an op that writes an external tensor (BatchNorm statistics) runs on a snapshot of it taken
   in forward, in forward state, so a replay never writes live tensors and reads what the op
   read then;
6. a record sits in a node's arguments only where the op's schema allows a tensor
   (``ArgLayout`` in ``_aten.py``): a ``Tensor`` or ``Tensor?`` position holds a record, None,
   or the Python number the dispatcher passed for a wrapped number; a ``Tensor[]`` position a
   list of them; every other argument is kept as the op got it, and neither the recording nor
   the replay looks inside it. An op with an argument of another type that could hold a tensor
   (a generic ``t``, a dict) is searched whole;
7. a view (``t``, ``view``, ``split``) is known at its base's version: the dispatch mode sees
   the op below autograd, where its result still has a counter of its own, and autograd
   makes it share its base's counter once the op returns. So ``t(weight)`` of a parameter
   that an optimizer step has written is a reference to a replayable node, not a stale read;
8. a tensor held by reference (a kept result, a stale read, a leaf autograd saves) remembers
   the tensor whose version counter it shares in the program and that counter's value; a
   replay or backward that reads it after the program wrote that tensor (an optimizer step
   between forward and backward, an output written in place) raises, as plain autograd does
   for a saved tensor. Writes inside the region never trip it: the held value is copied first
   (rule 3), and a copy is checked no more. A saved tensor the region rebuilds is checked
   the same way when backward unpacks it, while the tensor lives (the region's output,
   written in place by the caller): ``_Packed`` holds it weakly, with its version.

How backward rebuilds a tensor from the records: ``_replay.py``, NOTE [ Life of a replayed
tensor ].

NOTE [ A recompute-everything region is not a re-run ]

A region whose policy recomputes every op (``recompute_everything``) decides nothing per op,
and re-running its function in backward, as the region engine does, would spare it the
recording, most of a forward made of small ops. It stays a graph-engine region, because a
re-run is a different region, observably:

1. a replay runs the cone of the saved tensors still alive; a re-run runs the function up to
   the last one, including the ops of outputs that backward no longer needs;
2. data-dependent ops, collectives and ops with side effects are saved (``must_save_reason``
   in ``policies.py``); a re-run runs them again;
3. a random op that draws from an explicit ``torch.Generator`` replays from that generator's
   state; a re-run restores the default generators only, and draws other numbers;
4. a tensor from outside the region that the region reads, then writes in place (a running
   average buffer), replays from its snapshot (rule 5 above); a re-run reads it as written,
   and the gradients differ;
5. a saved tensor may be read twice in one backward; a nested region's policy joins the
   stack, and what it keeps is never recomputed.

``tests/test_graph.py`` and ``tests/test_policies.py`` check each of these under
``recompute_everything``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _attention, _state
from ._aten import ArgLayout, copy_with_layout, op_info
from ._aten import storage_key as _storage
from ._dispatch import EagerMode
from ._nodes import (
    _BLANK,
    _METADATA_ONLY,
    Node,
    Ref,
    _Entry,
    _External,
    _Held,
    _Input,
    _key,
    _map,
    _map_recorded,
    _Meta,
    _Packed,
    address_of,
    version_of,
)
from ._replay import Replay
from .errors import RematError, warn
from .policies import (
    Decision,
    OpContext,
    as_decision,
    decides_by_op,
    must_save_reason,
    reads_attention,
    resolve,
)
from .policies import check as check_policy
from .store._store import Saved, Store
from .store.scope import drain, outlives_the_step, store_for

if TYPE_CHECKING:
    from .checkpoint import SavedInputs

__all__: list[str] = []

# A result index; ("w", position) for a written argument; ("l", index, item) in a list result.
Key = int | tuple[str, int] | tuple[str, int, int]


class Graph(Replay):
    """The recorded ops of one forward run of a graph-engine region."""

    def __init__(self, policies: list[Any], inputs: list[torch.Tensor]) -> None:
        self.policies = policies
        self.by_op = _decisions_by_op(policies[0])  # while it is the only policy
        self.nodes: list[Node] = []
        # TensorImpl address -> how that tensor is known; see [ Replay identity ].
        self.current: dict[int, _Entry] = {}
        self.saved_inputs: SavedInputs | None = None
        for i, t in enumerate(inputs):
            # An inference tensor is read as one from outside: held, as nothing writes it.
            if _key(t) not in self.current and not t.is_inference():
                self.current[_key(t)] = _Entry(_Input(i), t._version, weakref.ref(t), address_of(t))
        self.held: dict[int, list[_Held | Saved]] = {}  # storage -> values held by reference
        self.stores: set[Store] = set()  # the stores kept results were offloaded to
        self.packed: list[weakref.ref[_Packed]] = []
        self.uses: dict[int, dict[Ref, int]] = {}  # graph task -> remaining uses
        self.cache: dict[int, dict[Ref, torch.Tensor]] = {}
        self.ran: dict[int, set[int]] = {}
        self.modules: list[str] = [""]
        self.naming = False  # whether module hooks keep ``modules`` (see ``_module_names``)
        self.in_attention = 0
        self.externals: dict[int, list[_External]] = {}
        # TensorImpl address of an external -> its storage's key, found when a write needs it
        self.external_storages: dict[int, int | None] = {}
        self._refs: list[Ref] = []
        # Results written through an alias that may not share their version counter (see
        # ``_aliases_of``), checked at the next op, pack or exit.
        self.unseen: list[tuple[int, _Entry, torch.Tensor]] = []
        self.inputs_cache: dict[int, tuple[torch.Tensor, ...]] = {}
        self.rng_after: dict[int, dict[int, list[tuple[Any, torch.Tensor | None]]]] = {}
        self.alive_uses: tuple[int, dict[Ref, int]] | None = None
        self.paused = False  # the engine's own bookkeeping ops are not the region's

    def lookup(self, t: torch.Tensor) -> _Entry | None:
        """The entry for ``t`` if it is the tensor the entry was made for (addresses recur)."""
        entry = self.current.get(_key(t))
        return entry if entry is not None and entry.tensor() is t else None

    # -- recording ---------------------------------------------------------------------------

    def hold(self, t: torch.Tensor, source: weakref.ref[torch.Tensor], version: int) -> _Held:
        """Hold ``t`` by reference: the value of the tensor ``source`` refers to, at
        ``version`` (see ``_Held``; ``_source`` gives both for a tensor of the program)."""
        held = _Held(t, source, version)
        storage = _storage(t)
        if storage is not None:
            self.held.setdefault(storage, []).append(held)
        return held

    def _before_write(self, t: torch.Tensor) -> None:
        # Copy-on-write for values held by reference: see [ Replay identity ] 3.
        storage = _storage(t)
        if storage is not None and storage in self.held:
            for held in self.held.pop(storage):
                if isinstance(held, Saved):
                    held.store.settle(held)  # its copy out reads the value before the write
                else:
                    held.copied()

    def arg(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        entry = self.current.get(int(value._cdata))
        if entry is not None and entry.tensor() is value:
            if entry.version == value._version and entry.address == address_of(value):
                if type(entry.ref) is Ref:
                    self._refs.append(entry.ref)
                return entry.ref
            return self.hold(value.detach(), *_source(value))  # stale
        external = _External(value, version_of(value))
        self.externals.setdefault(_key(value), []).append(external)
        return external

    def record(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self.unseen:
            self._unseen_writes()
        facts = _FACTS.get(id(func)) or _learn(func)
        refs: list[Ref] = []
        self._refs = refs  # ``arg`` adds the references it makes here
        layout = facts.layout
        if layout is None:
            node_args = tuple(_map(self.arg, value) for value in args)
        else:
            # The arguments as records, where the schema says tensors can be (a Tensor argument
            # comes as a Python number when it was one); ``arg`` with its common case inlined:
            # this loop runs for every tensor argument of every op.
            current = self.current
            recorded = list(args)
            n = len(args)
            for i in layout.tensors:
                if i >= n:
                    break
                value = args[i]
                if not isinstance(value, torch.Tensor):  # None, or a number for a Scalar
                    continue
                entry = current.get(value._cdata)
                if (
                    entry is not None
                    and entry.version == value._version
                    and entry.tensor() is value
                    and entry.address == address_of(value)
                ):
                    value = entry.ref
                    if type(value) is Ref:
                        refs.append(value)
                    recorded[i] = value
                else:
                    recorded[i] = self.arg(value)
            for i in layout.lists:
                if i < n:
                    recorded[i] = _map(self.arg, args[i])
            node_args = tuple(recorded)
        node_kwargs = {k: _map(self.arg, v) for k, v in kwargs.items()} if kwargs else {}
        if facts.special:
            node_args, node_kwargs = self._special(
                facts, args, kwargs, node_args, node_kwargs, refs
            )
        rng = _capture_rng(args, kwargs) if facts.random else None
        out = func._op(*args, **kwargs)
        index = len(self.nodes)
        module = self.modules[-1]
        by_op = self.by_op
        decision = (
            by_op.get(id(func))
            if by_op is not None and facts.must_save is None and len(self.policies) == 1
            else None
        )
        if decision is None:
            decision = self._decide(func, args, kwargs, out, module, facts.must_save)
        node = Node(
            func,
            node_args,
            node_kwargs,
            module,
            decision,
            facts.writes,
            rng,
            tuple(refs),
            self.in_attention > 0,
            layout,
        )
        if facts.blank and type(out) is torch.Tensor and not kwargs.get("pin_memory"):
            node.blank = _Meta(out)
        self.nodes.append(node)
        keep = decision is not _PREFER_RECOMPUTE and decision is not _MUST_RECOMPUTE
        if type(out) is torch.Tensor:
            if not facts.writes:  # the common case: one new result
                live = weakref.ref(out)
                if facts.view_of is None:
                    source, version = live, out._version
                else:  # see [ Replay identity ] 7
                    source, version = _source(args[facts.view_of])
                self.current[out._cdata] = _new_entry(
                    (_new_ref((index, 0)), version, live, address_of(out))
                )
                if keep:
                    node.kept[0] = self.hold(out.detach(), source, version)
                return out
            if facts.in_place and out is args[0]:  # ``x.div_(2)`` returns ``x``: written
                self._bind(out, (index, 0), node, True, keep, counted=facts.counted)  # (below)
                return out
        # Autograd bumps the version of each written tensor after this returns (where it counts
        # the op's writes): bind the written states at the version they will have when the
        # next op reads them.
        written = {
            _key(t): position
            for position, name in facts.writes
            if isinstance(
                t := args[position] if position < len(args) else kwargs.get(name), torch.Tensor
            )
        }
        results = out if isinstance(out, (tuple, list)) else (out,)
        base = args[facts.view_of] if facts.view_of is not None else None
        for k, result in enumerate(results):
            if isinstance(result, torch.Tensor):
                was_written = written.pop(result._cdata, None) is not None
                self._bind(result, (index, k), node, was_written, keep, base, facts.counted)
            elif isinstance(result, (tuple, list)):
                for j, t in enumerate(result):
                    if isinstance(t, torch.Tensor):
                        key = (index, ("l", k, j))
                        self._bind(t, key, node, t._cdata in written, keep, base, facts.counted)
        for position, name in facts.writes if written else ():
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor) and target._cdata in written:
                before = self.lookup(target)
                if before is None:
                    continue
                self._bind(target, (index, ("w", position)), node, True, keep, None, facts.counted)
                if not facts.counted:
                    self._written_unseen(before.ref, _new_ref((index, ("w", position))))
        return out

    def _written_unseen(self, before: Ref | _Input, after: Ref) -> None:
        """An op wrote a tensor without autograd counting the write (``rrelu_with_noise``
        fills its ``noise`` argument), after autograd had saved that tensor for the op's
        backward: the saved tensor keeps its version, and a plain backward reads the value as
        written. What was saved of the state before the write is the state after it."""
        for packed in self._saved_as(before):
            packed.ref = after

    def _saved_as(self, ref: Ref | _Input) -> list[_Packed]:
        """What autograd holds of the region's tensors that it saved as ``ref``."""
        return [p for weak in self.packed if (p := weak()) is not None and p.ref == ref]

    def _special(
        self,
        facts: _OpFacts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        node_args: tuple[Any, ...],
        node_kwargs: dict[str, Any],
        refs: list[Ref],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The records of an op that reads an argument's metadata only, or writes one; drops
        from ``refs`` the reference that a metadata read does not need."""
        if facts.metadata_only and isinstance(args[0], torch.Tensor):
            if type(node_args[0]) is Ref:
                refs.remove(node_args[0])  # the replay needs no producer for a layout
            node_args = (_Meta(args[0]), *node_args[1:])
        # Writes to external tensors run on snapshots, in forward and in replay alike.
        for position, name in facts.writes:
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor):
                recorded = node_args[position] if position < len(args) else node_kwargs[name]
                if isinstance(recorded, _External):
                    if self.held:
                        self._before_write(target)  # a kept view of it holds the value before
                    snapshot = _Held(copy_with_layout(target.detach()))
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
                    if self.held:
                        self._before_write(target)
                    if type(recorded) is Ref and self.nodes[recorded.node].op is _DETACH:
                        self._aliases_of(target)
                if self.externals:
                    self._snapshot_aliases(target)
        return node_args, node_kwargs

    def _aliases_of(self, target: torch.Tensor) -> None:
        """``target``, a ``detach`` result, is about to be written: the results of the region
        on its storage whose version counters it may not share (``h.data`` has its own, where
        ``h.detach()`` shares ``h``'s). Which do shows once the write is counted, at the next
        op: see ``_unseen_writes``."""
        storage = _storage(target)
        if storage is None:
            return
        for cdata, entry in self.current.items():
            t = entry.tensor()
            if (
                t is not None
                and t is not target
                and type(entry.ref) is Ref
                and t._version == entry.version
                and _storage(t) == storage
            ):
                # Held until then: a result the region no longer names (its last use was this
                # write's alias) still has its saved reads to settle.
                self.unseen.append((cdata, entry, t))

    def _unseen_writes(self) -> None:
        """The results noted by ``_aliases_of`` whose version did not move with the write:
        ``h.data.clamp_(-1, 1)`` wrote ``h`` unseen by its counter. Their records would replay
        the value before the write, where a plain run reads it as written: they are no longer
        known from here on (a later read holds the tensor as it is, [ Replay identity ] 4),
        and what was saved of them is held as it is."""
        unseen, self.unseen = self.unseen, []
        for cdata, entry, t in unseen:
            if self.current.get(cdata) is not entry or t._version != entry.version:
                continue  # its counter moved: [ Replay identity ] 3 holds it
            del self.current[cdata]
            saved = self._saved_as(entry.ref)
            if saved:
                held = self.hold(t.detach(), *_source(t))
                for packed in saved:
                    packed.ref = held

    def _snapshot_aliases(self, target: torch.Tensor) -> None:
        """Earlier reads of other tensors on the storage ``target`` is about to write (a
        buffer written through its ``.data``, a view taken before the write) replay from
        copies taken now: [ Replay identity ] 5 for aliases."""
        storage = _storage(target)
        if storage is None:
            return
        storages = self.external_storages
        for key, reads in self.externals.items():
            known = storages.get(key, False)
            if known is False:
                known = storages[key] = _storage(reads[0].tensor)
            if known != storage or key == _key(target):
                continue
            for read in reads:
                if read.snapshot is None and read.version == read.tensor._version:
                    read.snapshot = copy_with_layout(read.tensor.detach())

    def _bind(
        self,
        t: torch.Tensor,
        key: tuple[int, Key],
        node: Node,
        written: bool,
        keep: bool,
        base: torch.Tensor | None = None,
        counted: bool = True,
    ) -> None:
        """Make ``t`` known as ``key``; ``base``: the argument it is a view of, whose version
        counter it shares once the op returns ([ Replay identity ] 7); ``counted``: whether
        autograd counts the op's writes (``OpInfo.counted``)."""
        ref = _new_ref(key)
        source, version = _source(t if base is None or written else base)
        version += written and counted
        self.current[t._cdata] = _new_entry((ref, version, weakref.ref(t), address_of(t)))
        if keep:
            node.kept[ref.key] = self.hold(t.detach(), source, version)

    def _offload(self, ref: Ref) -> None:
        """Move a kept result to its tier, if its decision (or the ``remat.offload`` block the
        region runs in) says so. This happens when autograd saves it, or at region exit for
        results only a replay reads; results nothing reads are never written out."""
        node = self.nodes[ref.node]
        held = node.kept.get(ref.key)
        if not isinstance(held, _Held):
            return
        t = held.tensor
        root = held.source() if held.source is not None else None
        if root is not None and outlives_the_step(root):
            return  # a view of a parameter (``weight.t()``) or an input: a tier only copies it
        scope = _state.state.offload
        if node.decision.offload is not None:
            store = store_for(node.decision.offload)
            if not store.takes(t):  # a CPU tensor and the host tier: in host memory already
                tier_takes = getattr(store.tier, "takes", None)
                # Not for the few bytes a CUDA model keeps on the CPU (attention's random
                # seed and offset): a CPU model's activations.
                if tier_takes is not None and not tier_takes(t.device) and t.nbytes >= 1024:
                    _warn_kept_in_host_memory(store.tier.name)
                return
        elif scope is not None and scope.wants(t):
            store = scope.store
        else:
            return
        prefetch = scope.prefetch if scope is not None and store is scope.store else None
        # ``t`` holds the value it had when recorded: copy-on-write (``_before_write``) gave
        # it its own storage if anything wrote it since.
        saved = store.pack(t, check_version=False, prefetch=prefetch)
        self.stores.add(store)
        node.kept[ref.key] = saved
        holders = self.held.get(_storage(t) or -1, [])
        for i, other in enumerate(holders):
            if other is held:
                holders[i] = saved

    def _decide(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        module: str,
        reason: str | None,
    ) -> Decision:
        by_op = self.by_op if len(self.policies) == 1 else None
        decision = by_op.get(id(func)) if by_op is not None else None
        if decision is None:
            ctx = OpContext(module=module, in_attention=self.in_attention > 0, outputs=(func, out))
            decision = self._ask(ctx, func, args, kwargs)
            if by_op is not None:
                by_op[id(func)] = decision
        if reason is not None and decision.recompute:
            if decision is Decision.MUST_RECOMPUTE:
                raise RematError(
                    f"remat: a policy says MUST_RECOMPUTE for {func} in module "
                    f"{module or '(top)'}, which cannot be replayed safely: {reason}. Return "
                    "PREFER_RECOMPUTE (it yields to saving here), MUST_SAVE or an OFFLOAD "
                    "decision for it."
                )
            return Decision.MUST_SAVE
        return decision

    def _ask(
        self, ctx: OpContext, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Decision:
        """What the policies on the stack decide together for ``func`` in ``ctx``."""
        decisions = [as_decision(p(ctx, func, *args, **kwargs), p, func) for p in self.policies]
        return decisions[0] if len(decisions) == 1 else resolve(decisions, func, ctx.module)

    def retag(self, t: torch.Tensor, name: str) -> None:
        """``remat.tag``: ask the policies again about the op behind ``t``, with its name."""
        entry = self.lookup(t)
        if entry is None or not isinstance(entry.ref, Ref):
            return
        node = self.nodes[entry.ref.node]
        ctx = OpContext(module=node.module, tags=frozenset({name}), in_attention=node.in_attention)
        args, kwargs = self._live_arguments(node)
        decision = self._ask(ctx, node.op, args, kwargs)
        if not decision.recompute and node.decision.recompute:
            node.decision = decision
            node.kept[entry.ref.key] = self.hold(t.detach(), *_source(t))

    def _live_arguments(self, node: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments ``node``'s op was called with, from its records: the tensors still
        alive in the state the op read, ``None`` for those gone or written since. The records
        hold no tensor of the region that a plain run would have freed."""
        live: dict[Any, torch.Tensor] = {}
        for entry in self.current.values():
            t = entry.tensor()
            if t is not None and t._version == entry.version:
                live[entry.ref] = t

        def argument(value: Any) -> Any:
            if isinstance(value, (Ref, _Input)):
                return live.get(value)
            if isinstance(value, _External):
                return value.snapshot if value.snapshot is not None else value.tensor
            if isinstance(value, _Held):
                return value.tensor
            if isinstance(value, _Meta):
                return value.stand_in()
            return value

        args = tuple(_map_recorded(argument, a) for a in node.args)
        return args, {k: _map_recorded(argument, v) for k, v in node.kwargs.items()}

    # -- packing -------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> _Packed:
        if self.unseen:
            self._unseen_writes()
        entry = self.current.get(t._cdata)
        if (
            entry is not None
            and entry.version == t._version
            and entry.tensor() is t
            and entry.address == address_of(t)
        ):
            known = entry.ref
            # The entry's own reference and version: a result to rebuild is checked for
            # writes when it is unpacked ([ Replay identity ] 8).
            packed = (
                _Packed(known, entry.tensor, entry.version)
                if type(known) is Ref
                else _Packed(known)
            )
            if type(known) is Ref and self.nodes[known.node].kept:
                self._offload(known)
        elif t.grad_fn is None:
            # A leaf from outside the region (a parameter that LayerNorm saves): held itself,
            # since it holds no graph, without a ``detach`` through the recording mode.
            packed = _Packed(self.hold(t, *_source(t)))
        else:
            self.paused = True
            try:
                packed = _Packed(self.hold(t.detach(), *_source(t)))
            finally:
                self.paused = False
        self.packed.append(weakref.ref(packed))
        observer = _state.state.observer
        if observer is not None:
            ref = packed.ref
            kept = self.nodes[ref.node].kept.get(ref.key) if isinstance(ref, Ref) else None
            saved = kept is not None
            if isinstance(kept, Saved):
                observer.saved(t, "offload", f"graph engine, {kept.store.tier.name} tier")
            else:
                decision: _state.Decision = (
                    "recompute" if isinstance(packed.ref, Ref) and not saved else "keep"
                )
                observer.saved(t, decision, "graph engine")
        return packed

    def finish(self) -> None:
        """Region exit: drop kept results that no saved tensor can reach."""
        if self.unseen:
            self._unseen_writes()
        slots = list(self._alive_refs())
        alive = set(slots)
        cone, kept = self._cone(alive)
        reached = alive | kept
        replayed = set(cone)
        previous: int | None = None  # the last random op, in recording order
        for index, node in enumerate(self.nodes):
            if node.kept:
                node.kept = {k: v for k, v in node.kept.items() if Ref(index, k) in reached}
                for key in list(node.kept):
                    self._offload(Ref(index, key))
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
        self.alive_uses = (len(slots), self._counts(slots, cone))
        self.current = {}
        self.held = {}
        self.externals = {}
        self.external_storages = {}
        for store in self.stores:  # a failed write raises here, before backward
            store.flush()
        self.stores = set()


# The answers of each policy that decides by the op alone (``decides_by_op``), by ``id(op)``:
# every op asked about was recorded first, and ``_FACTS`` holds it, so its id stays its own.
_BY_OP: weakref.WeakKeyDictionary[Any, dict[int, Decision]] = weakref.WeakKeyDictionary()


def _decisions_by_op(policy: Any) -> dict[int, Decision] | None:
    return _BY_OP.setdefault(policy, {}) if decides_by_op(policy) else None


class _OpFacts(NamedTuple):
    op: torch._ops.OpOverload  # held, so that its id, the key below, stays its own
    writes: tuple[tuple[int, str], ...]
    metadata_only: bool
    blank: bool
    random: bool
    must_save: str | None
    special: bool  # metadata_only or writes: recorded by ``Graph._special``
    in_place: bool  # writes its first argument only (``div_``)
    counted: bool  # autograd counts its writes (see ``OpInfo.counted``)
    layout: ArgLayout | None
    # The position of the argument that the op's results are views of (``t``, ``view``,
    # ``split``), for an op that writes nothing; see [ Replay identity ] 7.
    view_of: int | None


# Keyed by ``id(op)``: an OpOverload hashes in Python, an int in C, and this lookup runs per op.
_FACTS: dict[int, _OpFacts] = {}


def _learn(func: torch._ops.OpOverload) -> _OpFacts:
    info = op_info(func)
    writes = info.writes
    metadata_only = func.overloadpacket.__name__ in _METADATA_ONLY
    facts = _FACTS[id(func)] = _OpFacts(
        op=func,
        writes=writes,
        metadata_only=metadata_only,
        blank=func.overloadpacket.__name__ in _BLANK,
        random=info.random,
        must_save=must_save_reason(func),
        special=metadata_only or bool(writes),
        in_place=len(writes) == 1 and writes[0][0] == 0,
        counted=info.counted,
        layout=info.layout,
        view_of=info.view_of,
    )
    return facts


def _source(t: torch.Tensor) -> tuple[weakref.ref[torch.Tensor], int]:
    """The tensor whose version counter ``t`` shares in the program (the root of its views),
    weakly, and that counter now: what a ``_Held`` value of ``t`` is checked against."""
    root = t._base
    if root is None:
        root = t
    return weakref.ref(root), root._version


_new_ref = functools.partial(tuple.__new__, Ref)  # Ref(node, key) without NamedTuple.__new__
# ``Decision.recompute`` without its property call, on the per-op path.
_PREFER_RECOMPUTE, _MUST_RECOMPUTE = Decision.PREFER_RECOMPUTE, Decision.MUST_RECOMPUTE
_DETACH = torch.ops.aten.detach.default  # what ``.data`` and ``.detach()`` record
_new_entry = functools.partial(tuple.__new__, _Entry)


def _capture_rng(args: Any, kwargs: dict[str, Any]) -> list[tuple[Any, torch.Tensor | None]]:
    """The state of each generator a random op is about to draw from."""
    generator = kwargs.get("generator")
    if generator is not None:
        return [(generator, generator.get_state())]
    devices: set[torch.device] = set()
    for value in (*args, *kwargs.values()):  # ATen arguments: tensors, or lists of them
        if isinstance(value, torch.Tensor):
            devices.add(value.device)
        elif isinstance(value, (tuple, list)):
            devices.update(t.device for t in value if isinstance(t, torch.Tensor))
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
        if func in _attention.MATMUL_FUNCTIONS and not self.graph.in_attention:
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):  # see NOTE [ Eager attention core ]
                _attention.mark(self.graph, out)
            return out
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        self.graph.in_attention += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.graph.in_attention -= 1


def _attention_scope(graph: Graph) -> contextlib.AbstractContextManager[Any]:
    """Track ``ctx.in_attention`` while the policy just pushed on ``graph.policies`` is there,
    if it may read it and no policy below it does (whose region tracks it already). Ops
    recorded untracked count as outside attention: only policies that never read it see them."""
    *below, policy = graph.policies
    if not reads_attention(policy) or any(reads_attention(p) for p in below):
        return contextlib.nullcontext()
    return _AttentionScope(graph)


class Recorder(EagerMode):
    """Records every op of a graph-engine region into its :class:`Graph`."""

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        self.graph = graph

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


def names_modules(policy: Any) -> bool:
    """Whether a region with ``policy`` keeps the name of the module each op runs in: see
    ``_module_names``."""
    return not decides_by_op(policy) or _state.state.observer is not None


@contextlib.contextmanager
def _module_names(
    graph: Graph, policy: Any, names: dict[int, str] | None, root: str
) -> Iterator[None]:
    """Keep ``graph.modules`` as the stack of module names being run, on this thread, while
    ``policy`` is on the stack, if it may read ``ctx.module`` and no policy below it does.

    A policy that decides by the op alone never reads the module, and the hooks that track it
    are global: with them, every module call takes ``nn.Module``'s slow path. Ops recorded
    untracked carry the name of the region's module (``root``): errors name it. A report being
    made (``remat.explain``'s observer) always asks for names: its rows name the module.
    """
    if not names_modules(policy) or graph.naming:
        yield
        return
    thread = threading.get_ident()
    names = names or {}
    depth = len(graph.modules)
    if root:
        graph.modules.append(root)

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
    graph.naming = True
    try:
        yield
    finally:
        graph.naming = False
        for h in handles:
            h.remove()
        del graph.modules[depth:]


def _in_torch_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are those of ``torch.utils.checkpoint``'s
    non-reentrant frame (its forward pass or its recompute): a region-engine frame of torch's
    between a graph-engine region and one inside it (rule 4 of NOTE [ Nested regions ] in
    ``checkpoint.py``, as ``_state.frame_saves`` marks remat's own)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    name = getattr(hooks[0], "__qualname__", "") if hooks else ""
    return name.startswith(("_checkpoint_hook.", "_recomputation_hook."))


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
    from .checkpoint import save_inputs

    active = _state.state.graph
    if active is not None and not _in_torch_checkpoint():
        # Nested graph regions share the outer recording; their policy joins the stack.
        active.policies.append(policy)
        try:
            with _module_names(active, policy, module_names, root), _attention_scope(active):
                yield
        finally:
            active.policies.pop()
        return
    graph = Graph([policy], inputs)
    graph.modules = [root]  # the module whose forward the region is, if any
    graph.saved_inputs = save_inputs(inputs, offload_inputs)
    _state.state.graph = graph
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(graph.pack, graph.unpack),
            _state.checkpointing(),
            _module_names(graph, policy, module_names, ""),
            _attention_scope(graph),
            Recorder(graph),
        ):
            yield
    except BaseException:
        for store in graph.stores:
            drain(store)
        raise
    finally:
        # The recording this region is nested in under torch's checkpoint, or None.
        _state.state.graph = active
    graph.finish()


def tag(t: torch.Tensor, name: str) -> torch.Tensor:
    """Name ``t`` for policies such as ``remat.policies.save_tagged(name)``; returns ``t``.

    Inside a graph-engine region the policies are asked again about the op that produced ``t``,
    now with ``ctx.tags == {name}`` and the op's arguments as far as they are still alive
    (``None`` for a tensor freed, or written in place, since); outside one, nothing happens.
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
    check_policy(policy, "remat.region")
    if not torch.is_grad_enabled() or _state.state.disabled:
        yield
        return
    _state.refuse_transforms("remat.region")
    with recording(policy, []):
        yield


def _warn_kept_in_host_memory(tier: str) -> None:
    """A policy's offload to the host tier of a tensor in host memory already: kept where it
    is, which frees nothing, and the policy recomputes it no more either."""
    warn(
        f"remat: a policy offloads saved tensors to the {tier} tier, but they are on the CPU, "
        "in host memory already: they are kept where they are, and the region holds them as "
        "if the policy saved them. On a model that runs on the CPU, offload to disk "
        "(offload_everything('disk'), Decision.MUST_OFFLOAD_DISK) or recompute them; the "
        "host tier frees an accelerator's memory."
    )
