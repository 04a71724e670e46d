"""Every built-in workload, every option: bit-equal to a plain run, and what backward holds."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.workloads import GPT, WORKLOAD_NAMES, GPTBlock, GPTConfig, get_workload

from helpers import assert_records_equal, train

OPTION_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "no-early-stop": {"early_stop": False},
    "no-determinism-check": {"determinism_check": "none"},
    "debug": {"debug": True},
    "offload-inputs": {"offload_to_cpu": True},
    "context-fn": {"context_fn": lambda: (torch.enable_grad(), torch.enable_grad())},
}


def _batches(name: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    workload = get_workload(name, "small")
    return [workload.batch(seed=s) for s in range(steps)]


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_every_block_checkpointed_is_bit_exact_over_three_steps(
    name: str, options: dict[str, Any]
) -> None:
    workload = get_workload(name, "small")
    plain = workload.model(seed=0)
    wrapped = remat.apply(copy.deepcopy(plain), workload.block_types, **options)
    batches = _batches(name, 3)
    assert_records_equal(
        train(plain, batches, workload.loss_fn), train(wrapped, batches, workload.loss_fn)
    )


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_whole_model_in_one_region_is_bit_exact(name: str) -> None:
    workload = get_workload(name, "small")
    plain = workload.model(seed=0)
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(plain))
    batches = _batches(name, 3)
    assert_records_equal(
        train(plain, batches, workload.loss_fn), train(wrapped, batches, workload.loss_fn)
    )


def test_mlp_checkpoint_sequential_is_bit_exact() -> None:
    workload = get_workload("mlp", "small")
    plain = workload.model(seed=0)
    twin = copy.deepcopy(plain)
    assert isinstance(twin, nn.Sequential)

    class Segmented(nn.Module):
        def __init__(self, seq: nn.Sequential) -> None:
            super().__init__()
            self.seq = seq

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = remat.checkpoint_sequential(self.seq, 2, x)
            return out

    batches = _batches("mlp", 3)
    plain_record = train(plain, batches, workload.loss_fn)
    segmented = train(Segmented(twin), batches, workload.loss_fn)
    segmented.param_grads = [{k[4:]: v for k, v in g.items()} for g in segmented.param_grads]
    segmented.params = [{k[4:]: v for k, v in g.items()} for g in segmented.params]
    segmented.buffers = [{k[4:]: v for k, v in g.items()} for g in segmented.buffers]
    assert_records_equal(plain_record, segmented)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_each_checkpointed_block_forward_body_runs_twice(name: str) -> None:
    # Hooks on the block itself run outside its region; its children run inside it, once in
    # forward and once in the recompute.
    workload = get_workload(name, "small")
    model = remat.apply(workload.model(seed=0), workload.block_types)
    runs: dict[str, list[tuple[bool, bool]]] = {}
    for block_name, block in workload.blocks(model):
        for sub in block.children():
            sub.register_forward_pre_hook(
                lambda m, a, n=block_name: runs.setdefault(n, []).append(
                    (remat.is_checkpointing(), remat.is_recomputing())
                )
            )
    x, target = workload.batch(seed=0)
    loss = workload.loss_fn(model(x), target)
    forward_counts = {n: len(v) for n, v in runs.items()}
    loss.backward()
    for block_name, seen in runs.items():
        per_run = forward_counts[block_name]
        assert len(seen) == 2 * per_run, block_name
        assert seen[:per_run] == [(True, False)] * per_run
        assert seen[per_run:] == [(False, True)] * per_run


# -- bytes held between forward and backward ----------------------------------------------------


def _live_after_forward(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> int:
    """Allocator bytes allocated during forward and still live when backward would start."""
    from torch.profiler import ProfilerActivity, profile

    holder: list[torch.Tensor] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = model(x)
        holder.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()))
        del logits
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = sum(e.nbytes() for e in events)
    holder[0].backward()
    return live


def _expected_bytes(model: GPT, x: torch.Tensor, target: torch.Tensor) -> int:
    """Block inputs plus what ops outside the blocks save, in a plain run, by unique storage."""
    storages: dict[int, int] = {}
    inside = [0]

    def enter(m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        inside[0] += 1
        storages[args[0].untyped_storage().data_ptr()] = args[0].untyped_storage().nbytes()

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        inside[0] -= 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not inside[0] and not isinstance(t, nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    handles = []
    for block in model.blocks:
        handles.append(block.register_forward_pre_hook(enter))
        handles.append(block.register_forward_hook(leave))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    for h in handles:
        h.remove()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    loss.backward()
    return sum(n for ptr, n in storages.items() if ptr not in params)


def test_bytes_held_for_backward_are_block_inputs_plus_outside() -> None:
    config = GPTConfig(vocab_size=512, seq_len=256, d_model=256, n_heads=4, n_layers=4, dropout=0.1)
    torch.manual_seed(0)
    plain = GPT(config)
    x = torch.randint(0, 512, (2, 256))
    target = torch.randint(0, 512, (2, 256))
    expected = _expected_bytes(plain, x, target)
    wrapped = remat.apply(copy.deepcopy(plain), GPTBlock)
    held = _live_after_forward(wrapped, x, target)
    plain_held = _live_after_forward(plain, x, target)
    assert abs(held - expected) <= 0.05 * expected, (held, expected)
    assert held < 0.25 * plain_held, (held, plain_held)
