"""The store and the host tier: offloaded tensors come back exact, in time, once per storage.

There is no accelerator here, so the host tier runs with ``include_cpu=True``: CPU tensors go
through the same pool, lanes (a worker thread instead of a side stream) and bookkeeping as
accelerator tensors would.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import remat
from remat.policies import Decision, OpContext
from remat.store import HostTier, Store
from remat.store._lanes import ThreadLane
from remat.store._tier import Ticket
from remat.workloads import WORKLOAD_NAMES, get_workload

from helpers import assert_records_equal, offloaded, train, wait_for

aten = torch.ops.aten


@pytest.fixture
def host() -> Iterator[HostTier]:
    tier = HostTier(include_cpu=True)
    with remat.store.tiers(host=tier):
        yield tier
    tier.close()


def _batches(name: str, steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    workload = get_workload(name, "small")
    return [workload.batch(seed=s) for s in range(steps)]


class Recording:
    """A tier that keeps bytes in a dict and logs every call, for golden call orders."""

    name = "recording"

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.data: dict[int, torch.Tensor] = {}
        self.next = 0

    def put(self, data: torch.Tensor) -> Ticket:
        self.next += 1
        self.data[self.next] = data.clone()
        self.log.append(("put", self.next))
        return self.next

    def prefetch(self, ticket: Any, device: torch.device) -> None:
        self.log.append(("prefetch", ticket))

    def get(self, ticket: Any, device: torch.device) -> torch.Tensor:
        self.log.append(("get", ticket))
        return self.data[ticket].clone()

    def drop(self, ticket: Any) -> None:
        self.log.append(("drop", ticket))
        del self.data[ticket]

    def flush(self) -> None:
        self.log.append(("flush", 0))

    def close(self) -> None:
        self.data.clear()


# ---------------------------------------------------------------------------------------------
# Exact: everything offloaded, per engine
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_everything_offloaded_to_host_is_bit_exact(name: str, host: HostTier) -> None:
    workload = get_workload(name, "small")
    plain = workload.model(seed=0)
    twin = offloaded(copy.deepcopy(plain), "host", min_bytes=0)
    batches = _batches(name)
    assert_records_equal(
        train(plain, batches, workload.loss_fn), train(twin, batches, workload.loss_fn)
    )
    assert host.stats.copies_out > 10 and host.stats.copies_in >= host.stats.copies_out


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_graph_engine_offloading_every_output_is_bit_exact(name: str, host: HostTier) -> None:
    workload = get_workload(name, "small")
    plain = workload.model(seed=0)
    policy = remat.policies.offload_everything("host")
    wrapped = remat.apply(copy.deepcopy(plain), workload.block_types, policy=policy)
    batches = _batches(name)
    assert_records_equal(
        train(plain, batches, workload.loss_fn), train(wrapped, batches, workload.loss_fn)
    )
    assert host.stats.copies_out > 10


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_region_engine_inputs_offloaded_is_bit_exact(name: str, host: HostTier) -> None:
    workload = get_workload(name, "small")
    plain = workload.model(seed=0)
    wrapped = remat.apply(copy.deepcopy(plain), workload.block_types, offload_to_cpu=True)
    batches = _batches(name)
    before = host.stats.copies_out
    assert_records_equal(
        train(plain, batches, workload.loss_fn), train(wrapped, batches, workload.loss_fn)
    )
    # Each block's input went out once per step (the first block's input is a leaf only when
    # the model starts with a block).
    blocks = sum(isinstance(m, workload.block_types) for m in plain.modules())
    assert host.stats.copies_out - before >= 2 * (blocks - 1)


def test_region_engine_inside_an_offload_block_offloads_region_inputs(host: HostTier) -> None:
    workload = get_workload("gpt", "small")
    plain = workload.model(seed=0)
    wrapped = offloaded(remat.apply(copy.deepcopy(plain), workload.block_types), "host")
    batches = _batches("gpt")
    assert_records_equal(
        train(plain, batches, workload.loss_fn), train(wrapped, batches, workload.loss_fn)
    )
    assert host.stats.copies_out > 0


def test_one_policy_keeps_offloads_and_recomputes(host: HostTier) -> None:
    def three_ways(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if op in remat.policies.MATMULS:
            return Decision.PREFER_SAVE
        if op is aten.gelu.default:
            return Decision.PREFER_OFFLOAD_HOST
        return Decision.PREFER_RECOMPUTE

    workload = get_workload("gpt", "small")
    plain = workload.model(seed=0)
    wrapped = remat.apply(copy.deepcopy(plain), workload.block_types, policy=three_ways)
    batches = _batches("gpt")
    assert_records_equal(
        train(plain, batches, workload.loss_fn), train(wrapped, batches, workload.loss_fn)
    )
    # On 2-d inputs each op saves another's output directly (no reshapes between them).
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh())
    remat.checkpoint_wrapper(mlp, policy=three_ways)
    report = remat.explain(mlp, torch.randn(4, 8))
    rows = [(r.op, r.decision) for r in report.rows if r.kind == "activation"]
    # The second linear layer's result is held too: tanh's output is rebuilt from it.
    assert rows == [
        ("addmm", "keep"),
        ("gelu", "offload"),
        ("tanh", "recompute"),
        ("addmm", "keep"),
    ]


def test_torch_cpu_offload_policy_works_unchanged(host: HostTier) -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    def torch_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is aten.mm.default:
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        return CheckpointPolicy.PREFER_RECOMPUTE

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x @ w).tanh() @ w

    expected = torch.autograd.grad(f(x).sum(), (x, w))
    before = host.stats.copies_out
    actual = torch.autograd.grad(remat.checkpoint(f, x, policy=torch_policy).sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))
    # The first mm's output goes out (tanh's output is rebuilt from it); the second's is
    # needed by nothing in backward, so it is never copied.
    assert host.stats.copies_out - before == 1


# ---------------------------------------------------------------------------------------------
# Autograd semantics
# ---------------------------------------------------------------------------------------------


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Sigmoid()), (
        torch.randn(8, 16, requires_grad=True)
    )


def test_retain_graph_twice_and_autograd_grad(host: HostTier) -> None:
    model, x = _mlp()
    loss = model(x).pow(2).sum()
    expected = torch.autograd.grad(loss, [x, *model.parameters()])
    with remat.offload("host", min_bytes=0):
        loss = model(x).pow(2).sum()
    first = torch.autograd.grad(loss, [x, *model.parameters()], retain_graph=True)
    second = torch.autograd.grad(loss, [x, *model.parameters()])
    for a, b, c in zip(expected, first, second, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_double_backward(host: HostTier) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * x.exp()).sum()

    x = torch.randn(32, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    (expected,) = torch.autograd.grad(g.sum(), x)
    with remat.offload("host", min_bytes=0):
        y = f(x)
        (g,) = torch.autograd.grad(y, x, create_graph=True)
    (actual,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(expected, actual)


def test_no_grad_saves_nothing(host: HostTier) -> None:
    model, x = _mlp()
    with torch.no_grad(), remat.offload("host", min_bytes=0):
        model(x)
    assert host.stats.copies_out == 0


def test_empty_tensors_stay_where_they_are(host: HostTier) -> None:
    """With ``min_bytes=0`` an empty saved tensor (cuDNN's BatchNorm saves an empty reserve) is
    not moved: it has no bytes, and a copy would cost a stream operation and a buffer. The
    tensors with bytes go, and the gradients are the plain ones."""
    x = torch.randn(4, 8, requires_grad=True)

    def body(t: torch.Tensor) -> torch.Tensor:
        h = t * 2
        empty = h[:0].clone()  # its own storage, of no bytes
        return (empty * empty).sum() + h.sin().sum()  # mul saves the empty tensor, sin h

    plain = torch.autograd.grad(body(x), x)[0]
    with remat.offload("host", min_bytes=0):
        out = body(x)
    assert host.stats.copies_out == 1  # h only
    assert torch.equal(torch.autograd.grad(out, x)[0], plain)


def test_prefetch_is_the_blocks_own() -> None:
    """``remat.offload(prefetch=0)`` reads nothing ahead for what its block stored, and a
    later block on the same tier, with no ``prefetch``, reads ahead as the store does (2): the
    first block's setting once stayed on the tier's store for every block after it."""
    tier = Recording()
    x = torch.randn(64, requires_grad=True)
    store = remat.store.scope.store_for(tier)  # the one store, held across both blocks
    for prefetch in (0, None):
        with remat.offload(tier, min_bytes=0, prefetch=prefetch):
            y = x
            for _ in range(3):
                y = y.exp()
        tier.log.clear()
        y.sum().backward()
        fetched = [op for op, _ in tier.log if op == "prefetch"]
        assert len(fetched) == (0 if prefetch == 0 else 3)  # 2 ahead of the last, 1 of the next
    assert store.prefetch == 2


def test_a_tier_made_for_a_step_is_collected_and_closed(tmp_path: Any) -> None:
    """The store of a tier is held while something it stored is: a ``DiskTier`` made for one
    step goes with the step, and its directory with it, closed on the closer thread (every one
    stayed open before)."""
    model, x = _mlp()
    refs = []
    for _ in range(3):
        tier = remat.store.DiskTier(tmp_path)
        refs.append(weakref.ref(tier))
        with remat.store.tiers(disk=tier), remat.offload("disk", min_bytes=0):
            loss = model(x).sum()
        loss.backward()
        del tier, loss
    assert [r() for r in refs] == [None, None, None]  # no gc.collect(): no cycles either
    wait_for(lambda: not any(tmp_path.iterdir()))  # the per-user parent goes too


def test_views_of_one_storage_are_stored_once_and_come_back_as_views() -> None:
    seen: list[tuple[int, int]] = []

    class TwoViews(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            base = a * 2
            ctx.save_for_backward(base[1:], base.t())
            return base.sum()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            rows, transposed = ctx.saved_tensors
            seen.append(
                (rows.untyped_storage().data_ptr(), transposed.untyped_storage().data_ptr())
            )
            assert torch.equal(rows, transposed.t()[1:])
            return grad * 2 * torch.ones_like(transposed.t())

    tier = Recording()
    a = torch.randn(4, 4, requires_grad=True)
    with remat.offload(tier, min_bytes=0):
        out = TwoViews.apply(a)
    assert [op for op, _ in tier.log] == ["put", "flush"]
    out.backward()
    assert len(seen) == 1 and seen[0][0] == seen[0][1]
    assert [op for op, _ in tier.log] == ["put", "flush", "get", "drop"]
    assert torch.equal(a.grad, torch.full((4, 4), 2.0))


def test_backward_fetches_in_reverse_order_of_saving_and_prefetches_ahead() -> None:
    tier = Recording()
    x = torch.randn(64, requires_grad=True)
    with remat.offload(tier, min_bytes=0, prefetch=2):
        y = x
        for _ in range(4):
            y = y.exp()  # exp saves its output: four storages, saved in order 1..4
    puts = [t for op, t in tier.log if op == "put"]
    assert puts == [1, 2, 3, 4]
    tier.log.clear()
    y.sum().backward()
    assert tier.log == [
        ("get", 4),
        ("prefetch", 3),
        ("prefetch", 2),
        ("drop", 4),
        ("get", 3),
        ("prefetch", 2),
        ("prefetch", 1),
        ("drop", 3),
        ("get", 2),
        ("prefetch", 1),
        ("drop", 2),
        ("get", 1),
        ("drop", 1),
    ]


def test_modified_in_place_after_saving_raises(host: HostTier) -> None:
    x = torch.randn(8, requires_grad=True)
    with remat.offload("host", min_bytes=0):
        y = x.exp()
    y.add_(1)
    with pytest.raises(remat.RematError, match=r"modified in place after it was saved"):
        y.sum().backward()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_saved_tensor_written_in_place_then_dropped_still_raises(
    host: HostTier, tier: str
) -> None:
    """The user's last reference goes before backward: the write is still seen (the store
    holds a witness of the tensor's version counter, not the tensor), and the witness keeps
    none of the tensor's memory. Before, backward read what the tier had written, racing the
    write: other gradients from run to run."""
    a = torch.randn(64, 64, requires_grad=True)
    with remat.offload(tier, min_bytes=0):
        t = a.sigmoid()  # saves its output
    storage = weakref.ref(t.untyped_storage())
    t[0].mul_(2)  # through a view: the version counter is shared
    loss = t.sum()
    del t
    gc.collect()
    if tier == "disk":  # written at the block's end (the host tier lets go of it lazily)
        assert storage() is None  # nothing held the tensor's memory
    with pytest.raises(remat.RematError, match=r"modified in place after it was saved: its ver"):
        loss.backward()


@pytest.mark.parametrize("what", ["parameter", "buffer", "small"])
def test_a_tensor_the_scope_keeps_written_in_place_before_backward_raises(
    host: HostTier, what: str
) -> None:
    """What an offload scope does not move (a parameter, a module's buffer, a tensor under
    min_bytes) is kept in place; saved-tensor hooks switch autograd's in-place check off for
    it too, and backward read the written value silently (a gradient of the cosine of the
    written tensor). Plain autograd raises; so does the scope now. Unwritten, the step is
    bit-equal to plain."""
    torch.manual_seed(0)
    linear, norm = nn.Linear(8, 8), nn.BatchNorm1d(8).eval()
    x = torch.randn(4, 8, requires_grad=True)

    def step(scoped: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with remat.offload("host", min_bytes=1024) if scoped else contextlib.nullcontext():
            h = x * 2  # 128 bytes: kept
            loss = (norm(linear(x)) + h.sin()).square().sum()
        written = {"parameter": linear.weight, "buffer": norm.running_var, "small": h}[what]
        return loss, written

    plain = torch.autograd.grad(step(False)[0], [x, linear.weight])
    assert all(map(torch.equal, plain, torch.autograd.grad(step(True)[0], [x, linear.weight])))
    for scoped, error in ((False, RuntimeError), (True, remat.RematError)):
        loss, written = step(scoped)
        with torch.no_grad():
            written.mul_(2)
        with pytest.raises(error, match="modified"):
            loss.backward()
        with torch.no_grad():
            written.div_(2)


def test_graph_engine_offloaded_output_then_written_in_place_is_exact(host: HostTier) -> None:
    w = torch.randn(8, 8, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x @ w  # offloaded
        a = h.exp()  # recomputed in backward from h as it is here...
        h.relu_()  # ... before this write
        return a * h

    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(f(x).sum(), (x, w))
    policy = remat.policies.offload_matmuls("host")
    actual = torch.autograd.grad(remat.checkpoint(f, x, policy=policy).sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))


# ---------------------------------------------------------------------------------------------
# Lifetimes
# ---------------------------------------------------------------------------------------------


def test_stored_bytes_freed_after_backward_and_when_backward_never_happens(
    host: HostTier,
) -> None:
    store = remat.store.scope.store_for(host)
    model, x = _mlp()
    with remat.offload(host, min_bytes=0):
        loss = model(x).sum()
    assert store.stored_bytes > 0
    loss.backward()
    assert store.stored_bytes == 0
    with remat.offload(host, min_bytes=0):
        loss = model(x).sum()
    assert store.stored_bytes > 0
    del loss
    assert store.stored_bytes == 0  # no gc.collect(): no reference cycles

    # Buffers went back to the pool: a dropped buffer whose copy out is still running on the
    # lane's thread waits in the retiring list until a later call of the tier sweeps it.
    def returned() -> bool:
        host.flush()  # sweeps the retiring list
        return host.pool.cached_bytes > 0

    wait_for(returned)


def test_pool_buffers_are_reused_from_step_to_step(host: HostTier) -> None:
    model, x = _mlp()
    for _ in range(3):
        with remat.offload(host, min_bytes=0):
            loss = model(x).sum()
        loss.backward()
        if _ == 0:
            after_first = host.pool.allocated
    assert host.pool.allocated == after_first


def test_a_model_and_its_offloaded_activations_are_freed_without_gc(host: HostTier) -> None:
    model, x = _mlp()
    with remat.offload(host, min_bytes=0):
        loss = model(x).sum()
    store = remat.store.scope.store_for(host)
    assert store.stored_bytes > 0
    ref = weakref.ref(model)
    del model, loss
    assert ref() is None and store.stored_bytes == 0


# ---------------------------------------------------------------------------------------------
# The lanes: ordering, bounds, early reuse (the stream logic, on a thread)
# ---------------------------------------------------------------------------------------------


class GatedLane(ThreadLane):
    """A thread lane whose copies wait until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self._jobs.put((self.gate.wait, Future()))  # the copy runs after the gate opens
        return super().copy(dst, src)


@contextmanager
def gated(tier: HostTier) -> Iterator[GatedLane]:
    lane = GatedLane()
    tier._lanes[torch.device("cpu")] = lane
    try:
        yield lane
    finally:
        lane.gate.set()


def _flat(n: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((n,), value).view(torch.uint8)


def test_copies_in_flight_are_bounded() -> None:
    tier = HostTier(include_cpu=True, max_in_flight=2)
    with gated(tier) as lane:
        tickets = [tier.put(_flat(256, i)) for i in range(2)]
        assert tier.stats.waits_for_bound == 0
        opener = threading.Timer(0.05, lane.gate.set)
        opener.start()
        tickets.append(tier.put(_flat(256, 2)))  # waits for the oldest copy
        opener.join()
    assert tier.stats.waits_for_bound == 1
    assert tier.stats.max_in_flight_seen == 2
    cpu = torch.device("cpu")
    for i, ticket in enumerate(tickets):
        assert torch.equal(tier.get(ticket, cpu), _flat(256, i))
    tier.close()


def test_a_source_is_held_until_its_copy_has_run() -> None:
    """The CPU face of pytorch/pytorch#106360: the memory a pending copy reads stays
    allocated, whoever drops the tensor, until the copy has run."""
    tier = HostTier(include_cpu=True)
    with gated(tier) as lane:
        source = torch.arange(1024, dtype=torch.float32)
        storage = weakref.ref(source.untyped_storage())
        ticket = tier.put(source.view(torch.uint8))
        del source
        gc.collect()
        assert storage() is not None  # the copy has not run: the bytes must stay
        lane.gate.set()
        tier.flush()
        back = tier.get(ticket, torch.device("cpu"))
    assert storage() is None  # the copy ran and the source went
    assert torch.equal(back.view(torch.float32), torch.arange(1024, dtype=torch.float32))
    tier.close()


def test_a_buffer_is_reused_only_after_its_copies_have_run() -> None:
    tier = HostTier(include_cpu=True)
    cpu = torch.device("cpu")
    ticket = tier.put(_flat(64, 1.0))
    tier.get(ticket, cpu)
    with gated(tier) as lane:
        tier.prefetch(ticket, cpu)  # a copy back, pending behind the gate
        tier.drop(ticket)
        assert tier.pool.cached_bytes == 0  # not yet free: a copy still reads it
        lane.gate.set()

        def given_back() -> bool:
            tier.flush()
            return tier.pool.cached_bytes > 0

        wait_for(given_back, timeout=30)
    assert tier.pool.cached_bytes == 256
    tier.close()


def test_loads_follow_stores_on_the_lane() -> None:
    tier = HostTier(include_cpu=True)
    cpu = torch.device("cpu")
    with gated(tier) as lane:
        ticket = tier.put(_flat(1 << 16, 7.0))
        tier.prefetch(ticket, cpu)  # queued behind the copy out
        lane.gate.set()
        assert torch.equal(tier.get(ticket, cpu), _flat(1 << 16, 7.0))
    tier.close()


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: remat.offload("hots"), r"unknown tier 'hots'.*did you mean 'host'"),
        (lambda: remat.offload("host", min_bytes=-1), r"expected min_bytes to be an int >= 0"),
        (lambda: remat.offload("host", min_bytes=1.5), r"min_bytes .* found 1\.5\. Pass e\.g\."),
        (lambda: remat.offload("host", prefetch=-2), r"expected prefetch to be an int >= 0"),
        (lambda: remat.offload("host", prefetch=True), r"prefetch .* found True"),
        (lambda: remat.offload(object()), r"expected tier to be 'host', 'disk' or a tier object"),  # type: ignore[arg-type]
        (lambda: remat.store.tiers(host=3), r"expected host= to be a tier .* found int 3"),  # type: ignore[arg-type]
        (lambda: HostTier(max_in_flight=0), r"HostTier expected max_in_flight to be an int >= 1"),
        (lambda: HostTier(max_in_flight=True), r"max_in_flight .* found True"),
        (lambda: HostTier(include_cpu=1), r"HostTier expected include_cpu to be True or False"),  # type: ignore[arg-type]
        (lambda: HostTier(max_cached_bytes=-1), r"HostTier expected max_cached_bytes to be an"),
        (lambda: Store(Recording(), prefetch=-1), r"expected prefetch to be an int >= 0"),  # type: ignore[arg-type]
        (lambda: Store("disk"), r"Store expected tier to be a tier .* lacks put, prefetch"),  # type: ignore[arg-type]
        # The class, not a tier: its methods are there, unbound (it failed at the first put).
        (lambda: remat.offload(remat.store.DiskTier), r"found type <class 'remat\.store\.disk"),  # type: ignore[arg-type]
        (lambda: Store(remat.store.DiskTier), r"found the class DiskTier; make one: DiskTier\(\)"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_raises_when_given(call: Callable[[], Any], message: str) -> None:
    # Raised by the call itself, not when a block is entered or the value first used.
    with pytest.raises(remat.RematError, match=f"^remat: .*{message}") as info:
        call()
    assert "\n" not in str(info.value)


def test_an_offload_policy_refuses_an_unknown_tier() -> None:
    with pytest.raises(remat.RematError, match=r"tier must be 'host' or 'disk'"):
        remat.policies.offload_everything("ssd")


def test_host_tier_refuses_cpu_tensors_unless_asked() -> None:
    tier = HostTier()
    with pytest.raises(remat.RematError, match=r"in host memory already.*tier='disk'"):
        tier.put(_flat(8))
    tier.close()


def test_must_recompute_on_a_data_dependent_op_names_offload_as_a_way_out() -> None:
    def policy(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return Decision.MUST_RECOMPUTE

    x = torch.randn(8, requires_grad=True)
    with pytest.raises(remat.RematError, match=r"MUST_SAVE or an OFFLOAD decision"):
        remat.checkpoint(lambda t: t[t.nonzero()].sum(), x, policy=policy)


def test_an_offload_decision_on_a_data_dependent_op_is_honoured(host: HostTier) -> None:
    def policy(ctx: OpContext, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return Decision.PREFER_OFFLOAD_HOST if op is aten.sort.default else Decision.MUST_SAVE

    x = torch.randn(8, requires_grad=True)
    expected = torch.autograd.grad(x.sort().values.exp().sum(), x)
    before = host.stats.copies_out
    actual = torch.autograd.grad(
        remat.checkpoint(lambda t: t.sort().values.exp().sum(), x, policy=policy), x
    )
    assert torch.equal(expected[0], actual[0])
    assert host.stats.copies_out - before >= 1


# ---------------------------------------------------------------------------------------------
# The disk tier behind the store
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def disk(tmp_path: Any) -> Iterator[remat.store.DiskTier]:
    tier = remat.store.DiskTier(tmp_path)
    with remat.store.tiers(disk=tier):
        yield tier
    tier.close()


def _files_in(tier: remat.store.DiskTier) -> list[str]:
    return sorted(p.name for p in tier.directory.iterdir())


@pytest.mark.parametrize("engine", ["none", "region", "graph"])
@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_everything_offloaded_to_disk_is_bit_exact(
    name: str, engine: str, disk: remat.store.DiskTier
) -> None:
    workload = get_workload(name, "small")
    plain = workload.model(seed=0)
    twin = copy.deepcopy(plain)
    if engine == "region":
        remat.apply(twin, workload.block_types)
    elif engine == "graph":
        remat.apply(twin, workload.block_types, policy=remat.policies.offload_everything("disk"))
    twin = offloaded(twin, "disk", min_bytes=0)
    batches = _batches(name)
    assert_records_equal(
        train(plain, batches, workload.loss_fn), train(twin, batches, workload.loss_fn)
    )
    assert disk.stats.files_written > 0 and disk.stats.files_read >= disk.stats.files_written
    assert _files_in(disk) == []  # every file removed once backward let go of it


def test_no_files_left_after_an_exception_in_the_step(disk: remat.store.DiskTier) -> None:
    model, x = _mlp()

    def failing_step() -> None:
        with remat.offload("disk", min_bytes=0):
            h = model[0](x).tanh()
            assert _files_in(disk) or disk.stats.files_written == 0
            raise ValueError(f"bad batch {h.shape}")

    with pytest.raises(ValueError, match="bad batch"):
        failing_step()
    disk.flush()
    assert _files_in(disk) == []


def test_a_full_disk_raises_in_forward_and_leaves_the_training_state_as_it_was(
    disk: remat.store.DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from remat.store import _files

    workload = get_workload("gpt", "small")
    model = workload.model(seed=0)
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    (x0, y0), (x1, y1) = _batches("gpt")

    def step(m: nn.Module, o: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        o.zero_grad()
        torch.manual_seed(7)
        with remat.offload("disk", min_bytes=0) if m is model else torch.enable_grad():
            loss = workload.loss_fn(m(x), y)
        loss.backward()
        o.step()

    step(model, opt, x0, y0)  # one good step: state to protect
    step(plain, plain_opt, x0, y0)

    def snapshot() -> list[torch.Tensor]:
        state = [t.clone() for t in model.state_dict().values()]
        state += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        state += [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        return state

    before = snapshot()
    write_all = _files.write_all

    def full(fd: int, data: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_files, "write_all", full)
    full_disk = pytest.raises(remat.RematError, match=r"(?s)No space left.*directory=")
    with full_disk, remat.offload("disk", min_bytes=0):
        workload.loss_fn(model(x1), y1)
    after = snapshot()
    assert len(before) == len(after)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # With room again, the same step gives what a plain step gives.
    monkeypatch.setattr(_files, "write_all", write_all)
    step(model, opt, x1, y1)
    step(plain, plain_opt, x1, y1)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _files_in(disk) == []


# ---------------------------------------------------------------------------------------------
# Built-in offload policies
# ---------------------------------------------------------------------------------------------


def test_offload_larger_than_moves_only_the_large_outputs(host: HostTier) -> None:
    w_big = torch.randn(16, 256, requires_grad=True)  # x @ w_big: 64 x 256 floats, 64 KiB
    w_small = torch.randn(256, 2, requires_grad=True)  # h @ w_small: 64 x 2 floats, 512 B

    def f(x: torch.Tensor) -> torch.Tensor:
        h = (x @ w_big).sin()  # sin saves its 64 KiB input
        return (h @ w_small).exp().sum()  # exp saves its 512 B output

    x = torch.randn(64, 16, requires_grad=True)
    expected = torch.autograd.grad(f(x), (x, w_big, w_small))
    policy = remat.policies.offload_larger_than(4096, "host")
    before = host.stats.bytes_out
    actual = torch.autograd.grad(remat.checkpoint(f, x, policy=policy), (x, w_big, w_small))
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))
    # The mm output (64 KiB) and the sin output (64 KiB, saved by the second mm) went out; the
    # 512-byte results stayed.
    assert host.stats.bytes_out - before == 2 * 64 * 256 * 4


def test_combinators_carry_offload_decisions() -> None:
    D = Decision
    aten_mm, aten_sin = aten.mm.default, aten.sin.default
    ctx = OpContext()
    offload_mm = remat.policies.offload_matmuls("disk")
    assert offload_mm(ctx, aten_mm) is D.PREFER_OFFLOAD_DISK
    assert offload_mm(ctx, aten_sin) is D.PREFER_RECOMPUTE
    assert remat.policies.must(offload_mm)(ctx, aten_mm) is D.MUST_OFFLOAD_DISK
    keep_sin = remat.policies.save_tagged("never")
    both = remat.policies.save_if_any(keep_sin, offload_mm)
    assert both(ctx, aten_mm) is D.PREFER_OFFLOAD_DISK  # nobody keeps it: offloaded
    assert both(ctx, aten_sin) is D.PREFER_RECOMPUTE
    keep_all = remat.policies.save_if_any(remat.policies.save_everything, offload_mm)
    assert keep_all(ctx, aten_mm) is D.PREFER_SAVE  # kept beats offloaded


# ---------------------------------------------------------------------------------------------
# A full disk, then a retry
# ---------------------------------------------------------------------------------------------


@contextmanager
def _no_gc() -> Iterator[None]:
    """Collection off: what is freed here is freed by reference counting, as in a user's loop
    where a cycle may wait for the collector for a long time."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _failing_step(model: nn.Module, x: torch.Tensor, seen: list[Any]) -> torch.Tensor:
    with remat.offload("disk", min_bytes=0):
        h = model[0](x).tanh()
        seen.append(weakref.ref(h))  # an activation the tier stores
        return model[2](h).sigmoid().pow(2).sum()


def test_a_failed_step_leaves_no_file_and_the_next_step_succeeds(
    disk: remat.store.DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from remat.store import _files

    model, x = _mlp()
    plain = copy.deepcopy(model)
    write_all = _files.write_all
    fail = threading.Event()

    def full_once(fd: int, view: Any) -> None:
        if fail.is_set():  # the second file of the step: the first one is written
            raise OSError(errno.ENOSPC, "No space left on device")
        fail.set()
        write_all(fd, view)

    monkeypatch.setattr(_files, "write_all", full_once)
    seen: list[Any] = []
    with _no_gc():
        with pytest.raises(remat.RematError, match="ENOSPC"):
            _failing_step(model, x, seen)
        assert seen[0]() is None  # nothing holds the failed step's tensors
        assert _files_in(disk) == []  # the file written before the failure is gone too
        monkeypatch.setattr(_files, "write_all", write_all)
        loss = _failing_step(model, x, seen)
        loss.backward()
    plain[2](plain[0](x).tanh()).sigmoid().pow(2).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert _files_in(disk) == []
    assert disk.stats.failed_writes == 1


def test_views_of_parameters_stay_in_place_and_only_activations_are_written(
    disk: remat.store.DiskTier,
) -> None:
    # nn.Linear saves its input and weight.t(); the view of the weight lives as long as the
    # weight does, so writing it out frees nothing. What goes to disk is the two activations
    # the step makes: tanh's output (8 x 32 floats, also linear 2's input) and sigmoid's
    # output (8 x 16 floats, also pow's input).
    model, x = _mlp()
    plain = copy.deepcopy(model)
    with remat.offload("disk", min_bytes=0):
        loss = model(x).pow(2).sum()
    loss.backward()
    assert disk.stats.bytes_written == (8 * 32 + 8 * 16) * 4
    assert disk.stats.files_written == 2
    plain(x).pow(2).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("how", ["offload_everything", "save_everything in remat.offload"])
def test_a_graph_region_writes_no_view_of_a_parameter(disk: remat.store.DiskTier, how: str) -> None:
    """As above, through a graph-engine region: a policy that offloads every op (or a region
    that keeps every op inside a ``remat.offload`` block) writes the two activations, not the
    weights' ``t()`` views (it wrote them on every step before)."""
    model, x = _mlp()
    plain = copy.deepcopy(model)
    if how == "offload_everything":
        with remat.region(policy=remat.policies.offload_everything("disk")):
            out = model(x)
    else:
        with (
            remat.offload("disk", min_bytes=0),
            remat.region(policy=remat.policies.save_everything),
        ):
            out = model(x)
    out.pow(2).sum().backward()
    assert disk.stats.bytes_written == (8 * 32 + 8 * 16) * 4
    assert disk.stats.files_written == 2
    plain(x).pow(2).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_buffers_stay_in_place_and_only_activations_are_written(
    disk: remat.store.DiskTier,
) -> None:
    # BatchNorm saves its running statistics, buffers that outlive the step; what goes to disk
    # is the linear output (8 x 32 floats), the batch's mean and inverse std (32 floats each),
    # tanh's output (8 x 32 floats) and the last linear's output, which pow saves (8 x 16).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 16))
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16, requires_grad=True)
    with remat.offload("disk", min_bytes=0):
        loss = model(x).pow(2).sum()
    loss.backward()
    assert disk.stats.bytes_written == (8 * 32 + 32 + 32 + 8 * 32 + 8 * 16) * 4
    assert disk.stats.files_written == 5
    plain(x).pow(2).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    for a, b in zip(model.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Lazy conjugate and negative views
# ---------------------------------------------------------------------------------------------


def _conj_view(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.exp() * (b * 2).conj()  # mul saves the lazy conjugate view (b * 2).conj()


def _neg_view(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.exp().real * (b * 2).conj().imag  # .imag of a conjugate view: the negative bit


@pytest.mark.parametrize("how", ["offload disk", "offload host", "graph policy disk"])
@pytest.mark.parametrize("fn", [_conj_view, _neg_view], ids=["conj", "neg"])
def test_views_with_the_conjugate_or_negative_bit_are_kept_and_exact(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    how: str,
    tmp_path: Any,
) -> None:
    # The tiers store a storage's bytes, which carry neither bit: offloaded, backward read
    # b * 2 for its conjugate (or negation) and the gradients were silently wrong. Such views
    # are kept as autograd keeps them (with filterwarnings=error, the "resized output"
    # warning of the version witness of such a view fails the test too).
    torch.manual_seed(0)
    a = torch.randn(8, 8, dtype=torch.complex64, requires_grad=True)
    b = torch.randn(8, 8, dtype=torch.complex64, requires_grad=True)
    expected = torch.autograd.grad((fn(a, b).abs() ** 2).sum(), (a, b))
    host, disk = HostTier(include_cpu=True), remat.store.DiskTier(tmp_path)
    with remat.store.tiers(host=host, disk=disk):
        if how == "graph policy disk":
            policy = remat.policies.offload_everything("disk")
            out = remat.checkpoint(fn, a, b, policy=policy)
        else:
            with remat.offload(how.split()[1], min_bytes=0):  # type: ignore[arg-type]
                out = fn(a, b)
        actual = torch.autograd.grad((out.abs() ** 2).sum(), (a, b))
    assert all(torch.equal(e, g) for e, g in zip(expected, actual, strict=True))
    assert host.stats.copies_out + disk.stats.files_written > 0  # a.exp() was offloaded
    host.close()
    disk.close()


def test_store_pack_refuses_a_conjugate_view() -> None:
    store = Store(Recording())
    view = (torch.randn(4, dtype=torch.complex64) * 2).conj()
    assert not store.takes(view) and not store.takes(view.imag)
    with pytest.raises(remat.RematError, match=r"conjugate bit.*Store\.takes"):
        store.pack(view)


# ---------------------------------------------------------------------------------------------
# Releases from finalizers never wait for a lock
# ---------------------------------------------------------------------------------------------


def _finishes(call: Callable[[], None], timeout: float = 10.0) -> bool:
    """Run ``call`` on a daemon thread; whether it finished in time (a hang fails the test,
    never the run)."""
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout)


class _FreeOnLookup(dict):  # type: ignore[type-arg]
    """The pool's free lists; looking one up frees a graph first, as the garbage collector
    does when it runs on an allocation made there."""

    def __init__(self, garbage: list[Any]) -> None:
        super().__init__()
        self.garbage = garbage

    def get(self, key: Any, default: Any = None) -> Any:
        self.garbage.clear()  # Saved.__del__ -> Store.release -> HostTier.drop -> pool.give
        return super().get(key, default)


def test_a_release_from_a_finalizer_inside_the_host_pools_lock_does_not_hang() -> None:
    tier = HostTier(include_cpu=True)
    store = Store(tier)
    garbage: list[Any] = [store.pack(torch.randn(64))]
    tier.settle(garbage[0].stored.ticket)  # its copy out is over: the drop gives the buffer back
    free = _FreeOnLookup(garbage)
    tier.pool._free = free
    assert _finishes(lambda: tier.settle(tier.put(torch.zeros(32, dtype=torch.uint8)))), "hang"
    assert not garbage and store.stored_bytes == 0
    assert sum(len(buffers) for buffers in free.values()) == 1  # the released buffer is back
    tier.close()


def test_a_release_inside_the_stores_section_waits_until_it_is_left() -> None:
    tier = Recording()
    store = Store(tier)
    first = store.pack(torch.randn(16))
    put = tier.put

    def put_and_collect(data: torch.Tensor) -> Ticket:
        nonlocal first
        del first  # as the collector would, inside pack's section
        assert ("drop", 1) not in tier.log  # queued: pack is half way
        return put(data)

    tier.put = put_and_collect  # type: ignore[method-assign]
    second = store.pack(torch.randn(16))
    assert ("drop", 1) in tier.log and len(store._order) == 1
    del second
    assert ("drop", 2) in tier.log and store.stored_bytes == 0


# ---------------------------------------------------------------------------------------------
# Failures belong to the thread whose block made the write
# ---------------------------------------------------------------------------------------------


def _block_fails_while(
    disk: remat.store.DiskTier, monkeypatch: pytest.MonkeyPatch, other_step: Callable[[], None]
) -> nn.Sequential:
    """Run a block on this thread whose tanh output (64 x 256) fails to write (ENOSPC), and,
    once the write has failed, ``other_step`` on another thread on the same tier; check that
    the block raises its failure at its end. Returns the block's model (no backward ran)."""
    import errno

    from remat.store import _files

    write_all = _files.write_all

    def full_for_one_block(fd: int, view: Any) -> None:
        if len(view) == 64 * 256 * 4:  # the tanh output of the first thread's block
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(fd, view)

    monkeypatch.setattr(_files, "write_all", full_for_one_block)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 1))
    x = torch.randn(64, 16)
    with pytest.raises(remat.RematError, match="ENOSPC"), remat.offload(disk, min_bytes=0):
        h = model[1](model[0](x))
        wait_for(lambda: disk.stats.failed_writes == 1)
        worker = threading.Thread(target=other_step)
        worker.start()
        worker.join()
        model[2](h).sum()
    return model


def test_a_failed_write_is_raised_by_its_own_block_never_by_another_threads(
    disk: remat.store.DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = threading.get_ident()
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    plain = copy.deepcopy(other)
    y = torch.randn(4, 8)
    results: list[Any] = []

    def other_step() -> None:  # another thread, same tier, while the first block runs
        assert threading.get_ident() != failing
        try:
            with remat.offload(disk, min_bytes=0):
                loss = other(y).sum()
            loss.backward()
            results.append("ok")
        except remat.RematError as error:
            results.append(error)

    model = _block_fails_while(disk, monkeypatch, other_step)
    assert results == ["ok"]
    plain(y).sum().backward()
    for a, b in zip(other.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad)
    assert all(p.grad is None for p in model.parameters())  # no backward of the failed step


def test_an_in_place_write_in_another_threads_region_leaves_a_failed_write_to_its_block(
    disk: remat.store.DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph-engine region that writes in place to a value it offloaded waits for that
    value's write first (``Store.settle``). That wait once flushed the whole disk tier, so a
    region on another thread raised the first thread's full disk, and the first thread's own
    block then ended without error and failed in backward instead. Now the region runs as a
    plain step does and the failure stays with the block that made it."""
    torch.manual_seed(1)
    w = torch.randn(24, 24, requires_grad=True)
    w_plain = w.detach().clone().requires_grad_()
    y = torch.randn(8, 24)

    def region(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = y @ w
        s = h.sin()  # saves h, offloaded by the policy (backward never reads it: plain
        h.mul_(2)  # autograd runs this too); in place on the offloaded value: settles first
        return h.sum() * s.detach().sum()

    results: list[Any] = []

    def other_step() -> None:  # another thread, same tier, while the first block runs
        try:
            policy = remat.policies.offload_everything("disk")
            with remat.store.tiers(disk=disk):  # chosen per thread
                loss = remat.checkpoint(region, w, y, policy=policy)
                loss.backward()
            results.append("ok")
        except remat.RematError as error:
            results.append(error)

    model = _block_fails_while(disk, monkeypatch, other_step)
    assert results == ["ok"]
    region(w_plain, y).backward()
    assert w.grad is not None and w_plain.grad is not None and torch.equal(w.grad, w_plain.grad)
    assert all(p.grad is None for p in model.parameters())  # no backward of the failed step


class _SaveTwo(torch.autograd.Function):
    """Saves both of its inputs; backward records whether they came back sharing memory."""

    aliased: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, big: torch.Tensor, small: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(big, small)
        return (big * big).sum() + (small * small).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        big, small = ctx.saved_tensors
        same = big.untyped_storage().data_ptr() == small.untyped_storage().data_ptr()
        _SaveTwo.aliased.append(same)
        return grad * 2 * big, grad * 2 * small


@pytest.mark.parametrize("saved", ["the whole and a small view", "a small view alone"])
def test_the_views_of_one_storage_are_moved_or_kept_together(
    disk: remat.store.DiskTier, saved: str
) -> None:
    """``min_bytes`` is a storage's size, not a view's: a 64-byte view of a 1 MiB activation
    holds the whole storage in memory, just as the whole does. Decided by the view's size, the
    small view was kept while the whole went to disk: the 1 MiB stayed in memory and was
    written out too, and backward got two tensors that no longer shared memory, where plain
    autograd's saved views share it. Now both go, the activation's memory is freed after
    forward, and the gradients are the plain ones."""
    w = torch.randn(1024, 256, requires_grad=True)

    def step(offloaded: bool) -> torch.Tensor:
        w.grad = None
        block = remat.offload(disk, min_bytes=1024) if offloaded else contextlib.nullcontext()
        with block:
            h = w * 2  # 1 MiB
            small = h[0, :16]  # 64 bytes of it
            if saved == "a small view alone":
                loss = (small * small).sum() + h.sum()
            else:
                loss = _SaveTwo.apply(h, small)
            storage = weakref.ref(h.untyped_storage())
            del h, small
        if offloaded:
            assert storage() is None  # in the tier only, not in memory as well
            assert disk.stats.bytes_written == 1024 * 256 * 4
        loss.backward()
        assert w.grad is not None
        return w.grad.clone()

    _SaveTwo.aliased.clear()
    plain = step(False)
    assert torch.equal(step(True), plain)
    assert _SaveTwo.aliased in ([], [True, True])  # shared memory, with and without remat


# ---------------------------------------------------------------------------------------------
# Reusable block objects
# ---------------------------------------------------------------------------------------------


def test_an_offload_object_and_a_tiers_object_are_reusable_and_nestable(tmp_path: Any) -> None:
    model, x = _mlp()
    plain = copy.deepcopy(model)
    tier = remat.store.DiskTier(tmp_path)
    off, using = remat.offload("disk", min_bytes=0), remat.store.tiers(disk=tier)
    for _ in range(3):  # entered every step, as torch.autocast objects are
        with using, off:
            with off:  # nested: a block of its own
                loss = model(x).pow(2).sum()
            loss = loss + model(x).sum()
        loss.backward()
        plain_loss = plain(x).pow(2).sum()
        (plain_loss + plain(x).sum()).backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
    assert tier.stats.files_written == 3 * 2 * 2 and _files_in(tier) == []
    assert remat.store.scope.tier_named("disk") is not tier  # every block was left
    tier.close()


# ---------------------------------------------------------------------------------------------
# What remat.offload moves: the input batch
# ---------------------------------------------------------------------------------------------


def test_an_input_without_grad_is_written_and_one_with_grad_is_not(
    disk: remat.store.DiskTier,
) -> None:
    # As documented: remat.offload cannot tell a user's input batch (a leaf without grad)
    # from a tensor the step makes without grad (BatchNorm's batch statistics, a mask), so
    # it writes both; a leaf that requires grad is left alone.
    torch.manual_seed(0)
    model = nn.Linear(64, 4)
    plain = copy.deepcopy(model)
    x = torch.randn(32, 64)
    with remat.offload("disk", min_bytes=0):
        loss = model(x).sum()
    assert disk.stats.bytes_written == x.numel() * 4  # linear saves only its input
    loss.backward()
    plain(x).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad)
    before = disk.stats.bytes_written
    with remat.offload("disk", min_bytes=0):
        loss = model(x.requires_grad_()).sum()
    loss.backward()
    assert disk.stats.bytes_written == before
