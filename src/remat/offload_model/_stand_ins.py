"""What a disk :class:`~remat.OffloadModel` leaves in the user's hands: handles that raise.

NOTE [ Stand-ins that raise ]

With ``offload_device="disk"`` the parameters, gradients and optimizer state of a slice live in
files; the ``nn.Parameter`` objects (which ``model.parameters()``, ``named_parameters()``,
``model.module.state_dict()`` and a parent module reach) and the per-slice optimizers' state
hold stand-ins without memory (a parameter's: one element expanded to its shape, see
``_DiskStored.resident``; a state tensor's: empty). A stand-in that *reads* as a tensor makes
every user path silently do nothing or worse: an optimizer over ``model.parameters()`` finds no
gradient and skips, a checkpoint of ``model.module.state_dict()`` saves placeholder values,
``clip_grad_norm_`` reads 0.

So a stand-in raises on use. While its slice is offloaded, a parameter's class is swapped for
a subclass (:func:`park`) whose ``__torch_function__`` raises :data:`MESSAGE`, and an optimizer
state tensor is a :class:`OnDisk` tensor that does the same. Every torch operation, method and
attribute read on them goes through ``__torch_function__`` (``p.grad``, ``p.shape``,
``p.detach()`` in ``state_dict``, ``p.is_leaf`` in an optimizer's constructor, ``torch.save``'s
``__reduce_ex__``), so each of those paths raises at its first touch, with what to use instead.
Only ``hash`` is let through, so that optimizers can key their state on parameters.

A parameter is *unparked* (its class restored) before its slice is loaded and parked again
after; remat's own code that touches parked parameters runs under :func:`internal`. With
``offload_device="cpu"`` parameters are real host tensors and nothing is parked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import nn

from ..errors import RematError

__all__: list[str] = []

MESSAGE = (
    "remat: OffloadModel(offload_device='disk') keeps parameters, gradients and optimizer "
    "state in files, and expected its stand-ins not to be used, found {what}. Train with "
    "model.configure_optimizer(factory) and model.step() (not an optimizer over "
    "model.parameters()), clip with model.clip_grad_norm_(), read gradients with "
    "model.named_grads(), save "
    "with model.state_dict() and model.optimizer_state_dict(); or use offload_device='cpu'."
)

_LET_THROUGH = {torch.Tensor.__hash__}


def _what(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None:
        verb = "reading" if name == "__get__" else "setting"
        return f"{verb} .{getattr(owner, '__name__', '?')} of one"
    return f"a call of {name} on one"


def _torch_function(
    cls: type, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
) -> Any:
    if func in _LET_THROUGH:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    refuse(_what(func))


def refuse(what: str) -> NoReturn:
    raise RematError(MESSAGE.format(what=what))


class OnDisk(torch.Tensor):
    """An optimizer state tensor whose value is in a file (see the module's NOTE)."""

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _torch_function(cls, func, types, args, kwargs)


def stand_in(dtype: torch.dtype) -> torch.Tensor:
    """An empty :class:`OnDisk` tensor of ``dtype``."""
    return torch.Tensor._make_subclass(OnDisk, torch.empty(0, dtype=dtype))


_parked: dict[type, type] = {}  # a parameter class -> its subclass that raises
_original: dict[type, type] = {}  # and back


def park(p: nn.Parameter) -> None:
    """Make ``p`` raise on use until :func:`unpark`."""
    cls = type(p)
    if cls in _original:
        return
    parked = _parked.get(cls)
    if parked is None:
        methods: dict[str, Any] = {"__torch_function__": classmethod(_torch_function)}
        parked = type(f"OnDisk{cls.__name__}", (cls,), methods)
        _parked[cls], _original[parked] = parked, cls
    p.__class__ = parked


def unpark(p: nn.Parameter) -> None:
    original = _original.get(type(p))
    if original is not None:
        p.__class__ = original


def is_parked(t: object) -> bool:
    return type(t) in _original


@contextmanager
def internal() -> Iterator[None]:
    """remat's own touches of parked parameters (optimizer construction, flags)."""
    with torch._C.DisableTorchFunctionSubclass():
        yield
