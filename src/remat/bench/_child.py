"""Run one measurement in a fresh Python process and read back the JSON object it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    tail = "\n".join(done.stderr.strip().splitlines()[-15:])
    if done.returncode != 0:
        raise RematError(f"remat bench: {what} failed (exit {done.returncode}):\n{tail}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RematError(f"remat bench: {what} printed no result:\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result
