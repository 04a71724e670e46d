"""Gradient-norm clipping over every slice of a disk :class:`~remat.OffloadModel`.

``torch.nn.utils.clip_grad_norm_`` needs every gradient at once; on disk they are in files, one
bundle per slice. The same arithmetic runs slice by slice: the norm of each gradient
(``torch._foreach_norm``, as torch), the total norm of those norms in torch's order (grouped by
dtype), then every slice's gradients times ``clamp(max_norm / (total + 1e-6), max=1)``, stored as
new copies and switched to all or nothing. With one dtype the result is torch's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._slices import Slice
from ._stored import Place, Stored

__all__: list[str] = []

_CPU = torch.device("cpu")


def clip_grad_norm(
    slices: Sequence[Slice], place: Place, max_norm: float, norm_type: float
) -> torch.Tensor:
    norms: list[torch.Tensor] = []
    for sl in slices:
        grads = [g for g in sl.load_grads(_CPU) if g is not None]
        if grads:
            norms.extend(torch._foreach_norm(grads, norm_type))
    if not norms:
        return torch.tensor(0.0)
    order = list(dict.fromkeys(n.dtype for n in norms))  # torch groups by dtype
    norms.sort(key=lambda n: order.index(n.dtype))
    total: torch.Tensor = torch.linalg.vector_norm(
        torch.stack([n.to(norms[0].dtype) for n in norms]), norm_type
    )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    new: list[tuple[Slice, Stored]] = []
    try:
        for sl in slices:
            if sl.grads is None:
                continue
            grads = sl.grads.load(_CPU)
            torch._foreach_mul_(grads, coef)
            new.append((sl, place.store(grads)))
        place.flush()
    except BaseException:
        for _, stored in new:
            stored.free()
        raise
    for sl, stored in new:
        sl.grads = stored
    return total
