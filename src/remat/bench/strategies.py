"""The strategies ``remat bench`` compares, in one registry.

A strategy changes a freshly built model in place so that its training step keeps, drops or
offloads activations in its own way. Each capability of remat adds its strategies here as
entries; the benchmark runs whatever is registered.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from .. import modules as remat_modules
from .. import policies
from ..checkpoint import RegionOptions, run_region
from ..errors import RematError, did_you_mean
from ..store import offload
from ..workloads import Workload

__all__: list[str] = []

# Checkpoints a callable: (function, *args) -> output.
Checkpointer = Callable[..., Any]


@dataclass(frozen=True)
class Strategy:
    """One way to run a training step: a name, what it does, and how to set a model up.

    ``counterpart`` names the baseline that works at the same granularity, against which the
    benchmark reports this strategy's time.
    """

    name: str
    description: str
    prepare: Callable[[nn.Module, Workload], None]
    counterpart: str | None = None
    needs_chain: bool = False
    needs_accelerator: bool = False
    needs_hf: bool = False  # a Hugging Face model (``remat bench --hf``)

    def unsupported(self, workload: Workload, device: str = "cpu") -> str | None:
        """Why this strategy cannot run on ``workload`` on ``device``, or None if it can."""
        if self.needs_chain and not workload.blocks_chain:
            return f"needs blocks that feed each other directly, which {workload.name} lacks"
        if self.needs_hf and not workload.name.startswith("hf-"):
            return "enables remat through remat.hf, on Hugging Face models (--hf) only"
        if self.needs_accelerator and device == "cpu":
            return "moves tensors from an accelerator to host memory; there is none on cpu"
        return None


def _torch_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _torch_sac(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=_save_matmuls_context, **kwargs
    )


def _save_matmuls(
    ctx: Any, op: Any, *args: Any, **kwargs: Any
) -> torch_checkpoint.CheckpointPolicy:
    # Matrix multiplies and attention are the expensive ops: save their outputs.
    if op in policies.MATMULS:
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls_context() -> Any:
    return torch_checkpoint.create_selective_checkpoint_contexts(_save_matmuls)  # type: ignore[no-untyped-call]


_REMAT_OPTIONS = RegionOptions()


def _remat_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return run_region(function, args, kwargs, _REMAT_OPTIONS)


def _graph(policy: policies.Policy) -> Callable[[nn.Module, Workload], None]:
    def prepare(model: nn.Module, workload: Workload) -> None:
        for _, block in workload.blocks(model):
            remat_modules.checkpoint_wrapper(block, policy=policy)

    return prepare


def _wrap(block: nn.Module, checkpointer: Checkpointer) -> None:
    forward = types.MethodType(type(block).forward, block)
    block.forward = functools.partial(checkpointer, forward)


def _every(k: int, checkpointer: Checkpointer) -> Callable[[nn.Module, Workload], None]:
    def prepare(model: nn.Module, workload: Workload) -> None:
        blocks = [m for _, m in workload.blocks(model)]
        for block in blocks[::k]:
            if checkpointer is _remat_checkpoint:
                remat_modules.checkpoint_wrapper(block)
            else:
                _wrap(block, checkpointer)

    return prepare


def _segments(count: int, checkpointer: Checkpointer) -> Callable[[nn.Module, Workload], None]:
    """``checkpoint_sequential`` over the blocks: ``count`` runs, all but the last checkpointed.

    The first block of each checkpointed run executes the whole run inside one region; the
    others pass their input through, so the model's own loop over its blocks is unchanged.
    """

    def prepare(model: nn.Module, workload: Workload) -> None:
        blocks = [m for _, m in workload.blocks(model)]
        if not workload.blocks_chain:
            raise RematError(
                f"remat bench: segments need blocks that feed each other directly; "
                f"{workload.name} has operations between its blocks."
            )
        if not 1 <= count <= len(blocks):
            raise RematError(
                f"remat bench: {count} segments need at least {count} blocks; "
                f"{workload.name} has {len(blocks)}."
            )
        size = len(blocks) // count
        for start in range(0, size * (count - 1), size):
            run = blocks[start : start + size]
            forwards = [types.MethodType(type(b).forward, b) for b in run]
            run[0].forward = functools.partial(checkpointer, functools.partial(_run_all, forwards))
            for block in run[1:]:
                block.forward = _identity

    return prepare


def _run_all(forwards: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    for forward in forwards:
        x = forward(x)
    return x


def _identity(x: Any) -> Any:
    return x


def _hf_enable(model: nn.Module, workload: Workload) -> None:
    from .. import hf

    hf.enable(model)


def _none(model: nn.Module, workload: Workload) -> None:
    return None


def _offloaded(tier: Literal["host", "disk"]) -> Callable[[nn.Module, Workload], None]:
    """The whole forward inside ``remat.offload(tier)``: every saved tensor of 1 KiB or more
    goes to the tier (with region strategies applied first, only what they save)."""

    def prepare(model: nn.Module, workload: Workload) -> None:
        forward = model.forward

        def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
            with offload(tier):
                return forward(*args, **kwargs)

        model.forward = offloaded_forward

    return prepare


def _then(*steps: Callable[[nn.Module, Workload], None]) -> Callable[[nn.Module, Workload], None]:
    def prepare(model: nn.Module, workload: Workload) -> None:
        for step in steps:
            step(model, workload)

    return prepare


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("none", "no checkpointing", _none),
        Strategy("torch-block", "torch checkpoint, every block", _every(1, _torch_checkpoint)),
        Strategy(
            "torch-every-2", "torch checkpoint, every 2nd block", _every(2, _torch_checkpoint)
        ),
        Strategy("torch-sac-mm", "torch SAC saving matmuls, every block", _every(1, _torch_sac)),
        Strategy(
            "torch-seq-3",
            "torch checkpoint_sequential, 3 segments",
            _segments(3, _torch_checkpoint),
            needs_chain=True,
        ),
        Strategy(
            "remat-block",
            "remat region engine, every block",
            _every(1, _remat_checkpoint),
            "torch-block",
        ),
        Strategy(
            "remat-every-2",
            "remat region engine, every 2nd block",
            _every(2, _remat_checkpoint),
            "torch-every-2",
        ),
        Strategy(
            "remat-hf",
            "remat.hf.enable(model): every layer a region, in one call",
            _hf_enable,
            "torch-block",
            needs_hf=True,
        ),
        Strategy(
            "remat-graph-mm",
            "remat graph engine saving matmuls, every block",
            _graph(policies.save_matmuls),
            "torch-sac-mm",
        ),
        Strategy(
            "remat-graph-all",
            "remat graph engine recomputing everything, every block",
            _graph(policies.recompute_everything),
            "remat-block",
        ),
        Strategy(
            "remat-seq-3",
            "remat region engine, 3 segments",
            _segments(3, _remat_checkpoint),
            "torch-seq-3",
            needs_chain=True,
        ),
        Strategy(
            "offload-host",
            "remat.offload('host'): every saved tensor in pinned host memory",
            _offloaded("host"),
            "none",
            needs_accelerator=True,
        ),
        Strategy(
            "offload-disk",
            "remat.offload('disk'): every saved tensor in files",
            _offloaded("disk"),
            "none",
        ),
        Strategy(
            "remat-block-disk",
            "remat region engine every block, block inputs in files",
            _then(_every(1, _remat_checkpoint), _offloaded("disk")),
            "remat-block",
        ),
        Strategy(
            "remat-graph-mm-disk",
            "remat graph engine every block, matmul outputs in files, the rest recomputed",
            _graph(policies.offload_matmuls("disk")),
            "remat-graph-mm",
        ),
    )
}


# ``remat-auto@50%``: remat.plan at a fraction of the plain step's peak activation memory.
# ``remat-auto@torch-block``: at the peak ``remat bench`` measured for torch-block in the same
# run, timed against torch-block.
AUTO = "remat-auto@"
TORCH = "torch-"

# Plans handed to a measuring process by ``remat bench``, by strategy name: what
# :func:`plan_budgets` returns for each, the plan as JSON under ``"plan"``. A fraction without
# one is planned in the process that measures it.
PLANS: dict[str, dict[str, Any]] = {}
# What each planned model's plan predicted, by ``id(model)``, for the measuring process to
# report next to what it measured.
PREDICTED: dict[int, dict[str, Any]] = {}


# ``remat-auto-disk@10%``: the same, with the disk tier among what the plan may use.
AUTO_DISK = "remat-auto-disk@"


def is_auto(name: str) -> bool:
    """Whether ``name`` is a planned strategy (``remat-auto@...``, ``remat-auto-disk@...``)."""
    return name.startswith((AUTO, AUTO_DISK))


def _spec(name: str) -> str:
    """What follows the ``@`` of a planned strategy's name."""
    for prefix in (AUTO, AUTO_DISK):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return ""


def plan_tiers(name: str) -> list[str]:
    """The tiers the planned strategy ``name`` may use."""
    return ["recompute", "disk"] if name.startswith(AUTO_DISK) else ["recompute"]


def auto_name(budget: float, tier: str | None = None) -> str:
    """``remat-auto@50%`` for 0.5; ``remat-auto-disk@50%`` with the disk tier."""
    return f"{AUTO_DISK if tier == 'disk' else AUTO}{budget * 100:g}%"


def matched_name(torch_name: str) -> str:
    """``remat-auto@torch-block`` for torch-block: planned at torch-block's measured peak."""
    return f"{AUTO}{torch_name}"


def matched_torch(name: str) -> str | None:
    """The torch strategy at whose measured peak ``name`` is planned, or None."""
    spec = _spec(name)
    return spec if spec.startswith(TORCH) else None


def budget_of(name: str, peaks: Mapping[str, int]) -> str | int:
    """The budget ``remat.plan`` gets for the planned strategy ``name``: its fraction
    (``"50%"``), or the bytes ``peaks`` (measured peaks by strategy) holds for its torch
    strategy."""
    torch_name = matched_torch(name)
    if torch_name is None:
        return _spec(name)
    return int(peaks[torch_name])


def _planning_inputs(
    workload: Workload, seed: int, device: torch.device
) -> tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]:
    model = workload.model(seed).to(device)
    inputs, target = (t.to(device) for t in workload.batch(seed))

    def loss_fn(out: Any) -> torch.Tensor:
        return workload.loss_fn(out, target)

    return model, inputs, loss_fn


def plan_budgets(
    workload: Workload, budgets: Mapping[str, str | int], seed: int, device: torch.device
) -> dict[str, dict[str, Any]]:
    """Plans for ``budgets`` (strategy name -> budget), from one profile of the workload's model.

    The profile measures the options of every tier some name may use (``plan_tiers``); each
    name is solved from the options of its own tiers. Each budget is solved and checked by one
    measured step (``solve_measured``), on a fresh model. Where no plan fits, the plan is made
    at the budget the planner names instead, and says so: ``budget_feasible`` 0,
    ``budget_bytes`` that budget, ``no_plan`` the planner's message. Each entry also holds
    the plan as JSON (``plan``), its prediction, the seconds of the shared profile
    (``profile_seconds``) and of its own solve and check (``plan_seconds``), and its blocks'
    options in runs (``plan_blocks``, see ``Plan.block_runs``).
    """
    from ..planning.planner import profile_model

    model, inputs, loss_fn = _planning_inputs(workload, seed, device)
    started = time.perf_counter()
    blocks = [name for name, _ in workload.blocks(model)]
    tiers = list(dict.fromkeys(t for name in budgets for t in plan_tiers(name)))
    with workload.forward_context(device):  # the planner plans the loop's autocast
        profiled = profile_model(model, inputs, loss_fn, blocks=blocks, tiers=tiers)
    profile_seconds = time.perf_counter() - started
    return {
        name: {
            **_plan_at(profiled.restricted(plan_tiers(name)), budget, workload, seed, device),
            "profile_seconds": profile_seconds,
        }
        for name, budget in budgets.items()
    }


def _plan_at(
    profiled: Any, budget: str | int, workload: Workload, seed: int, device: torch.device
) -> dict[str, Any]:
    from ..errors import NoPlanFits
    from ..planning.planner import solve, solve_measured

    model, inputs, loss_fn = _planning_inputs(workload, seed, device)
    started = time.perf_counter()
    outcome: dict[str, Any] = {"budget_feasible": 1.0}
    try:
        plan = solve_measured(profiled, budget, model, inputs, loss_fn)
    except NoPlanFits as error:
        plan = solve(profiled, error.smallest)
        outcome = {"budget_feasible": 0.0, "no_plan": str(error)}
    return {
        "plan": plan.to_json(),
        **outcome,
        "budget_bytes": float(plan.budget),
        "predicted_peak_bytes": float(plan.predicted_peak),
        "predicted_time_ratio": plan.predicted_seconds / max(plan.plain_seconds, 1e-12),
        "plan_blocks": plan.block_runs(),
        "plan_seconds": time.perf_counter() - started,
        "solve_seconds": float(plan.solver["solve_seconds"]),
    }


def _auto(name: str) -> Callable[[nn.Module, Workload], None]:
    def prepare(model: nn.Module, workload: Workload) -> None:
        from ..planning import Plan

        planned = PLANS.get(name) or _plan_here(name, model, workload)
        Plan.from_json(planned["plan"]).apply(model)
        PREDICTED[id(model)] = {k: v for k, v in planned.items() if k != "plan"}

    return prepare


def _plan_here(name: str, model: nn.Module, workload: Workload) -> dict[str, Any]:
    """A plan for ``name`` made in this process (measurements outside ``remat bench``), from a
    profile of the workload's model of seed 0."""
    torch_name = matched_torch(name)
    if torch_name is not None:
        raise RematError(
            f"remat bench: {name} is planned at the peak remat bench measures for "
            f"{torch_name} in the same run, and none was handed over; run it with "
            f"remat bench --strategies {torch_name} --budgets torch."
        )
    device = next(model.parameters()).device
    return plan_budgets(workload, {name: budget_of(name, {})}, 0, device)[name]


def get_strategy(name: str) -> Strategy:
    if is_auto(name):
        return _auto_strategy(name)
    try:
        return STRATEGIES[name]
    except KeyError:
        raise RematError(
            f"remat bench: unknown strategy {name!r}{did_you_mean(name, list(STRATEGIES))}; "
            f"expected any of: {', '.join(STRATEGIES)}."
        ) from None


def _auto_strategy(name: str) -> Strategy:
    torch_name = matched_torch(name)
    if torch_name is not None:
        get_strategy(torch_name)  # an unknown torch strategy fails here, naming the known ones
        return Strategy(
            name, f"remat.plan at {torch_name}'s measured peak", _auto(name), torch_name
        )
    budget = _spec(name)
    from ..planning._budget import parse_budget

    parse_budget(budget, 1)  # a malformed budget fails here, with the planner's message
    tiers = " and ".join(plan_tiers(name))
    return Strategy(
        name,
        f"remat.plan at a budget of {budget} of the plain peak ({tiers})",
        _auto(name),
        "none",
    )
