"""remat.MemoryTracker: exact bytes on hand-built cases, and agreement with the profiler."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.bench.measure import peak_step_bytes
from remat.track import MemoryReport, MemoryTracker, ModelState
from remat.workloads import get_workload

F32 = 4  # bytes per float32 element
CPU = torch.device("cpu")


def _linear_bytes(fan_in: int, fan_out: int) -> int:
    return (fan_in * fan_out + fan_out) * F32


# -- saved tensors ---------------------------------------------------------------------------


def test_linear_saves_its_input_and_the_weight_apart() -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    with MemoryTracker(model) as tracker:
        out = model(x)
        loss = out.sum()
        loss.backward()
    report = tracker.report()

    # addmm(bias, x, weight.t()) saves mat1 = x and mat2 = weight.t(), a view of the weight's
    # storage: a parameter, reported apart and not as activation bytes.
    assert report.saved_bytes == 16 * 64 * F32
    assert report.saved_param_bytes == 32 * 64 * F32
    assert report.saved_tensors == 2
    assert report.saved_bytes_by_module == {"": 16 * 64 * F32}
    assert report.saved_bytes_by_op == {"<input>": 16 * 64 * F32}  # x was made before entry

    # Six storages are allocated and none is freed before the last one appears: the output
    # (16x32), the loss (scalar), backward's seed gradient (ones_like, a scalar that the
    # expanded gradient of sum() keeps alive until AddmmBackward is done), x.grad (16x64),
    # weight.grad (32x64) and bias.grad (32).
    out_b, scalar_b, x_grad_b = 16 * 32 * F32, F32, 16 * 64 * F32
    weight_grad_b, bias_grad_b = 32 * 64 * F32, 32 * F32
    assert report.peak_bytes == {
        "cpu": out_b + 2 * scalar_b + x_grad_b + weight_grad_b + bias_grad_b
    }
    assert report.peak_bytes["cpu"] == 14472
    # The seed is freed at the end of backward; out and loss are still referenced.
    assert report.end_bytes == {"cpu": 14472 - scalar_b}
    # Gradients of parameters are model state; x.grad is not a parameter's gradient.
    assert report.activation_peak_bytes == {"cpu": out_b + 2 * scalar_b + x_grad_b}
    assert report.allocations == {"cpu": 6}
    assert report.state_at_entry == ModelState(params_bytes=_linear_bytes(64, 32))
    assert report.state_at_exit == ModelState(
        params_bytes=_linear_bytes(64, 32), grads_bytes=_linear_bytes(64, 32)
    )


def test_chain_of_linears_saved_bytes_by_module() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    x = torch.randn(5, 8)
    with MemoryTracker(model) as tracker:
        model(x).sum().backward()
    report = tracker.report()

    # "0" saves x for its weight's gradient; each ReLU saves its output, which the next Linear
    # saves again as its input: one storage, counted once, where it was first saved.
    assert report.saved_bytes_by_module == {"3": 5 * 32 * F32, "1": 5 * 16 * F32, "0": 5 * 8 * F32}
    assert report.saved_bytes == (5 * 32 + 5 * 16 + 5 * 8) * F32
    assert report.saved_bytes_by_op == {"relu": (5 * 32 + 5 * 16) * F32, "<input>": 5 * 8 * F32}
    # "0" has an input that needs no gradient, so its weight is not saved; "2" and "4" are.
    assert report.saved_param_bytes == (16 * 32 + 32 * 4) * F32


def test_views_of_one_storage_count_once() -> None:
    x = torch.randn(4, 6, requires_grad=True)
    with MemoryTracker() as tracker:
        y = x.exp()  # saves its result
        a = y[:, :2]
        b = y.view(-1)
        out = a.sin().sum() + b.cos().sum()  # sin and cos save their inputs: views of y
    report = tracker.report()
    assert report.saved_tensors == 3
    assert report.saved_bytes == 4 * 6 * F32
    assert report.saved_bytes_by_op == {"exp": 4 * 6 * F32}
    assert report.saved_bytes_by_module == {"<outside>": 4 * 6 * F32}
    del out


def test_checkpointed_region_saves_only_its_inputs() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with MemoryTracker(block) as tracker:
        remat.checkpoint(block, x).sum().backward()
    report = tracker.report()
    # Everything saved inside goes to remat's own hooks; the region's input reaches ours.
    assert report.saved_bytes == 4 * 8 * F32
    assert report.saved_bytes_by_module == {"<outside>": 4 * 8 * F32}
    assert report.saved_param_bytes == 0

    with MemoryTracker(block) as plain:
        block(x).sum().backward()
    assert plain.report().saved_bytes == (4 * 8 + 4 * 16) * F32  # x, and the ReLU's output


def test_wrapped_block_saved_bytes_are_block_inputs_plus_outside_saves() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    model = nn.Sequential(nn.Linear(8, 16), remat.checkpoint_wrapper(inner), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    with MemoryTracker(model) as tracker:
        model(x).sum().backward()
    report = tracker.report()
    assert report.saved_bytes_by_module == {
        "0": 4 * 8 * F32,  # x
        "1": 4 * 16 * F32,  # the region's input, the output of "0"
        "2": 4 * 16 * F32,  # the region's output, made by its last ReLU
    }
    assert report.saved_bytes_by_op == {
        "addmm": 4 * 16 * F32,
        "relu": 4 * 16 * F32,
        "<input>": 4 * 8 * F32,
    }


def test_recompute_is_counted_like_any_operator_and_matches_the_profiler() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    # No random state: the generator state a region keeps is made outside the dispatcher.
    block = remat.checkpoint_wrapper(inner, preserve_rng_state=False)
    model = nn.Sequential(nn.Linear(32, 64), block, nn.Linear(64, 8))
    x, y = torch.randn(16, 32), torch.randn(16, 8)

    def step() -> None:
        F.mse_loss(model(x), y).backward()

    step()  # warm-up: gradients exist and are accumulated into in place
    expected = peak_step_bytes(step, CPU)
    with MemoryTracker(model) as tracker:
        step()
    report = tracker.report()
    assert report.peak_bytes == {"cpu": expected}
    relus = [(s.module, s.delta_bytes) for s in report.timeline if s.op == "relu"]
    made = [module for module, delta in relus if delta > 0]
    assert made == ["1.0", "1.2", "<recompute>", "<recompute>"]
    assert report.end_bytes == {"cpu": 0}


def test_every_gpt_block_checkpointed_saves_block_inputs() -> None:
    workload = get_workload("gpt", "small")
    model = remat.apply(workload.model(0), workload.block_types)
    tokens, target = workload.batch(0)
    with MemoryTracker(model) as tracker:
        workload.loss_fn(model(tokens), target).backward()
    report = tracker.report()
    block_input = 2 * 16 * 32 * F32  # batch 2, seq 16, d_model 32
    for i in range(4):
        assert report.saved_bytes_by_module[f"blocks.{i}"] == block_input
    assert not any(name.startswith("blocks.0.") for name in report.saved_bytes_by_module)
    assert sum(report.saved_bytes_by_module.values()) == report.saved_bytes


def test_gpt_saved_bytes_by_module_and_op_add_up() -> None:
    workload = get_workload("gpt", "small")
    model = workload.model(0)
    tokens, target = workload.batch(0)
    with MemoryTracker(model) as tracker:
        workload.loss_fn(model(tokens), target).backward()
    report = tracker.report()
    names = dict(model.named_modules())
    assert set(report.saved_bytes_by_module) <= {*names, "<outside>"}
    for i in range(4):
        for sub in ("attn", "ln1", "ln2", "mlp.0", "mlp.1", "mlp.2"):
            assert report.saved_bytes_by_module[f"blocks.{i}.{sub}"] > 0
    assert "<outside>" in report.saved_bytes_by_module  # the loss
    assert sum(report.saved_bytes_by_module.values()) == report.saved_bytes
    assert sum(report.saved_bytes_by_op.values()) == report.saved_bytes
    assert report.saved_bytes > 0
    # Embedding lookups save their int64 indices: tokens (2x16) and positions (16).
    assert report.saved_bytes_by_module["tok_emb"] == 2 * 16 * 8
    assert report.saved_bytes_by_module["pos_emb"] == 16 * 8
    # Every weight matrix the linears multiply by is saved: parameters, kept apart.
    assert report.saved_param_bytes > 0
    assert list(report.saved_bytes_by_module.values()) == sorted(
        report.saved_bytes_by_module.values(), reverse=True
    )


# -- live bytes ------------------------------------------------------------------------------


def test_state_a_recompute_writes_and_puts_back_is_counted_both_ways() -> None:
    """A region with BatchNorm recomputes unguarded and puts back the running statistics it
    wrote (NOTE [ Writes undone ] in ``_guard.py``): the copies it keeps meanwhile are counted
    when made and when freed, so the step ends at the level it started from and its peak is
    the profiler's. (Copies made outside any operator showed only as frees: the step ended
    520 bytes below its start.)"""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU())
    block = remat.checkpoint_wrapper(inner, preserve_rng_state=False)
    model = nn.Sequential(block, nn.Linear(64, 8))
    x, y = torch.randn(16, 32), torch.randn(16, 8)

    def step() -> None:
        F.mse_loss(model(x), y).backward()

    step()  # warm-up: gradients exist, and the first recompute ran under the guard
    expected = peak_step_bytes(step, CPU)
    with MemoryTracker(model) as tracker:
        step()
    report = tracker.report()
    # running mean, var and count, copied into one allocation of 520 bytes and freed with it
    copies = [s.delta_bytes for s in report.timeline if s.op == "empty"]
    assert copies == [2 * 256 + 8, -(2 * 256 + 8)]
    assert report.end_bytes == {"cpu": 0}
    assert report.peak_bytes == {"cpu": expected}


def test_live_bytes_return_to_entry_level_after_del() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(16, 32, requires_grad=True)
    with MemoryTracker(model) as tracker:
        out = model(x)
        loss = out.square().mean()
        assert tracker.live_bytes("cpu") > 0
        loss.backward()
        del out, loss
        x.grad = None
        model.zero_grad(set_to_none=True)
        assert tracker.live_bytes() == 0
    report = tracker.report()
    assert report.end_bytes == {"cpu": 0}
    assert report.timeline[-1].live_bytes == 0
    assert max(s.live_bytes for s in report.timeline) == report.peak_bytes["cpu"]
    assert report.allocated_bytes["cpu"] == sum(
        s.delta_bytes for s in report.timeline if s.delta_bytes > 0
    )


def test_peak_matches_the_profiler_on_an_mlp_step() -> None:
    # The profiler sees every allocation and free of the CPU allocator; the tracker sees the
    # storages operators return. On this step no kernel allocates scratch memory of its own
    # and no storage is made outside the dispatcher, so the two agree to the byte. Where they
    # differ (e.g. LayerNorm's backward kernel, remat's saved random states) the tracker is
    # lower by what only the profiler can see; see NOTE [ Counting storages ].
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )
    x, y = torch.randn(16, 32), torch.randn(16, 8)

    def step() -> None:
        F.mse_loss(model(x), y).backward()

    step()
    expected = peak_step_bytes(step, CPU)
    with MemoryTracker(model) as tracker:
        step()
    report = tracker.report()
    assert report.peak_bytes == {"cpu": expected}
    assert report.end_bytes == {"cpu": 0}
    assert report.activation_peak_bytes == report.peak_bytes  # gradients were accumulated


def test_gpt_peak_matches_the_profiler() -> None:
    workload = get_workload("gpt", "small")
    model = workload.model(0)
    tokens, target = workload.batch(0)

    def step() -> None:
        torch.manual_seed(0)
        workload.loss_fn(model(tokens), target).backward()

    step()
    expected = peak_step_bytes(step, CPU)
    with MemoryTracker(model) as tracker:
        step()
    assert tracker.report().peak_bytes == {"cpu": expected}


def test_frees_of_known_older_storages_lower_the_level() -> None:
    model = nn.Linear(64, 32)
    model(torch.randn(16, 64)).sum().backward()
    with MemoryTracker(model) as tracker:
        model.zero_grad(set_to_none=True)
    report = tracker.report()
    assert report.end_bytes == {"cpu": -_linear_bytes(64, 32)}
    assert report.peak_bytes == {"cpu": 0}
    assert report.state_at_entry.grads_bytes == _linear_bytes(64, 32)
    assert report.state_at_exit.grads_bytes == 0


def test_no_grad_region_saves_nothing() -> None:
    model = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    with torch.no_grad(), MemoryTracker(model) as tracker:
        out = model(x)
    report = tracker.report()
    assert report.saved_bytes == 0 and report.saved_tensors == 0
    assert report.peak_bytes == {"cpu": 16 * 32 * F32}
    assert report.end_bytes == {"cpu": 16 * 32 * F32}
    del out


def test_timeline_is_bounded_or_off_and_peaks_do_not_depend_on_it() -> None:
    def step() -> MemoryReport:
        x = torch.randn(8, 8, requires_grad=True)
        with tracker:
            (x.exp() * 2).sin().sum().backward()
        return tracker.report()

    tracker = MemoryTracker()
    full = step()
    tracker = MemoryTracker(max_timeline_samples=3)
    short = step()
    tracker = MemoryTracker(timeline=False)
    none = step()
    assert len(full.timeline) > 3
    assert len(short.timeline) == 3 and short.timeline == short.timeline[:3]
    assert short.timeline_dropped == len(full.timeline) - 3
    assert none.timeline == () and none.timeline_dropped == 0
    assert full.peak_bytes == short.peak_bytes == none.peak_bytes
    assert [s.delta_bytes for s in short.timeline] == [s.delta_bytes for s in full.timeline[:3]]


# -- model state -----------------------------------------------------------------------------


def test_sgd_with_momentum_state_bytes() -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 64)
    with MemoryTracker(model, optimizer=opt) as tracker:
        model(x).sum().backward()
        opt.step()
    report = tracker.report()
    size = _linear_bytes(64, 32)
    assert report.state_at_entry == ModelState(params_bytes=size)
    # One momentum buffer per parameter.
    assert report.state_at_exit == ModelState(
        params_bytes=size, grads_bytes=size, optimizer_state_bytes=size
    )
    # Gradients and momentum buffers are what is left; the output (16x32) and the loss were
    # the activations, live together before the output was freed.
    assert report.end_bytes == {"cpu": 2 * size}
    assert report.peak_bytes == {"cpu": 2 * size}
    assert report.activation_peak_bytes == {"cpu": 16 * 32 * F32 + F32}

    with MemoryTracker(model, optimizer=opt) as steady:
        model(x).sum().backward()
        opt.step()
    assert steady.report().state_at_entry == report.state_at_exit
    assert steady.report().end_bytes == {"cpu": 0}


def test_adam_state_bytes() -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with MemoryTracker(model, optimizer=opt) as tracker:
        model(torch.randn(16, 64)).sum().backward()
        opt.step()
    report = tracker.report()
    size = _linear_bytes(64, 32)
    # exp_avg and exp_avg_sq per parameter, and a float32 scalar step count per parameter.
    adam = 2 * size + 2 * F32
    assert report.state_at_exit == ModelState(
        params_bytes=size, grads_bytes=size, optimizer_state_bytes=adam
    )
    assert report.end_bytes == {"cpu": size + adam}
    # Adam's update makes temporaries (sqrt of exp_avg_sq, the denominator): activations here.
    assert 0 < report.activation_peak_bytes["cpu"] < report.peak_bytes["cpu"]


def test_buffers_are_model_state() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with MemoryTracker(model) as tracker:
        model(torch.randn(3, 4)).sum().backward()
    report = tracker.report()
    # running_mean, running_var (8 floats each) and num_batches_tracked (an int64).
    assert report.state_at_entry.buffers_bytes == 2 * 8 * F32 + 8
    assert report.state_at_entry.params_bytes == _linear_bytes(4, 8) + 2 * 8 * F32


# -- output and errors -----------------------------------------------------------------------


def test_summary_and_json() -> None:
    workload = get_workload("gpt", "small")
    model = workload.model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tokens, target = workload.batch(0)
    with MemoryTracker(model, optimizer=opt) as tracker:
        workload.loss_fn(model(tokens), target).backward()
        opt.step()
    report = tracker.report()
    text = report.summary(top=3)
    assert report.summary() == str(report)
    for needle in ("peak", "cpu", "parameters", "optimizer state", "blocks.0.attn", "saved"):
        assert needle in text
    by_module = text.split("saved by module")[1].split("\n\n")[0].splitlines()[1:]
    assert by_module[0].split()[0] == next(iter(report.saved_bytes_by_module))
    assert "more" in text.split("saved by operator")[1]

    data = json.loads(json.dumps(report.to_json()))
    assert data["peak_bytes"] == dict(report.peak_bytes)
    assert data["saved_bytes_by_module"] == dict(report.saved_bytes_by_module)
    assert data["state_at_exit"]["total_bytes"] == report.state_at_exit.total_bytes
    assert len(data["timeline"]) == len(report.timeline)
    assert set(data["timeline"][0]) == {
        "seconds", "device", "live_bytes", "delta_bytes", "op", "module"
    }  # fmt: skip
    assert data["devices"] == ["cpu"]


def test_trackers_do_not_nest() -> None:
    with MemoryTracker() as outer:
        with pytest.raises(remat.RematError, match="do not nest"), MemoryTracker():
            pass
        torch.ones(3)
    assert outer.report().peak_bytes == {"cpu": 3 * F32}
    with MemoryTracker():  # the failed inner one left nothing behind
        pass


def test_misuse_is_reported() -> None:
    tracker = MemoryTracker()
    with pytest.raises(remat.RematError, match="after the with block"):
        tracker.report()
    with tracker, pytest.raises(remat.RematError, match="after the with block"):
        tracker.report()
    with pytest.raises(remat.RematError, match="one region"), tracker:
        pass
    with pytest.raises(remat.RematError, match=r"nn\.Module"):
        MemoryTracker(torch.optim)  # type: ignore[arg-type]
    with pytest.raises(remat.RematError, match="optimizer=opt"):
        MemoryTracker(None, nn.Linear(2, 2))  # type: ignore[arg-type]


def test_exception_in_region_still_reports_and_cleans_up() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    tracker = MemoryTracker(model)
    with pytest.raises(ValueError), tracker:
        model(torch.randn(2, 4))
        raise ValueError("boom")
    assert tracker.report().peak_bytes["cpu"] > 0
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


class _Failing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("forward failed")


def test_module_that_raises_leaves_attribution_intact() -> None:
    model = nn.Sequential(nn.Linear(2, 2), _Failing())
    x = torch.randn(1, 2, requires_grad=True)
    with MemoryTracker(model) as tracker:
        with pytest.raises(ValueError, match="forward failed"):
            model(x)
        y = x.exp()  # saved outside the model: the failed forward must not still be "running"
    assert tracker.report().saved_bytes_by_module == {"0": 2 * F32, "<outside>": 2 * F32}
    del y


def test_hooks_are_removed_and_graph_is_freed() -> None:
    model = nn.Linear(8, 8)
    with MemoryTracker(model) as tracker:
        y = model(torch.randn(2, 8)).exp()  # exp saves its output
        del y  # with the tracker's hooks, dropping the output must free the graph
        assert tracker.live_bytes() == 0
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_cross_check() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    name = str(device)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(device)
    x = torch.randn(64, 256, device=device)
    model(x).sum().backward()
    with MemoryTracker(model) as tracker:
        model(x).sum().backward()
    report = tracker.report()
    # The allocator rounds each block up to 512 bytes and sees kernel workspaces: never less.
    assert report.peak_bytes[name] > 0
    assert report.allocator_peak_bytes[name] >= report.peak_bytes[name]
    assert report.end_bytes[name] == 0
    assert report.allocator_end_bytes[name] == 0
    assert name in report.summary()
