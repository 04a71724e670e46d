"""An MLP chain as an ``nn.Sequential``, for ``checkpoint_sequential``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import Workload

__all__: list[str] = []

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
    elif size == "medium":
        config = MLPConfig(width=256, depth=16, dropout=0.1)
        batch_size = 2048
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
