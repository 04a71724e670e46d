"""The store: what autograd holds for an offloaded tensor, and how it comes back in time.

NOTE [ Life of an offloaded tensor ]

A tensor decided ``OFFLOAD`` (by a policy in a graph-engine region, by ``remat.offload`` for
everything a block saves, or as a region input with ``offload_to_cpu``) goes through here:

1. ``Store.pack(t)``: the tier stores ``t``'s whole *storage*, once: a second tensor saved
   from the same storage at the same version (a view, a transpose, the same tensor saved by
   two ops) shares the stored bytes, so views of one storage are stored once and come back as
   views of one storage. Autograd holds a ``Saved`` that knows the tensor's dtype, shape,
   strides and offset into the storage.
2. Forward goes on; the tier copies or writes in the background. The ``Saved`` remembers
   ``t``'s version and holds a *witness* of it (``_witness``): a tensor with no storage that
   shares ``t``'s version counter, so it sees every in-place write to ``t`` or a view of it,
   even after the user dropped ``t``. If the version moved, unpacking raises, as autograd
   does for a saved tensor modified in place (saved-tensor hooks switch autograd's own check
   off). Holding ``t`` weakly instead, as this once did, missed a write followed by ``del``:
   backward then read the bytes the tier had written, the old value or half of each, as the
   race with the background write fell.
3. At the end of an offload scope (``remat.offload`` block, graph-engine region) the store
   flushes the tier: a write that failed (a full disk) raises there, in forward, before
   backward has touched any gradient. A scope runs on one thread, and flushes the writes of
   that thread only (``DiskTier.flush_thread``): a failure belongs to the step that made the
   write, never to a step another thread runs on the same tier meanwhile.
4. ``Store.unpack(saved)``, in backward: the storage's bytes are fetched (or taken from the
   prefetch), and the next ``prefetch`` storages *saved before it* are prefetched, since
   backward needs tensors in reverse order of saving. A storage that is back and still alive
   (another view of it in use) is not fetched twice.
5. Autograd may unpack again (``retain_graph``, a double backward): the stored bytes stay in
   the tier until the last ``Saved`` of the storage is freed, then the tier drops them.
   ``Saved.__del__`` is a finalizer, run wherever the last reference goes, the garbage
   collector included, and that may be in the middle of the store's or the tier's own locked
   section on the same thread: the release is queued there and handled once the section is
   left, never waited for (NOTE [ Finalizers and the store's locks ] in ``_section.py``).

What the store never takes (``Store.takes``): tensors of a subclass, non-strided layouts, meta
tensors, and lazy views with the conjugate or negative bit (``(b * 2).conj()``,
``z.conj().imag``) or a zero tensor. A tier stores the bytes of the storage, and a tensor
rebuilt from them with ``set_`` has none of these bits: backward would read ``b * 2`` for its
conjugate, silently. Autograd keeps such a tensor as it is, as without offloading.
"""

from __future__ import annotations

import bisect
import functools
import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import RematError
from ._args import check_int, check_tier
from ._section import After, Section
from ._tier import Ticket, Tier

__all__: list[str] = []


class _Stored:
    """One storage's bytes in a tier."""

    __slots__ = (
        "__weakref__",
        "back",
        "device",
        "key",
        "nbytes",
        "prefetch",
        "serial",
        "ticket",
        "users",
        "version",
    )

    def __init__(
        self,
        serial: int,
        ticket: Ticket,
        nbytes: int,
        device: torch.device,
        version: int,
        prefetch: int | None,
    ) -> None:
        self.key = 0  # the source storage's address, while it is alive
        # Storages to read ahead when this one is unpacked; None: the store's ``prefetch``.
        self.prefetch = prefetch
        self.serial = serial
        self.ticket = ticket
        self.nbytes = nbytes
        self.device = device
        self.version = version
        self.users = 0
        # The storage as it came back, while something still uses it (Step 4).
        self.back: weakref.ref[torch.UntypedStorage] | None = None


class Saved:
    """What autograd holds for one offloaded tensor; see NOTE [ Life of an offloaded tensor ]."""

    __slots__ = ("dtype", "offset", "original", "shape", "store", "stored", "stride", "version")

    def __init__(
        self, store: Store, stored: _Stored, t: torch.Tensor, check: bool, version: int
    ) -> None:
        self.store = store
        self.stored = stored
        self.dtype = t.dtype
        self.shape = t.shape
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = version
        self.original = _witness(t) if check else None

    @property
    def tensor(self) -> torch.Tensor:
        return self.store.unpack(self)

    def __del__(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.release(self.stored)


def _witness(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter and holds none of its memory: ``detach``
    shares the counter, and ``set_`` below the in-place-or-view kernel (which counts writes)
    drops the storage without counting a write. See Step 2 of NOTE [ Life of an offloaded
    tensor ]."""
    with _disable_current_modes(), torch.no_grad():
        witness = t.detach()
        with torch._C._AutoDispatchBelowADInplaceOrView():
            witness.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
    return witness


def _lazy_bits(t: torch.Tensor) -> str:
    """The bits of ``t`` its storage's bytes do not carry (see the NOTE above), by name."""
    bits = [name for name, set_ in (("conjugate", t.is_conj()), ("negative", t.is_neg())) if set_]
    if t._is_zerotensor():
        bits.append("zero-tensor")
    return " and ".join(bits)


class Store:
    """Offloads saved storages to one tier and brings them back in reverse order of saving.

    Args:
        tier: where the bytes wait (``HostTier``, ``DiskTier`` or another ``Tier``).
        prefetch: storages fetched ahead of the one backward asks for.
    """

    def __init__(self, tier: Tier, *, prefetch: int = 2) -> None:
        check_tier("Store", "tier", tier, "Store(remat.store.HostTier())")
        check_int("Store", "prefetch", prefetch, 0, "Store(tier, prefetch=2)")
        self.tier = tier
        self.prefetch = prefetch
        self.stored_bytes = 0  # bytes in the tier now
        self._serial = 0
        self._order: list[_Stored] = []  # alive, in order of saving (serials ascending)
        # Tiers without ``takes`` (disk) take host bytes, from any device through the host.
        self._tier_takes = getattr(tier, "takes", None)
        # storage address -> (weak storage, its stored bytes) while the storage is alive
        self._live: dict[int, tuple[weakref.ref[torch.UntypedStorage], _Stored]] = {}
        # Guards the bookkeeping above; a release never waits for it (Step 5).
        self._section = Section(threading.RLock())

    def __repr__(self) -> str:
        return f"Store(tier={self.tier.name}, prefetch={self.prefetch})"

    def takes(self, t: torch.Tensor) -> bool:
        """Whether this store can hold ``t`` (a plain dense tensor the tier accepts, without
        the conjugate or negative bit: see the NOTE above)."""
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return False
        if t.layout is not torch.strided or t.is_meta or t.device.type == "meta":
            return False
        if t.is_conj() or t.is_neg() or t._is_zerotensor():
            return False
        return self._tier_takes is None or bool(self._tier_takes(t.device))

    def pack(
        self,
        t: torch.Tensor,
        *,
        check_version: bool = True,
        version: int | None = None,
        prefetch: int | None = None,
    ) -> Saved:
        """Store ``t``; with ``check_version``, unpacking raises if ``t`` was written in place
        since (Step 2); without, the stored value is a snapshot, as for the graph engine.
        ``version`` is the version ``t``'s value has, when autograd has yet to count a write
        that already happened (an in-place op seen from inside the dispatcher). ``prefetch``:
        the storages to read ahead when ``t`` comes back (default: the store's)."""
        # Callers ask ``takes`` first; the bits alone are checked again here, since a tensor
        # packed with one would come back silently wrong (see the NOTE above).
        if t.is_conj() or t.is_neg() or t._is_zerotensor():
            raise RematError(
                f"remat: Store.pack expected a tensor without the conjugate or negative bit, "
                f"found one with the {_lazy_bits(t)} bit. Ask Store.takes(t) first and keep "
                f"the tensor as it is when it says no."
            )
        storage = t.untyped_storage()
        key = storage._cdata
        version = t._version if version is None else version
        with self._section:
            live = self._live.get(key)
            if live is not None and live[0]() is storage and live[1].version == version:
                stored = live[1]
            else:
                stored = self._put(storage, t.device, version, prefetch)
                stored.key = key
                self._live[key] = (weakref.ref(storage, self._forget_storage(key)), stored)
            stored.users += 1
        return Saved(self, stored, t, check_version, version)

    def _put(
        self,
        storage: torch.UntypedStorage,
        device: torch.device,
        version: int,
        prefetch: int | None,
    ) -> _Stored:
        # The store's own ops are not the model's: dispatch modes (a graph recording, the
        # tracker, explain) must not see them.
        with _disable_current_modes():
            data = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            if device.type != "cpu" and self._tier_takes is None:
                data = data.cpu()  # tiers that take host bytes only (disk): a synchronous copy
        try:
            ticket = self.tier.put(data)
        except RematError:
            self._live.clear()  # an earlier write failed: share no stored bytes from before
            raise
        # ``put`` is called with the section held: a release it sets off (the collector
        # freeing another graph) is queued and handled when ``pack`` leaves the section.
        self._serial += 1
        stored = _Stored(self._serial, ticket, storage.nbytes(), device, version, prefetch)
        self._order.append(stored)
        self.stored_bytes += stored.nbytes
        return stored

    def _forget_storage(self, key: int) -> Any:
        this = weakref.ref(self)

        def forget(ref: weakref.ref[torch.UntypedStorage]) -> None:
            # No lock: this runs wherever the storage dies, a tier's worker thread included,
            # which may hold the tier's lock while ``pack`` holds ours and waits for it. At
            # worst a racing ``pack`` loses a dedup entry and stores the bytes once more.
            store = this()
            if store is not None:
                live = store._live.get(key)
                if live is not None and live[0] is ref:
                    store._live.pop(key, None)

        return forget

    def unpack(self, saved: Saved) -> torch.Tensor:
        original = saved.original
        if original is not None and original._version != saved.version:
            raise RematError(
                "remat: a tensor saved for backward (and offloaded to the "
                f"{self.tier.name} tier) was modified in place after it was saved: its version "
                f"is {original._version}, it was saved at version {saved.version} (shape "
                f"{tuple(saved.shape)}, {saved.dtype}). Clone it before modifying it, or make "
                "the in-place op out of place."
            )
        stored = saved.stored
        with self._section:
            storage = stored.back() if stored.back is not None else None
            if storage is None:
                data = self.tier.get(stored.ticket, stored.device)
                storage = data.untyped_storage()
                stored.back = weakref.ref(storage)
            self._prefetch_before(stored)
        out = torch.empty(0, dtype=saved.dtype, device=stored.device)
        return out.set_(storage, saved.offset, saved.shape, saved.stride)

    def _prefetch_before(self, stored: _Stored) -> None:
        ahead = self.prefetch if stored.prefetch is None else stored.prefetch
        if not ahead:
            return
        i = self._position(stored)
        for earlier in reversed(self._order[max(0, i - ahead) : i]):
            if earlier.back is None or earlier.back() is None:
                self.tier.prefetch(earlier.ticket, earlier.device)

    def _position(self, stored: _Stored) -> int:
        return bisect.bisect_left(self._order, stored.serial, key=lambda s: s.serial)

    def release(self, stored: _Stored) -> None:
        """One ``Saved`` of ``stored`` is gone; the last one drops the bytes (Step 5). Called
        from finalizers: never waits for the store's lock (``_section.py``)."""
        self._section.submit(self._released, stored)

    def _released(self, stored: _Stored) -> After:
        """Under the section: the bookkeeping of ``release``; returns the tier's ``drop``,
        called once the section is left, so that a tier is never entered from a release."""
        stored.users -= 1
        if stored.users > 0:
            return None
        i = self._position(stored)
        if i < len(self._order) and self._order[i] is stored:
            del self._order[i]
        self.stored_bytes -= stored.nbytes
        live = self._live.get(stored.key)
        if live is not None and live[1] is stored:  # a later save must store anew
            del self._live[stored.key]
        return functools.partial(self.tier.drop, stored.ticket)

    def settle(self, saved: Saved) -> None:
        """Before ``saved``'s source is written in place: let its copy out finish first.

        A tier's ``settle`` waits for that one ticket and raises nothing: a failed write is
        raised at the end of the scope that made it (Step 3), never by a settle in another
        thread's region, which would take the failure from its own step. A tier without
        ``settle`` is flushed instead: its ``flush_thread`` (this thread's writes, this one
        included) where it has one, else its ``flush``."""
        settle = getattr(self.tier, "settle", None)
        if settle is not None:
            settle(saved.stored.ticket)
        else:
            flush = getattr(self.tier, "flush_thread", None) or self.tier.flush
            flush()

    def flush(self) -> None:
        """End of an offload scope (Step 3), in the thread that ran it: raises the failures
        of the writes this thread made, never another thread's (a tier with ``flush_thread``,
        the disk tier; others' ``flush``). After a failed write, no later save shares the
        bytes stored before it (some may be missing), even while the failed step's tensors
        are still alive (a traceback holds them)."""
        flush = getattr(self.tier, "flush_thread", None) or self.tier.flush
        try:
            flush()
        except RematError:
            with self._section:
                self._live.clear()
            raise
