"""A plan becomes ordinary remat regions on the model's blocks.

Each block gets the option its plan picked: nothing (``plain``), the region engine around the
whole block (``region``), or the graph engine with a :class:`PlanPolicy` that looks each op up
by its key (see [ Op keys ] in ``profile.py``). A forward pre-hook on the block starts the
occurrence count afresh at each call. An option with a ``tier`` runs the block (or the
segment) inside ``remat.offload(tier)``: what it saves goes to the tier (for a region, its
input), entered by a forward pre-hook and left by a forward hook that runs on errors too.

NOTE [ Following a plan ]

A forward that differs from the profiled one (other shapes, another branch) stays exact: an op
whose key the plan does not know is kept (keeping is always exact; so is recomputing), and the
policy counts it. The first call that meets such ops warns once per policy, naming how many ops
it could not follow and one of their keys; ``Plan.report()`` shows the counts next to the
prediction. Under ``torch.compile`` the block's hooks do nothing while Dynamo traces (state
they changed between Dynamo's restarts of a trace made it fail); each traced pass of the region
warns about the pass before and starts the count afresh instead (rule 2 of [ Regions under
torch.compile ] in ``_compile.py``). Larger inputs than the profiled ones follow the plan (its
keys do not name shapes) but hold more than it predicted: a pre-hook on the first block
(:class:`UnlikeProfiled`) warns once when that block's tensor inputs have more bytes than in
the profiled step (in eager mode: a compiled step is not checked). It warns once too when the
block runs under other autocast settings than the plan was made for (none, or another dtype):
casts change what a step holds, and a plan measured the casts of its own loop only (see
NOTE [ Planning under autocast ] in ``_autocast.py``). And it warns once when the block runs on
another kind of device than the plan was measured on (a plan made on a CPU copy of a model
that trains on a GPU): kernels' scratch memory, the allocator's rounding and every op's time
differ between them.

NOTE [ The mode a plan was made in ]

A plan measures the step in the mode the model is in. In evaluation mode dropout saves no masks
and BatchNorm uses its running statistics, so a plan made there holds less than a training
step saves: applied to a model that then trains in training mode, its peak can be twice the
budget (the small GPT of ``remat bench`` at 40%: 251272 bytes against a budget of 121347),
with exact gradients and nothing else to show for it. ``from_pretrained`` of Hugging Face
returns a model in evaluation mode, so this is the mistake a user meets first. A plan records
the mode (``Plan.training``); one made in evaluation mode puts a :class:`RefuseTraining`
pre-hook on each block, and a forward in training mode with gradients raises. A plan made in
training mode needs no check: evaluation mode saves less (no dropout masks), and a model
trained in evaluation mode on purpose (frozen BatchNorm statistics) is planned and run in that
mode.

NOTE [ Segments on the model ]

A segment (blocks ``first`` to ``last``, see [ Segments ] in ``solve.py``) has no one function
to re-run: the parent's forward calls its blocks one by one. Where each block takes the
previous block's output, it runs on the region engine (see [ Segments on the region engine ]).
Otherwise it is a graph-engine region with
``recompute_everything`` opened by a forward pre-hook on its first block and closed by a forward
hook on its last: the engine records every ATen op in between (the blocks and whatever the
parent runs between them) and keeps only what enters the segment from outside, so backward
replays the segment once, from its input, as ``checkpoint_sequential`` recomputes a segment.
The region opens only while a forward of the model, or of a module between it and the
segment's blocks (``model.model(...)``), is under way (hooks on each of them count those), and
is closed by whichever comes first: the last block's forward returning, an error raised inside
any block of the segment (``always_call`` hooks; an interrupt, by the block's
:class:`SegmentForward`: see NOTE [ Interrupted forwards ]), or the end of one of those
forwards (for a forward that stops before the last block, or an error the parent raises
between blocks). A forward that begins while one is open (a stale region) closes it first.
A block of the segment called outside those forwards (a feature probe, a loss on one block's
output, code looping over the blocks) runs as a region of its own that recomputes everything
from its input: exact, holding its input alone, and closed when the call returns, as nothing
would close a segment opened there (its last block may never be called, and every later op
on the thread would be recorded into it). Under ``torch.no_grad()`` and
``remat.disable_checkpointing()`` the blocks run plainly. Under ``torch.compile``, where Dynamo
cannot trace the recording, each block's ``forward`` (a :class:`SegmentForward`) lowers the
block to its own torch checkpoint, as a linked segment's calls lower ([ Regions under
torch.compile ] 4 in ``_compile.py``): the compiled step holds each block's input instead of
the segment's first, in device memory where the plan put it in a tier.

NOTE [ Segments on the region engine ]

Recording every op costs the graph engine Python per op that the region engine does not pay
(2-3% of a step at the medium sizes of ``remat bench``). Where each block of a segment takes
the previous block's output as it is (an ``nn.Sequential``, or a model's own loop
``for block in self.layers: x = block(x)``, as the profile saw), the segment runs on the region
engine instead: each block's ``forward`` becomes a :class:`LinkedForward` (an instance
attribute, as ``checkpoint_wrapper`` sets one) that runs it as one call of the segment's
:class:`~remat.checkpoint.LinkedCalls`, so the blocks form one region that saves the first
block's input alone (NOTE [ Linked calls ] in ``checkpoint.py``). Whoever calls the blocks
(the parent, or code looping over them), the plan is followed. A block whose input is not the
previous block's output at run time starts a new region and keeps its input: exact, more
memory than planned, and a warning says so once. A segment whose input waits in a tier stays
on the graph engine, and so do segments of blocks on which the graph engine measured faster
(see ``planner._segments``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import threading
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import _state
from .._aten import storage_key
from ..checkpoint import LinkedCalls, RegionOptions
from ..errors import RematError, warn
from ..modules import (
    _CheckpointedForward,
    checkpoint_wrapper,
    forward_signature,
    is_wrapped,
    remove_hooks,
    sharded,
)
from ..policies import Decision, OpContext, recompute_everything
from ..store import offload
from ..store.scope import _NAMES
from ._autocast import Autocast
from ._budget import fmt_bytes
from .profile import KeyCounter, device_of

__all__ = [
    "CallCount",
    "Counted",
    "HeldOutput",
    "Linked",
    "LinkedForward",
    "Outer",
    "PerCallForward",
    "PlanPolicy",
    "Segment",
    "SegmentForward",
]

OFFLOADS: tuple[str, ...] = _NAMES  # the tiers a decision or an option may name


@dataclass
class PlanPolicy:
    """Decides each op of a block by its key: ``"keep"``, ``"recompute"``, or a tier's name
    (``"disk"``, ``"host"``) to offload it there."""

    # What it reads besides the op (see ``policies._fields``): no attention tracking needed.
    _remat_reads: ClassVar[frozenset[str]] = frozenset({"module", "tags"})
    # Counts ops within a call: under torch.compile, reset at each traced pass of its region.
    _remat_counts_calls: ClassVar[bool] = True

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

    def done(self, *_: Any, compiled: bool = False) -> None:
        """The block's forward returned (a forward hook), or a pass of the compiler's trace
        of it begins (``compiled``): warn once about unknown ops."""
        if self.unknown and not self.warned:
            self.warned = True
            if compiled:
                # Dynamo traces some ops otherwise than eager runs them (dropout as one
                # native_dropout, on the CPU), and a plan is made in eager mode.
                why = (
                    "as torch.compile traced it, which differs from the eager forward the "
                    "plan was made from; the compiler saves them, gradients stay exact. The "
                    "plan's memory holds for the eager step; see plan.report()."
                )
            else:
                why = (
                    "which ran differently from the profiled one; they are kept, gradients "
                    "stay exact. Plan again for this forward, or see plan.report()."
                )
            warn(
                f"remat: the plan for {self.block or 'a block'} could not follow "
                f"{self.unfollowed} op(s) of its forward (first: {self.unknown[0]}), {why}"
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
        return _DECISIONS.get(decision, Decision.PREFER_SAVE)


_DECISIONS = {
    "recompute": Decision.PREFER_RECOMPUTE,
    "keep": Decision.PREFER_SAVE,
    "disk": Decision.PREFER_OFFLOAD_DISK,
    "host": Decision.PREFER_OFFLOAD_HOST,
}


class Offloaded:
    """A block's forward inside ``remat.offload(tier)``: entered by a forward pre-hook, left
    by a forward hook that runs on errors too (a stack of them, for a block that calls itself).
    A scope whose forward ended without its hook (an interrupt, see NOTE [ Interrupted
    forwards ]) is closed at the block's next call."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        # each open scope, with the frame of the module call it belongs to (``call_frame``)
        self.open: list[tuple[contextlib.ExitStack, types.FrameType]] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        frame = call_frame(sys._getframe(1))
        while self.open and ended(self.open[-1][1]):
            self.open.pop()[0].close()
        stack = contextlib.ExitStack()
        stack.enter_context(offload(self.tier))  # type: ignore[arg-type]
        self.open.append((stack, frame))

    def exit(self, module: nn.Module, args: Any, out: Any) -> None:
        frame = call_frame(sys._getframe(1))
        # (scopes above this call's ended without their hooks: closed first)
        if any(f is frame for _, f in self.open):
            while self.open:
                stack, f = self.open.pop()
                stack.close()
                if f is frame:
                    break

    def __getstate__(self) -> dict[str, Any]:
        # (a copy made while a forward is under way starts with no scope open)
        return {**self.__dict__, "open": []}


def apply_option(
    block: nn.Module, path: str, kind: str, decisions: dict[str, str], tier: str | None = None
) -> PlanPolicy | None:
    """Set ``block`` up as one option says; returns the policy of a graph-engine option."""
    if tier is not None:
        offloaded = Offloaded(tier)
        block.register_forward_pre_hook(offloaded.enter)
        block.register_forward_hook(offloaded.exit, always_call=True)
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


# NOTE [ Options per call ]
#
# A block the forward calls more than once runs, at each call, the option the plan gave that
# call (see [ Shared blocks ] in ``planner.py``). Where its calls' options differ, its
# instance-level forward is a :class:`PerCallForward`, which numbers the block's calls in each
# forward and runs the call's option: the class's forward (plain), a region of the region
# engine, or one of the graph engine with the option's :class:`PlanPolicy` (one per option,
# its occurrence count started afresh at each call), inside ``remat.offload(tier)`` for an
# option with a tier. Every other block of the plan is counted too (:class:`Counted`, a
# forward pre-hook), a block called once as much as a shared block whose calls all run one
# option.
#
# The numbers start afresh at each forward of the model the plan was applied to, or of a
# module between it and the blocks (a loop may call ``model.model(...)``, a Hugging Face
# model's body without its head): :class:`Outer`'s hooks on each of them count how many
# forwards are under way, and the outermost one starts the count (:class:`CallCount`). Calls
# past the planned ones (a forward that loops more, a block called from outside those
# forwards) go round the planned ones again. Every option is exact, so numbers out of step
# with the plan move memory and time, never gradients; but the budget does not hold for such
# a step, so the first call past the planned ones (with gradients enabled) warns, once per
# block. Fewer calls than planned (a forward that raised, a loop that stopped early, a block
# skipped) run a prefix of the plan and hold no more than it. A recompute in backward runs no
# forward hooks (the region engine re-runs the class's forward, the graph engine ATen ops), so
# it is not counted.
#
# At the end of the outermost forward, a block under it that was not called may have been
# replaced since ``apply`` by a module the plan does not run (one without a :class:`Counted`
# hook), and a module list of blocks may hold one added since: each warns once.
#
# Under ``torch.compile`` each call runs the leanest of the block's options (the least kept
# bytes), as Dynamo traces that option on a block of its own: no number is read or advanced
# while Dynamo traces, whose restarts of a trace would see it advanced.


# NOTE [ Interrupted forwards ]
#
# A plan's hooks open state in a forward pre-hook and close it in a forward hook registered
# with ``always_call=True``: the count of forwards under way (:class:`Outer`), a graph-engine
# segment's recording (:class:`Segment`) and a tier's offload scope (:class:`Offloaded`). Torch
# runs ``always_call`` hooks for an ``Exception`` only: a ``KeyboardInterrupt`` (Ctrl-C in a
# notebook) or a ``SystemExit`` raised in the forward skips them. So each opening is noted with
# the frame of the module call it belongs to (:func:`call_frame`: torch's frame that called the
# module, which lives exactly as long as the call), and a forward found under way whose frame
# is no longer on the thread's stack ended without its hook (:func:`ended`). Such state is
# closed as early as the plan can see it:
#
# 1. An interrupt raised inside a block of a graph-engine segment: at once, by the block's
#    :class:`SegmentForward` (an instance-level ``forward``, so a ``try`` around it).
# 2. Otherwise (an interrupt in the parent's code between a segment's blocks, inside a block
#    with a tier, or inside the model around the blocks): at the next forward of the model or
#    of a module around the blocks (the outermost one drops the forwards that ended and closes
#    a segment left open) and at the next call of the block (a tier's scope), before anything
#    of that forward is recorded or offloaded. Until then the segment's recording or the
#    tier's scope stays open on the thread; code that runs there in between (another model's
#    steps) is recorded or offloaded by it, with exact gradients.
#
# The call numbers of [ Options per call ] then start afresh at the next forward, as after a
# forward that returned. Walking the stack costs a few frames, and only where a forward is
# already under way (a module around blocks inside the model, a segment's blocks): a forward
# with none pays nothing for it.

_MODULE_CODE = nn.Module._call_impl.__code__.co_filename


def call_frame(frame: types.FrameType) -> types.FrameType:
    """The frame of the module call that runs the hook whose caller is ``frame``: the
    outermost of torch's own frames there (``Module._wrapped_call_impl``), which lives as long
    as the call whatever frames torch runs the hooks from."""
    while (back := frame.f_back) is not None and back.f_code.co_filename == _MODULE_CODE:
        frame = back
    return frame


def ended(frame: types.FrameType) -> bool:
    """Whether ``frame`` is no longer running on this thread (its call returned or raised)."""
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        if f is frame:
            return False
        f = f.f_back
    return True


class Underway:
    """The forwards under way of some modules (a plan's model and the modules around its
    blocks), innermost last, each by the frame of its call (see NOTE [ Interrupted
    forwards ]) and the thread it runs on."""

    def __init__(self) -> None:
        self.calls: list[tuple[types.FrameType, int]] = []

    def begin(self, frame: types.FrameType) -> bool:
        """A forward begins (``frame``: :func:`call_frame`): whether it is the outermost."""
        self.drop_ended()
        self.calls.append((frame, threading.get_ident()))
        return len(self.calls) == 1

    def end(self, frame: types.FrameType) -> bool:
        """The forward of the call at ``frame`` ends (those begun inside it and still listed
        ended without their hooks): whether it was the outermost. A call not listed (a hook
        before the one that lists it raised) changes nothing."""
        if any(f is frame for f, _ in self.calls):
            while self.calls.pop()[0] is not frame:
                pass
        return not self.calls

    def drop_ended(self) -> None:
        """Forget the forwards that ended without their hooks. (Another thread's forward is
        not this thread's to judge: it is left.)"""
        calls = self.calls
        while calls and calls[-1][1] == threading.get_ident() and ended(calls[-1][0]):
            calls.pop()

    def __getstate__(self) -> dict[str, Any]:
        # (frames do not copy; a copy made while a forward is under way starts with none)
        return {"calls": []}


class CallCount:
    """The calls of each block so far in the forward under way, by path; ``planned``: each
    block's calls in the plan, ``budget`` the plan's (for the warnings), ``lists`` the
    children of each module list that holds blocks, by its path, as at ``apply``."""

    def __init__(
        self, planned: dict[str, int], budget: int, lists: dict[str, list[str]] | None = None
    ) -> None:
        self.planned = planned
        self.budget = budget
        self.lists = lists or {}
        self.counts: dict[str, int] = {}
        self.warned: set[str] = set()
        # the forwards of the model and the modules around blocks under way
        self.underway = Underway()

    @property
    def depth(self) -> int:
        """How many forwards of the model and the modules around blocks are under way."""
        return len(self.underway.calls)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a model pickled by an earlier remat counted its forwards in ``depth``)
        state.pop("depth", None)
        state.setdefault("underway", Underway())
        self.__dict__.update(state)

    def enter(self, frame: types.FrameType) -> None:
        """A forward of the model, or of a module between it and blocks, begins (``frame``:
        its call's, see NOTE [ Interrupted forwards ]): where it is the outermost, the calls
        are counted afresh."""
        if self.underway.begin(frame):
            self.counts = {}

    def leave(self, module: nn.Module, prefix: str, frame: types.FrameType) -> None:
        """The forward of ``module`` (at path ``prefix`` in the model, its call's ``frame``)
        ends."""
        if self.underway.end(frame) and torch.is_grad_enabled():
            self._check(module, prefix)

    def next(self, path: str) -> int:
        """The number, among the planned ones, of the call of block ``path`` that begins;
        warns once when it is past them."""
        n = self.counts.get(path, 0)
        self.counts[path] = n + 1
        planned = self.planned[path]
        if n == planned and path not in self.warned and torch.is_grad_enabled():
            self.warned.add(path)
            times = {1: "once", 2: "twice"}.get(planned, f"{planned} times")
            _budget_warning(
                repr(path),
                self.budget,
                f"was called more than {times} in one forward of the model, as the plan "
                "planned it (or called outside that forward); the calls past those are not in "
                "the plan",
                "Plan with the forward the model trains with (remat.plan, remat.fit), and call "
                "the block from the forward of the model the plan was applied to.",
            )
        return n % planned

    def _check(self, module: nn.Module, prefix: str) -> None:
        """At the end of the forward of ``module`` (the model, or the module at ``prefix``
        in it): a block under it that the forward did not call may have been replaced, after
        ``apply``, by a module the plan does not run, and a module list of blocks may hold
        one added since."""

        def under(path: str) -> nn.Module | None:
            if prefix and path != prefix and not path.startswith(prefix + "."):
                return None
            try:
                return module.get_submodule(path[len(prefix) + 1 :] if prefix else path)
            except AttributeError:
                return None  # removed: the forward runs fewer blocks than planned

        for path, children in self.lists.items():
            found = under(path)
            added = [n for n in found._modules if n not in children] if found is not None else []
            if added and path not in self.warned:
                self.warned.add(path)
                _budget_warning(
                    repr(f"{path}.{added[0]}"),
                    self.budget,
                    f"was added to {path} after the plan was applied, and runs outside it",
                    "Set the model's modules up before planning, or plan again.",
                )
        for path in self.planned:
            if path in self.counts or path in self.warned:
                continue
            block = under(path)
            if block is None or _counted(block):
                continue  # not called in this forward (skipped, an early exit): holds less
            self.warned.add(path)
            _budget_warning(
                repr(path),
                self.budget,
                f"is another {type(block).__name__} now, set in the place of the block the "
                "plan was applied to, and runs outside the plan",
                "Set the model's modules up before planning, or apply the plan again "
                "(remat.unapply(model), then plan.apply(model)), or plan again.",
            )


class Outer:
    """The forward pre-hook (:meth:`enter`) and hook (:meth:`leave`, run also when the
    forward raises) on the model and on each module between it and a block (at ``prefix``):
    the outermost of them that runs starts the count of block calls afresh, and checks the
    blocks under it at its end. A loop that calls a submodule (``model.model(...)`` of a
    Hugging Face model with a head) is counted as one that calls the model."""

    def __init__(self, count: CallCount, prefix: str) -> None:
        self.count = count
        self.prefix = prefix

    def enter(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self.count.enter(call_frame(sys._getframe(1)))

    def leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if not torch.compiler.is_compiling():
            self.count.leave(module, self.prefix, call_frame(sys._getframe(1)))


def count_calls(model: nn.Module, count: CallCount) -> None:
    """Put :class:`Outer`'s hooks on ``model`` and on each module between it and the blocks
    ``count`` plans."""
    prefixes = {""}
    for path in count.planned:
        parts = path.split(".")
        prefixes.update(".".join(parts[:i]) for i in range(1, len(parts)))
    for prefix in sorted(prefixes):
        outer = Outer(count, prefix)
        module = model.get_submodule(prefix)
        module.register_forward_pre_hook(outer.enter)
        module.register_forward_hook(outer.leave, always_call=True)


def _counted(block: nn.Module) -> bool:
    """Whether ``block`` is set up by a plan: its calls are counted (:class:`Counted`, or a
    :class:`PerCallForward` that numbers them)."""
    return isinstance(block.__dict__.get("forward"), PerCallForward) or any(
        isinstance(hook, Counted) for hook in block._forward_pre_hooks.values()
    )


class Counted:
    """A forward pre-hook that counts the calls of a block whose calls all run one option (see
    [ Options per call ])."""

    def __init__(self, count: CallCount, path: str) -> None:
        self.count = count
        self.path = path

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self.count.next(self.path)


class _Run:
    """One option of a shared block, as its calls run it."""

    def __init__(
        self, forward: _CheckpointedForward | None, policy: PlanPolicy | None, tier: str | None
    ) -> None:
        self.forward = forward  # None: the class's forward, plainly
        self.policy = policy
        self.tier = tier

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        compiling = torch.compiler.is_compiling()
        with contextlib.ExitStack() as stack:
            if self.tier is not None:
                stack.enter_context(offload(self.tier))  # type: ignore[arg-type]
            if self.policy is not None and not compiling:
                self.policy.reset()
            if self.forward is None:
                out = type(module).forward(module, *args, **kwargs)
            else:
                out = self.forward(*args, **kwargs)
            if self.policy is not None and not compiling:
                self.policy.done()
        return out


class PerCallForward:
    """The instance-level ``forward`` of a block whose calls run different options of a plan
    (see [ Options per call ]); holds the block weakly, as ``checkpoint_wrapper``'s forward
    does."""

    __slots__ = ("count", "leanest", "module_ref", "path", "runs")

    @property
    def __signature__(self) -> inspect.Signature:
        return forward_signature(self.module_ref())

    def __init__(
        self, module: nn.Module, path: str, runs: list[_Run], count: CallCount, leanest: int
    ) -> None:
        self.module_ref = weakref.ref(module)
        self.path = path
        self.runs = runs  # one per planned call
        self.count = count
        self.leanest = leanest  # the call whose option runs every call under torch.compile

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = _block(self.module_ref)
        if torch.compiler.is_compiling():
            return self.runs[self.leanest](module, args, kwargs)
        return self.runs[self.count.next(self.path)](module, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> PerCallForward:
        copied = _copied_block(self.module_ref, memo)
        runs = copy.deepcopy(self.runs, memo)
        return PerCallForward(
            copied, self.path, runs, copy.deepcopy(self.count, memo), self.leanest
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            PerCallForward,
            (self.module_ref(), self.path, self.runs, self.count, self.leanest),
        )


def apply_per_call(
    block: nn.Module, path: str, options: list[Any], count: CallCount
) -> list[PlanPolicy]:
    """Set ``block`` up to run ``options[i]`` (each a plan's ``Option``) at its call ``i``;
    returns the policies of its graph-engine options."""
    runs: dict[str, _Run] = {}
    for o in options:
        if o.name in runs:
            continue
        policy = None
        forward = None
        if o.kind != "plain":
            if o.kind != "region":
                policy = PlanPolicy(decisions=dict(o.decisions), block=f"{path} ({o.name})")
            parsed = RegionOptions.parse("remat.plan", {"policy": policy} if policy else {})
            forward = _CheckpointedForward(block, False, parsed)
        runs[o.name] = _Run(forward, policy, o.tier)
    leanest = min(range(len(options)), key=lambda i: options[i].kept)
    block.forward = PerCallForward(block, path, [runs[o.name] for o in options], count, leanest)
    return [r.policy for r in runs.values() if r.policy is not None]


def _policy(module: nn.Module) -> PlanPolicy | None:
    # The policy through the module's own wrapper, so that a deep copy of the model (whose
    # hooks are copied as they are) reaches the policy its wrapper uses.
    forward = module.__dict__.get("forward")
    policy = getattr(getattr(forward, "options", None), "policy", None)
    return policy if isinstance(policy, PlanPolicy) else None


def _reset(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    policy = _policy(module)
    if policy is not None:
        policy.reset()


def _done(module: nn.Module, args: Any, out: Any) -> None:
    if torch.compiler.is_compiling():
        return
    policy = _policy(module)
    if policy is not None:
        policy.done()


class RefuseTraining:
    """A forward pre-hook on each block of a plan made with the model in evaluation mode: a
    forward in training mode with gradients raises (see NOTE [ The mode a plan was made in ])."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, block: nn.Module, args: Any) -> None:
        if block.training and torch.is_grad_enabled():
            raise RematError(
                f"remat: {self.path} ({type(block).__name__}) runs forward in training mode, but "
                "its plan was made with the model in evaluation mode (no dropout, BatchNorm on "
                "its running statistics), so the plan's memory does not hold for this step: it "
                "saves what evaluation mode did not. Call model.train() before planning "
                "(remat.plan, remat.fit, remat.hf.enable with budget=) and plan again (Hugging "
                "Face's from_pretrained returns a model in evaluation mode)."
            )


class Unplanned:
    """A forward hook on a block the planner left out because it computed no gradient in the
    profiled step (frozen lower layers): warns once when it computes one (the layers were
    unfrozen since, or the model's input now needs a gradient), as the plan runs it plainly
    and holds what it saves, beyond the budget the plan was made for."""

    def __init__(self, path: str, budget: int, warned: list[bool]) -> None:
        self.path, self.budget = path, budget
        self.warned = warned  # shared by the plan's watches: one warning per plan

    def __call__(self, block: nn.Module, args: Any, out: Any) -> None:
        if self.warned[0] or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out)):
            self.warned[0] = True
            _budget_warning(
                self.path,
                self.budget,
                "computed no gradient when the plan was made (frozen, fed an input that needed "
                "none) and runs plainly, but computes one now",
                "Plan again (remat.fit) with the parameters and inputs that train.",
            )


class UnlikeProfiled:
    """A forward pre-hook on a plan's first block: warns once when the block gets larger
    inputs than the profiled step gave it, once when it runs under other autocast settings
    than the plan was made for, and once when it runs on another kind of device than the plan
    was measured on (``device``: a device type; None, from a plan file that does not say, is
    not checked; see NOTE [ Following a plan ])."""

    def __init__(
        self,
        path: str,
        measured: int,
        budget: int,
        autocast: Autocast | None = None,
        device: str | None = None,
    ) -> None:
        self.path, self.measured, self.budget = path, measured, budget
        self.autocast = autocast
        self.device = device
        self.warned: set[str] = set()

    def __call__(self, block: nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return  # (a compiled step's shapes may be symbolic: it is not checked)
        if self.measured and "inputs" not in self.warned:
            got = input_bytes((args, kwargs))
            if got > self.measured:
                self.warned.add("inputs")
                self._warn(
                    f"got inputs of {fmt_bytes(got)} where the plan was measured with "
                    f"{fmt_bytes(self.measured)}; activation memory grows with them",
                    "Plan with the largest batch you train on.",
                )
        device = device_of(block, (args, kwargs)).type
        if self.device is not None and device != self.device and "device" not in self.warned:
            self.warned.add("device")
            self._warn(
                f"runs on {device}, but the plan was measured on {self.device}; memory and time "
                "differ between devices",
                f"Plan the model on the device it trains on (its {device} copy).",
            )
        if "autocast" in self.warned:
            return
        now = Autocast.found(device)
        if now != self.autocast:
            self.warned.add("autocast")
            runs = f"runs under {now}" if now else "runs without autocast"
            made = f"under {self.autocast}" if self.autocast else "without autocast"
            fix = (
                f"Plan inside `with {now}:`, as the loop runs its forward"
                if now
                else f"Plan outside autocast, or run the forward under {self.autocast} as planned"
            )
            self._warn(
                f"{runs}, but the plan was made {made}; the casts change what a step holds",
                f"{fix} (remat.plan, remat.fit, remat.hf.enable with budget=).",
            )

    def _warn(self, what: str, fix: str) -> None:
        _budget_warning(repr(self.path), self.budget, what, fix)


# NOTE [ The output held through backward ]
#
# A plan is measured on a step that keeps the loss, not the model's output, through backward
# (``planner._step``), as ``loss_fn(model(x)).backward()`` does: there autograd frees the
# output once the loss's backward has read it. The loop ``out = model(x);
# loss_fn(out).backward()``, and Hugging Face's ``outputs = model(**batch);
# outputs.loss.backward()``, hold it to the end of backward instead, on top of everything the
# plan predicted there: a language model's logits can be as large as the whole budget. A
# forward hook on the model (:class:`HeldOutput`) finds when that can break the budget (the
# output's bytes above the room the plan leaves under it, and above 1% of the budget) and
# then hooks the gradient of each output tensor. A tensor's gradient is complete once every
# node that read the tensor has run and let go of what it saved: the loss's, and the model's
# own where an output is also read inside it (hidden states that the head reads). A tensor
# still alive when its own gradient arrives is held by the loop (or by a graph kept with
# ``retain_graph=True``), and stays so to the end of backward. Once the output tensors held so
# break the budget, the step warns, naming their bytes and the fix, once for the plan. The
# outputs are found in tuples, lists, dicts, Hugging Face's ``ModelOutput`` and dataclasses. A
# step that frees the output costs a weak reference and a tensor hook per output tensor.


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each counted once (none for a tensor without
    a plain storage)."""
    storages = {
        key: t.untyped_storage().nbytes() for t in tensors if (key := storage_key(t)) is not None
    }
    return sum(storages.values())


class HeldOutput:
    """A forward hook on the model a plan is applied to: warns once when the loop holds the
    model's output through backward and that can take the step past the budget (see NOTE
    [ The output held through backward ])."""

    def __init__(self, budget: int, predicted: int) -> None:
        self.budget = budget
        self.predicted = predicted
        self.warned = False

    def __call__(self, model: nn.Module, args: Any, out: Any) -> None:
        if self.warned or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        tensors = _output_tensors(out)
        if not self._breaks(_storage_bytes(tensors)):
            return
        held: dict[int, int] = {}  # storage -> bytes, of the outputs found held this step
        for t in tensors:
            key = storage_key(t)
            if t.grad_fn is not None and key is not None:
                t.register_hook(self._check(weakref.ref(t), key, held))  # type: ignore[no-untyped-call]

    def _check(
        self, ref: weakref.ref[torch.Tensor], key: int, held: dict[int, int]
    ) -> Callable[[torch.Tensor], None]:
        def reached(grad: torch.Tensor) -> None:
            t = ref()
            if self.warned or t is None:
                return
            held[key] = t.untyped_storage().nbytes()
            nbytes = sum(held.values())
            if not self._breaks(nbytes):
                return
            self.warned = True
            warn(
                f"remat: the model's output ({fmt_bytes(nbytes)}) is still held when backward "
                "reaches the model, so the step can hold up to that much above the plan's "
                f"predicted peak of {fmt_bytes(self.predicted)}, past its budget of "
                f"{fmt_bytes(self.budget)} (gradients stay exact). The plan was measured with "
                "the output freed once the loss is computed, as loss_fn(model(x)).backward() "
                "frees it. Compute the loss and drop the output before backward (loss = "
                "loss_fn(out); del out; loss.backward(), or keep only outputs.loss), or plan "
                f"with a budget {fmt_bytes(nbytes)} lower."
            )

        return reached

    def _breaks(self, held: int) -> bool:
        """Whether ``held`` bytes on top of the predicted peak break the budget, by more than
        1% of it (a classifier's scores are not worth a warning; a language model's logits
        are)."""
        return held > 0.01 * self.budget and self.predicted + held > self.budget


def _output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in a model's output: in tuples, lists, dicts and Hugging Face's
    ``ModelOutput`` (pytree nodes), and in the fields of a dataclass (which is none)."""
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif is_dataclass(leaf) and not isinstance(leaf, type):
            found += _output_tensors([getattr(leaf, f.name, None) for f in fields(leaf)])
    return found


def _budget_warning(block: str, budget: int, what: str, fix: str) -> None:
    """Warn that ``block`` (its path, as the message shows it) ``what``, so a plan's
    ``budget`` does not hold for this step; ``fix``."""
    warn(
        f"remat: block {block} {what}, so the plan's budget of {fmt_bytes(budget)} does not "
        f"hold for this step (gradients stay exact). {fix}"
    )


def input_bytes(inputs: Any) -> int:
    """Bytes of the tensors among ``inputs`` (a pytree)."""
    return sum(
        t.numel() * t.element_size()
        for t in pytree.tree_leaves(inputs)
        if isinstance(t, torch.Tensor)
    )


def undo_option(block: nn.Module) -> None:
    """Undo :func:`apply_option` on ``block``: its class's forward, no plan hooks."""
    if is_wrapped(block) or isinstance(block.__dict__.get("forward"), PerCallForward):
        del block.forward
    remove_hooks(block, _option_hook)


def _option_hook(hook: Any) -> bool:
    """Whether ``hook`` is one :func:`apply_option` or ``Plan.apply`` puts on a block."""
    return (
        hook is _reset
        or hook is _done
        or isinstance(hook, (Counted, HeldOutput, RefuseTraining, UnlikeProfiled, Unplanned))
        or isinstance(getattr(hook, "__self__", None), (Offloaded, Outer))
    )


class Segment:
    """Blocks run as one region that recomputes everything (see [ Segments on the model ])."""

    def __init__(self, tier: str | None = None) -> None:
        self.tier = tier  # the segment's input goes to this tier (``remat.offload``)
        self._open: contextlib.ExitStack | None = None
        self._error: BaseException | None = None  # the error being handled when it opened
        # the forwards under way of the modules around the segment (the model's and those
        # between it and the blocks): the segment opens only inside one. ``None`` in a model
        # pickled by an earlier remat, which has no hooks to count them: it opens at any call
        # of its first block, as it did there.
        self.underway: Underway | None = Underway()

    def begin(self, module: nn.Module, args: Any) -> None:
        """A forward of a module around the segment begins (a forward pre-hook). The outermost
        closes a segment that forwards ended without their hooks left open (see NOTE
        [ Interrupted forwards ])."""
        if torch.compiler.is_compiling() or self.underway is None:
            return
        if self.underway.begin(call_frame(sys._getframe(1))):
            self.close()

    def leave(self, module: nn.Module, args: Any, out: Any) -> None:
        """A forward of a module around the segment returned or raised: every block of the
        segment is inside it, so the segment is over."""
        if torch.compiler.is_compiling() or self.underway is None:
            return
        self.underway.end(call_frame(sys._getframe(1)))
        self.close()

    def enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.close()
        if not torch.is_grad_enabled() or _state.state.disabled or torch.compiler.is_compiling():
            return
        if self.underway is not None:
            self.underway.drop_ended()
            if not self.underway.calls:
                return  # the block called by itself: its SegmentForward runs it alone
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        self._open, self._error = self._region(tensors), sys.exc_info()[1]

    def _region(self, tensors: list[torch.Tensor]) -> contextlib.ExitStack:
        """A graph-engine region that recomputes everything from ``tensors`` (its input in the
        segment's tier), entered."""
        from ..graph import recording

        stack = contextlib.ExitStack()
        with contextlib.ExitStack() as failed:
            failed.push(stack)  # closed again if entering fails
            if self.tier is not None:
                stack.enter_context(offload(self.tier))  # type: ignore[arg-type]
            stack.enter_context(recording(recompute_everything, tensors))
            failed.pop_all()
        return stack

    def alone(self) -> bool:
        """Whether a block of the segment is called while no forward around the segment is
        under way (a feature probe, a loss on one block's output): then it runs by itself,
        and a segment left open by forwards that ended without their hooks is closed."""
        if self.underway is None:
            return False
        self.underway.drop_ended()
        if self.underway.calls:
            return False
        self.close()
        return True

    def run_alone(self, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one block of the segment by itself: a region of its own that keeps its input
        (in the segment's tier) and recomputes the rest, as the segment would from its own;
        plainly under ``torch.no_grad()`` and ``remat.disable_checkpointing()``."""
        if not torch.is_grad_enabled() or _state.state.disabled:
            return forward(*args, **kwargs)
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        with self._region(tensors):
            return forward(*args, **kwargs)

    def exit(self, module: nn.Module, args: Any, out: Any) -> None:
        """The last block's forward returned or raised."""
        if not torch.compiler.is_compiling():  # nothing opened (see ``enter``)
            self.close()

    def exit_on_error(self, module: nn.Module, args: Any, out: Any) -> None:
        """A block of the segment returned or raised: close on an error only."""
        if torch.compiler.is_compiling():
            return
        error = sys.exc_info()[1]
        if error is not None and error is not self._error:
            self.close()

    def close(self) -> None:
        stack, self._open = self._open, None
        if stack is not None:
            stack.close()

    def __getstate__(self) -> dict[str, Any]:
        # A segment open (a copy made while the model's forward is under way, or one that an
        # interrupted forward left open) holds a live recording, which does not pickle: a copy
        # starts closed.
        return {**self.__dict__, "_open": None, "_error": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("underway", None)  # (see ``__init__``)
        self.__dict__.update(state)


def apply_segment(
    root: nn.Module, paths: list[str], tier: str | None = None, linked: bool = False
) -> Segment | Linked:
    """Run the blocks at ``paths`` (consecutive, in forward order) of ``root`` as one segment:
    on the region engine with ``linked`` (each block takes the previous one's output, see
    [ Segments on the region engine ]), else on the graph engine, its input offloaded to
    ``tier`` if one is given."""
    blocks = [root.get_submodule(p) for p in paths]
    if linked and tier is None:
        chain = Linked(paths)
        for position, block in enumerate(blocks):
            if block.__dict__.get("forward") is not None:
                raise RematError(
                    f"remat: block {paths[position]} has an instance-level forward (a wrapper or "
                    "an assignment); a segment runs the class's forward. Remove it first "
                    f"(del module.forward) or plan the model without it."
                )
            block.forward = LinkedForward(block, chain, position)
        return chain
    segment = Segment(tier)
    for path, block in zip(paths, blocks, strict=True):
        label = _label(path, paths)
        block.forward = SegmentForward(block, block.__dict__.get("forward"), label, segment)
    blocks[0].register_forward_pre_hook(segment.enter, with_kwargs=True)
    for block in blocks[:-1]:
        block.register_forward_hook(segment.exit_on_error, always_call=True)
    blocks[-1].register_forward_hook(segment.exit, always_call=True)
    for module in _around(root, paths):
        module.register_forward_pre_hook(segment.begin)
        module.register_forward_hook(segment.leave, always_call=True)
    return segment


def _around(root: nn.Module, paths: list[str]) -> list[nn.Module]:
    """``root`` and the modules between it and all of the blocks at ``paths``: a forward of
    any of them holds every block's call."""
    parents = [p.split(".")[:-1] for p in paths]
    common = 0
    while all(len(p) > common and p[common] == parents[0][common] for p in parents):
        common += 1
    prefix = parents[0][:common]
    return [root.get_submodule(".".join(prefix[:i])) for i in range(common + 1)]


def undo_segment(root: nn.Module, paths: list[str]) -> None:
    """Undo :func:`apply_segment`."""
    for module in [*_around(root, paths), *(root.get_submodule(p) for p in paths)]:
        undo_segment_on(module)


def undo_segment_on(module: nn.Module) -> None:
    """Remove the hooks and the linked forward of any segment from one module."""
    remove_hooks(module, lambda hook: isinstance(getattr(hook, "__self__", None), Segment))
    forward = module.__dict__.get("forward")
    if isinstance(forward, LinkedForward):
        del module.forward
    elif isinstance(forward, SegmentForward):
        if forward.previous is None:
            del module.forward
        else:
            module.forward = forward.previous


def set_up(model: nn.Module) -> str | None:
    """The path of the first module of ``model`` that remat runs (a region, a plan's policy,
    segment or offload scope), or ``None``."""
    path: str
    for path, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if is_wrapped(module) or isinstance(
            forward, (LinkedForward, SegmentForward, PerCallForward)
        ):
            return path
        hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
        # (the hooks a plan puts on the model and the modules around its blocks are no
        # block's: the blocks name the path)
        if any(
            (_option_hook(hook) and not _around_blocks(hook))
            or isinstance(getattr(hook, "__self__", None), Segment)
            for hook in hooks
        ):
            return path
    return None


def undo_around_blocks(model: nn.Module) -> None:
    """Take the hooks ``Plan.apply`` puts on ``model`` and the modules around its blocks
    (:func:`count_calls`, :class:`HeldOutput`) off them."""
    for module in model.modules():
        remove_hooks(module, _around_blocks)


def _around_blocks(hook: Any) -> bool:
    """Whether ``hook`` is one ``Plan.apply`` puts on the model or a module around blocks,
    rather than on a block."""
    return isinstance(hook, HeldOutput) or isinstance(getattr(hook, "__self__", None), Outer)


def refuse_set_up(caller: str, model: nn.Module, why: str) -> None:
    """Raise when remat already runs somewhere in ``model`` (see :func:`set_up`)."""
    path = set_up(model)
    if path is not None:
        raise RematError(
            f"{caller}: {path or type(model).__name__} of {type(model).__name__} already runs "
            f"under remat (remat.apply, remat.hf.enable or a plan); {why}. Call "
            "remat.unapply(model) (or remat.hf.disable(model)) first."
        )


# The attribute of a model that holds the plan last applied to it (``Plan.of``) and the
# policies it set up there (what ``Plan.report`` counts). On the model, not in a table beside
# it: a copy of the model (an EMA's ``copy.deepcopy``, ``torch.save`` of the whole model) runs
# the plan's regions and policies, and is found to run it.
_APPLIED = "_remat_plan"


class _Applied:
    """A plan and the policies it set up on one model. A deep copy of the model shares the
    plan (data, which the copy runs too) and copies the policies along with the modules they
    are set on, through the same memo."""

    def __init__(self, plan: Any, policies: list[PlanPolicy]) -> None:
        self.plan = plan
        self.policies = policies

    def __deepcopy__(self, memo: dict[int, Any]) -> _Applied:
        return _Applied(self.plan, copy.deepcopy(self.policies, memo))


def note_applied(model: nn.Module, plan: Any, policies: list[PlanPolicy]) -> None:
    """Remember ``plan`` as the one set up on ``model``, with the policies it set up."""
    object.__setattr__(model, _APPLIED, _Applied(plan, policies))


def applied_plan(model: nn.Module) -> tuple[Any, list[PlanPolicy]] | None:
    """The plan set up on ``model`` and its policies there, ``None`` where none is."""
    found = model.__dict__.get(_APPLIED)
    return (found.plan, found.policies) if isinstance(found, _Applied) else None


def forget_applied(model: nn.Module) -> None:
    """``model``'s plan is taken off (``remat.unapply``, ``remat.hf.disable``)."""
    model.__dict__.pop(_APPLIED, None)


def undo_all(model: nn.Module) -> None:
    """Undo every option and segment a plan set up on ``model`` and the modules inside it."""
    forget_applied(model)
    for module in model.modules():
        undo_option(module)
        undo_segment_on(module)


def _block(ref: weakref.ref[nn.Module]) -> nn.Module:
    """The block a segment's forward belongs to."""
    module = ref()
    if module is None:
        raise RematError("remat: the module of this segment's forward was freed.")
    return module


def _copied_block(ref: weakref.ref[nn.Module], memo: dict[int, Any]) -> nn.Module:
    """The copy of a segment forward's block in a deep copy of the model: copy.deepcopy(model)
    copies a module before its ``__dict__``, so the copy is in ``memo``."""
    copied = memo.get(id(ref()))
    if not isinstance(copied, nn.Module):
        raise RematError(
            "remat: a segment's forward can be deep-copied only together with its module; "
            "deep-copy the model that contains it."
        )
    return copied


class SegmentForward:
    """The instance-level ``forward`` of a block in a graph-engine :class:`Segment`: the block's
    forward as it was (``previous``, an instance-level forward it had, or its class's), which
    the segment's hooks record in eager, and its own torch checkpoint under ``torch.compile``
    (see [ Segments on the model ]). A block called by itself runs as a region of its own, and
    an interrupt inside it closes the segment (see NOTE [ Interrupted forwards ]). Holds the
    block weakly, as ``checkpoint_wrapper``'s forward does."""

    __slots__ = ("label", "module_ref", "previous", "segment")

    @property
    def __signature__(self) -> inspect.Signature:
        if self.previous is not None:
            return inspect.signature(self.previous)
        return forward_signature(self.module_ref())

    def __init__(
        self,
        module: nn.Module,
        previous: Any = None,
        label: str = "",
        segment: Segment | None = None,
    ) -> None:
        self.module_ref = weakref.ref(module)
        self.previous = previous
        self.label = label  # "block B of the plan's segment A..C", for errors
        self.segment = segment

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = _block(self.module_ref)
        found = sharded(module)
        if found is not None:
            raise _sharded_error(self.label, found)
        if torch.compiler.is_compiling():  # [ Regions under torch.compile ] 4 in _compile.py
            from .._compile import lower

            # A partial of the class's function, as LinkedForward lowers: Dynamo traces it
            # in the one graph.
            forward = self.previous
            if forward is None:
                forward = functools.partial(type(module).forward, module)
            return lower(forward, args, kwargs)
        forward = self.previous
        if forward is None:
            forward = types.MethodType(type(module).forward, module)
        segment = self.segment
        if segment is None:
            return forward(*args, **kwargs)
        if segment.alone():
            return segment.run_alone(forward, args, kwargs)
        try:
            return forward(*args, **kwargs)
        except Exception:
            raise  # (the segment's always_call hooks close it)
        except BaseException:
            segment.close()  # torch runs no always_call hook for it
            raise

    def __deepcopy__(self, memo: dict[int, Any]) -> SegmentForward:
        copied = _copied_block(self.module_ref, memo)
        return SegmentForward(
            copied,
            copy.deepcopy(self.previous, memo),
            self.label,
            copy.deepcopy(self.segment, memo),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (SegmentForward, (self.module_ref(), self.previous, self.label, self.segment))


def _label(path: str, paths: list[str]) -> str:
    return f"block {path} of the plan's segment {paths[0]}..{paths[-1]}"


def _sharded_error(label: str, found: nn.Module) -> RematError:
    """The error for block ``label`` of a segment, which FSDP shards (``found`` in it). FSDP
    gathers a block's parameters for that block's own forward and backward only, and a
    segment's recompute runs the blocks before the one whose backward runs: with their
    parameters sharded, it fails in backward, or would be wrong."""
    return RematError(
        f"remat: {label} is sharded by FSDP ({type(found).__name__}). FSDP gathers a block's "
        "parameters for that block's forward and backward only, and a segment's recompute runs "
        "the blocks before it too. Plan the model without segments before calling fully_shard "
        "(or wrapping it in FullyShardedDataParallel): remat.plan(..., segments=False) or "
        "remat.fit(..., segments=False)."
    )


class Linked:
    """A segment on the region engine: its blocks' calls, linked (see [ Segments on the region
    engine ])."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = list(paths)
        self.calls = LinkedCalls()
        self.warned = False

    def broke(self, position: int) -> None:
        """The block at ``position`` could not take the previous block's output."""
        if self.warned:
            return
        self.warned = True
        warn(
            f"remat: block {self.paths[position]} of the plan's segment {self.paths[0]}.."
            f"{self.paths[-1]} did not take the previous block's output as it was (the code "
            "between them changed or replaced it); it starts a new region and its input is "
            "kept. Gradients stay exact; memory is above the plan's. Plan again for this "
            "forward."
        )


class LinkedForward:
    """The instance-level ``forward`` of a block in a :class:`Linked` segment; holds the block
    weakly, as ``checkpoint_wrapper``'s forward does."""

    __slots__ = ("chain", "module_ref", "position")

    @property
    def __signature__(self) -> inspect.Signature:
        return forward_signature(self.module_ref())

    def __init__(self, module: nn.Module, chain: Linked, position: int) -> None:
        self.module_ref = weakref.ref(module)
        self.chain = chain
        self.position = position

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = _block(self.module_ref)
        found = sharded(module)
        if found is not None:
            paths = self.chain.paths
            raise _sharded_error(_label(paths[self.position], paths), found)
        if torch.compiler.is_compiling():  # [ Regions under torch.compile ] 4 in _compile.py
            lowered = functools.partial(type(module).forward, module)
            return self.chain.calls.run(self.position, lowered, args, kwargs)
        forward = types.MethodType(type(module).forward, module)
        calls = self.chain.calls
        broken = calls.broken
        last = self.position == len(self.chain.paths) - 1
        out = calls.run(self.position, forward, args, kwargs, last=last)
        if calls.broken != broken:
            self.chain.broke(self.position)
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> LinkedForward:
        copied = _copied_block(self.module_ref, memo)
        return LinkedForward(copied, copy.deepcopy(self.chain, memo), self.position)

    def __reduce__(self) -> tuple[Any, ...]:
        return (LinkedForward, (self.module_ref(), self.chain, self.position))
