"""A recompute reads what its forward pass read, or raises: never other weights, silently.

Between a forward pass and its backward, the modules a region runs may hold other tensors
(``torch.func.functional_call`` swaps parameters in for one call only; a module may replace
a parameter), other flags (``model.eval()``), or tensors written in place (an optimizer step,
a weight clamp). Torch's checkpoint recomputes with whatever the module holds in backward,
and its gradients are then wrong without an error; these tests pin that too, so that they
show what they guard against. See NOTE [ A recompute reads what its forward pass read ] in
``src/remat/_reads.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
from remat.planning.apply import apply_segment


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.norm = nn.BatchNorm1d(2 * width)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.drop(torch.tanh(self.norm(self.fc1(x)))))


class TorchCheckpointed(nn.Module):
    """A block under torch's checkpoint, for the contrast."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch_checkpoint(self.block, x, use_reentrant=False)
        return out


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(8), Block(8), nn.Linear(8, 3))


ENGINES: dict[str, Callable[[nn.Sequential], object]] = {
    "region": lambda m: remat.apply(m, Block),
    "segment": lambda m: apply_segment(m, ["0", "1"]),  # linked calls, as a plan makes
    "graph": lambda m: remat.apply(m, Block, policy=remat.policies.recompute_everything),
    "graph-matmuls": lambda m: remat.apply(m, Block, policy=remat.policies.save_matmuls),
    "graph-everything": lambda m: remat.apply(m, Block, policy=remat.policies.save_everything),
}


def engine_model(engine: str) -> nn.Sequential:
    model = make_model()
    ENGINES[engine](model)
    return model


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)


def swapped_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters of the same names and shapes, other values: what a user passes to
    ``functional_call`` (a hypernetwork's output, a meta-learner's fast weights)."""
    return {
        name: (p.detach() * 1.5 + 0.01).requires_grad_() for name, p in model.named_parameters()
    }


def functional_grads(model: nn.Module, seed: int = 0) -> list[torch.Tensor]:
    params = swapped_params(model)
    x, y = batch(seed)
    torch.manual_seed(seed)
    loss = F.mse_loss(functional_call(model, params, (x,)), y)
    return list(torch.autograd.grad(loss, list(params.values())))


@pytest.mark.parametrize("engine", ENGINES)
def test_functional_call_recomputes_with_the_tensors_it_was_given(engine: str) -> None:
    """``functional_call`` swaps its parameters into the modules for the forward pass only; the
    recompute in backward runs with them again, and the gradients equal the plain model's bit
    for bit; the modules hold their own parameters after backward, with no gradient."""
    expected = functional_grads(make_model())
    model = engine_model(engine)
    own = [p for _, p in model.named_parameters()]
    got = functional_grads(model)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert [p for _, p in model.named_parameters()] == own
    assert all(p.grad is None for p in own)
    assert _get_current_dispatch_mode_stack() == []


def test_torch_checkpoint_recomputes_functional_call_with_the_module_s_own_parameters() -> None:
    """The contrast: torch's checkpoint rebuilds the activations from the module's own
    parameters, so the gradients differ from the plain model's, with no error."""
    expected = functional_grads(make_model())
    model = make_model()
    model[0] = TorchCheckpointed(model[0])
    model[1] = TorchCheckpointed(model[1])
    got = functional_grads(model)
    assert not all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def meta_gradients(model: nn.Module) -> list[torch.Tensor]:
    """Second-order MAML: one inner step on fast weights with ``create_graph=True``, the outer
    loss on another batch with the fast weights, its gradient with respect to the meta
    parameters (through the inner step's backward)."""
    meta = swapped_params(model)
    (x, y), (x2, y2) = batch(1), batch(2)
    torch.manual_seed(1)
    inner = F.mse_loss(functional_call(model, meta, (x,)), y)
    grads = torch.autograd.grad(inner, list(meta.values()), create_graph=True)
    fast = {k: p - 0.1 * g for (k, p), g in zip(meta.items(), grads, strict=True)}
    outer = F.mse_loss(functional_call(model, fast, (x2,)), y2)
    return list(torch.autograd.grad(outer, list(meta.values())))


@pytest.mark.parametrize("engine", ["region", "graph"])
def test_second_order_meta_learning_through_regions_equals_plain(engine: str) -> None:
    """Fast weights made from the meta parameters by a differentiable inner step, passed by
    ``functional_call``, and dropped by the caller before backward: the recomputes of both
    forward passes (and of the inner backward) read them, and the meta gradients equal the
    plain model's bit for bit."""
    expected = meta_gradients(make_model())
    got = meta_gradients(engine_model(engine))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def train_then_eval_backward(model: nn.Module) -> tuple[list[torch.Tensor], list[bool]]:
    """Forward in train mode, ``model.eval()`` before backward (an evaluation callback that
    runs between a loss and its backward, or a forgotten ``model.train()``)."""
    model.train()
    x, y = batch(3)
    torch.manual_seed(3)
    loss = F.mse_loss(model(x), y)
    model.eval()
    loss.backward()
    state = [*model.state_dict().values()]
    return [p.grad for p in model.parameters()] + state, [m.training for m in model.modules()]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_switched_to_eval_before_backward_recomputes_in_train_mode(engine: str) -> None:
    """Dropout and BatchNorm recompute as they ran in forward (train mode), so gradients and
    running statistics equal the plain model's; the modules stay in eval mode, as the user
    set them."""
    expected, _ = train_then_eval_backward(make_model())
    model = engine_model(engine)
    got, flags = train_then_eval_backward(model)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert flags == [False] * len(flags)


def test_torch_checkpoint_recomputes_in_the_mode_it_finds() -> None:
    """The contrast: torch's checkpoint recomputes BatchNorm in eval mode and fails on the
    shapes it saved (or, where the shapes agree, computes other gradients)."""
    model = make_model()
    model[0] = TorchCheckpointed(model[0])
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        train_then_eval_backward(model)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_replaced_parameter_gets_the_gradient_its_forward_pass_used(engine: str) -> None:
    """A parameter replaced by another object between forward and backward: autograd sends the
    gradient to the object the forward pass read, and the recompute reads that one too."""

    def step(model: nn.Sequential) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, y = batch(4)
        torch.manual_seed(4)
        loss = F.mse_loss(model(x), y)
        old = model[0].fc1.weight
        model[0].fc1.weight = nn.Parameter(old.detach() * 2)
        loss.backward()
        return old.grad, model[0].fc1.weight.grad

    expected_old, expected_new = step(make_model())
    got_old, got_new = step(engine_model(engine))
    assert expected_new is None and got_new is None
    assert expected_old is not None and got_old is not None
    assert torch.equal(expected_old, got_old)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_parameter_written_in_place_before_backward_raises(engine: str) -> None:
    """A weight clamp between forward and backward: plain autograd raises for the weights it
    saved; a recompute (or replay) would build other activations from the clamped weights, so
    remat raises a CheckpointError, and leaves no mode, flag or binding behind."""
    model = engine_model(engine)
    x, y = batch(5)
    loss = F.mse_loss(model(x), y)
    with torch.no_grad():
        model[0].fc2.weight.clamp_(-0.05, 0.05)
    with pytest.raises(remat.CheckpointError, match="modified in place"):
        loss.backward()
    assert _get_current_dispatch_mode_stack() == []
    assert all(m.training for m in model.modules())

    plain = make_model()
    loss = F.mse_loss(plain(x), y)
    with torch.no_grad():
        plain[0].fc2.weight.clamp_(-0.05, 0.05)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def clamp_first_weight_before_backward(model: nn.Sequential) -> list[torch.Tensor]:
    x, y = batch(6)
    torch.manual_seed(6)
    loss = F.mse_loss(model(x), y)
    with torch.no_grad():
        model[0].fc1.weight.mul_(0.5)
    loss.backward()
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_write_to_a_parameter_that_plain_backward_does_not_read(engine: str) -> None:
    """The first layer's weight, which plain autograd does not save (its input needs no
    gradient): plain backward is unaffected by the write. A recompute of the first layer's
    output would read the written weight and build other activations, so it raises (the
    region engine names the parameter); a policy that kept that output reads no weight in
    backward, and its gradients equal the plain model's."""
    expected = clamp_first_weight_before_backward(make_model())
    model = engine_model(engine)
    if engine in ("graph-matmuls", "graph-everything"):
        got = clamp_first_weight_before_backward(model)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
        return
    match = "parameter 'weight' of a Linear" if engine == "region" else "modified in place"
    with pytest.raises(remat.CheckpointError, match=match):
        clamp_first_weight_before_backward(model)


@pytest.mark.parametrize(
    "policy",
    [None, remat.policies.save_everything, remat.policies.recompute_everything],
    ids=["region", "kept", "rebuilt"],
)
def test_an_output_a_region_saved_and_the_caller_wrote_in_place_raises(policy: Any) -> None:
    """``tanh`` saves its result; a caller that writes the region's output in place before
    backward makes plain autograd raise. Autograd skips that check for a tensor a hook packed,
    as regions pack theirs: a region checks it itself, whether it keeps the result or
    rebuilds it (which would hand backward the value before the write, silently)."""

    def run(model: nn.Module) -> None:
        x = torch.randn(4, 8, requires_grad=True)
        out = model(x)
        out.mul_(2)
        out.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    remat.apply(model, [""], policy=policy)
    with pytest.raises(remat.CheckpointError, match="modified by an inplace operation"):
        run(model)


def test_buffers_written_by_another_call_are_not_mistaken_for_stale_reads() -> None:
    """Two forward passes through the same BatchNorm blocks before one backward (a siamese
    loss): the second writes the running statistics the first reached; neither recompute
    raises, and the gradients and statistics equal the plain model's."""

    def siamese(model: nn.Module) -> list[torch.Tensor]:
        (a, _), (b, _) = batch(7), batch(8)
        torch.manual_seed(7)
        loss = F.cosine_embedding_loss(model(a), model(b), torch.ones(16))
        loss.backward()
        return [p.grad for p in model.parameters()] + [*model.state_dict().values()]

    expected = siamese(make_model())
    for engine in ENGINES:
        got = siamese(engine_model(engine))
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), engine


def test_a_deepcopy_of_a_checkpointed_model_trains_as_its_own() -> None:
    """A copy made between steps (an EMA teacher) holds its own parameters; training the
    original after the copy reads the original's, and an EMA update of the copy between the
    original's forward and backward does not trip the check."""
    model = engine_model("region")
    plain = make_model()
    teacher = copy.deepcopy(model)
    for m in (plain, model):
        x, y = batch(9)
        torch.manual_seed(9)
        loss = F.mse_loss(m(x), y)
        if m is model:
            with torch.no_grad():
                for t, p in zip(teacher.parameters(), model.parameters(), strict=True):
                    t.mul_(0.9).add_(p, alpha=0.1)
        loss.backward()
    assert all(
        torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
        for a, b in zip(plain.parameters(), model.parameters(), strict=True)
    )


def test_a_parameter_added_before_backward_is_refused_and_nothing_is_left_bound() -> None:
    """A module that gains a parameter between forward and backward cannot be recomputed as
    its forward pass ran: a CheckpointError says so, and the training flags the recompute
    set back are restored before it raises."""
    model = engine_model("region")
    x, y = batch(10)
    loss = F.mse_loss(model(x), y)
    model.eval()
    model[1].fc1.register_parameter("extra", nn.Parameter(torch.zeros(1)))
    with pytest.raises(remat.CheckpointError, match="added or deleted"):
        loss.backward()
    assert not any(m.training for m in model.modules())
    assert "extra" in dict(model[1].fc1.named_parameters())


class RunningNorm(nn.Module):
    """Normalises by running statistics it reads, then rebinds to their update: the
    out-of-place form of a running normaliser or an EMA codebook (``self.mean = ...``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("var", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        y = (h - self.mean) / (self.var + 1e-5).sqrt()
        if self.training:
            with torch.no_grad():
                self.mean = 0.9 * self.mean + 0.1 * h.mean(0)
                self.var = 0.9 * self.var + 0.1 * h.var(0)
        return torch.tanh(y)


def running_norm_model(wrap: Callable[[nn.Sequential], object] | None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(RunningNorm(8), RunningNorm(8), nn.Linear(8, 3))
    if wrap is not None:
        wrap(model)
    return model


def train_three_steps(model: nn.Sequential) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return [*model.state_dict().values()]


REGION_ENGINES = {
    "region": lambda m: remat.apply(m, RunningNorm),
    "segment": lambda m: apply_segment(m, ["0", "1"]),
    "graph": lambda m: remat.apply(m, RunningNorm, policy=remat.policies.recompute_everything),
}


@pytest.mark.parametrize("engine", REGION_ENGINES)
def test_a_forward_that_rebinds_a_buffer_is_recomputed_from_the_one_it_read(engine: str) -> None:
    """The recompute reads the buffers the forward pass read, not their update, and the
    update it makes again is undone: parameters and statistics equal the plain model's after
    three steps (the statistics once updated per step, not twice)."""
    expected = train_three_steps(running_norm_model(None))
    got = train_three_steps(running_norm_model(REGION_ENGINES[engine]))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_torch_checkpoint_recomputes_from_a_rebound_buffer_and_updates_it_twice() -> None:
    """The contrast: torch's checkpoint reads the updated statistics in its recompute and
    rebinds them once more, so one step moves them twice."""
    plain = running_norm_model(None)
    model = running_norm_model(None)
    model[0] = TorchCheckpointed(model[0])  # type: ignore[arg-type]
    x, y = batch(0)
    for m in (plain, model):
        F.mse_loss(m(x), y).backward()
    twice = 0.9 * (0.9 * torch.zeros(8) + 0.1 * plain[0].fc(x).mean(0))
    twice += 0.1 * plain[0].fc(x).mean(0)
    assert not torch.equal(plain[0].mean, model[0].block.mean)
    assert torch.allclose(model[0].block.mean, twice.detach())


class CachingBlock(nn.Module):
    """Registers a buffer on its first call (a table of positions, made once)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "table" not in self._buffers:
            self.register_buffer("table", torch.linspace(0, 1, x.shape[-1]), persistent=False)
        return torch.tanh(self.fc(x) + self.table)


@pytest.mark.parametrize("policy", [None, remat.policies.recompute_everything])
def test_a_buffer_registered_by_the_first_forward_stays_the_one_registered(policy: Any) -> None:
    """The recompute of the first call runs without the buffer, as its forward pass did, and
    makes it again; the module keeps the one its forward pass registered (the second step's
    forward pass finds it)."""
    torch.manual_seed(0)
    plain = nn.Sequential(CachingBlock(8), nn.Linear(8, 3))
    model = copy.deepcopy(plain)
    remat.apply(model, CachingBlock, policy=policy)
    x, y = batch(1)
    tables = []
    for m in (plain, model):
        for _ in range(2):
            F.mse_loss(m(x), y).backward()
            tables.append(m[0].table)
    assert tables[2] is tables[3]
    assert all(
        torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
        for a, b in zip(plain.parameters(), model.parameters(), strict=True)
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("frozen_in_forward", [True, False])
def test_requires_grad_switched_before_backward_recomputes_with_forward_s(
    engine: str, frozen_in_forward: bool
) -> None:
    """A parameter frozen or unfrozen between forward and backward (a GAN freezes the
    discriminator after ``D(fake)``): autograd backpropagates through the graph forward
    recorded, and the recompute saves what forward saved, so gradients equal the plain
    model's; the flag stays as the user set it."""

    def step(model: nn.Sequential) -> list[torch.Tensor | None]:
        weight = model[0].fc1.weight
        weight.requires_grad_(not frozen_in_forward)
        x, y = batch(7)
        x.requires_grad_()
        torch.manual_seed(7)
        loss = F.mse_loss(model(x), y)
        weight.requires_grad_(frozen_in_forward)
        loss.backward()
        assert weight.requires_grad is frozen_in_forward
        return [x.grad, *(p.grad for p in model.parameters())]

    expected = step(make_model())
    got = step(engine_model(engine))
    assert all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(expected, got, strict=True)
    )
