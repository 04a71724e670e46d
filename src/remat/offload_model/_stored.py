"""Where a slice's tensors wait while the slice is not computing: host memory or disk.

A *bundle* is a list of tensors stored together: the parameters of one slice, their gradients,
their optimizer state, or one boundary activation. On disk a bundle is one file (one ticket of
:class:`~remat.store.disk.DiskTier`): its tensors are packed into one flat ``uint8`` buffer at
64-byte aligned offsets and come back as views of one freshly read buffer. In host memory a
bundle is the tensors themselves, copied to (pinned) host memory when they come from an
accelerator and kept as they are when they are already on the CPU, so that the host place with
a CPU compute device moves nothing.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Literal

import torch

from ..store._tier import Ticket, Tier
from ._stand_ins import stand_in

__all__: list[str] = []

OffloadDevice = Literal["cpu", "disk"]

_ALIGN = 64  # bytes: enough for the alignment of every dtype, so each entry can be viewed
_DISK_PENDING_BYTES = 64 * 2**20  # bytes a DiskTier may hold in RAM while writing them


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: torch.Size
    offset: int  # bytes from the start of the buffer
    nbytes: int


def _layout(tensors: list[torch.Tensor]) -> tuple[tuple[_Entry, ...], int]:
    entries = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(_Entry(t.dtype, t.shape, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(entries), offset


def _views(buffer: torch.Tensor, entries: tuple[_Entry, ...]) -> list[torch.Tensor]:
    return [buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries]


class Stored:
    """One bundle in its place; forgetting the object frees it (removes its file)."""

    def load(self, device: torch.device) -> list[torch.Tensor]:
        """The bundle's tensors on ``device``; the caller may keep and modify them."""
        raise NotImplementedError

    def prefetch(self, device: torch.device) -> None:
        """Start bringing the bundle to ``device``; harmless to call twice."""

    def resident(self) -> list[torch.Tensor]:
        """What stands in for each tensor while it is offloaded (see ``Place.placeholder``)."""
        raise NotImplementedError

    def stand_ins(self) -> list[torch.Tensor]:
        """What an optimizer's state holds for each tensor while it is offloaded: the tensors
        themselves in host memory, :class:`~._stand_ins.OnDisk` stand-ins on disk."""
        return self.resident()

    def free(self) -> None:
        """Free the bundle now (its file is removed), not when the object is collected: an
        error's traceback may keep the object alive long after a failed step."""


class _HostStored(Stored):
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def load(self, device: torch.device) -> list[torch.Tensor]:
        return [t if t.device == device else t.to(device, non_blocking=True) for t in self.tensors]

    def resident(self) -> list[torch.Tensor]:
        return self.tensors


class _DiskStored(Stored):
    def __init__(self, tier: Tier, tensors: list[torch.Tensor]) -> None:
        self.entries, total = _layout(tensors)
        buffer = torch.empty(total, dtype=torch.uint8)
        for view, t in zip(_views(buffer, self.entries), tensors, strict=True):
            view.copy_(t)
        self.tier = tier
        self.ticket: Ticket = tier.put(buffer)
        self._finalizer = weakref.finalize(self, tier.drop, self.ticket)
        self._finalizer.atexit = False  # at exit the tier removes its whole directory itself

    def load(self, device: torch.device) -> list[torch.Tensor]:
        return _views(self.tier.get(self.ticket, device), self.entries)

    def prefetch(self, device: torch.device) -> None:
        self.tier.prefetch(self.ticket, device)

    def resident(self) -> list[torch.Tensor]:
        # One element, expanded to the tensor's shape: no memory, but the shape autograd
        # records for a parameter's AccumulateGrad node when the parameter enters a slice's
        # node while offloaded (NOTE [ Which gradients a backward computes ] in _autograd.py),
        # which the slice's own backward then checks its gradients against.
        return [torch.empty((), dtype=e.dtype).expand(e.shape) for e in self.entries]

    def stand_ins(self) -> list[torch.Tensor]:
        return [stand_in(e.dtype) for e in self.entries]

    def free(self) -> None:
        self._finalizer()


class Place:
    """The offload device of one :class:`~remat.OffloadModel`: makes and flushes bundles."""

    def __init__(
        self,
        kind: OffloadDevice,
        device: torch.device,
        directory: str | os.PathLike[str] | None,
    ) -> None:
        self.kind = kind
        self.device = device
        # Host bundles of a CPU compute device are the tensors themselves: loading returns
        # them, and an optimizer step updates them where they are.
        self.in_place = kind == "cpu" and device.type == "cpu"
        self._pin = device.type == "cuda"
        self.tier: Tier | None = None
        if kind == "disk":
            from ..store.disk import DiskTier

            self.tier = DiskTier(directory, max_pending_bytes=_DISK_PENDING_BYTES)

    @property
    def directory(self) -> str | None:
        """The disk tier's private directory, or None for host memory."""
        path = getattr(self.tier, "directory", None)
        return None if path is None else os.fspath(path)

    def store(self, tensors: list[torch.Tensor]) -> Stored:
        """Send ``tensors`` to the offload device. Do not modify them afterwards."""
        tensors = [t.detach() for t in tensors]
        if self.tier is not None:
            return _DiskStored(self.tier, tensors)
        host = []
        for t in tensors:
            if t.device.type == "cpu" and (not self._pin or t.is_pinned()):
                host.append(t)
            else:
                copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
                copy.copy_(t)
                host.append(copy)
        return _HostStored(host)

    def flush(self) -> None:
        """Wait until every bundle stored so far is safely written; raise if one failed."""
        if self.tier is not None:
            self.tier.flush()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
