"""Portals: carry a skip tensor from one partition to a later one, hidden from autograd.

If a skip tensor went from partition ``a`` to partition ``b`` as an ordinary tensor, every
partition in between would have to take it as an input and return it, and a checkpointed
partition would keep it among its saved inputs. A portal instead holds the tensor itself, and
the graph only sees empty "phony" tensors: ``PortalBlue`` turns the stashed tensor into a phony
joined to the micro-batch in ``a``, ``PortalOrange`` turns a phony forked from the micro-batch
in ``b`` back into the tensor. In backward the gradient takes the same way back: PortalOrange
leaves it in the portal, PortalBlue hands it to the stashed tensor. The fork in ``b`` and the
join in ``a`` order the two: backward reaches PortalBlue only after PortalOrange.

NOTE [ Life of a tensor through a portal ]

Partition ``a`` stashes ``s`` for micro-batch ``i``; partition ``b > a`` pops it. The portal
holds ``s`` from [1] until its ``tensor_life``, the number of times it still has to hand ``s``
out, reaches 0; then it drops ``s``. A checkpointed micro-batch (``checkpoint="always"``, or
every one but the last with ``"except_last"``) hands it out twice: to ``b``'s forward and to
``b``'s recompute in backward.

  event                                                  takes s  life after   portal holds s
  ------------------------------------------------------ -------- ------------ --------------
  forward
  [1] a: stash; Portal(s, life); PortalBlue.forward               1 / ckpt 2   yes
  [2] b: pop; PortalOrange.forward (to b's device)       yes      0 / ckpt 1   no / ckpt yes
  backward
  [3] b recomputed (ckpt): pop; PortalOrange.forward     yes      0            no
  [4] PortalOrange.backward: grad of s into the portal
  [5] a recomputed (ckpt): stash again; ignored, the
      recomputed s is dropped at once
  [6] PortalBlue.backward: the grad from the portal to s;         0            no
      drops s if still held, and the grad

Order. [3] and [4] come in either order, and so do [5] and [6]; [4] always comes before [6]
(PortalOrange's phony input comes from a fork in ``b`` of the skips' phony, which descends from
PortalBlue's join in ``a``: NOTE [ The skips' phony ] in ``tracker.py``), and so does [3] when
it happens: a recompute of ``b`` is triggered by a node of ``b``, and every node of ``b`` that
depends on the micro-batch runs before backward leaves ``b`` (the micro-batch is joined to
PortalBlue's phony in ``a`` too). When the micro-batch carries no gradient from ``a`` to ``b``
(integer tensors), that last order is autograd's: on one device it runs nodes newest first,
so ``b``'s before ``a``'s; a recompute that asks for ``s`` after [6] raises, as below.

[3] does not always happen: the region engine stops a recompute after the last saved tensor
that backward still needs, and when nothing after the pop is needed the recompute stops before
it. Then ``s`` is dropped at [6], at the end of the stash's backward, instead of at [3]. Nothing
else holds ``s``: PortalBlue and PortalOrange save no tensor, so a skip tensor that is not also
saved by an operator is freed at [2] (plain) or at [3] or [6] (checkpointed). A forward that
is never backwarded frees ``s`` with its graph: the trackers that a checkpointed micro-batch's
regions keep hold only portals popped from earlier partitions (NOTE [ Which portals a tracker
keeps ] in ``tracker.py``), so no reference cycle keeps the portal.

Retrieving ``s`` after its life is over (a second backward with ``retain_graph=True`` through a
checkpointed micro-batch) raises :class:`~remat.RematError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...errors import RematError
from ..dependency import phony

__all__: list[str] = []

# Called as observer(portal, event) at each numbered event of the note above; for tests and
# debugging. Events: "blue", "orange", "orange backward", "blue backward".
observers: list[Callable[[Portal, str], None]] = []


def _tell(portal: Portal, event: str) -> None:
    for observer in observers:
        observer(portal, event)


class Portal:
    """Holds one skip tensor of one micro-batch and, in backward, its gradient."""

    __slots__ = ("empty", "grad", "name", "needs_grad", "tensor", "tensor_life")

    def __init__(self, tensor: Tensor | None, tensor_life: int, name: str = "") -> None:
        self.tensor = tensor
        self.tensor_life = tensor_life
        # A stash of None: every pop gets None.
        self.empty = tensor is None
        self.grad: Tensor | None = None
        self.name = name
        # Whether [1] made a PortalBlue, whose phony the pop must descend from (NOTE [ The
        # skips' phony ] in tracker.py); set by blue(), kept for the recompute's pop.
        self.needs_grad = False

    def __repr__(self) -> str:
        held = "empty" if self.tensor is None else f"holding {tuple(self.tensor.shape)}"
        return f"<Portal {self.name!r} {held}, life {self.tensor_life}>"

    def blue(self) -> Tensor:
        """Event [1]: a phony standing for the stashed tensor in the stashing partition."""
        tensor = self.tensor
        if tensor is None:
            return phony(torch.device("cpu"))
        _tell(self, "blue")
        if torch.is_grad_enabled() and tensor.requires_grad:
            self.needs_grad = True
            out: Tensor = PortalBlue.apply(self, tensor)  # type: ignore[no-untyped-call]
            return out
        return phony(tensor.device)

    def orange(self, phony: Tensor) -> Tensor | None:
        """Events [2] and [3]: the stashed tensor, on ``phony``'s device, for the popping layer."""
        if self.empty:
            return None
        if torch.is_grad_enabled() and phony.requires_grad:
            out: Tensor = PortalOrange.apply(self, phony)  # type: ignore[no-untyped-call]
            return out
        return self.use_tensor(phony.device).detach()

    def use_tensor(self, device: torch.device) -> Tensor:
        """The tensor on ``device``; the portal drops it after its last use."""
        tensor = self.tensor
        if tensor is None:
            raise RematError(
                f"remat: skip tensor {self.name!r} was asked for after the pipeline had "
                "already handed it out as many times as planned (see NOTE [ Life of a tensor "
                "through a portal ] in remat/pipe/skip/portal.py). A second backward with "
                "retain_graph=True through checkpointed micro-batches cannot rebuild it: use "
                'checkpoint="never" for that, or run the forward again.'
            )
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        _tell(self, "orange")
        return tensor.to(device)

    def put_grad(self, grad: Tensor) -> None:
        self.grad = grad

    def use_grad(self) -> Tensor | None:
        grad, self.grad = self.grad, None
        return grad

    def release(self) -> None:
        """Event [6]: nothing can ask for the tensor any more."""
        self.tensor = None
        self.tensor_life = 0


class PortalBlue(torch.autograd.Function):
    """Hides the stashed tensor behind a phony; its backward returns the tensor's gradient."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, tensor: Tensor) -> Tensor:
        ctx.portal = portal
        return phony(tensor.device)

    @staticmethod
    def backward(ctx: Any, grad_phony: Tensor) -> tuple[None, Tensor | None]:
        portal: Portal = ctx.portal
        grad = portal.use_grad()
        portal.release()
        _tell(portal, "blue backward")
        return None, grad


class PortalOrange(torch.autograd.Function):
    """Takes the stashed tensor out of the portal; its backward leaves the gradient there."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, phony: Tensor) -> Tensor:
        ctx.portal = portal
        tensor = portal.tensor
        ctx.source = tensor.device if tensor is not None else phony.device
        return portal.use_tensor(phony.device).detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        portal: Portal = ctx.portal
        portal.put_grad(grad.to(ctx.source))
        _tell(portal, "orange backward")
        return None, None
