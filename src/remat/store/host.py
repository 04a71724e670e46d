"""The host tier: saved tensors wait in host memory, copied off and back beside the compute.

NOTE [ Life of a tensor in the host tier ]

One storage's bytes, from ``put`` in forward to ``drop`` when autograd lets go of them:

1. ``put``: a buffer of the same size is taken from the pool (``_pool.py``) and a copy from
   the device into it is queued on the device's lane (``_lanes.py``). The ticket holds the
   source until that copy has finished; then only the buffer holds the bytes and the device
   memory is free once the computation lets go of it.
2. At most ``max_in_flight`` copies out are pending: a further ``put`` first waits for the
   oldest, which bounds both the device memory held by sources and the copy queue.
3. ``prefetch`` allocates the device tensor and queues the copy back on the same lane, so it
   runs after the copy out (lane rule 1) and never reads a half-written buffer.
4. ``get`` makes the computation wait for the copy back (``Done.join``) and hands the device
   tensor over; the buffer keeps the bytes for another backward.
5. ``drop`` returns the buffer to the pool once no copy on it is pending; until then the
   ticket waits in a retiring list that every later call sweeps. ``drop`` is called from
   finalizers (``Saved.__del__``), which the garbage collector may run inside the tier's own
   locked section, or on a lane's worker while a ``put`` holds the lock and waits for that
   worker's copy: it never waits for the lock, but queues the ticket, and the thread that
   leaves the section retires it (NOTE [ Finalizers and the store's locks ] in
   ``_section.py``). The pool's lock is only taken inside the tier's section, so a drop
   never meets it held either.

On a CPU-only machine the same path runs with a thread as the lane, when the tier is made
with ``include_cpu=True``; by default CPU tensors are not the host tier's business, since they
are in host memory already.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

import torch

from ..errors import RematError
from ._args import check_bool, check_int
from ._lanes import Done, Lane, lane_for
from ._pool import HostPool
from ._section import After, Section
from ._tier import Ticket

__all__ = ["HostStats", "HostTier"]


@dataclass
class HostStats:
    """What the host tier has done, for tests and the benchmark."""

    copies_out: int = 0
    copies_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    waits_for_bound: int = 0  # puts that waited because max_in_flight copies were pending
    max_in_flight_seen: int = 0


class _HostTicket:
    __slots__ = ("buffer", "load", "source", "stored")

    def __init__(self, buffer: torch.Tensor, stored: Done, source: torch.Tensor) -> None:
        self.buffer = buffer
        self.stored: Done | None = stored
        self.source: torch.Tensor | None = source
        self.load: tuple[torch.Tensor, Done] | None = None

    def out(self, wait: bool = False) -> bool:
        """Whether the copy out has finished (waiting for it with ``wait``); once it has, the
        source is let go. Raises if the copy failed."""
        if self.stored is not None:
            if not (wait or self.stored.query()):
                return False
            self.stored.wait()
            self.stored = self.source = None
        return True

    def settled(self) -> bool:
        """Whether no copy on the buffer is pending."""
        return self.out() and (self.load is None or self.load[1].query())


class HostTier:
    """Saved storages in (pinned) host memory; see NOTE [ Life of a tensor in the host tier ].

    Args:
        max_in_flight: copies out that may be pending at once.
        include_cpu: also take tensors that are on the CPU, copying them through a worker
            thread. They are in host memory already, so this saves nothing; it exists so that
            the tier's logic runs where there is no accelerator.
        max_cached_bytes: free buffers kept for reuse.
    """

    name = "host"

    def __init__(
        self,
        *,
        max_in_flight: int = 4,
        include_cpu: bool = False,
        max_cached_bytes: int = 4 * 2**30,
    ) -> None:
        check_int("HostTier", "max_in_flight", max_in_flight, 1, "HostTier(max_in_flight=4)")
        check_bool("HostTier", "include_cpu", include_cpu)
        check_int(
            "HostTier",
            "max_cached_bytes",
            max_cached_bytes,
            0,
            "HostTier(max_cached_bytes=4 * 2**30)",
        )
        self.max_in_flight = max_in_flight
        self.include_cpu = include_cpu
        self.pool = HostPool(pin=torch.cuda.is_available(), max_cached_bytes=max_cached_bytes)
        self.stats = HostStats()
        self._lanes: dict[torch.device, Lane] = {}
        self._in_flight: collections.deque[_HostTicket] = collections.deque()
        self._retiring: list[_HostTicket] = []
        self._section = Section(threading.RLock())

    def takes(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` go to this tier."""
        return device.type != "cpu" or self.include_cpu

    def _lane(self, device: torch.device) -> Lane:
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = lane_for(device)
        return lane

    def put(self, data: torch.Tensor) -> Ticket:
        if not self.takes(data.device):
            raise RematError(
                f"remat: the host tier takes tensors from an accelerator, got one on "
                f"{data.device}, which is in host memory already. Use tier='disk' to free host "
                "memory, or HostTier(include_cpu=True) to copy CPU tensors anyway."
            )
        with self._section:
            self._sweep()
            while len(self._in_flight) >= self.max_in_flight:
                self.stats.waits_for_bound += 1
                self._in_flight.popleft().out(wait=True)
            buffer = self.pool.take(data.numel())
            ticket = _HostTicket(buffer, self._lane(data.device).copy(buffer, data), data)
            self._in_flight.append(ticket)
            self.stats.copies_out += 1
            self.stats.bytes_out += data.numel()
            self.stats.max_in_flight_seen = max(self.stats.max_in_flight_seen, len(self._in_flight))
            return ticket

    def prefetch(self, ticket: Ticket, device: torch.device) -> None:
        assert isinstance(ticket, _HostTicket)
        with self._section:
            if ticket.load is not None:
                return
            if ticket.stored is not None and device not in self._lanes:
                ticket.stored.wait()  # a lane other than the one it went out on
            dst = torch.empty(ticket.buffer.numel(), dtype=torch.uint8, device=device)
            ticket.load = (dst, self._lane(device).copy(dst, ticket.buffer))
            self.stats.copies_in += 1
            self.stats.bytes_in += dst.numel()

    def get(self, ticket: Ticket, device: torch.device) -> torch.Tensor:
        assert isinstance(ticket, _HostTicket)
        self.prefetch(ticket, device)
        with self._section:
            assert ticket.load is not None
            dst, done = ticket.load
            ticket.load = None
        done.join()
        with self._section:
            ticket.out()  # the copy out ran before this copy back: let its source go
        return dst

    def drop(self, ticket: Ticket) -> None:
        """Retire ``ticket``; never waits for the tier's lock (see step 5 of the NOTE)."""
        assert isinstance(ticket, _HostTicket)
        self._section.submit(self._drop_locked, ticket)

    def _drop_locked(self, ticket: _HostTicket) -> After:
        self._retiring.append(ticket)
        self._sweep()
        return None

    def settle(self, ticket: Ticket) -> None:
        """Wait until the copy out of ``ticket`` has finished (before its source is written)."""
        assert isinstance(ticket, _HostTicket)
        with self._section:
            ticket.out(wait=True)

    def _sweep(self) -> None:
        while self._in_flight and self._in_flight[0].out():
            self._in_flight.popleft()
        still = []
        for ticket in self._retiring:
            if ticket.settled():
                self.pool.give(ticket.buffer)
            else:
                still.append(ticket)
        self._retiring = still

    def flush(self) -> None:
        """Raise a failed copy, if any has finished failing; copies out are not waited for,
        so that offloading overlaps with the rest of the step."""
        with self._section:
            self._sweep()

    def close(self) -> None:
        """Wait for every pending copy and free the pool's buffers."""
        with self._section:
            for ticket in [*self._in_flight, *self._retiring]:
                ticket.out(wait=True)
                if ticket.load is not None:
                    ticket.load[1].wait()
            self._in_flight.clear()
            self._retiring.clear()
            self.pool.clear()
            for lane in self._lanes.values():
                close = getattr(lane, "close", None)
                if close is not None:
                    close()
            self._lanes.clear()
