"""The disk tier: bytes round trip exactly, files never outlive their tier, errors surface once."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import errno
import gc
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import remat
from remat import RematError
from remat.store import _files
from remat.store.disk import DiskTier, sequential_bandwidth

from helpers import wait_for

CPU = torch.device("cpu")


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _files_in(tier: DiskTier) -> list[str]:
    return sorted(os.listdir(tier.directory))


@pytest.fixture
def tier(tmp_path: pathlib.Path) -> Iterator[DiskTier]:
    with DiskTier(tmp_path) as t:
        yield t


class _Gate:
    """Writes wait at the gate until it opens; ``entered`` counts the writes that reached it."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.open = threading.Event()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> _Gate:
    gate = _Gate()
    write_all = _files.write_all

    def gated(fd: int, view: memoryview) -> None:
        gate.entered.release()
        assert gate.open.wait(5)
        write_all(fd, view)

    monkeypatch.setattr(_files, "write_all", gated)
    return gate


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 1_000_003, 3 * 2**20 + 7])
def test_round_trip_is_bit_equal(tier: DiskTier, nbytes: int) -> None:
    data = _bytes(nbytes)
    ticket = tier.put(data)
    out = tier.get(ticket, CPU)
    assert out.dtype == torch.uint8 and out.shape == (nbytes,)
    assert torch.equal(out, data)
    assert out.data_ptr() != data.data_ptr() or nbytes == 0
    tier.drop(ticket)
    assert _files_in(tier) == []


def test_prefetch_then_get(tier: DiskTier) -> None:
    datas = [_bytes(2**16 + i, seed=i) for i in range(8)]
    tickets = [tier.put(d) for d in datas]
    for t in tickets:
        tier.prefetch(t, CPU)
        tier.prefetch(t, CPU)  # twice is harmless
    for t, d in zip(tickets, datas, strict=True):
        assert torch.equal(tier.get(t, CPU), d)
    assert tier.stats.files_read == 8


def test_get_twice_gives_equal_owned_tensors(tier: DiskTier) -> None:
    data = _bytes(10_000)
    ticket = tier.put(data)
    tier.prefetch(ticket, CPU)
    first = tier.get(ticket, CPU)
    first.zero_()  # the caller owns it: the stored bytes do not change
    tier.prefetch(ticket, CPU)  # a second backward prefetches again
    assert torch.equal(tier.get(ticket, CPU), data)
    assert torch.equal(tier.get(ticket, CPU), data)


def test_put_releases_data_once_written(tier: DiskTier) -> None:
    data = _bytes(2**20)
    ref = weakref.ref(data)
    ticket = tier.put(data)
    del data
    tier.flush()
    assert ref() is None
    assert len(_files_in(tier)) == 1
    tier.drop(ticket)


def test_the_allocator_sees_every_byte_the_tier_holds(tier: DiskTier) -> None:
    """A written tensor is freed, and a read allocated, in the caller's thread, where the
    profiler's allocator events (what the planner measures) see them: a free on a worker, or a
    file mapped for a read, would be missing from the step's memory."""
    from remat.planning.cost import timeline

    n = 3 * 2**20
    box: list[torch.Tensor] = []

    def step(mark: object) -> None:
        data = _bytes(n)
        mark("put")  # type: ignore[operator]
        ticket = tier.put(data)
        del data
        tier.flush()
        mark("written")  # type: ignore[operator]
        tier.prefetch(ticket, CPU)
        mark("prefetched")  # type: ignore[operator]
        box.append(tier.get(ticket, CPU))
        mark("got")  # type: ignore[operator]
        box.clear()
        tier.drop(ticket)
        mark("end")  # type: ignore[operator]

    line = timeline(step, CPU)
    level = line.levels
    assert level["put"] - level["written"] == n  # freed by flush, in this thread
    assert level["prefetched"] - level["written"] == n  # the read's target, allocated here
    assert level["got"] == level["prefetched"]
    assert level["got"] - level["end"] == n


def test_drop_before_or_during_write_leaves_no_file(tmp_path: pathlib.Path, gate: _Gate) -> None:
    with DiskTier(tmp_path, threads=1) as tier:
        writing = tier.put(_bytes(1000))
        assert gate.entered.acquire(timeout=5)  # its file is open, the worker waits
        queued = tier.put(_bytes(2000))
        tier.drop(queued)  # never starts
        tier.drop(writing)  # started: the worker removes its file
        gate.open.set()
        tier.flush()
        assert _files_in(tier) == []
        assert tier.stats.files_written == 1
        assert tier.stats.pending_bytes == 0


def test_a_flush_after_a_drop_waits_for_the_dropped_files_removal(
    tmp_path: pathlib.Path, gate: _Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    unlink = _files.unlink_quietly

    def slow_unlink(path: pathlib.Path) -> None:
        time.sleep(0.2)  # the worker is slow to remove the file of a write dropped midway
        unlink(path)

    monkeypatch.setattr(_files, "unlink_quietly", slow_unlink)
    with DiskTier(tmp_path, threads=1) as tier:
        ticket = tier.put(_bytes(1000))
        assert gate.entered.acquire(timeout=5)  # its file is open, the worker waits
        tier.drop(ticket)
        gate.open.set()
        tier.flush()
        assert _files_in(tier) == []


def test_drop_during_prefetch_leaves_no_file(tier: DiskTier, gate: _Gate) -> None:
    ticket = tier.put(_bytes(5000))
    tier.prefetch(ticket, CPU)  # waits for its write
    assert gate.entered.acquire(timeout=5)
    tier.drop(ticket)
    gate.open.set()
    tier.flush()
    wait_for(lambda: _files_in(tier) == [])
    tier.drop(ticket)  # twice is harmless
    with pytest.raises(RematError, match="not yet dropped"):
        tier.get(ticket, CPU)


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_directory_and_file_modes(tmp_path: pathlib.Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        with DiskTier(tmp_path) as tier:
            tier.put(_bytes(10))
            tier.flush()
            (name,) = _files_in(tier)
            assert stat.S_IMODE(os.stat(tier.directory).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(tier.directory.parent).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(tier.directory / name).st_mode) == 0o600
    finally:
        os.umask(old)


def test_the_per_user_parent_stays_while_another_directory_is_in_it(
    tmp_path: pathlib.Path,
) -> None:
    first, second = DiskTier(tmp_path), DiskTier(tmp_path)
    parent = _files.parent_directory(tmp_path)
    first.close()
    assert parent.is_dir() and second.directory.is_dir()
    second.close()
    assert os.listdir(tmp_path) == []


def test_a_parent_removed_while_a_directory_is_made_is_made_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process closing its last tier removes the per-user parent between this one
    making it and making its own directory in it: the parent is made again."""
    sweep = _files.sweep_stale

    def sweep_then_remove(parent: pathlib.Path) -> list[pathlib.Path]:
        removed = sweep(parent)
        os.rmdir(parent)
        return removed

    monkeypatch.setattr(_files, "sweep_stale", sweep_then_remove)
    path = _files.private_directory(tmp_path)
    try:
        assert path.is_dir() and path.parent == _files.parent_directory(tmp_path)
    finally:
        _files.remove_private_directory(path)
    assert os.listdir(tmp_path) == []


def test_directory_layout(tier: DiskTier, tmp_path: pathlib.Path) -> None:
    assert tier.directory.parent == _files.parent_directory(tmp_path)
    assert tier.directory.name.startswith(f"{os.getpid()}-")


def _held(path: pathlib.Path) -> int:
    """A descriptor holding the exclusive flock of the directory *path*, as an owner does."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


@pytest.mark.skipif(os.name != "posix", reason="liveness by flock")
def test_sweep_removes_the_directories_whose_lock_it_takes_only(tmp_path: pathlib.Path) -> None:
    parent = _files.parent_directory(tmp_path)
    parent.mkdir(mode=0o700)
    stale = parent / f"{os.getpid()}-00aa"  # our own pid: the lock decides, not the pid
    live = parent / "999999999-00bb"  # a pid no process has: the lock decides
    staging = parent / ".999999999-00cc.new"  # an owner killed while creating it
    foreign = parent / "not-ours"
    for path in (stale, live, staging, foreign):
        path.mkdir()
        (path / "00000000.bin").write_bytes(b"x")
    held = _held(live)
    try:
        mine = _files.private_directory(tmp_path)
        assert not stale.exists() and not staging.exists()
        assert live.exists() and foreign.exists() and mine.exists()
        assert _files.sweep_stale(parent) == []  # a second sweep finds nothing
    finally:
        os.close(held)  # the owner of `live` dies
        _files.remove_private_directory(mine)
    assert not mine.exists()
    assert _files.sweep_stale(parent) == [live]
    assert os.listdir(parent) == [foreign.name]


def _dead_pid() -> int:
    """The smallest pid above 2 that no process of this PID namespace has."""
    for pid in range(3, 1 << 22):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid")  # pragma: no cover


_OWNER = (
    "import os, sys, time\n"
    "pid = int(sys.argv[2])\n"
    "{become}"
    "import torch\n"
    "from remat.store.disk import DiskTier\n"
    "tier = DiskTier(sys.argv[1])\n"
    "tier.put(torch.ones(4096, dtype=torch.uint8))\n"
    "tier.flush()\n"
    "print(tier.directory, flush=True)\n"
    "time.sleep(60)\n"
)
# Claims a pid it does not have: the sweep must not go by what the name records.
_CLAIM = "os.getpid = lambda: pid\n"
# Forks inside a fresh PID namespace until a child has the wanted pid there.
_FORK = (
    "while os.getpid() != pid:\n"
    "    child = os.fork()\n"
    "    if child == 0:\n"
    "        if os.getpid() != pid: os._exit(0)\n"
    "    else:\n"
    "        os.waitpid(child, 0)\n"
    "        if child >= pid: sys.exit(f'pid {child} passed {pid}')\n"
)


def _start_owner(prefix: list[str], become: str, root: pathlib.Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(remat.__file__).parents[1]))
    script = _OWNER.format(become=become)
    command = [*prefix, sys.executable, "-c", script, str(root), str(_dead_pid())]
    return subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)


def _live_owner_is_kept_and_swept_once_killed(
    owner: subprocess.Popen[str], root: pathlib.Path
) -> None:
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline().strip()
        assert line, "the owner process failed"
        left = pathlib.Path(line)
        pid = int(left.name.split("-")[0])
        with pytest.raises(ProcessLookupError):  # what its name records looks dead here
            os.kill(pid, 0)
        with DiskTier(root):
            assert left.is_dir() and os.listdir(left) == ["00000000.bin"]
    finally:
        owner.kill()
        owner.communicate()
    with DiskTier(root) as tier:
        assert not left.exists()
        assert os.listdir(tier.directory.parent) == [tier.directory.name]


@pytest.mark.skipif(os.name != "posix", reason="liveness by flock")
def test_a_live_owner_whose_pid_looks_dead_is_not_swept(tmp_path: pathlib.Path) -> None:
    owner = _start_owner([], _CLAIM, tmp_path)
    _live_owner_is_kept_and_swept_once_killed(owner, tmp_path)


def _unshare_pid() -> list[str]:
    command = ["unshare", "--pid", "--fork", "--kill-child"]
    try:
        done = subprocess.run([*command, "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot run unshare to make a PID namespace: {exc}")
    if done.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {done.stderr.strip()}")
    return command


@pytest.mark.skipif(sys.platform != "linux", reason="PID namespaces are Linux's")
def test_an_owner_in_another_pid_namespace_is_not_swept(tmp_path: pathlib.Path) -> None:
    owner = _start_owner(_unshare_pid(), _FORK, tmp_path)
    _live_owner_is_kept_and_swept_once_killed(owner, tmp_path)


_CHILD = (
    "import sys, time, torch\n"
    "from remat.store.disk import DiskTier\n"
    "tier = DiskTier(sys.argv[1])  # never closed\n"
    "tier.put(torch.ones(4096, dtype=torch.uint8))\n"
    "tier.flush()\n"
    "tier.put(torch.ones(2**24, dtype=torch.uint8))  # pending at exit\n"
    "print(tier.directory, flush=True)\n"
    "if sys.argv[2] == 'wait': time.sleep(60)\n"
)


@pytest.fixture(scope="module")
def children(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[subprocess.Popen[str], pathlib.Path]]]:
    """Two processes that leave a tier unclosed, started together to save the test time:
    ``"exit"`` exits normally, ``"wait"`` sleeps until the test kills it."""
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(remat.__file__).parents[1]))
    started = {}
    for how in ("exit", "wait"):
        root = tmp_path_factory.mktemp(how)
        command = [sys.executable, "-c", _CHILD, str(root), how]
        started[how] = (subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True), root)
    yield started
    for child, _ in started.values():
        if child.poll() is None:
            child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_killed_process_leaves_directory_the_next_start_removes(
    children: dict[str, tuple[subprocess.Popen[str], pathlib.Path]],
) -> None:
    child, root = children["wait"]
    try:
        assert child.stdout is not None
        left = pathlib.Path(child.stdout.readline().strip())
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    assert left.is_dir() and len(os.listdir(left)) >= 1
    with DiskTier(root) as tier:
        assert not left.exists()
        assert tier.directory.parent == left.parent


def test_normal_exit_with_a_forgotten_tier_leaves_nothing(
    children: dict[str, tuple[subprocess.Popen[str], pathlib.Path]],
) -> None:
    child, root = children["exit"]
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    assert not pathlib.Path(out.strip()).exists()
    assert os.listdir(root) == []  # the per-user parent went with the last directory in it


def test_close_removes_everything(tmp_path: pathlib.Path) -> None:
    tier = DiskTier(tmp_path)
    tickets = [tier.put(_bytes(2**15, seed=i)) for i in range(5)]
    tier.prefetch(tickets[0], CPU)
    tier.flush()
    directory = tier.directory
    assert len(os.listdir(directory)) == 5
    tier.close()
    tier.close()  # twice is harmless
    assert not directory.exists()
    assert os.listdir(tmp_path) == []  # the directory the user gave is left as it was found
    with pytest.raises(RematError, match="already closed"):
        tier.put(_bytes(1))
    with pytest.raises(RematError, match="already closed"):
        tier.get(tickets[1], CPU)
    tier.drop(tickets[2])
    tier.flush()


def test_exception_in_scope_removes_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError), DiskTier(tmp_path) as tier:
        tier.put(_bytes(100))
        directory = tier.directory
        raise ValueError("step failed")
    assert not directory.exists()


def test_forgotten_tier_is_cleaned_without_gc(tmp_path: pathlib.Path) -> None:
    tier = DiskTier(tmp_path)
    tier.put(_bytes(2**20))  # possibly still being written
    tier.prefetch(tier.put(_bytes(100)), CPU)
    directory, ref = tier.directory, weakref.ref(tier)
    del tier
    assert ref() is None
    wait_for(lambda: not directory.exists(), timeout=10)  # closed on the closer thread


def test_a_collected_tier_is_closed_off_the_collecting_thread(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collector can run inside threading's locked sections (it hung a test run once, in
    Thread.start): joining the workers there deadlocks, so a collected tier's workers are joined
    by the closer thread, never by the thread that collected it (NOTE [ Closed when
    collected ] in disk.py)."""
    joined_on: list[str] = []
    shutdown = concurrent.futures.ThreadPoolExecutor.shutdown
    watched: list[Any] = []  # this test's executors (earlier tests' tiers may be collected too)

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        if any(self is e for e in watched):
            joined_on.append(threading.current_thread().name)
        shutdown(self, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "shutdown", spy)
    tier = DiskTier(tmp_path)
    watched.append(tier._shared.executor)
    tier.put(_bytes(2**20))
    cycle: list[Any] = [tier]
    cycle.append(cycle)  # only the cycle collector frees it
    directory = tier.directory
    del tier, cycle
    gc.collect()
    wait_for(lambda: not directory.exists(), timeout=10)  # closed on the closer thread
    assert joined_on == ["remat-disk-closer"]
    # close() itself still joins on the caller's thread, and only once.
    joined_on.clear()
    tier = DiskTier(tmp_path)
    watched.append(tier._shared.executor)
    tier.close()
    tier.close()
    assert joined_on == [threading.current_thread().name]


def test_pending_bytes_bound(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_all = _files.write_all

    def slow(fd: int, view: memoryview) -> None:
        time.sleep(0.02)  # far slower than a put: the puts fill the bound
        write_all(fd, view)

    monkeypatch.setattr(_files, "write_all", slow)
    bound = 2**20
    with DiskTier(tmp_path, threads=1, max_pending_bytes=bound) as tier:
        for i in range(16):
            tier.put(_bytes(2**18, seed=i))
        stats = tier.stats
        assert bound * 3 // 4 <= stats.peak_pending_bytes <= bound
        assert stats.puts_waited > 0
        big = _bytes(3 * bound)
        ticket = tier.put(big)  # larger than the bound: accepted alone
        assert tier.stats.peak_pending_bytes == 3 * bound
        assert torch.equal(tier.get(ticket, CPU), big)
        tier.flush()
        assert tier.stats.pending_bytes == 0
        assert tier.stats.bytes_written == 16 * 2**18 + 3 * bound


def test_stats_count_bytes_files_and_seconds(tier: DiskTier, gate: _Gate) -> None:
    sizes = [100, 2**16, 2**20]
    tickets = [tier.put(_bytes(n)) for n in sizes]
    assert tier.stats.pending_bytes == sum(sizes)  # held at the gate
    gate.open.set()
    tier.flush()
    tier.prefetch(tickets[2], CPU)
    tier.get(tickets[2], CPU)
    tier.get(tickets[0], CPU)  # read in the caller's thread
    stats = tier.stats
    assert (stats.bytes_written, stats.files_written) == (sum(sizes), 3)
    assert (stats.bytes_read, stats.files_read) == (sizes[0] + sizes[2], 2)
    assert stats.write_seconds > 0 and stats.read_seconds > 0
    assert 0 < stats.write_wall_seconds <= stats.write_seconds + 1e-6
    assert 0 < stats.read_wall_seconds <= stats.read_seconds + 1e-6
    assert (stats.pending_bytes, stats.peak_pending_bytes) == (0, sum(sizes))
    assert (stats.failed_writes, stats.puts_waited) == (0, 0)


def _fail_writes(monkeypatch: pytest.MonkeyPatch, after: threading.Event | None = None) -> None:
    """Writes put half their bytes on disk, then find the disk full (once *after* is set)."""

    def full(fd: int, view: memoryview) -> None:
        assert after is None or after.wait(5)
        os.write(fd, view[: len(view) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "write_all", full)


def test_write_error_is_clear_raised_once_and_cleaned(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_writes(monkeypatch)
    lost = tier.put(_bytes(3 * 2**20))
    with pytest.raises(RematError) as info:
        tier.flush()
    message = str(info.value)
    assert message.startswith("remat: ")
    for part in (
        "ENOSPC",
        str(3 * 2**20),
        str(tier.directory),
        "free there",
        "directory=",
        "min_bytes=",
    ):
        assert part in message
    assert isinstance(info.value.__cause__, OSError)
    assert _files_in(tier) == []  # the half-written file is gone
    tier.flush()  # raised once
    assert tier.stats.failed_writes == 1
    with pytest.raises(RematError, match="write failed earlier"):
        tier.get(lost, CPU)
    tier.drop(lost)

    monkeypatch.undo()  # space again: the tier still works
    data = _bytes(1234)
    assert torch.equal(tier.get(tier.put(data), CPU), data)


def test_write_error_surfaces_from_next_put(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    both_put = threading.Event()
    _fail_writes(monkeypatch, after=both_put)
    with DiskTier(tmp_path, threads=1) as tier:
        tier.put(_bytes(100))
        tier.put(_bytes(200))
        both_put.set()
        wait_for(lambda: tier.stats.failed_writes == 2)
        monkeypatch.undo()
        with pytest.raises(
            RematError, match=r"write 100 bytes.*ENOSPC.*1 more write\(s\), 200 bytes in all"
        ):
            tier.put(_bytes(300))
        ticket = tier.put(_bytes(300))  # reported once: this one is accepted
        tier.flush()
        assert len(_files_in(tier)) == 1
        tier.drop(ticket)


def test_a_reported_write_error_waits_for_the_writes_still_running(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The 100-byte write fails once the 200-byte one is queued (before, the second put would
    # report it); the 200-byte one is still running when the next put reports the first
    # failure. The report waits for it and covers both, so the retry that follows (disk space
    # back) meets no failure left over from the attempt that failed.
    queued = threading.Event()
    release = threading.Event()

    def full(fd: int, view: memoryview) -> None:
        assert (release if len(view) == 200 else queued).wait(5)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "write_all", full)
    with DiskTier(tmp_path, threads=2) as tier:
        tier.put(_bytes(100))
        tier.put(_bytes(200))
        queued.set()
        wait_for(lambda: tier.stats.failed_writes == 1)
        timer = threading.Timer(0.2, release.set)
        timer.start()
        with pytest.raises(
            RematError, match=r"write 100 bytes.*ENOSPC.*1 more write\(s\), 200 bytes in all"
        ):
            tier.put(_bytes(300))
        timer.join()
        monkeypatch.undo()
        data = _bytes(400)
        assert torch.equal(tier.get(tier.put(data), CPU), data)
        tier.flush()
        assert tier.stats.failed_writes == 2  # the put that raised queued nothing


def test_write_error_surfaces_from_get_of_the_failed_ticket(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_writes(monkeypatch)
    ticket = tier.put(_bytes(100))
    tier.prefetch(ticket, CPU)
    with pytest.raises(RematError, match="ENOSPC"):
        tier.get(ticket, CPU)
    tier.flush()  # already reported by get


def _refuse_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Every write fails with ``code`` before a byte is written, as ``open`` fails on a
    read-only filesystem (``EROFS``) or in a directory that was removed (``ENOENT``)."""

    def refused(path: pathlib.Path, data: torch.Tensor) -> None:
        raise OSError(code, os.strerror(code), os.fspath(path))

    monkeypatch.setattr(_files, "write_file", refused)


@pytest.mark.parametrize("cleanup", ["EROFS", "EACCES", "EIO", "not an OSError"])
def test_a_failed_write_whose_cleanup_fails_too_is_still_a_failure(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch, cleanup: str
) -> None:
    """On a filesystem remounted read-only, removing the failed write's partial file fails as
    well. The failure to report is the write's: the removal's error once escaped the worker
    instead, the write was counted as done, and the step failed only in backward, after
    writing some gradients, blaming something that removed the tier's files."""
    _refuse_writes(monkeypatch, errno.EROFS)
    unlink = os.unlink
    broken = [cleanup == "not an OSError"]  # a bug in the worker's cleanup, once

    def refused_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).startswith(str(tier.directory)):
            if broken.pop() if broken else False:
                raise RuntimeError("the cleanup itself is broken")
            code = getattr(errno, "EROFS" if cleanup == "not an OSError" else cleanup)
            raise OSError(code, os.strerror(code), str(path))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refused_unlink)
    lost = tier.put(_bytes(100))
    with pytest.raises(RematError, match="write failed") as info:
        tier.flush()
    message = str(info.value)
    assert "EROFS" in message and "writable" in message and "larger disk" not in message
    assert (tier.stats.failed_writes, tier.stats.files_written) == (1, 0)
    with pytest.raises(RematError, match="write failed earlier"):
        tier.get(lost, CPU)
    tier.drop(lost)
    monkeypatch.undo()  # writable again: the tier works
    data = _bytes(1234)
    assert torch.equal(tier.get(tier.put(data), CPU), data)


def test_a_read_only_filesystem_fails_the_step_at_the_end_of_its_block(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole step: creating and removing files both fail with ``EROFS`` (a filesystem
    remounted read-only). The block raises, before backward has written any gradient; once
    the filesystem is writable again, the same step gives the plain step's gradients."""
    model, plain = _deep_mlp(), _deep_mlp()
    x = torch.randn(8, 256)
    unlink = os.unlink
    with DiskTier(tmp_path) as tier, remat.store.tiers(disk=tier):
        directory = str(tier.directory)

        def refused_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if str(path).startswith(directory):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            unlink(path, *args, **kwargs)

        with monkeypatch.context() as patch:
            _refuse_writes(patch, errno.EROFS)
            patch.setattr(os, "unlink", refused_unlink)
            with pytest.raises(RematError, match=r"EROFS.*takes no writes"):
                with remat.offload("disk", min_bytes=0):
                    loss = model(x).square().sum()
                loss.backward()
            assert all(p.grad is None for p in model.parameters())
        _offloaded_step(model, x)
        assert _files_in(tier) == []
    plain(x).square().sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize(
    ("code", "says", "never"),
    [
        ("ENOSPC", ["bytes are free there", "larger disk", "min_bytes="], []),
        ("EDQUOT", ["quota", "larger disk"], []),
        ("EROFS", ["read-only", "writable"], ["larger disk", "free there"]),
        ("EACCES", ["permissions", "writable"], ["larger disk", "free there"]),
        ("ENOENT", ["removed", "run the step again"], ["larger disk", "free there"]),
        ("EIO", ["system log", "another directory"], ["larger disk", "free there"]),
    ],
)
def test_a_write_error_says_what_it_means(
    tier: DiskTier,
    monkeypatch: pytest.MonkeyPatch,
    code: str,
    says: list[str],
    never: list[str],
) -> None:
    """Only a full disk (or quota) is fixed by a larger disk: a read-only or removed directory
    once got that advice too."""
    _refuse_writes(monkeypatch, getattr(errno, code))
    ticket = tier.put(_bytes(100))
    with pytest.raises(RematError) as info:
        tier.flush()
    tier.drop(ticket)
    message = str(info.value)
    assert message.startswith("remat: the disk tier expected to write 100 bytes")
    assert code in message and str(tier.directory) in message
    for part in says:
        assert part in message
    for part in never:
        assert part not in message


def test_a_removed_directory_is_reported_as_removed_and_made_again(
    tmp_path: pathlib.Path,
) -> None:
    """A temporary-file cleaner removes the tier's directory in the middle of a step: the
    write that finds it gone says so (not that the disk is full), the directory comes back,
    private and locked against other processes' sweeps, and the tier works again; the file
    written before is gone, and reading it says so."""
    with DiskTier(tmp_path) as tier:
        before = tier.put(_bytes(100))
        tier.flush()
        shutil.rmtree(tier.directory)
        tier.put(_bytes(200))
        with pytest.raises(RematError, match=r"ENOENT.*directory was gone") as info:
            tier.flush()
        assert "larger disk" not in str(info.value)
        assert tier.directory.is_dir()
        assert stat.S_IMODE(os.stat(tier.directory).st_mode) == 0o700
        assert _files.sweep_stale(tier.directory.parent) == []  # it holds the lock again
        assert tier.directory.is_dir()
        data = _bytes(300)
        assert torch.equal(tier.get(tier.put(data), CPU), data)
        with pytest.raises(RematError, match=r"read failed.*directory was gone|removed"):
            tier.get(before, CPU)
    assert not os.path.exists(tier.directory)  # close removes the directory made again


def test_a_read_that_finds_the_directory_gone_makes_it_again(tmp_path: pathlib.Path) -> None:
    with DiskTier(tmp_path) as tier:
        ticket = tier.put(_bytes(100))
        tier.flush()
        shutil.rmtree(tier.directory)
        with pytest.raises(RematError, match=r"the tier's directory was gone.*run the step again"):
            tier.get(ticket, CPU)
        assert tier.directory.is_dir()
        data = _bytes(300)
        assert torch.equal(tier.get(tier.put(data), CPU), data)


def test_steps_after_the_directory_was_removed_between_steps_run_as_plain(
    tmp_path: pathlib.Path,
) -> None:
    """Removed between two steps (the tier holds no file then), the directory is made again
    by the next step's first write: that step and the ones after it give the plain gradients;
    once, every later step failed with a message that said the disk was full."""
    model, plain = _deep_mlp(), _deep_mlp()
    x = torch.randn(8, 256)
    with DiskTier(tmp_path) as tier, remat.store.tiers(disk=tier):
        _offloaded_step(model, x)
        plain(x).square().sum().backward()
        for _ in range(2):
            shutil.rmtree(tier.directory)
            _offloaded_step(model, x)
            plain(x).square().sum().backward()
            for a, b in zip(model.parameters(), plain.parameters(), strict=True):
                assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
        assert tier.stats.failed_writes == 0
        assert _files_in(tier) == []
    assert not os.path.exists(tier.directory)


def test_settle_waits_for_its_own_write_and_raises_no_failure(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``settle`` (the graph engine, before it writes in place to a value it offloaded) waits
    for that value's write only and leaves every failure, of any thread, to the ``flush`` of
    the block that made it: once the disk tier had no ``settle``, the store flushed the whole
    tier instead, raising (and so taking away) other threads' failures."""
    write_file = _files.write_file

    def full_for_100(path: pathlib.Path, data: torch.Tensor) -> None:
        if data.numel() == 100:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_file(path, data)

    monkeypatch.setattr(_files, "write_file", full_for_100)
    failed: list[object] = []
    other_put = threading.Event()
    settled = threading.Event()

    def other_thread() -> None:  # puts a write that fails, reports it after the settle
        failed.append(tier.put(_bytes(100)))
        other_put.set()
        assert settled.wait(5)
        try:
            tier.flush_thread()
        except RematError as error:
            failed.append(error)

    worker = threading.Thread(target=other_thread)
    worker.start()
    assert other_put.wait(5)
    mine = tier.put(_bytes(200))
    lost = tier.put(_bytes(100))  # this thread's own failure: also not raised by settle
    wait_for(lambda: tier.stats.failed_writes == 2)
    tier.settle(mine)
    assert (tier.directory / "00000001.bin").stat().st_size == 200  # written: settled
    settled.set()
    worker.join()
    assert len(failed) == 2 and isinstance(failed[1], RematError)
    assert "ENOSPC" in str(failed[1]) and "1 more write" not in str(failed[1])
    with pytest.raises(RematError, match=r"write 100 bytes.*ENOSPC"):
        tier.flush_thread()
    tier.flush()  # each failure was reported once, to its own thread
    assert torch.equal(tier.get(mine, CPU), _bytes(200))
    for ticket in (mine, lost, failed[0]):
        tier.drop(ticket)  # type: ignore[arg-type]


def _mount_tiny_tmpfs(path: pathlib.Path) -> bool:
    if sys.platform != "linux":
        return False
    path.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def test_real_full_disk_on_a_tiny_tmpfs(tmp_path: pathlib.Path) -> None:
    mount = tmp_path / "tiny"
    if not _mount_tiny_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    try:
        with DiskTier(mount) as tier:
            small = tier.put(_bytes(100_000))
            tier.put(_bytes(2 * 2**20))
            with pytest.raises(RematError, match="ENOSPC") as info:
                tier.flush()
            assert str(2 * 2**20) in str(info.value)
            assert _files_in(tier) == ["00000000.bin"]
            assert torch.equal(tier.get(small, CPU), _bytes(100_000))
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=10)


def _deep_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(12):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _offloaded_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    with remat.offload("disk", min_bytes=0):
        loss = model(x).square().sum()
    loss.backward()


def test_a_step_too_large_for_the_disk_fails_and_a_smaller_one_then_fits(
    tmp_path: pathlib.Path,
) -> None:
    # A 1 MiB disk: a step that saves 13 activations of 128 KiB (the input and 12 tanh
    # outputs) fails; its files must be gone once the error is raised (by reference counting
    # alone), so that a step with half the batch (13 x 64 KiB) finds the room it needs.
    mount = tmp_path / "tiny"
    if not _mount_tiny_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    model = _deep_mlp()
    plain = _deep_mlp()
    x, small = torch.randn(128, 256), torch.randn(64, 256)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with DiskTier(mount) as tier, remat.store.tiers(disk=tier):
            with pytest.raises(RematError, match="ENOSPC"):
                _offloaded_step(model, x)
            assert _files_in(tier) == []
            model.zero_grad(set_to_none=True)
            before = tier.stats.bytes_written
            _offloaded_step(model, small)
            assert tier.stats.bytes_written - before == 13 * 64 * 256 * 4
            assert _files_in(tier) == []
    finally:
        if enabled:
            gc.enable()
        subprocess.run(["umount", str(mount)], check=True, timeout=10)
    plain(small).square().sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_a_filesystem_remounted_read_only_fails_the_step_in_forward(
    tmp_path: pathlib.Path,
) -> None:
    """A real read-only filesystem (Linux remounts one so after a disk error): creating the
    file fails, and so does removing it. The step raises at the end of its block, before any
    gradient is written; once the filesystem is writable again the next step is the plain one."""
    mount = tmp_path / "tiny"
    if not _mount_tiny_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    model, plain = _deep_mlp(), _deep_mlp()
    x = torch.randn(8, 256)
    try:
        with DiskTier(mount) as tier, remat.store.tiers(disk=tier):
            remount = ["mount", "-o", "remount,ro", str(mount)]
            subprocess.run(remount, check=True, timeout=10)
            try:
                with pytest.raises(RematError, match=r"EROFS.*read-only"):
                    _offloaded_step(model, x)
            finally:
                remount[2] = "remount,rw"
                subprocess.run(remount, check=True, timeout=10)
            assert all(p.grad is None for p in model.parameters())
            _offloaded_step(model, x)
            assert _files_in(tier) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True, timeout=10)
    plain(x).square().sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_bad_arguments_are_clear_errors(tier: DiskTier, tmp_path: pathlib.Path) -> None:
    for bad in (
        torch.zeros(4, dtype=torch.float32),
        torch.zeros(2, 2, dtype=torch.uint8),
        torch.zeros(8, dtype=torch.uint8)[::2],
        b"bytes",
    ):
        with pytest.raises(RematError, match="flat contiguous uint8 CPU tensor"):
            tier.put(bad)  # type: ignore[arg-type]
    with pytest.raises(RematError, match="threads to be an int >= 1"):
        DiskTier(tmp_path, threads=0)
    with pytest.raises(RematError, match=r"threads to be an int >= 1, found True"):
        DiskTier(tmp_path, threads=True)
    with pytest.raises(RematError, match="max_pending_bytes"):
        DiskTier(tmp_path, max_pending_bytes=0)
    with DiskTier(tmp_path) as other:
        foreign = other.put(_bytes(1))
        with pytest.raises(RematError, match="ticket this disk tier returned"):
            tier.get(foreign, CPU)
        with pytest.raises(RematError, match="ticket this disk tier returned"):
            tier.prefetch(foreign, CPU)
        tier.drop(foreign)  # not ours: ignored
        assert torch.equal(other.get(foreign, CPU), _bytes(1))


@pytest.mark.parametrize(
    ("directory", "message"),
    [
        (123, r"expected directory to be a path \(str or os.PathLike\) or None, found int 123"),
        (b"/tmp", r"expected directory to be a path .* found bytes b'/tmp'"),
        ("", r"expected directory to be a non-empty path .* found ''"),
        (
            "/tmp/\0x",
            r"expected directory to be a non-empty path without NUL bytes, found '/tmp/\\x00x'",
        ),
    ],
)
def test_a_directory_that_is_no_path_is_a_clear_error(directory: object, message: str) -> None:
    with pytest.raises(RematError, match=f"^remat: DiskTier {message}.*DiskTier\\(directory="):
        DiskTier(directory)  # type: ignore[arg-type]


def test_a_directory_that_is_a_file_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(RematError, match=r"^remat: DiskTier expected directory=.*file' to be a "):
        DiskTier(tmp_path / "file")
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    with pytest.raises(RematError, match=r"found a broken symbolic link"):
        DiskTier(tmp_path / "broken")


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_a_symlinked_tier_directory_is_refused_with_its_target(tmp_path: pathlib.Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    _files.parent_directory(root).symlink_to(elsewhere)
    with pytest.raises(
        RematError,
        match=rf"^remat: expected .*remat-offload-\d+ to be a real directory, found a symbolic "
        rf"link to '{elsewhere}'.*Remove the link.*DiskTier\(directory=",
    ):
        DiskTier(root)
    assert os.listdir(elsewhere) == []
    # A symbolic link the user passes as the directory itself is the user's choice: followed.
    (tmp_path / "link").symlink_to(root / "real", target_is_directory=True)
    (root / "real").mkdir()
    with DiskTier(tmp_path / "link") as tier:
        assert tier.directory.resolve().parent.parent == root / "real"


def test_concurrent_callers(tier: DiskTier) -> None:
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(20):
                data = _bytes(1000 + i, seed=seed * 100 + i)
                ticket = tier.put(data)
                if i % 2:
                    tier.prefetch(ticket, CPU)
                assert torch.equal(tier.get(ticket, CPU), data)
                tier.drop(ticket)
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    tier.flush()
    assert _files_in(tier) == []
    assert tier.stats.files_written == 80


def test_without_numpy_the_bytes_still_round_trip(
    tier: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_numpy(self: torch.Tensor, *, force: bool = False) -> None:
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    for n in (0, 7, 2**20):
        data = _bytes(n)
        assert torch.equal(tier.get(tier.put(data), CPU), data)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_to_cuda(tier: DiskTier) -> None:
    data = _bytes(2**20)
    ticket = tier.put(data)
    cuda = torch.device("cuda")
    tier.prefetch(ticket, cuda)
    out = tier.get(ticket, cuda)
    assert out.device.type == "cuda"
    assert torch.equal(out.cpu(), data)
    assert torch.equal(tier.get(ticket, cuda).cpu(), data)


def test_sequential_bandwidth(tmp_path: pathlib.Path) -> None:
    write, read = sequential_bandwidth(tmp_path, 3 * 2**20 + 5)
    assert write > 0 and read > 0
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# A drop from a finalizer, inside the tier's own locked section
# ---------------------------------------------------------------------------------------------


def _finishes(call: Any, shared: Any, timeout: float = 10.0) -> bool:
    """Run ``call`` on a daemon thread; whether it finished in time. On a hang (the drop
    waiting for the lock its own thread holds) the lock is let go of by force, so that the
    stuck threads end and the test fails instead of the run hanging."""
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    if done.wait(timeout):
        return True
    with contextlib.suppress(RuntimeError):
        shared.cond.release()
    return False


@pytest.mark.parametrize("where", ["put", "write", "get"])
def test_a_drop_from_a_finalizer_inside_the_tiers_lock_does_not_hang(
    tmp_path: pathlib.Path, where: str
) -> None:
    # The garbage collector runs on any allocation, also one the tier makes with its lock held
    # (put submitting a write, a worker finishing one, get checking its ticket); freeing an
    # offloaded graph there drops a ticket (Saved.__del__ -> Store.release -> DiskTier.drop).
    # That drop waited for the lock its own thread held: a hang, for good.
    tier = DiskTier(tmp_path)
    shared = tier._shared
    store = remat.store.Store(tier)
    garbage: list[Any] = [store.pack(torch.randn(64))]
    kept = tier.put(_bytes(32))
    tier.flush()
    assert len(_files_in(tier)) == 2

    def collect(method: Any) -> Any:
        def collecting(*args: Any, **kwargs: Any) -> Any:
            garbage.clear()  # as the collector would: the last reference to the Saved
            return method(*args, **kwargs)

        return collecting

    def put_and_drop() -> None:
        ticket = tier.put(_bytes(16))
        tier.flush()
        tier.drop(ticket)

    if where == "put":
        shared.executor.submit = collect(shared.executor.submit)
    elif where == "write":  # on the worker thread
        shared.end_locked = collect(shared.end_locked)
    else:
        shared.check_ticket_locked = collect(shared.check_ticket_locked)
    call = (lambda: tier.get(kept, CPU)) if where == "get" else put_and_drop
    assert _finishes(call, shared), f"the drop inside {where} hangs"
    assert not garbage and store.stored_bytes == 0
    tier.flush()
    assert _files_in(tier) == [kept.path.name]  # the dropped file went, without gc.collect()
    tier.close()


# ---------------------------------------------------------------------------------------------
# A forked child
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_that_lets_go_of_a_graph_leaves_the_parents_files(
    tmp_path: pathlib.Path,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16)
    with DiskTier(tmp_path) as tier:
        with remat.offload(tier, min_bytes=0):
            out = model(x)
        tier.flush()
        files = _files_in(tier)
        assert len(files) == 2
        pid = os.fork()
        if pid == 0:  # the child lets go of its copy of the graph, and of the tier
            try:
                del out
                gc.collect()
                tier.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0
        assert _files_in(tier) == files  # the parent's step still has its files
        out.sum().backward()
        plain(x).sum().backward()
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            assert a.grad is not None and torch.equal(a.grad, b.grad)
        assert _files_in(tier) == []
