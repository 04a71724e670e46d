"""Apply the region engine to modules: one module, the submodules of a model, a sequence.

:func:`checkpoint_wrapper` makes every call of a module a checkpointed region without changing
the module's class, its ``state_dict`` keys or its parameter names: it sets an instance-level
``forward`` that calls the class's ``forward`` inside :func:`~remat.checkpoint`. That object
holds the module weakly, so the module and its wrapper form no reference cycle and the module is
freed as soon as the last outside reference goes, without waiting for ``gc.collect()``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from copy import deepcopy
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

from ._compile import module_names
from .checkpoint import RegionOptions, run_region
from .errors import RematError, did_you_mean
from .graph import names_modules
from .policies import save_matmuls

__all__ = ["apply", "checkpoint_sequential", "checkpoint_wrapper", "unapply"]

Where: TypeAlias = (
    "type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool] "
    "| Callable[[nn.Module], bool] | Sequence[str]"
)
Mode: TypeAlias = Literal["full", "selective"]
_MODES = ("full", "selective")


def forward_signature(module: nn.Module | None) -> inspect.Signature:
    """The signature of ``module``'s class ``forward``, bound to it: what
    ``inspect.signature(module.forward)`` gives without remat. An instance-level forward that
    remat installs shows it, since callers choose arguments by it (Hugging Face's
    ``generate`` builds ``position_ids`` from the attention mask only for a forward that takes
    them, and its ``Trainer`` drops the dataset columns the forward does not name)."""
    if module is None:
        return inspect.Signature(
            [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        )
    return inspect.signature(types.MethodType(type(module).forward, module))


class _CheckpointedForward:
    """The instance-level ``forward`` of a wrapped module."""

    __slots__ = ("module_ref", "name", "offload_to_cpu", "options")

    @property
    def __signature__(self) -> inspect.Signature:
        return forward_signature(self.module_ref())

    def __init__(
        self, module: nn.Module, offload_to_cpu: bool, options: RegionOptions, name: str = ""
    ) -> None:
        self.module_ref = weakref.ref(module)
        self.offload_to_cpu = offload_to_cpu
        self.options = options
        self.name = name  # qualified name in the model given to apply(), for reports

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module_ref()
        if module is None:
            raise RematError("remat: the module of this checkpointed forward was freed.")
        if torch.compiler.is_compiling():
            # See [ Regions under torch.compile ] in _compile.py.
            from ._compile import lower

            options = self.options
            return lower(
                functools.partial(type(module).forward, module),
                args,
                kwargs,
                policy=options.policy,
                preserve_rng_state=options.preserve_rng_state,
                context_fn=options.context_fn,
                offload_inputs=self.offload_to_cpu,
                module=self.name,
                # Not cached here: an attribute set while Dynamo traces fails its guard at the
                # next call, and every model with regions compiled twice.
                names=(self.name or type(module).__name__, module_names(module)),
            )
        forward = types.MethodType(type(module).forward, module)
        names = None
        root = self.name or type(module).__name__
        if self.options.policy is not None and names_modules(self.options.policy):
            prefix = f"{self.name}." if self.name else ""
            names = {id(m): prefix + name if name else root for name, m in module.named_modules()}
        return run_region(forward, args, kwargs, self.options, self.offload_to_cpu, names, root)

    def __deepcopy__(self, memo: dict[int, Any]) -> _CheckpointedForward:
        # copy.deepcopy(model) copies the module before its __dict__, so the copy is in memo.
        module = self.module_ref()
        copy = memo.get(id(module))
        if not isinstance(copy, nn.Module):
            raise RematError(
                "remat: a checkpointed forward can be deep-copied only together with its module; "
                "deep-copy the module (or the model that contains it)."
            )
        # The options too, as pickling copies them: a policy with state of its own (a plan's
        # per-op decisions, which count the ops each block followed) is the copy's own.
        options = deepcopy(self.options, memo)
        return _CheckpointedForward(copy, self.offload_to_cpu, options, self.name)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle by reference to the module; unpickling rebuilds the weak reference.
        return (_rebind, (self.module_ref(), self.offload_to_cpu, self.options, self.name))


def _rebind(module: nn.Module, offload_to_cpu: bool, options: RegionOptions, name: str) -> Any:
    return _CheckpointedForward(module, offload_to_cpu, options, name)


def checkpoint_wrapper(
    module: nn.Module, offload_to_cpu: bool = False, **options: Any
) -> nn.Module:
    """Make every call of ``module`` a checkpointed region, in place, and return it.

    The module keeps its class, its ``state_dict`` keys and its parameter names; keyword
    arguments, non-tensor inputs and outputs pass through. Under ``torch.no_grad()`` it runs
    plainly. Forward hooks registered on the module run outside the region, once.

    Args:
        module: the module to wrap.
        offload_to_cpu: keep the region's inputs in host memory until backward (asynchronous
            copies into pinned memory on accelerators; nothing to do for CPU tensors). Also
            positional, as in fairscale's ``checkpoint_wrapper(module, offload_to_cpu)``.
        **options: options of :func:`~remat.checkpoint` (``preserve_rng_state``,
            ``context_fn``, ``determinism_check``, ``early_stop``, ``debug``).
    """
    if not isinstance(module, nn.Module):
        raise RematError(
            f"remat.checkpoint_wrapper: expected an nn.Module, got {type(module).__name__}. "
            "For a plain function use remat.checkpoint(fn, *inputs)."
        )
    if not isinstance(offload_to_cpu, bool):
        ported = (
            " torch's checkpoint_wrapper takes its checkpoint_impl second; remat's region "
            "engine is always non-reentrant: drop that argument."
            if type(offload_to_cpu).__name__ == "CheckpointImpl"
            else ""
        )
        raise RematError(
            f"remat.checkpoint_wrapper: offload_to_cpu must be True or False, got "
            f"{offload_to_cpu!r}.{ported}"
        )
    if not _callable(module):
        raise RematError(
            f"remat.checkpoint_wrapper: this {type(module).__name__} has no forward: it is never "
            f"called, its model calls the modules in it, so wrapping it would checkpoint "
            f"nothing. Wrap those modules instead{_children_hint(module)}."
        )
    parsed = RegionOptions.parse("remat.checkpoint_wrapper", options)
    current = module.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        raise RematError(
            f"remat.checkpoint_wrapper: this {type(module).__name__} is already checkpointed; "
            "wrap each module once."
        )
    if current is not None:
        raise RematError(
            f"remat.checkpoint_wrapper: this {type(module).__name__} has an instance-level "
            "forward (set by another wrapper or by assignment); remat wraps the class's forward. "
            "Remove the instance attribute first (del module.forward)."
        )
    module.forward = _CheckpointedForward(module, offload_to_cpu, parsed)
    return module


def is_wrapped(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_wrapper` has wrapped ``module``."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def _matcher(where: Any, model: nn.Module) -> Callable[[str, nn.Module], bool]:
    if isinstance(where, type):
        if not issubclass(where, nn.Module):
            raise RematError(
                f"remat.apply: where={where.__name__} is not an nn.Module class; pass a module "
                "class, a tuple of classes, a predicate (name, module) -> bool or a list of "
                "qualified names."
            )
        return lambda name, module: isinstance(module, where)
    if isinstance(where, tuple) and where and all(isinstance(w, type) for w in where):
        bad = [w.__name__ for w in where if not issubclass(w, nn.Module)]
        if bad:
            raise RematError(f"remat.apply: where holds classes that are not modules: {bad}.")
        return lambda name, module: isinstance(module, where)
    if isinstance(where, (list, tuple)) and all(isinstance(w, str) for w in where):
        names = dict(model.named_modules())
        unknown = [w for w in where if w not in names]
        if unknown:
            hints = "".join(f"\n  {w!r}{did_you_mean(w, list(names))}" for w in unknown)
            raise RematError(
                f"remat.apply: {len(unknown)} of the names in where match no submodule of "
                f"{type(model).__name__}:{hints}\nNames are qualified as in "
                "model.named_modules(), e.g. 'blocks.0'."
            )
        wanted = set(where)
        return lambda name, module: name in wanted
    if isinstance(where, nn.Module):  # callable, but its forward is no predicate
        name = next((n for n, m in model.named_modules() if m is where), None)
        by_name = f"[{name!r}] (its qualified name)" if name is not None else "a list of names"
        raise RematError(
            f"remat.apply: where is a module instance ({type(where).__name__}); where selects "
            f"submodules by class, predicate or name. Pass {type(where).__name__} for every "
            f"module of its class, or {by_name} for this one."
        )
    if callable(where):
        one_argument = _takes_one_argument(where)
        if not one_argument and not _takes_two_arguments(where):
            raise RematError(
                f"remat.apply: the where predicate takes {_signature(where)}; it must take "
                "(name, module) or, as torch's check_fn, (module), and return True or False."
            )

        def predicate(name: str, module: nn.Module) -> bool:
            answer = where(module) if one_argument else where(name, module)
            if not isinstance(answer, bool):
                raise RematError(
                    f"remat.apply: the where predicate returned {answer!r} for {name!r}; it must "
                    "return True or False."
                )
            return answer

        return predicate
    hint = ""
    if isinstance(where, str):
        hint = f" For one module by name, wrap it in a list: where=[{where!r}]."
    elif isinstance(where, list) and where and all(isinstance(w, type) for w in where):
        hint = " For several classes, pass a tuple: where=(A, B)."
    raise RematError(
        f"remat.apply: where must be a module class, a tuple of classes, a predicate "
        f"(name, module) -> bool or a list of qualified names; got {type(where).__name__}." + hint
    )


def _hf_checkpointing_on(model: nn.Module) -> str | None:
    """The qualified name of the first module of ``model`` on which Hugging Face's gradient
    checkpointing is on (``""`` for the model itself), or ``None``.

    ``gradient_checkpointing_enable()`` sets ``gradient_checkpointing = True`` on the instances
    it checkpoints; reading the instance's dict skips ``nn.Module.__getattr__``, which raises
    for every module without it (this runs before every training forward of a model that
    :func:`remat.hf.enable` set up).
    """
    if not any(_hf_flag(m) for m in model.modules()):  # no names built where none is on
        return None
    name: str = next(name for name, m in model.named_modules() if _hf_flag(m))
    return name


def _hf_flag(module: nn.Module) -> bool:
    return module.__dict__.get("gradient_checkpointing") is True


def refuse_hf_checkpointing(caller: str, model: nn.Module, why: str, fix: str = "") -> None:
    """Raise if Hugging Face's gradient checkpointing is on in ``model``: ``why`` says what
    it would do to ``caller``'s work, ``fix`` (after the call that turns it off) what else."""
    hf_on = _hf_checkpointing_on(model)
    if hf_on is not None:
        raise RematError(
            f"{caller}: Hugging Face gradient checkpointing is on in {type(model).__name__} "
            f"({hf_on or 'the model'}); {why}. Call {_hf_disable(model)} first{fix}."
        )


def _refuse_hf_checkpointing(model: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook of a Hugging Face model that remat set up (:func:`apply`,
    ``Plan.apply``, :func:`remat.hf.enable`): Hugging Face's gradient checkpointing turned on
    afterwards (``gradient_checkpointing_enable()``) would wrap each layer in torch's checkpoint
    around or inside remat's regions, and replace a policy's or a plan's decisions by
    whole-layer recompute without a sign; the training forward refuses instead."""
    if not (model.training and torch.is_grad_enabled()):
        return
    hf_on = _hf_checkpointing_on(model)
    if hf_on is not None:
        raise RematError(
            f"remat: Hugging Face gradient checkpointing was turned on in "
            f"{type(model).__name__} ({hf_on or 'the model'}) after remat was set up on it; it "
            f"would recompute every layer around remat's own decisions. Call "
            f"{_hf_disable(model)}, or undo remat's (remat.unapply(model), "
            "remat.hf.disable(model)) to use Hugging Face's instead."
        )


def _hf_disable(model: nn.Module) -> str:
    """The call that turns Hugging Face's checkpointing off, by the name the installed
    transformers documents (5.24 renamed it, and warns on the old name)."""
    if callable(getattr(model, "activation_checkpointing_disable", None)):
        return "model.activation_checkpointing_disable()"
    return "model.gradient_checkpointing_disable()"


def guard_hf_checkpointing(model: nn.Module) -> None:
    """Give a Hugging Face model (one with a ``gradient_checkpointing`` flag on a module)
    the forward pre-hook :func:`_refuse_hf_checkpointing`, once."""
    hf = any(
        "gradient_checkpointing" in m.__dict__ or hasattr(type(m), "gradient_checkpointing")
        for m in model.modules()
    )
    if hf and not any(h is _refuse_hf_checkpointing for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_refuse_hf_checkpointing)


def unguard_hf_checkpointing(model: nn.Module) -> None:
    """Remove :func:`_refuse_hf_checkpointing` from ``model`` and the modules inside it."""
    for module in model.modules():
        remove_hooks(module, lambda hook: hook is _refuse_hf_checkpointing)


def remove_hooks(module: nn.Module, matches: Callable[[Callable[..., Any]], bool]) -> int:
    """Remove every forward pre-hook and forward hook of ``module`` that ``matches``, with what
    ``nn.Module`` keeps about it (``with_kwargs``, ``always_call``); return how many."""
    removed = 0
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key in [k for k, hook in hooks.items() if matches(hook)]:
            del hooks[key]
            removed += 1
            for extra in (
                module._forward_pre_hooks_with_kwargs,
                module._forward_hooks_with_kwargs,
                module._forward_hooks_always_called,
            ):
                extra.pop(key, None)
    return removed


def apply(
    model: nn.Module,
    where: Where | None = None,
    *,
    check_fn: Callable[[nn.Module], bool] | None = None,
    every: int = 1,
    mode: Mode | None = None,
    selective: str | int | None = None,
    offload_to_cpu: bool = False,
    **options: Any,
) -> nn.Module:
    """Checkpoint the submodules of ``model`` that ``where`` selects, in place; return ``model``.

    ``where`` is a module class, a tuple of classes, a predicate ``(qualified_name, module) ->
    bool``, a one-argument predicate ``check_fn(module) -> bool`` (the contract of torch's
    ``apply_activation_checkpointing``, also accepted as ``check_fn=``) or a list of qualified
    names (as in ``model.named_modules()``; ``""`` is the model itself). When a module and one
    inside it both match, only the outer one is wrapped: a region inside a region would
    recompute twice for nothing. Options are those of :func:`checkpoint_wrapper`.

    Args:
        every: checkpoint only every ``every``-th matching module, in the order of
            ``model.named_modules()``: the ``every``-th, the ``2 * every``-th, ... (torchtitan's
            selective activation checkpointing by layers).
        mode: torchtitan's activation-checkpointing modes. ``"full"`` checkpoints every
            matching module. ``"selective"`` with ``selective="op"`` keeps the outputs of
            matrix multiplies and attention and recomputes the rest (policy
            :func:`~remat.policies.save_matmuls`, torchtitan's op-level SAC); with
            ``selective=N`` (an int, or its string as in torchtitan's config) it checkpoints
            every N-th matching module fully.
        selective: ``"op"`` (the default with ``mode="selective"``) or a number of layers;
            given without ``mode="selective"``, it raises.

    Undo with :func:`unapply`. Example::

        remat.apply(gpt, GPTBlock)                          # every block
        remat.apply(gpt, lambda name, m: name in {"blocks.0", "blocks.2"})
        remat.apply(gpt, lambda m: isinstance(m, GPTBlock), every=2)
        remat.apply(gpt, GPTBlock, mode="selective", selective="op")
    """
    if not isinstance(model, nn.Module):
        raise RematError(f"remat.apply: expected an nn.Module, got {type(model).__name__}.")
    if check_fn is not None:
        if where is not None:
            raise RematError(
                "remat.apply: pass where or check_fn, not both (check_fn is where's "
                "one-argument form)."
            )
        if not callable(check_fn):
            raise RematError(
                f"remat.apply: check_fn must be a callable (module) -> bool, got "
                f"{type(check_fn).__name__}."
            )
        where = check_fn
    if where is None:
        raise RematError(
            "remat.apply: say which modules to checkpoint: a module class, a predicate, a list "
            "of names, or check_fn=lambda module: ..."
        )
    every, options = _mode_options(mode, selective, every, options)
    RegionOptions.parse("remat.apply", dict(options))
    if not isinstance(offload_to_cpu, bool):
        raise RematError(
            f"remat.apply: offload_to_cpu must be True or False, got {offload_to_cpu!r}."
        )
    refuse_hf_checkpointing(
        "remat.apply", model, "it would recompute each layer around or inside remat's regions"
    )
    match = _matcher(where, model)
    selected: list[tuple[str, nn.Module]] = []
    containers: list[tuple[str, nn.Module]] = []  # matched, but never called themselves
    for name, module in model.named_modules():
        if any(_inside(name, outer) for outer, _ in selected):
            continue
        if match(name, module):
            if _callable(module):
                selected.append((name, module))
            else:
                containers.append((name, module))
    # A container the selection reaches through the modules in it (a predicate that matches
    # them too) is fine; one it does not would be a region that never runs.
    empty = [
        (name, module)
        for name, module in containers
        if not any(_inside(inner, name) for inner, _ in selected)
    ]
    if empty:
        name, module = empty[0]
        raise RematError(
            f"remat.apply: where={_describe(where)} selects {name or '(the model)'!r}, a "
            f"{type(module).__name__}, which has no forward: it is never called, its model "
            f"calls the modules in it, so checkpointing it would save nothing. Select those "
            f"modules instead{_children_hint(module, name)}."
        )
    if not selected:
        raise RematError(
            f"remat.apply: where={_describe(where)} matches no module of "
            f"{type(model).__name__}; module classes present: {_classes(model)}."
        )
    if every > 1:
        selected = selected[every - 1 :: every]
        if not selected:
            raise RematError(
                f"remat.apply: every={every} selects none of the matching modules; fewer than "
                f"{every} match. Pass a smaller every."
            )
    taken = [name or "(the model)" for name, module in selected if "forward" in module.__dict__]
    if taken:
        raise RematError(
            f"remat.apply: {len(taken)} selected modules already have an instance-level forward "
            f"(already checkpointed, or patched): {taken}. Nothing was wrapped; select other "
            "modules or remove those wrappers first."
        )
    for name, module in selected:
        checkpoint_wrapper(module, offload_to_cpu=offload_to_cpu, **options)
        forward = module.__dict__["forward"]
        assert isinstance(forward, _CheckpointedForward)
        forward.name = name
    guard_hf_checkpointing(model)
    return model


def unapply(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` and :func:`checkpoint_wrapper` on ``model`` and every module inside
    it, in place; return ``model``.

    Each wrapped module gets its class's ``forward`` back; parameters, buffers and
    ``state_dict`` keys never changed, so nothing else moves. What :meth:`remat.Plan.apply`
    set up goes too: its regions, policies, offload scopes and segments, and so does what
    :func:`remat.hf.enable` set up. Modules that are not wrapped are left alone.
    """
    if not isinstance(model, nn.Module):
        raise RematError(f"remat.unapply: expected an nn.Module, got {type(model).__name__}.")
    from .hf import remove_cache_hooks  # both build on this module
    from .planning.apply import undo_all

    undo_all(model)  # wrapped modules among the rest
    remove_cache_hooks(model)  # remat.hf.enable's
    unguard_hf_checkpointing(model)
    return model


def _takes_one_argument(function: Callable[..., Any]) -> bool:
    """Whether ``function`` takes exactly one positional argument (torch's ``check_fn``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the documented form
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    return len(positional) == 1 and not variadic


def _takes_two_arguments(function: Callable[..., Any]) -> bool:
    """Whether ``function`` can be called with two positional arguments (or has no
    signature to tell, as a builtin)."""
    try:
        inspect.signature(function).bind("", None)
    except ValueError:
        return True
    except TypeError:
        return False
    return True


def _signature(function: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return "(?)"


def _mode_options(
    mode: Any, selective: Any, every: Any, options: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """``every`` and the region options that torchtitan's ``mode`` and ``selective`` mean."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise RematError(f"remat.apply: every must be an int >= 1, got {every!r}.")
    if (mode is None or mode == "full") and selective is not None:
        raise RematError(
            f"remat.apply: selective={selective!r} applies with mode='selective' (torchtitan's "
            f"selective_ac_option), and mode is {mode!r}, under which it would be ignored. Pass "
            "mode='selective' as well, or every=N for every N-th module."
        )
    if mode is None or mode == "full":
        return every, options
    if mode != "selective":
        raise RematError(
            f"remat.apply: mode must be 'full' or 'selective', got {mode!r}"
            f"{did_you_mean(str(mode), _MODES)}."
        )
    if selective is None or selective == "op":
        if "policy" in options:
            raise RematError(
                "remat.apply: mode='selective' with selective='op' sets the policy "
                "(remat.policies.save_matmuls); drop policy= or drop the mode."
            )
        return every, {**options, "policy": save_matmuls}
    layers = int(selective) if isinstance(selective, str) and selective.isdigit() else selective
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise RematError(
            f"remat.apply: selective must be 'op' or a number of layers >= 1, got {selective!r}."
        )
    if every != 1:
        raise RematError(
            "remat.apply: mode='selective' with a number of layers is every=N; pass one of them."
        )
    return layers, options


def _callable(module: nn.Module) -> bool:
    """Whether ``module``'s class has a ``forward`` (``nn.ModuleList`` and ``nn.ModuleDict``
    do not: a model calls the modules in them)."""
    return type(module).forward is not nn.Module.forward


def _children_hint(module: nn.Module, name: str = "") -> str:
    """What to select instead of ``module``: ``" (remat.apply(model, Block))"`` when its
    children share a class, else some of their qualified names; ``""`` when it has none."""
    children = list(module.named_children())
    if not children:
        return ""
    classes = {type(child) for _, child in children}
    if len(classes) == 1:
        return f" (remat.apply(model, {next(iter(classes)).__name__}))"
    prefix = f"{name}." if name else ""
    names = [f"{prefix}{child}" for child, _ in children[:3]]
    return f" (names such as {names})"


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def _describe(where: Any) -> str:
    if isinstance(where, type):
        return where.__name__
    if isinstance(where, tuple) and all(isinstance(w, type) for w in where):
        return "(" + ", ".join(w.__name__ for w in where) + ")"
    return repr(where) if not callable(where) else getattr(where, "__name__", "predicate")


def _classes(model: nn.Module) -> str:
    names = sorted({type(m).__name__ for m in model.modules()})
    return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")


def checkpoint_sequential(
    functions: nn.Sequential | Sequence[Callable[..., Any]] | Iterable[nn.Module],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **options: Any,
) -> Any:
    """Run a sequence of modules in ``segments`` pieces, each but the last a checkpointed region.

    The semantics of ``torch.utils.checkpoint.checkpoint_sequential``: the modules are split into
    ``segments`` runs of ``len // segments`` modules, the last run taking the remainder; every
    run but the last is checkpointed, since backward needs the last run's tensors at once.

    Args:
        functions: an ``nn.Sequential`` or a list of modules or functions, applied in order.
        segments: how many pieces, from 1 to the number of functions.
        input: the input of the first function; each function's output feeds the next.
        use_reentrant: as in :func:`~remat.checkpoint` (fourth, as torch's signature has it).
        **options: options of :func:`~remat.checkpoint`.
    """
    parsed = RegionOptions.parse(
        "remat.checkpoint_sequential", {**options, "use_reentrant": use_reentrant}
    )
    if isinstance(functions, (nn.Sequential, list, tuple, nn.ModuleList)):
        # Every position, a module held twice at both: ``children()`` yields each module once
        # and would skip the second (torch's checkpoint_sequential does, pytorch 2.13).
        steps = list(functions)
    else:
        raise RematError(
            "remat.checkpoint_sequential: functions must be an nn.Sequential or a list of "
            f"modules or functions, got {type(functions).__name__}."
        )
    not_callable = [i for i, f in enumerate(steps) if not callable(f)]
    if not_callable:
        raise RematError(
            f"remat.checkpoint_sequential: functions at positions {not_callable} are not callable."
        )
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise RematError(f"remat.checkpoint_sequential: segments must be an int, got {segments!r}.")
    if not 1 <= segments <= len(steps):
        raise RematError(
            f"remat.checkpoint_sequential: segments must be between 1 and the number of "
            f"functions ({len(steps)}), got {segments}. Pick a value in that range."
        )
    size = len(steps) // segments
    for start in range(0, size * (segments - 1), size):
        input = run_region(_run_steps, (steps[start : start + size], input), {}, parsed)
    return _run_steps(steps[size * (segments - 1) :], input)


def _run_steps(steps: Sequence[Callable[..., Any]], x: Any) -> Any:
    for step in steps:
        x = step(x)
    return x


def sharded(model: nn.Module) -> nn.Module | None:
    """The first module of ``model`` (itself included) that FSDP shards, FSDP2's
    ``fully_shard`` or FSDP1's ``FullyShardedDataParallel``; ``None`` where none is. FSDP's
    classes are read from the modules imported already (a sharded model has imported them),
    so a build of torch without ``torch.distributed`` needs no special case."""
    classes = tuple(
        found
        for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
        for attr in ("FSDPModule", "FullyShardedDataParallel")
        if isinstance(found := getattr(sys.modules.get(name), attr, None), type)
    )
    if not classes:
        return None
    return next((m for m in model.modules() if isinstance(m, classes)), None)


def refuse_sharded(caller: str, model: nn.Module) -> None:
    """Raise a :class:`RematError` where FSDP has sharded ``model`` or a module in it: the
    planner measures, and a plan names, the parameters of the model as it was built."""
    found = sharded(model)
    if found is not None:
        raise RematError(
            f"{caller}: the model is sharded by FSDP ({type(found).__name__}); a plan is "
            "made and set up on the model before sharding, whose parameters it measures and "
            "names. Plan, and apply the plan, first; then call fully_shard."
        )


def unwrapped(model: Any) -> Any:
    """The module inside the wrappers ``torch.compile``, ``DistributedDataParallel`` and
    ``nn.DataParallel`` put around a model (through any nesting of them), or ``model`` itself.

    The planner measures and sets up that module, so a plan's paths are the same with and
    without the wrappers, and its measured steps run no collective (ranks that measured
    differently would run different numbers of steps). A compiled wrapper traces the module
    again at its next call, since Dynamo guards on the forwards that a plan replaces."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    while True:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, wrappers):
            model = model.module
        else:
            return model
