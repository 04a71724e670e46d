"""Tests for the built-in workloads: reproducibility, shapes, blocks and dropout."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint_sequential

from remat import workloads
from remat.errors import RematError
from remat.workloads import SIZES, WORKLOAD_NAMES, Workload, get_workload

ALL = [(name, size) for name in WORKLOAD_NAMES for size in SIZES]

SMALL_BLOCKS = {
    "gpt": ["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
    "mlp": ["0", "1", "2", "3"],
    "convnet": ["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
    "unet": ["encoder.0", "encoder.1", "bottleneck", "decoder.0", "decoder.1"],
}

BENCH_BLOCK_COUNTS = {"gpt": 12, "mlp": 32, "convnet": 9, "unet": 7}


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _same(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _forward(wl: Workload, model: nn.Module, seed: int) -> Tensor:
    inputs, _ = wl.batch(0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out: Tensor = model(inputs)
    return out


def test_exports() -> None:
    assert WORKLOAD_NAMES == ("gpt", "mlp", "convnet", "unet")
    assert SIZES == ("small", "medium", "bench")
    assert set(workloads.__all__) == {"Workload", "get_workload", "WORKLOAD_NAMES", "SIZES"}
    for cls in ("GPT", "GPTBlock", "MLP", "MLPBlock", "ConvNet", "ConvBlock", "UNet", "UNetBlock"):
        assert issubclass(getattr(workloads, cls), nn.Module)


@pytest.mark.parametrize(("name", "size"), ALL)
def test_get_workload(name: str, size: str) -> None:
    wl = get_workload(name, size)
    assert (wl.name, wl.size) == (name, size)
    assert wl.description
    assert wl.block_types and all(issubclass(t, nn.Module) for t in wl.block_types)
    with pytest.raises(dataclasses.FrozenInstanceError):
        wl.name = "other"  # type: ignore[misc]


def test_default_size_is_small() -> None:
    assert get_workload("gpt").size == "small"


def test_unknown_name() -> None:
    message = (
        "remat: unknown workload 'gtp' (did you mean 'gpt'?); expected one of: "
        "convnet, gpt, mlp, unet"
    )
    with pytest.raises(RematError, match=f"^{re.escape(message)}$"):
        get_workload("gtp")


def test_unknown_size() -> None:
    message = "remat: unknown size 'huge'; expected one of: bench, medium, small"
    with pytest.raises(RematError, match=f"^{re.escape(message)}$"):
        get_workload("gpt", "huge")


@pytest.mark.parametrize(("name", "size"), ALL)
def test_model_is_reproducible(name: str, size: str) -> None:
    wl = get_workload(name, size)
    rng_before = torch.get_rng_state()
    first = wl.model(seed=3)
    assert torch.equal(torch.get_rng_state(), rng_before), "model() must not disturb the RNG"
    assert first.training
    assert all(p.device.type == "cpu" for p in first.parameters())
    again = wl.model(seed=3)
    assert _same(_params(first), _params(again))
    assert _same(_buffers(first), _buffers(again))
    other = wl.model(seed=4)
    assert not _same(_params(first), _params(other))


@pytest.mark.parametrize(("name", "size"), ALL)
def test_batch_is_reproducible(name: str, size: str) -> None:
    wl = get_workload(name, size)
    rng_before = torch.get_rng_state()
    x, y = wl.batch(seed=5)
    assert torch.equal(torch.get_rng_state(), rng_before), "batch() must not disturb the RNG"
    x2, y2 = wl.batch(seed=5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, y3 = wl.batch(seed=6)
    assert not torch.equal(x, x3)
    assert not torch.equal(y, y3)
    assert x.device.type == "cpu" and y.device.type == "cpu"
    assert x.dtype == (torch.long if name == "gpt" else torch.float32)
    assert y.dtype == (torch.float32 if name == "mlp" else torch.long)


def test_gpt_bench_shape() -> None:
    wl = get_workload("gpt", "bench")
    x, y = wl.batch()
    assert x.shape == y.shape == (2, 512)
    assert int(x.max()) < 8192 and int(x.min()) >= 0
    assert torch.equal(x[:, 1:], y[:, :-1]), "targets are the next tokens"
    model = wl.model()
    assert isinstance(model, workloads.GPT)
    assert model.config == workloads.GPTConfig(
        vocab_size=8192, seq_len=512, d_model=512, n_heads=8, n_layers=12, dropout=0.1
    )


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_small_training_step(name: str) -> None:
    wl = get_workload(name, "small")
    model = wl.model()
    inputs, target = wl.batch()
    torch.manual_seed(0)
    loss = wl.loss_fn(model(inputs), target)
    assert loss.dim() == 0
    assert math.isfinite(loss.item())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{pname} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{pname} has an all-zero gradient"


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_small_output_shape(name: str) -> None:
    wl = get_workload(name, "small")
    out = _forward(wl, wl.model(), seed=0)
    inputs, target = wl.batch()
    if name == "gpt":
        assert out.shape == (*target.shape, 64)
    elif name == "mlp":
        assert out.shape == target.shape
    elif name == "convnet":
        assert out.shape == (inputs.shape[0], 10)
    else:
        assert out.shape == (target.shape[0], 4, *target.shape[1:])


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_small_blocks_in_forward_order(name: str) -> None:
    wl = get_workload(name, "small")
    model = wl.model()
    blocks = wl.blocks(model)
    assert [n for n, _ in blocks] == SMALL_BLOCKS[name]
    modules = dict(model.named_modules())
    assert all(modules[n] is m for n, m in blocks)
    assert all(isinstance(m, wl.block_types) for _, m in blocks)

    called: list[str] = []
    for block_name, block in blocks:
        block.register_forward_pre_hook(lambda *_, n=block_name: called.append(n))
    _forward(wl, model, seed=0)
    assert called == SMALL_BLOCKS[name]


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_bench_block_count(name: str) -> None:
    wl = get_workload(name, "bench")
    assert len(wl.blocks(wl.model())) == BENCH_BLOCK_COUNTS[name]


def test_blocks_lists_outermost_only() -> None:
    wl = get_workload("gpt", "small")
    nested = dataclasses.replace(
        wl, block_types=(workloads.GPTBlock, workloads.CausalSelfAttention)
    )
    assert [n for n, _ in nested.blocks(wl.model())] == SMALL_BLOCKS["gpt"]
    inner = dataclasses.replace(wl, block_types=(workloads.CausalSelfAttention,))
    assert [n for n, _ in inner.blocks(wl.model())] == [f"blocks.{i}.attn" for i in range(4)]


def _dropout_rates(module: nn.Module) -> list[float]:
    rates = []
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            rates.append(m.p)
        elif isinstance(m, workloads.CausalSelfAttention):
            rates.append(m.dropout)
    return rates


@pytest.mark.parametrize(("name", "size"), ALL)
def test_every_block_has_dropout(name: str, size: str) -> None:
    wl = get_workload(name, size)
    for block_name, block in wl.blocks(wl.model()):
        assert any(p > 0 for p in _dropout_rates(block)), f"{block_name} has no active dropout"


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_dropout_is_active_in_train_mode(name: str) -> None:
    wl = get_workload(name, "small")
    model = wl.model()
    first = _forward(wl, model, seed=1)
    repeat = _forward(wl, model, seed=1)
    other = _forward(wl, model, seed=2)
    assert torch.equal(first, repeat), "same RNG state must give the same output"
    assert not torch.equal(first, other), "dropout must depend on the RNG in train mode"

    model.eval()
    assert torch.equal(_forward(wl, model, seed=1), _forward(wl, model, seed=2))


def test_gpt_is_causal() -> None:
    wl = get_workload("gpt", "small")
    model = wl.model().eval()
    x, _ = wl.batch()
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


def test_mlp_works_with_checkpoint_sequential() -> None:
    wl = get_workload("mlp", "small")
    inputs, target = wl.batch()

    plain = wl.model()
    assert isinstance(plain, nn.Sequential)
    torch.manual_seed(7)
    plain_loss = wl.loss_fn(plain(inputs), target)
    plain_loss.backward()

    ckpt = wl.model()
    torch.manual_seed(7)
    ckpt_out = checkpoint_sequential(ckpt, 2, inputs, use_reentrant=False)
    ckpt_loss = wl.loss_fn(ckpt_out, target)
    ckpt_loss.backward()

    assert torch.equal(plain_loss, ckpt_loss)
    for (pname, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad), pname
