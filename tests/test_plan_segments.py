"""Segments: several blocks run as one region that recomputes everything in backward (see
[ Segments ] in planning/solve.py and [ Segments on the model ] in planning/apply.py)."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat import _state
from remat.bench.measure import peak_step_bytes
from remat.planning.apply import apply_segment, undo_segment

from helpers import assert_records_equal, assert_save_and_resume_exact, counting_ops, train


class _Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("a block failed")
        return x + self.drop(self.fc2(torch.relu(self.fc1(x))))


class _Chain(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_Block() for _ in range(n)))
        self.head = nn.Linear(64, 8)
        self.stop_after: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if self.stop_after is not None and i > self.stop_after:
                break
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _model() -> _Chain:
    torch.manual_seed(0)
    return _Chain().train()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)) for _ in range(2)]


_PATHS = ["blocks.1", "blocks.2", "blocks.3"]


def test_a_segment_is_exact_with_dropout() -> None:
    model = _model()
    segmented = copy.deepcopy(model)
    apply_segment(segmented, _PATHS)
    assert_records_equal(train(model, _batches(), _loss), train(segmented, _batches(), _loss))


def _backward_ops(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, int]:
    torch.manual_seed(0)
    loss = _loss(model(x), target)
    with counting_ops() as ops:
        loss.backward()  # type: ignore[no-untyped-call]
    return ops.counts


def test_a_segment_recomputes_its_blocks_once_as_torch_checkpoint_does() -> None:
    """Backward runs the same ATen ops, as often, as torch's checkpoint around the same blocks
    (one segment, as ``checkpoint_sequential`` makes): replayed once, not once per block."""
    x, target = _batches()[0]
    model = _model()
    segmented = copy.deepcopy(model)
    apply_segment(segmented, _PATHS)

    class _Torch(nn.Module):
        def __init__(self, m: _Chain) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.m.blocks[0](x)
            tail = nn.Sequential(*self.m.blocks[1:])
            x = checkpoint(tail, x, use_reentrant=False)
            out: torch.Tensor = self.m.head(x)
            return out

    plain = _backward_ops(model, x, target)
    ours = _backward_ops(segmented, x, target)
    torchs = _backward_ops(_Torch(copy.deepcopy(model)), x, target)
    for op in ("mm", "addmm", "relu", "bernoulli_"):
        assert ours.get(op, 0) <= torchs.get(op, 0), (op, ours, torchs)
    # The three blocks' forward once more (two linears and a relu each; dropout's draws),
    # but for the last block's second linear: its output is not needed by backward, and the
    # graph engine replays only what backward reads (torch's checkpoint runs it too).
    assert ours["addmm"] - plain.get("addmm", 0) == 5
    assert torchs["addmm"] - plain.get("addmm", 0) == 6
    assert ours["relu"] - plain.get("relu", 0) == 3


def _peak(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> int:
    def step() -> None:
        torch.manual_seed(0)
        _loss(model(x), target).backward()  # type: ignore[no-untyped-call]

    step()
    return peak_step_bytes(step, torch.device("cpu"))


def test_a_segment_keeps_its_input_where_regions_keep_each_blocks() -> None:
    """After forward, a segment of three blocks holds its input (and its random-generator
    state); the same blocks as three regions hold three inputs and three states."""
    from remat.planning.cost import measure_memory

    torch.manual_seed(0)
    chain = nn.Sequential(*(_Block() for _ in range(3))).train()
    x = torch.randn(512, 64, requires_grad=True)
    segment, regions = copy.deepcopy(chain), copy.deepcopy(chain)
    apply_segment(segment, ["0", "1", "2"])
    for block in regions:
        remat.checkpoint_wrapper(block)
    cpu = torch.device("cpu")
    plain_kept, plain_backward, _, _ = measure_memory(chain, ((x,), {}), cpu)
    kept, backward, _, _ = measure_memory(segment, ((x,), {}), cpu)
    region_kept, region_backward, _, _ = measure_memory(regions, ((x,), {}), cpu)
    input_bytes = x.numel() * x.element_size()
    state = kept - input_bytes  # the segment's generator state
    assert 0 < state < input_bytes // 8
    assert region_kept == 3 * (input_bytes + state)
    assert kept < region_kept < plain_kept
    # It pays in backward: its three blocks' activations live at once, as in a plain chain.
    assert region_backward < backward and abs(backward - plain_backward) < input_bytes
    undo_segment(segment, ["0", "1", "2"])
    assert measure_memory(segment, ((x,), {}), cpu)[0] == plain_kept


def test_an_error_inside_a_segment_closes_its_region() -> None:
    model = _model()
    segmented = copy.deepcopy(model)
    apply_segment(segmented, _PATHS)
    segmented.blocks[2].fail = True  # type: ignore[union-attr]
    x, _ = _batches()[0]
    with pytest.raises(ValueError, match="a block failed"):
        segmented(x)
    assert _state.state.graph is None
    segmented.blocks[2].fail = False  # type: ignore[union-attr]
    # The next steps are exact, and autograd outside the model saves tensors as usual.
    assert_records_equal(train(model, _batches(), _loss), train(segmented, _batches(), _loss))
    a = torch.randn(3, requires_grad=True)
    (a * a).sum().backward()  # type: ignore[no-untyped-call]
    assert a.grad is not None and torch.equal(a.grad, 2 * a.detach())


def test_a_forward_that_stops_before_the_last_block_closes_the_region_at_its_end() -> None:
    model = _model()
    segmented = copy.deepcopy(model)
    apply_segment(segmented, _PATHS)
    for m in (model, segmented):
        m.stop_after = 2
    x, _ = _batches()[0]
    out = segmented(x)
    assert _state.state.graph is None
    del out
    assert_records_equal(train(model, _batches(), _loss), train(segmented, _batches(), _loss))


def test_no_grad_and_disabled_checkpointing_run_plainly() -> None:
    model = _model()
    apply_segment(model, _PATHS)
    x, _ = _batches()[0]
    seen: list[Any] = []
    hook = model.blocks[2].register_forward_hook(  # type: ignore[union-attr]
        lambda *_: seen.append(_state.state.graph)
    )
    with torch.no_grad():
        model(x)
    with remat.disable_checkpointing():
        model(x).sum().backward()
    model(x).sum().backward()
    hook.remove()
    assert seen[:2] == [None, None] and seen[2] is not None


def test_a_plan_with_segments_is_exact_saved_and_loaded(tmp_path: Any) -> None:
    """Where each block's input is much of what it keeps (an MLP block: linear, GELU,
    dropout, LayerNorm), the planner's smallest plan uses segments; the plan is exact, its
    peak the predicted one, and it survives a JSON file."""
    from remat.planning.planner import _smallest, profile_model, solve
    from remat.workloads.mlp import MLPBlock

    torch.manual_seed(0)
    model = nn.Sequential(*(MLPBlock(128, 0.1) for _ in range(8))).train()
    x, target = torch.randn(128, 128), torch.randn(128, 128)
    profiled = profile_model(model, x, lambda o: _loss(o, target), repeats=0)
    plan = solve(profiled, _smallest(profiled.costs, profiled.chain))
    assert any("segment" in b for b in plan.blocks), plan.summary()
    plan.save(tmp_path / "plan.json")
    loaded = remat.Plan.load(tmp_path / "plan.json")
    assert loaded.blocks == plan.blocks
    planned = loaded.apply(copy.deepcopy(model))
    measured = _peak(planned, x, target)
    assert abs(measured - plan.predicted_peak) <= 0.03 * measured, plan.summary()
    assert measured <= plan.budget
    # Without segments (the same options, one block each) the smallest plan is larger.
    singles = copy.copy(profiled)
    singles.chain = [[o for o in opts if o.span == 1] for opts in profiled.chain]
    assert _smallest(singles.costs, singles.chain) > plan.predicted_peak
    batches = [(x, target), (x, target)]
    assert_records_equal(
        train(copy.deepcopy(model), batches, _loss), train(planned, batches, _loss)
    )


def test_a_plan_with_segments_in_a_users_loop_with_save_and_resume(tmp_path: Any) -> None:
    """The loop users write, on a plan with segments: their own AdamW, clip_grad_norm_,
    zero_grad(set_to_none=True); after two steps a save (model, optimizer, plan), a fresh
    model with the plan loaded, a third step: bit-equal to three plain steps."""
    from remat.planning.planner import _smallest, profile_model, solve
    from remat.workloads.mlp import MLPBlock

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(MLPBlock(128, 0.1) for _ in range(8))).train()

    x, target = torch.randn(128, 128), torch.randn(128, 128)
    model, plain = build(), build()
    profiled = profile_model(model, x, lambda o: _loss(o, target), repeats=0)
    plan = solve(profiled, _smallest(profiled.costs, profiled.chain))
    assert any("segment" in b for b in plan.blocks), plan.summary()
    plan.apply(model)
    plan.save(tmp_path / "plan.json")
    assert_save_and_resume_exact(
        model,
        plain,
        lambda: remat.Plan.load(tmp_path / "plan.json").apply(build()),
        lambda m: _loss(m(x), target),
        tmp_path,
    )


# -- segments of an nn.Sequential (NOTE [ Segments of an nn.Sequential ] in apply.py) -----------


class _Spy(nn.Module):
    """Notes, at each call, the dispatch modes active and whether a recompute runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        if torch.is_grad_enabled():
            self.seen.append((len(_get_current_dispatch_mode_stack()), remat.is_recomputing()))
        return x


def _spied_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(_Block(), _Spy()) for _ in range(4))).train()


def _spy(model: nn.Module) -> _Spy:
    spy = model.get_submodule("2.1")
    assert isinstance(spy, _Spy)
    return spy


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()  # type: ignore[no-untyped-call]


def test_segment_of_an_nn_sequential_runs_on_the_region_engine() -> None:
    model = _spied_sequential()
    segmented = copy.deepcopy(model)
    apply_segment(segmented, ["1", "2", "3"])
    x = torch.randn(32, 64)
    _step(segmented, x)
    _step(segmented, x)
    # Forward with no dispatch mode (the graph engine records under one), then one recompute,
    # the first one under the write guard (see NOTE [ When the guard runs ] in _guard.py).
    assert _spy(segmented).seen == [(0, False), (1, True), (0, False), (0, True)]
    batches = [(x, torch.randn(32, 64)) for _ in range(2)]
    assert_records_equal(train(model, batches, _loss), train(segmented, batches, _loss))
    # Held after forward: the segment's input (and generator state), not its activations.
    from remat.planning.cost import measure_memory

    cpu, inputs = torch.device("cpu"), ((x.requires_grad_(),), {})
    plain_kept, segment_kept = (measure_memory(m, inputs, cpu).kept for m in (model, segmented))
    block_kept = plain_kept // 4
    assert plain_kept - 3 * block_kept < segment_kept < plain_kept - 2 * block_kept


def test_blocks_of_a_segmented_nn_sequential_called_one_by_one_follow_the_plan() -> None:
    """Code that loops over the children calls the blocks without the parent's forward: the
    graph-engine hooks run the segment then, and it stays exact."""
    model = _spied_sequential()
    segmented = copy.deepcopy(model)
    apply_segment(segmented, ["1", "2", "3"])

    def by_hand(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for child in m.children():
            x = child(x)
        return x

    x = torch.randn(32, 64)
    by_hand(segmented, x).square().mean().backward()
    modes, recomputing = zip(*_spy(segmented).seen, strict=True)
    assert modes[0] == 1 and not recomputing[0]  # recorded by the graph engine
    for m in (model, segmented):
        m.forward = functools.partial(by_hand, m)  # type: ignore[method-assign]
    batches = [(x, torch.randn(32, 64)) for _ in range(2)]
    assert_records_equal(train(model, batches, _loss), train(segmented, batches, _loss))


def test_a_deep_copy_of_a_segmented_nn_sequential_follows_its_plan_and_undo_restores() -> None:
    model = _spied_sequential()
    apply_segment(model, ["1", "2", "3"])
    copied = copy.deepcopy(model)
    x = torch.randn(32, 64)
    _step(copied, x)
    assert _spy(copied).seen == [(0, False), (1, True)] and not _spy(model).seen
    undo_segment(copied, ["1", "2", "3"])
    assert "forward" not in copied.__dict__
    _spy(copied).seen.clear()
    _step(copied, x)
    assert _spy(copied).seen == [(0, False)]  # a plain step


def test_an_nn_sequential_with_its_own_forward_keeps_the_graph_engine() -> None:
    class Scaled(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            for module in self:
                x = module(x) * 0.5
            return x

    torch.manual_seed(0)
    model = Scaled(*(nn.Sequential(_Block(), _Spy()) for _ in range(4))).train()
    segmented = copy.deepcopy(model)
    apply_segment(segmented, ["1", "2", "3"])
    assert "forward" not in segmented.__dict__
    x = torch.randn(32, 64)
    _step(segmented, x)
    assert _spy(segmented).seen[0] == (1, False)
    batches = [(x, torch.randn(32, 64)) for _ in range(2)]
    assert_records_equal(train(model, batches, _loss), train(segmented, batches, _loss))


def test_planned_segments_stay_inside_their_nn_sequential() -> None:
    """Two nn.Sequential of the same blocks: a segment crossing from one to the other would run
    on the graph engine, not on the region engine it was measured on, so none does."""
    from remat.planning.planner import _smallest, profile_model, solve
    from remat.workloads.mlp import MLPBlock

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(*(MLPBlock(128, 0.1) for _ in range(3))),
        nn.Sequential(*(MLPBlock(128, 0.1) for _ in range(3))),
    ).train()
    x, target = torch.randn(128, 128), torch.randn(128, 128)
    profiled = profile_model(model, x, lambda o: _loss(o, target), blocks=MLPBlock, repeats=0)
    assert profiled.groups == ["0"] * 3 + ["1"] * 3
    # Blocks 1 to 5 are of one type (block 0's input needs no gradient): segments of up to
    # five blocks are measured, but the chain offers none across the two nn.Sequential.
    assert max(o.span for o in profiled.options[profiled.types[1]]) == 5
    assert all(i + o.span <= 3 for i in range(3) for o in profiled.chain[i])
    plan = solve(profiled, _smallest(profiled.costs, profiled.chain))
    from remat.planning._plan import segments

    found = segments(plan.blocks)
    assert found, plan.summary()
    assert all(len({p.split(".")[0] for p in paths}) == 1 for paths in found), found
    planned = plan.apply(copy.deepcopy(model))
    measured = _peak(planned, x, target)
    assert abs(measured - plan.predicted_peak) <= 0.03 * measured, plan.summary()
    assert_records_equal(
        train(copy.deepcopy(model), [(x, target)] * 2, _loss),
        train(planned, [(x, target)] * 2, _loss),
    )
