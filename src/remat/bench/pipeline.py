"""``remat bench --pipeline``: memory per stage and step time of the U-Net in pipelines.

The ``unet`` workload's model, rebuilt as an ``nn.Sequential`` of skippable levels
(``remat.pipe._unet``), runs one training step in three ways, each with checkpointing
``"never"``, ``"except_last"`` and ``"always"``:

* ``plain``: the ``nn.Sequential`` on the whole batch, in this process;
* ``pipe-*``: :class:`remat.pipe.Pipe`, every partition on the benchmark's device, in this
  process: one peak for the whole pipeline (on CPU the partitions share one memory);
* ``stages-*``: one process per stage on ``torch.distributed.pipelining`` (gloo, GPipe
  schedule), skips carried through the stages in between: a peak per stage, each measured in
  its own process.

Peaks are activation bytes of one steady-state step above what was live before it, measured as
``bench/measure.py`` does (``torch.profiler`` memory events on CPU, the allocator's peak on
CUDA). Step times are medians over rounds; in-process strategies are timed in turn within each
round, stage times are the slowest stage's median. Every process computes with one thread. On
a CPU the processes of ``stages-*`` share the cores with each other, so their times say little
about a real multi-device run.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import RematError
from ..workloads import Workload, get_workload
from ._child import run_child
from .measure import peak_step_bytes

__all__: list[str] = []

MODES = ("never", "except_last", "always")


@dataclass(frozen=True)
class PipelineRow:
    """One way of running the step: peak activation bytes (per stage where there are stages)
    and the median step time in seconds."""

    name: str
    description: str
    peak_bytes: int
    stage_peak_bytes: list[int]
    step_seconds: float


@dataclass
class PipelineResult:
    workload: str
    description: str
    device: str
    partitions: int
    chunks: int
    batch_rows: int
    balance: list[int]
    rounds: int
    rows: list[PipelineRow] = field(default_factory=list)

    def table(self) -> str:
        lines = [
            f"{self.workload}: {self.description}",
            f"batch {self.batch_rows} rows, {self.chunks} micro-batches, {self.partitions} "
            f"partitions (balance {self.balance}), device {self.device}, {self.rounds} "
            f"round{'s' if self.rounds != 1 else ''}",
            "",
            f"{'strategy':<20} {'peak MiB':>9} {'per stage MiB':<22} {'step ms':>9} "
            f"{'vs plain':>8}",
        ]
        plain = self.rows[0].step_seconds
        for row in self.rows:
            stages = " / ".join(f"{b / 2**20:.2f}" for b in row.stage_peak_bytes) or "-"
            lines.append(
                f"{row.name:<20} {row.peak_bytes / 2**20:>9.2f} {stages:<22} "
                f"{row.step_seconds * 1e3:>9.1f} {row.step_seconds / plain:>7.2f}x"
            )
        return "\n".join(lines)


def _model(workload: Workload, seed: int) -> nn.Sequential:
    from ..pipe._unet import sequential_unet
    from ..workloads.unet import UNet

    unet = workload.model(seed)
    if not isinstance(unet, UNet):
        raise RematError(
            f"remat bench --pipeline: needs the unet workload (a model with skip connections "
            f"written as skippable levels), got {workload.name}."
        )
    return sequential_unet(unet)


def _batch(workload: Workload, seed: int, rows: int) -> tuple[Tensor, Tensor]:
    xs: list[Tensor] = []
    ys: list[Tensor] = []
    k = 0
    while sum(x.shape[0] for x in xs) < rows:
        x, y = workload.batch(seed + k)
        xs.append(x)
        ys.append(y)
        k += 1
    return torch.cat(xs)[:rows], torch.cat(ys)[:rows]


def _balance(layers: int, partitions: int) -> list[int]:
    return [layers // partitions + (1 if k < layers % partitions else 0) for k in range(partitions)]


def _step(model: nn.Module, workload: Workload, x: Tensor, y: Tensor) -> Callable[[], None]:
    def step() -> None:
        torch.manual_seed(0)
        loss = workload.loss_fn(model(x), y.to(x.device))
        loss.backward()  # type: ignore[no-untyped-call]

    return step


def _in_process(
    workload: Workload,
    seed: int,
    device: torch.device,
    partitions: int,
    chunks: int,
    rows: int,
    rounds: int,
) -> list[PipelineRow]:
    from ..pipe import Pipe

    x, y = _batch(workload, seed, rows)
    x, y = x.to(device), y.to(device)
    models: dict[str, nn.Module] = {"plain": _model(workload, seed).to(device)}
    balance = _balance(len(models["plain"]), partitions)  # type: ignore[arg-type]
    for mode in MODES:
        models[f"pipe-{mode}"] = Pipe(
            _model(workload, seed),
            balance=balance,
            devices=[device] * partitions,
            chunks=chunks,
            checkpoint=mode,  # type: ignore[arg-type]
        )
    steps = {name: _step(m, workload, x, y) for name, m in models.items()}
    peaks: dict[str, int] = {}
    for name, step in steps.items():
        step()  # warm-up; gradients are allocated before the measured step
        for p in models[name].parameters():
            if p.grad is not None:
                p.grad.zero_()
        peaks[name] = peak_step_bytes(step, device)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            steps[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[name].append(time.perf_counter() - start)
    described = {
        "plain": "nn.Sequential, whole batch, no checkpointing",
        **{f"pipe-{m}": f"Pipe in one process, checkpoint={m!r}" for m in MODES},
    }
    return [
        PipelineRow(name, described[name], peaks[name], [], statistics.median(seconds[name]))
        for name in names
    ]


def _stage_worker(rank: int, request: dict[str, Any]) -> None:
    import torch.distributed as dist

    from ..pipe.distributed import pipeline_schedule, pipeline_stage

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(request["port"])
    world = request["partitions"]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        workload = get_workload("unet", request["size"])
        x, y = _batch(workload, request["seed"], request["rows"])
        chunks = request["chunks"]
        out: dict[str, Any] = {}
        for mode in MODES:
            model = _model(workload, request["seed"])
            stage = pipeline_stage(
                model,
                balance=request["balance"],
                stage_index=rank,
                device="cpu",
                example=torch.tensor_split(x, chunks)[0],
                chunks=chunks,
                checkpoint=mode,  # type: ignore[arg-type]
            )
            schedule = pipeline_schedule(
                stage, schedule="gpipe", chunks=chunks, loss_fn=workload.loss_fn
            )

            def step(schedule: Any = schedule) -> None:
                torch.manual_seed(0)
                if rank == 0:
                    schedule.step(x)
                elif rank == world - 1:
                    schedule.step(target=y)
                else:
                    schedule.step()

            step()
            peak = peak_step_bytes(step, torch.device("cpu"))
            times = []
            for _ in range(request["rounds"]):
                dist.barrier()
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            out[mode] = {"peak_bytes": peak, "seconds": statistics.median(times)}
        Path(request["out"], f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _in_processes(
    size: str,
    seed: int,
    partitions: int,
    chunks: int,
    rows: int,
    rounds: int,
    balance: list[int],
) -> list[PipelineRow]:
    from torch.multiprocessing.spawn import start_processes

    with tempfile.TemporaryDirectory() as out:
        request = {
            "size": size,
            "seed": seed,
            "partitions": partitions,
            "chunks": chunks,
            "rows": rows,
            "rounds": rounds,
            "balance": balance,
            "port": _free_port(),
            "out": out,
        }
        start_processes(  # type: ignore[no-untyped-call]
            _stage_worker, args=(request,), nprocs=partitions, join=True, start_method="spawn"
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(partitions)]
    return [
        PipelineRow(
            f"stages-{mode}",
            f"{partitions} processes (gloo, GPipe), checkpoint={mode!r}",
            max(r[mode]["peak_bytes"] for r in ranks),
            [r[mode]["peak_bytes"] for r in ranks],
            max(r[mode]["seconds"] for r in ranks),
        )
        for mode in MODES
    ]


def run(
    size: str = "small",
    *,
    partitions: int = 2,
    chunks: int = 4,
    rounds: int = 5,
    seed: int = 0,
    device: str = "cpu",
    processes: bool = True,
) -> PipelineResult:
    """Measure every row; ``processes=False`` leaves out the ``stages-*`` rows."""
    workload = get_workload("unet", size)
    layers = len(_model(workload, seed))
    if not 1 <= partitions <= layers:
        raise RematError(
            f"remat bench --pipeline: {partitions} partitions for a model of {layers} layers; "
            f"use 1 to {layers}."
        )
    inputs, _ = workload.batch(seed)
    rows = max(chunks, len(inputs))
    balance = _balance(layers, partitions)
    result = PipelineResult(
        workload=f"unet-{size}",
        description=workload.description,
        device=device,
        partitions=partitions,
        chunks=chunks,
        batch_rows=rows,
        balance=balance,
        rounds=rounds,
    )
    result.rows = _in_process(
        workload, seed, torch.device(device), partitions, chunks, rows, rounds
    )
    if processes:
        result.rows += _in_processes(size, seed, partitions, chunks, rows, rounds, balance)
    return result


def write_json(result: PipelineResult, path: Path, run: dict[str, Any] | None = None) -> None:
    """The result as JSON, with ``run`` (what produced it: ``remat bench``'s command line,
    date and versions) under ``"run"`` where given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(result)
    if run is not None:
        data["run"] = run
    path.write_text(json.dumps(data, indent=2))


def from_json(data: dict[str, Any]) -> PipelineResult:
    rows = [PipelineRow(**row) for row in data.pop("rows")]
    return PipelineResult(**data, rows=rows)


def measure_in_subprocess(request: dict[str, Any]) -> PipelineResult:
    """:func:`run` in a fresh process (``python -m remat.bench.pipeline '<json>'``), so that
    the stage processes it spawns start from an importable main module and the peaks are not
    disturbed by this process's heap."""
    return from_json(run_child("remat.bench.pipeline", request, "--pipeline"))


if __name__ == "__main__":
    import sys

    # One thread here as in each stage process, so that the rows compare like with like.
    torch.set_num_threads(1)
    print(json.dumps(asdict(run(**json.loads(sys.argv[1])))))
