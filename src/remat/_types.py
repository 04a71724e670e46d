"""Type aliases shared across the package."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeAlias

__all__: list[str] = []

ContextFn: TypeAlias = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]
"""Returns the context managers that the forward pass and the recompute run under."""
