"""Measure one strategy's peak activation memory, and step times of several side by side.

Run as ``python -m remat.bench.measure '<json request>'``: each request runs in a fresh
process and prints one JSON line. The main kinds of request:

``memory``: build the workload, set it up with one strategy, take a first step next to a
plain model's (the exactness check below), then measure the peak of one steady-state step
above the memory live just before it. On CUDA that is
``max_memory_allocated() - memory_allocated()``. On CPU there are no allocator statistics, so
the step runs under ``torch.profiler`` with ``profile_memory=True`` and the peak is the maximum
of the running sum of every allocation and free: deterministic, including recompute and backward
temporaries, and undisturbed by other processes. Gradients are allocated before the measured
step, so the figure is activations and temporaries, not gradients. The first step checks that
loss, every gradient and every buffer (BatchNorm's statistics) are bit-identical to a plain
model's from the same seed, with deterministic kernels only on CUDA (:func:`exactness`).

``time``: every strategy's model in one process, on the same parameters and batch; each round
times one step of each strategy, in an order that rotates from round to round, and each
strategy's ratio is its step time over the plain step of the same round; the median over rounds
is reported. CPU time that other processes used during a step (from ``/proc/stat``) marks the
round as contended; contended rounds are left out while enough clean ones remain. The minor page
faults of each step are counted too: on CPU, a step that takes fresh pages from the system pays
for zeroing them, and how many it takes depends on what glibc kept from the steps before it,
which is why ``remat bench`` runs this request with glibc's thresholds fixed (``cli.py``).

``plan``: profile the workload's model once and plan each of ``budgets`` (strategy name ->
budget) from that profile (``strategies.plan_budgets``). ``remat bench`` writes what it returns
to a file and names the file as ``plans_file`` in the memory and time requests that follow, so
that each planned strategy is measured and timed with the one plan it was given.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._dispatch import EagerMode
from ..workloads import Workload, get_workload
from .strategies import PLANS, get_strategy, matched_torch, plan_budgets

__all__: list[str] = []

_CONTENDED = 0.15  # other processes' CPU seconds per wall second above which a step is contended


def training_step(model: nn.Module, workload: Workload, batch: Any, seed: int) -> torch.Tensor:
    inputs, target = batch
    torch.manual_seed(seed)
    with workload.forward_context(inputs.device):
        loss = workload.loss_fn(model(inputs), target)
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


def _zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def peak_step_bytes(step: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated by ``step`` above what was live when it started: the planner's
    measurement, so that a plan's prediction and the bench's figure are the same quantity."""
    from ..planning.cost import peak_bytes

    return peak_bytes(step, device)


def _prepared(workload: Workload, strategy: str, seed: int, device: torch.device) -> nn.Module:
    model = workload.model(seed).to(device)
    get_strategy(strategy).prepare(model, workload)
    return model


def _to(batch: Any, device: torch.device) -> Any:
    return tuple(t.to(device) for t in batch)


def memory(workload: Workload, strategy: str, seed: int, device: torch.device) -> dict[str, Any]:
    model = _prepared(workload, strategy, seed, device)
    batch = _to(workload.batch(seed), device)
    step = functools.partial(training_step, model, workload, batch, seed)
    peak = 0

    def measure() -> None:
        nonlocal peak
        _zero_grads(model)
        peak = peak_step_bytes(step, device)

    # The first compared step is the warm-up of the measured one.
    exact = exactness(workload, model, batch, seed, device, between=measure)
    from .strategies import PREDICTED

    return {"peak_bytes": peak, **exact, **PREDICTED.get(id(model), {})}


# The settings of cuBLAS's workspace under which torch counts its kernels as deterministic.
CUBLAS_DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@contextlib.contextmanager
def deterministic_kernels(device: torch.device) -> Iterator[None]:
    """On CUDA, deterministic kernels only (``torch.use_deterministic_algorithms``, cuDNN's
    deterministic algorithms, no autotuning): by default a convolution's backward and
    memory-efficient attention's accumulate in an order that changes from run to run, so that
    two plain steps differ in their last bits. An op that has no deterministic kernel there
    raises a ``RuntimeError`` that says so."""
    if device.type != "cuda":
        yield
        return
    cudnn = torch.backends.cudnn
    saved = (
        cudnn.deterministic,
        cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    cudnn.deterministic, cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = saved[:2]
        torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])


def _nondeterministic(error: RuntimeError) -> str | None:
    """The op that ``error`` says has no deterministic kernel, else ``None``."""
    text = str(error)
    if "does not have a deterministic implementation" in text:
        return text.split(" does not have", 1)[0].strip()
    if "not deterministic because it uses CuBLAS" in text:
        return f"cuBLAS (set {' '.join(f'{k}={v}' for k, v in CUBLAS_DETERMINISTIC.items())})"
    return None


def exactness(
    workload: Workload,
    model: nn.Module,
    batch: Any,
    seed: int,
    device: torch.device,
    between: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Whether ``model`` (the workload's model of ``seed``, fresh from its strategy) steps as a
    plain model of the same seed does, bit for bit, under :func:`deterministic_kernels`: its
    first step's loss and gradients (``grads_equal``) and the buffers after it
    (``buffers_equal``; ``None`` for a model without buffers), and, after ``between()`` ran,
    a later step's loss and gradients (``grads_equal`` too). The two steps differ where a
    strategy learns from its first step: a region's first recompute runs under the write
    guard, later ones may not (NOTE [ When the guard runs ] in ``_guard.py``).

    Where nothing can be compared, both are ``None`` and ``not_compared`` says why: an op of
    the step has no deterministic kernel on the device, or two plain steps differ (checked
    where the strategy's step differs from the plain one). ``model`` has taken its first step
    before ``between()`` either way."""

    def plain_step() -> tuple[torch.Tensor, nn.Module]:
        plain = workload.model(seed).to(device)
        return training_step(plain, workload, batch, seed + 1), plain

    def step() -> torch.Tensor:
        _zero_grads(model)
        return training_step(model, workload, batch, seed + 1)

    try:
        with deterministic_kernels(device):
            expected, plain = plain_step()
            got = step()
    except RuntimeError as error:
        op = _nondeterministic(error)
        if op is None:
            raise
        step()  # the first step, as the comparison would have taken it
        between()
        return {
            "grads_equal": None,
            "buffers_equal": None,
            "not_compared": f"{op} has no deterministic kernel on {device.type}",
        }
    grads, buffers = _equal(expected, plain, got, model)
    if not grads or buffers is False:
        with deterministic_kernels(device):
            again, twin = plain_step()
        if _equal(expected, plain, again, twin) != (True, None if buffers is None else True):
            between()
            return {
                "grads_equal": None,
                "buffers_equal": None,
                "not_compared": "two plain steps from the same seed differed",
            }
    between()
    if grads:
        with deterministic_kernels(device):
            later = step()
        grads = _equal(expected, plain, later, model)[0]
    return {"grads_equal": grads, "buffers_equal": buffers}


def _equal(
    expected: torch.Tensor, plain: nn.Module, got: torch.Tensor, model: nn.Module
) -> tuple[bool, bool | None]:
    """Loss and gradients equal; buffers equal (``None`` where there are none)."""
    grads = torch.equal(expected, got) and all(
        p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
        for p, q in zip(plain.parameters(), model.parameters(), strict=True)
    )
    pairs = list(zip(plain.buffers(), model.buffers(), strict=True))
    if not pairs:
        return grads, None
    return grads, all(torch.equal(a, b) for a, b in pairs)


def _busy_seconds() -> float:
    """CPU seconds all processes have spent, from the first line of /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _adjacent(names: list[str]) -> list[str]:
    """``names`` ordered so that each strategy follows the one it is compared with."""
    followers: dict[str, list[str]] = {}
    roots = []
    for name in names:
        other = get_strategy(name).counterpart
        if other in names:
            followers.setdefault(other, []).append(name)
        else:
            roots.append(name)
    order: list[str] = []

    def place(name: str) -> None:
        # The planned strategy at this one's measured peak goes on its other side, so that
        # both it and the strategy that follows at the same granularity are next to it.
        planned = [f for f in followers.get(name, []) if matched_torch(f) == name]
        order.extend(planned)
        order.append(name)
        for follower in followers.get(name, []):
            if follower not in planned:
                place(follower)

    for root in roots:
        place(root)
    return order


# The key of the control model in ``times``: no strategy's name (names have no spaces).
CONTROL = "none (second copy)"


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_step(step: Callable[[], Any], device: torch.device) -> tuple[float, bool, int]:
    """Wall seconds of one step, whether other processes competed for the CPU during it, and
    the minor page faults the process took in it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    faults = _minor_faults()
    busy, own, start = _busy_seconds(), time.process_time(), time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    others = (_busy_seconds() - busy) - (time.process_time() - own)
    # /proc/stat counts in clock ticks (10 ms): below two ticks a reading is quantisation.
    contended = others > max(_CONTENDED * wall, 2 / os.sysconf("SC_CLK_TCK"))
    return wall, contended, _minor_faults() - faults


def times(
    workload: Workload, strategies: list[str], seed: int, device: torch.device, rounds: int
) -> dict[str, Any]:
    names = ["none", *[s for s in strategies if s != "none"]]
    models = {name: _prepared(workload, name, seed, device) for name in names}
    # The control: a second plain model, timed next to the first in every round. Its ratio to
    # the first is what two runs of the same work read here; a ratio between strategies
    # nearer 1 than the control's spread does not tell them apart.
    models[CONTROL] = _prepared(workload, "none", seed, device)
    batch = _to(workload.batch(seed), device)
    for model in models.values():
        for _ in range(2):
            training_step(model, workload, batch, seed)
            _zero_grads(model)
    timed: list[dict[str, Any]] = []
    base = _adjacent(names)
    base.insert(base.index("none") + 1, CONTROL)
    for r in range(rounds):
        # Each strategy runs next to the one it is compared with, so that both see the same
        # state of the process's heap; the order turns and reverses from round to round.
        shift = (3 * r) % len(base)
        order = base[shift:] + base[:shift]
        if r % 2:
            order.reverse()
        seconds: dict[str, float] = {}
        faults: dict[str, int] = {}
        busy = False
        for name in order:
            wall, other, taken = timed_step(
                functools.partial(training_step, models[name], workload, batch, seed), device
            )
            _zero_grads(models[name])
            faults[name] = taken
            seconds[name] = wall
            busy = busy or other
        timed.append({"seconds": seconds, "faults": faults, "contended": busy})
    return summarize(names, timed)


def summarize(names: list[str], timed: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over timed rounds, from one process or pooled from several (``remat bench
    --processes``). Each round is ``{"seconds": {name: s}, "faults": {name: n}, "contended":
    bool}`` and times every strategy of ``names`` and the control. Rounds in which other
    processes competed for the CPU are left out, unless that would leave fewer than half."""
    clean = [t for t in timed if not t["contended"]]
    used = clean if len(clean) >= max(3, len(timed) // 2) else timed
    per_round = [t["seconds"] for t in used]
    control = [s[CONTROL] / s["none"] for s in per_round]
    return {
        "rounds": len(timed),
        "contended_rounds": sum(t["contended"] for t in timed),
        "used_rounds": len(used),
        "seconds": {n: statistics.median(s[n] for s in per_round) for n in names},
        "ratio": {n: statistics.median(s[n] / s["none"] for s in per_round) for n in names},
        "faults_per_step": {n: statistics.median(t["faults"][n] for t in timed) for n in names},
        "pairwise": {
            f"{a}/{b}": statistics.median(s[a] / s[b] for s in per_round)
            for a in names
            for b in names
            if a != b and a != "none" and b != "none"
        },
        "control": {
            "ratio": statistics.median(control),
            "low": min(control),
            "high": max(control),
        },
        "timed_rounds": timed,
    }


class _Passthrough(EagerMode):
    """A dispatch mode that only runs each op: the floor under any per-op recording in Python."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


class _CountOps(EagerMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def recording_overhead(workload: Workload, repeats: int = 300) -> float:
    """Microseconds the graph engine adds per op it records, in forward (see
    :func:`engine_overhead`)."""
    return engine_overhead(workload, repeats)["recording_us_per_op"]


def engine_overhead(workload: Workload, repeats: int = 300) -> dict[str, float]:
    """Microseconds the graph engine adds per op it records, in forward, and per op it
    replays, in backward.

    Measured on the first block of the workload's model, called with the input it gets in a
    plain forward: a plain copy and a copy under the graph engine (recompute_everything) run
    forward and backward alternately ``repeats`` times, and a plain forward without autograd
    runs beside them. Recording: the difference of the median forward times. Replay: the
    graph engine's backward less the plain backward and less the plain forward without
    autograd (the kernels a replay runs again). Each is divided by the block's number of ATen
    ops in forward, which a recompute-everything replay runs again. Use a small size: with
    small tensors the ops are short, so the difference is the engine's own work, not noise in
    the kernels. Times are the process's CPU time with one intra-op thread: the engine's work
    is Python on one thread, and CPU time is not inflated by other processes on the machine.
    A third, plain forward under a dispatch mode that only runs each op gives the floor that
    any recording through a Python dispatch mode pays (``dispatch_mode_us_per_op``).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _engine_overhead(workload, repeats)
    finally:
        torch.set_num_threads(threads)


def _engine_overhead(workload: Workload, repeats: int) -> dict[str, float]:
    import copy

    from .. import modules, policies

    model = workload.model()
    _, block = workload.blocks(model)[0]
    captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append((args, kwargs))

    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    inputs, _ = workload.batch()
    with torch.no_grad():
        model(inputs)
    handle.remove()
    args, kwargs = captured[0]
    args = tuple(
        a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
        for a in args
    )
    recorded = modules.checkpoint_wrapper(
        copy.deepcopy(block), policy=policies.recompute_everything
    )
    counter = _CountOps()
    with counter:
        block(*args, **kwargs)
    seconds: dict[str, list[float]] = {
        k: [] for k in ("fwd", "bwd", "rec", "replay", "bare", "mode")
    }

    def step(module: nn.Module, forward: str, backward: str) -> None:
        torch.manual_seed(0)
        start = time.process_time()
        out = module(*args, **kwargs)
        middle = time.process_time()
        out.sum().backward()
        seconds[forward].append(middle - start)
        seconds[backward].append(time.process_time() - middle)

    for _ in range(repeats):
        step(block, "fwd", "bwd")
        step(recorded, "rec", "replay")
        with torch.no_grad():
            torch.manual_seed(0)
            start = time.process_time()
            block(*args, **kwargs)
            seconds["bare"].append(time.process_time() - start)
            start = time.process_time()
            with _Passthrough():
                block(*args, **kwargs)
            seconds["mode"].append(time.process_time() - start)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    ops = max(counter.count, 1)
    return {
        "recording_us_per_op": 1e6 * (median["rec"] - median["fwd"]) / ops,
        "replay_us_per_op": 1e6 * (median["replay"] - median["bwd"] - median["bare"]) / ops,
        "dispatch_mode_us_per_op": 1e6 * (median["mode"] - median["bare"]) / ops,
    }


def status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    return _proc_status_kib(field) * 1024


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of the resident set (``VmHWM``) to the current size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_and_tracker(workload: Workload, strategy: str, seed: int) -> dict[str, Any]:
    """One step's peak by resident memory and by ``remat.MemoryTracker``, in this process.

    Meant for a fresh process started with ``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc
    returns freed tensor memory to the system and the resident set follows live tensors. After
    a warm-up step, the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``), one step
    runs, and its peak is the high-water mark minus the resident size just before it. A second
    step runs under the tracker.
    """
    from ..track import MemoryTracker

    device = torch.device("cpu")
    model = _prepared(workload, strategy, seed, device)
    batch = workload.batch(seed)
    training_step(model, workload, batch, seed)
    _zero_grads(model)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _proc_status_kib("VmRSS")
    training_step(model, workload, batch, seed)
    rss_peak = (_proc_status_kib("VmHWM") - base) * 1024
    _zero_grads(model)
    with MemoryTracker(model, timeline=False) as tracker:
        training_step(model, workload, batch, seed)
    report = tracker.report()
    return {"rss_peak_bytes": rss_peak, "tracker_peak_bytes": report.peak_bytes["cpu"]}


def handle(request: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(request.get("threads") or torch.get_num_threads())
    if request.get("hf"):
        from .hf import get_hf_workload

        workload = get_hf_workload(request["hf"], request["size"])
    else:
        workload = get_workload(request["workload"], request["size"])
    if request.get("autocast"):
        workload = workload.with_autocast(getattr(torch, request["autocast"]))
    device = torch.device(request.get("device", "cpu"))
    seed = int(request.get("seed", 0))
    if request.get("plans_file"):
        with open(request["plans_file"]) as f:
            PLANS.update(json.load(f))
    if request["kind"] == "plan":
        return plan_budgets(workload, request["budgets"], seed, device)
    if request["kind"] == "memory":
        if device.type == "cuda":  # before cuBLAS starts (see ``deterministic_kernels``)
            for key, value in CUBLAS_DETERMINISTIC.items():
                os.environ.setdefault(key, value)
        return memory(workload, request["strategy"], seed, device)
    if request["kind"] == "overhead":
        return engine_overhead(workload)
    if request["kind"] == "rss":
        return rss_and_tracker(workload, request["strategy"], seed)
    return times(workload, list(request["strategies"]), seed, device, int(request["rounds"]))


if __name__ == "__main__":
    print(json.dumps(handle(json.loads(sys.argv[1]))))
