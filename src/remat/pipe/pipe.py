"""``remat.pipe.Pipe``: GPipe for an ``nn.Sequential`` in one process.

The facade: it checks its arguments once, splits the module into partitions on their
devices, and for each call splits the input into micro-batches, runs them through the clock
cycles of ``pipeline.py`` and concatenates the outputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

from .. import _state
from ..checkpoint import RegionOptions
from ..errors import RematError, did_you_mean
from .batchnorm import DeferredBatchNorm
from .microbatch import TensorOrTensors, check_input, gather, scatter
from .partition import (
    DeviceLike,
    check_balance,
    check_devices,
    check_flag,
    check_module,
    split_module,
)
from .pipeline import CHECKPOINT_MODES, CheckpointMode, Pipeline, checkpoint_stop
from .skip.layout import inspect_skip_layout
from .skip.skippable import verify_skippables

__all__ = ["Pipe"]


def check_chunks(chunks: object, where: str) -> int:
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise RematError(
            f"remat: {where} chunks must be a positive int (the number of micro-batches), got "
            f"{chunks!r}."
        )
    return chunks


def check_checkpoint(checkpoint: object, where: str) -> CheckpointMode:
    for mode in CHECKPOINT_MODES:
        if checkpoint == mode:
            return mode
    raise RematError(
        f"remat: {where} checkpoint={checkpoint!r} is not a mode"
        f"{did_you_mean(str(checkpoint), CHECKPOINT_MODES)}; expected one of "
        f"{', '.join(map(repr, CHECKPOINT_MODES))}."
    )


class Pipe(nn.Module):
    """Run an ``nn.Sequential`` as a GPipe pipeline of partitions on devices.

    ::

        model = nn.Sequential(...)
        pipe = remat.pipe.Pipe(model, [2, 3], devices=["cuda:0", "cuda:1"], chunks=8)
        loss_fn(pipe(x), y).backward()  # x on any device; the output is on devices[-1]

    The signature is torchgpipe's ``GPipe(module, balance, devices=None, chunks=1,
    checkpoint="except_last", deferred_batch_norm=False)``.

    Args:
        module: the model; layers may be ``@remat.pipe.skippable`` (checked at once by
            :func:`~remat.pipe.verify_skippables`). Its layers are moved, not copied. Each
            layer and each parameter may appear at one position only.
        balance: layers per partition, summing to ``len(module)``.
        devices: one device per partition (a device may repeat; extra ones are ignored);
            ``None``: every partition on the current device (the current CUDA device, or the
            CPU on a machine without an accelerator).
        chunks: micro-batches per call; the input is split along dimension 0 with
            ``torch.tensor_split``, so the batch needs at least ``chunks`` rows.
        checkpoint: which micro-batches run in remat's region engine in training:
            ``"always"``, ``"except_last"`` (the last one's backward follows at once, so
            recomputing it saves little) or ``"never"``. Nothing is checkpointed in eval mode,
            under ``torch.no_grad()`` or inside ``remat.disable_checkpointing()``.
        deferred_batch_norm: replace BatchNorm layers by :class:`DeferredBatchNorm`, which
            updates running statistics once per mini-batch.

    The layers keep their names: ``pipe.state_dict()`` and ``pipe.named_parameters()`` use the
    ``nn.Sequential``'s names (``"0.weight"``, ...), so a plain model's state dict loads into
    the Pipe and back; a torchgpipe state dict (``"partitions.1.3.weight"``) loads too.
    ``pipe.partitions`` lists the partitions (``nn.Sequential``, not registered as
    submodules, so that every parameter has one name).

    Outputs and gradients equal those of the plain module run on the same micro-batches
    (see NOTE [ Pipeline clock cycles ] in ``pipeline.py`` for the order of accumulation).
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int],
        devices: Sequence[DeviceLike] | None = None,
        chunks: int = 1,
        checkpoint: CheckpointMode = "except_last",
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        module = check_module(module, "Pipe")
        self.chunks = check_chunks(chunks, "Pipe")
        self.checkpoint: CheckpointMode = check_checkpoint(checkpoint, "Pipe")
        self.balance = check_balance(module, balance, "Pipe")
        self.devices = check_devices(devices, len(self.balance), "Pipe")
        deferred = check_flag(deferred_batch_norm, "deferred_batch_norm", "Pipe")
        verify_skippables(module)
        if deferred:
            DeferredBatchNorm.convert_deferred_batch_norm(module, self.chunks)
        for name in module._modules:
            if hasattr(self, name) or name in ("partitions", "_pipeline"):
                raise RematError(
                    f"remat: Pipe keeps the layers under their names in the nn.Sequential, but "
                    f"layer {name!r} would hide Pipe.{name}; rename that layer."
                )
        partitions = split_module(module, self.balance, self.devices)
        for partition in partitions:
            for name, layer in partition.named_children():
                self.add_module(name, layer)
        self.partitions = partitions
        self._pipeline = Pipeline(
            partitions, self.devices, inspect_skip_layout(partitions), RegionOptions()
        )
        self.register_load_state_dict_pre_hook(_accept_torchgpipe_names)  # type: ignore[no-untyped-call]

    def __len__(self) -> int:
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        return layers[index]

    def train(self, mode: bool = True) -> Pipe:
        super().train(mode)
        for partition in self.partitions:
            partition.training = mode
        return self

    def extra_repr(self) -> str:
        devices = [str(d) for d in self.devices]
        return (
            f"balance={self.balance}, devices={devices}, chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}"
        )

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        """A dtype (``pipe.to(torch.float64)``) converts every partition where it is, as
        torchgpipe allows; a device would move them all to one, and is refused."""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise self._moved("to")
        super().to(dtype=dtype, non_blocking=non_blocking, memory_format=memory_format)
        return self

    def cuda(self, device: Any = None) -> Pipe:
        raise self._moved("cuda")

    def cpu(self) -> Pipe:
        raise self._moved("cpu")

    def _moved(self, method: str) -> RematError:
        return RematError(
            f"remat: Pipe.{method}() would move every partition to one device, but a Pipe "
            f"places them itself (devices={[str(d) for d in self.devices]}). Build a new Pipe "
            "with the devices you want."
        )

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        input = check_input(input, "Pipe")
        batches = scatter(input, self.chunks, "Pipe")
        # Each call is one mini-batch of `chunks` micro-batches. Sums that a DeferredBatchNorm
        # holds now come from a forward that raised part way: kept, they would move every
        # later commit of the running statistics off the mini-batches' boundaries.
        for layer in self.modules():
            if isinstance(layer, DeferredBatchNorm) and layer.tracked:
                layer._restart()
        checkpointing = self.training and torch.is_grad_enabled() and not _state.state.disabled
        stop = checkpoint_stop(self.checkpoint, self.chunks) if checkpointing else 0
        self._pipeline.run(batches, stop)
        return gather(batches, self._pipeline.where(len(self.partitions) - 1))


def _accept_torchgpipe_names(
    pipe: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Rename torchgpipe's keys (``partitions.J.NAME.rest``, NAME a layer of partition J) to
    the Pipe's own (``NAME.rest``) before loading; other keys are left for the usual checks."""
    partitions = cast(Pipe, pipe).partitions
    head = prefix + "partitions."
    for key in [k for k in state_dict if k.startswith(head)]:
        j, _, rest = key[len(head) :].partition(".")
        name = rest.partition(".")[0]
        if j.isdigit() and int(j) < len(partitions) and name in partitions[int(j)]._modules:
            state_dict[prefix + rest] = state_dict.pop(key)
