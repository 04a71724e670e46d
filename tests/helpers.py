"""Shared test helpers: run the same training steps plainly and with remat, and compare."""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat


@dataclass
class StepRecord:
    outputs: list[Any] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    param_grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)


def train(
    model: nn.Module,
    batches: list[tuple[Any, torch.Tensor]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    seed: int = 1234,
) -> StepRecord:
    """SGD steps from the same RNG state; records every output, grad, param and buffer."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    record = StepRecord()
    for step, (x, target) in enumerate(batches):
        x = x.detach().clone()
        if x.is_floating_point():
            x.requires_grad_(True)
        torch.manual_seed(seed + step)
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = loss_fn(out, target)
        with warnings.catch_warnings():
            # This loop holds the output through backward, to record it; a plan warns where
            # that breaks its budget (NOTE [ The output held through backward ] in
            # planning/apply.py), which is not what these records measure.
            warnings.filterwarnings("ignore", message="remat: the model's output")
            loss.backward()
        record.outputs.append(out.detach().clone() if isinstance(out, torch.Tensor) else out)
        record.losses.append(loss.detach().clone())
        record.input_grads.append(None if x.grad is None else x.grad.clone())
        record.param_grads.append(
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        )
        opt.step()
        record.params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        record.buffers.append({n: b.clone() for n, b in model.named_buffers()})
    return record


def assert_save_and_resume_exact(
    model: nn.Module,
    plain: nn.Module,
    resume: Callable[[], nn.Module] | None,
    loss_of: Callable[[nn.Module], torch.Tensor],
    directory: Any,
    after_backward: Callable[[], None] | None = None,
) -> nn.Module:
    """The loop users write, on ``model`` (set up by a plan): their own AdamW,
    ``clip_grad_norm_``, ``zero_grad(set_to_none=True)``; after two steps a save of the model
    and the optimizer in ``directory``, ``resume()`` (a fresh model with the plan loaded and
    applied) loading them, and a third step: losses, gradient norms, parameters and buffers
    bit-equal to three steps of ``plain``. ``loss_of(m)`` runs one forward; ``after_backward``
    runs after each backward. Without ``resume``, the model itself is saved whole
    (``torch.save({"model": model, ...})``) and loaded back. Returns the resumed model."""

    def steps(m: nn.Module, opt: torch.optim.Optimizer, first: int, last: int) -> list[Any]:
        out: list[Any] = []
        for step in range(first, last):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            loss = loss_of(m)
            loss.backward()  # type: ignore[no-untyped-call]
            if after_backward is not None:
                after_backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.5)
            opt.step()
            out += [loss.detach(), norm, *[p.detach().clone() for p in m.parameters()]]
            out += [b.clone() for b in m.buffers()]
        return out

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)

    expected = steps(plain, adamw(plain), 0, 3)
    opt = adamw(model)
    got = steps(model, opt, 0, 2)
    assert list(model.state_dict()) == list(plain.state_dict())  # a plan renames nothing
    if resume is None:
        torch.save({"model": model, "opt": opt.state_dict()}, directory / "ckpt.pt")
        saved = torch.load(directory / "ckpt.pt", weights_only=False)
        resumed = saved["model"]
    else:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, directory / "ckpt.pt")
        resumed = resume()
        saved = torch.load(directory / "ckpt.pt")
        resumed.load_state_dict(saved["model"])
    resumed_opt = adamw(resumed)
    resumed_opt.load_state_dict(saved["opt"])
    got += steps(resumed, resumed_opt, 2, 3)
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    return resumed


def assert_records_equal(plain: StepRecord, other: StepRecord) -> None:
    """Bit-for-bit equality of everything two runs recorded."""
    assert len(plain.losses) == len(other.losses)
    for step in range(len(plain.losses)):
        assert torch.equal(plain.losses[step], other.losses[step]), f"loss, step {step}"
        assert_equal(plain.outputs[step], other.outputs[step], f"output, step {step}")
        assert_equal(plain.input_grads[step], other.input_grads[step], f"input grad, step {step}")
        for kind in ("param_grads", "params", "buffers"):
            a, b = getattr(plain, kind)[step], getattr(other, kind)[step]
            assert a.keys() == b.keys(), kind
            for name in a:
                assert_equal(a[name], b[name], f"{kind} {name}, step {step}")


def assert_equal(a: Any, b: Any, what: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), what
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: max abs diff {(a - b).abs().max().item()}"
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{what}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_equal(a[k], b[k], f"{what}[{k!r}]")
    else:
        assert a == b, what


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class OpCounter(TorchDispatchMode):
    """Counts ATen operators by name (``"mm"``, ``"sin"``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)


@contextmanager
def counting_ops() -> Iterator[OpCounter]:
    with OpCounter() as counter:
        yield counter


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def offloaded(model: nn.Module, tier: Any, **options: Any) -> nn.Module:
    """``model`` with its forward run inside ``remat.offload(tier)``."""
    forward = model.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        with remat.offload(tier, **options):
            return forward(*args, **kwargs)

    model.forward = run  # type: ignore[method-assign]
    return model


class Fail(nn.Module):
    """Passes its input through, or raises once ``armed`` (a forward that fails part way)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("failed on purpose")
        return x
