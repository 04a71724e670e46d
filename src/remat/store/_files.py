"""Private directories for offloaded files, the cleanup that keeps disks from filling up, and
the raw file I/O the disk tier runs at the disk's sequential bandwidth with.

The disk tier writes saved tensors to files that may hold gigabytes. Those files must never
outlive the process that wrote them, however it ends:

- **normal exit or ``close()``**: the directory is removed (``remove_private_directory``,
  and once per process an ``atexit`` hook for every directory still registered);
- **an exception**: the tier's ``close()`` or its finalizer removes it, as for a normal exit;
- **SIGKILL, OOM killer, power loss**: nothing runs, so the next process that creates a
  directory under the same parent sweeps the directories of processes that are gone
  (``sweep_stale``).

Layout: ``<root>/remat-offload-<uid>/<pid>-<token>/``, beside its lock file
``<pid>-<token>.lock``. The parent is per user, so that one user's sweep never meets another
user's files and a shared ``/tmp`` cannot be used to plant a directory where ours goes; both
levels are mode ``0o700``, checked after creation because a umask can only take bits away and
a restrictive one would leave us unable to read back.

NOTE [ Who is alive: a lock, not a pid ]

A directory is live while its owner holds an exclusive ``flock`` on its lock file; the kernel
releases the lock when the owner dies, however it dies. The pid in the name is for people
reading a listing, never for deciding: a process in another PID namespace (a container that
shares the scratch directory) has a pid that means nothing here, or means another process.

1. **create**: the lock file is created (``O_EXCL``) and locked before the directory exists,
   and the owner checks that the path still names the file it locked (a sweep may have removed
   a lock file in the instant between its creation and its locking; the owner then starts
   again with a new name). So whenever the directory exists, its owner holds the lock.
2. **hold**: the lock's descriptor stays open for the directory's life (``O_CLOEXEC``: a
   program the owner executes does not inherit it; a forked child does, and keeps the
   directory live while it runs).
3. **sweep**: for each ``<pid>-<token>`` directory, try a non-blocking exclusive lock on its
   lock file. Obtained: the owner is gone; remove the directory, then the lock file, then let
   go. Refused: the owner lives; keep it. No lock file: not a directory this rule covers (made
   by a remat that recorded only a pid); keep it. A lock file with no directory (an owner or a
   sweep killed between the two removals) is removed the same way.
4. **remove**: ``close()``, the finalizer or ``atexit`` remove the directory, then the lock
   file, then close the descriptor.

The lock needs a filesystem where ``flock`` works between every process that shares it (local
disks, tmpfs; on NFS only where the client maps it to NFS locks). Sweeping runs on POSIX only.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import io
import os
import pathlib
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time

import torch

from ..errors import RematError

__all__: list[str] = []

# Bytes per os.write/readinto call: few enough calls to cost nothing, below Linux's ~2 GiB cap.
CHUNK_BYTES = 1 << 30
_PRIVATE_MODE = 0o700
_NAME = re.compile(r"^\d+-[0-9a-f]+$")
_LOCK_SUFFIX = ".lock"

_lock = threading.Lock()
# directory -> (pid of the process that owns it, descriptor of its locked lock file or -1)
_live: dict[pathlib.Path, tuple[int, int]] = {}
_atexit_registered = False


def parent_directory(root: str | os.PathLike[str] | None) -> pathlib.Path:
    """The per-user directory under *root* (default: the system temp dir) holding ours."""
    base = pathlib.Path(tempfile.gettempdir() if root is None else os.fspath(root))
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return base / f"remat-offload-{uid}"


def private_directory(root: str | os.PathLike[str] | None) -> pathlib.Path:
    """Create a fresh directory, mode ``0o700``, that only this process writes to.

    Stale directories of dead processes under the same parent are swept first. The directory
    is removed at normal interpreter exit unless :func:`remove_private_directory` did so before.
    """
    parent = parent_directory(root)
    try:
        parent.parent.mkdir(parents=True, exist_ok=True)
        _make_private(parent, exist_ok=True)
    except OSError as exc:
        raise RematError(
            f"remat: the disk tier needs a private directory under {parent.parent}, but it "
            f"could not be created: {exc}. Pass a writable directory with "
            f"DiskTier(directory=...)."
        ) from exc
    sweep_stale(parent)
    while True:
        path = parent / f"{os.getpid()}-{secrets.token_hex(8)}"
        fd = _take_lock(lock_path(path))  # [1. create]: the lock first
        if fd is None:  # pragma: no cover - a name collided, or a sweep removed the lock file
            continue
        try:
            _make_private(path, exist_ok=False)
        except BaseException:
            _release(path, fd)
            raise
        break
    _register(path, fd)
    return path


def lock_path(directory: pathlib.Path) -> pathlib.Path:
    """The lock file whose holder keeps *directory* live; see NOTE [ Who is alive ]."""
    return directory.with_name(directory.name + _LOCK_SUFFIX)


def sweep_stale(parent: pathlib.Path) -> list[pathlib.Path]:
    """Remove the directories under *parent* whose owner is gone; return those removed.

    An owner is gone when the lock on its lock file can be taken (see NOTE [ Who is alive ]
    [3. sweep]). Entries that do not look like ours (``<pid>-<hex>``) are left alone, as are
    directories without a lock file. Other processes may sweep the same parent at the same
    time: whatever they removed first is skipped.
    """
    if os.name != "posix":  # pragma: no cover - no flock
        return []
    try:
        names = set(os.listdir(parent))
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted(names):
        if name.endswith(_LOCK_SUFFIX):
            name = name[: -len(_LOCK_SUFFIX)]
            if not _NAME.match(name) or name in names:
                continue  # not ours, or handled with its directory
        elif not _NAME.match(name) or name + _LOCK_SUFFIX not in names:
            continue  # not ours, or no lock file: nothing tells whether its owner lives
        path = parent / name
        fd = _try_lock(lock_path(path))
        if fd is None:
            continue  # the owner lives, or another sweep is removing it
        try:
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                unlink_quietly(lock_path(path))
                if name in names:
                    removed.append(path)
        finally:
            os.close(fd)
    return removed


def remove_private_directory(path: pathlib.Path) -> None:
    """Remove *path* and everything in it, if this process created it; never raises."""
    with _lock:
        owner, fd = _live.pop(path, (-1, -1))
    if owner == os.getpid():  # a forked child must not remove its parent's files
        shutil.rmtree(path, ignore_errors=True)
        _release(path, fd)


def _take_lock(path: pathlib.Path) -> int | None:
    """Create *path* and lock it for good; ``None`` if the name is taken or the file was
    removed before the lock was held ([1. create])."""
    if os.name != "posix":  # pragma: no cover - no flock: nothing is swept either
        return -1
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
    except OSError:  # a sweep holds it (and is about to remove it), or removed it already
        pass
    os.close(fd)
    return None


def _try_lock(path: pathlib.Path) -> int | None:
    """A descriptor holding the exclusive lock of *path*; ``None`` if its owner lives."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # removed meanwhile, or not ours to open
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _release(path: pathlib.Path, fd: int) -> None:
    """[4. remove]: the lock file goes before the lock, so no sweep ever finds it unlocked
    while the directory is being removed."""
    unlink_quietly(lock_path(path))
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def _make_private(path: pathlib.Path, *, exist_ok: bool) -> None:
    try:
        os.mkdir(path, _PRIVATE_MODE)
    except FileExistsError:
        if not exist_ok:
            raise
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        raise RematError(
            f"remat: expected {path} to be a directory owned by this user, found "
            f"{'a directory' if stat.S_ISDIR(info.st_mode) else 'a non-directory'} owned by "
            f"uid {info.st_uid}. Remove it, or pass another place with DiskTier(directory=...)."
        )
    if stat.S_IMODE(info.st_mode) != _PRIVATE_MODE:
        os.chmod(path, _PRIVATE_MODE)


def _register(path: pathlib.Path, fd: int) -> None:
    global _atexit_registered
    with _lock:
        _live[path] = (os.getpid(), fd)
        if not _atexit_registered:
            atexit.register(_remove_all)
            _atexit_registered = True


def _remove_all() -> None:
    with _lock:
        paths = list(_live)
    for path in paths:
        remove_private_directory(path)


# Raw file I/O: large unbuffered calls straight from and into a tensor's memory.


def byte_view(data: torch.Tensor) -> memoryview:
    """A memoryview on the bytes of a flat contiguous uint8 CPU tensor, without a copy."""
    try:
        return data.detach().numpy().data
    except (ImportError, RuntimeError):  # torch without numpy: "Numpy is not available"
        if data.numel() == 0:
            return memoryview(b"")
        array = (ctypes.c_uint8 * data.numel()).from_address(data.data_ptr())
        return memoryview(array).cast("B")


def write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done : done + CHUNK_BYTES])


def read_all(file: io.FileIO, view: memoryview, path: pathlib.Path) -> None:
    done = 0
    while done < len(view):
        got = file.readinto(view[done : done + CHUNK_BYTES])
        if not got:
            raise OSError(
                errno.EIO, f"file ended after {done} of {len(view)} bytes", os.fspath(path)
            )
        done += got


def write_file(path: pathlib.Path, data: torch.Tensor) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags | getattr(os, "O_BINARY", 0), 0o600)
    try:
        if hasattr(os, "fchmod"):  # a umask may have taken bits away
            os.fchmod(fd, 0o600)
        write_all(fd, byte_view(data))
    finally:
        os.close(fd)  # may report ENOSPC itself (NFS), so inside the try of the caller


def read_file(path: pathlib.Path, out: torch.Tensor) -> torch.Tensor:
    """Fill *out*, a flat contiguous uint8 CPU tensor, with the bytes of the file at *path*."""
    with open(path, "rb", buffering=0) as file:
        read_all(file, byte_view(out), path)
    return out


def unlink_quietly(path: pathlib.Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def sequential_bandwidth(
    directory: str | os.PathLike[str] | None, nbytes: int = 2**30
) -> tuple[float, float]:
    """Bytes per second that a plain large-file write, then read, reach in *directory*.

    The baseline the disk tier is measured against: one file of *nbytes* written with
    ``os.write`` of 64 MiB chunks and read back with ``readinto``, the calls the tier uses,
    and like the tier without ``fsync``, so both measure what the kernel's page cache lets
    through (the disk itself once dirty pages exceed what the kernel will buffer). The read
    follows the write at once, as backward follows forward, so it is served from the page cache
    when the file fits; dropping the cache needs root and is not attempted. ``None`` means the
    system's temporary directory.
    """
    chunk = torch.ones(min(nbytes, 64 * 2**20), dtype=torch.uint8)
    view = byte_view(chunk)
    fd, name = tempfile.mkstemp(prefix="remat-bandwidth-", dir=directory)
    try:
        start = time.perf_counter()
        try:
            done = 0
            while done < nbytes:
                done += os.write(fd, view[: min(len(view), nbytes - done)])
        finally:
            os.close(fd)
        write_seconds = time.perf_counter() - start
        start = time.perf_counter()
        with open(name, "rb", buffering=0) as file:
            done = 0
            while done < nbytes:
                got = file.readinto(view[: min(len(view), nbytes - done)])
                if not got:
                    raise OSError(errno.EIO, f"file ended after {done} of {nbytes} bytes", name)
                done += got
        read_seconds = time.perf_counter() - start
    finally:
        os.unlink(name)
    return nbytes / max(write_seconds, 1e-9), nbytes / max(read_seconds, 1e-9)
