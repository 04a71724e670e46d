"""Make a recompute read what its forward pass read from the modules.

NOTE [ A recompute reads what its forward pass read ]

The region engine rebuilds activations by running the region's Python again. The recompute
reads the modules' parameters, buffers and flags as they are in backward, which may not be
how they were in forward. Usually nothing changed. When something did, the recompute builds
other activations, and the gradients come out wrong with no error. Torch's checkpoint
behaves this way in all four cases below.

1. *Another tensor in the module's place.* ``torch.func.functional_call(model, params, x)``
   swaps ``params`` into the modules for the call, then swaps the modules' own back when it
   returns. A recompute after that would read the module's own. A module may also replace a
   buffer or a parameter between forward and backward.

   A module may also rebind its own state in forward: a running normaliser or an EMA
   codebook written out of place (``self.mean = 0.9 * self.mean + 0.1 * h.mean(0)``), or a
   table registered on the first call. The recompute must read the state as the forward
   pass found it, and must not rebind it a second time.

   Before the forward pass runs, the region notes which tensor each module of the region
   held under each name: its *bindings*, taken from the modules that the walk of
   ``_guard.Reachable`` visits. A recompute that finds other tables puts the forward's
   bindings back while it runs, then restores the tables whole, which also undoes what the
   recompute bound. A table that gained or lost an entry between forward and backward is
   refused: the module may now hold the tensor as a plain attribute, which no table lookup
   reaches.

   The forward's tensors are held until the recompute. Where nothing was swapped, they are
   the module's own, so holding them costs nothing. Where something was, they are what a
   plain run's autograd holds.
2. *A tensor written in place since.* An optimizer step, an EMA update or a weight clamp
   between forward and backward writes a parameter that the recompute reads. Plain autograd
   raises for a saved tensor that was modified after it was saved, using its version
   counter. The recompute does the same for the parameters of the modules the region
   reached, and for any other tensor it reached that requires grad: when one's version
   differs from the one it had at the end of the forward pass, the recompute raises, naming
   it.

   Buffers and other tensors that need no gradient are checked when the region reads them.
   What a region reaches is more than what it reads: a BatchNorm in training reaches its
   running statistics without reading them, and another call of the same module may write
   them before this one's recompute (a later micro-batch in ``remat.pipe`` updates deferred
   statistics). The guarded first recompute notes the tensors the region read
   (``WriteGuard.read``); :meth:`Reads.learn` keeps those that need no gradient, by function,
   and every check from then on, that one's included, covers them too.

   Left out of this check:
   - tensors the forward pass wrote itself, which ``_guard.py`` replays (NOTE [ State read,
     then written ]);
   - the region's tensor arguments, which are saved through autograd, and autograd checks
     them;
   - a buffer the region reads only on some later call (a data-dependent branch), as in
     NOTE [ When the guard runs ] 2.
3. *A module switched between train() and eval().* Dropout and BatchNorm compute differently
   in eval mode. The forward pass notes each module's ``training`` flag. A recompute that
   finds another flag sets the forward's while it runs.
4. *A parameter frozen or unfrozen since.* A GAN freezes the discriminator after ``D(fake)``
   and before the generator's backward. Autograd backpropagates through the graph forward
   recorded, but a recompute with the new flag saves other tensors (a frozen weight's input
   is not saved), so it fails or, where the shapes agree, builds other gradients. The
   forward pass notes the ``requires_grad`` flag of each tensor the function reaches; a
   recompute that finds another flag on a leaf sets the forward's while it runs.

A forward pass notes one binding per parameter and buffer, one version and one
``requires_grad`` flag per tensor reached and one ``training`` flag per module. A recompute
compares them; a transformer block has a dozen of each.

The graph engine replays the recorded ops on the tensors that the forward pass read, so 1, 3
and 4 cannot happen to it. It checks 2 on every tensor it holds from the forward pass
(``_replay.py``).
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch
from torch import nn

from ._guard import Reachable
from .errors import CheckpointError

__all__: list[str] = []


# Functions and modules (the keys of ``_guard.identities``) -> the tensors outside the region
# that need no gradient and that a guarded recompute of theirs read, by id, held weakly: the
# state whose version :meth:`Reads.check` compares ([ A recompute reads what its forward pass
# read ] 2).
_read_by: weakref.WeakKeyDictionary[Any, dict[int, weakref.ref[torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def _was_read(keys: list[Any], t: torch.Tensor) -> bool:
    for key in keys:
        if key is not None:
            ref = _read_by.get(key, {}).get(id(t))
            if ref is not None and ref() is t:
                return True
    return False


class Reads:
    """What a region's forward pass read from outside it: see the note above.

    Made from ``reach``, the walk made before the forward pass, before it runs (what the
    modules held and their flags); :meth:`forward_done` completes it once the forward pass
    has run.
    """

    __slots__ = (
        "extra",
        "flags",
        "grads",
        "held",
        "lengths",
        "modules",
        "own",
        "tables",
        "versions",
        "written",
    )

    def __init__(self, reach: Reachable) -> None:
        # The modules, their ``training`` flags, their parameter and buffer tables and what
        # those held, and the ``requires_grad`` flag of each tensor the function reaches: once
        # per region call, before the forward pass, so that a forward pass that rebinds an
        # entry is recomputed from the tensor it read (1).
        self.modules = [m for m in reach.walked.values() if isinstance(m, nn.Module)]
        self.flags = tuple([m.training for m in self.modules])
        self.tables: list[dict[str, Any]] = []
        for m in self.modules:
            state = m.__dict__
            self.tables += (state["_parameters"], state["_buffers"])
        self.held = [table.copy() for table in self.tables]
        self.grads = tuple([t.requires_grad for t in reach.tensors[: reach.n_own]])
        self.versions = reach.versions
        self.lengths: tuple[int, ...] = ()
        self.own: list[weakref.ref[torch.Tensor]] = []
        self.written: set[int] | None = None
        self.extra: list[tuple[weakref.ref[torch.Tensor], int]] = []

    def forward_done(
        self,
        reach: Reachable,
        own: list[weakref.ref[torch.Tensor]],
        written: list[torch.Tensor],
        arguments: list[torch.Tensor],
    ) -> None:
        """After the forward pass: ``own``, weak references to the tensors the function
        itself reaches (``reach.own_refs()``, in the order of ``grads``); ``written``, the
        tensors the forward pass wrote; ``arguments``, the region's tensor arguments. Neither
        of the last two is checked by version."""
        self.lengths = tuple([len(table) for table in self.tables])
        self.own = own
        self.written = {id(t) for t in written} if written else None
        skip = {id(t) for t in arguments}
        n = reach.n_own
        for t, v in zip(reach.tensors[n:], reach.versions[n:], strict=True):
            if id(t) not in skip and id(t) not in (self.written or ()):
                self.extra.append((weakref.ref(t), v))

    def check(self, keys: list[Any]) -> None:
        """Raise when a tensor the forward pass read was written since ([ A recompute reads
        what its forward pass read ] 2); ``keys``: the region's, from ``_guard.identities``."""
        for ref, version in (*zip(self.own, self.versions, strict=False), *self.extra):
            t = ref()
            if (
                t is not None
                and t._version != version
                and (self.written is None or id(t) not in self.written)
                and (t.requires_grad or _was_read(keys, t))
            ):
                raise CheckpointError(
                    f"remat: the recompute of a checkpointed region would read "
                    f"{self.describe(t)}, which was modified in place after the forward pass "
                    f"(its version was {version}, it is {t._version}). The recompute would "
                    "rebuild other activations and the gradients would be wrong. Run backward "
                    "before modifying it (an optimizer step, an EMA update or a weight clamp "
                    "between forward and backward), or do not checkpoint this region."
                )

    def learn(self, keys: list[Any], read: set[int]) -> None:
        """Remember, under each of ``keys``, the reached tensors that need no gradient and
        that a guarded recompute read (``read``: ``WriteGuard.read``); see [ A recompute reads
        what its forward pass read ] 2."""
        found = {}
        for ref in (*self.own, *(ref for ref, _ in self.extra)):
            t = ref()
            if t is not None and not t.requires_grad and id(t) in read:
                found[id(t)] = ref
        for key in keys:
            if key is not None:
                known = _read_by.get(key)
                if known is None:
                    _read_by[key] = found.copy()
                else:  # forget the tensors that died
                    known.update(found)
                    for i in [i for i, r in known.items() if r() is None]:
                        del known[i]

    def bind(self) -> list[tuple[Any, Any]] | None:
        """Put back the forward pass's tensors, ``training`` and ``requires_grad`` flags where
        the modules now hold others ([ A recompute reads what its forward pass read ] 1, 3
        and 4); what :meth:`unbind` takes to restore the modules' own, or None when nothing
        changed. The tables are restored whole: what the recompute binds (a forward pass that
        rebinds a buffer does so again) is undone with them."""
        changed: list[tuple[Any, Any]] = []
        if tuple([m.training for m in self.modules]) != self.flags:
            for module, training in zip(self.modules, self.flags, strict=True):
                if module.training is not training:
                    changed.append((module, module.training))
                    module.training = training
        for ref, grad in zip(self.own, self.grads, strict=True):
            t = ref()
            if t is not None and t.requires_grad is not grad and t.is_leaf:
                changed.append((t, t.requires_grad))
                t.requires_grad_(grad)
        for i, (table, held) in enumerate(zip(self.tables, self.held, strict=True)):
            if len(table) != self.lengths[i]:
                self.unbind(changed)
                raise CheckpointError(
                    f"remat: a {type(self.modules[i // 2]).__name__} in a "
                    "checkpointed region has other parameters or buffers than in its "
                    "forward pass (one was added or deleted since), so its recompute cannot "
                    "run as the forward pass did. Change a model's parameters after "
                    "backward, not between forward and backward. FullyShardedDataParallel "
                    "(FSDP1) with use_orig_params=True does this itself: shard with "
                    "fully_shard (FSDP2) or use_orig_params=False, or give the region a "
                    "policy (the graph engine), with which it trains."
                )
            if len(table) != len(held) or not all(map(operator.is_, table.values(), held.values())):
                changed.append((table, table.copy()))
                table.clear()
                table.update(held)
        return changed or None

    @staticmethod
    def unbind(changed: list[tuple[Any, Any]]) -> None:
        """Restore what :meth:`bind` replaced."""
        for owner, value in reversed(changed):
            if isinstance(owner, nn.Module):
                owner.training = value
            elif isinstance(owner, torch.Tensor):
                owner.requires_grad_(value)
            else:
                owner.clear()
                owner.update(value)

    def describe(self, t: torch.Tensor) -> str:
        for i, (table, held) in enumerate(zip(self.tables, self.held, strict=True)):
            for name, bound in (*held.items(), *table.items()):
                if bound is t:
                    kind = "buffer" if i % 2 else "parameter"
                    return f"the {kind} {name!r} of a {type(self.modules[i // 2]).__name__}"
        return (
            f"a tensor of shape {tuple(t.shape)} that it reaches (a module attribute, a closure "
            "or a global)"
        )
