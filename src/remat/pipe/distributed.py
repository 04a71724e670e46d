"""The same skippable ``nn.Sequential`` with one stage per process, on
``torch.distributed.pipelining``.

``torch.distributed.pipelining`` sends each stage's outputs to the next stage only, and its
tracer refuses skip connections ("Backward of skip connections not supported yet"). So a skip
from stage ``a`` to stage ``b > a + 1`` rides along: stage ``a`` returns it as an extra
output, every stage in between takes it as an extra input and returns it again, and stage
``b`` pops it. Autograd and the schedule then handle its gradient like any other stage
output's, for every schedule. The price is memory and bandwidth: each stage in between keeps
the skip tensor of every micro-batch in flight, as its input and output, until that
micro-batch's backward. (Sending it straight from ``a`` to ``b`` would need point-to-point
operations of our own in step with the schedule's; see docs/pipe.md.)

NOTE [ Stage inputs and outputs ]

For stage ``j`` (``SkipLayout``): inputs ``(x, *carried_into(j))``, outputs
``(y, *carried_out_of(j))``, skips in the order the model stashes them; the last stage returns
``y`` alone. Inside, the stage runs its layers under a plain skip tracker preloaded with the
carried skips: a pop takes its tensor from there, a stash puts one there, and what is left
for later stages leaves as outputs (a skip passing through leaves as a view of the input).

Checkpointing: each micro-batch's stage forward runs in remat's region engine when the
micro-batch is checkpointed (``"always"``; ``"except_last"``: every one but the last of a
step; ``"never"``). The schedule calls forward in micro-batch order for every schedule, so the
stage counts calls to know which micro-batch it runs.

Metadata: a ``PipelineStage`` without example inputs infers shapes by running every stage
once on a micro-batch and backward once, which would update BatchNorm statistics and draw
random numbers outside the step. :func:`pipeline_stage` gives it the shapes instead, from a run
of meta-device copies of the partitions (no data, no state touched).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .. import _state
from ..checkpoint import RegionOptions, run_region
from ..errors import RematError, did_you_mean
from .batchnorm import DeferredBatchNorm
from .partition import check_balance, check_device, check_module, split_layers
from .pipe import check_checkpoint, check_chunks
from .pipeline import CheckpointMode, checkpoint_stop
from .skip.layout import Key, SkipLayout, inspect_skip_layout
from .skip.skippable import verify_skippables
from .skip.tracker import SkipTracker, use_skip_tracker

__all__ = ["ScheduleKind", "StageModule", "pipeline_schedule", "pipeline_stage", "split_stages"]

ScheduleKind = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[ScheduleKind, ...] = ("gpipe", "1f1b")


class StageModule(nn.Module):
    """One partition as a pipeline stage; see NOTE [ Stage inputs and outputs ]."""

    def __init__(
        self,
        partition: nn.Sequential,
        index: int,
        layout: SkipLayout,
        chunks: int,
        checkpoint: CheckpointMode,
    ) -> None:
        super().__init__()
        self.partition = partition
        self.index = index
        self.inputs: list[Key] = layout.carried_into(index)
        self.outputs: list[Key] = layout.carried_out_of(index)
        self.chunks = chunks
        self.checkpoint: CheckpointMode = checkpoint
        self.calls = 0
        self._options = RegionOptions()

    def forward(self, x: Tensor, *carried: Tensor) -> Tensor | tuple[Tensor, ...]:
        if len(carried) != len(self.inputs):
            raise RematError(
                f"remat: stage {self.index} takes the micro-batch and {len(self.inputs)} skip "
                f"tensors, got {len(carried)} skip tensors."
            )
        microbatch = self.calls % self.chunks
        self.calls += 1
        checkpointed = (
            self.training
            and torch.is_grad_enabled()
            and not _state.state.disabled
            and microbatch < checkpoint_stop(self.checkpoint, self.chunks)
        )
        if checkpointed:
            out: Tensor | tuple[Tensor, ...] = run_region(
                self._run, (x, *carried), {}, self._options
            )
            return out
        return self._run(x, *carried)

    def _run(self, x: Tensor, *carried: Tensor) -> Tensor | tuple[Tensor, ...]:
        tracker = SkipTracker()
        tracker.tensors.update(zip(self.inputs, carried, strict=True))
        with use_skip_tracker(tracker):
            y: Tensor = self.partition(x)
        if not self.outputs:
            return y
        skips: list[Tensor] = []
        for key in self.outputs:
            t = tracker.tensors.pop(key)
            if t is None:
                raise RematError(
                    f"remat: skip {key[1]!r} stashed None leaves stage {self.index}; across "
                    "processes every skip must be a tensor."
                )
            skips.append(t.view_as(t) if key in self.inputs else t)
        return (y, *skips)


def split_stages(
    module: nn.Sequential,
    *,
    balance: Sequence[int],
    chunks: int,
    checkpoint: CheckpointMode = "except_last",
    deferred_batch_norm: bool = False,
) -> list[StageModule]:
    """Every stage of ``module`` (sharing its layers, under their names in ``module``); a
    process keeps the one it runs."""
    where = "pipeline_stage"
    module = check_module(module, where)
    chunks = check_chunks(chunks, where)
    checkpoint = check_checkpoint(checkpoint, where)
    counts = check_balance(module, balance, where)
    verify_skippables(module)
    if deferred_batch_norm:
        DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
    partitions = split_layers(module, counts)
    layout = inspect_skip_layout(partitions)
    return [StageModule(p, j, layout, chunks, checkpoint) for j, p in enumerate(partitions)]


def stage_metas(
    stages: Sequence[StageModule], example: Tensor
) -> list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]]:
    """Meta tensors of every stage's inputs and outputs for one micro-batch like ``example``."""
    inputs: tuple[Tensor, ...] = (
        torch.empty_like(example, device="meta").requires_grad_(example.requires_grad),
    )
    metas: list[tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = []
    for stage in stages:
        shadow = copy.deepcopy(stage).to("meta")
        shadow.checkpoint = "never"
        with torch.enable_grad():
            out = shadow(*inputs)
        outputs = (out,) if isinstance(out, Tensor) else tuple(out)
        outputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in outputs)
        metas.append((inputs, outputs))
        inputs = outputs
    return metas


def pipeline_stage(
    module: nn.Sequential,
    *,
    balance: Sequence[int],
    stage_index: int,
    device: torch.device | str,
    example: Tensor,
    chunks: int,
    checkpoint: CheckpointMode = "except_last",
    deferred_batch_norm: bool = False,
    group: Any = None,
) -> Any:
    """This process's ``torch.distributed.pipelining.PipelineStage`` of ``module``.

    Every process builds the same ``module`` and calls this with its own ``stage_index``;
    ``example`` is one micro-batch of input (its shape and dtype are used, on the meta device),
    so every micro-batch must have that shape: a batch whose rows divide by ``chunks``.
    """
    from torch.distributed.pipelining import PipelineStage

    stages = split_stages(
        module,
        balance=balance,
        chunks=chunks,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
    )
    if not isinstance(stage_index, int) or not 0 <= stage_index < len(stages):
        raise RematError(
            f"remat: pipeline_stage stage_index={stage_index!r}, but balance {list(balance)} "
            f"has stages 0 to {len(stages) - 1}."
        )
    device = check_device(device, "pipeline_stage device")
    inputs, outputs = stage_metas(stages, example)[stage_index]
    stage = stages[stage_index].to(device)
    return PipelineStage(
        stage,
        stage_index,
        len(stages),
        device,
        input_args=inputs,
        output_args=outputs,
        group=group,
    )


def pipeline_schedule(
    stage: Any,
    *,
    schedule: ScheduleKind,
    chunks: int,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    scale_grads: bool = False,
) -> Any:
    """``ScheduleGPipe`` or ``Schedule1F1B`` over ``stage``, ``chunks`` micro-batches.

    ``scale_grads=False`` (unlike torch's default) leaves gradients as the sum over
    micro-batches of each micro-batch loss's gradients, the arithmetic of a plain model run
    micro-batch by micro-batch; ``True`` divides them by ``chunks``.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in kinds:
        raise RematError(
            f"remat: pipeline_schedule schedule={schedule!r} is not one of "
            f"{', '.join(map(repr, SCHEDULES))}{did_you_mean(str(schedule), SCHEDULES)}."
        )
    chunks = check_chunks(chunks, "pipeline_schedule")
    stages = int(stage.num_stages)
    if schedule == "1f1b" and chunks < stages:
        raise RematError(
            f"remat: pipeline_schedule schedule='1f1b' needs at least as many micro-batches as "
            f"stages, got chunks={chunks} for {stages} stages; use chunks >= {stages} or "
            "schedule='gpipe'."
        )
    return kinds[schedule](stage, n_microbatches=chunks, loss_fn=loss_fn, scale_grads=scale_grads)
