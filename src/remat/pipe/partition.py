"""Split an ``nn.Sequential`` into partitions by a balance, and place them on devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import torch
from torch import nn

from ..errors import RematError

__all__: list[str] = []

DeviceLike: TypeAlias = torch.device | str | int


def check_module(module: object, where: str) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise RematError(
            f"remat: {where} takes an nn.Sequential, got {type(module).__name__}. Write the "
            "model as nn.Sequential(layer, ...), with @remat.pipe.skippable layers for skip "
            "connections."
        )
    return module


def check_balance(module: nn.Sequential, balance: Sequence[int], where: str) -> list[int]:
    """The balance as a list, or a :class:`RematError` naming what is wrong with it."""
    if isinstance(balance, int) or not all(isinstance(b, int) for b in balance):
        raise RematError(
            f"remat: {where} balance must be a list of layer counts, one per partition, got "
            f"{balance!r}."
        )
    balance = list(balance)
    if not balance:
        raise RematError(f"remat: {where} balance is empty; give at least one partition.")
    if any(b <= 0 for b in balance):
        raise RematError(
            f"remat: {where} balance {balance} has a partition with {min(balance)} layers; every "
            "partition needs at least one layer."
        )
    if sum(balance) != len(module):
        raise RematError(
            f"remat: {where} balance {balance} sums to {sum(balance)}, but the module has "
            f"{len(module)} layers (module: {len(module)}, sum of balance: {sum(balance)}). "
            f"Give counts that sum to {len(module)}, e.g. {_even(len(module), len(balance))}."
        )
    return balance


def _even(layers: int, parts: int) -> list[int]:
    parts = max(1, min(parts, layers))
    return [layers // parts + (1 if k < layers % parts else 0) for k in range(parts)]


def check_devices(devices: Sequence[DeviceLike], partitions: int, where: str) -> list[torch.device]:
    if isinstance(devices, (str, int, torch.device)):
        raise RematError(
            f"remat: {where} devices must be a list with one device per partition, got "
            f"{devices!r}; e.g. devices={[str(devices)] * partitions!r}."
        )
    found = [torch.device(d if not isinstance(d, int) else f"cuda:{d}") for d in devices]
    if len(found) < partitions:
        raise RematError(
            f"remat: {where} has {partitions} partitions but only {len(found)} devices "
            f"({', '.join(map(str, found)) or 'none'}); give one device per partition "
            "(a device may repeat, e.g. ['cpu'] * partitions)."
        )
    return found[:partitions]


def split_module(
    module: nn.Sequential, balance: list[int], devices: list[torch.device]
) -> list[nn.Sequential]:
    """Partitions holding the module's own layers (not copies), moved to their devices."""
    layers = list(module)
    partitions: list[nn.Sequential] = []
    start = 0
    for count, device in zip(balance, devices, strict=True):
        partitions.append(nn.Sequential(*layers[start : start + count]).to(device))
        start += count
    return partitions
