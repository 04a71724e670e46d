"""Regions under ``torch.compile``, and compiled functions inside regions.

remat's engines work by hooks and dispatch modes that run in eager mode: the region engine
re-runs Python in backward, the graph engine records ATen ops with a ``TorchDispatchMode``.
Dynamo cannot trace either, and a compiled function re-run under a dispatch mode is traced
again. This module keeps both directions working.

NOTE [ Regions under torch.compile ]

1. While Dynamo traces (``torch.compiler.is_compiling()``), a region lowers to what the
   compiler understands: ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)``,
   which Dynamo turns into its checkpoint higher-order op, so the region stays in the one
   graph and the compiler's partitioner recomputes it in backward.
2. A region with a policy (the graph engine) lowers the same way with a selective-checkpoint
   context: ``create_selective_checkpoint_contexts(torch_policy)``. The adapter asks
   the remat policy and answers with a ``CheckpointPolicy``:

   - ``SAVE`` and ``RECOMPUTE`` map one to one (``MUST_`` and ``PREFER_`` kept);
   - an op that must be saved (``policies.must_save_reason``) is saved whatever the policy
     prefers, as in eager; ``MUST_RECOMPUTE`` on it raises;
   - ``PREFER_OFFLOAD_*`` becomes ``PREFER_SAVE`` (the compiled graph holds its tensors in
     device memory); ``MUST_OFFLOAD_*`` raises, naming the op;
   - the policy sees an ``OpContext`` with no tags, no attention flag and
     ``output_bytes=None`` (the compiler asks before the op runs). Its ``module`` is the
     module the op ran in, named as the eager graph engine names it, for a module's region
     (``checkpoint_wrapper``, ``remat.apply``, a plan): the trace's ``nn_module_stack`` keys
     each module by ``str(id(module))``, which the region's table of its modules, made at
     its first compiled call, turns into the name. Modules added after that call, and
     function regions, get the region's name. A policy that counts ops within a call (a
     plan's) starts afresh at each traced pass of the region (the ``context_fn`` runs once
     per pass; the compiler traces a region twice).

3. What the compiler does differs from remat's eager engines in these ways: module state
   written in forward (BatchNorm statistics) is written as torch's compiled checkpoint writes
   it, which is once (the compiled graph applies buffer writes in forward only); what is
   recomputed, and how random ops are replayed, is the partitioner's choice, not remat's early
   stop and RNG replay; region inputs stay on the device (``offload_to_cpu`` with accelerator
   inputs raises); ``remat.region`` blocks (no function to lower) run eagerly, with a graph
   break around them.
4. Linked calls (a planned segment over blocks a model's loop calls, NOTE [ Linked calls ] in
   ``checkpoint.py``) have no one function to lower: each call lowers to its own checkpoint,
   so the compiled step holds each block's input where the eager segment holds the first
   block's alone (a block's input against its activations: a few percent more memory than
   the plan). A graph-engine segment, recorded between hooks that Dynamo cannot trace, lowers
   the same way, block by block (``planning.apply.SegmentForward``).

NOTE [ Compiled functions inside a region ]

``remat.checkpoint(torch.compile(block), x)`` in eager: the region engine re-runs the compiled
callable in backward. Run under the write guard's dispatch mode, Dynamo would see a different
dispatch state, trace the function again, and save different tensors. So a compiled callable
is recomputed without dispatch modes (:class:`CompiledRegion`); the guard's job, keeping
module state from being written twice, is done around the call instead: the buffers of a compiled
module are copied before the recompute and each one whose value changed is written back (the
compiled graph may write buffers without moving their version counters, so values are
compared); a parameter or input whose version counter the recompute moved raises
:class:`~remat.CheckpointError`, since nothing remat holds could undo it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import _state
from .errors import CheckpointError, RematError
from .policies import Decision, OpContext, as_decision, must_save_reason

__all__: list[str] = []

_TO_TORCH = {
    Decision.MUST_SAVE: CheckpointPolicy.MUST_SAVE,
    Decision.PREFER_SAVE: CheckpointPolicy.PREFER_SAVE,
    Decision.MUST_RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE,
    Decision.PREFER_RECOMPUTE: CheckpointPolicy.PREFER_RECOMPUTE,
    Decision.PREFER_OFFLOAD_HOST: CheckpointPolicy.PREFER_SAVE,
    Decision.PREFER_OFFLOAD_DISK: CheckpointPolicy.PREFER_SAVE,
}


# A region's modules for rule 2 of [ Regions under torch.compile ]: the root's name, and
# (str(id(module)), its path below the root) for the root ("") and each module inside it.
ModuleNames = tuple[str, tuple[tuple[str, str], ...]]


def module_names(module: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """The ``(str(id), path)`` pairs of ``module`` and the modules inside it."""
    return tuple((str(id(m)), name) for name, m in module.named_modules())


@functools.lru_cache(maxsize=256)
def _by_id(names: tuple[tuple[str, str], ...]) -> dict[str, str]:
    return dict(names)


def _op_module(region: str, names: ModuleNames | None) -> str:
    """The qualified name of the module the op being traced ran in, as the eager graph engine
    names it, from the trace's ``nn_module_stack`` (keyed by ``str(id(module))``); the
    region's name where the stack names no module of the region."""
    if names is None:
        return region
    root, pairs = names
    meta = torch.fx.traceback.get_current_meta()
    stack = meta.get("nn_module_stack") if meta else None
    if stack:
        paths = _by_id(pairs)
        for key in reversed(list(stack)):
            path = paths.get(key)
            if path is not None:
                return f"{region}.{path}" if region and path else path or root
    return region


def _selective_contexts(policy: Any, policy_fn: Callable[..., Any]) -> Any:
    """The selective-checkpoint contexts of one traced pass of a region: a policy that counts
    ops within a call (a plan's, ``_remat_counts_calls``) warns about the ops of the pass before
    that it could not follow, and starts counting afresh, as its block's hooks make it do in
    eager mode."""
    if getattr(policy, "_remat_counts_calls", False):
        # The block's forward hooks, which warn about ops the plan could not follow and start
        # each eager call afresh, do nothing while Dynamo traces: the passes do both here.
        policy.done(compiled=True)
        policy.reset()
    return create_selective_checkpoint_contexts(policy_fn)  # type: ignore[no-untyped-call]


def torch_policy(
    policy: Callable[..., Any],
    module: str,
    names: ModuleNames | None,
    ctx: Any,
    op: Any,
    *args: Any,
    **kwargs: Any,
) -> CheckpointPolicy:
    """``policy`` as a torch selective-checkpoint ``policy_fn`` (bind the first three
    arguments with ``functools.partial``); see rule 2 of [ Regions under torch.compile ]."""
    answer = policy(OpContext(module=_op_module(module, names)), op, *args, **kwargs)
    decision = as_decision(answer, policy, op)
    if decision.offload is not None and decision.must:
        raise RematError(
            f"remat: the policy says {decision.name} for {op}, but under torch.compile a "
            "region cannot offload (the compiled graph keeps its tensors on the device). "
            "Return PREFER_OFFLOAD_* to save it instead, or run this region eagerly "
            "(torch.compiler.disable)."
        )
    if decision.recompute and isinstance(op, torch._ops.OpOverload):
        reason = must_save_reason(op)
        if reason is not None:
            if decision.must:
                raise RematError(
                    f"remat: the policy says MUST_RECOMPUTE for {op}, but {reason}, so its "
                    "output must be saved. Return PREFER_RECOMPUTE or a save decision."
                )
            return CheckpointPolicy.MUST_SAVE
    return _TO_TORCH[decision]


def lower(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    policy: Callable[..., Any] | None = None,
    preserve_rng_state: bool = True,
    context_fn: Callable[[], Any] | None = None,
    offload_inputs: bool = False,
    module: str = "",
    names: ModuleNames | None = None,
) -> Any:
    """Run a region as torch's checkpoint, for Dynamo to trace; see [ Regions under
    torch.compile ]. ``names`` are the region's modules, for a module's region."""
    if not torch.is_grad_enabled() or _state.state.disabled:
        return function(*args, **kwargs)
    if offload_inputs:
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                raise RematError(
                    "remat: offload_to_cpu=True cannot move region inputs to the host under "
                    f"torch.compile (found an input on {v.device}). Wrap without "
                    "offload_to_cpu, or exclude this module from compilation "
                    "(torch.compiler.disable)."
                )
    if policy is not None:
        if context_fn is not None:
            raise RematError("remat: a region takes a policy or a context_fn, not both; drop one.")
        # Partials of plain functions, so that Dynamo takes the context_fn as a constant.
        policy_fn = functools.partial(torch_policy, policy, module, names)
        context_fn = functools.partial(_selective_contexts, policy, policy_fn)
    options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if context_fn is not None:
        options["context_fn"] = context_fn
    return torch.utils.checkpoint.checkpoint(function, *args, **options, **kwargs)


def is_compiled(function: Any) -> bool:
    """Whether ``function`` is what ``torch.compile`` returned (a module or a function)."""
    return isinstance(function, torch._dynamo.eval_frame.OptimizedModule) or hasattr(
        function, "_torchdynamo_orig_callable"
    )


class CompiledRegion:
    """A compiled callable as a region's function: recomputed without dispatch modes, module
    buffers restored after it; see [ Compiled functions inside a region ]."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        original = getattr(function, "_orig_mod", None)
        self.module = original if isinstance(original, torch.nn.Module) else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _state.state.recomputing:
            return self.function(*args, **kwargs)
        buffers = list(self.module.buffers()) if self.module is not None else []
        before = [(b, b.detach().clone()) for b in buffers]
        fixed = [
            t
            for t in (
                *(self.module.parameters() if self.module is not None else ()),
                *(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)),
            )
        ]
        versions = [t._version for t in fixed]
        # The restore runs without modes too: under the write guard it would land on a copy.
        with torch.utils._python_dispatch._disable_current_modes():
            try:
                out = self.function(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for buffer, copy in before:
                        if not torch.equal(buffer, copy):
                            # Back to the value autograd may have saved: its version stays.
                            with _unsafe_preserve_version_counter(buffer):
                                buffer.copy_(copy)
        if any(t._version != v for t, v in zip(fixed, versions, strict=True)):
            raise CheckpointError(
                "remat: the recompute of a compiled region wrote to a parameter or an input in "
                "place; remat can restore only module buffers of a compiled function. Make the "
                "write out of place, or checkpoint the module before compiling it "
                "(torch.compile(remat.checkpoint_wrapper(block)))."
            )
        return out
