"""``@skippable``: modules that hand tensors to later layers of an ``nn.Sequential``.

A skippable module's ``forward`` is a generator. ``yield stash(name, tensor)`` hands a tensor
over; ``x = yield pop(name)`` receives one that an earlier layer stashed::

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return self.pool(x)

    @skippable(pop=["skip"])
    class Up(nn.Module):
        def forward(self, x):
            skip = yield pop("skip")
            return torch.cat([self.up(x), skip], dim=1)

The same model runs as a plain ``nn.Sequential`` (the tensors go through a dictionary of the
current thread) or in a :class:`~remat.pipe.Pipe`, which carries them between partitions through
portals (``portal.py``). Names are declared up front so that :func:`verify_skippables` can check
the wiring of a whole model before it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, ClassVar, TypeAlias, TypeVar

from torch import Tensor, nn

from ...errors import RematError
from ..microbatch import Batch, TensorOrTensors
from .namespace import DEFAULT, Namespace
from .tracker import current_skip_tracker

__all__ = ["Skippable", "pop", "skippable", "stash", "verify_skippables"]

Key = tuple[Namespace, str]


class stash:
    """``yield stash(name, tensor)``: hand ``tensor`` to the layer that pops ``name``."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Tensor | None) -> None:
        self.name = name
        self.tensor = tensor


class pop:
    """``tensor = yield pop(name)``: receive the tensor an earlier layer stashed as ``name``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


Command: TypeAlias = stash | pop

# The type of a skippable ``forward``: yields commands, receives popped tensors, returns output.
SkipGenerator: TypeAlias = Generator[Command, Tensor | None, TensorOrTensors]

S = TypeVar("S", bound="Skippable")


def _label(key: Key) -> str:
    ns, name = key
    return repr(name) if ns is DEFAULT else f"{name!r} in {ns!r}"


class Skippable(nn.Module):
    """Base of the classes :func:`skippable` makes; wraps one instance of the user's class.

    The wrapped module is ``self.module``, so parameter names gain a ``module.`` component.
    """

    module_cls: ClassVar[type[nn.Module]]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module!r})"

    def namespaced(self, name: str) -> Key:
        return self.namespaces.get(name, DEFAULT), name

    def stashable(self) -> Iterator[Key]:
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterator[Key]:
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self: S, ns: Namespace, *, only: Iterable[str] | None = None) -> S:
        """Put this module's skip names (or ``only`` these) in ``ns``; returns ``self``.

        Pair a stash and its pop by isolating both in the same namespace::

            ns = Namespace()
            nn.Sequential(Down().isolate(ns), Middle(), Up().isolate(ns))
        """
        names = set(only) if only is not None else self.stashable_names | self.poppable_names
        unknown = sorted(names - self.stashable_names - self.poppable_names)
        if unknown:
            raise RematError(
                f"remat: {type(self).__name__}.isolate(only=...) names {unknown}, which it "
                f"neither stashes nor pops; it declares stash={sorted(self.stashable_names)} "
                f"and pop={sorted(self.poppable_names)}."
            )
        for name in names:
            self.namespaces[name] = ns
        return self

    def dispatch(
        self,
        input: TensorOrTensors,
        handle_stash: Callable[[str, Tensor | None], None],
        handle_pop: Callable[[str], Tensor | None],
    ) -> TensorOrTensors:
        """Run the wrapped module, answering each command its generator yields."""
        generator = self.module(input)
        if not isinstance(generator, Generator):
            out: TensorOrTensors = generator
            return out
        try:
            command = next(generator)
            while True:
                if isinstance(command, stash):
                    handle_stash(command.name, command.tensor)
                    command = generator.send(None)
                elif isinstance(command, pop):
                    command = generator.send(handle_pop(command.name))
                else:
                    raise RematError(
                        f"remat: {type(self).__name__}.forward yielded "
                        f"{type(command).__name__}; a skippable forward yields only "
                        "stash(name, tensor) or pop(name)."
                    )
        except StopIteration as stop:
            result: TensorOrTensors = stop.value
            return result

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        cls = type(self).__name__
        tracker = current_skip_tracker()
        batch = Batch(_tensors(input, f"{cls}, a skippable layer, takes"))
        # Every declared pop is taken at entry, so that the portal is tied to the input.
        poppable = {name: tracker.load(batch, ns, name) for ns, name in self.poppable()}
        stashed: dict[str, Tensor | None] = {}

        def handle_stash(name: str, tensor: Tensor | None) -> None:
            if name not in self.stashable_names:
                raise RematError(
                    f"remat: {cls} stashed {name!r}, but it declares "
                    f"stash={sorted(self.stashable_names)}; add {name!r} to @skippable(stash=...)."
                )
            if name in stashed:
                raise RematError(f"remat: {cls} stashed {name!r} twice in one forward.")
            stashed[name] = tensor

        def handle_pop(name: str) -> Tensor | None:
            if name not in self.poppable_names:
                raise RematError(
                    f"remat: {cls} popped {name!r}, but it declares "
                    f"pop={sorted(self.poppable_names)}; add {name!r} to @skippable(pop=...)."
                )
            if name not in poppable:
                raise RematError(f"remat: {cls} popped {name!r} twice in one forward.")
            return poppable.pop(name)

        output = self.dispatch(batch.value, handle_stash, handle_pop)
        missing = sorted(self.stashable_names - stashed.keys())
        if missing:
            raise RematError(
                f"remat: {cls} declares stash={sorted(self.stashable_names)} but did not stash "
                f"{missing} in this forward; every declared name must be stashed each time."
            )
        if poppable:
            raise RematError(
                f"remat: {cls} declares pop={sorted(self.poppable_names)} but did not pop "
                f"{sorted(poppable)} in this forward; every declared name must be popped."
            )
        out = Batch(_tensors(output, f"{cls}, a skippable layer, returned"))
        for ns, name in self.stashable():
            tracker.save(out, ns, name, stashed[name])
        return out.value


def _tensors(value: Any, what: str) -> TensorOrTensors:
    """``value`` where it is a tensor or a tuple (a list is passed on as one), what a
    skippable layer passes on; a ``RematError`` saying ``what`` was found otherwise: a dict
    would be taken for the tuple of its keys, a string for its characters."""
    if isinstance(value, (Tensor, tuple)):
        return value
    if isinstance(value, list):
        return tuple(value)
    raise RematError(
        f"remat: {what} a {type(value).__name__}; a skippable layer takes and returns a "
        "tensor or a tuple of tensors, as the layers of a Pipe do. Pass the tensors as a "
        "tuple, and other values as attributes of the layer."
    )


def skippable(
    stash: Iterable[str] = (), pop: Iterable[str] = ()
) -> Callable[[type[nn.Module]], type[Skippable]]:
    """Declare the skip names a module class stashes and pops; see the module docstring."""
    stash_names = frozenset(stash)
    pop_names = frozenset(pop)
    for names, what in ((stash_names, "stash"), (pop_names, "pop")):
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise RematError(f"remat: @skippable({what}=...) takes names as str, got {bad!r}.")

    def decorate(cls: type[nn.Module]) -> type[Skippable]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise RematError(
                f"remat: @skippable decorates an nn.Module subclass, got {cls!r}; put it on "
                "the class definition."
            )
        return type(
            cls.__name__,
            (Skippable,),
            {
                "module_cls": cls,
                "stashable_names": stash_names,
                "poppable_names": pop_names,
                "__qualname__": cls.__qualname__,
                "__module__": cls.__module__,
                "__doc__": cls.__doc__,
            },
        )

    return decorate


def verify_skippables(module: nn.Sequential) -> None:
    """Check the skip wiring of ``module`` and raise one error that lists every problem.

    Each stashed name must be popped by exactly one later layer, each popped name must be
    stashed by exactly one earlier layer; names repeated by blocks need namespaces
    (``.isolate(Namespace())``). A skippable nested inside a layer (a residual block written
    as ``nn.Sequential(Stash(), ..., Pop())``) must have its partner inside the same layer: a
    pipeline carries skips between the ``nn.Sequential``'s own layers only.
    """
    problems: list[str] = []
    stashed: dict[Key, int] = {}
    popped: dict[Key, int] = {}
    inner = [inner_pairs(layer) for layer in module]
    for index, layer in enumerate(module):
        problems += _nested_problems(index, layer, inner[index])
        if not isinstance(layer, Skippable):
            continue
        where = f"layer {index} ({type(layer).__name__})"
        for key in layer.poppable():
            if key in popped:
                problems.append(
                    f"{_label(key)} is popped twice: by layer {popped[key]} and by {where}."
                )
            elif key not in stashed:
                problems.append(
                    f"{_label(key)} is popped by {where} but no earlier layer stashes it."
                )
            popped[key] = index
        for key in layer.stashable():
            if key in stashed:
                problems.append(
                    f"{_label(key)} is stashed twice: by layer {stashed[key]} and by {where}."
                )
            stashed[key] = index
    for key, index in stashed.items():
        if key not in popped or popped[key] < index:
            problems.append(
                f"{_label(key)} is stashed by layer {index} ({type(module[index]).__name__}) but "
                "no later layer pops it."
            )
    for index, keys in enumerate(inner):
        for key in sorted(keys & (stashed.keys() | popped.keys()), key=lambda k: k[1]):
            problems.append(
                f"{_label(key)} is stashed and popped inside layer {index} "
                f"({type(module[index]).__name__}), and also by layer "
                f"{stashed.get(key, popped.get(key))}; give the pair inside layer {index} its "
                "own namespace with .isolate(Namespace())."
            )
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise RematError(
            f"remat: the skip connections of this nn.Sequential are wired wrongly "
            f"({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n{listing}\n"
            "Fix: declare each name in @skippable(stash=..., pop=...), stash it once before the "
            "layer that pops it, and give each repeated stash/pop pair its own namespace with "
            ".isolate(Namespace())."
        )


def _nested(layer: nn.Module) -> Iterator[tuple[str, Skippable]]:
    """The skippables inside ``layer`` (not ``layer`` itself), with their paths in it."""
    for path, sub in layer.named_modules():
        if sub is not layer and isinstance(sub, Skippable):
            yield path, sub


def inner_pairs(layer: nn.Module) -> set[Key]:
    """The skips that skippables nested in ``layer`` both stash and pop: they stay inside it."""
    stashes = {key for _, sub in _nested(layer) for key in sub.stashable()}
    pops = {key for _, sub in _nested(layer) for key in sub.poppable()}
    return stashes & pops


def _nested_problems(index: int, layer: nn.Module, inner: set[Key]) -> list[str]:
    """Stashes and pops nested in top-level layer ``index`` whose partner is not inside it."""
    problems: list[str] = []
    for path, sub in _nested(layer):
        for verb, partner, keys in (
            ("stashed", "popped", sub.stashable()),
            ("popped", "stashed", sub.poppable()),
        ):
            for key in keys:
                if key not in inner:
                    problems.append(
                        f"{_label(key)} is {verb} by {type(sub).__name__} at {index}.{path}, "
                        f"nested in layer {index} ({type(layer).__name__}), but not {partner} "
                        f"inside that layer; a pipeline carries skips only between the "
                        f"nn.Sequential's own layers: make {index}.{path} a layer of the "
                        "nn.Sequential itself (unwrap the module that holds it), or keep the "
                        "stash and its pop inside one layer."
                    )
    return problems
