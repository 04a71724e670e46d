"""Profile a model for planning: its repeated blocks, and each block type's recorded ops.

A *block* is one of the repeated submodules of the model (a transformer's layers): the
children of the largest ``nn.ModuleList`` or ``nn.Sequential`` whose children share a class,
or the modules the user names with ``blocks=``. Blocks with the same class, parameter shapes
and input shapes form one *block type*, profiled and solved once.

A block type is profiled by running one block (a copy, so that the model's buffers and random
state stay as they are) as a graph-engine region whose policy keeps everything and writes down
what the engine sees: each ATen op with its module path, its occurrence within that module's
call, its output bytes (a view holds its whole storage), the earlier ops it reads, and whether
autograd saves its output. A second, plain run of the block times each op (median of repeats).

NOTE [ Op keys ]

A decision is keyed ``module|op|occurrence``: the module path relative to the block (the
block itself is its class name), the op's overload name, and how many times that op ran in that
module before, within one call of the block. Keys never use a global op counter, so a forward
that runs another branch or other shapes still finds its decisions for the ops it shares with
the profiled one, and the ops it does not share are simply kept.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import _state
from .._aten import op_info, storage_key
from .._cache import cache_arguments, describe
from .._dispatch import EagerMode
from .._nodes import _BLANK, _Input
from ..checkpoint import links
from ..errors import RematError
from ..modules import checkpoint_wrapper
from ..policies import Decision, OpContext, must_save_reason
from ._autocast import loop_forward

__all__: list[str] = []


@dataclass
class OpRecord:
    """One recorded op of a block: see [ Op keys ]."""

    key: str
    bytes: int
    saved: bool
    deps: tuple[int, ...]
    must_save: bool
    view: bool = False  # its results alias its arguments (or are blank): rebuilt for free
    seconds: float = 0.0


@dataclass
class BlockProfile:
    """What one block type does in forward, as the graph engine records it."""

    name: str  # the block type: its class name and a signature number
    ops: list[OpRecord]
    forward_seconds: float = 0.0
    # Each of the block's tensor inputs that autograd saves in its forward (a first
    # LayerNorm's input), by bytes: what ``remat.offload`` moves besides the ops' results.
    saved_inputs: list[int] = field(default_factory=list)
    # The bytes of each storage autograd saves in the block's forward, once per storage,
    # whether it saves the tensor or views of it (the block's inputs among them, its
    # parameters and buffers not): what ``remat.offload``, which decides by storage, moves.
    # None for a profile made without it (by hand).
    saved_storages: list[int] | None = None


@dataclass
class Blocks:
    """The blocks of a model in forward order, with their captured inputs and types."""

    paths: list[str]
    types: list[str]
    inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    # The blocks whose first call took the output of the block before them in ``paths``, called
    # just before, as it was: segments of such blocks run on the region engine (see
    # [ Segments on the region engine ] in ``apply.py``).
    linked: set[str] = field(default_factory=set)
    # Block type -> the type that a copy of such a block has when the block before it is
    # another copy, fed its first output (see ``planner._Chain``), where a block of the model
    # has that type and it is not the block's own: a first block whose input needs no gradient
    # is followed by blocks whose input does. A segment measured on copies of the first block
    # covers such followers (see [ Segments ] in ``solve.py``).
    chained: dict[str, str] = field(default_factory=dict)
    # Per block, its side inputs' storages (``side_inputs``) that the plain step frees by its
    # forward's end: ``storage_key`` -> bytes.
    side: dict[str, dict[int, int]] = field(default_factory=dict)
    # The blocks found that ran and computed no gradient (frozen, fed an input that needs
    # none), left out of the plan.
    frozen: list[str] = field(default_factory=list)
    # The path of each block call of the step's forward, in order (weights shared across depth
    # call one block several times: each call is a position of the planner's chain).
    order: list[str] = field(default_factory=list)


def op_key(module: str, op: Any, occurrence: int) -> str:
    return f"{module}|{op}|{occurrence}"


class KeyCounter:
    """Occurrence numbers of ``(module, op)`` pairs within one call of a block."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, Any], int] = {}

    def reset(self) -> None:
        self.counts = {}

    def key(self, module: str, op: Any) -> str:
        n = self.counts.get((module, op), 0)
        self.counts[(module, op)] = n + 1
        return op_key(module, op, n)

    def __reduce__(self) -> tuple[type[KeyCounter], tuple[()]]:
        # The counts are scratch for the call under way, keyed by ATen op objects, which do
        # not pickle: a copy or a pickle of a planned model (``torch.save(model)`` between
        # steps) starts from none, as each call of the block does.
        return (KeyCounter, ())


# -- finding the blocks ------------------------------------------------------------------------


def _signature(module: nn.Module) -> tuple[Any, ...]:
    return (
        type(module).__qualname__,
        tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
    )


def find_blocks(model: nn.Module, blocks: Any = None) -> list[str]:
    """The paths of the model's blocks: those named (a path, a list of them, the path of an
    ``nn.ModuleList`` for its children, or a class), or else every child of an ``nn.ModuleList``
    or ``nn.Sequential`` that sits in a run of two or more of one class (runs in which some
    block has trainable parameters, where any run has such a block). A run inside a block is
    part of the block; a run of containers (stages) holding runs of their own gives way to
    those. Found none: ``[]`` (see :func:`shared_blocks`)."""
    names = dict(model.named_modules())
    if blocks is not None:
        if selects_by_class(blocks):
            found = _outermost([n for n, m in names.items() if isinstance(m, blocks) and n])
        else:
            found = _named_paths(model, names, blocks)
        if not found:
            raise RematError(
                f"remat.plan: blocks={blocks!r} matches no submodule of {type(model).__name__}; "
                "give submodule paths such as 'layers.0', or a module class."
            )
        return found
    runs: list[list[str]] = []
    for name, module in names.items():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            prefix = f"{name}." if name else ""
            runs += [[prefix + n for n in run] for run in _repeated_runs(module)]
    # Any block of a run may train: fine-tuning the last layers (LoRA on them) leaves the
    # first frozen.
    weighty = [
        run for run in runs if any(p.requires_grad for n in run for p in names[n].parameters())
    ]
    found = [n for run in (weighty or runs) for n in run]
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    found = [  # a stage (a container) of blocks is not a block: its blocks are
        n
        for n in found
        if not isinstance(names[n], containers) or not any(o.startswith(n + ".") for o in found)
    ]
    return _outermost(found)


_BLOCKS_TAKES = (
    "blocks= takes a submodule path ('layers.0'), a list or tuple of them (the path of an "
    "nn.ModuleList stands for its children), or a module class or tuple of classes"
)


def _named_paths(model: nn.Module, names: dict[str, nn.Module], blocks: Any) -> list[str]:
    """The paths ``blocks=`` names, each once and none inside another: a block is planned
    whole, so one named inside another (or twice) would be planned twice."""
    given = [blocks] if isinstance(blocks, str) else blocks
    if not isinstance(given, (list, tuple)) or not all(isinstance(n, str) for n in given):
        raise _not_paths(model, names, blocks)
    named: list[tuple[str, str]] = []  # each block's path, and the name given for it
    for n in given:
        container = names.get(n) if n else None
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)):  # never called: its
            named += [(f"{n}.{c}", n) for c in container._modules]  # children are the blocks
        else:
            named.append((n, n))
    missing = [n for n, _ in named if n not in names or not n]
    if missing:
        raise RematError(
            f"remat.plan: blocks= names {missing[0]!r}, which is not a submodule of "
            f"{type(model).__name__}; give submodule paths such as 'layers.0', or a "
            "module class."
        )
    for i, (path, name) in enumerate(named):
        twice = next((g for p, g in named[:i] if p == path), None)
        outer = next((p for p, _ in named if path.startswith(p + ".")), None)
        if twice is None and outer is None:
            continue
        if twice == name:
            what, fix = f"{name!r} twice", "name it once"
        elif twice is not None:  # once itself, once as a child of a ModuleList named
            listed = name if name != path else twice
            what = f"both {listed!r}, whose children are blocks, and {path!r}, one of them"
            fix = f"drop {path!r}"
        else:
            what = f"both {outer!r} and {name!r}, which is inside it"
            fix = f"drop {name!r}"
        raise RematError(
            f"remat.plan: blocks= names {what}; a block is planned whole, with the modules "
            f"inside it, so each is named once and none inside another: {fix}."
        )
    return [path for path, _ in named]


def _not_paths(model: nn.Module, names: dict[str, nn.Module], blocks: Any) -> RematError:
    """The error for a ``blocks=`` that is neither paths nor classes: a module, say."""
    items = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
    bad = next(b for b in items if not isinstance(b, str))
    found = type(bad).__name__
    if isinstance(bad, nn.Module):
        found = f"a {found} module"
    elif isinstance(bad, type):
        found = f"class {bad.__name__}"
    if bad is not blocks:
        found = f"a {type(blocks).__name__} holding {found}"
    path = next((n for n, m in names.items() if m is bad and n), None)
    if path is not None:
        fix = f"name that module by its path, blocks=[{path!r}], or by its class"
    elif isinstance(bad, nn.Module):
        fix = f"that module is not in {type(model).__name__}: name its blocks by path or class"
    else:
        fix = "give submodule paths such as 'layers.0', or a module class"
    return RematError(f"remat.plan: {_BLOCKS_TAKES}; got {found}. To plan it, {fix}.")


def no_blocks_found(model: nn.Module) -> RematError:
    """The error for a model in which neither :func:`find_blocks` nor :func:`shared_blocks`
    found a block."""
    return RematError(
        f"remat.plan: found no repeated blocks in {type(model).__name__} (two or more "
        "modules of one class next to each other in an nn.ModuleList or nn.Sequential, or one "
        "module with trainable parameters that the forward calls more than once); name them "
        "with blocks=['layers.0', ...] or blocks=BlockClass."
    )


def shared_blocks(model: nn.Module, step: Callable[..., Any]) -> list[str]:
    """The blocks of a model that shares weights across depth (ALBERT's layer, a looped
    transformer), for a model in which :func:`find_blocks` found none: the outermost
    submodules with trainable parameters that the forward of one ``step(forward_end)`` calls
    more than once, in the order of their first calls."""
    calls: dict[str, int] = {}
    forwarding = [True]

    def count(path: str) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            if forwarding:
                calls[path] = calls.get(path, 0) + 1

        return pre

    handles = [
        module.register_forward_pre_hook(count(path))
        for path, module in model.named_modules()
        if path and any(p.requires_grad for p in module.parameters())
    ]
    try:
        step(forwarding.clear)
    finally:
        for h in handles:
            h.remove()
    return _outermost([path for path, n in calls.items() if n > 1])


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` less those inside another of them: a block nested in a block is part of it."""
    return [n for n in paths if not any(n.startswith(o + ".") for o in paths)]


def selects_by_class(blocks: Any) -> bool:
    """Whether ``blocks=`` is a module class or a tuple of them: a selection, which like the
    default leaves out the blocks a step does not call or train, where paths must run."""
    return isinstance(blocks, type) or (
        isinstance(blocks, tuple) and bool(blocks) and all(isinstance(b, type) for b in blocks)
    )


def _repeated_runs(container: nn.Module) -> list[list[str]]:
    """The names of the children in runs of two or more of one class: the three ``Block``s of
    ``nn.Sequential(stem, Block, Block, Block, head)``."""
    children = list(container.named_children())
    runs: list[list[str]] = []
    start = 0
    for end in range(1, len(children) + 1):
        if end < len(children) and type(children[end][1]) is type(children[start][1]):
            continue
        if end - start >= 2:
            runs.append([name for name, _ in children[start:end]])
        start = end
    return runs


def _refuse_cache(path: str, module: nn.Module, args: Any, kwargs: Any) -> None:
    """Raise when a block runs with a key/value cache in the profiled step: each replay of the
    block, in profiling and in backward, would append to the cache again (see NOTE [ Key/value
    caches in training ] in ``hf.py``)."""
    if not torch.is_grad_enabled():
        return
    found = cache_arguments(module, args, kwargs)
    if found is None:
        return
    fix = (
        "Pass use_cache=False to the model, in example_inputs and in training, or plan with "
        "remat.hf.enable(model, budget=..., example_inputs=..., loss_fn=...), which drops "
        "the cache wherever gradients are on, as Hugging Face's gradient checkpointing does "
        "in training."
    )
    raise RematError(
        f"remat.plan: block {path!r} ({type(module).__name__}) runs with a key/value cache "
        f"({describe(*found)}); a replay of the block would append to the cache a second "
        f"time. {fix}"
    )


class _Collectives(EagerMode):
    """Notes the collectives (``c10d`` and functional collective ops) a step runs."""

    NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace in self.NAMESPACES:
            self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def capture(
    model: nn.Module, paths: list[str], step: Callable[..., Any], *, named: bool = True
) -> Blocks:
    """Run ``step(forward_end)`` once (forward and backward; it calls ``forward_end()`` where
    the forward and the loss end) and capture each block's inputs; blocks whose
    parameters and input shapes agree get one type name. The blocks come back in the order the
    forward calls them; a block it does not call is an error where the user ``named`` the
    blocks, and left out where ``find_blocks`` found them (a model's evaluation-only heads)."""
    names = dict(model.named_modules())
    found = Blocks(paths=list(paths), types=[])
    handles = []
    forwarding = [True]  # emptied where the forward and the loss end

    def hook(path: str) -> Any:
        def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
            if forwarding:  # not a call the backward makes (a user's own checkpoint)
                found.order.append(path)
            if path not in found.inputs:
                _refuse_cache(path, module, args, kwargs)
                for t in side_inputs((args, kwargs)):
                    key = storage_key(t)
                    assert key is not None  # ``side_inputs`` takes plain storages only
                    side.setdefault(key, t.untyped_storage())
                    found.side.setdefault(path, {})[key] = t.untyped_storage().nbytes()
                found.inputs[path] = pytree.tree_map_only(
                    torch.Tensor,
                    lambda t: t.detach().clone().requires_grad_(t.requires_grad),
                    (args, kwargs),
                )

        return pre

    # The last block call's output leaves and their versions, for ``found.linked``.
    last: dict[str, Any] = {"path": None, "outputs": []}

    def link(path: str, args: Any, kwargs: Any) -> None:
        before = paths.index(path) - 1
        if path in found.inputs or before < 0 or last["path"] != paths[before]:
            return
        if links(last["outputs"], args, kwargs):
            found.linked.add(path)

    # Each block's first output tensor, at its first call: shape, dtype, requires_grad.
    first_out: dict[str, tuple[tuple[int, ...], torch.dtype, bool]] = {}
    trains: set[str] = set()  # the blocks that returned a tensor that requires grad

    def returned(path: str, out: Any) -> None:
        leaves = enumerate(pytree.tree_leaves(out))
        outputs = [(i, t, t._version) for i, t in leaves if isinstance(t, torch.Tensor)]
        last["path"], last["outputs"] = path, outputs
        if outputs and path not in first_out:
            t = outputs[0][1]
            first_out[path] = (tuple(t.shape), t.dtype, t.requires_grad)
        if any(t.requires_grad for _, t, _ in outputs):
            trains.add(path)

    for path in paths:
        module = names[path]
        handles.append(
            module.register_forward_pre_hook(
                lambda m, a, k, path=path: link(path, a, k), with_kwargs=True
            )
        )
        handles.append(module.register_forward_pre_hook(hook(path), with_kwargs=True))
        handles.append(
            module.register_forward_hook(lambda m, a, out, path=path: returned(path, out))
        )
    # The blocks' side inputs' storages by ``storage_key``, held to the step's end: no other
    # storage takes the key of one freed before, so two blocks got the same tensor where keys
    # agree. Those the plain step still uses at its forward's end (an embedding saves the
    # position ids it read) are live in its backward whatever the blocks hold.
    side: dict[int, torch.UntypedStorage] = {}

    def forward_end() -> None:
        forwarding.clear()
        for address, storage in side.items():
            if used_elsewhere(storage):
                for got in found.side.values():
                    got.pop(address, None)

    collectives = _Collectives()
    # A collective needs a process group: without one, the step runs under no mode of ours.
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        with collectives if distributed else contextlib.nullcontext():
            step(forward_end)
    finally:
        for h in handles:
            h.remove()
        last.clear()
        side.clear()
    if collectives.seen:
        raise RematError(
            f"remat.plan: the training step runs a collective ({collectives.seen[0]}: a "
            "SyncBatchNorm, a tensor- or expert-parallel layer, a loss reduced across ranks). "
            "The planner runs the step and each block as many times as its measurements "
            "take, which differs from rank to rank, so the ranks' collectives would not "
            "pair (a hang or a size mismatch). Choose by hand, the same on every rank: "
            "remat.apply(model, Block) recomputes each block (and runs its collectives "
            "again in backward), or plan a copy of the model whose layers run no collective "
            "(a BatchNorm in place of SyncBatchNorm) and set that plan up on every rank."
        )
    # Blocks found that the step does not call, or whose output needs no gradient (frozen, fed
    # an input that needs none: autograd saves nothing in them), are left out.
    ran = [path for path in found.inputs if named or path in trains]
    if not ran:
        raise RematError(
            f"remat.plan: none of the blocks found in {type(model).__name__} ({paths[0]!r}, "
            "...) ran in the example step with a gradient to compute (a block whose "
            "parameters are frozen and whose input needs no gradient saves nothing for "
            "backward); give blocks= that the forward calls and trains."
        )
    if ran != paths and (not named or len(ran) == len(paths)):
        again = capture(model, ran, step)  # again, in forward order: ``link`` reads it
        again.frozen = [p for p in found.inputs if p not in trains]
        return again
    signatures: dict[Any, str] = {}
    followers: dict[str, Any] = {}  # type -> the signature of its chain's next copy
    for path in paths:
        if path not in found.inputs:
            raise RematError(
                f"remat.plan: block {path!r} did not run in the example step; give blocks= "
                "that the forward calls."
            )
        if path not in trains:
            raise RematError(
                f"remat.plan: block {path!r} returned no tensor that requires grad (its "
                "parameters are frozen and its input needs no gradient), so autograd saves "
                "nothing in it and there is nothing to plan; leave it out of blocks=."
            )
        shapes = tuple(
            (tuple(t.shape), t.dtype, t.requires_grad)
            for t in pytree.tree_leaves(found.inputs[path])
            if isinstance(t, torch.Tensor)
        )
        sig = (_signature(names[path]), shapes)
        if sig not in signatures:
            signatures[sig] = f"{type(names[path]).__name__}#{len(signatures)}"
        found.types.append(signatures[sig])
        out = first_out.get(path)
        if out is not None and shapes and shapes[0][:2] == out[:2]:
            # The chain feeds the first output to the first argument (``planner._Chain``).
            followers[signatures[sig]] = (sig[0], (out, *shapes[1:]))
    for t, sig in followers.items():
        follower = signatures.get(sig)
        if follower is not None and follower != t:
            found.chained[t] = follower
    return found


# -- recording one block -------------------------------------------------------------------------


class _Observer:
    """A keep-everything policy that writes down what the graph engine records."""

    def __init__(self) -> None:
        self.counter = KeyCounter()
        self.graph: Any = None
        self.ops: list[OpRecord] = []

    def __call__(self, ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if ctx.tags:
            return Decision.PREFER_SAVE
        graph = _state.state.graph  # None inside a region-engine region of the block
        if graph is not None:
            self.graph = graph
        # The earlier ops it reads, as the engine recorded them for its replay (a read of an
        # argument's shape only, as ``empty_like``'s, is none).
        deps = {ref.node for ref in graph._refs} if graph is not None else set()
        self.ops.append(
            OpRecord(
                key=self.counter.key(ctx.module, op),
                bytes=int(ctx.output_bytes or 0),
                saved=False,
                deps=tuple(sorted(deps)),
                must_save=must_save_reason(op) is not None,
                # A view is rebuilt from its base; a blank result (``empty_like``) by an
                # allocation: neither is ever stored, so neither is kept nor offloaded.
                view=not op_info(op).any_fresh or op.overloadpacket.__name__ in _BLANK,
            )
        )
        return Decision.PREFER_SAVE


class _Timer(EagerMode):
    """Times each op a plain forward runs: on the CPU, its wall time; on CUDA, the longer of
    the host's time to launch it and the device's time to run it (CUDA events around it, read
    once the forward is over), whichever bounds a replay of the op."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.cuda = device.type == "cuda"
        # The stream the block's ops are queued on: that of its own device, which need not be
        # the current one.
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.host: list[float] = []
        self.events: list[tuple[Any, Any]] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.cuda:
            began = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ended = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            began.record(self.stream)
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.host.append(time.perf_counter() - start)
        if self.cuda:
            ended.record(self.stream)
            self.events.append((began, ended))
        return out

    def seconds(self) -> list[float]:
        if not self.cuda:
            return self.host
        synchronize(self.device)
        device = [began.elapsed_time(ended) / 1e3 for began, ended in self.events]
        return [max(h, d) for h, d in zip(self.host, device, strict=True)]


def device_of(module: nn.Module, inputs: Any = None) -> torch.device:
    """Where ``module`` runs: its parameters' device, else that of the first tensor among
    ``inputs``, else the CPU."""
    param = next(module.parameters(), None)
    if param is not None:
        return param.device
    tensor = next((t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: a step is timed, or measured, to its end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], Any], device: torch.device) -> float:
    """Seconds of ``run()``, to the end of its work on ``device``."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def fresh_inputs(
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """New leaf copies of a block's captured inputs."""
    out: tuple[tuple[Any, ...], dict[str, Any]] = pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), inputs
    )
    return out


def side_inputs(inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> list[torch.Tensor]:
    """A block's side inputs: the tensors it is called with besides its first argument that
    need no gradient (an attention mask, position ids), one per storage. A model's forward
    makes them once and passes them to every block; what a block holds of them for its
    backward lives as long as the block needs it, where a plain block may hold none. Only
    tensors with a plain storage count (``storage_key``): a subclass (a ``DTensor``) may have
    none to follow."""
    args, kwargs = inputs
    found: dict[int, torch.Tensor] = {}
    for t in pytree.tree_leaves((args[1:], kwargs)):
        if isinstance(t, torch.Tensor) and not t.requires_grad:
            key = storage_key(t)
            if key is not None:
                found.setdefault(key, t)
    return list(found.values())


def used_elsewhere(storage: torch.UntypedStorage) -> bool:
    """Whether anything besides the caller's reference to ``storage`` uses it: a tensor on it,
    a tensor autograd saved, a recompute's record."""
    return int(torch._C._storage_Use_Count(storage._cdata)) > 1


def grad_outputs(out: Any) -> list[torch.Tensor]:
    """Every tensor of a block's output that requires grad, for a backward through all of
    them: a block that also returns an auxiliary loss (a mixture of experts' balancing term)
    saves for it too, and a backward through the first alone would leave that held."""
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        first_tensor(out)  # raises, saying why
    return outs


def first_tensor(out: Any) -> torch.Tensor:
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    raise RematError(
        "remat.plan: a block returned no tensor that requires grad; blocks must be on the "
        "path from parameters to the loss."
    )


def copy_block(block: nn.Module, name: str) -> nn.Module:
    """A deep copy of ``block``, which the planner measures options on; a block that cannot
    be copied raises, saying why."""
    try:
        return copy.deepcopy(block)
    except RuntimeError as e:
        raise RematError(
            f"remat.plan: the planner measures each block type on copies of a block, and "
            f"blocks of type {name} cannot be deep-copied ({e}). A module that keeps a "
            "computed tensor as an attribute does this: torch.nn.utils.spectral_norm and "
            "weight_norm do; their torch.nn.utils.parametrizations versions copy, and plan."
        ) from e


def profile_block(
    block: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    name: str,
    device: torch.device,
    repeats: int = 3,
) -> BlockProfile:
    """Record ``block``'s ops under the graph engine and time them in plain runs on
    ``device``."""
    observed = copy_block(block, name)
    observer = _Observer()
    checkpoint_wrapper(observed, policy=observer)
    args, kwargs = fresh_inputs(inputs)
    torch.manual_seed(0)
    with loop_forward():
        out = first_tensor(observed(*args, **kwargs))
    graph = observer.graph
    saved_inputs: dict[int | None, int] = {}  # by storage
    # Every storage autograd saved, by ``storage_key``: all of them are alive here (the
    # recording holds what it kept), so no two share a key.
    storages: dict[int, int] = {}
    state = {
        key
        for t in (*observed.parameters(), *observed.buffers())
        if (key := storage_key(t)) is not None
    }
    if graph is not None:
        tensors = graph.saved_inputs.tensors if graph.saved_inputs is not None else ()
        for packed in graph.packed:
            ref = getattr(packed(), "ref", None)
            node = getattr(ref, "node", None)
            saved: torch.Tensor | None = None
            if isinstance(node, int) and node < len(observer.ops):
                observer.ops[node].saved = True
                held = graph.nodes[node].kept.get(getattr(ref, "key", None))
                saved = getattr(held, "tensor", None)
            elif isinstance(ref, _Input) and ref.index < len(tensors):
                saved = tensors[ref.index]
                saved_inputs[storage_key(saved)] = saved.untyped_storage().nbytes()
            if saved is not None and (key := storage_key(saved)) is not None and key not in state:
                storages[key] = saved.untyped_storage().nbytes()
    del out
    ops = observer.ops
    plain = copy.deepcopy(block)
    runs: list[list[float]] = []
    totals: list[float] = []

    def forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with loop_forward():
            plain(*args, **kwargs)

    for _ in range(repeats):
        args, kwargs = fresh_inputs(inputs)
        torch.manual_seed(0)
        timer = _Timer(device)
        with torch.no_grad(), loop_forward(), timer:
            plain(*args, **kwargs)
        runs.append(timer.seconds())
        # What the region engine's recompute costs: the forward with autograd recording.
        totals.append(timed(functools.partial(forward, *fresh_inputs(inputs)), device))
    if all(len(r) == len(ops) for r in runs):
        for i, op in enumerate(ops):
            op.seconds = statistics.median(r[i] for r in runs)
    else:  # the plain run dispatches other ops than the recording: share its time evenly
        share = statistics.median(totals) / max(len(ops), 1)
        for op in ops:
            op.seconds = share
    return BlockProfile(
        name=name,
        ops=ops,
        forward_seconds=statistics.median(totals),
        saved_inputs=list(saved_inputs.values()),
        saved_storages=list(storages.values()) if graph is not None else None,
    )
