"""remat.explain: one row per saved tensor, with module, producer, size and remat's decision."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import remat
from remat.explain import explain
from remat.workloads import get_workload


def _count_saves(fn, *args) -> int:  # type: ignore[no-untyped-def]
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return count[0]


def test_rows_of_a_small_chain() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 8, requires_grad=True)
    report = explain(model, x)
    got = [(r.module, r.op, r.kind, r.shape, r.decision, r.how) for r in report.rows]
    assert got == [
        ("0", "input", "input", (3, 8), "keep", "autograd"),
        ("0", "parameter", "parameter", (8, 4), "keep", "autograd"),
        ("1", "relu", "activation", (3, 4), "keep", "autograd"),
        ("2", "relu", "activation", (3, 4), "keep", "autograd"),
        ("2", "parameter", "parameter", (4, 2), "keep", "autograd"),
    ]
    # x and relu's output, each once; parameters are not activations.
    assert report.kept_bytes == 3 * 8 * 4 + 3 * 4 * 4
    assert [r.shared for r in report.rows] == [False, False, False, True, False]


def test_one_row_per_saved_tensor_on_the_gpt_with_module_names() -> None:
    workload = get_workload("gpt", "small")
    model = workload.model(seed=0)
    x, _ = workload.batch(seed=0)
    report = explain(model, x)
    assert len(report.rows) == _count_saves(model, x)
    modules = {name for name, _ in model.named_modules()}
    assert {r.module for r in report.rows} <= modules
    assert "blocks.0.attn" in {r.module for r in report.rows}
    assert {r.decision for r in report.rows} == {"keep"}
    assert report.recomputed_bytes == 0


def test_checkpointed_blocks_are_recomputed_and_their_inputs_kept() -> None:
    workload = get_workload("gpt", "small")
    plain = workload.model(seed=0)
    x, _ = workload.batch(seed=0)
    before = explain(plain, x)
    model = remat.apply(workload.model(seed=0), workload.block_types)
    after = explain(model, x)
    inside = [r for r in after.rows if r.module.startswith("blocks.") and "." in r.module[7:]]
    assert inside and {(r.decision, r.how) for r in inside} == {("recompute", "region engine")}
    inputs = [r for r in after.rows if r.how == "region input"]
    assert [r.module for r in inputs] == [f"blocks.{i}" for i in range(4)]
    assert {r.decision for r in inputs} == {"keep"}
    # What a plain run keeps is what remat keeps plus what it recomputes, storage for storage.
    assert before.kept_bytes == after.kept_bytes + after.recomputed_bytes
    block_input = 2 * 16 * 32 * 4
    outside = sum(
        t.kept_bytes for name, t in before.by_module().items() if not name.startswith("blocks.")
    )
    assert after.kept_bytes == 4 * block_input + outside


def test_offload_inputs_on_cpu_are_reported_as_kept_in_host_memory() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    remat.checkpoint_wrapper(model[0], offload_to_cpu=True)
    report = explain(model, torch.randn(2, 4, requires_grad=True))
    assert report.rows[0].how == "not offloaded: already in host memory"


def test_explain_changes_neither_buffers_nor_random_state() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    explain(model, x)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_sorting_json_and_table() -> None:
    model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 2))
    report = explain(model, torch.randn(5, 8))
    by_size = report.sorted("bytes")
    assert [r.bytes for r in by_size.rows] == sorted((r.bytes for r in report.rows), reverse=True)
    assert report.sorted("order").rows == report.rows
    data = json.loads(report.dumps())
    assert len(data["rows"]) == len(report.rows) and data["kept_bytes"] == report.kept_bytes
    text = report.table(limit=2)
    assert "totals by module" in text and "more rows" in text and "gelu" in str(report)


def test_explain_a_plain_function() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    report = explain(lambda x: (x @ w).sin(), torch.randn(2, 3))
    assert [(r.op, r.kind) for r in report.rows] == [("input", "input"), ("mm", "activation")]


def test_bad_input() -> None:
    with pytest.raises(remat.RematError, match="expected a module or a function, got int"):
        explain(3)  # type: ignore[arg-type]
    report = explain(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(remat.RematError, match="cannot sort by 'size'"):
        report.sorted("size")  # type: ignore[arg-type]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_explain_total_equals_the_trackers_saved_bytes(checkpointed: bool) -> None:
    workload = get_workload("gpt", "small")
    model = workload.model(seed=0)
    if checkpointed:
        remat.apply(model, workload.block_types)
    x, _ = workload.batch(seed=0)
    report = explain(model, x)
    with remat.MemoryTracker(model) as tracker:
        model(x)
    assert report.kept_bytes == tracker.report().saved_bytes > 0
