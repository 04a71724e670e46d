"""Keep a recompute from writing to tensors that outlive it.

NOTE [ State mutates once ]

A region's forward pass may write to tensors that live outside it: BatchNorm and InstanceNorm
update ``running_mean``, ``running_var`` and ``num_batches_tracked``, a module may count its
calls in a buffer, a function may ``copy_`` into a cache. Re-running the region in backward
would apply those writes a second time; PyTorch's own checkpoint does (pytorch/pytorch#96136).

:class:`WriteGuard` is a ``TorchDispatchMode`` active only during a recompute. It tells tensors
apart by storage:

1. A storage is *fresh* when an operator run under the guard created it (a result that is not
   an alias of an argument, see ``_aten.OpInfo.fresh``). Views of it share the storage and are
   fresh too.
2. Every other storage is *external*: region inputs, parameters, buffers, globals.
3. An operator that writes an external tensor runs on a copy of it instead. The copy receives
   the write and is dropped; the external tensor keeps the value the forward pass left.

So no class needs a special case: whatever the region wrote in forward, in whatever module, is
written exactly once. The one blind spot: a storage created without any ATen operator (e.g.
``torch.from_numpy`` of an array made inside the region) counts as external, so writes to it
during the recompute are not applied.
"""

from __future__ import annotations

from typing import Any

import torch

from ._aten import op_info
from ._aten import storage_key as _storage_key
from ._dispatch import EagerMode

__all__: list[str] = []


class WriteGuard(EagerMode):
    """Redirect writes to external tensors onto throwaway copies; see [ State mutates once ]."""

    def __init__(self) -> None:
        super().__init__()
        self._fresh: set[int] = set()
        self.redirected = 0

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        info = op_info(func)
        if info.writes:
            args, kwargs = self._redirect(info.writes, args, kwargs)
        out = func(*args, **kwargs)
        if info.any_fresh:
            if type(out) is torch.Tensor:
                key = _storage_key(out)
                if key is not None:
                    self._fresh.add(key)
            else:
                self._register(out, info.fresh)
        return out

    def _is_external(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        key = _storage_key(value)
        return key is not None and key not in self._fresh

    def _redirect(
        self, writes: tuple[tuple[int, str], ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        new_args: list[Any] | None = None
        for position, name in writes:
            if position < len(args):
                value = args[position]
                if self._is_external(value):
                    if new_args is None:
                        new_args = list(args)
                    new_args[position] = self._copy(value)
            elif name in kwargs and self._is_external(kwargs[name]):
                kwargs = {**kwargs, name: self._copy(kwargs[name])}
        return (tuple(new_args) if new_args is not None else args), kwargs

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        self.redirected += 1
        copy = t.clone()
        key = _storage_key(copy)
        if key is not None:
            self._fresh.add(key)
        return copy

    def _register(self, out: Any, fresh: tuple[bool, ...]) -> None:
        results = out if isinstance(out, (tuple, list)) and len(fresh) != 1 else (out,)
        for result, is_fresh in zip(results, fresh, strict=False):
            if not is_fresh:
                continue
            for t in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(t, torch.Tensor):
                    key = _storage_key(t)
                    if key is not None:
                        self._fresh.add(key)
