"""``remat.plan`` and ``remat.fit``: profile, measure, solve, and hand back a :class:`Plan`.

The steps, each in its own module: find the blocks and capture their inputs
(``profile.py``), measure the plain step and each block type's options (``cost.py``), solve
per block type for a Pareto set of per-op options and over the chain for the budget
(``solve.py``), and write it all down (``_plan.py``). Planning leaves the model as it found
it: parameters, gradients, buffers (BatchNorm statistics) and the random generators.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import RematError
from ._budget import fmt_bytes, parse_budget
from ._plan import Option, Plan, fingerprint, segments
from .apply import apply_option, apply_segment, undo_option, undo_segment
from .cost import PlainStep, measure_memory, measure_plain_step, measure_seconds, peak_bytes
from .profile import BlockProfile, capture, find_blocks, first_tensor, fresh_inputs, profile_block
from .solve import (
    RECORD_OVERHEAD,
    ChainCosts,
    ChainOption,
    OpChoice,
    chain_dp,
    chain_peak,
    chosen,
    pareto,
)

__all__ = ["fit", "plan"]

_TIERS = ("recompute", "host", "disk")
MAX_SEGMENT = 12  # the most blocks one segment covers


class NoPlanFits(RematError):
    """No plan fits the budget; ``smallest`` is the budget in bytes the message names instead."""

    def __init__(self, message: str, smallest: int) -> None:
        super().__init__(message)
        self.smallest = smallest


def _step(
    model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None
) -> Callable[[], Any]:
    args = inputs if isinstance(inputs, tuple) else () if isinstance(inputs, dict) else (inputs,)
    kwargs = inputs if isinstance(inputs, dict) else {}

    def step() -> None:
        torch.manual_seed(0)
        # The output is not held during backward, as in a training loop that keeps the loss.
        out = model(*args, **kwargs)
        loss = loss_fn(out) if loss_fn is not None else out.sum()
        del out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise RematError(
                "remat.plan: loss_fn must return a one-element tensor, got "
                f"{type(loss).__name__}; pass loss_fn=lambda out: criterion(out, target)."
            )
        loss.backward()  # type: ignore[no-untyped-call]

    return step


def _tiers(tiers: Sequence[str] | None, device: torch.device) -> list[str]:
    if tiers is None:
        return ["recompute"]
    chosen = list(tiers)
    bad = [t for t in chosen if t not in _TIERS]
    if bad or not chosen:
        raise RematError(f"remat.plan: tiers must name some of {', '.join(_TIERS)}, got {tiers!r}.")
    if any(t != "recompute" for t in chosen):
        raise RematError(
            f"remat.plan: tiers={chosen!r}: the planner plans recompute only so far; offload by "
            "hand with remat.offload or remat.policies.offload_* and plan with "
            "tiers=['recompute']."
        )
    return chosen


def _decisions(
    profile: BlockProfile, choice: OpChoice
) -> tuple[dict[str, str], list[dict[str, Any]]]:
    decisions: dict[str, str] = {}
    tensors: list[dict[str, Any]] = []
    for i, op in enumerate(profile.ops):
        decision = "keep" if i in choice.keep else "recompute"
        decisions[op.key] = decision
        if op.saved:
            if op.must_save:
                reason = "must be saved (cannot be replayed safely)"
            elif op.view:
                reason = "a view: rebuilt from its base"
            elif decision == "keep":
                reason = "kept: rebuilding it costs more than its bytes are worth here"
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
        for b in self.blocks:
            out = b(*args, **kwargs)
            args = (first_tensor(out), *args[1:])
        return out


def _chains(block: nn.Module, inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> bool:
    """Whether ``block``'s first output can be its next copy's first argument."""
    args, kwargs = fresh_inputs(inputs)
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    with _as_found(block), torch.no_grad():
        out = block(*args, **kwargs)
    t = next((v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)), None)
    return t is not None and t.shape == args[0].shape and t.dtype == args[0].dtype


def _segments(
    block: nn.Module,
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    device: torch.device,
    longest: int,
    repeats: int,
    per_block: float,
) -> list[Option]:
    """Segment options of 2 to ``longest`` blocks (see [ Segments ] in ``solve.py``): those of
    two and three blocks measured on chains of copies of ``block`` against plain chains of the
    same length, longer ones extrapolated from them: bytes grow by what the third block added
    to the second (memory repeats to the byte), time by the mean per block of the two (a
    difference of two timings would carry their noise, times the blocks added). Kept and left
    bytes are written as the plain blocks' plus the segment's difference from a plain chain.
    ``per_block`` is the op model's extra seconds per block (a forward replayed and recorded),
    the prediction when nothing is timed (``repeats=0``)."""
    if longest < 2 or not _chains(block, inputs):
        return []
    single = measure_memory(copy.deepcopy(block), inputs, device)
    found: dict[int, tuple[float, float, float, float]] = {}
    for span in (2, 3)[: longest - 1]:
        plain = _Chain(block, span)
        segment = _Chain(block, span)
        apply_segment(segment, [f"blocks.{k}" for k in range(span)])
        p_kept, _, p_left = measure_memory(plain, inputs, device)
        kept_, backward_, left_ = measure_memory(segment, inputs, device)
        found[span] = (
            float(kept_ - p_kept + span * single[0]),
            float(backward_),
            float(left_ - p_left + span * single[2]),
            measure_seconds(segment, plain, inputs, repeats) if repeats > 0 else math.nan,
        )
    options = []
    for span in range(2, longest + 1):
        if span in found:
            values, source = found[span], "measured"
        else:  # memory: a block more adds what the third added; time: each block its share
            a, b = found[2], found[3]
            grown = [y + (span - 3) * (y - x) for x, y in zip(a[:3], b[:3], strict=True)]
            values = (grown[0], grown[1], grown[2], span * (a[3] + b[3]) / 5)
            source = "extrapolated"
        kept, backward, left, seconds = values
        options.append(
            Option(
                name=f"segment-{span}",
                kind="segment",
                kept=int(kept),
                backward=int(backward),
                seconds=span * per_block,
                measured_seconds=seconds if repeats > 0 else None,
                left=int(left),
                span=span,
                source=source,
            )
        )
    return options


def _options(
    block: nn.Module,
    inputs: Any,
    profile: BlockProfile,
    device: torch.device,
    points: int,
    repeats: int,
    longest: int = 1,
) -> tuple[list[Option], float]:
    """The options of one block type, each measured on a copy of ``block``; the solve time."""
    start = time.perf_counter()
    front = pareto(profile, points=points)
    solve_seconds = time.perf_counter() - start
    plain = copy.deepcopy(block)
    candidates: list[tuple[str, str, dict[str, str], list[dict[str, Any]], float, float]] = [
        ("plain", "plain", {}, [], 0.0, 0.0),
        ("region", "region", {}, [], profile.forward_seconds, 0.0),
        # The graph engine records every op in forward, and replays what it must.
    ]
    for k, choice in enumerate(front):
        decisions, tensors = _decisions(profile, choice)
        seconds = choice.seconds + RECORD_OVERHEAD * len(profile.ops)
        candidates.append((f"graph-{k}", "graph", decisions, tensors, seconds, choice.gap))
    options: list[Option] = []
    for name, kind, decisions, tensors, predicted, gap in candidates:
        copy_ = copy.deepcopy(block)
        apply_option(copy_, name, kind, decisions)
        kept, backward, left = measure_memory(copy_, inputs, device)
        measured = None
        if repeats > 0:
            measured = 0.0 if kind == "plain" else measure_seconds(copy_, plain, inputs, repeats)
        options.append(
            Option(name, kind, kept, backward, predicted, measured, left, gap, decisions, tensors)
        )
    # Drop options another option beats on every count (segments compete among themselves
    # only: one covers more blocks).
    kept_options = [
        o
        for o in options
        if o.kind == "plain"
        or not any(
            p is not o
            and p.kept <= o.kept
            and p.backward <= o.backward
            and p.seconds <= o.seconds
            and p.left <= o.left
            and p.span == o.span
            and (p.kept, p.backward, p.seconds, p.left) != (o.kept, o.backward, o.seconds, o.left)
            for p in options
        )
    ]
    per_block = profile.forward_seconds + RECORD_OVERHEAD * len(profile.ops)
    segments = _segments(block, inputs, device, longest, repeats, per_block)
    return kept_options + segments, solve_seconds


def _runs(types: list[str]) -> dict[str, int]:
    """The longest run of consecutive blocks of each type."""
    longest: dict[str, int] = {}
    run = 0
    for i, t in enumerate(types):
        run = run + 1 if i and types[i - 1] == t else 1
        longest[t] = max(longest.get(t, 0), run)
    return longest


def _chain(
    plain: PlainStep, types: list[str], options: dict[str, list[Option]]
) -> tuple[ChainCosts, list[list[ChainOption]], list[list[str]]]:
    """The chain model's constants, and per block the options that may start there (a segment
    only where the blocks it covers are of one type) with their names."""
    base = {name: next(o for o in opts if o.kind == "plain") for name, opts in options.items()}
    # What is live besides the blocks' kept bytes at each block's backward, measured there: in
    # a U-Net the skip tensors and their gradients make it differ from block to block, and one
    # constant (the largest) overstated the peak of every plan by up to a block's activations.
    gaps = tuple(
        plain.backward_peaks[i] - base[t].backward - sum(plain.kept[:i])
        for i, t in enumerate(types)
    )
    costs = ChainCosts(head=plain.head - sum(plain.kept), before=0, tail=plain.tail, gaps=gaps)
    chain: list[list[ChainOption]] = []
    names: list[list[str]] = []
    for i, t in enumerate(types):
        here = [o for o in options[t] if o.span == 1 or types[i : i + o.span] == [t] * o.span]
        chain.append(
            [
                ChainOption(
                    kept=max(sum(plain.kept[i : i + o.span]) + o.kept - o.span * base[t].kept, 0),
                    backward=o.backward,
                    # Measured (paired medians) where the planner measured, else the op model.
                    seconds=o.measured_seconds if o.measured_seconds is not None else o.seconds,
                    # What it holds after its own backward until the whole backward ends, beyond
                    # plain: a graph-engine region's records, and a region's saved input
                    # (measured: a ConvNet's regions hold it, and leaving it out underestimated
                    # their peak).
                    left=max(o.left - o.span * base[t].left, 0),
                    span=o.span,
                )
                for o in here
            ]
        )
        names.append([o.name for o in here])
    return costs, chain, names


def _smallest(costs: ChainCosts, chain: list[list[ChainOption]]) -> int:
    """The smallest budget the chain DP can meet: bisection on feasibility, then the predicted
    peak of the plan at the budget found (which fits that peak itself)."""
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
    picks = chain_dp(costs, chain, high)
    if picks is not None:
        peak = chain_peak(costs, chosen(chain, picks))
        if chain_dp(costs, chain, peak) is not None:
            return peak
    return high


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
    costs: ChainCosts = field(init=False)
    chain: list[list[ChainOption]] = field(init=False)
    names: list[list[str]] = field(init=False)  # the name of each chain option

    def __post_init__(self) -> None:
        self.costs, self.chain, self.names = _chain(self.plain, self.types, self.options)


@contextlib.contextmanager
def _as_found(model: nn.Module) -> Iterator[None]:
    """Planning leaves the model as it found it: buffers (BatchNorm statistics), gradients and
    the CPU random generator are put back on the way out."""
    rng = torch.get_rng_state()
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else None)
        for n, p in model.named_parameters()
    }
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        for n, p in model.named_parameters():
            p.grad = grads.get(n)


def profile_model(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    blocks: Any = None,
    tiers: Sequence[str] | None = None,
    points: int = 8,
    repeats: int = 5,
) -> Profiled:
    """Measure ``model``'s plain step and each block type's options (see ``cost.py``)."""
    if not isinstance(model, nn.Module):
        raise RematError(f"remat.plan: expected an nn.Module, got {type(model).__name__}.")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    chosen_tiers = _tiers(tiers, device)
    paths = find_blocks(model, blocks)
    started = time.perf_counter()
    with _as_found(model):
        step = _step(model, example_inputs, loss_fn)
        found = capture(model, paths, step)
        plain = measure_plain_step(model, paths, step, device, repeats=max(repeats // 2, 1))
        options: dict[str, list[Option]] = {}
        solve_seconds = 0.0
        longest = {t: min(n, MAX_SEGMENT) for t, n in _runs(found.types).items()}
        for t in dict.fromkeys(found.types):
            path = paths[found.types.index(t)]
            block = model.get_submodule(path)
            profile = profile_block(block, found.inputs[path], t, repeats=max(repeats // 2, 1))
            options[t], seconds = _options(
                block, found.inputs[path], profile, device, points, repeats, longest[t]
            )
            solve_seconds += seconds
    return Profiled(
        paths=paths,
        types=found.types,
        plain=plain,
        options=options,
        fingerprint=fingerprint(model, paths),
        tiers=chosen_tiers,
        solve_seconds=solve_seconds,
        profile_seconds=time.perf_counter() - started,
    )


def solve(profiled: Profiled, budget: Any) -> Plan:
    """The fastest plan for ``budget`` from what ``profiled`` measured."""
    plain, costs, chain, options = profiled.plain, profiled.costs, profiled.chain, profiled.options
    budget_bytes = parse_budget(budget, plain.peak)
    start = time.perf_counter()
    picks = chain_dp(costs, chain, budget_bytes)
    dp_seconds = time.perf_counter() - start
    if picks is None:
        smallest = _smallest(costs, chain)
        raise NoPlanFits(
            f"remat.plan: no plan fits a budget of {fmt_bytes(budget_bytes)} ({budget!r}); the "
            f"smallest that fits is {fmt_bytes(smallest)} ({smallest} bytes, "
            f"{smallest / max(plain.peak, 1):.0%} of the plain step's "
            f"{fmt_bytes(plain.peak)}). Raise the budget.",
            smallest,
        )
    picked = chosen(chain, picks)
    curve = []
    for fraction in (1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.1):
        b = int(plain.peak * fraction)
        p = chain_dp(costs, chain, b)
        if p is not None:
            opts = chosen(chain, p)
            curve.append(
                {
                    "budget": float(b),
                    "peak": float(chain_peak(costs, opts)),
                    "seconds": plain.seconds + sum(o.seconds for o in opts),
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
        predicted_peak=chain_peak(costs, picked),
        predicted_seconds=plain.seconds + sum(o.seconds for o in picked),
        blocks=_blocks(profiled, picks),
        options=options,
        solver={
            "block": "HiGHS MILP (scipy.optimize.milp) per block type",
            "chain": "exact DP over the chain of blocks",
            "gap": max(gaps, default=0.0),
            "solve_seconds": profiled.solve_seconds + dp_seconds,
            "chain_costs": {
                "head": costs.head,
                "before": costs.before,
                "tail": costs.tail,
                "gaps": list(costs.gaps),
            },
        },
        tiers=profiled.tiers,
        bandwidths={},
        pareto=curve,
        measured={
            "profile_seconds": profiled.profile_seconds,
            "plain_kept": plain.kept,
            "plain_backward_peaks": plain.backward_peaks,
        },
    )


def _blocks(profiled: Profiled, picks: list[int]) -> list[dict[str, str]]:
    """A plan's ``blocks`` entries for an assignment: each block's option, and for the blocks
    of a segment the path of its first block."""
    out: list[dict[str, str]] = []
    name, first = "", None  # the option in force, and the first block of its segment if any
    for i, (path, t, k) in enumerate(zip(profiled.paths, profiled.types, picks, strict=True)):
        if k >= 0:  # an option starts here; -1: the segment started before goes on
            name = profiled.names[i][k]
            first = path if profiled.chain[i][k].span > 1 else None
        entry = {"path": path, "type": t, "option": name}
        if first is not None:
            entry["segment"] = first
        out.append(entry)
    return out


def measured_peak(
    plan: Plan,
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> int:
    """The peak activation memory of one step of ``model`` set up as ``plan`` says (after a
    warm-up step), measured as the profile was; the model is left as it was found."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    blocks = [model.get_submodule(b["path"]) for b in plan.blocks]
    with _as_found(model):
        try:
            plan.apply(model)
            step = _step(model, example_inputs, loss_fn)
            step()
            return peak_bytes(step, device)
        finally:
            for block in blocks:
                undo_option(block)
            for paths in segments(plan.blocks):
                undo_segment(model, paths)
            plan.policies = []  # what report() counts starts at the user's own apply


def solve_measured(
    profiled: Profiled,
    budget: Any,
    model: nn.Module,
    example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    attempts: int = 4,
) -> Plan:
    """:func:`solve`, then one measured step of the plan: where the measured peak is above
    the budget (the model missed something), solve again for plans predicted below the budget
    by as much as the model understated this one.

    The plan keeps the model's prediction (``predicted_peak``) and records the measurement
    (``measured["verified_peak"]``) and how many solves it took.
    """
    budget_bytes = parse_budget(budget, profiled.plain.peak)
    target: Any = budget
    peak = 0
    for attempt in range(1, attempts + 1):
        try:
            result = solve(profiled, target)
        except RematError:
            if attempt == 1:
                raise
            raise NoPlanFits(
                f"remat.plan: the fastest plan within {fmt_bytes(budget_bytes)} ({budget!r}) "
                f"measured {fmt_bytes(peak)} at its peak, above the budget, and no plan fits "
                f"a tighter one; raise the budget to {fmt_bytes(peak)} ({peak} bytes).",
                peak,
            ) from None
        peak = measured_peak(result, model, example_inputs, loss_fn)
        if peak <= budget_bytes:
            break
        # The model understated this plan's peak by (peak - predicted): the next plan must be
        # predicted that much below the budget, which excludes this one.
        target = min(result.budget, result.predicted_peak) - (peak - budget_bytes)
        if target <= 0 or attempt == attempts:
            raise NoPlanFits(
                f"remat.plan: the fastest plan within {fmt_bytes(budget_bytes)} ({budget!r}) "
                f"measured {fmt_bytes(peak)} at its peak, above the budget; raise the budget to "
                f"{fmt_bytes(peak)} ({peak} bytes).",
                peak,
            )
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
) -> Plan:
    """The fastest plan whose predicted peak activation memory fits ``budget``, checked by one
    measured step (see :func:`solve_measured`).

    Args:
        model: the model, in the mode it trains in (``model.train()``).
        example_inputs: one step's inputs: a tensor, a tuple of positional inputs, or a dict
            of keyword inputs (a Hugging Face batch).
        budget: activation memory (the step's peak above parameters, gradients and optimizer
            state): a fraction of the plain step's (``"50%"``, ``0.5``) or bytes
            (``600 * 2**20``, ``"1.5GiB"``).
        loss_fn: ``loss_fn(output) -> scalar``; by default the sum of the output.
        blocks: the repeated blocks, as submodule paths or a module class; by default the
            children of the largest ``nn.ModuleList``/``nn.Sequential`` of one class.
        tiers: what the plan may use; ``["recompute"]`` (the default) so far.
        points: caps swept per block type for the per-op options.
        repeats: timing repeats (medians) per measured option.

    Raises :class:`~remat.RematError` for a malformed budget, and for one no plan fits,
    naming the smallest budget that fits.
    """
    parse_budget(budget, 1)  # a malformed budget fails before any work
    profiled = profile_model(
        model, example_inputs, loss_fn, blocks=blocks, tiers=tiers, points=points, repeats=repeats
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
