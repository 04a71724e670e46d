"""``remat.explain``: what a forward pass saves for backward, and what remat does with it.

People debug out-of-memory errors from allocator snapshots because nothing says what autograd
saved, where, and why. :func:`explain` runs one forward pass and lists every tensor saved for
backward: the module it was saved in, the operator that produced it, its shape, dtype and size,
and its fate: kept, recomputed by remat (and by which engine), or offloaded. It is to eager
PyTorch what ``jax.ad_checkpoint.print_saved_residuals`` is to traced JAX.

How each fact is found:

* **saved tensors**: an outermost ``saved_tensors_hooks`` sees what plain autograd keeps; inside
  remat's regions remat's own hooks take over and report each tensor to the active observer
  (``_state.SaveObserver``) with the decision they make.
* **producing operator**: a ``TorchDispatchMode`` remembers, for each storage, the last operator
  that allocated or wrote it (so a dropout mask is the ``bernoulli_`` that filled it, not the
  ``empty_like`` that made it), and the module it ran in. A saved view is attributed to the
  operator behind its storage. Tensors made before the forward pass are ``input`` or
  ``parameter``. Storages are held weakly and told apart from later storages at the same
  address, so what the forward pass frees is not confused with what it allocates next.
* **module**: forward pre- and post-hooks keep the stack of qualified module names.

NOTE [ What a graph region holds ]

A graph-engine region decides per op, but what it holds after forward is decided per storage,
at region exit (``remat.graph``, [ Life of a replayed tensor ] 2). The decision of the op that
made a saved tensor is not its fate:

1. a saved view (``F.linear`` saves its ``addmm`` result as a ``view``) is rebuilt by a cheap
   view op, but its bytes are those of the result it views: kept if the engine kept that
   result, offloaded if it moved it to a tier, recomputed only if neither;
2. the engine holds results that no backward formula saves, when a saved tensor is rebuilt
   from them (``h = x @ w; (h * 2).sin()`` under ``save_matmuls`` keeps ``h`` to rebuild
   ``h * 2``): each gets a row of its own, "held to rebuild saved tensors";
3. parameters are held by the model whatever a region does with the views it saved of them.

So each row saved in a graph region is settled once the forward pass is over, from the
engine's records, and the totals are what the forward pass leaves allocated (the tests check
them against ``remat.MemoryTracker`` and the disk tier's stored bytes for each policy).

The forward pass leaves the model as it found it (NOTE [ Putting a model back ] in
``_found.py``): its buffers, their versions, and the random state it draws from, so explaining
a model does not change its training, even between a step's forward and its backward.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import _state
from ._aten import op_info
from ._aten import storage_key as _key
from ._dispatch import EagerMode
from ._found import accelerators, as_found, modules_reached
from ._nodes import Ref, _Input
from .errors import RematError
from .modules import unwrapped
from .store._store import Saved

__all__ = ["SavedTensor", "SavedTensorReport", "explain"]

SortKey = Literal["order", "bytes", "module", "op", "decision"]
_SORT_KEYS = ("order", "bytes", "module", "op", "decision")


@dataclass(frozen=True)
class SavedTensor:
    """One tensor saved for backward during the explained forward pass."""

    order: int
    module: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int  # the tensor's own elements; see ``storage_bytes`` for what it keeps alive
    storage_bytes: int
    shared: bool  # its storage was already listed by an earlier row
    kind: Literal["activation", "parameter", "buffer", "input"]
    decision: _state.Decision
    how: str


@dataclass(frozen=True)
class ModuleTotals:
    """Bytes saved in one module, by unique storage, split by what remat does with them."""

    kept_bytes: int = 0
    recomputed_bytes: int = 0
    offloaded_bytes: int = 0
    tensors: int = 0


@dataclass(frozen=True)
class SavedTensorReport:
    """Every tensor saved for backward in one forward pass; printable, sortable, exportable.

    Totals count each storage once and leave parameters and buffers out: the model holds them
    anyway.
    """

    rows: list[SavedTensor] = field(default_factory=list)

    @property
    def kept_bytes(self) -> int:
        """Activation bytes autograd holds between forward and backward."""
        return self._total("keep")

    @property
    def recomputed_bytes(self) -> int:
        """Activation bytes remat drops in forward and rebuilds in backward."""
        return self._total("recompute")

    @property
    def offloaded_bytes(self) -> int:
        """Activation bytes remat moves to a slower tier until backward."""
        return self._total("offload")

    def _total(self, decision: str) -> int:
        return sum(
            r.storage_bytes
            for r in self.rows
            if r.decision == decision and not r.shared and r.kind in ("activation", "input")
        )

    def by_module(self) -> dict[str, ModuleTotals]:
        """Totals per module, in the order modules first saved something."""
        totals: dict[str, ModuleTotals] = {}
        for r in self.rows:
            t = totals.get(r.module, ModuleTotals())
            size = 0 if r.shared or r.kind in ("parameter", "buffer") else r.storage_bytes
            totals[r.module] = replace(
                t,
                kept_bytes=t.kept_bytes + (size if r.decision == "keep" else 0),
                recomputed_bytes=t.recomputed_bytes + (size if r.decision == "recompute" else 0),
                offloaded_bytes=t.offloaded_bytes + (size if r.decision == "offload" else 0),
                tensors=t.tensors + 1,
            )
        return totals

    def sorted(self, by: SortKey = "bytes", descending: bool | None = None) -> SavedTensorReport:
        """The same rows sorted by a column (``bytes`` descending by default)."""
        if by not in _SORT_KEYS:
            raise RematError(
                f"remat.explain: cannot sort by {by!r}; expected one of {', '.join(_SORT_KEYS)}."
            )
        reverse = (by == "bytes") if descending is None else descending
        return SavedTensorReport(sorted(self.rows, key=lambda r: getattr(r, by), reverse=reverse))

    def table(self, limit: int | None = None) -> str:
        """A text table of the rows, then totals by module. ``limit`` caps both lists: at most
        ``limit`` rows and ``limit`` modules are printed, each list followed by how many it
        left out (``0`` prints the totals alone)."""
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        ):
            raise RematError(
                f"remat.explain: table(limit={limit!r}): expected a number of rows >= 0, or None "
                "for every row."
            )
        header = ("#", "module", "op", "shape", "dtype", "MiB", "remat")
        lines = [
            (
                str(r.order),
                r.module or "(top)",
                r.op,
                "x".join(map(str, r.shape)) or "scalar",
                r.dtype.replace("torch.", ""),
                f"{r.bytes / 2**20:.3f}" + ("*" if r.shared else ""),
                f"{r.decision} ({r.how})",
            )
            for r in self.rows[:limit]
        ]
        widths = [max([len(h), *(len(line[i]) for line in lines)]) for i, h in enumerate(header)]
        out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
        out += [
            "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in lines
        ]
        if not self.rows:
            out.append("(nothing saved for backward)")
        elif len(lines) < len(self.rows):
            out.append(f"... {len(self.rows) - len(lines)} more rows")
        out.append("* storage shared with an earlier row, counted once in totals")
        out.append("")
        out.append("totals by module (MiB): kept / recomputed / offloaded")
        modules = list(self.by_module().items())
        for name, t in modules[:limit]:
            out.append(
                f"  {name or '(top)'}: {t.kept_bytes / 2**20:.3f} / "
                f"{t.recomputed_bytes / 2**20:.3f} / {t.offloaded_bytes / 2**20:.3f}"
            )
        if limit is not None and len(modules) > limit:
            out.append(f"  ... {len(modules) - limit} more modules")
        out.append(
            f"total: kept {self.kept_bytes / 2**20:.3f} MiB, recomputed "
            f"{self.recomputed_bytes / 2**20:.3f} MiB, offloaded "
            f"{self.offloaded_bytes / 2**20:.3f} MiB"
        )
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """The rows, totals by module and totals, as plain Python values."""
        return {
            "rows": [asdict(r) for r in self.rows],
            "by_module": {k: asdict(v) for k, v in self.by_module().items()},
            "kept_bytes": self.kept_bytes,
            "recomputed_bytes": self.recomputed_bytes,
            "offloaded_bytes": self.offloaded_bytes,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


class _StorageMap:
    """Storage -> value, for storages still alive; a freed storage's address may be reused."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[StorageWeakRef, Any]] = {}

    def set(self, t: torch.Tensor, value: Any) -> None:
        key = _key(t)
        if key is not None:
            self._items[key] = (StorageWeakRef(t.untyped_storage()), value)  # type: ignore[no-untyped-call]

    def get(self, t: torch.Tensor) -> Any:
        key = _key(t)
        item = self._items.get(key) if key is not None else None
        if item is None or item[0].expired():  # type: ignore[no-untyped-call]
            return None
        return item[1]


class _Producers(EagerMode):
    """Remembers which operator, in which module, allocated each storage."""

    def __init__(self, modules: list[str]) -> None:
        super().__init__()
        self.modules = modules
        self.producer = _StorageMap()

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        info = op_info(func)
        name = func.overloadpacket.__name__
        for position, arg_name in info.writes:
            target = args[position] if position < len(args) else kwargs.get(arg_name)
            if isinstance(target, torch.Tensor):
                self.producer.set(target, (name, self.modules[-1]))
        if info.any_fresh:
            results = out if isinstance(out, (tuple, list)) else (out,)
            for t in results:
                if isinstance(t, torch.Tensor):
                    self.producer.set(t, (name, self.modules[-1]))
        return out


class _GraphRow(NamedTuple):
    """A row saved in a graph-engine region, and the result whose storage it is."""

    row: int
    graph: Any
    ref: Any  # the saved tensor's own reference in the graph
    owner: Any  # the ``Ref`` of the result owning its storage, or a non-``Ref`` (input, held)


class _Explainer:
    def __init__(
        self,
        held: dict[int, Literal["parameter", "buffer"]],
        producers: _Producers,
        modules: list[str],
    ) -> None:
        self.held = held  # storage -> what of the model's state it is
        self.producers = producers
        self.modules = modules
        self.rows: list[SavedTensor] = []
        self.seen = _StorageMap()
        self.graph_rows: list[_GraphRow] = []

    def saved(self, t: torch.Tensor, decision: _state.Decision, how: str) -> None:
        key = _key(t)
        shared = self.seen.get(t) is not None
        self.seen.set(t, True)
        produced = self.producers.producer.get(t)
        kind: Literal["activation", "parameter", "buffer", "input"]
        op: str
        if key is not None and key in self.held:
            kind = op = self.held[key]
        elif produced is not None:
            kind, op = "activation", produced[0]
        else:
            kind, op = "input", "input"
        if kind in ("parameter", "buffer") and decision == "recompute":
            # The engine rebuilds the view it saved (``weight.t()``), but the bytes are the
            # parameter's or buffer's, held by the model whatever remat does.
            decision, how = "keep", f"{how}: a {kind}, held by the model"
        graph = _state.state.graph if how.startswith("graph engine") else None
        if graph is not None:
            ref, owner = _owner(graph, t)
            self.graph_rows.append(_GraphRow(len(self.rows), graph, ref, owner))
        self.rows.append(
            SavedTensor(
                order=len(self.rows),
                module=self.modules[-1],
                op=op,
                shape=tuple(t.shape),
                dtype=str(t.dtype),
                device=str(t.device),
                bytes=t.numel() * t.element_size(),
                storage_bytes=t.untyped_storage().nbytes() if key is not None else 0,
                shared=shared,
                kind=kind,
                decision=decision,
                how=how,
            )
        )

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        how = "region input" if _state.state.saving_region_inputs else "autograd"
        self.saved(t, "keep", how)
        # A detached alias: returning a saved output itself would tie it to its own grad_fn.
        return t.detach()

    def settle(self) -> None:
        """Once the forward pass is over: give each row saved in a graph-engine region the fate
        of its storage as the engine left it, and add a row for each result the engine holds
        that no saved tensor is a view of. See NOTE [ What a graph region holds ]."""
        owners: set[tuple[int, Any]] = set()
        offloaded: set[int] = set()
        for index, graph, ref, owner in self.graph_rows:
            row = self.rows[index]
            if isinstance(owner, Ref):
                owners.add((id(graph), owner))
            if row.kind in ("parameter", "buffer") or owner is None:
                continue
            if not isinstance(owner, Ref):
                how = _HOW_INPUT if isinstance(owner, _Input) else _HOW_OUTSIDE
                self.rows[index] = replace(row, decision="keep", how=how)
                continue
            node = graph.nodes[owner.node]
            kept = node.kept.get(owner.key)
            view = "" if owner == ref else f", a view of {node.op.overloadpacket.__name__}'s result"
            if kept is None:
                self.rows[index] = replace(row, decision="recompute", how="graph engine" + view)
            elif isinstance(kept, Saved):
                shared = row.shared or id(kept.stored) in offloaded
                offloaded.add(id(kept.stored))
                how = f"graph engine, {kept.store.tier.name} tier{view}"
                self.rows[index] = replace(row, decision="offload", how=how, shared=shared)
            else:
                self.rows[index] = replace(row, decision="keep", how="graph engine" + view)
        graphs = {id(g): g for _, g, _, _ in self.graph_rows}
        for graph in graphs.values():
            for number, node in enumerate(graph.nodes):
                for result, kept in node.kept.items():
                    if (id(graph), Ref(number, result)) not in owners:
                        self._held_for_replay(node, kept, offloaded)

    def _held_for_replay(self, node: Any, kept: Any, offloaded: set[int]) -> None:
        how = "graph engine, held to rebuild saved tensors"
        op, module = node.op.overloadpacket.__name__, node.module
        if isinstance(kept, Saved):
            size = math.prod(kept.shape) * kept.dtype.itemsize
            row = SavedTensor(
                len(self.rows), module, op, tuple(kept.shape), str(kept.dtype),
                str(kept.stored.device), size, kept.stored.nbytes,
                id(kept.stored) in offloaded, "activation", "offload",
                f"{how}, {kept.store.tier.name} tier",
            )  # fmt: skip
            offloaded.add(id(kept.stored))
        else:
            t = kept.tensor
            if _key(t) in self.held:  # a view of a parameter or buffer: held by the model
                return
            shared = self.seen.get(t) is not None
            self.seen.set(t, True)
            row = SavedTensor(
                len(self.rows), module, op, tuple(t.shape), str(t.dtype), str(t.device),
                t.numel() * t.element_size(), t.untyped_storage().nbytes(), shared,
                "activation", "keep", how,
            )  # fmt: skip
        self.rows.append(row)


_HOW_INPUT = "graph engine, the region's input"
_HOW_OUTSIDE = "graph engine, a tensor from outside the region, held as it is"


def _owner(graph: Any, t: torch.Tensor) -> tuple[Any, Any]:
    """``t``'s reference in ``graph`` and the result whose storage ``t`` is (following views),
    or ``(None, None)`` when the engine holds ``t`` as it is (read at another version)."""
    entry = graph.lookup(t)
    if entry is None or entry.version != t._version:
        return None, None
    owner = entry.ref
    while isinstance(owner, Ref):
        node = graph.nodes[owner.node]
        if owner.key in node.kept or not _is_view(node.op) or not node.args:
            break
        owner = node.args[0]
    return entry.ref, owner


def _is_view(op: Any) -> bool:
    """Whether ``op``'s result shares the storage of its first argument."""
    return bool(getattr(op, "is_view", False)) or op.overloadpacket.__name__ == "_unsafe_view"


@contextlib.contextmanager
def _module_stack(model: nn.Module | None, stack: list[str]) -> Iterator[None]:
    if model is None:
        yield
        return
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def pre(m: nn.Module, args: Any, name: str = name) -> None:
            stack.append(name)

        def post(m: nn.Module, args: Any, out: Any) -> None:
            stack.pop()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def explain(
    model_or_fn: nn.Module | Callable[..., Any], *inputs: Any, **kwargs: Any
) -> SavedTensorReport:
    """Run one forward pass of ``model_or_fn(*inputs, **kwargs)`` and report what it saves.

    Returns a :class:`SavedTensorReport`: one row per tensor saved for backward, with module,
    producing operator, shape, dtype, bytes, and what remat does with it. Print it for a table;
    ``.sorted("bytes")``, ``.by_module()``, ``.to_json()`` for the rest.

    The pass runs with gradients enabled and no backward; the random state is restored after it,
    and so are the buffers of a module (BatchNorm statistics), so explaining changes nothing. A
    model that ``torch.compile`` returned is explained through the module it wraps, in eager
    mode, where remat's decisions are made.

    Example::

        report = remat.explain(model, tokens)
        print(report.sorted("bytes").table(limit=20))
    """
    if not callable(model_or_fn):
        raise RematError(
            f"remat.explain: expected a module or a function, got {type(model_or_fn).__name__}."
        )
    if _state.state.observer is not None:
        raise RematError("remat.explain: already explaining on this thread; calls do not nest.")
    if torch.is_inference_mode_enabled():
        raise RematError(
            "remat.explain: called under torch.inference_mode(), where a forward pass saves "
            "nothing for backward, so the report would be empty. Explain outside it."
        )
    model_or_fn = unwrapped(model_or_fn)
    model = model_or_fn if isinstance(model_or_fn, nn.Module) else None
    modules = [""]
    # The models a function reaches (``lambda x: loss_fn(model(x), y)``): their parameters
    # are held, not activations, and their state is put back as for a model given.
    models = [model] if model is not None else modules_reached(model_or_fn)
    held: dict[int, Literal["parameter", "buffer"]] = {}
    for m in models:
        held.update((key, "buffer") for b in m.buffers() if (key := _key(b)))
        held.update((key, "parameter") for p in m.parameters() if (key := _key(p)))
    tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
    tensors += pytree.tree_leaves((inputs, kwargs))
    producers = _Producers(modules)
    explainer = _Explainer(held, producers, modules)
    _state.state.observer = explainer
    try:
        with as_found(models, accelerators(tensors)):
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.enable_grad())
                named = model if model is not None else _one_root(models)
                stack.enter_context(_module_stack(named, modules))
                hooks = torch.autograd.graph.saved_tensors_hooks(explainer.pack, _same)
                stack.enter_context(hooks)
                stack.enter_context(producers)
                out = model_or_fn(*inputs, **kwargs)
            explainer.settle()  # while ``out`` keeps the graph, and so the records, alive
            # The hook in each saved variable holds the explainer: were the graph-engine
            # records still reachable from it, they would hold the graph in a cycle through
            # autograd's C++ nodes, and what the regions offloaded would stay, files and all.
            explainer.graph_rows.clear()
            del out
    finally:
        _state.state.observer = None
    return SavedTensorReport(explainer.rows)


def _one_root(modules: list[nn.Module]) -> nn.Module | None:
    """The one module of ``modules`` that holds all the others, if there is one: a function
    that runs one model (``lambda x: loss_fn(model(x), y)``) has its rows named by that
    model's modules."""
    inner = {id(c) for m in modules for c in m.modules() if c is not m}
    roots = [m for m in modules if id(m) not in inner]
    return roots[0] if len(roots) == 1 else None


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
