"""The region engine: exactness against plain runs, autograd semantics, replay, state, errors."""

from __future__ import annotations

import copy
import functools
import gc
import threading
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat.checkpoint import LinkedCalls

from helpers import (
    assert_equal,
    assert_records_equal,
    assert_save_and_resume_exact,
    counting_ops,
    train,
)


def _grads(*tensors: torch.Tensor) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_()


def _fresh(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def run_both(fn: Any, *leaves: torch.Tensor, seed: int = 7, **options: Any) -> None:
    """fn(*leaves) -> scalar loss, run plainly and inside remat.checkpoint; compare all."""
    a, b = _fresh(*leaves), _fresh(*leaves)
    torch.manual_seed(seed)
    plain = fn(*a)
    plain.backward()
    torch.manual_seed(seed)
    out = remat.checkpoint(fn, *b, **options)
    out.backward()
    assert torch.equal(plain, out)
    assert_equal(_grads(*a), _grads(*b), "grads")


# -- transparency -------------------------------------------------------------------------------


def test_dropout_function_is_exact() -> None:
    w = _leaf(8, 8)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(x @ w), 0.5, training=True)
        return (F.dropout(h.exp(), 0.3, training=True) * h).sum()

    run_both(fn, _leaf(4, 8), w)


def test_kwargs_and_nested_inputs_and_outputs() -> None:
    x, w, b = _leaf(3, 4), _leaf(4, 4), _leaf(4)

    def fn(
        x: torch.Tensor, pair: tuple[torch.Tensor, str], *, cfg: dict[str, Any], scale: float
    ) -> dict[str, Any]:
        weight, tag = pair
        h = F.dropout(x @ weight + cfg["bias"], 0.2, training=True) * scale
        return {"out": h.sin(), "extra": (h.cos(), tag, None), "n": cfg["n"]}

    xs, ws, bs = _fresh(x, w, b), _fresh(x, w, b), None
    del bs
    torch.manual_seed(3)
    plain = fn(xs[0], (xs[1], "t"), cfg={"bias": xs[2], "n": 5}, scale=2.0)
    (plain["out"].sum() + plain["extra"][0].sum()).backward()
    torch.manual_seed(3)
    out = remat.checkpoint(fn, ws[0], (ws[1], "t"), cfg={"bias": ws[2], "n": 5}, scale=2.0)
    (out["out"].sum() + out["extra"][0].sum()).backward()
    assert out["extra"][1:] == ("t", None) and out["n"] == 5
    assert_equal(plain["out"], out["out"])
    assert_equal(_grads(*xs), _grads(*ws), "grads")


def test_inputs_without_grad_and_parameters_inside() -> None:
    lin = nn.Linear(6, 6)
    x = torch.randn(2, 6)  # no grad
    twin = copy.deepcopy(lin)
    torch.manual_seed(0)
    F.dropout(lin(x), 0.5).pow(2).sum().backward()
    torch.manual_seed(0)
    out = remat.checkpoint(lambda t: F.dropout(twin(t), 0.5).pow(2).sum(), x)
    assert out.requires_grad
    out.backward()
    assert_equal([p.grad for p in lin.parameters()], [p.grad for p in twin.parameters()])


def test_custom_autograd_function_inside() -> None:
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x**3

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return 3 * x * x * g

    run_both(lambda x: Cube.apply(F.dropout(x, 0.5)).sum(), _leaf(5, 5))


def test_no_grad_runs_plainly_and_saves_nothing() -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(remat.is_checkpointing())
        return x.sin()

    x = _leaf(3)
    with torch.no_grad():
        out = remat.checkpoint(fn, x)
    assert not out.requires_grad and calls == [False]
    with torch.inference_mode():
        remat.checkpoint(fn, x)
    assert calls == [False, False]


# -- autograd semantics -------------------------------------------------------------------------


def test_retain_graph_and_several_backwards() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x.sin(), 0.5).exp()

    a, b = _fresh(_leaf(4, 4), _leaf(4, 4))[0], None
    x = a.detach().clone().requires_grad_()
    torch.manual_seed(1)
    plain = fn(a).sum()
    plain.backward(retain_graph=True)
    plain.backward()
    torch.manual_seed(1)
    out = remat.checkpoint(fn, x).sum()
    with counting_ops() as ops:
        out.backward(retain_graph=True)
        out.backward()
    assert ops["sin"] == 2  # one recompute per backward
    assert b is None and torch.equal(a.grad, x.grad)


def test_autograd_grad_with_inputs_subset() -> None:
    x, w = _leaf(3, 4), _leaf(4, 2)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(x @ w), 0.4).sum()

    (xa, wa), (xb, wb) = _fresh(x, w), _fresh(x, w)
    torch.manual_seed(2)
    (ga,) = torch.autograd.grad(fn(xa, wa), (wa,))
    torch.manual_seed(2)
    (gb,) = torch.autograd.grad(remat.checkpoint(fn, xb, wb), (wb,))
    assert torch.equal(ga, gb) and xb.grad is None and wb.grad is None
    out = remat.checkpoint(fn, xb, wb)
    out.backward(inputs=[xb])
    assert xb.grad is not None and wb.grad is None


def test_double_backward() -> None:
    x, w = _leaf(4, 3), _leaf(3, 3)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(x @ w) * F.dropout(x.sin() @ w, 0.3)).sum()

    (xa, wa), (xb, wb) = _fresh(x, w), _fresh(x, w)
    torch.manual_seed(4)
    (ga,) = torch.autograd.grad(fn(xa, wa), xa, create_graph=True)
    ga.pow(2).sum().backward()
    torch.manual_seed(4)
    (gb,) = torch.autograd.grad(remat.checkpoint(fn, xb, wb), xb, create_graph=True)
    gb.pow(2).sum().backward()
    assert torch.equal(ga, gb)
    assert_equal(_grads(xa, wa), _grads(xb, wb))


def test_backward_inside_the_function() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(x.sin(), 0.5)
        (gx,) = torch.autograd.grad(y.cos().sum(), x, create_graph=True)
        return (gx * y).sum()

    run_both(fn, _leaf(6))


def test_nested_regions_are_exact_and_recompute_outer_first() -> None:
    calls = {"outer": 0, "inner": 0}

    def inner(h: torch.Tensor) -> torch.Tensor:
        calls["inner"] += 1
        return F.dropout(h.exp(), 0.5).sin()

    def outer(x: torch.Tensor, use_remat: bool) -> torch.Tensor:
        calls["outer"] += 1
        h = x.cos()
        h = remat.checkpoint(inner, h) if use_remat else inner(h)
        return (h * x).sum()

    x = _leaf(5, 5)
    a, b = _fresh(x), _fresh(x)
    torch.manual_seed(9)
    plain = outer(a[0], False)
    plain.backward()
    calls.update(outer=0, inner=0)
    torch.manual_seed(9)
    out = remat.checkpoint(outer, b[0], True)
    out.backward()
    assert torch.equal(plain, out) and torch.equal(a[0].grad, b[0].grad)
    # outer: forward + one recompute. inner: forward, its forward again inside the outer
    # recompute (Rule 2: that is what rebuilds its inputs), and its own recompute.
    assert calls == {"outer": 2, "inner": 3}


def test_non_tensor_and_tensor_mixed_outputs_under_nesting() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        inner = remat.checkpoint(lambda t: [t.sin(), F.dropout(t, 0.5)], x)
        return inner[0] * inner[1], 3, inner

    x = _leaf(4)
    a, b = _fresh(x)[0], _fresh(x)[0]
    torch.manual_seed(5)
    p = fn(a)
    (p[0].sum() + p[2][1].sum()).backward()
    torch.manual_seed(5)
    q = remat.checkpoint(fn, b)
    (q[0].sum() + q[2][1].sum()).backward()
    assert q[1] == 3 and torch.equal(a.grad, b.grad)


# -- early stop ---------------------------------------------------------------------------------


def _early_stop_fn(x: torch.Tensor, marks: list[str]) -> torch.Tensor:
    marks.append("start")
    y = x.sin()  # saves x
    z = y.exp()  # saves z
    marks.append("after last save")
    return z + 1.0  # add saves nothing, and its backward runs no add


@pytest.mark.parametrize("early_stop", [True, False, "torch's switch"])
def test_early_stop_skips_ops_after_last_needed_save(early_stop: bool | str) -> None:
    """``early_stop=False``, or torch's ``set_checkpoint_early_stop(False)`` around the
    forward pass as code ported from torch's checkpoint has it, runs the recompute to the
    end."""
    marks: list[str] = []
    x = _leaf(4)
    if early_stop == "torch's switch":
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            out = remat.checkpoint(_early_stop_fn, x, marks)
        early_stop = False
    else:
        out = remat.checkpoint(_early_stop_fn, x, marks, early_stop=early_stop)
    with counting_ops() as ops:
        out.sum().backward()
    assert ops["sin"] == 1 and ops["exp"] == 1
    assert ops["add"] == (0 if early_stop else 1)
    assert marks.count("after last save") == (1 if early_stop else 2)
    assert torch.equal(x.grad, (x.sin().exp() * x.cos()).detach())


def test_early_stop_stops_at_last_tensor_still_needed() -> None:
    # When the later outputs are gone before backward, their saved tensors are freed with them
    # and the recompute stops after the last save that is still alive.
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x.sin()  # saves x
        return a, torch.atan2(a.exp(), x)  # exp saves its result, atan2 both operands

    x = _leaf(6)
    first, second = remat.checkpoint(fn, x)
    del second
    with counting_ops() as ops:
        first.sum().backward()
    # The recompute stops when sin saves its input, before sin itself runs again.
    assert ops["sin"] == 0 and ops["exp"] == 0 and ops["atan2"] == 0
    assert torch.equal(x.grad, x.detach().cos())


# -- exact replay -------------------------------------------------------------------------------


def test_without_rng_replay_a_random_recompute_raises_where_torch_differs() -> None:
    def body(t: torch.Tensor) -> torch.Tensor:
        return F.dropout(t, 0.5).pow(2).sum()

    x = _leaf(64)
    a, b, c = _fresh(x)[0], _fresh(x)[0], _fresh(x)[0]
    torch.manual_seed(0)
    body(a).backward()
    # Torch's checkpoint recomputes with another mask and returns other gradients.
    torch.manual_seed(0)
    torch.utils.checkpoint.checkpoint(
        body, b, use_reentrant=False, preserve_rng_state=False
    ).backward()
    assert not torch.equal(a.grad, b.grad)
    torch.manual_seed(0)
    out = remat.checkpoint(body, c, preserve_rng_state=False)
    with pytest.raises(remat.CheckpointError, match=r"bernoulli.*preserve_rng_state=False"):
        out.backward()
    assert c.grad is None  # no gradient of the redrawn mask reached the leaf


def test_without_rng_replay_a_region_that_draws_nothing_recomputes_exactly() -> None:
    lin = nn.Linear(16, 16)
    wrapped = copy.deepcopy(lin)
    remat.checkpoint_wrapper(wrapped, preserve_rng_state=False)
    x = torch.randn(4, 16)
    for _ in range(3):  # the first recompute is checked, the later ones run unguarded
        lin(x).tanh().sum().backward()
        wrapped(x).tanh().sum().backward()
        assert torch.equal(lin.weight.grad, wrapped.weight.grad)


def test_without_rng_replay_a_recompute_that_stops_before_its_draw_passes() -> None:
    # What backward needs is rebuilt before the dropout runs: nothing redrawn reaches it.
    def body(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t.sin() * t, F.dropout(t.detach(), 0.5)

    x = _leaf(64)
    plain = _fresh(x)[0]
    body(plain)[0].sum().backward()
    region = _fresh(x)[0]
    remat.checkpoint(body, region, preserve_rng_state=False)[0].sum().backward()
    assert torch.equal(plain.grad, region.grad)


def test_backward_leaves_global_rng_as_plain_run_does() -> None:
    x = _leaf(16)
    torch.manual_seed(0)
    F.dropout(x, 0.5).sum().backward()
    plain_state = torch.get_rng_state()
    torch.manual_seed(0)
    remat.checkpoint(lambda t: F.dropout(t, 0.5).sum(), x).backward()
    assert torch.equal(plain_state, torch.get_rng_state())


def test_autocast_state_is_replayed() -> None:
    lin = nn.Linear(8, 8)
    twin = copy.deepcopy(lin)
    x = _leaf(4, 8)
    a, b = _fresh(x)[0], _fresh(x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = lin(a).float().sin().sum()
        out = remat.checkpoint(lambda t: twin(t).float().sin().sum(), b)
    plain.backward()
    out.backward()  # outside autocast: the recompute must still run in bfloat16
    assert torch.equal(a.grad, b.grad)
    assert_equal([p.grad for p in lin.parameters()], [p.grad for p in twin.parameters()])


def test_default_device_is_replayed() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.ones(x.shape)).sin().sum()

    x = _leaf(3)
    out = remat.checkpoint(fn, x)
    with torch.device("meta"):
        out.backward()  # the recompute's torch.ones must be made on the forward's device
    assert torch.equal(x.grad, x.detach().cos())


def test_context_fn_with_torch_selective_checkpoint_policy() -> None:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == torch.ops.aten.mm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.mm(x, w).sin(), 0.5).mm(w).sum()

    x, w = _leaf(4, 4), _leaf(4, 4)
    run_both(fn, x, w, context_fn=lambda: create_selective_checkpoint_contexts(policy))
    out = remat.checkpoint(
        fn, x, w, context_fn=lambda: create_selective_checkpoint_contexts(policy)
    )
    with counting_ops() as ops:
        out.backward()
    assert ops["sin"] == 1  # the recompute; backward of sin runs cos
    assert ops["mm"] == 4  # backward's four mm; the saved ones are not run again


def test_determinism_check_lists_each_differing_tensor() -> None:
    state = {"n": 4}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x[: state["n"]].sin() * 2).exp().sum()

    out = remat.checkpoint(fn, _leaf(8))
    state["n"] = 3
    with pytest.raises(remat.CheckpointError) as info:
        out.backward()
    message = str(info.value)
    assert "saved tensor 0: forward shape=(4,), dtype=torch.float32, device=cpu" in message
    assert "recompute shape=(3,)" in message
    assert "saved tensor 1" in message and "Usual causes" in message


def test_determinism_check_catches_a_shorter_recompute() -> None:
    state = {"extra": True}

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        return y.exp().sum() if state["extra"] else y.sum()

    out = remat.checkpoint(fn, _leaf(4), early_stop=False)
    state["extra"] = False
    with pytest.raises(
        remat.CheckpointError, match="forward saved 2 tensors; the recompute saved only 1"
    ):
        out.backward()


def test_debug_shows_where_the_operators_diverge() -> None:
    state = {"cos": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.cos() if state["cos"] else x.sin()
        return y[:2].exp().sum() if state["cos"] else y.exp().sum()

    out = remat.checkpoint(fn, _leaf(4), debug=True)
    state["cos"] = True
    with pytest.raises(
        remat.CheckpointError, match=r"(?s)first difference at #0.*aten\.sin.*aten\.cos"
    ):
        out.backward()


def test_determinism_check_none_skips_the_check() -> None:
    state = {"k": 1.0}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * state["k"]).sin().sum()

    x = _leaf(3)
    out = remat.checkpoint(fn, x, determinism_check="none")
    state["k"] = 2.0
    out.backward()  # same metadata, so no check could see it; the values follow the new state
    assert torch.equal(x.grad, (x * 2.0).cos().detach())


# -- state mutates once -------------------------------------------------------------------------


NORMS = [
    lambda: nn.BatchNorm1d(6),
    lambda: nn.BatchNorm2d(6),
    lambda: nn.BatchNorm3d(6),
    lambda: nn.SyncBatchNorm(6),
    lambda: nn.InstanceNorm1d(6, track_running_stats=True, affine=True),
    lambda: nn.InstanceNorm2d(6, track_running_stats=True),
    lambda: nn.BatchNorm1d(6, momentum=None),
]
INPUT_DIMS = [1, 2, 3, 2, 1, 2, 1]


class _NormNet(nn.Module):
    def __init__(self, norm: nn.Module, dims: int) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.conv = conv(3, 6, 3, padding=1)
        self.norm = norm
        self.drop = nn.Dropout(0.2)
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.norm(self.conv(x))))


@pytest.mark.parametrize("index", range(len(NORMS)))
def test_norm_running_statistics_update_once(index: int) -> None:
    dims = INPUT_DIMS[index]
    torch.manual_seed(0)
    plain = _NormNet(NORMS[index](), dims)
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(plain))
    shape = (4, 3) + (5,) * dims
    batches = [(torch.randn(shape), torch.randn((*shape[:1], 6, *shape[2:]))) for _ in range(3)]
    loss = nn.functional.mse_loss
    assert_records_equal(train(plain, batches, loss), train(wrapped, batches, loss))


def test_torch_checkpoint_updates_batchnorm_twice() -> None:
    # The bug remat's write guard fixes (pytorch/pytorch#96136): shown so the test above could fail.
    bn = nn.BatchNorm1d(4)
    x = _leaf(8, 4)
    torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2


class _Stateful(nn.Module):
    """Writes buffers in forward through in-place ops, copy_, out= and an index_put."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(3))
        self.register_buffer("hist", torch.zeros(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.cache.copy_(x.detach().mean(0)[:3])
        torch.add(self.hist, 1.0, out=self.hist)
        self.hist[0] = self.hist[0] * 2
        scratch = torch.zeros_like(x)
        scratch.add_(self.lin(x))  # a write to a tensor made inside the region must still happen
        return (scratch * self.cache.sum()).sin()


def test_buffers_written_in_forward_are_written_once() -> None:
    torch.manual_seed(0)
    plain = _Stateful()
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(plain))
    batches = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)]
    a, b = train(plain, batches, F.mse_loss), train(wrapped, batches, F.mse_loss)
    assert_records_equal(a, b)
    assert int(wrapped.calls) == 3 and torch.equal(wrapped.hist, plain.hist)


# -- when the guard runs (NOTE [ When the guard runs ] in _guard.py) ----------------------------


def _modes_in_recompute(fn: Any, steps: int, *inputs: torch.Tensor) -> list[int]:
    """Run ``steps`` forward+backward passes of ``remat.checkpoint(fn)``; the number of dispatch
    modes active in each recompute."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes: list[int] = []

    def spy(*args: torch.Tensor) -> torch.Tensor:
        if remat.is_recomputing():
            modes.append(len(_get_current_dispatch_mode_stack()))
        out: torch.Tensor = fn(*args)
        return out

    for _ in range(steps):
        remat.checkpoint(spy, *inputs).sum().backward()
    return modes


def test_region_without_writes_recomputes_with_no_dispatch_mode() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 4))
    # The first recompute of a function runs guarded, to see whether it hides a write.
    assert _modes_in_recompute(block, 3, _leaf(2, 4)) == [1, 0, 0]
    plain = copy.deepcopy(block)
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(block))
    batches = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)]
    assert_records_equal(train(plain, batches, F.mse_loss), train(wrapped, batches, F.mse_loss))


def _batchnorm_block(momentum: float | None = 0.1) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=momentum), nn.Tanh())


def test_region_writing_batchnorm_statistics_undoes_the_recompute_writes() -> None:
    # NOTE [ Writes undone ]: the first recompute runs guarded and shows the writes are the
    # block's own state, never read back; later recomputes write it and put it back.
    torch.manual_seed(0)
    block = _batchnorm_block()
    plain = copy.deepcopy(block)
    x = _leaf(8, 4)
    assert _modes_in_recompute(block, 3, x) == [1, 0, 0]
    for _ in range(3):
        plain(x).sum().backward()
    assert int(block[1].num_batches_tracked) == int(plain[1].num_batches_tracked) == 3
    # Values and version counters as a plain run leaves them.
    for a, b in zip(block.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b) and a._version == b._version


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_blocks_train_exactly_guarded_or_undone(momentum: float | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_batchnorm_block(momentum), _batchnorm_block(momentum))
    wrapped = copy.deepcopy(model)
    for block in wrapped:
        remat.checkpoint_wrapper(block)
    batches = [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(4)]
    assert_records_equal(train(model, batches, F.mse_loss), train(wrapped, batches, F.mse_loss))


def test_batchnorm_blocks_in_a_users_loop_with_save_and_resume(tmp_path: Any) -> None:
    """AdamW, clip_grad_norm_, a save after two steps and a resumed third, on BatchNorm blocks
    whose later recomputes undo their writes: bit-equal to three plain steps."""

    def build(wrapped: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(_batchnorm_block(), _batchnorm_block())
        for block in model if wrapped else ():
            remat.checkpoint_wrapper(block)
        return model

    x = torch.randn(8, 4)
    model = build(True)
    recomputes: list[str] = []
    close, enter = remat._guard.Undo.close, remat._guard.WriteGuard.__enter__
    guarded = [False]

    def closing(self: Any) -> None:  # after each recompute
        recomputes.append("guarded" if guarded[0] else "undone")
        guarded[0] = False
        close(self)

    def entering(self: Any) -> Any:
        guarded[0] = True
        return enter(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(remat._guard.Undo, "close", closing)
        patch.setattr(remat._guard.WriteGuard, "__enter__", entering)
        assert_save_and_resume_exact(
            model,
            build(False),
            lambda: build(True),
            lambda m: m(x).square().mean(),
            tmp_path,
        )
    # Each block's first recompute is guarded, from the snapshot of [ State read, then
    # written ]; the model's second step undoes both blocks' writes with no guard; the resumed
    # model (new blocks) runs one step, guarded.
    assert recomputes == ["guarded"] * 2 + ["undone"] * 2 + ["guarded"] * 2


def test_batchnorm_without_momentum_reads_its_count_back_from_a_snapshot() -> None:
    # ``momentum=None`` reads ``num_batches_tracked`` after writing it. Its forward passes
    # snapshot the block's state, and its recomputes start from that snapshot: the count they
    # read back is the forward pass's, with no guard after the first ([ State read, then
    # written ]).
    torch.manual_seed(0)
    block = _batchnorm_block(momentum=None)
    plain = copy.deepcopy(block)
    x = _leaf(8, 4)
    assert _modes_in_recompute(block, 3, x) == [1, 0, 0]
    for _ in range(3):
        plain(x).sum().backward()
    for a, b in zip(block.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b) and a._version == b._version


class _Calls(nn.Module):
    """Counts its calls in a buffer; ``scaled`` also scales by the count, reading its state
    after writing it."""

    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.lin = nn.Linear(4, 4)
        self.scaled = scaled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        y = self.lin(x)
        return (y * self.calls if self.scaled else y).sin()


def test_state_read_after_its_write_is_replayed_from_a_snapshot() -> None:
    # Undone writes alone would let the recompute read the count written twice; starting
    # from the forward pass's snapshot, it reads the count the forward pass read.
    torch.manual_seed(0)
    model = _Calls(scaled=True)
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(model))
    batches = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)]
    assert_records_equal(train(model, batches, F.mse_loss), train(wrapped, batches, F.mse_loss))
    assert _modes_in_recompute(_Calls(scaled=True), 3, _leaf(2, 4)) == [1, 0, 0]


def test_undone_writes_pass_autograd_version_check_of_a_later_save() -> None:
    module = _Calls()
    for step in range(3):
        x, y = _leaf(2, 4), _leaf(2, 4)
        out = remat.checkpoint(module, x)
        other = y * module.calls  # saves ``calls`` at the version the forward pass left
        out.sum().backward()  # the recompute writes ``calls`` and (from step 1) undoes it
        other.sum().backward()  # would raise if the version had moved
        assert torch.equal(y.grad, torch.full((2, 4), float(step + 1)))  # type: ignore[arg-type]
    assert int(module.calls) == 3


def test_undo_puts_state_back_when_the_recompute_raises() -> None:
    module = _Calls()
    fail = [False]

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = module(x)
        if remat.is_recomputing() and fail[0]:
            raise RuntimeError("recompute failed")
        return out * out  # saves ``out``: the recompute runs past the raise

    remat.checkpoint(fn, _leaf(2, 4)).sum().backward()  # the guarded first recompute
    fail[0] = True
    out = remat.checkpoint(fn, _leaf(2, 4)).sum()
    version = module.calls._version
    with pytest.raises(RuntimeError, match="recompute failed"):
        out.backward()
    assert int(module.calls) == 2 and module.calls._version == version


def test_state_over_the_undo_limit_keeps_the_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat._guard, "UNDO_LIMIT", 2)  # smaller than the 4-byte count
    module = _Calls()
    assert _modes_in_recompute(module, 3, _leaf(2, 4)) == [1, 1, 1]
    assert int(module.calls) == 3


def test_hidden_write_next_to_a_seen_one_keeps_the_guard() -> None:
    counter = _Counter()
    module = _Calls()

    def fn(x: torch.Tensor) -> torch.Tensor:
        counter.calls.add_(1)  # out of the cheap check's sight, so out of the undo's
        return module(x)

    assert _modes_in_recompute(fn, 3, _leaf(2, 4)) == [1, 1, 1]
    assert int(counter.calls) == int(module.calls) == 3


class _Counter:
    """A plain object: what it holds is out of the cheap check's sight."""

    def __init__(self) -> None:
        self.calls = torch.zeros(())


def test_write_hidden_from_the_version_check_is_guarded() -> None:
    counter = _Counter()
    lin = nn.Linear(4, 4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        counter.calls.add_(1)
        return lin(x).relu()

    # The first recompute (guarded) finds the hidden write: every later one is guarded too.
    assert _modes_in_recompute(fn, 3, _leaf(2, 4)) == [1, 1, 1]
    assert int(counter.calls) == 3


def test_closure_tensor_and_plain_module_attribute_writes_are_seen_in_forward() -> None:
    calls = torch.zeros(())

    class Attribute(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen = torch.zeros(())  # an attribute, not a registered buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen += 1
            return self.lin(x).sin()

    module = Attribute()

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.add_(1)
        return x.cos()

    # The spy's first recompute is guarded. Its forward's check reaches the module through its
    # closure, so the next recompute writes and is undone; a function in a closure it does not
    # follow, so the write to ``calls`` is hidden from it and every recompute is guarded.
    for function, modes in ((module, [1, 0]), (fn, [1, 1])):
        remat.checkpoint(function, _leaf(2, 4)).sum().backward()  # the guarded first recompute
        # As if that recompute had shown nothing: the forward's own check must see the write.
        remat._guard.verified(remat._guard.identities(function, ()), False)
        assert _modes_in_recompute(function, 2, _leaf(2, 4)) == modes
    # Written once per forward pass: had the forward's check missed the write, the unguarded
    # recompute would have written it again, with nothing to undo it.
    assert int(module.seen) == 3 and int(calls) == 3


# A global written only inside a comprehension: the comprehension is a code object of its own.
_WRITTEN_IN_A_COMPREHENSION = torch.zeros(())


def test_global_written_inside_a_comprehension_is_seen_in_forward() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        if remat.is_recomputing():
            modes.append(len(_get_current_dispatch_mode_stack()))
        _ = [_WRITTEN_IN_A_COMPREHENSION.add_(1) for _ in range(1)]
        return x.cos()

    start = int(_WRITTEN_IN_A_COMPREHENSION)
    for _ in range(3):
        remat.checkpoint(fn, _leaf(2, 4)).sum().backward()
    # The forward's check sees the write: the first recompute is guarded, the next ones undone.
    # Had it missed the write, the guard would have found it hidden and run every recompute
    # guarded ([1, 1, 1]).
    assert modes == [1, 0, 0]
    assert int(_WRITTEN_IN_A_COMPREHENSION) - start == 3


def test_a_region_walks_what_it_reaches_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # The recompute checks the tensors its forward pass listed ([ When the guard runs ] 3).
    walks: list[bool] = []
    visit = remat._guard._visit_function

    def counting(*args: Any) -> None:
        walks.append(remat.is_recomputing())
        visit(*args)

    monkeypatch.setattr(remat._guard, "_visit_function", counting)
    block = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    assert _modes_in_recompute(block, 3, _leaf(2, 4)) == [1, 0, 0]
    assert walks == [False] * 3


def test_recompute_writing_what_its_forward_did_not_raises() -> None:
    buffer = torch.zeros(())
    write = [False]

    def fn(x: torch.Tensor) -> torch.Tensor:
        if remat.is_recomputing() and write[0]:
            buffer.add_(1)
        return x.sin()

    remat.checkpoint(fn, _leaf(3)).sum().backward()  # the guarded first recompute: clean
    write[0] = True
    out = remat.checkpoint(fn, _leaf(3)).sum()
    with pytest.raises(remat.CheckpointError, match="wrote a tensor that outlives it"):
        out.backward()


# -- flags --------------------------------------------------------------------------------------


def test_flags_inside_forward_and_recompute() -> None:
    seen: list[tuple[bool, bool]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.append((remat.is_checkpointing(), remat.is_recomputing()))
        return x.sin().sum()

    assert not remat.is_checkpointing() and not remat.is_recomputing()
    remat.checkpoint(fn, _leaf(3)).backward()
    assert seen == [(True, False), (False, True)]
    assert not remat.is_checkpointing() and not remat.is_recomputing()


def test_flags_are_thread_local() -> None:
    seen: dict[str, bool] = {}

    def other_thread() -> None:
        seen["checkpointing"] = remat.is_checkpointing()

    def fn(x: torch.Tensor) -> torch.Tensor:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        seen["here"] = remat.is_checkpointing()
        return x.sin()

    remat.checkpoint(fn, _leaf(2))
    assert seen == {"checkpointing": False, "here": True}


def test_flags_restored_when_an_exception_escapes() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        remat.checkpoint(fn, _leaf(2))
    assert not remat.is_checkpointing()
    with pytest.raises(ValueError, match="boom"), remat.disable_checkpointing():
        raise ValueError("boom")
    calls = []
    remat.checkpoint(lambda t: calls.append(remat.is_checkpointing()) or t.sin(), _leaf(2))
    assert calls == [True]


def test_disable_checkpointing_runs_plainly() -> None:
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(remat.is_checkpointing())
        return x.sin().sum()

    with remat.disable_checkpointing():
        out = remat.checkpoint(fn, _leaf(3))
    out.backward()
    assert calls == [False]


@pytest.mark.parametrize("inner_policy", [None, remat.policies.save_matmuls])
def test_a_backward_under_disable_checkpointing_recomputes_nested_regions_as_forward_ran(
    inner_policy: Any,
) -> None:
    """Checkpointing is switched off for the regions entered inside the block, not for the
    recompute of a region entered before it: the nested region runs as a region again, as
    in forward (it ran plainly, saved other tensors, and the recompute raised)."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    plain = copy.deepcopy(inner)
    x = torch.randn(4, 8)
    plain(x).tanh().square().mean().backward()
    loss = (
        remat.checkpoint(lambda t: remat.checkpoint(inner, t, policy=inner_policy).tanh(), x)
        .square()
        .mean()
    )
    with remat.disable_checkpointing():
        loss.backward()
    assert all(
        torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        for p, q in zip(plain.parameters(), inner.parameters(), strict=True)
    )


# -- lifetimes ----------------------------------------------------------------------------------


def test_nothing_leaks_when_backward_never_happens() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen: list[weakref.ref[torch.Tensor]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x).relu()
            self.seen.append(weakref.ref(h))
            return h.sin()

    gc.disable()
    try:
        block = Block()
        out = remat.checkpoint(block, _leaf(2, 4))
        block_ref = weakref.ref(block)
        activation = block.seen[0]
        assert activation() is None  # dropped right after forward: not saved
        del block, out
        assert block_ref() is None
    finally:
        gc.enable()


def test_recomputed_tensors_are_released_as_backward_consumes_them() -> None:
    kept: list[weakref.ref[torch.Tensor]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        if remat.is_recomputing():
            kept.append(weakref.ref(h))
        return h.sin().sum()

    gc.disable()
    try:
        out = remat.checkpoint(fn, _leaf(8))
        out.backward(retain_graph=True)
        assert kept and kept[-1]() is None  # freed even though the graph is retained
        out.backward()
        assert len(kept) == 2 and kept[-1]() is None
    finally:
        gc.enable()


class _ReadTwice(torch.autograd.Function):
    """Reads ``ctx.saved_tensors`` twice in backward, as a helper it calls may."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (first,) = ctx.saved_tensors
        (second,) = ctx.saved_tensors
        return g * first.exp() + second


def test_a_saved_tensor_read_twice_raises_on_the_region_engine_only() -> None:
    """The region engine hands each rebuilt tensor out once per backward (it lives no longer
    than autograd holds it), and says so for a second read; the graph engine replays it, and
    matches plain autograd."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        return _ReadTwice.apply(t.sin()).tanh()

    x = _leaf(4, 3)
    expected = torch.autograd.grad(fn(x).sum(), x)[0]
    out = remat.checkpoint(fn, x).sum()
    with pytest.raises(remat.CheckpointError, match="requested twice in one backward pass;"):
        out.backward()
    graph = remat.checkpoint(fn, x, policy=remat.policies.recompute_everything)
    assert torch.equal(torch.autograd.grad(graph.sum(), x)[0], expected)


def test_an_intermediate_written_in_place_after_an_op_saved_it_raises_like_plain() -> None:
    """``tanh`` saves its result; the region then writes it in place and drops it. Plain
    autograd raises in backward. The recompute writes it again after saving it: the region
    engine raises too, where torch's checkpoint hands tanh's backward the written value (a
    wrong gradient, no error). The same region with a copy before the write is exact."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def fn(t: torch.Tensor, copy_first: bool) -> torch.Tensor:
        y = lin(t).tanh()
        z = y.clone() if copy_first else y
        z[:, 0] += z[:, 1].exp()
        return z.sigmoid()

    x = _leaf(3, 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fn(x, False).sum().backward()
    with pytest.raises(remat.CheckpointError, match="modified by an inplace operation"):
        remat.checkpoint(fn, x, False).sum().backward()
    expected = torch.autograd.grad(fn(x, True).sum(), [x, *lin.parameters()])
    torch_ckpt = torch.utils.checkpoint.checkpoint(fn, x, False, use_reentrant=False)
    wrong = torch.autograd.grad(torch_ckpt.sum(), [x, *lin.parameters()])
    assert not torch.equal(wrong[0], expected[0])
    got = torch.autograd.grad(remat.checkpoint(fn, x, True).sum(), [x, *lin.parameters()])
    assert_equal(got, expected)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"preserve_rng_state": "yes"}, "preserve_rng_state must be True or False, got 'yes'"),
        ({"early_stop": 1}, "early_stop must be True or False"),
        ({"determinism_check": "strict"}, "determinism_check must be one of"),
        ({"context_fn": 3}, "context_fn must be a callable"),
        ({"use_reentrant": True}, "use_reentrant=True is not supported"),
    ],
)
def test_bad_options_raise(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(remat.RematError, match=match):
        remat.checkpoint(torch.sin, _leaf(2), **kwargs)


def test_an_option_the_function_also_takes_is_refused() -> None:
    """torch's checkpoint passes keywords it does not know to the function; remat's checkpoint
    takes ``policy=`` itself. Code ported from torch that passes its own ``policy`` argument
    gets an error naming the clash, not remat's option applied or a missing argument.
    ``early_stop=`` is an option of torch's checkpoint too: both take it, and neither passes
    it on, whatever the function's parameters."""
    net = nn.Linear(2, 2)

    def act(obs: torch.Tensor, policy: nn.Module) -> torch.Tensor:
        return policy(obs).tanh()

    seen: list[bool] = []

    def stop(obs: torch.Tensor, early_stop: bool = True) -> torch.Tensor:
        seen.append(early_stop)
        return obs.sin()

    with pytest.raises(remat.RematError, match=r"policy= is an option of remat\.checkpoint, and"):
        remat.checkpoint(act, _leaf(3, 2), policy=remat.policies.save_matmuls)
    torch_checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    for run in (remat.checkpoint, torch_checkpoint):
        run(stop, _leaf(3, 2), early_stop=False).sum().backward()
    assert seen == [True] * 4  # forward and recompute, under each
    # A module is never a policy, even for a function that takes **kwargs.
    with pytest.raises(remat.RematError, match=r"policy must be a callable .* got the module Line"):
        remat.checkpoint(lambda obs, **kw: kw["policy"](obs), _leaf(3, 2), policy=net)
    bound = functools.partial(act, policy=net)
    run_both(lambda t: bound(t).sum(), _leaf(3, 2), policy=remat.policies.save_matmuls)


def test_non_callable_raises() -> None:
    with pytest.raises(remat.RematError, match="expected a callable as first argument, got Tensor"):
        remat.checkpoint(_leaf(2), _leaf(2))  # type: ignore[arg-type]


def test_use_reentrant_false_is_accepted() -> None:
    run_both(lambda t: F.dropout(t, 0.5).sin().sum(), _leaf(4), use_reentrant=False)


def test_errors_share_one_root() -> None:
    assert issubclass(remat.CheckpointError, remat.RematError)
    assert issubclass(remat.RematError, RuntimeError)


def test_parameters_written_in_forward_are_written_once() -> None:
    # Embedding(max_norm=...) renormalises rows of its weight in place in forward.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 4))
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(plain))
    batches = [(torch.randint(0, 10, (3, 5)), torch.randn(3, 5, 4)) for _ in range(3)]
    assert_records_equal(train(plain, batches, F.mse_loss), train(wrapped, batches, F.mse_loss))
    # A parameter written in place under no_grad, as optimizers inside a region would.
    p = nn.Parameter(torch.ones(3))

    def fn(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p.mul_(2)
        return (x * p).sum()

    out = remat.checkpoint(fn, torch.ones(3, requires_grad=True))
    assert torch.equal(p.detach(), torch.full((3,), 2.0))
    out.backward()
    assert torch.equal(p.detach(), torch.full((3,), 2.0))  # not doubled again by the recompute


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


@pytest.mark.parametrize("engine", ["region", "graph"])
def test_a_chain_of_regions_holds_no_more_than_torch_checkpoint(engine: str) -> None:
    """A region's inputs and what it rebuilt go when its part of the graph has run, not when
    the whole backward ends: in a chain of three regions the step's peak (allocator events) is
    torch's non-reentrant checkpoint's, not one activation above it."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    from remat.bench.measure import peak_step_bytes

    policy = remat.policies.recompute_everything if engine == "graph" else None
    peaks = {}
    for kind in ("torch", "remat"):
        torch.manual_seed(0)
        blocks = nn.ModuleList(_Residual() for _ in range(3))
        x = torch.randn(128, 256, requires_grad=True)

        def step(x: torch.Tensor = x, blocks: nn.ModuleList = blocks, kind: str = kind) -> None:
            h = x * 1
            for block in blocks:
                if kind == "torch":
                    h = torch_checkpoint(block, h, use_reentrant=False)
                else:
                    h = remat.checkpoint(block, h, policy=policy)
            h.sum().backward()

        step()
        peaks[kind] = peak_step_bytes(step, torch.device("cpu"))
    assert peaks["remat"] <= peaks["torch"], peaks


_TRANSFORMS = {
    "grad": lambda f, x: torch.func.grad(f)(x),
    "vmap": lambda f, x: torch.func.vmap(f)(x),
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1],
}


# torch.func.jvp's first call imports code that calls torch.jit.script, which warns.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("transform", sorted(_TRANSFORMS))
@pytest.mark.parametrize("engine", ["region", "graph", "linked", "with-region"])
def test_torch_func_transforms_raise_and_disable_checkpointing_runs_plainly(
    transform: str, engine: str
) -> None:
    """A recompute runs in backward, outside the transform that made the region's tensors:
    a region inside ``torch.func`` raises, naming the transform and the way out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    chain = LinkedCalls()

    def wrapped(x: torch.Tensor) -> torch.Tensor:
        if engine == "region":
            out = remat.checkpoint(model, x)
        elif engine == "graph":
            out = remat.checkpoint(model, x, policy=remat.policies.save_matmuls)
        elif engine == "linked":
            out = chain.run(0, model, (x,), {}, last=True)
        else:
            with remat.region(policy=remat.policies.recompute_everything):
                out = model(x)
        return out.sum()

    x = torch.randn(3, 4)
    run = _TRANSFORMS[transform]
    with pytest.raises(remat.RematError, match=f"inside torch.func.{transform}.*disable_checkp"):
        run(wrapped, x)
    with remat.disable_checkpointing():
        assert torch.equal(run(wrapped, x), run(lambda t: model(t).sum(), x))


# torch's forward-AD module scripts a function as it is imported, which torch 2.13 warns of.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_ad_through_a_region() -> None:
    """``torch.autograd.forward_ad`` passes through a region as through torch's checkpoint:
    the tangent equals the plain one (the region's input saver once had no ``jvp``)."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x, v = torch.randn(3, 4), torch.randn(3, 4)
    with fwAD.dual_level():
        plain = fwAD.unpack_dual(block(fwAD.make_dual(x, v)))
        ours = fwAD.unpack_dual(remat.checkpoint(block, fwAD.make_dual(x, v)))
    assert torch.equal(plain.primal, ours.primal) and torch.equal(plain.tangent, ours.tangent)


class _Hooked(nn.Module):
    """A block whose forward registers tensor hooks on what outlives it: a gradient scale on
    its weight and on its input, a post-accumulate hook on its bias."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def scale(name: str) -> Any:
            return lambda g: (self.calls.append(name), g * 0.5)[1]

        self.lin.weight.register_hook(scale("weight"))
        x.register_hook(scale("input"))
        self.lin.bias.register_post_accumulate_grad_hook(lambda p: self.calls.append("bias"))
        return self.lin(x).tanh()


@pytest.mark.parametrize("wrap", ["checkpoint", "apply"])
def test_hooks_a_forward_registers_on_what_outlives_it_fire_once(wrap: str) -> None:
    """A recompute runs the forward again, which registers each hook again on the live weight,
    bias and input: they fired twice, and a gradient scale scaled twice (torch's checkpoint
    does so too). The hooks the recompute registers there are removed after it; those
    registered before the region, and those of the forward pass, fire once each."""
    torch.manual_seed(0)
    plain_calls: list[str] = []
    plain = _Hooked(plain_calls)
    calls: list[str] = []
    block = _Hooked(calls)
    block.load_state_dict(plain.state_dict())
    model = nn.Sequential(block)
    if wrap == "apply":
        remat.apply(model, _Hooked)
    grads = []
    for m, seen in ((plain, plain_calls), (model, calls)):
        w = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w.register_hook(lambda g, seen=seen: (seen.append("before"), g)[1])
        x = w * 2  # a non-leaf input
        out = remat.checkpoint(m, x) if m is model and wrap == "checkpoint" else m(x)
        out.square().sum().backward()
        grads.append([w.grad, *(p.grad for p in m.parameters())])
    assert sorted(calls) == sorted(plain_calls) == ["before", "bias", "input", "weight"]
    assert_equal(grads[0], grads[1], "grads")


_ENGINES = {
    "region": None,
    "mm": remat.policies.save_matmuls,
    "all": remat.policies.recompute_everything,
}


@pytest.mark.parametrize("outer", ["region", "mm"])
@pytest.mark.parametrize("mid", ["region", "mm", "torch"])
@pytest.mark.parametrize("inner", ["region", "mm", "all"])
def test_three_nested_regions_of_either_engine_are_exact(outer: str, mid: str, inner: str) -> None:
    """Regions three deep, each on either engine (the middle one also torch's non-reentrant
    checkpoint, as user code around a remat region may have), with dropout innermost: outputs
    and gradients equal the plain program's. A graph-engine region inside a region-engine one
    (remat's or torch's) inside a graph-engine one joined the outer recording in forward and
    not in the recompute (none is open in backward), so it saved its inputs only in the
    recompute, and the determinism check failed on a deterministic program."""

    def run(engines: tuple[str, str, str] | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)

        def call(level: int, fn: Any, *args: Any) -> Any:
            if engines is None:
                return fn(*args)
            if engines[level] == "torch":
                return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
            return remat.checkpoint(fn, *args, policy=_ENGINES[engines[level]])

        def innermost(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return F.dropout((a @ b).sin(), 0.3)

        def middle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return call(2, innermost, a, b) * a

        def outermost(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return call(1, middle, a.cos(), b).exp()

        out = call(0, outermost, x, w) @ w
        out.square().sum().backward()
        return [out, x.grad, w.grad]  # type: ignore[list-item]

    assert_equal(run(None), run((outer, mid, inner)), "outputs and grads")


def test_the_outer_recording_is_current_again_after_a_region_under_torch_s_checkpoint() -> None:
    """A graph region inside torch's checkpoint inside another records on its own; when it
    ends, the outer recording is the current one again, so a tensor tagged after it is kept
    by the outer policy (it was recomputed: the outer region had lost its recording)."""
    torch.manual_seed(0)
    l1, l2, l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def inner(h: torch.Tensor) -> torch.Tensor:
        with remat.region(policy=remat.policies.save_matmuls):
            return l2(h).tanh()

    def body(x: torch.Tensor) -> torch.Tensor:
        with remat.region(policy=remat.policies.save_tagged("kept")):
            h = torch.utils.checkpoint.checkpoint(inner, l1(x).tanh(), use_reentrant=False)
            return remat.tag(l3(h), "kept").sin()  # sin saves the tagged tensor

    x = torch.randn(4, 8, requires_grad=True)
    rows = [r for r in remat.explain(body, x).rows if r.op == "addmm" and r.module == ""]
    assert [r.decision for r in rows] == ["keep"]  # l3's output, tagged, saved by sin
    plain_grads = torch.autograd.grad(l3(l2(l1(x).tanh()).tanh()).sin().sum(), [x, l1.weight])
    grads = torch.autograd.grad(body(x).sum(), [x, l1.weight])
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))


class _CTC(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor) -> Any:
        return F.ctc_loss(self.lin(x).log_softmax(-1), targets, lengths, lengths.clamp(max=4))


def test_ctc_loss_whose_first_recompute_takes_another_path_under_the_guard_is_exact() -> None:
    """``F.ctc_loss`` with length tensors converts them to lists, except under a Python
    dispatch mode, where it keeps tensors and saves other tensors: the first recompute, which
    runs under the write guard, saved (3,) int64 where forward saved (12, 3, 5) float, and
    raised CheckpointError. Once that recompute shows the region writes nothing, it runs again
    without the guard, as later ones do, and the step equals the plain one bit for bit."""
    torch.manual_seed(0)
    plain = _CTC()
    model = remat.checkpoint_wrapper(copy.deepcopy(plain))
    targets = torch.randint(1, 5, (3, 4), generator=torch.Generator().manual_seed(1))
    lengths = torch.full((3,), 12, dtype=torch.long)
    for step in range(2):
        x = torch.randn(12, 3, 8, generator=torch.Generator().manual_seed(step))
        losses, grads = [], []
        for m in (plain, model):
            m.zero_grad()
            loss = m(x, targets, lengths)
            loss.backward()
            losses.append(loss)
            grads.append([p.grad for p in m.parameters()])
        assert_equal(losses[0], losses[1], "loss")
        assert_equal(grads[0], grads[1], "grads")
