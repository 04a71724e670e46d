"""Critical sections that a release from a finalizer never waits for.

NOTE [ Finalizers and the store's locks ]

The store and its tiers are reached from finalizers: autograd frees an offloaded graph, a
``Saved`` dies, and ``Saved.__del__`` releases its bytes (``Store.release``, then the tier's
``drop``); ``OffloadModel`` drops its tickets from ``weakref.finalize``. A finalizer runs where
the last reference goes, and the cyclic garbage collector runs on whatever thread allocates, at
any allocation: inside the store's or a tier's own critical section (``DiskTier.put``
submitting a write, a worker finishing one, the host pool handing out a buffer), or on a
thread that a lock holder waits for (a lane's worker running a copy, a worker thread being
started). A release that waited for the lock there would wait for its own thread, or for a
thread that waits for it: the process hangs for good.

So a release never waits for a lock. ``Section.submit(handle, item)`` queues the release, and
it is handled under the lock by whichever thread can take the lock without waiting:

- the releasing thread itself, at once, when it is outside the section and the lock is free;
- that same thread when it leaves its outermost section, when it is inside one already (the
  operation it interrupted finishes first: state is never changed in the middle of one);
- the thread holding the lock, when it leaves: it looks at the queue after letting go of the
  lock, and the release was queued before the attempt to take the lock failed, so none is
  missed, and a release from another thread takes effect as soon as the holder is done.

"Inside" is counted per thread before the lock is taken and after it is let go, so a
finalizer run by the allocations of ``acquire`` or ``release`` themselves is queued too. A
handler runs under the lock and returns what is to run after it is let go (removing a file,
the tier's own ``drop``), or ``None``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

__all__: list[str] = []

After = Callable[[], None] | None
Handler = Callable[[Any], After]


class _Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


class Section:
    """``with section:`` holds ``lock``; ``submit`` queues work that must not wait for it."""

    __slots__ = ("_depth", "_queue", "lock")

    def __init__(self, lock: _Lock) -> None:
        self.lock = lock
        self._depth = threading.local()
        self._queue: collections.deque[tuple[Handler, Any]] = collections.deque()

    def inside(self) -> bool:
        """Whether this thread is in the section (or entering or leaving it)."""
        return bool(getattr(self._depth, "n", 0))

    def _count(self, step: int) -> None:
        self._depth.n = getattr(self._depth, "n", 0) + step

    def __enter__(self) -> None:
        self._count(1)  # before the lock: see the note
        try:
            self.lock.acquire()
        except BaseException:
            self._count(-1)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.lock.release()
        self._count(-1)
        if self._queue and not self.inside():
            self.drain()

    def submit(self, handle: Handler, item: Any) -> None:
        """Run ``handle(item)`` under the lock now, or as soon as a thread can without
        waiting; see NOTE [ Finalizers and the store's locks ]."""
        self._queue.append((handle, item))
        self.drain()

    def drain(self) -> None:
        while self._queue and not self.inside():
            self._count(1)
            if not self.lock.acquire(blocking=False):
                self._count(-1)
                return  # the holder drains when it leaves
            after: list[Callable[[], None]] = []
            try:
                while self._queue:
                    handle, item = self._queue.popleft()
                    then = handle(item)
                    if then is not None:
                        after.append(then)
            finally:
                self.lock.release()
                self._count(-1)
                for then in after:
                    then()
