"""The graph engine (``remat.graph``): exact replay, partial recompute, bytes held, lifetimes.

Every numerical check compares against a plain run of the same code from the same RNG state, bit
for bit (``torch.equal``), with dropout active. Mechanism checks count the ATen ops that backward
runs (a replayed op shows up there, a kept result does not), measure the bytes that forward leaves
allocated with the profiler's memory events, and follow storages with weak references.
"""

from __future__ import annotations

import copy
import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat import policies
from remat.policies import Decision
from remat.workloads import GPT, WORKLOAD_NAMES, GPTBlock, GPTConfig, get_workload

from helpers import (
    OpCounter,
    StepRecord,
    assert_equal,
    assert_records_equal,
    counting_ops,
    train,
)

# Bytes of the CPU generator's state (mt19937), which the engine snapshots for each random op.
RNG_STATE_BYTES = torch.get_rng_state().numel()


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_()


def _fresh(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _grads(*tensors: torch.Tensor) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def run_both(
    fn: Callable[..., torch.Tensor], *leaves: torch.Tensor, policy: Any, seed: int = 7
) -> OpCounter:
    """``fn(*leaves) -> scalar`` plainly and in a graph region with ``policy``; compare outputs,
    grads and the global RNG state after backward. Returns the op counts of the region's
    backward."""
    a, b = _fresh(*leaves), _fresh(*leaves)
    torch.manual_seed(seed)
    plain = fn(*a)
    plain.backward()
    plain_rng = torch.get_rng_state()
    torch.manual_seed(seed)
    out = remat.checkpoint(fn, *b, policy=policy)
    with counting_ops() as ops:
        out.backward()
    assert torch.equal(plain, out)
    assert_equal(_grads(*a), _grads(*b), "grads")
    assert torch.equal(plain_rng, torch.get_rng_state()), "backward left another RNG state"
    return ops


class _Storages(TorchDispatchMode):
    """Weak references to the storages of what the named ops return while the mode is on."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = set(names)
        self.refs: list[StorageWeakRef] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.names:
            self.refs.append(StorageWeakRef(out.untyped_storage()))
        return out

    def alive(self) -> list[bool]:
        return [not r.expired() for r in self.refs]


@contextmanager
def _no_gc() -> Iterator[None]:
    """Reference counting alone must free what the checks below follow."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# ---------------------------------------------------------------------------------------------
# A. Every workload under every built-in policy is bit-exact
# ---------------------------------------------------------------------------------------------

# Thresholds for save_smaller_than that keep some of each workload's op outputs and recompute
# others (the smaller activations of a block against its larger ones).
_SMALLER_THAN = {"gpt": 4097, "mlp": 513, "convnet": 20_000, "unet": 10_000}

POLICY_NAMES = (
    "save_everything",
    "recompute_everything",
    "save_matmuls",
    "recompute_attention_core",
    "save_tagged",
    "save_smaller_than",
)


def _policy(name: str, workload: str) -> Any:
    if name == "save_tagged":
        return policies.save_tagged("first-layer")
    if name == "save_smaller_than":
        return policies.save_smaller_than(_SMALLER_THAN[workload])
    return getattr(policies, name)


def _tag_first_layer(model: nn.Module, block_types: tuple[type[nn.Module], ...]) -> None:
    """Tag the output of the first Linear or Conv2d inside each block as ``"first-layer"``."""
    for module in model.modules():
        if isinstance(module, block_types):
            first = next(m for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))
            first.register_forward_hook(lambda m, args, out: remat.tag(out, "first-layer"))


@functools.cache
def _plain_record(name: str) -> StepRecord:
    workload = get_workload(name, "small")
    batches = [workload.batch(seed=s) for s in range(3)]
    return train(workload.model(seed=0), batches, workload.loss_fn)


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_every_workload_under_every_policy_is_bit_exact(name: str, policy_name: str) -> None:
    # Outputs, losses, input grads, every parameter grad, parameters and buffers (BatchNorm
    # running statistics) after each of 3 SGD steps.
    workload = get_workload(name, "small")
    model = workload.model(seed=0)
    if policy_name == "save_tagged":
        _tag_first_layer(model, workload.block_types)
    remat.apply(model, workload.block_types, policy=_policy(policy_name, name))
    batches = [workload.batch(seed=s) for s in range(3)]
    assert_records_equal(_plain_record(name), train(model, batches, workload.loss_fn))


# ---------------------------------------------------------------------------------------------
# B. Backward replays only the cone of what it needs
# ---------------------------------------------------------------------------------------------


def _two_branches(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    early = x.exp().sigmoid()  # exp and sigmoid each save their result
    late = x.tanh()  # tanh saves its result
    return early, late


def test_ops_whose_saved_tensors_died_with_a_dropped_output_are_not_replayed() -> None:
    x = _leaf(64)
    xp = _fresh(x)[0]
    _, plain_late = _two_branches(xp)
    plain_late.sum().backward()

    early, late = remat.checkpoint(_two_branches, x, policy=policies.recompute_everything)
    del early
    with counting_ops() as ops:
        late.sum().backward()
    assert ops["tanh"] == 1  # late's saved result, rebuilt
    assert ops["exp"] == 0 and ops["sigmoid"] == 0  # their saved tensors died with `early`
    assert torch.equal(x.grad, xp.grad)

    # The same count sees the early branch when backward needs it.
    x.grad = None
    early, late = remat.checkpoint(_two_branches, x, policy=policies.recompute_everything)
    with counting_ops() as ops:
        (early.sum() + late.sum()).backward()
    assert (ops["exp"], ops["sigmoid"], ops["tanh"]) == (1, 1, 1)


def _kept_middle(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.exp()  # early: needed only to differentiate through the matmul
    m = h @ w  # kept under save_matmuls
    late = m.sigmoid().tanh()  # sigmoid and tanh save their results
    return m, late


def test_grad_for_a_late_tensor_replays_only_the_ops_after_the_last_kept_result() -> None:
    x, w = _leaf(8, 6), _leaf(6, 5)
    xp, wp = _fresh(x, w)
    mp, latep = _kept_middle(xp, wp)
    (expected,) = torch.autograd.grad(latep.sum(), inputs=[mp])

    m, late = remat.checkpoint(_kept_middle, x, w, policy=policies.save_matmuls)
    with counting_ops() as ops:
        (got,) = torch.autograd.grad(late.sum(), inputs=[m])
    assert torch.equal(got, expected)
    assert ops["sigmoid"] == 1 and ops["tanh"] == 1  # the cone of the two saved results
    assert ops["exp"] == 0 and ops["mm"] == 0  # before the kept matmul: never replayed
    assert x.grad is None and w.grad is None


def test_an_op_that_several_saved_tensors_need_is_replayed_once_per_backward() -> None:
    # Four saved tensors share one chain: the first unpack replays it, the others read the cache.
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()  # saves a
        b = a.sigmoid()  # saves b
        c = b.tanh()  # saves c
        return (c * a).sum()  # saves c and a

    ops = run_both(fn, _leaf(32), policy=policies.recompute_everything)
    assert (ops["exp"], ops["sigmoid"], ops["tanh"]) == (1, 1, 1)


def test_metadata_only_reads_do_not_pull_their_producer_into_the_replay() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.dropout(x @ w, 0.5).sum()  # mul saves only the mask

    ops = run_both(fn, _leaf(4, 6), _leaf(6, 5), policy=policies.recompute_everything)
    assert ops["bernoulli_"] == 1  # the mask is rebuilt
    assert ops["mm"] == 2  # backward's two matmuls; the forward's is not needed for a shape


# ---------------------------------------------------------------------------------------------
# C. Bytes held between forward and backward
# ---------------------------------------------------------------------------------------------


def _held_after_forward(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> int:
    """Bytes allocated during forward and the loss and still live when backward would start."""
    from torch.profiler import ProfilerActivity, profile

    holder: list[torch.Tensor] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = model(x)
        holder.append(F.cross_entropy(logits.flatten(0, 1), target.flatten()))
        del logits
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = sum(e.nbytes() for e in events)
    holder[0].backward()
    return held


def _plain_bytes_outside_blocks(model: GPT, x: torch.Tensor, target: torch.Tensor) -> int:
    """What a plain run saves outside the blocks plus every block's input, by unique storage,
    and the loss; storages that exist before forward (parameters, the batch) are not counted."""
    storages: dict[int, int] = {}
    depth = [0]

    def enter(m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        depth[0] += 1
        storages[args[0].untyped_storage().data_ptr()] = args[0].untyped_storage().nbytes()

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        depth[0] -= 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not depth[0]:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    handles = []
    for block in model.blocks:
        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x).flatten(0, 1), target.flatten())
    for h in handles:
        h.remove()
    existing = {t.untyped_storage().data_ptr() for t in (*model.parameters(), x, target)}
    loss.backward()
    return sum(n for ptr, n in storages.items() if ptr not in existing) + loss.nbytes


# Batch, sequence, width, heads, layers of a GPT big enough that activations dominate what is held.
_B, _T, _D, _H, _L = 3, 64, 48, 4, 2


def _mid_gpt(dropout: float) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    config = GPTConfig(
        vocab_size=96, seq_len=_T, d_model=_D, n_heads=_H, n_layers=_L, dropout=dropout
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(config)
        x = torch.randint(0, 96, (_B, _T))
        target = torch.randint(0, 96, (_B, _T))
    return model, x, target


def test_bytes_held_match_a_count_by_hand() -> None:
    model, x, target = _mid_gpt(dropout=0.1)
    outside = _plain_bytes_outside_blocks(copy.deepcopy(model), x, target)
    # Each block has three random ops (the attention dropout inside SDPA's math path on CPU,
    # resid_dropout, the MLP's dropout), all replayed: the engine holds the generator state the
    # first drew from, and the other two replay in a chain from where it left the generator.
    rng_states = _L * RNG_STATE_BYTES
    # save_matmuls keeps, per block, the float32 outputs of: the qkv projection (B*T*3d), the
    # attention scores q@k^T (B*H*T*T), probabilities@v (B*T*d), proj (B*T*d) and fc1 (B*T*4d);
    # not fc2's, which only the MLP dropout's empty_like reads, for its shape (see
    # test_metadata_only_reads_do_not_pull_their_producer_into_the_replay).
    B, T, d, H = _B, _T, _D, _H
    matmul_outputs = _L * 4 * (B * T * 3 * d + B * H * T * T + 2 * B * T * d + B * T * 4 * d)
    expected = {
        policies.recompute_everything: outside + rng_states,
        policies.save_matmuls: outside + rng_states + matmul_outputs,
    }
    for policy, count in expected.items():
        wrapped = remat.apply(copy.deepcopy(model), GPTBlock, policy=policy)
        assert _held_after_forward(wrapped, x, target) == count, policy.__name__
    # And both are well under a plain run.
    plain = _held_after_forward(copy.deepcopy(model), x, target)
    assert expected[policies.save_matmuls] < 0.6 * plain
    assert expected[policies.recompute_everything] < 0.15 * plain


def _torch_equivalent(policy: Any) -> Callable[..., CheckpointPolicy]:
    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        saves = policy(policies.OpContext(), op, *args, **kwargs).save
        return CheckpointPolicy.PREFER_SAVE if saves else CheckpointPolicy.PREFER_RECOMPUTE

    return torch_policy


class _TorchSAC(nn.Module):
    """A block under torch's selective activation checkpointing."""

    def __init__(self, block: nn.Module, policy: Callable[..., CheckpointPolicy]) -> None:
        super().__init__()
        self.block = block
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(
            self.block,
            x,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(self.policy),
        )
        return out


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("policy_name", ["recompute_everything", "save_matmuls"])
def test_graph_engine_holds_no_more_than_torch_selective_checkpointing(
    policy_name: str, dropout: float
) -> None:
    policy = getattr(policies, policy_name)
    model, x, target = _mid_gpt(dropout)
    graph = remat.apply(copy.deepcopy(model), GPTBlock, policy=policy)
    sac = copy.deepcopy(model)
    sac.blocks = nn.ModuleList(_TorchSAC(b, _torch_equivalent(policy)) for b in sac.blocks)
    a = train(copy.deepcopy(graph), [(x, target)], _lm_loss)
    b = train(copy.deepcopy(sac), [(x, target)], _lm_loss)
    assert_equal(a.outputs, b.outputs, "outputs")  # the same computation, the same draws
    assert _held_after_forward(graph, x, target) <= _held_after_forward(sac, x, target)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_save_everything_holds_what_a_plain_run_holds() -> None:
    model, x, target = _mid_gpt(dropout=0.1)
    plain = _held_after_forward(copy.deepcopy(model), x, target)
    wrapped = remat.apply(copy.deepcopy(model), GPTBlock, policy=policies.save_everything)
    assert _held_after_forward(wrapped, x, target) == plain


def test_kept_results_that_no_saved_tensor_reaches_are_dropped_at_region_exit() -> None:
    x, w = torch.randn(64, 32), _leaf(32, 48)
    mm_bytes = 64 * 48 * 4

    def unreachable(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).sum()  # sum saves only sizes: nothing reaches the kept matmul output

    def reachable(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).sin().sum()  # sin saves it

    def held(fn: Callable[..., torch.Tensor]) -> int:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = remat.checkpoint(fn, x, w, policy=policies.save_matmuls)
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        out.backward()
        return sum(e.nbytes() for e in events) - out.nbytes

    assert held(unreachable) == 0
    assert held(reachable) == mm_bytes


# ---------------------------------------------------------------------------------------------
# D. Exact replay: random ops, in-place ops, state, views, data-dependent ops
# ---------------------------------------------------------------------------------------------


def test_random_ops_replay_bit_for_bit() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x.exp(), 0.5)
        r, n = torch.rand(x.shape), torch.randn(x.shape)
        b = torch.bernoulli(torch.full(x.shape, 0.3))
        return (h.sin() * r + n * h.tanh() * b + torch.rand_like(x) * x.sigmoid()).sum()

    ops = run_both(fn, _leaf(256), policy=policies.recompute_everything)
    # Each random op was replayed (not kept) and drew what it drew in forward.
    assert ops["bernoulli_"] == 1 and ops["bernoulli"] == 1
    assert ops["rand"] == 1 and ops["randn"] == 1 and ops["rand_like"] == 1


@pytest.mark.parametrize(
    "policy", [policies.recompute_everything, policies.save_matmuls], ids=["all", "mm"]
)
def test_an_argument_written_without_autograd_counting_it_replays_as_written(
    policy: Any,
) -> None:
    """``rrelu_with_noise`` fills its ``noise`` argument, a functional op's write that leaves
    the version counter as it was, after autograd saved ``noise`` for the op's backward. The
    saved noise is the value as written: replayed from the rrelu, not from the ``empty_like``
    that made the tensor (which gave gradients of uninitialised memory)."""
    w = _leaf(8, 8)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rrelu(x @ w, training=True).exp().sum()

    ops = run_both(fn, _leaf(4, 8), w, policy=policy)
    assert ops["rrelu_with_noise"] == 1 and ops["empty_like"] == 0


@pytest.mark.parametrize(
    "policy", [policies.recompute_everything, policies.save_matmuls], ids=["all", "mm"]
)
@pytest.mark.parametrize("alias", ["data", "detach"])
def test_a_result_written_through_data_replays_as_written(policy: Any, alias: str) -> None:
    """``h.data`` has a version counter of its own: a write through it leaves ``h``'s where it
    was, and a plain run reads ``h`` as written, in forward and where ``mul`` saved ``h``
    before the write. Those reads hold ``h`` as it is, rather than replaying ``mm`` (the value
    before the write). ``h.detach()`` shares the counter, so a later read is a stale one."""
    w, v = _leaf(8, 8), _leaf(4, 8)

    def fn(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        h = x @ w
        a = h.exp()  # reads h before the write: replays from mm
        if alias == "data":
            b = h * v  # saves h before the write; its backward reads h as written
            h.data.clamp_(-1, 1)
        else:
            b = v.sin()
            h.detach().clamp_(-1, 1)
        return (a.sum() + (h * 2).exp().sum() + b.sum()) / 64

    run_both(fn, _leaf(4, 8), w, v, policy=policy)


@pytest.mark.parametrize(
    "policy", [policies.recompute_everything, policies.save_matmuls], ids=["all", "mm"]
)
def test_a_result_written_through_data_as_its_last_use_replays_as_written(policy: Any) -> None:
    """``h.data.mul_(2)`` after ``sin`` saved ``h``, and no later op reads ``h``: the region's
    function returns, ``h`` dies, and the write is settled at the region's exit, which still
    holds ``h`` (a plain backward reads it as written)."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        y = h.sin()
        h.data.mul_(2)
        return y  # no op of the region reads anything after the write

    leaves = _leaf(3, 4), _leaf(4, 4)
    a, b = _fresh(*leaves), _fresh(*leaves)
    fn(*a).square().sum().backward()
    remat.checkpoint(fn, *b, policy=policy).square().sum().backward()
    assert_equal(_grads(*a), _grads(*b), "grads")


@pytest.mark.parametrize(
    "policy", [policies.recompute_everything, policies.save_matmuls], ids=["all", "mm"]
)
def test_data_assigned_to_a_result_replays_the_assigned_data(policy: Any) -> None:
    """A straight-through estimator written ``q.data = round(q.data * 4) / 4``: the same
    tensor object, at the same version, holds other data, which a plain run reads forward
    and backward; so does the region, where replaying ``clone`` would give the unrounded
    values (gradients off by 14%)."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        q = (x @ w).clone()
        q.data = torch.round(q.data * 4) / 4
        return (q.sin() @ w).tanh().square().sum()

    run_both(fn, _leaf(3, 4), _leaf(4, 4), policy=policy)


@pytest.mark.parametrize(
    "policy",
    [None, policies.recompute_everything, policies.save_matmuls],
    ids=["region", "all", "mm"],
)
def test_tensors_made_in_inference_mode_are_read_as_constants(policy: Any) -> None:
    """A table made under ``torch.inference_mode`` has no version counter: read by a region,
    passed to one as an input, or a module's buffer, it is held as it is (nothing outside
    inference mode can write it), where reading its version raised inside remat."""
    with torch.inference_mode():
        table = torch.arange(4.0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            with torch.inference_mode():
                self.register_buffer("pos", torch.arange(4.0), persistent=False)

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) * table.clone()).sin() + self.pos.clone() + t.clone()

    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Block())
    model = remat.apply(copy.deepcopy(plain), Block, policy=policy)
    x = torch.randn(3, 4)
    grads = []
    for m in (plain, model):
        out = m[1](m[0](x, table), table)  # type: ignore[operator]
        out.square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    assert_equal(grads[0], grads[1], "grads")


def test_an_lstm_on_the_cpu_keeps_its_kernels_output() -> None:
    """The CPU LSTM kernel makes the workspace its backward reads only where autograd records;
    a replay runs without, and once failed ("replay did not rebuild"). Its output is kept,
    whatever the policy."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, batch_first=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return lstm(x)[0].sin().sum()

    grads, data = [], torch.randn(2, 3, 8)
    for policy in (None, policies.recompute_everything):
        lstm.zero_grad()
        x = data.clone().requires_grad_()
        out = fn(x) if policy is None else remat.checkpoint(fn, x, policy=policy)
        with counting_ops() as ops:
            out.backward()
        grads.append([x.grad, *(p.grad for p in lstm.parameters())])
    assert ops["mkldnn_rnn_layer"] == 0  # kept, not replayed
    assert_equal(grads[0], grads[1], "grads")


def test_blank_results_replay_as_fresh_tensors_with_the_recorded_layout() -> None:
    # Dropout's mask starts as empty_like(x), filled in place by bernoulli_. The replay makes
    # the blank tensor directly, with the layout empty_like gave it (here a transposed one,
    # which preserve_format keeps), instead of running empty_like on a meta stand-in.
    layouts: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.exp().t()
        mask = torch.empty_like(h).bernoulli_(0.5)
        blank = h.new_empty((3, 5)).fill_(2.0)
        layouts.append((tuple(mask.shape), mask.stride()))
        return (h * mask).sin().sum() + (blank * x[:3, :5]).cos().sum()

    ops = run_both(fn, _leaf(16, 8), policy=policies.recompute_everything)
    assert layouts == [((8, 16), (1, 8))] * 2
    assert ops["empty_like"] == 0 and ops["new_empty"] == 0 and ops["empty_strided"] == 2
    assert ops["bernoulli_"] == 1 and ops["fill_"] == 1


def test_random_op_with_an_explicit_generator_replays_from_that_generator() -> None:
    generator = torch.Generator()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.rand(x.shape, generator=generator)).exp().sin().sum()

    x = _leaf(32)
    a, b = _fresh(x, x)
    generator.manual_seed(3)
    fn(a).backward()
    state = generator.get_state()
    generator.manual_seed(3)
    out = remat.checkpoint(fn, b, policy=policies.recompute_everything)
    with counting_ops() as ops:
        out.backward()
    assert ops["rand"] == 1 and torch.equal(a.grad, b.grad)
    assert torch.equal(generator.get_state(), state)


@pytest.mark.parametrize(
    "policy", [policies.recompute_everything, policies.save_matmuls, policies.save_everything]
)
def test_in_place_ops_on_intermediates_replay_exactly(policy: Any) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        h.mul_(2)
        h = h.relu_()
        g = F.dropout(h, 0.3)  # bernoulli_ and div_ on a fresh mask, then mul
        F.dropout(g, 0.2, inplace=True)
        return (g.sin() * h.tanh()).sum()

    ops = run_both(fn, _leaf(16, 8), _leaf(8, 8), policy=policy)
    if policy is policies.recompute_everything:
        assert ops["mul_"] == 2 and ops["relu_"] == 1 and ops["bernoulli_"] == 2


class _GRUCell(nn.Module):
    """The ops of ``nn.GRUCell`` on the CPU: each gate is a chunk of a wider tensor (strides
    (48, 1) for a (4, 16) gate), written in place by ``add_`` and ``sigmoid_``."""

    def __init__(self) -> None:
        super().__init__()
        self.wi, self.wh = nn.Linear(16, 48), nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        ir, iz, i_n = self.wi(x).unsafe_chunk(3, 1)
        hr, hz, h_n = self.wh(h).unsafe_chunk(3, 1)
        r = hr.add_(ir).sigmoid_()
        z = hz.add_(iz).sigmoid_()
        n = i_n.add(h_n.mul_(r)).tanh_()
        return (h - n).mul_(z).add_(n)


def _recurrent_cells() -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    gru, gru_cell, lstm_cell, cell = (
        nn.GRU(16, 16, batch_first=True),
        nn.GRUCell(16, 16),
        nn.LSTMCell(16, 16),
        _GRUCell(),
    )
    return {
        "gru": lambda x, h: gru(torch.stack([x, h], 1))[0].square().sum(),
        "gru_cell": lambda x, h: gru_cell(x, h).square().sum(),
        "lstm_cell": lambda x, h: lstm_cell(x, (h, h))[0].square().sum(),
        "ops_of_a_gru_cell": lambda x, h: cell(x, h).square().sum(),
    }


@pytest.mark.parametrize("policy", [policies.recompute_everything, policies.save_matmuls])
@pytest.mark.parametrize("name", ["gru", "gru_cell", "lstm_cell", "ops_of_a_gru_cell"])
def test_a_replay_writes_in_place_on_the_layout_forward_wrote(name: str, policy: Any) -> None:
    # A replayed in-place write whose input another replayed op still needs runs on a copy;
    # the copy keeps the strides of a chunk of the gates, as forward's write saw them. On a
    # contiguous copy the CPU's sigmoid gives other bits, and the gradients differed.
    torch.manual_seed(1)
    run_both(_recurrent_cells()[name], _leaf(4, 16), _leaf(4, 16), policy=policy)


def test_copy_with_layout_keeps_sizes_strides_and_values() -> None:
    from remat._aten import copy_with_layout

    wide = torch.randn(4, 48)
    for t in (wide[:, :16], wide.t(), wide[::2, 1::3], wide, torch.randn(4, 1).expand(4, 3)):
        copy = copy_with_layout(t)
        assert torch.equal(copy, t) and copy.untyped_storage().data_ptr() != t.data_ptr()
        if t.stride() != (1, 0):  # an expand's elements overlap: cloned, contiguous
            assert copy.stride() == t.stride()
    assert not torch.equal(wide[:, :16].sigmoid(), wide[:, :16].clone().sigmoid())


class _Stateful(nn.Module):
    """Writes buffers in forward: add_, copy_, BatchNorm statistics; reads them after."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("cache", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = self.norm(self.lin(x))
        self.cache.copy_(h.detach().mean(0))
        return F.dropout(h * self.cache.sigmoid(), 0.2).tanh()


@pytest.mark.parametrize("policy", [policies.recompute_everything, policies.save_matmuls])
def test_buffers_are_written_once_and_never_by_a_replay(policy: Any) -> None:
    torch.manual_seed(0)
    plain = _Stateful()
    batches = [(torch.randn(6, 4), torch.randn(6, 4)) for _ in range(3)]
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(plain), policy=policy)
    assert_records_equal(
        train(copy.deepcopy(plain), batches, F.mse_loss), train(wrapped, batches, F.mse_loss)
    )

    # One more forward; backward replays BatchNorm, which must not touch the live statistics.
    torch.manual_seed(1)
    out = wrapped(_leaf(6, 4))
    after_forward = {n: b.clone() for n, b in wrapped.named_buffers()}
    with counting_ops() as ops:
        out.sum().backward()
    assert ops["native_batch_norm"] == 1
    assert_equal(after_forward, {n: b.clone() for n, b in wrapped.named_buffers()}, "buffers")
    assert int(wrapped.calls) == 4 and int(wrapped.norm.num_batches_tracked) == 4


class _WritesParameters(nn.Module):
    """Writes parameters in forward: Embedding's max_norm renormalises rows in place, and a
    scale is decayed under no_grad; both are read afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.mul_(0.9)
        return F.dropout(self.lin(self.emb(idx)).tanh() * self.scale, 0.2).sin()


@pytest.mark.parametrize("policy", [policies.recompute_everything, policies.save_matmuls])
def test_parameters_written_in_forward_are_written_once(policy: Any) -> None:
    torch.manual_seed(0)
    plain = _WritesParameters()
    batches = [(torch.randint(0, 10, (6,)), torch.randn(6, 4)) for _ in range(3)]
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(plain), policy=policy)
    assert_records_equal(
        train(copy.deepcopy(plain), batches, F.mse_loss), train(wrapped, batches, F.mse_loss)
    )
    out = wrapped(torch.randint(0, 10, (6,)))
    after_forward = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
    with counting_ops() as ops:
        out.sum().backward()
    assert ops["tanh"] == 1  # replayed from the parameters as forward left them
    assert ops["embedding_renorm_"] == 0
    assert_equal(after_forward, {n: p.detach().clone() for n, p in wrapped.named_parameters()})


class _Ema(nn.Module):
    """Reads a buffer, then updates it in place, in the same forward (an EMA of its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = (h - self.ema).sin()  # sin saves its input, which read the buffer before the update
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return y


def test_buffer_read_then_updated_in_place_in_the_same_forward() -> None:
    torch.manual_seed(0)
    plain = _Ema()
    batches = [(torch.randn(6, 4), torch.randn(6, 4)) for _ in range(2)]
    wrapped = remat.checkpoint_wrapper(copy.deepcopy(plain), policy=policies.recompute_everything)
    assert_records_equal(
        train(copy.deepcopy(plain), batches, F.mse_loss), train(wrapped, batches, F.mse_loss)
    )


def test_region_input_written_in_place_raises_as_torch_checkpoint_does() -> None:
    # A region saves its inputs through autograd, so that an enclosing region can manage them
    # (Rule 2 of the nesting note); an input written in place inside the region then fails
    # autograd's version check in backward, with both engines and with torch's checkpoint,
    # instead of replaying from a value it no longer has.
    def fn(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        counts.add_(1)
        return (x * counts).exp().sum()

    for run, error in (
        (lambda x, c: remat.checkpoint(fn, x, c, policy=policies.recompute_everything), "remat"),
        (lambda x, c: remat.checkpoint(fn, x, c), "remat"),
        (lambda x, c: torch.utils.checkpoint.checkpoint(fn, x, c, use_reentrant=False), "torch"),
    ):
        counts = torch.zeros(5)
        out = run(_leaf(5), counts)
        assert torch.equal(counts, torch.ones(5))  # written once, by forward
        # remat's error says which tensor and what to do, around autograd's own
        expected = (
            (remat.CheckpointError, r"an input of a checkpointed region .* Pass the region a copy")
            if error == "remat"
            else (RuntimeError, "modified by an inplace operation")
        )
        with pytest.raises(expected[0], match=expected[1]):
            out.backward()


def test_outside_tensor_modified_after_forward_raises_instead_of_replaying_other_values() -> None:
    x, w = _leaf(5), torch.randn(5)
    with remat.region(policy=policies.recompute_everything):
        out = (x + w).sin().sum()  # add saves nothing; its result is replayed from w
    w.add_(1)
    with pytest.raises(remat.CheckpointError, match="modified in place after the forward pass"):
        out.backward()


def _view_written_then_base_read(x: torch.Tensor) -> torch.Tensor:
    base = x * 2
    base[1:3].mul_(x[0])
    return base.sin().sum() + base[2:4].exp().sum()


def _view_relu_then_reshape_chain(x: torch.Tensor) -> torch.Tensor:
    base = x * 1.5
    base.view(2, 3)[0].relu_()
    return (base.reshape(3, 2).transpose(0, 1).sigmoid() * 2).sum()


def _slices_of_an_intermediate_saved(x: torch.Tensor) -> torch.Tensor:
    h = x.reshape(4, 6).exp() * 3
    return h[:, 1:4].sin().sum() + h.t().contiguous().view(-1)[:4].tanh().sum()


def _transpose_reshape_matmul_chain(x: torch.Tensor) -> torch.Tensor:
    h = (x.reshape(4, 6) @ x.reshape(6, 4)).t()
    g = h.reshape(2, 8).transpose(0, 1).contiguous().view(4, 4).sigmoid()
    return (g.expand(3, 4, 4) * h.unsqueeze(0)).tanh().sum()


def _chunk_written_in_place(x: torch.Tensor) -> torch.Tensor:
    h = x * 3
    a, b = h[:12], h.narrow(0, 12, 12)
    b.add_(a.detach())
    return (a.exp() * b.sin()).sum()


VIEW_FUNCTIONS = [
    _view_written_then_base_read,
    _view_relu_then_reshape_chain,
    _slices_of_an_intermediate_saved,
    _transpose_reshape_matmul_chain,
    _chunk_written_in_place,
]


@pytest.mark.parametrize(
    "policy",
    [policies.recompute_everything, policies.save_matmuls, policies.save_smaller_than(40)],
    ids=["recompute_everything", "save_matmuls", "save_smaller_than"],
)
@pytest.mark.parametrize("fn", VIEW_FUNCTIONS, ids=[f.__name__[1:] for f in VIEW_FUNCTIONS])
def test_views_and_aliases_keep_their_relationships(fn: Any, policy: Any) -> None:
    size = 6 if fn is _view_relu_then_reshape_chain else 24
    run_both(fn, _leaf(size), policy=policy)


def test_out_argument_write_does_not_corrupt_a_state_another_replay_reads() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        m = (x.detach() > 0).float()
        s = (x + m).sin()  # sin saves x + m, rebuilt from m before the write below
        torch.mul(m, 3.0, out=m)
        return (s + x * m).sum()  # mul saves m after the write

    run_both(fn, _leaf(16), policy=policies.recompute_everything)


class _Gate(nn.Module):
    """Top-2 routing over ``experts`` experts: weights and chosen experts per row."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = self.proj(x).softmax(-1).topk(2, dim=-1)
        return weights, chosen


class _Experts(nn.Module):
    """Routes rows to experts with topk, unique, nonzero, sort and .item()."""

    def __init__(self, width: int = 6, experts: int = 4) -> None:
        super().__init__()
        self.gate = _Gate(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            rows = (chosen == e).any(-1).nonzero().squeeze(-1)
            share = (weights * (chosen == e)).sum(-1, keepdim=True)[rows]
            out = out.index_add(0, rows, self.experts[e](x[rows]).tanh() * share)
        first = torch.sort(weights[:, 0], descending=True).indices[0]
        return F.dropout(out, 0.1) * (1 + int(chosen[first, 0].item()))


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = _Experts()
        self.out = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.moe(x))
        return out


DATA_DEPENDENT = ("topk", "_unique2", "nonzero", "sort", "_local_scalar_dense")


def test_data_dependent_ops_are_saved_even_under_recompute_everything() -> None:
    torch.manual_seed(0)
    plain = _MoE()
    batches = [(torch.randn(10, 6), torch.randn(10, 6)) for _ in range(3)]
    wrapped = remat.apply(copy.deepcopy(plain), ["moe"], policy=policies.recompute_everything)
    assert_records_equal(
        train(copy.deepcopy(plain), batches, F.mse_loss), train(wrapped, batches, F.mse_loss)
    )
    with counting_ops() as forward_ops:
        out = wrapped(_leaf(10, 6))
    with counting_ops() as ops:
        out.sum().backward()
    assert all(forward_ops[name] >= 1 for name in DATA_DEPENDENT), forward_ops.counts
    assert {name: ops[name] for name in DATA_DEPENDENT} == dict.fromkeys(DATA_DEPENDENT, 0)
    assert ops["tanh"] >= 1 and ops["bernoulli_"] == 1  # the ops around them were replayed


def _recompute_routing(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
    if op is torch.ops.aten.topk.default:
        return Decision.MUST_RECOMPUTE
    return Decision.PREFER_RECOMPUTE


def test_must_recompute_on_a_data_dependent_op_raises_naming_op_and_module() -> None:
    wrapped = remat.checkpoint_wrapper(_Experts(), policy=_recompute_routing)
    with pytest.raises(
        remat.RematError, match=r"MUST_RECOMPUTE for aten\.topk\.default in module gate"
    ):
        wrapped(_leaf(10, 6))


def test_error_for_an_op_in_the_wrapped_modules_own_forward_names_that_module() -> None:
    wrapped = remat.checkpoint_wrapper(_Gate(6, 4), policy=_recompute_routing)
    with pytest.raises(remat.RematError, match=r"aten\.topk\.default in module _Gate"):
        wrapped(_leaf(10, 6))


# ---------------------------------------------------------------------------------------------
# E. Autograd semantics and lifetimes
# ---------------------------------------------------------------------------------------------


def _dropout_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) * F.dropout(x.sin() @ w, 0.3)).exp().sum()


def test_retain_graph_backwards_accumulate_exactly_and_each_replays() -> None:
    x, w = _leaf(4, 3), _leaf(3, 3)
    (xa, wa), (xb, wb) = _fresh(x, w), _fresh(x, w)
    torch.manual_seed(1)
    plain = _dropout_chain(xa, wa)
    plain.backward(retain_graph=True)
    plain.backward()
    torch.manual_seed(1)
    out = remat.checkpoint(_dropout_chain, xb, wb, policy=policies.recompute_everything)
    with counting_ops() as ops:
        out.backward(retain_graph=True)
        out.backward()
    assert ops["tanh"] == 2 and ops["bernoulli_"] == 2  # one replay per backward
    assert_equal(_grads(xa, wa), _grads(xb, wb))


def test_a_saved_tensor_needed_by_two_backwards_is_rebuilt_for_each() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.dropout(x.exp(), 0.5)  # exp saves its result; h is saved by both outputs' ops
        return h.sin().sum(), (h * h).sum()

    x = _leaf(64)
    a, b = _fresh(x, x)
    torch.manual_seed(2)
    p1, p2 = fn(a)
    p1.backward(retain_graph=True)
    first = a.grad.clone()
    p2.backward()
    torch.manual_seed(2)
    o1, o2 = remat.checkpoint(fn, b, policy=policies.recompute_everything)
    with counting_ops() as ops:
        o1.backward(retain_graph=True)
        assert torch.equal(b.grad, first)
        o2.backward()
    assert ops["exp"] == 2 and ops["bernoulli_"] == 2
    assert torch.equal(a.grad, b.grad)


def test_autograd_grad_with_inputs_subset() -> None:
    x, w = _leaf(4, 3), _leaf(3, 3)
    (xa, wa), (xb, wb) = _fresh(x, w), _fresh(x, w)
    torch.manual_seed(3)
    (ga,) = torch.autograd.grad(_dropout_chain(xa, wa), (wa,))
    torch.manual_seed(3)
    out = remat.checkpoint(_dropout_chain, xb, wb, policy=policies.save_matmuls)
    (gb,) = torch.autograd.grad(out, (wb,))
    assert torch.equal(ga, gb) and xb.grad is None and wb.grad is None


def test_partial_backward_with_inputs() -> None:
    x, w = _leaf(4, 3), _leaf(3, 3)
    (xa, wa), (xb, wb) = _fresh(x, w), _fresh(x, w)
    torch.manual_seed(4)
    _dropout_chain(xa, wa).backward(inputs=[xa])
    torch.manual_seed(4)
    remat.checkpoint(_dropout_chain, xb, wb, policy=policies.recompute_everything).backward(
        inputs=[xb]
    )
    assert torch.equal(xa.grad, xb.grad) and wb.grad is None


@pytest.mark.parametrize("policy", [policies.recompute_everything, policies.save_matmuls])
def test_double_backward(policy: Any) -> None:
    x, w = _leaf(4, 3), _leaf(3, 3)
    (xa, wa), (xb, wb) = _fresh(x, w), _fresh(x, w)
    torch.manual_seed(5)
    (ga,) = torch.autograd.grad(_dropout_chain(xa, wa), xa, create_graph=True)
    ga.pow(2).sum().backward()
    torch.manual_seed(5)
    out = remat.checkpoint(_dropout_chain, xb, wb, policy=policy)
    (gb,) = torch.autograd.grad(out, xb, create_graph=True)
    gb.pow(2).sum().backward()
    assert torch.equal(ga, gb)
    assert_equal(_grads(xa, wa), _grads(xb, wb))


class _ReadTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        first = ctx.saved_tensors
        second = ctx.saved_tensors
        return g * first[0] * second[0]


def test_saved_tensor_read_twice_in_one_backward() -> None:
    run_both(
        lambda t: _ReadTwice.apply(t.sin()).sum(), _leaf(8), policy=policies.recompute_everything
    )


@pytest.mark.parametrize("policy", [policies.recompute_everything, policies.save_everything])
def test_nothing_leaks_when_backward_never_happens(policy: Any) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen: list[StorageWeakRef] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x).relu()  # relu saves its result
            self.seen.append(StorageWeakRef(h.untyped_storage()))
            return h.sin()

    with _no_gc():
        block = Block()
        out = remat.checkpoint(block, _leaf(2, 4), policy=policy)
        block_ref = weakref.ref(block)
        activation = block.seen[0]
        # Kept under save_everything, dropped at once otherwise.
        assert activation.expired() == (policy is policies.recompute_everything)
        del block, out
        assert block_ref() is None and activation.expired()


def test_replayed_tensors_are_freed_as_backward_consumes_them() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.exp().sigmoid().tanh().sum()

    with _no_gc():
        x = _leaf(1000)
        out = remat.checkpoint(fn, x, policy=policies.recompute_everything)
        with _Storages("exp", "sigmoid", "tanh") as replayed:
            out.backward(retain_graph=True)  # the graph, and the engine's, stay alive
        assert len(replayed.refs) == 3 and not any(replayed.alive())


def test_a_saved_tensor_read_outside_backward_is_rebuilt_and_not_cached() -> None:
    x = _leaf(1000)
    with _no_gc():
        y = remat.checkpoint(lambda t: t.exp().sin(), x, policy=policies.recompute_everything)
        with _Storages("exp") as replayed:
            saved = y.grad_fn._saved_self  # sin's input, rebuilt outside any backward
        assert torch.equal(saved, x.exp()) and len(replayed.refs) == 1
        del saved
        assert not any(replayed.alive())
    y.sum().backward()
    assert torch.equal(x.grad, (x.exp().cos() * x.exp()).detach())


def test_partial_backward_leaves_nothing_cached() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x.exp()  # saves a
        b = a.sigmoid()  # saves b
        return b, b.tanh()  # tanh saves its result

    with _no_gc():
        x = _leaf(1000)
        b, c = remat.checkpoint(fn, x, policy=policies.recompute_everything)
        with _Storages("exp", "sigmoid") as replayed:
            torch.autograd.grad(c.sum(), b)  # needs only c: exp and sigmoid replayed
        assert len(replayed.refs) == 2
        assert not any(replayed.alive())  # while b (and the engine) are still alive


def test_graph_region_inside_a_region_engine_region() -> None:
    def outer(x: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        y = remat.checkpoint(
            lambda t: F.dropout(t.sin(), 0.5).tanh(), h, policy=policies.recompute_everything
        )
        return (y * h).sum()

    x = _leaf(16)
    a, b = _fresh(x, x)
    torch.manual_seed(0)
    outer(a).backward()
    torch.manual_seed(0)
    remat.checkpoint(outer, b).backward()
    assert torch.equal(a.grad, b.grad)


def test_region_engine_region_inside_a_graph_region() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        y = remat.checkpoint(lambda t: F.dropout(t.sin(), 0.5).tanh(), h)
        return (y * h).sum()

    run_both(fn, _leaf(16), policy=policies.recompute_everything)


def test_nested_graph_regions_share_one_recording() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.exp()
        with remat.region(policy=policies.save_everything):
            g = F.dropout(h @ w, 0.4).sigmoid()
        y = remat.checkpoint(lambda t: t.tanh() * h, g, policy=policies.save_matmuls)
        return y.sum()

    ops = run_both(fn, _leaf(6, 5), _leaf(5, 5), policy=policies.recompute_everything)
    # exp is saved by nothing but read by the inner regions' ops: the outer policy decides it,
    # and the inner regions' ops (sigmoid kept, tanh recomputed) follow their own policies.
    assert ops["exp"] == 1 and ops["sigmoid"] == 0 and ops["tanh"] == 1


def test_autocast_and_default_device_of_forward_are_what_replays_see() -> None:
    lin = nn.Linear(8, 8)
    twin = copy.deepcopy(lin)
    x = _leaf(4, 8)
    a, b = _fresh(x, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(0)
        plain = F.dropout(lin(a), 0.3).float().sin().sum()
        torch.manual_seed(0)
        out = remat.checkpoint(
            lambda t: F.dropout(twin(t), 0.3).float().sin().sum(),
            b,
            policy=policies.recompute_everything,
        )
    plain.backward()
    with torch.device("meta"):
        out.backward()  # outside autocast, another default device: replays are recorded ops
    assert torch.equal(a.grad, b.grad)
    assert_equal([p.grad for p in lin.parameters()], [p.grad for p in twin.parameters()])


# ---------------------------------------------------------------------------------------------
# G. remat.explain on graph regions
# ---------------------------------------------------------------------------------------------


def test_explain_reports_graph_engine_decisions() -> None:
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 5), nn.Tanh())
    remat.checkpoint_wrapper(model, policy=policies.save_matmuls)
    report = remat.explain(model, _leaf(3, 8))
    activations = [
        (r.module, r.op, r.shape, r.decision, r.how) for r in report.rows if r.kind == "activation"
    ]
    assert activations == [
        ("1", "addmm", (3, 6), "keep", "graph engine"),  # the first matmul's output, kept
        ("2", "tanh", (3, 5), "recompute", "graph engine"),  # tanh's result, replayed
        # ... from the second matmul's output, which the engine holds for that replay
        ("1", "addmm", (3, 5), "keep", "graph engine, held to rebuild saved tensors"),
    ]
    # The region's input and the two kept outputs.
    assert report.kept_bytes == 3 * 8 * 4 + 3 * 6 * 4 + 3 * 5 * 4
    assert report.recomputed_bytes == 3 * 5 * 4


def test_explain_reports_a_saved_region_input_as_kept() -> None:
    model = remat.checkpoint_wrapper(nn.Linear(8, 6), policy=policies.recompute_everything)
    report = remat.explain(model, _leaf(3, 8))
    inputs = [r for r in report.rows if r.kind == "input"]
    assert inputs and all(r.decision == "keep" for r in inputs), [
        (r.how, r.decision) for r in inputs
    ]


def test_explain_on_a_region_block() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        with remat.region(policy=policies.recompute_everything):
            return x.exp().sin()

    report = remat.explain(fn, _leaf(3, 8))
    assert [(r.op, r.decision, r.how) for r in report.rows] == [
        ("exp", "recompute", "graph engine"),  # exp saves its result
        ("exp", "recompute", "graph engine"),  # sin saves its input, the same tensor
    ]
    assert report.kept_bytes == 0 and report.recomputed_bytes == 3 * 8 * 4


# ---------------------------------------------------------------------------------------------
# H. module names: tracked only for policies that may read ctx.module
# ---------------------------------------------------------------------------------------------


class _HookProbe(nn.Module):
    """Records how many global module hooks are installed while its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.modules import module as nn_module

        self.seen.append(
            len(nn_module._global_forward_pre_hooks) + len(nn_module._global_forward_hooks)
        )
        return x.sin()


def test_a_policy_deciding_by_op_records_without_module_hooks() -> None:
    probe = _HookProbe()
    model = nn.Sequential(nn.Linear(4, 4), probe)
    remat.checkpoint_wrapper(model, policy=policies.save_matmuls)
    model(_leaf(2, 4)).sum().backward()
    assert probe.seen == [0]


def _module_reader(seen: list[tuple[str, str]]) -> Any:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        seen.append((ctx.module, op.overloadpacket.__name__))
        return Decision.PREFER_RECOMPUTE

    return policy


def test_a_policy_reading_the_module_gets_its_path_also_inside_a_by_op_region() -> None:
    torch.manual_seed(0)
    for outer_policy in (None, policies.save_matmuls):
        seen: list[tuple[str, str]] = []
        probe = _HookProbe()
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), probe))
        remat.apply(model, ["1"], policy=_module_reader(seen))
        if outer_policy is not None:
            remat.checkpoint_wrapper(model, policy=outer_policy)
        model(_leaf(2, 4)).sum().backward()
        assert ("1.1", "tanh") in seen and ("1.2", "sin") in seen
        assert ("1.0", "addmm") in seen
        assert probe.seen == [2]  # tracked by hooks while the reading policy is on the stack


def _walks_per_call(policy: Any) -> int:
    """How often a wrapped module's tree is walked for names, in one training call."""
    walks: list[str] = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    named_modules = model.named_modules

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks.append("walk")
        return named_modules(*args, **kwargs)

    model.named_modules = counted  # type: ignore[method-assign]
    remat.checkpoint_wrapper(model, policy=policy)
    model(_leaf(2, 4)).sum().backward()
    return len(walks)


def test_a_policy_deciding_by_op_names_no_modules_on_each_call() -> None:
    assert _walks_per_call(policies.save_matmuls) == 0  # the names would go unused
    assert _walks_per_call(_module_reader([])) == 1  # this policy reads ctx.module


# -- where the records sit --------------------------------------------------------------------


def test_argument_layouts_follow_the_schemas() -> None:
    from remat._aten import ArgLayout, op_info

    aten = torch.ops.aten
    assert op_info(aten.view.default).layout == ArgLayout((0,), ())
    assert op_info(aten.native_layer_norm.default).layout == ArgLayout((0, 2, 3), ())
    assert op_info(aten.cat.default).layout == ArgLayout((), (0,))
    assert op_info(aten.index.Tensor).layout == ArgLayout((0,), (1,))
    # A generic or opaque argument type: every argument is searched for tensors.
    assert op_info(aten.add.t).layout is None
    assert op_info(aten.set_.source_Storage).layout is None


def test_which_writes_autograd_counts_follows_the_schemas() -> None:
    """In-place and ``out=`` variants bump the written tensors' version counters; a functional
    op that writes an argument does not (checked against the counters themselves)."""
    from remat._aten import op_info

    aten = torch.ops.aten
    x, noise, out = torch.randn(3, 4), torch.empty(3, 4), torch.empty(3, 4)
    x.mul_(2)
    torch.add(x, 1, out=out)
    aten.rrelu_with_noise.default(x, noise, 0.1, 0.3, True)
    assert (x._version, out._version, noise._version) == (1, 1, 0)
    assert op_info(aten.mul_.Tensor).counted and op_info(aten.add.out).counted
    assert not op_info(aten.rrelu_with_noise.default).counted
    assert not op_info(aten.native_batch_norm.default).counted
    assert not op_info(aten.exp.default).counted  # writes nothing


def _views_cat_index_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(x.exp().view(4, 8) @ w, (8,))
    h = torch.cat([h, F.dropout(h, 0.3)], dim=1)[torch.tensor([0, 2, 3])]
    return h.add_(1).tanh().sum()  # add_(1) reaches the mode with the number 1 as ``other``


def _recorded(fn: Callable[..., torch.Tensor], *leaves: torch.Tensor) -> tuple[Any, OpCounter]:
    """The graph a recompute-everything region records for ``fn``, and its backward's ops."""
    graphs: list[Any] = []

    def capture(*args: torch.Tensor) -> torch.Tensor:
        out = fn(*args)
        graphs.append(remat._state.state.graph)
        return out

    ops = run_both(capture, *leaves, policy=policies.recompute_everything)
    return graphs[-1], ops  # the first run is the plain one


def test_records_sit_where_the_schema_allows_tensors() -> None:
    from remat._nodes import Ref

    graph, ops = _recorded(_views_cat_index_norm, _leaf(2, 16), _leaf(8, 8))
    by_name: dict[str, Any] = {}
    for node in graph.nodes:
        by_name.setdefault(node.op.overloadpacket.__name__, node)
    view = by_name["view"]
    assert type(view.args[0]) is Ref and view.args[1] == [4, 8]
    cat = by_name["cat"]
    assert [type(a) for a in cat.args[0]] == [Ref, Ref] and cat.args[1] == 1
    add_ = by_name["add_"]
    assert type(add_.args[0]) is Ref and add_.args[1] == 1
    assert ops["add_"] == 1 and ops["exp"] == 1  # replayed, from those records


def test_ops_without_a_layout_are_searched_whole_and_replay_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from remat import graph as graph_module

    x, w = _leaf(2, 16), _leaf(8, 8)
    by_layout, ops = _recorded(_views_cat_index_norm, *_fresh(x, w))
    learn = graph_module._learn

    def without_layout(func: Any) -> Any:
        facts = learn(func)._replace(layout=None)
        graph_module._FACTS[id(func)] = facts
        return facts

    monkeypatch.setattr(graph_module, "_FACTS", {})
    monkeypatch.setattr(graph_module, "_learn", without_layout)
    searched, searched_ops = _recorded(_views_cat_index_norm, *_fresh(x, w))
    assert all(node.layout is None for node in searched.nodes)
    assert [(n.op, n.refs) for n in searched.nodes] == [(n.op, n.refs) for n in by_layout.nodes]
    assert searched_ops.counts == ops.counts


def test_a_parameter_saved_in_a_region_is_held_without_a_detach() -> None:
    # LayerNorm saves its weight and bias: leaves from outside the region, held as they are.
    norm = nn.LayerNorm(8)
    x = _leaf(4, 8)
    with counting_ops() as ops:
        out = remat.checkpoint(norm, x, policy=policies.recompute_everything)
    assert ops["native_layer_norm"] == 1 and ops["detach"] == 0
    out.sum().backward()
    plain, xp = nn.LayerNorm(8), _fresh(x)[0]
    plain.load_state_dict(norm.state_dict())
    plain(xp).sum().backward()
    assert torch.equal(x.grad, xp.grad)
    assert torch.equal(norm.weight.grad, plain.weight.grad)
