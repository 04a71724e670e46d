"""Run one measurement in a fresh Python process and read back its result as JSON: a new
interpreter per measurement (:func:`run_child`), or a child forked from a server that has
imported torch once (:class:`ForkServer`)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import RematError

__all__: list[str] = []


def run_child(
    module: str,
    request: Mapping[str, Any],
    what: str,
    env: Mapping[str, str] | None = None,
    flags: Sequence[str] = (),
) -> dict[str, Any]:
    """``python -m module *flags '<request as JSON>'`` with ``env`` added to this process's
    environment; the last line of its output that starts with ``{``, parsed. A failure raises
    :class:`~remat.RematError` naming ``what`` was measured, with the end of the child's
    stderr."""
    done = subprocess.run(
        [sys.executable, "-m", module, *flags, json.dumps(request)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        check=False,
    )
    tail = _tail(done.stderr)
    if done.returncode != 0:
        raise RematError(f"remat bench: {what} failed (exit {done.returncode}):\n{tail}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RematError(f"remat bench: {what} printed no result:\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _tail(output: str) -> str:
    """The last lines of a child's output, for an error that says why it failed."""
    return "\n".join(output.strip().splitlines()[-15:])


class ForkServer:
    """Fresh processes for many measurements of one kind, without importing torch for each:
    a server process imports ``module`` once and forks a child per :meth:`run`, which calls
    ``module.handle(request)`` and exits. A child starts from the server's state, in which no
    tensor was ever made and CUDA never initialized: as fresh as a new interpreter for what is
    measured in it (the allocator, random generators, CUDA, the modules' globals), two seconds
    sooner.

    ``env`` is added to the server's environment, and so to every child's; settings read as
    a process starts (glibc's ``MALLOC_*``) take effect as in :func:`run_child`. ``preload``
    names more modules the server imports, ones each child would otherwise import on its own.
    Use it as a context manager: the server exits at the end of the ``with`` block.
    """

    def __init__(
        self, module: str, env: Mapping[str, str] | None = None, preload: Sequence[str] = ()
    ) -> None:
        self.module = module
        self.preload = list(preload)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.server: subprocess.Popen[str] | None = None
        self.directory: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> ForkServer:
        self.directory = tempfile.TemporaryDirectory(prefix="remat-forks-")
        with open(os.path.join(self.directory.name, "server.txt"), "w") as errors:
            self.server = subprocess.Popen(
                [sys.executable, "-m", "remat.bench._child", self.module, *self.preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                env=self.env,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            assert self.server.stdin is not None and self.server.stdout is not None
            if exc[0] is not None:
                # Stopped (SIGTERM, an error): the measurement under way is not waited for.
                self.server.terminate()
            self.server.stdin.close()
            self.server.wait()
            self.server.stdout.close()
            self.server = None
        if self.directory is not None:
            self.directory.cleanup()
            self.directory = None

    def run(self, request: Mapping[str, Any], what: str) -> dict[str, Any]:
        """``module.handle(request)`` in a forked child; its result. A failure raises
        :class:`~remat.RematError` naming ``what`` was measured, with the end of the child's
        output."""
        if self.server is None or self.directory is None:
            raise RematError("remat bench: a ForkServer runs requests inside its with block.")
        assert self.server.stdin is not None and self.server.stdout is not None
        result = os.path.join(self.directory.name, "result.json")
        output = os.path.join(self.directory.name, "output.txt")
        for path in (result, output):
            if os.path.exists(path):
                os.remove(path)
        order = {"request": request, "result": result, "output": output}
        self.server.stdin.write(json.dumps(order) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        if not line:
            with open(os.path.join(self.directory.name, "server.txt")) as f:
                tail = _tail(f.read())
            raise RematError(f"remat bench: {what} failed: its server process exited:\n{tail}")
        code = int(line)
        tail = ""
        if os.path.exists(output):
            with open(output) as f:
                tail = _tail(f.read())
        if code != 0:
            raise RematError(f"remat bench: {what} failed (exit {code}):\n{tail}")
        if not os.path.exists(result):
            raise RematError(f"remat bench: {what} printed no result:\n{tail}")
        with open(result) as f:
            answer: dict[str, Any] = json.load(f)
        return answer


def _serve(module_name: str, preload: Sequence[str]) -> None:
    """The server of :class:`ForkServer`: one order per line on stdin, each run in a forked
    child, its exit status written back as a line."""
    module = importlib.import_module(module_name)
    for name in preload:
        importlib.import_module(name)
    import torch

    # A child forked after CUDA was initialized cannot use CUDA: the server never touches it.
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise SystemExit(f"remat bench: importing {[module_name, *preload]} initialized CUDA.")
    running = 0  # the child measuring now, stopped with the server on SIGTERM

    def stop(signum: int, frame: object) -> None:
        if running:
            os.kill(running, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    for line in sys.stdin:
        order = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = 1
            try:
                # The child's output goes to a file: the server's stdout carries the replies.
                fd = os.open(order["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                answer = module.handle(order["request"])
                with open(order["result"], "w") as f:
                    json.dump(answer, f)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        running = pid
        _, status = os.waitpid(pid, 0)
        running = 0
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
