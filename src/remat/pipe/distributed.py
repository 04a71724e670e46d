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

Each stage passes one tensor to the next (plus the carried skips): a tuple of activations
between two stages is refused (``RematError``), since the stage cannot tell it from skips.

NOTE [ Micro-batches of a step ]

Checkpointing: each micro-batch's stage forward runs in remat's region engine when the
micro-batch is checkpointed (``"always"``; ``"except_last"``: every one but the last of a
step; ``"never"``). The schedule calls forward in micro-batch order for every schedule, so the
stage counts its calls since the step began to know which micro-batch it runs; a
:class:`~remat.pipe.DeferredBatchNorm` in it likewise counts micro-batches up to ``chunks``.
Both counts start again at every step: the schedule of :func:`pipeline_schedule` calls
:meth:`StageModule.restart` at the start of ``step()`` / ``eval()`` and again after torch's
stage initialisation (whose shape inference, for a ``PipelineStage`` built without shapes,
calls the stage once more); it also drops the micro-batch losses torch keeps from a step that
raised. So a step that raised part way, or an extra call, leaves nothing behind for the next
step.

Shapes: torch receives each micro-batch into buffers shaped once, from the example (or from
torch's shape inference). A micro-batch of another shape would be received into them
silently, short rows left as they were. So every stage checks each micro-batch's shape and
dtype against the ones it was built for (``StageModule.expected``), and the first stage's
schedule checks the whole batch's split before anything is sent: a wrong batch raises there,
on the first stage, and the other stages, waiting for it, receive nothing.

Metadata: a ``PipelineStage`` without example inputs infers shapes by running every stage
once on a micro-batch and backward once, which would update BatchNorm statistics and draw
random numbers outside the step. :func:`pipeline_stage` gives it the shapes instead, from a run
of meta-device copies of the partitions (no data, no state touched).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

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


Meta = tuple[torch.Size, torch.dtype]


def _describe(meta: Meta) -> str:
    shape, dtype = meta
    return f"shape {tuple(shape)} {str(dtype).removeprefix('torch.')}"


class StageModule(nn.Module):
    """One partition as a pipeline stage; see NOTE [ Stage inputs and outputs ] and NOTE
    [ Micro-batches of a step ]."""

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
        self.last = index == layout.num_partitions - 1
        self.inputs: list[Key] = layout.carried_into(index)
        self.outputs: list[Key] = layout.carried_out_of(index)
        self.chunks = chunks
        self.checkpoint: CheckpointMode = checkpoint
        # Forward calls since the step began (restart()); the micro-batch index.
        self.calls = 0
        # Shape and dtype of each input of one micro-batch: the example's (pipeline_stage),
        # or else those of the first micro-batch the stage runs.
        self.expected: list[Meta] | None = None
        self._options = RegionOptions()

    def restart(self) -> None:
        """Start a step: micro-batch 0 comes next, and a :class:`DeferredBatchNorm` forgets
        the micro-batches of a step that raised part way."""
        self.calls = 0
        for layer in self.partition.modules():
            if isinstance(layer, DeferredBatchNorm):
                layer._restart()

    def check_microbatch(self, inputs: Sequence[Tensor], microbatch: int, batch: str = "") -> None:
        """Raise unless ``inputs`` (one micro-batch) match the shapes the stage was built for."""
        found: list[Meta] = [(t.shape, t.dtype) for t in inputs]
        if self.expected is None:
            self.expected = found
            return
        for k, (want, got) in enumerate(zip(self.expected, found, strict=True)):
            if want != got:
                what = "micro-batch" if k == 0 else f"skip {self.inputs[k - 1][1]!r} of micro-batch"
                rows = want[0][0] * self.chunks if len(want[0]) else "the same"
                raise RematError(
                    f"remat: stage {self.index} takes micro-batches of {_describe(want)}, but "
                    f"{what} {microbatch} of this step has {_describe(got)}{batch}. Across "
                    f"processes every micro-batch must have the shape and dtype the stages were "
                    f"built for: give batches of {rows} rows (pad the last batch, or "
                    "DataLoader(drop_last=True)), or build the stages with an example of the "
                    "micro-batches you run (pipeline_stage(example=...))."
                )

    def forward(self, x: Tensor, *carried: Tensor) -> Tensor | tuple[Tensor, ...]:
        if len(carried) != len(self.inputs) or not isinstance(x, Tensor):
            raise RematError(
                f"remat: stage {self.index} takes one tensor (the micro-batch) and "
                f"{len(self.inputs)} skip tensors, got {1 + len(carried)} inputs "
                f"({', '.join(type(a).__name__ for a in (x, *carried))}). Across processes each "
                "stage passes one tensor to the next, plus the skips remat carries."
            )
        microbatch = self.calls % self.chunks
        self.check_microbatch((x, *carried), microbatch)
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
        if self.last:
            return y
        if not isinstance(y, Tensor):
            count = f"a tuple of {len(y)} values" if isinstance(y, tuple) else type(y).__name__
            raise RematError(
                f"remat: the layers of stage {self.index} return {count}, but across processes "
                f"each stage passes one tensor to the next (plus the skips, which remat "
                "carries). Choose balance so that the layers passing it sit in one stage, "
                "return one tensor (torch.cat, torch.stack), or pass the others as skips "
                "(stash / pop)."
            )
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
    process keeps the one it runs.

    :func:`pipeline_stage` wraps one in a ``PipelineStage`` with its shapes. Wrapping it in
    torch's ``PipelineStage(stage, index, n, device)`` without shapes works too, but torch
    then infers them by running the stage on the first micro-batch of the first step, a real
    forward and backward: a plain BatchNorm updates its running statistics once more and
    random numbers are drawn. The stage counts micro-batches per step (NOTE [ Micro-batches
    of a step ]): drive it with :func:`pipeline_schedule`, which restarts the count at every
    step and after that inference, or call ``stage.restart()`` before every ``step()`` of a
    schedule of your own; otherwise the extra call (or a step that raised) shifts which
    micro-batch ``"except_last"`` leaves out and where a DeferredBatchNorm commits.
    """
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
        for layer in shadow.modules():
            # momentum=None averages with 1 / num_batches_tracked, a value a meta tensor
            # does not have; the copy's statistics are thrown away anyway.
            if isinstance(layer, _BatchNorm) and layer.momentum is None:
                layer.momentum = 0.0
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
    so every micro-batch must have that shape and dtype: a batch of ``chunks`` times the
    example's rows. Another batch (a DataLoader's short last batch) raises a ``RematError`` on
    the first stage before anything is sent. Drive the stage with :func:`pipeline_schedule`.
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
    if not isinstance(example, Tensor):
        raise RematError(
            f"remat: pipeline_stage example must be one micro-batch as a tensor, got "
            f"{type(example).__name__}; across processes each stage takes one tensor."
        )
    inputs, outputs = stage_metas(stages, example)[stage_index]
    stage = stages[stage_index].to(device)
    stage.expected = [(t.shape, t.dtype) for t in inputs]
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

    ``chunks`` must be the stage's (``pipeline_stage(chunks=...)``). The schedule (a subclass
    of torch's) restarts the stage's micro-batch count at every ``step()`` / ``eval()`` and,
    on the first stage, checks that the batch splits into micro-batches of the stage's shape
    before anything is sent (NOTE [ Micro-batches of a step ]).

    ``scale_grads=False`` (unlike torch's default) leaves gradients as the sum over
    micro-batches of each micro-batch loss's gradients, the arithmetic of a plain model run
    micro-batch by micro-batch; ``True`` divides them by ``chunks``.
    """
    if schedule not in SCHEDULES:
        raise RematError(
            f"remat: pipeline_schedule schedule={schedule!r} is not one of "
            f"{', '.join(map(repr, SCHEDULES))}{did_you_mean(str(schedule), SCHEDULES)}."
        )
    chunks = check_chunks(chunks, "pipeline_schedule")
    module = getattr(stage, "submod", None)
    if isinstance(module, StageModule) and module.chunks != chunks:
        raise RematError(
            f"remat: pipeline_schedule chunks={chunks}, but stage {module.index} was built "
            f"for chunks={module.chunks} (it counts micro-batches per step, and a "
            f"DeferredBatchNorm commits once per {module.chunks} micro-batches); pass "
            f"chunks={module.chunks}, or build the stage with chunks={chunks}."
        )
    stages = int(stage.num_stages)
    if schedule == "1f1b" and chunks < stages:
        raise RematError(
            f"remat: pipeline_schedule schedule='1f1b' needs at least as many micro-batches as "
            f"stages, got chunks={chunks} for {stages} stages; use chunks >= {stages} or "
            "schedule='gpipe'."
        )
    kind = _schedule_class(schedule)
    return kind(stage, n_microbatches=chunks, loss_fn=loss_fn, scale_grads=scale_grads)


class _RestartEachStep:
    """Mixed into torch's single-stage schedules: NOTE [ Micro-batches of a step ]."""

    _stage: Any
    _n_microbatches: int

    def step(self, *args: Any, **kwargs: Any) -> Any:
        module = self._stage.submod
        if isinstance(module, StageModule):
            if self._stage.is_first:
                _check_batch(module, args, self._n_microbatches)
            module.restart()
        # torch keeps the losses of a step that raised, and the next step then fails
        # ("Expecting 4 losses but got 6").
        losses = getattr(self, "_internal_losses", None)
        if isinstance(losses, list):
            losses.clear()
        return super().step(*args, **kwargs)  # type: ignore[misc]

    def _initialize_stage(self, *args: Any, **kwargs: Any) -> None:
        super()._initialize_stage(*args, **kwargs)  # type: ignore[misc]
        # torch's shape inference (a stage built without shapes) ran the stage once here.
        if isinstance(self._stage.submod, StageModule):
            self._stage.submod.restart()


@functools.cache
def _schedule_class(schedule: ScheduleKind) -> type[Any]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    base = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return type(base.__name__, (_RestartEachStep, base), {"__module__": __name__})


def _check_batch(module: StageModule, args: tuple[Any, ...], chunks: int) -> None:
    """The first stage's check of a whole batch, before the schedule sends anything."""
    if len(args) != 1 or not isinstance(args[0], Tensor):
        raise RematError(
            f"remat: the first stage's step() takes the batch as one tensor, got {len(args)} "
            f"positional arguments ({', '.join(type(a).__name__ for a in args)}); call "
            "schedule.step(x) (or eval(x)) with the whole batch x as one tensor."
        )
    batch = args[0]
    rows = batch.size(0) if batch.dim() else 0
    for i, microbatch in enumerate(torch.tensor_split(batch, chunks) if rows else [batch]):
        module.check_microbatch(
            (microbatch,), i, f": a batch of {rows} rows in {chunks} micro-batches"
        )
