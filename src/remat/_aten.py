"""Facts about ATen operators that remat's engines need, read from their schemas and cached.

For each operator overload: which arguments it writes, which of its results are new tensors
rather than views or aliases of an argument, and which positional arguments can hold tensors.
Schemas mark writes with ``(a!)``; a few operators write without saying so and are listed in
:data:`UNDECLARED_WRITES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

__all__: list[str] = []

aten = torch.ops.aten

# These batch-norm kernels update ``running_mean`` and ``running_var`` in place when
# ``training`` is true, but their schemas do not mark the two arguments as written.
UNDECLARED_WRITES: dict[str, tuple[str, ...]] = {
    "aten::native_batch_norm": ("running_mean", "running_var"),
    "aten::cudnn_batch_norm": ("running_mean", "running_var"),
    "aten::miopen_batch_norm": ("running_mean", "running_var"),
}

# Results that alias an argument but are new to the program: ``lift_fresh`` returns the tensor
# that ``torch.tensor(data)`` built from Python data outside the dispatcher.
FRESH_ALIASES = frozenset({"aten::lift_fresh"})


class ArgLayout(NamedTuple):
    """Where an operator's positional arguments can hold tensors, by their schema types. The
    graph engine looks only there, in each op it records and replays; any other positional
    argument (an int, a list of ints, a float, a device) is passed on as it is."""

    # ``Tensor`` or ``Tensor?``: a tensor, None, or a Python number (``x.add_(1)`` reaches a
    # dispatch mode with the wrapped number unwrapped)
    tensors: tuple[int, ...]
    lists: tuple[int, ...]  # ``Tensor[]`` or ``Tensor?[]``


@dataclass(frozen=True)
class OpInfo:
    """What an operator overload writes and creates."""

    # (position, name) of every argument the operator may write.
    writes: tuple[tuple[int, str], ...]
    # Whether autograd counts the writes (bumps the written tensors' version counters once the
    # op returns): true for in-place (``mul_``) and ``out=`` variants; false for a functional
    # op that writes an argument (``rrelu_with_noise`` fills its ``noise``; the batch-norm
    # kernels update their running statistics), whose written tensors keep their version.
    counted: bool
    # For each result, whether it is a new tensor (not an alias of an argument).
    fresh: tuple[bool, ...]
    any_fresh: bool
    # For an op that writes nothing and whose results are all views of one argument (``t``,
    # ``view``, ``split``), that argument's position: the results share its version counter
    # once the op returns, though not yet inside a dispatch mode.
    view_of: int | None
    # ``None`` when a positional argument's type could hold a tensor in some other form (a
    # generic ``t``, a dict, a custom class): every argument is then searched for tensors.
    layout: ArgLayout | None
    # Whether the operator draws random numbers (``bernoulli_``, ``rand``, ``normal_``).
    random: bool
    op: torch._ops.OpOverload  # held, so that its id, the cache key, stays its own


# Keyed by ``id(op)``: an OpOverload hashes in Python, an int in C, and dispatch modes look an
# op up here once per op they see.
_cache: dict[int, OpInfo] = {}


def storage_key(t: torch.Tensor) -> int | None:
    """A key for ``t``'s storage, unique among live storages: the address of the StorageImpl,
    which stays put when the storage is resized. ``None`` for tensors without a plain storage
    (sparse, nested, wrapper subclasses); parameters are plain tensors here."""
    if t.layout is not torch.strided or type(t) not in _PLAIN:
        return None
    return int(t.untyped_storage()._cdata)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def copy_with_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its sizes and strides, for a replay that writes a value in place
    where forward wrote the original. ``clone()`` keeps the strides of a dense tensor only: a
    chunk of a wider tensor (a GRU's gates) comes back contiguous, and some CPU kernels give
    other bits on another layout (``sigmoid_`` on a strided view and on its contiguous copy),
    so the replay would rebuild other values than forward saved. A tensor whose elements may
    overlap (an ``expand``) cannot be written in place, and is cloned."""
    if t.layout is not torch.strided or t.is_contiguous() or not _no_overlap(t):
        return t.clone()
    copy = t.new_empty_strided(t.size(), t.stride())
    return copy.copy_(t)


def _no_overlap(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory, by a sufficient test on its strides."""
    pairs = zip(t.stride(), t.shape, strict=True)
    dims = sorted((stride, size) for stride, size in pairs if size > 1)
    extent = 1  # elements spanned by the dimensions of smaller stride
    for stride, size in dims:
        if stride < extent:
            return False
        extent = stride * (size - 1) + extent
    return True


def op_info(op: torch._ops.OpOverload) -> OpInfo:
    info = _cache.get(id(op))
    if info is None:
        info = _cache[id(op)] = _read_schema(op)
    return info


def _read_schema(op: torch._ops.OpOverload) -> OpInfo:
    schema = op._schema
    undeclared = UNDECLARED_WRITES.get(schema.name, ())
    writes = tuple(
        (i, arg.name)
        for i, arg in enumerate(schema.arguments)
        if (arg.alias_info is not None and arg.alias_info.is_write) or arg.name in undeclared
    )
    fresh_alias = schema.name in FRESH_ALIASES
    fresh = tuple(ret.alias_info is None or fresh_alias for ret in schema.returns)
    aliased = [i for i, arg in enumerate(schema.arguments) if arg.alias_info is not None]
    view_of = aliased[0] if not writes and fresh and not any(fresh) and len(aliased) == 1 else None
    counted = bool(writes) and (
        schema.name.endswith("_") or any(schema.arguments[i].is_out for i, _ in writes)
    )
    random = torch.Tag.nondeterministic_seeded in op.tags
    return OpInfo(writes, counted, fresh, any(fresh), view_of, _layout(schema), random, op)


# Schema types whose values hold no tensor: ``int`` stands for ScalarType, Layout and
# MemoryFormat too, ``number`` for Scalar.
_PLAIN_TYPES = (
    torch.IntType,
    torch.SymIntType,
    torch.BoolType,
    torch.FloatType,
    torch.ComplexType,
    torch.NumberType,
    torch.StringType,
    torch.DeviceObjType,
)


def _layout(schema: torch._C.FunctionSchema) -> ArgLayout | None:
    tensors: list[int] = []
    lists: list[int] = []
    for i, arg in enumerate(a for a in schema.arguments if not a.kwarg_only):
        kind = _kind(arg.type)
        if kind == "tensor":
            tensors.append(i)
        elif kind == "list":
            lists.append(i)
        elif kind != "plain":
            return None
    return ArgLayout(tuple(tensors), tuple(lists))


def _kind(t: torch._C.JitType) -> Literal["tensor", "list", "plain", "other"]:
    """A tensor, a list of tensors, a value that holds none, or anything else."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.TensorType):
        return "tensor"
    if isinstance(t, torch.ListType):
        item = t.getElementType()
        if isinstance(item, torch.OptionalType):
            item = item.getElementType()
        if isinstance(item, torch.TensorType):
            return "list"
        t = item
    return "plain" if isinstance(t, _PLAIN_TYPES) else "other"
