"""remat regions under torch.compile, and compiled functions inside remat regions.

Small shapes and few compiles: Dynamo is reset around every test.
"""

from __future__ import annotations

import copy
import functools
import gc
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import remat
from remat.policies import Decision, save_matmuls


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.l1 = nn.Linear(width, 2 * width)
        self.l2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)).sin()) + x


class Model(nn.Module):
    """Two blocks; ``how`` says how they are checkpointed inside ``forward``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.how == "remat":
                x = remat.checkpoint(block, x)
            elif self.how == "remat-policy":
                x = remat.checkpoint(block, x, policy=save_matmuls)
            elif self.how == "mixed":  # one region of each engine
                policy = save_matmuls if block is self.blocks[1] else None
                x = remat.checkpoint(block, x, policy=policy)
            elif self.how == "torch":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x.sum()


def build(how: str) -> Model:
    torch.manual_seed(0)
    return Model(how)


def saved_bytes(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The output of ``run()`` and the bytes autograd saved for backward while it ran."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, total


def grads(model: nn.Module, x: torch.Tensor, loss: torch.Tensor) -> list[torch.Tensor]:
    loss.backward()
    assert x.grad is not None
    return [x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]


def compiled_run(how: str) -> tuple[list[torch.Tensor], int, int, int]:
    """Gradients, saved bytes, frames compiled and graph breaks of ``torch.compile(model)``."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build(how)
    counter = CompileCounterWithBackend("aot_eager")
    x = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(1))
    loss, nbytes = saved_bytes(lambda: torch.compile(model, backend=counter)(x))
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return grads(model, x, loss), nbytes, counter.frame_count, breaks


def test_torch_compile_of_a_model_with_regions_of_each_engine() -> None:
    plain, plain_bytes, plain_frames, _ = compiled_run("plain")
    _, torch_bytes, torch_frames, torch_breaks = compiled_run("torch")
    for how in ("remat", "remat-policy"):
        got, nbytes, frames, breaks = compiled_run(how)
        assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True)), how
        # One graph, as torch's checkpoint gets, and no more breaks than it gets.
        assert (frames, breaks) == (torch_frames, torch_breaks) == (plain_frames, 0), how
        # The compiled region still saves less than the compiled plain model.
        assert nbytes < plain_bytes, (how, nbytes, plain_bytes)
    assert torch_bytes < plain_bytes


@pytest.mark.parametrize("linked", [True, False], ids=["region-engine", "graph-engine"])
def test_a_planned_segment_under_compile_lowers_each_block_to_a_region(linked: bool) -> None:
    """A planned segment, on either engine: under torch.compile each block is torch's
    checkpoint, in one graph, with exact gradients and less saved than plain (the graph
    engine's recording cannot be traced; run plainly, the segment would save everything)."""
    from remat.planning.apply import apply_segment

    plain, plain_bytes, plain_frames, _ = compiled_run("plain")
    _, torch_bytes, _, _ = compiled_run("torch")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build("plain")
    apply_segment(model, ["blocks.0", "blocks.1"], linked=linked)
    counter = CompileCounterWithBackend("aot_eager")
    x = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(1))
    loss, nbytes = saved_bytes(lambda: torch.compile(model, backend=counter)(x))
    assert (counter.frame_count, sum(torch._dynamo.utils.counters["graph_break"].values())) == (
        plain_frames,
        0,
    )
    got = grads(model, x, loss)
    assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))
    assert nbytes == torch_bytes < plain_bytes


def test_compiled_apply_keeps_one_graph_and_exact_gradients() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Block())
    wrapped = remat.apply(copy.deepcopy(plain), Block, policy=save_matmuls)
    x = torch.randn(4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    expected = grads(plain, x, torch.compile(plain, backend="aot_eager")(x).sum())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(wrapped, backend=counter)
    loss = compiled(x2).sum()
    assert counter.frame_count == 1
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    got = grads(wrapped, x2, loss)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # Later calls reuse the graph: the first once cached the regions' module names on the
    # wrapper while Dynamo traced, which failed a guard, and every model compiled twice.
    for _ in range(2):
        compiled(x2).sum().backward()
    assert counter.frame_count == 1


def test_policy_offload_must_is_refused_under_compile_and_prefer_is_saved() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    from remat._compile import torch_policy

    def prefer(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return Decision.PREFER_OFFLOAD_HOST

    def must(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return Decision.MUST_OFFLOAD_HOST

    aten = torch.ops.aten
    assert torch_policy(prefer, "", None, None, aten.mm.default) is CheckpointPolicy.PREFER_SAVE
    assert torch_policy(save_matmuls, "", None, None, aten.sin.default) is (
        CheckpointPolicy.PREFER_RECOMPUTE
    )
    # Data-dependent ops are saved whatever a PREFER_ policy says, as in eager.
    assert torch_policy(save_matmuls, "", None, None, aten.nonzero.default) is (
        CheckpointPolicy.MUST_SAVE
    )
    with pytest.raises(remat.RematError, match="cannot offload"):
        torch_policy(must, "", None, None, aten.mm.default)


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.bn(self.l1(x)))).sin()


def test_checkpoint_of_a_compiled_block_is_exact_and_compiles_once() -> None:
    torch.manual_seed(0)
    plain = NormBlock()
    block = copy.deepcopy(plain)
    x = torch.randn(4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()

    torch.manual_seed(2)
    out, plain_bytes = saved_bytes(lambda: torch.compile(plain, backend="aot_eager")(x))
    expected = grads(plain, x, out.sum())

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter)
    torch.manual_seed(2)
    out2, nbytes = saved_bytes(lambda: remat.checkpoint(compiled, x2))
    assert torch.equal(out, out2)
    got = grads(block, x2, out2.sum())
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # The recompute runs the graph compiled in forward: no second trace.
    assert counter.frame_count == 1
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    # BatchNorm's statistics were written once, as in the plain run.
    assert int(block.bn.num_batches_tracked) == int(plain.bn.num_batches_tracked) == 1
    assert torch.equal(block.bn.running_mean, plain.bn.running_mean)
    assert torch.equal(block.bn.running_var, plain.bn.running_var)
    # Only the region's input is saved.
    assert nbytes == x2.numel() * x2.element_size() < plain_bytes


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"determinism_check": "strict"}, "determinism_check must be one of"),
        ({"preserve_rng_state": "yes"}, "preserve_rng_state must be True or False"),
        ({"use_reentrant": True}, "use_reentrant=True is not supported"),
        ({"policy": 3}, "policy must be a callable"),
        ({"policy": save_matmuls, "debug": True}, "debug applies to the region engine"),
        ({"context_fn": 5}, "context_fn must be a callable"),
    ],
    ids=["determinism_check", "preserve_rng_state", "use_reentrant", "policy", "debug", "ctx"],
)
def test_a_compiled_checkpoint_checks_its_options_as_eager_does(
    options: dict[str, Any], match: str
) -> None:
    """``remat.checkpoint`` under ``torch.compile`` lowers to torch's checkpoint, which takes
    fewer options: each one is still checked as in eager mode, while Dynamo traces (the error
    comes inside Dynamo's), and good ones break no graph, a policy made in the trace included."""
    block = Block()
    x = torch.randn(4, 8, requires_grad=True)

    def step(x: torch.Tensor, **options: Any) -> torch.Tensor:
        return remat.checkpoint(block, x, **options).sum()

    with pytest.raises(remat.RematError, match=match):
        remat.checkpoint(block, x, **options)  # eager
    torch._dynamo.reset()
    with pytest.raises(Exception, match=f"RematError: remat.checkpoint: {match}"):
        torch.compile(step, backend="aot_eager")(x, **options)

    def made_in_the_trace(x: torch.Tensor) -> torch.Tensor:
        return step(x, policy=lambda ctx, op, *args, **kwargs: Decision.PREFER_SAVE)

    for good in (step, functools.partial(step, policy=save_matmuls), made_in_the_trace):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(good)(x)
        assert explained.graph_break_count == 0, explained.break_reasons


def test_checkpoint_of_a_compiled_block_with_a_policy_says_where_to_put_the_region() -> None:
    compiled = torch.compile(Block(), backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(remat.RematError, match="inside the compiled"):
        remat.checkpoint(compiled, x, policy=save_matmuls)


# Inductor's import of torch.utils.mkldnn warns about torch.jit inside torch itself.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="inductor needs a C compiler on CPU, and none is installed",
)
def test_inductor_gradients_match_eager_within_inductor_tolerance() -> None:
    eager_model = build("plain")
    x = torch.randn(2, 8, requires_grad=True)
    expected = grads(eager_model, x, eager_model(x))
    model = build("mixed")
    x2 = x.detach().clone().requires_grad_()
    got = grads(model, x2, torch.compile(model)(x2))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_compiled_region_writes_batchnorm_statistics_once_and_refuses_must_offload() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    model = remat.checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(4, 8, requires_grad=True)
    torch.compile(model, backend="aot_eager")(x).sum().backward()
    plain(x).sum().backward()
    bn, plain_bn = model[1], plain[1]
    assert isinstance(bn, nn.BatchNorm1d) and isinstance(plain_bn, nn.BatchNorm1d)
    assert int(bn.num_batches_tracked) == 1
    assert torch.equal(bn.running_mean, plain_bn.running_mean)

    def must_offload(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return Decision.MUST_OFFLOAD_HOST

    torch._dynamo.reset()
    refused = remat.checkpoint_wrapper(copy.deepcopy(plain), policy=must_offload)
    # The compiler asks the policy while it builds the graph, and wraps what it raises.
    failed = torch._dynamo.exc.BackendCompilerFailed
    modes = len(_get_current_dispatch_mode_stack())
    try:
        with pytest.raises(failed, match=r"RematError: remat: .* under torch\.compile a region"):
            torch.compile(refused, backend="aot_eager")(x)
    finally:
        # torch 2.11 leaves its selective checkpoint's dispatch mode active after the error,
        # until the collector closes the checkpoint's generator (held in a cycle through the
        # error), which takes the mode off.
        gc.collect()
    left = _get_current_dispatch_mode_stack()[modes:]
    assert not left, f"torch left {left} active after the policy's error"


def _planned(budget: str) -> tuple[nn.Module, nn.Module, torch.Tensor, remat.Plan]:
    """Two blocks, a plain copy, a batch, and the blocks' plan for ``budget`` (not applied)."""
    torch.manual_seed(0)
    model = Model("plain").train()
    plain = copy.deepcopy(model)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    plan = remat.plan(model, x, budget=budget, loss_fn=lambda out: out.square().sum(), repeats=0)
    return model, plain, x, plan


def _options(plan: remat.Plan) -> list[str]:
    """Each block's option, a region or graph-engine cap alike as "recompute": which of the
    two a 90% budget gets turns on the ops' timed seconds, which vary from run to run."""
    return [
        "recompute" if b["option"] == "region" or b["option"].startswith("graph-") else b["option"]
        for b in plan.blocks
    ]


def test_a_compiled_plan_checks_its_mode_and_takes_other_batch_sizes() -> None:
    """A plan's pre-hooks under torch.compile: the first block's check of its input bytes is
    left to eager mode (a recompiled step's shapes are symbolic), so a larger batch runs exact;
    a plan made in evaluation mode still refuses a training forward."""
    model, plain, x, plan = _planned("90%")
    plan.apply(model)
    assert _options(plan) == ["recompute", "plain"], plan.summary()
    compiled = torch.compile(model, backend="aot_eager")
    for batch in (x, torch.cat([x, x, x])):  # the second recompiles with a symbolic batch
        b1, b2 = batch.clone().requires_grad_(), batch.clone().requires_grad_()
        plain.zero_grad(), model.zero_grad()
        expected = grads(plain, b1, plain(b1).square().sum())
        got = grads(model, b2, compiled(b2).square().sum())
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

    model.eval()
    remat.unapply(model)
    torch._dynamo.reset()
    remat.fit(model, x, budget="90%", loss_fn=lambda out: out.square().sum(), repeats=0)
    model.train()
    with pytest.raises(remat.RematError, match="plan was made with the model in evaluation"):
        torch.compile(model, backend="aot_eager")(x)


def test_a_model_compiled_before_planning_is_planned_through_the_module_it_wraps(
    tmp_path: Any,
) -> None:
    """``remat.fit(torch.compile(model), ...)``: the planner measures the eager module (its
    blocks keep their own paths), sets it up, and the compiled wrapper, already run once,
    traces the planned model again; its steps equal the plain compiled model's bit for bit.
    A saved plan applies to a compiled copy the same way."""
    torch.manual_seed(0)
    model = Model("plain").train()
    plain = torch.compile(copy.deepcopy(model), backend="aot_eager")
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.square().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    compiled(x)
    plan = remat.fit(compiled, x, budget="90%", loss_fn=loss_fn, repeats=0)
    assert [b["path"] for b in plan.blocks] == ["blocks.0", "blocks.1"]
    assert _options(plan) == ["recompute", "plain"], plan.summary()
    frames = counter.frame_count
    b1, b2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = grads(plain, b1, loss_fn(plain(b1)))
    got = grads(model, b2, loss_fn(compiled(b2)))
    assert counter.frame_count == frames + 1  # traced again, planned
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))

    plan.save(tmp_path / "plan.json")
    torch.manual_seed(0)
    again = torch.compile(Model("plain").train(), backend="aot_eager")
    assert remat.Plan.load(tmp_path / "plan.json").apply(again) is again
    b3 = x.clone().requires_grad_()
    assert all(
        torch.equal(a, b)
        for a, b in zip(grads(again, b3, loss_fn(again(b3))), expected, strict=True)
    )


def test_a_policy_sees_each_ops_module_under_compile_as_in_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under compile the module an op ran in comes from the trace's ``nn_module_stack``: a
    policy reads the same names as in eager mode, and a block planned per op finds its
    decisions (keyed by module), so it saves what the plan says, with exact gradients."""
    seen: dict[str, list[str]] = {"eager": [], "compiled": []}
    where = ["eager"]

    def noting(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        seen[where[0]].append(ctx.module)
        return Decision.PREFER_RECOMPUTE

    torch.manual_seed(0)
    model = remat.apply(Model("plain"), Block, policy=noting)
    x = torch.randn(4, 8)
    model(x)
    where[0] = "compiled"
    torch.compile(model, backend="aot_eager")(x)
    assert seen["eager"] == ["blocks.0.l1"] * 2 + ["blocks.0"] * 2 + ["blocks.0.l2"] * 2 + [
        "blocks.0"
    ] + ["blocks.1.l1"] * 2 + ["blocks.1"] * 2 + ["blocks.1.l2"] * 2 + ["blocks.1"]
    assert set(seen["compiled"]) == set(seen["eager"])

    torch._dynamo.reset()
    # The first block on the graph-engine option that keeps least, the second plain: which
    # options a budget gets, and which dominate, turn on one timing run, which load sways.
    monkeypatch.setattr(remat.planning.planner, "undominated", list)
    model, plain, x, plan = _planned("70%")
    first, second = plan.blocks
    least = min((o for o in plan.options[first["type"]] if o.kind == "graph"), key=lambda o: o.kept)
    plan.blocks = [
        {"path": first["path"], "type": first["type"], "option": least.name},
        {"path": second["path"], "type": second["type"], "option": "plain"},
    ]
    plan.apply(model)
    plain_x, x = x.clone().requires_grad_(), x.clone().requires_grad_()
    _, plain_bytes = saved_bytes(lambda: torch.compile(plain, backend="aot_eager")(plain_x))
    loss, nbytes = saved_bytes(lambda: torch.compile(model, backend="aot_eager")(x).sum())
    assert [(p.followed, p.unfollowed) for p in plan.policies] == [(14, 0)]  # two traced passes
    assert nbytes < plain_bytes  # every op recomputed as planned, none kept for lack of a key
    expected = grads(plain, plain_x, plain(plain_x).sum())
    assert all(torch.equal(a, b) for a, b in zip(grads(model, x, loss), expected, strict=True))


class DropoutBlock(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(p)
        self.l2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.relu(self.l1(x))))


def _planned_per_op(p: float, x: torch.Tensor) -> tuple[nn.Module, nn.Module, list[Any]]:
    """Two dropout blocks, each on the graph engine with a plan that recomputes every op
    the eager forward runs (keyed as a plan keys them); a plain copy; the blocks' policies."""
    from remat.planning.apply import apply_option
    from remat.planning.profile import profile_block

    torch.manual_seed(0)
    model = nn.Sequential(DropoutBlock(p), DropoutBlock(p))
    plain = copy.deepcopy(model)
    profile = profile_block(
        model[0], ((x.clone().requires_grad_(),), {}), "block", torch.device("cpu"), repeats=1
    )
    decisions = {op.key: "recompute" for op in profile.ops}
    policies = [apply_option(b, str(i), "graph", decisions) for i, b in enumerate(model)]
    return model, plain, policies


def test_a_per_op_plan_with_dropout_compiles_exact_and_says_what_it_could_not_follow() -> None:
    """Dynamo traces dropout otherwise than eager runs it on the CPU (``native_dropout``, or
    a ``clone`` at p=0, for eager's ``bernoulli_``, ``div_`` and ``mul``): a block planned per
    op in eager meets keys it does not know under compile. The block's forward hook, which
    warns about such keys, once ran inside Dynamo's trace, and the compile of a second planned
    model failed (``SpeculationLogDivergence`` at the hook). Now the hooks do nothing while
    Dynamo traces, each compiled step equals the compiled plain model's bit for bit, and each
    block warns once, naming compile."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    every: list[Any] = []
    with pytest.warns(UserWarning, match="as torch.compile traced it") as caught:
        for p in (0.0, 0.5):
            model, plain, policies = _planned_per_op(p, x)
            eager_keys = next(q.decisions for q in policies if q is not None)
            assert not any("native_dropout" in k for k in eager_keys)
            results = []
            for m in (model, plain):
                torch.manual_seed(0)
                loss = torch.compile(m, backend="aot_eager")(x).square().sum()
                loss.backward()
                results.append([loss.detach(), *(q.grad for q in m.parameters())])
            assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), p
            every += policies
    assert len([w for w in caught if "remat" in str(w.message)]) == 4  # once per block
    assert all(q is not None and q.warned and q.unfollowed > 0 for q in every)


class _Looped(nn.Module):
    """One block called three times (weights shared across depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = x + self.layer(x)
        return x


# A graph-engine option traced by Dynamo meets ops the eager profile did not (``aten.t``),
# and says so: the case of every graph-engine plan under compile, tested above.
@pytest.mark.filterwarnings("ignore:remat. the plan for layer.* could not follow")
def test_a_shared_block_with_options_per_call_compiles_to_its_leanest() -> None:
    """A block whose calls run different options of a plan (NOTE [ Options per call ] in
    ``planning/apply.py``): under torch.compile every call runs the leanest, in one graph,
    with exact gradients, saving what the block under that option at every call saves, and
    numbering no call while Dynamo traces."""
    torch.manual_seed(0)
    model = _Looped()
    x = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(1))
    plan = remat.plan(model, x, budget="100%", loss_fn=lambda out: out.sum(), repeats=0)

    def compiled(calls: list[str]) -> tuple[list[torch.Tensor], int, int]:
        torch._dynamo.reset()
        plan.blocks[0].update(option=calls[0], calls=calls)
        planned = plan.apply(copy.deepcopy(model))
        counter = CompileCounterWithBackend("aot_eager")
        xc = x.detach().clone().requires_grad_()
        loss, nbytes = saved_bytes(lambda: torch.compile(planned, backend=counter)(xc).sum())
        if len(set(calls)) > 1:
            assert planned.layer.__dict__["forward"].count.counts == {}
        return grads(planned, xc, loss), nbytes, counter.frame_count

    options = plan.options[plan.blocks[0]["type"]]
    lean = min((o for o in options if o.kind in ("region", "graph")), key=lambda o: o.kept).name
    plain, plain_bytes, _ = compiled(["plain"] * 3)
    leanest, lean_bytes, _ = compiled([lean] * 3)
    got, nbytes, frames = compiled(["plain", lean, "plain"])
    assert frames == 1 and nbytes == lean_bytes < plain_bytes
    assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(leanest, plain, strict=True))
