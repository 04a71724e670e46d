"""Eager attention in a graph-engine region: find its core, so that policies see it.

``ctx.in_attention`` is set for ops that run inside ``scaled_dot_product_attention``. Models
that write attention out (Hugging Face's ``attn_implementation="eager"``: matmul, scale, mask,
softmax, dropout, matmul) never call it, and ``recompute_attention_core`` would recompute
nothing there, silently. This module recognises that core in the recorded ops.

NOTE [ Eager attention core ]

1. The trigger: a ``torch.matmul`` (or ``@``, ``bmm``) returns, in a region whose policy stack
   may read ``ctx.in_attention`` (the only regions that track attention at all).
2. Its matmul node ``M2`` is found behind the views of its result. Walking back from ``M2``'s
   first operand, through any ops recorded after ``M1`` below and no other matmul, a softmax
   over the last dimension ``S`` must be found; walking back from ``S``'s input, a matmul
   ``M1``. Bounded walks (``_DEPTH`` ops): attention has a handful of ops between them.
3. The core is every op recorded from ``M1`` on that ``M2``'s first operand depends on: the
   scores, the scale and mask, the softmax, the dropout mask and its application (the
   quadratic tensors), never ``q``, ``k``, ``v`` or anything recorded before ``M1``.
4. The decisions of the core's ops were made when they ran, outside attention as far as the
   policies knew: each policy stack is asked again, with ``in_attention=True`` and the op's
   arguments as far as they live (as for ``remat.tag``). Where it now says recompute, the
   op's kept results are dropped: backward rebuilds them from the records, which every op has,
   with the random state every random op captured. Where it says save, nothing changes: a
   result already dropped cannot be brought back (a policy that saves inside attention and
   recomputes outside it sees eager attention as outside).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._nodes import Node, Ref, _Held
from .policies import OpContext, must_save_reason

__all__: list[str] = []

_MATMULS = frozenset({"bmm", "mm", "baddbmm", "matmul"})
_SOFTMAX = frozenset({"_softmax", "softmax", "_safe_softmax"})
_DEPTH = 16

# The torch functions whose result may end an attention core (step 1).
MATMUL_FUNCTIONS = frozenset(
    {
        torch.matmul,
        torch.bmm,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.bmm,
    }
)


def _name(node: Node) -> str:
    return str(node.op.overloadpacket.__name__)


def _find(graph: Any, start: Ref, found: Callable[[Node], bool], floor: int = 0) -> int | None:
    """The nearest node before ``start`` (breadth first, at most ``_DEPTH`` steps, at or above
    index ``floor``, through no matmul) for which ``found`` holds, or ``None``."""
    frontier, seen = [start.node], set()
    for _ in range(_DEPTH):
        following: list[int] = []
        for index in frontier:
            if index in seen or index < floor:
                continue
            seen.add(index)
            node = graph.nodes[index]
            if found(node):
                return index
            if _name(node) not in _MATMULS:
                following += [r.node for r in node.refs]
        frontier = following
    return None


def _is_softmax(node: Node) -> bool:
    """A softmax over the last dimension (``-1``, or the last by the kept result's shape)."""
    if _name(node) not in _SOFTMAX or len(node.args) < 2:
        return False
    held = node.kept.get(0)
    last = held.tensor.dim() - 1 if isinstance(held, _Held) else None
    return node.args[1] in (-1, last)


def _is_matmul(node: Node) -> bool:
    return _name(node) in _MATMULS


def core(graph: Any, result: torch.Tensor) -> list[int]:
    """The recorded ops of the attention core that ``result`` of a matmul ends, ascending; empty
    if it ends none. See NOTE [ Eager attention core ] 2 and 3."""
    entry = graph.lookup(result)
    if entry is None or not isinstance(entry.ref, Ref):
        return []
    m2 = _find(graph, entry.ref, _is_matmul)
    if m2 is None:
        return []
    first = graph.nodes[m2].args[0] if graph.nodes[m2].args else None
    if not isinstance(first, Ref):
        return []
    s = _find(graph, first, _is_softmax)
    if s is None:
        return []
    softmax_input = graph.nodes[s].args[0]
    m1 = _find(graph, softmax_input, _is_matmul) if isinstance(softmax_input, Ref) else None
    if m1 is None:
        return []
    inside: set[int] = set()
    stack = [first.node]
    while stack:
        index = stack.pop()
        if index in inside or index < m1:
            continue
        inside.add(index)
        if index != m1:
            stack += [r.node for r in graph.nodes[index].refs]
    return sorted(inside)


def mark(graph: Any, result: torch.Tensor) -> None:
    """Ask the policies again about the ops of the attention core ``result`` ends, as inside
    attention, and drop the kept results of those that are now recomputed (step 4)."""
    for index in core(graph, result):
        node = graph.nodes[index]
        if node.in_attention:
            continue
        node.in_attention = True
        if node.decision.recompute or must_save_reason(node.op) is not None:
            continue
        args, kwargs = graph._live_arguments(node)
        held = node.kept.get(0)
        size = held.tensor.untyped_storage().nbytes() if isinstance(held, _Held) else None
        ctx = OpContext(module=node.module, in_attention=True, output_bytes=size)
        decision = graph._ask(ctx, node.op, args, kwargs)
        if decision.recompute:
            node.decision = decision
            node.kept.clear()
