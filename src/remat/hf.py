"""Hugging Face ``transformers`` models in one call: ``remat.hf.enable(model)``.

A ``PreTrainedModel`` names the classes it must never split across devices in
``_no_split_modules``: its decoder or encoder layer, and sometimes its embeddings. The layers
are those of the named classes that sit in an ``nn.ModuleList`` (the stack the model loops
over); each becomes a remat region, with the region engine (``policy=None``), a policy (the
graph engine) or a memory budget (the planner). Nothing here imports ``transformers``: the
model carries everything this module reads.

NOTE [ Key/value caches in training ]

A layer given a key/value cache (``use_cache=True``, ``cache`` as transformers 5.24 names it,
``past_key_values`` before it, ``layer_past``) appends its keys and values to that cache object
in forward. The object is Python state, not a tensor, so remat's write guard cannot keep a
recompute from appending a second time, and a region refuses such a call in forward (see
``_cache.py``). Hugging Face's own gradient checkpointing drops the cache in
each layer while training, with a warning; ``enable`` does the same, through a forward
pre-hook on each layer: while the layer runs with gradients enabled, ``use_cache`` becomes
``False`` and the cache argument becomes ``None``, and a warning is logged once per layer
class (logger ``remat.hf``). That includes evaluation mode with gradients (attribution,
fine-tuning with dropout off), where a region recomputes all the same: keeping the cache
there raised in backward, or with SDPA attention appended the keys twice to the caller's
cache, silently. Under ``torch.no_grad()`` (generation) nothing is recomputed and the cache
passes through untouched. The model's config is not changed. A cache that already holds keys
and values for the layer (prefix tuning passes trainable ones; a continued sequence) is not
dropped but refused: without it the layer would attend to other keys, and the prefix would
never train (``_holds_keys``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import modules
from ._cache import cache_arguments, signature
from .errors import RematError
from .modules import unwrapped
from .policies import Policy

__all__ = ["disable", "enable", "layer_classes"]

logger = logging.getLogger("remat.hf")

_warned: set[str] = set()


def layer_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The repeated layer classes of a Hugging Face model, found from ``_no_split_modules``.

    Every class that the model or one of its submodules names in ``_no_split_modules`` and
    that has an instance inside an ``nn.ModuleList`` (the stack of layers the model loops
    over); embeddings, also named there, are not in such a list and are left out.
    """
    named: set[str] = set()
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            named.update(names)
    if not named:
        raise RematError(
            f"remat.hf: {type(model).__name__} names no layer classes (no _no_split_modules on "
            "it or its submodules); pass them yourself: remat.hf.enable(model, "
            "layers=(MyLayer,))."
        )
    found = {
        type(child)
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for child in module.children()
        if type(child).__name__ in named
    }
    if not found:
        raise RematError(
            f"remat.hf: none of the classes {sorted(named)} that {type(model).__name__} names in "
            "_no_split_modules is in an nn.ModuleList; pass the layer classes yourself: "
            "remat.hf.enable(model, layers=(MyLayer,))."
        )
    return tuple(sorted(found, key=lambda cls: cls.__name__))


def enable(
    model: nn.Module,
    policy: Policy | None = None,
    *,
    budget: int | float | str | None = None,
    layers: modules.Where | None = None,
    example_inputs: Any = None,
    loss_fn: Callable[..., Any] | None = None,
    **options: Any,
) -> nn.Module:
    """Make every layer of a Hugging Face model a remat region, in place; return the model.

    Args:
        model: a ``transformers`` model (any ``nn.Module`` whose layers ``_no_split_modules``
            names, or any module with ``layers=`` given).
        policy: ``None`` re-runs each whole layer in backward (the region engine, as Hugging
            Face's ``gradient_checkpointing_enable()``); a policy of :mod:`remat.policies`
            decides per op what each layer keeps, offloads or recomputes (the graph engine).
        budget: instead of a policy, the memory the step may use, planned by ``remat.fit``
            (bytes, or a fraction of the plain step's activation memory); needs
            ``example_inputs``, the keyword arguments of a training call (with ``labels``).
        example_inputs: with ``budget``, the model's inputs for the measured step.
        loss_fn: with ``budget``, output -> loss; default ``output.loss``, the loss the model
            computes from ``labels``.
        layers: the modules to make regions, in any form :func:`remat.apply` takes (a class, a
            tuple of classes, a predicate or qualified names); default:
            :func:`layer_classes`, or, with ``budget`` and a model that names none (ALBERT),
            the blocks :func:`remat.plan` finds: runs of layers in an ``nn.ModuleList``, or
            the layer the forward calls again and again.
        **options: options of :func:`remat.apply` (``offload_to_cpu``, ``determinism_check``,
            ...); with ``budget``, options of :func:`remat.fit` (``tiers``, ``repeats``,
            ``points``, ``segments``).

    Key/value caches are dropped in training, as Hugging Face does for its gradient
    checkpointing (see NOTE [ Key/value caches in training ]). Undo with :func:`disable`.
    """
    if not isinstance(model, nn.Module):
        raise RematError(f"remat.hf.enable: expected an nn.Module, got {type(model).__name__}.")
    compiled, model = model, unwrapped(model)  # compiled, DDP: the module inside
    if budget is not None and policy is not None:
        raise RematError(
            "remat.hf.enable: got both policy= and budget=; a budget lets the planner choose "
            "the policy. Pass one of them."
        )
    if policy is not None and not callable(policy):
        hint = (
            f" A budget goes by keyword: remat.hf.enable(model, budget={policy!r})."
            if isinstance(policy, (int, float, str))
            else ""
        )
        raise RematError(
            "remat.hf.enable: policy must be a remat policy, a callable (ctx, op, *args, "
            f"**kwargs) -> Decision (see remat.policies), got {type(policy).__name__} "
            f"({policy!r}).{hint}"
        )
    if budget is None and (example_inputs is not None or loss_fn is not None):
        given = [
            n
            for n, v in (("example_inputs", example_inputs), ("loss_fn", loss_fn))
            if v is not None
        ]
        raise RematError(
            f"remat.hf.enable: got {'= and '.join(given)}= without budget=; they are the "
            "planner's, which measures a step only to meet a budget. Pass budget= too (bytes "
            'or a fraction, e.g. budget="50%"), or drop them.'
        )
    modules.refuse_hf_checkpointing(
        "remat.hf.enable", model, "each layer would be recomputed twice"
    )
    if _enabled(model):
        raise RematError(
            f"remat.hf.enable: remat is already enabled on {type(model).__name__}; call "
            "remat.hf.disable(model) first to change the policy."
        )
    where: modules.Where | None = layers
    if layers is None:
        try:
            where = layer_classes(model)
        except RematError:
            if budget is None:
                raise
            where = None  # the planner finds the blocks (``_fit``)
    if budget is not None:
        _fit(model, where, budget, example_inputs, loss_fn, options)
        return compiled
    before = {id(m) for m in model.modules() if modules.is_wrapped(m)}
    if policy is not None:
        options["policy"] = policy
    modules.apply(model, where, **options)
    for m in model.modules():
        if modules.is_wrapped(m) and id(m) not in before:
            _hook(m)
    return compiled


def _hook(layer: nn.Module) -> None:
    """Put the key/value cache hook on ``layer``. Its class's signature is read now: read in a
    call that ``torch.compile`` traces, the cache filled there would fail Dynamo's guard at the
    next call and compile the model again."""
    signature(type(layer))
    layer.register_forward_pre_hook(_drop_cache, with_kwargs=True)


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable`: every layer it made a region, or that its budget's plan set up
    (policies, offload scopes, segments), runs plainly again; return the model."""
    if not isinstance(model, nn.Module):
        raise RematError(f"remat.hf.disable: expected an nn.Module, got {type(model).__name__}.")
    compiled, model = model, unwrapped(model)
    from .planning.apply import forget_applied, undo_around_blocks, undo_option, undo_segment_on

    found = 0
    for m in model.modules():
        if modules.remove_hooks(m, lambda hook: hook is _drop_cache):
            found += 1
            undo_option(m)  # its region, or what a budget's plan set up (see _fit)
            undo_segment_on(m)
    if found:
        undo_segment_on(model)  # a graph-engine segment closes at the end of the model's forward
        undo_option(model)
        undo_around_blocks(model)  # the count of the layers' calls, the held output's check
        modules.unguard_hf_checkpointing(model)
        forget_applied(model)
    if not found:
        raise RematError(
            f"remat.hf.disable: no layer of {type(model).__name__} was enabled by "
            "remat.hf.enable; nothing to undo."
        )
    return compiled


def remove_cache_hooks(model: nn.Module) -> int:
    """Take :func:`enable`'s key/value cache hooks off ``model``'s layers (``remat.unapply``
    undoes what ``enable`` set up too); how many layers had one."""
    removed = [modules.remove_hooks(m, lambda hook: hook is _drop_cache) for m in model.modules()]
    return sum(map(bool, removed))


def _enabled(model: nn.Module) -> bool:
    return any(
        hook is _drop_cache for m in model.modules() for hook in m._forward_pre_hooks.values()
    )


def _fit(
    model: nn.Module,
    where: modules.Where | None,
    budget: int | float | str,
    example_inputs: Any,
    loss_fn: Callable[..., Any] | None,
    options: dict[str, Any],
) -> None:
    from .planning import fit, plan
    from .planning.planner import discover_blocks
    from .planning.profile import selects_by_class

    allowed = {
        p.name for p in inspect.signature(plan).parameters.values() if p.kind is p.KEYWORD_ONLY
    } - {"blocks"}  # enable selects the blocks: the layers
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise RematError(
            f"remat.hf.enable: with budget=, the options are remat.fit's "
            f"({', '.join(sorted(allowed))}); got {', '.join(unknown)}. The plan chooses "
            "what each layer keeps, offloads or recomputes: options of remat.apply "
            "(offload_to_cpu, every, determinism_check, ...) go with a policy, not a budget."
        )
    if example_inputs is None:
        raise RematError(
            "remat.hf.enable: budget= plans from one measured step; pass example_inputs= (the "
            "model's inputs, with labels= for its loss; or loss_fn= too, output -> loss)."
        )
    if where is None:  # no layer classes named: the blocks remat.plan finds
        layers = discover_blocks(model, example_inputs, loss_fn or _output_loss)
        if not layers:
            raise RematError(
                f"remat.hf.enable: {type(model).__name__} names no layer classes in "
                "_no_split_modules, has no run of layers in an nn.ModuleList, and its forward "
                "calls no module with trainable parameters more than once; pass the layer "
                "classes yourself: remat.hf.enable(model, budget=..., layers=(MyLayer,))."
            )
    else:
        match = modules._matcher(where, model)
        layers = [name for name, m in model.named_modules() if name and match(name, m)]
        if not layers:
            raise RematError(
                f"remat.hf.enable: no layer of {type(model).__name__} matches {where!r}; pass "
                "layers= naming the model's repeated layers."
            )
    for name in layers:
        _hook(model.get_submodule(name))
    try:
        fit(
            model,
            example_inputs,
            budget=budget,
            loss_fn=loss_fn or _output_loss,
            # Classes select: layers the step does not call or train are left out of the plan.
            blocks=where if where is not None and selects_by_class(where) else layers,
            **options,
        )
    except BaseException:
        for name in layers:  # a failed plan leaves the model as it was
            modules.remove_hooks(model.get_submodule(name), lambda hook: hook is _drop_cache)
        raise


def _output_loss(out: Any) -> torch.Tensor:
    """The loss a Hugging Face model computes from ``labels`` (``out.loss``): the planned
    step's loss where ``loss_fn`` is not given."""
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise RematError(
            f"remat.hf.enable: the model's output ({type(out).__name__}) has no loss to plan "
            "the step with: pass labels in example_inputs (as in training), or loss_fn= "
            "(output -> loss)."
        )
    return loss


def _holds_keys(value: Any, module: nn.Module) -> bool:
    """Whether a cache argument already holds keys and values for ``module``'s layer before it
    runs: tensors (a legacy ``layer_past`` tuple), or a ``Cache`` object with a sequence for
    the layer's index (an attention submodule's ``layer_idx``). Without a layer index, a cache
    object is taken as empty: the layers before this one in the same forward may have filled
    theirs."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))
    length = getattr(value, "get_seq_length", None)
    index = next(
        (i for m in module.modules() if isinstance(i := getattr(m, "layer_idx", None), int)),
        None,
    )
    if not callable(length) or index is None:
        return False
    try:
        return bool(length(index) > 0)
    except (IndexError, KeyError, TypeError):  # no entry for this layer yet
        return False


def _drop_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook of an enabled layer: no key/value cache while it records for
    backward (see NOTE [ Key/value caches in training ])."""
    if not torch.is_grad_enabled():
        return None
    found = cache_arguments(module, args, kwargs)
    if found is None:
        return None
    bound, changed = found
    held = [n for n in changed if n != "use_cache" and _holds_keys(bound.arguments[n], module)]
    if held:
        raise RematError(
            f"remat.hf: {type(module).__name__} got {held[0]}= holding keys and values for "
            "its layer already (a prefix, as prefix tuning passes one, or an earlier part of "
            "the sequence) while gradients are enabled. A layer appends to its cache, and a "
            "recompute would append again; dropping the cache, as remat.hf does for an empty "
            "one, would change what the layer attends to. Train it without remat.hf "
            "(remat.hf.disable(model)), or pass the prefix another way (as input embeddings)."
        )
    for name in changed:
        bound.arguments[name] = False if name == "use_cache" else None
    name = type(module).__name__
    # Under torch.compile the warning stays out of the traced code: a logger call there is a
    # graph break (and an error with fullgraph=True).
    if not torch.compiler.is_compiling() and name not in _warned:
        _warned.add(name)
        logger.warning(
            "remat.hf: a key/value cache cannot be used with recompute while gradients are "
            "enabled; %s runs with %s.",
            name,
            ", ".join("use_cache=False" if n == "use_cache" else f"{n}=None" for n in changed),
        )
    return bound.args[1:], bound.kwargs
