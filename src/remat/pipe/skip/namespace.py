"""Namespaces for skip names, so that repeated blocks can reuse one name.

A U-Net's levels are one class instantiated several times; each stashes ``"skip"`` and a
later level pops ``"skip"``. Isolating each pair in its own :class:`Namespace` keeps the
levels apart: the tracker keys every skip tensor on ``(namespace, name)``.

Namespaces compare by identity, so ``copy.deepcopy`` of an isolated block gives a block in a
namespace of its own. The default namespace is the one exception: it is a singleton that
copying and pickling keep, since a model's skippable layers refer to it implicitly (an
unisolated name) while the keys of a skip layout refer to it explicitly, and a copied key
must still find the layer's tensor.
"""

from __future__ import annotations

import itertools
from typing import Any

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

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self is DEFAULT:
            # A global name: pickle and copy return the DEFAULT of the loading process.
            return "DEFAULT"
        return super().__reduce_ex__(protocol)


DEFAULT = Namespace()
"""The namespace of every skip name not isolated otherwise."""
