"""The U-Net workload as an ``nn.Sequential`` of skippable levels, for pipelines.

:func:`sequential_unet` rebuilds :class:`remat.workloads.UNet` from the same module objects:
each encoder level stashes its block's output as ``"skip"`` and pools, each decoder level pops
it, upsamples and concatenates. One :class:`~remat.pipe.Namespace` per level lets every level
use the name ``"skip"``. The plain ``nn.Sequential`` computes exactly what ``UNet.forward``
computes, operator for operator, so the workload's seeds and figures carry over.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from ..workloads.unet import UNet
from .skip.namespace import Namespace
from .skip.skippable import SkipGenerator, Skippable, pop, skippable, stash

__all__: list[str] = []


@skippable(stash=["skip"])
class EncoderLevel(nn.Module):
    """One encoder level: the block, its output stashed, then pooled."""

    def __init__(self, block: nn.Module, pool: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.pool = pool

    def forward(self, x: Tensor) -> SkipGenerator:
        x = self.block(x)
        yield stash("skip", x)
        out: Tensor = self.pool(x)
        return out


@skippable(pop=["skip"])
class DecoderLevel(nn.Module):
    """One decoder level: upsample, concatenate the popped skip, then the block."""

    def __init__(self, up: nn.Module, block: nn.Module) -> None:
        super().__init__()
        self.up = up
        self.block = block

    def forward(self, x: Tensor) -> SkipGenerator:
        skip = yield pop("skip")
        assert skip is not None
        out: Tensor = self.block(torch.cat([self.up(x), skip], dim=1))
        return out


def sequential_unet(unet: UNet) -> nn.Sequential:
    """``unet`` as ``[encoder levels..., bottleneck, decoder levels..., head]`` (2 x depth + 2
    layers), sharing its modules and parameters."""
    namespaces = [Namespace() for _ in unet.encoder]
    layers: list[nn.Module] = [
        cast(Skippable, EncoderLevel(block, unet.pool)).isolate(ns)
        for block, ns in zip(unet.encoder, namespaces, strict=True)
    ]
    layers.append(unet.bottleneck)
    layers.extend(
        cast(Skippable, DecoderLevel(up, block)).isolate(ns)
        for up, block, ns in zip(unet.upsamples, unet.decoder, reversed(namespaces), strict=True)
    )
    layers.append(unet.head)
    return nn.Sequential(*layers)
