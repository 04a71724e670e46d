"""Peak resident memory of CPU training with ``OffloadModel`` on disk, against a plain step.

The claim to check: with ``OffloadModel(device="cpu", offload_device="disk")`` the benchmark
GPT trains with a peak RSS below the bytes of its parameters plus its optimizer state (AdamW:
``exp_avg`` and ``exp_avg_sq``, twice the parameters), which a plain step must hold at once.

Each measurement runs in a fresh interpreter (``python -m remat.bench.offload_model --child
...``) started with ``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc returns large frees to the
system and the resident set follows live memory. Reported, in bytes and seconds:

- ``baseline_rss_bytes``: RSS after importing torch and remat, before building anything;
- ``build_peak_rss_bytes``: the high-water mark after building the model (and, for
  OffloadModel, sending it to disk): the whole model is built in RAM by the workload first;
- ``peak_rss_bytes``: the high-water mark over the training steps alone (the kernel's mark is
  reset after the build through ``/proc/self/clear_refs``; where that is not possible it is the
  whole process's mark and ``peak_reset`` is False);
- ``step_seconds``: wall time of each training step (forward, backward, optimizer step,
  zero_grad).

Usage: ``python -m remat.bench.offload_model [--size bench] [--steps 3] [--slices 14]
[--microbatches 1] [--directory DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from torch import nn

from ..workloads import GPT
from ._child import run_child
from .measure import reset_peak_rss, status_bytes

__all__: list[str] = []

_MMAP_THRESHOLD = "65536"


class GPTEmbedding(nn.Module):
    """The part of :class:`~remat.workloads.GPT` before its blocks, as one module."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok_emb = gpt.tok_emb
        self.pos_emb = gpt.pos_emb
        self.drop = gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        out: torch.Tensor = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        return out


class GPTHead(nn.Module):
    """The part of :class:`~remat.workloads.GPT` after its blocks, as one module."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f = gpt.ln_f
        self.head = gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def gpt_modules(gpt: GPT) -> list[nn.Module]:
    """The workload GPT as a chain of modules (embedding, each block, final norm and head)
    that computes exactly what ``gpt(idx)`` does, sharing its parameters."""
    return [GPTEmbedding(gpt), *gpt.blocks, GPTHead(gpt)]


# -- one measurement, in this process ---------------------------------------------------------


def _reset_peak() -> bool:
    try:
        reset_peak_rss()
    except OSError:
        return False
    return True


def _child(request: dict[str, Any]) -> dict[str, Any]:
    from ..offload_model import OffloadModel
    from ..workloads import get_workload

    torch.set_num_threads(int(request.get("threads") or torch.get_num_threads()))
    baseline = status_bytes("VmRSS")
    workload = get_workload("gpt", request["size"])
    inputs, target = workload.batch(0)
    gpt = workload.model(0)
    assert isinstance(gpt, GPT)
    param_bytes = sum(p.numel() * p.element_size() for p in gpt.parameters())
    lr = 1e-4
    model: Any
    if request["kind"] == "offload":
        model = OffloadModel(
            gpt_modules(gpt),
            device="cpu",
            offload_device="disk",
            num_slices=int(request["slices"]),
            num_microbatches=int(request["microbatches"]),
            checkpoint_activation=bool(request["checkpoint_activation"]),
            disk_directory=request.get("directory"),
        )
        del gpt
        model.configure_optimizer(lambda ps: torch.optim.AdamW(ps, lr=lr))

        def step() -> None:
            loss = workload.loss_fn(model(inputs), target)
            loss.backward()  # type: ignore[no-untyped-call]
            model.step()
            model.zero_grad()

    else:
        model = gpt
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

        def step() -> None:
            loss = workload.loss_fn(model(inputs), target)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    build_peak = status_bytes("VmHWM")
    reset = _reset_peak()
    seconds: list[float] = []
    for _ in range(int(request["steps"])):
        start = time.perf_counter()
        torch.manual_seed(len(seconds))
        step()
        seconds.append(time.perf_counter() - start)
    result: dict[str, Any] = {
        "kind": request["kind"],
        "baseline_rss_bytes": baseline,
        "build_peak_rss_bytes": build_peak,
        "peak_rss_bytes": status_bytes("VmHWM"),
        "peak_reset": reset,
        "param_bytes": param_bytes,
        "optimizer_state_bytes": 2 * param_bytes,  # AdamW: exp_avg and exp_avg_sq
        "step_seconds": seconds,
    }
    if request["kind"] == "offload":
        result["slice_bytes"] = list(model.slice_bytes)
        result["disk_directory"] = model.disk_directory
        model.close()
    return result


# -- the driver --------------------------------------------------------------------------------


def measure(
    kind: str,
    *,
    size: str = "bench",
    steps: int = 3,
    slices: int = 14,
    microbatches: int = 1,
    checkpoint_activation: bool = True,
    directory: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run ``steps`` training steps of the GPT workload in a fresh process and return its
    figures. ``kind`` is ``"offload"`` (OffloadModel on the CPU with the disk tier) or
    ``"plain"`` (the model and AdamW as they are)."""
    if kind not in ("offload", "plain"):
        raise ValueError(f"remat: kind must be 'offload' or 'plain', found {kind!r}")
    request = {
        "kind": kind,
        "size": size,
        "steps": steps,
        "slices": slices,
        "microbatches": microbatches,
        "checkpoint_activation": checkpoint_activation,
        "directory": directory,
        "threads": threads,
    }
    env = {"MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD}
    return run_child(
        "remat.bench.offload_model", request, f"the {kind} measurement", env, ["--child"]
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remat.bench.offload_model")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="bench")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--slices", type=int, default=14)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--keep-activations", action="store_true")
    parser.add_argument("--directory", default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    options = {"size": args.size, "steps": args.steps, "threads": args.threads}
    offload = measure(
        "offload",
        slices=args.slices,
        microbatches=args.microbatches,
        checkpoint_activation=not args.keep_activations,
        directory=args.directory,
        **options,
    )
    plain = measure("plain", **options)
    limit = offload["param_bytes"] + offload["optimizer_state_bytes"]
    for r in (offload, plain):
        steps = ", ".join(f"{s:.2f}" for s in r["step_seconds"])
        print(
            f"{r['kind']:>8}: peak RSS over the steps {_mib(r['peak_rss_bytes'])} "
            f"(reset after build: {r['peak_reset']}), peak while building "
            f"{_mib(r['build_peak_rss_bytes'])}, baseline {_mib(r['baseline_rss_bytes'])}, "
            f"step seconds [{steps}]"
        )
    print(
        f"params {_mib(offload['param_bytes'])} + AdamW state "
        f"{_mib(offload['optimizer_state_bytes'])} = {_mib(limit)}; OffloadModel peak RSS "
        f"{'below' if offload['peak_rss_bytes'] < limit else 'NOT below'} it"
    )
    print(json.dumps({"offload": offload, "plain": plain}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
