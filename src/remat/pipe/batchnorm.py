"""BatchNorm whose running statistics see the whole mini-batch, not each micro-batch.

Micro-batching a model with BatchNorm normalises each micro-batch with its own statistics,
as a smaller batch would; that is the arithmetic of the plain model run micro-batch by
micro-batch. What changes is the running statistics: updated once per micro-batch, they
follow ``chunks`` small batches instead of one large one. :class:`DeferredBatchNorm` (after
torchgpipe's) accumulates sums over the micro-batches of one mini-batch and updates the running
statistics once, when the last micro-batch has passed, from the mini-batch's mean and unbiased
variance. A recompute (``remat.is_recomputing()``) accumulates nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._state import is_recomputing
from ..errors import RematError

__all__ = ["DeferredBatchNorm"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm for ``chunks`` micro-batches per mini-batch; see the module docstring."""

    sum: Tensor
    sum_squares: Tensor
    running_mean: Tensor
    running_var: Tensor
    num_batches_tracked: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        chunks: int = 1,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        # The sums of the mini-batch under way are state of one step, not of the model: they
        # stay out of the state dict, which then has the keys of a plain BatchNorm, so that
        # the state dicts of a Pipe and of the plain model load into each other.
        self.register_buffer("sum", torch.zeros_like(self.running_mean), persistent=False)
        self.register_buffer("sum_squares", torch.zeros_like(self.running_var), persistent=False)
        self.counter = 0
        self.tracked = 0
        self.chunks = chunks

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() <= 2:
            raise RematError(
                f"remat: DeferredBatchNorm takes (N, C, ...) inputs with spatial dimensions, got "
                f"{input.dim()} dimensions {tuple(input.shape)}."
            )

    def _track(self, input: Tensor) -> bool:
        dims = [0, *range(2, input.dim())]
        with torch.no_grad():
            self.sum += input.sum(dims)
            self.sum_squares += (input**2).sum(dims)
        self.counter += input.numel() // input.size(1)
        self.tracked += 1
        return self.tracked == self.chunks

    def _commit(self) -> None:
        """Update the running statistics once, as ``F.batch_norm`` would for the mini-batch.

        The arithmetic after the sums follows ATen's CPU update (``batch_norm_cpu_update_stats``):
        the mean ``sum / n``, the unbiased variance ``var_sum / (n - 1)`` and the mean's momentum
        step in the statistics' dtype, the variance's momentum step in float64. So the
        result equals a plain BatchNorm on the whole mini-batch bit for bit whenever the sums
        do, i.e. whenever adding the micro-batches' sums in another order loses nothing.
        """
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        n = self.counter
        with torch.no_grad():
            momentum = torch.tensor(
                factor, dtype=self.running_mean.dtype, device=self.running_mean.device
            )
            mean = self.sum / n
            var_sum = self.sum_squares - mean * self.sum
            unbiased = (var_sum / max(n - 1, 1)).double()
            self.running_mean.copy_(momentum * mean + (1 - momentum) * self.running_mean)
            keep = ((1 - momentum) * self.running_var).double()
            self.running_var.copy_(momentum.double() * unbiased + keep)
        self._restart()

    def _restart(self) -> None:
        """Forget the micro-batches seen so far in this mini-batch."""
        with torch.no_grad():
            self.sum.zero_()
            self.sum_squares.zero_()
        self.counter = 0
        self.tracked = 0

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # torchgpipe's DeferredBatchNorm (and remat's before the sums left the state dict)
        # saved the sums as buffers: such a state dict loads, its sums dropped (between steps
        # they are zero).
        for name in ("sum", "sum_squares"):
            state_dict.pop(prefix + name, None)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                training=False,
                momentum=0.0,
                eps=self.eps,
            )
        if not is_recomputing() and self._track(input):
            self._commit()
        return F.batch_norm(
            input,
            None,
            None,
            self.weight,
            self.bias,
            training=True,
            momentum=0.0,
            eps=self.eps,
        )

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """``module`` with every ``nn.BatchNorm{1,2,3}d`` replaced, parameters and running
        statistics carried over, and every :class:`DeferredBatchNorm` set to ``chunks``;
        returns ``module`` itself when it has none to replace.

        A :class:`DeferredBatchNorm` is kept (the same module) with its ``chunks`` changed: one
        left at an earlier ``chunks`` would commit its statistics several times per
        mini-batch. Sums of an unfinished mini-batch (a forward that raised) are dropped, as
        :class:`~remat.pipe.Pipe` drops them at the start of each forward.
        """
        if isinstance(module, DeferredBatchNorm):
            module.chunks = chunks
            module._restart()
            return module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            converted = cls(module.num_features, module.eps, module.momentum, module.affine, chunks)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            with torch.no_grad():
                converted.running_mean.copy_(module.running_mean)  # type: ignore[arg-type]
                converted.running_var.copy_(module.running_var)  # type: ignore[arg-type]
                converted.num_batches_tracked.copy_(module.num_batches_tracked)  # type: ignore[arg-type]
            converted.to(module.running_mean.device)  # type: ignore[union-attr]
            converted.train(module.training)
            return converted
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module
