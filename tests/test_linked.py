"""Linked calls: consecutive calls as one region while each takes the previous one's output
(NOTE [ Linked calls ] in checkpoint.py). Exactness against plain runs, what is saved, when
a link breaks, and autograd semantics."""

from __future__ import annotations

import copy
import gc
import types
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.checkpoint import LinkedCalls, RegionOptions

from helpers import assert_equal, counting_ops


class _Block(nn.Module):
    """Dropout, BatchNorm, kwargs, a non-tensor argument, and a tuple output with a None and a
    float in it, as Hugging Face layers return."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.calls = 0
        self.returned: list[weakref.ref[torch.Tensor]] = []  # each call's hidden state

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0
    ) -> tuple[torch.Tensor, None, float]:
        self.calls += 1
        y = F.dropout(torch.tanh(self.fc(self.norm(x))), 0.2) * scale
        if mask is not None:
            y = y * mask
        out = x + self.bn(y)
        self.returned.append(weakref.ref(out))
        return out, None, scale


class _Model(nn.Module):
    """A model's own loop over an nn.ModuleList; ``chain`` runs the blocks as linked calls."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(n))
        self.chain: LinkedCalls | None = None
        self.between: Any = None  # runs on the hidden state between blocks 1 and 2

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.chain is None:
                x, _, _ = block(x, mask, scale=0.5)
            else:
                forward = types.MethodType(type(block).forward, block)
                last = i == len(self.blocks) - 1
                x, _, _ = self.chain.run(i, forward, (x, mask), {"scale": 0.5}, last=last)
            if i == 1 and self.between is not None:
                x = self.between(x)
        return x


def _pair(n: int = 4) -> tuple[_Model, _Model]:
    torch.manual_seed(0)
    plain = _Model(n).train()
    linked = copy.deepcopy(plain)
    linked.chain = LinkedCalls()
    return plain, linked


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 16, generator=g), torch.rand(8, 16, generator=g)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }


def _calls(model: _Model) -> list[int]:
    return [b.calls for b in model.blocks]  # type: ignore[union-attr]


def test_linked_calls_are_exact_and_recompute_each_block_once() -> None:
    plain, linked = _pair()
    x, mask = _inputs()
    xa, xb = _leaf(x), _leaf(x)
    torch.manual_seed(1)
    out_a = plain(xa, mask)
    out_a.square().sum().backward()
    torch.manual_seed(1)
    out_b = linked(xb, mask)
    assert _calls(linked) == [1, 1, 1, 1]
    out_b.square().sum().backward()
    assert _calls(linked) == [2, 2, 2, 2]  # one recompute of the chain, every block once
    assert linked.chain is not None and linked.chain.broken == 0
    assert torch.equal(out_a, out_b) and torch.equal(xa.grad, xb.grad)  # type: ignore[arg-type]
    assert_equal(_state(plain), _state(linked))  # BatchNorm statistics updated once


@pytest.mark.parametrize("order", ["summed", "second-first"])
def test_two_forwards_before_a_backward_each_recompute_their_own_chain(order: str) -> None:
    """Gradient accumulation with both micro-batches' forwards first: each forward makes its
    own chain, and each backward recomputes its own, once, from its own input and generators,
    whichever order the backwards run in."""
    plain, linked = _pair()
    x, mask = _inputs()
    batches = (x, x.flip(0) * 2)

    def run(model: _Model) -> list[torch.Tensor]:
        torch.manual_seed(1)
        leaves = [_leaf(b) for b in batches]
        losses = [model(leaf, mask).square().sum() for leaf in leaves]
        if order == "summed":
            (losses[0] + losses[1]).backward()
        else:
            losses[1].backward()
            losses[0].backward()
        return [*losses, *(leaf.grad for leaf in leaves)]  # type: ignore[misc]

    expected = run(plain)
    got = run(linked)
    assert _calls(linked) == [4, 4, 4, 4]  # two forwards, two recomputes: each block once each
    assert linked.chain is not None and linked.chain.broken == 0
    assert_equal(expected, got)
    assert_equal(_state(plain), _state(linked))  # BatchNorm statistics: once per forward


def test_only_the_first_calls_input_is_saved() -> None:
    """The outputs that link the calls are freed after forward, as their activations are; a
    region per block keeps each one as the next block's input."""
    for how in ("linked", "regions"):
        _, model = _pair()
        if how == "regions":
            model.chain = None
            for block in model.blocks:
                remat.checkpoint_wrapper(block)
        x, mask = _inputs()
        out = model(_leaf(x), mask)
        alive = [b.returned[0]() is not None for b in model.blocks]  # type: ignore[union-attr]
        assert alive == ([False, False, False, True] if how == "linked" else [True] * 4), how
        del out


def test_a_chain_holds_what_one_region_around_its_calls_holds() -> None:
    """Kept after forward, to the byte, the same as one region that runs all four blocks (one
    input, one generator state), as checkpoint_sequential makes it; no more in backward."""
    from remat.planning.cost import measure_memory

    class OneRegion(nn.Module):
        def __init__(self, model: _Model) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = remat.checkpoint(self.model, x, mask)
            return out

    plain, linked = _pair()
    x, mask = _inputs()
    inputs = ((_leaf(x), mask), {})
    cpu = torch.device("cpu")
    ours = measure_memory(linked, inputs, cpu)
    one = measure_memory(OneRegion(plain), inputs, cpu)
    assert ours.kept == one.kept and ours.backward <= one.backward
    assert ours.kept < measure_memory(plain, inputs, cpu).kept


def _plain_step_with(
    between: Any,
) -> tuple[_Model, _Model, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain and a linked model that run ``between`` after block 1; the plain one's step
    done (from seed 1); both models, the inputs of each, and the mask."""
    plain, linked = _pair()
    plain.between = linked.between = between
    x, mask = _inputs()
    xa, xb = _leaf(x), _leaf(x)
    torch.manual_seed(1)
    plain(xa, mask).sum().backward()
    return plain, linked, xa, xb, mask


def test_a_link_broken_between_calls_starts_a_new_region_and_stays_exact() -> None:
    """An in-place change of the output between blocks (a new version), or a new tensor made
    from it, breaks the link: block 2 keeps its input, and gradients stay exact."""
    for between in (lambda t: t.mul_(1.0), lambda t: t * 1.0):
        plain, linked, xa, xb, mask = _plain_step_with(between)
        torch.manual_seed(1)
        linked(xb, mask).sum().backward()
        assert linked.chain is not None and linked.chain.broken == 1
        assert _calls(linked) == [2, 2, 2, 2]
        assert torch.equal(xa.grad, xb.grad)  # type: ignore[arg-type]
        assert_equal(_state(plain), _state(linked))


def test_a_chain_keeps_one_generator_state_unless_the_caller_draws_between_calls() -> None:
    """Each call's generators are those the previous call left, so only the first call keeps
    a copy; a draw between calls (the same tensor passed on, so the link holds) makes the next
    call keep its own, and the dropout masks stay exact."""
    from remat.checkpoint import _Call

    made: list[_Call] = []
    original = _Call.__init__

    def spy(self: _Call, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    def draw(t: torch.Tensor) -> torch.Tensor:
        torch.rand(3)
        return t

    for between, kept in ((None, [True, False, False, False]), (draw, [True, False, True, False])):
        plain, linked, xa, xb, mask = _plain_step_with(between)
        made.clear()
        _Call.__init__ = spy  # type: ignore[method-assign]
        try:
            torch.manual_seed(1)
            out = linked(xb, mask)
        finally:
            _Call.__init__ = original  # type: ignore[method-assign]
        assert [c.ambient.cpu_rng is not None for c in made] == kept
        assert linked.chain is not None and linked.chain.broken == 0
        out.sum().backward()
        assert torch.equal(xa.grad, xb.grad)  # type: ignore[arg-type]
        assert_equal(_state(plain), _state(linked))


def test_continuing_calls_replay_the_forward_default_device_and_autocast() -> None:
    """A call that continues the previous call's generators captures none, and its replay has
    nothing to set while backward runs as forward did; a backward under another default device
    or autocast state must still see the forward's in every call of the chain, not only the
    first."""

    def block(x: torch.Tensor) -> torch.Tensor:
        # A factory call on the default device, a matmul autocast would change, and dropout.
        return F.dropout(torch.tanh(x @ (torch.ones(x.shape[-1], x.shape[-1]) / 8)), 0.3)

    def run(chain: LinkedCalls | None, x: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            x = block(x) if chain is None else chain.run(i, block, (x,), {}, last=i == 2)
        return x.square().sum()

    x = torch.randn(4, 8)
    contexts: list[Any] = [
        lambda: torch.device("meta"),
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    ]
    for backward_under in contexts:
        xa, xb = _leaf(x), _leaf(x)
        torch.manual_seed(3)
        plain = run(None, xa)
        torch.manual_seed(3)
        chain = LinkedCalls()
        linked = run(chain, xb)
        assert chain.broken == 0
        # Both backward passes under it: autocast changes backward's own kernels too.
        with backward_under():
            plain.backward()
        with backward_under():
            linked.backward()
        assert torch.equal(plain, linked)
        assert torch.equal(xa.grad, xb.grad)  # type: ignore[arg-type]


def test_retain_graph_recomputes_once_per_backward_and_autograd_grad() -> None:
    plain, linked = _pair()
    x, mask = _inputs()
    xa, xb = _leaf(x), _leaf(x)
    torch.manual_seed(1)
    la = plain(xa, mask).square().sum()
    torch.manual_seed(1)
    lb = linked(xb, mask).square().sum()
    with counting_ops() as ops:
        (ga,) = torch.autograd.grad(la, xa, retain_graph=True)
        (gb,) = torch.autograd.grad(lb, xb, retain_graph=True)
    assert torch.equal(ga, gb)
    assert ops["tanh"] == 4  # the linked backward recomputed each block's tanh once
    lb.backward()
    la.backward()
    assert_equal(_state(plain)["grads"], _state(linked)["grads"])
    assert _calls(linked) == [3, 3, 3, 3]


def test_double_backward_through_linked_calls() -> None:
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w) * F.dropout(x.sin(), 0.3)

    def run(x: torch.Tensor, w: torch.Tensor, chain: LinkedCalls | None) -> torch.Tensor:
        for i in range(3):
            x = block(x, w) if chain is None else chain.run(i, block, (x, w), {}, last=i == 2)
        return x.sum()

    torch.manual_seed(0)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    (xa, wa), (xb, wb) = (_leaf(x), _leaf(w)), (_leaf(x), _leaf(w))
    torch.manual_seed(4)
    (ga,) = torch.autograd.grad(run(xa, wa, None), xa, create_graph=True)
    ga.pow(2).sum().backward()
    torch.manual_seed(4)
    (gb,) = torch.autograd.grad(run(xb, wb, LinkedCalls()), xb, create_graph=True)
    gb.pow(2).sum().backward()
    assert torch.equal(ga, gb)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)  # type: ignore[arg-type]


def test_no_grad_and_disabled_checkpointing_run_plainly() -> None:
    plain, linked = _pair()
    x, mask = _inputs()
    with torch.no_grad():
        torch.manual_seed(1)
        a = plain(x, mask)
        torch.manual_seed(1)
        b = linked(x, mask)
    assert torch.equal(a, b) and _calls(linked) == [1, 1, 1, 1]
    assert linked.chain is not None and linked.chain.broken == 0
    with remat.disable_checkpointing():
        linked(_leaf(x), mask).sum().backward()
    assert _calls(linked) == [2, 2, 2, 2]  # no recompute


def test_a_partial_backward_and_an_unused_graph_leak_nothing() -> None:
    """The chain reaches its open frame weakly: a forward whose graph is dropped frees the
    frame and the model, without the garbage collector."""
    gc.disable()
    try:
        _, linked = _pair()
        x, mask = _inputs()
        out = linked(_leaf(x), mask)
        chain = linked.chain
        assert chain is not None
        # The last call closed the chain; a forward stopped early leaves it open.
        model_ref = weakref.ref(linked)
        del out, linked
        assert model_ref() is None
        blocks = nn.ModuleList(_Block() for _ in range(3))
        chain = LinkedCalls()
        h = chain.run(0, blocks[0], (_leaf(x),), {})[0]
        returned = chain._returned
        assert returned is not None and returned.frame() is not None
        del h
        assert returned.frame() is None
    finally:
        gc.enable()


def test_a_recompute_that_differs_is_reported() -> None:
    """A call whose recompute returns another structure cannot feed the next call's link."""
    flips = {"n": 0}

    def first(x: torch.Tensor) -> Any:
        flips["n"] += 1
        y = x.sin()
        return (y,) if flips["n"] == 1 else (None, y)

    def second(y: torch.Tensor) -> torch.Tensor:
        return y.cos()

    chain = LinkedCalls()
    x = _leaf(torch.randn(4))
    y = chain.run(0, first, (x,), {})[0]
    out = chain.run(1, second, (y,), {}, last=True)
    with pytest.raises(remat.CheckpointError, match="no tensor at leaf 0"):
        out.sum().backward()


def test_options_that_need_one_function_are_refused() -> None:
    with pytest.raises(remat.RematError, match="context_fn and policy are not supported"):
        LinkedCalls(RegionOptions(policy=remat.policies.save_matmuls))
