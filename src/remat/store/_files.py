"""Private directories for offloaded files, the cleanup that keeps disks from filling up, and
the raw file I/O the disk tier runs at the disk's sequential bandwidth with.

The disk tier writes saved tensors to files that may hold gigabytes. Those files must never
outlive the process that wrote them, however it ends:

- **normal exit or ``close()``**: the directory is removed (``remove_private_directory``,
  and once per process an ``atexit`` hook for every directory still registered), and the
  per-user parent with it when no other directory is left in it;
- **an exception**: the tier's ``close()`` or its finalizer removes it, as for a normal exit;
- **SIGKILL, OOM killer, power loss**: nothing runs, so the next process that creates a
  directory under the same parent sweeps the directories of processes that are gone
  (``sweep_stale``).

Layout: ``<root>/remat-offload-<uid>/<pid>-<token>/``. The parent is per user, so that one
user's sweep never meets another user's files and a shared ``/tmp`` cannot be used to plant a
directory where ours goes; both levels are mode ``0o700``, checked after creation because a
umask can only take bits away and a restrictive one would leave us unable to read back.

NOTE [ Who is alive: a lock, not a pid ]

A directory is live while its owner holds an exclusive ``flock`` on it (on the directory
itself, so that the tier's files are all there is); the kernel releases the lock when the
owner dies, however it dies. The pid in the name is for people reading a listing, never for
deciding: a process in another PID namespace (a container that shares the scratch directory)
has a pid that means nothing here, or means another process.

1. **create**: the directory is made under a staging name (``.<pid>-<token>.new``), opened
   and locked, then renamed to its name; the lock, held on the directory's inode, moves with
   it. So whenever a directory has its name, its owner holds the lock. A sweep that took the
   lock of a staging directory in the instant before its owner did removes it; the owner's
   lock or rename then fails, and it starts again with a new name.
2. **hold**: the locked descriptor stays open for the directory's life (``O_CLOEXEC``: a
   program the owner executes does not inherit it; a forked child does, and keeps the
   directory live while it runs).
3. **sweep**: for each ``<pid>-<token>`` (or staging) directory, try a non-blocking exclusive
   lock. Obtained: the owner is gone; remove the directory, then let go. Refused: the owner
   lives; keep it.
4. **remove**: ``close()``, the finalizer or ``atexit`` remove the directory, then close the
   descriptor.

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
_NAME = re.compile(r"^\.?\d+-[0-9a-f]+(\.new)?$")  # named, or staging ([1. create])

_lock = threading.Lock()
# directory -> (pid of the process that owns it, its locked descriptor or -1)
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
    while True:  # [1. create]
        name = f"{os.getpid()}-{secrets.token_hex(8)}"
        fd = _create_locked(parent, name)
        if fd is not None:
            break
    path = parent / name
    _register(path, fd)
    return path


def _create_locked(parent: pathlib.Path, name: str) -> int | None:
    """Make ``parent / name``, mode ``0o700``, holding its lock ([1. create]); the locked
    descriptor, or ``None`` when the attempt lost a race and should be made again."""
    staging, path = parent / f".{name}.new", parent / name
    try:
        _make_private(staging, exist_ok=False)
    except FileExistsError:  # pragma: no cover - 64 random bits collided
        return None
    except FileNotFoundError:  # the last directory under it was removed, and it with it
        _make_private(parent, exist_ok=True)
        return None
    fd = _try_lock(staging)
    if fd is None:  # pragma: no cover - a sweep took it first, and removes it
        return None
    try:
        os.rename(staging, path)
    except FileNotFoundError:  # pragma: no cover - a sweep removed it before our lock
        os.close(fd)
        return None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(fd)
        raise
    return fd


def restore_private_directory(path: pathlib.Path) -> bool:
    """Make *path* again, a private directory of this process that something else removed (a
    temporary-file cleaner); whether it did. Nothing is done for a directory that is there, or
    that is not this process's (a forked child's copy of a tier, or one already removed by
    ``remove_private_directory``). The directory comes back under its name, locked as at
    [1. create], so that a sweep of another process never takes it for a dead owner's.

    Raises ``OSError`` (or ``RematError`` for a parent that is not ours) when it cannot.
    """
    with _lock:
        owner, _ = _live.get(path, (-1, -1))
    if owner != os.getpid() or os.path.isdir(path):
        return False
    parent = path.parent
    parent.parent.mkdir(parents=True, exist_ok=True)
    _make_private(parent, exist_ok=True)
    for _ in range(3):
        fd = _create_locked(parent, path.name)
        if fd is not None:
            break
    else:  # pragma: no cover - lost every race, or a stale staging directory is in the way
        raise OSError(errno.EEXIST, "could not make the directory again", os.fspath(path))
    with _lock:
        if path in _live:
            stale = _live[path][1]
            _live[path] = (owner, fd)
            fd = stale  # the descriptor of the removed directory: its lock guards nothing
        else:  # removed by close() meanwhile
            shutil.rmtree(path, ignore_errors=True)
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    return True


def sweep_stale(parent: pathlib.Path) -> list[pathlib.Path]:
    """Remove the directories under *parent* whose owner is gone; return those removed.

    An owner is gone when the lock on its directory can be taken (NOTE [ Who is alive ]
    [3. sweep]). Entries that do not look like ours (``<pid>-<hex>``) are left alone. Other
    processes may sweep the same parent at the same time: whatever they removed first, or hold
    the lock of, is skipped.
    """
    if os.name != "posix":  # pragma: no cover - no flock
        return []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    removed = []
    for name in sorted(names):
        if _NAME.match(name) is None:
            continue
        path = parent / name
        fd = _try_lock(path)
        if fd is None:
            continue  # the owner lives, or another sweep is removing it
        try:
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def remove_private_directory(path: pathlib.Path) -> None:
    """Remove *path* and everything in it, if this process created it; never raises."""
    with _lock:
        owner, fd = _live.pop(path, (-1, -1))
    if owner == os.getpid():  # a forked child must not remove its parent's files
        shutil.rmtree(path, ignore_errors=True)  # [4. remove]: still locked meanwhile
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        # The per-user parent goes too once it is empty, so that a directory the user gave
        # is left as it was found; one another process still uses stays (rmdir refuses).
        with contextlib.suppress(OSError):
            os.rmdir(path.parent)


def _try_lock(path: pathlib.Path) -> int | None:
    """A descriptor of the directory *path* holding its exclusive lock; ``None`` if another
    holds it (its owner lives), or it is gone or not a directory. ``-1`` without ``flock``."""
    if os.name != "posix":  # pragma: no cover - no flock: nothing is swept either
        return -1
    import fcntl

    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError:  # removed meanwhile, a symlink, not a directory, not ours to open
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _make_private(path: pathlib.Path, *, exist_ok: bool) -> None:
    try:
        os.mkdir(path, _PRIVATE_MODE)
    except FileExistsError:
        if not exist_ok:
            raise
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise RematError(
            f"remat: expected {path} to be a real directory, found a symbolic link to "
            f"{os.readlink(path)!r}: the disk tier does not follow links inside its directory, "
            f"since whoever made the link chooses where the offloaded tensors go. Remove the "
            f"link (remat makes the directory itself), or pass another place with "
            f"DiskTier(directory=...)."
        )
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
    """Remove the file at *path* if it can be removed; never raises ``OSError``. The tier calls
    it to clean up after a failure (which it reports itself, and which a failing removal, on a
    filesystem remounted read-only, must not hide) and from finalizers (which must not raise):
    a file that stays is removed with the directory, at ``close()`` or exit."""
    with contextlib.suppress(OSError):
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
