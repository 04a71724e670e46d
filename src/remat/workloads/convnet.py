"""A residual ConvNet with BatchNorm: running statistics that must be updated once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import Workload

__all__: list[str] = []

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


def _images(
    batch_size: int, in_channels: int, image_size: int, generator: torch.Generator
) -> Tensor:
    return torch.randn(
        batch_size,
        in_channels,
        image_size,
        image_size,
        generator=generator,
        device=generator.device,
    )


def _image_batch(
    batch_size: int,
    in_channels: int,
    image_size: int,
    num_classes: int,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    x = _images(batch_size, in_channels, image_size, generator)
    target = torch.randint(
        0, num_classes, (batch_size,), generator=generator, device=generator.device
    )
    return x, target


def _cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits, target)


def _convnet_workload(size: str) -> Workload:
    if size in ("bench", "medium"):  # medium: the bench model on an eighth of the batch
        config = ConvNetConfig(
            in_channels=3,
            channels=16,
            stages=3,
            blocks_per_stage=3,
            image_size=64,
            num_classes=10,
            dropout=0.1,
        )
        batch_size = 128 if size == "bench" else 16
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
