"""Check a pipeline's arguments, split an ``nn.Sequential`` into partitions by a balance, and
place them on devices.

Every check runs at construction and raises a one-line :class:`~remat.RematError` that names
the value, what was expected and the fix, so that a bad argument never surfaces later as a raw
error from inside torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from numbers import Integral
from typing import TypeAlias

import torch
from torch import nn

from ..errors import RematError

__all__: list[str] = []

DeviceLike: TypeAlias = torch.device | str | int


def check_module(module: object, where: str) -> nn.Sequential:
    """``module`` itself if it is an ``nn.Sequential`` whose layers and parameters each appear
    once; see :func:`check_unshared`."""
    if not isinstance(module, nn.Sequential):
        raise RematError(
            f"remat: {where} takes an nn.Sequential, got {type(module).__name__}. Write the "
            "model as nn.Sequential(layer, ...), with @remat.pipe.skippable layers for skip "
            "connections."
        )
    check_unshared(module, where)
    return module


def check_unshared(module: nn.Sequential, where: str) -> None:
    """Refuse a layer used at two positions, or a parameter shared by two layers.

    Such a parameter receives gradients from two places of the pipeline; when they are in
    different partitions, the schedule adds them in another order than a plain run does, so
    gradients would not be exact (and across processes each stage would train its own copy).
    torchgpipe refuses both too.
    """
    named = list(module._modules.items())
    first: dict[int, tuple[int, str]] = {}
    for position, (name, layer) in enumerate(named):
        if layer is None:
            continue
        if id(layer) in first:
            at, other = first[id(layer)]
            raise RematError(
                f"remat: {where} takes each layer once, but the nn.Sequential holds the same "
                f"{type(layer).__name__} at positions {at} ({other!r}) and {position} "
                f"({name!r}); a module used twice gets gradients that a pipeline cannot add in "
                "the plain order. Give each position its own module (copy.deepcopy), or wrap "
                "the layers that share it in one nn.Module so that they stay in one layer."
            )
        first[id(layer)] = (position, name)
    owner: dict[int, tuple[int, str, str]] = {}
    for position, (name, layer) in enumerate(named):
        if layer is None:
            continue
        for pname, p in layer.named_parameters(remove_duplicate=True):
            if id(p) in owner and owner[id(p)][0] != position:
                at, other, oname = owner[id(p)]
                raise RematError(
                    f"remat: {where} takes each parameter in one layer, but {other}.{oname} "
                    f"(position {at}) and {name}.{pname} (position {position}) are the same "
                    "parameter (tied weights); a pipeline cannot add its gradients in the plain "
                    "order. Untie them, or wrap the layers that share it in one nn.Module so "
                    "that they stay in one layer."
                )
            owner.setdefault(id(p), (position, name, pname))


def check_balance(module: nn.Sequential, balance: object, where: str) -> list[int]:
    """The balance as a list, or a :class:`RematError` naming what is wrong with it."""
    example = _even(len(module), 2)
    if balance is None:
        raise RematError(
            f"remat: {where} needs balance, the number of layers in each partition (summing to "
            f"the module's {len(module)} layers); e.g. balance={example}."
        )
    counts = list(balance) if isinstance(balance, Iterable) and not isinstance(balance, str) else []
    if not counts or not all(isinstance(b, Integral) and not isinstance(b, bool) for b in counts):
        raise RematError(
            f"remat: {where} balance must be a non-empty list of layer counts, one per "
            f"partition, got {balance!r}; e.g. balance={example}."
        )
    counts = [int(b) for b in counts]
    if any(b <= 0 for b in counts):
        raise RematError(
            f"remat: {where} balance {counts} has a partition with {min(counts)} layers; every "
            "partition needs at least one layer."
        )
    if sum(counts) != len(module):
        raise RematError(
            f"remat: {where} balance {counts} sums to {sum(counts)}, but the module has "
            f"{len(module)} layers (module: {len(module)}, sum of balance: {sum(counts)}). "
            f"Give counts that sum to {len(module)}, e.g. {_even(len(module), len(counts))}."
        )
    return counts


def _even(layers: int, parts: int) -> list[int]:
    parts = max(1, min(parts, layers))
    return [layers // parts + (1 if k < layers % parts else 0) for k in range(parts)]


def current_device() -> torch.device:
    """The current accelerator device (``cuda:N`` after ``torch.cuda.set_device(N)``), or the
    CPU on a machine without one."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def check_device(device: object, where: str) -> torch.device:
    """``device`` as a ``torch.device`` this machine has, or a :class:`RematError`."""
    expected = (
        "expected a torch.device, a device string such as 'cpu', 'cuda' or 'cuda:1', or a "
        "CUDA device index"
    )
    fix = " Use 'cuda' (or 'cuda:N') for a GPU, or 'cpu'."
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        found = torch.device("cuda", device)
    elif isinstance(device, torch.device):
        found = device
    elif isinstance(device, str):
        try:
            found = torch.device(device)
        except RuntimeError:
            raise RematError(
                f"remat: {where}={device!r} is not a device; {expected}.{fix}"
            ) from None
    else:
        raise RematError(f"remat: {where}={device!r} is not a device; {expected}.{fix}")
    if found.type == "cpu":
        return found
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != found.type:
        have = "no accelerator" if accelerator is None else f"a {accelerator.type} accelerator"
        raise RematError(
            f"remat: {where}={device!r} names a {found.type} device, but this machine has "
            f"{have}; use 'cpu'{'' if accelerator is None else f' or {accelerator.type!r}'}."
        )
    count = torch.accelerator.device_count()
    if found.index is not None and found.index >= count:
        raise RematError(
            f"remat: {where}={device!r} names {found}, but only {count} {found.type} device"
            f"{'s are' if count != 1 else ' is'} visible ({found.type}:0 to "
            f"{found.type}:{count - 1}); use an index below {count}."
        )
    return found


def check_devices(devices: object, partitions: int, where: str) -> list[torch.device]:
    """One device per partition: ``devices`` (extra ones ignored) or, for ``None``, the
    current device for every partition."""
    if devices is None:
        return [current_device()] * partitions
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Iterable):
        raise RematError(
            f"remat: {where} devices must be a list with one device per partition, got "
            f"{devices!r}; e.g. devices={[str(devices)] * partitions!r}."
        )
    found = [check_device(d, f"{where} devices[{i}]") for i, d in enumerate(devices)]
    if len(found) < partitions:
        raise RematError(
            f"remat: {where} has {partitions} partitions but only {len(found)} devices "
            f"({', '.join(map(str, found)) or 'none'}); give one device per partition "
            "(a device may repeat, e.g. ['cpu'] * partitions)."
        )
    return found[:partitions]


def check_flag(value: object, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise RematError(f"remat: {where} {name} must be True or False, got {value!r}.")
    return value


def split_layers(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Partitions holding the module's own layers (not copies) under their own names, so that
    a layer's parameters keep the names they have in ``module``."""
    named = list(module._modules.items())
    partitions: list[nn.Sequential] = []
    start = 0
    for count in balance:
        partitions.append(nn.Sequential(OrderedDict(named[start : start + count])))
        start += count
    return partitions


def split_module(
    module: nn.Sequential, balance: list[int], devices: list[torch.device]
) -> list[nn.Sequential]:
    """:func:`split_layers`, each partition moved to its device."""
    partitions = split_layers(module, balance)
    for partition, device in zip(partitions, devices, strict=True):
        partition.to(device)
    return partitions
