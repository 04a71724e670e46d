"""Skip connections: @skippable in a plain nn.Sequential, namespaces, wiring errors, and the
life of a skip tensor through a portal at each event of NOTE [ Life of a tensor through a
portal ] (remat/pipe/skip/portal.py), with weak references to show when it is freed."""

from __future__ import annotations

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
