"""Present ``remat bench`` results: a table, a JSON document, a memory-versus-time plot."""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RematError

__all__: list[str] = []

MIB = 2**20


@dataclass(frozen=True)
class Row:
    """One strategy's results. Bytes are activation peaks; ratios are against ``none``."""

    strategy: str
    description: str
    peak_bytes: int
    memory_ratio: float
    step_seconds: float
    time_ratio: float
    # Loss and every gradient bit-equal to a plain step's; ``None``: the plain step did not
    # reproduce itself on the device, so nothing could be compared (``measure.exactness``).
    grads_equal: bool | None
    counterpart: str | None = None
    counterpart_time_ratio: float | None = None
    faults_per_step: float = 0.0  # minor page faults of the process per timed step (median)
    # A planned strategy's prediction (``remat-auto@...``): peak bytes, time vs none, and the
    # seconds its plan took after the shared profile (solve and measured check; see
    # ``Result.profile_seconds``) and to solve alone.
    predicted_peak_bytes: float | None = None
    predicted_time_ratio: float | None = None
    plan_seconds: float | None = None
    solve_seconds: float | None = None
    budget_bytes: float | None = None  # the budget planned for
    # False: no plan fits the budget asked for; planned at the budget the planner named
    # instead (``budget_bytes``), and ``no_plan`` is the planner's message.
    budget_feasible: bool | None = None
    no_plan: str | None = None
    # The plan's option for each block, in runs of consecutive blocks (``Plan.block_runs``).
    plan_blocks: list[str] | None = None
    # Every buffer bit-equal to a plain step's (``None``: the model has none, or nothing could
    # be compared).
    buffers_equal: bool | None = None
    not_compared: str | None = None  # why nothing could be compared, where it could not


def exact(row: Row) -> str:
    """The exactness cell: ``yes``, ``NO: grads``, ``NO: buffers`` or ``n/a``."""
    if row.grads_equal is None:
        return "n/a"
    wrong = [
        what
        for what, ok in (("grads", row.grads_equal), ("buffers", row.buffers_equal))
        if ok is False
    ]
    return f"NO: {', '.join(wrong)}" if wrong else "yes"


def exactness_lines(result: Result) -> list[str]:
    """What the exactness column's ``n/a`` and ``NO: buffers`` mean, where the table has them."""
    lines = []
    unknown: dict[str, list[str]] = {}
    for r in result.rows:
        if r.grads_equal is None:
            unknown.setdefault(r.not_compared or "no reason recorded", []).append(r.strategy)
    for why, names in unknown.items():
        lines.append(f"exact n/a ({', '.join(names)}): {why}, so nothing could be compared")
    buffers = [r.strategy for r in result.rows if r.grads_equal and r.buffers_equal is False]
    if buffers:
        lines.append(
            f"exact NO: buffers ({', '.join(buffers)}): gradients equal to the plain step's, "
            "buffers not: the step wrote state a second time (a recompute that runs the "
            "forward's writes again updates BatchNorm's running statistics twice)"
        )
    return lines


@dataclass(frozen=True)
class Dominance:
    """A torch strategy's point against the planner's at its measured peak
    (``remat-auto@torch-...``): memories, the paired step-time ratio and the verdict."""

    torch: str
    planned: str
    torch_peak_bytes: int
    planned_peak_bytes: int
    time_ratio: float | None  # the planned step over the torch step, paired median over rounds
    control_spread: float  # the timing control's distance from 1
    verdict: str  # see :func:`verdict`; "no plan fits" when none fits the torch peak
    smallest_budget_bytes: float | None = None  # where no plan fits: the smallest that does


@dataclass(frozen=True)
class Result:
    workload: str
    description: str
    device: str
    rounds: int
    contended_rounds: int
    used_rounds: int
    rows: list[Row]
    pairwise_time: dict[str, float]
    recording_us_per_op: float | None = None
    replay_us_per_op: float | None = None  # the graph engine's Python per op it replays
    # A dispatch mode that only runs each op, per op in forward: the floor under recording.
    dispatch_mode_us_per_op: float | None = None
    allocator: str = "cached"  # see ``remat bench --allocator``
    autocast: str | None = None  # the dtype of forward and loss under torch.autocast, if any
    # The plain step against a second plain model timed next to it in every round: the median
    # ratio, and its lowest and highest round (see ``measure.times``).
    control_time_ratio: float | None = None
    control_time_range: tuple[float, float] | None = None
    processes: int = 1  # timing processes whose rounds were pooled
    round_seconds: list[dict[str, float]] | None = None  # each round's step times, by strategy
    profile_seconds: float | None = None  # remat.plan's one profile for all planned strategies
    dominance: list[Dominance] = field(default_factory=list)  # one per remat-auto@torch-...
    # What produced the result: the command line, the date, the versions, the options asked
    # for (``remat bench``'s ``_provenance``).
    run: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# The least timing noise a verdict allows for: the control of one run can read 1.000 while the
# same code's ratio moves by about 1% from run to run here (docs/benchmarks.md: 0.993, then
# 1.003), so a plan 0.5% faster than torch in one run does not dominate it.
MIN_SPREAD = 0.01

# The fewest rounds (pooled over timing processes) whose median a verdict is drawn from: a
# single round's ratio moves by 10-20% here (docs/benchmarks.md: single rounds from 0.83 to
# 1.40), and the median of two is their mean.
MIN_ROUNDS = 3
TOO_FEW_ROUNDS = "too few rounds for a verdict"

# A timing control (the plain step against a second plain model) outside this range says the
# run's step times moved by more than the differences the table is read for.
CONTROL_RANGE = (0.9, 1.1)


def verdict(planned_peak: float, torch_peak: float, time_ratio: float, spread: float) -> str:
    """How the planned point compares with the torch point at the same budget: ``more memory``
    when its peak is above the torch peak; else ``dominates`` when its paired time ratio is
    below 1 by more than the timing control's ``spread``, ``ties (within the control)`` when
    it is within the spread of 1, ``slower`` when above."""
    if planned_peak > torch_peak:
        return "more memory"
    if 1.0 - time_ratio > spread:
        return "dominates"
    if time_ratio - 1.0 <= spread:
        return "ties (within the control)"
    return "slower"


def dominance(rows: list[Row], control_ratio: float | None, *, rounds: int) -> list[Dominance]:
    """One :class:`Dominance` per ``remat-auto@torch-...`` row whose torch strategy is in
    ``rows``, in the order of the rows. ``rounds``: the timed rounds the ratios are medians of;
    below :data:`MIN_ROUNDS` the verdict is :data:`TOO_FEW_ROUNDS`."""
    from .strategies import matched_torch

    spread = max(abs(control_ratio - 1.0) if control_ratio is not None else 0.0, MIN_SPREAD)
    by_name = {r.strategy: r for r in rows}
    found = []
    for planned in rows:
        torch_row = by_name.get(matched_torch(planned.strategy) or "")
        if torch_row is None:
            continue
        ratio = planned.counterpart_time_ratio
        feasible = planned.budget_feasible is not False
        if not feasible:
            judged = "no plan fits"
        elif ratio is None:
            judged = "not timed"
        elif rounds < MIN_ROUNDS:
            judged = f"{TOO_FEW_ROUNDS} ({_rounds(rounds)}; it takes {MIN_ROUNDS})"
        else:
            judged = verdict(planned.peak_bytes, torch_row.peak_bytes, ratio, spread)
        found.append(
            Dominance(
                torch=torch_row.strategy,
                planned=planned.strategy,
                torch_peak_bytes=torch_row.peak_bytes,
                planned_peak_bytes=planned.peak_bytes,
                time_ratio=ratio,
                control_spread=spread,
                verdict=judged,
                smallest_budget_bytes=None if feasible else planned.budget_bytes,
            )
        )
    return found


def _rounds(n: int) -> str:
    return f"{n} round{'' if n == 1 else 's'}"


def timing_warning(result: Result) -> str | None:
    """A warning for the line under the table where the run's step times are not reliable:
    fewer than :data:`MIN_ROUNDS` rounds, rounds in which other processes competed for the CPU
    kept for want of clean ones, or a timing control outside :data:`CONTROL_RANGE`; what to do
    about it. ``None`` where none of these holds."""
    why = []
    if result.used_rounds < MIN_ROUNDS:
        why.append(f"medians of {_rounds(result.used_rounds)}")
    kept = result.used_rounds - (result.rounds - result.contended_rounds)
    if kept > 0:
        why.append(
            f"{kept} of the {_rounds(result.used_rounds)} used had other processes competing "
            "for the CPU"
        )
    control = result.control_time_ratio
    low, high = CONTROL_RANGE
    if control is not None and not low <= control <= high:
        why.append(f"the timing control reads {control:.3f}, outside {low}-{high}")
    if not why:
        return None
    return (
        f"WARNING: the step times and time ratios above are not reliable ({'; '.join(why)}). "
        f"Time again with --rounds {max(7, MIN_ROUNDS)} or more, or --processes 3, on a quiet "
        "machine."
    )


def dominance_lines(result: Result) -> list[str]:
    """The planned point at each torch strategy's measured peak, one line per torch strategy."""
    lines = []
    for d in result.dominance:
        ratio = "not timed" if d.time_ratio is None else f"{d.time_ratio:.3f}"
        torch_point = f"{d.torch} {mib(d.torch_peak_bytes, 2)} MiB"
        point = f"{d.planned} {mib(d.planned_peak_bytes, 2)} MiB, time vs {d.torch} {ratio}"
        if d.smallest_budget_bytes is not None:
            lines.append(
                f"{torch_point}: no plan fits; the smallest budget that fits is "
                f"{mib(d.smallest_budget_bytes, 2)} MiB ({point}, planned at that budget)"
            )
        else:
            lines.append(f"{torch_point}: {point} (control +-{d.control_spread:.3f}): {d.verdict}")
    return lines


def mib(n: float, least: int = 1) -> str:
    """Bytes in MiB with at least three significant figures and ``least`` decimals: 558.1,
    21.3, 0.213; peaks of a small workload that differ by tens of KiB read differently."""
    value = n / MIB
    decimals = least
    if value != 0 and abs(value) < 100:
        decimals = max(least, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def _predicted(row: Row) -> str:
    if row.predicted_peak_bytes is None or row.predicted_time_ratio is None:
        return ""
    note = ""
    if row.budget_feasible is False and row.budget_bytes is not None:
        note = f" (no plan fits; smallest {mib(row.budget_bytes)} MiB)"
    return f"{mib(row.predicted_peak_bytes)} / {row.predicted_time_ratio:.2f}{note}"


def table(result: Result) -> Any:
    """A rich table of the results."""
    from rich.table import Table

    t = Table(
        title=f"remat bench: {result.workload} on {result.device}", caption=result.description
    )
    headers = ("strategy", "peak act. MiB", "mem vs none", "step s", "time vs none")
    predicted = any(row.predicted_peak_bytes is not None for row in result.rows)
    extra = ("predicted MiB / time",) if predicted else ()
    for header in (*headers, *extra, "time vs torch", "exact"):
        t.add_column(header, justify="left" if header == "strategy" else "right", no_wrap=True)
    for row in result.rows:
        t.add_row(
            row.strategy,
            mib(row.peak_bytes),
            f"{row.memory_ratio:.2f}",
            f"{row.step_seconds:.3f}",
            f"{row.time_ratio:.2f}",
            *((_predicted(row),) if predicted else ()),
            _vs(row),
            exact(row),
        )
    return t


def print_table(result: Result) -> None:
    """Print :func:`table` to stdout, in a log or a narrow terminal as wide as the table, so
    that no header or cell is cut."""
    from rich.console import Console

    console = Console()
    results = table(result)
    unbounded = console.options.update_width(10_000)
    needed = max(console.measure(results, options=unbounded).maximum, 160)
    if console.width < needed:
        console = Console(width=needed)
    console.print(results)


def _vs(row: Row) -> str:
    if row.counterpart is None or row.counterpart_time_ratio is None:
        return ""
    return f"{row.counterpart_time_ratio:.3f} ({row.counterpart})"


def markdown(result: Result) -> str:
    """The results as a Markdown table, for the README."""
    lines = [
        "| strategy | peak activation MiB | memory vs none | step s | time vs none "
        "| time vs torch, same granularity | exact |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result.rows:
        lines.append(
            f"| {r.strategy} | {mib(r.peak_bytes)} | {r.memory_ratio:.2f} | "
            f"{r.step_seconds:.3f} | {r.time_ratio:.2f} | {_vs(r)} | "
            f"{exact(r)} |"
        )
    return "\n".join(lines)


def check_writable(path: Path) -> None:
    """Raise a :class:`RematError` now if ``path`` cannot be written later."""
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RematError(f"remat bench: cannot create {directory}: {error.strerror}") from None
    if path.is_dir():
        raise RematError(f"remat bench: {path} is a directory; give a file path.")
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.")
    except OSError as error:
        raise RematError(
            f"remat bench: cannot write in {directory} ({error.strerror}); choose another path."
        ) from None
    os.close(fd)
    os.unlink(probe)


def _open_mode(path: Path) -> int:
    """The permissions a plain ``open(path, "w")`` leaves the file with: an existing file's
    own, else ``0o666`` less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed onto it: a reader never sees
    half a file. The file gets the permissions :func:`_open_mode` names, not mkstemp's 0600."""
    mode = _open_mode(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(result: Result, path: Path) -> None:
    _atomic_write(path, (json.dumps(result.to_json(), indent=2) + "\n").encode())


def plot_formats() -> dict[str, str]:
    """The file formats matplotlib writes here, by suffix (without the dot): its description."""
    import shutil

    from matplotlib import rcParams
    from matplotlib.backend_bases import FigureCanvasBase

    formats: dict[str, str] = dict(FigureCanvasBase.get_supported_filetypes())
    if shutil.which(str(rcParams["pgf.texsystem"])) is None:
        formats.pop("pgf", None)  # PGF measures its text with LaTeX
    return formats


def check_plot_format(path: Path) -> None:
    """Raise a :class:`RematError` now if matplotlib cannot write the format ``path``'s suffix
    names."""
    formats = plot_formats()
    suffix = path.suffix[1:].lower()
    if suffix not in formats:
        named = f"the suffix .{suffix}" if suffix else "no suffix"
        raise RematError(
            f"remat bench: --plot {path} has {named}; the plot's format comes from it: "
            f"{', '.join('.' + f for f in sorted(formats))}."
        )


def write_plot(result: Result, path: Path) -> None:
    """Activation memory against step time (see :func:`figure`), in the format ``path``'s
    suffix names (:func:`check_plot_format`)."""
    import io

    import matplotlib.pyplot as plt

    fig = figure(result)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix[1:].lower())
    plt.close(fig)
    _atomic_write(path, buffer.getvalue())


def figure(result: Result) -> Any:
    """Activation memory against step time: one point per strategy, the planner's points
    joined by budget, the Pareto front; every label placed where it overlaps no other label,
    point, drawn line or the legend (:func:`_label_positions`), a numbered key under the axes
    for names that fit nowhere. A matplotlib figure (Agg); close it with ``plt.close``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .strategies import matched_torch

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    rows = result.rows
    xs = [r.step_seconds for r in rows]
    ys = [r.peak_bytes / MIB for r in rows]
    kind = [_kind(r.strategy) for r in rows]
    lines: list[list[tuple[float, float]]] = []  # drawn lines the labels keep off
    front = _pareto(list(zip(xs, ys, strict=True)))
    ax.step(
        [p[0] for p in front],
        [p[1] for p in front],
        where="post",
        color="gray",
        linestyle="--",
        zorder=2,
        label="Pareto front",
    )
    for k, color, label in (
        ("baseline", "tab:blue", "torch and no checkpointing"),
        ("remat", "tab:green", "remat strategies by hand"),
    ):
        picked = [i for i in range(len(rows)) if kind[i] == k]
        if picked:
            ax.scatter(
                [xs[i] for i in picked],
                [ys[i] for i in picked],
                c=color,
                s=40,
                zorder=3,
                label=label,
            )
    for k, color, label in (
        ("auto", "tab:orange", "remat.plan at each budget"),
        ("auto-disk", "tab:purple", "remat.plan with the disk tier"),
    ):
        # In order of memory: the front as the budget shrinks.
        line = sorted((ys[i], xs[i]) for i in range(len(rows)) if kind[i] == k)
        if line:
            lines.append([(x, y) for y, x in line])
            ax.plot(
                [p[1] for p in line],
                [p[0] for p in line],
                color=color,
                marker="o",
                zorder=4,
                label=label,
            )
    matched = [i for i in range(len(rows)) if kind[i] == "matched"]
    if matched:
        # Each ring sits on (or near) its torch strategy's point: the plan at that peak.
        ax.scatter(
            [xs[i] for i in matched],
            [ys[i] for i in matched],
            s=130,
            facecolors="none",
            edgecolors="tab:orange",
            linewidths=1.5,
            zorder=5,
            label="remat.plan at each torch point's peak",
        )
        at = {r.strategy: (xs[i], ys[i]) for i, r in enumerate(rows)}
        for i in matched:
            start = at.get(matched_torch(rows[i].strategy) or "")
            if start is not None:  # from the torch point to the plan at its peak
                lines.append([start, (xs[i], ys[i])])
                ax.annotate(
                    "",
                    (xs[i], ys[i]),
                    start,
                    arrowprops={
                        "arrowstyle": "->",
                        "color": "tab:orange",
                        "lw": 1.0,
                        "shrinkA": 4,
                        "shrinkB": 7,
                    },
                    zorder=5,
                )
    ax.set_xlabel("step time (s, median)")
    ax.set_ylabel("peak activation memory (MiB)")
    ax.set_title(f"remat bench: {result.workload} ({result.device})", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.08, y=0.08)
    ax.set_ylim(bottom=0)
    legend = ax.legend(loc="upper right", fontsize=8)
    # Labels: the baselines first, then the planner's budgets, then the rest; the rings go
    # unlabelled (the table names them).
    order = sorted(
        (i for i in range(len(rows)) if kind[i] != "matched"),
        key=lambda i: ("baseline", "auto", "auto-disk", "remat").index(kind[i]),
    )
    points = [(xs[i], ys[i], rows[i].strategy) for i in order]
    fig.tight_layout()
    labels, key = _annotate(fig, ax, legend, points, lines)
    if key:
        # A strip under the axes for the key, about 140 characters a line at its size; the
        # labels are placed again in the smaller axes.
        lines_needed = len("  ".join(key)) // 140 + 1
        for label in labels:
            label.remove()
        fig.tight_layout(rect=(0, min(0.4, 0.03 + 0.03 * lines_needed), 1, 1))
        _, key = _annotate(fig, ax, legend, points, lines)
        fig.text(0.01, 0.01, "  ".join(key), fontsize=7, va="bottom", wrap=True)
    return fig


def _kind(strategy: str) -> str:
    from .strategies import AUTO, AUTO_DISK, matched_torch

    if matched_torch(strategy) is not None:
        return "matched"
    if strategy.startswith(AUTO):
        return "auto"
    if strategy.startswith(AUTO_DISK):
        return "auto-disk"
    return "remat" if strategy.startswith("remat") else "baseline"


def _annotate(
    fig: Any,
    ax: Any,
    legend: Any,
    points: list[tuple[float, float, str]],
    lines: list[list[tuple[float, float]]],
) -> tuple[list[Any], list[str]]:
    """Label each point of ``points`` (data coordinates, name) at a free place, off the
    ``lines`` too; a point whose name fits nowhere gets a number. Returns the labels drawn and
    the key: which name each number is."""
    renderer = fig.canvas.get_renderer()
    scale = fig.dpi / 72  # points to pixels
    centres = [tuple(ax.transData.transform((x, y))) for x, y, _ in points]
    radius = 6 * scale  # half a marker (s=40) and a little space, in pixels
    obstacles = [(cx - radius, cy - radius, cx + radius, cy + radius) for cx, cy in centres]
    box = legend.get_window_extent(renderer)
    obstacles.append((box.x0, box.y0, box.x1, box.y1))
    for line in lines:  # small boxes every few pixels along each segment
        ends = [tuple(ax.transData.transform(p)) for p in line]
        for (x0, y0), (x1, y1) in itertools.pairwise(ends):
            steps = max(1, int(max(abs(x1 - x0), abs(y1 - y0)) / 4))
            for k in range(steps + 1):
                x, y = x0 + (x1 - x0) * k / steps, y0 + (y1 - y0) * k / steps
                obstacles.append((x - 1.5, y - 1.5, x + 1.5, y + 1.5))
    frame = ax.get_window_extent(renderer)
    names = [name for _, _, name in points]
    numbers = [str(n + 1) for n in range(len(points))]

    def size(text: str) -> tuple[float, float]:
        probe = ax.text(0, 0, text, fontsize=8)
        extent = probe.get_window_extent(renderer)
        probe.remove()
        return extent.width, extent.height

    places = _label_positions(
        centres,
        [size(n) for n in names],
        [size(n) for n in numbers],
        obstacles,
        (frame.x0, frame.y0, frame.x1, frame.y1),
        scale,
    )
    labels, key = [], []
    for (x, y, name), number, place in zip(points, numbers, places, strict=True):
        dx, dy, ha, va, numbered = place
        far = dx * dx + dy * dy > 10**2  # beyond the first ring: a leader line
        label = ax.annotate(
            number if numbered else name,
            (x, y),
            textcoords="offset points",
            xytext=(dx, dy),
            fontsize=8,
            ha=ha,
            va=va,
            arrowprops={"arrowstyle": "-", "color": "0.4", "lw": 0.7, "shrinkA": 0, "shrinkB": 4}
            if far
            else None,
            # Readable where a line of the plot runs under it.
            bbox={
                "boxstyle": "square,pad=0.1",
                "facecolor": "white",
                "edgecolor": "none",
                "alpha": 0.8,
            },
            zorder=6,
        )
        labels.append(label)
        if numbered:
            key.append(f"{number}: {name}")
    return labels, key


Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels


def _label_positions(
    centres: list[tuple[float, float]],
    sizes: list[tuple[float, float]],
    number_sizes: list[tuple[float, float]],
    obstacles: list[Box],
    frame: Box,
    scale: float,
) -> list[tuple[float, float, str, str, bool]]:
    """Where each point's label goes, greedily in the order given: the nearest offset (points)
    around the point whose text box stays inside ``frame`` and overlaps no obstacle and no
    label placed before it, the name first, else its number (the ``bool``). Returns the offset,
    the text's alignment and whether it is numbered. A label that fits nowhere sits to the
    right of its point, overlapping."""
    import math

    angles = (0, 30, -30, 180, 150, -150, 90, -90, 60, -60, 120, -120)
    rings = (6, 14, 24, 36, 50, 66, 84)
    candidates = [(r, a) for r in rings for a in angles]
    taken = list(obstacles)
    places: list[tuple[float, float, str, str, bool]] = []
    for (cx, cy), name_size, number_size in zip(centres, sizes, number_sizes, strict=True):
        place: tuple[float, float, str, str, bool] | None = None
        for numbered, (w, h) in ((False, name_size), (True, number_size)):
            for r, a in candidates:
                cos, sin = math.cos(math.radians(a)), math.sin(math.radians(a))
                dx, dy = r * cos, r * sin
                ha = "left" if cos > 0.3 else "right" if cos < -0.3 else "center"
                va = "bottom" if sin > 0.3 else "top" if sin < -0.3 else "center"
                text = text_box(cx + dx * scale, cy + dy * scale, w, h, ha, va)
                if _inside(text, frame) and not any(_overlap(text, t) for t in taken):
                    place = (dx, dy, ha, va, numbered)
                    taken.append(text)
                    break
            if place is not None:
                break
        places.append(place or (6.0, 0.0, "left", "center", False))
    return places


def text_box(x: float, y: float, w: float, h: float, ha: str, va: str) -> Box:
    """The box of a ``w`` by ``h`` text anchored at ``(x, y)`` with that alignment."""
    x0 = x if ha == "left" else x - w if ha == "right" else x - w / 2
    y0 = y if va == "bottom" else y - h if va == "top" else y - h / 2
    return (x0, y0, x0 + w, y0 + h)


def _inside(box: Box, frame: Box) -> bool:
    return box[0] >= frame[0] and box[1] >= frame[1] and box[2] <= frame[2] and box[3] <= frame[3]


def _overlap(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both time and memory, by increasing time."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front
