"""The disk tier on a GPT training step: resident memory, bandwidth and time.

``remat bench --offload`` runs three measurements, each in fresh processes:

1. **Peak RSS.** One process per strategy (``none``, ``offload-disk``, and region or graph
   strategies with their saved tensors on disk) started with ``MALLOC_MMAP_THRESHOLD_=65536`` so
   that glibc returns large frees to the system and the resident set follows live memory.
   After a warm-up step the kernel's high-water mark is reset (``/proc/self/clear_refs``) and
   one step (forward and backward) runs. Reported: the process's peak RSS during the step and
   its rise above the RSS just before it.
2. **Bandwidth and time.** One process with a plain model and a model whose forward runs in
   ``remat.offload("disk")``, stepped alternately. The disk tier's counters give the bytes
   written and read per step and the wall seconds during which at least one write (read) was
   running; the same directory's plain large-file write and read
   (:func:`remat.store.disk.sequential_bandwidth`, the same calls, a file as large as one
   step's writes) are measured in the same process right after, best of three. The step-time
   ratio is the median over rounds of offloaded over plain.
3. **OffloadModel** (``remat.bench.offload_model``): CPU training with the model's slices,
   optimizer state and activations on disk, against the bytes of parameters plus AdamW state.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch

from ..workloads import get_workload
from ._child import run_child
from .measure import reset_peak_rss, status_bytes, training_step

__all__: list[str] = []

_MMAP_THRESHOLD = "65536"
RSS_STRATEGIES = ("none", "offload-disk", "remat-block", "remat-block-disk")


def _zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _rss(request: dict[str, Any]) -> dict[str, Any]:
    from .measure import _prepared

    workload = get_workload("gpt", request["size"])
    seed = request["seed"]
    model = _prepared(workload, request["strategy"], seed, torch.device("cpu"))
    batch = workload.batch(seed)
    training_step(model, workload, batch, seed)
    _zero(model)
    reset_peak_rss()
    before = status_bytes("VmRSS")
    start = time.perf_counter()
    training_step(model, workload, batch, seed)
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM")
    return {"rss_before_bytes": before, "rss_peak_bytes": peak, "step_seconds": seconds}


def _io(request: dict[str, Any]) -> dict[str, Any]:
    from ..store.disk import sequential_bandwidth
    from ..store.scope import tier_named
    from .measure import _prepared

    workload = get_workload("gpt", request["size"])
    seed = request["seed"]
    plain = _prepared(workload, "none", seed, torch.device("cpu"))
    offloaded = _prepared(workload, "offload-disk", seed, torch.device("cpu"))
    tier: Any = tier_named("disk")
    batch = workload.batch(seed)
    for model in (plain, offloaded):
        training_step(model, workload, batch, seed)
        _zero(model)
    isolated = _store_and_load(workload, plain, batch, seed)
    ratios, plain_s, offload_s = [], [], []
    written = read = 0
    write_wall = read_wall = 0.0
    for r in range(request["rounds"]):
        order = (plain, offloaded) if r % 2 == 0 else (offloaded, plain)
        seconds = {}
        for model in order:
            stats = tier.stats
            start = time.perf_counter()
            training_step(model, workload, batch, seed)
            seconds[id(model)] = time.perf_counter() - start
            _zero(model)
            if model is offloaded:
                after = tier.stats
                written += after.bytes_written - stats.bytes_written
                read += after.bytes_read - stats.bytes_read
                write_wall += after.write_wall_seconds - stats.write_wall_seconds
                read_wall += after.read_wall_seconds - stats.read_wall_seconds
        plain_s.append(seconds[id(plain)])
        offload_s.append(seconds[id(offloaded)])
        ratios.append(seconds[id(offloaded)] / seconds[id(plain)])
    per_step = written // request["rounds"]
    plain_write, plain_read = zip(
        *(sequential_bandwidth(tier.directory, max(per_step, 2**20)) for _ in range(3)),
        strict=True,
    )
    return {
        "directory": str(tier.directory.parent.parent),
        "bytes_written_per_step": per_step,
        "bytes_read_per_step": read // request["rounds"],
        "tier_write_bytes_per_s": written / max(write_wall, 1e-9),
        "tier_read_bytes_per_s": read / max(read_wall, 1e-9),
        "plain_write_bytes_per_s": max(plain_write),
        "plain_read_bytes_per_s": max(plain_read),
        **isolated,
        "plain_step_seconds": statistics.median(plain_s),
        "offload_step_seconds": statistics.median(offload_s),
        "time_ratio": statistics.median(ratios),
    }


def _store_and_load(workload: Any, model: torch.nn.Module, batch: Any, seed: int) -> dict[str, Any]:
    """The saved tensors of one step, stored through remat's store and loaded back in reverse
    order (with its prefetch, each dropped after use as backward does, every page of it read
    once), with nothing else running, against the same bytes as one plain large file in the
    same directory."""
    from ..store import DiskTier, Store
    from ..store.disk import sequential_bandwidth
    from ..store.scope import tier_named

    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and not (t.is_leaf and t.requires_grad):
            saved.append(t)
        return t

    torch.manual_seed(seed)
    inputs, target = batch
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = workload.loss_fn(model(inputs), target)
    del loss
    directory = tier_named("disk").directory.parent.parent  # type: ignore[attr-defined]
    # The page cache makes single readings of write bandwidth swing several-fold here:
    # alternate the two, three times each, and keep the best of each.
    tier_io: list[tuple[float, float]] = []
    plain_io: list[tuple[float, float]] = []
    nbytes = 0
    for _ in range(3):
        tier = DiskTier(directory)
        store = Store(tier)
        start = time.perf_counter()
        handles = [store.pack(t, check_version=False) for t in saved]
        store.flush()
        write_s = time.perf_counter() - start
        nbytes = store.stored_bytes
        start = time.perf_counter()
        for handle in reversed(handles):
            value = handle.tensor
            _touch(value)  # loaded means in memory: fault in any page not yet resident
            del value
        read_s = time.perf_counter() - start
        del handles
        tier.close()
        tier_io.append((nbytes / write_s, nbytes / read_s))
        plain_io.append(sequential_bandwidth(directory, nbytes))
    return {
        "isolated_bytes": nbytes,
        "isolated_tier_write_bytes_per_s": max(w for w, _ in tier_io),
        "isolated_tier_read_bytes_per_s": max(r for _, r in tier_io),
        "isolated_plain_write_bytes_per_s": max(w for w, _ in plain_io),
        "isolated_plain_read_bytes_per_s": max(r for _, r in plain_io),
    }


def _touch(t: torch.Tensor) -> None:
    """Read one byte of every page of ``t``'s storage."""
    storage = t.untyped_storage()
    if storage.nbytes():
        torch.empty(0, dtype=torch.uint8).set_(storage)[::4096].sum()


def _spawn(request: dict[str, Any], mmap_threshold: bool) -> dict[str, Any]:
    env = {"MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD} if mmap_threshold else {}
    return run_child("remat.bench.offload", request, f"--offload {request['kind']}", env)


def measure(
    size: str = "bench", seed: int = 0, rounds: int = 5, offload_model: bool = True
) -> dict[str, Any]:
    """All three measurements; see the module's docstring."""
    rss = {
        name: _spawn({"kind": "rss", "size": size, "seed": seed, "strategy": name}, True)
        for name in RSS_STRATEGIES
    }
    io = _spawn({"kind": "io", "size": size, "seed": seed, "rounds": rounds}, False)
    result: dict[str, Any] = {"size": size, "rss": rss, "io": io}
    if offload_model:
        from .offload_model import measure as measure_offload_model

        slices = 14 if size == "bench" else 3  # the bench GPT has 14 modules, the small 6
        result["offload_model"] = {
            "offload": measure_offload_model("offload", size=size, steps=2, slices=slices),
            "plain": measure_offload_model("plain", size=size, steps=2),
        }
    return result


# The least a ratio's denominator (bytes) may be for the ratio to be printed.
_MIN_DENOMINATOR = 2**20


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _bandwidths(io: dict[str, Any], prefix: str) -> list[str]:
    lines = []
    for what in ("write", "read"):
        tier = io[f"{prefix}tier_{what}_bytes_per_s"]
        plain = io[f"{prefix}plain_{what}_bytes_per_s"]
        lines.append(
            f"    {what}: tier {tier / 1e9:.2f} GB/s, plain large file {plain / 1e9:.2f} GB/s, "
            f"ratio {tier / plain:.2f}"
        )
    return lines


def report(result: dict[str, Any]) -> str:
    """The figures as plain lines of text."""
    lines = [f"disk tier, gpt-{result['size']} training step (forward + backward), CPU:"]
    rss = result["rss"]
    none_peak = rss["none"]["rss_peak_bytes"]
    none_rise = rss["none"]["rss_peak_bytes"] - rss["none"]["rss_before_bytes"]
    lines.append(
        f"  {'strategy':18} {'peak RSS':>12} {'vs none':>8} {'rise in step':>14} {'vs none':>8}"
    )
    tiny = False  # some ratio is to less than a MiB, and reads n/a
    for name, r in rss.items():
        rise = r["rss_peak_bytes"] - r["rss_before_bytes"]
        # A small step may raise the resident set by nothing or a few pages (the heap holds
        # its pages): a ratio to that is noise.
        tiny |= none_rise < _MIN_DENOMINATOR
        versus = f"{rise / none_rise:8.2f}" if none_rise >= _MIN_DENOMINATOR else f"{'n/a':>8}"
        lines.append(
            f"  {name:18} {_mib(r['rss_peak_bytes']):>12} {r['rss_peak_bytes'] / none_peak:8.2f}"
            f" {_mib(rise):>14} {versus}"
        )
    io = result["io"]
    lines.append(
        f"  per step: {_mib(io['bytes_written_per_step'])} written, "
        f"{_mib(io['bytes_read_per_step'])} read, in {io['directory']}"
    )
    lines.append("  during the step (the I/O threads share the CPU with the step):")
    lines += _bandwidths(io, "")
    lines.append(
        f"  the step's saved tensors alone ({_mib(io['isolated_bytes'])}, stored then loaded "
        "in reverse, nothing else running):"
    )
    lines += _bandwidths(io, "isolated_")
    lines.append(
        f"  step time: plain {io['plain_step_seconds']:.3f} s, offloaded "
        f"{io['offload_step_seconds']:.3f} s, ratio {io['time_ratio']:.2f} (median of rounds)"
    )
    om = result.get("offload_model")
    if om is not None:
        o, p = om["offload"], om["plain"]
        bound = o["param_bytes"] + o["optimizer_state_bytes"]
        tiny |= bound < _MIN_DENOMINATOR
        ratio = f"{o['peak_rss_bytes'] / bound:.2f}" if bound >= _MIN_DENOMINATOR else "n/a"
        lines.append(
            f"OffloadModel on disk (CPU, AdamW): peak RSS {_mib(o['peak_rss_bytes'])} vs "
            f"parameters + optimizer state {_mib(bound)} (ratio {ratio});"
            f" plain step peak RSS {_mib(p['peak_rss_bytes'])}; step "
            f"{statistics.median(o['step_seconds']):.2f} s vs plain "
            f"{statistics.median(p['step_seconds']):.2f} s"
        )
    if tiny:
        lines.append(
            f"n/a: a ratio to less than {_mib(_MIN_DENOMINATOR)} says nothing (at "
            f"gpt-{result['size']} a step's tensors fit in pages the process already holds); use "
            "--size bench."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    torch.set_num_threads(torch.get_num_threads())
    out = _rss(request) if request["kind"] == "rss" else _io(request)
    print(json.dumps(out))
