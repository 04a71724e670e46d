"""On a CUDA device: every engine and tier bit-equal to a plain run, and the mechanisms only a
GPU has: random numbers replayed from the accelerator's generators, pinned host buffers and a
copy stream for the host tier, the caching allocator's figures.

These tests need a CUDA device and are skipped without one (CI has none); where they last ran
and what they printed is in ``docs/benchmarks.md`` ("On a GPU"). Each comparison first runs
the plain step twice and asserts that it reproduces itself, so that a kernel that is not
deterministic on the device shows as that, not as a remat bug.
"""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.store import DiskTier, HostTier
from remat.workloads import WORKLOAD_NAMES, get_workload

from helpers import StepRecord, assert_records_equal, offloaded, train

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def deterministic_kernels() -> Iterator[None]:
    """cuDNN picks the same convolution algorithms in every run (its autotuner may not)."""
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _batches(name: str, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    workload = get_workload(name, "small")
    return [tuple(t.to(CUDA) for t in workload.batch(seed=s)) for s in range(steps)]  # type: ignore[misc]


def _plain(name: str) -> tuple[nn.Module, StepRecord, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The workload's model on the GPU and its plain record, checked to reproduce itself."""
    workload = get_workload(name, "small")
    model = workload.model(seed=0).to(CUDA)
    batches = _batches(name)
    record = train(copy.deepcopy(model), batches, workload.loss_fn)
    assert_records_equal(record, train(copy.deepcopy(model), batches, workload.loss_fn))
    return model, record, batches


# ---------------------------------------------------------------------------------------------
# Every engine, every workload
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"offload_to_cpu": True}], ids=["region", "inputs-off"])
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_region_engine_is_bit_exact(name: str, options: dict[str, Any]) -> None:
    workload = get_workload(name, "small")
    model, plain, batches = _plain(name)
    wrapped = remat.apply(copy.deepcopy(model), workload.block_types, **options)
    assert_records_equal(plain, train(wrapped, batches, workload.loss_fn))


POLICIES = {
    "recompute-everything": remat.policies.recompute_everything,
    "save-matmuls": remat.policies.save_matmuls,
    "offload-matmuls": remat.policies.offload_matmuls("host"),
}


@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_graph_engine_is_bit_exact(name: str, policy: Any) -> None:
    workload = get_workload(name, "small")
    model, plain, batches = _plain(name)
    wrapped = remat.apply(copy.deepcopy(model), workload.block_types, policy=policy)
    assert_records_equal(plain, train(wrapped, batches, workload.loss_fn))


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_autocast_bf16_regions_are_bit_exact(name: str) -> None:
    workload = get_workload(name, "small")
    model = workload.model(seed=0).to(CUDA)
    batches = _batches(name, 2)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return workload.loss_fn(out, target)

    class Cast(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> Any:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return self.inner(x)

    plain = train(Cast(copy.deepcopy(model)), batches, loss_fn)
    assert_records_equal(plain, train(Cast(copy.deepcopy(model)), batches, loss_fn))
    wrapped = Cast(remat.apply(copy.deepcopy(model), workload.block_types))
    assert_records_equal(plain, train(wrapped, batches, loss_fn))
    graph = Cast(
        remat.apply(copy.deepcopy(model), workload.block_types, policy=remat.policies.save_matmuls)
    )
    assert_records_equal(plain, train(graph, batches, loss_fn))


# ---------------------------------------------------------------------------------------------
# Random numbers on the accelerator
# ---------------------------------------------------------------------------------------------


def test_dropout_masks_replay_from_the_cuda_generator() -> None:
    """Without the replay the masks differ (torch's checkpoint shows it): the test can fail;
    remat's region without it raises."""
    x = torch.randn(64, 256, device=CUDA, requires_grad=True)

    def body(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(t.sin(), 0.5).cos()

    torch.manual_seed(0)
    plain = torch.autograd.grad(body(x).sum(), x)[0]
    torch.manual_seed(0)
    out = remat.checkpoint(body, x)
    torch.cuda.manual_seed(123)  # the loop draws from the generator before backward
    again = torch.autograd.grad(out.sum(), x)[0]
    assert torch.equal(plain, again)
    torch.manual_seed(0)
    out = torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False, preserve_rng_state=False)
    torch.cuda.manual_seed(123)
    assert not torch.equal(plain, torch.autograd.grad(out.sum(), x)[0])
    torch.manual_seed(0)
    out = remat.checkpoint(body, x, preserve_rng_state=False)
    torch.cuda.manual_seed(123)
    with pytest.raises(remat.CheckpointError, match="preserve_rng_state=False"):
        torch.autograd.grad(out.sum(), x)


def test_region_with_cpu_inputs_replays_its_cuda_draws() -> None:
    torch.cuda.init()
    x = torch.randn(32, 16, requires_grad=True)

    def body(t: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(32, 16, device=CUDA)
        return (t.to(CUDA) * noise).tanh().cpu()

    torch.manual_seed(1)
    plain = torch.autograd.grad(body(x).square().sum(), x)[0]
    torch.manual_seed(1)
    out = remat.checkpoint(body, x)
    state = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(7)
    torch.rand(4, device=CUDA)
    moved = torch.cuda.get_rng_state()
    grad = torch.autograd.grad(out.square().sum(), x)[0]
    assert torch.equal(plain, grad)
    assert torch.equal(torch.cuda.get_rng_state(), moved)  # the loop's generator is untouched
    assert not torch.equal(state, moved)


def test_a_cuda_generator_the_region_holds_replays() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.gen = torch.Generator(device=CUDA).manual_seed(5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return (h * torch.rand(h.shape, device=CUDA, generator=self.gen)).relu()

    torch.manual_seed(0)
    model = Noisy().to(CUDA)
    torch.manual_seed(0)
    twin = Noisy().to(CUDA)
    x = torch.randn(8, 16, device=CUDA)
    model(x).sum().backward()
    out = remat.checkpoint(twin, x)
    twin.gen.manual_seed(99)  # draws the loop makes before backward
    out.sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# State read and then written, on the device
# ---------------------------------------------------------------------------------------------


class RunningCenter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.drop = nn.Dropout(0.2)
        self.register_buffer("mean", torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = h - self.mean
        with torch.no_grad():
            self.mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return torch.tanh(self.drop(y))


@pytest.mark.parametrize("make", [RunningCenter, lambda: nn.BatchNorm1d(64, momentum=None)])
def test_state_read_then_written_replays_on_cuda(make: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), make(), nn.Linear(64, 64), make()).to(CUDA)
    batches = [(torch.randn(32, 64, device=CUDA), torch.randn(32, 64, device=CUDA))]
    batches *= 3

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).square().mean()

    plain = train(copy.deepcopy(model), batches, loss_fn)
    wrapped = remat.apply(copy.deepcopy(model), lambda name, m: name in ("1", "3"))
    assert_records_equal(plain, train(wrapped, batches, loss_fn))
    whole = remat.checkpoint_wrapper(copy.deepcopy(model))
    assert_records_equal(plain, train(whole, batches, loss_fn))


# ---------------------------------------------------------------------------------------------
# The host tier: pinned buffers, a copy stream
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def host() -> Iterator[HostTier]:
    tier = HostTier()
    with remat.store.tiers(host=tier):
        yield tier
    tier.close()


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_host_tier_is_bit_exact_through_pinned_buffers(name: str, host: HostTier) -> None:
    workload = get_workload(name, "small")
    model, plain, batches = _plain(name)
    twin = offloaded(copy.deepcopy(model), "host", min_bytes=0)
    assert_records_equal(plain, train(twin, batches, workload.loss_fn))
    assert host.pool.pin
    assert host.stats.copies_out > 10 and host.stats.copies_in >= host.stats.copies_out
    assert host.stats.bytes_in >= host.stats.bytes_out  # read twice: fetched twice
    # Empty ones (cuDNN's BatchNorm saves an empty reserve) have no memory to pin.
    buffers = [b for free in host.pool._free.values() for b in free if b.numel()]
    assert buffers and all(b.is_pinned() for b in buffers)


def test_host_tier_frees_device_memory_until_backward(host: HostTier) -> None:
    """What the forward saved lies in host memory: the device holds less after forward, by
    about the bytes that went out, and the gradients are the plain ones."""
    workload = get_workload("gpt", "small")
    model = workload.model(seed=0).to(CUDA)
    x, target = (t.to(CUDA) for t in workload.batch(seed=0))

    def after_forward(m: nn.Module) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(0)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = workload.loss_fn(m(x), target)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        return held, loss.detach(), [p.grad for p in m.parameters()]  # type: ignore[misc]

    held_plain, loss_plain, grads_plain = after_forward(copy.deepcopy(model))
    held, loss, grads = after_forward(offloaded(copy.deepcopy(model), "host", min_bytes=2**12))
    assert torch.equal(loss, loss_plain)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_plain, strict=True))
    assert host.stats.bytes_out > 0
    assert held_plain - held >= 0.9 * host.stats.bytes_out, (held_plain, held, host.stats)


def test_disk_tier_is_bit_exact_from_the_gpu(tmp_path: Any) -> None:
    tier = DiskTier(str(tmp_path))
    workload = get_workload("gpt", "small")
    model, plain, batches = _plain("gpt")
    with remat.store.tiers(disk=tier):
        twin = offloaded(copy.deepcopy(model), "disk", min_bytes=0)
        assert_records_equal(plain, train(twin, batches, workload.loss_fn))
    tier.close()


# ---------------------------------------------------------------------------------------------
# Memory figures from the caching allocator
# ---------------------------------------------------------------------------------------------


def test_memory_tracker_reads_the_caching_allocator() -> None:
    workload = get_workload("gpt", "small")
    model = workload.model(seed=0).to(CUDA)
    x, target = (t.to(CUDA) for t in workload.batch(seed=0))

    def step(m: nn.Module) -> None:
        torch.manual_seed(0)
        workload.loss_fn(m(x), target).backward()

    step(copy.deepcopy(model))  # the first step: cuBLAS's workspace and the like
    twin = copy.deepcopy(model)
    # Garbage from earlier tests, collected inside a measured step, frees more than the step
    # allocates: both steps run with the collector off.
    gc.collect()
    gc.disable()
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(twin)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        with remat.MemoryTracker(model) as tracker:
            step(model)
    finally:
        gc.enable()
    report = tracker.report()
    name = f"cuda:{torch.cuda.current_device()}"
    assert report.allocator_peak_bytes[name] == peak, (report.allocator_peak_bytes, peak)
    # The tracker's own books count storages; the allocator rounds blocks up and sees kernel
    # workspaces.
    assert 0 < report.peak_bytes[name] <= peak, (report.peak_bytes, peak)


def test_regions_lower_the_measured_peak() -> None:
    workload = get_workload("gpt", "medium")
    model = workload.model(seed=0).to(CUDA)
    x, target = (t.to(CUDA) for t in workload.batch(seed=0))

    def peak(m: nn.Module) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        workload.loss_fn(m(x), target).backward()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)

    plain = peak(copy.deepcopy(model))
    region = peak(remat.apply(copy.deepcopy(model), workload.block_types))
    assert region < 0.5 * plain, (region, plain)


# ---------------------------------------------------------------------------------------------
# The planner on the device
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "budget"), [("gpt", "50%"), ("convnet", "75%")])
def test_the_planner_plans_a_cuda_model_by_the_allocators_counters(name: str, budget: str) -> None:
    """``remat.plan`` on a model on the GPU: memory from the caching allocator's counters, each
    op timed by CUDA events. The plan fits its budget as measured, its prediction is within 3%
    of the plain step's peak of what it measured, planning leaves the CUDA generator as it
    was, and the plan trains bit for bit as the plain model does."""
    model, record, batches = _plain(name)
    workload = get_workload(name, "small")
    x, target = batches[0]

    def loss_fn(out: Any) -> torch.Tensor:
        return workload.loss_fn(out, target)

    blocks = [path for path, _ in workload.blocks(model)]
    rng = torch.cuda.get_rng_state()
    plan = remat.plan(model, x, budget, loss_fn, blocks=blocks, repeats=1)
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    verified = plan.measured["verified_peak"]
    assert verified <= plan.budget < plan.plain_peak
    assert abs(plan.predicted_peak - verified) <= 0.03 * plan.plain_peak, (plan.summary(), verified)
    assert any(b["option"] != "plain" for b in plan.blocks)
    assert plan.plain_seconds > 0 and plan.predicted_seconds >= plan.plain_seconds
    assert_records_equal(record, train(plan.apply(copy.deepcopy(model)), batches, workload.loss_fn))


def test_each_op_of_a_cuda_block_is_timed_on_the_device() -> None:
    from remat.planning.profile import profile_block

    workload = get_workload("gpt", "small")
    model = workload.model(seed=0).to(CUDA)
    _, block = workload.blocks(model)[0]
    x = torch.randn(2, 16, 32, device=CUDA, requires_grad=True)
    profile = profile_block(block, ((x,), {}), "block", CUDA, repeats=1)
    assert profile.ops and all(op.seconds > 0 for op in profile.ops)
    assert profile.forward_seconds > 0


# ---------------------------------------------------------------------------------------------
# remat bench's exactness column, on the device
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["convnet", "gpt"])
def test_the_bench_compares_steps_with_deterministic_kernels(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ConvNet's plain step does not reproduce itself with cuDNN's default algorithms, nor
    attention's with its default backward; the bench compares under deterministic kernels
    only, and finds remat's steps exact and torch's checkpoint writing BatchNorm's statistics
    twice, outside the fixture that asks for cuDNN's deterministic algorithms here."""
    from remat.bench import measure

    for key, value in measure.CUBLAS_DETERMINISTIC.items():
        monkeypatch.setenv(key, value)
    torch.backends.cudnn.deterministic = False
    workload = get_workload(name, "small")
    remat_block = measure.memory(workload, "remat-block", 0, CUDA)
    torch_block = measure.memory(workload, "torch-block", 0, CUDA)
    buffers = None if name == "gpt" else True
    assert (remat_block["grads_equal"], remat_block["buffers_equal"]) == (True, buffers)
    torch_buffers = None if name == "gpt" else False
    assert (torch_block["grads_equal"], torch_block["buffers_equal"]) == (True, torch_buffers)
    assert not torch.backends.cudnn.deterministic
    assert not torch.are_deterministic_algorithms_enabled()


# ---------------------------------------------------------------------------------------------
# Hugging Face, on the device
# ---------------------------------------------------------------------------------------------


def test_hugging_face_llama_with_attention_dropout_is_bit_exact() -> None:
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        attention_dropout=0.1,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).to(CUDA).train()
    tokens = torch.randint(0, 128, (2, 16), device=CUDA)

    def grads(m: nn.Module) -> list[torch.Tensor]:
        torch.manual_seed(3)
        m(input_ids=tokens, labels=tokens).loss.backward()
        return [p.grad.clone() for p in m.parameters() if p.grad is not None]  # type: ignore[union-attr]

    plain = grads(copy.deepcopy(model))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads(copy.deepcopy(model)), strict=True))
    twin = copy.deepcopy(model)
    remat.hf.enable(twin)
    got = grads(twin)
    assert len(got) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
