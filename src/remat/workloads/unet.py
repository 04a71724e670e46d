"""A U-Net with skip connections across levels."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from ._base import Workload
from .convnet import _cross_entropy, _images

__all__: list[str] = []

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
    x = _images(batch_size, in_channels, image_size, generator)
    target = torch.randint(
        0,
        num_classes,
        (batch_size, image_size, image_size),
        generator=generator,
        device=generator.device,
    )
    return x, target


def _unet_workload(size: str) -> Workload:
    if size in ("bench", "medium"):  # medium: the bench model on an eighth of the batch
        config = UNetConfig(
            in_channels=3,
            base_channels=16,
            depth=3,
            image_size=128,
            num_classes=4,
            dropout=0.1,
        )
        batch_size = 40 if size == "bench" else 5
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
