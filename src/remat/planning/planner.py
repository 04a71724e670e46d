"""``remat.plan`` and ``remat.fit``: profile, measure, solve, and hand back a :class:`Plan`.

The steps, each in its own module: find the blocks and capture their inputs
(``profile.py``), measure the plain step and each block type's options (``cost.py``), solve
per block type for a Pareto set of per-op options and over the chain for the budget
(``solve.py``), and write it all down (``_plan.py``). Planning leaves the model as it found
it: parameters, gradients, buffers (BatchNorm statistics) and the random generators.

NOTE [ Offloaded options ]

With an offload tier (``tiers=["recompute", "disk"]``), each block type gets options that send
what it saves there, measured like the others (the tier's memory is in the allocator's events:
see NOTE [ Memory the allocator sees ] in ``store/disk.py``):

* ``offload-disk``: the block inside ``remat.offload("disk")``, everything it saves written
  out. What this option adds to a block's step, per byte moved, is the tier's cost per byte in
  the block MILP (see [ The block MILP ] in ``solve.py``); the tier's bandwidths while the block
  computed go into the plan.
* ``region-disk``, ``segment-N-disk``: a region or a segment whose input waits in the tier.
* ``graph-K-disk``: the MILP's per-op choices with the tier among them.

A block's writes finish by the end of its forward (the scope or region flushes the tier
there), but how many are still pending at any moment of that forward depends on the disk: in
the worst case everything the block offloads is in memory at once, as if kept. So an
offloading option's ``forward`` peak is taken as at least its twin's that keeps instead (the
plain block, the region, the segment, the same per-op choice keeping what it offloads), and
the chain counts it at that block's forward (see [ The chain DP ] in ``solve.py``). In
backward, the tier reads a few storages ahead (``Store.prefetch``), which belong to the blocks
before: an offloading option's backward peak counts its own largest ones that many times over
(``ahead``). The plan never relies on the disk being fast to fit its budget; only its time
does.

NOTE [ Offload priced across the chain ]

An option is timed on one copy of the block, but what offloading costs a block grows with how
much the step offloads around it: on the medium GPT of ``remat bench`` (8 blocks, 2-core CPU),
``offload-disk`` added 13.3 ms to a step on one block, and 14.9, 16.2 and 17.4 ms a block on 2,
4 and 8 (the tier's writer threads and the page cache compete with the step's own compute).
Priced by the one block, a plan of eight offloading blocks predicted 1.40x the plain step and
measured 1.57-1.81x. So where a block type repeats, its ``offload-<tier>`` option is timed
again on every block of the type at once, in whole steps against plain ones
(:func:`_offload_across`), and what that costs a block above the one-block figure, per byte
moved, is added to each option of the type that uses the tier, by the bytes it moves. Plans
that offload fewer blocks are then priced high, by up to that excess: the prediction errs
towards recompute, never towards a slower plan than it says.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import math
import statistics
import time
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import modules
from .._found import as_found, grads_as_found, reached
from ..errors import NoPlanFits, RematError
from ..modules import refuse_sharded, unwrapped
from ._autocast import Autocast, loop_forward, outside
from ._budget import fmt_bytes, parse_budget
from ._plan import Option, Plan, fingerprint, option_of_call
from .apply import (
    OFFLOADS,
    apply_option,
    apply_segment,
    input_bytes,
    refuse_set_up,
    undo_all,
    undo_option,
)
from .cost import (
    PlainStep,
    measure_memory,
    measure_plain_step,
    measure_seconds,
    paired_extra,
    peak_bytes,
    time_plain_steps,
)
from .profile import (
    BlockProfile,
    capture,
    device_of,
    find_blocks,
    first_tensor,
    fresh_inputs,
    grad_outputs,
    no_blocks_found,
    profile_block,
    selects_by_class,
    shared_blocks,
    timed,
)
from .solve import (
    CHAIN_MILP_SECONDS,
    RECORD_OVERHEAD,
    ChainCosts,
    ChainOption,
    OpChoice,
    chain_dp,
    chain_peak,
    chain_solve,
    chosen,
    pareto,
)

__all__ = ["fit", "plan"]

_TIERS = ("recompute", *OFFLOADS)
MAX_SEGMENT = 12  # the most blocks one segment covers
# What an offloaded byte is taken to cost (written and read back) where nothing was timed
# (``repeats=0``): 0.5 GB/s, a disk tier's bandwidth while a 2-core CPU computes.
OFFLOAD_SECONDS_PER_BYTE = 2e-9
_AHEAD = 2  # storages an offload scope reads ahead in backward (``Store``'s default prefetch)


def _check_loss_fn(loss_fn: Any) -> None:
    """Raise a :class:`RematError` unless ``loss_fn`` can be called with the output alone."""
    if not callable(loss_fn):
        raise RematError(
            f"remat.plan: loss_fn must be a function of the model's output, got "
            f"{type(loss_fn).__name__}."
        )
    called = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn  # a criterion
    try:
        parameters = inspect.signature(called).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in parameters if p.kind in positional and p.default is p.empty]
    if len(required) > 1:
        raise RematError(
            f"remat.plan: loss_fn is called with the model's output alone, loss_fn(output), "
            f"but it requires {len(required)} arguments ({', '.join(required)}). Bind the "
            "others, e.g. loss_fn=lambda out: criterion(out, target) with the example batch's "
            "target."
        )


def _step(
    model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None
) -> Callable[..., None]:
    """One training step of ``model``: ``step()``, or ``step(forward_end)`` to call
    ``forward_end()`` as the forward and the loss end (inside the loop's autocast)."""
    args = inputs if isinstance(inputs, tuple) else () if isinstance(inputs, dict) else (inputs,)
    kwargs = inputs if isinstance(inputs, dict) else {}
    if loss_fn is not None:
        _check_loss_fn(loss_fn)

    def step(forward_end: Callable[[], None] | None = None) -> None:
        torch.manual_seed(0)
        # The output is not held during backward, as in a training loop that keeps the loss.
        with loop_forward():
            out = model(*args, **kwargs)
            if loss_fn is not None:
                loss = loss_fn(out)
            elif isinstance(out, torch.Tensor):
                loss = out.sum()
            else:
                raise RematError(
                    f"remat.plan: the model returned {type(out).__name__}, and without "
                    "loss_fn the loss is the sum of a tensor output; pass the loss the loop "
                    "computes, e.g. loss_fn=lambda out: criterion(out['logits'], target)."
                )
            if forward_end is not None:
                forward_end()
        del out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise RematError(
                f"remat.plan: loss_fn must return a one-element tensor, got {got}; pass "
                "loss_fn=lambda out: criterion(out, target)."
            )
        if not loss.requires_grad:
            raise RematError(
                "remat.plan: the loss does not require grad, so the step saves nothing for "
                "backward and there is nothing to plan: no parameter the loss depends on has "
                "requires_grad=True (or the model ran under torch.no_grad()). Plan the model "
                "as it trains."
            )
        loss.backward()  # type: ignore[no-untyped-call]

    return step


def _tiers(tiers: Sequence[str] | None, device: torch.device) -> list[str]:
    """The tiers a plan may use, checked; by default recompute only (offloading to disk writes
    files, which a user asks for)."""
    if tiers is None:
        return ["recompute"]
    chosen = list(dict.fromkeys(tiers)) if not isinstance(tiers, str) else []
    bad = [t for t in chosen if t not in _TIERS]
    if bad or not chosen:
        raise RematError(
            f"remat.plan: tiers must be a list of some of {', '.join(map(repr, _TIERS))}, got "
            f"{tiers!r}; e.g. tiers=['recompute', 'disk']."
        )
    if "host" in chosen and device.type == "cpu":
        raise RematError(
            "remat.plan: tiers=['host'] moves saved tensors from an accelerator to host memory, "
            "but this model is on the CPU, whose tensors are in host memory already; use "
            "tiers=['recompute', 'disk'] to offload to files."
        )
    return chosen


def _offload_tiers(tiers: Sequence[str]) -> list[str]:
    return [t for t in tiers if t != "recompute"]


def _input_bytes(inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> int:
    """The bytes of a block's first argument: what a region or a segment keeps, or offloads."""
    first = inputs[0][:1]
    return sum(t.untyped_storage().nbytes() for t in first if isinstance(t, torch.Tensor))


def _decisions(
    profile: BlockProfile, choice: OpChoice, tier: str | None = None, per_byte: float = 0.0
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    decisions: dict[str, str] = {}
    tensors: list[dict[str, Any]] = []
    for i, op in enumerate(profile.ops):
        decision = "keep" if i in choice.keep else "recompute"
        if tier is not None and i in choice.offload:
            decision = tier
        decisions[op.key] = decision
        if op.saved:
            if op.must_save:
                reason = "must be saved (cannot be replayed safely)"
            elif op.view:
                reason = "a view: rebuilt from its base"
            elif decision == "keep":
                reason = "kept: rebuilding it costs more than its bytes are worth here"
            elif decision == tier:
                reason = (
                    f"offloaded to {tier}: {per_byte * op.bytes * 1e6:.0f} us to write and read "
                    f"back, against {op.seconds * 1e6:.0f} us to rebuild"
                )
            else:
                reason = f"recomputed: {op.seconds * 1e6:.0f} us to rebuild"
            tensors.append(
                {"key": op.key, "bytes": op.bytes, "decision": decision, "reason": reason}
            )
    return decisions, tensors


class _Chain(nn.Module):
    """Copies of one block called one after another, as a chain of them runs in the model:
    each block's first output tensor is the next one's first argument."""

    def __init__(self, block: nn.Module, span: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(copy.deepcopy(block) for _ in range(span))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = None
        others: list[torch.Tensor] = []  # what else the blocks before the last returned
        for i, b in enumerate(self.blocks):
            out = b(*args, **kwargs)
            first = first_tensor(out)
            args = (first, *args[1:])
            if i + 1 < len(self.blocks):  # held to the backward, as a model holds an aux loss
                others += [t for t in grad_outputs(out) if t is not first]
        return (out, others) if others else out


def _chains(block: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
    """Whether ``block``'s first output can be its next copy's first argument."""
    args, kwargs = fresh_inputs(inputs)
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    with _as_found(block, device_of(block, inputs)), torch.no_grad(), loop_forward():
        out = block(*args, **kwargs)
    t = next((v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)), None)
    return t is not None and t.shape == args[0].shape and t.dtype == args[0].dtype


class _SegmentCosts(NamedTuple):
    """A segment's measured costs (see :func:`_segments`); ``seconds`` comes last."""

    kept: float
    backward: float
    left: float
    forward: float
    cached: float
    side: float
    seconds: float


def _segments(
    block: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    device: torch.device,
    longest: int,
    repeats: int,
    forward_seconds: float,
    record_seconds: float,
    tiers: dict[str | None, float],
    linked: bool = False,
) -> list[Option]:
    """Segment options of 2 to ``longest`` blocks (see [ Segments ] in ``solve.py``): those of
    two and three blocks measured on chains of copies of ``block`` against plain chains of the
    same length, longer ones extrapolated from them: bytes grow by what the third block added
    to the second (memory repeats to the byte), time by the mean per block of the two (a
    difference of two timings would carry their noise, times the blocks added). Kept and left
    bytes are written as the plain blocks' plus the segment's difference from a plain chain.
    The op model's extra seconds per block, the prediction when nothing is timed
    (``repeats=0``), are ``forward_seconds`` (a forward replayed) plus, on the graph engine,
    ``record_seconds`` (it recorded). ``tiers`` maps each tier the segment's input may wait in
    (``None``: none) to its seconds per byte. ``linked``: the model's blocks of this type take
    the previous block's output, so its segments without a tier may run on the region engine
    (see [ Segments on the region engine ] in ``apply.py``); they do where that measured at
    least as fast as the graph engine."""
    if longest < 2 or not _chains(block, inputs):
        return []
    single = measure_memory(copy.deepcopy(block), inputs, device)
    found: dict[tuple[str | None, int], _SegmentCosts] = {}
    # Linked segments without a tier run on the region engine, or on the graph engine where
    # that measured faster (blocks so small that the region engine's Python per call, which
    # the graph engine does not pay, outweighs the graph engine's per op).
    on_graph: dict[int, _SegmentCosts] = {}
    engines = [(tier, linked and tier is None) for tier in tiers]
    if linked and None in tiers and repeats > 0:
        engines.append((None, False))  # the last: the graph engine, for comparison
    for span in (2, 3)[: longest - 1]:
        plain = _Chain(block, span)
        chain = measure_memory(plain, inputs, device)
        paths = [f"blocks.{k}" for k in range(span)]
        for n, (tier, on_region) in enumerate(engines):
            segment = _Chain(block, span)
            apply_segment(segment, paths, tier, on_region)
            got = measure_memory(segment, inputs, device)
            values = _SegmentCosts(
                got.kept - chain.kept + span * single.kept,
                got.backward,
                got.left - chain.left + span * single.left,
                got.forward,
                got.cached - chain.cached + span * single.cached,
                got.side,
                (
                    measure_seconds(segment, plain, inputs, device, repeats)
                    if repeats > 0
                    else math.nan
                ),
            )
            if n < len(tiers):
                found[tier, span] = values
            else:
                on_graph[span] = values
    on_graph_seconds = sum(v.seconds for v in on_graph.values())
    if on_graph and on_graph_seconds < sum(found[None, k].seconds for k in on_graph):
        linked = False
        found.update({(None, k): v for k, v in on_graph.items()})
    per_block = forward_seconds + (0.0 if linked else record_seconds)
    options = []
    for tier, per_byte in tiers.items():
        moved = per_byte * _input_bytes(inputs)
        for span in range(2, longest + 1):
            if (tier, span) in found:
                values, source = found[tier, span], "measured"
            else:  # memory: a block more adds what the third added; time: each its share
                a, b = found[tier, 2], found[tier, 3]
                grown = [y + (span - 3) * (y - x) for x, y in zip(a[:-1], b[:-1], strict=True)]
                values = _SegmentCosts._make([*grown, span * (a.seconds + b.seconds) / 5])
                source = "extrapolated"
            kept, backward, left, forward, cached, side, seconds = values
            options.append(
                Option(
                    name=f"segment-{span}" + (f"-{tier}" if tier else ""),
                    kind="segment",
                    kept=int(kept),
                    backward=int(backward),
                    seconds=span * per_block + moved,
                    measured_seconds=seconds if repeats > 0 else None,
                    left=int(left),
                    span=span,
                    source=source,
                    tier=tier,
                    forward=int(forward),
                    linked=linked and tier is None,
                    cached=int(cached),
                    side=int(side),
                )
            )
    return options


@dataclass
class _Candidate:
    name: str
    kind: str
    seconds: float  # predicted
    decisions: dict[str, str] = field(default_factory=dict)
    tensors: list[dict[str, Any]] = field(default_factory=list)
    gap: float = 0.0
    tier: str | None = None


def _measure(
    c: _Candidate,
    block: nn.Module,
    plain: nn.Module,
    inputs: Any,
    device: torch.device,
    repeats: int,
) -> Option:
    copy_ = copy.deepcopy(block)
    apply_option(copy_, c.name, c.kind, c.decisions, c.tier)
    kept, backward, left, forward, cached, side = measure_memory(copy_, inputs, device)
    measured = None
    if repeats > 0:
        timed = c.kind != "plain" or c.tier is not None
        measured = measure_seconds(copy_, plain, inputs, device, repeats) if timed else 0.0
    return Option(
        c.name,
        c.kind,
        kept,
        backward,
        c.seconds,
        measured,
        left,
        c.gap,
        c.decisions,
        c.tensors,
        tier=c.tier,
        forward=forward,
        cached=cached,
        side=side,
    )


def _offloaded_bytes(profile: BlockProfile) -> int:
    """What ``remat.offload`` moves of one block: the storages of 1 KiB or more that autograd
    saves in it. The scope decides by storage (``Scope.wants``), so a saved view moves its
    base's storage, once however many views of it are saved, though the base itself is not
    saved; a parameter's storage (a transposed weight) stays. A profile made without its
    storages (by hand) counts its saved results and inputs."""
    if profile.saved_storages is not None:
        return sum(n for n in profile.saved_storages if n >= 1024)
    results = sum(op.bytes for op in profile.ops if op.saved and not op.view and op.bytes >= 1024)
    return results + sum(n for n in profile.saved_inputs if n >= 1024)


def _moved_bytes(o: Option, profile: BlockProfile, inputs: Any, tier: str) -> int:
    """The bytes option ``o`` sends to ``tier`` in one block's forward (a segment's: its
    input's)."""
    if o.kind == "graph":
        return sum(op.bytes for op in profile.ops if o.decisions.get(op.key) == tier)
    if o.tier != tier:
        return 0
    return _offloaded_bytes(profile) if o.kind == "plain" else _input_bytes(inputs)


def _price_across(
    options: list[Option], per_block: float, profile: BlockProfile, inputs: Any, tier: str
) -> None:
    """Add to each of ``options`` (those that use ``tier``) what offloading costs a block
    beyond its one-block timing, by the bytes it moves: ``per_block`` is the extra seconds a
    block's ``offload-<tier>`` took with every block of its type offloading (see [ Offload
    priced across the chain ])."""
    everything = next(
        (o for o in options if o.kind == "plain" and o.tier == tier and o.span == 1), None
    )
    if everything is None or everything.measured_seconds is None:
        return
    moved = _moved_bytes(everything, profile, inputs, tier)
    excess = per_block - everything.measured_seconds
    if moved <= 0 or excess <= 0:
        return
    for o in options:
        if o.measured_seconds is not None:
            o.measured_seconds += excess * _moved_bytes(o, profile, inputs, tier) / moved


def _offload_across(
    model: nn.Module,
    paths: list[str],
    step: Callable[..., None],
    device: torch.device,
    tier: str,
    pairs: int,
) -> float:
    """Median extra seconds a block takes in a whole step with every block of ``paths`` under
    ``remat.offload(tier)`` (its ``offload-<tier>`` option), against plain steps, in ``pairs``
    pairs that alternate which runs first (see [ Offload priced across the chain ])."""
    blocks = [model.get_submodule(p) for p in paths]

    def once(offloaded: bool) -> float:
        if offloaded:
            for block, path in zip(blocks, paths, strict=True):
                apply_option(block, path, "plain", {}, tier)
        try:
            return timed(step, device)
        finally:
            if offloaded:
                for block in blocks:
                    undo_option(block)

    return paired_extra(lambda: once(True), lambda: once(False), pairs) / len(blocks)


def _tier_stats(tier: str) -> tuple[int, float, int, float]:
    """(bytes written, write wall seconds, bytes read, read wall seconds) of the disk tier the
    name stands for now; zeros for a tier that does not count them."""
    from ..store.scope import tier_named

    stats = getattr(tier_named(tier), "stats", None)
    if stats is None or not hasattr(stats, "write_wall_seconds"):
        return 0, 0.0, 0, 0.0
    return (
        stats.bytes_written,
        stats.write_wall_seconds,
        stats.bytes_read,
        stats.read_wall_seconds,
    )


def _tier_options(
    block: nn.Module,
    plain: nn.Module,
    inputs: Any,
    profile: BlockProfile,
    device: torch.device,
    points: int,
    repeats: int,
    tier: str,
    recompute: bool,
    bandwidths: dict[str, float] | None,
) -> tuple[list[Option], float, float]:
    """The options of one block type that use ``tier`` (see [ Offloaded options ]), the cost
    per byte moved that the first of them measured, and the solve time."""
    # Everything the block saves in the tier first: what a byte there costs while the block
    # computes, for the MILP (see [ The block MILP ]).
    moved = _offloaded_bytes(profile)
    before = _tier_stats(tier)
    everything = _measure(
        _Candidate(f"offload-{tier}", "plain", OFFLOAD_SECONDS_PER_BYTE * moved, tier=tier),
        block,
        plain,
        inputs,
        device,
        repeats,
    )
    after = _tier_stats(tier)
    written, write_wall = after[0] - before[0], after[1] - before[1]
    read, read_wall = after[2] - before[2], after[3] - before[3]
    if bandwidths is not None and write_wall > 0 and read_wall > 0:
        bandwidths[f"{tier}_write"] = written / write_wall
        bandwidths[f"{tier}_read"] = read / read_wall
    cost = OFFLOAD_SECONDS_PER_BYTE
    if everything.measured_seconds is not None and moved > 0:
        cost = max(everything.measured_seconds / moved, 1e-12)
    if not recompute:
        return [everything], cost, 0.0
    candidates = [
        _Candidate(
            f"region-{tier}",
            "region",
            profile.forward_seconds + cost * _input_bytes(inputs),
            tier=tier,
        )
    ]
    start = time.perf_counter()
    front = [c for c in pareto(profile, points=points, offload_cost=cost) if c.offload]
    solve_seconds = time.perf_counter() - start
    for k, choice in enumerate(front):
        decisions, tensors = _decisions(profile, choice, tier, cost)
        seconds = choice.seconds + RECORD_OVERHEAD * len(profile.ops)
        candidates.append(
            _Candidate(f"graph-{k}-{tier}", "graph", seconds, decisions, tensors, choice.gap)
        )
    found = [everything, *(_measure(c, block, plain, inputs, device, repeats) for c in candidates)]
    return found, cost, solve_seconds


def _bound(
    options: list[Option],
    block: nn.Module,
    inputs: Any,
    profile: BlockProfile,
    device: torch.device,
) -> None:
    """For each option that offloads, the worst case the chain counts (see [ Offloaded
    options ]): its forward peak at least its twin's that keeps instead, and the storages read
    ahead for the blocks before it during its backward."""
    twins = {(o.kind, o.span): o for o in options if not o.offloads}
    saved = sorted((op.bytes for op in profile.ops if op.saved and not op.view), reverse=True)
    for o in options:
        if not o.offloads:
            continue
        if o.kind == "graph":  # its twin keeps what it offloads
            moved = [op.bytes for op in profile.ops if o.decisions.get(op.key) in OFFLOADS]
            o.ahead = sum(sorted(moved, reverse=True)[:_AHEAD])
            kept = {k: "keep" if d in OFFLOADS else d for k, d in o.decisions.items()}
            twin = copy.deepcopy(block)
            apply_option(twin, o.name, "graph", kept)
            o.forward = max(o.forward, measure_memory(twin, inputs, device).forward)
        else:  # the whole block (plain), or a region's or a segment's input, in the tier
            o.ahead = sum(saved[:_AHEAD]) if o.kind == "plain" else _AHEAD * _input_bytes(inputs)
            o.forward = max(o.forward, twins[o.kind, o.span].forward)


def _options(
    block: nn.Module,
    inputs: Any,
    profile: BlockProfile,
    device: torch.device,
    points: int,
    repeats: int,
    longest: int = 1,
    tiers: Sequence[str] = ("recompute",),
    bandwidths: dict[str, float] | None = None,
    linked: bool = False,
    across: Callable[[str], float] | None = None,
) -> tuple[list[Option], float]:
    """The options of one block type, each measured on a copy of ``block``; the solve time.
    With an offload tier, the bandwidths it reached while the block computed go into
    ``bandwidths``; ``across(tier)``, where given, is what offloading everything costs a block
    with every block of its type offloading (see [ Offload priced across the chain ])."""
    recompute = "recompute" in tiers
    plain = copy.deepcopy(block)
    solve_seconds = 0.0
    candidates = [_Candidate("plain", "plain", 0.0)]
    if recompute:
        start = time.perf_counter()
        front = pareto(profile, points=points)
        solve_seconds += time.perf_counter() - start
        candidates.append(_Candidate("region", "region", profile.forward_seconds))
        # The graph engine records every op in forward, and replays what it must.
        for k, choice in enumerate(front):
            decisions, tensors = _decisions(profile, choice)
            seconds = choice.seconds + RECORD_OVERHEAD * len(profile.ops)
            candidates.append(
                _Candidate(f"graph-{k}", "graph", seconds, decisions, tensors, choice.gap)
            )
    options = [_measure(c, block, plain, inputs, device, repeats) for c in candidates]
    per_byte: dict[str | None, float] = {None: 0.0}  # a segment's input kept, or in a tier
    for tier in _offload_tiers(tiers):
        found, per_byte[tier], seconds = _tier_options(
            block, plain, inputs, profile, device, points, repeats, tier, recompute, bandwidths
        )
        options += found
        solve_seconds += seconds
    segments: list[Option] = []
    if recompute:
        # A segment replays each block's forward; the graph engine records it in forward too.
        forward, record = profile.forward_seconds, RECORD_OVERHEAD * len(profile.ops)
        segments = _segments(
            block, inputs, device, longest, repeats, forward, record, per_byte, linked
        )
    if across is not None:
        for tier in _offload_tiers(tiers):
            priced = [o for o in (*options, *segments) if tier in _uses(o)]
            _price_across(priced, across(tier), profile, inputs, tier)
    _bound(options + segments, block, inputs, profile, device)
    return undominated(options) + segments, solve_seconds


def undominated(options: list[Option]) -> list[Option]:
    """``options`` without those another option beats on every count as the chain counts them,
    using no tier the other does not (a plan restricted to fewer tiers keeps what it can use);
    segments compete among themselves only (one covers more blocks). The plain block stays."""

    def counts(o: Option) -> tuple[int, int, float, int, int]:
        return (o.kept, _chain_backward(o), _chain_seconds(o), o.left, o.side)

    return [
        o
        for o in options
        if (o.kind == "plain" and o.tier is None)
        or not any(
            p is not o
            and p.span == o.span
            and _uses(p) <= _uses(o)
            and all(x <= y for x, y in zip(counts(p), counts(o), strict=True))
            and counts(p) != counts(o)
            for p in options
        )
    ]


def _chain_backward(o: Option) -> int:
    """The backward peak the chain counts: for an option that offloads, with the tensors read
    ahead for the blocks before it (see [ Offloaded options ])."""
    return o.backward + o.ahead


def _chain_seconds(o: Option) -> float:
    """Measured (paired medians) where the planner measured, else the op model's."""
    return o.measured_seconds if o.measured_seconds is not None else o.seconds


def _covers(types: list[str], i: int, span: int, chained: dict[str, str]) -> bool:
    """Whether a segment of ``span`` blocks measured on copies of block ``i`` (see
    :class:`_Chain`) is what blocks ``i`` to ``i + span - 1`` are: the blocks after the first
    have the type a copy fed by the one before has (its own, or ``chained``'s)."""
    follower = chained.get(types[i], types[i])
    return i + span <= len(types) and all(u == follower for u in types[i + 1 : i + span])


def _runs(types: list[str], chained: dict[str, str]) -> dict[str, int]:
    """For each type, the most blocks a segment that starts at a block of it can cover."""
    longest: dict[str, int] = {}
    for i, t in enumerate(types):
        span = 1
        while _covers(types, i, span + 1, chained):
            span += 1
        longest[t] = max(longest.get(t, 0), span)
    return longest


def _chain(
    plain: PlainStep,
    types: list[str],
    options: dict[str, list[Option]],
    groups: Sequence[str] = (),
    chained: dict[str, str] | None = None,
    side: int = 0,
    shared: Container[int] = (),
    later: Container[int] = (),
    recomputed: Container[int] = (),
) -> tuple[ChainCosts, list[list[ChainOption]], list[list[str]]]:
    """The chain model's constants, and per block the options that may start there (a segment
    only where the blocks it covers are what its measured chain was, see :func:`_covers`, and,
    if ``groups`` names one per block, of one group, and none of them a call of a block
    called more than once, at a position of ``shared``) with their names. ``side``: the bytes
    of the side inputs every block gets (see [ Side inputs ] in ``solve.py``). The calls at
    ``shared`` are priced without their casts, and those at ``later`` (after a block's first
    call) run backward on the casts the first made; at ``recomputed``, only options that keep
    none of the casts, the first call priced as a block of its own (see [ Casts of shared
    blocks ])."""
    base = {name: next(o for o in opts if o.kind == "plain") for name, opts in options.items()}
    # Of a type's casts (all of them: what an option that keeps none leaves cached), what an
    # option keeps; a later call of a shared block keeps none of its own.
    casts = {name: max(o.cached for o in opts) for name, opts in options.items()}

    def own(o: Option, t: str, i: int) -> int:
        return casts[t] - o.cached if i in later else 0

    # What is live besides the blocks' kept bytes at each block's backward, measured there: in
    # a U-Net the skip tensors and their gradients make it differ from block to block, and one
    # constant (the largest) overstated the peak of every plan by up to a block's activations.
    gaps = tuple(
        plain.backward_peaks[i] - (base[t].backward - own(base[t], t, i)) - sum(plain.kept[:i])
        for i, t in enumerate(types)
    )
    costs = ChainCosts(
        head=plain.head - sum(plain.kept),
        before=0,
        tail=plain.tail,
        gaps=gaps,
        forward_head=plain.forward_head - sum(plain.kept),
        head_after=plain.head_after - sum(plain.kept),
        forward_head_after=plain.forward_head_after - sum(plain.kept),
        # The level each block's forward starts from, as the gaps are made: its forward peak
        # on the plain step, less the plain block's own alone and the blocks' kept before it.
        starts=tuple(
            plain.forward_peaks[i] - base[t].forward - sum(plain.kept[:i])
            for i, t in enumerate(types)
        ),
    )
    chain: list[list[ChainOption]] = []
    names: list[list[str]] = []
    for i, t in enumerate(types):
        # Priced without its casts, unless the first call where no call keeps them: see
        # [ Casts of shared blocks ].
        uncast = i in shared and (i in later or i not in recomputed)
        here = [
            o
            for o in options[t]
            if (
                o.span == 1
                or (
                    _covers(types, i, o.span, chained or {})
                    and len(set(groups[i : i + o.span])) <= 1
                    and not any(j in shared for j in range(i, i + o.span))
                )
            )
            and (i not in recomputed or _recasts(o, casts[t], i in later))
        ]
        chain.append(
            [
                ChainOption(
                    kept=max(
                        sum(plain.kept[i : i + o.span])
                        + o.kept
                        - o.span * base[t].kept
                        + (o.cached - base[t].cached if uncast else 0),
                        0,
                    ),
                    backward=_chain_backward(o) - own(o, t, i),
                    seconds=_chain_seconds(o),
                    # What it holds after its own backward until the whole backward ends, beyond
                    # plain: a graph-engine region's records, and a region's saved input
                    # (measured: a ConvNet's regions hold it, and leaving it out underestimated
                    # their peak).
                    left=max(o.left - o.span * base[t].left, 0),
                    span=o.span,
                    cached=0 if uncast else max(o.cached - o.span * base[t].cached, 0),
                    forward=o.forward,
                    # Of the side inputs the plain step frees with its forward: what it
                    # holds beyond the plain block (which holds those the step keeps, as
                    # Llama's rotary tables), at most those.
                    side=min(max(o.side - base[t].side, 0), side),
                )
                for o in here
            ]
        )
        names.append([o.name for o in here])
    return costs, chain, names


def _smallest(costs: ChainCosts, chain: list[list[ChainOption]]) -> int:
    """The smallest budget some assignment fits: one byte less and none does.

    Bisection on feasibility first (:func:`chain_dp`), to 0.2% of the largest peak. The
    DP's grid is a fraction of the budget it is given, so its answers are not monotone to the
    byte: from there, each step asks for a plan one byte below the smallest budget found to
    fit, and goes down to that plan's peak, until there is none."""
    singles = [[o for o in opts if o.span == 1] for opts in chain]
    high = max(
        chain_peak(costs, [min(opts, key=lambda o: o.kept + o.backward) for opts in singles]), 1
    )
    high = max(high, chain_peak(costs, [opts[0] for opts in chain]))
    low = 0
    while high - low > max(high // 500, 1):
        mid = (low + high) // 2
        if chain_dp(costs, chain, mid) is None:
            low = mid
        else:
            high = mid
    fits = high  # a budget the DP finds a plan for
    for _ in range(_SMALLEST_STEPS):
        below = chain_dp(costs, chain, fits - 1)
        if below is None:
            return fits
        peak = chain_peak(costs, chosen(chain, below))  # at most fits - 1
        fits = peak if chain_dp(costs, chain, peak) is not None else fits - 1
    return fits


# At most this many steps below the bisection's answer (each one or two DPs).
_SMALLEST_STEPS = 64

# NOTE [ Shared blocks ]
#
# A block the forward calls several times (weights shared across depth: ALBERT's layer, a
# looped transformer) saves activations at each call, so each call is a position of the
# chain: the plain step marks each call as a block of its own (``measure_plain_step``), and
# each is priced by the options of the block's type, measured on its first call's inputs.
# Each call takes an option of its own, as a block of its own would (at half the memory,
# some calls run plainly and others recompute): the plan lists them, call by call, in the
# block's entry (``calls``), and the block's forward picks its call's option (see
# [ Options per call ] in ``apply.py``). No segment covers a call of a shared block: a
# segment opens at its first block's call and closes at its last's, which a block called
# again would do again in the middle.
#
# NOTE [ Casts of shared blocks ]
#
# Under a loop's autocast a block's first call casts its weights (bfloat16 copies) into
# autocast's cache, and its later calls reuse those copies: the plain step's marks count the
# casts in the first call's kept bytes alone. An option measured alone splits the casts
# between what it keeps (a plain block saves a matmul's cast weight for backward) and what
# the cache frees at the forward's end (``cached``). Priced as blocks of their own, every
# call would shed the casts its option does not keep, each time, where the step holds one
# copy: a looped block called six times, planned at half the plain step, measured up to 18%
# above its prediction. So the calls of a shared block are priced without the casts:
#
# 1. A call's kept bytes differ from the plain call's by ``kept + cached`` of its option
#    against the plain block's (what each holds, casts included either way), and it leaves
#    nothing in the cache.
# 2. A later call (not the first) holds none of the casts as its own: they were there before
#    its forward. Its option's backward peak, and the plain block's it is set against, are
#    counted less the casts each keeps (all casts being what a region, which keeps none,
#    leaves cached).
# 3. The one copy of the casts stays where the plain step has it, in the first call's kept
#    bytes, to the first call's backward, the last of the step's.
#
# That is exact where the first call keeps the casts (runs plainly). Where only later calls
# keep them, they go at the backward of the earliest of those, and where no call keeps them
# at the forward's end: the model holds them longer, high by one copy of the casts from
# there on, never low. The smallest plans recompute the casts in every call, so the chain is
# solved again as it is exactly for those (``Profiled.variants``), for each set of shared
# blocks (of the first ``_MOST_CAST_VARIANTS`` with casts): at their first call only options
# that keep none of the casts, priced as a block of its own (the cache holds them to the
# forward's end), and at later calls only regions. At a later call the casts come from the
# cache, made by no op of the call, so the graph engine holds them as the call's inputs
# (measured: 2 x 16,640 bytes above the prediction when this variant let graph options
# recompute later calls); a region lets them go. The fastest plan that fits, over the chain
# and its variants, is the answer. On a looped block and on ALBERT in bfloat16, every plan
# so chosen measured what it predicted to 0.1%. Pricing the calls as blocks of their own
# instead measured up to 18% above, and charging the first call's option with the casts it
# keeps alone (exact where no call keeps them) 4-9% above, in every plan the solver chose:
# those where a later call keeps the casts and the first does not.


def _recasts(o: Option, casts: int, later: bool) -> bool:
    """Whether option ``o`` of a shared block keeps none of the block's ``casts`` after its
    forward, at the block's first call or at a ``later`` one. At a later call the casts come
    from autocast's cache, made by no op of the call: the graph engine holds them as the
    call's inputs, and only a region, which recomputes the whole call, lets them go."""
    return o.cached >= casts and (not later or o.kind == "region")


class _Variant(NamedTuple):
    """A chain to solve: its costs, the options at each position and their names."""

    costs: ChainCosts
    chain: list[list[ChainOption]]
    names: list[list[str]]


# Shared blocks with casts whose every-call-recomputed variants are solved (2**n chains).
_MOST_CAST_VARIANTS = 3


@dataclass
class Profiled:
    """Everything measured about one model for planning: solve it for any budget."""

    paths: list[str]
    types: list[str]
    plain: PlainStep
    options: dict[str, list[Option]]
    fingerprint: dict[str, Any]
    tiers: list[str]
    solve_seconds: float
    profile_seconds: float
    # Bytes per second each offload tier wrote and read while a block computed.
    bandwidths: dict[str, float] = field(default_factory=dict)
    # Per block, the first block of its run of linked blocks, whose segments run on the region
    # engine, or "": a segment must not leave its run, or a block in it would keep its input,
    # not as measured.
    groups: list[str] = field(default_factory=list)
    # Block type -> the type of the blocks its segments cover after their first (see
    # ``Blocks.chained`` in ``profile.py``); absent: its own.
    chained: dict[str, str] = field(default_factory=dict)
    training: bool = True  # the model's mode when it was profiled
    input_bytes: int = 0  # of the tensors the first block got
    # Of the side inputs every block got, the same tensors (see [ Side inputs ] in ``solve.py``).
    side_bytes: int = 0
    autocast: Autocast | None = None  # the loop's, around each forward
    device: str = "cpu"  # the type of the device the step ran and was measured on
    # The blocks the step's forward called more than once, and how many times: each call is a
    # position of the chain, with an option of its own (see [ Shared blocks ]).
    repeated: dict[str, int] = field(default_factory=dict)
    # The blocks found that computed no gradient in the profiled step (see ``Blocks.frozen``).
    frozen: list[str] = field(default_factory=list)
    costs: ChainCosts = field(init=False)
    chain: list[list[ChainOption]] = field(init=False)
    names: list[list[str]] = field(init=False)  # the name of each chain option
    # The chain again for each set of shared blocks whose calls all recompute their casts
    # (see [ Casts of shared blocks ]): costs, options, their names. Solved with the chain.
    variants: list[_Variant] = field(init=False)

    def chains(self) -> list[_Variant]:
        """The chain and its variants."""
        return [_Variant(self.costs, self.chain, self.names), *self.variants]

    def __post_init__(self) -> None:
        # The calls of blocks the forward calls more than once: no segment covers them.
        shared = {i for i, p in enumerate(self.paths) if p in self.repeated}
        later = {i for i, p in enumerate(self.paths) if self.paths.index(p) < i}

        def chain(recomputed: Container[int] = ()) -> _Variant:
            return _Variant(
                *_chain(
                    self.plain,
                    self.types,
                    self.options,
                    self.groups,
                    self.chained,
                    self.side_bytes,
                    shared,
                    later,
                    recomputed,
                )
            )

        main = chain()
        self.costs, self.chain, self.names = main
        cast = [
            p
            for p in self.repeated
            if max(o.cached for o in self.options[self.types[self.paths.index(p)]]) > 0
        ][:_MOST_CAST_VARIANTS]
        variants = (
            chain({i for i, p in enumerate(self.paths) if p in chosen_paths})
            for n in range(1, len(cast) + 1)
            for chosen_paths in itertools.combinations(cast, n)
        )
        # (a block type whose region caches less than another option has no variant)
        self.variants = [v for v in variants if all(v.chain)]

    @property
    def blocks(self) -> list[str]:
        """The blocks' paths, each once, in the order of their first calls."""
        return list(dict.fromkeys(self.paths))

    def restricted(self, tiers: Sequence[str]) -> Profiled:
        """The same measurements with only the options that use no more than ``tiers``."""
        allowed = set(tiers)
        if not allowed <= set(self.tiers):
            raise RematError(
                f"remat.plan: expected tiers among the profiled {self.tiers!r}, got {tiers!r}; "
                "profile with those tiers."
            )
        options = {t: [o for o in opts if _uses(o) <= allowed] for t, opts in self.options.items()}
        return dataclasses.replace(self, options=options, tiers=list(tiers))


def _uses(o: Option) -> set[str]:
    """The tiers option ``o`` uses."""
    used = {d for d in o.decisions.values() if d in _TIERS}
    if o.tier is not None:
        used.add(o.tier)
    if o.kind in ("region", "segment") or "recompute" in o.decisions.values():
        used.add("recompute")
    return used


@contextlib.contextmanager
def _as_found(
    model: nn.Module,
    device: torch.device,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    inputs: Any = None,
) -> Iterator[None]:
    """Planning leaves the model as it found it: buffers (BatchNorm statistics), the random
    generators (the CPU's, ``device``'s, those the model holds, Python's and NumPy's) and
    gradients; and so what ``loss_fn`` reaches (a head or a criterion kept outside the model)
    and the example ``inputs``' gradients (NOTE [ Putting a model back ] in ``_found.py``)."""
    models = [model]
    tensors: list[torch.Tensor] = list(model.parameters())
    if loss_fn is not None:
        modules, held = reached(loss_fn)
        models += [m for m in modules if m is not model]
        tensors += [p for m in modules for p in m.parameters()] + held
    tensors += [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    with (
        grads_as_found(tensors),
        as_found(models, (device.type,) if device.type != "cpu" else ()),
    ):
        yield


def discover_blocks(
    model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None
) -> list[str]:
    """The blocks :func:`plan` finds in ``model`` where ``blocks=`` is not given: the runs of
    blocks in its ``nn.ModuleList``/``nn.Sequential`` containers, or else the outermost modules
    with trainable parameters that one step's forward calls more than once; ``[]`` where it
    has neither. The step runs as the planner runs it, leaving the model as it found it."""
    paths = find_blocks(model)
    if paths:
        return paths
    device = device_of(model, example_inputs)
    with outside(Autocast.found(device.type)), _as_found(model, device, loss_fn, example_inputs):
        return shared_blocks(model, _step(model, example_inputs, loss_fn))


def profile_model(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    blocks: Any = None,
    tiers: Sequence[str] | None = None,
    points: int = 8,
    repeats: int = 5,
    segments: bool = True,
) -> Profiled:
    """Measure ``model``'s plain step and each block type's options (see ``cost.py``)."""
    if not isinstance(model, nn.Module):
        raise RematError(f"remat.plan: expected an nn.Module, got {type(model).__name__}.")
    refuse_sharded("remat.plan", model)
    device = device_of(model, example_inputs)
    if device.type not in ("cpu", "cuda"):
        # Each option's memory is read from the CPU allocator's events or the CUDA
        # allocator's counters (``cost.timeline``).
        raise RematError(
            f"remat.plan: expected a model on the CPU or a CUDA device, found one on {device}: "
            "the planner measures memory with the CPU allocator's events or the CUDA "
            "allocator's counters, and has no way to measure this device's. Choose by hand "
            "there (remat.apply, remat.policies), or plan a CPU copy of the model, whose "
            "predictions will not hold on this device."
        )
    # Inside torch.autocast, the plan is for a loop that enters it around each forward (see
    # NOTE [ Planning under autocast ] in ``_autocast.py``).
    autocast = Autocast.found(device.type)
    chosen_tiers = _tiers(tiers, device)
    paths = find_blocks(model, blocks)
    started = time.perf_counter()
    with outside(autocast), _as_found(model, device, loss_fn, example_inputs):
        step = _step(model, example_inputs, loss_fn)
        if not paths:  # no runs of blocks: a block the forward calls again and again?
            paths = shared_blocks(model, step)
            if not paths:
                raise no_blocks_found(model)
        named = blocks is not None and not selects_by_class(blocks)
        found = capture(model, paths, step, named=named)
        paths = found.paths
        # The chain's positions: each block call of the forward (see [ Shared blocks ]).
        calls = found.order
        repeated = {p: n for p in paths if (n := calls.count(p)) > 1}
        types = dict(zip(paths, found.types, strict=True))
        # Every predicted ratio divides by this time: the median of as many steps as each
        # option's timing takes (a 2-core machine's steps vary by 5-10%).
        plain = measure_plain_step(model, calls, step, device, repeats=max(repeats, 1))
        options: dict[str, list[Option]] = {}
        bandwidths: dict[str, float] = {}
        solve_seconds = 0.0
        most = MAX_SEGMENT if segments else 1
        longest = {t: min(n, most) for t, n in _runs(found.types, found.chained).items()}
        # Segments of a type link where a block of it is followed by one its chain covers,
        # called with its output.
        linked = {
            t: any(
                paths[i + 1] in found.linked and _covers(found.types, i, 2, found.chained)
                for i in range(len(paths) - 1)
                if found.types[i] == t
            )
            for t in found.types
        }
        for t in dict.fromkeys(found.types):
            path = paths[found.types.index(t)]
            block = model.get_submodule(path)
            profile = profile_block(
                block, found.inputs[path], t, device, repeats=max(repeats // 2, 1)
            )
            of_type = [p for p, u in zip(paths, found.types, strict=True) if u == t]
            # Whole steps, in half the pairs an option's timing takes: each is many blocks
            # long, and the excess it measures is large wherever it changes a plan.
            across = (
                functools.partial(
                    _offload_across, model, of_type, step, device, pairs=max(repeats // 2, 1)
                )
                if len(of_type) > 1 and repeats > 0
                else None
            )
            options[t], seconds = _options(
                block,
                found.inputs[path],
                profile,
                device,
                points,
                repeats,
                longest[t],
                chosen_tiers,
                bandwidths,
                linked[t],
                across,
            )
            solve_seconds += seconds
        if repeats > 0:
            # Every predicted ratio divides by the plain step's time, and the options' extra
            # seconds were measured after it. On a 2-core host, a medium GPT's plain step read
            # 0.231, 0.221 and 0.232 s at a profile's start and 0.260, 0.253 and 0.222 s at
            # its end: it is timed again there, and both sets pooled.
            later = time_plain_steps(model, step, device, repeats)
            samples = [*plain.samples, *later]
            plain = dataclasses.replace(plain, seconds=statistics.median(samples), samples=samples)
    return Profiled(
        paths=calls,
        types=[types[p] for p in calls],
        plain=plain,
        options=options,
        fingerprint=fingerprint(model, paths),
        tiers=chosen_tiers,
        solve_seconds=solve_seconds,
        profile_seconds=time.perf_counter() - started,
        bandwidths=bandwidths,
        groups=[
            run if any(o.linked for o in options[types[p]]) else ""
            for run, p in zip(_linked_runs(calls, found.linked), calls, strict=True)
        ],
        chained=dict(found.chained),
        training=model.training,
        input_bytes=input_bytes(found.inputs[paths[0]]),
        side_bytes=_shared_side_bytes([found.side.get(p, {}) for p in paths]),
        device=device.type,
        autocast=autocast,
        repeated=repeated,
        frozen=list(found.frozen),
    )


def _shared_side_bytes(side: list[dict[int, int]]) -> int:
    """The bytes of the side inputs (``profile.side_inputs``) that every block got, the same
    storages in each; ``side`` holds each block's, ``storage_key`` -> bytes."""
    if not side:
        return 0
    shared = set(side[0]).intersection(*side[1:])
    return sum(side[0][k] for k in shared)


def _planned_blocks(profiled: Profiled) -> str:
    """Which blocks the plan chose options for, for an error that says no plan fits: the
    blocks found may not be the ones that hold the step's memory, or may run more than once."""
    paths = profiled.blocks
    span = paths[0] if len(paths) == 1 else f"{paths[0]} to {paths[-1]}"
    types = ", ".join(dict.fromkeys(c for _, c in profiled.fingerprint.get("blocks", [])))
    planned = f"It planned {len(paths)} block{'s' * (len(paths) > 1)}, {span} ({types})"
    if profiled.repeated:
        planned += f" ({_repeated(profiled.repeated)})"
    return f"{planned}; if the step's memory is elsewhere, name the blocks to plan with blocks=."


def _repeated(calls: dict[str, int]) -> str:
    """The blocks the forward calls more than once, for a message (see [ Shared blocks ])."""
    runs = ", ".join(f"{p!r} {n} times" for p, n in calls.items())
    return f"the forward called {runs}, each call planned as a block"


def _linked_runs(paths: list[str], linked: set[str]) -> list[str]:
    """Per block, the first block of its run of linked blocks: a segment on the region engine
    must not leave its run (see [ Segments on the region engine ] in ``apply.py``)."""
    runs: list[str] = []
    for i, p in enumerate(paths):
        runs.append(runs[-1] if i > 0 and p in linked else p)
    return runs


def _no_plan(
    profiled: Profiled,
    budget: Any,
    budget_bytes: int,
    smallest: int,
    checked: str = "",
    named: str = "the smallest that fits is",
) -> NoPlanFits:
    """The error that no plan fits ``budget``, naming ``smallest`` (and how a measured step
    ``checked`` it) and the blocks planned."""
    plain = profiled.plain.peak
    return NoPlanFits(
        f"remat.plan: no plan fits a budget of {fmt_bytes(budget_bytes)} ({budget!r}, "
        f"{budget_bytes} bytes); {named} {fmt_bytes(smallest)} "
        f"({smallest} bytes, {smallest / max(plain, 1):.0%} of the plain step's "
        f"{fmt_bytes(plain)}){checked}. Raise the budget. {_planned_blocks(profiled)}",
        smallest,
    )


def solve(
    profiled: Profiled, budget: Any, charges: Mapping[tuple[int, int], int] | None = None
) -> Plan:
    """The fastest plan for ``budget`` from what ``profiled`` measured. ``charges`` adds bytes
    to chosen options (block, option index) for the choice only (see :func:`solve_measured`);
    the plan's prediction is the model's own."""
    plain, costs, chain, options = profiled.plain, profiled.costs, profiled.chain, profiled.options
    budget_bytes = parse_budget(budget, plain.peak)
    start = time.perf_counter()
    found = _fastest_of_variants(profiled, budget_bytes, charges or {})
    dp_seconds = time.perf_counter() - start
    if found is None:
        smallest = min(_smallest(v.costs, v.chain) for v in profiled.chains())
        raise _no_plan(profiled, budget, budget_bytes, smallest)
    picks, optimal, peak, seconds = found
    curve = []
    for fraction in (1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.1):
        b = int(plain.peak * fraction)
        point = _fastest_of_variants(profiled, b, {}, time_limit=1.0)  # a point of the curve
        if point is not None:
            curve.append(
                {
                    "budget": float(b),
                    "peak": float(point.peak),
                    "seconds": plain.seconds + point.seconds,
                }
            )
    text = budget if isinstance(budget, str) else repr(budget)
    gaps = [o.gap for opts in options.values() for o in opts]
    return Plan(
        fingerprint=profiled.fingerprint,
        budget=budget_bytes,
        budget_text=text,
        plain_peak=plain.peak,
        plain_seconds=plain.seconds,
        predicted_peak=peak,
        predicted_seconds=plain.seconds + seconds,
        blocks=_blocks(profiled, picks),
        options=options,
        solver={
            "block": "HiGHS MILP (scipy.optimize.milp) per block type",
            "chain": _chain_solver(chain, optimal),
            "gap": max(gaps, default=0.0),
            "solve_seconds": profiled.solve_seconds + dp_seconds,
            "chain_costs": {
                "head": costs.head,
                "forward_head": costs.forward_head,
                "before": costs.before,
                "tail": costs.tail,
                "gaps": list(costs.gaps),
                "starts": list(costs.starts),
                "side": profiled.side_bytes,
            },
        },
        tiers=profiled.tiers,
        training=profiled.training,
        autocast=profiled.autocast.to_json() if profiled.autocast else None,
        bandwidths=dict(profiled.bandwidths),
        pareto=curve,
        measured={
            "profile_seconds": profiled.profile_seconds,
            "plain_kept": plain.kept,
            "plain_backward_peaks": plain.backward_peaks,
            "input_bytes": profiled.input_bytes,
            "device": profiled.device,
            "frozen": list(profiled.frozen),
            "calls": dict(profiled.repeated),
        },
    )


class _Answer(NamedTuple):
    """The fastest assignment :func:`_fastest_of_variants` found."""

    picks: list[int]  # indices into ``Profiled.chain`` (-1: inside a segment)
    optimal: bool  # its chain's solve proved it optimal
    peak: int  # predicted, without charges
    seconds: float  # beyond the plain step


def _fastest_of_variants(
    profiled: Profiled,
    budget: int,
    charges: Mapping[tuple[int, int], int],
    time_limit: float = CHAIN_MILP_SECONDS,
) -> _Answer | None:
    """The fastest assignment that fits ``budget`` over the chain of ``profiled`` and its
    variants (see [ Casts of shared blocks ]), the least peak breaking a tie; ``None`` where
    none fits. ``charges`` is keyed by ``profiled.chain``'s indices."""
    best: _Answer | None = None
    for costs, chain, names in profiled.chains():
        index = [{name: k for k, name in enumerate(here)} for here in names]
        mapped = {
            (i, index[i][name]): c
            for (i, k), c in charges.items()
            if (name := profiled.names[i][k]) in index[i]
        }
        answer = chain_solve(costs, _charged(chain, mapped), budget, time_limit=time_limit)
        if answer.picks is None:
            continue
        options = chosen(chain, answer.picks)
        seconds = sum(o.seconds for o in options)
        peak = chain_peak(costs, options)
        if best is None or (seconds, peak) < (best.seconds, best.peak):
            main = [
                profiled.names[i].index(names[i][k]) if k >= 0 else k
                for i, k in enumerate(answer.picks)
            ]
            best = _Answer(main, answer.optimal, peak, seconds)
    return best


def _chain_solver(chain: list[list[ChainOption]], optimal: bool) -> str:
    """How the chain was solved, for the plan (see [ Casts cached to the forward's end ])."""
    proof = f"not proven optimal within {CHAIN_MILP_SECONDS:g} s"
    if not any(o.cached for opts in chain for o in opts):
        if optimal:
            return "exact DP over the chain of blocks"
        # The DP's answer went to the MILP, which stopped at its time limit ([ The chain DP ]).
        return f"DP, then HiGHS MILP over the chain of blocks (past the DP's grid; {proof})"
    return (
        "DP, then HiGHS MILP over the chain of blocks (casts cached under autocast; "
        f"{'optimal' if optimal else proof})"
    )


def _blocks(profiled: Profiled, picks: list[int]) -> list[dict[str, Any]]:
    """A plan's ``blocks`` entries for an assignment: each block's option, for the blocks of
    a segment the path of its first block, and for a block called more than once each call's
    option."""
    out: dict[str, dict[str, Any]] = {}
    name, first = "", None  # the option in force, and the first block of its segment if any
    for i, (path, t, k) in enumerate(zip(profiled.paths, profiled.types, picks, strict=True)):
        if k >= 0:  # an option starts here; -1: the segment started before goes on
            name = profiled.names[i][k]
            first = path if profiled.chain[i][k].span > 1 else None
        if path in out:  # a later call of a shared block (see [ Shared blocks ])
            out[path]["calls"].append(name)
            continue
        entry: dict[str, Any] = {"path": path, "type": t, "option": name}
        if first is not None:
            entry["segment"] = first
        if path in profiled.repeated:
            entry["calls"] = [name]  # the option of each call; ``option``: the first's
        out[path] = entry
    return list(out.values())


def measured_peak(
    plan: Plan,
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> int:
    """The peak activation memory of one step of ``model`` set up as ``plan`` says (after a
    warm-up step), measured as the profile was; the model is left as it was found."""
    device = device_of(model, example_inputs)
    autocast = Autocast.from_json(plan.autocast)
    with outside(autocast), _as_found(model, device, loss_fn, example_inputs):
        try:
            plan.apply(model)
            step = _step(model, example_inputs, loss_fn)
            step()
            return peak_bytes(step, device)
        finally:
            undo_all(model)  # the blocks' options and segments, and the frozen blocks' watch
            plan.policies = []  # what report() counts starts at the user's own apply


def _charged(
    chain: list[list[ChainOption]], charges: Mapping[tuple[int, int], int]
) -> list[list[ChainOption]]:
    """``chain`` with ``charges[i, k]`` bytes added to what option ``k`` of block ``i`` keeps
    after its forward, needs in its backward and leaves after it: every term of a predicted
    peak (see [ The chain DP ]) of an assignment that picks it rises by at least that much."""
    if not charges:
        return chain
    return [
        [
            dataclasses.replace(o, kept=o.kept + c, backward=o.backward + c, left=o.left + c)
            if (c := charges.get((i, k), 0))
            else o
            for k, o in enumerate(opts)
        ]
        for i, opts in enumerate(chain)
    ]


def _picks(profiled: Profiled, plan: Plan) -> list[tuple[int, int]]:
    """The (block, option index) pairs a plan made by :func:`solve` chose."""
    entries = {entry["path"]: entry for entry in plan.blocks}
    seen: dict[str, int] = {}  # calls of each block so far
    out = []
    for i, path in enumerate(profiled.paths):  # each call of a shared block is a position
        entry = entries[path]
        call = seen[path] = seen.get(path, -1) + 1
        if entry.get("segment", path) == path:  # not inside a segment
            out.append((i, profiled.names[i].index(option_of_call(entry, call))))
    return out


def _over_budget(budget: Any, budget_bytes: int, peaks: list[int], then: str) -> NoPlanFits:
    """The error of :func:`solve_measured` when no plan measured within the budget: what the
    first measured, ``then`` what followed, and the least any measured."""
    smallest = min(peaks)
    return NoPlanFits(
        f"remat.plan: the fastest plan within {fmt_bytes(budget_bytes)} ({budget!r}) measured "
        f"{fmt_bytes(peaks[0])} at its peak, above the budget, and {then}; the least any plan "
        f"measured was {fmt_bytes(smallest)}: raise the budget to {smallest} bytes.",
        smallest,
    )


def solve_measured(
    profiled: Profiled,
    budget: Any,
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    attempts: int = 4,
) -> Plan:
    """:func:`solve`, then one measured step of the plan; where the measured peak is above
    the budget (the model missed something), solve again (see [ A plan measured above its
    budget ]).

    The plan keeps the model's prediction (``predicted_peak``) and records the measurement
    (``measured["verified_peak"]``) and how many solves it took. Where no plan fits, the
    :class:`NoPlanFits` raised names a budget a measured step confirmed (see [ The smallest
    budget, measured ]).
    """
    try:
        return _solve_measured(profiled, budget, model, example_inputs, loss_fn, attempts, [])
    except NoPlanFits as error:
        raise _confirmed(
            error, profiled, budget, model, example_inputs, loss_fn, attempts
        ) from None


# NOTE [ The smallest budget, measured ]
#
# The smallest budget the chain model predicts some plan fits is a prediction, and the model
# can be low: blocks of one type are measured on the first one's input, and a mixture of
# experts routes other tokens in each layer, so its other layers keep other bytes (a top-k
# model at 10% named 2,426,452 bytes, and planning at exactly that measured 2,586,824). So
# before ``NoPlanFits`` names a budget, the planner plans at it as ``solve_measured`` does, from
# the same profile, and a plan that measures within it confirms it. Where none does, the
# least peak those solves measured is above it, and is tried next, until a budget is
# confirmed, or reaches the plain step's peak (the profile measured the plain step: every block
# plain fits it), or ``_CONFIRM_STEPS`` measured steps are spent: then the error names the
# budget it would have tried next and says that no plan was measured at it. Measured peaks
# repeat from step to step (the allocator's events on the CPU), so planning at the named
# budget from the same profile takes the same solves and returns the plan that confirmed it.
_CONFIRM_STEPS = 12


def _confirmed(
    error: NoPlanFits,
    profiled: Profiled,
    budget: Any,
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    attempts: int,
) -> NoPlanFits:
    """The error to raise for ``budget``, where planning at it raised ``error``: one that
    names a budget at which :func:`solve_measured` returns a plan from ``profiled`` (see
    [ The smallest budget, measured ])."""
    budget_bytes = parse_budget(budget, profiled.plain.peak)
    candidate = max(error.smallest, budget_bytes + 1)
    left = _CONFIRM_STEPS
    while left > 0:
        if budget_bytes < profiled.plain.peak <= candidate:  # the profile measured the plain step
            checked = ": the plain step, every block plain, measured it"
            return _no_plan(profiled, budget, budget_bytes, profiled.plain.peak, checked)
        peaks: list[int] = []
        try:
            found = _solve_measured(
                profiled, candidate, model, example_inputs, loss_fn, min(attempts, left), peaks
            )
        except NoPlanFits as again:
            left -= max(len(peaks), 1)
            candidate = max(again.smallest, candidate + 1)
            continue
        peak = found.measured["verified_peak"]
        checked = f": a plan at that budget measured {fmt_bytes(peak)} ({peak} bytes)"
        return _no_plan(profiled, budget, budget_bytes, candidate, checked)
    unchecked = (
        f": every plan of {_CONFIRM_STEPS} more measured steps, made for budgets below it, "
        "measured above its budget, and no plan was measured at it"
    )
    return _no_plan(profiled, budget, budget_bytes, candidate, unchecked, "the next to try is")


def _solve_measured(
    profiled: Profiled,
    budget: Any,
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    attempts: int,
    peaks: list[int],
) -> Plan:
    """:func:`solve_measured` but for the error where no plan fits: that of the budget's own
    solves, the least peak they measured (in ``peaks``, each measured step's) or the model's
    prediction where none was measured."""
    # NOTE [ A plan measured above its budget ]
    #
    # A plan the model predicted at p measured m > budget. Either the model understates every
    # plan (what the blocks' neighbours hold, measured once) or only the options this plan
    # chose. One failure cannot tell the two apart, so the options a failed plan chose are
    # charged its whole error m - p (``_charged``): that plan is now predicted at m or more and
    # is never chosen again, and plans that share none of its options keep their prediction
    # (near the smallest budget, that is what finds the plan that fits). From the second
    # failure on, the least error of the failed plans, u, is taken as every plan's: the target
    # is budget - u and the charges are what each failed plan's error has beyond u, which
    # still excludes every failed plan (its charged prediction is at least m - u > target).
    budget_bytes = parse_budget(budget, profiled.plain.peak)
    failed: list[tuple[list[tuple[int, int]], int]] = []  # picks, and m - p
    for attempt in range(1, attempts + 1):
        common = min((e for _, e in failed), default=0) if len(failed) > 1 else 0
        charges: dict[tuple[int, int], int] = {}
        for picks, error in failed:
            for pick in picks:
                charges[pick] = max(charges.get(pick, 0), error - common)
        try:
            result = solve(profiled, budget_bytes - common if common else budget, charges)
        except RematError:
            if attempt == 1:
                raise
            raise _over_budget(
                budget, budget_bytes, peaks, "no other plan fits it by the model corrected for that"
            ) from None
        peak = measured_peak(result, model, example_inputs, loss_fn)
        peaks.append(peak)
        if peak <= budget_bytes:
            break
        if attempt == attempts:
            raise _over_budget(budget, budget_bytes, peaks, f"so did the next {attempts - 1}")
        failed.append((_picks(profiled, result), peak - result.predicted_peak))
    result.budget = budget_bytes
    result.budget_text = budget if isinstance(budget, str) else repr(budget)
    result.measured["verified_peak"] = peak
    result.measured["solves"] = attempt
    return result


def plan(
    model: nn.Module,
    example_inputs: Any,
    budget: Any = "50%",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    blocks: Any = None,
    tiers: Sequence[str] | None = None,
    points: int = 8,
    repeats: int = 5,
    segments: bool = True,
) -> Plan:
    """The fastest plan whose predicted peak activation memory fits ``budget``, checked by one
    measured step (see :func:`solve_measured`).

    Args:
        model: the model, in the mode it trains in (``model.train()``). One that
            ``torch.compile``, ``DistributedDataParallel`` or ``nn.DataParallel`` wraps is
            planned through the module inside: the plan's paths are the same with and without
            them, and no measured step runs a collective.
        example_inputs: one step's inputs: a tensor, a tuple of positional inputs, or a dict
            of keyword inputs (a Hugging Face batch).
        budget: activation memory (the step's peak above parameters, gradients and optimizer
            state): a fraction of the plain step's (``"50%"``, ``0.5``) or bytes
            (``600 * 2**20``, ``"1.5GiB"``).
        loss_fn: ``loss_fn(output) -> scalar``; by default the sum of the output, which must
            then be a tensor.
        blocks: the repeated blocks, as submodule paths (each must run and compute a gradient
            in the step; the path of an ``nn.ModuleList`` stands for its children) or a module
            class or tuple of classes; by default every child of an
            ``nn.ModuleList``/``nn.Sequential`` in a run of two or more of one class (a
            transformer's layers, a ResNet's blocks in each stage). Blocks found by default or
            by class that the step does not call, or that compute no gradient (frozen, fed an
            input that needs none), are left out.
        tiers: what the plan may use: ``"recompute"`` (the default, alone), ``"disk"`` (files
            in a private directory, see :class:`~remat.store.DiskTier`; the tier named
            ``"disk"`` when the plan runs, see :func:`remat.store.tiers`), ``"host"`` (pinned
            host memory, for a model on a CUDA device).
        points: caps swept per block type for the per-op options.
        repeats: timing repeats (medians) per measured option.
        segments: whether the plan may recompute consecutive blocks as one segment. Pass
            ``False`` for a model that ``fully_shard`` (FSDP2) shards block by block after
            planning: FSDP2 gathers a block's parameters for that block's own forward and
            backward, and a segment's recompute runs the blocks before it too.

    On a CUDA device it measures memory by the caching allocator's counters, and resets their
    peak statistics (``torch.cuda.max_memory_allocated`` reads from the last step it measured).

    Called inside ``torch.autocast``, it plans a loop that runs each forward and its loss under
    those settings and backward outside (see NOTE [ Planning under autocast ] in
    ``_autocast.py``); the plan records them (``Plan.autocast``).

    Raises :class:`~remat.RematError` for a malformed budget, and for one no plan fits,
    naming the smallest budget that fits.
    """
    parse_budget(budget, 1)  # a malformed budget fails before any work
    for name, value, least in (("points", points, 1), ("repeats", repeats, 0)):
        if type(value) is not int or value < least:
            raise RematError(
                f"remat.plan: {name} must be an int of at least {least}, got {value!r}."
            )
    if torch.is_inference_mode_enabled():
        raise RematError(
            "remat.plan: called under torch.inference_mode(), where no step computes "
            "gradients; the planner measures a training step (forward and backward). Plan "
            "outside it."
        )
    model = unwrapped(model)
    if isinstance(model, nn.Module):
        why = (
            "the profile would measure its recompute as the plain step, and the plan run around it"
        )
        modules.refuse_hf_checkpointing("remat.plan", model, why, ": the plan replaces it")
        refuse_set_up(
            "remat.plan", model, "the profile would measure remat's step as the plain one"
        )
    if not isinstance(segments, bool):
        raise RematError(f"remat.plan: segments must be True or False, got {segments!r}.")
    profiled = profile_model(
        model,
        example_inputs,
        loss_fn,
        blocks=blocks,
        tiers=tiers,
        points=points,
        repeats=repeats,
        segments=segments,
    )
    return solve_measured(profiled, budget, model, example_inputs, loss_fn)


def fit(
    model: nn.Module,
    example_inputs: Any,
    budget: Any = "50%",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **options: Any,
) -> Plan:
    """:func:`plan`, then ``Plan.apply(model)``; returns the plan."""
    result = plan(model, example_inputs, budget, loss_fn, **options)
    result.apply(model)
    return result
