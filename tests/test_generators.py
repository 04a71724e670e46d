"""Random ops that draw from a ``torch.Generator`` of their own: the recompute draws what the
forward pass drew, wherever the region keeps the generator, and a generator it cannot find
raises instead of drawing other numbers (NOTE [ Explicit generators ] in _ambient.py)."""

from __future__ import annotations

import copy
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import remat
from remat.checkpoint import LinkedCalls

from helpers import assert_equal

_GLOBAL_GENERATOR = torch.Generator().manual_seed(11)


def _noise(h: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A dropout that draws its mask from ``generator``; its backward needs the mask."""
    keep = torch.rand(h.shape, generator=generator) > 0.3
    return torch.tanh(h * keep)


class _Held(nn.Module):
    """A module that keeps its generator as an attribute (a noise layer, a sampler)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _noise(self.lin(x), self.generator)


class _Global(nn.Module):
    """A module whose code draws from a module-level generator."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _noise(self.lin(x), _GLOBAL_GENERATOR)


class _InDict(nn.Module):
    """A generator held in a dict attribute."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.rngs = {"noise": torch.Generator().manual_seed(6)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _noise(self.lin(x), self.rngs["noise"])


class _Hidden(nn.Module):
    """A generator on a plain object, where the walk does not look."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.config = types.SimpleNamespace(generator=torch.Generator().manual_seed(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _noise(self.lin(x), self.config.generator)


def _generators(model: nn.Module) -> list[torch.Generator]:
    found = [m.generator for m in model.modules() if isinstance(m, _Held)]
    found += [m.rngs["noise"] for m in model.modules() if isinstance(m, _InDict)]
    found += [m.config.generator for m in model.modules() if isinstance(m, _Hidden)]
    if any(isinstance(m, _Global) for m in model.modules()):
        found.append(_GLOBAL_GENERATOR)
    return found


def _step(model: nn.Module, x: torch.Tensor, **backward: Any) -> dict[str, Any]:
    """One step; what a user would look at after it, the generators' states included."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    out = model(x)
    with warnings.catch_warnings():
        # held through backward, to return it: see helpers.train
        warnings.filterwarnings("ignore", message="remat: the model's output")
        out.square().sum().backward(**backward)
    return {
        "out": out.detach(),
        "x": x.grad,
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "generators": [g.get_state() for g in _generators(model)],
        "cpu": torch.get_rng_state(),
    }


def _pair(
    make: Callable[[], nn.Module], wrap: Callable[[nn.Module], nn.Module]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One step of a plain model and of its wrapped copy, each from the same generator states."""
    torch.manual_seed(0)
    plain = make()
    states = [g.get_state() for g in _generators(plain)]
    wrapped = wrap(copy.deepcopy(plain))
    x = torch.randn(4, 8)
    a = _step(plain, x)
    for g, state in zip(_generators(plain), states, strict=True):
        g.set_state(state)  # the global generator is shared by both models
    return a, _step(wrapped, x)


def _checkpointed(model: nn.Module) -> nn.Module:
    return remat.checkpoint_wrapper(model)


@pytest.mark.parametrize("make", [_Held, _Global, _InDict], ids=["attribute", "global", "dict"])
def test_a_region_replays_the_generators_it_reaches(make: Callable[[], nn.Module]) -> None:
    plain, region = _pair(lambda: nn.Sequential(make(), make()), _checkpointed)
    assert_equal(plain, region)


def test_torch_checkpoint_draws_other_numbers_from_an_explicit_generator() -> None:
    """The failure remat fixes: torch's checkpoint replays the default generators only."""

    def wrap(model: nn.Module) -> nn.Module:
        class Torch(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = model

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                out: torch.Tensor = torch.utils.checkpoint.checkpoint(
                    self.inner, x, use_reentrant=False
                )
                return out

        return Torch()

    plain, torch_run = _pair(_Held, wrap)
    assert torch.equal(plain["out"], torch_run["out"])
    assert not torch.equal(plain["x"], torch_run["x"])  # other masks in the recompute
    assert not torch.equal(plain["generators"][0], torch_run["generators"][0])  # drawn twice


def test_a_generator_passed_as_an_argument_or_held_in_a_closure() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def by_argument(inp: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        return _noise(lin(inp), generator)

    closed = torch.Generator().manual_seed(9)

    def by_closure(inp: torch.Tensor) -> torch.Tensor:
        return _noise(lin(inp), closed)

    for run in ("argument", "closure"):
        results = []
        for checkpointed in (False, True):
            generator = torch.Generator().manual_seed(3)
            closed.manual_seed(9)
            inp = x.clone().requires_grad_()
            lin.zero_grad()
            if run == "argument":
                args: tuple[Any, ...] = (by_argument, inp)
                kwargs: dict[str, Any] = {"generator": generator}
            else:
                args, kwargs = (by_closure, inp), {}
            out = remat.checkpoint(*args, **kwargs) if checkpointed else args[0](inp, **kwargs)
            out.sum().backward()
            results.append(
                (inp.grad, lin.weight.grad.clone(), generator.get_state(), closed.get_state())
            )
        assert_equal(results[0], results[1], run)


def test_every_step_replays_with_the_guard_skipped() -> None:
    """The first recompute runs guarded ([ When the guard runs ] 2); the later ones run with no
    dispatch mode, and the generators are still replayed."""
    modes: list[int] = []

    class Watched(_Held):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if remat.is_recomputing():
                modes.append(len(_get_current_dispatch_mode_stack()))
            return super().forward(x)

    torch.manual_seed(0)
    plain = Watched()
    model = remat.checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(4, 8)
    for step in range(3):
        a = _step(plain, x)
        b = _step(model, x)
        plain.zero_grad()
        model.zero_grad()
        assert_equal(a, b, f"step {step}")
    assert modes == [1, 0, 0]  # the guard in the first recompute only


def _one(checkpointed: bool) -> tuple[nn.Module, torch.Generator, torch.Tensor]:
    """A ``_Held`` block, checkpointed or not, its generator and an input."""
    torch.manual_seed(0)
    model = _Held()
    wrapped = remat.checkpoint_wrapper(model) if checkpointed else model
    return wrapped, model.generator, torch.randn(4, 8, requires_grad=True)


def test_draws_between_forward_and_backward_are_kept() -> None:
    """Code after the forward pass draws from the generator (sampling, augmentation): the
    recompute replays the forward's draw and leaves the generator where that code left it."""
    results = []
    for checkpointed in (False, True):
        model, generator, x = _one(checkpointed)
        out = model(x)
        sample = torch.rand(3, generator=generator)
        out.sum().backward()
        after = torch.rand(3, generator=generator)
        results.append((x.grad, sample, after))
    assert_equal(results[0], results[1])


def test_retain_graph_and_a_second_backward() -> None:
    results = []
    for checkpointed in (False, True):
        model, generator, x = _one(checkpointed)
        out = model(x)
        out.square().sum().backward(retain_graph=True)
        first = x.grad.clone()
        out.square().sum().backward()
        results.append((first, x.grad, generator.get_state()))
    assert_equal(results[0], results[1])


def test_nested_regions_and_linked_calls() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = remat.checkpoint_wrapper(_Held())
            self.last = _Held()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(self.inner(x))

    plain, nested = _pair(Outer, _checkpointed)
    assert_equal(plain, nested, "nested")

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(_Held() for _ in range(3))
            self.chain: LinkedCalls | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, block in enumerate(self.blocks):
                if self.chain is None:
                    x = block(x)
                else:
                    x = self.chain.run(i, block, (x,), {}, last=i == 2)
            return x

    def link(model: nn.Module) -> nn.Module:
        model.chain = LinkedCalls()
        return model

    plain, linked = _pair(Loop, link)
    assert_equal(plain, linked, "linked")


def test_the_graph_engine_replays_explicit_generators() -> None:
    policy = remat.policies.recompute_everything
    plain, graph = _pair(_Held, lambda m: remat.checkpoint_wrapper(m, policy=policy))
    assert_equal(plain, graph)


def test_a_generator_the_walk_cannot_find_raises() -> None:
    torch.manual_seed(0)
    model = remat.checkpoint_wrapper(_Hidden())
    out = model(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(remat.CheckpointError, match=r"torch.Generator .*forward pass did not find"):
        out.sum().backward()


def test_without_preserve_rng_state_a_draw_from_any_generator_raises() -> None:
    """``preserve_rng_state=False`` replays no generator, so a recompute that draws from one
    (here an explicit generator the walk does not find) raises rather than give gradients of
    other numbers ([ Random ops not replayed ] in _ambient.py)."""
    torch.manual_seed(0)
    model = _Hidden()
    x = torch.randn(4, 8, requires_grad=True)
    out = remat.checkpoint(model, x, preserve_rng_state=False)
    with pytest.raises(remat.CheckpointError, match=r"preserve_rng_state=False"):
        out.sum().backward()
    assert x.grad is None


def test_offload_model_replays_its_slices_generators(tmp_path: Any) -> None:
    torch.manual_seed(0)
    layers = [_Held(), nn.ReLU(), _Held(), _Held()]
    plain = nn.Sequential(*copy.deepcopy(layers))
    model = remat.OffloadModel(
        copy.deepcopy(layers),
        device="cpu",
        offload_device="cpu",
        num_slices=2,
        checkpoint_activation=True,
    )
    x = torch.randn(4, 8)
    a = _step(plain, x)
    b = _step(model, x)
    assert_equal(a["out"], b["out"])
    assert_equal(a["x"], b["x"])
    assert_equal(list(a["grads"].values()), list(b["grads"].values()))
    assert_equal(a["generators"], b["generators"])


def test_offload_model_raises_for_a_generator_it_cannot_find() -> None:
    torch.manual_seed(0)
    model = remat.OffloadModel(
        [_Hidden(), _Hidden()],
        device="cpu",
        offload_device="cpu",
        num_slices=2,
        checkpoint_activation=True,
    )
    out = model(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(remat.CheckpointError, match="slice of an OffloadModel"):
        out.sum().backward()


def test_planning_leaves_the_generators_as_it_found_them() -> None:
    """``remat.fit`` runs the step several times to measure it; the model's generators are set
    back, so the first planned step draws what a plain model's first step draws."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(_Held(64) for _ in range(4)))
    fitted = copy.deepcopy(plain)
    x = torch.randn(256, 64)
    states = [g.get_state() for g in _generators(fitted)]
    plan = remat.fit(fitted, x, budget="90%", loss_fn=lambda o: o.square().sum(), repeats=0)
    assert any(b["option"] != "plain" for b in plan.blocks)  # something is recomputed
    assert_equal(states, [g.get_state() for g in _generators(fitted)])
    assert_equal(_step(plain, x), _step(fitted, x))
