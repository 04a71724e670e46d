"""Built-in training workloads shared by the test suite and the benchmarks.

Every memory policy in remat (keep, offload, recompute) has to be checked against the same
question: does it change the numbers, and how much activation memory does it save? Answering
that needs models whose shape is fixed, whose parameters and batches are reproducible from a
seed, and whose layers exercise the awkward cases (dropout, BatchNorm, attention, skip
connections). This module provides four such models, each in three sizes:

* ``small``: tiny models whose training step takes milliseconds, for unit tests.
* ``medium``: about a tenth of ``bench``, where memory matters and a step takes a fraction of
  a second on two cores: the default of ``remat bench``.
* ``bench``: roughly 1 GiB of activations per training step, for benchmarks.

Models are initialised randomly and batches are synthetic, so nothing is downloaded. All four
models use dropout, so a policy that recomputes a forward pass without restoring the RNG state
produces visibly different gradients.

Example::

    from remat.workloads import get_workload

    wl = get_workload("gpt", "small")
    model = wl.model(seed=0)
    inputs, target = wl.batch(seed=0)
    loss = wl.loss_fn(model(inputs), target)
    loss.backward()
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import RematError, did_you_mean
from ._base import Workload
from .convnet import ConvBlock as ConvBlock
from .convnet import ConvNet as ConvNet
from .convnet import ConvNetConfig as ConvNetConfig
from .convnet import Downsample as Downsample
from .convnet import _convnet_workload
from .gpt import GPT as GPT
from .gpt import CausalSelfAttention as CausalSelfAttention
from .gpt import GPTBlock as GPTBlock
from .gpt import GPTConfig as GPTConfig
from .gpt import _gpt_workload
from .mlp import MLP as MLP
from .mlp import MLPBlock as MLPBlock
from .mlp import MLPConfig as MLPConfig
from .mlp import _mlp_workload
from .unet import UNet as UNet
from .unet import UNetBlock as UNetBlock
from .unet import UNetConfig as UNetConfig
from .unet import _unet_workload

__all__ = ["SIZES", "WORKLOAD_NAMES", "Workload", "get_workload"]

WORKLOAD_NAMES: tuple[str, ...] = ("gpt", "mlp", "convnet", "unet")
"""Names accepted by :func:`get_workload`."""

SIZES: tuple[str, ...] = ("small", "medium", "bench")
"""Sizes accepted by :func:`get_workload`."""


def _unknown(kind: str, value: str, choices: tuple[str, ...]) -> RematError:
    return RematError(
        f"remat: unknown {kind} {value!r}{did_you_mean(value, choices)}; expected one of: "
        f"{', '.join(sorted(choices))}"
    )


# ---------------------------------------------------------------------------------------------
# Registry


_FACTORIES: dict[str, Callable[[str], Workload]] = {
    "gpt": _gpt_workload,
    "mlp": _mlp_workload,
    "convnet": _convnet_workload,
    "unet": _unet_workload,
}


def get_workload(name: str, size: str = "small") -> Workload:
    """Return the built-in workload ``name`` at ``size``.

    Raises:
        RematError: ``name`` is not in :data:`WORKLOAD_NAMES` or ``size`` is not in
            :data:`SIZES`.
    """
    if name not in _FACTORIES:
        raise _unknown("workload", name, WORKLOAD_NAMES)
    if size not in SIZES:
        raise _unknown("size", size, SIZES)
    return _FACTORIES[name](size)
