"""The skippable U-Net with one stage per process on torch.distributed.pipelining (gloo).

Each test launches its processes itself (spawn, a free local port) and runs the whole grid
inside one launch: checkpoint modes x 1/4/8 micro-batches x GPipe/1F1B (1F1B needs at least
as many micro-batches as stages). Skips cross non-adjacent stages: with 4 stages, balance
[2, 1, 1, 2], both levels' skips leave stage 0 and ride through stages 1 (and 2).

Reference, on every rank: the plain nn.Sequential (same seed) run micro-batch by
micro-batch, ``tensor_split`` of the batch, each micro-batch's cross-entropy backward in order
0..m-1, as both schedules do (``scale_grads=False``). Compared with torch.equal: each stage's
parameter gradients and BatchNorm buffers, and on the last stage the merged output and every
micro-batch loss. The model is the unet workload's small shape with dropout off (each process
draws its own random numbers). Each launch also runs a small model whose skip is in the default
namespace (no ``isolate``), from stage 0 to the last stage.
"""

from __future__ import annotations

import copy
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from remat.bench.pipeline import _free_port
from remat.pipe import pop, skippable, stash

BALANCES = {2: [3, 3], 4: [2, 1, 1, 2]}


def _grid(world: int) -> list[tuple[str, str, int, str]]:
    unet = [
        ("unet", mode, chunks, schedule)
        for mode in ("never", "except_last", "always")
        for chunks in (1, 4, 8)
        for schedule in ("gpipe", "1f1b")
        if schedule == "gpipe" or chunks >= world
    ]
    return [*unet, ("default-ns", "always", 4, "gpipe"), ("default-ns", "except_last", 4, "1f1b")]


@skippable(stash=["skip"])
class StashInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        yield stash("skip", x)
        return self.linear(x)


@skippable(pop=["skip"])
class AddSkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        skip = yield pop("skip")
        return self.linear(x) + skip


def default_namespace_model() -> nn.Sequential:
    """Six layers; the skip ``"skip"`` (default namespace) goes from layer 0 to layer 4."""
    return nn.Sequential(
        StashInput(),
        nn.Linear(8, 8),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        nn.Linear(8, 8),
        AddSkip(),
        nn.Linear(8, 4),
    )


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from remat.pipe._unet import sequential_unet
    from remat.pipe.distributed import pipeline_schedule, pipeline_stage
    from remat.workloads import UNet, UNetConfig

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        balance = BALANCES[world]
        torch.manual_seed(0)
        config = UNetConfig(
            in_channels=3, base_channels=8, depth=2, image_size=16, num_classes=4, dropout=0.0
        )
        bases = {"unet": sequential_unet(UNet(config)), "default-ns": default_namespace_model()}
        g = torch.Generator().manual_seed(1)
        inputs = {
            "unet": (
                torch.randn(8, 3, 16, 16, generator=g),
                torch.randint(0, 4, (8, 16, 16), generator=g),
            ),
            "default-ns": (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)),
        }
        results: list[dict[str, Any]] = []
        for name, mode, chunks, kind in _grid(world):
            model, ref = copy.deepcopy(bases[name]), copy.deepcopy(bases[name])
            x, target = inputs[name]
            stage = pipeline_stage(
                model,
                balance=balance,
                stage_index=rank,
                device="cpu",
                example=torch.tensor_split(x, chunks)[0],
                chunks=chunks,
                checkpoint=mode,  # type: ignore[arg-type]
            )
            schedule = pipeline_schedule(
                stage,
                schedule=kind,
                chunks=chunks,
                loss_fn=F.cross_entropy,  # type: ignore[arg-type]
            )
            losses: list[torch.Tensor] = []
            out = None
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                out = schedule.step(target=target, losses=losses)
            else:
                schedule.step()
            ref_outs, ref_losses = [], []
            for xc, tc in zip(
                torch.tensor_split(x, chunks), torch.tensor_split(target, chunks), strict=True
            ):
                o = ref(xc)
                loss = F.cross_entropy(o, tc)
                loss.backward()
                ref_outs.append(o.detach())
                ref_losses.append(loss.detach())
            start = sum(balance[:rank])
            layers = list(ref)[start : start + balance[rank]]
            ref_params = [p for layer in layers for p in layer.parameters()]
            params = list(stage.submod.parameters())
            ref_buffers = [b for layer in layers for b in layer.buffers()]
            buffers = list(stage.submod.buffers())
            result = {
                "config": (name, mode, chunks, kind),
                "params": len(params),
                "grads_equal": len(params) == len(ref_params)
                and all(
                    torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
                    for p, q in zip(params, ref_params, strict=True)
                ),
                "buffers_equal": len(buffers) == len(ref_buffers)
                and all(torch.equal(a, b) for a, b in zip(buffers, ref_buffers, strict=True)),
            }
            if rank == world - 1:
                result["outputs_equal"] = torch.equal(out, torch.cat(ref_outs))  # type: ignore[arg-type]
                result["losses_equal"] = len(losses) == chunks and all(
                    torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)
                )
            results.append(result)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _launch(world: int, out_dir: Path, limit_s: float = 240.0) -> list[list[dict[str, Any]]]:
    context = mp.start_processes(
        _worker,
        args=(world, _free_port(), str(out_dir)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} pipeline processes did not finish in {limit_s:.0f} s")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_unet_stages_in_processes_equal_plain_sequential_bit_for_bit(
    world: int, tmp_path: Path
) -> None:
    ranks = _launch(world, tmp_path)
    grid = _grid(world)
    assert len(grid) == 17
    for rank, results in enumerate(ranks):
        assert [r["config"] for r in results] == grid
        for r in results:
            assert r["params"] > 0, (rank, r["config"])
            assert r["grads_equal"], (rank, r["config"])
            assert r["buffers_equal"], (rank, r["config"])
            if rank == world - 1:
                assert r["outputs_equal"], r["config"]
                assert r["losses_equal"], r["config"]


def test_stage_errors_name_the_values() -> None:
    import remat
    from remat.pipe._unet import sequential_unet
    from remat.pipe.distributed import split_stages
    from remat.workloads import UNet, UNetConfig

    model = sequential_unet(UNet(UNetConfig(3, 8, 2, 16, 4, 0.0)))
    with pytest.raises(remat.RematError, match=r"balance \[3, 2\] sums to 5.*6 layers"):
        split_stages(model, balance=[3, 2], chunks=2)
    stages = split_stages(model, balance=[2, 1, 1, 2], chunks=2)
    assert [len(s.inputs) for s in stages] == [0, 2, 2, 1]
    assert [len(s.outputs) for s in stages] == [2, 2, 1, 0]


def test_stage_modules_in_one_process_equal_plain_sequential() -> None:
    """The stage modules chained by hand (skips as extra inputs and outputs), checkpointing
    every micro-batch, against the plain model: outputs and parameter gradients, torch.equal."""
    from remat.pipe._unet import sequential_unet
    from remat.pipe.distributed import split_stages
    from remat.workloads import UNet, UNetConfig

    torch.manual_seed(0)
    base = sequential_unet(UNet(UNetConfig(3, 8, 2, 16, 4, 0.0)))
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    stages = split_stages(model, balance=[2, 1, 1, 2], chunks=1, checkpoint="always")
    x = torch.randn(2, 3, 16, 16)
    h: Any = (x,)
    for stage in stages:
        h = stage(*h)
        h = (h,) if isinstance(h, torch.Tensor) else h
    out = h[0]
    expected = ref(x)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(out, expected)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def test_default_namespace_skip_survives_copies_of_stages() -> None:
    """pipeline_stage infers shapes on deep copies of the stages; a skip in the default
    namespace must still pair its stash and pop there (it raised a bare KeyError), and the
    default namespace stays one object through copy and pickle."""
    import pickle

    from remat.pipe.distributed import split_stages, stage_metas
    from remat.pipe.skip.namespace import DEFAULT

    assert copy.deepcopy(DEFAULT) is DEFAULT
    assert pickle.loads(pickle.dumps(DEFAULT)) is DEFAULT
    stages = split_stages(default_namespace_model(), balance=[2, 1, 1, 2], chunks=2)
    metas = stage_metas(stages, torch.randn(4, 8))
    assert [len(inputs) for inputs, _ in metas] == [1, 2, 2, 2]
    assert [tuple(out.shape) for out in metas[-1][1]] == [(4, 4)]


# --- One stage in this process (world 1): the step boundaries and the checks of pipeline_schedule


@pytest.fixture
def one_process_group() -> Any:
    """A gloo process group of this process alone, destroyed afterwards (one stage is both
    the first and the last: no point-to-point traffic, so nothing can hang)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class FailAt(nn.Module):
    """Passes its input through, but its call number ``at`` (from 0) raises, once."""

    def __init__(self) -> None:
        super().__init__()
        self.at = -1
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.at:
            raise ValueError("failed on purpose")
        return x


class Flags(nn.Module):
    """Records remat.is_checkpointing() for every forward that is not a recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import remat

        if not remat.is_recomputing():
            self.flags.append(remat.is_checkpointing())
        return x


def integer_batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Small integers: every sum is exact, and so is each micro-batch's mean when its values
    per channel are a power of two (rows / chunks * 16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, 3, 4, 4), generator=g).float()
    return x, torch.randint(0, 4, (rows, 4, 4), generator=g)


def test_step_after_a_step_that_raised_starts_a_new_minibatch(one_process_group: Any) -> None:
    """A step that raises in micro-batch 2 leaves DeferredBatchNorm sums of micro-batches 0-2
    and the stage's call count at 3. The next steps must start afresh: running statistics
    equal nn.BatchNorm2d on each whole mini-batch (torch.equal), "except_last" checkpoints
    micro-batches 0-2 of each step, gradients equal the plain model's micro-batch by
    micro-batch. (They did not: the leftovers moved every commit off the step's boundary.)"""
    import torch.nn.functional as F

    from remat.pipe.distributed import pipeline_schedule, pipeline_stage

    torch.manual_seed(0)
    fail, flags = FailAt(), Flags()
    model = nn.Sequential(nn.BatchNorm2d(3), fail, flags, nn.Conv2d(3, 4, 1))
    ref = copy.deepcopy(model)
    bn = copy.deepcopy(model[0])
    chunks = 4
    x, y = integer_batch(8, seed=0)
    stage = pipeline_stage(
        model,
        balance=[4],
        stage_index=0,
        device="cpu",
        example=x.tensor_split(chunks)[0],
        chunks=chunks,
        deferred_batch_norm=True,
    )
    schedule = pipeline_schedule(stage, schedule="gpipe", chunks=chunks, loss_fn=F.cross_entropy)
    fail.at = 2
    with pytest.raises(RuntimeError, match=r"failed to run forward"):
        schedule.step(x, target=y, losses=[])
    assert model[0].tracked == 3 and stage.submod.calls == 3  # micro-batches 0-2 passed BN
    for p in model.parameters():
        p.grad = None
    flags.flags.clear()
    for step in range(2):
        x, y = integer_batch(8, seed=1 + step)
        schedule.step(x, target=y, losses=[])
        F.batch_norm(x, bn.running_mean, bn.running_var, training=True, momentum=0.1)
        for xc, yc in zip(x.tensor_split(chunks), y.tensor_split(chunks), strict=True):
            F.cross_entropy(ref(xc), yc).backward()
    assert flags.flags == [True, True, True, False] * 2
    assert int(model[0].num_batches_tracked) == 2
    assert torch.equal(model[0].running_mean, bn.running_mean)
    assert torch.equal(model[0].running_var, bn.running_var)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def test_schedule_chunks_must_be_the_stage_chunks(one_process_group: Any) -> None:
    import remat
    from remat.pipe.distributed import pipeline_schedule, pipeline_stage

    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    stage = pipeline_stage(
        model,
        balance=[2],
        stage_index=0,
        device="cpu",
        example=torch.randn(2, 3, 4, 4),
        chunks=2,
        deferred_batch_norm=True,
    )
    with pytest.raises(
        remat.RematError, match=r"chunks=4, but stage 0 was built for chunks=2.*pass chunks=2"
    ):
        pipeline_schedule(stage, schedule="gpipe", chunks=4)


def test_torch_pipeline_stage_without_shapes_counts_micro_batches_per_step(
    one_process_group: Any,
) -> None:
    """split_stages and torch's own PipelineStage without shapes: torch's shape inference
    calls the stage once more in the first step. pipeline_schedule's schedule restarts the
    count after it: 4 calls per step, "except_last" flags per step, and DeferredBatchNorm
    statistics equal nn.BatchNorm2d on each whole mini-batch (torch.equal); the count was 5,
    then 9, and the statistics straddled the steps."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage

    from remat.pipe.distributed import pipeline_schedule, split_stages

    torch.manual_seed(0)
    flags = Flags()
    model = nn.Sequential(nn.BatchNorm2d(3), flags, nn.Conv2d(3, 4, 1))
    bn = copy.deepcopy(model[0])
    (module,) = split_stages(model, balance=[3], chunks=4, deferred_batch_norm=True)
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    schedule = pipeline_schedule(stage, schedule="gpipe", chunks=4, loss_fn=F.cross_entropy)
    for step in range(2):
        x, y = integer_batch(8, seed=step)
        flags.flags.clear()
        schedule.step(x, target=y, losses=[])
        F.batch_norm(x, bn.running_mean, bn.running_var, training=True, momentum=0.1)
        assert module.calls == 4, step
        inference = [True] if step == 0 else []  # torch's shape inference: one more call
        assert flags.flags == [*inference, True, True, True, False], step
        assert torch.equal(model[0].running_mean, bn.running_mean), step
        assert torch.equal(model[0].running_var, bn.running_var), step
    assert int(model[0].num_batches_tracked) == 2


def test_meta_shape_run_with_cumulative_batch_norm(one_process_group: Any) -> None:
    """BatchNorm(momentum=None) averages with 1 / num_batches_tracked; pipeline_stage's shape
    run on meta copies raised "Tensor.item() cannot be called on meta tensors" (deferred, one
    micro-batch; and plain BatchNorm alike). The model's own statistics stay untouched."""
    from remat.pipe.distributed import pipeline_stage

    for deferred in (True, False):
        model = nn.Sequential(
            nn.BatchNorm2d(3, momentum=None), nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)
        )
        before = copy.deepcopy(model.state_dict())
        stage = pipeline_stage(
            model,
            balance=[2, 1],
            stage_index=0,
            device="cpu",
            example=torch.randn(2, 3, 4, 4),
            chunks=1,
            deferred_batch_norm=deferred,
        )
        assert stage.submod.expected == [(torch.Size([2, 3, 4, 4]), torch.float32)]
        assert model[0].momentum is None
        for key, value in before.items():
            assert torch.equal(model.state_dict()[key], value), key


def test_tuple_between_stages_is_refused_with_the_fix() -> None:
    """A layer returning a tuple at a stage boundary: one RematError that says so (it blamed
    skips, or raised AttributeError when a skip crossed the same boundary)."""
    import remat
    from remat.pipe.distributed import pipeline_stage

    class Two(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x * 2

    class Sum(nn.Module):
        def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return t[0] + t[1]

    plain = nn.Sequential(nn.Linear(8, 8), Two(), Sum(), nn.Linear(8, 8))
    skipped = nn.Sequential(StashInput(), Two(), Sum(), AddSkip())
    for model in (plain, skipped):
        for index in (0, 1):
            with pytest.raises(
                remat.RematError,
                match=r"layers of stage 0 return a tuple of 2 values.*one tensor.*balance",
            ):
                pipeline_stage(
                    model,
                    balance=[2, 2],
                    stage_index=index,
                    device="cpu",
                    example=torch.randn(2, 8),
                    chunks=2,
                )


def test_stage_module_checks_each_micro_batch_shape() -> None:
    """Without an example a stage takes the shape of its first micro-batch; another one
    raises, naming both shapes and the fix."""
    import remat
    from remat.pipe.distributed import split_stages

    first, _ = split_stages(default_namespace_model(), balance=[2, 4], chunks=2)
    first(torch.randn(4, 8))
    first(torch.randn(4, 8))
    with pytest.raises(
        remat.RematError,
        match=r"stage 0 takes micro-batches of shape \(4, 8\) float32, but micro-batch 0 of "
        r"this step has shape \(3, 8\) float32.*batches of 8 rows.*drop_last",
    ):
        first(torch.randn(3, 8))
    with pytest.raises(remat.RematError, match=r"has shape \(4, 8\) float64"):
        first(torch.randn(4, 8, dtype=torch.float64))


# --- Two processes: a batch that does not split into the example's micro-batches


def _short_batch_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    import remat
    from remat.pipe.distributed import pipeline_schedule, pipeline_stage

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        ref = copy.deepcopy(model)
        chunks = 2
        good, target = torch.randn(8, 3), torch.randint(0, 2, (8,))
        stage = pipeline_stage(
            model,
            balance=[1, 1],
            stage_index=rank,
            device="cpu",
            example=good.tensor_split(chunks)[0],
            chunks=chunks,
        )
        schedule = pipeline_schedule(
            stage,
            schedule="gpipe",
            chunks=chunks,
            loss_fn=F.cross_entropy,  # type: ignore[arg-type]
        )
        result: dict[str, Any] = {}
        if rank == 0:  # the other stage waits for nothing: the first stage sends nothing
            for name, call in (
                ("step", lambda: schedule.step(torch.randn(7, 3))),
                ("eval", lambda: schedule.eval(torch.randn(7, 3))),
                ("dtype", lambda: schedule.step(good.double())),
            ):
                try:
                    call()
                    result[name] = None
                except remat.RematError as error:
                    result[name] = str(error)
        dist.barrier()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(good)
        else:
            out = schedule.step(target=target, losses=losses)
            expected = torch.cat([ref(c) for c in good.tensor_split(chunks)])
            result["outputs_equal"] = torch.equal(out, expected)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_batch_that_does_not_split_into_example_micro_batches_raises_before_sending(
    tmp_path: Path,
) -> None:
    """7 rows in 2 micro-batches of a stage built for 4-row ones: the first stage raises a
    RematError before anything is sent (step and eval; a float64 batch too), and the next
    good step runs as usual: the output equals the plain model's (torch.equal). It used to
    receive the 3-row micro-batch into the 4-row buffer, an 8-row output for 7 rows."""
    context = mp.start_processes(
        _short_batch_worker,
        args=(2, _free_port(), str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 60
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the 2 pipeline processes did not finish in 60 s")
    first, last = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    shape = r"stage 0 takes micro-batches of shape \(4, 3\) float32, but micro-batch "
    for name in ("step", "eval"):
        assert first[name] is not None, name
        assert re.search(
            shape + r"1 of this step has shape \(3, 3\) float32: a batch of 7 rows in 2 "
            r"micro-batches.*batches of 8 rows \(pad the last batch, or "
            r"DataLoader\(drop_last=True\)\)",
            first[name],
        ), first[name]
    assert re.search(shape + r"0 of this step has shape \(4, 3\) float64", first["dtype"])
    assert last["outputs_equal"]
