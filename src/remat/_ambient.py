"""Capture the ambient state a region ran under, and replay it for the recompute.

A recompute must see what the forward pass saw, or it produces other values: the random
number generators of the CPU and of every accelerator the region may use, the autocast
settings, and the default device of factory functions. This module captures them when a region
starts and re-enters them around its recompute, restoring the backward pass's own state after.

Accelerator generators are captured for every device of every accelerator type that is
initialised when the region starts, not only the devices of the region's inputs: a region that
moves CPU inputs to a GPU and runs dropout there replays exactly too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch

from .errors import CheckpointError

__all__: list[str] = []

# Accelerator types whose generators remat captures, looked up lazily on ``torch``.
_ACCELERATOR_TYPES = ("cuda", "xpu", "mtia", "mps")


def _accelerator_module(device_type: str) -> ModuleType | None:
    module = getattr(torch, device_type, None)
    return module if isinstance(module, ModuleType) else None


def _initialized_accelerators() -> tuple[str, ...]:
    """Accelerator types whose runtime is initialised (a cheap check: nothing is initialised)."""
    found = []
    names = list(_ACCELERATOR_TYPES)
    custom = torch._C._get_privateuse1_backend_name()
    if custom != "privateuseone":
        names.append(custom)
    for name in names:
        module = _accelerator_module(name)
        if module is None:
            continue
        is_initialized = getattr(module, "is_initialized", None)
        if callable(is_initialized):
            if is_initialized():
                found.append(name)
        elif name == "mps" and torch.backends.mps.is_available():
            found.append(name)
    return tuple(found)


def _device_states(device_type: str) -> list[torch.Tensor]:
    module = _accelerator_module(device_type)
    assert module is not None
    count = module.device_count() if hasattr(module, "device_count") else 1
    if device_type == "mps":
        return [module.get_rng_state()]
    return [module.get_rng_state(i) for i in range(count)]


def _set_device_states(device_type: str, states: list[torch.Tensor]) -> None:
    module = _accelerator_module(device_type)
    assert module is not None
    if device_type == "mps":
        module.set_rng_state(states[0])
        return
    for index, state in enumerate(states):
        module.set_rng_state(state, index)


@dataclass(frozen=True)
class _Autocast:
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


@dataclass(frozen=True)
class Ambient:
    """The state one forward run of a region saw, as needed to replay it."""

    cpu_rng: torch.Tensor | None
    device_rng: tuple[tuple[str, list[torch.Tensor]], ...]
    accelerators: tuple[str, ...]
    autocast: tuple[_Autocast, ...]
    default_device: torch.device
    # The generators were, when the run started, as the previous run of the same recompute
    # left them: its replay leaves them right, and none is captured (see [ Linked calls ]).
    continues: bool = False

    @classmethod
    def capture(cls, preserve_rng_state: bool) -> Ambient:
        accelerators = _initialized_accelerators()
        cache = torch.is_autocast_cache_enabled()
        autocast = tuple(
            _Autocast(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), cache)
            for t in ("cpu", *accelerators)
        )
        return cls(
            cpu_rng=torch.get_rng_state() if preserve_rng_state else None,
            device_rng=tuple((t, _device_states(t)) for t in accelerators)
            if preserve_rng_state
            else (),
            accelerators=accelerators,
            autocast=autocast,
            default_device=torch.get_default_device(),
        )

    def same_generators(self, other: Ambient) -> bool:
        """Whether both captured the same generator states (both captured them)."""
        if self.cpu_rng is None or other.cpu_rng is None:
            return False
        if not torch.equal(self.cpu_rng, other.cpu_rng):
            return False
        mine, theirs = dict(self.device_rng), dict(other.device_rng)
        return mine.keys() == theirs.keys() and all(
            len(mine[t]) == len(theirs[t])
            and all(torch.equal(a, b) for a, b in zip(mine[t], theirs[t], strict=True))
            for t in mine
        )

    def continuing(self) -> Ambient:
        """This state without its generators, replayed as the previous run left them."""
        return replace(self, cpu_rng=None, device_rng=(), continues=True)

    def check_forward_done(self) -> None:
        """Raise if the region initialised an accelerator whose generator it could not capture."""
        if self.cpu_rng is None and not self.continues:
            return
        started = [t for t in _initialized_accelerators() if t not in self.accelerators]
        if started:
            raise CheckpointError(
                f"remat: the checkpointed region initialised {', '.join(started)} for the first "
                "time, so the random state it used there could not be captured for the "
                f"recompute. Initialise it before the first region (e.g. torch.{started[0]}."
                "init()), or pass preserve_rng_state=False if the region draws no random numbers."
            )

    @contextmanager
    def replay(self, restore: bool = True) -> Iterator[None]:
        """Run a block under this state; the caller's generators are restored afterwards
        (with ``restore=False``, the caller restores them, see :func:`restoring_rng`)."""
        with ExitStack() as stack:
            if self.cpu_rng is not None:
                if restore:
                    stack.enter_context(restoring_rng(self.device_rng))
                torch.set_rng_state(self.cpu_rng)
                for device_type, states in self.device_rng:
                    _set_device_states(device_type, states)
            for ac in self.autocast:
                if ac != _Autocast(
                    ac.device_type,
                    torch.is_autocast_enabled(ac.device_type),
                    torch.get_autocast_dtype(ac.device_type),
                    torch.is_autocast_cache_enabled(),
                ):
                    stack.enter_context(
                        torch.autocast(
                            ac.device_type,
                            dtype=ac.dtype,
                            enabled=ac.enabled,
                            cache_enabled=ac.cache_enabled,
                        )
                    )
            if torch.get_default_device() != self.default_device:
                stack.enter_context(self.default_device)
            yield


@contextmanager
def restoring_rng(device_rng: tuple[tuple[str, Any], ...]) -> Iterator[None]:
    """Put the CPU generator, and those of ``device_rng``'s device types, back on exit."""
    cpu = torch.get_rng_state()
    devices = [(t, _device_states(t)) for t, _ in device_rng]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for device_type, states in devices:
            _set_device_states(device_type, states)
