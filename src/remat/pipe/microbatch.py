"""Micro-batches: the input split along its first dimension, and the outputs joined back.

GPipe (Huang et al., 2019, arXiv:1811.06965) feeds a pipeline with micro-batches so that
partitions on different devices work at the same time. A micro-batch is one tensor or a tuple
of tensors; :class:`Batch` wraps either so that the pipeline and the skip tracker can replace
the tensor that carries the autograd dependencies (see ``dependency.py``) without caring which.

Splitting uses ``torch.tensor_split``, as ``torch.distributed.pipelining`` does: ``chunks``
micro-batches always, of sizes that differ by at most one row. A bit-exact reference for a
:class:`~remat.pipe.Pipe` run splits its input the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeAlias

import torch
from torch import Tensor

from ..errors import RematError

__all__: list[str] = []

TensorOrTensors: TypeAlias = Tensor | tuple[Tensor, ...]


class Batch:
    """One micro-batch: a tensor (atomic) or a tuple of tensors, replaceable in place."""

    __slots__ = ("_values", "atomic")

    def __init__(self, value: TensorOrTensors) -> None:
        self.atomic = isinstance(value, Tensor)
        self._values: list[Tensor] = [value] if isinstance(value, Tensor) else list(value)

    @property
    def value(self) -> TensorOrTensors:
        """The tensor, or the tuple of tensors, as the next layer takes it."""
        return self._values[0] if self.atomic else tuple(self._values)

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._values)

    def __getitem__(self, index: int) -> Tensor:
        return self._values[index]

    def __setitem__(self, index: int, value: Tensor) -> None:
        self._values[index] = value

    def find_tensor_idx(self) -> int:
        """The tensor that carries phony dependencies: the first floating-point one, else 0.

        A phony joined to an integer tensor would still order backward, but only a tensor that
        can require grad takes part in backward at all.
        """
        for i, t in enumerate(self._values):
            if t.is_floating_point():
                return i
        return 0

    def call(self, function: Callable[..., TensorOrTensors]) -> Batch:
        """``Batch(function(value))``, unpacking a tuple into arguments."""
        return Batch(function(self.value) if self.atomic else function(*self._values))


def check_input(input: object, where: str) -> TensorOrTensors:
    """The input itself, or a :class:`RematError` that says what a pipeline accepts."""
    if isinstance(input, Tensor):
        return input
    if isinstance(input, tuple) and input and all(isinstance(t, Tensor) for t in input):
        return input
    found = type(input).__name__
    if isinstance(input, tuple):
        found = f"tuple of ({', '.join(type(t).__name__ for t in input)})"
    raise RematError(
        f"remat: {where} takes a tensor or a non-empty tuple of tensors, got {found}. Pass "
        "other values through the layers' own attributes."
    )


def check_output(output: object, where: str) -> TensorOrTensors:
    """A task's output as a micro-batch for the next partition (a list becomes a tuple, as it
    always did), or a :class:`RematError` naming ``where`` and what may pass."""
    values = list(output) if isinstance(output, (tuple, list)) else None
    if isinstance(output, Tensor):
        return output
    if values and all(isinstance(t, Tensor) for t in values):
        return tuple(values)
    found = type(output).__name__
    if values is not None:
        found = f"{found} of ({', '.join(type(t).__name__ for t in values)})"
    raise RematError(
        f"remat: {where} returned {found}, but a Pipe passes between partitions, and returns, "
        "only a tensor or a non-empty tuple of tensors (no None, dict or other values). Return "
        "the tensors as a tuple, choose balance so that the layers that pass other values sit "
        "in one partition, or pass such values as skips or attributes of the layers."
    )


def scatter(input: TensorOrTensors, chunks: int, where: str = "Pipe") -> list[Batch]:
    """``chunks`` micro-batches of ``input`` along dimension 0 (``torch.tensor_split``)."""
    tensors = (input,) if isinstance(input, Tensor) else input
    scalars = [k for k, t in enumerate(tensors) if t.dim() == 0]
    if scalars:
        which = "the input" if isinstance(input, Tensor) else f"input tensor {scalars[0]}"
        raise RematError(
            f"remat: {where} splits its input into micro-batches along dimension 0, but "
            f"{which} is a 0-dim tensor (a scalar), which has no dimension 0. Give it a batch "
            "dimension (x.unsqueeze(0) for one row, or x.expand(batch_size) to repeat it per "
            "row), or pass it to the layers through an attribute."
        )
    rows = {t.shape[0] for t in tensors}
    if len(rows) != 1:
        raise RematError(
            f"remat: {where} splits every input tensor along dimension 0, but they have "
            f"different sizes there: {sorted(rows)}. Give them the same batch size."
        )
    (batch_size,) = rows
    if batch_size == 0:
        raise RematError(
            f"remat: {where} got an empty batch (0 rows along dimension 0); it splits the batch "
            f"into chunks={chunks} micro-batches of at least one row each, so it needs at least "
            f"{chunks} row{'s' if chunks > 1 else ''}. Skip empty batches before calling it."
        )
    if chunks > batch_size:
        raise RematError(
            f"remat: {where} has chunks={chunks} but the batch has {batch_size} rows; each "
            f"micro-batch needs at least one row. Use chunks <= {batch_size} or a larger batch."
        )
    pieces = [torch.tensor_split(t, chunks) for t in tensors]
    if isinstance(input, Tensor):
        return [Batch(p) for p in pieces[0]]
    return [Batch(tuple(p[i] for p in pieces)) for i in range(chunks)]


def gather(outputs: list[Batch], where: str = "the last layer") -> TensorOrTensors:
    """The micro-batch outputs joined along dimension 0."""
    shapes = {(b.atomic, len(b)) for b in outputs}
    if len(shapes) != 1:
        raise RematError(
            f"remat: {where} returned a different number of tensors for different "
            f"micro-batches ({sorted(len(b) for b in outputs)}); a Pipe joins the micro-batch "
            "outputs tensor by tensor, so every micro-batch must return the same structure."
        )
    for k, t in enumerate(outputs[0]):
        if t.dim() == 0:
            which = "its output" if outputs[0].atomic else f"output {k} of its tuple"
            raise RematError(
                f"remat: {where} returned a 0-dim tensor as {which}; a Pipe joins the "
                "micro-batch outputs along dimension 0, which a scalar does not have. Return "
                "it with a batch dimension (x.unsqueeze(0): one value per micro-batch), or "
                "compute it from the Pipe's output instead."
            )
    if outputs[0].atomic:
        return torch.cat([b[0] for b in outputs])
    width = len(outputs[0])
    return tuple(torch.cat([b[k] for b in outputs]) for k in range(width))
