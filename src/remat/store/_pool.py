"""A pool of host buffers, reused from step to step.

Allocating pinned host memory is slow (it pins pages and may synchronise the device), so an
offloader that allocates one buffer per saved tensor spends much of the step in the allocator
(torchtune#2076). A training step saves tensors of the same sizes every time, so buffers are
kept by size after use and handed out again to the next tensor of that size. Buffers are
pinned when an accelerator is available to pin for; on a CPU-only machine they are ordinary
memory.

The pool's lock is a plain lock, taken by the host tier inside its own section only, and no
object the garbage collector tracks is made while it is held (the lists of free buffers are
made before taking it), so the collector never runs there: a finalizer that drops a ticket
(and so gives a buffer back) can never find the lock held by its own thread. See NOTE
[ Finalizers and the store's locks ] in ``_section.py``.
"""

from __future__ import annotations

import threading

import torch

__all__: list[str] = []


class HostPool:
    """Flat ``uint8`` host buffers by exact size.

    ``take(n)`` returns a free buffer of ``n`` bytes, or a new one; ``give(buffer)`` returns it
    for reuse. At most ``max_cached_bytes`` are kept free; buffers given back past that bound
    are released to the allocator.
    """

    def __init__(self, *, pin: bool, max_cached_bytes: int = 4 * 2**30) -> None:
        self.pin = pin
        self.max_cached_bytes = max_cached_bytes
        self.cached_bytes = 0
        self.allocated = 0  # buffers ever allocated, to measure reuse
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.cached_bytes -= nbytes
                return free.pop()
            self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel()
        fresh: list[torch.Tensor] = []  # made outside the lock: see the module's docstring
        with self._lock:
            if self.cached_bytes + nbytes <= self.max_cached_bytes:
                self._free.setdefault(nbytes, fresh).append(buffer)
                self.cached_bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.cached_bytes = 0
