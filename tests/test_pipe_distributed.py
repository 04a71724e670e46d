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
