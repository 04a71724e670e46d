"""Parameters and buffers written in place between a slice's forward pass and its backward.

NOTE [ Written between forward and backward ]

Plain autograd raises in backward when a tensor it saved was written in place since ("modified
by an inplace operation"), by the tensor's version counter. A slice's backward reads its
parameters and buffers again, where that check does not reach: with
``checkpoint_activation=True`` the recompute runs the slice on them; with ``False`` the saved
views of parameters are rebuilt from the loaded parameters (``_ParamView`` in
``_autograd.py``), and with ``offload_device="cpu"`` on a CPU compute device the saved buffers
are the modules' own. An optimizer step, a weight clamp or ``bn.running_var.mul_(4)`` between
forward and backward would give the gradients of a mixture, activations of the old values and
backward of the new, with no error. So each slice checks the versions itself:

1. When a slice's forward pass is done (every micro-batch of it) and the slice is back at
   rest, :class:`Versions` notes the version of each of its parameters and of each buffer its
   modules hold. The forward pass's own writes are behind it: BatchNorm in training moves
   ``num_batches_tracked`` (and its running statistics, whose kernels do not bump their
   versions) before the note is taken.
2. Buffers the forward pass wrote (replaced, or version moved while it ran) are left out: the
   model's own later forward passes write them again (the next micro-batch, a second forward
   before one backward, a validation pass in training mode), and a recompute starts from the
   snapshot its forward took of them (NOTE [ State read, then written ] in ``_guard.py``).
3. The slice's backward, before it brings the slice in, compares: a parameter or buffer whose
   version moved raises a ``RematError`` naming every one written, with every offload device
   and either ``checkpoint_activation``, as plain autograd raises. (Some of these backwards
   would read a copy made in forward; the error does not depend on where the copy is.) A
   buffer the module replaced by another tensor is not compared: loading a slice to an
   accelerator and back replaces its buffers, so a write to the new tensor is not seen.
4. The training loop passes: backward comes before ``optimizer.step()`` or ``model.step()``,
   and each forward pass takes its own note. Loading and unloading a slice assigns
   ``param.data``, which keeps the parameter's version counter; so does storing gradients.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import RematError
from ._slices import Slice
from ._stand_ins import internal

__all__: list[str] = []

_Key = tuple[int, str]  # a buffer: id of its owning module, and its key there


def buffer_versions(sl: Slice) -> dict[_Key, tuple[torch.Tensor, int]]:
    """The buffers the slice's modules hold now, with their versions."""
    out = {}
    for _, owner, key in sl.named_buffers():
        b = owner._buffers[key]
        assert b is not None
        out[(id(owner), key)] = (b, b._version)
    return out


def written_since(sl: Slice, before: dict[_Key, tuple[torch.Tensor, int]]) -> set[_Key]:
    """The buffers replaced or written since ``before`` (point 2 of the NOTE)."""
    now = buffer_versions(sl)
    return {
        k
        for k, (b, v) in now.items()
        if k not in before or before[k][0] is not b or before[k][1] != v
    }


class Versions:
    """A slice's parameters and buffers as its forward pass left them at rest: point 1 of
    NOTE [ Written between forward and backward ]. Buffers are held weakly, so that a
    replaced one is not kept alive by the note."""

    def __init__(self, sl: Slice, written: set[_Key]) -> None:
        with internal():  # parked parameters raise on every touch but this one
            self.params = [p._version for p in sl.params]
        self.buffers = [
            (name, owner, key, weakref.ref(b), b._version)
            for name, owner, key in sl.named_buffers()
            if (id(owner), key) not in written and (b := owner._buffers[key]) is not None
        ]

    def check(self, sl: Slice) -> None:
        """Raise, naming every parameter and buffer written in place since the note."""
        found = []
        with internal():
            for name, p, version in zip(sl.names, sl.params, self.params, strict=True):
                if p._version != version:
                    found.append(f"parameter {name!r} (version {version}, now {p._version})")
        for name, owner, key, ref, version in self.buffers:
            b = ref()
            if b is not None and owner._buffers.get(key) is b and b._version != version:
                found.append(f"buffer {name!r} (version {version}, now {b._version})")
        if found:
            raise RematError(
                f"remat: OffloadModel expected the parameters and buffers of slice {sl.index} "
                f"as its forward pass left them, found {len(found)} modified in place before "
                f"backward: {', '.join(found[:5])}. A backward reading them would mix "
                "activations of the old values with the new ones, and the gradients would be "
                "wrong (plain autograd raises here too). Run backward before modifying them "
                "(an optimizer step, a weight clamp or a write to running statistics between "
                "forward and backward), or run the forward pass again after the change."
            )
