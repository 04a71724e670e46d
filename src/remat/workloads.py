"""Built-in training workloads shared by the test suite and the benchmarks.

Every memory policy in remat (keep, offload, recompute) has to be checked against the same
question: does it change the numbers, and how much activation memory does it save? Answering
that needs models whose shape is fixed, whose parameters and batches are reproducible from a
seed, and whose layers exercise the awkward cases (dropout, BatchNorm, attention, skip
connections). This module provides four such models, each in two sizes:

* ``small``: tiny models whose training step takes milliseconds, for unit tests.
* ``bench``: roughly 1 GiB of activations per training step, for benchmarks.

Models are initialised randomly and batches are synthetic, so nothing is downloaded. All four
models use dropout, so a policy that recomputes a forward pass without restoring the RNG state
produces visibly different gradients.

Example::

    from remat.workloads import get_workload

    wl = get_workload("gpt", "small")
    model = wl.model(seed=0)
    inputs, target = wl.batch(seed=0)
    loss = wl.loss_fn(model(inputs), target)
    loss.backward()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .errors import RematError, did_you_mean

__all__ = ["Workload", "get_workload", "WORKLOAD_NAMES", "SIZES"]

WORKLOAD_NAMES: tuple[str, ...] = ("gpt", "mlp", "convnet", "unet")
"""Names accepted by :func:`get_workload`."""

SIZES: tuple[str, ...] = ("small", "bench")
"""Sizes accepted by :func:`get_workload`."""


@dataclass(frozen=True)
class Workload:
    """A model family, a synthetic batch generator and a loss, at one size.

    Attributes:
        name: Workload name, one of :data:`WORKLOAD_NAMES`.
        size: Size name, one of :data:`SIZES`.
        build: Builds the model, drawing its random initialisation from torch's current
            global RNG. Prefer :meth:`model`, which seeds and isolates the RNG.
        make_batch: Draws an ``(input, target)`` pair from the given generator.
        loss_fn: Maps ``(model output, target)`` to a scalar loss.
        block_types: The repeated block classes; "checkpoint every block" wraps each
            outermost instance of these.
        description: One line describing the shape of the model and batch.
    """

    name: str
    size: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    loss_fn: Callable[[Any, Tensor], Tensor]
    block_types: tuple[type[nn.Module], ...]
    description: str
    blocks_chain: bool = False
    """Whether each block's output is the next block's input, with nothing in between (what
    ``checkpoint_sequential`` over the blocks needs)."""

    def model(self, seed: int = 0) -> nn.Module:
        """Build the model on the CPU with parameters determined by ``seed``.

        The global CPU RNG is seeded for the duration of the build and restored afterwards,
        so calling this does not disturb the caller's random stream. The model is returned
        in training mode; move it to another device with ``.to()`` if needed.
        """
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.default_generator.manual_seed(seed)
            module = self.build()
        module.train()
        return module

    def batch(self, seed: int = 0) -> tuple[Tensor, Tensor]:
        """Return the ``(input, target)`` pair determined by ``seed``, on the CPU."""
        generator = torch.Generator().manual_seed(seed)
        return self.make_batch(generator)

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return ``(qualified name, module)`` for every block of ``model`` in forward order.

        Blocks are the outermost submodules that are instances of :attr:`block_types`; a
        block nested inside another block is not listed separately. They are listed in
        registration order, which for the built-in models is the order ``forward`` calls them.
        """
        found: list[tuple[str, nn.Module]] = []
        prefixes: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(prefix) for prefix in prefixes):
                continue
            if isinstance(module, self.block_types):
                found.append((name, module))
                prefixes.append(f"{name}." if name else "")
        return found


def _unknown(kind: str, value: str, choices: tuple[str, ...]) -> RematError:
    return RematError(
        f"remat: unknown {kind} {value!r}{did_you_mean(value, choices)}; expected one of: "
        f"{', '.join(sorted(choices))}"
    )


# ---------------------------------------------------------------------------------------------
# GPT


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT` model."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    dropout: float


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"remat: d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        head_dim = width // self.n_heads
        q, k, v = self.qkv(x).split(width, dim=2)
        q = q.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        out: Tensor = self.resid_dropout(self.proj(y))
        return out


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer decoder block: attention and MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """GPT-style decoder-only language model returning logits of shape (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            GPTBlock(config.d_model, config.n_heads, config.dropout) for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(_gpt_init)

    def forward(self, idx: Tensor) -> Tensor:
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"remat: sequence length {seq} exceeds {self.config.seq_len}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


def _gpt_init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _gpt_batch(
    batch_size: int, seq_len: int, vocab_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(
        0, vocab_size, (batch_size, seq_len + 1), generator=generator, device=generator.device
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _gpt_workload(size: str) -> Workload:
    if size == "bench":
        config = GPTConfig(
            vocab_size=8192, seq_len=512, d_model=512, n_heads=8, n_layers=12, dropout=0.1
        )
        batch_size = 2
    else:
        config = GPTConfig(
            vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, dropout=0.1
        )
        batch_size = 2
    return Workload(
        name="gpt",
        size=size,
        build=partial(GPT, config),
        make_batch=partial(_gpt_batch, batch_size, config.seq_len, config.vocab_size),
        loss_fn=_lm_loss,
        block_types=(GPTBlock,),
        blocks_chain=True,
        description=(
            f"GPT decoder: {config.n_layers} layers, d_model {config.d_model}, "
            f"{config.n_heads} heads, seq {config.seq_len}, batch {batch_size}, "
            f"vocab {config.vocab_size}, dropout {config.dropout}"
        ),
    )


# ---------------------------------------------------------------------------------------------
# MLP


@dataclass(frozen=True)
class MLPConfig:
    """Shape of an :class:`MLP` model."""

    width: int
    depth: int
    dropout: float
    residual: bool = True


class MLPBlock(nn.Module):
    """Linear, GELU, Dropout, LayerNorm; optionally added to the block input."""

    def __init__(self, width: int, dropout: float, residual: bool = True) -> None:
        super().__init__()
        self.residual = residual
        self.linear = nn.Linear(width, width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.norm(self.drop(self.act(self.linear(x))))
        return x + y if self.residual else y


class MLP(nn.Sequential):
    """A chain of :class:`MLPBlock` as an ``nn.Sequential``, so sequential checkpointing applies."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__(
            *(MLPBlock(config.width, config.dropout, config.residual) for _ in range(config.depth))
        )


def _mlp_batch(batch_size: int, width: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.randn(batch_size, width, generator=generator, device=generator.device)
    target = torch.randn(batch_size, width, generator=generator, device=generator.device)
    return x, target


def _mse_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


def _mlp_workload(size: str) -> Workload:
    if size == "bench":
        config = MLPConfig(width=512, depth=32, dropout=0.1)
        batch_size = 4096
    else:
        config = MLPConfig(width=16, depth=4, dropout=0.1)
        batch_size = 8
    return Workload(
        name="mlp",
        size=size,
        build=partial(MLP, config),
        make_batch=partial(_mlp_batch, batch_size, config.width),
        loss_fn=_mse_loss,
        block_types=(MLPBlock,),
        blocks_chain=True,
        description=(
            f"residual MLP chain: {config.depth} blocks, width {config.width}, "
            f"batch {batch_size}, dropout {config.dropout}"
        ),
    )


# ---------------------------------------------------------------------------------------------
# ConvNet


@dataclass(frozen=True)
class ConvNetConfig:
    """Shape of a :class:`ConvNet` model."""

    in_channels: int
    channels: int
    stages: int
    blocks_per_stage: int
    image_size: int
    num_classes: int
    dropout: float


class ConvBlock(nn.Module):
    """Residual block: two 3x3 convolutions with BatchNorm, ReLU and channel dropout."""

    def __init__(self, channels: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout2d(dropout)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        y = self.drop(self.relu(self.bn1(self.conv1(x))))
        y = self.bn2(self.conv2(y))
        return F.relu(x + y)


class Downsample(nn.Module):
    """Strided 3x3 convolution that halves the resolution and doubles the channels."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(2 * channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """Residual ConvNet classifier with BatchNorm, returning logits of shape (batch, classes)."""

    def __init__(self, config: ConvNetConfig) -> None:
        super().__init__()
        self.config = config
        c = config.channels
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        downsamples: list[nn.Module] = []
        for stage in range(config.stages):
            if stage > 0:
                downsamples.append(Downsample(c))
                c *= 2
            blocks.extend(ConvBlock(c, config.dropout) for _ in range(config.blocks_per_stage))
        self.blocks = nn.ModuleList(blocks)
        self.downsamples = nn.ModuleList(downsamples)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c, config.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        per_stage = self.config.blocks_per_stage
        for i, block in enumerate(self.blocks):
            if i > 0 and i % per_stage == 0:
                x = self.downsamples[i // per_stage - 1](x)
            x = block(x)
        logits: Tensor = self.classifier(torch.flatten(self.pool(x), 1))
        return logits


def _image_batch(
    batch_size: int,
    in_channels: int,
    image_size: int,
    num_classes: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    x = torch.randn(
        batch_size,
        in_channels,
        image_size,
        image_size,
        generator=generator,
        device=generator.device,
    )
    target = torch.randint(
        0, num_classes, (batch_size,), generator=generator, device=generator.device
    )
    return x, target


def _cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits, target)


def _convnet_workload(size: str) -> Workload:
    if size == "bench":
        config = ConvNetConfig(
            in_channels=3,
            channels=16,
            stages=3,
            blocks_per_stage=3,
            image_size=64,
            num_classes=10,
            dropout=0.1,
        )
        batch_size = 128
    else:
        config = ConvNetConfig(
            in_channels=3,
            channels=8,
            stages=2,
            blocks_per_stage=2,
            image_size=16,
            num_classes=10,
            dropout=0.1,
        )
        batch_size = 4
    return Workload(
        name="convnet",
        size=size,
        build=partial(ConvNet, config),
        make_batch=partial(
            _image_batch, batch_size, config.in_channels, config.image_size, config.num_classes
        ),
        loss_fn=_cross_entropy,
        block_types=(ConvBlock,),
        description=(
            f"residual ConvNet with BatchNorm: {config.stages} stages x "
            f"{config.blocks_per_stage} blocks, {config.channels} base channels, "
            f"{config.image_size}x{config.image_size} images, batch {batch_size}, "
            f"{config.num_classes} classes, dropout {config.dropout}"
        ),
    )


# ---------------------------------------------------------------------------------------------
# U-Net


@dataclass(frozen=True)
class UNetConfig:
    """Shape of a :class:`UNet` model."""

    in_channels: int
    base_channels: int
    depth: int
    image_size: int
    num_classes: int
    dropout: float


class UNetBlock(nn.Module):
    """Two 3x3 convolutions, each with BatchNorm and ReLU, followed by channel dropout."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.drop = nn.Dropout2d(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        out: Tensor = self.drop(x)
        return out


class UNet(nn.Module):
    """U-Net segmentation model returning per-pixel logits of shape (batch, classes, H, W)."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.base_channels * 2**level for level in range(config.depth + 1)]
        in_widths = [config.in_channels, *widths[:-2]]
        self.encoder = nn.ModuleList(
            UNetBlock(cin, cout, config.dropout)
            for cin, cout in zip(in_widths, widths[:-1], strict=True)
        )
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = UNetBlock(widths[-2], widths[-1], config.dropout)
        decoder_widths = widths[-2::-1]
        self.upsamples = nn.ModuleList(
            nn.ConvTranspose2d(2 * c, c, kernel_size=2, stride=2) for c in decoder_widths
        )
        self.decoder = nn.ModuleList(UNetBlock(2 * c, c, config.dropout) for c in decoder_widths)
        self.head = nn.Conv2d(config.base_channels, config.num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        factor = 2**self.config.depth
        if x.shape[-2] % factor or x.shape[-1] % factor:
            raise ValueError(
                f"remat: U-Net input size {tuple(x.shape[-2:])} is not divisible by {factor}"
            )
        skips: list[Tensor] = []
        for block in self.encoder:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, block, skip in zip(self.upsamples, self.decoder, reversed(skips), strict=True):
            x = block(torch.cat([up(x), skip], dim=1))
        logits: Tensor = self.head(x)
        return logits


def _segmentation_batch(
    batch_size: int,
    in_channels: int,
    image_size: int,
    num_classes: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    x = torch.randn(
        batch_size,
        in_channels,
        image_size,
        image_size,
        generator=generator,
        device=generator.device,
    )
    target = torch.randint(
        0,
        num_classes,
        (batch_size, image_size, image_size),
        generator=generator,
        device=generator.device,
    )
    return x, target


def _unet_workload(size: str) -> Workload:
    if size == "bench":
        config = UNetConfig(
            in_channels=3,
            base_channels=16,
            depth=3,
            image_size=128,
            num_classes=4,
            dropout=0.1,
        )
        batch_size = 40
    else:
        config = UNetConfig(
            in_channels=3,
            base_channels=8,
            depth=2,
            image_size=16,
            num_classes=4,
            dropout=0.1,
        )
        batch_size = 2
    return Workload(
        name="unet",
        size=size,
        build=partial(UNet, config),
        make_batch=partial(
            _segmentation_batch,
            batch_size,
            config.in_channels,
            config.image_size,
            config.num_classes,
        ),
        loss_fn=_cross_entropy,
        block_types=(UNetBlock,),
        description=(
            f"U-Net segmentation: depth {config.depth}, {config.base_channels} base channels, "
            f"{config.image_size}x{config.image_size} images, batch {batch_size}, "
            f"{config.num_classes} classes, dropout {config.dropout}"
        ),
    )


# ---------------------------------------------------------------------------------------------
# Registry


_FACTORIES: dict[str, Callable[[str], Workload]] = {
    "gpt": _gpt_workload,
    "mlp": _mlp_workload,
    "convnet": _convnet_workload,
    "unet": _unet_workload,
}


def get_workload(name: str, size: str = "small") -> Workload:
    """Return the built-in workload ``name`` at ``size``.

    Raises:
        RematError: ``name`` is not in :data:`WORKLOAD_NAMES` or ``size`` is not in
            :data:`SIZES`.
    """
    if name not in _FACTORIES:
        raise _unknown("workload", name, WORKLOAD_NAMES)
    if size not in SIZES:
        raise _unknown("size", size, SIZES)
    return _FACTORIES[name](size)
