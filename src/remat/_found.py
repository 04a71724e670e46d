"""Leave a model as it was found after running it to look at it (``remat.explain``, the
planner's measured steps).

NOTE [ Putting a model back ]

``remat.explain`` runs a forward pass and the planner runs whole steps on the user's own model;
neither may leave a trace the user's training would see. What a forward pass can change, and
how each is put back:

1. A buffer written in place (BatchNorm's running statistics, a step counter): its values, and
   then its version counter. A write is seen by the version or, since BatchNorm's kernels
   write the running statistics without bumping theirs, by the values. A graph still waiting
   for its backward (``explain`` called between a step's forward and its backward) saved the
   statistics at their version; a copy alone would bump it, and that backward would raise
   autograd's in-place error. A buffer found as it was is not touched.
2. A buffer slot given another tensor (a memory bank, ``self.bank = torch.cat([self.bank, h])``;
   a cache registered as ``None`` and filled): the slot gets its own tensor back, with the
   values it had (it may have been written before it was replaced), and a buffer registered
   during the pass is removed.
3. Random state: the CPU generator, the default generators of the accelerators the model and
   its inputs use, and the ``torch.Generator`` objects the model holds (see [ Explicit
   generators ] in ``_ambient.py``).

A function explained (``lambda x: loss_fn(model(x), y)``) is put back through the modules it
reaches, found as the write guard finds them (NOTE [ When the guard runs ] 1 in ``_guard.py``).

Gradients are the planner's own concern (its steps run backward; ``explain`` runs none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._ambient import restoring_rng, set_generators
from ._guard import Reachable, _set_versions, generators_in

__all__: list[str] = []


class _Buffers:
    """Each module's buffer slots: the tensor each held, its values and its version."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        modules = dict.fromkeys(m for model in models for m in model.modules())
        self.slots = [(m, dict(m._buffers)) for m in modules]
        self.copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        for _, buffers in self.slots:
            for b in buffers.values():
                # An inference tensor has no version counter, and nothing outside
                # ``torch.inference_mode`` can write it.
                if b is not None and id(b) not in self.copies and not b.is_inference():
                    self.copies[id(b)] = (b, b._version, b.detach().clone())

    def restore(self) -> None:
        for module, buffers in self.slots:
            for name in [n for n in module._buffers if n not in buffers]:
                del module._buffers[name]
                module._non_persistent_buffers_set.discard(name)
            for name, b in buffers.items():
                if module._buffers.get(name) is not b:
                    module._buffers[name] = b
        # BatchNorm's kernels write its running statistics without bumping their versions:
        # a buffer is compared by value too.
        moved = [(b, v, c) for b, v, c in self.copies.values() if _moved(b, v, c)]
        with torch.no_grad():
            for b, _, copy in moved:
                if b.shape != copy.shape:  # resized in place
                    b.resize_(copy.shape)
                b.copy_(copy)
        if moved and _set_versions is not None:
            _set_versions([b for b, _, _ in moved], [v for _, v, _ in moved])


def _moved(b: torch.Tensor, version: int, copy: torch.Tensor) -> bool:
    return b._version != version or b.shape != copy.shape or not torch.equal(b, copy)


def accelerators(tensors: Iterable[object]) -> tuple[str, ...]:
    """The device types other than the CPU among ``tensors``, in order, once each."""
    found = dict.fromkeys(
        t.device.type for t in tensors if isinstance(t, torch.Tensor) and t.device.type != "cpu"
    )
    found.pop("meta", None)
    return tuple(found)


def modules_reached(function: Callable[..., Any]) -> list[nn.Module]:
    """The modules a function reaches, as the write guard finds them (its closure, defaults,
    the globals its code loads, the ``self`` of a bound method, a partial's arguments): a
    function such as ``lambda x: loss_fn(model(x), y)`` reaches ``model``."""
    walked = Reachable(function, (), {}).walked.values()
    return [m for m in walked if isinstance(m, nn.Module)]


@contextlib.contextmanager
def as_found(models: Sequence[nn.Module], device_types: Iterable[str] = ()) -> Iterator[None]:
    """Put the buffers and generators of ``models``, the CPU generator and those of
    ``device_types`` back on the way out (see NOTE [ Putting a model back ])."""
    explicit = [(g, g.get_state()) for g in generators_in(*models)]
    buffers = _Buffers(models)
    try:
        with restoring_rng(tuple((t, None) for t in device_types)):
            yield
    finally:
        set_generators(explicit)
        buffers.restore()
