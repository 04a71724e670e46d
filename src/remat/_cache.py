"""Key/value caches given to a layer that is recomputed.

A Hugging Face layer given a key/value cache appends its keys and values to that Python object
in forward (NOTE [ Key/value caches in training ] in ``hf.py``). A region of the region engine
re-runs the layer's Python in backward, which appends them again: the caller's cache ends with
every key twice, and the recompute attends over them (with SDPA and no mask transformers cuts
them back to the query's length, so the gradients come out right and the doubled cache goes
unnoticed). Nothing about a tensor changes, so remat's write guard cannot see it; a region
therefore refuses such a call in forward (:func:`refuse_in_region`), as the planner refuses a
block that runs with one. ``remat.hf.enable`` drops the cache first, in a forward pre-hook.
The graph engine replays ATen ops, never the layer's Python, and is not affected.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from torch import nn

from .errors import RematError

CACHE_ARGUMENTS = ("past_key_values", "layer_past", "cache")

_UNREAD = inspect.Signature()  # a class whose signature was not read yet (compared by identity)
_signatures: weakref.WeakKeyDictionary[type[nn.Module], inspect.Signature | None] = (
    weakref.WeakKeyDictionary()
)


def signature(cls: type[nn.Module]) -> inspect.Signature | None:
    """``cls.forward``'s signature where it takes a cache argument (or ``use_cache``), else
    ``None``; read once per class."""
    found = _signatures.get(cls, _UNREAD)
    if found is _UNREAD:
        read = inspect.signature(cls.forward)
        takes = any(name in read.parameters for name in ("use_cache", *CACHE_ARGUMENTS))
        found = _signatures[cls] = read if takes else None
    return found


def cache_arguments(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[inspect.BoundArguments, list[str]] | None:
    """The key/value cache arguments of a call of ``module`` that are on (``use_cache`` true,
    ``cache``, ``past_key_values`` or ``layer_past`` given), with the call's bound arguments;
    ``None`` when there are none, or when the call does not bind to ``forward``'s signature."""
    found = signature(type(module))
    if found is None:
        return None
    try:
        bound = found.bind_partial(module, *args, **kwargs)
    except TypeError:
        return None  # the layer's own call raises the clearer error
    on = [
        name
        for name in ("use_cache", *CACHE_ARGUMENTS)
        if bound.arguments.get(name) not in (None, False)
    ]
    return (bound, on) if on else None


def describe(bound: inspect.BoundArguments, on: list[str]) -> str:
    """The cache arguments ``on`` of a call, as ``use_cache=True, past_key_values=DynamicCache``."""
    return ", ".join(
        "use_cache=True"
        if name == "use_cache"
        else f"{name}={type(bound.arguments[name]).__name__}"
        for name in on
    )


def refuse_in_region(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise where ``function`` (a module, or a module's bound ``forward``) runs with a key/value
    cache as a region of the region engine, which would re-run it in backward."""
    module = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    if not isinstance(module, nn.Module):
        return
    found = cache_arguments(module, args, kwargs)
    if found is None:
        return
    raise RematError(
        f"remat: {type(module).__name__} runs in a checkpointed region with a key/value cache "
        f"({describe(*found)}) while gradients are enabled. The layer appends its keys and "
        "values to the cache, and the region's recompute in backward would append them again. "
        "Pass use_cache=False to the model in training, or set the model up with "
        "remat.hf.enable(model) (policy= and budget= as you need), which drops the cache "
        "wherever gradients are on, as Hugging Face's gradient checkpointing does."
    )
