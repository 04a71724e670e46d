"""OffloadModel: slices trained from host memory or disk, bit-identical to a plain run.

Every comparison is ``torch.equal``. The reference of each test is stated in its docstring; in
general (NOTE [ OffloadModel design ] 6) it is the same modules run plainly on the same
micro-batches in the same slice-major order, outputs concatenated, which for one micro-batch is
the plain model itself.
"""

from __future__ import annotations

import copy
import errno
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.bench.offload_model import gpt_modules
from remat.errors import RematError
from remat.offload_model import OffloadModel
from remat.workloads import get_workload

from helpers import wait_for

GPT = get_workload("gpt", "small")
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def gpt_batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (rows, 17), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def reference_forward(
    modules: list[nn.Module], ranges: tuple[range, ...], x: torch.Tensor, microbatches: int
) -> torch.Tensor:
    """The plain run OffloadModel must equal: slice-major over the same micro-batches."""
    chunks = list(x.tensor_split(microbatches))
    for span in ranges:
        outs = []
        for c in chunks:
            for i in span:
                c = modules[i](c)
            outs.append(c)
        chunks = outs
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]


def offload(modules: list[nn.Module], tmp_path: Path, **options: Any) -> OffloadModel:
    options.setdefault("device", "cpu")
    options.setdefault("offload_device", "disk")
    options.setdefault("num_slices", 3)
    if options["offload_device"] == "disk":
        options["disk_directory"] = tmp_path
    return OffloadModel(modules, **options)


def files_in(path: Path) -> list[Path]:
    # ``os.walk`` passes over a directory removed while it walks (a tier closed on its closer
    # thread removes its per-user parent last); ``rglob`` raises there.
    return [Path(d, f) for d, _, files in os.walk(path) for f in files]


def grads_of(model: OffloadModel) -> dict[str, torch.Tensor | None]:
    return {n: None if g is None else g.clone() for n, g in model.named_grads()}


def assert_grads_equal(plain: nn.Module, model: OffloadModel) -> None:
    got = list(model.named_grads())
    expected = list(plain.named_parameters())
    assert len(got) == len(expected)
    for (name, g), (_, p) in zip(got, expected, strict=True):
        assert p.grad is not None and g is not None, name
        assert torch.equal(p.grad, g.to(p.grad.device)), name


# -- bit-equal gradients ---------------------------------------------------------------------


def test_a_call_written_for_fairscale_works_unchanged() -> None:
    """fairscale's positional order (model, device, offload_device, num_slices,
    checkpoint_activation, num_microbatches) and its defaults (host memory, 3 slices)."""
    x, target = gpt_batch(4)
    cpu = torch.device("cpu")

    def grads(model: nn.Module) -> list[torch.Tensor | None]:
        torch.manual_seed(7)
        lm_loss(model(x), target).backward()
        return [p.grad for p in model.parameters()]

    positional = OffloadModel(gpt_modules(GPT.model(0)), cpu, cpu, 3, True, 2)
    keywords = OffloadModel(
        gpt_modules(GPT.model(0)),
        device=cpu,
        offload_device=cpu,
        num_slices=3,
        checkpoint_activation=True,
        num_microbatches=2,
    )
    assert all(
        a is not None and b is not None and torch.equal(a, b)
        for a, b in zip(grads(positional), grads(keywords), strict=True)
    )
    defaults = OffloadModel(model=gpt_modules(GPT.model(0)), device=cpu)
    assert defaults.offload_device == "cpu" and len(defaults.slice_ranges) == 3
    assert (defaults.checkpoint_activation, defaults.num_microbatches) == (False, 1)
    plain = GPT.model(0)
    grads(plain)
    grads(defaults)
    assert_grads_equal(plain, defaults)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_one_microbatch_equals_plain_gpt(
    device: str, offload_device: str, checkpoint_activation: bool, tmp_path: Path
) -> None:
    """Reference: the plain workload GPT, one full-batch step (dropout on).

    Loss, logits and every parameter gradient are bit-identical."""
    plain = GPT.model(0).to(device)
    x, target = (t.to(device) for t in gpt_batch(4))
    torch.manual_seed(7)
    expected_out = plain(x)
    expected = lm_loss(expected_out, target)
    expected.backward()

    model = offload(
        gpt_modules(GPT.model(0)),
        tmp_path,
        device=device,
        offload_device=offload_device,
        num_slices=3,
        checkpoint_activation=checkpoint_activation,
    )
    torch.manual_seed(7)
    out = model(x)
    loss = lm_loss(out, target)
    loss.backward()
    assert out.device == x.device
    assert torch.equal(out, expected_out)
    assert torch.equal(loss, expected)
    assert_grads_equal(plain, model)
    # Backward reran the slices' dropout, yet the generator is where the plain step left it.
    after = torch.rand(3)
    torch.manual_seed(7)
    plain(x)
    assert torch.equal(torch.rand(3), after)


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_four_microbatches_equal_reference(
    offload_device: str, checkpoint_activation: bool, tmp_path: Path
) -> None:
    """Reference: the same GPT modules run plainly, slice-major over the same 4 micro-batches
    (``reference_forward``), outputs concatenated, one loss, one backward.

    Two backward passes accumulate (gradients summed over micro-batches in the order autograd
    sums them, then added to the previous gradient as AccumulateGrad does)."""
    x, target = gpt_batch(8)
    model = offload(
        gpt_modules(GPT.model(0)),
        tmp_path,
        offload_device=offload_device,
        num_slices=4,
        num_microbatches=4,
        checkpoint_activation=checkpoint_activation,
    )
    modules = gpt_modules(GPT.model(0))
    plain = nn.Sequential(*modules)
    for step in range(2):
        torch.manual_seed(step)
        expected = lm_loss(reference_forward(modules, model.slice_ranges, x, 4), target)
        expected.backward()
        torch.manual_seed(step)
        loss = lm_loss(model(x), target)
        loss.backward()
        assert torch.equal(loss, expected)
        assert_grads_equal(plain, model)


@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_input_gradient_equals_reference(
    checkpoint_activation: bool, microbatches: int, tmp_path: Path
) -> None:
    """Reference: the plain modules, slice-major over the same micro-batches (``reference_forward``;
    with one micro-batch, the plain ``nn.Sequential``). A floating input that requires grad gets
    the same gradient; dropout and the modules' own randomness replay."""

    def layers() -> list[nn.Module]:
        torch.manual_seed(3)
        return [
            nn.Linear(6, 16),
            nn.GELU(),
            nn.Dropout(0.3),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Dropout(0.2),
            nn.Linear(16, 2),
        ]

    model = offload(
        layers(),
        tmp_path,
        num_slices=3,
        num_microbatches=microbatches,
        checkpoint_activation=checkpoint_activation,
    )
    plain = nn.Sequential(*layers())
    x = torch.randn(8, 6)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(11)
    reference_forward(list(plain), model.slice_ranges, x1, microbatches).square().sum().backward()
    torch.manual_seed(11)
    model(x2).square().sum().backward()
    assert x1.grad is not None and x2.grad is not None
    assert torch.equal(x1.grad, x2.grad)
    assert_grads_equal(plain, model)


def test_buffers_written_once_and_equal(tmp_path: Path) -> None:
    """Reference: the plain ``nn.Sequential`` with BatchNorm, one step. With
    checkpoint_activation=True each slice reruns in backward, yet running statistics and
    ``num_batches_tracked`` are updated once, as in the plain step."""

    def layers() -> list[nn.Module]:
        torch.manual_seed(5)
        return [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3)]

    plain = nn.Sequential(*layers())
    model = offload(layers(), tmp_path, num_slices=2, checkpoint_activation=True)
    x = torch.randn(6, 4)
    plain(x).sum().backward()
    model(x).sum().backward()
    assert_grads_equal(plain, model)
    state = model.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name


def norm_dropout_modules() -> list[nn.Module]:
    torch.manual_seed(5)
    return [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3)]


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_eval_between_forward_and_backward_changes_nothing(
    offload_device: str, checkpoint_activation: bool, tmp_path: Path
) -> None:
    """Reference: the plain modules, ``model.eval()`` between forward and backward. The
    recompute runs BatchNorm and Dropout in the mode the forward pass ran them in (as the
    region engine's does, docs/exactness.md guarantee 7), then leaves the modules in eval."""
    plain = nn.Sequential(*norm_dropout_modules())
    model = offload(
        norm_dropout_modules(),
        tmp_path,
        offload_device=offload_device,
        num_slices=2,
        checkpoint_activation=checkpoint_activation,
    )
    x = torch.randn(6, 4)
    for m in (plain, model):
        torch.manual_seed(1)
        loss = m(x).square().mean()
        m.eval()
        loss.backward()
    assert_grads_equal(plain, model)
    assert not any(m.training for m in model.modules())
    state = model.state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name


def test_eval_flags_come_back_when_the_recompute_raises(tmp_path: Path) -> None:
    """A recompute that raises leaves the modules in the mode backward found them in."""

    class FailsInRecompute(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if remat.is_recomputing():
                raise ValueError("recompute failed")
            return x

    modules = [nn.Linear(4, 4), nn.Dropout(0.5), FailsInRecompute(), nn.Linear(4, 2)]
    model = offload(modules, tmp_path, num_slices=1, checkpoint_activation=True)
    loss = model(torch.randn(3, 4)).sum()
    model.eval()
    with pytest.raises(ValueError, match="recompute failed"):
        loss.backward()
    assert not any(m.training for m in model.modules())


# -- the streamed optimizer ------------------------------------------------------------------


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
def test_adamw_three_steps_equal_one_plain_adamw(offload_device: str, tmp_path: Path) -> None:
    """Reference: the plain GPT with one AdamW over all its parameters, three full-batch steps.

    OffloadModel keeps one AdamW per slice, its state offloaded; parameters (via state_dict,
    gathered from the offload device), gradients and losses are bit-identical at every step."""
    plain = GPT.model(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    model = offload(gpt_modules(GPT.model(0)), tmp_path, offload_device=offload_device)
    model.configure_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    assert len(model.optimizers) == 3
    for step in range(3):
        x, target = gpt_batch(4, seed=step)
        torch.manual_seed(step)
        expected = lm_loss(plain(x), target)
        expected.backward()
        optimizer.step()
        torch.manual_seed(step)
        loss = lm_loss(model(x), target)
        loss.backward()
        assert_grads_equal(plain, model)
        model.step()
        optimizer.zero_grad()
        model.zero_grad()
        assert torch.equal(loss, expected)
        state = model.state_dict()
        for (name, p), key in zip(plain.named_parameters(), state, strict=True):
            assert torch.equal(state[key], p.detach()), f"{name}, step {step}"
        assert all(g is None for _, g in model.named_grads())


def test_state_dict_round_trip(tmp_path: Path) -> None:
    """Reference: the wrapped ``nn.Sequential``'s own ``state_dict()`` before wrapping: same
    keys, same values; ``load_state_dict`` of another model's values makes the model compute
    what that model computes."""
    modules = gpt_modules(GPT.model(0))
    expected = {k: v.clone() for k, v in nn.Sequential(*modules).state_dict().items()}
    model = offload(modules, tmp_path)
    state = model.state_dict()
    assert list(state) == list(expected)
    for key in expected:
        assert torch.equal(state[key], expected[key]), key

    other = nn.Sequential(*gpt_modules(GPT.model(1)))
    model.load_state_dict(other.state_dict())
    x, _ = gpt_batch(2)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), other.eval()(x))
    with pytest.raises(RematError, match=r"1 missing \(0\.tok_emb\.weight\)"):
        model.load_state_dict({k: v for k, v in other.state_dict().items() if "tok_emb" not in k})


# -- files, failures, lifetimes --------------------------------------------------------------


@pytest.mark.parametrize("offload_device", ["disk", "cpu"])
def test_a_forward_without_backward_frees_its_activations(
    tmp_path: Path, offload_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation loop run with grad enabled (or a loss that is skipped): each forward's
    pass, with its stored activations, goes with its output, without ``gc.collect()``. The
    saved-tensor hooks of a kept slice once held the pass, a cycle through autograd's C++
    graph that no collection could break: every such forward stayed, files and all."""
    from remat.offload_model import _autograd

    passes: list[weakref.ref[Any]] = []
    init = _autograd.Pass.__init__

    def noted(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        passes.append(weakref.ref(self))

    monkeypatch.setattr(_autograd.Pass, "__init__", noted)
    model = offload(
        gpt_modules(GPT.model(0)),
        tmp_path,
        offload_device=offload_device,
        checkpoint_activation=False,
    )
    x, _ = gpt_batch(2)
    before = len(files_in(tmp_path))
    gc.disable()
    try:
        for _ in range(3):
            out = model(x)
            assert out.grad_fn is not None
            del out
        assert len(passes) == 3 and all(p() is None for p in passes)
    finally:
        gc.enable()
    # The disk tier removes a dropped file on its worker thread: soon after, not at once.
    wait_for(lambda: len(files_in(tmp_path)) == before)


def test_no_files_left_after_close_and_after_collection(tmp_path: Path) -> None:
    """A step writes parameters, boundaries, gradients and optimizer state; ``close()`` removes
    them all, and a model that is just dropped is freed without ``gc.collect()`` and its files
    go too."""
    for explicit in (True, False):
        model = offload(gpt_modules(GPT.model(0)), tmp_path, checkpoint_activation=True)
        model.configure_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1))
        x, target = gpt_batch(2)
        loss = lm_loss(model(x), target)
        loss.backward()
        model.step()
        assert files_in(tmp_path)
        directory = model.disk_directory
        assert directory is not None
        ref = weakref.ref(model)
        if explicit:
            model.close()
        gc.disable()
        try:
            del model, loss
            assert ref() is None
        finally:
            gc.enable()
        # A dropped model's tier is closed on the tier's closer thread (NOTE [ Closed when
        # collected ] in store/disk.py), soon after: wait for it.
        wait_for(lambda d=directory: not os.path.exists(d), timeout=10)
        assert files_in(tmp_path) == []


def test_exception_in_step_leaves_no_activation_files(tmp_path: Path) -> None:
    """A module that raises in the middle of forward: the boundary activations stored so far
    are removed at once (only the three parameter files stay), gradients stay as they were, and
    the next step trains normally."""

    class Fails(nn.Module):
        armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed:
                raise ValueError("boom")
            return x

    fails = Fails()
    modules = [nn.Linear(4, 4), nn.Linear(4, 4), fails, nn.Linear(4, 4)]
    model = offload(modules, tmp_path, num_slices=3, checkpoint_activation=True)
    params = len(files_in(tmp_path))
    fails.armed = True
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 4))
    model._place.flush()  # writes already queued have run
    assert len(files_in(tmp_path)) == params
    assert all(g is None for _, g in model.named_grads())
    fails.armed = False
    model(torch.randn(2, 4)).sum().backward()
    assert all(g is not None for _, g in model.named_grads())
    model.close()
    assert files_in(tmp_path) == []


def _python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


_CHILD = """
    import os, signal, sys
    import torch
    from torch import nn
    from remat.offload_model import OffloadModel
    model = OffloadModel([nn.Linear(8, 8), nn.Linear(8, 8)], device="cpu",
                         offload_device="disk", num_slices=2, checkpoint_activation=True,
                         disk_directory=sys.argv[1])
    loss = model(torch.randn(4, 8)).sum()
    model._place.flush()
    print(model.disk_directory, len(os.listdir(model.disk_directory)), flush=True)
    if "{end}" == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_no_files_left_after_normal_exit(tmp_path: Path) -> None:
    """A process that exits normally, its model and graph still alive, removes its files."""
    done = _python(_CHILD.format(end="exit"), tmp_path)
    assert done.returncode == 0, done.stderr
    directory, count = done.stdout.split()
    assert int(count) == 4  # two parameter bundles, two boundary inputs
    assert files_in(tmp_path) == []
    assert not os.path.exists(directory)


def test_files_of_a_killed_process_are_swept(tmp_path: Path) -> None:
    """A process killed with SIGKILL leaves its files; the next OffloadModel on the same
    directory removes them, and removes its own on close."""
    done = _python(_CHILD.format(end="kill"), tmp_path)
    assert done.returncode == -signal.SIGKILL, done.stderr
    directory, count = done.stdout.split()
    assert int(count) == 4 and len(files_in(tmp_path)) == 4
    model = offload([nn.Linear(2, 2)], tmp_path, num_slices=1)
    assert not os.path.exists(directory)
    model.close()
    assert files_in(tmp_path) == []


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, bool]:
    """While ``state["full"]``, every write to a file under ``tmp_path`` fails with ENOSPC, as
    the system call would on a full disk (``os.write`` is what the disk tier writes with)."""
    state = {"full": False}
    write = os.write

    def write_or_fail(fd: int, data: Any) -> int:
        if state["full"] and os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", write_or_fail)
    return state


def test_full_disk_leaves_model_gradients_and_optimizer_state(
    tmp_path: Path, full_disk: dict[str, bool]
) -> None:
    """Reference: the plain GPT with one AdamW, two full-batch steps. OffloadModel's backward of
    step 2 fails on a full disk, then its optimizer step fails: each raises RematError naming
    ENOSPC and leaves parameters, gradients and optimizer state as they were, so that running
    them again once the disk has room gives exactly the plain run's parameters."""
    plain = GPT.model(0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    model = offload(gpt_modules(GPT.model(0)), tmp_path, checkpoint_activation=True)
    model.configure_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    for step in range(2):
        x, target = gpt_batch(4, seed=step)
        torch.manual_seed(step)
        lm_loss(plain(x), target).backward()
        optimizer.step()
        optimizer.zero_grad()

        torch.manual_seed(step)
        loss = lm_loss(model(x), target)
        if step == 1:
            model._place.flush()
            before_params, before_grads = model.state_dict(), grads_of(model)
            full_disk["full"] = True
            with pytest.raises(RematError, match="ENOSPC"):
                loss.backward(retain_graph=True)
            full_disk["full"] = False
            assert grads_of(model) == before_grads  # all None: no gradient was committed
        loss.backward()
        if step == 1:
            before_grads = grads_of(model)
            full_disk["full"] = True
            with pytest.raises(RematError, match="ENOSPC"):
                model.step()
            full_disk["full"] = False
            after = model.state_dict()
            assert all(torch.equal(after[k], v) for k, v in before_params.items())
            for (name, g), (_, h) in zip(
                grads_of(model).items(), before_grads.items(), strict=True
            ):
                assert g is not None and h is not None and torch.equal(g, h), name
        model.step()
        model.zero_grad()
    state = model.state_dict()
    for (name, p), key in zip(plain.named_parameters(), state, strict=True):
        assert torch.equal(state[key], p.detach()), name
    model.close()
    assert files_in(tmp_path) == []


def test_full_disk_at_construction_restores_the_model(
    tmp_path: Path, full_disk: dict[str, bool]
) -> None:
    """Writing the parameters fails: RematError, and the modules keep their parameters."""
    modules = [nn.Linear(3, 3), nn.Linear(3, 3)]
    expected = [p.detach().clone() for m in modules for p in m.parameters()]
    full_disk["full"] = True
    with pytest.raises(RematError, match="ENOSPC"):
        offload(modules, tmp_path, num_slices=2)
    got = [p.detach() for m in modules for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


# -- backward variants -----------------------------------------------------------------------


def test_retain_graph_backward_twice(tmp_path: Path) -> None:
    """Reference: the plain GPT, backward twice over one forward (gradients doubled by
    accumulation). With checkpoint_activation=True the slices rerun from the boundaries they
    kept; with False their graphs are gone after the first backward: a clear error."""
    plain = GPT.model(0)
    x, target = gpt_batch(2)
    torch.manual_seed(1)
    expected = lm_loss(plain(x), target)
    expected.backward(retain_graph=True)
    expected.backward()

    model = offload(gpt_modules(GPT.model(0)), tmp_path, checkpoint_activation=True)
    torch.manual_seed(1)
    loss = lm_loss(model(x), target)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_grads_equal(plain, model)

    kept = offload(gpt_modules(GPT.model(0)), tmp_path, checkpoint_activation=False)
    loss = lm_loss(kept(x), target)
    loss.backward(retain_graph=True)
    with pytest.raises(RematError, match="freed by the first backward"):
        loss.backward()


def norm_modules() -> list[nn.Module]:
    torch.manual_seed(5)
    return [nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_written_between_forward_and_backward_raises(
    offload_device: str, checkpoint_activation: bool, tmp_path: Path
) -> None:
    """Plain autograd raises ("modified by an inplace operation") for a parameter or buffer
    written in place between forward and backward; so does OffloadModel, naming it, for every
    offload device and checkpoint_activation, where backward would read the new value with
    the activations of the old (NOTE [ Written between forward and backward ])."""
    model = offload(
        norm_modules(),
        tmp_path,
        offload_device=offload_device,
        num_slices=2,
        checkpoint_activation=checkpoint_activation,
    ).eval()
    model.configure_optimizer(sgd)
    assert model.slice_ranges == (range(0, 1), range(1, 4))
    x = torch.randn(6, 4)
    model(x).square().mean().backward()

    loss = model(x).square().mean()
    model.step()  # an optimizer step before backward writes every parameter
    written = r"parameter '1\.weight' \(version \d+, now \d+\), parameter '1\.bias'"
    with pytest.raises(RematError, match=rf"slice 1 .* found 4 .*: {written}"):
        loss.backward()

    loss = model(x).square().mean()
    with torch.no_grad():
        model.module[1].running_var.mul_(4.0)  # buffers are host tensors on either device
    with pytest.raises(RematError, match=r"slice 1 .* found 1 .*: buffer '1\.running_var' \("):
        loss.backward()
    if offload_device == "cpu":
        loss = model(x).square().mean()
        with torch.no_grad():
            model.module[0].weight.clamp_(-0.1, 0.1)
        with pytest.raises(RematError, match=r"slice 0 .* found 1 .*: parameter '0\.weight' \("):
            loss.backward()


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_training_loop_with_batchnorm_writes_nothing_it_checks(
    offload_device: str, checkpoint_activation: bool, tmp_path: Path
) -> None:
    """Reference: the plain modules with SGD. The writes of a training step are not writes
    between forward and backward: BatchNorm's running statistics moved by the forward pass
    and by a training-mode forward under no_grad before backward, a second backward of a
    retained graph, ``step()`` after backward. Gradients and state equal plain's."""
    plain = nn.Sequential(*norm_modules())
    optimizer = sgd(list(plain.parameters()))
    model = offload(
        norm_modules(),
        tmp_path,
        offload_device=offload_device,
        num_slices=2,
        checkpoint_activation=checkpoint_activation,
    )
    model.configure_optimizer(sgd)
    for step in range(2):
        x, other = torch.randn(6, 4), torch.randn(5, 4)
        for m in (plain, model):
            loss = m(x).square().mean()
            with torch.no_grad():
                m(other)
            loss.backward(retain_graph=checkpoint_activation)
            if checkpoint_activation:
                loss.backward()
        assert_grads_equal(plain, model)
        optimizer.step()
        model.step()
        optimizer.zero_grad()
        model.zero_grad()
        state = model.state_dict()
        for name, value in plain.state_dict().items():
            assert torch.equal(state[name], value), f"{name}, step {step}"


def test_create_graph_is_refused(tmp_path: Path) -> None:
    model = offload([nn.Linear(3, 3), nn.Tanh()], tmp_path, num_slices=2)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RematError, match="create_graph=True"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


def tiny_modules() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2)]


def param_grads(model: OffloadModel) -> dict[str, torch.Tensor | None]:
    return {n: None if g is None else g.clone() for n, g in model.named_grads()}


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_autograd_grad_and_backward_inputs_leave_parameter_grads(
    offload_device: str, checkpoint_activation: bool, tmp_path: Path
) -> None:
    """Reference: the plain modules on the same two micro-batches. ``autograd.grad(loss, [x])``
    and ``loss.backward(inputs=[x])`` give x's gradient and leave every parameter's gradient as
    it was (None before any backward, the accumulated value after one); a plain backward after
    them accumulates exactly as plain."""
    plain = tiny_modules()
    model = offload(
        tiny_modules(),
        tmp_path,
        offload_device=offload_device,
        num_slices=3,
        num_microbatches=2,
        checkpoint_activation=checkpoint_activation,
    )
    reference = nn.Sequential(*plain)
    x = torch.randn(4, 4, requires_grad=True)

    def plain_loss() -> torch.Tensor:
        return reference_forward(plain, model.slice_ranges, x, 2).square().sum()

    expected = torch.autograd.grad(plain_loss(), [x])
    assert torch.equal(torch.autograd.grad(model(x).square().sum(), [x])[0], expected[0])
    assert all(g is None for g in param_grads(model).values())

    plain_loss().backward()
    model(x).square().sum().backward()
    assert_grads_equal(reference, model)
    before = param_grads(model)

    x.grad = None
    plain_loss().backward(inputs=[x])
    expected_x = x.grad
    x.grad = None
    model(x).square().sum().backward(inputs=[x])
    assert x.grad is not None and expected_x is not None and torch.equal(x.grad, expected_x)
    assert torch.equal(
        torch.autograd.grad(model(x).square().sum(), [x])[0],
        torch.autograd.grad(plain_loss(), [x])[0],
    )
    after = param_grads(model)
    assert after.keys() == before.keys()
    for name, g in before.items():
        got = after[name]
        assert g is not None and got is not None and torch.equal(got, g), name

    plain_loss().backward()
    model(x).square().sum().backward()
    assert_grads_equal(reference, model)


def test_backward_inputs_naming_parameters_computes_only_those(tmp_path: Path) -> None:
    """Reference: the plain modules, ``backward(inputs=[last layer's weight])``: that weight's
    gradient alone is written (by the last slice, which commits since no earlier slice runs);
    ``autograd.grad`` over a parameter, whose gradient OffloadModel cannot hand back, is a
    clear error that leaves every gradient as it was."""
    plain = tiny_modules()
    model = OffloadModel(tiny_modules(), device="cpu", offload_device="cpu", num_slices=3)
    x = torch.randn(4, 4)
    nn.Sequential(*plain)(x).square().sum().backward(inputs=[plain[3].weight])
    weight = dict(model.named_parameters())["module.3.weight"]
    model(x).square().sum().backward(inputs=[weight])
    assert weight.grad is not None and plain[3].weight.grad is not None
    assert torch.equal(weight.grad, plain[3].weight.grad)
    assert [n for n, p in model.named_parameters() if p.grad is not None] == ["module.3.weight"]

    with pytest.raises(RematError, match=r"autograd\.grad .* parameter '3\.weight'"):
        torch.autograd.grad(model(x).square().sum(), [weight])
    assert torch.equal(weight.grad, plain[3].weight.grad)
    assert [n for n, p in model.named_parameters() if p.grad is not None] == ["module.3.weight"]


def test_parameter_gradient_hooks_are_refused(tmp_path: Path) -> None:
    """A tensor hook would run on each micro-batch's part of a gradient and a post-accumulate
    hook never: a parameter carrying either is refused at forward, and at backward when the
    hook came after forward (the gradients stay as they were); without it, training works."""
    model = OffloadModel(
        tiny_modules(),
        device="cpu",
        offload_device="cpu",
        num_slices=2,
        num_microbatches=2,
        checkpoint_activation=True,
    )
    x = torch.randn(4, 4)
    weight = dict(model.named_parameters())["module.2.weight"]
    handle = weight.register_hook(lambda g: g.clamp(-0.05, 0.05))
    with pytest.raises(RematError, match=r"found register_hook on '2\.weight'.*handle\.remove"):
        model(x)
    handle.remove()
    handle = weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(RematError, match=r"found register_post_accumulate_grad_hook on '2\.w"):
        model(x)
    handle.remove()
    loss = model(x).square().sum()
    handle = weight.register_hook(lambda g: g.clamp(-0.05, 0.05))
    with pytest.raises(RematError, match=r"found register_hook on '2\.weight'"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    handle.remove()
    model(x).square().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_no_grad_forward_equals_plain(tmp_path: Path) -> None:
    """Reference: the plain GPT in eval mode under no_grad, on the same micro-batches."""
    plain = GPT.model(0).eval()
    model = offload(gpt_modules(GPT.model(0)), tmp_path, num_microbatches=2).eval()
    x, _ = gpt_batch(4)
    with torch.no_grad():
        expected = torch.cat([plain(c) for c in x.tensor_split(2)])
        assert torch.equal(model(x), expected)


# -- slices and arguments --------------------------------------------------------------------


def test_slices_balance_parameter_bytes(tmp_path: Path) -> None:
    """Contiguous slices whose largest parameter total is as small as possible."""
    sizes = [1, 1, 8, 1, 1, 1, 1, 4]
    modules = [nn.Linear(n, 16, bias=False) for n in sizes]
    model = offload(modules, tmp_path, offload_device="cpu", num_slices=3)
    assert model.slice_ranges == (range(0, 2), range(2, 3), range(3, 8))
    assert model.slice_bytes == (2 * 64, 8 * 64, 8 * 64)
    one_each = offload(modules[:3], tmp_path, offload_device="cpu", num_slices=3)
    assert one_each.slice_ranges == (range(0, 1), range(1, 2), range(2, 3))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"model": nn.Linear(2, 2)}, "expected an nn.Sequential or a list of nn.Module"),
        ({"model": [nn.Linear(2, 2), "relu"]}, "a list holding a str"),
        ({"model": []}, "at least one module"),
        ({"device": "gpu"}, "expected a device such as 'cpu'"),
        ({"device": "meta"}, "expected device 'cpu' or 'cuda"),
        ({"offload_device": "disc"}, "did you mean 'disk'"),
        ({"num_slices": 0}, "num_slices to be at least 1 and at most 2"),
        ({"num_slices": 3}, r"at most 2 \(the number of modules\), found 3"),
        ({"num_slices": 1.5}, "num_slices to be an int"),
        ({"num_microbatches": 0}, "num_microbatches to be at least 1"),
        ({"checkpoint_activation": "yes"}, "checkpoint_activation=True or False"),
        (
            {"disk_directory": "/nonexistent/zz"},
            "disk_directory only with offload_device='disk', found disk_directory="
            "'/nonexistent/zz' with offload_device='cpu'",
        ),
        (
            {"disk_directory": "/nonexistent/zz", "offload_device": torch.device("cpu")},
            "disk_directory only with offload_device='disk'",
        ),
    ],
)
def test_bad_arguments(options: dict[str, Any], match: str, tmp_path: Path) -> None:
    arguments: dict[str, Any] = {
        "model": [nn.Linear(2, 2), nn.Linear(2, 2)],
        "device": "cpu",
        "offload_device": "cpu",
        "num_slices": 2,
        **options,
    }
    model = arguments.pop("model")
    with pytest.raises(RematError, match=f"^remat: .*{match}"):
        OffloadModel(model, **arguments)
    assert files_in(tmp_path) == []


def test_cuda_unavailable_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RematError, match="CUDA is not available"):
        OffloadModel([nn.Linear(2, 2)], device="cuda", offload_device="cpu", num_slices=1)


def test_bad_uses(tmp_path: Path) -> None:
    """Inputs, outputs and calls OffloadModel does not support, each with its fix."""
    model = offload([nn.Linear(2, 2), nn.Linear(2, 2)], tmp_path, num_slices=2, num_microbatches=3)
    with pytest.raises(RematError, match=r"at least num_microbatches=3 rows .* shape \(2, 2\)"):
        model(torch.randn(2, 2))
    with pytest.raises(RematError, match="expected one tensor as input, found tuple"):
        model((torch.randn(3, 2),))  # type: ignore[arg-type]
    with pytest.raises(RematError, match="places its parameters itself"):
        model.to(torch.float64)
    with pytest.raises(RematError, match="expected optimizers, found none"):
        model.step()
    with pytest.raises(RematError, match=r"return a torch\.optim\.Optimizer"):
        model.configure_optimizer(lambda ps: None)  # type: ignore[arg-type,return-value]

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    pair = offload([nn.Linear(2, 2), Pair()], tmp_path, num_slices=1)
    with pytest.raises(RematError, match=r"module 1 .* to return one tensor, found tuple"):
        pair(torch.randn(2, 2))

    tied, other = nn.Linear(2, 2), nn.Linear(2, 2)
    other.weight = tied.weight
    with pytest.raises(RematError, match=r"1 shared across slices: 2\.weight \(slices 0 and 1\)"):
        offload([tied, nn.Tanh(), other], tmp_path, num_slices=2)


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_a_module_repeated_in_the_sequence(
    offload_device: str, checkpoint_activation: bool, tmp_path: Path
) -> None:
    """Reference: the plain ``nn.Sequential`` holding one Linear twice. Repeated inside one
    slice, it trains as the plain model, bit for bit, with the plain model's state-dict keys;
    repeated across slices, its parameters are shared across slices, which is refused."""
    torch.manual_seed(0)
    twice = nn.Linear(4, 4)
    layers = nn.Sequential(nn.Linear(4, 4), twice, nn.Tanh(), twice, nn.Linear(4, 2))
    plain = copy.deepcopy(layers)
    model = offload(
        copy.deepcopy(layers),
        tmp_path,
        offload_device=offload_device,
        num_slices=2,
        checkpoint_activation=checkpoint_activation,
    )
    assert model.slice_ranges == (range(0, 1), range(1, 5))
    x = torch.randn(6, 4)
    assert torch.equal(model(x), plain(x))
    plain(x).square().sum().backward()
    model(x).square().sum().backward()
    assert_grads_equal(plain, model)
    state = model.state_dict()
    assert list(state) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        assert torch.equal(state[name], value), name

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    with pytest.raises(RematError, match=r"2 shared across slices: 2\.weight \(slices 0 and 1\)"):
        offload([lin, nn.ReLU(), lin], tmp_path, offload_device=offload_device, num_slices=2)


def test_disk_tier_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "remat.store.disk", None)
    with pytest.raises(RematError, match="offload_device='disk', found it unavailable"):
        OffloadModel([nn.Linear(2, 2)], device="cpu", offload_device="disk", num_slices=1)


# -- the user's own loop (issue 14, 1) -------------------------------------------------------


def small_modules(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 8), nn.Linear(8, 3)]


@pytest.mark.parametrize("offload_device", ["cpu", torch.device("cpu")])
def test_fairscale_loop_on_cpu_trains_like_plain(offload_device: Any, tmp_path: Path) -> None:
    """Reference: the plain modules with one SGD over their parameters. fairscale's loop over
    ``model.parameters()`` (two backward calls accumulating, clip_grad_norm_, step, the
    optimizer's zero_grad) gives the same gradients on ``param.grad``, the same norm and the
    same parameters; ``torch.device("cpu")`` is fairscale's spelling of "cpu"."""
    plain = nn.Sequential(*small_modules())
    model = OffloadModel(small_modules(), device="cpu", offload_device=offload_device, num_slices=2)
    assert model.offload_device == "cpu"
    runs = []
    for m in (plain, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        record = []
        for step in range(2):
            torch.manual_seed(step)
            for half in range(2):  # accumulation over two backward calls
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2 * step + half))
                m(x).square().mean().backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            record += [norm] + [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad(set_to_none=True)
            record += [p.detach().clone() for p in m.parameters()]
        runs.append(record)
    assert runs[1][0] > 0
    for i, (a, b) in enumerate(zip(*runs, strict=True)):
        assert torch.equal(a, b), i
    assert grads_of(model) == {n: None for n, _ in model.named_grads()}


def test_cpu_gradients_are_param_grad(tmp_path: Path) -> None:
    """With "cpu", ``named_grads`` and ``param.grad`` are one thing: a gradient the user scales
    in place is the one ``model.step()`` applies, and ``zero_grad`` of either clears both."""
    model = OffloadModel(small_modules(), device="cpu", offload_device="cpu", num_slices=2)
    model.configure_optimizer(lambda ps: torch.optim.SGD(ps, lr=1.0))
    model(torch.randn(4, 6)).sum().backward()
    named = dict(model.named_parameters())
    for name, g in model.named_grads():
        assert g is not None and named[f"module.{name}"].grad is g
    for p in model.parameters():
        p.grad.mul_(0)  # type: ignore[union-attr]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_disk_stand_ins_raise_and_say_what_to_use(tmp_path: Path) -> None:
    """With "disk" the parameters and the per-slice optimizer state are empty stand-ins: each
    path that would silently do nothing with them raises a RematError naming the API to use."""
    model = offload(small_modules(), tmp_path, num_slices=2)
    use = "configure_optimizer.*model.step"
    with pytest.raises(RematError, match=use):
        torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    weight = model.module[0].weight
    for action in (
        lambda: weight.grad,
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        lambda: model.module.state_dict(),
        lambda: [p.sum() for _, p in model.named_parameters()],
        lambda: torch.save(weight, tmp_path / "w.pt"),
    ):
        with pytest.raises(RematError, match=use):
            action()
    model.configure_optimizer(lambda ps: torch.optim.AdamW(ps, lr=0.1))
    model.step()
    with pytest.raises(RematError, match="optimizer_state_dict"):
        torch.save(model.optimizers[0].state_dict(), tmp_path / "o.pt")
    # What to use instead works, and remat's own paths are unaffected.
    assert all(g is not None and g.shape != (0,) for _, g in model.named_grads())
    assert model.state_dict()["0.weight"].shape == (8, 6)
    model.zero_grad()
    model(torch.randn(4, 6)).sum().backward()
    model.step()


# -- checkpoints (issue 14, 2) ---------------------------------------------------------------


class Parent(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 6)
        self.body = body
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
def test_state_dict_inside_a_parent(offload_device: str, tmp_path: Path) -> None:
    """Reference: the same parent with a plain ``nn.Sequential`` body. The parent's state dict
    has its keys and values; the plain parent's state dict of other weights loads into the
    offloaded one (and back), which then computes what the plain one computes; a missing key is
    reported by torch's strict check."""
    torch.manual_seed(0)
    plain = Parent(nn.Sequential(*small_modules(0))).eval()
    torch.manual_seed(0)
    parent = Parent(
        offload(small_modules(0), tmp_path, offload_device=offload_device, num_slices=2)
    ).eval()
    expected, got = plain.state_dict(), parent.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())

    torch.manual_seed(1)
    other = Parent(nn.Sequential(*small_modules(1))).eval()
    result = parent.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.randn(3, 5)
    with torch.no_grad():
        assert torch.equal(parent(x), other(x))
    plain.load_state_dict(parent.state_dict())
    with torch.no_grad():
        assert torch.equal(plain(x), other(x))
    partial = {k: v for k, v in other.state_dict().items() if k != "body.3.bias"}
    with pytest.raises(RuntimeError, match=r'Missing key.*"body\.3\.bias"'):
        parent.load_state_dict(partial)
    result = parent.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["body.3.bias"]


def test_copy_and_pickle(tmp_path: Path) -> None:
    """A disk model cannot be copied (its parameters are in its own files): deepcopy and pickle
    raise a RematError naming the checkpoint API. A "cpu" model is copied like a module."""
    model = offload(small_modules(), tmp_path, num_slices=2)
    with pytest.raises(RematError, match="optimizer_state_dict"):
        copy.deepcopy(model)
    with pytest.raises(RematError, match="optimizer_state_dict"):
        pickle.dumps(model)
    host = OffloadModel(small_modules(), device="cpu", offload_device="cpu", num_slices=2)
    twin = copy.deepcopy(host)
    x = torch.randn(3, 6)
    with torch.no_grad():
        assert torch.equal(twin.eval()(x), host.eval()(x))


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
def test_optimizer_state_round_trip_adamw(offload_device: str, tmp_path: Path) -> None:
    """Reference: the plain modules with one AdamW, four steps. OffloadModel on disk takes two,
    saves ``state_dict()`` and ``optimizer_state_dict()`` with torch.save (AdamW's moments equal
    the plain optimizer's), a new OffloadModel loads both and takes two more: its parameters
    equal the plain run's."""
    plain = nn.Sequential(*small_modules())
    optimizer = adamw(list(plain.parameters()))
    model = offload(small_modules(), tmp_path, num_slices=2, offload_device=offload_device)
    model.configure_optimizer(adamw)

    def step(m: nn.Module, k: int) -> None:
        torch.manual_seed(k)
        m(torch.randn(4, 6, generator=torch.Generator().manual_seed(k))).square().mean().backward()

    for k in range(2):
        step(plain, k), optimizer.step(), optimizer.zero_grad()  # type: ignore[func-returns-value]
        step(model, k), model.step(), model.zero_grad()  # type: ignore[func-returns-value]
    saved = model.optimizer_state_dict()
    moments = [s for sd in saved["slices"] for s in sd["state"].values()]
    expected = [optimizer.state[p] for p in plain.parameters()]
    assert len(moments) == len(expected) == 6
    for got, want in zip(moments, expected, strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[key], want[key]), key
    torch.save({"model": model.state_dict(), "optim": saved}, tmp_path / "ckpt.pt")
    model.close()

    resumed = offload(small_modules(seed=5), tmp_path, num_slices=2, offload_device=offload_device)
    resumed.configure_optimizer(adamw)
    checkpoint = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(checkpoint["model"])
    resumed.load_optimizer_state_dict(checkpoint["optim"])
    for k in range(2, 4):
        step(plain, k), optimizer.step(), optimizer.zero_grad()  # type: ignore[func-returns-value]
        step(resumed, k), resumed.step(), resumed.zero_grad()  # type: ignore[func-returns-value]
    state = resumed.state_dict()
    for (name, p), key in zip(plain.named_parameters(), state, strict=True):
        assert torch.equal(state[key], p.detach()), name
    with pytest.raises(RematError, match="with 2 slices, found 1"):
        resumed.load_optimizer_state_dict({"slices": [None]})


_RESUME = """
    import sys, torch
    from torch import nn
    from remat.offload_model import OffloadModel
    path = sys.argv[1]
    torch.manual_seed(3)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.2), nn.Linear(8, 8), nn.Linear(8, 3)]
    model = OffloadModel(layers, device="cpu", offload_device="disk", num_slices=2,
                         disk_directory=path)
    model.configure_optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    checkpoint = torch.load(path + "/ckpt.pt")
    model.load_state_dict(checkpoint["model"])
    model.load_optimizer_state_dict(checkpoint["optim"])
    for k in range(2, 4):
        torch.manual_seed(k)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
        model(x).square().mean().backward()
        model.step()
        model.zero_grad()
    torch.save(model.state_dict(), path + "/resumed.pt")
"""


def test_save_restart_resume_in_a_fresh_process(tmp_path: Path) -> None:
    """Reference: four uninterrupted steps of an OffloadModel on disk with AdamW. The same
    model saved after two, resumed in a fresh process for two more, ends with the same
    parameters, bit for bit."""
    model = offload(small_modules(), tmp_path, num_slices=2)
    model.configure_optimizer(adamw)
    for k in range(4):
        if k == 2:
            torch.save(
                {"model": model.state_dict(), "optim": model.optimizer_state_dict()},
                tmp_path / "ckpt.pt",
            )
        torch.manual_seed(k)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
        model(x).square().mean().backward()
        model.step()
        model.zero_grad()
    done = _python(_RESUME, tmp_path)
    assert done.returncode == 0, done.stderr
    resumed = torch.load(tmp_path / "resumed.pt")
    expected = model.state_dict()
    assert list(resumed) == list(expected)
    for key, value in expected.items():
        assert torch.equal(resumed[key], value), key


# -- a failed step frees its copies (issue 14, 3) --------------------------------------------


def test_failed_step_and_backward_free_their_files(
    tmp_path: Path, full_disk: dict[str, bool]
) -> None:
    """A step (and a backward) that fails on a full disk: while the caller still holds the
    error, no file is there that was not there before the call (its new copies are gone), and the
    next step succeeds once the disk has room, equal to the plain run."""
    plain = nn.Sequential(*small_modules())
    optimizer = adamw(list(plain.parameters()))
    model = offload(small_modules(), tmp_path, num_slices=2, checkpoint_activation=True)
    model.configure_optimizer(adamw)
    for k in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
        torch.manual_seed(k)
        plain(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.manual_seed(k)
        loss = model(x).square().mean()
        model._place.flush()
        if k == 1:
            before = set(files_in(tmp_path))
            full_disk["full"] = True
            with pytest.raises(RematError, match="ENOSPC") as failed_backward:
                loss.backward(retain_graph=True)
            assert set(files_in(tmp_path)) == before
            full_disk["full"] = False
        loss.backward()
        if k >= 1:
            before = set(files_in(tmp_path))
            full_disk["full"] = True
            with pytest.raises(RematError, match="ENOSPC") as failed_step:
                model.step()
            # A subset, not equality: a file that backward dropped while a prefetch still read
            # it goes when that read ends, which may fall inside the failed step.
            assert set(files_in(tmp_path)) <= before, "the failed step's copies are left"
            full_disk["full"] = False
        model.step()
        model.zero_grad()
    assert failed_backward.value is not None and failed_step.value is not None
    state = model.state_dict()
    for (name, p), key in zip(plain.named_parameters(), state, strict=True):
        assert torch.equal(state[key], p.detach()), name


def test_offload_device_other_torch_device_is_refused() -> None:
    with pytest.raises(RematError, match=r"torch\.device\('cpu'\), found device\(type='meta'\)"):
        OffloadModel(
            [nn.Linear(2, 2)], device="cpu", offload_device=torch.device("meta"), num_slices=1
        )  # type: ignore[arg-type]


@pytest.mark.parametrize("offload_device", ["cpu", "disk"])
def test_clip_grad_norm_equals_torch(offload_device: str, tmp_path: Path) -> None:
    """Reference: ``torch.nn.utils.clip_grad_norm_`` over the plain modules' parameters.
    ``model.clip_grad_norm_`` (slice by slice on disk) returns the same total norm and leaves
    the same gradients, for a norm above and below ``max_norm`` and for the inf norm."""
    plain = nn.Sequential(*small_modules())
    model = offload(small_modules(), tmp_path, num_slices=2, offload_device=offload_device)
    for m in (plain, model):
        torch.manual_seed(0)
        m(torch.randn(4, 6, generator=torch.Generator().manual_seed(0))).square().sum().backward()
    for max_norm, norm_type in ((0.05, 2.0), (1e3, 2.0), (0.01, float("inf"))):
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
        got = model.clip_grad_norm_(max_norm, norm_type)
        assert torch.equal(got, expected)
        assert_grads_equal(plain, model)
