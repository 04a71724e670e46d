"""Solvers: per block type, a MILP over its saved tensors gives a Pareto set of options; over
the chain of blocks, an exact dynamic program picks one option per block under the budget. A
greedy knapsack is the baseline the tests compare both against.

NOTE [ The block MILP ]

For the ops of one block (``BlockProfile.ops``), binaries ``k_i`` (the engine keeps op i's
result) and ``r_i`` (backward recomputes it):

1. a result autograd saves is kept or recomputed: ``k_i + r_i >= 1``;
2. recomputing a result needs each recorded argument kept or recomputed too:
   ``k_j + r_j >= r_i`` for every op j it reads (so a dropped tensor whose inputs are dropped
   costs their recompute as well, once: the engine caches a replayed result while a pending
   saved tensor needs it);
3. ops that must be saved (``must_save_reason``) are never recomputed: ``r_i = 0``; views
   (results aliasing an argument) are never kept: ``k_i = 0``, their replay is free of memory;
4. kept bytes ``sum b_i k_i <= cap``.

The objective is the recompute time ``sum (t_i + overhead) r_i``, plus a tie-break of a
millionth of a second per MiB kept so that among equally fast options the smaller one wins.
Solving for a sweep of caps gives the Pareto set of (kept bytes, recompute time).

With an offload tier, a third binary ``o_i`` (op i's result waits in the tier) counts as
stored in rules 1 and 2 (``k_i + r_i + o_i >= 1``, ``k_j + r_j + o_j >= r_i``: the engine
replays from an offloaded result as from a kept one), never for views, not in the cap (its
bytes leave memory once written), and costs ``c * b_i`` seconds: the tier's measured cost per
byte (what writing it out and reading it back adds to a block's step while the block computes).

NOTE [ The chain DP ]

Block i with option o keeps ``K[i][o]`` bytes after its forward, needs ``B[o]`` bytes above
the level it started at during its backward, and leaves ``L[o]`` bytes held after its backward
until the whole backward ends (a graph-engine region's kept results live as long as its
records). The predicted peak is
``max(H + sum_j K_j, max_i (E + G_i + sum_{j<i} K_j + B_i + sum_{j>i} L_j), tail + sum_j L_j,
max_i (F_i + sum_{j<i} (K_j + C_j) + A_i))``
(``G_i``: what is live besides the blocks' kept bytes at block i's backward, measured on the
plain step: layers between the blocks, skip tensors, gradients; ``E`` is then zero)
(see ``cost.py``). The last term is block i's forward: ``A_i`` bytes above the level it starts
from, ``F_i`` plus what the blocks before it keep and leave in autocast's cache (``C_j``, see
[ Casts cached to the forward's end ]), with ``F_i`` measured on the plain step as ``G_i`` is. A
region's forward peaks above what it keeps (its activations live until it returns), so under
autocast, where the casts of the regions before it are still cached, the last region's forward
can be the step's peak. A DP over blocks in forward order keeps two numbers as state: the prefix
sum of ``K``, and a reservation ``R`` for the ``L`` of the blocks still to come (any ``R`` at
the start, each block takes its ``L`` out of it, never below zero), so every constraint reads
the state. Both axes live on grids (1/1024 and 1/64 of the budget by default), rounded down,
so that the grid never refuses an assignment the exact model fits (an every-other-block plan
whose peak is the budget to the byte); an answer the exact model puts over the budget is
solved again on finer grids (up to 1/16384 of the budget). Where the finest grid still admits
one, the DP is solved on tighter budgets, which can shut out the fastest assignment that fits
(on small random chains on a coarse grid, answers up to twice as slow), or every one: on a
U-Net, every block recomputed fit the budget to the byte, and faster assignments a few
kilobytes over it kept the DP's answers off it until none was left. Then the chain's MILP
(:func:`_chain_milp`, exact for the model) decides, given the DP's answer as a bound: it finds
a faster one that fits, or proves there is none, or stops at its time limit with the DP's
answer marked not proven optimal. Settled answers, nearly all, skip it: on a 48-block chain,
whose identical blocks give it many equivalent orders, it takes seconds a budget. What the
solver returns always fits.

NOTE [ Segments ]

An option may cover several consecutive blocks (``span > 1``): a segment, run as one region
that keeps only its input and recomputes all of its blocks together in backward, as
``torch.utils.checkpoint.checkpoint_sequential`` does. Its ``kept`` is what the whole
segment holds, ``backward`` its peak while the segment's backward runs (its blocks' recomputed
activations at once), and the peak constraint at its backward takes the largest ``G_i`` of the
blocks it covers. The DP then keeps a state per block boundary, and a segment moves from
boundary ``i`` to ``i + span``; an assignment lists one option index per block, ``-1`` for the
blocks a segment started earlier covers. A segment starts at a block of one type and covers
blocks of the type its measured chain's later copies had (``planner._covers``): the same type,
or, after a first block whose input needs no gradient, the type of the blocks that follow it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import RematError
from .profile import BlockProfile

__all__: list[str] = []

REPLAY_OVERHEAD = 25e-6  # seconds the graph engine spends per replayed op besides the kernel
RECORD_OVERHEAD = 20e-6  # seconds it spends recording one op in forward
RAISES = 8  # steps of the head's raise for cached casts (see [ Casts cached to the forward's end ])
CHAIN_MILP_SECONDS = 5.0  # the most the chain's MILP runs per budget (same note)


@dataclass(frozen=True)
class OpChoice:
    """One solution of the block MILP."""

    keep: frozenset[int]
    recompute: frozenset[int]
    kept_bytes: int
    seconds: float
    gap: float  # the solver's relative optimality gap
    offload: frozenset[int] = frozenset()  # results that wait in the offload tier


def _relevant(profile: BlockProfile) -> list[int]:
    """Ops whose results backward may need: saved ones and everything they read."""
    needed: set[int] = set()
    stack = [i for i, op in enumerate(profile.ops) if op.saved]
    while stack:
        i = stack.pop()
        if i in needed:
            continue
        needed.add(i)
        stack.extend(j for j in profile.ops[i].deps if j < len(profile.ops))
    return sorted(needed)


def solve_block(
    profile: BlockProfile, cap: int, time_limit: float = 5.0, offload_cost: float | None = None
) -> OpChoice | None:
    """The fastest keep/recompute choice for ``profile`` keeping at most ``cap`` bytes, by
    HiGHS; ``None`` when no choice fits (see [ The block MILP ]). With ``offload_cost``
    (seconds per byte), results may be offloaded too."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import lil_matrix
    except ImportError as e:  # pragma: no cover - scipy is a dependency of the planner
        raise RematError(
            "remat.plan: the planner needs scipy (for its HiGHS MILP solver); pip install scipy."
        ) from e
    nodes = _relevant(profile)
    if not nodes:
        return OpChoice(frozenset(), frozenset(), 0, 0.0, 0.0)
    index = {n: i for i, n in enumerate(nodes)}
    m = len(nodes)
    ops = profile.ops
    width = 3 * m if offload_cost is not None else 2 * m  # k, r and, with a tier, o
    cost = np.zeros(width)
    lower = np.zeros(width)
    upper = np.ones(width)
    # Time in units of replaying every op once; bytes, as a tie-break, in units of keeping
    # everything, weighted far below any op's replay.
    total_seconds = sum(ops[n].seconds + REPLAY_OVERHEAD for n in nodes)
    total_bytes = max(sum(ops[n].bytes for n in nodes), 1)
    tie = 1e-3 * min(ops[n].seconds + REPLAY_OVERHEAD for n in nodes) / total_seconds
    for n, i in index.items():
        op = ops[n]
        cost[i] = tie * op.bytes / total_bytes
        cost[m + i] = (op.seconds + REPLAY_OVERHEAD) / total_seconds
        if op.must_save:
            upper[m + i] = 0
        if op.view and not op.must_save:
            upper[i] = 0
        if offload_cost is not None:
            cost[2 * m + i] = offload_cost * op.bytes / total_seconds
            if op.view or op.bytes == 0:
                upper[2 * m + i] = 0

    def stored(i: int) -> dict[int, float]:
        out = {i: 1.0, m + i: 1.0}
        if offload_cost is not None:
            out[2 * m + i] = 1.0
        return out

    rows: list[tuple[dict[int, float], float, float]] = []
    for n, i in index.items():
        op = ops[n]
        if op.saved:
            rows.append((stored(i), 1.0, math.inf))
        for d in op.deps:
            j = index[d]
            rows.append(({**stored(j), m + i: -1.0}, 0.0, math.inf))
    rows.append(({i: float(ops[n].bytes) for n, i in index.items()}, -math.inf, float(cap)))
    a = lil_matrix((len(rows), width))
    lo = np.empty(len(rows))
    hi = np.empty(len(rows))
    for r, (coefs, low, high) in enumerate(rows):
        for c, v in coefs.items():
            a[r, c] += v
        lo[r], hi[r] = low, high
    result = milp(
        cost,
        constraints=LinearConstraint(a.tocsr(), lo, hi),
        integrality=np.ones(width),
        bounds=Bounds(lower, upper),
        options={"time_limit": time_limit, "mip_rel_gap": 1e-6},
    )
    if result.x is None:
        return None
    x = np.round(result.x).astype(int)
    off = x[2 * m :] if offload_cost is not None else np.zeros(m, dtype=int)
    recompute = frozenset(nodes[i] for i in range(m) if x[m + i] and not x[i] and not off[i])
    # What is stored and read: saved, or read by a replay (the engine drops the rest at exit).
    read = {d for n in recompute for d in ops[n].deps}
    wanted = [i for i in range(m) if ops[nodes[i]].saved or nodes[i] in read]
    keep = frozenset(nodes[i] for i in wanted if x[i])
    offload = frozenset(nodes[i] for i in wanted if off[i] and not x[i])
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    return OpChoice(
        keep=keep,
        recompute=recompute,
        kept_bytes=sum(ops[n].bytes for n in keep),
        seconds=sum(ops[n].seconds + REPLAY_OVERHEAD for n in recompute)
        + (offload_cost or 0.0) * sum(ops[n].bytes for n in offload),
        gap=gap,
        offload=offload,
    )


def pareto(
    profile: BlockProfile,
    points: int = 8,
    time_limit: float = 5.0,
    offload_cost: float | None = None,
) -> list[OpChoice]:
    """Block MILP solutions for a sweep of caps, fastest first, without dominated ones."""
    total = sum(op.bytes for op in profile.ops if op.saved and not op.view)
    found: dict[tuple[frozenset[int], frozenset[int]], OpChoice] = {}
    for k in range(points):
        cap = int(total * (1 - k / (points - 1))) if points > 1 else total
        choice = solve_block(profile, cap, time_limit, offload_cost)
        if choice is not None:
            found.setdefault((choice.keep, choice.offload), choice)
    choices = sorted(found.values(), key=lambda c: (c.seconds, c.kept_bytes))
    front: list[OpChoice] = []
    for c in choices:
        if not front or c.kept_bytes < front[-1].kept_bytes:
            front.append(c)
    return front


def brute_force_block(
    profile: BlockProfile, cap: int, offload_cost: float | None = None
) -> float | None:
    """The MILP's optimum by enumeration, for tiny graphs in tests: minimal recompute time
    (plus the offload cost of what is offloaded, with a tier)."""
    nodes = _relevant(profile)
    ops = profile.ops
    best: float | None = None
    states = (0, 1, 2) if offload_cost is not None else (0, 1)  # 1: kept, 2: offloaded
    for bits in itertools.product(states, repeat=len(nodes)):
        keep = {n for n, b in zip(nodes, bits, strict=True) if b}
        offloaded = {n for n, b in zip(nodes, bits, strict=True) if b == 2}
        if any(ops[n].view and not ops[n].must_save for n in keep - offloaded):
            continue
        if any(ops[n].view or ops[n].bytes == 0 for n in offloaded):
            continue
        if sum(ops[n].bytes for n in keep - offloaded) > cap:
            continue
        # Recompute what is needed and not kept, transitively.
        recompute: set[int] = set()
        stack = [n for n in nodes if ops[n].saved and n not in keep]
        ok = True
        while stack:
            n = stack.pop()
            if n in recompute:
                continue
            if ops[n].must_save:
                ok = False
                break
            recompute.add(n)
            stack.extend(d for d in ops[n].deps if d not in keep)
        if not ok:
            continue
        seconds = sum(ops[n].seconds + REPLAY_OVERHEAD for n in recompute)
        # An offloaded result costs its transfer only where something reads it.
        read = {d for n in recompute for d in ops[n].deps}
        used = {n for n in offloaded if ops[n].saved or n in read}
        seconds += (offload_cost or 0.0) * sum(ops[n].bytes for n in used)
        if best is None or seconds < best - 1e-12:
            best = seconds
    return best


# -- the chain ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainOption:
    """One option for one block of the chain, as the chain sees it."""

    kept: int  # bytes held after the block's forward until its backward
    backward: int  # bytes needed during its backward above the level before its forward
    seconds: float  # step time added over a plain block
    left: int = 0  # bytes still held after its backward, until the step's backward ends
    span: int = 1  # blocks it covers: more than one for a segment (see [ Segments ])
    # bytes autocast's cache holds from its forward to the forward's end, beyond plain's (see
    # [ Casts cached to the forward's end ])
    cached: int = 0
    # bytes needed during its forward above the level before it (see [ The chain DP ])
    forward: int = 0
    # bytes of the side inputs every block gets that it holds past its forward (see
    # [ Side inputs ])
    side: int = 0


@dataclass(frozen=True)
class ChainCosts:
    """The chain model's constants (see ``cost.ChainModel``)."""

    head: int  # H: the peak of forward and the head's backward, less the blocks' kept bytes
    before: int  # E: what is live outside the blocks during their backward
    tail: int  # the peak after the first block's backward
    # Per block: what is live besides the blocks' kept bytes at its backward (what layers
    # between the blocks keep, skip tensors, gradients), on top of ``before``; none when empty.
    gaps: tuple[int, ...] = ()
    # The part of ``head`` to the end of the forward, where autocast's cache still holds the
    # casts of blocks that do not keep them (see [ Casts cached to the forward's end ]);
    # None: all of it.
    forward_head: int | None = None
    # Per block: the level its forward starts from besides the kept and cached bytes of the
    # blocks before it (``F_i`` in [ The chain DP ]); none: forwards are not counted.
    starts: tuple[int, ...] = ()
    # ``head`` and ``forward_head`` from the last block's forward end on, where the plain step
    # no longer holds the side inputs (see [ Side inputs ]); None: the whole of them.
    head_after: int | None = None
    forward_head_after: int | None = None

    def holding(self, side: int) -> ChainCosts:
        """These costs with ``side`` bytes of side inputs live from the last block's forward
        end to the backward's end (see [ Side inputs ])."""
        after = self.head if self.head_after is None else self.head_after
        forward_head = self.forward_head
        if forward_head is not None:
            forward_after = (
                forward_head if self.forward_head_after is None else self.forward_head_after
            )
            forward_head = max(forward_head, forward_after + side)
        return dataclasses.replace(
            self,
            head=max(self.head, after + side),
            before=self.before + side,
            tail=self.tail + side,
            forward_head=forward_head,
        )

    def end(self, cached: int) -> int:
        """What the head needs at the forward's end with ``cached`` bytes in autocast's cache."""
        return (self.head if self.forward_head is None else self.forward_head) + cached

    def start(self, i: int) -> int | None:
        """``F_i``, or None when the forwards are not counted."""
        return self.starts[i] if i < len(self.starts) else None

    def gap(self, i: int, span: int = 1) -> int:
        """The largest ``G`` of blocks ``i`` to ``i + span - 1``."""
        return max((self.gaps[j] for j in range(i, min(i + span, len(self.gaps)))), default=0)


def chosen(blocks: Sequence[Sequence[ChainOption]], picks: Sequence[int]) -> list[ChainOption]:
    """The options an assignment picks, in forward order (blocks a segment covers skipped)."""
    return [blocks[i][k] for i, k in enumerate(picks) if k >= 0]


def chain_peak(costs: ChainCosts, options: Sequence[ChainOption]) -> int:
    """The predicted peak of one assignment's options in forward order (see [ The chain DP ])."""
    side = max((o.side for o in options), default=0)
    if side:
        costs = costs.holding(side)
    prefix = cached = 0
    left = sum(o.left for o in options)
    peak = costs.tail + left
    i = 0
    for o in options:
        left -= o.left
        peak = max(peak, costs.before + costs.gap(i, o.span) + prefix + o.backward + left)
        start = costs.start(i)
        if start is not None:
            peak = max(peak, start + prefix + cached + o.forward)
        prefix += o.kept
        cached += o.cached
        i += o.span
    return max(peak, costs.head + prefix, costs.end(cached) + prefix)


def _fastest(blocks: Sequence[Sequence[ChainOption]]) -> tuple[float, list[int]]:
    """The fastest assignment whatever its peak (segments included), and its time."""
    n = len(blocks)
    to = [0.0] + [math.inf] * n  # the least time to cover the blocks before each boundary
    last: list[tuple[int, int]] = [(-1, -1)] * (n + 1)  # (start, option) of that cover's last
    for i, opts in enumerate(blocks):
        for k, o in enumerate(opts):
            t = i + o.span
            if t <= n and to[i] + o.seconds < to[t]:
                to[t], last[t] = to[i] + o.seconds, (i, k)
    picks = [-1] * n
    t = n
    while t > 0:
        i, k = last[t]
        picks[i], t = k, i
    return to[n], picks


def _singles(blocks: Sequence[Sequence[ChainOption]]) -> list[list[int]]:
    """Per block, the indices of its options that cover it alone."""
    return [[k for k, o in enumerate(opts) if o.span == 1] for opts in blocks]


class ChainAnswer(NamedTuple):
    """What :func:`chain_solve` found: the assignment (``None``: no assignment fits) and
    whether it is proven the fastest that fits."""

    picks: list[int] | None
    optimal: bool


def chain_dp(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    budget: int,
    grid: int = 1024,
    rgrid: int = 64,
) -> list[int] | None:
    """The assignment :func:`chain_solve` finds (``None``: none fits)."""
    return chain_solve(costs, blocks, budget, grid, rgrid).picks


def chain_solve(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    budget: int,
    grid: int = 1024,
    rgrid: int = 64,
    time_limit: float = CHAIN_MILP_SECONDS,
) -> ChainAnswer:
    """The fastest assignment (one option index per block, ``-1`` where a segment covers it)
    whose predicted peak fits ``budget`` (see [ The chain DP ]). The prefix sums live on a
    grid of ``budget / grid`` bytes, rounded down; an answer the exact model puts over the
    budget is solved again on finer grids, then on tighter budgets, so what is returned
    always fits. Options whose casts autocast's cache holds are solved as [ Casts cached to
    the forward's end ] says, by a MILP that may stop at ``time_limit`` seconds with its best
    answer so far (``optimal`` False). Side inputs are solved as [ Side inputs ] says."""
    if any(o.side for opts in blocks for o in opts):
        return _side_solve(costs, blocks, budget, grid, rgrid, time_limit)
    # NOTE [ Casts cached to the forward's end ]
    #
    # Under a loop's autocast, the cast weights a block does not keep (a region's, a segment's)
    # still live in autocast's cache until the forward's context ends (see NOTE [ Planning
    # under autocast ] in ``_autocast.py``): ``cached`` bytes ``C_j`` that count at the
    # forward's end, ``H_f + sum_j (K_j + C_j)`` (``H_f``: the head's part to the forward's
    # end, ``ChainCosts.forward_head``), and nowhere after. The DP's state has no axis for
    # them; a third axis on its grid multiplies its memory by the axis' size, and rounding
    # casts a few grid units wide sends its answers to the retries (1-7 s a budget on the
    # medium GPT's 8 blocks). Such a chain is solved in two steps:
    #
    # 1. the DP on heads raised to ``H_f`` plus ``c``, and every forward's start raised by
    #    ``c`` (what the blocks before it cache is at most what all cache), for ``c`` in
    #    ``RAISES`` even steps from zero to the most any assignment could cache, and, where an
    #    answer caches more than its ``c``, again at what it caches; the fastest answer that
    #    fits the exact model is
    #    kept. It is fast and often the fastest there is, not always: on the medium GPT in
    #    bfloat16 with the disk tier, it found no plan at 38 MiB where one fits, and at 60 MiB
    #    one 10% slower in recompute than the best;
    # 2. a MILP over the chain by HiGHS (:func:`_chain_milp`): exact for the same model, with
    #    step 1's time as a bound on its objective. On the medium GPT's chain it takes
    #    0.01-0.4 s a budget; on chains of many identical blocks it can take far longer (30 s
    #    for some budgets at 24 blocks: its binaries have many equivalent orders), so it stops
    #    at ``time_limit``, and the faster of the two answers is returned, marked not proven
    #    optimal. Where step 1's answer is as fast as the fastest assignment of all, whatever
    #    its peak (every block plain, at a large budget), it is optimal and step 2 never runs.
    if not any(o.cached for opts in blocks for o in opts):
        picks, settled = _chain_dp(costs, blocks, budget, grid, rgrid)
        if settled:
            return ChainAnswer(picks, True)
        # The grid's rounding admitted answers over the budget until the DP solved on
        # lowered targets (see [ The chain DP ]): whether a faster answer fits, or any where
        # it found none, is the MILP's to say.
        return _bettered(costs, blocks, budget, picks, time_limit)
    fastest, _ = _fastest(blocks)
    raised = _raised_dp(costs, blocks, budget, grid, rgrid, fastest)
    if raised is not None and sum(o.seconds for o in chosen(blocks, raised)) <= fastest:
        return ChainAnswer(raised, True)  # as fast as any assignment, fitting or not
    return _bettered(costs, blocks, budget, raised, time_limit)


def _side_solve(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    budget: int,
    grid: int,
    rgrid: int,
    time_limit: float,
) -> ChainAnswer:
    """[ Side inputs ]: the fastest of the fastest assignments holding at most each amount of
    side inputs that some option holds, on costs that hold that amount."""
    # NOTE [ Side inputs ]
    #
    # A model's forward makes some tensors once and passes them to every block: an attention
    # mask, position ids (``profile.side_inputs``). A plain block may hold none of them for
    # its backward (a mask added to the attention scores is not saved), so the plain step
    # frees them as its forward returns; a block that recomputes needs them in its backward
    # and holds them: a region until its own backward, a graph-engine region until the whole
    # backward ends. Measured alone, a block holds nothing of what its caller holds, so an
    # option's ``kept`` leaves them out, and its ``side`` says how many of their bytes it
    # keeps alive. An assignment's options hold them once, as many bytes as the option that
    # holds the most (``ChainCosts.holding``), from the last block's forward end (the head,
    # past the forward's own peak, where the plain step held them too) to the backward's end,
    # at every block's backward and in the tail. That is exact where a graph-engine region
    # holds them, and where the peak falls at or after the backward of the first block that
    # holds them and not between the last block and the model's return (a final norm);
    # elsewhere it is high by at most their bytes. Hugging Face GPT-2 and Llama pass a
    # (batch, 1, seq, seq) float mask to every layer: 0.5 MiB at seq 256 and batch 2, by
    # which every plan that recomputed a layer measured above its prediction before it was
    # counted.
    #
    # The DP's state has no axis for what the blocks so far hold. The chain is solved once per
    # amount some option holds, and once for none: with the options that hold at most that
    # amount, on costs that hold it. Each assignment is predicted exactly by the solve for
    # the most its options hold, and above that by the solves for more, so the fastest of the
    # answers is the fastest for the model. The amounts are few: none, the mask, the mask
    # and the position ids.
    answers = []
    optimal = True
    for amount in sorted({0, *(o.side for opts in blocks for o in opts)}):
        keep = [[k for k, o in enumerate(opts) if o.side <= amount] for opts in blocks]
        some = [[opts[k] for k in kept] for opts, kept in zip(blocks, keep, strict=True)]
        free = [[dataclasses.replace(o, side=0) for o in opts] for opts in some]
        found = chain_solve(costs.holding(amount), free, budget, grid, rgrid, time_limit)
        optimal = optimal and found.optimal
        if found.picks is not None:
            picks = [-1 if k < 0 else keep[i][k] for i, k in enumerate(found.picks)]
            answers.append((sum(o.seconds for o in chosen(blocks, picks)), picks))
    if not answers:
        return ChainAnswer(None, optimal)
    return ChainAnswer(min(answers, key=lambda a: a[0])[1], optimal)


def _bettered(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    budget: int,
    picks: list[int] | None,
    time_limit: float,
) -> ChainAnswer:
    """``picks`` (an answer that fits, or None), or a faster one that fits: the chain's MILP
    looks for one faster than ``picks``; where it proves none exists, ``picks`` is optimal."""
    bound = None if picks is None else sum(o.seconds for o in chosen(blocks, picks))
    found = _chain_milp(costs, blocks, budget, bound, time_limit)
    if found.picks is None:  # nothing faster than the bound fits
        return ChainAnswer(picks, found.optimal)
    if bound is not None and sum(o.seconds for o in chosen(blocks, found.picks)) >= bound:
        return ChainAnswer(picks, found.optimal)  # within HiGHS' tolerance of the bound
    return found


def _raised_dp(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    budget: int,
    grid: int,
    rgrid: int,
    fastest: float,
) -> list[int] | None:
    """Step 1 of [ Casts cached to the forward's end ]: the DP on raised heads; it stops at an
    answer that takes ``fastest`` seconds, the least any assignment takes."""
    bare = [[dataclasses.replace(o, cached=0) for o in opts] for opts in blocks]
    most = sum(max(o.cached for o in opts) for opts in blocks)
    raises = {most * k // RAISES for k in range(RAISES + 1)}
    tried: set[int] = set()
    best: tuple[float, list[int]] | None = None
    while raises - tried:
        raised = min(raises - tried)
        tried.add(raised)
        head = max(costs.head, costs.end(raised))
        # What the blocks before a forward cache is at most what all of them cache.
        starts = tuple(s + raised for s in costs.starts)
        picks, _ = _chain_dp(
            dataclasses.replace(costs, head=head, starts=starts), bare, budget, grid, rgrid
        )
        if picks is None:  # a larger raise only asks for more
            break
        options = chosen(blocks, picks)
        if chain_peak(costs, options) <= budget:
            seconds = sum(o.seconds for o in options)
            if best is None or seconds < best[0]:
                best = (seconds, picks)
            if seconds <= fastest:  # no raise can find a faster one
                break
        else:
            raises.add(sum(o.cached for o in options))
    return None if best is None else best[1]


def _chain_milp(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    budget: int,
    bound: float | None,
    time_limit: float,
) -> ChainAnswer:
    """Step 2 of [ Casts cached to the forward's end ]: the chain as a MILP, for an answer
    faster than ``bound`` seconds (``picks`` None: none fits, or none was found in time).
    The rows are :func:`_chain_rows`'. The answer is checked on the exact model; one HiGHS
    lets over its feasibility tolerance is solved again on a budget lowered by the excess, so
    what is returned always fits."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix

    n = len(blocks)
    items = [(i, k) for i, opts in enumerate(blocks) for k, o in enumerate(opts) if i + o.span <= n]
    m, width = len(items), len(items) + 3 * (n + 1)
    seconds = [blocks[i][k].seconds for i, k in items]
    cost = np.zeros(width)
    cost[:m] = seconds
    integrality = np.zeros(width)
    integrality[:m] = 1
    upper = np.full(width, np.inf)
    upper[:m] = 1
    deadline = time.perf_counter() + time_limit
    target = budget
    for _ in range(8):
        left = deadline - time.perf_counter()
        if target <= 0 or left <= 0:
            break
        rows = _chain_rows(costs, blocks, items, target)
        if bound is not None:  # faster than the answer in hand, by more than rounding
            rows.append((dict(enumerate(seconds)), -math.inf, bound * (1 - 1e-9)))
        entries = [(r, c, v) for r, (coefs, _, _) in enumerate(rows) for c, v in coefs.items()]
        r_, c_, v_ = zip(*entries, strict=True)
        a = csr_matrix((v_, (r_, c_)), shape=(len(rows), width))
        result = milp(
            cost,
            constraints=LinearConstraint(a, [r[1] for r in rows], [r[2] for r in rows]),
            integrality=integrality,
            bounds=Bounds(np.zeros(width), upper),
            options={"mip_rel_gap": 0.0, "time_limit": left},
        )
        if result.x is None:
            return ChainAnswer(None, result.status == 2)  # 2: proven infeasible
        picks = [-1] * n
        for c, (i, k) in enumerate(items):
            if result.x[c] > 0.5:
                picks[i] = k
        peak = chain_peak(costs, chosen(blocks, picks))
        if peak <= budget:
            return ChainAnswer(picks, result.status == 0 and target == budget)
        target -= peak - budget
    return ChainAnswer(None, False)


def _chain_rows(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    items: Sequence[tuple[int, int]],
    target: int,
) -> list[tuple[dict[int, float], float, float]]:
    """The rows (coefficients by column, low, high) of :func:`_chain_milp` at ``target``.

    Columns: a binary ``x`` per option (``items``: block ``i``, option ``o``), then per block
    boundary ``b`` continuous ``P_b`` (the kept bytes of the options that end by ``b``), then
    ``S_b`` (what the options that start at ``b`` or later leave held after their backward),
    then ``Q_b`` (the cached bytes of the options that end by ``b``). Every block is covered by
    exactly one option; the forward's end reads ``H + P_n`` and ``H_f + P_n + Q_n``, the tail
    ``tail + S_0``, and option ``(i, o)``, where it is chosen, its backward
    ``E + G + P_i + B_o + S_{i + span}`` and its forward ``F_i + P_i + Q_i + A_o``, each by a
    big-M row that holds for every value the sums can take when it is not. Bytes are in units
    of ``target``."""
    n, m = len(blocks), len(items)
    p0, s0, q0 = m, m + n + 1, m + 2 * (n + 1)
    scale = float(target)
    chosen_at = [(c, i, blocks[i][k]) for c, (i, k) in enumerate(items)]
    rows: list[tuple[dict[int, float], float, float]] = [
        ({p0: 1.0}, 0.0, 0.0),
        ({s0 + n: 1.0}, 0.0, 0.0),
    ]
    for b in range(n):  # each block covered once
        rows.append(({c: 1.0 for c, i, o in chosen_at if i <= b < i + o.span}, 1.0, 1.0))
    for b in range(1, n + 1):  # P_b = P_{b-1} + kept of the options ending at b
        ending = {c: -o.kept / scale for c, i, o in chosen_at if i + o.span == b}
        rows.append(({p0 + b: 1.0, p0 + b - 1: -1.0, **ending}, 0.0, 0.0))
    for b in range(n):  # S_b = S_{b+1} + left of the options starting at b
        starting = {c: -o.left / scale for c, i, o in chosen_at if i == b}
        rows.append(({s0 + b: 1.0, s0 + b + 1: -1.0, **starting}, 0.0, 0.0))
    rows.append(({q0: 1.0}, 0.0, 0.0))
    for b in range(1, n + 1):  # Q_b = Q_{b-1} + cached of the options ending at b
        ending = {c: -o.cached / scale for c, i, o in chosen_at if i + o.span == b}
        rows.append(({q0 + b: 1.0, q0 + b - 1: -1.0, **ending}, 0.0, 0.0))
    rows.append(({p0 + n: 1.0}, -math.inf, (target - costs.head) / scale))
    rows.append(({p0 + n: 1.0, q0 + n: 1.0}, -math.inf, (target - costs.end(0)) / scale))
    rows.append(({s0: 1.0}, -math.inf, (target - costs.tail) / scale))

    def chosen_only(c: int, sums: dict[int, float], fixed: int, most: int) -> None:
        """``fixed + sums <= target`` where option ``c`` is chosen: a big-M row."""
        big = (fixed + most - target) / scale  # the row's excess at its largest
        if big > 0:
            rows.append(({**sums, c: big}, -math.inf, (target - fixed) / scale + big))

    kept = sum(max(o.kept for o in opts) for opts in blocks)
    most = kept + sum(max(o.left for o in opts) for opts in blocks)
    cached = kept + sum(max(o.cached for o in opts) for opts in blocks)
    for c, i, o in chosen_at:
        fixed = costs.before + costs.gap(i, o.span) + o.backward
        chosen_only(c, {p0 + i: 1.0, s0 + i + o.span: 1.0}, fixed, most)
        start = costs.start(i)
        if start is not None:
            chosen_only(c, {p0 + i: 1.0, q0 + i: 1.0}, start + o.forward, cached)
    return rows


def _chain_dp(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    budget: int,
    grid: int,
    rgrid: int,
) -> tuple[list[int] | None, bool]:
    """The DP for options that cache nothing: an assignment that fits (None: none found), and
    whether the answer is settled (the fastest that fits, or none fits). An answer found on a
    lowered target is not: a faster assignment may fit, or one may fit where none was found."""
    if not blocks:
        return ([] if max(costs.head, costs.tail) <= budget else None), True
    _, fastest = _fastest(blocks)
    if chain_peak(costs, chosen(blocks, fastest)) <= budget:
        return fastest, True  # nothing to trade: the grid's rounding must not cost time here
    # Rounding down can admit an answer the exact model puts over the budget: refine the grid
    # (the error falls with the unit), then, on the finest, lower the target below that
    # answer's peak on the grid, by its excess. On a grid, every assignment that fits is
    # admitted: none admitted means none fits, and an admitted answer that fits is the fastest.
    grids = [grid * 4**k for k in range(4) if k == 0 or grid * 4**k <= max(grid, 1 << 14)]
    for g in grids:
        found = _chain_dp_grid(costs, blocks, budget, budget, g, rgrid)
        if found is None:
            return None, True
        if chain_peak(costs, chosen(blocks, found[0])) <= budget:
            return found[0], True
    target = budget
    for _ in range(16):
        found = _chain_dp_grid(costs, blocks, target, budget, grids[-1], rgrid)
        if found is None:
            return None, False
        picks, on_grid = found
        peak = chain_peak(costs, chosen(blocks, picks))
        if peak <= budget:
            return picks, False
        target = min(target, on_grid) - max(peak - budget, budget // grids[-1], 1)
    return None, False


def _chain_dp_grid(
    costs: ChainCosts,
    blocks: Sequence[Sequence[ChainOption]],
    target: int,
    budget: int,
    grid: int,
    rgrid: int,
) -> tuple[list[int], int] | None:
    """The DP on the grid: the fastest assignment and its peak as the grid sees it."""
    import numpy as np

    unit = max(budget / grid, 1.0)
    # The kept bytes of all blocks reach at most target - head (the forward's end fits).
    size = int((target - min(costs.head, 0)) / unit) + 2
    lefts = max((o.left for opts in blocks for o in opts), default=0)
    # The reservation axis: what blocks after this one leave behind (see [ The chain DP ]).
    runit = max(budget / rgrid, 1.0)
    rsize = min(int(lefts * len(blocks) / runit) + 2, rgrid + 2) if lefts > 0 else 1
    if rsize > 2:  # two points (0 and one unit) already cover a total below one unit
        runit = max(lefts * len(blocks) / (rsize - 2), 1.0)
    if costs.tail > target or target <= 0:
        return None
    inf = math.inf
    n = len(blocks)
    reserve = np.arange(rsize) * runit
    prefix = (np.arange(size) * unit)[:, None]
    # best[t]: the least time to boundary t (blocks before t done) in each state; a segment
    # moves from boundary i to i + span (see [ Segments ]).
    best: list[Any] = [np.full((size, rsize), inf) for _ in range(n + 1)]
    best[0][0] = np.where(costs.tail + reserve <= target, 0.0, inf)
    pick = [np.full((size, rsize), -1, dtype=np.int64) for _ in range(n + 1)]
    start = [np.full((size, rsize), -1, dtype=np.int64) for _ in range(n + 1)]
    for i, options in enumerate(blocks):
        here = best[i]
        if not np.isfinite(here).any():
            continue
        for k, o in enumerate(options):
            t = i + o.span
            step = int(o.kept // unit)
            rstep = int(o.left // runit) if rsize > 1 else 0
            if t > n or step >= size or rstep >= rsize:
                continue
            after = reserve[None, :] - rstep * runit  # reserved for the blocks after this one
            gap = costs.gap(i, o.span)
            allowed = costs.before + gap + prefix + o.backward + after <= target
            level = costs.start(i)
            if level is not None:  # its forward (no casts cached: see ``_raised_dp``)
                allowed &= level + prefix + o.forward <= target
            value = np.where(allowed, here + o.seconds, inf)
            src = value[: size - step, rstep:]
            dst = best[t][step:, : rsize - rstep]
            better = src < dst
            dst[better] = src[better]
            pick[t][step:, : rsize - rstep][better] = k
            start[t][step:, : rsize - rstep][better] = i
    final = np.where(costs.head + prefix <= target, best[n], inf)
    end = np.unravel_index(int(np.argmin(final)), final.shape)
    if not math.isfinite(final[end]):
        return None
    picks = [-1] * n
    p, r, t = int(end[0]), int(end[1]), n
    while t > 0:
        k, i = int(pick[t][p, r]), int(start[t][p, r])
        picks[i] = k
        p -= int(blocks[i][k].kept // unit)
        r += int(blocks[i][k].left // runit) if rsize > 1 else 0
        t = i
    on_grid = [
        dataclasses.replace(
            o,
            kept=int(o.kept // unit * unit),
            left=int(o.left // runit * runit) if rsize > 1 else 0,
        )
        for o in chosen(blocks, picks)
    ]
    return picks, chain_peak(costs, on_grid)


def chain_brute_force(
    costs: ChainCosts, blocks: Sequence[Sequence[ChainOption]], budget: int
) -> float | None:
    """The fastest feasible assignment's time by enumeration, segments included (tests only)."""

    def tilings(i: int) -> Iterator[list[ChainOption]]:
        if i == len(blocks):
            yield []
            return
        for o in blocks[i]:
            if i + o.span <= len(blocks):
                for rest in tilings(i + o.span):
                    yield [o, *rest]

    best: float | None = None
    for combo in tilings(0):
        if chain_peak(costs, combo) <= budget:
            t = sum(o.seconds for o in combo)
            best = t if best is None else min(best, t)
    return best


def chain_greedy(
    costs: ChainCosts, blocks: Sequence[Sequence[ChainOption]], budget: int
) -> list[int] | None:
    """The baseline: start from each block's fastest option and repeatedly take the change
    that saves the most peak bytes per second added, until the chain fits (options of one block
    only: no segments)."""
    singles = _singles(blocks)
    picks = [
        min(ks, key=lambda k: opts[k].seconds) for opts, ks in zip(blocks, singles, strict=True)
    ]

    def peak(p: list[int]) -> int:
        return chain_peak(costs, chosen(blocks, p))

    current = peak(picks)
    while current > budget:
        move: tuple[float, int, int] | None = None
        for i, opts in enumerate(blocks):
            for k in singles[i]:
                o = opts[k]
                trial = [*picks[:i], k, *picks[i + 1 :]]
                saved = current - peak(trial)
                if saved <= 0:
                    continue
                added = max(o.seconds - opts[picks[i]].seconds, 1e-12)
                rate = saved / added
                if move is None or rate > move[0]:
                    move = (rate, i, k)
        if move is None:
            return None
        picks[move[1]] = move[2]
        current = peak(picks)
    return picks
