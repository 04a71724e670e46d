"""The disk tier: saved tensors wait in files, written and read back by background threads.

Host memory is the last place a saved tensor can go before it must be recomputed. When even
host RAM is short (CPU training of a model whose activations exceed RAM, or a GPU step whose
offloaded activations exceed the host's), the disk tier moves those bytes to files in a
private directory and brings them back before backward needs them.

It is built to run at the directory's sequential bandwidth: each storage is one file, written
with a few large unbuffered ``os.write`` calls straight from the tensor's memory and read back
with ``readinto`` into a fresh tensor, no pickling and no intermediate copy, by a small pool of
worker threads so that the step keeps computing meanwhile. :func:`sequential_bandwidth` measures
what the same directory gives a plain large file with the same calls, for the benchmark.

NOTE [ Life of an offloaded file ]

One storage's bytes, from ``put`` in forward to ``drop`` when autograd lets go of them. The
ticket (``_DiskTicket``) is the only record; the worker threads see it and the tier's shared
state (``_Shared``), never the tier itself, so a forgotten tier is collected at once.

1. **put**: the caller's flat ``uint8`` tensor is validated, the ticket takes a reference to it
   and its bytes count as pending; if pending bytes would pass ``max_pending_bytes``, ``put``
   first waits for earlier writes (a single larger put waits until nothing else is pending).
   A write is queued; ``put`` returns the ticket at once.
2. **written**: a worker creates ``<seq>.bin`` (``O_EXCL``, mode ``0o600``), writes it and
   closes it; from here on the bytes live in the file (and the page cache, which the kernel
   may reclaim). The worker does not let go of the tensor itself: the next call of the tier
   in the caller's thread (``put``, ``prefetch``, ``get``, ``flush``, ``drop``) does, which is
   what frees the RAM. See NOTE [ Memory the allocator sees ].
3. **prefetch**: a fresh tensor is allocated in the caller's thread (pinned when the target
   is a CUDA device) and a read into it is queued; the read waits for the write (queued
   before it, so it never deadlocks the pool).
4. **get**: takes the prefetched tensor if there is one (and forgets it: the caller owns it),
   else reads now into a fresh tensor in the caller's thread; for a non-CPU device the bytes
   are read into (pinned) CPU memory and copied to the device. The file stays, so a second
   backward can ``get`` again.
5. **drop**: forgets the ticket; the file is removed at once if no I/O on it is pending, else by
   the worker that finishes the last one. A write that has not started yet is skipped, so a
   drop before the write never leaves a file. ``drop`` comes from finalizers (a ``Saved``
   freed by the garbage collector, which runs on any allocation, also on one the tier makes
   with its lock held, in the caller's thread or a worker's): it never waits for the lock.
   Made inside the tier's section, it is queued and done when the section is left; made
   while another thread holds the lock, that thread does it when it leaves (NOTE
   [ Finalizers and the store's locks ] in ``_section.py``). A forked child that drops its
   copy of a ticket removes nothing: no file is removed by a process other than the tier's
   owner (``_Shared.unlink``), as ``close`` removes nothing there either.
6. **error**: a write that raises (``ENOSPC``, ``EDQUOT``, ``EROFS``, ``ENOENT``...) records a
   :class:`~remat.RematError` naming the directory, the bytes and what the error means for the
   user: room for a full disk or quota, a writable directory for a read-only one, and for a
   removed directory (10) what happened to it. The error is made first, then the partial file
   removed if it can be: on a filesystem remounted read-only the removal fails too, and must
   not take the failure's place. Anything raised in between is a failure of the ticket as well:
   a worker's exception reaches no one, and a write it ended would count as done. The failure
   belongs to the thread that put the ticket (its ``_Owner``): that thread's next ``put`` or
   ``get``, or ``flush_thread`` (the store's flush at the end of an offload block or region),
   raises it, exactly once; ``flush`` raises every thread's; ``settle`` (the graph engine,
   before writing in place to a value whose write may still run) waits for that one ticket's
   write and raises none. So two threads stepping on one tier (the process-wide default) never
   get each other's failures: a failed step raises at the end of its own block, before its
   backward. Before raising, it waits for the thread's writes still running, so that one report
   covers every failure so far (several are reported together) and none surfaces later in an
   unrelated call, such as the retry of the step that failed; a ``get`` of the failed ticket
   itself always raises.
   What is raised is a fresh copy of the recorded error, whose cause (the ``OSError``) keeps no
   traceback: the ticket records the error, and a raised error's traceback holds the frames of
   the failed step, whose tensors hold the ticket. Either link would close a cycle that keeps
   the step's files on disk (and the retry failing for want of space) until the garbage
   collector happens to run; without them, the files go when the step's tensors do.
7. **close**: waits for running I/O, cancels queued I/O, removes every file and the directory.
   ``with DiskTier() as tier:`` closes on an exception too; a tier that is never closed is
   closed on a thread of its own once it is collected (NOTE [ Closed when collected ]), or at
   interpreter exit (8).
8. **exit**: the worker threads are not daemons: ``concurrent.futures`` finishes their queued
   work at interpreter shutdown, then the finalizers and the ``atexit`` hook of ``_files.py``
   remove what is left.
9. **killed**: SIGKILL runs nothing. The kernel releases the lock the tier held on its
   directory, and the next process creating a directory under the same parent removes every
   directory whose lock it can take (``_files.sweep_stale``; NOTE [ Who is alive: a lock, not
   a pid ] in ``_files.py``), whatever PID namespace either process runs in.
10. **removed**: something else removes the directory while the tier lives (a temporary-file
   cleaner, a cleanup script; the default tier lives in the system's temporary directory).
   Its files are lost, and without the directory every later write would fail. The tier
   makes it again under its name, locked as at creation (``_files.restore_private_directory``),
   so that other processes' sweeps leave it alone: in ``put`` when the tier holds no ticket
   (between steps: one ``stat`` a step, and the step notices nothing), and after a write or
   read that failed for want of it (a step that had files there fails, saying so, and the
   next one runs).


NOTE [ Memory the allocator sees ]

Every byte the tier holds in RAM is allocated and freed in the caller's thread, never on a
worker: a written tensor is let go by the caller's next call of the tier, and a read goes into
a tensor the caller allocated, which the worker reaches through the ticket and lets go of
before its read is reported done (a tensor passed to the worker as an argument, or returned
through its future, would be held by the pool's work item until the worker got round to
dropping it, and freed there whenever the caller was done with it first). A tensor dropped
while a worker still reads into it is the exception: the worker frees it. The caller's thread
is where the step runs (on the CPU, autograd's backward too), so its memory, as
``torch.profiler``'s allocator events and the malloc arena of that thread see it, includes what
the tier holds, and is what the planner measures and the budget bounds. A worker freeing the
tensor it wrote, or a file mapped into memory for a read, would be invisible there: the first
made the step look larger than it is, the second smaller.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import os
import pathlib
import queue
import shutil
import threading
import time
import weakref
from types import TracebackType

import torch

from ..errors import RematError
from . import _args, _files
from ._files import sequential_bandwidth as sequential_bandwidth
from ._section import After, Section
from ._tier import Ticket

__all__ = ["DiskStats", "DiskTier", "sequential_bandwidth"]

_FIX = (
    "Fix: pass a directory on a larger disk with DiskTier(directory=...), or offload less "
    "(raise min_bytes=)."
)
# Errors that say the disk (or the user's quota on it) is full: the fix is room.
_NO_SPACE = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, n))
# Errors that say the directory takes no writes: a filesystem remounted read-only (ext4's
# reaction to a disk error), or permissions changed under the tier.
_NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


@dataclasses.dataclass
class DiskStats:
    """What the disk tier has done so far, for tests and the benchmark (``DiskTier.stats``).

    ``write_seconds`` and ``read_seconds`` add up the time of every write and read, in workers
    or in ``get``; with several threads they can exceed the wall time, so the tier's bandwidth
    is ``bytes_written / write_wall_seconds``, the wall time during which at least one write
    ran (likewise for reads).
    """

    bytes_written: int = 0
    bytes_read: int = 0
    files_written: int = 0
    files_read: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    write_wall_seconds: float = 0.0
    read_wall_seconds: float = 0.0
    pending_bytes: int = 0  # put, not yet written (nor failed, nor skipped)
    peak_pending_bytes: int = 0
    puts_waited: int = 0  # puts that blocked because of max_pending_bytes
    failed_writes: int = 0


class _Owner:
    """The thread that put a ticket, as the tier sees it: its writes in flight, for
    ``flush_thread`` (see [6. error])."""

    __slots__ = ("in_flight",)

    def __init__(self) -> None:
        self.in_flight = 0


class _Failure:
    """A write that failed, not yet reported; ``fix`` ends the message of ``error``."""

    __slots__ = ("error", "fix", "nbytes", "owner")

    def __init__(self, error: RematError, fix: str, nbytes: int, owner: _Owner) -> None:
        self.error = error
        self.fix = fix
        self.nbytes = nbytes
        self.owner = owner


class _DiskTicket:
    """One stored storage: its file, and the I/O still pending on it."""

    __slots__ = (
        "buffer",
        "data",
        "dropped",
        "error",
        "io",
        "load",
        "nbytes",
        "owner",
        "path",
        "writing",
    )

    def __init__(self, data: torch.Tensor, path: pathlib.Path, owner: _Owner) -> None:
        self.data: torch.Tensor | None = data  # until written: see [2. written]
        self.owner = owner  # the thread that put it
        self.nbytes = data.numel()
        self.path = path
        self.writing = True
        self.io = 1  # pending write and reads; the last one out removes a dropped file
        self.dropped = False
        self.error: RematError | None = None
        # A prefetch: its read, and the tensor it reads into (see [ Memory the allocator sees ]).
        self.load: concurrent.futures.Future[bool] | None = None
        self.buffer: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"<disk ticket {self.path.name}: {self.nbytes} bytes>"


class _Shared:
    """The tier's state, shared with its worker threads; never refers to the tier."""

    def __init__(self, directory: pathlib.Path, threads: int, max_pending_bytes: int) -> None:
        self.directory = directory
        self.max_pending_bytes = max_pending_bytes
        self.pid = os.getpid()
        self.cond = threading.Condition(threading.Lock())
        # ``with section:`` holds ``cond``; a drop never waits for it, see NOTE [ Finalizers
        # and the store's locks ] in ``_section.py``.
        self.section = Section(self.cond)
        self.owners = threading.local()  # this thread's _Owner
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="remat-disk"
        )
        self.tickets: set[_DiskTicket] = set()
        self.written: list[_DiskTicket] = []  # written, their tensors not let go of yet
        self.errors: list[_Failure] = []  # failed writes not yet reported, in order
        self.closed = False
        self.seq = 0
        self.writes_in_flight = 0
        self.active = {"write": 0, "read": 0}
        self.since = {"write": 0.0, "read": 0.0}
        self.stats = DiskStats()

    # All methods ending in _locked run inside self.section (with self.cond held).

    def owns_files(self) -> bool:
        """Whether this process may remove the tier's files: a forked child that lets go of
        its copy of a graph must not remove the files its parent's step still reads."""
        return os.getpid() == self.pid

    def unlink(self, path: pathlib.Path) -> None:
        if self.owns_files():
            _files.unlink_quietly(path)

    def owner(self) -> _Owner:
        """The calling thread's ``_Owner``."""
        owner: _Owner | None = getattr(self.owners, "owner", None)
        if owner is None:
            owner = self.owners.owner = _Owner()
        return owner

    def release(self) -> None:
        """Let go of the tensors written so far, in the caller's thread (see [2. written])."""
        if not self.written or self.section.inside():  # a drop from a finalizer in here
            return  # (read without the lock: a write finishing now waits a call)
        with self.section:
            written, self.written = self.written, []
            held = [t.data for t in written]
            for t in written:
                t.data = None
        del held  # outside the lock: freeing may take a while

    def check_open_locked(self) -> None:
        if os.getpid() != self.pid:
            raise RematError(
                f"remat: expected the disk tier to be used by the process that made it (pid "
                f"{self.pid}), found it used by pid {os.getpid()}, a forked child. Make a new "
                f"DiskTier in the child."
            )
        if self.closed:
            raise RematError(
                f"remat: expected an open disk tier, found one already closed (its directory "
                f"{self.directory} is gone). Make a new DiskTier."
            )

    def check_ticket_locked(self, ticket: Ticket) -> _DiskTicket:
        self.check_open_locked()
        if not isinstance(ticket, _DiskTicket) or ticket not in self.tickets:
            raise RematError(
                f"remat: expected a ticket this disk tier returned from put() and not yet "
                f"dropped, found {ticket!r}. Keep each ticket with the tier that made it and "
                f"do not use it after drop()."
            )
        return ticket

    def raise_errors_locked(self, owner: _Owner | None) -> None:
        """Raise the failures not yet reported of the writes ``owner`` put (of every thread's
        writes, with ``None``)."""

        def mine(failure: _Failure) -> bool:
            return owner is None or failure.owner is owner

        if not any(mine(f) for f in self.errors):
            return
        self.cond.wait_for(  # see [6. error]
            lambda: (
                (self.writes_in_flight if owner is None else owner.in_flight) == 0 or self.closed
            )
        )
        failures = [f for f in self.errors if mine(f)]
        self.errors[:] = [f for f in self.errors if not mine(f)]
        if not failures:  # closed meanwhile
            return
        first, rest = failures[0], failures[1:]
        if not rest:
            raise _raisable(first.error)
        more = sum(f.nbytes for f in rest)
        also = f"{len(rest)} more write(s), {more} bytes in all, failed too. {first.fix}"
        raise _raisable(first.error, str(first.error).replace(first.fix, also))

    def begin_locked(self, kind: str) -> float:
        now = time.perf_counter()
        if self.active[kind] == 0:
            self.since[kind] = now
        self.active[kind] += 1
        return now

    def end_locked(self, kind: str, start: float, nbytes: int | None) -> None:
        now = time.perf_counter()
        self.active[kind] -= 1
        wall = now - self.since[kind] if self.active[kind] == 0 else 0.0
        stats = self.stats
        if kind == "write":
            stats.write_seconds += now - start
            stats.write_wall_seconds += wall
            if nbytes is not None:
                stats.bytes_written += nbytes
                stats.files_written += 1
        else:
            stats.read_seconds += now - start
            stats.read_wall_seconds += wall
            if nbytes is not None:
                stats.bytes_read += nbytes
                stats.files_read += 1

    def restore_locked(self) -> None:
        """Make the tier's directory again if something removed it (a temporary-file cleaner
        such as systemd-tmpfiles, a cleanup script), so that the next writes find it: see
        [10. removed]. Never raises: a directory that cannot be made again makes the next
        write fail, with its own error."""
        if self.closed or not self.owns_files():
            return
        with contextlib.suppress(OSError, RematError):
            _files.restore_private_directory(self.directory)

    def drop_locked(self, ticket: _DiskTicket) -> After:
        """``DiskTier.drop``, under the section; returns the removal of the file, if no I/O
        on it is pending (else the last I/O removes it)."""
        if not isinstance(ticket, _DiskTicket) or ticket not in self.tickets:
            return None
        self.tickets.discard(ticket)
        ticket.dropped = True
        ticket.load = ticket.buffer = None
        if ticket.io != 0:
            return None
        return functools.partial(self.unlink, ticket.path)

    def finish_io_locked(self, ticket: _DiskTicket) -> bool:
        """One I/O on *ticket* is over; whether the caller must now remove its file."""
        ticket.io -= 1
        return ticket.dropped and ticket.io == 0

    def close(self) -> None:
        with self.section:
            if self.closed:
                return
            self.closed = True
            for ticket in self.tickets:
                ticket.data = None  # a queued write sees it and skips
                ticket.load = ticket.buffer = None
            self.tickets.clear()
            self.written.clear()
            self.errors.clear()
            self.cond.notify_all()
        if not self.owns_files():  # a forked child: the files are the parent's
            return
        self.executor.shutdown(wait=True, cancel_futures=True)
        _files.remove_private_directory(self.directory)


# NOTE [ Closed when collected ]
#
# Closing a tier joins its worker threads. A tier that is never closed is closed once it is
# collected, and the garbage collector runs wherever an allocation triggers it, including
# inside ``threading``'s own locked sections (starting a thread, for one): a join there waits
# for a lock its own thread holds, and the process hangs. So the finalizer only puts the
# tier's shared state on a ``queue.SimpleQueue`` (whose ``put`` may be called from finalizers)
# and a daemon thread, started with the first tier, closes it from there. At interpreter exit
# the finalizer does not run (a daemon thread joining threads while the interpreter finalizes
# aborts it): ``concurrent.futures`` finishes the workers' queued jobs and the ``atexit`` hook
# of ``_files.py`` removes what is left (step 8 of [ Life of an offloaded file ]).
_CLOSE_LATER: queue.SimpleQueue[_Shared] = queue.SimpleQueue()
_closer: threading.Thread | None = None
_closer_lock = threading.Lock()


def _start_closer() -> None:
    global _closer
    with _closer_lock:
        if _closer is None or not _closer.is_alive():
            _closer = threading.Thread(target=_close_collected, name="remat-disk-closer")
            _closer.daemon = True
            _closer.start()


def _close_collected() -> None:
    while True:
        _CLOSE_LATER.get().close()


class DiskTier:
    """Saved tensors in files of a private directory, written and read by background threads.

    Args:
        directory: where the tier makes its private directory
            (``<directory>/remat-offload-<uid>/<pid>-<token>``, mode ``0o700``); by default the
            system's temporary directory. Pick a fast local disk with room for the offloaded
            activations of one step.
        threads: worker threads writing and reading files.
        max_pending_bytes: ``put`` blocks while more bytes than this wait to be written, which
            bounds the RAM the tier holds on to (one larger put is accepted alone).

    See NOTE [ Life of an offloaded file ] for what happens to each ticket. ``put``, ``get``
    and ``drop`` may be called from any thread (the autograd engine's included).
    """

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        threads: int = 2,
        max_pending_bytes: int = 64 * 2**20,
    ) -> None:
        root = _args.check_directory("DiskTier", directory)
        _args.check_int("DiskTier", "threads", threads, 1, "DiskTier(threads=2)")
        _args.check_int(
            "DiskTier",
            "max_pending_bytes",
            max_pending_bytes,
            1,
            "DiskTier(max_pending_bytes=64 * 2**20)",
        )
        path = _files.private_directory(root)
        self._shared = _Shared(path, threads, max_pending_bytes)
        _start_closer()
        # Collected without close(): the closer thread closes it ([ Closed when collected ]).
        self._finalizer = weakref.finalize(self, _CLOSE_LATER.put, self._shared)
        self._finalizer.atexit = False  # at exit: step 8 of [ Life of an offloaded file ]

    @property
    def directory(self) -> pathlib.Path:
        """The tier's private directory, removed by :meth:`close`."""
        return self._shared.directory

    @property
    def max_pending_bytes(self) -> int:
        return self._shared.max_pending_bytes

    @property
    def stats(self) -> DiskStats:
        """A snapshot of the tier's counters."""
        with self._shared.section:
            return dataclasses.replace(self._shared.stats)

    def put(self, data: torch.Tensor) -> _DiskTicket:
        """Queue a write of *data*, a flat contiguous ``uint8`` CPU tensor; return its ticket.

        Raises the failure of an earlier write, if one is not reported yet.
        """
        _check_data(data)
        shared = self._shared
        shared.release()
        nbytes = data.numel()
        inline = False
        with shared.section:
            waited = False
            owner = shared.owner()
            if not shared.tickets:  # idle, no file to lose: a removed directory comes back
                shared.restore_locked()  # ([10. removed]); one stat a step otherwise
            while True:
                shared.check_open_locked()
                shared.raise_errors_locked(owner)
                pending = shared.stats.pending_bytes
                if pending == 0 or pending + nbytes <= shared.max_pending_bytes:
                    break
                waited = True
                shared.cond.wait()
            stats = shared.stats
            stats.puts_waited += int(waited)
            stats.pending_bytes += nbytes
            stats.peak_pending_bytes = max(stats.peak_pending_bytes, stats.pending_bytes)
            shared.writes_in_flight += 1
            owner.in_flight += 1
            ticket = _DiskTicket(data, shared.directory / f"{shared.seq:08x}.bin", owner)
            shared.seq += 1
            shared.tickets.add(ticket)
            try:
                shared.executor.submit(_write, shared, ticket)
            except RuntimeError:  # the interpreter is shutting down: no new threads
                inline = True
        if inline:
            _write(shared, ticket)
        if waited:  # writes finished while this put waited: let go of their tensors
            shared.release()
        return ticket

    def prefetch(self, ticket: Ticket, device: torch.device) -> None:
        """Start reading *ticket* back in the background; harmless if already started."""
        shared = self._shared
        shared.release()
        with shared.section:
            ticket = shared.check_ticket_locked(ticket)
            if ticket.load is not None or ticket.error is not None:
                return
        # Allocated in the caller's thread (see [ Memory the allocator sees ]), outside the
        # lock (pinning may take a while).
        buffer = _empty(ticket.nbytes, torch.device(device))
        with shared.section:
            if shared.closed or ticket.dropped or ticket.load is not None:
                return  # closed, dropped or prefetched by another thread meanwhile
            try:
                ticket.load = shared.executor.submit(_load, shared, ticket)
            except RuntimeError:  # interpreter shutdown: get() will read in its own thread
                return
            ticket.buffer = buffer
            ticket.io += 1

    def get(self, ticket: Ticket, device: torch.device) -> torch.Tensor:
        """The stored bytes as a flat ``uint8`` tensor on *device*, owned by the caller.

        Uses the prefetched tensor if there is one, else reads now. For a non-CPU device the
        file is read into (pinned) CPU memory, then copied to the device.
        """
        device = torch.device(device)
        shared = self._shared
        shared.release()
        with shared.section:
            ticket = shared.check_ticket_locked(ticket)
            if ticket.error is not None:
                raise self._ticket_error_locked(ticket)
            shared.raise_errors_locked(shared.owner())
            load, ticket.load = ticket.load, None
            buffer, ticket.buffer = ticket.buffer, None
        out = buffer if load is not None and _result(shared, load, ticket) else None
        if out is None:
            out = self._read_now(ticket, device)
        return out if out.device == device else out.to(device)

    def drop(self, ticket: Ticket) -> None:
        """Forget *ticket*; its file goes as soon as no I/O on it is pending. Never blocks: it
        is called from finalizers, which may run inside the tier's own locked section (see
        [5. drop]). In a forked child it does nothing: the files are the parent's."""
        shared = self._shared
        if not shared.owns_files():
            return
        shared.section.submit(shared.drop_locked, ticket)
        shared.release()

    def flush(self) -> None:
        """Wait for every write so far (a write whose ticket was dropped meanwhile, until its
        file is removed); raise the first failure not yet reported, of any thread's write."""
        shared = self._shared
        with shared.section:
            shared.cond.wait_for(lambda: shared.writes_in_flight == 0 or shared.closed)
        shared.release()
        with shared.section:
            shared.raise_errors_locked(None)

    def settle(self, ticket: Ticket) -> None:
        """Wait until the write of *ticket* has read its bytes (before its source is written
        in place; ``Store.settle``). Raises nothing, not even this write's failure: every
        failure stays recorded for the thread that put its ticket, which raises it at the end
        of its own block (see [6. error]); a settle made by another thread, or by the graph
        engine in the middle of a region, must not take it from there."""
        shared = self._shared
        with shared.section:
            if isinstance(ticket, _DiskTicket):
                shared.cond.wait_for(lambda: not ticket.writing or shared.closed)
        shared.release()

    def flush_thread(self) -> None:
        """``flush``, for the writes the calling thread put only: waits for them and raises
        their first failure not yet reported, never another thread's (see [6. error]). The
        store's flush at the end of an offload scope calls this."""
        shared = self._shared
        with shared.section:
            owner = shared.owner()
            shared.cond.wait_for(lambda: owner.in_flight == 0 or shared.closed)
        shared.release()
        with shared.section:
            shared.raise_errors_locked(owner)

    def close(self) -> None:
        """Wait for running I/O, drop every ticket, remove the files and the directory."""
        if self._finalizer.detach() is not None:
            self._shared.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._shared.closed else f"{len(self._shared.tickets)} tickets"
        return f"DiskTier({str(self.directory)!r}, {state})"

    def _read_now(self, ticket: _DiskTicket, device: torch.device) -> torch.Tensor:
        shared = self._shared
        with shared.section:
            shared.cond.wait_for(lambda: not ticket.writing or shared.closed)
            shared.check_ticket_locked(ticket)
            if ticket.error is not None:
                raise self._ticket_error_locked(ticket)
            ticket.io += 1
            start = shared.begin_locked("read")
        out: torch.Tensor | None = None
        try:
            out = _files.read_file(ticket.path, _empty(ticket.nbytes, device))
        except OSError as exc:
            raise _read_error(shared, ticket, exc) from exc
        finally:
            with shared.section:
                shared.end_locked("read", start, None if out is None else ticket.nbytes)
                remove = shared.finish_io_locked(ticket)
            if remove:
                shared.unlink(ticket.path)
        return out

    def _ticket_error_locked(self, ticket: _DiskTicket) -> RematError:
        """The error for a get of a ticket whose write failed; reports it if not yet done."""
        shared = self._shared
        assert ticket.error is not None
        if any(f.error is ticket.error for f in shared.errors):
            shared.errors[:] = [f for f in shared.errors if f.error is not ticket.error]
            return _raisable(ticket.error)
        return RematError(
            f"remat: expected the bytes of {ticket!r} on disk, found none: its write failed "
            f"earlier, as reported then ({ticket.error}). Backward cannot proceed; run the "
            f"step again after freeing space."
        )


def _check_data(data: object) -> None:
    if (
        not isinstance(data, torch.Tensor)
        or data.dtype != torch.uint8
        or data.dim() != 1
        or data.device.type != "cpu"
        or not data.is_contiguous()
    ):
        found = (
            f"dtype={data.dtype}, shape={tuple(data.shape)}, device={data.device}, "
            f"contiguous={data.is_contiguous()}"
            if isinstance(data, torch.Tensor)
            else type(data).__name__
        )
        raise RematError(
            f"remat: the disk tier expected a flat contiguous uint8 CPU tensor, found "
            f"{found}. Pass the bytes of a storage, e.g. t.untyped_storage() wrapped with "
            f"torch.empty(0, dtype=torch.uint8).set_(storage), copied to the CPU first."
        )


def _empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host memory to read into: pinned when it goes on to a CUDA device, for a fast copy."""
    pin = device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _result(shared: _Shared, load: concurrent.futures.Future[bool], ticket: _DiskTicket) -> bool:
    try:
        return load.result()
    except OSError as exc:
        raise _read_error(shared, ticket, exc) from exc


def _write(shared: _Shared, ticket: _DiskTicket) -> None:
    """Worker: write one ticket's file; see [2. written] and [6. error]. Whatever goes wrong
    between taking the ticket and recording its outcome is a failure of this ticket: nothing
    a worker raises reaches anyone (its future is never read), so a failure that escaped here
    would be lost, and the write taken for a success."""
    with shared.section:
        data, nbytes = ticket.data, ticket.nbytes
        skip = data is None or ticket.dropped
        start = 0.0 if skip else shared.begin_locked("write")
    failure: tuple[RematError, str] | None = None
    try:
        if data is not None and not skip:
            try:
                _files.write_file(ticket.path, data)
            except BaseException as exc:
                failure = _write_error(shared.directory, nbytes, exc)  # first: see below
                # Cleanup: a partial file that cannot be removed (the filesystem went
                # read-only, which fails the removal too) stays until the directory goes;
                # the failure recorded above is what gets reported.
                shared.unlink(ticket.path)
                if _errno(exc) == errno.ENOENT:  # the directory is gone: [10. removed]
                    with shared.section:
                        shared.restore_locked()
                if not isinstance(exc, Exception):
                    raise  # KeyboardInterrupt, SystemExit (an inline write, at shutdown)
    except BaseException as exc:
        if failure is None:  # a failure of the cleanup itself, or in describing the failure
            failure = _write_error(shared.directory, nbytes, exc)
        if not isinstance(exc, Exception):
            raise
    finally:
        del data  # the ticket still holds it: the caller lets go (see [2. written])
        with shared.section:
            if ticket.data is not None and not shared.closed:
                shared.written.append(ticket)
            else:
                ticket.data = None
            ticket.writing = False
            shared.stats.pending_bytes -= nbytes
            if not skip:
                shared.end_locked("write", start, None if failure else nbytes)
            if failure is not None:
                error, fix = failure
                ticket.error = error
                shared.stats.failed_writes += 1
                if not shared.closed:
                    shared.errors.append(_Failure(error, fix, nbytes, ticket.owner))
            remove = shared.finish_io_locked(ticket)
        # The write ends when the file of a ticket dropped meanwhile is gone: ``flush`` waits for
        # that too, so no file outlives a flush after its drop.
        try:
            if remove:
                shared.unlink(ticket.path)
        finally:
            with shared.section:
                shared.writes_in_flight -= 1
                ticket.owner.in_flight -= 1
                shared.cond.notify_all()


def _load(shared: _Shared, ticket: _DiskTicket) -> bool:
    """Worker: read one ticket into the tensor its prefetch allocated (``ticket.buffer``);
    whether it did. The tensor stays the ticket's, handed to the caller by ``get``: the worker
    lets go of it before its read is reported done, so that the caller's is the last reference
    (see [ Memory the allocator sees ])."""
    try:
        with shared.section:
            # The write was queued before us, so it runs or ran: see [3. prefetch].
            shared.cond.wait_for(lambda: not ticket.writing or shared.closed)
            buffer = ticket.buffer
            if buffer is None or ticket.dropped or ticket.error is not None or shared.closed:
                return False
            start = shared.begin_locked("read")
        done = False
        try:
            _files.read_file(ticket.path, buffer)
            done = True
        finally:
            del buffer
            with shared.section:
                shared.end_locked("read", start, ticket.nbytes if done else None)
        return done
    finally:
        with shared.section:
            remove = shared.finish_io_locked(ticket)
        if remove:
            shared.unlink(ticket.path)


def _errno(exc: BaseException) -> int | None:
    return exc.errno if isinstance(exc, OSError) else None


def _write_error(
    directory: pathlib.Path, nbytes: int, exc: BaseException
) -> tuple[RematError, str]:
    """The error recorded for a failed write, and its last sentence (the fix), worded by what
    the failure says about the directory. Never raises: it runs in the worker's handler of
    that failure (see ``_write``)."""
    code = _errno(exc)
    reason = (
        f"{errno.errorcode.get(code, code)}: {exc.strerror}"
        if isinstance(exc, OSError) and code is not None
        else repr(exc)
    )
    if code == errno.ENOENT:
        found = (
            "the tier's directory was gone: something other than remat removed it while the "
            "tier used it (a temporary-file cleaner such as systemd-tmpfiles or tmpwatch, a "
            "cleanup script), and with it the files this step had written there. remat makes "
            "the directory again for the writes that follow"
        )
        fix = (
            "Fix: run the step again; to keep it from recurring, keep the cleaner out of that "
            "directory or pass one it leaves alone with DiskTier(directory=...)."
        )
    elif code in _NOT_WRITABLE:
        found = (
            "the directory takes no writes: its filesystem is read-only (Linux remounts a "
            "filesystem read-only after a disk error) or its permissions changed"
        )
        fix = (
            f"Fix: make {directory} writable again (check the system log for disk errors), "
            f"or pass a writable directory with DiskTier(directory=...)."
        )
    elif code in _NO_SPACE:
        try:
            found = f"{shutil.disk_usage(directory).free} bytes are free there"
        except Exception:  # describing the failure must not fail
            found = "its free space is unknown"
        if code == getattr(errno, "EDQUOT", None):
            found += ", but your disk quota is used up"
        fix = _FIX
    else:
        found = "the disk or its filesystem reported an error"
        fix = (
            "Fix: check the disk behind that directory (the system log names I/O errors), or "
            "pass another directory with DiskTier(directory=...)."
        )
    error = RematError(
        f"remat: the disk tier expected to write {nbytes} bytes ({nbytes / 2**20:.1f} MiB) to "
        f"{directory}, but the write failed ({reason}); {found}. {fix}"
    )
    # See [6. error]: the cause keeps no frame, so it holds neither the bytes nor the ticket.
    cause: BaseException | None = exc
    while cause is not None:
        cause.__traceback__ = None
        cause = cause.__cause__ or cause.__context__
    error.__cause__ = exc
    return error, fix


def _raisable(error: RematError, message: str | None = None) -> RematError:
    """A fresh copy of a recorded write failure, to raise; see [6. error].

    The recorded error is never raised itself: raising gives it a traceback through the
    frames of the failed step, whose tensors hold the tickets that record it, a reference
    cycle that would keep the step's files on disk until the garbage collector runs.
    """
    fresh = RematError(str(error) if message is None else message)
    fresh.__cause__ = error.__cause__
    return fresh


def _read_error(shared: _Shared, ticket: _DiskTicket, exc: OSError) -> RematError:
    """The error for a failed read, in the caller's thread; a removed directory is made again
    for the steps that follow ([10. removed])."""
    if os.path.isdir(shared.directory):
        return RematError(
            f"remat: expected to read {ticket.nbytes} bytes back from {ticket.path}, but the "
            f"read failed ({exc}). Something removed or truncated the tier's files while it "
            f"ran; keep other processes out of its directory."
        )
    with shared.section:
        shared.restore_locked()
    return RematError(
        f"remat: expected to read {ticket.nbytes} bytes back from {ticket.path}, but the read "
        f"failed ({exc}): the tier's directory was gone, removed while the tier used it by "
        f"something other than remat (a temporary-file cleaner such as systemd-tmpfiles or "
        f"tmpwatch, a cleanup script), with the files of this step. remat makes the directory "
        f"again for the steps that follow. Fix: run the step again; to keep it from recurring, "
        f"keep the cleaner out of that directory or pass one it leaves alone with "
        f"DiskTier(directory=...)."
    )
