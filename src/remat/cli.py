"""The ``remat`` command line: ``remat bench`` compares every strategy on one workload."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import RematError, did_you_mean

if TYPE_CHECKING:
    import torch

    from .bench._child import ForkServer

__all__: list[str] = []


_DEFAULT_BUDGETS = "0.75,0.5,0.25,torch"
# Below what recompute alone reaches on the default workload (gpt, medium: 20% of the plain peak).
_DEFAULT_DISK_BUDGETS = "0.18"
# ``--autocast``: the dtypes torch.autocast takes on a CPU and on CUDA.
_AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="remat", description="remat bench compares every strategy on one workload."
    )
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="compare activation memory and step time of every strategy on a workload",
        description=(
            "Measures each strategy's peak activation memory in a fresh process and all step "
            "times side by side in one process, and checks each strategy's gradients against a "
            "plain run bit for bit."
        ),
    )
    bench.add_argument("--workload", help="built-in workload (default: gpt)")
    bench.add_argument(
        "--size",
        help="small (milliseconds a step), medium (where memory matters, a fraction of a second "
        "a step here) or bench (about 1 GiB of activations) (default: medium; small with "
        "--pipeline and --offload)",
    )
    bench.add_argument(
        "--hf", metavar="MODEL", help="a Hugging Face model from its config: gpt2, llama or bert"
    )
    bench.add_argument(
        "--strategies", help="comma-separated strategy names (default: all registered)"
    )
    bench.add_argument(
        "--budgets",
        help="comma-separated memory budgets as fractions of the plain step's activation peak "
        "or percentages of it (e.g. 0.5,0.25,10%%): adds a remat-auto@50%%-style strategy per "
        "budget, planned by remat.plan from one profile, with its prediction next to the "
        "measurement; the word "
        "torch adds remat-auto@torch-block-style strategies, one per torch strategy of the run, "
        "planned at its measured peak and timed against it, with a line after the table on "
        "whether the planned point dominates the torch one "
        f"(default: {_DEFAULT_BUDGETS} when --strategies is not given, else none)",
    )
    bench.add_argument(
        "--disk-budgets",
        help="comma-separated budgets, as for --budgets, planned with the disk tier among what "
        "the plan may use (remat.plan(..., tiers=['recompute', 'disk'])): adds a "
        "remat-auto-disk@10%%-style strategy per budget, reaching below what recompute alone "
        f"can (default: {_DEFAULT_DISK_BUDGETS} when --strategies is not given, else none)",
    )
    bench.add_argument("--rounds", type=int, default=7, help="timed rounds (default: 7)")
    bench.add_argument(
        "--processes",
        type=int,
        default=1,
        help="timing processes, each timing --rounds rounds; ratios are medians over the rounds "
        "of all of them (default: 1). Where each model's memory lands differs from process to "
        "process and moves step times by a few percent; more processes average that out",
    )
    bench.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda (default: cpu)",
    )
    bench.add_argument(
        "--autocast",
        choices=tuple(_AUTOCAST),
        help="run every strategy's forward and loss under torch.autocast in this dtype, "
        "backward outside it, as a mixed-precision loop does; the planner plans that loop "
        "(default: the model's own dtype, float32)",
    )
    bench.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model's parameters, the batch and dropout, the same for every "
        "strategy (default: 0)",
    )
    bench.add_argument(
        "--allocator",
        choices=("cached", "system"),
        default="cached",
        help="CPU step times: 'cached' (default) fixes glibc's mmap and trim thresholds so "
        "that freed memory stays with the process, as it does with the CUDA caching allocator, "
        "and no step pays for fresh pages that an earlier step of another strategy gave back; "
        "'system' keeps glibc's dynamic thresholds",
    )
    bench.add_argument(
        "--json",
        type=Path,
        help="JSON output (default: bench-out/NAME.json, NAME the workload and size, e.g. "
        "gpt-medium, hf-gpt2-medium, gpt-medium-bf16 with --autocast; offload-gpt-SIZE, "
        "pipeline-unet-SIZE and solve-time-gpt for those runs)",
    )
    bench.add_argument(
        "--plot",
        type=Path,
        help="plot output, in the format its suffix names: .png, .svg, .pdf, ... "
        "(default: --json's path with .png, else bench-out/NAME.png)",
    )
    bench.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (on a terminal) and no progress lines (in a log)",
    )
    bench.add_argument("--list", action="store_true", help="list strategies and workloads")
    bench.add_argument(
        "--offload",
        action="store_true",
        help="offload tiers instead: peak RSS, disk bandwidth and step time of the gpt step "
        "with its saved tensors on disk, and OffloadModel on disk (use with --size bench)",
    )
    bench.add_argument(
        "--solve-time",
        action="store_true",
        help="the planner's time instead: one remat.plan call at 25%% on a 48-layer GPT of the "
        "medium family (one block type), with its profile and solve seconds; with --autocast, "
        "planned for a loop under it",
    )
    bench.add_argument(
        "--pipeline",
        action="store_true",
        help="pipelines instead: memory per stage and step time of the unet workload in "
        "remat.pipe.Pipe and in one process per stage (2 partitions, 4 micro-batches)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the results' provenance
    try:
        with _terminate_as_interrupt():
            return _bench(args)
    except RematError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except _Terminated:
        print("remat bench: terminated.", file=sys.stderr)
        return 128 + 15
    except KeyboardInterrupt:  # the measuring processes are stopped and their files gone
        print("remat bench: interrupted.", file=sys.stderr)
        return 130


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it stops as after Ctrl-C: the measuring
    processes stopped and the temporary files gone."""


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`_Terminated` (in the main thread; elsewhere
    signals cannot be handled and SIGTERM keeps its handler)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# What each run other than the strategy table reads of the options; any other one given to it
# is refused rather than ignored.
_MODES = {
    "list": ("--list", frozenset()),
    "offload": ("--offload", frozenset({"size", "seed", "rounds", "json", "no_progress"})),
    "pipeline": (
        "--pipeline",
        frozenset({"size", "seed", "rounds", "device", "json", "workload", "no_progress"}),
    ),
    "solve_time": ("--solve-time", frozenset({"seed", "autocast", "json", "no_progress"})),
}


def _refuse_unused(args: argparse.Namespace) -> None:
    """Raise a :class:`RematError` for two runs asked at once, or for an option the asked run
    does not read (``_MODES``): an option silently ignored is output that is not what was
    asked for (CPU figures for ``--offload --device cuda``)."""
    modes = [m for m in _MODES if getattr(args, m)]
    if len(modes) > 1:
        flags = " and ".join(_MODES[m][0] for m in modes)
        raise RematError(f"remat bench: {flags} are separate runs; ask for one at a time.")
    if not modes:
        return
    flag, used = _MODES[modes[0]]
    given = [name for name in args.given if name not in used and name not in _MODES]
    if given:
        options = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        reads = (
            ", ".join(f"--{name.replace('_', '-')}" for name in sorted(used)) or "no other option"
        )
        raise RematError(
            f"remat bench {flag}: does not use {options} (it reads {reads}); drop "
            f"{'it' if len(given) == 1 else 'them'}."
        )


def _bench(args: argparse.Namespace) -> int:
    from .bench.strategies import STRATEGIES, get_strategy
    from .workloads import SIZES, WORKLOAD_NAMES, _unknown, get_workload

    # The options given other than as their defaults, before the defaults that depend on the
    # run are filled in.
    defaults = vars(_parser().parse_args(["bench"]))
    args.given = [
        name for name, value in vars(args).items() if name in defaults and value != defaults[name]
    ]
    mode = " --offload" if args.offload else " --pipeline" if args.pipeline else ""
    if args.size is None:
        args.size = "small" if mode else "medium"
    if args.size not in SIZES:  # before a mode's child process would fail on it
        raise _unknown("size", args.size, SIZES)
    args.workload = args.workload or "gpt"  # given or not: "workload" in args.given
    if args.rounds < 1:
        raise RematError(f"remat bench{mode}: --rounds must be at least 1, got {args.rounds}.")
    if args.processes < 1:
        raise RematError(f"remat bench: --processes must be at least 1, got {args.processes}.")
    if args.processes > 1 and (args.pipeline or args.offload):
        raise RematError(
            "remat bench: --processes pools the step times of the strategy table; --pipeline "
            "and --offload measure in one process each. Drop --processes."
        )
    if args.autocast and (args.pipeline or args.offload):
        raise RematError(
            "remat bench: --autocast runs the strategy table and --solve-time under autocast; "
            "--pipeline and --offload measure in float32. Drop --autocast."
        )
    if args.pipeline:
        return _pipeline(args)
    if args.offload:
        return _offload(args)
    if args.solve_time:
        return _solve_time(args)
    _refuse_unused(args)
    if args.list:
        for entry in STRATEGIES.values():
            print(f"{entry.name:20} {entry.description}")
        print(
            f"{'remat-auto@50%':20} remat.plan at a budget (--budgets 0.5); remat-auto@torch-block "
            "at that strategy's measured peak (--budgets torch); remat-auto-disk@18% with the "
            "disk tier (--disk-budgets 0.18)"
        )
        print("workloads:", ", ".join(WORKLOAD_NAMES), "| --hf: gpt2, llama, bert")
        return 0
    if args.hf is not None and "workload" in args.given:
        raise RematError(
            f"remat bench: --hf {args.hf} and --workload {args.workload} both name the model; "
            "give one."
        )
    if args.hf is not None:
        from .bench.hf import get_hf_workload

        workload = get_hf_workload(args.hf, args.size)
        name = f"hf-{args.hf}-{args.size}"
    else:
        workload = get_workload(args.workload, args.size)
        name = f"{args.workload}-{args.size}"
    dtype = _autocast_dtype(args)
    if dtype is not None:
        workload = workload.with_autocast(dtype)
        name += f"-{args.autocast}"
    _check_device(args.device)
    if args.strategies is not None:
        strategies = _names(args.strategies, "--strategies")
        for strategy in strategies:
            reason = get_strategy(strategy).unsupported(workload, args.device)
            if reason is not None:
                raise RematError(f"remat bench: strategy {strategy} {reason}.")
    else:
        strategies = []
        for entry in STRATEGIES.values():
            reason = entry.unsupported(workload, args.device)
            if reason is None:
                strategies.append(entry.name)
            else:
                print(f"skipping {entry.name}: it {reason}")
    budgets, disk_budgets = args.budgets, args.disk_budgets
    if budgets is None and args.strategies is None:
        budgets = _DEFAULT_BUDGETS
    if disk_budgets is None and args.strategies is None:
        disk_budgets = _DEFAULT_DISK_BUDGETS
    strategies = list(
        dict.fromkeys(strategies + _budgets(budgets, strategies) + _disk_budgets(disk_budgets))
    )
    _check_matched(strategies)
    from .bench import report

    json_path = args.json or Path("bench-out") / f"{name}.json"
    # The plot goes next to its JSON, so that a run's two files are found and replaced together.
    plot_path = args.plot or json_path.with_suffix(".png")
    if json_path.resolve() == plot_path.resolve():
        raise RematError(
            f"remat bench: --json and --plot name the same file, {json_path}; the plot would "
            "overwrite the results. Give them two paths"
            + ("." if args.plot else " (the plot goes to --json's path with .png; give --plot).")
        )
    _require("rich", "the table and progress bar")
    _require("matplotlib", "the plot")
    report.check_plot_format(plot_path)
    for path in (json_path, plot_path):
        report.check_writable(path)

    base = {"workload": args.workload, "size": args.size, "hf": args.hf, "seed": args.seed}
    base["device"] = args.device
    base["allocator"] = args.allocator
    base["autocast"] = _AUTOCAST[args.autocast] if args.autocast else None
    run = _provenance(args)
    run["budgets"] = _names(budgets, "--budgets") if budgets is not None else []
    run["disk_budgets"] = _names(disk_budgets, "--disk-budgets") if disk_budgets else []
    result = _run(
        base, strategies, args.rounds, args.processes, workload, name, not args.no_progress
    )
    result = dataclasses.replace(result, run=run)

    report.print_table(result)
    warning = report.timing_warning(result)
    if warning is not None:
        print(warning)
    if result.recording_us_per_op is not None:
        floor = result.dispatch_mode_us_per_op
        print(
            f"graph engine recording overhead: {result.recording_us_per_op:.1f} us per ATen op "
            "(first block of the small size, forward"
            + (
                f"; a Python dispatch mode that only runs each op costs {floor:.1f})"
                if floor is not None
                else ")"
            )
        )
    if result.replay_us_per_op is not None:
        print(
            f"graph engine replay overhead: {result.replay_us_per_op:.1f} us per ATen op "
            "(first block of the small size, backward)"
        )
    if result.control_time_ratio is not None and result.control_time_range is not None:
        low, high = result.control_time_range
        print(
            "timing control: the plain step against a second plain model timed next to it, "
            f"{result.control_time_ratio:.3f} (rounds {low:.3f}-{high:.3f}; {result.rounds} "
            f"round{'s' if result.rounds > 1 else ''} "
            f"in {result.processes} timing process{'es' if result.processes > 1 else ''}); time "
            "ratios no farther from 1 than this one are within this run's noise"
        )
    for line in report.exactness_lines(result):
        print(line)
    _print_planning(result)
    faults = ", ".join(f"{r.strategy} {r.faults_per_step:,.0f}" for r in result.rows)
    print(f"minor page faults per step ({result.allocator} allocator): {faults}")
    if result.contended_rounds and result.used_rounds < result.rounds:
        # Where they were kept instead, the warning under the table says so.
        print(
            f"note: other processes competed for the CPU in {result.contended_rounds} of "
            f"{result.rounds} timed rounds, left out; {result.used_rounds} rounds were used."
        )
    if result.dominance:
        print("the planner at each torch strategy's measured peak (time: paired median ratio):")
        for line in report.dominance_lines(result):
            print(f"  {line}")
    replaced = [path for path in (json_path, plot_path) if path.exists()]
    report.write_json(result, json_path)
    report.write_plot(result, plot_path)
    print(f"wrote {json_path} and {plot_path}")
    _overwrote(replaced)
    return 0


def _provenance(args: argparse.Namespace, mode: str | None = None) -> dict[str, Any]:
    """What produced a result, for its JSON: the command line, the date it started, the
    versions of remat, torch and Python, and the options that choose what was measured (for a
    ``mode`` of ``_MODES``, those it reads). The strategies are those asked for by name
    (``None``: every registered one the workload supports)."""
    import datetime
    import platform
    import shlex

    import torch

    from . import __version__

    options = {
        "workload": None if args.hf is not None else args.workload,
        "hf": args.hf,
        "size": args.size,
        "seed": args.seed,
        "strategies": None if args.strategies is None else _names(args.strategies, "--strategies"),
        "rounds": args.rounds,
        "processes": args.processes,
        "device": args.device,
        "autocast": args.autocast,
        "allocator": args.allocator,
    }
    if mode is not None:
        options = {k: v for k, v in options.items() if k in _MODES[mode][1]}
    return {
        "command": shlex.join(["remat", *args.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "remat": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        **options,
    }


def _overwrote(paths: list[Path]) -> None:
    """Say which output files replaced ones that were there before the run wrote them."""
    if paths:
        print(f"overwrote {' and '.join(str(p) for p in paths)} (from an earlier run)")


def _print_planning(result: Any) -> None:
    planned = [r for r in result.rows if r.plan_seconds is not None and r.solve_seconds is not None]
    if planned and result.profile_seconds is not None:
        timed = ", ".join(f"{r.strategy} {r.plan_seconds:.1f} s" for r in planned)
        solved = ", ".join(f"{r.strategy} {r.solve_seconds:.2f} s" for r in planned)
        print(
            f"remat.plan: one profile in {result.profile_seconds:.1f} s for every budget, then "
            f"per budget the chain's solve and a measured step: {timed}; the solvers' seconds "
            f"of each plan, the block types' (once, in the profile) and its chain's: {solved}"
        )


def _pipeline(args: argparse.Namespace) -> int:
    from .bench import pipeline, report

    if ("workload" in args.given and args.workload != "unet") or args.hf is not None:
        raise RematError(
            "remat bench --pipeline: measures the unet workload (skip connections across "
            f"stages); drop {'--workload ' + args.workload if args.hf is None else '--hf'}."
        )
    _refuse_unused(args)
    _check_device(args.device)
    json_path = args.json or Path("bench-out") / f"pipeline-unet-{args.size}.json"
    report.check_writable(json_path)
    request = {"size": args.size, "rounds": args.rounds, "seed": args.seed}
    request["device"] = args.device
    run = _provenance(args, "pipeline")
    result = pipeline.measure_in_subprocess(request)
    print(result.table())
    replaced = [json_path] if json_path.exists() else []
    pipeline.write_json(result, json_path, run)
    print(f"wrote {json_path}")
    _overwrote(replaced)
    return 0


def _require(module: str, purpose: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise RematError(
            f"remat bench: {module} is needed for {purpose}; install it with "
            "pip install 'remat[bench]'."
        )


def _run(
    base: dict[str, Any],
    strategies: list[str],
    rounds: int,
    processes: int,
    workload: Any,
    name: str,
    progress: bool,
) -> Any:
    """Memory of each strategy, then plans for the planned ones (``remat-auto@...``, whose
    budgets may be measured peaks) and their memory, then step times; the results."""
    import tempfile

    from rich.progress import Progress

    from .bench._child import ForkServer
    from .bench.strategies import is_auto

    names = ["none", *[s for s in strategies if s != "none"]]
    planned = [s for s in names if is_auto(s)]
    overhead = any(s.startswith("remat-graph") for s in names)
    total = len(names) + bool(planned) + processes + overhead
    # A bar on a terminal; in a log (stdout not a terminal) one line per finished measurement.
    lines = _Lines(total) if progress and not _terminal() else None
    with (
        Progress(disable=not progress or lines is not None, transient=True) as bar,
        tempfile.TemporaryDirectory(prefix="remat-bench-") as directory,
    ):
        task = bar.add_task("memory", total=total)

        def step(what: str) -> None:
            bar.update(task, description=what)

        def done(what: str) -> None:
            bar.advance(task)
            if lines is not None:
                lines.done(what)

        # Each strategy's memory in a process of its own, forked from one that imported torch
        # and, on CPU, what torch.profiler imports as it starts (torch._inductor, about a
        # second) and a Hugging Face model's modules. On CUDA the allocator's counters measure,
        # with no profiler, and transformers may ask CUDA for its devices as it imports.
        preload = []
        if base["device"] == "cpu":
            from .bench.hf import preload as hf_modules

            preload = ["torch._inductor", *(hf_modules(base["hf"]) if base["hf"] else [])]
        with ForkServer("remat.bench.measure", _MEMORY_ALLOCATOR, preload=preload) as forks:
            memory = _memories(base, [s for s in names if s not in planned], forks, step, done)
            if planned:
                plans = _plans(base, planned, memory, Path(directory), step, done)
                base = {**base, "plans_file": plans}
                memory.update(_memories(base, planned, forks, step, done))
        timing = _times(base, names, rounds, processes, step, done)
        if overhead:
            # On the small size of the workload: the engine's per-op cost, not kernel noise.
            step("graph engine overhead")
            timing.update(_subprocess({**base, "size": "small", "kind": "overhead"}))
            done("graph engine recording and replay overhead")
    return _result(base, names, memory, timing, workload, name, processes)


def _memories(
    base: dict[str, Any],
    names: list[str],
    forks: ForkServer,
    step: Callable[[str], None],
    done: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Each strategy's memory measurement, each in a fresh process forked by ``forks``."""
    memory = {}
    for s in names:
        step(f"memory: {s}")
        memory[s] = forks.run({**base, "kind": "memory", "strategy": s}, f"the memory of {s}")
        done(f"memory of {s}: peak {memory[s]['peak_bytes'] / 2**20:,.1f} MiB")
    return memory


def _plans(
    base: dict[str, Any],
    planned: list[str],
    memory: dict[str, dict[str, Any]],
    directory: Path,
    step: Callable[[str], None],
    done: Callable[[str], None],
) -> str:
    """Plans for the planned strategies, from one profile in a fresh process, written to a file
    in ``directory`` for the processes that measure and time them; the file's path."""
    from .bench.strategies import budget_of

    peaks = {s: int(m["peak_bytes"]) for s, m in memory.items()}
    budgets = {s: budget_of(s, peaks) for s in planned}
    step(f"remat.plan: {len(planned)} budgets")
    plans = _subprocess({**base, "kind": "plan", "budgets": budgets})
    path = directory / "plans.json"
    path.write_text(json.dumps(plans))
    done(f"remat.plan: one profile, {len(planned)} budget{'s' if len(planned) > 1 else ''}")
    return str(path)


def _times(
    base: dict[str, Any],
    names: list[str],
    rounds: int,
    processes: int,
    step: Callable[[str], None],
    done: Callable[[str], None],
) -> dict[str, Any]:
    """Step times of every strategy, in ``processes`` timing processes, pooled."""
    from .bench import measure

    step(
        f"step times: {processes} x {rounds} round{'s' if rounds > 1 else ''} x {len(names)} "
        "strategies"
    )
    request = {**base, "kind": "time", "strategies": names, "rounds": rounds}
    timed = []
    for process in range(processes):
        timed.extend(_subprocess(request)["timed_rounds"])
        done(
            f"step times, timing process {process + 1} of {processes}: {rounds} "
            f"round{'s' if rounds > 1 else ''} x {len(names)} strategies"
        )
    return measure.summarize(names, timed)


def _result(
    base: dict[str, Any],
    names: list[str],
    memory: dict[str, dict[str, Any]],
    timing: dict[str, Any],
    workload: Any,
    name: str,
    processes: int,
) -> Any:
    from .bench import report
    from .bench.strategies import get_strategy

    plain = memory["none"]["peak_bytes"]
    rows = [
        report.Row(
            strategy=s,
            description=get_strategy(s).description,
            peak_bytes=memory[s]["peak_bytes"],
            memory_ratio=memory[s]["peak_bytes"] / plain if plain else float("nan"),
            step_seconds=timing["seconds"][s],
            time_ratio=timing["ratio"][s],
            grads_equal=memory[s]["grads_equal"],
            buffers_equal=memory[s].get("buffers_equal"),
            not_compared=memory[s].get("not_compared"),
            counterpart=_counterpart(s, names),
            counterpart_time_ratio=timing["pairwise"].get(f"{s}/{_counterpart(s, names)}"),
            faults_per_step=timing["faults_per_step"][s],
            predicted_peak_bytes=memory[s].get("predicted_peak_bytes"),
            predicted_time_ratio=memory[s].get("predicted_time_ratio"),
            plan_seconds=memory[s].get("plan_seconds"),
            solve_seconds=memory[s].get("solve_seconds"),
            budget_bytes=memory[s].get("budget_bytes"),
            budget_feasible=(
                bool(memory[s]["budget_feasible"]) if "budget_feasible" in memory[s] else None
            ),
            no_plan=memory[s].get("no_plan"),
            plan_blocks=memory[s].get("plan_blocks"),
        )
        for s in names
    ]
    profiles = [m["profile_seconds"] for m in memory.values() if "profile_seconds" in m]
    return report.Result(
        workload=name,
        description=workload.description,
        device=base["device"],
        rounds=timing["rounds"],
        contended_rounds=timing["contended_rounds"],
        used_rounds=timing["used_rounds"],
        rows=rows,
        pairwise_time=timing["pairwise"],
        recording_us_per_op=timing.get("recording_us_per_op"),
        replay_us_per_op=timing.get("replay_us_per_op"),
        dispatch_mode_us_per_op=timing.get("dispatch_mode_us_per_op"),
        allocator=base["allocator"],
        autocast=base.get("autocast"),
        control_time_ratio=timing["control"]["ratio"],
        control_time_range=(timing["control"]["low"], timing["control"]["high"]),
        processes=processes,
        round_seconds=[r["seconds"] for r in timing["timed_rounds"]],
        profile_seconds=profiles[0] if profiles else None,
        dominance=report.dominance(rows, timing["control"]["ratio"], rounds=timing["used_rounds"]),
    )


def _terminal() -> bool:
    return sys.stdout.isatty()


class _Lines:
    """Progress for logs: ``[k/n] what finished (seconds since the start)``, one line each."""

    def __init__(self, total: int) -> None:
        import time

        self.total = total
        self.count = 0
        self.start = time.monotonic()

    def done(self, what: str) -> None:
        import time

        self.count += 1
        elapsed = time.monotonic() - self.start
        print(f"[{self.count}/{self.total}] {what} ({elapsed:.0f} s)", flush=True)


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise RematError(f"remat bench: --device must be cpu or cuda, got {device!r}.")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RematError("remat bench: --device cuda, but CUDA is not available here.")


def _names(text: str, flag: str) -> list[str]:
    """The comma-separated entries of ``text``, stripped; an empty one is refused."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise RematError(
            f"remat bench: {flag} takes a comma-separated list, got {text!r}, with an "
            "empty entry; drop the extra comma, or the option to take its default."
        )
    return parts


def _budgets(text: str | None, strategies: list[str]) -> list[str]:
    """``remat-auto@...`` strategy names for ``--budgets``: ``remat-auto@50%`` for 0.5, and for
    the word ``torch`` one ``remat-auto@torch-...`` per torch strategy of ``strategies``."""
    from .bench.strategies import TORCH, auto_name, matched_name

    if text is None:
        return []
    names = []
    for part in _names(text, "--budgets"):
        if part != "torch":
            names.append(auto_name(_fraction(part)))
            continue
        torches = [s for s in strategies if s.startswith(TORCH)]
        if not torches:
            raise RematError(
                "remat bench: --budgets torch plans at each torch strategy's measured peak, but "
                "the run has no torch strategy; add some to --strategies, e.g. "
                "--strategies torch-block,torch-every-2."
            )
        names += [matched_name(s) for s in torches]
    return names


def _disk_budgets(text: str | None) -> list[str]:
    """``remat-auto-disk@...`` strategy names for ``--disk-budgets``."""
    from .bench.strategies import auto_name

    if text is None:
        return []
    return [
        auto_name(_fraction(part, "--disk-budgets"), "disk")
        for part in _names(text, "--disk-budgets")
    ]


def _fraction(part: str, flag: str = "--budgets") -> float:
    """A budget as a fraction of the plain step's peak: ``0.5`` or ``50%``, as the strategy
    names (``remat-auto@50%``) and ``remat.plan`` write it."""
    try:
        fraction = float(part[:-1]) / 100 if part.endswith("%") else float(part)
    except ValueError:
        fraction = -1.0
    if not 0.0 < fraction <= 1.0:
        if flag != "--budgets":
            raise RematError(
                f"remat bench: {flag} takes fractions in (0, 1] of the plain step's activation "
                f"peak or percentages, separated by commas, e.g. 0.2,15%; got {part!r}."
            )
        raise RematError(
            f"remat bench: --budgets takes fractions in (0, 1] of the plain step's activation "
            f"peak or percentages, or the word torch (each torch strategy's measured peak), "
            f"separated by commas, e.g. 0.5,25%,torch; got "
            f"{part!r}{did_you_mean(part.strip(), ['torch'])}."
        )
    return fraction


def _check_matched(strategies: list[str]) -> None:
    """Each ``remat-auto@torch-...`` needs its torch strategy in the run, measured first."""
    from .bench.strategies import matched_torch

    for strategy in strategies:
        torch_name = matched_torch(strategy)
        if torch_name is not None and torch_name not in strategies:
            raise RematError(
                f"remat bench: {strategy} is planned at {torch_name}'s measured peak, but "
                f"{torch_name} is not in the run; add it to --strategies."
            )


def _counterpart(name: str, names: list[str]) -> str | None:
    from .bench.strategies import get_strategy

    other = get_strategy(name).counterpart
    return other if other in names else None


# glibc settings for the CPU step-time process under ``--allocator cached``. Fixed thresholds
# turn off glibc's dynamic ones: allocations up to 1 GiB come from the heap, and the heap is never
# trimmed, so after the warm-up steps no step takes fresh pages. With the dynamic thresholds the
# number of pages a step takes depends on the strategies that ran before it in the process (on
# the bench GPT, from none to 130,000 per step for the same strategy), and zeroing them costs
# more than what tells strategies apart.
_CACHED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


# Memory is measured with frees of large tensors going back to the system: the resident set
# follows live tensors.
_MEMORY_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _subprocess(request: dict[str, Any]) -> dict[str, Any]:
    from .bench._child import run_child

    env: dict[str, str] = {}
    if request["kind"] in ("time", "plan") and request.get("allocator") == "cached":
        # The planner times its options in the conditions its plans are timed in.
        env.update(_CACHED_ALLOCATOR if request.get("device", "cpu") == "cpu" else {})
    return run_child("remat.bench.measure", request, f"the {request['kind']} measurement", env)


def _autocast_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """The dtype ``--autocast`` names; None without it."""
    import torch

    return getattr(torch, _AUTOCAST[args.autocast]) if args.autocast else None


def _solve_time(args: argparse.Namespace) -> int:
    from .bench import report, solve_time

    if "workload" in args.given or args.hf is not None or args.strategies or args.budgets:
        raise RematError(
            "remat bench --solve-time: plans a 48-layer gpt at 25% and takes no workload, "
            "strategies or budgets; drop --workload/--hf/--strategies/--budgets."
        )
    _refuse_unused(args)
    suffix = f"-{args.autocast}" if args.autocast else ""
    json_path = args.json or Path("bench-out") / f"solve-time-gpt{suffix}.json"
    report.check_writable(json_path)
    run = _provenance(args, "solve_time")
    result = solve_time.measure(seed=args.seed, autocast=_autocast_dtype(args))
    print(solve_time.report(result))
    replaced = [json_path] if json_path.exists() else []
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({**result, "run": run}, indent=1))
    print(f"wrote {json_path}")
    _overwrote(replaced)
    return 0


def _offload(args: argparse.Namespace) -> int:

    from .bench import offload, report

    if ("workload" in args.given and args.workload != "gpt") or args.hf is not None:
        raise RematError("remat bench --offload: measures the gpt workload; drop --workload/--hf.")
    _refuse_unused(args)
    json_path = args.json or Path("bench-out") / f"offload-gpt-{args.size}.json"
    report.check_writable(json_path)
    run = _provenance(args, "offload")
    result = offload.measure(args.size, args.seed, args.rounds)
    print(offload.report(result))
    replaced = [json_path] if json_path.exists() else []
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({**result, "run": run}, indent=1))
    print(f"wrote {json_path}")
    _overwrote(replaced)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
