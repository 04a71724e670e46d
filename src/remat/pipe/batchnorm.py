"""BatchNorm whose running statistics see the whole mini-batch, not each micro-batch.

Micro-batching a model with BatchNorm normalises each micro-batch with its own statistics,
as a smaller batch would; that is the arithmetic of the plain model run micro-batch by
micro-batch. What changes is the running statistics: updated once per micro-batch, they
follow ``chunks`` small batches instead of one large one. :class:`DeferredBatchNorm` (after
torchgpipe's) accumulates sums over the micro-batches of one mini-batch and updates the running
statistics once, when the last micro-batch has passed, from the mini-batch's mean and unbiased
variance. A recompute (``remat.is_recomputing()``) accumulates nothing.

NOTE [ Deferred statistics ]

Per micro-batch ``i`` (``n_i`` values per channel) the layer keeps, per channel, the float64
sum ``S_i``, the mean ``m_i = S_i / n_i`` rounded to the input's dtype, and ``M2_i``, the
float64 sum of ``(x - m_i)**2`` with each square taken in the input's dtype: the arithmetic of
ATen's CPU kernel (``batch_norm_cpu_collect_stats_contiguous_impl``). At the commit the mean
is ``c = (sum S_i) / n`` rounded as ATen rounds it, and the sum of squared deviations about
``c`` combines the micro-batches exactly in float64 (the parallel variance of Chan et al.,
"Updating formulae and a pairwise algorithm for computing sample variances", 1979):

    sum_i  M2_i + 2 (m_i - c) (S_i - n_i m_i) + n_i (m_i - c)**2

With one micro-batch the layer does not defer: it hands the running statistics to
``F.batch_norm``, which updates them as a plain BatchNorm does, on any layout and device (the
sums above would match the contiguous CPU kernel here, ``m_0 == c``, but the kernels for
channels-last inputs, for ``(N, C)`` features and on CUDA sum in float32). With several, for
contiguous CPU inputs, the mean still is the kernel's (float64 sums of float32 data are exact
but for extreme ranges), while the variance rounds each square about ``m_i`` instead of about
``c``: a few units in the last place. ``sum_squares - mean * sum`` (torchgpipe's
formula) loses far more to cancellation when the mean is large against the deviation.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._state import is_recomputing
from ..errors import RematError

__all__ = ["DeferredBatchNorm"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm for ``chunks`` micro-batches per mini-batch; see the module docstring."""

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
        # The statistics of the mini-batch under way are state of one step, not of the model:
        # they stay out of the state dict, which then has the keys of a plain BatchNorm, so
        # that the state dicts of a Pipe and of the plain model load into each other. One
        # entry per micro-batch: (n_i, S_i, m_i, M2_i), NOTE [ Deferred statistics ].
        self.parts: list[tuple[int, Tensor, Tensor, Tensor]] = []
        self.chunks = chunks

    @property
    def tracked(self) -> int:
        """Micro-batches of the mini-batch under way seen so far."""
        return len(self.parts)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise RematError(
                f"remat: DeferredBatchNorm takes (N, C, ...) inputs, as BatchNorm does, got "
                f"{input.dim()} dimension(s) {tuple(input.shape)}; give the batch dimension "
                "first and the channels second."
            )

    def _track(self, input: Tensor) -> bool:
        """Keep one micro-batch's statistics; true when it completes the mini-batch."""
        dims = [0, *range(2, input.dim())]
        n = input.numel() // input.size(1)
        with torch.no_grad():
            x = input if input.dtype in (torch.float32, torch.float64) else input.float()
            total = x.sum(dims, dtype=torch.float64)
            mean = (total / n).to(x.dtype)
            deviation = x - mean.view(1, -1, *[1] * (x.dim() - 2))
            squares = (deviation * deviation).sum(dims, dtype=torch.float64)
        self.parts.append((n, total, mean, squares))
        return self.tracked == self.chunks

    def _commit(self) -> None:
        """Update the running statistics once, as ``F.batch_norm`` would for the mini-batch.

        The mean and the sum of squared deviations: NOTE [ Deferred statistics ]. After them
        the arithmetic follows ATen's CPU update (``batch_norm_cpu_update_stats_template``):
        the mean's momentum step in the statistics' dtype; the unbiased variance
        ``var_sum / (n - 1)`` in the statistics' dtype and its momentum step in float64.
        """
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        n = sum(part[0] for part in self.parts)
        with torch.no_grad():
            dtype = self.running_mean.dtype
            momentum = torch.tensor(factor, dtype=dtype, device=self.running_mean.device)
            total = torch.stack([part[1] for part in self.parts]).sum(0)
            mean = (total / n).to(dtype)
            c = mean.double()
            var_sum = torch.zeros_like(total)
            for n_i, total_i, mean_i, squares_i in self.parts:
                shift = mean_i.double() - c
                var_sum += squares_i + 2 * shift * (total_i - n_i * mean_i.double())
                var_sum += n_i * shift * shift
            unbiased = (var_sum.to(self.running_var.dtype) / max(n - 1, 1)).double()
            self.running_mean.copy_(momentum * mean + (1 - momentum) * self.running_mean)
            keep = ((1 - momentum) * self.running_var).double()
            self.running_var.copy_(momentum.double() * unbiased + keep)
        self._restart()

    def _restart(self) -> None:
        """Forget the micro-batches seen so far in this mini-batch."""
        self.parts = []

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
        # saved sums "sum" and "sum_squares" as buffers: such a state dict loads, its sums
        # dropped (between steps they are zero).
        for name in ("sum", "sum_squares"):
            state_dict.pop(prefix + name, None)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        running = (self.running_mean, self.running_var)
        if not self.training:
            return F.batch_norm(input, *running, self.weight, self.bias, False, 0.0, self.eps)
        # Each micro-batch is normalised by its own statistics, as the plain model's would be.
        stats: tuple[Tensor | None, Tensor | None] = (None, None)
        momentum = 0.0
        # A meta-device run (pipeline_stage's shapes) has no values to track.
        if input.is_meta:
            pass
        elif self.chunks == 1:
            # One micro-batch is the whole mini-batch: ATen updates the statistics, as a plain
            # BatchNorm does, bit for bit on every layout and device (NOTE [ Deferred
            # statistics ] reproduces one CPU kernel only). A recompute makes the same call, so
            # that ATen saves the same tensors for backward as in forward; remat's region engine
            # puts back what the recompute writes (NOTE [ Writes undone ] in remat/_guard.py).
            self.num_batches_tracked += 1
            tracked = float(self.num_batches_tracked)
            momentum = 1.0 / tracked if self.momentum is None else self.momentum
            stats = running
        elif not is_recomputing() and self._track(input):
            # The sums live in a Python list, out of the engine's reach: a recompute adds none.
            self._commit()
        return F.batch_norm(input, *stats, self.weight, self.bias, True, momentum, self.eps)

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
            # The statistics keep their device and dtype (float64, half): converted first,
            # then filled, so that no value is rounded on the way.
            stats = cast(Tensor, module.running_mean)
            converted.to(device=stats.device, dtype=stats.dtype)
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias
            with torch.no_grad():
                converted.running_mean.copy_(stats)
                converted.running_var.copy_(cast(Tensor, module.running_var))
                converted.num_batches_tracked.copy_(cast(Tensor, module.num_batches_tracked))
            converted.train(module.training)
            return converted
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module
