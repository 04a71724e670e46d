"""Capture the ambient state a region ran under, and replay it for the recompute.

A recompute must see what the forward pass saw, or it produces other values: the random
number generators of the CPU and of every accelerator the region may use, the autocast
settings, and the default device of factory functions. This module captures them when a region
starts and re-enters them around its recompute, restoring the backward pass's own state after.

Accelerator generators are captured for every device of every accelerator type that is
initialised when the region starts, not only the devices of the region's inputs: a region that
moves CPU inputs to a GPU and runs dropout there replays exactly too.

NOTE [ Explicit generators ]

Code that draws from a ``torch.Generator`` of its own (``torch.rand(shape, generator=g)``: a
module that holds a generator for its noise, a sampler seeded apart from the model, a thread
that must not share the default generator) draws from a state the default generators do not
hold. A region engine that replays only the default ones re-runs such a draw from wherever
``g`` stands in backward: the recompute draws other numbers, the gradients are wrong without an
error, and ``g`` ends two draws ahead of a plain run (torch's checkpoint does both).

1. The walk that lists what a region reaches (``_guard.Reachable``: its arguments, the
   attributes of its modules, closures, defaults and the globals its code loads) lists the
   generators there too. A forward pass captures each one's state before the function runs.
2. Its recompute sets each listed generator to that state, runs, and sets it back to the state
   it had before the recompute: the region draws what its forward pass drew, and code after
   backward draws what it would in a plain run.
3. A generator the walk cannot see (an attribute of a plain object, one a helper function
   returns) is caught where hidden writes are ([ When the guard runs ] 2 in ``_guard.py``): the
   first recompute of every function runs under the write guard, which looks at the generator
   of every random op; one that is neither listed nor a default generator raises a
   ``CheckpointError`` after that recompute, before its numbers reach a gradient.

Python objects are not the key: the dispatcher hands a mode a new ``torch.Generator`` object
for the same generator, so generators are told apart by the C++ generator they wrap
(``_cdata``). With ``preserve_rng_state=False`` nothing is replayed, as for the default
generators (see [ Random ops not replayed ]). The graph engine replays each random op from the
state of the generator it names, so it needs none of this.

NOTE [ Random ops not replayed ]

``preserve_rng_state=False`` promises that the region draws no random numbers, so that its
forward pass can skip capturing the generators. A region that draws anyway (dropout left in a
block, a noise layer) recomputes with other numbers than its forward pass drew: the saved
tensors it rebuilds are not the ones the forward pass used, and the gradients are of no step
that ran. Torch's checkpoint gives those gradients without a word. remat checks the promise
where it already looks at every op: the first recompute of each function runs under the write
guard ([ When the guard runs ] 2 in ``_guard.py``), which notes the first op tagged
``nondeterministic_seeded`` that it runs, from any generator; the recompute then raises a
``CheckpointError`` naming that op, before the rebuilt tensors reach a gradient. A recompute
that stops early before the draw (``early_stop``) rebuilt nothing from it and passes. Like a
hidden write, a draw that a function makes only on some later call (a data-dependent branch)
is not seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .errors import CheckpointError

__all__: list[str] = []

# Accelerator types whose generators remat captures, looked up lazily on ``torch``.
_ACCELERATOR_TYPES = ("cuda", "xpu", "mtia", "mps")


def _accelerator_module(device_type: str) -> ModuleType | None:
    module = getattr(torch, device_type, None)
    return module if isinstance(module, ModuleType) else None


# (privateuse1 backend name, [(type, its module)]): the accelerator modules to probe, found once
# per backend name (they are looked up by name on ``torch``, which costs more than the probe).
_probes: tuple[str, list[tuple[str, ModuleType]]] | None = None


def _initialized_accelerators() -> tuple[str, ...]:
    """Accelerator types whose runtime is initialised (a cheap check: nothing is initialised)."""
    global _probes
    custom = torch._C._get_privateuse1_backend_name()
    if _probes is None or _probes[0] != custom:
        names = [*_ACCELERATOR_TYPES, *([custom] if custom != "privateuseone" else [])]
        found_modules = [(n, _accelerator_module(n)) for n in names]
        _probes = (custom, [(n, m) for n, m in found_modules if m is not None])
    found = []
    for name, module in _probes[1]:
        is_initialized = getattr(module, "is_initialized", None)
        if callable(is_initialized):
            if is_initialized():
                found.append(name)
        elif name == "mps" and torch.backends.mps.is_available():
            found.append(name)
    return tuple(found)


_CPU = torch.device("cpu")


def _default_device() -> torch.device:
    """``torch.get_default_device()``, without its Python where no mode can change it: no
    torch-function mode is active (``torch.set_default_device`` and ``with torch.device(...)``
    both push one) and no global device context is set."""
    if torch._C._len_torch_function_stack() == 0 and (
        getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None) is None
    ):
        return _CPU
    return torch.get_default_device()


def _device_states(device_type: str) -> list[torch.Tensor]:
    module = _accelerator_module(device_type)
    assert module is not None
    count = module.device_count() if hasattr(module, "device_count") else 1
    if device_type == "mps":
        return [module.get_rng_state()]
    return [module.get_rng_state(i) for i in range(count)]


def _set_device_states(device_type: str, states: list[torch.Tensor]) -> None:
    module = _accelerator_module(device_type)
    assert module is not None
    if device_type == "mps":
        module.set_rng_state(states[0])
        return
    for index, state in enumerate(states):
        module.set_rng_state(state, index)


# One device type's autocast settings: (device type, enabled, dtype, cache enabled).
_Autocast = tuple[str, bool, torch.dtype, bool]


def _autocast(device_types: tuple[str, ...]) -> tuple[_Autocast, ...]:
    cache = torch.is_autocast_cache_enabled()
    return tuple(
        (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), cache) for t in device_types
    )


def generator_key(generator: torch.Generator) -> int:
    """The C++ generator ``generator`` wraps: [ Explicit generators ]."""
    return int(generator._cdata)  # type: ignore[attr-defined]


def is_default_generator(generator: torch.Generator) -> bool:
    """Whether ``generator`` is one of PyTorch's default generators (the CPU's or an
    accelerator device's), which :class:`Generators` captures."""
    key = generator_key(generator)
    if generator.device.type == "cpu":
        return key == generator_key(torch.default_generator)
    module = _accelerator_module(generator.device.type)
    defaults = getattr(module, "default_generators", ()) if module is not None else ()
    return any(key == generator_key(d) for d in defaults)


# Explicit generators with a state each: [ Explicit generators ].
GeneratorStates = list[tuple[torch.Generator, torch.Tensor]]


def set_generators(states: GeneratorStates) -> GeneratorStates:
    """Set each generator to its state; the states they had, for setting them back."""
    before = [(generator, generator.get_state()) for generator, _ in states]
    for generator, state in states:
        generator.set_state(state)
    return before


def unlisted_generator(generator: torch.Generator, what: str) -> CheckpointError:
    """The error for a recompute of a ``what`` that drew from a generator its forward pass
    did not capture ([ Explicit generators ] 3)."""
    return CheckpointError(
        f"remat: the recompute of a {what} drew random numbers from a torch.Generator (on "
        f"{generator.device}) that its forward pass did not find, so its state could not be "
        "replayed: the recompute drew other numbers than the forward pass, and the gradients "
        "would be wrong. remat finds generators among a region's arguments, its modules' "
        "attributes, closures, default arguments and the globals its code loads: keep the "
        "generator in one of those places (e.g. self.generator = g on a module inside it), or "
        "give the region a policy (remat.policies.recompute_everything replays each random op "
        "from its own generator's state)."
    )


def unreplayed_draw(op: torch._ops.OpOverload, what: str) -> CheckpointError:
    """The error for a recompute of a ``what`` made with ``preserve_rng_state=False`` that
    drew random numbers ([ Random ops not replayed ])."""
    return CheckpointError(
        f"remat: the recompute of a {what} drew random numbers ({op}), but the region was made "
        "with preserve_rng_state=False, so the generators were not replayed: the recompute "
        "drew other numbers than its forward pass did, and the gradients would differ from a "
        "plain run's (torch's checkpoint returns them without an error). Pass "
        "preserve_rng_state=True (the default); False is for regions that draw no random "
        "numbers (put dropout in eval mode, or outside the region)."
    )


@dataclass(frozen=True)
class Generators:
    """The states of the CPU generator and of every device of the initialised accelerators."""

    cpu: torch.Tensor
    devices: tuple[tuple[str, list[torch.Tensor]], ...]
    accelerators: tuple[str, ...]

    @classmethod
    def capture(cls, accelerators: tuple[str, ...] | None = None) -> Generators:
        if accelerators is None:
            accelerators = _initialized_accelerators()
        devices = tuple((t, _device_states(t)) for t in accelerators)
        return cls(torch.get_rng_state(), devices, accelerators)

    def same(self, other: Generators) -> bool:
        """Whether both hold the same states."""
        if not torch.equal(self.cpu, other.cpu):
            return False
        mine, theirs = dict(self.devices), dict(other.devices)
        return mine.keys() == theirs.keys() and all(
            len(mine[t]) == len(theirs[t])
            and all(torch.equal(a, b) for a, b in zip(mine[t], theirs[t], strict=True))
            for t in mine
        )


@dataclass(frozen=True)
class Ambient:
    """The state one forward run of a region saw, as needed to replay it."""

    cpu_rng: torch.Tensor | None
    device_rng: tuple[tuple[str, list[torch.Tensor]], ...]
    accelerators: tuple[str, ...]
    autocast: tuple[_Autocast, ...]
    default_device: torch.device
    # The generators were, when the run started, as the previous run of the same recompute
    # left them: its replay leaves them right, and none is captured (see [ Linked calls ]).
    continues: bool = False

    @classmethod
    def capture(
        cls,
        preserve_rng_state: bool,
        generators: Generators | None = None,
        continues: bool = False,
    ) -> Ambient:
        """The state now. ``generators``: the generators, if the caller captured them just
        before; ``continues``: capture none, the run continues them (see :attr:`continues`)."""
        if generators is not None:
            accelerators = generators.accelerators
        else:
            accelerators = _initialized_accelerators()
        if continues:
            generators = None
        elif generators is None and preserve_rng_state:
            generators = Generators.capture(accelerators)
        return cls(
            cpu_rng=generators.cpu if generators is not None else None,
            device_rng=generators.devices if generators is not None else (),
            accelerators=accelerators,
            autocast=_autocast(("cpu", *accelerators)),
            default_device=_default_device(),
            continues=continues,
        )

    @property
    def replays_rng(self) -> bool:
        """Whether the recompute replays random state (``preserve_rng_state``)."""
        return self.cpu_rng is not None or self.continues

    def check_forward_done(self) -> None:
        """Raise if the region initialised an accelerator whose generator it could not capture."""
        if self.cpu_rng is None and not self.continues:
            return
        started = [t for t in _initialized_accelerators() if t not in self.accelerators]
        if started:
            raise CheckpointError(
                f"remat: the checkpointed region initialised {', '.join(started)} for the first "
                "time, so the random state it used there could not be captured for the "
                f"recompute. Initialise it before the first region (e.g. torch.{started[0]}."
                "init()), or pass preserve_rng_state=False if the region draws no random numbers."
            )

    def replay(self, restore: bool = True) -> AbstractContextManager[None]:
        """Run a block under this state; the caller's generators are restored afterwards
        (with ``restore=False``, the caller restores them, see :func:`restoring_rng`)."""
        autocast_now = _autocast(("cpu", *self.accelerators))
        device_now = _default_device()
        if (
            self.cpu_rng is None
            and self.autocast == autocast_now
            and device_now == self.default_device
        ):
            return nullcontext()  # nothing to set: a linked call that continues, most often
        return self._replay(restore, autocast_now, device_now)

    @contextmanager
    def _replay(
        self, restore: bool, autocast_now: tuple[_Autocast, ...], device_now: torch.device
    ) -> Iterator[None]:
        with ExitStack() as stack:
            if self.cpu_rng is not None:
                if restore:
                    stack.enter_context(restoring_rng(self.device_rng))
                torch.set_rng_state(self.cpu_rng)
                for device_type, states in self.device_rng:
                    _set_device_states(device_type, states)
            for want, now in zip(self.autocast, autocast_now, strict=True):
                if want != now:
                    device_type, enabled, dtype, cache_enabled = want
                    stack.enter_context(
                        torch.autocast(
                            device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled
                        )
                    )
            if device_now != self.default_device:
                stack.enter_context(self.default_device)
            yield


@contextmanager
def restoring_rng(device_rng: tuple[tuple[str, Any], ...]) -> Iterator[None]:
    """Put the CPU generator, and those of ``device_rng``'s device types, back on exit."""
    cpu = torch.get_rng_state()
    devices = [(t, _device_states(t)) for t, _ in device_rng]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for device_type, states in devices:
            _set_device_states(device_type, states)
