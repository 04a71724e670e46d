"""Skip connections: @skippable in a plain nn.Sequential, namespaces, wiring errors, and the
life of a skip tensor through a portal at each event of NOTE [ Life of a tensor through a
portal ] (remat/pipe/skip/portal.py), with weak references to show when it is freed."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.pipe import Namespace, Pipe, pop, skippable, stash, verify_skippables
from remat.pipe.skip import portal as portal_module
from remat.pipe.skip.portal import Portal

from helpers import Fail

# -- modules ---------------------------------------------------------------------------------

Log = list[tuple[Any, ...]]


@skippable(stash=["s"])
class Stash(nn.Module):
    """Stashes s = 2x, a fresh tensor nothing else keeps; returns sin(x), which saves x."""

    def __init__(self, log: Log, refs: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__()
        self.log = log
        self.refs = refs

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        s = x * 2.0
        if not remat.is_recomputing():
            self.refs.append(weakref.ref(s))
        self.log.append(("stash layer", remat.is_recomputing()))
        yield stash("s", s)
        return x.sin()


@skippable(pop=["s"])
class PopThenLinear(nn.Module):
    """Pops s, adds it, then a Linear saves the sum: a recompute must run through the pop."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        s = yield pop("s")
        return self.linear(x + s)


@skippable(pop=["s"])
class PopAdd(nn.Module):
    """Pops s and adds it; saves nothing, so a recompute may stop before it."""

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        s = yield pop("s")
        return x + s


class Observe:
    """Logs every portal event with what the portal holds then."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def __call__(self, portal: Portal, event: str) -> None:
        self.log.append(
            (event, portal.tensor is not None, portal.tensor_life, remat.is_recomputing())
        )


@pytest.fixture
def log() -> Iterator[Log]:
    entries: Log = []
    observer = Observe(entries)
    portal_module.observers.append(observer)
    try:
        yield entries
    finally:
        portal_module.observers.remove(observer)


def two_partitions(
    pop_layer: nn.Module, log: Log, refs: list[Any], mode: str, chunks: int = 1
) -> Pipe:
    torch.manual_seed(0)
    model = nn.Sequential(Stash(log, refs), nn.Linear(4, 4), nn.Linear(4, 4), pop_layer)
    return Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=chunks, checkpoint=mode)  # type: ignore[arg-type]


# -- portal lives ----------------------------------------------------------------------------


def test_portal_life_without_checkpointing(log: Log) -> None:
    """Life 1: [1] blue holds s; [2] the forward pop takes it and the portal drops it; s is
    freed then, since nothing else holds it; [4] and [6] carry the gradient."""
    refs: list[weakref.ref[torch.Tensor]] = []
    pipe = two_partitions(PopThenLinear(), log, refs, "never")
    x = torch.randn(3, 4, requires_grad=True)
    out = pipe(x)
    assert log == [
        ("stash layer", False),
        ("blue", True, 1, False),
        ("orange", False, 0, False),
    ]
    assert refs[0]() is None, "the skip tensor outlived its pop"
    log.clear()
    out.sum().backward()
    assert log == [("orange backward", False, 0, False), ("blue backward", False, 0, False)]
    assert x.grad is not None


def test_portal_life_checkpointed_recompute_takes_the_tensor(log: Log) -> None:
    """Life 2: [2] the forward pop leaves s in the portal (life 1); [3] the recompute of the
    popping partition takes it (life 0) and s is freed before [4]; [5] the recompute of the
    stashing partition stashes again without touching the portal; [6] releases nothing."""
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at: list[bool] = []
    pipe = two_partitions(PopThenLinear(), log, refs, "always")
    x = torch.randn(3, 4, requires_grad=True)
    out = pipe(x)
    assert log == [
        ("stash layer", False),
        ("blue", True, 2, False),
        ("orange", True, 1, False),
    ]
    assert refs[0]() is not None, "a checkpointed micro-batch needs s again in backward"
    log.clear()

    def check_freed(portal: Portal, event: str) -> None:
        if event == "orange backward":
            alive_at.append(refs[0]() is not None)

    portal_module.observers.append(check_freed)
    try:
        out.sum().backward()
    finally:
        portal_module.observers.remove(check_freed)
    assert log == [
        ("orange", False, 0, True),  # [3]
        ("orange backward", False, 0, False),  # [4]
        ("stash layer", True),  # [5]
        ("blue backward", False, 0, False),  # [6]
    ]
    assert alive_at == [False]
    assert refs[0]() is None


def test_portal_life_checkpointed_recompute_stops_before_pop(log: Log) -> None:
    """When nothing after the pop is saved the recompute stops before it: [3] never happens,
    s stays in the portal (life 1) through [4] and is dropped at [6]."""
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_at: dict[str, bool] = {}
    pipe = two_partitions(PopAdd(), log, refs, "always")
    x = torch.randn(3, 4, requires_grad=True)
    out = pipe(x)
    log.clear()

    def check(portal: Portal, event: str) -> None:
        alive_at[event] = refs[0]() is not None

    portal_module.observers.append(check)
    try:
        out.sum().backward()
    finally:
        portal_module.observers.remove(check)
    assert log == [
        ("orange backward", True, 1, False),
        ("stash layer", True),
        ("blue backward", False, 0, False),
    ]
    assert alive_at == {"orange backward": True, "blue backward": False}
    assert refs[0]() is None


def test_skip_tensors_of_every_microbatch_freed_after_backward() -> None:
    """Every micro-batch's skip tensor is freed without gc once backward is done, for each
    checkpoint mode (no reference cycle holds a portal or its tensor)."""
    for mode in ("never", "except_last", "always"):
        refs: list[weakref.ref[torch.Tensor]] = []
        pipe = two_partitions(PopThenLinear(), [], refs, mode, chunks=4)
        gc.disable()
        try:
            pipe(torch.randn(8, 4, requires_grad=True)).sum().backward()
            assert len(refs) == 4
            assert all(r() is None for r in refs), mode
        finally:
            gc.enable()


def test_second_backward_through_checkpointed_portal_says_why() -> None:
    pipe = two_partitions(PopThenLinear(), [], [], "always")
    out = pipe(torch.randn(2, 4, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(remat.RematError, match=r"skip tensor 's'.*retain_graph=True.*never"):
        out.backward()


def test_skip_within_one_partition_needs_no_portal(log: Log) -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    model = nn.Sequential(Stash([], refs), nn.Linear(4, 4), PopAdd(), nn.Linear(4, 4))
    pipe = Pipe(model, balance=[3, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    pipe(torch.randn(4, 4, requires_grad=True)).sum().backward()
    assert log == []


@skippable(stash=["s"])
class StashMasked(nn.Module):
    """Takes (mask, h), a mask that needs no grad first: the micro-batch's phony dependencies
    ride on the mask. Stashes lin(h) and passes both on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> Iterator[Any]:
        mask, h = inputs
        h = self.linear(h)
        yield stash("s", h)
        return mask, h


class Masked(nn.Module):
    """lin(h) * mask saves the mask only while the mask needs no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> Any:
        mask, h = inputs
        return mask, self.linear(h) * mask


@skippable(pop=["s"])
class PopMasked(nn.Module):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> Iterator[Any]:
        _, h = inputs
        s = yield pop("s")
        return h + s


@skippable(stash=["s"])
class StashBranch(nn.Module):
    """Stashes a computed branch and returns its input, which needs no grad."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        yield stash("s", self.linear(x))
        return x


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
@pytest.mark.parametrize("shape", ["tuple", "tensor"])
def test_stash_before_a_micro_batch_that_needs_no_grad_recomputes_as_forward(
    mode: str, shape: str
) -> None:
    """The stash joins the micro-batch to a phony that requires grad, so the micro-batch
    requires grad after it; the recompute of the stashing partition must do the same, or the
    layers after the stash save other tensors than in forward (it raised CheckpointError:
    "forward saved 5 tensors; the recompute saved only 4"). Reference: the plain model on the
    same micro-batches, outputs concatenated, one backward; gradients torch.equal."""
    torch.manual_seed(0)
    if shape == "tuple":
        model = nn.Sequential(StashMasked(), Masked(), PopMasked())
        inputs: Any = (torch.ones(4, 4), torch.randn(4, 4))
        pieces = list(zip(*(t.tensor_split(2) for t in inputs), strict=True))
    else:
        model = nn.Sequential(StashBranch(), nn.Linear(4, 4), PopAdd())
        inputs = torch.randn(4, 4)
        pieces = list(inputs.tensor_split(2))
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint=mode)  # type: ignore[arg-type]
    out_ref = torch.cat([ref(piece) for piece in pieces])
    out_pipe = pipe(inputs)
    out_ref.square().sum().backward()
    out_pipe.square().sum().backward()
    assert torch.equal(out_ref, out_pipe)
    for (name, p), q in zip(ref.named_parameters(), pipe.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]


@skippable(stash=["s"])
class StashEmbedding(nn.Module):
    """Stashes the embedding of token ids and passes the ids (an integer tensor) on."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> Iterator[Any]:
        yield stash("s", self.embedding(ids))
        return ids


class Ones(nn.Module):
    """A tensor of its input's shape without autograd history (queries of a decoder, say)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x)


@skippable(pop=["s"])
class PopEmbedding(nn.Module):
    """Pops s and adds its own embedding of the ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> Iterator[Any]:
        s = yield pop("s")
        return s + self.embedding(ids)


@skippable(pop=["s"])
class PopScale(nn.Module):
    """Pops s and multiplies it by lin(x); lin and mul save tensors, so recomputes pop."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        s = yield pop("s")
        return self.linear(x) * s


def main_path_without_grad(kind: str) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "integer":  # token ids all the way from the stash to the pop
        ids = torch.randint(0, 10, (4, 3), generator=g)
        layers: list[nn.Module] = [StashEmbedding(), nn.Identity(), PopEmbedding()]
        return nn.Sequential(*layers, nn.Linear(4, 2)), ids
    if kind == "integer, then float":  # ids at the stash, an embedding with grad at the pop
        ids = torch.randint(0, 10, (4, 3), generator=g)
        layers = [StashEmbedding(), nn.Embedding(10, 4), PopAdd()]
        return nn.Sequential(*layers, nn.Linear(4, 2)), ids
    # "no history": the micro-batch loses its graph between the stash and the pop.
    x = torch.randn(4, 4, generator=g)
    return nn.Sequential(StashBranch(), Ones(), PopScale(), nn.Linear(4, 2)), x


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
@pytest.mark.parametrize("balance", [[2, 2], [1, 3], [1, 1, 2], [3, 1]])
@pytest.mark.parametrize("kind", ["integer", "integer, then float", "no history"])
def test_skip_gradient_crosses_partitions_when_the_micro_batch_carries_none(
    kind: str, balance: list[int], mode: str
) -> None:
    """The micro-batch between stash and pop is an integer tensor or has no autograd history,
    so a phony forked from it or joined to it leads nowhere: the stashed tensor's gradient was
    dropped, with no error (its layer's weight.grad stayed None). The skips' phony now carries
    PortalBlue's dependency to the pop (NOTE [ The skips' phony ]): outputs and every gradient
    equal the plain model's on the same micro-batches, torch.equal."""
    model, inputs = main_path_without_grad(kind)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=balance, devices=["cpu"] * len(balance), chunks=2, checkpoint=mode)  # type: ignore[arg-type]
    out_ref = torch.cat([ref(piece) for piece in inputs.tensor_split(2)])
    out_pipe = pipe(inputs)
    out_ref.square().sum().backward()
    out_pipe.square().sum().backward()
    assert torch.equal(out_ref, out_pipe)
    for (name, p), q in zip(ref.named_parameters(), pipe.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.equal(p.grad, q.grad), name


@skippable(stash=["s"])
class StashTanh(nn.Module):
    """Stashes s = tanh(x): tanh saves its output, so s's grad_fn leads to the region."""

    def __init__(self, refs: list[weakref.ref[torch.Tensor]]) -> None:
        super().__init__()
        self.refs = refs

    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        s = x.tanh()
        if not remat.is_recomputing():
            self.refs.append(weakref.ref(s))
        yield stash("s", s)
        return x.sin()


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
def test_skip_tensors_of_a_forward_without_backward_are_freed(mode: str) -> None:
    """A forward never backwarded (a loss only logged, a skipped step) or one that raised
    between stash and pop frees its skip tensors without gc. A checkpointed region keeps its
    tracker; a tracker that kept the portals of its own stashes made a cycle through autograd
    nodes (tensor -> grad_fn -> region -> tracker -> portal -> tensor, NOTE [ Which portals a
    tracker keeps ]) that gc cannot see, and the tensors stayed alive for good. Training
    afterwards still equals the plain model."""
    refs: list[weakref.ref[torch.Tensor]] = []
    torch.manual_seed(0)
    model = nn.Sequential(StashTanh(refs), nn.Linear(4, 4), Fail(), PopThenLinear())
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 2, 1], devices=["cpu"] * 3, chunks=4, checkpoint=mode)  # type: ignore[arg-type]
    fail = pipe[2]
    assert isinstance(fail, Fail)
    x = torch.randn(8, 4, requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        out = pipe(x)
        del out
        assert len(refs) == 4
        assert all(r() is None for r in refs), "skips of a dropped forward outlived it"
        refs.clear()
        fail.armed = True
        with pytest.raises(RuntimeError, match="on purpose"):
            pipe(x)  # partition 1 fails on micro-batch 0 after partition 0 stashed for 0 and 1
        fail.armed = False
        assert len(refs) == 2
        assert all(r() is None for r in refs), "skips of a forward that raised outlived it"
        out_pipe = pipe(x)
        out_pipe.sum().backward()
    finally:
        gc.enable()
    xr = x.detach().clone().requires_grad_()
    out_ref = torch.cat([ref(c) for c in xr.tensor_split(4)])
    out_ref.sum().backward()
    assert torch.equal(out_ref, out_pipe)
    assert torch.equal(xr.grad, x.grad)  # type: ignore[arg-type]
    for (name, p), q in zip(ref.named_parameters(), pipe.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["except_last", "always"])
def test_skip_within_a_partition_that_raised_is_freed(mode: str) -> None:
    """A partition that raises between a stash and its pop in the same partition: the
    tracker, which the region keeps, must not keep the stashed tensor (a cycle as above)."""
    refs: list[weakref.ref[torch.Tensor]] = []
    fail = Fail()
    model = nn.Sequential(StashTanh(refs), fail, PopThenLinear(), nn.Linear(4, 4))
    pipe = Pipe(model, balance=[3, 1], devices=["cpu"] * 2, chunks=2, checkpoint=mode)  # type: ignore[arg-type]
    fail.armed = True
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="on purpose"):
            pipe(torch.randn(4, 4, requires_grad=True))
        assert len(refs) == 1
        assert refs[0]() is None, "the skip of a partition that raised outlived it"
    finally:
        gc.enable()


# -- skippable in a plain Sequential and namespaces -------------------------------------------


@skippable(stash=["skip"])
class Down(nn.Module):
    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        yield stash("skip", x)
        return x * 2


@skippable(pop=["skip"])
class Up(nn.Module):
    def forward(self, x: torch.Tensor) -> Iterator[Any]:
        skip = yield pop("skip")
        return x + skip


def test_namespaces_let_levels_reuse_a_name() -> None:
    outer, inner = Namespace(), Namespace()
    model = nn.Sequential(
        Down().isolate(outer), Down().isolate(inner), Up().isolate(inner), Up().isolate(outer)
    )
    verify_skippables(model)
    x = torch.ones(2, 1)
    # x -> 2x (stash x) -> 4x (stash 2x) -> 4x + 2x -> 6x + x
    assert torch.equal(model(x), 7 * x)
    pipe = Pipe(model, balance=[1, 1, 1, 1], devices=["cpu"] * 4, chunks=2)
    assert torch.equal(pipe(x), 7 * x)


def residual_block() -> nn.Sequential:
    """A residual block built from skippables: Down stashes x and returns 2x, Up adds x."""
    return nn.Sequential(Down(), nn.Linear(1, 1), Up())


@pytest.mark.parametrize("mode", ["never", "except_last", "always"])
@pytest.mark.parametrize("balance", [[1, 2], [2, 1], [1, 1, 1]])
def test_stash_and_pop_nested_in_one_layer_stay_in_it(balance: list[int], mode: str) -> None:
    """Two blocks whose stash and pop are nested in one layer, both in the default namespace:
    verify_skippables passed, the Pipe was built, and the first forward failed with a bare
    KeyError in SkipLayout.requires_portal. Such a skip needs no portal; outputs and gradients
    equal the plain model's, torch.equal."""
    torch.manual_seed(0)
    model = nn.Sequential(residual_block(), nn.Linear(1, 1), residual_block())
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=balance, devices=["cpu"] * len(balance), chunks=2, checkpoint=mode)  # type: ignore[arg-type]
    x = torch.randn(4, 1)
    out_ref = torch.cat([ref(piece) for piece in x.tensor_split(2)])
    out_pipe = pipe(x)
    out_ref.square().sum().backward()
    out_pipe.square().sum().backward()
    assert torch.equal(out_ref, out_pipe)
    for (name, p), q in zip(ref.named_parameters(), pipe.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]


def test_stash_and_pop_nested_in_different_layers_are_refused_at_construction() -> None:
    """A nested stash whose pop sits in another layer: the Pipe has no partition for it (a
    bare KeyError at the first forward); now the Pipe refuses it when built, naming both."""
    model = nn.Sequential(nn.Sequential(Down(), nn.ReLU()), nn.Linear(1, 1), nn.Sequential(Up()))
    model(torch.ones(2, 1))  # runs plainly
    with pytest.raises(remat.RematError, match=r"\(2 problems\)") as info:
        Pipe(model, balance=[1, 2], devices=["cpu"] * 2, chunks=1)
    message = str(info.value)
    assert "'skip' is stashed by Down at 0.0, nested in layer 0 (Sequential), but not popped" in (
        message
    )
    assert "'skip' is popped by Up at 2.0, nested in layer 2 (Sequential), but not stashed" in (
        message
    )
    assert "make 0.0 a layer of the nn.Sequential itself" in message
    # The same name used by a pair inside a layer and by top-level layers around it.
    model = nn.Sequential(Down(), residual_block(), Up())
    with pytest.raises(remat.RematError, match=r"inside layer 1 \(Sequential\), and also by"):
        verify_skippables(model)


def test_verify_skippables_reports_every_problem_at_once() -> None:
    ns = Namespace()
    model = nn.Sequential(
        Up(),  # pops 'skip' that no one stashed
        Down().isolate(ns),
        Down().isolate(ns),  # stashes it a second time
        Up().isolate(ns),
        Down(),  # never popped
    )
    with pytest.raises(remat.RematError) as info:
        verify_skippables(model)
    message = str(info.value)
    assert message.startswith("remat: the skip connections")
    assert "(3 problems)" in message
    assert "'skip' is popped by layer 0 (Up) but no earlier layer stashes it" in message
    assert "is stashed twice: by layer 1 and by layer 2 (Down)" in message
    assert "'skip' is stashed by layer 4 (Down) but no later layer pops it" in message
    assert ".isolate(Namespace())" in message
    with pytest.raises(remat.RematError, match="3 problems"):
        Pipe(model, balance=[5], devices=["cpu"], chunks=1)


def test_pop_without_stash_and_undeclared_names_fail_clearly() -> None:
    with pytest.raises(remat.RematError, match=r"'skip' is popped, but no earlier layer"):
        nn.Sequential(Up())(torch.ones(1))

    @skippable(stash=["a"])
    class Wrong(nn.Module):
        def forward(self, x: torch.Tensor) -> Iterator[Any]:
            yield stash("b", x)
            return x

    with pytest.raises(remat.RematError, match=r"stashed 'b', but it declares stash=\['a'\]"):
        Wrong()(torch.ones(1))
    with pytest.raises(remat.RematError, match=r"names \['c'\], which it neither"):
        Down().isolate(Namespace(), only=["c"])
    with pytest.raises(remat.RematError, match=r"nn\.Module subclass"):
        skippable(stash=["a"])(int)  # type: ignore[arg-type]


def test_a_skippable_layer_refuses_a_dict_rather_than_taking_its_keys() -> None:
    """A skippable layer passes a tensor or a tuple on; a dict was read as the tuple of its
    keys (the layer got strings, in a plain Sequential too), a string as its characters."""

    @skippable(stash=["s"])
    class Keyed(nn.Module):
        def forward(self, x: Any) -> Iterator[Any]:
            yield stash("s", x["a"])
            return x

    with pytest.raises(remat.RematError, match=r"Keyed, a skippable layer, takes a dict; a"):
        Keyed()({"a": torch.ones(1)})

    @skippable(stash=["s"])
    class Named(nn.Module):
        def forward(self, x: torch.Tensor) -> Iterator[Any]:
            yield stash("s", x)
            return "done"

    with pytest.raises(remat.RematError, match=r"Named, a skippable layer, returned a str; "):
        nn.Sequential(Named(), Up())(torch.ones(1))

    @skippable(stash=["s"])
    class Pair(nn.Module):
        def forward(self, x: Any) -> Iterator[Any]:
            yield stash("s", x[0])
            return x

    @skippable(pop=["s"])
    class Sum(nn.Module):
        def forward(self, x: Any) -> Iterator[Any]:
            s = yield pop("s")
            return x[0] + x[1] + s

    # a tuple goes through as before, and a list as a tuple
    x = (torch.ones(2), torch.full((2,), 2.0))
    for given in (x, list(x)):
        assert torch.equal(nn.Sequential(Pair(), Sum())(given), torch.full((2,), 4.0))
