"""Replay of a graph-engine region in backward: rebuild a saved tensor from its records.

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

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from . import _state
from ._aten import copy_with_layout
from ._aten import storage_key as _storage
from ._nodes import (
    _RECORDED,
    NO_COUNTER,
    Node,
    Ref,
    _External,
    _Held,
    _Input,
    _map_recorded,
    _Meta,
    _Packed,
)
from .errors import CheckpointError, saved_and_written

if TYPE_CHECKING:
    from .checkpoint import SavedInputs

__all__: list[str] = []

# A result index; ("w", position) for a written argument; ("l", index, item) in a list result.
Key = int | tuple[str, int] | tuple[str, int, int]


class Replay:
    """The replay half of :class:`remat.graph.Graph`: per-backward use counts and caches."""

    nodes: list[Node]
    packed: list[weakref.ref[_Packed]]
    saved_inputs: SavedInputs | None
    uses: dict[int, dict[Ref, int]]
    cache: dict[int, dict[Ref, torch.Tensor]]
    ran: dict[int, set[int]]
    inputs_cache: dict[int, tuple[torch.Tensor, ...]]
    rng_after: dict[int, dict[int, list[tuple[Any, torch.Tensor | None]]]]
    # The number of live slots at the region's exit, and the use counts for them
    # (``_counts``); None before the exit.
    alive_uses: tuple[int, dict[Ref, int]] | None

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
            check_held(ref, "saved for backward")
            return ref.tensor
        saved = packed.tensor() if packed.tensor is not None else None
        if saved is not None and saved._version != packed.version:
            raise saved_and_written(
                "a tensor saved in a graph-engine region", saved, packed.version
            )
        task, outside = _state.backward_task()
        if task not in self.uses:
            self._count_uses(task)
            if not outside:
                # What a backward leaves cached (slots it never asked for) goes when it ends.
                _state.forget_when_backward_ends(self._end, task)
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
            inputs = self.inputs_cache[task] = self._inputs()
        return inputs[index]

    def _inputs(self) -> tuple[torch.Tensor, ...]:
        return self.saved_inputs.tensors if self.saved_inputs is not None else ()

    def _end(self, task: int) -> None:
        self.uses.pop(task, None)
        self.cache.pop(task, None)
        self.ran.pop(task, None)
        self.inputs_cache.pop(task, None)
        self.rng_after.pop(task, None)

    def _count_uses(self, task: int, roots: list[Ref] | None = None) -> None:
        if roots is not None:
            uses = self._counts(roots)
        else:
            alive = list(self._alive_refs())
            counted = self.alive_uses
            # Nothing is saved after the region's exit, so the same number of live slots means
            # the same slots: the counts made there hold (a copy, which the backward consumes).
            if counted is not None and counted[0] == len(alive):
                uses = dict(counted[1])
            else:
                uses = self._counts(alive)
        self.uses[task] = uses
        self.cache[task] = {}
        self.ran[task] = set()

    def _counts(self, roots: list[Ref], cone: list[int] | None = None) -> dict[Ref, int]:
        """How many times a replay for ``roots`` reads each result: once per root, and once
        per argument of each node in their cone (``cone``, where it is known)."""
        uses: dict[Ref, int] = {}
        for ref in roots:
            uses[ref] = uses.get(ref, 0) + 1
        for index in self._cone(roots)[0] if cone is None else cone:
            for a in self.nodes[index].refs:
                uses[a] = uses.get(a, 0) + 1
        return uses

    def _use(self, ref: Ref, task: int) -> None:
        uses = self.uses[task]
        uses[ref] -= 1
        if uses[ref] <= 0:
            self.cache[task].pop(ref, None)

    def _value(self, ref: Ref, task: int) -> torch.Tensor | None:
        kept = self.nodes[ref.node].kept.get(ref.key)
        if kept is not None:
            tensor: torch.Tensor = kept.tensor
            if type(kept) is _Held and kept.source is not None:
                check_held(kept, "kept", self.nodes[ref.node].op)
            return tensor
        return self.cache[task].get(ref)

    def _materialize(self, ref: Ref, task: int) -> torch.Tensor:
        value = self._value(ref, task)
        if value is not None:
            return value
        cache, ran = self.cache[task], self.ran[task]
        if ref.node in ran:
            # Read a second time in this backward (a custom Function reading ctx.saved_tensors
            # twice): rebuild it on its own, with counts for its cone only.
            again = _state.made_up_task()
            self._count_uses(again, [ref])
            self.inputs_cache[again] = self.inputs_cache.get(task) or self._inputs()
            try:
                return self._materialize(ref, again)
            finally:
                self._end(again)
        with _Replaying():
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
        args, kwargs, out = self._call(index, node, task, cache)
        made: list[Ref] = []
        if type(out) is torch.Tensor and not node.writes:  # the common case: one new result
            ref = _new_ref((index, 0))
            if uses.get(ref, 0) > 0:  # cached only if a node or a slot still reads it
                cache[ref] = out
        else:
            results = out if isinstance(out, (tuple, list)) else (out,)
            for k, result in enumerate(results):
                if isinstance(result, torch.Tensor):
                    made.append(Ref(index, k))
                    cache[made[-1]] = result
                elif isinstance(result, (tuple, list)):
                    for j, t in enumerate(result):
                        made.append(Ref(index, ("l", k, j)))
                        cache[made[-1]] = t
            for position, name in node.writes:
                target = args[position] if position < len(args) else kwargs.get(name)
                if isinstance(target, torch.Tensor):
                    made.append(Ref(index, ("w", position)))
                    cache[made[-1]] = target
        for a in node.refs:  # ``_use``, inlined
            left = uses[a] - 1
            uses[a] = left
            if left <= 0:
                cache.pop(a, None)
        for r in made:
            if uses.get(r, 0) <= 0:
                cache.pop(r, None)

    def _call(
        self, index: int, node: Node, task: int, cache: dict[Ref, torch.Tensor]
    ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """Run ``node``'s op with the generator state it drew from; its resolved arguments (what
        it wrote) and its result."""
        if node.blank is not None:
            return (), {}, node.blank.empty()
        written: frozenset[int | str] = (
            frozenset([p for p, _ in node.writes] + [n for _, n in node.writes])
            if node.writes
            else _NOTHING_WRITTEN
        )

        def resolve_arg(value: Any, position: int | str | None = None) -> Any:
            if isinstance(value, Ref):
                t = self._value(value, task)
                if t is None:
                    raise CheckpointError(
                        f"remat: replaying {node.op} in {node.module or '(top)'} needs a result "
                        f"of {self.nodes[value.node].op} that is gone."
                    )
                if position in written and self._shared(value, t, task):
                    # another consumer still needs the state before this write
                    t = copy_with_layout(t)
                return t
            if isinstance(value, _Input):
                t = self._input(value.index, task)
                return copy_with_layout(t) if position in written else t  # never write a live input
            if isinstance(value, _Meta):
                return value.stand_in()
            if isinstance(value, _External):
                if value.snapshot is not None:
                    return value.snapshot
                if value.version != NO_COUNTER and value.tensor._version != value.version:
                    raise CheckpointError(
                        f"remat: {node.op} in {node.module or '(top)'} read a tensor from outside "
                        "the region (a parameter, a buffer) that was modified in place after the "
                        "forward pass (an optimizer step, an EMA update or a clamp between "
                        "forward and backward); its replayed result would differ and the "
                        "gradients would be wrong. Run backward before modifying it."
                    )
                return value.tensor
            if isinstance(value, _Held):
                check_held(value, "read", node.op)
                return copy_with_layout(value.tensor) if position in written else value.tensor
            return value

        layout = node.layout
        if layout is None or node.writes:
            args = tuple(
                resolve_arg(a, i) if isinstance(a, _RECORDED) else _map_recorded(resolve_arg, a)
                for i, a in enumerate(node.args)
            )
        else:
            # Records sit only where the schema says tensors can be (see ``ArgLayout``); the
            # common case of ``resolve_arg`` inlined: this loop runs for every replayed op.
            nodes = self.nodes
            resolved = list(node.args)
            n = len(resolved)
            for i in layout.tensors:
                if i >= n:
                    break
                a = resolved[i]
                if type(a) is Ref:
                    kept = nodes[a.node].kept.get(a.key)
                    if kept is None:
                        t = cache.get(a)
                    else:
                        t = kept.tensor
                        if type(kept) is _Held and kept.source is not None:
                            check_held(kept, "kept", nodes[a.node].op)
                    resolved[i] = t if t is not None else resolve_arg(a)
                elif isinstance(a, _RECORDED):
                    resolved[i] = resolve_arg(a)
            for i in layout.lists:
                if i < n:
                    resolved[i] = _map_recorded(resolve_arg, resolved[i])
            args = tuple(resolved)
        device: dict[str, Any] = {}
        if node.args and type(node.args[0]) is _Meta and node.kwargs.get("device") is None:
            # The op made its result where its argument lived, not on the meta stand-in.
            device = {"device": node.args[0].device}
        kwargs = (
            {
                k: resolve_arg(v, k) if isinstance(v, _RECORDED) else _map_recorded(resolve_arg, v)
                for k, v in node.kwargs.items()
            }
            if node.kwargs
            else {}
        )
        states = node.rng
        if states is None:
            return args, kwargs, node.op._op(*args, **kwargs, **device)
        if node.after is not None:
            states = self.rng_after[task].pop(node.after)
        with _replay_rng(states):
            out = node.op(*args, **kwargs, **device)
            if node.feeds:
                self.rng_after.setdefault(task, {})[index] = [(g, g.get_state()) for g, _ in states]
        return args, kwargs, out


def check_held(held: _Held, how: str, op: Any = None) -> None:
    """Raise when the program wrote a tensor the region held from its forward pass, since it
    held it: see [ A recompute reads what its forward pass read ] 2 in ``_reads.py``. ``how``
    the region held it ("kept", "read", "saved for backward") and ``op``, the op that made or
    read it, go into the message only: this runs for every held value a replay reads."""
    source = held.source() if held.source is not None else None
    if source is not None and source._version != held.version:
        what = f"{how} (by {op})" if op is not None else how
        raise CheckpointError(
            f"remat: backward needs a tensor of shape {tuple(held.tensor.shape)} that a "
            f"graph-engine region {what} in its forward pass, and it was modified in place "
            f"since (its version was {held.version}, it is {source._version}): a parameter "
            "written by an optimizer step, an EMA update or a clamp between forward and "
            "backward, or an output written in place. Plain autograd raises here too. Run "
            "backward before modifying it, or modify a clone."
        )


_NOTHING_WRITTEN: frozenset[int | str] = frozenset()
_new_ref = functools.partial(tuple.__new__, Ref)  # Ref(node, key) without NamedTuple.__new__


class _Replaying:
    """Replays run without autograd and without autocast: they rebuild values recorded as they
    were computed."""

    __slots__ = ("autocast", "grad")

    def __enter__(self) -> None:
        self.grad = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        self.autocast: contextlib.ExitStack | None = None
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                self.autocast = self.autocast or contextlib.ExitStack()
                self.autocast.enter_context(torch.autocast(device_type, enabled=False))

    def __exit__(self, *exc: object) -> None:
        if self.autocast is not None:
            self.autocast.close()
        torch.set_grad_enabled(self.grad)


@contextlib.contextmanager
def _replay_rng(states: list[tuple[Any, torch.Tensor | None]]) -> Iterator[None]:
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
