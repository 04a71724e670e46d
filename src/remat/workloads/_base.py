"""The :class:`Workload` record that every built-in workload fills in."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Workload"]


@dataclass(frozen=True)
class Workload:
    """A model family, a synthetic batch generator and a loss, at one size.

    Attributes:
        name: Workload name, one of :data:`WORKLOAD_NAMES`.
        size: Size name, one of :data:`SIZES`.
        build: Builds the model, drawing its random initialisation from torch's current
            global RNG. Prefer :meth:`model`, which seeds and isolates the RNG.
        make_batch: Draws an ``(input, target)`` pair from the given generator.
        loss_fn: Maps ``(model output, target)`` to a scalar loss.
        block_types: The repeated block classes; "checkpoint every block" wraps each
            outermost instance of these.
        description: One line describing the shape of the model and batch.
        autocast: The dtype the training loop runs forward and loss in, under
            ``torch.autocast`` (backward outside it, as in torch's recipe), or ``None`` for
            the model's own dtype. See :meth:`forward_context`.
    """

    name: str
    size: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[Tensor, Tensor]]
    loss_fn: Callable[[Any, Tensor], Tensor]
    block_types: tuple[type[nn.Module], ...]
    description: str
    blocks_chain: bool = False
    """Whether each block's output is the next block's input, with nothing in between (what
    ``checkpoint_sequential`` over the blocks needs)."""
    autocast: torch.dtype | None = None

    def with_autocast(self, dtype: torch.dtype) -> Workload:
        """This workload with its forward and loss under ``torch.autocast`` in ``dtype``."""
        name = str(dtype).removeprefix("torch.")
        return dataclasses.replace(
            self,
            autocast=dtype,
            description=f"{self.description}; forward and loss under autocast ({name})",
        )

    def forward_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The context the training loop runs forward and loss in on ``device``:
        ``torch.autocast`` with :attr:`autocast`, or one that does nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)

    def model(self, seed: int = 0) -> nn.Module:
        """Build the model on the CPU with parameters determined by ``seed``.

        The global CPU RNG is seeded for the duration of the build and restored afterwards,
        so calling this does not disturb the caller's random stream. The model is returned
        in training mode; move it to another device with ``.to()`` if needed.
        """
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.default_generator.manual_seed(seed)
            module = self.build()
        module.train()
        return module

    def batch(self, seed: int = 0) -> tuple[Tensor, Tensor]:
        """Return the ``(input, target)`` pair determined by ``seed``, on the CPU."""
        generator = torch.Generator().manual_seed(seed)
        return self.make_batch(generator)

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return ``(qualified name, module)`` for every block of ``model`` in forward order.

        Blocks are the outermost submodules that are instances of :attr:`block_types`; a
        block nested inside another block is not listed separately. They are listed in
        registration order, which for the built-in models is the order ``forward`` calls them.
        """
        found: list[tuple[str, nn.Module]] = []
        prefixes: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(prefix) for prefix in prefixes):
                continue
            if isinstance(module, self.block_types):
                found.append((name, module))
                prefixes.append(f"{name}." if name else "")
        return found
