"""Constructor arguments of the tiers and of ``remat.offload``, checked when they are given.

A wrong value found at first use surfaces far from where it was written (a worker thread, the
middle of backward) or as a raw ``TypeError`` from deep inside ``os``; every check here raises a
one-line :class:`~remat.RematError` naming the argument, what was expected, what was found and
a value that works.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from ..errors import RematError

__all__: list[str] = []


TIER_METHODS = ("put", "prefetch", "get", "drop", "flush")


def is_tier(obj: object) -> bool:
    """Whether *obj* has the methods the store calls on a tier (``_tier.Tier``): an instance,
    not the class (``DiskTier`` rather than ``DiskTier()`` has them all, unbound)."""
    return not isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in TIER_METHODS)


def check_tier(owner: str, name: str, value: Any, example: str) -> None:
    if not is_tier(value):
        if isinstance(value, type):
            raise RematError(
                f"remat: {owner} expected {name} to be a tier object, found the class "
                f"{value.__name__}; make one: {value.__name__}()."
            )
        missing = [m for m in TIER_METHODS if not callable(getattr(value, m, None))]
        raise RematError(
            f"remat: {owner} expected {name} to be a tier (HostTier, DiskTier or an object with "
            f"{'/'.join(TIER_METHODS)}), found {type(value).__name__} {value!r}, which lacks "
            f"{', '.join(missing)}. Pass e.g. {example}."
        )


def check_int(owner: str, name: str, value: Any, minimum: int, example: str) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RematError(
            f"remat: {owner} expected {name} to be an int >= {minimum}, found {value!r}. "
            f"Pass e.g. {example}."
        )
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RematError(
            f"remat: {owner} expected {name} to be True or False, found {value!r}. "
            f"Pass {name}=True or {name}=False."
        )
    return value


def check_directory(owner: str, value: Any) -> pathlib.Path | None:
    """``value`` as a path, if it names a place where a directory can be (or is); ``None``
    stays ``None`` (the system's temporary directory)."""
    fix = f"Pass a directory path as a str or pathlib.Path, e.g. {owner}(directory='/scratch')."
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, (str, os.PathLike)):
        raise RematError(
            f"remat: {owner} expected directory to be a path (str or os.PathLike) or None, "
            f"found {type(value).__name__} {value!r}. {fix}"
        )
    try:
        text = os.fspath(value)
    except TypeError as exc:
        raise RematError(
            f"remat: {owner} expected directory to be a path, found {exc}. {fix}"
        ) from exc
    if not isinstance(text, str) or not text or "\0" in text:
        raise RematError(
            f"remat: {owner} expected directory to be a non-empty path without NUL bytes, "
            f"found {text!r}. {fix}"
        )
    path = pathlib.Path(text)
    if os.path.lexists(path) and not path.is_dir():
        what = "a broken symbolic link" if not path.exists() else "a file, not a directory"
        raise RematError(
            f"remat: {owner} expected directory={text!r} to be a directory (or not to exist "
            f"yet), found {what}. {fix}"
        )
    return path
