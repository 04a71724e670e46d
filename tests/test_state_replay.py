"""Regions that read module state and then update it replay from the state their forward
pass read; state written between forward and backward raises. Never other values, silently.

A running normaliser, an EMA codebook or a step counter reads a buffer and then writes it in
the same forward pass. A recompute that reads the buffer as backward finds it reads the
update, builds other activations, and gives wrong gradients with no error; torch's
checkpoint does (pinned below, so that the tests show what they guard against). See NOTE
[ State read, then written ] in ``src/remat/_guard.py`` and NOTE [ A recompute reads what its
forward pass read ] in ``src/remat/_reads.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
from remat.planning.apply import apply_segment


class RunningCenter(nn.Module):
    """Subtracts a running mean, then moves it (in-place ops under no_grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = h - self.mean
        if self.training:
            self.update(h.detach().mean(0))
        return torch.tanh(self.drop(y))

    def update(self, mean: torch.Tensor) -> None:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(mean, alpha=0.1)


class DataCenter(RunningCenter):
    """The same, written through ``.data``: no version counter moves."""

    def update(self, mean: torch.Tensor) -> None:
        self.mean.data.mul_(0.9).add_(mean, alpha=0.1)


class ViewCenter(RunningCenter):
    """The same, written through a view of the buffer."""

    def update(self, mean: torch.Tensor) -> None:
        with torch.no_grad():
            self.mean[:].mul_(0.9).add_(mean, alpha=0.1)


class StepScale(nn.Module):
    """Scales by a step counter, then counts the step."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.step.float() * 0.5
        if self.training:
            self.step += 1
        return torch.tanh(self.lin(x) * scale)


class EMAQuantizer(nn.Module):
    """A vector quantiser with an EMA codebook: quantise, then update the codes used."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("codebook", torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            index = torch.cdist(h, self.codebook).argmin(1)
        quantized = h + (F.embedding(index, self.codebook) - h).detach()
        if self.training:
            with torch.no_grad():
                moved = 0.9 * self.codebook[index] + 0.1 * h
                self.codebook.index_copy_(0, index, moved)
        return torch.tanh(quantized * h)


BLOCKS = [RunningCenter, DataCenter, ViewCenter, StepScale, EMAQuantizer]

ENGINES: dict[str, Callable[[nn.Sequential, type[nn.Module]], object]] = {
    "region": lambda m, cls: remat.apply(m, cls),
    "segment": lambda m, cls: apply_segment(m, ["0", "1"]),  # linked calls, as a plan makes
    "graph": lambda m, cls: remat.apply(m, cls, policy=remat.policies.recompute_everything),
    "graph-matmuls": lambda m, cls: remat.apply(m, cls, policy=remat.policies.save_matmuls),
}


def train(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    """A user's loop: SGD with momentum, clipping; every input gradient, parameter and buffer
    after each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    record: list[torch.Tensor] = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(6, 8, generator=g).requires_grad_()
        torch.manual_seed(100 + step)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        assert x.grad is not None
        record += [loss.detach(), x.grad, *[p.detach().clone() for p in model.parameters()]]
        record += [b.clone() for b in model.buffers()]
    return record


def make(cls: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(cls(), cls())


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", BLOCKS, ids=lambda c: c.__name__)
def test_state_read_then_written_trains_as_plain(cls: type[nn.Module], engine: str) -> None:
    expected = train(make(cls))
    model = make(cls)
    ENGINES[engine](model, cls)
    assert same(train(model), expected)


class TorchCheckpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch_checkpoint(self.block, x, use_reentrant=False)
        return out


@pytest.mark.parametrize("cls", BLOCKS, ids=lambda c: c.__name__)
def test_torch_checkpoint_recomputes_from_the_updated_state(cls: type[nn.Module]) -> None:
    model = make(cls)
    torch_model = nn.Sequential(*(TorchCheckpointed(block) for block in model))
    assert not same(train(torch_model), train(make(cls)))


def recompute_modes(model: nn.Module, steps: int) -> list[int]:
    """The number of dispatch modes active in the first block's recompute, per step."""
    modes: list[int] = []

    def spy(module: nn.Module, args: object) -> None:
        if remat.is_recomputing():
            modes.append(len(_get_current_dispatch_mode_stack()))

    handle = model[0].lin.register_forward_pre_hook(spy)  # type: ignore[union-attr,operator]
    train(model, steps)
    handle.remove()
    return modes


def test_after_the_first_recompute_a_snapshot_replaces_the_guard() -> None:
    """The first recompute runs guarded and learns that the block reads what it writes; later
    forward passes snapshot the block's state, and their recomputes start from it with no
    dispatch mode, writing and putting back the state."""
    model = make(RunningCenter)
    remat.apply(model, RunningCenter)
    assert recompute_modes(model, 3) == [1, 0, 0]


def test_without_a_snapshot_a_read_before_the_write_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """State over the snapshot limit: the recompute cannot start from what the forward pass
    read, and raises instead of building other activations."""
    monkeypatch.setattr(remat._guard, "UNDO_LIMIT", 4)
    model = make(RunningCenter)
    remat.apply(model, RunningCenter)
    with pytest.raises(remat.CheckpointError, match="read the buffer 'mean' of a RunningCenter"):
        train(model, 1)


class Scaled(nn.Module):
    """Reads a buffer that the training loop may change; ``mask`` is read through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 1.5))
        self.register_buffer("mask", torch.ones(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * self.scale * self.mask[: x.shape[0]])


@pytest.mark.parametrize("buffer", ["scale", "mask"])
@pytest.mark.parametrize("engine", ["region", "graph"])
def test_a_buffer_written_between_forward_and_backward_raises(buffer: str, engine: str) -> None:
    """A buffer the region reads, written in place by the loop after forward: on the guarded
    first recompute and on a later unguarded one, the recompute raises and names it (plain
    autograd raises too, for the buffer it saved)."""
    model = nn.Sequential(Scaled(), Scaled())
    policy = remat.policies.recompute_everything if engine == "graph" else None
    remat.apply(model, Scaled, policy=policy)
    for step in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        loss = model(x).sum()
        if step in (0, 2):
            with torch.no_grad():
                getattr(model[0], buffer).mul_(2)
            match = f"buffer {buffer!r} of a Scaled" if engine == "region" else "modified in place"
            with pytest.raises(remat.CheckpointError, match=match):
                loss.backward()
        else:
            loss.backward()
    plain = nn.Sequential(Scaled(), Scaled())
    loss = plain(torch.randn(4, 8, requires_grad=True)).sum()
    with torch.no_grad():
        plain[0].scale.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def offloaded(cls: type[nn.Module], microbatches: int, recompute: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = nn.Sequential(*(cls() for _ in range(4)))
    return remat.OffloadModel(
        layers,
        device="cpu",
        offload_device=torch.device("cpu"),
        num_slices=2,
        num_microbatches=microbatches,
        checkpoint_activation=recompute,
    )


@pytest.mark.parametrize("cls", BLOCKS, ids=lambda c: c.__name__)
def test_offload_model_recomputes_slices_from_the_state_they_read(cls: type[nn.Module]) -> None:
    """Each micro-batch's forward pass snapshots its slice's buffers; the rerun in backward
    starts from them. One micro-batch equals the plain model; two equal the slices kept."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(cls() for _ in range(4)))
    assert same(train(offloaded(cls, 1, True)), train(plain))
    assert same(train(offloaded(cls, 2, True)), train(offloaded(cls, 2, False)))


def test_offload_model_without_a_snapshot_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.offload_model._autograd, "UNDO_LIMIT", 4)
    with pytest.raises(remat.RematError, match="reads a buffer of shape"):
        train(offloaded(RunningCenter, 1, True), 1)
