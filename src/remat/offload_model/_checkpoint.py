"""Checkpoints of an :class:`~remat.OffloadModel`: its parameters and its optimizers' state,
gathered from the offload device with their real values, and stored back all or nothing.

NOTE [ OffloadModel checkpoints ]

1. Keys. ``model.state_dict()`` has the wrapped model's keys (``"0.weight"``), with the real
   values on the CPU. Inside a parent module the OffloadModel is transparent: the parent's
   ``state_dict()`` holds ``"<name>.0.weight"``, the keys a plain ``nn.Sequential`` at that
   place would have, so a plain model's checkpoint loads into a model whose body is offloaded,
   and back. ``parent.load_state_dict`` reaches :meth:`OffloadModel._load_from_state_dict`
   first: it takes its keys out of the dict (so that the wrapped modules, whose parameters are
   stand-ins, never see them) and loads them; a post-hook then forgets the keys that the wrapped
   modules report missing under ``"<name>.module."``.
2. Optimizer state. ``model.optimizer_state_dict()`` is ``{"slices": [sd_0, ...]}``: each
   slice's optimizer's own ``state_dict()`` with every state tensor's real value (a copy, on
   the CPU), ``None`` for a slice without an optimizer. ``load_optimizer_state_dict`` loads each
   into its slice's optimizer with the slice's parameters loaded (torch casts state to the
   parameters' device and dtype), stores the state, and switches to it once every write is
   done; if one fails, every optimizer is as it was.
3. The per-slice optimizers' own ``state_dict()`` holds stand-ins that raise on use with
   ``offload_device="disk"`` (NOTE [ Stand-ins that raise ]): saving it cannot lose the moments
   silently.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import RematError
from ._slices import Slice
from ._stand_ins import internal
from ._stored import Place, Stored

__all__: list[str] = []

_CPU = torch.device("cpu")


def own_keys(module: nn.Module) -> dict[str, torch.Tensor]:
    """The wrapped model's state-dict entries (parameters as stand-ins), by key."""
    with internal():
        return dict(module.state_dict(keep_vars=True))


def gather(module: nn.Module, slices: Sequence[Slice]) -> OrderedDict[str, Any]:
    """The wrapped model's state dict with every tensor's real value on the CPU."""
    values: dict[int, torch.Tensor] = {}
    for sl in slices:
        for p, t in zip(sl.params, sl.stored.load(_CPU), strict=True):
            values[id(p)] = t
    out: OrderedDict[str, Any] = OrderedDict()
    with internal():
        for name, value in own_keys(module).items():
            if isinstance(value, torch.Tensor):
                value = values.get(id(value), value).detach()
            out[name] = value
    return out


def load(
    module: nn.Module, slices: Sequence[Slice], place: Place, state_dict: Mapping[str, Any]
) -> None:
    """Store the values of ``state_dict`` (wrapped keys, any subset) all or nothing."""
    own = own_keys(module)
    name_of = {id(v): k for k, v in own.items()}
    new: list[tuple[Slice, Stored]] = []
    try:
        for sl in slices:
            keys = [name_of[id(p)] for p in sl.params]
            if not any(k in state_dict for k in keys):
                continue
            current = sl.stored.load(_CPU)
            tensors = []
            for key, old in zip(keys, current, strict=True):
                value = state_dict.get(key)
                if value is None:
                    tensors.append(old.clone() if place.in_place else old)
                    continue
                if not isinstance(value, torch.Tensor) or value.shape != old.shape:
                    found = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                    raise RematError(
                        f"remat: OffloadModel.load_state_dict expected {key} of shape "
                        f"{tuple(old.shape)}, found {found}. Load a state dict of the same "
                        "model."
                    )
                tensors.append(value.detach().to("cpu", old.dtype, copy=True))
            new.append((sl, place.store(tensors)))
        place.flush()
    except BaseException:
        for _, stored in new:
            stored.free()
        raise
    param_ids = {id(p) for sl in slices for p in sl.params}
    with torch.no_grad():
        for key, target in own.items():
            if id(target) not in param_ids and key in state_dict:
                target.copy_(state_dict[key])
    for sl, stored in new:
        sl.stored = stored
        sl.unload()


def forget_inner_missing(module: nn.Module, incompatible: Any) -> None:
    """Load post-hook of an OffloadModel: its wrapped modules report every key missing, since
    it took them out of the dict and loaded them itself (see NOTE point 1)."""
    prefix = getattr(module, "_inner_prefix", None)
    if prefix is None:
        return
    missing = incompatible.missing_keys
    missing[:] = [k for k in missing if not k.startswith(prefix)]
    setattr(module, "_inner_prefix", None)  # noqa: B010


# -- optimizer state -------------------------------------------------------------------------


def optimizer_state(slices: Sequence[Slice]) -> dict[str, Any]:
    out: list[dict[str, Any] | None] = []
    for sl in slices:
        if sl.optimizer is None:
            out.append(None)
            continue
        with internal():
            sd = sl.optimizer.state_dict()
        flat = [p for group in sl.optimizer.param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(flat)}
        state = {i: dict(s) for i, s in sd["state"].items()}
        if sl.state is not None:
            for (position, key, _), t in zip(sl.state_keys, sl.state.load(_CPU), strict=True):
                state[index[id(sl.params[position])]][key] = t.clone()
        out.append({**sd, "state": state})
    return {"slices": out}


def load_optimizer_state(
    slices: Sequence[Slice], place: Place, device: torch.device, state_dict: object
) -> None:
    given = state_dict.get("slices") if isinstance(state_dict, Mapping) else None
    if not isinstance(given, (list, tuple)) or len(given) != len(slices):
        found = len(given) if isinstance(given, (list, tuple)) else type(state_dict).__name__
        raise RematError(
            f"remat: OffloadModel.load_optimizer_state_dict expected the dict that "
            f"optimizer_state_dict() returns, with {len(slices)} slices, found {found}. Save "
            "model.optimizer_state_dict() of a model with the same num_slices."
        )
    for sl, sd in zip(slices, given, strict=True):
        if (sl.optimizer is None) != (sd is None):
            raise RematError(
                f"remat: OffloadModel.load_optimizer_state_dict expected "
                f"{'no state' if sl.optimizer is None else 'a state dict'} for slice "
                f"{sl.index}, found {'none' if sd is None else 'one'}. Call "
                "model.configure_optimizer(...) before loading, with the same model."
            )
    Saved = tuple[Any, Any, Stored | None, list[Any]]
    done: list[tuple[Slice, Saved, Stored | None, list[Any]]] = []
    try:
        for sl, sd in zip(slices, given, strict=True):
            optimizer = sl.optimizer
            if optimizer is None:
                continue
            saved: Saved = (optimizer.state, optimizer.param_groups, sl.state, sl.state_keys)
            sl.load(device)
            try:
                optimizer.load_state_dict(copy.deepcopy(sd))
                new_state, keys = sl.store_state()
            except BaseException:
                optimizer.state, optimizer.param_groups = saved[0], saved[1]
                raise
            finally:
                sl.unload()
            done.append((sl, saved, new_state, keys))
        place.flush()
    except BaseException:
        for sl, saved, new_state, _ in done:
            assert sl.optimizer is not None
            sl.optimizer.state, sl.optimizer.param_groups = saved[0], saved[1]
            if new_state is not None:
                new_state.free()
        raise
    for sl, _, new_state, keys in done:
        sl.state, sl.state_keys = new_state, keys
