"""Policies (``remat.policies``): built-ins, combinators, the rules for several policies, and
what each built-in replays in backward, measured in FLOPs.

Numerical checks compare against a plain run from the same RNG state, bit for bit
(``torch.equal``), with dropout active. Mechanism checks count the ATen ops and FLOPs of backward:
an op whose output a policy keeps never shows up there, an op it recomputes does.
"""

from __future__ import annotations

import copy
import functools
import re
import threading
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat import policies
from remat.policies import Decision, OpContext, as_decision, must_save_reason, resolve
from remat.workloads import GPTBlock

from helpers import OpCounter, assert_equal, counting_ops

aten = torch.ops.aten


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_()


def _fresh(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


def _grads(*tensors: torch.Tensor) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def run_both(fn: Any, *leaves: torch.Tensor, policy: Any, seed: int = 7) -> OpCounter:
    """``fn(*leaves) -> scalar`` plainly and in a graph region with ``policy``; compare output and
    grads bit for bit. Returns the op counts of the region's backward."""
    a, b = _fresh(*leaves), _fresh(*leaves)
    torch.manual_seed(seed)
    plain = fn(*a)
    plain.backward()
    torch.manual_seed(seed)
    out = remat.checkpoint(fn, *b, policy=policy)
    with counting_ops() as ops:
        out.backward()
    assert torch.equal(plain, out)
    assert_equal(_grads(*a), _grads(*b), "grads")
    return ops


def _held_by_forward(fn: Any, *args: torch.Tensor, policy: Any) -> int:
    """Bytes a graph region's forward leaves allocated, besides its output."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = remat.checkpoint(fn, *args, policy=policy)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    out.backward()
    return sum(e.nbytes() for e in events) - out.nbytes


# ---------------------------------------------------------------------------------------------
# Decisions, conversions, and the rules for several policies
# ---------------------------------------------------------------------------------------------


def test_decision_properties() -> None:
    D = Decision
    assert [d for d in D if d.must] == [
        D.MUST_SAVE,
        D.MUST_RECOMPUTE,
        D.MUST_OFFLOAD_HOST,
        D.MUST_OFFLOAD_DISK,
    ]
    assert [d for d in D if d.save] == [D.MUST_SAVE, D.PREFER_SAVE]
    assert [d for d in D if d.recompute] == [D.MUST_RECOMPUTE, D.PREFER_RECOMPUTE]
    assert {d: d.offload for d in D if d.offload} == {
        D.MUST_OFFLOAD_HOST: "host",
        D.PREFER_OFFLOAD_HOST: "host",
        D.MUST_OFFLOAD_DISK: "disk",
        D.PREFER_OFFLOAD_DISK: "disk",
    }


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (Decision.PREFER_SAVE, Decision.PREFER_SAVE),
        (CheckpointPolicy.MUST_SAVE, Decision.MUST_SAVE),
        (CheckpointPolicy.PREFER_SAVE, Decision.PREFER_SAVE),
        (CheckpointPolicy.MUST_RECOMPUTE, Decision.MUST_RECOMPUTE),
        (CheckpointPolicy.PREFER_RECOMPUTE, Decision.PREFER_RECOMPUTE),
        (CheckpointPolicy.MUST_CPU_OFFLOAD, Decision.MUST_OFFLOAD_HOST),
        (CheckpointPolicy.PREFER_CPU_OFFLOAD, Decision.PREFER_OFFLOAD_HOST),
        (True, Decision.MUST_SAVE),  # as in torch: True saves
        (False, Decision.PREFER_RECOMPUTE),
    ],
)
def test_what_a_policy_may_return(returned: Any, expected: Decision) -> None:
    assert as_decision(returned, save_nothing, aten.mm.default) is expected


def save_nothing(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    return Decision.PREFER_RECOMPUTE


@pytest.mark.parametrize("returned", ["save", None, 1, Decision.PREFER_SAVE.value])
def test_a_policy_returning_something_else_raises_with_its_name_and_value(returned: Any) -> None:
    def undecided(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        return returned

    expected = f"policy undecided returned {returned!r} ({type(returned).__name__}) for aten.exp"
    with pytest.raises(remat.RematError, match=re.escape(expected)):
        remat.checkpoint(lambda t: t.exp().sum(), _leaf(3), policy=undecided)


def test_resolve_follows_the_rules() -> None:
    D = Decision
    op = aten.exp.default
    # 1. MUST beats PREFER, wherever it sits in the stack.
    assert resolve([D.MUST_SAVE, D.PREFER_RECOMPUTE], op, "m") is D.MUST_SAVE
    assert resolve([D.PREFER_SAVE, D.MUST_RECOMPUTE, D.PREFER_SAVE], op, "m") is D.MUST_RECOMPUTE
    # 3. Among PREFERs the innermost (last) wins.
    assert resolve([D.PREFER_SAVE, D.PREFER_RECOMPUTE], op, "m") is D.PREFER_RECOMPUTE
    assert resolve([D.PREFER_RECOMPUTE, D.PREFER_SAVE], op, "m") is D.PREFER_SAVE
    # The same MUST twice is no conflict.
    assert resolve([D.MUST_SAVE, D.PREFER_RECOMPUTE, D.MUST_SAVE], op, "m") is D.MUST_SAVE
    # 2. Two different MUSTs raise, naming the op, the module and both decisions.
    with pytest.raises(
        remat.RematError,
        match=r"conflicting policies for aten\.exp\.default in module attn: .*MUST_RECOMPUTE "
        r"and MUST_SAVE",
    ):
        resolve([D.MUST_SAVE, D.MUST_RECOMPUTE], op, "attn")


@pytest.mark.parametrize(
    ("op", "reason"),
    [
        (aten.nonzero.default, "shape depends on the data"),
        (aten._unique2.default, "shape depends on the data"),
        (aten.masked_select.default, "shape depends on the data"),
        (aten.topk.default, "routing decisions"),
        (aten.sort.default, "routing decisions"),
        (aten._local_scalar_dense.default, ".item()"),
        (aten.mm.default, None),
        (aten.bernoulli_.float, None),  # random ops are replayed exactly, not saved
    ],
)
def test_must_save_reason(op: Any, reason: str | None) -> None:
    found = must_save_reason(op)
    assert found is None if reason is None else reason in (found or "")


# ---------------------------------------------------------------------------------------------
# Built-in policies and combinators, called directly
# ---------------------------------------------------------------------------------------------


def test_built_in_decisions() -> None:
    D, ctx = Decision, OpContext()
    assert policies.save_everything(ctx, aten.sin.default) is D.PREFER_SAVE
    assert policies.recompute_everything(ctx, aten.mm.default) is D.PREFER_RECOMPUTE
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default):
        assert policies.save_matmuls(ctx, op) is D.PREFER_SAVE
    for op in (aten.sin.default, aten.gelu.default, aten._softmax.default):
        assert policies.save_matmuls(ctx, op) is D.PREFER_RECOMPUTE
    inside = OpContext(in_attention=True)
    assert policies.recompute_attention_core(inside, aten.bmm.default) is D.PREFER_RECOMPUTE
    assert policies.recompute_attention_core(ctx, aten.addmm.default) is D.PREFER_SAVE


def test_save_smaller_than_is_strict_and_ignores_unknown_sizes() -> None:
    policy = policies.save_smaller_than(100)
    assert policy.__name__ == "save_smaller_than(100)"
    assert policy(OpContext(output_bytes=99), aten.sin.default) is Decision.PREFER_SAVE
    assert policy(OpContext(output_bytes=100), aten.sin.default) is Decision.PREFER_RECOMPUTE
    assert policy(OpContext(output_bytes=None), aten.sin.default) is Decision.PREFER_RECOMPUTE
    assert policies.save_smaller_than(0)(OpContext(output_bytes=0), aten.sin.default).save is False


def test_save_tagged_saves_only_the_named_tags() -> None:
    policy = policies.save_tagged("kv", "scores")
    assert policy.__name__ == "save_tagged('kv', 'scores')"
    sin = aten.sin.default
    assert policy(OpContext(tags=frozenset({"kv"})), sin) is Decision.MUST_SAVE
    assert policy(OpContext(tags=frozenset({"other"})), sin) is Decision.PREFER_RECOMPUTE
    assert policy(OpContext(), sin) is Decision.PREFER_RECOMPUTE


def test_save_if_any_keeps_what_any_policy_keeps() -> None:
    D = Decision
    combined = policies.save_if_any(policies.save_matmuls, policies.save_tagged("t"))
    assert combined.__name__ == "save_if_any(save_matmuls, save_tagged('t'))"
    tagged = OpContext(tags=frozenset({"t"}))
    assert combined(OpContext(), aten.mm.default) is D.PREFER_SAVE
    assert combined(OpContext(), aten.sin.default) is D.PREFER_RECOMPUTE
    assert combined(tagged, aten.sin.default) is D.MUST_SAVE  # save_tagged says MUST_SAVE
    # A keep wins over a MUST_RECOMPUTE; with no keep, a MUST_RECOMPUTE stays a MUST.
    strict = policies.save_if_any(
        policies.must(policies.recompute_everything), policies.save_matmuls
    )
    assert strict(OpContext(), aten.mm.default) is D.PREFER_SAVE
    assert strict(OpContext(), aten.sin.default) is D.MUST_RECOMPUTE
    # Torch decisions and bools from the parts are understood.
    torch_style = policies.save_if_any(
        lambda ctx, op, *a, **k: op == aten.sin.default,
        lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE,
    )
    assert torch_style(OpContext(), aten.sin.default) is D.MUST_SAVE
    assert torch_style(OpContext(), aten.cos.default) is D.PREFER_RECOMPUTE


def test_must_makes_every_preference_a_requirement() -> None:
    D = Decision
    strict = policies.must(policies.save_matmuls)
    assert strict.__name__ == "must(save_matmuls)"
    assert strict(OpContext(), aten.mm.default) is D.MUST_SAVE
    assert strict(OpContext(), aten.sin.default) is D.MUST_RECOMPUTE
    already = policies.must(lambda ctx, op, *a, **k: CheckpointPolicy.MUST_RECOMPUTE)
    assert already(OpContext(), aten.mm.default) is D.MUST_RECOMPUTE
    assert policies.must(lambda ctx, op, *a, **k: False)(OpContext(), aten.mm.default) is (
        D.MUST_RECOMPUTE
    )


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: policies.save_tagged(), r"save_tagged: expected tag names, got \(\)"),
        (lambda: policies.save_tagged("a", 1), r"save_tagged: expected tag names, got \('a', 1\)"),
        (lambda: policies.save_smaller_than(-1), "save_smaller_than: expected bytes >= 0, got -1"),
        (lambda: policies.save_smaller_than(1.5), "save_smaller_than: expected bytes >= 0"),
        (lambda: policies.save_smaller_than(True), "save_smaller_than: expected bytes >= 0"),
        (lambda: policies.save_if_any(), r"save_if_any: expected policies, got \(\)"),
        (lambda: policies.save_if_any(policies.save_matmuls, 3), "save_if_any: expected policies"),
    ],
)
def test_bad_policy_arguments_raise(make: Any, match: str) -> None:
    with pytest.raises(remat.RematError, match=match):
        make()


@pytest.mark.parametrize(
    "options",
    [
        {"early_stop": False},
        {"preserve_rng_state": False},
        {"debug": True},
        {"context_fn": lambda: (torch.enable_grad(), torch.enable_grad())},
    ],
    ids=["early_stop", "preserve_rng_state", "debug", "context_fn"],
)
def test_region_engine_options_with_a_policy_raise(options: dict[str, Any]) -> None:
    name = next(iter(options))
    match = f"{name} applies to the region engine, but a policy selects the graph engine"
    with pytest.raises(remat.RematError, match=f"remat.checkpoint: {match}"):
        remat.checkpoint(torch.sin, _leaf(2), policy=policies.save_matmuls, **options)
    with pytest.raises(remat.RematError, match=f"remat.checkpoint_wrapper: {match}"):
        remat.checkpoint_wrapper(nn.Linear(2, 2), policy=policies.save_matmuls, **options)
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(remat.RematError, match=f"remat.apply: {match}"):
        remat.apply(model, nn.Linear, policy=policies.save_matmuls, **options)
    assert "forward" not in model[0].__dict__  # nothing was wrapped


def test_a_policy_that_is_not_callable_raises() -> None:
    with pytest.raises(remat.RematError, match=r"remat\.checkpoint: policy must be a callable"):
        remat.checkpoint(torch.sin, _leaf(2), policy="save_matmuls")
    # A built-in policy's name: the error names the function (a factory with a call).
    for name, meant in [
        ("save_matmuls", "policy=remat.policies.save_matmuls."),
        ("offload_everything", "policy=remat.policies.offload_everything('host')."),
        ("OpContext", "; see remat.policies."),  # in the module, but no policy
        ("bogus", "; see remat.policies."),
    ]:
        with pytest.raises(remat.RematError) as caught:
            remat.apply(nn.Sequential(nn.Linear(2, 2)), nn.Linear, policy=name)
        assert str(caught.value).endswith(meant), str(caught.value)
    with (
        pytest.raises(remat.RematError, match=r"remat\.region: policy must be a callable"),
        remat.region(policy=3),
    ):
        pass


def _two_parameters(ctx: Any, op: Any) -> bool:
    return True


_FACTORY_CALLS = [
    (policies.offload_everything, "offload_everything('host')"),
    (policies.offload_matmuls, "offload_matmuls('host')"),
    (policies.offload_larger_than, "offload_larger_than(2**20, 'host')"),
    (policies.save_tagged, "save_tagged('name')"),
    (policies.save_smaller_than, "save_smaller_than(2**20)"),
    (policies.save_if_any, "save_if_any(save_matmuls, save_tagged('name'))"),
    (policies.must, "must(save_matmuls)"),
]


def _fronts(policy: Any) -> list[tuple[str, Any]]:
    """Each front that accepts a policy, as (its name, a call that gives it ``policy``)."""

    def in_region() -> None:
        with remat.region(policy=policy):
            pass

    return [
        ("remat.checkpoint", lambda: remat.checkpoint(torch.sin, _leaf(2), policy=policy)),
        ("remat.region", in_region),
        (
            "remat.checkpoint_wrapper",
            lambda: remat.checkpoint_wrapper(nn.Linear(2, 2), policy=policy),
        ),
        (
            "remat.apply",
            lambda: remat.apply(nn.Sequential(nn.Linear(2, 2)), nn.Linear, policy=policy),
        ),
    ]


@pytest.mark.parametrize(
    ("factory", "call"), _FACTORY_CALLS, ids=lambda v: getattr(v, "__name__", "")
)
def test_an_uncalled_factory_is_refused_where_it_is_given_with_the_call_to_make(
    factory: Any, call: str
) -> None:
    for front, give in _fronts(factory):
        expected = (
            f"{front}: policy=remat.policies.{factory.__name__} is a factory; call it: "
            f"policy=remat.policies.{call}."
        )
        with pytest.raises(remat.RematError, match=f"^{re.escape(expected)}$"):
            give()
    # The call the message names makes a policy.
    made = eval(call, {**vars(policies)})
    assert remat.policies.check(made, "test") is made


def test_a_policy_without_the_op_arguments_in_its_signature_is_refused_where_it_is_given() -> None:
    for front, give in _fronts(_two_parameters):
        expected = (
            f"{front}: policy=_two_parameters takes (ctx, op), but a policy is called "
            "as policy(ctx, op, *args, **kwargs) with the op's arguments; give it those "
            "parameters."
        )
        with pytest.raises(remat.RematError, match=f"^{re.escape(expected)}$"):
            give()


def test_a_policy_is_read_once_and_a_refused_one_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``remat.checkpoint(fn, x, policy=p)`` in a loop reads ``p``'s signature once (reading it
    costs more than a small region's forward); a policy refused is refused at every call."""
    reads: list[Any] = []
    signature = policies.inspect.signature

    def counted(obj: Any) -> Any:
        reads.append(obj)
        return signature(obj)

    monkeypatch.setattr(policies.inspect, "signature", counted)

    def fresh_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return Decision.PREFER_RECOMPUTE

    x = _leaf(4)
    for _ in range(3):
        remat.checkpoint(torch.sin, x, policy=fresh_policy).sum().backward()
    assert reads.count(fresh_policy) == 1
    for _ in range(2):
        with pytest.raises(remat.RematError, match=r"takes \(ctx, op\)"):
            remat.checkpoint(torch.sin, x, policy=_two_parameters)
    assert reads.count(_two_parameters) == 2


def test_combinators_check_their_policies_when_made() -> None:
    with pytest.raises(
        remat.RematError,
        match=r"^remat\.policies\.must: policy must be a callable .* got str \('x'\)",
    ):
        policies.must("x")  # type: ignore[arg-type]
    with pytest.raises(remat.RematError, match=r"^remat\.policies\.must: .*save_tagged is a"):
        policies.must(policies.save_tagged)
    with pytest.raises(remat.RematError, match=r"^remat\.policies\.save_if_any: .*offload_eve"):
        policies.save_if_any(policies.save_matmuls, policies.offload_everything)
    with pytest.raises(remat.RematError, match=r"^remat\.policies\.save_if_any: policy=_two_pa"):
        policies.save_if_any(_two_parameters)


def test_policies_of_every_accepted_shape_pass_the_check() -> None:
    class Callable_:
        def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
            return True

    accepted = [
        policies.save_matmuls,
        policies.must(policies.save_everything),
        torch_policy,
        Callable_(),
        lambda ctx, op, *a, **k: False,
        functools.partial(lambda flag, ctx, op, *a, **k: flag, True),
    ]
    for policy in accepted:
        assert policies.check(policy, "test") is policy
        remat.checkpoint(torch.sin, _leaf(2), policy=policy).sum().backward()


# ---------------------------------------------------------------------------------------------
# Several policies in nested regions
# ---------------------------------------------------------------------------------------------


def _exp_sin(x: torch.Tensor) -> torch.Tensor:
    return x.exp().sin().sum()  # exp saves its result, sin its input: the same tensor


def _exp_replays(outer: Any, inner: Any, inner_as_checkpoint: bool = False) -> int:
    """How often backward replays exp when ``_exp_sin`` runs in a region in a region."""
    x = _leaf(8)
    xp = _fresh(x)[0]
    _exp_sin(xp).backward()
    with remat.region(policy=outer):
        if inner_as_checkpoint:
            out = remat.checkpoint(_exp_sin, x, policy=inner)
        else:
            with remat.region(policy=inner):
                out = _exp_sin(x)
    with counting_ops() as ops:
        out.backward()
    assert torch.equal(x.grad, xp.grad)
    return ops["exp"]


KEEP, DROP = policies.save_everything, policies.recompute_everything
MUST_KEEP, MUST_DROP = policies.must(KEEP), policies.must(DROP)


@pytest.mark.parametrize(
    ("outer", "inner", "replays"),
    [
        (KEEP, DROP, 1),  # the innermost PREFER wins
        (DROP, KEEP, 0),
        (MUST_KEEP, DROP, 0),  # an outer MUST beats an inner PREFER
        (MUST_DROP, KEEP, 1),
        (KEEP, MUST_DROP, 1),  # an inner MUST beats an outer PREFER
        (DROP, MUST_KEEP, 0),
        (MUST_KEEP, KEEP, 0),  # agreeing MUST and PREFER
    ],
    ids=lambda p: getattr(p, "__name__", str(p)),
)
@pytest.mark.parametrize("inner_as_checkpoint", [False, True], ids=["region", "checkpoint"])
def test_nested_region_decisions(
    outer: Any, inner: Any, replays: int, inner_as_checkpoint: bool
) -> None:
    assert _exp_replays(outer, inner, inner_as_checkpoint) == replays


def test_conflicting_musts_in_nested_regions_raise() -> None:
    x = _leaf(8)
    with (
        pytest.raises(
            remat.RematError,
            match=r"conflicting policies for aten\.exp\.default .*MUST_RECOMPUTE and MUST_SAVE",
        ),
        remat.region(policy=MUST_KEEP),
        remat.region(policy=MUST_DROP),
    ):
        _exp_sin(x)


def test_nested_policy_applies_only_inside_its_region() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()  # outer region: recomputed
        with remat.region(policy=policies.save_everything):
            b = a.sigmoid()  # inner region: kept
        return (a * b.tanh()).sum()  # outer: tanh recomputed

    ops = run_both(fn, _leaf(16), policy=policies.recompute_everything)
    assert (ops["exp"], ops["sigmoid"], ops["tanh"]) == (1, 0, 1)


# ---------------------------------------------------------------------------------------------
# Torch selective-checkpointing policies work unchanged
# ---------------------------------------------------------------------------------------------


RECOMPUTE_FLAGS: list[bool] = []  # what torch_policy read from ctx.is_recompute


def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    RECOMPUTE_FLAGS.append(ctx.is_recompute)  # torch policies may read it
    return (
        CheckpointPolicy.MUST_SAVE if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    )


def bool_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return bool(op == aten.mm.default)


def _mm_dropout(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.dropout(torch.mm(x, w).sin(), 0.5).mm(w).sum()


@pytest.mark.parametrize("policy", [torch_policy, bool_policy])
def test_torch_style_policies_work_unchanged(policy: Any) -> None:
    x, w = _leaf(4, 4), _leaf(4, 4)
    RECOMPUTE_FLAGS.clear()
    ops = run_both(_mm_dropout, x, w, policy=policy)
    # remat asks a policy in forward only (torch 2.11 asks again in its recompute)
    assert policy is bool_policy or (RECOMPUTE_FLAGS and not any(RECOMPUTE_FLAGS))
    assert ops["mm"] == 4  # backward's own: the saved matmuls are not replayed
    assert ops["sin"] == 1 and ops["bernoulli_"] == 1  # the rest is
    # The same function drives torch's own selective checkpointing to the same grads.
    a, b = _fresh(x, w), _fresh(x, w)
    torch.manual_seed(7)
    remat.checkpoint(_mm_dropout, *a, policy=policy).backward()
    torch_sac_backward(_mm_dropout, b, policy)
    assert_equal(_grads(*a), _grads(*b))


def torch_sac_backward(fn: Any, leaves: list[torch.Tensor], policy: Any) -> None:
    """``fn(*leaves)`` under torch's selective checkpointing with ``policy``, and its backward,
    from seed 7."""
    torch.manual_seed(7)
    torch.utils.checkpoint.checkpoint(
        fn,
        *leaves,
        use_reentrant=False,
        context_fn=lambda: create_selective_checkpoint_contexts(policy),
    ).backward()


def _saved_then_recomputed_draw(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = (x @ w) * torch.rand_like(x)  # drawn, and kept by the policy below
    g = h[:, :4]
    return (g.sin() * torch.rand_like(g)).sum()  # drawn after it, and recomputed


def _keep_the_first_draw(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op == aten.rand_like.default and args[0].shape[1] == 8:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_a_draw_recomputed_after_a_kept_draw_replays_its_own_numbers() -> None:
    """A random op whose output the policy keeps, then one it recomputes (on CUDA, attention
    with dropout draws from the generator itself, and a matmul policy keeps it): the replay
    draws the second op's numbers from the state that op drew from. Torch's selective
    checkpointing restores the state from before the region, skips the kept draw, and so
    draws the first op's numbers for the second: other gradients, no error (pinned)."""
    x, w = _leaf(8, 8), _leaf(8, 8)
    ops = run_both(_saved_then_recomputed_draw, x, w, policy=_keep_the_first_draw)
    assert ops["rand_like"] == 1  # the kept draw is not replayed, the other one is
    a, b = _fresh(x, w), _fresh(x, w)
    torch.manual_seed(7)
    _saved_then_recomputed_draw(*a).backward()
    torch_sac_backward(_saved_then_recomputed_draw, b, _keep_the_first_draw)
    assert not torch.equal(a[0].grad, b[0].grad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# remat.tag
# ---------------------------------------------------------------------------------------------


def _tagged(x: torch.Tensor) -> torch.Tensor:
    a = x.exp()  # exp saves its result
    b = remat.tag(a.sin(), "b")  # sin saves its input, a
    return b.tanh().sum()  # tanh saves its result, rebuilt from b


def test_save_tagged_keeps_exactly_the_tagged_tensor() -> None:
    x = _leaf(256)
    ops = run_both(_tagged, x, policy=policies.save_tagged("b"))
    assert (ops["sin"], ops["exp"], ops["tanh"]) == (0, 1, 1)  # b is kept, a and c replayed
    assert _held_by_forward(_tagged, x, policy=policies.save_tagged("b")) == 256 * 4
    # Under another name the tag keeps nothing.
    ops = run_both(_tagged, x, policy=policies.save_tagged("other"))
    assert (ops["sin"], ops["exp"], ops["tanh"]) == (1, 1, 1)
    assert _held_by_forward(_tagged, x, policy=policies.save_tagged("other")) == 0


def test_tag_outside_a_region_returns_the_tensor_and_does_nothing() -> None:
    t = _leaf(3)
    assert remat.tag(t, "b") is t
    x = _fresh(t)[0]
    y = remat.tag(x.exp(), "b")
    assert y.grad_fn is not None and torch.equal(y, t.exp())
    with pytest.raises(remat.RematError, match=r"remat.tag: expected \(tensor, name: str\)"):
        remat.tag(t, 3)  # type: ignore[arg-type]
    with pytest.raises(remat.RematError, match=r"remat.tag: expected \(tensor, name: str\)"):
        remat.tag([t], "b")  # type: ignore[arg-type]


def test_tag_on_a_tensor_from_outside_the_region_changes_nothing() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        remat.tag(x, "b")  # a region input: nothing to keep, nothing to replay
        return _tagged(x)

    ops = run_both(fn, _leaf(16), policy=policies.save_tagged("b"))
    assert (ops["sin"], ops["exp"]) == (0, 1)


def test_a_tag_asks_the_policies_with_its_ops_arguments_as_far_as_they_live() -> None:
    asked: list[tuple[Any, tuple[Any, ...]]] = []

    def policy(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if ctx.tags:
            asked.append((op, args))
        return Decision.PREFER_RECOMPUTE

    inputs: dict[str, torch.Tensor] = {}

    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        b = a.sin()
        for _ in range(12):  # many ops between an op and the tag that names its result
            b.cos()
        remat.tag(b, "b")
        c = x.cos()
        d = c.tanh()
        del c  # tanh saves its result, not c: a plain run frees c here
        remat.tag(d, "d")
        inputs["a"] = a
        return (b + d).sum()

    remat.checkpoint(fn, _leaf(8), policy=policy).backward()
    assert [op for op, _ in asked] == [torch.ops.aten.sin.default, torch.ops.aten.tanh.default]
    assert asked[0][1][0] is inputs["a"]  # alive: the very tensor sin read
    assert asked[1][1] == (None,)  # gone: the records keep no tensor a plain run frees


def test_a_tag_inside_attention_is_asked_about_as_inside_attention() -> None:
    seen: list[bool] = []

    def policy(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if ctx.tags:
            seen.append(ctx.in_attention)
        return policies.recompute_attention_core(ctx, op, *args, **kwargs)

    k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)

    def fn(q: torch.Tensor) -> torch.Tensor:
        return remat.tag(F.scaled_dot_product_attention(q, k, v), "attention").sum()

    def untagged(q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v).sum()

    # The output was made inside scaled_dot_product_attention: asked again with its tag, the
    # policy still says recompute, so the region keeps no more than without the tag (the
    # generator state of the attention op).
    q = _leaf(1, 2, 8, 4)
    assert _held_by_forward(fn, q, policy=policy) == _held_by_forward(untagged, q, policy=policy)
    assert seen == [True]


def _reader(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
    return Decision.PREFER_RECOMPUTE if ctx.in_attention else Decision.PREFER_SAVE


@pytest.mark.parametrize(
    ("policy", "tracked"),
    [
        (policies.save_matmuls, False),
        (policies.recompute_everything, False),
        (policies.save_everything, False),
        (policies.save_tagged("h"), False),
        (policies.save_smaller_than(64), False),
        (policies.offload_matmuls("host"), False),
        (policies.must(policies.save_matmuls), False),
        (policies.save_if_any(policies.save_matmuls, policies.save_tagged("h")), False),
        (policies.recompute_attention_core, True),
        (_reader, True),  # any policy remat does not know may read ctx.in_attention
        (policies.must(policies.recompute_attention_core), True),
        (policies.save_if_any(policies.save_matmuls, _reader), True),
    ],
)
def test_only_policies_that_may_read_in_attention_pay_for_tracking_it(
    policy: Any, tracked: bool
) -> None:
    # Tracking ``ctx.in_attention`` takes a TorchFunctionMode, which every torch call of the
    # region goes through; the built-ins that never read it run without one.
    outside = torch._C._len_torch_function_stack()
    inside: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        inside.append(torch._C._len_torch_function_stack())
        return x.sin().sum()

    remat.checkpoint(fn, _leaf(4), policy=policy).backward()
    assert inside == [outside + tracked]
    assert policies.reads_attention(policy) is tracked


def test_a_nested_policy_that_reads_in_attention_is_told_inside_a_region_that_does_not() -> None:
    seen: list[tuple[str, bool]] = []

    def reader(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        seen.append((op.overloadpacket.__name__, ctx.in_attention))
        return _reader(ctx, op, *args, **kwargs)

    k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)

    def fn(q: torch.Tensor) -> torch.Tensor:
        with remat.region(policy=reader):
            a = F.scaled_dot_product_attention(q, k, v)
        b = q.exp()  # the reader is not on the stack here
        with remat.region(policy=reader):  # tracked again after the first nested region ended
            c = F.scaled_dot_product_attention(q, k, v)
        return (a + b + c).sum()

    q = _leaf(1, 2, 8, 4)
    plain_q = q.detach().clone().requires_grad_()
    fn(plain_q).backward()
    remat.checkpoint(fn, q, policy=policies.save_matmuls).backward()
    assert torch.equal(q.grad, plain_q.grad)
    assert len(seen) >= 2 and all(inside for _, inside in seen), seen
    assert "exp" not in {name for name, _ in seen}


@pytest.mark.parametrize(
    ("policy", "by_op"),
    [
        (policies.save_matmuls, True),
        (policies.recompute_everything, True),
        (policies.save_everything, True),
        (policies.offload_everything("host"), True),
        (policies.offload_matmuls("disk"), True),
        (policies.must(policies.save_matmuls), True),
        (policies.save_if_any(policies.save_matmuls, policies.offload_matmuls("host")), True),
        (policies.save_tagged("h"), False),
        (policies.save_smaller_than(64), False),
        (policies.offload_larger_than(64), False),
        (policies.recompute_attention_core, False),
        (_reader, False),  # any policy remat does not know may read anything
        (policies.must(_reader), False),
        (policies.save_if_any(policies.save_matmuls, policies.save_tagged("h")), False),
    ],
)
def test_which_policies_decide_by_the_op_alone(policy: Any, by_op: bool) -> None:
    assert policies.decides_by_op(policy) is by_op


def test_a_policy_that_decides_by_the_op_alone_is_asked_once_per_op() -> None:
    asked: Counter[Any] = Counter()

    def by_op(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        asked[op] += 1
        return Decision.PREFER_SAVE if op is aten.mm.default else Decision.PREFER_RECOMPUTE

    policies._reads()(by_op)  # marked as the built-ins that read nothing but the op are
    w = _leaf(6, 6)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.sin().sin() @ w).sin().sum()

    for _ in range(3):
        ops = run_both(fn, _leaf(4, 6), policy=by_op)
        # Its answers still hold: the matmul is kept, so backward runs only its own two;
        # both sins before it are replayed (the matmul's backward reads the second, whose
        # backward reads the first).
        assert (ops["mm"], ops["sin"]) == (2, 2)
    # Three regions of three sins and a matmul each; asked once per op, not per call.
    assert asked[aten.sin.default] == 1 and asked[aten.mm.default] == 1
    assert all(n == 1 for n in asked.values()), asked


def test_a_nested_policy_is_asked_every_time_and_leaves_the_outer_answers_as_they_were() -> None:
    outer: Counter[Any] = Counter()
    inner: Counter[Any] = Counter()

    def by_op(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        outer[op] += 1
        return Decision.PREFER_RECOMPUTE

    def keep(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        inner[op] += 1
        return Decision.MUST_SAVE

    policies._reads()(by_op)

    def fn(x: torch.Tensor) -> torch.Tensor:
        with remat.region(policy=keep):  # the stack holds two policies: no answer reused
            a = x.sin().sin()
        return a.sin().sin().sum()  # the outer policy alone: its own answer, PREFER_RECOMPUTE

    for _ in range(2):
        ops = run_both(fn, _leaf(8), policy=by_op)
        # The nested sins are kept (MUST_SAVE); of the two after them, the first is replayed
        # for the second's backward: a resolved MUST_SAVE stored as the outer answer would
        # keep it instead.
        assert ops["sin"] == 1
    # Per run, the nested region asks ``keep`` about its two sins, and so does the plain run's
    # region (its own graph region there); ``by_op`` is asked about both nested sins, and about
    # the sins after them only the first time.
    assert inner[aten.sin.default] == 2 * (2 + 2) and outer[aten.sin.default] == 2 * 2 + 1


def test_the_records_hold_no_intermediate_longer_than_a_plain_run() -> None:
    freed: list[bool] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        a = x.mul(2.0)
        b = a.add(1.0)  # neither mul by a number nor add saves a tensor for backward
        gone = weakref.ref(a)
        del a
        freed.append(gone() is None)
        return b.sin().sum()

    remat.checkpoint(fn, _leaf(8), policy=policies.recompute_everything).backward()
    fn(_leaf(8))  # and in a plain run, for comparison
    assert freed == [True, True]


def test_save_if_any_and_must_in_a_region() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = remat.tag(x.exp(), "h")  # kept through the tag
        m = h @ w  # kept as a matmul
        return (m.sigmoid() * h.sin()).sum()  # mul saves both: sigmoid and sin are replayed

    either = policies.save_if_any(policies.save_tagged("h"), policies.save_matmuls)
    ops = run_both(fn, _leaf(8, 6), _leaf(6, 6), policy=either)
    assert (ops["exp"], ops["mm"], ops["sigmoid"], ops["sin"]) == (0, 2, 1, 1)
    # save_tagged says MUST_SAVE for the tagged exp: a must(...) region around it that says
    # MUST_RECOMPUTE conflicts with it rather than silently winning.
    x, w = _leaf(8, 6), _leaf(6, 6)
    with (
        pytest.raises(remat.RematError, match=r"aten\.exp\.default .*MUST_RECOMPUTE and MUST_SAVE"),
        remat.region(policy=MUST_DROP),
        remat.region(policy=either),
    ):
        fn(x, w)


def test_tag_with_a_policy_that_reads_the_ops_arguments() -> None:
    def matrices(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        keep = isinstance(args[0], torch.Tensor) and args[0].dim() > 1
        return Decision.PREFER_SAVE if keep else Decision.PREFER_RECOMPUTE

    policy = policies.save_if_any(policies.save_tagged("h"), matrices)
    run_both(lambda x: remat.tag(x.exp(), "h").sin().sum(), _leaf(8), policy=policy)


def test_save_smaller_than_never_keeps_more_than_it_says() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        big = x.exp()  # 256 KiB: recomputed
        return big[0, :4].sin().sum()  # sin saves a 16-byte view of it

    held = _held_by_forward(fn, _leaf(256, 256), policy=policies.save_smaller_than(1024))
    assert held < 1024


# ---------------------------------------------------------------------------------------------
# What policies see
# ---------------------------------------------------------------------------------------------

# One GPT block: batch 2, sequence 12, width 20, 2 heads of 10; B*T = 24 rows; MLP width 80.
_B, _T, _D, _H = 2, 12, 20, 2


def _block() -> GPTBlock:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPTBlock(_D, _H, dropout=0.1)


def test_policies_see_module_output_size_and_attention_scope_once_per_op() -> None:
    seen: list[tuple[str, str, int | None, bool]] = []

    def spy(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        assert not ctx.is_recompute and not ctx.tags
        seen.append((ctx.module, op.overloadpacket.__name__, ctx.output_bytes, ctx.in_attention))
        return Decision.PREFER_RECOMPUTE

    x = _leaf(_B, _T, _D)
    plain, block = _block(), remat.checkpoint_wrapper(_block(), policy=spy)
    with counting_ops() as plain_ops:
        plain(x)
    out = block(x)
    # Once per op of the block (detach: see test_policies_are_asked_only_about_the_regions_ops).
    asked = Counter(name for _, name, _, _ in seen if name != "detach")
    assert asked == Counter({k: v for k, v in plain_ops.counts.items() if k != "detach"})
    # Every linear layer, by module, with the float32 bytes of its (B*T, out) result.
    assert [(m, size) for m, name, size, _ in seen if name == "addmm"] == [
        ("attn.qkv", 24 * 60 * 4),
        ("attn.proj", 24 * 20 * 4),
        ("mlp.0", 24 * 80 * 4),
        ("mlp.2", 24 * 20 * 4),
    ]
    attention = [(m, name) for m, name, _, inside in seen if inside]
    assert {m for m, _ in attention} == {"attn"}
    assert [name for _, name in attention if name in ("bmm", "_safe_softmax", "bernoulli_")] == [
        "bmm",
        "_safe_softmax",
        "bernoulli_",
        "bmm",
    ]
    assert not any(inside for _, name, _, inside in seen if name in ("addmm", "native_layer_norm"))
    calls = len(seen)
    out.sum().backward()
    assert len(seen) == calls  # never asked in backward


def test_policies_are_asked_only_about_the_regions_ops() -> None:
    asked: list[str] = []

    def spy(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        asked.append(op.overloadpacket.__name__)
        return Decision.PREFER_RECOMPUTE

    norm = nn.LayerNorm(4)  # native_layer_norm saves its weight and bias
    x = _leaf(2, 4)
    with counting_ops() as plain_ops:
        norm(x)
    remat.checkpoint(norm, x, policy=spy)
    assert Counter(asked) == Counter(plain_ops.counts)


# ---------------------------------------------------------------------------------------------
# B. What each built-in policy replays on one GPT block, in FLOPs
# ---------------------------------------------------------------------------------------------
#
# Forward FLOPs of the matmuls of the block (2 * M * K * N each):
#   qkv      addmm [24 x 20] @ [20 x 60]               2*24*20*60 = 57600
#   scores   bmm   [4 x 12 x 10] @ [4 x 10 x 12]       2*4*12*12*10 = 11520   (B*H = 4; q @ k^T)
#   context  bmm   [4 x 12 x 12] @ [4 x 12 x 10]       2*4*12*12*10 = 11520   (probs @ v)
#   proj     addmm [24 x 20] @ [20 x 20]               2*24*20*20 = 19200
#   fc1      addmm [24 x 20] @ [20 x 80]               2*24*20*80 = 76800
#   fc2      addmm [24 x 80] @ [80 x 20]               2*24*80*20 = 76800
# (On CPU, SDPA with dropout runs its math path: two bmm's around softmax and dropout.)
# A plain backward runs two matmuls per linear layer (input and weight grads) and four bmm's for
# attention: 2 * (57600 + 19200 + 76800 + 76800) + 4 * 11520 = 506880.

PLAIN_BACKWARD_FLOPS = 506880
QKV = ("addmm", (24, 20), (20, 60))
SCORES = ("bmm", (4, 12, 10), (4, 10, 12))
CONTEXT = ("bmm", (4, 12, 12), (4, 12, 10))
PROJ = ("addmm", (24, 20), (20, 20))
FC1 = ("addmm", (24, 20), (20, 80))
FC2 = ("addmm", (24, 80), (80, 20))


class _Matmuls(TorchDispatchMode):
    """Records each matmul-family op as (name, shape of its left operand, of its right one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, tuple[int, ...], tuple[int, ...]]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            self.ops[(name, tuple(args[-2].shape), tuple(args[-1].shape))] += 1
        return func(*args, **(kwargs or {}))


def _block_backward(policy: Any) -> tuple[int, Counter[Any], list[torch.Tensor | None]]:
    """Backward FLOPs, matmuls run and grads of one GPT block, plainly or under ``policy``."""
    block = _block()
    block.mlp[0].register_forward_hook(lambda m, args, out: remat.tag(out, "fc1"))
    x = torch.randn(_B, _T, _D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.manual_seed(2)
    out = block(x) if policy is None else remat.checkpoint(block, x, policy=policy)
    with FlopCounterMode(display=False) as flops, _Matmuls() as matmuls:
        out.square().sum().backward()
    return flops.get_total_flops(), matmuls.ops, [x.grad, *(p.grad for p in block.parameters())]


def test_plain_block_backward_is_what_the_count_says() -> None:
    flops, _, _ = _block_backward(None)
    assert flops == PLAIN_BACKWARD_FLOPS


def test_save_matmuls_replays_no_matmul_flops() -> None:
    plain_flops, plain_ops, plain_grads = _block_backward(None)
    flops, ops, grads = _block_backward(policies.save_matmuls)
    assert flops == plain_flops == PLAIN_BACKWARD_FLOPS
    assert ops == plain_ops
    assert_equal(plain_grads, grads, "grads")


class _Products(nn.Module):
    """Each product ``save_matmuls`` keeps besides ``mm`` and ``bmm``, with a pointwise op
    after it that backward replays."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5))
        self.b = nn.Parameter(torch.randn(6))
        self.batch = nn.Parameter(torch.randn(3, 6, 4))
        self.c = nn.Parameter(torch.randn(4, 4))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        mv = (self.w @ v).sin()  # mv
        addmv = torch.addmv(self.b, self.w, v).sin()
        dot = torch.dot(mv, addmv).sin()
        vdot = torch.vdot(mv, self.b).sin()
        addbmm = torch.addbmm(self.c, self.batch.mT, self.batch * mv[:, None])
        return (addbmm.sin().sum() + dot + vdot) * mv.cos().sum()


def test_save_matmuls_keeps_matrix_vector_and_dot_products() -> None:
    """``mv``, ``addmv``, ``dot``, ``vdot`` and ``addbmm`` are matmuls as much as ``mm`` is:
    under ``save_matmuls`` backward runs the same products a plain backward runs, none
    replayed, and the gradients are the plain ones bit for bit."""
    products = ("mv", "addmv", "dot", "vdot", "addbmm", "mm", "bmm")

    def backward(policy: Any) -> tuple[dict[str, int], list[torch.Tensor | None]]:
        torch.manual_seed(0)
        model = _Products()
        v = torch.randn(5, requires_grad=True)
        out = model(v) if policy is None else remat.checkpoint(model, v, policy=policy)
        with counting_ops() as ops:
            out.backward()
        return {k: ops[k] for k in products}, [v.grad, *(p.grad for p in model.parameters())]

    plain_ops, plain_grads = backward(None)
    ops, grads = backward(policies.save_matmuls)
    assert ops == plain_ops
    assert_equal(plain_grads, grads, "grads")
    replayed, _ = backward(policies.recompute_everything)  # the count sees a replay
    assert all(replayed[k] > plain_ops[k] for k in ("mv", "addmv", "dot", "vdot", "addbmm"))


@pytest.mark.parametrize(
    ("policy", "replayed", "replayed_flops"),
    [
        (policies.save_everything, [], 0),
        (policies.save_matmuls, [], 0),
        # Everything the saved tensors depend on: q, k, v for attention's backward (qkv), the
        # probabilities (scores), proj's input (context), ln2's input (proj), gelu's input (fc1).
        # Not fc2: the MLP dropout's mask reads its output through empty_like, for its shape
        # only (see test_metadata_only_reads_do_not_pull_their_producer_into_the_replay).
        (
            policies.recompute_everything,
            [QKV, SCORES, CONTEXT, PROJ, FC1],
            57600 + 11520 + 11520 + 19200 + 76800,
        ),
        # Only what runs inside SDPA: the probabilities come back from the scores; the output of
        # probs @ v is not needed (the contiguous copy after it, outside SDPA, is kept).
        (policies.recompute_attention_core, [SCORES], 11520),
        # Outputs of 6000 bytes or more are recomputed: fc1 and gelu (24*80*4 = 7680 bytes
        # each); qkv (5760), scores (2304) and every (24, 20) result (1920) are kept.
        (policies.save_smaller_than(6000), [FC1], 76800),
        # The tagged fc1 output is kept, everything else replayed as under recompute_everything.
        (
            policies.save_tagged("fc1"),
            [QKV, SCORES, CONTEXT, PROJ],
            57600 + 11520 + 11520 + 19200,
        ),
    ],
    ids=lambda p: getattr(p, "__name__", None) if callable(p) else None,
)
def test_backward_flops_are_plain_plus_exactly_the_replayed_matmuls(
    policy: Any, replayed: list[Any], replayed_flops: int
) -> None:
    _, plain_ops, plain_grads = _block_backward(None)
    flops, ops, grads = _block_backward(policy)
    assert ops - plain_ops == Counter(replayed) and not plain_ops - ops
    assert flops == PLAIN_BACKWARD_FLOPS + replayed_flops
    assert_equal(plain_grads, grads, "grads")


def test_the_flop_count_sees_a_replay() -> None:
    # The region engine re-runs the whole block, fc2 included: its FLOPs are a full forward.
    block = _block()
    x = _leaf(_B, _T, _D)
    torch.manual_seed(2)
    out = remat.checkpoint(copy.deepcopy(block), x)
    with FlopCounterMode(display=False) as flops:
        out.square().sum().backward()
    forward = 57600 + 11520 + 11520 + 19200 + 76800 + 76800
    assert flops.get_total_flops() == PLAIN_BACKWARD_FLOPS + forward


# ---------------------------------------------------------------------------------------------
# C. recompute_attention_core on attention written out, as Hugging Face's "eager" does it
# ---------------------------------------------------------------------------------------------


class EagerAttention(nn.Module):
    """Self-attention as ``attn_implementation="eager"`` computes it in Hugging Face models:
    matmul, scale, mask, softmax in float32, dropout, matmul; no scaled_dot_product_attention."""

    def __init__(self, width: int = _D, heads: int = _H, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(width, width) for _ in range(4)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        shape = (b, t, self.heads, d // self.heads)
        query = self.q_proj(x).view(shape).transpose(1, 2)
        key = self.k_proj(x).view(shape).transpose(1, 2)
        value = self.v_proj(x).view(shape).transpose(1, 2)
        weights = torch.matmul(query, key.transpose(2, 3)) * (d // self.heads) ** -0.5
        weights = weights + mask
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = F.dropout(weights, p=self.dropout, training=self.training)
        out = torch.matmul(weights, value)
        return self.o_proj(out.transpose(1, 2).contiguous().reshape(b, t, d))


def _eager_backward(policy: Any) -> tuple[Counter[str], Counter[Any], list[torch.Tensor | None]]:
    """Backward op counts, matmuls and grads of an eager attention block, plainly or under
    ``policy``, from the same parameters, input and random state (dropout active)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = EagerAttention()
    x = torch.randn(_B, _T, _D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    mask = torch.triu(torch.full((_T, _T), float("-inf")), 1)
    torch.manual_seed(2)
    out = block(x, mask) if policy is None else remat.checkpoint(block, x, mask, policy=policy)
    with counting_ops() as ops, _Matmuls() as matmuls:
        out.square().sum().backward()
    grads = [x.grad, *(p.grad for p in block.parameters())]
    return Counter(ops.counts), matmuls.ops, grads


def test_recompute_attention_core_recomputes_the_core_of_eager_attention() -> None:
    plain_ops, plain_matmuls, plain_grads = _eager_backward(None)
    ops, matmuls, grads = _eager_backward(policies.recompute_attention_core)
    assert_equal(plain_grads, grads, "grads")
    # Backward replays the scores (q @ k^T), the softmax and the dropout mask: the tensors
    # quadratic in the sequence. Not q, k, v (their projections are kept), not probs @ v.
    assert matmuls - plain_matmuls == Counter({SCORES: 1})
    replayed = ops - plain_ops
    assert replayed["_softmax"] == replayed["bernoulli_"] == replayed["bmm"] == 1
    assert replayed["addmm"] == 0 and not plain_ops - ops
    # What the forward pass holds: the quadratic tensors are gone, the projections stay.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = EagerAttention()
    x = _leaf(_B, _T, _D)
    mask = torch.triu(torch.full((_T, _T), float("-inf")), 1)
    report = remat.explain(
        lambda x: remat.checkpoint(block, x, mask, policy=policies.recompute_attention_core), x
    )
    rows = [r for r in report.rows if r.kind == "activation"]
    quadratic = {(r.op, r.decision) for r in rows if r.shape[-2:] == (_T, _T)}
    assert quadratic == {("_softmax", "recompute"), ("div_", "recompute"), ("mul", "recompute")}
    heads = {
        (r.shape, r.decision)
        for r in rows
        if len(r.shape) == 3 and r.shape[0] == _B * _H and r.shape[1:] != (_T, _T)
    }
    assert heads == {((4, 12, 10), "keep"), ((4, 10, 12), "keep")}  # q, k^T and v


def test_a_softmax_that_feeds_no_matmul_is_not_attention() -> None:
    def router(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(x, w).softmax(dim=-1)  # a softmax after a matmul, then no matmul
        return (scores * x[..., :4]).sum()

    x, w = _leaf(3, 8), _leaf(8, 4)
    ops = run_both(router, x, w, policy=policies.recompute_attention_core)
    assert ops["_softmax"] == 0 and ops["mm"] == 2  # nothing replayed: only x's and w's grads


# ---------------------------------------------------------------------------------------------
# D. Random ops and threads (NOTE [ Random ops under a policy ], remat.checkpoint's docstring)
# ---------------------------------------------------------------------------------------------


def _two_dropouts(generator: torch.Generator | None) -> Any:
    """Two dropouts; between them, in forward only, another thread draws 8 numbers from
    ``generator`` (the default CPU generator when ``None``)."""

    def draw() -> None:
        torch.rand(8, generator=generator)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x * 2, 0.5)
        if not remat.is_recomputing():
            other = threading.Thread(target=draw)
            other.start()
            other.join()
        return F.dropout(h.sin(), 0.5).sum()

    return f


@pytest.mark.parametrize(
    "policy", [None, policies.recompute_everything], ids=["region engine", "graph engine"]
)
def test_a_thread_with_its_own_generator_leaves_the_replay_exact(policy: Any) -> None:
    def grads(generator: torch.Generator | None, checkpointed: bool) -> torch.Tensor:
        x = torch.randn(64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        f = _two_dropouts(generator)
        torch.manual_seed(0)
        (remat.checkpoint(f, x, policy=policy) if checkpointed else f(x)).backward()
        assert x.grad is not None
        return x.grad

    # The documented remedy: the other thread draws from a generator of its own.
    own = torch.Generator().manual_seed(5)
    plain = grads(own, checkpointed=False)
    own.manual_seed(5)
    assert torch.equal(plain, grads(own, checkpointed=True))
    # The race it avoids: a draw from the shared default generator between the two dropouts
    # shifts the second mask in forward, not in the replay.
    assert not torch.equal(grads(None, checkpointed=False), grads(None, checkpointed=True))


def test_host_offload_of_cpu_activations_warns_and_a_few_bytes_do_not() -> None:
    """On the CPU the host tier keeps what a policy sends it where it is: for activations the
    policy then saves nothing, and says so; for the few bytes a CUDA model keeps on the CPU
    (attention's random seed and offset) it does not."""

    def block(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).cos().sum()

    host = policies.offload_everything("host")
    small = torch.randn(8, requires_grad=True)  # 32 bytes a tensor
    remat.checkpoint(block, small, policy=host).backward()
    large = torch.randn(4096, requires_grad=True)
    with pytest.warns(UserWarning, match=r"offloads saved tensors to the host tier, but they are"):
        remat.checkpoint(block, large, policy=host).backward()
    expected = torch.randn(4096).requires_grad_()
    with torch.no_grad():
        expected.copy_(large)
    block(expected).backward()
    assert torch.equal(large.grad, expected.grad)
