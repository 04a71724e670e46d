"""What every storage tier offers: move bytes out, bring them back, forget them.

A tier stores *storages*, not tensors: the store (``remat.store``) hands it the bytes of one
storage as a flat ``uint8`` tensor and rebuilds every saved view from them, so views of one
storage are stored once. A tier never sees dtypes, shapes or autograd.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__: list[str] = []


class Ticket(Protocol):
    """A tier's receipt for one stored storage; opaque to everyone but the tier."""


class Tier(Protocol):
    """Storage for the bytes of offloaded storages, from forward until backward.

    The life of one ticket, in the order the store calls these:

    1. ``put(data)`` returns at once; the copy or write runs in the background. The tier holds
       ``data`` until it is safely stored, then lets it go (that is what frees the memory). It
       may block to bound the bytes in flight.
    2. ``prefetch(ticket)`` starts bringing the bytes back; calling it twice is harmless.
    3. ``get(ticket)`` waits for them and returns a flat ``uint8`` tensor on ``device`` that the
       caller owns. It may be called again for the same ticket (a second backward).
    4. ``drop(ticket)`` is the last call for a ticket: its space is freed once pending work on
       it has finished. It is called from finalizers, possibly inside one of the tier's own
       calls on the same thread (the garbage collector runs on any allocation): it must never
       wait for a lock (see NOTE [ Finalizers and the store's locks ] in ``_section.py``).

    ``flush()`` waits for every ``put`` so far and raises the first failure as a
    :class:`~remat.RematError`; ``close()`` drops everything and frees the tier's resources.
    A tier may also offer ``flush_thread()``, the same for the puts of the calling thread
    only; the store's flush at the end of an offload scope prefers it, so that a failure is
    raised by the step that made the write and by no other thread's. And ``settle(ticket)``:
    wait until the copy or write of one ticket has read its source (which is about to be
    written in place), raising nothing, so that failures stay with the scope that owns them;
    without it, the store flushes instead.
    """

    name: str

    def put(self, data: torch.Tensor) -> Ticket: ...

    def prefetch(self, ticket: Ticket, device: torch.device) -> None: ...

    def get(self, ticket: Ticket, device: torch.device) -> torch.Tensor: ...

    def drop(self, ticket: Ticket) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
