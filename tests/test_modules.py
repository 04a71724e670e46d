"""Tests of remat.modules: checkpoint_wrapper, apply and checkpoint_sequential.

Every numerical check compares against a plain run of the same model, built from the same seed,
fed the same batches under the same global RNG state, bit for bit (``torch.equal``), with dropout
active. Mechanism checks count forward calls, look at the region flags each call sees, count the
tensors autograd saves outside the region, and follow tensors and modules with weak references.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import remat
from remat import RematError
from remat.modules import is_wrapped

D = 6
BATCH = 8

# ---------------------------------------------------------------------------------------------
# Comparison helpers
# ---------------------------------------------------------------------------------------------


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Every place where two nested structures differ: structure, types, non-tensor values, and
    tensors (dtype, shape or any bit)."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        return [] if torch.equal(a, b) else [f"{path}: values differ"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _assert_same(a: Any, b: Any) -> None:
    diffs = _differences(a, b)
    assert not diffs, "\n".join(diffs)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    return value


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        grads[name] = p.grad.clone()
    return grads


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (running_mean, running_var, num_batches_tracked)."""
    return {n: t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}


@contextlib.contextmanager
def _count_saved() -> Iterator[list[torch.Tensor]]:
    """Saved-tensor hooks that record what autograd keeps outside any region."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _warm_up() -> None:
    # The first recompute in a process lazily imports parts of torch; torch.fx records the
    # importing frame in a reference cycle, which would keep that first region's inputs alive
    # until gc.collect(). Leak checks run one region first so that they measure remat only.
    w = remat.checkpoint_wrapper(nn.Linear(2, 2))
    w(torch.ones(1, 2, requires_grad=True)).sum().backward()


# ---------------------------------------------------------------------------------------------
# A module with dropout, BatchNorm, keyword arguments, nested inputs and non-tensor outputs
# ---------------------------------------------------------------------------------------------


class Fancy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(D, D)
        self.calls: list[tuple[bool, bool]] = []

    def forward(
        self,
        x: torch.Tensor,
        extras: dict[str, Any],
        *,
        scale: float = 1.0,
        mask: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        self.calls.append((remat.is_checkpointing(), remat.is_recomputing()))
        a, b = extras["pair"]
        h = self.bn(self.lin(x * a + b))
        h = self.drop(torch.tanh(h)) * scale
        if mask is not None:
            h = h * mask
        y = self.out(h) + extras["bias"]["c"]
        return {"y": y, "name": "fancy", "count": 3, "aux": (y.square().mean(), None)}


def _fancy_batch(step: int) -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    x, a, b = (torch.randn(BATCH, D, generator=g).requires_grad_() for _ in range(3))
    c = torch.randn(D, generator=g).requires_grad_()
    mask = (torch.rand(BATCH, D, generator=g) > 0.2).float()
    args = (x, {"pair": [a, b], "bias": {"c": c}})
    return args, {"scale": 0.5, "mask": mask}, [x, a, b, c]


_LOSS_WEIGHTS = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(5))


def _fancy_loss(out: dict[str, Any]) -> torch.Tensor:
    return (out["y"] * _LOSS_WEIGHTS).sum() + out["aux"][0]


def _call_module(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return model(*args, **kwargs)


def _train_fancy(
    prepare: Callable[[nn.Module], object] = lambda m: m,
    steps: int = 3,
    call: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any] = _call_module,
) -> tuple[Fancy, list[dict[str, Any]]]:
    """Train a fresh Fancy (seed 0) with SGD; per step: outputs, input and parameter gradients,
    and parameters and buffers after the update."""
    torch.manual_seed(0)
    model = Fancy()
    prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    records = []
    for step in range(steps):
        args, kwargs, leaves = _fancy_batch(step)
        torch.manual_seed(1000 + step)
        out = call(model, args, kwargs)
        _fancy_loss(out).backward()
        record = {
            "out": _detach(out),
            "input_grads": [t.grad for t in leaves],
            "grads": _grads(model),
        }
        opt.step()
        opt.zero_grad()
        record["state"] = _tensors(model)
        records.append(record)
    return model, records


# ---------------------------------------------------------------------------------------------
# 1. checkpoint_wrapper: exact results, state updated once
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 3])
def test_wrapper_matches_plain_bit_for_bit(steps: int) -> None:
    dropped: list[int] = []

    def count_dropped(model: nn.Module) -> None:
        model.drop.register_forward_hook(lambda m, i, o: dropped.append(int((o == 0).sum())))

    plain, expected = _train_fancy(count_dropped, steps=steps)
    wrapped, got = _train_fancy(remat.checkpoint_wrapper, steps=steps)
    assert is_wrapped(wrapped)
    _assert_same(got, expected)
    # Non-tensor outputs and the None pass through untouched.
    assert got[0]["out"]["name"] == "fancy" and got[0]["out"]["count"] == 3
    assert got[0]["out"]["aux"][1] is None
    # Every step was checkpointed: a forward and one recompute, against one plain forward.
    assert wrapped.calls == [(True, False), (False, True)] * steps
    assert plain.calls == [(False, False)] * steps
    # The BatchNorm statistics moved once per step, like the plain run.
    assert wrapped.bn.num_batches_tracked.item() == steps
    # Dropout was active and dropped something in every step, so the RNG replay is exercised.
    assert len(dropped) == steps and min(dropped) > 0


def test_harness_detects_a_recompute_without_rng_replay() -> None:
    # The comparison above can fail: without RNG replay torch's checkpoint draws another
    # dropout mask in its recompute, and the gradients differ from the plain run.
    def torch_without_replay(model: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        return torch_checkpoint.checkpoint(
            model, *args, use_reentrant=False, preserve_rng_state=False, **kw
        )

    _, expected = _train_fancy(steps=1)
    _, got = _train_fancy(call=torch_without_replay, steps=1)
    _assert_same(got[0]["out"], expected[0]["out"])
    assert _differences(got[0]["grads"], expected[0]["grads"])


def test_wrapper_without_rng_replay_refuses_a_block_with_dropout() -> None:
    # remat raises where torch's checkpoint (above) gives other gradients.
    with pytest.raises(remat.CheckpointError, match="preserve_rng_state=False"):
        _train_fancy(lambda m: remat.checkpoint_wrapper(m, preserve_rng_state=False), 1)


def test_torch_checkpoint_updates_batchnorm_twice_remat_once() -> None:
    # pytorch/pytorch#96136: torch.utils.checkpoint re-runs BatchNorm's running-stat update in
    # the recompute. remat's write guard applies it once.
    def torch_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return torch_checkpoint.checkpoint(model, *args, use_reentrant=False, **kwargs)

    plain, expected = _train_fancy(steps=1)
    theirs, torch_got = _train_fancy(steps=1, call=torch_call)
    ours, remat_got = _train_fancy(remat.checkpoint_wrapper, steps=1)

    assert theirs.calls == [(False, False)] * 2  # torch recomputed the forward
    _assert_same(torch_got[0]["out"], expected[0]["out"])
    _assert_same(torch_got[0]["grads"], expected[0]["grads"])
    assert plain.bn.num_batches_tracked.item() == 1
    assert theirs.bn.num_batches_tracked.item() == 2
    assert not torch.equal(theirs.bn.running_mean, plain.bn.running_mean)
    assert not torch.equal(theirs.bn.running_var, plain.bn.running_var)

    assert ours.bn.num_batches_tracked.item() == 1
    _assert_same(remat_got, expected)


def test_wrapper_offload_to_cpu_is_exact_on_cpu() -> None:
    _, expected = _train_fancy(steps=2)
    wrapped, got = _train_fancy(lambda m: remat.checkpoint_wrapper(m, offload_to_cpu=True), steps=2)
    _assert_same(got, expected)
    assert wrapped.calls == [(True, False), (False, True)] * 2
    assert wrapped.bn.num_batches_tracked.item() == 2


def test_wrapper_options_are_forwarded() -> None:
    # early_stop=False and determinism_check="none" reach the region and keep results exact.
    _, expected = _train_fancy(steps=1)
    wrapped, got = _train_fancy(
        lambda m: remat.checkpoint_wrapper(m, early_stop=False, determinism_check="none"), 1
    )
    _assert_same(got, expected)
    assert wrapped.calls == [(True, False), (False, True)]


# ---------------------------------------------------------------------------------------------
# 2. Forward counts and region flags
# ---------------------------------------------------------------------------------------------


def _fresh_fancy(wrap: bool) -> Fancy:
    torch.manual_seed(0)
    model = Fancy()
    if wrap:
        remat.checkpoint_wrapper(model)
    return model


def test_wrapped_forward_runs_twice_per_step_and_saves_no_activation() -> None:
    model = _fresh_fancy(wrap=True)
    args, kwargs, leaves = _fancy_batch(0)
    with _count_saved() as saved:
        out = model(*args, **kwargs)
    # Forward pass: inside the region, checkpointing and not recomputing.
    assert model.calls == [(True, False)]
    # Outside the region autograd keeps at most the region's tensor inputs, no activation.
    inputs = {t.data_ptr() for t in [*leaves, kwargs["mask"]]}
    assert {t.data_ptr() for t in saved} <= inputs
    _fancy_loss(out).backward()
    # Backward: one recompute, flagged as such.
    assert model.calls == [(True, False), (False, True)]

    plain = _fresh_fancy(wrap=False)
    with _count_saved() as plain_saved:
        plain(*args, **kwargs)
    assert len(plain_saved) > len(inputs)
    assert plain.calls == [(False, False)]


def test_wrapped_module_saves_its_tensor_inputs_through_autograd() -> None:
    # Rule 2 of the nesting note and offload_to_cpu both rely on the region's inputs being
    # saved tensors of the graph, seen by the saved-tensor hooks around the region.
    model = remat.checkpoint_wrapper(nn.Linear(D, D))
    x = torch.randn(BATCH, D, requires_grad=True) * 2
    with _count_saved() as saved:
        model(x)
    assert [t.data_ptr() for t in saved] == [x.data_ptr()]


def test_wrapped_module_input_modified_in_place_raises_like_plain() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(D, D)
    model = remat.checkpoint_wrapper(copy.deepcopy(plain))
    base = torch.randn(BATCH, D, requires_grad=True)
    for m in (plain, model):
        x = base * 1
        y = m(x)
        x.mul_(2)  # the gradient of the weight needs the value x had in forward
        with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
            y.sum().backward()


def test_nested_input_modified_in_place_raises_like_plain() -> None:
    torch.manual_seed(0)
    plain = Fancy()
    model = remat.checkpoint_wrapper(copy.deepcopy(plain))
    for m in (plain, model):
        args, kwargs, _ = _fancy_batch(0)
        out = m(*args, **kwargs)
        with torch.no_grad():
            args[1]["pair"][0].mul_(2)  # a tensor inside a list argument
        with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
            _fancy_loss(out).backward()


def test_wrapped_module_inside_a_region_lets_the_region_drop_its_input() -> None:
    _warm_up()
    torch.manual_seed(0)
    stem = nn.Linear(D, D)
    inner = remat.checkpoint_wrapper(nn.Linear(D, D))
    seen: list[weakref.ref[torch.Tensor]] = []
    inner.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0])))
    x = torch.randn(BATCH, D, requires_grad=True)
    with _gc_off():
        out = remat.checkpoint(lambda t: inner(torch.tanh(stem(t))), x)
        # The inner region's input is an activation of the outer region: the outer region
        # drops it and rebuilds it in backward (Rule 2).
        assert seen[0]() is None
        del out


def test_wrapped_forward_under_no_grad_runs_once_and_saves_nothing() -> None:
    model = _fresh_fancy(wrap=True)
    args, kwargs, _ = _fancy_batch(0)
    with torch.no_grad(), _count_saved() as saved:
        out = model(*args, **kwargs)
    assert model.calls == [(False, False)]
    assert saved == []
    assert out["y"].grad_fn is None and not out["y"].requires_grad
    assert model.bn.num_batches_tracked.item() == 1


def test_disable_checkpointing_runs_the_wrapped_forward_once() -> None:
    plain = _fresh_fancy(wrap=False)
    model = _fresh_fancy(wrap=True)
    args, kwargs, leaves = _fancy_batch(0)
    torch.manual_seed(1)
    with _count_saved() as plain_saved:
        expected = plain(*args, **kwargs)
    _fancy_loss(expected).backward()
    expected_grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    torch.manual_seed(1)
    with remat.disable_checkpointing(), _count_saved() as saved:
        out = model(*args, **kwargs)
    _fancy_loss(out).backward()
    assert model.calls == [(False, False)]
    assert len(saved) == len(plain_saved)
    _assert_same(_detach(out), _detach(expected))
    _assert_same([t.grad for t in leaves], expected_grads)
    _assert_same(_grads(model), _grads(plain))


def test_forward_hooks_on_wrapped_module_run_once() -> None:
    model = _fresh_fancy(wrap=True)
    seen: list[str] = []
    model.register_forward_pre_hook(lambda m, a, k: seen.append("pre"), with_kwargs=True)
    model.register_forward_hook(lambda m, a, o: seen.append("post"))
    args, kwargs, _ = _fancy_batch(0)
    _fancy_loss(model(*args, **kwargs)).backward()
    assert seen == ["pre", "post"]
    assert len(model.calls) == 2


# ---------------------------------------------------------------------------------------------
# 3. Identity of the wrapped module, argument errors
# ---------------------------------------------------------------------------------------------


def test_wrapping_keeps_class_names_keys_and_repr() -> None:
    plain = _fresh_fancy(wrap=False)
    torch.manual_seed(0)
    model = Fancy()
    assert remat.checkpoint_wrapper(model) is model
    assert type(model) is Fancy
    assert is_wrapped(model) and not is_wrapped(plain)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in plain.named_buffers()]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert repr(model) == repr(plain)
    # A plain state_dict loads strictly into the wrapped module, and back.
    model.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(model.state_dict(), strict=True)


def test_wrapping_twice_raises() -> None:
    model = remat.checkpoint_wrapper(nn.Linear(2, 2))
    with pytest.raises(RematError, match=r"this Linear is already checkpointed; wrap each"):
        remat.checkpoint_wrapper(model)


def test_wrapping_a_module_with_an_instance_forward_raises() -> None:
    model = nn.Linear(2, 2)
    model.forward = lambda x: x  # type: ignore[method-assign]
    with pytest.raises(RematError, match=r"instance-level forward.*del module\.forward"):
        remat.checkpoint_wrapper(model)
    assert not is_wrapped(model)


@pytest.mark.parametrize("value", [lambda x: x, 3, [nn.Linear(2, 2)]])
def test_wrapping_a_non_module_raises(value: Any) -> None:
    name = type(value).__name__
    with pytest.raises(RematError, match=rf"expected an nn\.Module, got {name}"):
        remat.checkpoint_wrapper(value)


def test_unknown_option_raises_with_hint() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(
        RematError, match=r"unknown option 'preserve_rng'.*did you mean 'preserve_rng_state'"
    ):
        remat.checkpoint_wrapper(model, preserve_rng=False)
    assert not is_wrapped(model)


def test_arguments_of_torch_and_fairscale_wrappers_say_how_to_port_them() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    impl = CheckpointImpl.NO_REENTRANT
    with pytest.raises(RematError, match=r"takes its checkpoint_impl second.*drop that argument"):
        remat.checkpoint_wrapper(nn.Linear(2, 2), impl)  # type: ignore[arg-type]
    with pytest.raises(RematError, match=r"checkpoint_impl=.*always non-reentrant: drop it"):
        remat.checkpoint_wrapper(nn.Linear(2, 2), checkpoint_impl=impl)
    with pytest.raises(RematError, match=r"maintain_forward_counter=.*: drop it"):
        remat.checkpoint_wrapper(nn.Linear(2, 2), maintain_forward_counter=True)
    with pytest.raises(RematError, match=r"auto_wrap_policy=.*as remat\.apply's second arg"):
        remat.apply(nn.Sequential(nn.Linear(2, 2)), nn.Linear, auto_wrap_policy=None)
    # Not taken for a misspelt option of remat's: no "did you mean 'context_fn'".
    with pytest.raises(RematError, match=r"checkpoint_fn= is not an option of remat's\. ") as e:
        remat.checkpoint_wrapper(nn.Linear(2, 2), checkpoint_fn=torch.utils.checkpoint.checkpoint)
    assert "did you mean" not in str(e.value)


def test_a_context_fn_that_returns_one_context_manager_says_two_are_expected() -> None:
    x = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(RematError, match=r"context_fn must return two context managers.*got "):
        remat.checkpoint(nn.Linear(2, 2), x, context_fn=contextlib.nullcontext)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"offload_to_cpu": "yes"}, r"offload_to_cpu must be True or False, got 'yes'"),
        ({"offload_to_cpu": 1}, r"offload_to_cpu must be True or False, got 1"),
        ({"preserve_rng_state": "no"}, r"preserve_rng_state must be True or False"),
        ({"use_reentrant": True}, r"use_reentrant=True is not supported"),
        ({"determinism_check": "strict"}, r"determinism_check must be one of"),
        ({"context_fn": 3}, r"context_fn must be a callable"),
    ],
)
def test_bad_option_values_raise_and_leave_module_unwrapped(
    options: dict[str, Any], pattern: str
) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(RematError, match=pattern):
        remat.checkpoint_wrapper(model, **options)
    assert not is_wrapped(model)


# ---------------------------------------------------------------------------------------------
# 4. No reference cycles, activations freed with the graph
# ---------------------------------------------------------------------------------------------


class Act(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, D)
        self.act = nn.Tanh()
        self.drop = nn.Dropout(0.5)
        self.lin2 = nn.Linear(D, D)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin2(self.drop(self.act(self.lin1(x))))


def test_wrapped_module_is_freed_without_gc() -> None:
    _warm_up()
    with _gc_off():
        model = remat.checkpoint_wrapper(Act())
        ref = weakref.ref(model)
        del model
        assert ref() is None


def test_wrapped_module_is_freed_without_gc_after_forward_and_backward() -> None:
    _warm_up()
    with _gc_off():
        model = remat.checkpoint_wrapper(Act())
        ref = weakref.ref(model)
        x = torch.randn(BATCH, D, requires_grad=True)
        out = model(x)
        out.sum().backward()
        assert model.calls == 2
        del model, out
        assert ref() is None


def test_gc_check_detects_a_cycle() -> None:
    # Control for the two tests above: a wrapper that binds the module in its own __dict__
    # forms a cycle, which the same check sees.
    with _gc_off():
        model = Act()
        model.forward = types.MethodType(Act.forward, model)  # type: ignore[method-assign]
        ref = weakref.ref(model)
        del model
        assert ref() is not None
    gc.collect()
    assert ref() is None


def test_graph_holds_the_module_until_the_output_is_dropped() -> None:
    _warm_up()
    with _gc_off():
        model = remat.checkpoint_wrapper(Act())
        ref = weakref.ref(model)
        out = model(torch.randn(BATCH, D, requires_grad=True))
        del model
        assert ref() is not None  # backward would still need it
        del out
        assert ref() is None


def test_freed_module_makes_its_forward_raise() -> None:
    model = remat.checkpoint_wrapper(Act())
    forward = model.forward
    del model
    gc.collect()
    with pytest.raises(RematError, match=r"module of this checkpointed forward was freed"):
        forward(torch.randn(1, D))


@pytest.mark.parametrize("wrap", [False, True])
def test_activations_are_dropped_and_freed(wrap: bool) -> None:
    _warm_up()
    torch.manual_seed(0)
    model = Act()
    if wrap:
        remat.checkpoint_wrapper(model)
    # The input of lin2 is an activation that autograd saves (for lin2's weight gradient).
    seen: list[weakref.ref[torch.Tensor]] = []
    model.lin2.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0])))
    base = torch.randn(BATCH, D, requires_grad=True)
    with _gc_off():
        x = base * 2  # a non-leaf input: only the graph can keep it
        x_ref = weakref.ref(x)
        out = model(x)
        del x
        assert x_ref() is not None  # the region keeps its input
        # A plain run keeps the activation for backward; the region does not.
        assert (seen[0]() is None) == wrap
        del out
        assert x_ref() is None
        assert all(r() is None for r in seen)

        x = base * 2
        x_ref = weakref.ref(x)
        out = model(x)
        del x
        out.sum().backward()
        # The recompute's activations are handed to autograd once and go with the graph.
        assert len(seen) == (3 if wrap else 2)
        assert all(r() is None for r in seen)
        assert x_ref() is None
        del out


# ---------------------------------------------------------------------------------------------
# 5. deepcopy and pickling
# ---------------------------------------------------------------------------------------------


def _act_step(model: nn.Module) -> dict[str, Any]:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(BATCH, D, generator=g, requires_grad=True)
    torch.manual_seed(77)
    y = model(x)
    (y * _LOSS_WEIGHTS).sum().backward()
    return {"y": y.detach(), "x.grad": x.grad, "grads": _grads(model)}


def _perturb(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)


def test_deepcopy_of_wrapped_module_runs_on_the_copy() -> None:
    torch.manual_seed(0)
    plain = Act()
    original = remat.checkpoint_wrapper(copy.deepcopy(plain))
    clone = copy.deepcopy(original)
    plain_clone = copy.deepcopy(plain)
    assert is_wrapped(clone) and type(clone) is Act
    assert clone.forward is not original.forward
    _perturb(clone)
    _perturb(plain_clone)

    got = _act_step(clone)
    assert clone.calls == 2 and original.calls == 0  # checkpointed, and on the copy
    _assert_same(got, _act_step(plain_clone))
    assert _differences(got["y"], _act_step(original)["y"])
    assert original.calls == 2


def test_deepcopy_of_model_containing_wrapped_module() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(D, D), Act(), nn.Linear(D, D))
    model = copy.deepcopy(plain)
    remat.checkpoint_wrapper(model[1])
    clone = copy.deepcopy(model)
    plain_clone = copy.deepcopy(plain)
    assert is_wrapped(clone[1]) and not is_wrapped(clone)
    _perturb(clone[1])
    _perturb(plain_clone[1])

    got = _act_step(clone)
    assert clone[1].calls == 2 and model[1].calls == 0
    _assert_same(got, _act_step(plain_clone))
    assert _differences(got["y"], _act_step(model)["y"])


def test_deepcopy_of_the_forward_alone_raises() -> None:
    model = remat.checkpoint_wrapper(Act())
    with pytest.raises(RematError, match=r"deep-copied only together with its module"):
        copy.deepcopy(model.forward)


def _round_trip(obj: nn.Module) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_pickle_round_trip_of_wrapped_module() -> None:
    torch.manual_seed(0)
    plain = Act()
    model = remat.checkpoint_wrapper(copy.deepcopy(plain))
    loaded = _round_trip(model)
    assert type(loaded) is Act and is_wrapped(loaded)
    _assert_same(_tensors(loaded), _tensors(model))

    _assert_same(_act_step(loaded), _act_step(copy.deepcopy(plain)))
    assert loaded.calls == 2 and model.calls == 0

    # The loaded forward runs on the loaded parameters.
    plain_again = copy.deepcopy(plain)
    _perturb(loaded)
    _perturb(plain_again)
    for m in (loaded, plain_again):
        m.zero_grad()
    _assert_same(_act_step(loaded), _act_step(plain_again))
    assert loaded.calls == 4 and model.calls == 0


def test_pickle_round_trip_of_model_containing_wrapped_module() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(D, D), Act(), nn.Linear(D, D))
    model = copy.deepcopy(plain)
    remat.checkpoint_wrapper(model[1])
    loaded = _round_trip(model)
    assert is_wrapped(loaded[1]) and not is_wrapped(loaded[0])
    _assert_same(_act_step(loaded), _act_step(plain))
    assert loaded[1].calls == 2 and model[1].calls == 0


# ---------------------------------------------------------------------------------------------
# 7. apply
# ---------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.act = nn.Tanh()
        self.drop = nn.Dropout(0.3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(self.act(self.lin(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.body = nn.Sequential(Block(), nn.BatchNorm1d(D), Block())
        self.extra = Block()
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.extra(self.body(self.stem(x))))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _wrapped_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if is_wrapped(m)}


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (Block, {"body.0", "body.2", "extra"}),
        ((Block, nn.Linear), {"stem", "body.0", "body.2", "extra", "head"}),
        (lambda name, m: name in {"body.2", "head"}, {"body.2", "head"}),
        (["extra", "body.0"], {"extra", "body.0"}),
        (("stem",), {"stem"}),
        # A parent and a child both match: only the parent is wrapped.
        (["body", "body.0"], {"body"}),
        (lambda name, m: isinstance(m, (nn.Sequential, Block)), {"body", "extra"}),
        ((nn.Sequential, nn.Linear), {"stem", "body", "extra.lin", "head"}),
        (lambda name, m: True, {""}),
    ],
)
def test_apply_selects_outermost_matches(where: Any, expected: set[str]) -> None:
    model = _net()
    assert remat.apply(model, where) is model
    assert _wrapped_names(model) == expected
    assert type(model) is Net


def _train_net(
    prepare: Callable[[nn.Module], object], steps: int = 2
) -> tuple[Net, list[dict[str, Any]]]:
    model = _net()
    prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = []
    for step in range(steps):
        g = torch.Generator().manual_seed(200 + step)
        x = torch.randn(BATCH, D, generator=g, requires_grad=True)
        torch.manual_seed(2000 + step)
        y = model(x)
        y.square().sum().backward()
        record = {"y": y.detach(), "x.grad": x.grad, "grads": _grads(model)}
        opt.step()
        opt.zero_grad()
        record["state"] = _tensors(model)
        records.append(record)
    return model, records


@pytest.mark.parametrize(
    ("where", "block_calls"),
    [(Block, [4, 4, 4]), (["body"], [4, 4, 2]), ((Block, nn.Linear), [4, 4, 4])],
)
def test_apply_gradients_match_plain(where: Any, block_calls: list[int]) -> None:
    plain, expected = _train_net(lambda m: m)
    model, got = _train_net(lambda m: remat.apply(m, where))
    _assert_same(got, expected)
    # Each Block ran once per step in the plain run, twice when inside a wrapped module.
    assert [b.calls for b in model.modules() if isinstance(b, Block)] == block_calls
    assert [b.calls for b in plain.modules() if isinstance(b, Block)] == [2, 2, 2]
    bn = model.body[1]
    assert isinstance(bn, nn.BatchNorm1d) and bn.num_batches_tracked.item() == 2


def test_apply_passes_options_through() -> None:
    _, expected = _train_net(lambda m: m, steps=1)
    model, got = _train_net(lambda m: remat.apply(m, Block, offload_to_cpu=True), steps=1)
    assert _wrapped_names(model) == {"body.0", "body.2", "extra"}
    _assert_same(got, expected)
    with pytest.raises(RematError, match=r"did you mean 'preserve_rng_state'"):
        remat.apply(_net(), Block, preserve_rng=False)


def test_apply_matching_nothing_lists_classes() -> None:
    model = _net()
    with pytest.raises(
        RematError,
        match=r"where=Conv2d matches no module of Net; module classes present: "
        r"BatchNorm1d, Block, Dropout, Linear, Net, Sequential, Tanh\.",
    ):
        remat.apply(model, nn.Conv2d)
    with pytest.raises(RematError, match=r"matches no module of Net"):
        remat.apply(model, lambda name, m: False)
    assert _wrapped_names(model) == set()


def test_apply_unknown_name_raises_with_hint() -> None:
    model = _net()
    with pytest.raises(RematError) as info:
        remat.apply(model, ["body.0", "bdy.2", "nowhere_at_all"])
    message = str(info.value)
    assert "2 of the names in where match no submodule of Net" in message
    assert "'bdy.2' (did you mean 'body.2'?)" in message
    assert "'nowhere_at_all'" in message
    assert "'body.0'" not in message
    assert _wrapped_names(model) == set()


@pytest.mark.parametrize("answer", [1, None, "yes"])
def test_apply_predicate_returning_non_bool_raises(answer: Any) -> None:
    model = _net()
    with pytest.raises(RematError, match=rf"predicate returned {answer!r} for 'body'"):
        remat.apply(model, lambda name, m: name == "stem" or (answer if name == "body" else False))
    # The selection is validated before anything is wrapped.
    assert _wrapped_names(model) == set()


@pytest.mark.parametrize(
    ("where", "pattern"),
    [
        (int, r"where=int is not an nn\.Module class"),
        ((Block, int), r"where holds classes that are not modules: \['int'\]"),
        ("body", r"where must be a module class.*got str\. .*where=\['body'\]"),
        (3, r"where must be a module class.*got int"),
        ([Block], r"got list\. For several classes, pass a tuple"),
        (lambda name, module, depth: True, r"predicate takes \(name, module, depth\)"),
    ],
)
def test_apply_bad_where_raises(where: Any, pattern: str) -> None:
    with pytest.raises(RematError, match=pattern):
        remat.apply(_net(), where)


def test_apply_given_a_module_instance_names_its_class_and_path() -> None:
    # A module is callable: taken for a predicate, its forward ran with (name, module).
    model = _net()
    with pytest.raises(RematError, match=r"module instance \(Block\).*Pass Block .*\['body\.2'\]"):
        remat.apply(model, model.body[2])
    assert _wrapped_names(model) == set()


def test_apply_over_an_already_wrapped_module_is_all_or_nothing() -> None:
    model = _net()
    remat.checkpoint_wrapper(model.body[2])
    try:
        remat.apply(model, Block)
    except RematError:
        assert _wrapped_names(model) == {"body.2"}
    else:
        assert _wrapped_names(model) == {"body.0", "body.2", "extra"}


def test_apply_non_module_model_raises() -> None:
    with pytest.raises(RematError, match=r"remat\.apply: expected an nn\.Module, got list"):
        remat.apply([nn.Linear(2, 2)], nn.Linear)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# 8. checkpoint_sequential
# ---------------------------------------------------------------------------------------------


class Counted(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


BN_INDEX = 1


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        Counted(nn.Linear(D, D)),
        Counted(nn.BatchNorm1d(D)),
        Counted(nn.Tanh()),
        Counted(nn.Dropout(0.5)),
        Counted(nn.Linear(D, D)),
    )


def _train_seq(
    run: Callable[[Any, torch.Tensor], torch.Tensor], as_list: bool, steps: int = 2
) -> tuple[nn.Sequential, list[dict[str, Any]]]:
    seq = _seq()
    functions = list(seq) if as_list else seq
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    records = []
    for step in range(steps):
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(BATCH, D, generator=g, requires_grad=True)
        torch.manual_seed(3000 + step)
        y = run(functions, x)
        (y * _LOSS_WEIGHTS).sum().backward()
        record = {"y": y.detach(), "x.grad": x.grad, "grads": _grads(seq)}
        opt.step()
        opt.zero_grad()
        record["state"] = _tensors(seq)
        records.append(record)
    return seq, records


def _plain_run(functions: Any, x: torch.Tensor) -> torch.Tensor:
    for f in functions:
        x = f(x)
    return x


@pytest.mark.parametrize("as_list", [False, True], ids=["sequential", "list"])
@pytest.mark.parametrize("segments", [1, 2, 3, 5])
def test_checkpoint_sequential_matches_plain_and_torch(segments: int, as_list: bool) -> None:
    steps = 2
    plain, expected = _train_seq(_plain_run, as_list, steps)
    # torch's signature, ``use_reentrant`` fourth and positional, as ported code passes it
    ours, got = _train_seq(
        lambda f, x: remat.checkpoint_sequential(f, segments, x, False), as_list, steps
    )
    theirs, torch_got = _train_seq(
        lambda f, x: torch_checkpoint.checkpoint_sequential(f, segments, x, False),
        as_list,
        steps,
    )
    _assert_same(got, expected)
    # torch's own checkpoint_sequential gives the same outputs and gradients (its BatchNorm
    # statistics differ, see below, but training-mode BatchNorm does not read them).
    keys = ("y", "x.grad", "grads")
    for mine, reference in zip(torch_got, got, strict=True):
        _assert_same({k: mine[k] for k in keys}, {k: reference[k] for k in keys})

    # Segments of len // segments modules; all but the last are checkpointed, so recomputed
    # exactly once per step, and the last segment (with the remainder) is never recomputed.
    checkpointed = (len(plain) // segments) * (segments - 1)
    expected_calls = [steps * (2 if i < checkpointed else 1) for i in range(len(plain))]
    assert [m.calls for m in ours] == expected_calls
    assert [m.calls for m in theirs] == expected_calls
    assert [m.calls for m in plain] == [steps] * len(plain)

    # BatchNorm statistics move once per step with remat; torch moves them again when it
    # recomputes the BatchNorm.
    assert ours[BN_INDEX].inner.num_batches_tracked.item() == steps
    bn_recomputed = checkpointed > BN_INDEX
    assert theirs[BN_INDEX].inner.num_batches_tracked.item() == steps * (1 + bn_recomputed)


def test_checkpoint_sequential_non_dividing_segments() -> None:
    # 5 functions in 2 segments: the first 2 are checkpointed, the last 3 run plainly.
    seq, got = _train_seq(lambda f, x: remat.checkpoint_sequential(f, 2, x), False, 1)
    _, expected = _train_seq(_plain_run, False, 1)
    _assert_same(got, expected)
    assert [m.calls for m in seq] == [2, 2, 1, 1, 1]


def test_checkpoint_sequential_with_plain_functions() -> None:
    def build() -> list[Callable[[torch.Tensor], torch.Tensor]]:
        torch.manual_seed(0)
        return [Counted(nn.Linear(D, D)), torch.tanh, Counted(nn.Dropout(0.5)), nn.Linear(D, D)]

    x = torch.randn(BATCH, D, requires_grad=True)
    results = []
    for run in (
        _plain_run,
        lambda f, t: remat.checkpoint_sequential(f, 2, t),
        lambda f, t: torch_checkpoint.checkpoint_sequential(f, 2, t, use_reentrant=False),
    ):
        functions = build()
        torch.manual_seed(5)
        y = run(functions, x)
        (y * _LOSS_WEIGHTS).sum().backward()
        grads = [p.grad for f in functions if isinstance(f, nn.Module) for p in f.parameters()]
        results.append(([y.detach(), x.grad.clone(), *grads], [functions[0].calls]))
        x.grad = None
    _assert_same(results[1], (results[0][0], [2]))
    _assert_same(results[2], (results[0][0], [2]))


@pytest.mark.parametrize(("segments", "calls"), [(1, 2), (2, 3), (3, 3)])
def test_checkpoint_sequential_runs_a_module_held_twice_at_both_positions(
    segments: int, calls: int
) -> None:
    # The same block at positions 0 and 2 (weights tied across depth) runs twice, as in the
    # Sequential's own forward; ``children()`` yields it once and would skip position 2.
    torch.manual_seed(0)
    block = Counted(nn.Linear(D, D))
    seq = nn.Sequential(block, nn.Tanh(), block)
    x = torch.randn(BATCH, D, requires_grad=True)
    results = []
    for run in (seq, lambda t: remat.checkpoint_sequential(seq, segments, t)):
        block.calls = 0
        y = run(x)
        (y * _LOSS_WEIGHTS).sum().backward()
        results.append([y.detach(), x.grad, _grads(seq), block.calls])
        seq.zero_grad(set_to_none=True)
        x.grad = None
    # Checkpointed, position 0 runs again in backward when its segment is not the last.
    _assert_same(results[1], [*results[0][:3], calls])
    assert results[0][3] == 2
    with pytest.raises(RematError, match=r"number of functions \(3\), got 4"):
        remat.checkpoint_sequential(seq, 4, x)


def test_checkpoint_sequential_under_no_grad_runs_once() -> None:
    seq = _seq()
    with torch.no_grad(), _count_saved() as saved:
        y = remat.checkpoint_sequential(seq, 2, torch.randn(BATCH, D))
    assert [m.calls for m in seq] == [1] * len(seq)
    assert saved == [] and y.grad_fn is None


@pytest.mark.parametrize(
    ("segments", "pattern"),
    [
        (0, r"segments must be between 1 and the number of functions \(5\), got 0"),
        (6, r"segments must be between 1 and the number of functions \(5\), got 6"),
        (-1, r"between 1 and the number of functions \(5\), got -1"),
        ("2", r"segments must be an int, got '2'"),
        (2.0, r"segments must be an int, got 2\.0"),
        (True, r"segments must be an int, got True"),
    ],
)
def test_checkpoint_sequential_bad_segments(segments: Any, pattern: str) -> None:
    with pytest.raises(RematError, match=pattern):
        remat.checkpoint_sequential(_seq(), segments, torch.randn(BATCH, D))


def test_checkpoint_sequential_bad_functions() -> None:
    x = torch.randn(BATCH, D)
    with pytest.raises(RematError, match=r"functions at positions \[1, 3\] are not callable"):
        remat.checkpoint_sequential([nn.Tanh(), 3, nn.Tanh(), "relu"], 2, x)
    with pytest.raises(RematError, match=r"must be an nn\.Sequential or a list.*got generator"):
        remat.checkpoint_sequential((m for m in [nn.Tanh()]), 1, x)
    with pytest.raises(RematError, match=r"unknown option 'early'.*did you mean 'early_stop'"):
        remat.checkpoint_sequential([nn.Tanh()], 1, x, early=True)
    with pytest.raises(RematError, match=r"functions \(0\), got 1"):
        remat.checkpoint_sequential([], 1, x)


# ---------------------------------------------------------------------------------------------
# 9. Porting paths: the spellings of torch, torchtitan and fairscale, in their tests' style
# ---------------------------------------------------------------------------------------------


def test_apply_activation_checkpointing_check_fn_one_argument() -> None:
    # torch's apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block)).
    _, expected = _train_net(lambda m: m)
    for prepare in (
        lambda m: remat.apply(m, lambda submodule: isinstance(submodule, Block)),
        lambda m: remat.apply(m, check_fn=lambda submodule: isinstance(submodule, Block)),
    ):
        model, got = _train_net(prepare)
        assert _wrapped_names(model) == {"body.0", "body.2", "extra"}
        _assert_same(got, expected)
        assert [b.calls for b in model.modules() if isinstance(b, Block)] == [4, 4, 4]
    with pytest.raises(RematError, match="where or check_fn, not both"):
        remat.apply(_net(), Block, check_fn=lambda m: True)


def test_apply_every_n_checkpoints_every_nth_matching_block() -> None:
    # torchtitan's selective AC by layers: the 2nd, 4th, ... matching block.
    _, expected = _train_net(lambda m: m)
    model, got = _train_net(lambda m: remat.apply(m, Block, every=2))
    assert _wrapped_names(model) == {"body.2"}
    _assert_same(got, expected)
    assert [b.calls for b in model.modules() if isinstance(b, Block)] == [2, 4, 2]
    with pytest.raises(RematError, match="every=4 selects none"):
        remat.apply(_net(), Block, every=4)
    with pytest.raises(RematError, match="every must be an int >= 1, got 0"):
        remat.apply(_net(), Block, every=0)


def test_apply_torchtitan_modes() -> None:
    _, expected = _train_net(lambda m: m)
    full, got = _train_net(lambda m: remat.apply(m, Block, mode="full"))
    _assert_same(got, expected)
    assert _wrapped_names(full) == {"body.0", "body.2", "extra"}
    # selective by layers: the config string of torchtitan ("2") or an int.
    for every in ("2", 2):
        layers, got = _train_net(
            lambda m, n=every: remat.apply(m, Block, mode="selective", selective=n)
        )
        _assert_same(got, expected)
        assert _wrapped_names(layers) == {"body.2"}
    # selective by op: matrix multiplies kept, the rest recomputed by the graph engine.
    ops, got = _train_net(lambda m: remat.apply(m, Block, mode="selective", selective="op"))
    _assert_same(got, expected)
    forwards = [m.__dict__["forward"] for m in ops.modules() if is_wrapped(m)]
    assert len(forwards) == 3
    assert all(f.options.policy is remat.policies.save_matmuls for f in forwards)
    # The graph engine replays ops, never the block's Python: each block ran once per step.
    assert [b.calls for b in ops.modules() if isinstance(b, Block)] == [2, 2, 2]
    with pytest.raises(RematError, match="mode must be 'full' or 'selective', got 'selectve'"):
        remat.apply(_net(), Block, mode="selectve")  # type: ignore[arg-type]
    with pytest.raises(RematError, match="selective must be 'op' or a number of layers"):
        remat.apply(_net(), Block, mode="selective", selective="ops")
    # Without mode="selective", selective= was ignored: every block wrapped, no policy.
    for mode in (None, "full"):
        model = _net()
        with pytest.raises(RematError, match=r"selective=2 applies with mode='selective'"):
            remat.apply(model, Block, mode=mode, selective=2)  # type: ignore[arg-type]
        assert _wrapped_names(model) == set()


def test_apply_selective_op_saves_less_than_plain_and_more_than_full() -> None:
    class SinBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1, self.lin2 = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin2(torch.sin(self.lin1(x)))  # sin saves its input, the mm's output

    def saved(prepare: Callable[[nn.Module], object]) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(SinBlock(), SinBlock())
        prepare(model)
        return remat.explain(model, torch.randn(BATCH, D, requires_grad=True)).kept_bytes

    plain = saved(lambda m: m)
    ops = saved(lambda m: remat.apply(m, SinBlock, mode="selective", selective="op"))
    full = saved(lambda m: remat.apply(m, SinBlock, mode="full"))
    assert full < ops < plain, (full, ops, plain)


def test_unapply_restores_the_original_modules() -> None:
    _, expected = _train_net(lambda m: m)
    keys = list(_net().state_dict())
    model, got = _train_net(lambda m: remat.unapply(remat.apply(m, Block)))
    assert _wrapped_names(model) == set()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert list(model.state_dict()) == keys
    _assert_same(got, expected)
    # Unwrapped: each block runs once per step again.
    assert [b.calls for b in model.modules() if isinstance(b, Block)] == [2, 2, 2]
    # Wrapping again after unapply works, and unapply of an unwrapped model changes nothing.
    assert _wrapped_names(remat.apply(model, Block)) == {"body.0", "body.2", "extra"}
    assert remat.unapply(remat.unapply(model)) is model


def test_checkpoint_error_is_a_torch_checkpoint_error() -> None:
    # torch's test_checkpoint style: a recompute that saves a differently shaped tensor.
    state = {"first": True}

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x if state["first"] else x[:2]
        state["first"] = False
        return y.sin()

    x = torch.randn(4, 3, requires_grad=True)
    out = remat.checkpoint(fn, x)
    with pytest.raises(torch_checkpoint.CheckpointError, match="remat: the recompute"):
        out.sum().backward()
    assert issubclass(remat.CheckpointError, RematError)
    assert issubclass(remat.CheckpointError, torch_checkpoint.CheckpointError)


def test_fairscale_checkpoint_wrapper_offload_to_cpu_positional() -> None:
    # fairscale's test_checkpoint_activations: checkpoint_wrapper(module, offload_to_cpu).
    def get_loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        torch.manual_seed(1)
        loss = model(x).sum()
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.2), nn.Linear(D, D))
    x = torch.randn(BATCH, D)
    for offload_to_cpu in (False, True):
        model = copy.deepcopy(plain)
        assert remat.checkpoint_wrapper(model, offload_to_cpu) is model
        assert model.__dict__["forward"].offload_to_cpu is offload_to_cpu
        loss, grads = get_loss_and_grads(model, x)
        plain_loss, plain_grads = get_loss_and_grads(copy.deepcopy(plain), x)
        assert torch.equal(loss, plain_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    # True sends the region's inputs to the host tier; on CPU they are there already.
    model = remat.checkpoint_wrapper(copy.deepcopy(plain), True)
    report = remat.explain(model, torch.randn(BATCH, D, requires_grad=True))
    assert report.rows[0].how == "not offloaded: already in host memory"


@pytest.mark.parametrize("policy", [None, remat.policies.save_matmuls], ids=["region", "graph"])
def test_user_hooks_run_as_documented(policy: Any) -> None:
    """Hooks on the wrapped module run once per step; hooks on modules inside it run again in
    the region engine's recompute (a pruning or weight-norm pre-hook is part of the forward),
    where ``remat.is_recomputing()`` tells them apart; the graph engine replays ATen ops and
    runs none. A backward hook sees the plain run's gradient."""

    def run(wrap: bool) -> tuple[dict[str, list[bool]], list[torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Dropout(0.3), nn.Linear(D, D))
        calls: dict[str, list[bool]] = {"pre": [], "outer": [], "inner": [], "backward": []}
        grad_out: list[torch.Tensor] = []
        model.register_forward_pre_hook(lambda m, a: calls["pre"].append(remat.is_recomputing()))
        model.register_forward_hook(lambda m, a, o: calls["outer"].append(remat.is_recomputing()))
        model[0].register_forward_hook(
            lambda m, a, o: calls["inner"].append(remat.is_recomputing())
        )

        def backward_hook(m: nn.Module, grad_input: Any, grad_output: Any) -> None:
            calls["backward"].append(remat.is_recomputing())
            grad_out.append(grad_output[0].clone())

        model.register_full_backward_hook(backward_hook)
        if wrap:
            remat.checkpoint_wrapper(model, policy=policy)
        x = torch.randn(BATCH, D, requires_grad=True)
        torch.manual_seed(1)
        model(x).square().sum().backward()
        return calls, grad_out, [x.grad, *(p.grad for p in model.parameters())]  # type: ignore[list-item]

    plain, plain_grad_out, plain_grads = run(wrap=False)
    calls, grad_out, grads = run(wrap=True)
    assert plain == {"pre": [False], "outer": [False], "inner": [False], "backward": [False]}
    recompute = [True] if policy is None else []
    assert calls == {**plain, "inner": [False, *recompute]}
    assert all(torch.equal(a, b) for a, b in zip(plain_grad_out, grad_out, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads, strict=True))


class _Counted(nn.Linear):
    """A linear layer that notes each call of its forward, and whether it was a recompute."""

    def __init__(self) -> None:
        super().__init__(D, D)
        self.calls: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(remat.is_recomputing())
        return super().forward(x)


class _Layered(nn.Module):
    """Its layers in a ``ModuleList`` and two heads in a ``ModuleDict``: containers that the
    model's ``forward`` never calls, only the modules in them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Counted() for _ in range(3)])
        self.heads = nn.ModuleDict({"a": nn.Linear(D, 2), "b": nn.Tanh()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.heads["a"](x)


@pytest.mark.parametrize(
    ("where", "hint"),
    [
        (nn.ModuleList, r"'layers', a ModuleList.*\(remat\.apply\(model, _Counted\)\)"),
        (["layers"], r"'layers', a ModuleList"),
        (["heads", "layers.0"], r"'heads', a ModuleDict.*\['heads\.a', 'heads\.b'\]"),
    ],
)
def test_a_container_that_is_never_called_is_refused(where: Any, hint: str) -> None:
    """Wrapping a ``ModuleList`` would checkpoint nothing, silently: its model calls the
    layers in it, never the list. The error names it and what to select instead; nothing is
    wrapped."""
    model = _Layered()
    with pytest.raises(RematError, match=rf"^remat\.apply: where=.* selects {hint}"):
        remat.apply(model, where)
    assert not any(is_wrapped(m) for m in model.modules())
    with pytest.raises(RematError, match=r"ModuleList has no forward: it is never called"):
        remat.checkpoint_wrapper(model.layers)


def test_a_predicate_that_reaches_a_container_wraps_the_modules_in_it() -> None:
    """A predicate that matches the list and its layers wraps the layers, and each of them
    is recomputed in backward, once."""
    model = _Layered()
    remat.apply(model, lambda name, module: name.startswith("layers"))
    wrapped = [name for name, m in model.named_modules() if is_wrapped(m)]
    assert wrapped == ["layers.0", "layers.1", "layers.2"]
    model(torch.randn(BATCH, D, requires_grad=True)).sum().backward()
    assert [layer.calls for layer in model.layers] == [[False, True]] * 3


def test_fsdp1_with_original_parameters_names_itself_and_the_setups_that_train() -> None:
    """FSDP1 with use_orig_params=True swaps a module's parameters between forward and
    backward; the region engine's recompute says so, and how to shard instead."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    from remat.workloads import get_workload

    workload = get_workload("gpt", "small")
    x, target = workload.batch(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for orig in (True, False):
            model = remat.apply(workload.model(0), workload.block_types)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # FSDP1's own deprecation notices
                sharded = FullyShardedDataParallel(
                    model, use_orig_params=orig, device_id=torch.device("cpu")
                )
            loss = workload.loss_fn(sharded(x), target)
            if orig:
                with pytest.raises(
                    remat.CheckpointError, match=r"FSDP1\) with use_orig_params=True"
                ):
                    loss.backward()
            else:
                loss.backward()
    finally:
        dist.destroy_process_group()


class _LazyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.LazyLinear(16), nn.Dropout(0.5), nn.LazyLinear(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.tanh(self.fc1(x))))


@pytest.mark.parametrize("policy", [None, remat.policies.recompute_everything])
def test_a_lazy_module_in_a_region_is_refused_until_its_first_forward_made_it(
    policy: Any,
) -> None:
    """A lazy module's first forward pass makes its parameters, drawing their values, which
    a recompute would do again: the region engine refuses it with what to do, and after one
    forward under no_grad a step equals a plain model's. The graph engine replays the ops it
    recorded, the parameters made once, so it trains from the first step."""

    def step(wrap: bool, dry_run: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(_LazyBlock(), nn.Linear(8, 1))
        if wrap:
            remat.apply(model, _LazyBlock, policy=policy)
        x = torch.randn(4, 8)
        if dry_run:
            with torch.no_grad():
                model(x)
        torch.manual_seed(1)
        model(x).square().mean().backward()
        return [p.grad for p in model.parameters()]  # type: ignore[misc]

    if policy is None:
        with pytest.raises(RematError, match=r"lazy module \(LazyLinear\).*torch\.no_grad"):
            step(wrap=True, dry_run=False)
    for dry_run in [True] if policy is None else [False, True]:
        expected, got = step(wrap=False, dry_run=dry_run), step(wrap=True, dry_run=dry_run)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
