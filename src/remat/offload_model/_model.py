"""Train a model larger than the compute device's memory by keeping it on a slower tier.

``OffloadModel`` splits a sequence of modules into slices. Parameters, gradients and optimizer
state of every slice live on the *offload device*: host memory, or files on disk when even host
memory is short (CPU training of a model whose parameters and optimizer state do not fit in
RAM). A slice comes to the *compute device* only to run: for its forward, for its backward, for
its optimizer step. Only the activations at slice boundaries are kept between forward and
backward (on the offload device too), unless ``checkpoint_activation=False`` asks to keep the
slices' inner activations as well. This is the design of fairscale's ``OffloadModel`` (after
ZeRO-Offload, Ren et al. 2021, and L2L, Pudipeddi et al. 2020), with gradients bit-identical to
a plain run, random ops replayed exactly on every device type, the optimizer step streamed
slice by slice, and all-or-nothing updates when the disk fails.

NOTE [ OffloadModel design ]

1. Slices. The modules are split into ``num_slices`` contiguous groups, balanced by parameter
   bytes: the largest slice is as small as possible (``_slices.partition``), since the
   largest slice bounds the compute device's share of the model. ``slice_ranges`` lists them.
2. Order. Forward runs each slice on every micro-batch before the next slice
   (slice-major, as fairscale), so each slice moves in once per pass; backward runs the slices
   in reverse, and the micro-batches of a slice in reverse too.
3. Micro-batches. The input is split with ``x.tensor_split(num_microbatches)`` along dim 0;
   the outputs of a slice are concatenated along dim 0 and passed on whole.
4. ``checkpoint_activation=True``: a slice keeps only its input per micro-batch (on the offload
   device) and the ambient state it ran under (``_ambient.Ambient``: CPU and every initialised
   accelerator's generator, autocast). Backward reruns the slice from that input under the same
   state, with :class:`~remat._guard.WriteGuard` so that buffers are written once (Rule 3 of the
   architecture), then differentiates the rerun. ``checkpoint_activation=False``: the slice's
   graph is kept from forward, and every tensor it saves goes to the offload device through
   saved-tensor hooks (views of the slice's parameters are not copied: they are rebuilt from the
   parameters when they are back). Its graph is freed by the first backward.
5. Gradients. A slice's backward computes, per micro-batch, the gradients of its trainable
   parameters (``torch.autograd.grad``, never ``AccumulateGrad``) and sums them in reverse
   micro-batch order, which is the order in which autograd sums them in the reference run; then
   ``new = old + sum`` as ``AccumulateGrad`` does, stored on the offload device: on
   ``param.grad`` with ``"cpu"`` (host tensors), in files with ``"disk"``. Only the gradients
   the running backward asks for are computed: none in ``torch.autograd.grad(loss, [x])`` or
   ``loss.backward(inputs=[x])``, as plain autograd; and since ``AccumulateGrad`` never sees
   them, parameters with gradient hooks are refused (NOTE [ Which gradients a backward
   computes ] in ``_autograd.py``).
6. The reference that gradients equal bit for bit: the same modules run plainly on the same
   micro-batches in the same slice-major order, outputs concatenated::

       chunks = list(x.tensor_split(num_microbatches))
       for r in model.slice_ranges:
           chunks = [run modules r on c for c in chunks]
       out = torch.cat(chunks)

   With one micro-batch this is the plain model. The sums differ in two cases: a parameter
   used more than once inside one slice with several micro-batches (autograd then
   interleaves the uses of all micro-batches in one sum), and several forward passes into one
   backward onto gradients already there (each pass's slice adds its sum to the stored
   gradient, ``(old + g_a) + g_b``, where autograd adds ``old + (g_a + g_b)``).
7. Optimizer. ``configure_optimizer(factory)`` makes one optimizer per slice over the slice's
   trainable parameters. ``step()`` brings each slice's parameters, gradients and optimizer
   state in, steps, and stores the results as new copies. Element-wise optimizers (SGD, Adam,
   AdamW, ...) give the same result as one optimizer over all parameters; anything that couples
   parameters across slices (global gradient-norm clipping, LAMB's trust ratio over groups)
   does not.
8. All or nothing. Nothing already stored is overwritten: backward and ``step()`` store new
   copies, wait for every write (``flush``), and only then switch to them, dropping the old. If
   a write fails (disk full) the error is raised and the model, gradients and optimizer state
   are as they were before the call; the call's new copies are freed before the error leaves
   it (``Stored.free``), so that an error kept for reporting keeps no file. With
   ``offload_device="cpu"`` and a CPU compute device the host copies *are* the tensors and
   the step updates them in place, like a plain optimizer.

NOTE [ Life of a slice in one training step ]

For slice ``s`` of ``S``, ``M`` micro-batches, ``checkpoint_activation=True``:

1. forward, ``_SliceFunction.forward``: slice ``s+1``'s parameters start coming in (prefetch);
   ``s``'s parameters come to the compute device.
2. for each micro-batch ``m``: its input goes to the offload device; the ambient state, the
   buffers and the modules' ``training`` flags are captured; the slice runs; its output stays
   on the compute device for slice ``s+1``.
3. the parameters are let go (nothing is written: they did not change); the versions of the
   parameters and buffers at rest are noted (NOTE [ Written between forward and backward ] in
   ``_written.py``); the outputs of all micro-batches, concatenated, go on to slice ``s+1``.
4. backward, ``_SliceFunction.backward`` with the gradient of that output: the versions are
   compared (a parameter or buffer written since raises); ``s``'s parameters come in,
   ``s-1``'s start coming in.
5. for ``m = M-1 .. 0``: the input of ``m`` comes back, the slice reruns under the captured
   state and flags (the live flags come back after) and is differentiated; parameter
   gradients are summed; the input's gradient is kept.
6. ``old + sum`` is stored as a new copy (pending); parameters are let go; the concatenated
   input gradients go on to slice ``s-1``.
7. after slice 0: every write is waited for, then all pending gradients replace the old ones.
   If anything failed, the pending copies are dropped (their files removed).
8. the boundary inputs stay until the graph is freed (a second backward reruns from them).

What is where: parameters of an offloaded slice read as their host copies
(``offload_device="cpu"``) or as stand-ins that raise when used (``"disk"``, NOTE [ Stand-ins
that raise ] in ``_stand_ins.py``); buffers of an offloaded slice wait in host memory.
Gradients: with ``"cpu"`` on ``param.grad`` after backward (host tensors), so that a user's
own optimizer over ``model.parameters()``, ``clip_grad_norm_`` and ``zero_grad`` work as on a
plain model; with ``"disk"`` in files, read with :meth:`OffloadModel.named_grads`. Checkpoints:
NOTE [ OffloadModel checkpoints ] in ``_checkpoint.py``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..errors import RematError
from . import _checkpoint
from ._autograd import Pass, checked, run_slices
from ._build import (
    _check_disk_available,
    _check_disk_directory,
    _check_int,
    _device,
    _make_slices,
    _modules,
    _offload_device,
)
from ._clip import clip_grad_norm
from ._slices import Slice
from ._stand_ins import internal
from ._stored import OffloadDevice, Place, Stored

__all__ = ["OffloadModel"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class OffloadModel(nn.Module):
    """A sequence of modules trained slice by slice from host memory or disk.

    The arguments up to ``num_microbatches`` are fairscale's ``OffloadModel``'s, in its order
    and with its defaults, so that a call written for it works unchanged.

    Args:
        model: an ``nn.Sequential`` or a list of modules, each feeding the next.
        device: the compute device (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        offload_device: where parameters, gradients, optimizer state and slice-boundary
            activations wait: ``"cpu"`` or ``torch.device("cpu")`` (host memory, pinned when
            ``device`` is CUDA; gradients on ``param.grad``, so a user's own loop works) or
            ``"disk"`` (files of a :class:`~remat.store.disk.DiskTier`; meant for training on
            the CPU, also allowed with CUDA, through host memory).
        num_slices: how many contiguous groups of modules to split ``model`` into, balanced by
            parameter bytes; 1 to ``len(model)`` (default 3, as fairscale's).
        num_microbatches: the input's rows are split into this many micro-batches, each run
            through a slice before the next slice comes in.
        checkpoint_activation: keep only the slices' inputs and rerun each slice in backward
            (True), or keep every activation the slices save, on the offload device (False).
        disk_directory: where the disk tier makes its private directory (default: the system's
            temporary directory); only with ``offload_device="disk"``.

    A training step::

        model = remat.OffloadModel(layers, device="cpu", offload_device="disk", num_slices=8)
        model.configure_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
        loss = loss_fn(model(x), target)
        loss.backward()
        model.step()
        model.zero_grad()

    With ``offload_device="cpu"`` a plain loop works too (``opt =
    torch.optim.AdamW(model.parameters())``, ``clip_grad_norm_``, ``opt.step()``). With
    ``"disk"`` the parameters are stand-ins that raise when used: train with
    ``configure_optimizer`` and ``step``. Checkpoint with ``state_dict()`` and
    ``optimizer_state_dict()``.

    The forward pass takes one tensor (rows along dim 0) and returns one tensor on ``device``;
    each slice, too, must pass one tensor to the next. See NOTE [ OffloadModel design ] in this
    module for the exact semantics, and NOTE [ Life of a slice in one training step ].
    """

    def __init__(
        self,
        model: nn.Sequential | Sequence[nn.Module],
        device: str | torch.device,
        offload_device: OffloadDevice | torch.device = "cpu",
        num_slices: int = 3,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
        *,
        disk_directory: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        modules = _modules(model)
        self.device = _device(device)
        offload_device = _offload_device(offload_device)
        _check_disk_directory(disk_directory, offload_device)
        _check_int("num_slices", num_slices, 1, len(modules), "the number of modules")
        _check_int("num_microbatches", num_microbatches, 1, None, "")
        if not isinstance(checkpoint_activation, bool):
            raise RematError(
                f"remat: OffloadModel expected checkpoint_activation=True or False, found "
                f"{checkpoint_activation!r} ({type(checkpoint_activation).__name__})."
            )
        self.module = model if isinstance(model, nn.Sequential) else nn.Sequential(*modules)
        self.offload_device: OffloadDevice = offload_device
        self.num_microbatches = num_microbatches
        self.checkpoint_activation = checkpoint_activation
        if offload_device == "disk":
            _check_disk_available()
        self._place = Place(offload_device, self.device, disk_directory)
        try:
            self._slices = _make_slices(self.module, modules, num_slices, self._place)
        except BaseException:
            self._place.close()
            raise
        self._inner_prefix: str | None = None  # see NOTE [ OffloadModel checkpoints ] 1
        self.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            _checkpoint.forget_inner_missing
        )

    # -- introspection ---------------------------------------------------------------------

    @property
    def slice_ranges(self) -> tuple[range, ...]:
        """The module indices of each slice, in order."""
        return tuple(sl.span for sl in self._slices)

    @property
    def slice_bytes(self) -> tuple[int, ...]:
        """Parameter bytes of each slice."""
        return tuple(sl.nbytes for sl in self._slices)

    @property
    def disk_directory(self) -> str | None:
        """The disk tier's private directory (removed by :meth:`close`), or None."""
        return self._place.directory

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The per-slice optimizers (for learning-rate schedulers), after configure_optimizer."""
        return tuple(sl.optimizer for sl in self._slices if sl.optimizer is not None)

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(name, gradient on the CPU or None)`` for every parameter, one slice at a time."""
        cpu = torch.device("cpu")
        for sl in self._slices:
            grads = sl.load_grads(cpu)
            yield from zip(sl.names, grads, strict=True)

    # -- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x = x.to(self.device)
        if not torch.is_grad_enabled():
            # Nothing to keep for backward: each slice runs once on each micro-batch.
            chunks = list(x.tensor_split(self.num_microbatches))
            for sl in self._slices:
                with sl.on(self.device):
                    chunks = [checked(sl.run(c), sl, self.num_microbatches) for c in chunks]
            return torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        run = Pass(
            self._slices,
            self._place,
            self.device,
            self.num_microbatches,
            keep_activations=not self.checkpoint_activation,
        )
        return run_slices(run, x)

    def _check_input(self, x: object) -> None:
        if not isinstance(x, torch.Tensor):
            raise RematError(
                f"remat: OffloadModel expected one tensor as input, found {type(x).__name__}. "
                "Pass a single tensor with the batch along dim 0; pack several inputs into one "
                "tensor, or make the first module take them from a tensor."
            )
        rows = x.shape[0] if x.dim() else 0
        if rows < self.num_microbatches:
            raise RematError(
                f"remat: OffloadModel expected an input with at least num_microbatches="
                f"{self.num_microbatches} rows along dim 0, found shape {tuple(x.shape)}. Pass "
                "a larger batch or a smaller num_microbatches."
            )

    # -- optimizer -------------------------------------------------------------------------

    def configure_optimizer(self, factory: OptimizerFactory) -> None:
        """Make one optimizer per slice with ``factory(trainable params of the slice)``.

        Example: ``model.configure_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3))``.
        Its state lives on the offload device, beside the parameters.
        """
        if not callable(factory):
            raise RematError(
                f"remat: OffloadModel.configure_optimizer expected a callable from a list of "
                f"parameters to an optimizer, found {type(factory).__name__}. Pass e.g. "
                "lambda params: torch.optim.AdamW(params, lr=1e-3)."
            )
        optimizers: list[torch.optim.Optimizer | None] = []
        for sl in self._slices:
            with internal():
                params = [p for p in sl.params if p.requires_grad]
            if not params:
                optimizers.append(None)
                continue
            with internal():  # the optimizer looks at the parameters: stand-ins, on disk
                optimizer = factory(params)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise RematError(
                    f"remat: OffloadModel.configure_optimizer expected the factory to return a "
                    f"torch.optim.Optimizer, found {type(optimizer).__name__}."
                )
            given = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if given != {id(p) for p in params}:
                raise RematError(
                    f"remat: OffloadModel.configure_optimizer expected the optimizer of slice "
                    f"{sl.index} to hold exactly the {len(params)} parameters it was given, "
                    f"found {len(given)}. Build the optimizer from the list passed to the "
                    "factory."
                )
            optimizers.append(optimizer)
        for sl, made in zip(self._slices, optimizers, strict=True):
            sl.optimizer, sl.state, sl.state_keys = made, None, []

    def step(self) -> None:
        """One optimizer step, slice by slice; all or nothing (NOTE [ OffloadModel design ] 8)."""
        if all(sl.optimizer is None for sl in self._slices):
            raise RematError(
                "remat: OffloadModel.step expected optimizers, found none configured. Call "
                "model.configure_optimizer(lambda params: torch.optim.AdamW(params, lr=...)) "
                "first."
            )
        done: list[tuple[Slice, dict[Any, Any], Stored, Stored | None, list[Any]]] = []
        try:
            for sl in self._slices:
                if sl.optimizer is None or not sl.has_grads():
                    continue
                before = {p: dict(state) for p, state in sl.optimizer.state.items()}
                try:
                    new_params, new_state, keys = self._step_slice(sl)
                except BaseException:
                    sl.optimizer.state.clear()
                    sl.optimizer.state.update(before)
                    raise
                done.append((sl, before, new_params, new_state, keys))
            self._place.flush()
        except BaseException:
            # The new copies are freed now: an error kept for reporting must not keep their
            # files (see NOTE [ OffloadModel design ] 8).
            for sl, before, new_params, new_state, _ in done:
                assert sl.optimizer is not None
                sl.optimizer.state.clear()
                sl.optimizer.state.update(before)
                sl.unload()
                for new in (new_params, new_state):
                    if new is not None and new is not sl.stored:
                        new.free()
            raise
        for sl, _, new_params, new_state, keys in done:
            sl.stored, sl.state, sl.state_keys = new_params, new_state, keys

    def _step_slice(self, sl: Slice) -> tuple[Stored, Stored | None, list[Any]]:
        assert sl.optimizer is not None
        held = [p.grad for p in sl.params] if sl.grads_on_params else None
        new_params: Stored | None = None
        sl.load(self.device)
        try:
            try:
                for p, g in zip(sl.params, sl.load_grads(self.device), strict=True):
                    p.grad = g
                sl.load_state(self.device)
                sl.optimizer.step()
                if self._place.in_place:
                    new_params = sl.stored
                else:
                    new_params = self._place.store(list(sl.params))
                new_state, keys = sl.store_state()
            finally:
                for p in sl.params:
                    p.grad = None
        except BaseException:
            if new_params is not None and new_params is not sl.stored:
                new_params.free()
            sl.unload()
            _restore_grads(sl, held)
            raise
        sl.unload(new_params)
        _restore_grads(sl, held)
        return new_params, new_state, keys

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every gradient, also with ``"disk"``, where
        it runs slice by slice (``_clip.py``); returns the total norm before clipping."""
        if self.offload_device == "cpu":
            return torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)
        return clip_grad_norm(self._slices, self._place, float(max_norm), float(norm_type))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients (``set_to_none=False``: make them zeros instead)."""
        for sl in self._slices:
            sl.clear_grads(set_to_none)
        self._place.flush()

    # -- checkpoints: NOTE [ OffloadModel checkpoints ] in _checkpoint.py -------------------

    def state_dict(  # type: ignore[override]
        self,
        *args: Any,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        """The wrapped model's state dict: its keys (after ``prefix``, as a parent module
        passes it), every tensor's real value gathered to the CPU. ``keep_vars`` is ignored:
        the parameters' values are copies, the parameters may be stand-ins."""
        if args:
            raise RematError(
                "remat: OffloadModel.state_dict expected keyword arguments only (destination=, "
                "prefix=, keep_vars=), found positional ones. Pass them by name."
            )
        out: dict[str, Any] = OrderedDict() if destination is None else destination
        for key, value in _checkpoint.gather(self.module, self._slices).items():
            out[prefix + key] = value
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Copy a state dict of the wrapped model in; all or nothing, like ``step()``."""
        if assign:
            raise RematError(
                "remat: OffloadModel.load_state_dict expected assign=False, found True: the "
                "offloaded copies are OffloadModel's own. Drop assign=True."
            )
        own = _checkpoint.own_keys(self.module)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RematError(
                f"remat: OffloadModel.load_state_dict expected the wrapped model's keys, found "
                f"{len(missing)} missing ({', '.join(missing[:5])}) and {len(unexpected)} "
                f"unexpected ({', '.join(unexpected[:5])}). Pass strict=False to load a subset."
            )
        _checkpoint.load(self.module, self._slices, self._place, state_dict)
        return _IncompatibleKeys(missing, unexpected)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A parent's load_state_dict: take this model's keys out (NOTE point 1).
        own = _checkpoint.own_keys(self.module)
        mine = {}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            value = state_dict.pop(key)
            if key[len(prefix) :] in own:
                mine[key[len(prefix) :]] = value
            else:
                unexpected_keys.append(key)
        missing_keys.extend(prefix + k for k in own if k not in mine)
        self._inner_prefix = prefix + "module."
        _checkpoint.load(self.module, self._slices, self._place, mine)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The per-slice optimizers' state with real values on the CPU, for ``torch.save``:
        ``{"slices": [slice 0's optimizer.state_dict() or None, ...]}``."""
        return _checkpoint.optimizer_state(self._slices)

    def load_optimizer_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`optimizer_state_dict` returned, after ``configure_optimizer``
        with the same factory; all or nothing."""
        _checkpoint.load_optimizer_state(self._slices, self._place, self.device, state_dict)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self.offload_device == "disk":
            _refuse_copy()
        return super().__reduce_ex__(protocol)

    # -- placement -------------------------------------------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> OffloadModel:
        raise RematError(
            "remat: OffloadModel places its parameters itself, found a call that moves or "
            "converts them (.to, .cuda, .half...). Convert the model before wrapping it, and "
            "pass the compute device as OffloadModel(..., device=...)."
        )

    def close(self) -> None:
        """Remove the offloaded files now (also done when the model is collected or at exit).
        The model cannot be used afterwards."""
        self._place.close()

    def extra_repr(self) -> str:
        return (
            f"device={self.device}, offload_device={self.offload_device!r}, "
            f"num_slices={len(self._slices)}, num_microbatches={self.num_microbatches}, "
            f"checkpoint_activation={self.checkpoint_activation}"
        )


def _restore_grads(sl: Slice, held: list[torch.Tensor | None] | None) -> None:
    if held is not None:
        for p, g in zip(sl.params, held, strict=True):
            p.grad = g


def _refuse_copy() -> NoReturn:
    raise RematError(
        "remat: OffloadModel expected offload_device='cpu' to be copied or pickled, found "
        "offload_device='disk': its parameters live in files of its own disk tier. Save "
        "model.state_dict() and model.optimizer_state_dict() with torch.save and load them "
        "into a new OffloadModel."
    )
