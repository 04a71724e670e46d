"""Offload tiers in the planner: ``remat.plan(..., tiers=["recompute", "disk"])`` (see
[ The block MILP ] in planning/solve.py and NOTE [ Memory the allocator sees ] in store/disk.py)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat import RematError
from remat.bench.measure import peak_step_bytes
from remat.planning import planner
from remat.planning._plan import Option
from remat.planning.apply import apply_option, undo_option
from remat.planning.planner import (
    _smallest,
    profile_model,
    solve,
    solve_measured,
    undominated,
)
from remat.planning.profile import profile_block
from remat.planning.solve import solve_block
from remat.store import DiskTier
from remat.workloads.mlp import MLPBlock

from helpers import assert_save_and_resume_exact, wait_for


class _Net(nn.Module):
    """Blocks with dropout, then a BatchNorm head: buffers must update exactly once a step."""

    def __init__(self, n: int = 6, width: int = 128) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(MLPBlock(width, 0.1) for _ in range(n)))
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(self.blocks(x)))
        return out


def _build() -> _Net:
    torch.manual_seed(0)
    return _Net().train()


X = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))
TARGET = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out - TARGET).square().mean()


@pytest.fixture
def disk(tmp_path: Any) -> Iterator[DiskTier]:
    """A disk tier of the test's own, as the tier named "disk" for what runs in the test."""
    with DiskTier(tmp_path) as tier, remat.store.tiers(disk=tier):
        yield tier


def _files(tier: DiskTier) -> list[Any]:
    return list(tier.directory.iterdir())


def _no_files(tier: DiskTier) -> None:
    """Wait until ``tier`` holds no file: a dropped ticket's file goes when the I/O on it ends
    (a read ahead of a tensor backward then did not need), on the tier's threads."""
    wait_for(lambda: not _files(tier))


def test_tiers_are_checked_before_any_work() -> None:
    model = _build()
    with pytest.raises(RematError, match="host memory already"):
        remat.plan(model, X, "50%", _loss, tiers=["recompute", "host"])
    for bad in (["recompute", "tape"], "disk", []):
        with pytest.raises(RematError, match="tiers must be a list"):
            remat.plan(model, X, "50%", _loss, tiers=bad)  # type: ignore[arg-type]


def test_the_disk_tier_plans_below_what_recompute_alone_reaches(disk: DiskTier) -> None:
    model = _build()
    alone = profile_model(model, X, _loss, repeats=0)
    tiered = profile_model(model, X, _loss, tiers=["recompute", "disk"], repeats=0)
    assert alone.tiers == ["recompute"] and tiered.tiers == ["recompute", "disk"]
    floor = _smallest(alone.costs, alone.chain)
    lower = _smallest(tiered.costs, tiered.chain)
    assert lower < 0.9 * floor, (lower, floor)
    budget = (lower + floor) // 2
    with pytest.raises(remat.NoPlanFits):
        solve(alone, budget)
    plan = solve_measured(tiered, budget, model, X, _loss)
    used = [plan.option(b) for b in plan.blocks]
    assert any(o.tier == "disk" or "disk" in o.decisions.values() for o in used), plan.summary()
    assert plan.measured["verified_peak"] <= budget
    # The prediction is the measured peak of the applied plan, as a user measures it.
    applied = plan.apply(copy.deepcopy(model))

    def step() -> None:
        _loss(applied(X)).backward()  # type: ignore[no-untyped-call]

    step()  # a warm-up step, as the planner's
    measured = peak_step_bytes(step, torch.device("cpu"))
    # The prediction counts an offloading block's writes as all pending at once (see
    # [ Offloaded options ]): the measured peak is at most that, and below by what the disk
    # wrote in time (a block's activations here).
    assert 0.85 * plan.predicted_peak <= measured <= 1.03 * plan.predicted_peak
    assert measured <= budget
    assert disk.stats.bytes_written > 0
    _no_files(disk)


def test_a_disk_plan_in_a_users_loop_with_save_and_resume(disk: DiskTier, tmp_path: Any) -> None:
    """AdamW, clip_grad_norm_, zero_grad(set_to_none=True), a save after two steps and a
    resumed third step in a fresh model with the plan loaded: bit-equal to three plain steps,
    and no file of the tier outlives a step."""
    model, plain = _build(), _build()
    profiled = profile_model(model, X, _loss, tiers=["recompute", "disk"], repeats=0)
    plan = solve(profiled, _smallest(profiled.costs, profiled.chain))
    assert any(plan.option(b).tier == "disk" for b in plan.blocks), plan.summary()
    plan.apply(model)
    plan.save(tmp_path / "plan.json")
    written = disk.stats.bytes_written

    def resume() -> nn.Module:
        loaded = remat.Plan.load(tmp_path / "plan.json")
        assert loaded.to_json() == plan.to_json()
        return loaded.apply(_build())

    def no_files() -> None:
        _no_files(disk)

    assert_save_and_resume_exact(model, plain, resume, lambda m: _loss(m(X)), tmp_path, no_files)
    assert disk.stats.bytes_written > written


def test_a_graph_option_offloads_exactly_the_ops_its_plan_names(disk: DiskTier) -> None:
    # tanh and sigmoid save their outputs; the matmuls' outputs are saved by nothing.
    block = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 128), nn.Sigmoid())
    inputs = ((torch.randn(64, 128, requires_grad=True),), {})
    profile = profile_block(block, inputs, "Sequential#0", torch.device("cpu"), repeats=1)
    choice = solve_block(profile, cap=0, offload_cost=1e-12)  # writing is all but free
    assert choice is not None and choice.keep == frozenset()
    names = sorted(profile.ops[i].key for i in choice.offload)
    assert names == ["1|aten.tanh.default|0", "3|aten.sigmoid.default|0"], names
    decisions = {
        op.key: "disk" if i in choice.offload else "recompute" for i, op in enumerate(profile.ops)
    }
    planned = copy.deepcopy(block)
    apply_option(planned, "b", "graph", decisions)
    x = inputs[0][0].detach().clone().requires_grad_()
    before = disk.stats
    torch.manual_seed(0)
    out = planned(x)
    after = disk.stats
    assert after.bytes_written - before.bytes_written == (64 * 256 + 64 * 128) * 4
    assert after.files_written - before.files_written == 2
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    # Backward's four matmuls (input and weight gradients of both linears), no replayed one.
    assert counter.get_total_flops() == 4 * (2 * 64 * 128 * 256)
    expected_x = x.detach().clone().requires_grad_()
    block(expected_x).sum().backward()
    assert torch.equal(x.grad, expected_x.grad)  # type: ignore[arg-type]
    for p, q in zip(planned.parameters(), block.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    undo_option(planned)
    assert not planned._forward_pre_hooks and not planned._forward_hooks
    _no_files(disk)


def test_under_autocast_an_option_s_cached_bytes_are_its_casts_alone(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a loop's autocast, what an option leaves in autocast's cache (``cached``) is the
    casts of the block's weights, whatever the option does with its input: a region that
    writes its input to disk frees it as the next block starts, which counts in ``kept``. Were
    it counted in ``cached`` too, every disk plan would be predicted an input per block above
    its peak at the forward's end, and the disk tier would reach no lower than recompute."""
    # Every option is kept: which ones another beats on time is a matter of timing noise, and
    # the memory each holds is what this test reads.
    monkeypatch.setattr(planner, "undominated", lambda options: options)
    model = _build()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        profiled = profile_model(model, X, _loss, tiers=["recompute", "disk"], repeats=0)
    linear = model.blocks[1].linear
    casts = (linear.weight.numel() + linear.bias.numel()) * torch.bfloat16.itemsize
    # The second block: the first one's input needs no gradient, so its matmul keeps no weight.
    second = profiled.types[profiled.paths.index("blocks.1")]
    options = {o.name: o for o in profiled.options[second] if o.span == 1}
    plain = options["plain"]
    # The matmul keeps the cast weight, not the bias: only the bias's cast is the cache's.
    assert plain.cached == linear.bias.numel() * torch.bfloat16.itemsize
    # The region, and the block with all it saves on disk (the cast weight too: the cache
    # holds it still).
    region, on_disk = options["region"], options["offload-disk"]
    assert on_disk.tier == "disk"
    assert region.cached == casts and on_disk.cached == casts, (region, on_disk)
    # On disk, the block frees the input the region keeps, and holds nothing else.
    assert on_disk.kept <= region.kept - X.numel() * X.element_size() + 1024
    # So the disk tier plans below what recompute alone reaches, and the plan fits in the loop.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        alone = profile_model(model, X, _loss, repeats=0)
    lower, floor = _smallest(profiled.costs, profiled.chain), _smallest(alone.costs, alone.chain)
    assert lower < floor
    # Between the two: at ``lower`` itself, when the disk's writes and reads land moves the
    # measured peak by up to a few tens of KiB from step to step (see the planner's limits),
    # which the measured check answers by solving again.
    budget = (lower + floor) // 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plan = solve_measured(profiled, budget, model, X, _loss)
    assert any(plan.option(b).tier == "disk" for b in plan.blocks), plan.summary()
    assert plan.measured["verified_peak"] <= budget


def test_disk_alone_never_recomputes(disk: DiskTier) -> None:
    """``tiers=["disk"]``: the plan offloads or keeps, and backward runs no forward op again."""
    model = _build()
    profiled = profile_model(model, X, _loss, tiers=["disk"], repeats=0)
    kinds = {(o.kind, o.tier) for opts in profiled.options.values() for o in opts}
    assert kinds == {("plain", None), ("plain", "disk")}
    plan = solve(profiled, _smallest(profiled.costs, profiled.chain))
    assert {plan.option(b).name for b in plan.blocks} == {"offload-disk"}

    def flops(m: nn.Module) -> int:
        with FlopCounterMode(display=False) as counter:
            torch.manual_seed(0)
            _loss(m(X)).backward()  # type: ignore[no-untyped-call]
        return int(counter.get_total_flops())

    plain = _build()
    applied = plan.apply(_build())
    assert flops(applied) == flops(plain)
    for p, q in zip(applied.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def test_the_plan_records_the_tier_bandwidths_measured_while_blocks_computed(
    disk: DiskTier,
) -> None:
    model = _build()
    profiled = profile_model(model, X, _loss, tiers=["recompute", "disk"], repeats=1)
    assert profiled.bandwidths["disk_write"] > 0 and profiled.bandwidths["disk_read"] > 0
    plan = solve(profiled, "60%")
    assert plan.bandwidths == profiled.bandwidths
    assert remat.Plan.from_json(plan.to_json()).bandwidths == plan.bandwidths
    assert "tiers recompute, disk" in plan.summary()
    assert f"writes {plan.bandwidths['disk_write'] / 1e9:.2f} GB/s" in plan.summary()


def test_an_option_that_offloads_never_drops_one_that_does_not() -> None:
    """A plan without the disk tier from a profile with it (``restricted(["recompute"])``, as
    the bench plans both from one profile) still has every recompute option it would have
    had: ``region-disk`` beating ``region`` on every count does not drop it; another recompute
    option does."""
    plain = Option("plain", "plain", kept=100, backward=50, seconds=0.0)
    region = Option("region", "region", kept=10, backward=50, seconds=1.0)
    on_disk = Option("region-disk", "region", kept=0, backward=50, seconds=0.5, tier="disk")
    assert [o.name for o in undominated([plain, region, on_disk])] == [
        "plain",
        "region",
        "region-disk",
    ]
    better = Option("graph-0", "graph", kept=5, backward=40, seconds=0.9)
    assert [o.name for o in undominated([plain, region, on_disk, better])] == [
        "plain",
        "region-disk",
        "graph-0",
    ]
    # The chain counts an offloading option's forward as its backward too.
    slow = Option("offload-disk", "plain", kept=0, backward=10, seconds=0.5, tier="disk")
    slow.forward = 100
    assert "offload-disk" in [o.name for o in undominated([plain, region, slow, on_disk])]


def test_offloading_is_timed_on_every_block_of_a_type_at_once(disk: DiskTier) -> None:
    """``_offload_across`` runs whole steps with every block of the type offloaded, against
    plain ones (the tier writes every block's saved tensors in each offloaded step, and nothing
    in the plain ones), and leaves the blocks as it found them: see [ Offload priced across
    the chain ]."""
    from remat.planning.planner import _offload_across, _offloaded_bytes, _step

    model = _build()
    paths = [f"blocks.{i}" for i in range(6)]
    step = _step(model, X, _loss)
    profile = profile_block(model.blocks[0], ((X,), {}), "MLPBlock", torch.device("cpu"))
    before = disk.stats.bytes_written
    seconds = _offload_across(model, paths, step, torch.device("cpu"), "disk", pairs=3)
    across = disk.stats.bytes_written - before
    assert seconds >= 0.0
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in model.blocks)
    _no_files(disk)
    # One step with every block offloaded, by hand.
    for block, path in zip(model.blocks, paths, strict=True):
        apply_option(block, path, "plain", {}, "disk")
    before = disk.stats.bytes_written
    step()
    one = disk.stats.bytes_written - before
    for block in model.blocks:
        undo_option(block)
    # One offloaded step to warm up, then one per pair; each writes what every block saves,
    # its input included (what the profile counts).
    assert across == 4 * one
    assert one == 6 * _offloaded_bytes(profile) and profile.saved_inputs == [X.nbytes]


class _SavesViews(nn.Module):
    """A block whose Linear's result autograd saves only through two views of it (a reshape
    and a slice, each multiplied by a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.scale = nn.Parameter(torch.ones(4, 16))
        self.gain = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        out: torch.Tensor = (h.view(-1, 4, 16) * self.scale).sum(1) + h[:, :16] * self.gain
        return out


def test_what_the_profile_says_offload_moves_is_what_it_writes(disk: DiskTier) -> None:
    """``_offloaded_bytes`` (what ``offload-disk`` moves of a block, by which offloading's time
    is shared between options) is what ``remat.offload`` writes: it decides by storage
    (``Scope.wants``), so the views of the Linear's result move that result's storage, once,
    though the result itself is not saved; the transposed weight, a parameter's storage,
    stays; and the block's input moves."""
    from remat.planning.planner import _offloaded_bytes

    torch.manual_seed(0)
    block = _SavesViews()
    x = torch.randn(32, 16, requires_grad=True)
    profile = profile_block(block, ((x,), {}), "_SavesViews", torch.device("cpu"), repeats=1)
    apply_option(block, "block", "plain", {}, "disk")
    before = disk.stats.bytes_written
    block(x * 1).sum().backward()
    written = disk.stats.bytes_written - before
    undo_option(block)
    assert written == _offloaded_bytes(profile) == 32 * 64 * 4 + x.nbytes


def test_what_offloading_costs_across_the_chain_is_added_by_bytes_moved() -> None:
    """Each option that uses the tier pays the excess of the chain's per-block timing over the
    one-block timing, per byte it moves; options that do not use it are untouched."""
    from remat.planning.planner import _price_across
    from remat.planning.profile import BlockProfile, OpRecord

    ops = [
        OpRecord(key="a", bytes=6000, saved=True, deps=(), must_save=False),
        OpRecord(key="b", bytes=4000, saved=True, deps=(0,), must_save=False),
    ]
    profile = BlockProfile(name="B", ops=ops, forward_seconds=0.0)
    inputs = ((torch.zeros(250),), {})  # 1,000 bytes: what a region or segment offloads
    everything = Option("offload-disk", "plain", 0, 0, 0.0, 0.010, tier="disk")
    region = Option("region-disk", "region", 0, 0, 0.0, 0.012, tier="disk")
    segment = Option("segment-2-disk", "segment", 0, 0, 0.0, 0.030, span=2, tier="disk")
    graph = Option(
        "graph-0-disk", "graph", 0, 0, 0.0, 0.005, decisions={"a": "recompute", "b": "disk"}
    )
    _price_across([everything, region, segment, graph], 0.016, profile, inputs, "disk")
    # 6 ms more a block for the 10,000 bytes everything moves: 0.6 us a byte.
    assert everything.measured_seconds == pytest.approx(0.016)
    assert region.measured_seconds == pytest.approx(0.012 + 0.0006)
    assert segment.measured_seconds == pytest.approx(0.030 + 0.0006)
    assert graph.measured_seconds == pytest.approx(0.005 + 0.0024)
    # Cheaper across the chain than alone: nothing changes.
    _price_across([region], 0.001, profile, inputs, "disk")
    assert region.measured_seconds == pytest.approx(0.0126)


def test_the_profile_prices_offloading_across_each_repeated_block_type(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``profile_model`` times offloading across the blocks of every type that repeats, and
    each of its options that use the tier carries the excess; a type of one block keeps its
    one-block timing."""
    calls: list[tuple[list[str], str]] = []

    def across(
        model: nn.Module, paths: list[str], step: Any, device: Any, tier: str, pairs: int
    ) -> float:
        calls.append((list(paths), tier))
        return 10.0  # ten seconds a block: far above any one-block timing, even under load

    monkeypatch.setattr(planner, "_offload_across", across)
    profiled = profile_model(_build(), X, _loss, tiers=["recompute", "disk"], repeats=1, points=2)
    types = dict.fromkeys(profiled.types)
    assert len(types) == 2  # the first block's input needs no gradient: a type of its own
    first, rest = types
    assert calls == [([f"blocks.{i}" for i in range(1, 6)], "disk")]

    # The repeated type: everything offloaded costs what the chain measured, and every option
    # that sends bytes to disk pays for them (a region's input: a third of what the block
    # saves); the rest, and the type of one block, keep their one-block timings (milliseconds).
    def seconds(o: Option) -> float:
        assert o.measured_seconds is not None
        return o.measured_seconds

    everything = next(o for o in profiled.options[rest] if o.name == "offload-disk")
    assert seconds(everything) == pytest.approx(10.0)
    assert all(seconds(o) > 2.0 for o in profiled.options[rest] if o.offloads)
    assert all(seconds(o) < 1.0 for o in profiled.options[rest] if not o.offloads)
    assert all(seconds(o) < 1.0 for o in profiled.options[first])


def _autograd_uses(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    """A step's loss and gradients three ways users take them: two backward passes over one
    retained graph, ``torch.autograd.grad`` (which leaves ``.grad`` alone), and a gradient
    penalty (double backward through ``create_graph=True``)."""
    from remat.workloads import get_workload

    loss_fn = get_workload("gpt", "small").loss_fn
    params = list(model.parameters())
    got: list[torch.Tensor] = []
    torch.manual_seed(7)
    loss = loss_fn(model(x), target)
    loss.backward(retain_graph=True)
    loss.backward()
    got += [loss.detach(), *(p.grad.clone() for p in params)]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(8)
    grads = torch.autograd.grad(loss_fn(model(x), target), params)
    assert all(p.grad is None for p in params)
    got += grads
    torch.manual_seed(9)
    loss = loss_fn(model(x), target)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    total = loss + sum(g.square().sum() for g in grads)
    total.backward()
    got += [total.detach(), *(p.grad.clone() for p in params)]  # type: ignore[union-attr]
    return got


def test_every_option_a_plan_applies_is_exact_for_retained_graphs_grad_and_double_backward(
    disk: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each option the planner measured for the GPT's blocks (plain, a region, the graph
    engine at each cap of its front, offloading to disk, a region's input on disk, the graph
    engine with disk among its choices, segments of two to four blocks with their input kept
    or on disk), applied to every block, gives the plain model's losses and
    gradients bit for bit when the graph is retained and walked twice, when gradients come from
    ``torch.autograd.grad``, and through a gradient penalty's double backward; the options
    with the disk tier write to it and leave no file, and each graph-engine block follows its
    plan in every op."""
    from remat.planning.planner import profile_model, solve
    from remat.workloads import get_workload

    workload = get_workload("gpt", "small")
    model = workload.model(seed=0)
    x, target = workload.batch(seed=0)
    # Every option measured, dominated or not (which dominate turns on one timing run).
    monkeypatch.setattr(planner, "undominated", list)
    profiled = profile_model(
        model, x, lambda o: workload.loss_fn(o, target), tiers=["recompute", "disk"], repeats=0
    )
    (kind,) = set(profiled.types)
    plan = solve(profiled, "100%")
    names = [o.name for o in profiled.options[kind]]
    kinds = {o.kind for o in profiled.options[kind]}
    assert kinds == {"plain", "region", "graph", "segment"}, names
    assert {o.tier for o in profiled.options[kind]} == {None, "disk"}, names
    expected = _autograd_uses(workload.model(seed=0), x, target)
    n = len(profiled.paths)
    for option in profiled.options[kind]:
        if option.span > 1:  # segments of ``span`` blocks, one after another
            plan.blocks = [
                {"path": p, "type": kind, "option": option.name}
                | {"segment": profiled.paths[k - k % option.span]}
                for k, p in enumerate(profiled.paths)
                if n - (k - k % option.span) >= option.span
            ]
            plan.blocks += [
                {"path": p, "type": kind, "option": "plain"}
                for p in profiled.paths[len(plan.blocks) :]
            ]
        else:
            plan.blocks = [{"path": p, "type": kind, "option": option.name} for p in profiled.paths]
        planned = plan.apply(workload.model(seed=0))
        written = disk.stats.bytes_written
        got = _autograd_uses(planned, x, target)
        assert len(got) == len(expected)
        for k, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(a, b), (option.name, k)
        assert (disk.stats.bytes_written > written) == option.offloads, option.name
        _no_files(disk)
        assert bool(plan.policies) == (option.kind == "graph"), option.name
        for policy in plan.policies:
            assert policy.followed > 0 and policy.unfollowed == 0, (option.name, plan.report())
    # How many caps the fronts hold turns on the ops' timed seconds (one noisy run here);
    # every kind is there, and every segment.
    segments = [n for n in names if n.startswith("segment-")]
    assert segments == [f"segment-{k}{t}" for t in ("", "-disk") for k in (2, 3, 4)], names
