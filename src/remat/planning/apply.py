"""A plan becomes ordinary remat regions on the model's blocks.

Each block gets the option its plan picked: nothing (``plain``), the region engine around the
whole block (``region``), or the graph engine with a :class:`PlanPolicy` that looks each op up
by its key (see [ Op keys ] in ``profile.py``). A forward pre-hook on the block starts the
occurrence count afresh at each call.

NOTE [ Following a plan ]

A forward that differs from the profiled one (other shapes, another branch) stays exact: an op
whose key the plan does not know is kept (keeping is always exact; so is recomputing), and the
policy counts it. The first call that meets such ops warns once per policy, naming how many ops
it could not follow and one of their keys; ``Plan.report()`` shows the counts next to the
prediction.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from ..modules import checkpoint_wrapper, is_wrapped
from ..policies import Decision, OpContext
from .profile import KeyCounter

__all__ = ["PlanPolicy"]


@dataclass
class PlanPolicy:
    """Decides each op of a block by its key: ``"keep"`` or ``"recompute"``."""

    # What it reads besides the op (see ``policies._fields``): no attention tracking needed.
    _remat_reads: ClassVar[frozenset[str]] = frozenset({"module", "tags"})

    decisions: dict[str, str]
    block: str = ""
    counter: KeyCounter = field(default_factory=KeyCounter)
    followed: int = 0
    unfollowed: int = 0
    unknown: list[str] = field(default_factory=list)
    warned: bool = False

    def reset(self, *_: Any) -> None:
        """A new call of the block: count occurrences afresh (a forward pre-hook)."""
        self.counter.reset()

    def done(self, *_: Any) -> None:
        """The block's forward returned (a forward hook): warn once about unknown ops."""
        if self.unknown and not self.warned:
            self.warned = True
            warnings.warn(
                f"remat: the plan for {self.block or 'a block'} could not follow "
                f"{len(self.unknown)} op(s) of its forward (first: {self.unknown[0]}), which "
                "ran differently from the profiled one; they are kept, gradients stay exact. "
                "Plan again for this forward, or see plan.report().",
                stacklevel=2,
            )

    def __call__(self, ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if ctx.tags:  # remat.tag asks again about an op decided already: leave it
            return Decision.PREFER_RECOMPUTE
        key = self.counter.key(ctx.module, op)
        decision = self.decisions.get(key)
        if decision is None:
            self.unfollowed += 1
            if len(self.unknown) < 8:
                self.unknown.append(key)
            return Decision.PREFER_SAVE
        self.followed += 1
        return Decision.PREFER_RECOMPUTE if decision == "recompute" else Decision.PREFER_SAVE


def apply_option(
    block: nn.Module, path: str, kind: str, decisions: dict[str, str]
) -> PlanPolicy | None:
    """Set ``block`` up as one option says; returns the policy of a graph-engine option."""
    if kind == "plain":
        return None
    if kind == "region":
        checkpoint_wrapper(block)
        return None
    policy = PlanPolicy(decisions=dict(decisions), block=path)
    checkpoint_wrapper(block, policy=policy)
    block.register_forward_pre_hook(_reset)
    block.register_forward_hook(_done)
    return policy


def _policy(module: nn.Module) -> PlanPolicy | None:
    # The policy through the module's own wrapper, so that a deep copy of the model (whose
    # hooks are copied as they are) reaches the policy its wrapper uses.
    forward = module.__dict__.get("forward")
    policy = getattr(getattr(forward, "options", None), "policy", None)
    return policy if isinstance(policy, PlanPolicy) else None


def _reset(module: nn.Module, args: Any) -> None:
    policy = _policy(module)
    if policy is not None:
        policy.reset()


def _done(module: nn.Module, args: Any, out: Any) -> None:
    policy = _policy(module)
    if policy is not None:
        policy.done()


def undo_option(block: nn.Module) -> None:
    """Undo :func:`apply_option` on ``block``: its class's forward, no plan hooks."""
    if is_wrapped(block):
        del block.forward
    for hooks in (block._forward_pre_hooks, block._forward_hooks):
        for key in [k for k, hook in hooks.items() if hook is _reset or hook is _done]:
            del hooks[key]
