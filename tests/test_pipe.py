"""remat.pipe.Pipe in one process: transparency, schedule, checkpoint flags, bad input.

Reference for bit-exact comparisons (unless a test says otherwise): the plain
``nn.Sequential`` (a deep copy of the same initial model) applied to the same micro-batches,
``torch.tensor_split(x, chunks)``, in order 0..m-1, outputs concatenated, the same loss, one
backward. Each BatchNorm then normalises each micro-batch with its own statistics and updates
its running statistics once per micro-batch in that order, as in the pipeline; autograd
accumulates each parameter's gradients in the order m-1..0 in both runs (NOTE [ Pipeline
clock cycles ]). The U-Net is the ``unet`` workload's model at its small shape with dropout
off, except in the dropout test, whose reference also runs in clock order.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.pipe import DeferredBatchNorm, Pipe
from remat.pipe._unet import sequential_unet
from remat.pipe.pipeline import clock_cycles
from remat.pipe.skip.tracker import SkipTracker, use_skip_tracker
from remat.workloads import UNet, UNetConfig, get_workload

from helpers import Fail

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
BALANCES = {1: [6], 2: [3, 3], 4: [2, 1, 1, 2]}


def small_unet(dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    """The unet workload's small model (depth 2, 8 base channels), as skippable levels."""
    config = UNetConfig(
        in_channels=3, base_channels=8, depth=2, image_size=16, num_classes=4, dropout=dropout
    )
    torch.manual_seed(seed)
    return sequential_unet(UNet(config))


def batch(rows: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3, 16, 16, generator=g), torch.randint(
        0, 4, (rows, 16, 16), generator=g
    )


def plain_by_microbatch(model: nn.Sequential, x: torch.Tensor, chunks: int) -> torch.Tensor:
    return torch.cat([model(c) for c in torch.tensor_split(x, chunks)])


def assert_same_step(ref: nn.Module, pipe: Pipe, x: torch.Tensor, target: torch.Tensor) -> None:
    xr = x.clone().requires_grad_()
    xp = x.clone().requires_grad_()
    out_ref = plain_by_microbatch(ref, xr, pipe.chunks)  # type: ignore[arg-type]
    out_pipe = pipe(xp)
    F.cross_entropy(out_ref, target).backward()
    F.cross_entropy(out_pipe, target).backward()
    assert torch.equal(out_ref, out_pipe)
    assert torch.equal(xr.grad, xp.grad)  # type: ignore[arg-type]
    ref_params = dict(ref.named_parameters())
    pipe_params = list(pipe.parameters())
    assert len(ref_params) == len(pipe_params)
    for (name, p), q in zip(ref_params.items(), pipe_params, strict=True):
        assert torch.equal(p.grad, q.grad.to(p.device)), name  # type: ignore[arg-type, union-attr]
    for (name, a), b in zip(ref.named_buffers(), pipe.buffers(), strict=True):
        assert torch.equal(a, b.to(a.device)), name


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("partitions", [1, 2, 4])
@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_unet_equals_plain_sequential_on_same_microbatches_bit_for_bit(
    checkpoint: str, partitions: int, chunks: int
) -> None:
    """Outputs, input grad, every parameter grad and BN buffers, torch.equal, against the plain
    nn.Sequential run micro-batch by micro-batch (module docstring). Skips cross partitions:
    with 4 partitions [2, 1, 1, 2] both levels' skips travel from partition 0 to 2 and 3."""
    model = small_unet()
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model,
        balance=BALANCES[partitions],
        devices=["cpu"] * partitions,
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
    )
    assert_same_step(ref, pipe, *batch())


def test_skippable_unet_equals_workload_unet() -> None:
    """The skippable nn.Sequential computes exactly UNet.forward (same modules)."""
    unet = get_workload("unet", "small").model(seed=0)
    seq = sequential_unet(unet)  # type: ignore[arg-type]
    x, _ = batch(4)
    torch.manual_seed(5)
    expected = unet(x)
    torch.manual_seed(5)
    assert torch.equal(seq(x), expected)


@pytest.mark.parametrize("devices", [("cpu", "cpu"), ("cpu", "cuda")])
def test_partitions_on_two_devices_equal_plain_run_on_same_devices(
    devices: tuple[str, str],
) -> None:
    """Reference: the plain layers placed on the same devices, run micro-batch by micro-batch
    with the same device copies; skips cross from devices[0] to devices[1] through portals."""
    if "cuda" in devices and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = small_unet()
    ref = copy.deepcopy(model)
    ref_parts = [ref[:3].to(devices[0]), ref[3:].to(devices[1])]
    pipe = Pipe(model, balance=[3, 3], devices=list(devices), chunks=4, checkpoint="except_last")
    x, target = batch()
    xr = x.clone().requires_grad_()
    xp = x.clone().requires_grad_()
    outs = []
    tracker = SkipTracker()
    with use_skip_tracker(tracker):
        for c in torch.tensor_split(xr, 4):
            h = ref_parts[0](c.to(devices[0]))
            for key, t in list(tracker.tensors.items()):
                tracker.tensors[key] = t.to(devices[1]) if t is not None else None
            outs.append(ref_parts[1](h.to(devices[1])))
    out_ref = torch.cat(outs)
    out_pipe = pipe(xp)
    assert out_pipe.device == torch.device(devices[1]) or devices[1] == "cuda"
    F.cross_entropy(out_ref, target.to(out_ref.device)).backward()
    F.cross_entropy(out_pipe, target.to(out_pipe.device)).backward()
    assert torch.equal(out_ref, out_pipe)
    assert torch.equal(xr.grad, xp.grad)  # type: ignore[arg-type]
    for p, q in zip(ref.parameters(), pipe.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def test_dropout_equals_plain_layers_run_in_clock_order() -> None:
    """With the workload's dropout (0.1) the random draws follow the clock cycles, so the
    reference is the plain layers (no Pipe, no portals, no checkpointing) run on the same
    micro-batches in the same (micro-batch, partition) order, each micro-batch with its own
    dict of skips. The pipeline checkpoints every micro-batch: recomputes replay the masks."""
    model = small_unet(dropout=0.1)
    ref = copy.deepcopy(model)
    balance, chunks = [3, 3], 4
    pipe = Pipe(model, balance=balance, devices=["cpu", "cpu"], chunks=chunks, checkpoint="always")
    x, target = batch()
    parts = [ref[:3], ref[3:]]
    xr = x.clone().requires_grad_()
    xp = x.clone().requires_grad_()
    acts = list(torch.tensor_split(xr, chunks))
    trackers = [SkipTracker() for _ in range(chunks)]
    torch.manual_seed(7)
    for schedule in clock_cycles(chunks, len(balance)):
        for i, j in schedule:
            with use_skip_tracker(trackers[i]):
                acts[i] = parts[j](acts[i])
    out_ref = torch.cat(acts)
    torch.manual_seed(7)
    out_pipe = pipe(xp)
    F.cross_entropy(out_ref, target).backward()
    F.cross_entropy(out_pipe, target).backward()
    assert torch.equal(out_ref, out_pipe)
    assert torch.equal(xr.grad, xp.grad)  # type: ignore[arg-type]
    for p, q in zip(ref.parameters(), pipe.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def test_clock_cycles_golden() -> None:
    assert list(clock_cycles(3, 2)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1)],
        [(2, 1)],
    ]
    assert list(clock_cycles(1, 3)) == [[(0, 0)], [(0, 1)], [(0, 2)]]


class Record(nn.Module):
    """Logs (event, micro-batch, partition, checkpointing, recomputing); saves its input."""

    def __init__(self, partition: int, log: list[tuple[str, int, int, bool, bool]]) -> None:
        super().__init__()
        self.partition = partition
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = int(x[0, 0].item() // 1000)
        event = "recompute" if remat.is_recomputing() else "forward"
        self.log.append(
            (event, i, self.partition, remat.is_checkpointing(), remat.is_recomputing())
        )
        y = x.sin() * 0 + x  # sin saves x, so a checkpointed partition is recomputed
        if torch.is_grad_enabled() and y.requires_grad and not remat.is_recomputing():
            partition = self.partition

            def hook(grad: torch.Tensor) -> None:
                self.log.append(("backward", i, partition, False, False))

            y.register_hook(hook)
        return y


def test_timeline_and_checkpoint_flags_except_last() -> None:
    """Forward in clock order; backward visits micro-batches m-1..0 in every partition; the
    first m-1 micro-batches run checkpointed and are recomputed, the last is not."""
    log: list[tuple[str, int, int, bool, bool]] = []
    model = nn.Sequential(Record(0, log), Record(1, log))
    pipe = Pipe(model, balance=[1, 1], devices=["cpu", "cpu"], chunks=3)
    x = (torch.arange(3.0) * 1000).repeat_interleave(2).reshape(6, 1).requires_grad_()
    pipe(x).sum().backward()
    forward = [(i, j, c, r) for e, i, j, c, r in log if e == "forward"]
    assert forward == [
        (0, 0, True, False),
        (1, 0, True, False),
        (0, 1, True, False),
        (2, 0, False, False),
        (1, 1, True, False),
        (2, 1, False, False),
    ]
    recomputed = sorted((i, j) for e, i, j, c, r in log if e == "recompute")
    assert recomputed == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(not c and r for e, i, j, c, r in log if e == "recompute")
    for j in (0, 1):
        order = [i for e, i, jj, _, _ in log if e == "backward" and jj == j]
        assert order == [2, 1, 0]


def test_eval_and_no_grad_do_not_checkpoint() -> None:
    log: list[tuple[str, int, int, bool, bool]] = []
    pipe = Pipe(nn.Sequential(Record(0, log)), balance=[1], devices=["cpu"], chunks=2)
    x = torch.zeros(2, 1)
    with torch.no_grad():
        pipe(x)
    pipe.eval()
    pipe(x.requires_grad_()).sum().backward()
    assert log and all(not c and not r for _, _, _, c, r in log)


def test_tuple_input_and_output() -> None:
    class Both(nn.Module):
        def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            x, y = xy
            return x * 2, y + x

    ref = nn.Sequential(Both(), Both())
    pipe = Pipe(copy.deepcopy(ref), balance=[1, 1], devices=["cpu", "cpu"], chunks=2)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    out = pipe((x, y))
    expected = [ref((a, b)) for a, b in zip(x.tensor_split(2), y.tensor_split(2), strict=True)]
    assert isinstance(out, tuple)
    assert torch.equal(out[0], torch.cat([e[0] for e in expected]))
    assert torch.equal(out[1], torch.cat([e[1] for e in expected]))


class Returns(nn.Module):
    """Returns what ``make(x)`` builds: a dict, a tuple holding None, a scalar, a list."""

    def __init__(self, make: Callable[[torch.Tensor], object]) -> None:
        super().__init__()
        self.make = make

    def forward(self, x: torch.Tensor) -> object:
        return self.make(x)


def test_values_other_than_tensors_between_partitions_name_the_layer() -> None:
    """A dict, or a tuple holding None, at a partition boundary raised AttributeError ('str'
    object has no attribute 'device') from inside remat.pipe; a last layer returning a 0-dim
    tensor raised torch's RuntimeError from the concatenation. Now a RematError names the
    partition, its last layer and what may pass. A list of tensors still passes, as a tuple."""
    x = torch.randn(4, 3)
    cases: list[tuple[nn.Sequential, str]] = [
        (
            nn.Sequential(Returns(lambda x: {"h": x}), nn.Identity()),
            r"partition 0, whose last layer is '0' \(Returns\), returned dict, but a Pipe "
            r"passes between partitions.*only a tensor or a non-empty tuple of tensors",
        ),
        (
            nn.Sequential(Returns(lambda x: (x, None)), nn.Identity()),
            r"'0' \(Returns\), returned tuple of \(Tensor, NoneType\)",
        ),
        (
            nn.Sequential(nn.Identity(), Returns(lambda x: (x, x.sum()))),
            r"partition 1, whose last layer is '1' \(Returns\), returned a 0-dim tensor as "
            r"output 1 of its tuple.*unsqueeze",
        ),
    ]
    for model, match in cases:
        for chunks in (1, 2):
            pipe = Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=chunks)
            with pytest.raises(remat.RematError, match=match):
                pipe(x)
    pipe = Pipe(nn.Sequential(Returns(lambda x: [x, 2 * x]), nn.Identity()), [1, 1], chunks=2)
    out = pipe(x)
    assert isinstance(out, tuple) and torch.equal(out[1], 2 * x)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.randn(0, 4), r"empty batch \(0 rows.*chunks=1.*at least 1 row\."),
        (torch.tensor(3.0), r"the input is a 0-dim tensor.*unsqueeze\(0\)"),
        ((torch.randn(2, 4), torch.tensor(1.0)), r"input tensor 1 is a 0-dim tensor"),
    ],
)
def test_empty_batch_and_scalar_input_say_what_to_do(x: object, match: str) -> None:
    """Both said "Use chunks <= 0 or a larger batch", a value chunks cannot take."""
    pipe = Pipe(nn.Sequential(nn.Identity()), [1], chunks=1)
    with pytest.raises(remat.RematError, match=match) as info:
        pipe(x)  # type: ignore[arg-type]
    assert "chunks <= 0" not in str(info.value)


def test_deferred_batch_norm_updates_running_stats_once_per_minibatch() -> None:
    """Outputs and grads: bit-equal to the plain model (nn.BatchNorm2d) run micro-batch by
    micro-batch, since both normalise each micro-batch with its own statistics. Running
    statistics: one update from the whole mini-batch, compared with one full-batch
    nn.BatchNorm2d update within float rounding (sums in another order): rtol 1e-5,
    atol 1e-6. num_batches_tracked is 1 although every micro-batch was recomputed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    ref = copy.deepcopy(model)
    full = copy.deepcopy(model)
    pipe = Pipe(
        model,
        balance=[2, 2],
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint="always",
        deferred_batch_norm=True,
    )
    assert isinstance(pipe[1], DeferredBatchNorm)
    x = torch.randn(8, 3, 6, 6)
    out_pipe = pipe(x)
    out_ref = plain_by_microbatch(ref, x, 4)
    out_pipe.square().sum().backward()
    out_ref.square().sum().backward()
    assert torch.equal(out_pipe, out_ref)
    for p, q in zip(ref.parameters(), pipe.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    full(x)
    bn, deferred = full[1], pipe[1]
    assert int(deferred.num_batches_tracked) == 1  # type: ignore[arg-type]
    torch.testing.assert_close(deferred.running_mean, bn.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(deferred.running_var, bn.running_var, rtol=1e-5, atol=1e-6)


def exactly_summable_batch(rows: int, channels: int, seed: int) -> torch.Tensor:
    """Quarter-integer values, symmetric about a half-integer mean per channel: every partial
    sum (of x and of x**2) is exact in float32, so summing in any order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(-12, 13, (rows // 2, channels, 4, 4), generator=g).float() / 4
    mean = torch.randint(-8, 9, (1, channels, 1, 1), generator=g).float() / 2
    return torch.cat([v, -v])[torch.randperm(rows, generator=g)] + mean


@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batch_norm_statistics_equal_batch_norm_on_the_whole_minibatch(
    momentum: float | None,
) -> None:
    """Two steps of 4 micro-batches, every one checkpointed (recomputes track nothing): running
    mean, running variance and num_batches_tracked equal nn.BatchNorm2d run on each whole
    mini-batch, torch.equal. The BatchNorm already was a DeferredBatchNorm for chunks=1 (as
    after an earlier Pipe); converting it for chunks=4 must not leave it committing once per
    micro-batch (it did: num_batches_tracked was 8).

    Exact equality needs the sums to be exact: BatchNorm sums the whole mini-batch in its
    kernel's order, DeferredBatchNorm sums each micro-batch and adds the sums, and in general
    float32 rounds the two differently (the random-data test above checks that case within
    rounding). Here the inputs are chosen so that every sum is exact, which leaves the rest of
    the arithmetic (mean, unbiased variance, momentum step) to be compared bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.BatchNorm2d(4, momentum=momentum), nn.Conv2d(4, 4, 1), nn.ReLU(), nn.Conv2d(4, 2, 1)
    )
    with torch.no_grad():
        model[0].running_mean.uniform_(-1, 1)  # type: ignore[operator]
        model[0].running_var.uniform_(0.5, 2)  # type: ignore[operator]
    full = copy.deepcopy(model[0])
    DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=1)
    pipe = Pipe(model, [2, 2], ["cpu", "cpu"], 4, checkpoint="always", deferred_batch_norm=True)
    deferred = pipe[0]
    assert isinstance(deferred, DeferredBatchNorm) and deferred.chunks == 4
    for step in range(2):
        x = exactly_summable_batch(8, 4, seed=step)
        pipe(x).sum().backward()
        full(x)
    assert torch.equal(deferred.num_batches_tracked, full.num_batches_tracked)
    assert int(deferred.num_batches_tracked) == 2
    assert torch.equal(deferred.running_mean, full.running_mean)
    assert torch.equal(deferred.running_var, full.running_var)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_deferred_batch_norm_after_a_forward_that_raised(checkpoint: str) -> None:
    """A forward that raises after some micro-batches passed a DeferredBatchNorm leaves their
    sums and count there; the next forward starts a new mini-batch without them. Running
    statistics after two good steps equal nn.BatchNorm2d run on the two whole mini-batches
    only, torch.equal (exactly summable inputs, as above). Kept, the leftovers moved every
    later commit off the mini-batches' boundaries."""
    torch.manual_seed(0)
    fail = Fail()
    model = nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), fail, nn.Conv2d(4, 2, 1))
    full = copy.deepcopy(model[0])
    pipe = Pipe(model, [2, 2], ["cpu", "cpu"], 4, checkpoint=checkpoint, deferred_batch_norm=True)  # type: ignore[arg-type]
    deferred = pipe[0]
    assert isinstance(deferred, DeferredBatchNorm)
    fail.armed = True
    with pytest.raises(RuntimeError, match="on purpose"):
        pipe(exactly_summable_batch(8, 4, seed=9) * 100)
    fail.armed = False
    assert deferred.tracked == 2  # micro-batches 0 and 1 passed partition 0
    for step in range(2):
        x = exactly_summable_batch(8, 4, seed=step)
        pipe(x).sum().backward()
        full(x)
    assert torch.equal(deferred.num_batches_tracked, full.num_batches_tracked)
    assert torch.equal(deferred.running_mean, full.running_mean)
    assert torch.equal(deferred.running_var, full.running_var)


def test_deferred_batch_norm_state_dict_loads_into_plain_model_and_back() -> None:
    """DeferredBatchNorm's sums of the mini-batch under way are not in the state dict, so a
    Pipe with deferred_batch_norm=True has the plain model's keys (it had extra "1.sum" and
    "1.sum_squares", and strict loading failed both ways). A state dict that still holds the
    sums (torchgpipe's, under its own names, or an older remat Pipe's) loads too."""

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))

    torch.manual_seed(0)
    trained = build()
    trained(torch.randn(4, 2, 3, 3))
    pipe = Pipe(build(), [2, 2], ["cpu", "cpu"], chunks=2, deferred_batch_norm=True)
    assert list(pipe.state_dict()) == list(trained.state_dict())
    pipe.load_state_dict(trained.state_dict())  # strict
    plain = build()
    plain.load_state_dict(pipe.state_dict())  # strict
    for key, value in trained.state_dict().items():
        assert torch.equal(pipe.state_dict()[key], value), key
        assert torch.equal(plain.state_dict()[key], value), key
    sums = {"1.sum": torch.ones(4), "1.sum_squares": torch.ones(4)}
    pipe.load_state_dict({**trained.state_dict(), **sums})  # strict
    torchgpipe = {
        f"partitions.{0 if k[0] in '01' else 1}.{k}": v
        for k, v in {**trained.state_dict(), **sums}.items()
    }
    pipe.load_state_dict(torchgpipe)  # strict
    deferred = pipe[1]
    assert isinstance(deferred, DeferredBatchNorm)
    assert deferred.tracked == 0
    assert torch.equal(deferred.running_var, trained[1].running_var)  # type: ignore[arg-type]


def random_batches(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Three random batches, each with its own scale and offset (not exactly summable)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(shape, generator=g) * (0.1 + 10 * torch.rand(1, generator=g))
            + 5 * torch.randn(1, generator=g)
        ).to(dtype)
        for _ in range(3)
    ]


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize(
    ("layer", "shape", "dtype"),
    [
        (nn.BatchNorm2d, (8, 3, 5, 4), torch.float32),
        (nn.BatchNorm2d, (3, 6, 7, 7), torch.float32),
        (nn.BatchNorm1d, (16, 4, 9), torch.float32),
        (nn.BatchNorm3d, (4, 2, 3, 3, 3), torch.float32),
        # Kernels that NOTE [ Deferred statistics ] does not reproduce: one micro-batch hands
        # the statistics to ATen.
        (nn.BatchNorm1d, (16, 4), torch.float32),
        (nn.BatchNorm1d, (16, 4, 1), torch.float32),
        (nn.BatchNorm2d, (8, 3, 5, 4), torch.float64),
    ],
)
def test_deferred_batch_norm_one_micro_batch_equals_batch_norm_bit_for_bit(
    layer: type[nn.Module],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    momentum: float | None,
) -> None:
    """One micro-batch per mini-batch, random data whose sums are not exact: running mean and
    running variance equal the plain BatchNorm's, torch.equal, three steps (NOTE [ Deferred
    statistics ]). The variance as sum_squares - mean * sum differed in the last bits. (For
    float64 data the float64 sums are rounded, in another order than ATen's: equal when they
    are exact, see the dtype test below.)"""
    torch.manual_seed(0)
    plain = layer(shape[1], momentum=momentum).to(dtype)
    with torch.no_grad():
        plain.running_mean.uniform_(-1, 1)  # type: ignore[operator]
        plain.running_var.uniform_(0.5, 2)  # type: ignore[operator]
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks=1)
    assert isinstance(deferred, DeferredBatchNorm)
    for step, x in enumerate(random_batches(shape, dtype, seed=sum(shape))):
        torch.testing.assert_close(deferred(x), plain(x), rtol=0, atol=0)
        assert torch.equal(deferred.running_mean, plain.running_mean), step
        assert torch.equal(deferred.running_var, plain.running_var), step
    assert torch.equal(deferred.num_batches_tracked, plain.num_batches_tracked)
    # Channels-last inputs, which ATen reduces with another kernel, too.
    for step, x in enumerate(random_batches(shape, dtype, seed=1)):
        if x.dim() == 4:
            x = x.to(memory_format=torch.channels_last)
        torch.testing.assert_close(deferred(x), plain(x), rtol=0, atol=0)
        assert torch.equal(deferred.running_mean, plain.running_mean), step
        assert torch.equal(deferred.running_var, plain.running_var), step


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("how", ["pipe", "remat.checkpoint"])
def test_deferred_batch_norm_one_micro_batch_recomputes_as_forward(
    how: str, momentum: float | None
) -> None:
    """chunks=1 and checkpointing: the recompute called F.batch_norm without the running
    statistics, so ATen saved other tensors and backward raised a CheckpointError. Now outputs,
    gradients, running statistics and num_batches_tracked equal a plain BatchNorm's, two
    steps, torch.equal (the engine puts back what the recompute writes)."""

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4, momentum=momentum),
            nn.ReLU(),
            nn.Conv2d(4, 2, 1),
        )

    plain = make()
    if how == "pipe":
        model: nn.Module = Pipe(
            make(), [2, 2], chunks=1, checkpoint="always", deferred_batch_norm=True
        )
        run: Callable[[torch.Tensor], torch.Tensor] = model
    else:
        model = DeferredBatchNorm.convert_deferred_batch_norm(make(), chunks=1)
        run = functools.partial(remat.checkpoint, model)
    for step in range(2):
        x = torch.randn(8, 3, 5, 5, generator=torch.Generator().manual_seed(step))
        out = run(x)
        ref = plain(x)
        assert torch.equal(out, ref), step
        out.square().sum().backward()
        ref.square().sum().backward()
        for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), (step, name)  # type: ignore[arg-type]
        for (name, a), b in zip(plain.named_buffers(), model.buffers(), strict=True):
            assert torch.equal(a, b), (step, name)


@pytest.mark.parametrize("seed", range(4))
def test_deferred_batch_norm_micro_batches_within_the_documented_bound(seed: int) -> None:
    """Several micro-batches, random data: the running mean equals a plain BatchNorm run on
    the whole mini-batch (torch.equal: float64 sums of float32 data are exact here), the
    running variance is within a relative 1e-6 of it, as docs/pipe.md says."""
    torch.manual_seed(seed)
    plain = nn.BatchNorm2d(5)
    chunks = 4
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks)
    assert isinstance(deferred, DeferredBatchNorm)
    for step, x in enumerate(random_batches((11, 5, 6, 6), torch.float32, seed=seed)):
        for micro_batch in x.tensor_split(chunks):
            deferred(micro_batch)
        plain(x)
        assert torch.equal(deferred.running_mean, plain.running_mean), step
        torch.testing.assert_close(deferred.running_var, plain.running_var, rtol=1e-6, atol=0)
    assert int(deferred.num_batches_tracked) == 3


def test_deferred_batch_norm_keeps_the_statistics_dtype() -> None:
    """A float64 model's running statistics stay float64 through the conversion (they became
    float32, rounded, and eval mode then raised a dtype error); half ones stay half. With
    integer data every sum is exact, so the float64 statistics equal a plain BatchNorm's on
    the whole mini-batch, torch.equal, and so does the eval output."""
    from remat.pipe.distributed import split_stages

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 2, 1)).double()
    with torch.no_grad():
        model[0].running_var.uniform_(0.5, 2)  # type: ignore[operator]
    plain = copy.deepcopy(model)
    pipe = Pipe(model, [1, 1], chunks=2, deferred_batch_norm=True)
    deferred = pipe[0]
    assert isinstance(deferred, DeferredBatchNorm)
    assert torch.equal(deferred.running_var, plain[0].running_var)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (4, 3, 4, 4), generator=g).double()
    pipe(x).sum().backward()
    plain[0](x)
    assert deferred.running_mean.dtype == deferred.running_var.dtype == torch.float64
    assert torch.equal(deferred.running_mean, plain[0].running_mean)  # type: ignore[arg-type]
    assert torch.equal(deferred.running_var, plain[0].running_var)  # type: ignore[arg-type]
    pipe.eval()
    plain.eval()
    assert torch.equal(pipe(x), plain(x))  # type: ignore[arg-type]

    half = DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm2d(3).half())
    assert half.running_mean.dtype == half.running_var.dtype == torch.float16  # type: ignore[union-attr]
    stages = split_stages(
        nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 2, 1)).double(),
        balance=[1, 1],
        chunks=2,
        deferred_batch_norm=True,
    )
    assert [b.dtype for b in stages[0].buffers()] == [torch.float64, torch.float64, torch.int64]


def test_bad_balance_devices_chunks_and_mode_name_the_values() -> None:
    model = small_unet()
    with pytest.raises(remat.RematError, match=r"balance \[2, 2\] sums to 4.*6 layers.*\[3, 3\]"):
        Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=1)
    with pytest.raises(remat.RematError, match=r"3 partitions but only 2 devices"):
        Pipe(model, balance=[2, 2, 2], devices=["cpu", "cpu"], chunks=1)
    with pytest.raises(remat.RematError, match=r"at least one layer"):
        Pipe(model, balance=[6, 0], devices=["cpu", "cpu"], chunks=1)
    with pytest.raises(remat.RematError, match=r"checkpoint='alway' .*did you mean 'always'"):
        Pipe(model, balance=[6], devices=["cpu"], chunks=1, checkpoint="alway")  # type: ignore[arg-type]
    with pytest.raises(remat.RematError, match=r"chunks must be a positive int.*0"):
        Pipe(model, balance=[6], devices=["cpu"], chunks=0)
    with pytest.raises(remat.RematError, match=r"takes an nn.Sequential, got Linear"):
        Pipe(nn.Linear(2, 2), balance=[1], devices=["cpu"], chunks=1)  # type: ignore[arg-type]
    pipe = Pipe(model, balance=[6], devices=["cpu"], chunks=8)
    with pytest.raises(remat.RematError, match=r"chunks=8 but the batch has 5 rows.*chunks <= 5"):
        pipe(torch.randn(5, 3, 16, 16))
    with pytest.raises(remat.RematError, match=r"places them itself"):
        pipe.to("cpu")
    with pytest.raises(remat.RematError, match=r"places them itself"):
        pipe.to("cpu", torch.float64)
    # a dtype alone converts each partition where it is, as torchgpipe allows
    assert pipe.to(torch.float64) is pipe
    assert {p.dtype for p in pipe.parameters()} == {torch.float64}
    assert pipe(torch.randn(8, 3, 16, 16, dtype=torch.float64)).dtype == torch.float64


# -- torchgpipe's spellings, in the style of its tests/test_gpipe.py -------------------------


def test_balance_positionally_chunks_and_devices_default() -> None:
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    pipe = Pipe(model, [1, 1])
    assert pipe.balance == [1, 1]
    assert pipe.chunks == 1
    assert pipe.checkpoint == "except_last"
    assert pipe.devices == [torch.device("cpu")] * 2 or torch.cuda.is_available()
    if torch.cuda.is_available():
        assert pipe.devices == [torch.device("cuda", torch.cuda.current_device())] * 2


def test_torchgpipe_call_equals_plain_sequential() -> None:
    """GPipe(module, balance, devices=..., chunks=..., checkpoint=...) as torchgpipe spells it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    pipe = Pipe(model, [2, 3], devices=["cpu", "cpu"], chunks=4, checkpoint="always")
    x = torch.randn(8, 4)
    out = pipe(x)
    expected = plain_by_microbatch(ref, x, 4)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert torch.equal(out, expected)
    for (name, p), (ref_name, q) in zip(
        pipe.named_parameters(), ref.named_parameters(), strict=True
    ):
        assert name == ref_name
        assert torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]


def test_sequential_like() -> None:
    a = nn.Linear(1, 1)
    b = nn.Linear(1, 1)
    model = Pipe(nn.Sequential(a, b), [1, 1], devices=["cpu", "cpu"])
    assert len(model) == 2
    assert list(model) == [a, b]
    assert model[0] is a
    assert model[1] is b
    assert model[-1] is b
    assert model[-2] is a
    with pytest.raises(IndexError):
        _ = model[2]
    model.eval()
    assert not a.training and not any(p.training for p in model.partitions)


def test_named_parameters_and_buffers_keep_the_sequential_names() -> None:
    """Name-based parameter groups (no weight decay on biases and norms) match the plain
    model's: torchgpipe's layer names, not renumbered per partition (``partitions.1.0``)."""
    model = nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(3, 4, 3), bn=nn.BatchNorm2d(4), relu=nn.ReLU(), head=nn.Conv2d(4, 2, 1)
        )
    )
    names = [n for n, _ in model.named_parameters()]
    buffers = [n for n, _ in model.named_buffers()]
    pipe = Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=2)
    assert [n for n, _ in pipe.named_parameters()] == names
    assert [n for n, _ in pipe.named_buffers()] == buffers
    assert list(pipe.state_dict()) == list(model.state_dict())
    decay = [p for n, p in pipe.named_parameters() if not n.endswith("bias") and "bn" not in n]
    assert [p.shape for p in decay] == [(4, 3, 3, 3), (2, 4, 1, 1)]
    numbered = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    pipe = Pipe(numbered, [1, 2], devices=["cpu", "cpu"])
    assert [n for n, _ in pipe.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_state_dict_of_plain_sequential_loads_into_pipe_and_back() -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))

    torch.manual_seed(0)
    trained = build()
    trained(torch.randn(4, 3, 6, 6))  # running statistics differ from a fresh model's
    torch.manual_seed(1)
    pipe = Pipe(build(), [2, 2], devices=["cpu", "cpu"], chunks=2)
    pipe.load_state_dict(trained.state_dict())  # strict
    for key, value in trained.state_dict().items():
        assert torch.equal(pipe.state_dict()[key], value), key
    torch.manual_seed(2)
    plain = build()
    plain.load_state_dict(pipe.state_dict())  # strict
    x = torch.randn(4, 3, 6, 6)
    plain.eval()
    pipe.eval()
    trained.eval()
    assert torch.equal(plain(x), trained(x))
    assert torch.equal(pipe(x), trained(x))


def test_torchgpipe_state_dict_loads() -> None:
    """torchgpipe saves layer NAME of partition J as ``partitions.J.NAME``."""
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    saved = {
        f"partitions.{0 if k.startswith('0.') else 1}.{k}": v
        for k, v in source.state_dict().items()
    }
    assert list(saved) == [
        "partitions.0.0.weight",
        "partitions.0.0.bias",
        "partitions.1.2.weight",
        "partitions.1.2.bias",
    ]
    torch.manual_seed(1)
    pipe = Pipe(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)), [1, 2], ["cpu"] * 2)
    pipe.load_state_dict(saved)  # strict
    for key, value in source.state_dict().items():
        assert torch.equal(pipe.state_dict()[key], value), key
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*partitions\.1\.0\.weight"):
        pipe.load_state_dict(
            {**source.state_dict(), "partitions.1.0.weight": saved["partitions.0.0.weight"]}
        )


def test_verify_module_duplicate_children() -> None:
    """A module at two positions is refused, as torchgpipe does: across partitions its
    gradients would be added in another order than the plain run's."""
    conv = nn.Conv2d(3, 3, 1)
    model = nn.Sequential(conv, nn.ReLU(), conv)
    with pytest.raises(remat.RematError, match=r"same Conv2d at positions 0 \('0'\) and 2 \('2'\)"):
        Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    from remat.pipe.distributed import split_stages

    with pytest.raises(remat.RematError, match=r"positions 0 \('0'\) and 2 \('2'\)"):
        split_stages(model, balance=[2, 1], chunks=1)


def test_verify_module_duplicate_parameters_in_distinct_children() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    with pytest.raises(remat.RematError, match=r"0\.weight \(position 0\) and 2\.weight \(posi"):
        Pipe(nn.Sequential(a, nn.ReLU(), b), balance=[1, 2], devices=["cpu", "cpu"], chunks=1)


def test_bad_arguments_name_the_value_and_the_fix() -> None:
    """Every argument is checked at construction, in one line that says what was expected."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    def fails(match: str, **kwargs: object) -> None:
        arguments: dict[str, object] = {"balance": [2], "devices": ["cpu"], "chunks": 1}
        with pytest.raises(remat.RematError, match=match) as info:
            Pipe(model, **{**arguments, **kwargs})  # type: ignore[arg-type]
        message = str(info.value)
        assert message.startswith("remat: ") and "\n" not in message, message

    fails(
        r"devices\[0\]='gpu' is not a device.*Use 'cuda' \(or 'cuda:N'\) for a GPU",
        balance=[1, 1],
        devices=["gpu", "cpu"],
    )
    fails(r"devices\[1\]=1.5 is not a device", balance=[1, 1], devices=["cpu", 1.5])
    fails(r"devices must be a list.*'cpu'", balance=[1, 1], devices="cpu")
    if not torch.cuda.is_available():
        fails(
            r"devices\[0\]='cuda:1' names a cuda device, but this machine has no accel",
            devices=["cuda:1"],
        )
        fails(r"devices\[0\]=0 names a cuda device", devices=[0])
    else:
        count = torch.cuda.device_count()
        fails(rf"only {count} cuda device", devices=[f"cuda:{count}"])
    fails(r"needs balance.*balance=\[1, 1\]", balance=None)
    fails(r"balance must be a non-empty list.*1.5", balance=[1.5, 0.5])
    fails(r"balance must be a non-empty list.*True", balance=[True, True])
    fails(r"chunks must be a positive int.*'4'", chunks="4")
    fails(r"checkpoint='sometimes' is not a mode", checkpoint="sometimes")
    fails(r"deferred_batch_norm must be True or False, got 'yes'", deferred_batch_norm="yes")
    named = nn.Sequential(OrderedDict(chunks=nn.Linear(2, 2)))
    with pytest.raises(remat.RematError, match=r"layer 'chunks' would hide Pipe.chunks"):
        Pipe(named, balance=[1], devices=["cpu"], chunks=1)


def test_debug_points_at_the_first_operator_that_differs() -> None:
    """``debug=True`` (the region engine's operator diff, which a pipeline's regions use): the
    recompute's own bookkeeping (a detach per saved tensor) is not logged, so the pointer
    lands on the first real difference, #3 here, not on #0 as soon as a tensor is saved."""
    state = {"changed": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin().cos().exp()
        y = y.sum(0, keepdim=True).sin() if state["changed"] else y.sin()
        return y.sin().sum()

    out = remat.checkpoint(fn, torch.randn(4, requires_grad=True), debug=True)
    state["changed"] = True
    with pytest.raises(remat.CheckpointError) as info:
        out.backward()
    lines = str(info.value).splitlines()
    start = lines.index("Operators from #0 (first difference at #3):")
    same = [line.split() for line in lines[start + 1 : start + 4]]
    assert [(w[0], w[2], w[4]) for w in same] == [
        ("#0", "aten.sin.default", "aten.sin.default"),
        ("#1", "aten.cos.default", "aten.cos.default"),
        ("#2", "aten.exp.default", "aten.exp.default"),
    ]
    assert lines[start + 4].split() == [
        "#3",
        "forward",
        "aten.sin.default",
        "recompute",
        "aten.sum.dim_IntList",
    ]


def test_deferred_batch_norm_on_features_without_spatial_dimensions() -> None:
    """A BatchNorm1d on (N, C) features (torchgpipe refuses them): each micro-batch is
    normalised by its own statistics, as the plain model run micro-batch by micro-batch, bit
    for bit, and the running statistics follow the whole mini-batch's within the documented
    bound (ATen reduces (N, C) with a kernel that sums in float32, so the mean too is within
    it rather than equal). A 1-D input is no batch of channels."""

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))

    plain, chunks = model(), 4
    pipe = Pipe(model(), [2, 2], ["cpu", "cpu"], chunks, deferred_batch_norm=True)
    bn = plain[1]
    for step in range(3):
        x = torch.randn(64, 8) * 3 + 1
        out = pipe(x)
        with torch.no_grad():
            # The plain model per micro-batch: the arithmetic the pipe's outputs follow.
            frozen = copy.deepcopy(plain).train()
            expected = torch.cat([frozen(m) for m in x.tensor_split(chunks)])
            plain(x)  # the statistics of the whole mini-batch
        assert torch.equal(out, expected), step
        deferred = pipe.partitions[0][1]
        assert isinstance(deferred, DeferredBatchNorm)
        torch.testing.assert_close(deferred.running_mean, bn.running_mean, rtol=1e-6, atol=0)
        torch.testing.assert_close(deferred.running_var, bn.running_var, rtol=1e-6, atol=0)
    assert int(deferred.num_batches_tracked) == 3
    with pytest.raises(remat.RematError, match=r"takes \(N, C, \.\.\.\) inputs.*got 1"):
        DeferredBatchNorm(4)(torch.randn(4))
