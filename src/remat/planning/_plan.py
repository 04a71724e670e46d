"""The ``Plan``: what the planner decided, what it predicted and measured, as versioned JSON.

A plan is data, never code: it is saved as JSON (never pickle), and loading it into a model
whose fingerprint (class, parameter names and shapes, block paths) differs raises a
:class:`~remat.RematError` naming the first difference.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from ..errors import RematError
from ..modules import guard_hf_checkpointing, refuse_sharded, unwrapped
from ._autocast import Autocast
from ._budget import fmt_bytes
from .apply import (
    OFFLOADS,
    CallCount,
    Counted,
    HeldOutput,
    PlanPolicy,
    RefuseTraining,
    UnlikeProfiled,
    Unplanned,
    applied_plan,
    apply_option,
    apply_per_call,
    apply_segment,
    count_calls,
    note_applied,
    refuse_set_up,
    undo_all,
)

__all__ = ["Plan"]

# 2: options record the side inputs they hold (``Option.side``). A version-1 file reads as
# holding none, which is what its plan predicted with.
# 3: a block the forward calls more than once lists the option of each call (``calls``), which
# a reader of version 2 would not run.
VERSION = 3
_READABLE = (1, 2, 3)


@dataclass
class Option:
    """One way to run one block type, with its measured costs (see ``cost.py``)."""

    name: str
    kind: str  # "plain", "region", "graph" or "segment"
    kept: int  # bytes held from the block's forward to its backward, measured alone
    backward: int  # peak bytes during its backward above the level before its forward
    seconds: float  # extra seconds of a step by the op model (see ``planner._options``)
    # Measured extra seconds of one block's forward and backward, paired medians; the chain
    # uses these where they were measured (``repeats > 0``).
    measured_seconds: float | None = None
    left: int = 0  # bytes still held after its backward, measured alone
    gap: float = 0.0  # the MILP's relative optimality gap
    # op key -> "keep", "recompute", or the tier it is offloaded to ("disk", "host")
    decisions: dict[str, str] = field(default_factory=dict)
    # Per saved tensor: {"key", "bytes", "decision", "reason"}.
    tensors: list[dict[str, Any]] = field(default_factory=list)
    # Blocks it covers: more than one for a segment (see [ Segments ] in ``solve.py``).
    span: int = 1
    # How its costs were found: "measured" on copies of the block, or "extrapolated" from the
    # segments of two and three blocks measured so (a segment's costs grow by a block's).
    source: str = "measured"
    # The tier the block (or segment) runs under (``remat.offload``): what it saves goes there,
    # for a region or a segment its input; None: nowhere.
    tier: str | None = None
    # Peak bytes during its forward above the level before it, measured alone; for an option
    # that offloads, at least its twin's that keeps instead (see [ Offloaded options ]).
    forward: int = 0
    # Bytes that blocks before it offloaded and that come back while its backward runs, read
    # ahead (``Store.prefetch``); a bound, from the block's own offloaded tensors.
    ahead: int = 0
    # A segment on the region engine, its blocks' calls linked (see [ Segments on the region
    # engine ] in ``apply.py``); else a segment runs on the graph engine.
    linked: bool = False
    # Bytes autocast's cache holds from its forward to the end of the step's forward, beyond
    # what it keeps: weights it cast and does not keep (see NOTE [ Planning under autocast ] in
    # ``_autocast.py``); zero without autocast.
    cached: int = 0
    # Bytes of the block's side inputs (an attention mask every block gets) it holds after its
    # forward, measured alone (see ``cost.side_inputs``): they live on past the model's forward
    # where a plain block frees them.
    side: int = 0

    @property
    def offloads(self) -> bool:
        """Whether the option sends anything to a tier."""
        return self.tier is not None or any(d in OFFLOADS for d in self.decisions.values())


@dataclass
class Plan:
    """A memory plan for one model: one option per block, and what it predicts.

    Build one with :func:`remat.plan`; ``apply(model)`` sets the model up; ``save`` and
    ``load`` keep it as JSON; ``summary()`` and ``report()`` explain it.
    """

    fingerprint: dict[str, Any]
    budget: int
    budget_text: str
    plain_peak: int
    plain_seconds: float
    predicted_peak: int
    predicted_seconds: float
    # {"path", "type", "option"} in forward order; the blocks of a segment all name it, and
    # "segment" names the path of its first block; a block the forward calls more than once
    # lists the option of each call in "calls" ("option" is its first call's).
    blocks: list[dict[str, Any]]
    options: dict[str, list[Option]]  # block type -> its options
    solver: dict[str, Any]
    tiers: list[str]
    bandwidths: dict[str, float] = field(default_factory=dict)
    pareto: list[dict[str, float]] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    # The model's mode when it was planned; a plan made in evaluation mode refuses a training
    # forward (see NOTE [ The mode a plan was made in ] in ``apply.py``).
    training: bool = True
    # The torch.autocast the planned loop enters around each forward ({"device_type", "dtype",
    # "cache_enabled"}); None: none (see NOTE [ Planning under autocast ] in ``_autocast.py``).
    autocast: dict[str, Any] | None = None
    version: int = VERSION
    policies: list[PlanPolicy] = field(default_factory=list, repr=False, compare=False)

    # -- applying ------------------------------------------------------------------------------

    def option(self, block: dict[str, Any]) -> Option:
        """The option ``block`` runs under: for a block of a segment, the segment's, which its
        first block's type holds (the blocks after it may be of another, see
        ``Blocks.chained`` in ``profile.py``)."""
        first = block.get("segment", block["path"])
        if first != block["path"]:
            block = next((b for b in self.blocks if b["path"] == first), block)
        return self._named(block["type"], block["option"])

    def _named(self, block_type: str, name: str) -> Option:
        """Option ``name`` of ``block_type``."""
        for o in self.options[block_type]:
            if o.name == name:
                return o
        raise RematError(
            f"remat: the plan names option {name!r} for a block of type {block_type}, which "
            "lacks it; the plan file is damaged. Plan again."
        )

    def apply(self, model: nn.Module) -> nn.Module:
        """Set ``model``'s blocks up as planned, in place; returns ``model``. A model that
        ``torch.compile``, ``DistributedDataParallel`` or ``nn.DataParallel`` wraps is set up
        through the module inside, as :func:`remat.plan` plans it."""
        if not isinstance(model, nn.Module):
            raise RematError(
                f"Plan.apply: expected an nn.Module, got {type(model).__name__}; pass the "
                "model the plan was made for: plan.apply(model)."
            )
        compiled, model = model, unwrapped(model)
        refuse_sharded("Plan.apply", model)
        check_fingerprint(self.fingerprint, fingerprint(model, [b["path"] for b in self.blocks]))
        refuse_set_up("Plan.apply", model, "a plan sets up a model that runs plainly")
        try:
            self._apply(model)
        except BaseException:
            undo_all(model)  # all or nothing: the model runs plainly again, as it did
            self.policies = []
            raise
        note_applied(model, self, self.policies)
        return compiled

    @staticmethod
    def of(model: nn.Module) -> Plan | None:
        """The plan set up on ``model`` by :meth:`apply`, and so by :func:`remat.fit` and by
        :func:`remat.hf.enable` with a ``budget``: its ``summary()`` and ``report()``, and
        ``save()`` for the next run. ``None`` where no plan is set up, or
        :func:`remat.unapply` took it off. A model that ``torch.compile``,
        ``DistributedDataParallel`` or ``nn.DataParallel`` wraps is looked up through the
        module inside. A copy of the model runs the plan too, and has it: ``copy.deepcopy``
        shares it, a whole model saved with ``torch.save`` and loaded carries an equal one."""
        if not isinstance(model, nn.Module):
            raise RematError(f"remat.Plan.of: expected an nn.Module, got {type(model).__name__}.")
        found = applied_plan(unwrapped(model))
        return found[0] if found is not None and isinstance(found[0], Plan) else None

    def _apply(self, model: nn.Module) -> None:
        self.policies = []
        first = {b["path"]: b for b in self.blocks}
        for paths in segments(self.blocks):
            o = self.option(first[paths[0]])
            apply_segment(model, paths, o.tier, o.linked)
        # Every block's calls, counted in each forward (numbered, for a shared block whose
        # calls run different options): see [ Options per call ] in ``apply.py``.
        planned = {b["path"]: max(len(b.get("calls", [])), 1) for b in self.blocks}
        parents = {p.rpartition(".")[0] for p in planned if "." in p}
        lists = {
            p: list(m._modules)
            for p in parents
            if isinstance(
                m := model.get_submodule(p), (nn.ModuleList, nn.ModuleDict, nn.Sequential)
            )
        }
        count = CallCount(planned, self.budget, lists)
        if planned:
            count_calls(model, count)
            # See [ The output held through backward ] in ``apply.py``.
            model.register_forward_hook(HeldOutput(self.budget, self.predicted_peak))
        for block in self.blocks:
            o = self.option(block)
            module = model.get_submodule(block["path"])
            calls = block.get("calls", [])
            if len(set(calls)) > 1:
                options = [self._named(block["type"], name) for name in calls]
                self.policies += apply_per_call(module, block["path"], options, count)
                continue
            module.register_forward_pre_hook(Counted(count, block["path"]))
            if o.kind == "segment":
                continue
            policy = apply_option(module, block["path"], o.kind, o.decisions, o.tier)
            if policy is not None:
                self.policies.append(policy)
        if self.blocks:
            path = self.blocks[0]["path"]
            measured_inputs = int(self.measured.get("input_bytes", 0))
            model.get_submodule(path).register_forward_pre_hook(
                UnlikeProfiled(
                    path,
                    measured_inputs,
                    self.budget,
                    Autocast.from_json(self.autocast),
                    self.measured.get("device"),
                ),
                with_kwargs=True,
            )
        warned = [False]
        names = dict(model.named_modules())
        for path in self.measured.get("frozen", []):
            if isinstance(path, str) and path in names:
                names[path].register_forward_hook(Unplanned(path, self.budget, warned))
        if not self.training:
            for block in self.blocks:
                path = block["path"]
                model.get_submodule(path).register_forward_pre_hook(RefuseTraining(path))
        guard_hf_checkpointing(model)

    # -- text ----------------------------------------------------------------------------------

    def summary(self) -> str:
        """Predicted peak and step time against a plain step, and the option of each block."""
        lines = [
            f"remat plan: budget {fmt_bytes(self.budget)} ({self.budget_text}) of activation "
            f"memory; plain step peak {fmt_bytes(self.plain_peak)}",
            f"  predicted peak {fmt_bytes(self.predicted_peak)} "
            f"({self.predicted_peak / max(self.plain_peak, 1):.0%} of plain), step time "
            f"{self.predicted_seconds * 1e3:.1f} ms "
            f"({self.predicted_seconds / max(self.plain_seconds, 1e-12):.2f}x plain "
            f"{self.plain_seconds * 1e3:.1f} ms)",
            f"  solver: {self.solver.get('block', '')}; {self.solver.get('chain', '')}; "
            f"solve {self.solver.get('solve_seconds', 0.0):.2f} s, profile "
            f"{self.measured.get('profile_seconds', 0.0):.1f} s; tiers {', '.join(self.tiers)}",
        ]
        if "device" in self.measured:
            lines[-1] += f"; measured on {self.measured['device']}"
        for tier in dict.fromkeys(k.rsplit("_", 1)[0] for k in self.bandwidths):
            write, read = self.bandwidths.get(f"{tier}_write"), self.bandwidths.get(f"{tier}_read")
            if write and read:
                lines.append(
                    f"  {tier} tier while a block computed: writes {write / 1e9:.2f} GB/s, "
                    f"reads {read / 1e9:.2f} GB/s"
                )
        if not self.training:
            lines.append(
                "  planned in evaluation mode: a forward in training mode refuses this plan"
            )
        autocast = Autocast.from_json(self.autocast)
        if autocast is not None:
            lines.append(f"  planned for a loop that runs each forward and loss under {autocast}")
        verified = self.measured.get("verified_peak")
        if verified is not None:
            lines.append(
                f"  measured peak {fmt_bytes(verified)} in one step of the applied plan "
                f"({self.measured.get('solves', 1)} solve(s))"
            )
        side = self.solver.get("chain_costs", {}).get("side", 0)
        if side:
            lines.append(
                f"  side inputs every block gets, freed with the plain step's forward (an "
                f"attention mask): {fmt_bytes(side)}, counted where a block holds them"
            )
        lines.append("  blocks in forward order:")
        lines += [f"    {line}" for line in _block_runs(self.blocks, len(self.options) > 1, True)]
        for name, options in self.options.items():
            lines.append(
                f"  options of {name} (kept, backward peak: measured; extra time: "
                "predicted, measured):"
            )
            for o in options:
                recomputed = sum(1 for d in o.decisions.values() if d == "recompute")
                what = f", {recomputed} ops recomputed" if o.kind == "graph" else ""
                offloaded = sum(1 for d in o.decisions.values() if d in OFFLOADS)
                if offloaded:
                    what += f", {offloaded} offloaded"
                if o.tier is not None:
                    what += f", under remat.offload({o.tier!r})"
                if o.source != "measured":
                    what += f" ({o.source})"
                measured = (
                    f"{o.measured_seconds * 1e3:8.2f} ms" if o.measured_seconds is not None else "-"
                )
                lines.append(
                    f"    {o.name:<16} {fmt_bytes(o.kept):>12} {fmt_bytes(o.backward):>12} "
                    f"{o.seconds * 1e3:8.2f} ms {measured}{what}"
                )
        return "\n".join(lines)

    def block_runs(self) -> list[str]:
        """Each block's option, one line per run of consecutive blocks with the same one, as
        :meth:`summary` lists them: ``"blocks.1..blocks.4  segment-2 (4 blocks, 2 segments)"``."""
        return _block_runs(self.blocks, len(self.options) > 1, aligned=False)

    def report(self, observed_peak: int | None = None, *, model: nn.Module | None = None) -> str:
        """Predicted against observed: the ops each graph-engine block followed and could not
        follow in every forward since ``apply`` set the plan up on ``model`` (by default the
        model it was applied to last), and the measured peak when given."""
        policies = self.policies
        if model is not None:
            found = applied_plan(unwrapped(model)) if isinstance(model, nn.Module) else None
            if found is None or found[0] is not self:
                raise RematError(
                    "remat: Plan.report(model=...) reports on a model this plan is set up on, "
                    f"and it is not set up on this {type(model).__name__}"
                    + (" (another plan is)" if found is not None else "")
                    + ": pass a model plan.apply(...) set up, or none for the last one."
                )
            policies = found[1]
        lines = [f"predicted peak {fmt_bytes(self.predicted_peak)}"]
        if observed_peak is not None:
            diff = (observed_peak - self.predicted_peak) / max(self.predicted_peak, 1)
            lines[0] += f", observed {fmt_bytes(observed_peak)} ({diff:+.1%})"
        if policies:
            lines.append("ops of each forward since apply:")
        for p in policies:
            line = f"  {p.block}: {p.followed} ops followed, {p.unfollowed} not in the plan"
            if p.unknown:
                line += f" (kept; first: {p.unknown[0]})"
            lines.append(line)
        return "\n".join(lines)

    # -- files ---------------------------------------------------------------------------------

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("policies")
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise RematError(f"remat: a plan file must be JSON, but reading it failed: {e}.") from e
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        if type(found) is not int or found not in _READABLE:  # a bool is no version
            newer = type(found) is int and found > VERSION
            raise RematError(
                f"remat: expected a plan file of version {' or '.join(map(str, _READABLE))}, "
                f"found {found!r}; "
                + (
                    "it was written by a newer remat: upgrade remat or plan again."
                    if newer
                    else "plan again with this version of remat."
                )
            )
        data["version"] = VERSION  # what it reads as: the fields added since have defaults
        try:
            data["options"] = {k: [Option(**o) for o in v] for k, v in data["options"].items()}
            plan = cls(**data)
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise RematError(f"remat: the plan file is damaged ({e}); plan again.") from e
        damage = _damage(plan)
        if damage:
            raise RematError(f"remat: the plan file is damaged ({damage}); plan again.")
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        with open(path, encoding="utf-8") as f:
            try:
                text = f.read()
            except UnicodeDecodeError as e:
                raise RematError(
                    f"remat: a plan file is JSON text, but {os.fspath(path)!r} is not text "
                    f"({e}); give the file Plan.save wrote."
                ) from e
        return cls.from_json(text)


_NUMBER = (int, float)


def _allowed(hint: Any) -> tuple[type, ...]:
    """The types a value read from JSON may have for a field annotated ``hint``: a float
    field takes an int, a union each member's types, a generic (``dict[str, str]``) its
    container."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(t for member in typing.get_args(hint) for t in _allowed(member))
    if hint is float:
        return _NUMBER
    origin = typing.get_origin(hint)
    return (origin if origin is not None else hint,)


def _field_types(cls: type) -> dict[str, tuple[type, ...]]:
    """Each field of dataclass ``cls`` that a file sets, and the types it may hold there."""
    hints = typing.get_type_hints(cls)
    return {f.name: _allowed(hints[f.name]) for f in dataclasses.fields(cls) if f.init}


_PLAN_FIELDS = _field_types(Plan)
_OPTION_FIELDS = _field_types(Option)
_KINDS = ("plain", "region", "graph", "segment")


def _is(value: Any, types: tuple[type, ...]) -> bool:
    """``isinstance`` where a bool counts only as a bool, not as a number."""
    if type(value) is bool:
        return bool in types
    return isinstance(value, types)


def _damage(plan: Plan) -> str:
    """What in a plan read from a file has another type than a plan holds, or names what
    does not exist; "" if nothing. A damaged file fails here, not half-way through
    ``apply`` or ``summary``."""
    for name in ("budget", "plain_peak", "predicted_peak"):
        if not _is(getattr(plan, name), (int,)):
            return f"{name} is {getattr(plan, name)!r}, not a number of bytes"
    for name in ("plain_seconds", "predicted_seconds"):
        if not _is(getattr(plan, name), _NUMBER):
            return f"{name} is {getattr(plan, name)!r}, not seconds"
    if not isinstance(plan.blocks, list) or not isinstance(plan.options, dict):
        return "blocks must be a list and options a mapping"
    for name, allowed in _PLAN_FIELDS.items():
        if not _is(getattr(plan, name), allowed):
            return f"{name} is {getattr(plan, name)!r}, not a {allowed[0].__name__}"
    fingerprint = plan.fingerprint
    if not (
        isinstance(fingerprint.get("model"), str)
        and isinstance(fingerprint.get("parameters"), list)
        and isinstance(fingerprint.get("blocks"), list)
    ):
        return "the fingerprint lacks the model's class, parameters or blocks"
    if not all(isinstance(t, str) for t in plan.tiers):
        return f"tiers is {plan.tiers!r}, not a list of tier names"
    measured = plan.measured
    measured_types: dict[str, tuple[type, ...]] = {
        "input_bytes": (int,),
        "frozen": (list,),
        "device": (str,),
    }
    for name, allowed in measured_types.items():
        if name in measured and not _is(measured[name], allowed):
            return f"measured {name} is {measured[name]!r}"
    autocast = plan.autocast
    if autocast is not None and not (
        isinstance(autocast.get("device_type"), str) and isinstance(autocast.get("dtype"), str)
    ):
        return f"autocast is {autocast!r}, not a device type and a dtype"
    for kind, options in plan.options.items():
        for o in options:
            for name, allowed in _OPTION_FIELDS.items():
                if not _is(getattr(o, name), allowed):
                    return f"option {o.name!r} of {kind} has {name} {getattr(o, name)!r}"
            if o.kind not in _KINDS:
                return f"option {o.name!r} of {kind} is of kind {o.kind!r}, not one of {_KINDS}"
            bad = [d for d in o.decisions.values() if d not in ("keep", "recompute", *OFFLOADS)]
            if bad:
                return f"option {o.name!r} of {kind} decides {bad[0]!r}"
            if o.tier is not None and o.tier not in OFFLOADS:
                return f"option {o.name!r} of {kind} runs under tier {o.tier!r}"
    paths = set()
    for block in plan.blocks:
        if not isinstance(block, dict) or not all(
            isinstance(block.get(k), str) for k in ("path", "type", "option")
        ):
            return f"a block is {block!r}, not its path, type and option"
        if block["type"] not in plan.options:
            return f"block {block['path']} is of type {block['type']!r}, which has no options"
        paths.add(block["path"])
    for block in plan.blocks:
        first = block.get("segment", block["path"])
        if not isinstance(first, str) or first not in paths:
            return f"block {block['path']} is in a segment from {first!r}, which is no block"
        names = {o.name for o in plan.options[block["type"]]}
        if first == block["path"] and block["option"] not in names:
            return f"block {block['path']} runs option {block['option']!r}, which its type lacks"
        calls = block.get("calls")
        singles = {o.name for o in plan.options[block["type"]] if o.kind != "segment"}
        if calls is not None and (
            not isinstance(calls, list)
            or not calls
            or any(not isinstance(c, str) or c not in singles for c in calls)
            or "segment" in block
        ):
            return (
                f"block {block['path']} has calls {calls!r}, not options of its type that "
                "cover one block"
            )
    return _segment_damage(plan)


def _segment_damage(plan: Plan) -> str:
    """What in a plan's segments is not as the planner writes them (``planner._blocks``), ""
    if nothing: a block whose option is a segment of ``span`` blocks starts one, and it and
    the ``span - 1`` blocks after it in forward order name it in ``"segment"`` and name its
    option; no other block names a segment."""
    blocks = plan.blocks
    segment_of = {b["path"]: b.get("segment") for b in blocks}
    for block in blocks:
        first = block.get("segment")
        if first is not None and segment_of[first] != first:
            return (
                f"block {block['path']} is in a segment from {first!r}, which does not start "
                f"one (its segment is {segment_of[first]!r}, not its own path)"
            )
    for i, block in enumerate(blocks):
        path = block["path"]
        if block.get("segment", path) != path:
            continue  # inside a segment: checked with the segment's first block
        o = plan.option(block)
        members = [b["path"] for b in blocks if b.get("segment") == path]
        if o.kind != "segment":
            if members:
                return (
                    f"the segment from {path} ({', '.join(members)}) runs option {o.name!r} "
                    f"of kind {o.kind!r}, not a segment"
                )
            continue
        covered = blocks[i : i + o.span]
        expected = [b["path"] for b in covered]
        if o.span < 2:
            return f"option {o.name!r} is a segment of {o.span} blocks, not of 2 or more"
        if len(expected) < o.span:
            return (
                f"block {path} starts {o.name!r}, a segment of {o.span} blocks, past the "
                f"plan's last block ({blocks[-1]['path']})"
            )
        if members != expected:
            return (
                f"block {path} starts {o.name!r}, a segment of {o.span} blocks: expected "
                f"{', '.join(expected)} to name it as their segment, found "
                f"{', '.join(members) or 'none'}"
            )
        other = next((b for b in covered if b["option"] != o.name), None)
        if other is not None:
            return (
                f"block {other['path']} is in segment {o.name!r} from {path}, but names "
                f"option {other['option']!r}"
            )
    return ""


def option_of_call(block: dict[str, Any], call: int) -> str:
    """The name of the option ``block`` (a plan's entry) runs at its call number ``call``: a
    block the forward calls more than once lists each call's (``calls``)."""
    calls = block.get("calls")
    return str(calls[call] if isinstance(calls, list) and call < len(calls) else block["option"])


def segments(blocks: list[dict[str, Any]]) -> list[list[str]]:
    """The paths of each segment a plan's blocks form, in forward order."""
    found: dict[str, list[str]] = {}
    for block in blocks:
        first = block.get("segment")
        if first is not None:
            found.setdefault(first, []).append(block["path"])
    return list(found.values())


def fingerprint(model: nn.Module, blocks: list[str]) -> dict[str, Any]:
    """What a plan must find again in the model it is applied to."""
    return {
        "model": type(model).__qualname__,
        "parameters": [[n, list(p.shape)] for n, p in model.named_parameters()],
        "blocks": [
            [b, type(model.get_submodule(b)).__qualname__ if _has(model, b) else "?"]
            for b in blocks
        ],
    }


def _block_runs(blocks: list[dict[str, Any]], several_types: bool, aligned: bool) -> list[str]:
    """One line per run of consecutive blocks of ``blocks`` with the same option, by path,
    with how many blocks (or segments) it holds; ``aligned``: the options in one column. A
    block the forward calls more than once (its ``calls``) has a line of its own, which says
    so."""
    runs: list[list[Any]] = []  # first path, last path, label, blocks, segments
    for block in blocks:
        path = block["path"]
        if block.get("segment", path) != path:  # inside a segment started earlier
            runs[-1][1] = path
            runs[-1][3] += 1
            continue
        label = f"{block['type']}: " if several_types else ""
        names = block.get("calls", [])
        if len(set(names)) > 1:  # consecutive calls with one option, counted
            groups = [(n, len(list(g))) for n, g in itertools.groupby(names)]
            label += ", ".join(f"{n} x{k}" if k > 1 else n for n, k in groups)
            label += f" (its {len(names)} calls in order)"
        else:
            label += block["option"]
            label += f" (each of its {len(names)} calls)" if len(names) > 1 else ""
        if len(names) > 1:
            runs.append([path, path, label, 1, 1])
        elif runs and runs[-1][2] == label:
            runs[-1][1] = path
            runs[-1][3] += 1
            runs[-1][4] += 1
        else:
            runs.append([path, path, label, 1, 1])
    spans = [first if first == last else f"{first}..{last}" for first, last, *_ in runs]
    width = max(map(len, spans), default=0) if aligned else 0
    lines = []
    for span, (_, _, label, count, units) in zip(spans, runs, strict=True):
        many = f"{count} blocks"
        if "segment-" in label:
            many += ", one segment" if units == 1 else f", {units} segments"
        lines.append(f"{span:<{width}}  {label}" + (f" ({many})" if count > 1 else ""))
    return lines


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def check_fingerprint(planned: dict[str, Any], found: dict[str, Any]) -> None:
    if planned == found:
        return
    if planned.get("model") != found.get("model"):
        what = f"a {planned.get('model')}, got a {found.get('model')}"
    elif planned.get("blocks") != found.get("blocks"):
        want = [p for p, _ in planned.get("blocks", [])]
        got = [p for p, _ in found.get("blocks", [])]
        what = f"{len(want)} blocks ({_span(want)}), got {len(got)} ({_span(got)})"
        if len(want) == len(got):
            pairs = zip(planned["blocks"], found["blocks"], strict=True)
            i = next(i for i, (a, b) in enumerate(pairs) if a != b)
            what = f"block {i} to be {planned['blocks'][i]}, got {found['blocks'][i]}"
    else:
        a = {n: s for n, s in planned.get("parameters", [])}
        b = {n: s for n, s in found.get("parameters", [])}
        # The first parameter both have in another shape says most; else one only one has.
        shaped = [n for n in a if n in b and a[n] != b[n]]
        if shaped:
            what = f"parameter {shaped[0]} of shape {a[shaped[0]]}, got {b[shaped[0]]}"
        else:
            extra = sorted(set(b) - set(a))
            missing = sorted(set(a) - set(b))
            what = (
                f"the parameters it was planned with, got {len(extra)} more ({extra[0]} of "
                f"shape {b[extra[0]]}, ...)"
                if extra
                else f"parameter {missing[0]} of shape {a[missing[0]]}, got none"
                if missing
                else "the same parameters, got others"
            )
    raise RematError(
        f"remat: this plan was made for another model: expected {what}. Plan this model with "
        "remat.plan(model, ...)."
    )


def _span(paths: list[str]) -> str:
    """``paths`` in a few words: ``'blocks.0 to blocks.5'``."""
    if not paths:
        return "none"
    return paths[0] if len(paths) == 1 else f"{paths[0]} to {paths[-1]}"
