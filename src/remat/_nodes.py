"""The records of a graph-engine region: references to tensor states, nodes, what autograd
holds. Shared by the recording (``graph.py``) and the replay (``_replay.py``); see NOTE
[ Replay identity ] in ``graph.py``."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ._aten import ArgLayout, copy_with_layout
from .policies import Decision

__all__: list[str] = []

# A result index; ("w", position) for a written argument; ("l", index, item) in a list result.
Key = int | tuple[str, int] | tuple[str, int, int]


class Ref(NamedTuple):
    """A tensor state in the recorded graph: result ``key`` of node ``node``."""

    node: int
    key: Key


@dataclass(frozen=True)
class _Input:
    index: int  # position among the region's tensor inputs


@dataclass
class _External:
    """A tensor from outside the region, held; its version is checked at replay. When the
    region later writes it in place, ``snapshot`` holds the state this read saw."""

    tensor: torch.Tensor
    version: int  # ``NO_COUNTER`` for an inference tensor
    snapshot: torch.Tensor | None = None


# The version of a tensor made under ``torch.inference_mode``, which has no version counter:
# nothing outside inference mode can write it, so it needs no check.
NO_COUNTER = -1


def version_of(t: torch.Tensor) -> int:
    """``t._version``, or ``NO_COUNTER`` for an inference tensor."""
    try:
        return t._version
    except RuntimeError:
        if t.is_inference():
            return NO_COUNTER
        raise


class _Meta:
    """A tensor argument an op reads only for its metadata (``empty_like(x)``): replayed as a
    meta-device tensor with the same shape, strides and dtype, so the cone stops here. A
    plain class with slots: ops that make one are recorded on the per-op path."""

    __slots__ = ("device", "dtype", "shape", "stride")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape: tuple[int, ...] = tuple(t.shape)
        self.stride: tuple[int, ...] = t.stride()
        self.dtype: torch.dtype = t.dtype
        self.device: torch.device = t.device

    def __repr__(self) -> str:
        return f"_Meta(shape={self.shape}, stride={self.stride}, dtype={self.dtype})"

    def stand_in(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")

    def empty(self) -> torch.Tensor:
        """Uninitialized memory with this layout, on the real device."""
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


# Ops whose result is uninitialized memory laid out from their arguments: a replay makes a
# blank tensor with the recorded result's layout instead (see ``Node.blank``).
_BLANK = frozenset({"empty_like", "new_empty", "new_empty_strided"})

# Ops that read their first tensor argument for its metadata only.
_METADATA_ONLY = frozenset(
    {
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)


class _Held:
    """A tensor held by reference (a stale read or a kept result), copied before the region
    writes it.

    ``source``: a weak reference to the tensor whose version counter the held value shares
    in the program (the root of its views), and ``version``: that counter when the value was
    held. A write after the forward pass goes through no recording mode, so the value must
    still be at ``version`` when backward reads it, or plain autograd would have raised: see
    ``_replay.check_held``. ``source`` is None for a copy, which no write outside reaches.
    """

    __slots__ = ("source", "tensor", "version")

    def __init__(
        self,
        tensor: torch.Tensor,
        source: weakref.ref[torch.Tensor] | None = None,
        version: int = 0,
    ) -> None:
        self.tensor = tensor
        self.source = source
        self.version = version

    def copied(self) -> None:
        """Hold a copy from now on: the region is about to write the value held."""
        self.tensor = copy_with_layout(self.tensor)
        self.source = None

    def __repr__(self) -> str:
        return f"_Held(shape={tuple(self.tensor.shape)}, version={self.version})"


class Node:
    """One recorded op. A plain class with slots: one is made per op the region runs."""

    __slots__ = (
        "after",
        "args",
        "blank",
        "decision",
        "feeds",
        "in_attention",
        "kept",
        "kwargs",
        "layout",
        "module",
        "op",
        "refs",
        "rng",
        "writes",
    )

    def __init__(
        self,
        op: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        module: str,
        decision: Decision,
        writes: tuple[tuple[int, str], ...],
        rng: list[tuple[Any, torch.Tensor | None]] | None = None,
        refs: tuple[Ref, ...] = (),
        in_attention: bool = False,
        layout: ArgLayout | None = None,
    ) -> None:
        self.op = op
        self.args = args
        # Where ``args`` can hold records, as for the op's tensors (see ``ArgLayout``); None:
        # anywhere.
        self.layout = layout
        self.kwargs = kwargs
        self.module = module
        self.decision = decision
        self.writes = writes
        # (generator, state before the op) for a random op; the state is None when the op
        # follows another random op of the replay, ``after``, and starts where that one left
        # the generator.
        self.rng = rng
        self.after: int | None = None
        self.feeds = False  # a later random op starts where this one leaves the generator
        self.kept: dict[Key, Any] = {}  # _Held, or Saved when offloaded
        self.refs = refs  # every reference among the arguments, repeats included
        # The result's layout, for an op in ``_BLANK``: its replay allocates that layout
        # directly (running ``empty_like`` on a meta stand-in goes through torch's Python
        # reference).
        self.blank: _Meta | None = None
        self.in_attention = in_attention  # ran inside ``scaled_dot_product_attention``


class _Packed:
    """What autograd holds for one tensor saved in a graph region; for one the region will
    rebuild, the tensor saved (weakly) and its version then, checked when it is unpacked
    (see ``errors.saved_and_written``)."""

    __slots__ = ("__weakref__", "ref", "tensor", "version")

    def __init__(
        self,
        ref: Ref | _Input | _Held,
        tensor: weakref.ref[torch.Tensor] | None = None,
        version: int = 0,
    ) -> None:
        self.ref = ref
        self.tensor = tensor
        self.version = version


class _Entry(NamedTuple):
    """How a tensor alive in forward is known: its reference, at which version, which object,
    and the address of its data, which moves where ``t.data = other`` swaps the data of the
    same object without a write (see [ Replay identity ] in ``graph.py``)."""

    ref: Ref | _Input
    version: int
    tensor: weakref.ref[torch.Tensor]
    address: int


def address_of(t: torch.Tensor) -> int:
    """The address of ``t``'s data; 0 for a tensor without storage (sparse, a wrapper)."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return 0


def _key(t: torch.Tensor) -> int:
    return int(t._cdata)


def _refs_in(tree: Any) -> Iterator[Ref]:
    if isinstance(tree, Ref):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _refs_in(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _refs_in(item)


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to the tensors in an op argument (tensors, lists and tuples of them)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if not isinstance(value, (tuple, list)):
        return value
    mapped = []  # a plain loop: this runs for every argument of every recorded op
    for v in value:
        if isinstance(v, torch.Tensor):
            v = fn(v)
        elif isinstance(v, (tuple, list)):
            v = _map(fn, v)
        mapped.append(v)
    return mapped if isinstance(value, list) else tuple(mapped)


_RECORDED = (Ref, _Input, _External, _Held, _Meta)


def _map_recorded(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, _RECORDED):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_recorded(fn, v) for v in value)
    return value
