"""remat.explain: one row per saved tensor, with module, producer, size and remat's decision."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import policies
from remat.explain import SavedTensorReport, explain
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
    activations = [r for r in inside if r.kind != "parameter"]
    assert activations and {(r.decision, r.how) for r in activations} == {
        ("recompute", "region engine")
    }
    assert {(r.decision, r.how) for r in inside if r.kind == "parameter"} == {
        ("keep", "region engine: a parameter, held by the model")
    }
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
    text = report.to_json()
    assert isinstance(text, str) and json.loads(text) == json.loads(json.dumps(report.to_dict()))
    data = report.to_dict()
    assert len(data["rows"]) == len(report.rows) and data["kept_bytes"] == report.kept_bytes
    text = report.table(limit=2)
    assert "totals by module" in text and "more rows" in text and "gelu" in str(report)


def test_explain_a_plain_function() -> None:
    w = torch.randn(3, 3, requires_grad=True)
    report = explain(lambda x: (x @ w).sin(), torch.randn(2, 3))
    assert [(r.op, r.kind) for r in report.rows] == [("input", "input"), ("mm", "activation")]


def test_a_function_running_one_model_has_its_rows_named_by_that_model() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    of_model = [(r.module, r.op) for r in explain(model, x).rows]
    of_function = [(r.module, r.op) for r in explain(lambda t: model(t).sin(), x).rows]
    assert of_function == [*of_model, ("", "addmm")]  # sin saves the model's output
    assert {m for m, _ in of_model} == {"0", "1", "2"}


def test_bad_input() -> None:
    with pytest.raises(remat.RematError, match="expected a module or a function, got int"):
        explain(3)  # type: ignore[arg-type]
    report = explain(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(remat.RematError, match="cannot sort by 'size'"):
        report.sorted("size")  # type: ignore[arg-type]
    # A forward pass under inference mode saves nothing: an empty report would mislead.
    with torch.inference_mode(), pytest.raises(remat.RematError, match="inference_mode"):
        explain(nn.Linear(2, 2), torch.randn(1, 2))


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


# ---------------------------------------------------------------------------------------------
# What the engines do, told truly
# ---------------------------------------------------------------------------------------------

_POLICIES = {
    "save_everything": policies.save_everything,
    "recompute_everything": policies.recompute_everything,
    "save_matmuls": policies.save_matmuls,
    "save_smaller_than": policies.save_smaller_than(4096),
    "recompute_attention_core": policies.recompute_attention_core,
    "save_tagged": policies.save_tagged("none"),
    "offload_everything": policies.offload_everything("host"),
    "offload_matmuls": policies.offload_matmuls("host"),
}


def _gpt(policy: Any = None) -> tuple[nn.Module, torch.Tensor]:
    workload = get_workload("gpt", "small")
    model = workload.model(seed=0)
    if policy is not None:
        remat.apply(model, workload.block_types, policy=policy)
    x, _ = workload.batch(seed=0)
    return model, x


@functools.cache
def _plain_gpt_report() -> SavedTensorReport:
    return explain(*_gpt())


def _held_after_forward(model: nn.Module, x: torch.Tensor) -> int:
    """What the forward pass leaves allocated besides its output, by the tracker's books."""
    with remat.MemoryTracker(model) as tracker:
        out = model(x)
        held = tracker.live_bytes() - out.nbytes
        del out
    return held


def _unique(report: SavedTensorReport, decision: str, kind: str = "activation") -> int:
    return sum(
        r.storage_bytes
        for r in report.rows
        if r.decision == decision and r.kind == kind and not r.shared
    )


@pytest.mark.parametrize("name", list(_POLICIES))
def test_kept_bytes_are_what_the_forward_pass_leaves_allocated_under_each_policy(
    name: str,
) -> None:
    model, x = _gpt(_POLICIES[name])
    # On the CPU the host tier keeps what the offload policies send it, and says so.
    kept_in_place = (
        pytest.warns(UserWarning, match="on the CPU, in host memory already")
        if name.startswith("offload")
        else contextlib.nullcontext()
    )
    with kept_in_place:
        report = explain(model, x)
        held = _held_after_forward(model, x)
    # The token ids were allocated before the tracker started: it does not count them.
    assert report.kept_bytes - _unique(report, "keep", "input") == held
    # Every storage a plain run saves is kept, recomputed or offloaded; the engine may hold
    # more than that (results it replays saved tensors from), never less.
    plain = _plain_gpt_report()
    extra = sum(r.storage_bytes for r in report.rows if "held to rebuild" in r.how and not r.shared)
    assert plain.kept_bytes == (
        report.kept_bytes + report.recomputed_bytes + report.offloaded_bytes - extra
    )
    assert not [r for r in report.rows if r.kind == "parameter" and r.decision != "keep"]


def test_save_matmuls_keeps_the_matmul_results_that_recompute_everything_rebuilds() -> None:
    everything = explain(*_gpt(policies.recompute_everything))
    matmuls = explain(*_gpt(policies.save_matmuls))
    assert matmuls.kept_bytes > everything.kept_bytes
    # What save_matmuls keeps besides what recompute_everything keeps: the four linear layers'
    # (B*T, out) results per block, 2*16*(96 + 32 + 128 + 32) floats, and the attention
    # kernel's output and its logsumexp-free math path results are not among them on CPU.
    linear = 2 * 16 * (96 + 32 + 128 + 32) * 4
    addmm = [r for r in matmuls.rows if r.op == "addmm" and r.kind == "activation"]
    assert addmm and {r.decision for r in addmm} == {"keep"}
    assert {r.decision for r in everything.rows if r.op == "addmm"} == {"recompute"}
    assert matmuls.kept_bytes - everything.kept_bytes >= 4 * linear


def test_offloaded_bytes_are_what_the_disk_tier_stores(tmp_path: Any) -> None:
    model, x = _gpt(policies.offload_matmuls("disk"))
    with remat.store.tiers(disk=remat.store.DiskTier(tmp_path)):
        report = explain(model, x)
        store = remat.store.scope.store_for("disk")
        before = store.stored_bytes
        out = model(x)
        stored = store.stored_bytes - before
        del out
    assert report.offloaded_bytes == stored > 0
    assert {r.decision for r in report.rows if r.op == "addmm"} == {"offload"}


def test_explain_leaves_nothing_offloaded_behind(tmp_path: Any) -> None:
    """What the regions offload during ``explain`` goes with its forward, without
    ``gc.collect()``: the explainer's hook, in every saved variable, once held the graph
    engine's records in a cycle through autograd's nodes, and the files stayed."""
    model, x = _gpt(policies.offload_matmuls("disk"))
    with remat.store.tiers(disk=remat.store.DiskTier(tmp_path)):
        store = remat.store.scope.store_for("disk")
        gc.disable()
        try:
            for _ in range(2):
                assert explain(model, x).offloaded_bytes > 0
                assert store.stored_bytes == 0
        finally:
            gc.enable()


def test_parameters_saved_in_a_region_are_held_not_recomputed() -> None:
    for policy in (None, policies.recompute_everything, policies.save_everything):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        remat.checkpoint_wrapper(model[0], policy=policy)
        report = explain(model, torch.randn(2, 4, requires_grad=True))
        params = [r for r in report.rows if r.kind == "parameter"]
        assert params and {r.decision for r in params} == {"keep"}
        # The engine's kept ``weight.t()`` is the parameter's storage, not an activation.
        assert not [r for r in report.rows if "held to rebuild" in r.how]
        assert {r.how for r in report.rows if r.kind == "input"} <= {
            "region input",
            "graph engine, the region's input",
            "region engine",
        }


def test_a_result_the_engine_keeps_for_a_replay_is_listed() -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x @ w  # kept by save_matmuls; no backward formula saves it
        return (h * 2).sin()  # sin saves h * 2, rebuilt from h

    x = torch.randn(3, 4, requires_grad=True)
    report = explain(lambda x: remat.checkpoint(f, x, policy=policies.save_matmuls), x)
    rows = [(r.op, r.decision, r.how) for r in report.rows if r.kind == "activation"]
    assert rows == [
        ("mul", "recompute", "graph engine"),
        ("mm", "keep", "graph engine, held to rebuild saved tensors"),
    ]
    # x (mm saves it, as the region's input), w (mm saves it too) and h.
    assert report.kept_bytes == 3 * 4 * 4 + 4 * 4 * 4 + 3 * 4 * 4


# ---------------------------------------------------------------------------------------------
# The table and the export
# ---------------------------------------------------------------------------------------------


def test_a_table_of_nothing_saved() -> None:
    report = explain(lambda x: x + 1, torch.randn(2))
    assert report.rows == []
    text = report.table()
    assert "(nothing saved for backward)" in text and "total: kept 0.000 MiB" in text
    assert report.table(limit=0) == text


def test_limit_caps_rows_and_modules_and_rejects_negatives() -> None:
    model, x = _gpt()
    report = explain(model, x)
    modules = len(report.by_module())
    assert len(report.rows) > 3 and modules > 3
    text = report.table(limit=3)
    lines = text.splitlines()
    assert len(lines) == 1 + 3 + 1 + 1 + 1 + 1 + 3 + 1 + 1
    assert f"... {len(report.rows) - 3} more rows" in text
    assert f"... {modules - 3} more modules" in text
    none = report.table(limit=0).splitlines()
    assert none[1] == f"... {len(report.rows)} more rows" and len(none) == 7
    assert len(report.table().splitlines()) == 1 + len(report.rows) + 1 + 1 + 1 + modules + 1
    for bad in (-1, 1.5, True):
        with pytest.raises(remat.RematError, match=r"table\(limit=.*\): expected a number of rows"):
            report.table(limit=bad)  # type: ignore[arg-type]


def test_a_compiled_model_is_explained_through_the_module_it_wraps() -> None:
    """``remat.explain(torch.compile(model), x)`` reports the eager forward, row for row as
    ``remat.explain(model, x)`` does, and compiles nothing."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 4))
    remat.apply(model, lambda name, m: name == "1")
    x = torch.randn(3, 8)
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter)
    expected, got = explain(model, x), explain(compiled, x)
    assert counter.frame_count == 0
    assert [(r.module, r.op, r.bytes, r.decision) for r in got.rows] == [
        (r.module, r.op, r.bytes, r.decision) for r in expected.rows
    ]
    assert any(r.decision == "recompute" for r in got.rows)
    torch._dynamo.reset()


class _Noisy(nn.Module):
    """Draws from a generator it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.g = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h + 0.1 * torch.randn(h.shape, generator=self.g)


def test_explaining_leaves_the_generators_a_model_holds_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Noisy())
    remat.apply(model, _Noisy)
    untouched = copy.deepcopy(model)
    x = torch.randn(4, 8)
    explain(model, x)
    assert torch.equal(model[0].g.get_state(), untouched[0].g.get_state())
    for m in (untouched, model):
        m(x).square().sum().backward()
    for p, q in zip(untouched.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _Rotary(nn.Module):
    """Multiplies by a table it holds as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("cos", torch.randn(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.cos


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "region"])
def test_buffers_saved_for_backward_are_the_models_not_activations(wrapped: bool) -> None:
    model = nn.Sequential(_Rotary(), _Rotary())
    if wrapped:
        remat.apply(model, _Rotary)
    x = torch.randn(2, 32, 16)
    report = explain(model, x)
    tables = [r for r in report.rows if r.shape == (32, 16) and r.kind == "buffer"]
    # each block's product saves its buffer: held by the model, kept whatever remat does
    assert len(tables) == 2
    assert all(r.decision == "keep" for r in report.rows if r.kind == "buffer")
    assert not [r for r in report.rows if r.op == "set_"]
    with remat.MemoryTracker(model) as tracker:
        out = model(x)
        del out
    assert report.kept_bytes == tracker.report().saved_bytes
    assert report.kept_bytes == sum(t.kept_bytes for t in report.by_module().values())
    # wrapped, all a block saves is its input and the model's own tensors: nothing to rebuild
    assert report.recomputed_bytes == 0


def test_explaining_between_a_forward_and_its_backward_leaves_that_backward_working() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8)
    loss = model(x).sum()
    explain(model, x)  # BatchNorm's statistics are put back, and so are their versions
    loss.backward()
    plain(x).sum().backward()
    assert [b._version for b in model.buffers()] == [b._version for b in plain.buffers()]
    for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _Bank(nn.Module):
    """Replaces a buffer with a new tensor each call and fills one registered as None."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("bank", torch.zeros(0, 4))
        self.register_buffer("last", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.bank = torch.cat([self.bank, h.detach()])[-16:]
        self.last = h.detach().clone()
        self.register_buffer("made", torch.ones(1))
        return h


def test_explaining_puts_back_buffers_the_forward_replaced_or_registered() -> None:
    model = _Bank()
    bank = model.bank
    explain(model, torch.randn(2, 4))
    assert model.bank is bank and model.bank.shape == (0, 4)
    assert model.last is None
    assert "made" not in dict(model.named_buffers())
    assert list(model.state_dict()) == ["bank", "lin.weight", "lin.bias"]


def test_a_function_explained_is_put_back_through_the_model_it_reaches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    report = explain(lambda x: nn.functional.cross_entropy(model(x), y), x)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    weights = [r for r in report.rows if r.shape == (8, 2)]  # the head's weight, transposed
    assert weights and all(r.kind == "parameter" for r in weights)
    with remat.MemoryTracker(model) as tracker:
        nn.functional.cross_entropy(model(x), y)
    assert report.kept_bytes == tracker.report().saved_bytes
