"""Which tier object a tier name means, and ``remat.offload`` for whole blocks.

Decisions name a tier (``OFFLOAD_HOST``, ``OFFLOAD_DISK``); the objects behind the names are
process-wide defaults made on first use (a :class:`HostTier`, and a :class:`DiskTier` in the
system's temporary directory), unless :func:`tiers` sets others for a block of code on this
thread. Each tier object has one :class:`Store`, so that prefetching in backward follows the
order of saving across every region and block that used the tier.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from types import TracebackType
from typing import Any, Literal

import torch

from .. import _state
from ..errors import RematError, did_you_mean
from ._args import check_int, is_tier
from ._store import Saved, Store, _lazy_bits
from ._tier import Tier

__all__ = ["offload", "tiers"]

TierName = Literal["host", "disk"]
_NAMES: tuple[TierName, ...] = ("host", "disk")


class _Chosen(threading.local):
    def __init__(self) -> None:
        self.tiers: dict[str, Tier] = {}


_chosen = _Chosen()
_defaults: dict[str, Tier] = {}
# Weakly: a store lives while something it stored does (a ``Saved`` holds it) or its user
# holds it, and then lets its tier go, so a tier made for one step is collected and closed.
_stores: weakref.WeakValueDictionary[int, Store] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def _default(name: str) -> Tier:
    with _lock:
        tier = _defaults.get(name)
        if tier is None:
            from .disk import DiskTier
            from .host import HostTier

            tier = _defaults[name] = HostTier() if name == "host" else DiskTier()
        return tier


def tier_named(name: str) -> Tier:
    """The tier object ``name`` stands for on this thread now."""
    _check_name(name)
    return _chosen.tiers.get(name) or _default(name)


def _check_name(name: str) -> None:
    if name not in _NAMES:
        raise RematError(
            f"remat: unknown tier {name!r}; expected one of {', '.join(map(repr, _NAMES))}"
            f"{did_you_mean(name, _NAMES)}, or a tier object such as remat.store.DiskTier()."
        )


def store_for(tier: Tier | str) -> Store:
    """The one store of ``tier`` (a tier object or name)."""
    if isinstance(tier, str):
        tier = tier_named(tier)
    with _lock:
        store = _stores.get(id(tier))
        if store is None or store.tier is not tier:
            store = _stores[id(tier)] = Store(tier)
        return store


def tiers(
    *, host: Tier | None = None, disk: Tier | None = None
) -> contextlib.AbstractContextManager[None]:
    """Use these tier objects for the names ``"host"`` and ``"disk"`` in this block.

    ::

        with remat.store.tiers(disk=remat.store.DiskTier("/nvme/scratch")):
            loss = model(x)  # OFFLOAD_DISK decisions and remat.offload("disk") write there
        loss.backward()

    The object may be entered again (once a step, nested, on several threads).
    """
    for name, tier in (("host", host), ("disk", disk)):
        if tier is not None and not is_tier(tier):
            raise RematError(
                f"remat: remat.store.tiers expected {name}= to be a tier (HostTier, DiskTier "
                f"or an object with put/prefetch/get/drop/flush/close), found "
                f"{type(tier).__name__} {tier!r}. Pass e.g. {name}=remat.store."
                f"{'HostTier' if name == 'host' else 'DiskTier'}()."
            )
    return _Using(host, disk)


class _Entries(threading.local):
    """What each ``with`` of one reusable block object has to undo, innermost last, per
    thread: the object may be entered again (nested, or once a step) and on several threads."""

    def __init__(self) -> None:
        self.stack: list[Any] = []

    def pop(self, what: str) -> Any:
        if not self.stack:
            raise RematError(
                f"remat: expected {what} to be left on the thread that entered it, found it "
                f"left on a thread where it was not entered. Enter and leave it with one "
                f"`with` statement."
            )
        return self.stack.pop()


class _Using(contextlib.ContextDecorator, contextlib.AbstractContextManager[None]):
    """``remat.store.tiers(...)``: reusable, also nested and on several threads at once."""

    def __init__(self, host: Tier | None, disk: Tier | None) -> None:
        self.chosen = {k: v for k, v in (("host", host), ("disk", disk)) if v is not None}
        self._entries = _Entries()

    def __enter__(self) -> None:
        self._entries.stack.append(dict(_chosen.tiers))
        _chosen.tiers.update(self.chosen)

    def __exit__(self, *exc: object) -> None:
        _chosen.tiers = self._entries.pop("remat.store.tiers(...)")


class Scope:
    """An active ``remat.offload`` block: its store, the smallest tensor it moves, and the
    storages of the buffers of every module called in it (see :meth:`outlives`)."""

    __slots__ = ("buffers", "min_bytes", "prefetch", "store")

    def __init__(self, store: Store, min_bytes: int, prefetch: int | None = None) -> None:
        self.store = store
        self.min_bytes = min_bytes
        self.prefetch = prefetch  # for what this block stores; None: the store's
        # storage key -> the storage, weakly: buffers of modules called in the block
        self.buffers: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def wants(self, t: torch.Tensor) -> bool:
        """Whether the block moves ``t``: decided by its *storage*, which is what the store
        moves (NOTE [ Life of an offloaded tensor ] in ``_store.py``) and what a saved view
        holds alive, so that every view of one storage gets one decision. Decided by the
        view's own bytes, a 64-byte view of a 1 MiB activation saved next to the whole of it
        would be kept while the whole went to the tier: the storage held in memory and in the
        tier, and the two back in backward sharing no memory, where autograd's saved views
        share it."""
        if self.outlives(t):
            return False  # model state and inputs live on anyway: moving them frees nothing
        if not self.store.takes(t):
            return False
        nbytes = _storage_bytes(t)
        # An empty storage (cuDNN's BatchNorm saves an empty reserve) has nothing to move.
        return nbytes > 0 and nbytes >= self.min_bytes

    def outlives(self, t: torch.Tensor) -> bool:
        """Whether ``t`` outlives the step: see :func:`outlives_the_step`, or it is a buffer
        of a module called in the block (BatchNorm saves its running statistics), or a view
        of one."""
        if outlives_the_step(t):
            return True
        if t.grad_fn is not None and t._base is None:
            return False
        storage = t.untyped_storage()
        held = self.buffers.get(storage._cdata)
        return held is not None and held() is storage

    def note_buffers(self, module: torch.nn.Module) -> None:
        for buffer in module._buffers.values():
            if buffer is not None and buffer.layout is torch.strided and not buffer.is_meta:
                storage = buffer.untyped_storage()
                self.buffers[storage._cdata] = weakref.ref(storage)


def _storage_bytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s storage (of ``t`` itself for a tensor without one)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # no storage to ask (a subclass, a meta view)
        return t.numel() * t.element_size()


def outlives_the_step(t: torch.Tensor) -> bool:
    """Whether ``t`` is model state or an input that requires grad, or a view of one: a
    parameter, a leaf that requires grad, or a view whose base is such a tensor (``nn.Linear``
    saves ``weight.t()``). Its storage stays alive whatever autograd holds, so storing it in a
    tier would only copy it, every step. A leaf that does not require grad is not among them:
    it may be the user's batch, alive anyway, but just as well a tensor the step made without
    grad (a mask, ``torch.ones`` for an attention bias, BatchNorm's batch statistics), which
    dies with the step; the two look the same here, and moving the first costs one copy,
    keeping the second would keep memory the block is meant to free."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


def _note_buffers(module: torch.nn.Module, args: Any) -> None:
    """Global forward pre-hook while a block runs: the module's buffers outlive the step."""
    scope = _state.state.offload
    if isinstance(scope, Scope):
        scope.note_buffers(module)


def offload(
    tier: TierName | Tier = "host", *, min_bytes: int = 1024, prefetch: int | None = None
) -> contextlib.AbstractContextManager[None]:
    """Offload what the block saves for backward to ``tier``, until backward needs it.

    Every tensor autograd saves inside the block whose storage holds at least ``min_bytes``
    (a view counts the storage it views, which the tier moves whole), goes to the tier
    (``"host"``: pinned host memory, for accelerator tensors; ``"disk"``: files in a private
    directory, for any tensor) and is brought back in backward, ``prefetch`` tensors ahead
    (default 2; the setting holds for what this block stores, not for later blocks). What
    outlives the step is left alone, since moving it frees nothing: parameters, leaves
    that require grad, the buffers of the modules called in the block, and views of any of
    these (``nn.Linear`` saves ``weight.t()``); so are CPU tensors under the host tier, which
    are in host memory already. Inside checkpointed
    regions the region decides (a region engine saves only its inputs; a graph engine
    offloads here what its policy keeps). The block's writes are flushed when it exits, so a
    full disk raises there, before backward (the failures of this thread's writes: a block
    never raises another thread's). A user's input batch that does not require grad is moved
    too: nothing tells it from a tensor the step makes without grad (a mask, BatchNorm's batch
    statistics), which must move.

    The returned object may be entered again, once a step (``off = remat.offload("disk")``,
    then ``with off:``), nested, or on several threads; each ``with`` is a block of its own.

    ::

        with remat.offload("disk", min_bytes=2**20):
            loss = model(x)
        loss.backward()
    """
    check_int("remat.offload", "min_bytes", min_bytes, 0, "remat.offload(min_bytes=1024)")
    if prefetch is not None:
        check_int("remat.offload", "prefetch", prefetch, 0, "remat.offload(prefetch=2)")
    if isinstance(tier, str):
        _check_name(tier)  # the object is the one the name stands for when the block starts
    elif not is_tier(tier):
        raise RematError(
            f"remat: remat.offload expected tier to be 'host', 'disk' or a tier object (with "
            f"put/prefetch/get/drop/flush/close), found {type(tier).__name__} {tier!r}. Pass "
            f"e.g. remat.offload('disk') or remat.offload(remat.store.DiskTier('/scratch'))."
        )
    return _Offload(tier, min_bytes, prefetch)


class _Entry:
    """One ``with`` of a ``remat.offload`` object: what its exit undoes."""

    __slots__ = ("hook", "hooks", "previous", "store")

    def __init__(
        self,
        store: Store,
        previous: Any,
        hook: torch.utils.hooks.RemovableHandle,
        hooks: torch.autograd.graph.saved_tensors_hooks,
    ) -> None:
        self.store = store
        self.previous = previous
        self.hook = hook
        self.hooks = hooks


class _Offload(contextlib.ContextDecorator, contextlib.AbstractContextManager[None]):
    """``remat.offload(...)``: reusable (``off = remat.offload("disk")``, then ``with off:``
    every step), also nested and on several threads at once. Each ``with`` is a block of its
    own: the tier a name stands for is looked up when it starts, and its writes are flushed
    when it ends."""

    def __init__(self, tier: TierName | Tier, min_bytes: int, prefetch: int | None) -> None:
        self.tier = tier
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self._entries = _Entries()

    def __enter__(self) -> None:
        tier = self.tier
        store = store_for(tier_named(tier) if isinstance(tier, str) else tier)
        scope = Scope(store, self.min_bytes, self.prefetch)
        hooks = torch.autograd.graph.saved_tensors_hooks(_packer(scope), _unpack)
        previous = _state.state.offload
        # Every module called in the block, on this thread, tells the scope its buffers.
        hook = torch.nn.modules.module.register_module_forward_pre_hook(_note_buffers)
        try:
            hooks.__enter__()
        except BaseException:
            hook.remove()
            raise
        _state.state.offload = scope
        self._entries.stack.append(_Entry(store, previous, hook, hooks))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        entry: _Entry = self._entries.pop("remat.offload(...)")
        try:
            entry.hooks.__exit__(exc_type, exc, traceback)
            if exc_type is not None:
                drain(entry.store)
        finally:
            entry.hook.remove()
            _state.state.offload = entry.previous
        if exc_type is None:
            entry.store.flush()


def drain(store: Store) -> None:
    """After an exception in an offload scope: wait for its writes, so that their failures,
    part of the same failed step, are not reported again by the next one."""
    with contextlib.suppress(RematError):
        store.flush()


def _packer(scope: Scope) -> Any:
    def pack(t: torch.Tensor) -> Any:
        observer = _state.state.observer
        if not scope.wants(t):
            if observer is not None:
                observer.saved(t, "keep", f"not offloaded: {_why_not(scope, t)}")
            return _Kept(t)
        if observer is not None:
            observer.saved(t, "offload", f"{scope.store.tier.name} tier")
        return scope.store.pack(t, prefetch=scope.prefetch)

    return pack


def _why_not(scope: Scope, t: torch.Tensor) -> str:
    bits = _lazy_bits(t)
    if bits:
        return f"a lazy view with the {bits} bit, which stored bytes do not carry"
    if not scope.store.takes(t):
        if t.device.type == "cpu" and scope.store.tier.name == "host":
            return "already in host memory"
        return f"the {scope.store.tier.name} tier does not take this tensor"
    if outlives_the_step(t):
        if t._base is not None:
            return "a view of a leaf that requires grad (a parameter, an input), alive anyway"
        return "a leaf that requires grad, alive anyway"
    if scope.outlives(t):
        return "a module's buffer (or a view of one), alive anyway"
    nbytes = _storage_bytes(t)
    if nbytes == 0:
        return "empty: nothing to move"
    return f"its storage ({nbytes} bytes) is smaller than min_bytes={scope.min_bytes}"


class _Kept:
    """A tensor an offload scope keeps in place, with its version when it was saved: saved-
    tensor hooks switch autograd's own check of in-place writes off, for these too, so a
    parameter written by an optimizer step, or a buffer, before backward would be read as
    written (see Step 2 of NOTE [ Life of an offloaded tensor ] in ``_store.py``)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise RematError(
                "remat: a tensor saved for backward (kept in memory by remat.offload) was "
                f"modified in place after it was saved: its version is {t._version}, it was "
                f"saved at version {self.version} (shape {tuple(t.shape)}, {t.dtype}). A "
                "parameter or buffer written before backward (an optimizer step, a clamp, a "
                "running statistic) or a small tensor written in place; plain autograd raises "
                "here too. Clone it before modifying it, make the in-place op out of place, or "
                "run backward first."
            )
        return t


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, _Kept):
        return packed.unpack()
    return packed.tensor if isinstance(packed, Saved) else packed


def offload_hooks(tier: TierName | Tier) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that offload every tensor ``tier`` takes, whatever its size (for a
    region's inputs with ``offload_to_cpu``)."""
    store = store_for(tier)
    return torch.autograd.graph.saved_tensors_hooks(_packer(Scope(store, 0)), _unpack)
