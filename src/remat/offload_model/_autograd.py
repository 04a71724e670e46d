"""One forward pass of an :class:`~remat.OffloadModel`, and the autograd node of each slice.

Each slice is one :class:`_SliceFunction` node in the caller's graph: its forward runs the slice
on every micro-batch and returns their outputs concatenated, on the compute device; its backward
brings the slice back, computes the gradients of its input and parameters micro-batch by
micro-batch, and sends the parameter gradients to the offload device. A :class:`Pass` holds what
the backward of the slices needs; the nodes hold the pass, so it lives as long as the graph.
See NOTE [ Life of a slice in one training step ] in ``_model.py``.

NOTE [ Which gradients a backward computes ]

Plain autograd writes ``param.grad`` only in a backward that asks for it: ``loss.backward()``
asks for every leaf, ``loss.backward(inputs=[x])`` and ``torch.autograd.grad(loss, [x])`` for
``x`` alone (gradient penalties and saliency maps rely on the parameters' gradients staying as
they were). A slice computes its parameters' gradients itself, so it must ask the engine which
of them the running backward wants:

1. The trainable parameters of a slice are inputs of its node, so that their
   ``AccumulateGrad`` nodes are in the graph; the node returns None for them (the slice stores
   the gradients itself, summed over micro-batches), and ``AccumulateGrad`` does nothing with
   None. ``torch._C._will_engine_execute_node`` on each parameter's node says whether this
   backward asks for it: always in ``loss.backward()``, for the parameters named in
   ``backward(inputs=...)``, never in ``autograd.grad(loss, [x])``. Only the asked gradients
   are computed and committed; with none asked and no input gradient needed, the slice is not
   even brought in.
2. ``autograd.grad`` over a parameter would capture its gradient from the node's output, which
   is None: the engine refuses the question for such a captured leaf, and the slice raises a
   ``RematError`` instead of returning nothing.
3. The gradients are committed by the last slice the backward runs through: slice 0, or the
   first slice whose predecessor the engine will not run (``backward(inputs=...)`` naming
   parameters of later slices only).
4. Being an ``AccumulateGrad`` input with None also makes torch call a parameter's tensor hooks
   with None, and its gradient never passes through ``AccumulateGrad``: parameters with
   ``register_hook`` or ``register_post_accumulate_grad_hook`` hooks are refused
   (``refuse_hooks``), at forward and again at backward.
5. The pass's ``dummy`` input keeps every slice's node in ``loss.backward()``'s graph when the
   model's input needs no gradient and a slice has no trainable parameter, so that slice 0
   still runs and commits.

On a CUDA compute device a parameter's ``AccumulateGrad`` node changes when the slice moves it
there (torch forgets it on a change of device), so ``backward(inputs=[param])`` does not find
the parameter in the graph; ``loss.backward()`` and backwards over inputs are unaffected.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .. import _state
from .._ambient import (
    Ambient,
    GeneratorStates,
    set_generators,
    unlisted_generator,
)
from .._guard import UNDO_LIMIT, Undo, WriteGuard, generators_in, undoable
from ..errors import RematError
from ._slices import Slice
from ._stand_ins import internal
from ._stored import Place, Stored
from ._written import Versions, buffer_versions, written_since

__all__: list[str] = []


@dataclass
class _Kept:
    """The graph of one slice on one micro-batch, kept from forward (checkpoint_activation
    False). It refers to its ends by edge, so that neither end's values stay alive."""

    output: GradientEdge | None  # None when nothing in the slice requires grad
    source: GradientEdge | None  # where the micro-batch entered; None if it needs no grad
    params: dict[int, GradientEdge]  # of the trainable parameters, by position in the slice


@dataclass(frozen=True)
class _ParamView:
    """A saved tensor that is a view of a slice parameter: rebuilt from the loaded parameter
    instead of being offloaded a second time."""

    storage: int  # index into the slice's parameter storages
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Source(torch.autograd.Function):
    """Identity marking where a micro-batch enters a kept slice graph (see :class:`_Kept`)."""

    @staticmethod
    def forward(ctx: Any, dummy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


class Pass:
    """What one forward call of an OffloadModel leaves for its backward."""

    def __init__(
        self,
        slices: list[Slice],
        place: Place,
        device: torch.device,
        microbatches: int,
        keep_activations: bool,
    ) -> None:
        self.slices = slices
        self.place = place
        self.device = device
        self.microbatches = microbatches
        self.keep = keep_activations
        n = len(slices)
        self.inputs: list[list[Stored]] = [[] for _ in range(n)]
        # Per slice and micro-batch, the state its forward pass ran under: the ambient state
        # and the explicit generators of its modules ([ Explicit generators ] in _ambient.py).
        self.ambients: list[list[tuple[Ambient, GeneratorStates, _State]]] = [[] for _ in range(n)]
        self.kept: list[list[_Kept] | None] = [[] for _ in range(n)]
        self.rows: list[list[int]] = [[] for _ in range(n)]
        self.pending: dict[int, tuple[Stored | None, list[int]]] = {}
        # Per slice, its parameters and buffers as its forward pass left them: NOTE [ Written
        # between forward and backward ] in _written.py.
        self.versions: list[Versions | None] = [None] * n
        self.dummy = torch.empty(0, requires_grad=True)

    def release(self) -> None:
        """Forget everything stored for backward (files are removed)."""
        self.inputs = [[] for _ in self.slices]
        self.ambients = [[] for _ in self.slices]
        self.kept = [None for _ in self.slices]
        self.versions = [None for _ in self.slices]
        self.drop_pending()

    def drop_pending(self) -> None:
        """Free the gradients of a backward that failed: now, not when an error's traceback
        lets go of them (see [ Life of a slice in one training step ] step 7)."""
        for stored, _ in self.pending.values():
            if stored is not None:
                stored.free()
        self.pending.clear()

    # -- forward ---------------------------------------------------------------------------

    def forward_slice(self, index: int, x: torch.Tensor, input_grad: bool) -> torch.Tensor:
        sl = self.slices[index]
        if index + 1 < len(self.slices):
            self.slices[index + 1].prefetch(self.device)
        chunks = x.tensor_split(self.microbatches) if self.microbatches > 1 else (x,)
        outs = []
        with sl.on(self.device):
            buffers = buffer_versions(sl)
            for xm in chunks:
                if self.keep:
                    out = self._forward_kept(sl, xm, input_grad)
                else:
                    out = self._forward_recomputed(sl, xm, input_grad)
                outs.append(out)
            written = written_since(sl, buffers)
        self.versions[index] = Versions(sl, written)  # at rest: see [ Written between ... ] 1
        self.rows[index] = [o.shape[0] if o.dim() else 1 for o in outs]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _forward_recomputed(self, sl: Slice, xm: torch.Tensor, input_grad: bool) -> torch.Tensor:
        # See [ Life of a slice in one training step ] step 2.
        self.inputs[sl.index].append(self.place.store([xm.clone() if self.place.in_place else xm]))
        ambient = Ambient.capture(preserve_rng_state=True)
        explicit = [(g, g.get_state()) for g in generators_in(sl.modules)]
        state = _State(sl)
        with torch.enable_grad():
            # As in the reference and in the recompute: some kernels choose their algorithm by
            # whether autograd records (attention backends), so forward records too.
            out = checked(sl.run(xm.detach().requires_grad_(input_grad)), sl, self.microbatches)
        ambient.check_forward_done()
        state.forward_done()
        self.ambients[sl.index].append((ambient, explicit, state))
        return out.detach()

    def _forward_kept(self, sl: Slice, xm: torch.Tensor, input_grad: bool) -> torch.Tensor:
        storages = list(sl.storages())
        index = {ptr: i for i, ptr in enumerate(storages)}
        # The hooks live in the saved variables of the graph that ``self.kept`` holds edges
        # of: a hook that held ``self`` would close a cycle through autograd's C++ nodes,
        # which the garbage collector cannot see, and a forward never followed by a backward
        # would never be freed.
        place = self.place

        def pack(t: torch.Tensor) -> Any:
            ptr = t.untyped_storage().data_ptr()
            if ptr in index:
                return _ParamView(
                    index[ptr], t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset())
                )
            return (place.store([t]), t.device)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _ParamView):
                storage = list(sl.storages().values())[packed.storage]
                return torch.empty(0, dtype=packed.dtype, device=storage.device).set_(
                    storage, packed.offset, packed.size, packed.stride
                )
            stored, device = packed
            return stored.load(device)[0]  # type: ignore[no-any-return]

        with torch.enable_grad():
            src: torch.Tensor = (
                _Source.apply(self.dummy, xm.detach())  # type: ignore[no-untyped-call]
                if input_grad
                else xm.detach()
            )
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = checked(sl.run(src), sl, self.microbatches)
        kept = self.kept[sl.index]
        assert kept is not None
        kept.append(
            _Kept(
                output=get_gradient_edge(out) if out.requires_grad else None,
                source=get_gradient_edge(src) if input_grad else None,
                params={i: get_gradient_edge(sl.params[i]) for i in trainable(sl)},
            )
        )
        return out.detach()

    # -- backward --------------------------------------------------------------------------

    def backward_slice(
        self, index: int, grad: torch.Tensor, input_grad: bool, asked: list[int]
    ) -> torch.Tensor | None:
        """The gradient of the slice's input (if ``input_grad``); the gradients of the
        parameters at positions ``asked`` go to ``self.pending``, the others are not computed
        (NOTE [ Which gradients a backward computes ])."""
        sl = self.slices[index]
        refuse_hooks(sl)
        if not self.inputs[index] and not self.kept[index]:
            raise RematError(
                f"remat: OffloadModel expected the stored activations of slice {index} for "
                "this backward, found them freed: with checkpoint_activation=False the slices' "
                "graphs are freed by the first backward (as retain_graph=False would), or the "
                "forward failed. Run forward again, or use checkpoint_activation=True to run "
                "backward twice over one forward."
            )
        acc: list[torch.Tensor | None] = [None] * len(sl.params)
        chunks: tuple[torch.Tensor, ...] = (grad,)
        if self.microbatches > 1:
            chunks = grad.split(self.rows[index])  # type: ignore[no-untyped-call]
        input_grads: list[torch.Tensor | None] = [None] * self.microbatches
        if not asked and not input_grad:
            # Nothing of this slice is asked for: no need to bring it in and rerun it.
            self.free_kept(index)
            return None
        versions = self.versions[index]
        if versions is not None:
            versions.check(sl)
        if index > 0:
            self.slices[index - 1].prefetch(self.device)
        with sl.on(self.device):
            # Micro-batches in reverse: the order in which autograd accumulates the gradients
            # of the reference run (see [ Life of a slice in one training step ] step 5).
            for m in reversed(range(self.microbatches)):
                if self.keep:
                    g_input, g_params = self._backward_kept(index, m, chunks[m], input_grad, asked)
                else:
                    g_input, g_params = self._backward_recomputed(
                        sl, m, chunks[m], input_grad, asked
                    )
                input_grads[m] = g_input
                for position, g in zip(asked, g_params, strict=True):
                    if g is not None:
                        previous = acc[position]
                        acc[position] = g if previous is None else previous + g
            if any(g is not None for g in acc):
                # Like AccumulateGrad: new = old + sum over this backward's micro-batches.
                old = sl.load_grads(self.device)
                total = [
                    o if a is None else (a if o is None else o + a)
                    for o, a in zip(old, acc, strict=True)
                ]
                self.pending[index] = sl.store_grads(total)
        self.free_kept(index)
        if not input_grad:
            return None
        parts = [
            torch.zeros_like(c) if g is None else g
            for g, c in zip(input_grads, chunks, strict=True)
        ]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def free_kept(self, index: int) -> None:
        """A kept slice graph is freed by the backward that ran through it, as autograd
        frees a graph (retain_graph=False)."""
        if self.keep:
            self.kept[index] = None

    def _backward_recomputed(
        self, sl: Slice, m: int, grad: torch.Tensor, input_grad: bool, asked: list[int]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        inputs = self.inputs[sl.index]
        if m > 0:
            inputs[m - 1].prefetch(self.device)
        xm = inputs[m].load(self.device)[0].detach().requires_grad_(input_grad)
        ambient, explicit, state = self.ambients[sl.index][m]
        guard, undo = state.replay(explicit)
        drawn = set_generators(explicit) if explicit else None
        try:
            try:
                with (
                    torch.enable_grad(),
                    _state.recomputing(),
                    ambient.replay(),
                    guard,
                    state.modes(),
                ):
                    out = checked(sl.run(xm), sl, self.microbatches)
            finally:
                if drawn is not None:
                    set_generators(drawn)
            if guard.unlisted is not None:
                raise unlisted_generator(guard.unlisted, "slice of an OffloadModel")
            if guard.stale is not None:
                raise RematError(
                    "remat: OffloadModel(checkpoint_activation=True) recomputes a slice that "
                    f"reads a buffer of shape {tuple(guard.stale.shape)} before updating it, and "
                    f"the slice's buffers hold more than {UNDO_LIMIT} bytes, too many to "
                    "snapshot in forward: the recompute would read the update and the gradients "
                    "would be wrong. Keep the module that reads and updates this buffer out of "
                    "the offloaded layers, or use checkpoint_activation=False."
                )
            # A parameter that stopped requiring grad after forward cannot be differentiated
            # in the rerun: it gets no gradient.
            rerun = [i for i in asked if sl.params[i].requires_grad]
            wanted: list[torch.Tensor] = [sl.params[i] for i in rerun]
            if input_grad:
                wanted.insert(0, xm)
            g_input, found = _grads(out if out.requires_grad else None, wanted, grad, input_grad)
            by_position = dict(zip(rerun, found, strict=True))
            return g_input, [by_position.get(i) for i in asked]
        finally:
            # After the rerun's backward, which checks the versions of the buffers it saved.
            if undo is not None:
                undo.close()

    def _backward_kept(
        self, index: int, m: int, grad: torch.Tensor, input_grad: bool, asked: list[int]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        kept = self.kept[index]
        assert kept is not None
        graph = kept[m]
        wanted: list[GradientEdge] = [graph.params[i] for i in asked]
        if input_grad:
            assert graph.source is not None
            wanted.insert(0, graph.source)
        return _grads(graph.output, wanted, grad, input_grad)

    def commit(self) -> None:
        """The last slice's backward is done: make the new gradients the slices' gradients,
        once every byte of them is safely stored (else raise, and keep the old ones)."""
        self.place.flush()
        for index, (stored, positions) in self.pending.items():
            self.slices[index].commit_grads(stored, positions)
        self.pending.clear()


class _State:
    """The buffers of a slice as one micro-batch's forward pass found them, for its recompute
    to start from: NOTE [ State read, then written ] in ``_guard.py``. Buffers are named by
    module and key, since loading a slice to another device replaces them. Also the modules'
    ``training`` flags, so that ``model.eval()`` between forward and backward does not change
    Dropout or BatchNorm in the recompute (as for the region engine: NOTE [ A recompute reads
    what its forward pass read ] 3 in ``_reads.py``)."""

    def __init__(self, sl: Slice) -> None:
        self.flags = [(m, m.training) for module in sl.modules for m in module.modules()]
        self.names = [
            (owner, name)
            for module in sl.modules
            for owner in module.modules()
            for name, b in owner._buffers.items()
            if b is not None and not b.requires_grad
        ]
        tensors = self.tensors()
        small = sum(t.numel() * t.element_size() for t in tensors) <= UNDO_LIMIT
        can = small and undoable(tensors, [])
        self.snapshot = [t.detach().clone() for t in tensors] if can else None
        self.versions = [t._version for t in tensors]
        self.written: list[int] = []

    def tensors(self) -> list[torch.Tensor]:
        return [owner._buffers[name] for owner, name in self.names]  # type: ignore[misc]

    def forward_done(self) -> None:
        """Note which buffers the forward pass wrote (their versions moved)."""
        tensors = self.tensors()
        pairs = zip(tensors, self.versions, strict=True)
        self.written = [i for i, (t, v) in enumerate(pairs) if t._version != v]

    @contextmanager
    def modes(self) -> Iterator[None]:
        """The forward pass's ``training`` flags for the block; the live ones after it, also
        when it raises."""
        live = [m.training for m, _ in self.flags]
        try:
            for m, training in self.flags:
                m.training = training
            yield
        finally:
            for (m, _), training in zip(self.flags, live, strict=True):
                m.training = training

    def replay(self, generators: GeneratorStates) -> tuple[WriteGuard, Undo | None]:
        """The guard for the recompute and, with a snapshot, the undo that puts the live
        buffers back after it; the buffers hold the snapshot until then."""
        tensors = self.tensors()
        written = [tensors[i] for i in self.written]
        if self.snapshot is None:
            return WriteGuard(None, generators, state=tensors, written=written), None
        undo = Undo(tensors)
        with torch.no_grad():
            for t, value in zip(tensors, self.snapshot, strict=True):
                t.copy_(value)
        return WriteGuard(tensors, generators, lands=True, state=tensors, written=written), undo


def _grads(
    output: torch.Tensor | GradientEdge | None,
    wanted: list[Any],
    grad: torch.Tensor,
    input_grad: bool,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """Gradients of ``wanted`` (input first when ``input_grad``), then split off the input's."""
    if output is None or not wanted:
        found: list[torch.Tensor | None] = [None] * len(wanted)
    else:
        outputs: list[Any] = [output]
        found = list(torch.autograd.grad(outputs, wanted, grad_outputs=[grad], allow_unused=True))
    if input_grad:
        return found[0], found[1:]
    return None, found


def checked(out: object, sl: Slice, microbatches: int) -> torch.Tensor:
    last = sl.span.stop - 1
    if not isinstance(out, torch.Tensor):
        raise RematError(
            f"remat: OffloadModel expected module {last} (the last of slice {sl.index}) to "
            f"return one tensor, found {type(out).__name__}. Each slice passes one tensor to "
            "the next; wrap modules that return tuples or dicts so that they return a tensor, "
            "or choose num_slices so that such modules are not at the end of a slice."
        )
    if microbatches > 1 and out.dim() == 0:
        raise RematError(
            f"remat: OffloadModel expected module {last} (the last of slice {sl.index}) to "
            f"return a tensor with a batch dimension, found a 0-d tensor with "
            f"num_microbatches={microbatches}: micro-batch outputs are concatenated along "
            "dim 0. Compute a scalar loss outside the model, on its output."
        )
    return out


class _SliceFunction(torch.autograd.Function):
    """One slice as one autograd node: see the module docstring. Its inputs are the pass, the
    slice's index, the pass's dummy, the slice's input and the slice's trainable parameters;
    the parameters are there only to be asked about (NOTE [ Which gradients a backward
    computes ]): the node returns no gradient for them."""

    @staticmethod
    def forward(
        ctx: Any, run: Pass, index: int, dummy: torch.Tensor, x: torch.Tensor, *params: Any
    ) -> torch.Tensor:
        ctx.run = run
        ctx.index = index
        ctx.positions = trainable(run.slices[index])
        assert len(ctx.positions) == len(params)
        return run.forward_slice(index, x, bool(ctx.needs_input_grad[3]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        run: Pass = ctx.run
        if torch.is_grad_enabled():
            run.release()
            raise RematError(
                "remat: OffloadModel expected a first-order backward, found create_graph=True: "
                "gradients of gradients through offloaded slices are not supported. Call "
                "backward() without create_graph."
            )
        try:
            asked = _asked(ctx, run.slices[ctx.index])
            input_grad = run.backward_slice(ctx.index, grad, bool(ctx.needs_input_grad[3]), asked)
            # The last slice this backward runs through commits: slice 0, or the first slice
            # whose input's node (the slice before) the engine will not run, as in a
            # backward(inputs=[...]) that asks for parameters of later slices only.
            previous = ctx.next_functions[1][0]  # one entry per tensor input: dummy, x, params
            if ctx.index == 0 or not torch._C._will_engine_execute_node(previous):
                run.commit()
        except BaseException:
            run.drop_pending()  # gradients stay as they were before this backward
            raise
        return (None, None, None, input_grad, *([None] * len(ctx.positions)))


def trainable(sl: Slice) -> list[int]:
    """Positions of the slice's parameters that require grad."""
    with internal():  # parked parameters raise on every touch but this one
        return [i for i, p in enumerate(sl.params) if p.requires_grad]


def _asked(ctx: Any, sl: Slice) -> list[int]:
    """Positions of the parameters whose gradient the running backward asks for: NOTE [ Which
    gradients a backward computes ]."""
    asked = []
    for position, (node, _) in zip(ctx.positions, ctx.next_functions[2:], strict=True):
        try:
            will_run = torch._C._will_engine_execute_node(node)
        except RuntimeError:
            # Raised for a leaf's node that autograd.grad captures instead of running.
            raise RematError(
                f"remat: OffloadModel expected torch.autograd.grad to ask for gradients of "
                f"tensors outside the model (its input, say), found it asking for the "
                f"gradient of parameter {sl.names[position]!r}: OffloadModel computes "
                "parameter gradients itself, slice by slice, and hands them to param.grad, "
                "not to autograd.grad. Call loss.backward(), or loss.backward(inputs=[...]) "
                "naming the parameters, and read param.grad."
            ) from None
        if will_run:
            asked.append(position)
    return asked


def refuse_hooks(sl: Slice) -> None:
    """Refuse gradient hooks on the slice's parameters: torch would run a tensor hook on each
    micro-batch's part of the gradient (in the slice's own ``autograd.grad``) and once more
    with None (the node returns no gradient for the parameters), and never a post-accumulate
    hook, since the gradient is stored by the slice, not by ``AccumulateGrad``."""
    with internal():
        for name, p in zip(sl.names, sl.params, strict=True):
            kinds = [
                kind
                for kind, hooks in (
                    ("register_hook", p._backward_hooks),
                    ("register_post_accumulate_grad_hook", p._post_accumulate_grad_hooks),
                )
                if hooks
            ]
            if kinds:
                raise RematError(
                    f"remat: OffloadModel expected parameters without gradient hooks, found "
                    f"{' and '.join(kinds)} on {name!r}: OffloadModel sums each parameter's "
                    "gradient over micro-batches and stores it on the offload device itself, "
                    "so torch would run such a hook on partial gradients, or never. Remove "
                    "the hook (handle.remove()) and apply it to the gradients after backward "
                    "(param.grad, or model.named_grads() with offload_device='disk'), or keep "
                    "this module out of the OffloadModel."
                )


def run_slices(run: Pass, x: torch.Tensor) -> torch.Tensor:
    """The forward pass through every slice, recorded as one node per slice."""
    try:
        for sl in run.slices:
            refuse_hooks(sl)
        for sl in run.slices:
            params = [sl.params[i] for i in trainable(sl)]
            x = _SliceFunction.apply(run, sl.index, run.dummy, x, *params)  # type: ignore[no-untyped-call]
    except BaseException:
        run.release()
        raise
    return x
