"""Segments: several blocks run as one region that recomputes everything in backward (see
[ Segments ] in planning/solve.py and [ Segments on the model ] in planning/apply.py)."""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat import _state
from remat.bench.measure import peak_step_bytes
from remat.planning.apply import (
    Linked,
    LinkedForward,
    SegmentForward,
    apply_segment,
    undo_segment,
)

from helpers import (
    assert_equal,
    assert_records_equal,
    assert_save_and_resume_exact,
    counting_ops,
    train,
)


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
    plain_kept, plain_backward, *_ = measure_memory(chain, ((x,), {}), cpu)
    kept, backward, *_ = measure_memory(segment, ((x,), {}), cpu)
    region_kept, region_backward, *_ = measure_memory(regions, ((x,), {}), cpu)
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


# -- segments on the region engine (NOTE [ Segments on the region engine ] in apply.py) ---------


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


class _Looped(nn.Module):
    """Blocks in an nn.ModuleList that the model's own forward loops over, as a GPT's are;
    ``scale`` multiplies the output of the blocks it names, between blocks."""

    def __init__(self, n: int = 4, scale: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(_Block(), _Spy()) for _ in range(n))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in self.scale:
                x = x * 0.5
        return x


def _spied(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "sequential":
        return nn.Sequential(*(nn.Sequential(_Block(), _Spy()) for _ in range(4))).train()
    return _Looped().train()


def _paths(model: nn.Module) -> list[str]:
    prefix = "blocks." if isinstance(model, _Looped) else ""
    return [f"{prefix}{k}" for k in (1, 2, 3)]


def _spy(model: nn.Module, k: int = 2) -> _Spy:
    prefix = "blocks." if isinstance(model, _Looped) else ""
    spy = model.get_submodule(f"{prefix}{k}.1")
    assert isinstance(spy, _Spy)
    return spy


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("kind", ["sequential", "looped"])
def test_a_linked_segment_runs_on_the_region_engine(kind: str) -> None:
    """An nn.Sequential, or a model's own loop over an nn.ModuleList: the segment's forward
    runs with no dispatch mode, its blocks are recomputed once per backward, it keeps its
    input alone, and training is bit-exact."""
    model = _spied(kind)
    segmented = copy.deepcopy(model)
    assert isinstance(apply_segment(segmented, _paths(model), linked=True), Linked)
    x = torch.randn(32, 64)
    _step(segmented, x)
    _step(segmented, x)
    # Forward with no dispatch mode (the graph engine records under one), then one recompute,
    # the first one under the write guard (see NOTE [ When the guard runs ] in _guard.py).
    for k in (1, 2):
        assert _spy(segmented, k).seen == [(0, False), (1, True), (0, False), (0, True)]
    # Block 0 is outside the segment; the recompute stops before block 3's spy, after the
    # last tensor backward needs (early stop).
    for k in (0, 3):
        assert _spy(segmented, k).seen == [(0, False), (0, False)]
    batches = [(x, torch.randn(32, 64)) for _ in range(2)]
    assert_records_equal(train(model, batches, _loss), train(segmented, batches, _loss))
    # Held after forward: the segment's input (and generator states), not its activations.
    from remat.planning.cost import measure_memory

    cpu, inputs = torch.device("cpu"), ((x.requires_grad_(),), {})
    plain_kept, segment_kept = (measure_memory(m, inputs, cpu).kept for m in (model, segmented))
    block_kept = plain_kept // 4
    assert plain_kept - 3 * block_kept < segment_kept < plain_kept - 2 * block_kept


def test_blocks_of_a_linked_segment_called_by_other_code_follow_the_plan() -> None:
    """Code that loops over an nn.Sequential's children calls the blocks without its forward:
    the segment links them all the same."""
    model = _spied("sequential")
    segmented = copy.deepcopy(model)
    apply_segment(segmented, ["1", "2", "3"], linked=True)

    def by_hand(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for child in m.children():
            x = child(x)
        return x

    x = torch.randn(32, 64)
    by_hand(segmented, x).square().mean().backward()
    assert _spy(segmented).seen == [(0, False), (1, True)]
    for m in (model, segmented):
        m.forward = functools.partial(by_hand, m)  # type: ignore[method-assign]
    batches = [(x, torch.randn(32, 64)) for _ in range(2)]
    assert_records_equal(train(model, batches, _loss), train(segmented, batches, _loss))


def test_a_deep_copy_of_a_linked_segment_follows_its_plan_and_undo_restores() -> None:
    model = _spied("looped")
    apply_segment(model, _paths(model), linked=True)
    copied = copy.deepcopy(model)
    first = copied.get_submodule("blocks.1").forward
    assert isinstance(first, LinkedForward)
    assert first.chain is not model.get_submodule("blocks.1").forward.chain  # type: ignore[union-attr]
    x = torch.randn(32, 64)
    _step(copied, x)
    assert _spy(copied).seen == [(0, False), (1, True)] and not _spy(model).seen
    undo_segment(copied, _paths(copied))
    assert all("forward" not in copied.get_submodule(p).__dict__ for p in _paths(copied))
    _spy(copied).seen.clear()
    _step(copied, x)
    assert _spy(copied).seen == [(0, False)]  # a plain step


def test_a_block_whose_input_is_changed_between_blocks_keeps_it_and_warns_once() -> None:
    """The model scales block 1's output before block 2: block 2 cannot link, starts a new
    region and keeps its input; one warning, exact training."""
    torch.manual_seed(0)
    model = _Looped(scale=(1,)).train()
    segmented = copy.deepcopy(model)
    chain = apply_segment(segmented, _paths(model), linked=True)
    assert isinstance(chain, Linked)
    x = torch.randn(32, 64)
    with pytest.warns(UserWarning, match=r"block blocks\.2 of the plan's segment") as caught:
        _step(segmented, x)
        _step(segmented, x)
    assert len(caught) == 1 and chain.calls.broken == 2
    assert caught[0].filename == __file__  # the user's forward call, not a line inside remat
    # Blocks 2 and 3 still form one region: block 2 is recomputed once, with block 3.
    assert _spy(segmented, 2).seen == [(0, False), (1, True), (0, False), (0, True)]
    batches = [(x, torch.randn(32, 64)) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already
        assert_records_equal(train(model, batches, _loss), train(segmented, batches, _loss))


def test_a_forward_hook_that_replaces_a_blocks_output_breaks_the_link() -> None:
    """The segment runs each block's class forward; a forward hook of the model's own runs
    around it and may replace the output: the next block does not link, and stays exact."""
    torch.manual_seed(0)
    model = _Looped().train()
    segmented = copy.deepcopy(model)
    for m in (model, segmented):
        m.get_submodule("blocks.1").register_forward_hook(lambda mod, a, out: out * 1.0)
    chain = apply_segment(segmented, _paths(model), linked=True)
    assert isinstance(chain, Linked)
    x = torch.randn(32, 64)
    batches = [(x, torch.randn(32, 64)) for _ in range(2)]
    with pytest.warns(UserWarning, match=r"block blocks\.2"):
        assert_records_equal(train(model, batches, _loss), train(segmented, batches, _loss))
    assert chain.calls.broken == 2


@pytest.mark.parametrize("linked", [True, False])
def test_a_segments_blocks_show_their_forward_signature(linked: bool) -> None:
    """Callers choose arguments by ``inspect.signature(block.forward)`` (Hugging Face does);
    the forward a segment installs on each block shows the block's own."""
    model = _Looped().train()
    before = [inspect.signature(b.forward) for b in model.blocks]
    apply_segment(model, _paths(model), linked=linked)
    assert all("forward" in vars(b) for b in model.blocks[1:])  # an instance-level forward
    assert [inspect.signature(b.forward) for b in model.blocks] == before


def test_the_profile_finds_which_blocks_link() -> None:
    """Linked blocks' segments are measured on the region engine; a block whose input the
    model changes starts a new run, and no segment crosses into it."""
    from remat.planning._plan import segments
    from remat.planning.planner import _smallest, profile_model, solve
    from remat.workloads.mlp import MLPBlock

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(MLPBlock(128, 0.1) for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i == 2:
                    x = x * 0.5
            return x

    torch.manual_seed(0)
    model = Model().train()
    x, target = torch.randn(128, 128), torch.randn(128, 128)
    profiled = profile_model(model, x, lambda o: _loss(o, target), repeats=0)
    assert profiled.groups[1:] == ["layers.0"] * 2 + ["layers.3"] * 3
    segment_options = [o for o in profiled.options[profiled.types[1]] if o.kind == "segment"]
    assert segment_options and all(o.linked for o in segment_options)
    assert all(i + o.span <= 3 for i in range(3) for o in profiled.chain[i])
    plan = solve(profiled, _smallest(profiled.costs, profiled.chain))
    found = segments(plan.blocks)
    assert found, plan.summary()
    planned = plan.apply(copy.deepcopy(model))
    assert all(
        isinstance(planned.get_submodule(p).forward, LinkedForward) for s in found for p in s
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every link holds
        measured = _peak(planned, x, target)
    assert abs(measured - plan.predicted_peak) <= 0.03 * measured, plan.summary()
    assert_records_equal(
        train(copy.deepcopy(model), [(x, target)] * 2, _loss),
        train(planned, [(x, target)] * 2, _loss),
    )


def test_a_segment_may_start_at_a_first_block_whose_input_needs_no_gradient() -> None:
    """The model's first block takes an input that needs no gradient, so its type differs from
    the blocks after it. Its segments are measured on copies of it, whose later copies are of
    the next blocks' type, so they may cover those blocks, as torch's checkpoint_sequential's
    first segment does: a plan with one segment over all four blocks runs as predicted."""
    from remat.planning._plan import segments
    from remat.planning.planner import _smallest, profile_model, solve
    from remat.planning.solve import chain_peak

    torch.manual_seed(0)
    model = _Looped(n=4).train()
    x, target = torch.randn(32, 64), torch.randn(32, 64)
    profiled = profile_model(model, x, lambda o: _loss(o, target), repeats=0)
    first, rest = profiled.types[0], profiled.types[1]
    assert first != rest and profiled.types[1:] == [rest] * 3
    assert profiled.chained == {first: rest}
    assert all(o.linked for o in profiled.options[first] if o.kind == "segment")
    whole = next(k for k, o in enumerate(profiled.chain[0]) if o.span == 4)
    name = profiled.names[0][whole]
    # A plan of the solver's, set to that segment (the solver picks by time, and at this size
    # a segment and per-block regions take about the same).
    plan = solve(profiled, _smallest(profiled.costs, profiled.chain))
    plan.blocks = [
        {"path": f"blocks.{k}", "type": profiled.types[k], "option": name, "segment": "blocks.0"}
        for k in range(4)
    ]
    assert segments(plan.blocks) == [[f"blocks.{k}" for k in range(4)]]
    planned = plan.apply(copy.deepcopy(model))
    assert all(isinstance(b.forward, LinkedForward) for b in planned.blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every link holds
        measured = _peak(planned, x, target)
    predicted = chain_peak(profiled.costs, [profiled.chain[0][whole]])
    assert abs(measured - predicted) <= 0.03 * measured, (measured, predicted)
    assert_records_equal(
        train(copy.deepcopy(model), [(x, target)] * 2, _loss),
        train(planned, [(x, target)] * 2, _loss),
    )
    for k in range(4):
        _spy(planned, k).seen.clear()
    # One segment: each block runs in forward, then once in its recompute, which stops after
    # the last tensor backward needs (before the last block's spy).
    _step(planned, x)
    assert [_spy(planned, k).seen for k in range(4)] == [[(0, False), (0, True)]] * 3 + [
        [(0, False)]
    ]


def test_segments_of_blocks_that_do_not_link_stay_on_the_graph_engine() -> None:
    """Each block's output is scaled before the next block: no block links, so segments are
    measured and applied on the graph engine, which records what runs between blocks."""
    from remat.planning.planner import profile_model

    torch.manual_seed(0)
    model = _Looped(n=4, scale=(0, 1, 2, 3)).train()
    x = torch.randn(32, 64)
    profiled = profile_model(model, x, lambda o: o.square().mean(), repeats=0)
    assert profiled.groups == [""] * 4
    # Block 0's input needs no gradient: blocks 1 to 3 are the type with segments.
    segment_options = [o for o in profiled.options[profiled.types[1]] if o.kind == "segment"]
    assert segment_options and not any(o.linked for o in segment_options)


def test_a_graph_engine_segment_keeps_a_blocks_own_forward_and_undo_restores_it() -> None:
    """A block with an instance-level forward (a wrapper, as accelerate's hooks set one): the
    segment's forward calls it, a deep copy calls the copy's, and undo puts it back."""
    model = _model()
    plain = copy.deepcopy(model)
    calls: list[int] = []

    def own_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls.append(id(block))
        return type(block).forward(block, x)

    for m in (model, plain):
        block = m.get_submodule("blocks.2")
        block.forward = functools.partial(own_forward, block)
    apply_segment(model, _PATHS)
    copied = copy.deepcopy(model)
    records = train(model, _batches(), _loss)
    assert_records_equal(train(plain, _batches(), _loss), records)
    assert set(calls) == {id(model.blocks[2]), id(plain.blocks[2])}
    calls.clear()
    assert_records_equal(train(copied, _batches(), _loss), records)
    assert set(calls) == {id(copied.blocks[2])}
    undo_segment(model, _PATHS)
    assert model.blocks[2].__dict__["forward"].func is own_forward
    assert all("forward" not in model.get_submodule(p).__dict__ for p in ("blocks.1", "blocks.3"))


def test_unapply_undoes_a_plan_with_segments_on_both_engines() -> None:
    """remat.unapply leaves no part of a plan behind: a linked segment's forwards, a
    graph-engine segment's hooks (on its blocks and the root), a block's policy and its hooks."""
    torch.manual_seed(0)
    model = _Looped(n=6).train()
    plain = copy.deepcopy(model)
    apply_segment(model, ["blocks.0", "blocks.1"], linked=True)
    apply_segment(model, ["blocks.2", "blocks.3"])
    from remat.planning.apply import apply_option

    apply_option(model.get_submodule("blocks.4"), "blocks.4", "graph", {})
    remat.unapply(model)
    for m in model.modules():
        assert "forward" not in m.__dict__
        assert not m._forward_hooks and not m._forward_pre_hooks, type(m).__name__
    x = torch.randn(32, 64)
    _step(model, x)
    assert all(_spy(model, k).seen == [(0, False)] for k in range(6))  # plain: no recompute
    batches = [(x, torch.randn(32, 64)) for _ in range(2)]
    assert_records_equal(train(plain, batches, _loss), train(model, batches, _loss))


@pytest.mark.parametrize("faster", ["region", "graph"])
def test_linked_segments_run_on_the_engine_that_measured_faster(
    faster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where blocks link, segments of two and three blocks are timed on both engines; the
    faster one runs them (here the timing is made up: linked chains take 1 s or 2 s)."""
    from remat.planning import planner
    from remat.planning.planner import _smallest, profile_model, solve
    from remat.workloads.mlp import MLPBlock

    def seconds(
        block: nn.Module, plain: nn.Module, inputs: Any, device: Any, repeats: int
    ) -> float:
        on_region = any(
            isinstance(m.__dict__.get("forward"), LinkedForward) for m in block.modules()
        )
        return 1.0 if on_region == (faster == "region") else 2.0

    monkeypatch.setattr(planner, "measure_seconds", seconds)
    torch.manual_seed(0)
    model = nn.Sequential(*(MLPBlock(128, 0.1) for _ in range(6))).train()
    x, target = torch.randn(128, 128), torch.randn(128, 128)
    profiled = profile_model(model, x, lambda o: _loss(o, target), repeats=1)
    segment_options = [o for o in profiled.options[profiled.types[1]] if o.kind == "segment"]
    assert segment_options
    assert all(o.linked == (faster == "region") for o in segment_options)
    # The faster engine's timings are the options' (1 s for the chains of two and three).
    assert {o.measured_seconds for o in segment_options if o.source == "measured"} == {1.0}
    assert profiled.groups[1:] == (["0"] * 5 if faster == "region" else [""] * 5)
    plan = solve(profiled, _smallest(profiled.costs, profiled.chain))
    planned = plan.apply(copy.deepcopy(model))
    found = [p for s in segments_of(plan) for p in s]
    assert found, plan.summary()
    linked = [
        isinstance(planned.get_submodule(p).__dict__.get("forward"), LinkedForward) for p in found
    ]
    assert all(linked) if faster == "region" else not any(linked)
    assert_records_equal(
        train(copy.deepcopy(model), [(x, target)] * 2, _loss),
        train(planned, [(x, target)] * 2, _loss),
    )


def segments_of(plan: remat.Plan) -> list[list[str]]:
    from remat.planning._plan import segments

    return segments(plan.blocks)


def test_the_summary_lists_blocks_by_path_in_runs_of_one_option() -> None:
    """Each line of the summary's block list is a run of consecutive blocks with one option,
    by path; a run of segments counts blocks and segments, so that 2x segment-2 cannot be
    read as two blocks."""
    from remat.planning._plan import _block_runs

    def block(i: int, option: str, segment: int | None = None, kind: str = "A") -> dict[str, Any]:
        found: dict[str, Any] = {"path": f"l.{i}", "type": kind, "option": option}
        if segment is not None:
            found["segment"] = f"l.{segment}"
        return found

    blocks = [
        block(0, "graph-4"),
        *(block(i, "segment-2", 1 + 2 * ((i - 1) // 2)) for i in range(1, 5)),
        *(block(i, "segment-3", 5) for i in range(5, 8)),
        block(8, "region"),
        block(9, "region"),
        block(10, "plain", kind="B"),
    ]
    assert _block_runs(blocks, several_types=False, aligned=True) == [
        "l.0       graph-4",
        "l.1..l.4  segment-2 (4 blocks, 2 segments)",
        "l.5..l.7  segment-3 (3 blocks, one segment)",
        "l.8..l.9  region (2 blocks)",
        "l.10      plain",
    ]
    assert _block_runs(blocks, several_types=True, aligned=True)[-1] == "l.10      B: plain"
    assert _block_runs(blocks, several_types=False, aligned=False)[0] == "l.0  graph-4"


@pytest.mark.parametrize("linked", [True, False], ids=["region-engine", "graph-engine"])
def test_a_segment_left_open_pickles_and_trains_on_exactly(linked: bool) -> None:
    """A forward that stops inside a segment (an early exit after its first block) leaves a
    linked chain holding its last call by weak references, which do not pickle;
    ``torch.save(model)`` raised. A pickle now starts with the segment closed, and the loaded
    model and the original both train on bit-equal to a plain one. (A graph-engine segment's
    first block called alone, a feature probe, runs as a region of its own and leaves nothing
    open: see ``test_a_graph_engine_segments_block_called_alone_runs_as_a_region_of_its_own``.)
    """
    import io

    plain = _model()
    model = copy.deepcopy(plain)
    apply_segment(model, _PATHS, linked=linked)
    x, _ = _batches()[0]
    for m in (plain, model):
        m.stop_after = 1  # runs blocks.0 and blocks.1, the segment's first
        m(x).sum().backward()
        m.stop_after = None
        if not linked:
            m.blocks[1](x)  # alone, outside the model's forward
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    expected = train(copy.deepcopy(plain), _batches(), _loss)
    assert_records_equal(expected, train(loaded, _batches(), _loss))
    assert_records_equal(expected, train(model, _batches(), _loss))


def test_a_linked_segment_whose_first_block_is_frozen_links_no_call_and_says_nothing() -> None:
    """With the layers below frozen (and the model's input needing no gradient), a linked
    segment's first block computes no gradient and saves nothing: its frame is gone when the
    next block runs, so there is nothing to link to. That counted as a broken link, with a
    warning that the code between the blocks changed its output; now it counts as none (the
    warning would be an error here), and the step equals the plain one."""
    plain = _model()
    for block in list(plain.blocks)[:2]:
        block.requires_grad_(False)
    model = copy.deepcopy(plain)
    chain = apply_segment(model, _PATHS, linked=True)
    assert isinstance(chain, Linked)
    x, target = _batches()[0]
    grads = []
    for m in (plain, model):
        torch.manual_seed(0)
        _loss(m(x), target).backward()
        grads.append([p.grad for p in m.parameters()])
    assert chain.calls.broken == 0
    assert_equal(grads[0], grads[1], "grads")


@pytest.mark.parametrize("linked", [True, False])
def test_a_segment_whose_blocks_fsdp_shards_refuses_to_run(linked: bool) -> None:
    """FSDP gathers a block's parameters for that block's own forward and backward; a
    segment's recompute runs the blocks before it as well, whose parameters are sharded then.
    A segment set up and then sharded raises at its forward, naming the block and the way out
    (no segments), on either engine."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    apply_segment(model, _PATHS, linked=linked)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        with pytest.raises(
            remat.RematError,
            match=r"blocks\.1 .* is sharded by FSDP \(FSDP_Block\).*segments=False",
        ):
            model(torch.randn(4, 64))
    finally:
        dist.destroy_process_group()


def _nothing_open() -> None:
    """No region, dispatch mode or saved-tensor hooks left on the thread."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert not remat.is_checkpointing()
    assert _state.state.graph is None and _state.state.offload is None
    assert _get_current_dispatch_mode_stack() == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.mark.parametrize("called", ["first", "middle", "loop"])
def test_a_graph_engine_segments_block_called_alone_runs_as_a_region_of_its_own(
    called: str,
) -> None:
    """A block of a graph-engine segment called outside the model's forward (a feature probe,
    a loss on one block's output, a loop over the blocks) opened the segment and left it open
    after the call returned: every later op on the thread was recorded. It now runs as a
    region of its own (its input kept, the rest recomputed in backward), leaves nothing open,
    and its gradients are bit-equal to a plain block's."""
    model = _model()
    segmented = copy.deepcopy(model)
    apply_segment(segmented, _PATHS)
    x, _ = _batches()[0]
    counts, grads = [], []
    for m in (model, segmented):
        blocks = {"first": [m.blocks[1]], "middle": [m.blocks[2]], "loop": list(m.blocks)}
        xm = x.detach().clone().requires_grad_(True)
        torch.manual_seed(3)
        h = xm
        for block in blocks[called]:
            h = block(h)
        if m is segmented:
            _nothing_open()
        with counting_ops() as ops:
            h.square().sum().backward()  # type: ignore[no-untyped-call]
        counts.append(ops.counts.get("addmm", 0))
        grads.append([xm.grad, *(p.grad for p in m.parameters())])
    assert_equal(grads[0], grads[1])
    assert counts[1] > counts[0]  # recomputed: a region, not a plain block
    _nothing_open()
    assert_records_equal(train(model, _batches(), _loss), train(segmented, _batches(), _loss))


@pytest.fixture
def every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner keeps each option it measured: which options dominate turns on timed
    seconds."""
    from remat.planning import planner

    monkeypatch.setattr(planner, "undominated", list)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


@pytest.mark.usefixtures("every_option")
@pytest.mark.parametrize("where", ["in-a-block", "between-blocks"])
def test_an_interrupt_in_a_graph_engine_segment_leaves_nothing_behind(where: str) -> None:
    """Torch runs ``always_call`` forward hooks for an ``Exception`` only: a
    ``KeyboardInterrupt`` (Ctrl-C) left a plan's graph-engine segment recording on the thread
    and its count of forwards under way off, so later steps warned that blocks ran more
    often than planned. An interrupt inside a block of the segment now closes it at once;
    one between its blocks, at the model's next forward (NOTE [ Interrupted forwards ] in
    ``planning/apply.py``). The next steps are bit-equal to a plain model's, and quiet."""
    from remat.planning.apply import Outer

    torch.manual_seed(0)
    model = _Looped(n=4, scale=(0, 1, 2, 3)).train()
    x = torch.randn(32, 64)
    plan = remat.plan(model, x, budget="100%", loss_fn=lambda o: o.square().mean(), repeats=0)
    # blocks.1 and blocks.2 as one segment, whose blocks do not link: the graph engine
    plan.blocks = [
        {"path": b["path"], "type": b["type"], "option": "plain"}
        | ({"option": "segment-2", "segment": "blocks.1"} if b["path"] in _PATHS[:2] else {})
        for b in plan.blocks
    ]
    plain, planned = copy.deepcopy(model), plan.apply(copy.deepcopy(model))
    assert isinstance(planned.blocks[1].__dict__["forward"], SegmentForward)
    if where == "in-a-block":
        handle = planned.blocks[2][0].fc2.register_forward_pre_hook(_interrupt)
    else:
        handle = planned.blocks[1].register_forward_hook(_interrupt)
    interrupted = False
    try:
        planned(x)
    except KeyboardInterrupt:
        interrupted = True
    handle.remove()
    assert interrupted
    if where == "in-a-block":
        _nothing_open()
    batches = [(x, torch.randn(32, 64)) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = train(planned, batches, _loss)
    assert_records_equal(train(plain, batches, _loss), records)
    _nothing_open()
    outer = [h.__self__ for h in planned._forward_pre_hooks.values() if hasattr(h, "__self__")]
    assert [o.count.depth for o in outer if isinstance(o, Outer)] == [0]


def test_an_interrupt_inside_a_block_with_a_tier_closes_its_offload_scope() -> None:
    """A block a plan runs inside ``remat.offload(tier)``: an interrupt inside it skips the
    hook that leaves the scope. The block's next call closes it before opening its own, and
    training goes on bit-equal to a plain model."""
    from remat.planning.apply import apply_option

    model = _model()
    offloaded = copy.deepcopy(model)
    apply_option(offloaded.blocks[2], "blocks.2", "plain", {}, tier="disk")
    handle = offloaded.blocks[2].fc2.register_forward_pre_hook(_interrupt)
    x, _ = _batches()[0]
    interrupted = False
    try:
        offloaded(x)
    except KeyboardInterrupt:
        interrupted = True
    handle.remove()
    assert interrupted
    assert_records_equal(train(model, _batches(), _loss), train(offloaded, _batches(), _loss))
    _nothing_open()
