"""Checking OffloadModel's arguments and splitting the model into slices."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ..errors import RematError, did_you_mean
from ._slices import Slice, partition
from ._stand_ins import unpark
from ._stored import OffloadDevice, Place

__all__: list[str] = []

_OFFLOAD_DEVICES = ("cpu", "disk")


def _modules(model: object) -> list[nn.Module]:
    sequence = isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model)
    if isinstance(model, nn.Sequential) or sequence:
        modules: list[nn.Module] = list(model)  # type: ignore[call-overload]
    else:
        kind = type(model).__name__
        if isinstance(model, (list, tuple)):
            bad = next(m for m in model if not isinstance(m, nn.Module))
            kind = f"a {type(model).__name__} holding a {type(bad).__name__}"
        raise RematError(
            f"remat: OffloadModel expected an nn.Sequential or a list of nn.Module, found "
            f"{kind}. Pass the model's layers in forward order, e.g. "
            "OffloadModel(nn.Sequential(embed, *blocks, head), ...)."
        )
    if not modules:
        raise RematError(
            "remat: OffloadModel expected at least one module, found an empty sequence."
        )
    return modules


def _device(device: object) -> torch.device:
    try:
        parsed: torch.device = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as error:
        raise RematError(
            f"remat: OffloadModel expected a device such as 'cpu' or 'cuda:0', found "
            f"{device!r} ({error})."
        ) from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise RematError(
                f"remat: OffloadModel expected a usable compute device, found {device!r} but "
                "CUDA is not available. Pass device='cpu'."
            )
        return torch.device(
            "cuda", torch.cuda.current_device() if parsed.index is None else parsed.index
        )
    if parsed.type != "cpu":
        raise RematError(
            f"remat: OffloadModel expected device 'cpu' or 'cuda[:N]', found {device!r}."
        )
    return parsed


def _offload_device(value: object) -> OffloadDevice:
    if isinstance(value, torch.device) and value.type == "cpu":
        return "cpu"  # fairscale's spelling: offload_device=torch.device("cpu")
    if isinstance(value, torch.device):
        raise RematError(
            f"remat: OffloadModel expected offload_device 'cpu', 'disk' or "
            f"torch.device('cpu'), found {value!r}. Offloading is to host memory or disk; pass "
            "the compute device as device=."
        )
    _check_choice("offload_device", value, _OFFLOAD_DEVICES)
    return value  # type: ignore[return-value]


def _check_disk_directory(value: object, offload_device: OffloadDevice) -> None:
    # Only the disk tier has a directory: one given with "cpu" would be ignored, and a user
    # who meant the disk would find the host memory full instead.
    if value is not None and offload_device != "disk":
        raise RematError(
            f"remat: OffloadModel expected disk_directory only with offload_device='disk', "
            f"found disk_directory={value!r} with offload_device={offload_device!r}, which "
            "writes nothing to disk. Drop disk_directory, or pass offload_device='disk'."
        )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = did_you_mean(value, choices) if isinstance(value, str) else ""
        raise RematError(
            f"remat: OffloadModel expected {name} to be one of {', '.join(map(repr, choices))}, "
            f"found {value!r}{hint}."
        )


def _check_int(name: str, value: object, low: int, high: int | None, high_what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RematError(
            f"remat: OffloadModel expected {name} to be an int, found {value!r} "
            f"({type(value).__name__})."
        )
    if value < low or (high is not None and value > high):
        upper = f" and at most {high} ({high_what})" if high is not None else ""
        raise RematError(
            f"remat: OffloadModel expected {name} to be at least {low}{upper}, found {value}."
        )


def _check_disk_available() -> None:
    try:
        importlib.import_module("remat.store.disk")
    except ImportError as error:
        raise RematError(
            f"remat: OffloadModel expected the disk tier (remat.store.disk) for "
            f"offload_device='disk', found it unavailable ({error}). Use offload_device='cpu'."
        ) from error


def _make_slices(
    sequential: nn.Sequential, modules: list[nn.Module], num_slices: int, place: Place
) -> list[Slice]:
    # Each parameter belongs to the first module that holds it; sharing across slices is refused.
    owner: dict[int, int] = {}
    params_of: list[list[tuple[str, nn.Parameter]]] = []
    # Every position's name, a module repeated included (``named_children`` lists it once),
    # so that ``prefixes[i]`` names ``modules[i]``.
    prefixes = list(sequential._modules)
    for i, module in enumerate(modules):
        found = []
        for name, p in module.named_parameters():
            if id(p) not in owner:
                owner[id(p)] = i
                found.append((f"{prefixes[i]}.{name}", p))
        params_of.append(found)
    weights = [sum(p.numel() * p.element_size() for _, p in ps) for ps in params_of]
    ranges = partition(weights, num_slices)
    slice_of = {i: s for s, r in enumerate(ranges) for i in r}
    shared = []
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            if slice_of[owner[id(p)]] != slice_of[i]:
                first = slice_of[owner[id(p)]]
                shared.append(f"{prefixes[i]}.{name} (slices {first} and {slice_of[i]})")
    if shared:
        raise RematError(
            f"remat: OffloadModel expected every parameter to belong to one slice, found "
            f"{len(shared)} shared across slices: {', '.join(shared[:5])}. Change num_slices "
            "so that modules sharing parameters fall in one slice, or untie the parameters."
        )
    slices: list[Slice] = []
    originals = [(p, p.data) for ps in params_of for _, p in ps]
    try:
        for s, span in enumerate(ranges):
            named = [np for i in span for np in params_of[i]]
            slices.append(
                Slice(
                    s,
                    [modules[i] for i in span],
                    span,
                    [prefixes[i] for i in span],
                    [n for n, _ in named],
                    [p for _, p in named],
                    place,
                )
            )
        place.flush()
    except BaseException:
        # A failed write (disk full): the caller's model is put back as it was.
        for p, data in originals:
            unpark(p)
            p.data = data
        raise
    return slices
