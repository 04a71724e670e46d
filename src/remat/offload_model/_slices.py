"""Slices: contiguous groups of modules that come to the compute device one at a time.

A :class:`Slice` owns the offloaded copies of its parameters, of their gradients and of its
optimizer's state, each as one bundle (``_stored.py``), and moves them in and out. While a
slice is offloaded its parameters read as the host copies (``offload_device="cpu"``) or as
stand-ins without memory that raise when used (``"disk"``, NOTE [ Stand-ins that raise ] in
``_stand_ins.py``); its buffers wait in host memory. Gradients live on ``param.grad`` with
``"cpu"`` (where optimizers and ``clip_grad_norm_`` look), in a bundle with ``"disk"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ._stand_ins import park, unpark
from ._stored import Place, Stored

__all__: list[str] = []


def partition(weights: list[int], parts: int) -> list[range]:
    """Split ``range(len(weights))`` into ``parts`` contiguous non-empty ranges whose largest
    sum of weights is as small as possible (binary search on that sum, then a greedy fill)."""
    n = len(weights)
    assert 1 <= parts <= n

    def groups_needed(limit: int) -> int:
        count, load = 1, 0
        for w in weights:
            if load + w > limit:
                count, load = count + 1, 0
            load += w
        return count

    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if groups_needed(mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    ranges: list[range] = []
    start, load = 0, 0
    for i, w in enumerate(weights):
        # Close the current group when item i would overflow it, or when every item left is
        # needed to make one group each.
        if i > start and (load + w > lo or n - i < parts - len(ranges)):
            ranges.append(range(start, i))
            start, load = i, 0
        load += w
    ranges.append(range(start, n))
    assert len(ranges) == parts
    return ranges


class Slice:
    """One group of modules, and the offloaded copies of everything it trains."""

    def __init__(
        self,
        index: int,
        modules: list[nn.Module],
        span: range,
        prefixes: list[str],
        names: list[str],
        params: list[nn.Parameter],
        place: Place,
    ) -> None:
        self.index = index
        self.modules = modules
        self.span = span
        self.prefixes = prefixes  # the modules' names in the wrapped nn.Sequential
        self.names = names
        self.params = params
        self.place = place
        self.nbytes = sum(p.numel() * p.element_size() for p in params)  # of its parameters
        self.stored: Stored = place.store(list(params))
        self.grads: Stored | None = None
        self.grad_positions: list[int] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.state: Stored | None = None
        self.state_keys: list[tuple[int, str, torch.device]] = []
        self.loaded = False
        # Host gradients are the parameters' own ``.grad``; disk gradients are a bundle.
        self.grads_on_params = place.kind == "cpu"
        self.unload()

    def run(self, x: torch.Tensor) -> object:
        out: object = x
        for module in self.modules:
            out = module(out)
        return out

    # -- parameters and buffers ------------------------------------------------------------

    def prefetch(self, device: torch.device) -> None:
        self.stored.prefetch(device)

    def load(self, device: torch.device) -> None:
        """Bring the parameters and buffers to ``device``."""
        for p, t in zip(self.params, self.stored.load(device), strict=True):
            unpark(p)
            p.data = t
        self._move_buffers(device)
        self.loaded = True

    def unload(self, stored: Stored | None = None) -> None:
        """Let go of the parameters on the compute device; they read as ``stored`` (by default
        the committed copy) until the next load. Nothing is written: parameters change only in
        :meth:`~remat.OffloadModel.step`, which stores them itself."""
        disk = self.place.kind == "disk"
        for p, t in zip(self.params, (stored or self.stored).resident(), strict=True):
            unpark(p)
            p.data = t
            if disk:
                park(p)
        self._move_buffers(torch.device("cpu"))
        self.loaded = False

    def named_buffers(self) -> list[tuple[str, nn.Module, str]]:
        """``(name in the wrapped model, owning module, key)`` of each buffer the slice's
        modules hold now, once each (a module repeated in the slice is listed once)."""
        found: dict[tuple[int, str], tuple[str, nn.Module, str]] = {}
        for prefix, module in zip(self.prefixes, self.modules, strict=True):
            for path, owner in module.named_modules(prefix=prefix):
                for key, b in owner._buffers.items():
                    if b is not None:
                        found.setdefault((id(owner), key), (f"{path}.{key}", owner, key))
        return list(found.values())

    def _move_buffers(self, device: torch.device) -> None:
        for module in self.modules:
            for owner in module.modules():
                for name, b in owner._buffers.items():
                    if b is not None and b.device != device:
                        owner._buffers[name] = b.to(device)

    @contextmanager
    def on(self, device: torch.device) -> Iterator[None]:
        """The slice on ``device`` for the duration of the block."""
        self.load(device)
        try:
            yield
        finally:
            self.unload()

    def storages(self) -> dict[int, torch.UntypedStorage]:
        """The storages of the loaded parameters, by address (for recognising saved views)."""
        found = {}
        for p in self.params:
            storage = p.untyped_storage()
            if storage.data_ptr() != 0:
                found[storage.data_ptr()] = storage
        return found

    # -- gradients -------------------------------------------------------------------------

    def has_grads(self) -> bool:
        if self.grads_on_params:
            return any(p.grad is not None for p in self.params)
        return self.grads is not None

    def load_grads(self, device: torch.device) -> list[torch.Tensor | None]:
        if self.grads_on_params:
            return [
                None if g is None else g if g.device == device else g.to(device)
                for g in (p.grad for p in self.params)
            ]
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        if self.grads is not None:
            for position, g in zip(self.grad_positions, self.grads.load(device), strict=True):
                grads[position] = g
        return grads

    def store_grads(self, grads: list[torch.Tensor | None]) -> tuple[Stored | None, list[int]]:
        positions = [i for i, g in enumerate(grads) if g is not None]
        if not positions:
            return None, []
        return self.place.store([g for g in grads if g is not None]), positions

    def commit_grads(self, stored: Stored | None, positions: list[int]) -> None:
        """Make stored gradients the slice's gradients (the slice is not loaded)."""
        if not self.grads_on_params:
            self.grads, self.grad_positions = stored, positions
            return
        tensors = [] if stored is None else stored.resident()
        for position, g in zip(positions, tensors, strict=True):
            self.params[position].grad = g

    def clear_grads(self, set_to_none: bool) -> None:
        if self.grads_on_params:
            for p in self.params:
                if p.grad is not None and set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            return
        if self.grads is None:
            return
        if set_to_none:
            self.grads, self.grad_positions = None, []
            return
        zeros = [torch.zeros_like(g) for g in self.grads.load(torch.device("cpu"))]
        self.grads = self.place.store(zeros)

    # -- optimizer state -------------------------------------------------------------------

    def load_state(self, device: torch.device) -> None:
        if self.state is None or self.optimizer is None:
            return
        tensors = self.state.load(device)
        for (position, key, home), t in zip(self.state_keys, tensors, strict=True):
            self.optimizer.state[self.params[position]][key] = t if t.device == home else t.to(home)

    def store_state(self) -> tuple[Stored | None, list[tuple[int, str, torch.device]]]:
        """Offload the optimizer's state tensors; the state then holds their stand-ins."""
        if self.optimizer is None:
            return None, []
        keys: list[tuple[int, str, torch.device]] = []
        tensors: list[torch.Tensor] = []
        for position, p in enumerate(self.params):
            if p not in self.optimizer.state:
                continue
            state = self.optimizer.state[p]
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    keys.append((position, key, value.device))
                    tensors.append(value)
        if not tensors:
            return None, []
        stored = self.place.store(tensors)
        for (position, key, _), stand_in in zip(keys, stored.stand_ins(), strict=True):
            self.optimizer.state[self.params[position]][key] = stand_in
        return stored, keys
