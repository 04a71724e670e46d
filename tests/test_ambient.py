"""Replay of accelerator random state, exercised through a stand-in accelerator on CPU.

The machine running the suite may have no GPU, so a fake ``torch.cuda`` generator (initialised,
two devices, a counter per device) stands in for it. The region draws from the fake device 1
while its inputs are CPU tensors: the recompute must still see the same draws, and the
generators must be left as the backward pass had them.
"""

from __future__ import annotations

import pytest
import torch

import remat
from remat import _ambient


class FakeGenerators:
    def __init__(self) -> None:
        self.state = [
            torch.tensor([100], dtype=torch.uint8),
            torch.tensor([200], dtype=torch.uint8),
        ]
        self.initialized = True

    def get_rng_state(self, index: int = 0) -> torch.Tensor:
        return self.state[index].clone()

    def set_rng_state(self, state: torch.Tensor, index: int = 0) -> None:
        self.state[index] = state.clone()

    def draw(self, index: int) -> float:
        value = float(self.state[index].item())
        self.state[index] += 1
        return value


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeGenerators:
    fake = FakeGenerators()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: fake.initialized)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    return fake


def test_captures_every_device_of_an_initialised_accelerator(fake_cuda: FakeGenerators) -> None:
    ambient = _ambient.Ambient.capture(preserve_rng_state=True)
    assert ambient.accelerators == ("cuda",)
    assert [int(s.item()) for s in dict(ambient.device_rng)["cuda"]] == [100, 200]


def test_region_with_cpu_inputs_replays_the_device_draws(fake_cuda: FakeGenerators) -> None:
    draws: list[tuple[bool, float]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        scale = fake_cuda.draw(1)  # a random draw on device 1, from CPU inputs
        draws.append((remat.is_recomputing(), scale))
        return (x * scale).sin().sum()

    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(fn, x)
    fake_cuda.draw(1)  # the training loop draws more before backward
    before_backward = fake_cuda.get_rng_state(1)
    out.backward()
    assert draws == [(False, 200.0), (True, 200.0)]
    assert torch.equal(fake_cuda.get_rng_state(1), before_backward)  # restored after replay
    assert torch.equal(x.grad, (x * 200.0).cos().detach() * 200.0)


def test_without_preserve_rng_state_the_device_draws_differ(fake_cuda: FakeGenerators) -> None:
    draws: list[float] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        draws.append(fake_cuda.draw(0))
        return x.sin().sum()

    remat.checkpoint(fn, torch.randn(2, requires_grad=True), preserve_rng_state=False).backward()
    assert draws == [100.0, 101.0]


def test_accelerator_initialised_inside_the_region_raises(fake_cuda: FakeGenerators) -> None:
    fake_cuda.initialized = False

    def fn(x: torch.Tensor) -> torch.Tensor:
        fake_cuda.initialized = True
        return x.sin()

    with pytest.raises(
        remat.CheckpointError, match=r"initialised cuda for the first time.*init\(\)"
    ):
        remat.checkpoint(fn, torch.randn(2, requires_grad=True))
