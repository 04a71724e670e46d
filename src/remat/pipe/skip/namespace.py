"""Namespaces for skip names, so that repeated blocks can reuse one name.

A U-Net's levels are one class instantiated several times; each stashes ``"skip"`` and a
later level pops ``"skip"``. Isolating each pair in its own :class:`Namespace` keeps the
levels apart: the tracker keys every skip tensor on ``(namespace, name)``.
"""

from __future__ import annotations

import itertools

__all__ = ["Namespace"]

_counter = itertools.count()


class Namespace:
    """A fresh namespace for skip names; compare by identity, order by creation.

    ::

        ns = Namespace()
        model = nn.Sequential(Down().isolate(ns), ..., Up().isolate(ns))
    """

    __slots__ = ("_id",)

    def __init__(self) -> None:
        self._id = next(_counter)

    def __repr__(self) -> str:
        return f"<Namespace {self._id}>"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Namespace):
            return NotImplemented
        return self._id < other._id


DEFAULT = Namespace()
"""The namespace of every skip name not isolated otherwise."""
