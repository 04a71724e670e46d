"""Order autograd without passing data: forks and joins of empty "phony" tensors.

A phony is an empty tensor. ``fork(x)`` returns ``x`` and a phony; ``join(y, phony)`` returns
``y``. Values pass unchanged and gradients pass unchanged, but autograd now sees an edge from
the fork to the join: in backward, everything before the fork waits for the join. The pipeline
uses this to fix the order of micro-batches in backward, and skip connections use it to tie a
portal to the micro-batch it belongs to (``skip/portal.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .microbatch import Batch

__all__: list[str] = []


def phony(device: torch.device, requires_grad: bool = False) -> Tensor:
    """A new empty tensor on ``device``; it holds no memory."""
    return torch.empty(0, device=device, requires_grad=requires_grad)


class Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor) -> tuple[Tensor, Tensor]:
        return input.detach(), phony(input.device)

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor, grad_phony: Tensor) -> Tensor:
        return grad_input


class Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, phony: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor) -> tuple[Tensor, None]:
        return grad_input, None


def fork(input: Tensor) -> tuple[Tensor, Tensor]:
    """``input`` and a phony that later operations can depend on."""
    if torch.is_grad_enabled() and input.requires_grad:
        out, p = Fork.apply(input)  # type: ignore[no-untyped-call]
        return out, p
    return input, phony(input.device)


def join(input: Tensor, phony: Tensor) -> Tensor:
    """``input``, which backward reaches before it reaches ``phony``'s fork."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        out: Tensor = Join.apply(input, phony)  # type: ignore[no-untyped-call]
        return out
    return input


def depend(fork_from: Batch, join_to: Batch) -> None:
    """Make backward finish ``join_to`` (up to here) before it enters ``fork_from`` here."""
    i = fork_from.find_tensor_idx()
    fork_from[i], p = fork(fork_from[i])
    j = join_to.find_tensor_idx()
    join_to[j] = join(join_to[j], p)
