"""Per-operator decisions: save an op's output for backward, or drop it and recompute it.

A policy is called once per ATen operator of a graph-engine region, in forward, as
``policy(ctx, op, *args, **kwargs)`` — the signature of a ``torch.utils.checkpoint`` selective
checkpointing policy, so such a policy works unchanged — and returns a :class:`Decision`, a
``torch.utils.checkpoint.CheckpointPolicy``, or a bool (``True`` means ``MUST_SAVE``, ``False``
``PREFER_RECOMPUTE``, as in torch).

NOTE [ Deciding with several policies ]

Regions nest, and each may carry a policy: the decisions for one op form a stack, innermost
last.

1. ``MUST_*`` beats ``PREFER_*``: the decision of the innermost region that says ``MUST_*``
   wins over every ``PREFER_*``.
2. Two different ``MUST_*`` decisions for the same op raise :class:`~remat.RematError`: no
   silent choice between two requirements.
3. Among ``PREFER_*`` decisions, the innermost region's wins.
4. Some ops must be saved whatever the policies say (see ``must_save_reason``): their result
   could change in a recompute (``nonzero``, ``unique``, ``topk`` and ``sort`` used for
   routing, device syncs, collectives, ops with side effects). ``PREFER_RECOMPUTE`` yields to
   that; ``MUST_RECOMPUTE`` on such an op raises, naming the op and the module. Offloading
   them is fine: an offloaded tensor comes back as it was, it is not recomputed.
5. An ``OFFLOAD_*`` decision names its tier; the tier object behind the name is the one
   ``remat.store.tiers`` set for the thread (by default one host tier and one disk tier in the
   system's temporary directory per process). Inside a ``remat.offload`` block, outputs a
   policy keeps are offloaded to that block's tier too.

NOTE [ Random ops under a policy ]

A recomputed random op (dropout) replays with the generator state it drew from, so that it
draws the same numbers; consecutive random ops replayed together keep the first one's state.
The default generators are shared by the threads of the process: another thread drawing from
one between two random ops of a region, or while backward replays them, shifts the numbers
the replay draws and the gradients are silently wrong (as with ``torch.utils.checkpoint``).
Give such threads their own ``torch.Generator``; see ``remat.checkpoint``.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any, Literal, TypeAlias, TypeVar

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ._aten import op_info
from .errors import RematError

__all__ = [
    "Decision",
    "OpContext",
    "Policy",
    "check",
    "decides_by_op",
    "must",
    "offload_everything",
    "offload_larger_than",
    "offload_matmuls",
    "reads_attention",
    "recompute_attention_core",
    "recompute_everything",
    "save_everything",
    "save_if_any",
    "save_matmuls",
    "save_smaller_than",
    "save_tagged",
]

aten = torch.ops.aten


class Decision(enum.Enum):
    """What to do with one op's output: keep it where it is (``SAVE``), drop it and rebuild
    it in backward (``RECOMPUTE``), or move it to a slower tier until backward needs it
    (``OFFLOAD_HOST``: host memory; ``OFFLOAD_DISK``: files), each as a requirement
    (``MUST_``) or a preference (``PREFER_``)."""

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"
    MUST_OFFLOAD_HOST = "must_offload_host"
    PREFER_OFFLOAD_HOST = "prefer_offload_host"
    MUST_OFFLOAD_DISK = "must_offload_disk"
    PREFER_OFFLOAD_DISK = "prefer_offload_disk"

    @property
    def must(self) -> bool:
        return self.value.startswith("must_")

    @property
    def save(self) -> bool:
        """Kept where it is."""
        return self in (Decision.MUST_SAVE, Decision.PREFER_SAVE)

    @property
    def recompute(self) -> bool:
        return self in (Decision.MUST_RECOMPUTE, Decision.PREFER_RECOMPUTE)

    @property
    def offload(self) -> Literal["host", "disk"] | None:
        """The tier an offload decision names, else ``None``."""
        if self in (Decision.MUST_OFFLOAD_HOST, Decision.PREFER_OFFLOAD_HOST):
            return "host"
        if self in (Decision.MUST_OFFLOAD_DISK, Decision.PREFER_OFFLOAD_DISK):
            return "disk"
        return None


_FROM_TORCH = {
    CheckpointPolicy.MUST_SAVE: Decision.MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE: Decision.PREFER_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE: Decision.MUST_RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE: Decision.PREFER_RECOMPUTE,
    CheckpointPolicy.MUST_CPU_OFFLOAD: Decision.MUST_OFFLOAD_HOST,
    CheckpointPolicy.PREFER_CPU_OFFLOAD: Decision.PREFER_OFFLOAD_HOST,
}


class OpContext:
    """What a policy knows about the op it decides for, besides the op and its arguments.

    ``module`` is the qualified name of the module the op ran in; ``tags`` the names given with
    ``remat.tag`` (set when the policies are asked again about a tagged tensor's op);
    ``in_attention`` whether the op runs inside ``scaled_dot_product_attention`` (tracked while
    a policy on the stack may read it, see :func:`reads_attention`), or in the core of
    attention written out (matmul, softmax, dropout, matmul), where the policies are asked
    again with ``in_attention=True`` once the core's last matmul has run;
    ``output_bytes`` what keeping the op's results would hold (a view holds its whole storage),
    or ``None`` when asked about a tagged tensor. ``is_recompute`` is always ``False``
    (policies run in forward only); it is there so that torch selective-checkpointing policies
    that read it work unchanged.
    """

    __slots__ = ("_bytes", "_outputs", "in_attention", "module", "tags")
    is_recompute = False

    def __init__(
        self,
        module: str = "",
        tags: frozenset[str] = frozenset(),
        in_attention: bool = False,
        output_bytes: int | None = None,
        outputs: tuple[Any, Any] | None = None,
    ) -> None:
        self.module = module
        self.tags = tags
        self.in_attention = in_attention
        self._bytes = output_bytes
        self._outputs = outputs  # (op, result), sized only if a policy asks

    @property
    def output_bytes(self) -> int | None:
        if self._bytes is not None or self._outputs is None:
            return self._bytes
        op, out = self._outputs
        fresh = op_info(op).fresh
        results = out if isinstance(out, (tuple, list)) else (out,)
        total = 0
        for result, is_fresh in zip(results, fresh, strict=False):
            for t in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                    size = t.numel() * t.element_size()
                    total += size if is_fresh else t.untyped_storage().nbytes()
        return total


Policy: TypeAlias = Callable[..., "Decision | CheckpointPolicy | bool"]
"""``policy(ctx: OpContext, op: OpOverload, *args, **kwargs) -> Decision``."""


def as_decision(result: Any, policy: Any, op: Any) -> Decision:
    """Turn what a policy returned into a :class:`Decision`, or raise if it is none."""
    if isinstance(result, Decision):
        return result
    if isinstance(result, CheckpointPolicy):
        if result in _FROM_TORCH:
            return _FROM_TORCH[result]
        raise RematError(
            f"remat: policy {_name(policy)} returned {result} for {op}, a CheckpointPolicy this "
            "version of remat does not know. Return a remat.policies.Decision."
        )
    if isinstance(result, bool):
        return Decision.MUST_SAVE if result else Decision.PREFER_RECOMPUTE
    raise RematError(
        f"remat: policy {_name(policy)} returned {result!r} ({type(result).__name__}) for {op}; "
        "expected a remat.policies.Decision, a torch CheckpointPolicy or a bool."
    )


_P = TypeVar("_P", bound=Callable[..., Any])

# What each built-in policy reads besides the op (none reads the op's arguments):
# ``"in_attention"``, ``"tags"``, ``"output_bytes"``. A graph-engine region skips the work of
# telling a policy what it never reads: without ``"in_attention"`` it runs without the
# ``TorchFunctionMode`` that tracks it (a few microseconds on every torch call), and a policy
# that reads nothing is asked once per op, its answer reused for every later call of that op.
# A policy not listed here (any user policy, a torch selective-checkpointing function) may
# read anything.
_READS: weakref.WeakKeyDictionary[Callable[..., Any], frozenset[str]] = weakref.WeakKeyDictionary()


def _reads(*fields: str) -> Callable[[_P], _P]:
    def mark(policy: _P) -> _P:
        _READS[policy] = frozenset(fields)
        return policy

    return mark


def _fields(policy: Any) -> frozenset[str] | None:
    """What ``policy`` reads, or ``None`` when it is not a built-in that says."""
    try:
        fields = _READS.get(policy)
    except TypeError:  # not weakly referenceable, so not a built-in function
        fields = None
    if fields is None:  # a factory's policy, or a built-in class of them (the planner's)
        fields = (
            policy.reads
            if isinstance(policy, _Built)
            else getattr(type(policy), "_remat_reads", None)
        )
    return fields


def reads_attention(policy: Any) -> bool:
    """Whether ``policy`` may read ``ctx.in_attention``: ``True`` for every policy but the
    built-ins known not to."""
    fields = _fields(policy)
    return fields is None or "in_attention" in fields


def decides_by_op(policy: Any) -> bool:
    """Whether ``policy``'s decision depends on the op alone, not on its context or arguments
    (``save_matmuls``, ``save_everything``, ...): a region asks it once per op."""
    return _fields(policy) == frozenset()


def _name(policy: Any) -> str:
    return getattr(policy, "__name__", None) or type(policy).__name__


# The built-in factories, each with a call that makes a policy of it: passing the factory
# itself where a policy is expected is the easiest mistake to make with them.
_FACTORIES: dict[str, str] = {}


def _factory(example: str) -> Callable[[_P], _P]:
    def mark(factory: _P) -> _P:
        _FACTORIES[factory.__name__] = example
        return factory

    return mark


def _is_factory(value: Any) -> str | None:
    name = getattr(value, "__name__", None)
    if name in _FACTORIES and globals().get(name) is value:
        return _FACTORIES[name]
    return None


def check(policy: Any, caller: str) -> Any:
    """Raise a :class:`~remat.RematError` unless ``policy`` can be called as
    ``policy(ctx, op, *args, **kwargs)``; returns it. Every front that accepts a policy
    (``checkpoint``, ``region``, ``apply``, ``checkpoint_wrapper``, the combinators) calls
    this, so that a wrong value fails where it is given, not inside the first recorded op."""
    with contextlib.suppress(TypeError):
        if policy in _CALLABLE_AS_POLICY:
            return policy
    if isinstance(policy, torch.nn.Module):  # callable with any arguments, never a policy
        raise RematError(
            f"{caller}: policy must be a callable (ctx, op, *args, **kwargs) -> Decision, got "
            f"the module {type(policy).__name__}; see remat.policies. A module the function "
            "itself takes as policy: pass it positionally or bind it with functools.partial."
        )
    example = _is_factory(policy)
    if example is not None:
        raise RematError(
            f"{caller}: policy=remat.policies.{policy.__name__} is a factory; call it: "
            f"policy=remat.policies.{example}."
        )
    if not callable(policy):
        hint = "see remat.policies"
        if isinstance(policy, str) and policy in _BUILT_IN:  # a policy's name: its function
            hint = f"pass the function: policy=remat.policies.{_BUILT_IN[policy]}"
        raise RematError(
            f"{caller}: policy must be a callable (ctx, op, *args, **kwargs) -> Decision, got "
            f"{type(policy).__name__} {_short(policy)}; {hint}."
        )
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # a builtin or extension callable: nothing to read
        return policy
    try:
        signature.bind(OpContext(), aten.mm.default, None, None, None, keyword=None)
    except TypeError:
        raise RematError(
            f"{caller}: policy={_name(policy)} takes ({', '.join(signature.parameters)}), but a "
            "policy is called as "
            "policy(ctx, op, *args, **kwargs) with the op's arguments; give it those "
            "parameters."
        ) from None
    with contextlib.suppress(TypeError):  # not hashable, or no weak reference: checked each time
        _CALLABLE_AS_POLICY.add(policy)
    return policy


# The policies ``check`` passed: reading a signature costs more than a small region's forward
# (``remat.checkpoint(fn, x, policy=p)`` checks ``p`` on every call).
_CALLABLE_AS_POLICY: weakref.WeakSet[Any] = weakref.WeakSet()


def _short(value: Any) -> str:
    text = repr(value)
    return f"({text[:57]}...)" if len(text) > 60 else f"({text})"


class _Built:
    """A policy a factory made (``save_tagged("a")``, ``offload_matmuls("disk")``, ...): a
    module-level ``decide`` function and the values it was made with, so that a model set up
    with it pickles (``torch.save(model)``, ``copy.deepcopy``, spawned workers) as one set up
    with ``save_matmuls`` does; a closure would not."""

    def __init__(
        self,
        name: str,
        reads: frozenset[str] | None,
        decide: Callable[..., Decision],
        *state: Any,
    ) -> None:
        self.__name__ = name
        self.reads = reads  # what ``decide`` reads (see ``_fields``); None: anything
        self.decide = decide
        self.state = state

    def __call__(self, ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return self.decide(*self.state, ctx, op, *args, **kwargs)

    def __repr__(self) -> str:
        return f"remat.policies.{self.__name__}"


def resolve(decisions: list[Decision], op: Any, module: str) -> Decision:
    """One decision from a stack of them, innermost last; see [ Deciding with several policies ]."""
    musts = {d for d in decisions if d.must}
    if len(musts) > 1:
        raise RematError(
            f"remat: conflicting policies for {op} in module {module or '(top)'}: nested regions "
            f"say {' and '.join(sorted(d.name for d in musts))}. Make one of them PREFER_*."
        )
    if musts:
        return musts.pop()
    return decisions[-1]


# Ops whose output a recompute could change, or that must not run twice.
_DATA_DEPENDENT = {
    "nonzero": "its output shape depends on the data",
    "nonzero_static": "its output depends on the data",
    "unique": "its output shape depends on the data",
    "_unique": "its output shape depends on the data",
    "_unique2": "its output shape depends on the data",
    "unique_dim": "its output shape depends on the data",
    "unique_consecutive": "its output shape depends on the data",
    "masked_select": "its output shape depends on the data",
    "topk": "routing decisions must not change between forward and recompute",
    "sort": "routing decisions must not change between forward and recompute",
    "argsort": "routing decisions must not change between forward and recompute",
    "_local_scalar_dense": "it syncs with the device (.item())",
    "_assert_async": "it is a device-side check with a side effect",
    "_print": "it has a side effect",
    # An LSTM on the CPU: the kernel makes the workspace its backward reads only when autograd
    # records, and a replay runs without it.
    "mkldnn_rnn_layer": "its workspace is made only where autograd records (LSTM on the CPU)",
}


def must_save_reason(op: torch._ops.OpOverload) -> str | None:
    """Why ``op``'s output must be saved whatever the policy says, or ``None``."""
    name = op.overloadpacket.__name__
    if name in _DATA_DEPENDENT:
        return _DATA_DEPENDENT[name]
    if op.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
        return "it is a collective"
    if torch.Tag.data_dependent_output in op.tags:
        return "its output depends on the data"
    return None


# -- built-in policies ----------------------------------------------------------------------------


@_reads()
def save_everything(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    """Keep every output autograd needs: no recompute, the most memory (a plain run)."""
    return Decision.PREFER_SAVE


@_reads()
def recompute_everything(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    """Keep nothing but the region's inputs: the least memory, one extra forward of compute."""
    return Decision.PREFER_RECOMPUTE


MATMULS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.addbmm.default,
        aten.mv.default,
        aten.addmv.default,
        aten.dot.default,
        aten.vdot.default,
        aten._int_mm.default,
        aten._scaled_mm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten.convolution.default,
    }
)


@_reads()
def save_matmuls(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    """Matrix multiplies, convolutions and attention kernels are the expensive ops: keep their
    outputs, recompute the cheap pointwise ops around them."""
    return Decision.PREFER_SAVE if op in MATMULS else Decision.PREFER_RECOMPUTE


@_factory("save_tagged('name')")
def save_tagged(*names: str) -> Policy:
    """Keep the tensors named with ``remat.tag(t, name)`` for one of ``names``; recompute the
    rest (JAX's ``save_only_these_names``)."""
    wanted = frozenset(names)
    if not wanted or not all(isinstance(n, str) for n in names):
        raise RematError(f"remat.policies.save_tagged: expected tag names, got {names!r}.")

    return _Built(
        f"save_tagged({', '.join(map(repr, names))})", frozenset({"tags"}), _tagged, wanted
    )


def _tagged(wanted: frozenset[str], ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    return Decision.MUST_SAVE if ctx.tags & wanted else Decision.PREFER_RECOMPUTE


@_factory("save_smaller_than(2**20)")
def save_smaller_than(nbytes: int) -> Policy:
    """Keep outputs smaller than ``nbytes``: they cost little memory, and recomputing them
    would need the ops before them too."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise RematError(f"remat.policies.save_smaller_than: expected bytes >= 0, got {nbytes!r}.")

    return _Built(f"save_smaller_than({nbytes})", frozenset({"output_bytes"}), _smaller, nbytes)


def _smaller(nbytes: int, ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    small = ctx.output_bytes is not None and ctx.output_bytes < nbytes
    return Decision.PREFER_SAVE if small else Decision.PREFER_RECOMPUTE


@_reads("in_attention")
def recompute_attention_core(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    """Megatron's selective recompute: attention scores and probabilities take memory
    quadratic in the sequence for little compute, so recompute everything inside
    ``scaled_dot_product_attention`` and keep the rest.

    Attention written out (Hugging Face's ``attn_implementation="eager"``: matmul, scale,
    mask, softmax over the last dimension, dropout, matmul) is recognised too, once its second
    matmul runs: the ops from the first matmul to the second's input are recomputed (see NOTE
    [ Eager attention core ] in ``remat._attention``)."""
    return Decision.PREFER_RECOMPUTE if ctx.in_attention else Decision.PREFER_SAVE


@_factory("save_if_any(save_matmuls, save_tagged('name'))")
def save_if_any(*policies: Policy) -> Policy:
    """Keep an output if any of ``policies`` keeps it (JAX's ``save_from_both_policies``);
    else offload it if any offloads it (the first such decision); else recompute it."""
    if not policies or not all(callable(p) for p in policies):
        raise RematError(f"remat.policies.save_if_any: expected policies, got {policies!r}.")
    for p in policies:
        check(p, "remat.policies.save_if_any")

    fields: frozenset[str] | None = frozenset()
    for p in policies:
        part = _fields(p)
        fields = None if fields is None or part is None else fields | part
    name = f"save_if_any({', '.join(_name(p) for p in policies)})"
    return _Built(name, fields, _any_saves, policies)


def _any_saves(
    policies: tuple[Policy, ...], ctx: OpContext, op: Any, *args: Any, **kwargs: Any
) -> Decision:
    decisions = [as_decision(p(ctx, op, *args, **kwargs), p, op) for p in policies]
    saves = [d for d in decisions if d.save]
    if saves:
        return Decision.MUST_SAVE if any(d.must for d in saves) else Decision.PREFER_SAVE
    offloads = [d for d in decisions if d.offload]
    if offloads:  # stored somewhere beats recomputed
        return next((d for d in offloads if d.must), offloads[0])
    return Decision.MUST_RECOMPUTE if any(d.must for d in decisions) else Decision.PREFER_RECOMPUTE


_OFFLOAD = {
    "host": Decision.PREFER_OFFLOAD_HOST,
    "disk": Decision.PREFER_OFFLOAD_DISK,
}


def _offload_decision(caller: str, tier: str) -> Decision:
    if tier not in _OFFLOAD:
        raise RematError(f"remat.policies.{caller}: tier must be 'host' or 'disk', got {tier!r}.")
    return _OFFLOAD[tier]


@_factory("offload_everything('host')")
def offload_everything(tier: str = "host") -> Policy:
    """Move every output autograd needs to ``tier``: no recompute, and device memory only for
    what is in flight; the cost is bandwidth."""
    decision = _offload_decision("offload_everything", tier)

    return _Built(f"offload_everything({tier!r})", frozenset(), _always, decision)


def _always(decision: Decision, ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    return decision


@_factory("offload_matmuls('host')")
def offload_matmuls(tier: str = "host") -> Policy:
    """Offload the outputs of the expensive ops (``MATMULS``) and recompute the cheap ones
    around them: backward replays no matmul, and keeps nothing on the device."""
    decision = _offload_decision("offload_matmuls", tier)

    return _Built(f"offload_matmuls({tier!r})", frozenset(), _matmuls_to, decision)


def _matmuls_to(decision: Decision, ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    return decision if op in MATMULS else Decision.PREFER_RECOMPUTE


@_factory("offload_larger_than(2**20, 'host')")
def offload_larger_than(nbytes: int, tier: str = "host") -> Policy:
    """Offload outputs of at least ``nbytes`` and keep smaller ones: moving a small tensor
    costs more in latency than it frees."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise RematError(
            f"remat.policies.offload_larger_than: expected bytes >= 0, got {nbytes!r}."
        )
    decision = _offload_decision("offload_larger_than", tier)

    name = f"offload_larger_than({nbytes}, {tier!r})"
    return _Built(name, frozenset({"output_bytes"}), _larger_to, nbytes, decision)


def _larger_to(
    nbytes: int, decision: Decision, ctx: OpContext, op: Any, *args: Any, **kwargs: Any
) -> Decision:
    large = ctx.output_bytes is None or ctx.output_bytes >= nbytes
    return decision if large else Decision.PREFER_SAVE


@_factory("must(save_matmuls)")
def must(policy: Policy) -> Policy:
    """``policy`` with every ``PREFER_*`` made ``MUST_*``, so that outer regions cannot
    override it."""
    check(policy, "remat.policies.must")
    return _Built(f"must({_name(policy)})", _fields(policy), _strict, policy)


_STRONG = {d: Decision[d.name.replace("PREFER_", "MUST_")] for d in Decision if not d.must}


def _strict(policy: Policy, ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    decision = as_decision(policy(ctx, op, *args, **kwargs), policy, op)
    return _STRONG.get(decision, decision)


# The policies (functions of ``ctx, op, ...``) and policy factories remat ships, by name: what a
# policy given as a string meant (a factory with an example call).
_BUILT_IN = {
    name: _is_factory(value) or name
    for name, value in list(globals().items())
    if name in __all__
    and isinstance(value, types.FunctionType)
    and (_is_factory(value) is not None or value.__code__.co_varnames[:2] == ("ctx", "op"))
}
