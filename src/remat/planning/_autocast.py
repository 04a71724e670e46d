"""Planning a mixed-precision step: every forward the planner runs enters the loop's autocast.

NOTE [ Planning under autocast ]

A training loop under mixed precision enters ``torch.autocast`` around each forward and its
loss, and leaves it before backward::

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model(x))
    loss.backward()

What such a step holds is not what the same step holds inside one long autocast context:

* Leaving the outermost context drops autocast's cache of cast weights. So each step of the
  loop casts the weights again, and the copies autograd saves (a matmul's low-precision
  weight) are that step's activation memory; inside one long context they are made by the
  first step and outlive every later one, so a planner measuring there would miss them. A
  region's recompute casts again too, inside a context of its own, which drops the copies on
  its way out only if it is the outermost one.
* Backward runs without autocast.

So ``remat.plan`` called inside ``torch.autocast`` plans that loop. It takes the context's
settings (device type, dtype, cache) as the loop's (:meth:`Autocast.found`), and does its own
work as if outside every context (:func:`outside`): autocast off, and the context depth torch
keeps set to zero, so that leaving a context, the planner's or a recompute's, drops the cache
as it does in the loop. Every forward the planner runs, of the whole step or of one block's
option, enters a fresh context with the loop's settings (:func:`loop_forward`). The plan
keeps the settings (``Plan.autocast``); a plan run under other autocast settings than it was
made for warns once (``UnlikeProfiled`` in ``apply.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RematError

__all__ = ["Autocast", "loop_forward", "outside"]


@dataclass(frozen=True)
class Autocast:
    """The ``torch.autocast`` a training loop enters around each forward and its loss."""

    device_type: str
    dtype: torch.dtype
    cache_enabled: bool = True

    @classmethod
    def found(cls, device_type: str) -> Autocast | None:
        """The autocast in effect for ``device_type`` now; None where there is none."""
        if not torch.is_autocast_enabled(device_type):
            return None
        return cls(
            device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()
        )

    def __str__(self) -> str:
        return f"torch.autocast({self.device_type!r}, dtype={self.dtype})"

    def to_json(self) -> dict[str, Any]:
        dtype = str(self.dtype).removeprefix("torch.")
        return {
            "device_type": self.device_type,
            "dtype": dtype,
            "cache_enabled": self.cache_enabled,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Autocast | None:
        if data is None:
            return None
        dtype = getattr(torch, str(data.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise RematError(
                f"remat: the plan file's autocast names dtype {data.get('dtype')!r}, which is not "
                "a torch dtype; the plan file is damaged. Plan again."
            )
        return cls(str(data["device_type"]), dtype, bool(data.get("cache_enabled", True)))


# The loop's autocast while the planner runs inside :func:`outside`; None: the loop has none.
_LOOP: ContextVar[Autocast | None] = ContextVar("remat_planned_autocast", default=None)


@contextlib.contextmanager
def outside(autocast: Autocast | None) -> Iterator[None]:
    """Run the planner's work as a loop under ``autocast`` runs outside its forwards: autocast
    off for ``autocast.device_type`` and torch's context depth at zero (see [ Planning under
    autocast ]); every :func:`loop_forward` inside enters ``autocast``. With None, only the
    latter (no forward enters a context) is set."""
    token = _LOOP.set(autocast)
    try:
        if autocast is None:
            yield
        else:
            with _depth_zero(autocast.device_type):
                yield
    finally:
        _LOOP.reset(token)


@contextlib.contextmanager
def _depth_zero(device: str) -> Iterator[None]:
    """Autocast off for ``device`` and torch's context depth at zero; all restored after."""
    enabled, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    cache = torch.is_autocast_cache_enabled()
    depth = 0
    while torch.autocast_decrement_nesting() >= 0:
        depth += 1
    torch.autocast_increment_nesting()  # the decrement that went below zero
    torch.set_autocast_enabled(device, False)
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        for _ in range(depth):
            torch.autocast_increment_nesting()
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(cache)


@contextlib.contextmanager
def loop_forward() -> Iterator[None]:
    """One forward (and its loss) as the planned loop runs it: inside a fresh
    ``torch.autocast`` with the loop's settings, or as it is where the loop has none."""
    autocast = _LOOP.get()
    if autocast is None:
        yield
        return
    with torch.autocast(
        autocast.device_type, dtype=autocast.dtype, cache_enabled=autocast.cache_enabled
    ):
        yield
