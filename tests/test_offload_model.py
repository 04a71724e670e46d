"""OffloadModel: slices trained from host memory or disk, bit-identical to a plain run.

Every comparison is ``torch.equal``. The reference of each test is stated in its docstring; in
general (NOTE [ OffloadModel design ] 6) it is the same modules run plainly on the same
micro-batches in the same slice-major order, outputs concatenated, which for one micro-batch is
the plain model itself.
"""

from __future__ import annotations

import errno
import gc
import os
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

from remat.bench.offload_model import gpt_modules
from remat.errors import RematError
from remat.offload_model import OffloadModel
from remat.workloads import get_workload

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
    return OffloadModel(modules, disk_directory=tmp_path, **options)


def files_in(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


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


def test_no_files_left_after_close_and_after_collection(tmp_path: Path) -> None:
    """A step writes parameters, boundaries, gradients and optimizer state; ``close()`` removes
    them all, and a model that is just dropped is freed without ``gc.collect()`` and removes
    them too."""
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
        assert files_in(tmp_path) == []
        assert not os.path.exists(directory)


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


def test_create_graph_is_refused(tmp_path: Path) -> None:
    model = offload([nn.Linear(3, 3), nn.Tanh()], tmp_path, num_slices=2)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(RematError, match="create_graph=True"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


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


def test_disk_tier_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "remat.store.disk", None)
    with pytest.raises(RematError, match="offload_device='disk', found it unavailable"):
        OffloadModel([nn.Linear(2, 2)], device="cpu", offload_device="disk", num_slices=1)
