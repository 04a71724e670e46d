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
   generators ] in ``_ambient.py``); and Python's ``random`` and NumPy's global generator,
   which a forward may draw from too (Hugging Face's wav2vec2 and WavLM drop layers and mask
   time steps with ``np.random``). NumPy's is put back only where NumPy is imported already:
   remat does not import it, and a NumPy imported during the pass starts from a fresh seed.
4. Gradients, for the planner, whose steps run backward (``explain`` runs none; see
   :func:`grads_as_found`): each ``.grad`` of the model's parameters, of the tensors its
   ``loss_fn`` reaches (the parameters of a head or a criterion kept outside the model, whose
   buffers and generators are put back as the model's are) and of the example inputs (an
   input with ``requires_grad=True``) is put back as the tensor it was, with its values, or
   ``None`` where it was ``None``. A user's loop that accumulates into ``.grad`` then takes its
   first step as it would have without planning.

A function explained (``lambda x: loss_fn(model(x), y)``) is put back through the modules it
reaches, found as the write guard finds them (NOTE [ When the guard runs ] 1 in ``_guard.py``).
The planner's ``loss_fn`` is put back so too: the modules it reaches as a model's (1 to 3),
and the tensors it reaches (4).
"""

from __future__ import annotations

import contextlib
import random
import sys
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
    return reached(function)[0]


def reached(function: Callable[..., Any]) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """The modules a function reaches (see :func:`modules_reached`) and the tensors: the
    modules' parameters and buffers, and the tensors it holds itself."""
    found = Reachable(function, (), {})
    return [m for m in found.walked.values() if isinstance(m, nn.Module)], found.tensors


@contextlib.contextmanager
def grads_as_found(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Put each ``.grad`` of ``tensors`` back on the way out (see NOTE [ Putting a model back ]
    4): as the tensor it was (a user's reference to it, or a view into a bucket such as DDP's
    ``gradient_as_bucket_view``, stays valid), with its values; ``None`` where it was ``None``.
    A tensor that keeps no ``.grad`` (not a leaf, and not ``retain_grad()``) is left alone."""
    found: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
    for t in tensors:
        if id(t) in found or not (t.is_leaf or t.retains_grad):
            continue
        grad = t.grad
        found[id(t)] = (t, grad, grad.detach().clone() if grad is not None else None)
    try:
        yield
    finally:
        with torch.no_grad():
            for t, grad, values in found.values():
                if grad is not None and values is not None:
                    grad.copy_(values)
                if t.grad is not grad:
                    t.grad = grad


@contextlib.contextmanager
def as_found(models: Sequence[nn.Module], device_types: Iterable[str] = ()) -> Iterator[None]:
    """Put the buffers and generators of ``models``, the CPU generator and those of
    ``device_types`` back on the way out (see NOTE [ Putting a model back ])."""
    explicit = [(g, g.get_state()) for g in generators_in(*models)]
    buffers = _Buffers(models)
    python = random.getstate()
    numpy = _numpy_random()
    numpy_state = numpy.get_state() if numpy is not None else None
    try:
        with restoring_rng(tuple((t, None) for t in device_types)):
            yield
    finally:
        set_generators(explicit)
        buffers.restore()
        random.setstate(python)
        if numpy is not None:
            numpy.set_state(numpy_state)


def _numpy_random() -> Any:
    """``numpy.random`` where NumPy is imported already, else ``None`` (remat does not import
    it)."""
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "random", None) if numpy is not None else None
