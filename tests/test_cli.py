"""``remat bench`` from the command line: a real run, and one-line errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from remat import cli
from remat.bench import measure
from remat.bench.report import MIN_SPREAD


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from remat.bench import _child

    servers: list[tuple[str, dict[str, str], Any]] = []
    start = _child.ForkServer.__init__

    def recorded(
        self: _child.ForkServer, module: str, env: dict[str, str] | None = None, **rest: Any
    ) -> None:
        start(self, module, env, **rest)
        servers.append((module, dict(env or {}), rest.get("preload")))

    monkeypatch.setattr(_child.ForkServer, "__init__", recorded)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code, out, err = _run(
        capsys,
        "bench",
        "--workload", "gpt",
        "--size", "small",
        "--strategies", "torch-block,remat-block",
        "--rounds", "1",
        "--processes", "2",
        "--json", str(out_json),
        "--plot", str(out_png),
    )  # fmt: skip
    assert code == 0, err
    # stdout is not a terminal here: one progress line per finished measurement, in order.
    progress = [line for line in out.splitlines() if line.startswith("[")]
    expected = [
        r"\[1/5\] memory of none: peak [\d,.]+ MiB \(\d+ s\)",
        r"\[2/5\] memory of torch-block: peak [\d,.]+ MiB \(\d+ s\)",
        r"\[3/5\] memory of remat-block: peak [\d,.]+ MiB \(\d+ s\)",
        r"\[4/5\] step times, timing process 1 of 2: 1 round x 3 strategies \(\d+ s\)",
        r"\[5/5\] step times, timing process 2 of 2: 1 round x 3 strategies \(\d+ s\)",
    ]
    assert len(progress) == len(expected), out
    assert all(re.fullmatch(p, line) for p, line in zip(expected, progress, strict=True)), out
    data = json.loads(out_json.read_text())
    assert [r["strategy"] for r in data["rows"]] == ["none", "torch-block", "remat-block"]
    assert all(r["grads_equal"] for r in data["rows"])
    assert data["rows"][2]["counterpart"] == "torch-block"
    assert data["rows"][1]["peak_bytes"] < data["rows"][0]["peak_bytes"]
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    # Every memory was measured in a process forked from one server, whose frees of large
    # tensors go back to the system, and which imported what the profiler imports as it starts.
    threshold = {"MALLOC_MMAP_THRESHOLD_": "65536"}
    assert servers == [("remat.bench.measure", threshold, ["torch._inductor"])]
    assert "remat-block" in out and "time vs torch" in out
    assert data["allocator"] == "cached" and "minor page faults per step (cached allocator)" in out
    assert all(r["faults_per_step"] >= 0 for r in data["rows"])
    low, high = data["control_time_range"]
    assert 0 < low <= data["control_time_ratio"] <= high
    assert "timing control: the plain step against a second plain model" in out
    rounds = data["round_seconds"]
    timed = {"none", "torch-block", "remat-block", measure.CONTROL}
    # One round from each of two timing processes, pooled.
    assert data["processes"] == 2 and data["rounds"] == 2
    assert len(rounds) == 2 and all(set(r) == timed for r in rounds)
    assert "2 rounds in 2 timing processes" in out


def test_step_times_run_with_glibc_thresholds_fixed_unless_asked_for_the_system_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    envs: dict[tuple[str, str], dict[str, str]] = {}

    def run(argv: list[str], *, env: dict[str, str], **kwargs: object) -> object:
        request = json.loads(argv[-1])
        envs[(request["kind"], request.get("allocator"))] = env
        return subprocess.CompletedProcess(argv, 0, stdout="{}\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    base = {"workload": "mlp", "size": "small", "device": "cpu"}
    for allocator in ("cached", "system"):
        cli._subprocess({**base, "kind": "time", "allocator": allocator})
    cached = envs[("time", "cached")]
    assert cached["MALLOC_MMAP_THRESHOLD_"] == str(2**30)
    assert cached["MALLOC_TRIM_THRESHOLD_"] == str(2**34)
    assert envs[("time", "system")].get("MALLOC_TRIM_THRESHOLD_") == os.environ.get(
        "MALLOC_TRIM_THRESHOLD_"
    )


def _small_bench(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str
) -> tuple[str, dict[str, Any]]:
    """``remat bench --size small *argv`` for one round, checked to exit 0: its output and JSON."""
    out_json = tmp_path / "r.json"
    code, out, err = _run(
        capsys,
        "bench",
        "--size", "small",
        *argv,
        "--rounds", "1",
        "--json", str(out_json),
        "--plot", str(tmp_path / "r.png"),
    )  # fmt: skip
    assert code == 0, err
    return out, json.loads(out_json.read_text())


def test_bench_plans_at_each_torch_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, data = _small_bench(capsys, tmp_path, "--strategies", "torch-block", "--budgets", "torch")
    # The torch strategy's memory is measured before the plan at its peak is made.
    progress = [
        line.split("] ")[1].split(":")[0] for line in out.splitlines() if line.startswith("[")
    ]
    assert progress[:4] == [
        "memory of none",
        "memory of torch-block",
        "remat.plan",
        "memory of remat-auto@torch-block",
    ]
    rows = {r["strategy"]: r for r in data["rows"]}
    planned, torch_block = rows["remat-auto@torch-block"], rows["torch-block"]
    assert planned["budget_feasible"] and planned["budget_bytes"] == torch_block["peak_bytes"]
    assert planned["peak_bytes"] <= torch_block["peak_bytes"] and planned["grads_equal"]
    assert planned["counterpart"] == "torch-block"
    # The plan measured, block by block: every block of the small GPT once, in runs.
    runs = planned["plan_blocks"]
    assert runs and runs[0].startswith("blocks.0") and "blocks.3" in runs[-1], runs
    assert torch_block["plan_blocks"] is None
    (found,) = data["dominance"]
    assert found["torch"] == "torch-block" and found["planned"] == "remat-auto@torch-block"
    assert found["time_ratio"] == planned["counterpart_time_ratio"]
    # The control's distance from 1, but never below the 1% a verdict always allows.
    spread = max(abs(data["control_time_ratio"] - 1), MIN_SPREAD)
    assert found["control_spread"] == pytest.approx(spread)
    # One round gives no verdict (three quiet rounds do: the stubbed tests below).
    assert found["verdict"] == "too few rounds for a verdict (1 round; it takes 3)"
    assert f"(control +-{found['control_spread']:.3f}): {found['verdict']}" in out


def test_bench_under_autocast_runs_and_plans_the_mixed_precision_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, data = _small_bench(
        capsys, tmp_path, "--autocast", "bf16", "--strategies", "torch-block", "--budgets", "0.5",
        "--no-progress",
    )  # fmt: skip
    assert data["autocast"] == "bfloat16" and data["workload"] == "gpt-small-bf16"
    assert "remat bench: gpt-small-bf16 on cpu" in out
    assert "under autocast (bfloat16)" in data["description"]
    rows = {r["strategy"]: r for r in data["rows"]}
    assert all(r["grads_equal"] for r in rows.values())
    # The plan is the autocast loop's: its prediction is the loop's measured peak, to the byte.
    planned = rows["remat-auto@50%"]
    assert planned["budget_feasible"] and planned["peak_bytes"] <= planned["budget_bytes"]
    assert planned["predicted_peak_bytes"] == planned["peak_bytes"]
    # And the loop ran under autocast: the plain step's peak is not the float32 one.
    fp32 = measure.handle(
        {"kind": "memory", "workload": "gpt", "size": "small", "strategy": "none", "seed": 0}
    )
    assert rows["none"]["peak_bytes"] != fp32["peak_bytes"]


def test_bench_plans_with_the_disk_tier_below_what_recompute_reaches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, data = _small_bench(
        capsys, tmp_path, "--strategies", "none", "--budgets", "0.3", "--disk-budgets", "0.3"
    )
    # The table is as wide as its widest row (a budget no plan fits says so): nothing is cut.
    assert "no plan fits; smallest" in out and "exact" in out and "…" not in out
    rows = {r["strategy"]: r for r in data["rows"]}
    alone, disk = rows["remat-auto@30%"], rows["remat-auto-disk@30%"]
    # Recompute alone cannot reach 30% of the small GPT's peak; with the disk tier it can.
    assert alone["budget_feasible"] == 0 and alone["budget_bytes"] > disk["budget_bytes"]
    assert disk["budget_feasible"] == 1 and disk["peak_bytes"] <= disk["budget_bytes"]
    assert disk["peak_bytes"] < alone["peak_bytes"]
    assert alone["grads_equal"] and disk["grads_equal"]
    assert "recompute and disk" in disk["description"]


BAD: list[tuple[list[str], str]] = [
    (["--workload", "gtp"], "unknown workload 'gtp' (did you mean 'gpt'?)"),
    (["--size", "huge"], "unknown size 'huge'"),
    (["--strategies", "none,remat-blok"], "unknown strategy 'remat-blok'"),
    (["--processes", "0"], "--processes must be at least 1, got 0"),
    (["--workload", "unet", "--strategies", "torch-seq-3"], "feed each other directly"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--hf", "gpt3"], "unknown --hf model 'gpt3'"),
    (["--strategies", "offload-host"], "offload-host moves tensors from an accelerator"),
    (["--offload", "--workload", "mlp"], "--offload: measures the gpt workload"),
    (["--offload", "--rounds", "0"], "--offload: --rounds must be at least 1"),
    (["--solve-time", "--workload", "mlp"], "--solve-time: plans a 48-layer gpt at 25%"),
    # a size the child process of a mode would fail on, checked first; the default workload
    # named explicitly is not taken for no workload at all
    (["--pipeline", "--size", "huge"], "unknown size 'huge'; expected one of: bench,"),
    (["--offload", "--size", "huge"], "unknown size 'huge'; expected one of: bench,"),
    (["--pipeline", "--workload", "gpt"], "measures the unet workload (skip connections"),
    (["--solve-time", "--workload", "gpt"], "--solve-time: plans a 48-layer gpt at 25%"),
    (["--offload", "--workload", "gpt"], "--offload: does not use --workload"),
    (["--pipeline", "--processes", "2"], "--pipeline and --offload measure in one process"),
    (["--budgets", "0.5,tourch"], "--budgets takes fractions in (0, 1] of the plain step's"),
    (["--disk-budgets", "0.1,2"], "--disk-budgets takes fractions in (0, 1] of the plain step"),
    (["--strategies", "none,remat-block", "--budgets", "torch"], "the run has no torch strategy"),
    (["--strategies", "remat-auto@torch-block"], "torch-block is not in the run; add it"),
    (["--strategies", "torch-block,remat-auto@torch-blok"], "unknown strategy 'torch-blok'"),
    (["--offload", "--autocast", "bf16"], "--pipeline and --offload measure in float32"),
    (["--pipeline", "--autocast", "fp16"], "--pipeline and --offload measure in float32"),
    # options a run does not read are refused, not ignored
    (["--list", "--offload"], "--list and --offload are separate runs; ask for one at a time"),
    (["--list", "--rounds", "3"], "--list: does not use --rounds, --json, --no-progress"),
    (["--offload", "--device", "cuda"], "--offload: does not use --device (it reads --json"),
    (["--solve-time", "--disk-budgets", "0.2"], "--solve-time: does not use --disk-budgets"),
    (["--pipeline", "--budgets", "0.5"], "--pipeline: does not use --budgets"),
    (
        ["--pipeline", "--hf", "gpt2"],
        "measures the unet workload (skip connections across stages); drop --hf.",
    ),
    (["--strategies", ""], "--strategies takes a comma-separated list, got '', with an empty"),
    (["--disk-budgets", "0.5,,0.2"], "--disk-budgets takes a comma-separated list, got '0.5,,0.2'"),
    (["--hf", "gpt2", "--workload", "mlp"], "--hf gpt2 and --workload mlp both name the model"),
    (["--hf", "gpt2", "--workload", "gpt"], "--hf gpt2 and --workload gpt both name the model"),
]


def test_json_and_plot_on_one_file_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same = str(tmp_path / "out")
    code, _, err = _run(capsys, "bench", "--json", same, "--plot", same)
    assert code == 2 and "--json and --plot name the same file" in err
    assert list(tmp_path.iterdir()) == []


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"remat {remat.__version__}\n"


def test_list_entries_are_stripped() -> None:
    assert cli._names(" none, torch-block ", "--strategies") == ["none", "torch-block"]


def test_an_interrupted_bench_says_so_in_one_line_and_exits_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_bench", interrupted)
    code, _, err = _run(capsys, "bench", "--list")
    assert (code, err) == (130, "remat bench: interrupted.\n")


def test_the_bench_on_cuda_without_cuda_stops_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remat bench --device cuda`` with the planner's strategies (the default run's) and no
    CUDA here: one line, exit 2, nothing written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out_json = tmp_path / "r.json"
    code, out, err = _run(capsys, "bench", "--device", "cuda", "--json", str(out_json))
    assert "skipping the planner" not in out
    assert code == 2 and "--device cuda, but CUDA is not available here" in err
    assert not out_json.exists()


@pytest.mark.parametrize(("argv", "message"), BAD)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def measured(*args: Any) -> Any:
        raise AssertionError(f"remat bench {argv} measured instead of refusing")

    monkeypatch.setattr(cli, "_run", measured)  # an input refused is refused before measuring
    out_json = tmp_path / "never.json"
    code, _, err = _run(capsys, "bench", *argv, "--json", str(out_json), "--no-progress")
    assert code == 2
    assert err.count("\n") == 1 and message in err and err.startswith("error: remat")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (the dev extra)"
)
def test_bench_on_a_hugging_face_model_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remat bench --hf gpt2``: every row's gradients equal the plain model's, and the memory
    server imported transformers and GPT-2's modules once, for all its children."""
    from remat.bench import _child

    preloads: list[Any] = []
    start = _child.ForkServer.__init__

    def recorded(self: _child.ForkServer, *args: Any, **kwargs: Any) -> None:
        start(self, *args, **kwargs)
        preloads.append(self.preload)

    monkeypatch.setattr(_child.ForkServer, "__init__", recorded)
    _, data = _small_bench(capsys, tmp_path, "--hf", "gpt2", "--strategies", "remat-hf")
    assert [r["strategy"] for r in data["rows"]] == ["none", "remat-hf"]
    assert all(r["grads_equal"] for r in data["rows"])
    assert data["rows"][1]["peak_bytes"] < data["rows"][0]["peak_bytes"]
    expected = ["transformers", "transformers.models.gpt2.modeling_gpt2"]
    assert preloads == [["torch._inductor", *expected]]


def test_hf_without_transformers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "transformers" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    code, _, err = _run(capsys, "bench", "--hf", "gpt2", "--json", str(tmp_path / "x.json"))
    assert code == 2 and "--hf needs the transformers package" in err
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = _run(capsys, "bench", "--plot", str(blocker / "x.png"), "--no-progress")
    assert code == 2 and "cannot create" in err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "bench", "--list")
    assert code == 0 and "remat-block" in out and "workloads: gpt, mlp, convnet, unet" in out


def test_python_dash_m_remat_runs_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "remat", "bench", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "remat-block" in done.stdout and "workloads:" in done.stdout
    usage = subprocess.run(
        [sys.executable, "-m", "remat"], capture_output=True, text=True, timeout=120, check=False
    )
    assert usage.returncode == 2 and "usage: remat" in usage.stderr


def test_python_dash_m_remat_cli_reaches_every_subcommand() -> None:
    """``python -m remat.cli`` runs its main after every function it dispatches to is
    defined: ``--solve-time`` reaches its own check of the arguments."""
    done = subprocess.run(
        [sys.executable, "-m", "remat.cli", "bench", "--solve-time", "--strategies", "none"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "remat bench --solve-time: plans a 48-layer gpt" in done.stderr


def _fake_run(
    monkeypatch: pytest.MonkeyPatch,
    rounds: list[tuple[float, bool]],
    peaks: dict[str, int] | None = None,
) -> None:
    """Stub out the measurements of ``remat bench``: each timed round is ``(control ratio,
    contended)``, every planned strategy 10% faster than its torch strategy, memory from
    ``peaks`` (bytes, default 1 MiB less per strategy); the rest of the run (verdicts, table,
    files) is the real one."""
    from remat.bench.strategies import matched_torch

    def run(
        base: dict[str, Any],
        strategies: list[str],
        n: int,
        processes: int,
        workload: Any,
        name: str,
        progress: bool,
    ) -> Any:
        names = ["none", *[s for s in strategies if s != "none"]]
        memory: dict[str, dict[str, Any]] = {}
        for i, s in enumerate(names):
            peak = (peaks or {}).get(s, (20 - i) * 2**20)
            memory[s] = {"peak_bytes": peak, "grads_equal": True}
            torch_name = matched_torch(s)
            if torch_name is not None:
                memory[s].update(budget_bytes=float(peak), budget_feasible=True)
        timed = []
        for control, contended in rounds:
            seconds = {s: 1.0 for s in names}
            seconds.update({s: 0.9 for s in names if matched_torch(s) is not None})
            seconds[measure.CONTROL] = control
            faults = dict.fromkeys(seconds, 0)
            timed.append({"seconds": seconds, "faults": faults, "contended": contended})
        timing = measure.summarize(names, timed)
        return cli._result(base, names, memory, timing, workload, name, processes)

    monkeypatch.setattr(cli, "_run", run)


def _stubbed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str
) -> tuple[str, dict[str, Any]]:
    code, out, err = _run(
        capsys, "bench", "--size", "small", "--json", str(tmp_path / "r.json"), *argv
    )
    assert code == 0, err
    return out, json.loads((tmp_path / "r.json").read_text())


def _after_table(out: str, description: str) -> str:
    """The line printed right under the table (its caption is the workload's description)."""
    lines = out.splitlines()
    (caption,) = [i for i, line in enumerate(lines) if description[:40] in line]
    return lines[caption + 1]


@pytest.mark.parametrize("rounds", [[(1.0, False)], [(1.0, False), (1.0, False)]])
def test_fewer_than_three_rounds_give_no_verdict_and_a_warning_under_the_table(
    rounds: list[tuple[float, bool]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_run(monkeypatch, rounds)
    argv = ("--strategies", "torch-block", "--budgets", "torch", "--rounds", str(len(rounds)))
    out, data = _stubbed(capsys, tmp_path, *argv)
    (found,) = data["dominance"]
    assert found["verdict"].startswith("too few rounds for a verdict")
    assert "dominates" not in out and "too few rounds for a verdict" in out
    warning = _after_table(out, data["description"])
    assert warning.startswith("WARNING: the step times and time ratios above are not reliable")
    assert "--rounds 7" in warning and "--processes" in warning and "quiet machine" in warning


def test_three_quiet_rounds_give_a_verdict_and_no_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_run(monkeypatch, [(1.0, False)] * 3)
    out, data = _stubbed(capsys, tmp_path, "--strategies", "torch-block", "--budgets", "torch")
    assert data["dominance"][0]["verdict"] == "dominates"
    assert "WARNING" not in out


@pytest.mark.parametrize(
    ("rounds", "why"),
    [
        # Two of four rounds clean: the contended ones are kept, for want of three clean ones.
        ([(1.0, True), (1.0, True), (1.0, False), (1.0, False)], "2 of the 4 rounds used had"),
        ([(1.2, False)] * 3, "the timing control reads 1.200, outside 0.9-1.1"),
    ],
)
def test_contended_rounds_kept_or_a_wide_control_warn_under_the_table(
    rounds: list[tuple[float, bool]],
    why: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_run(monkeypatch, rounds)
    out, data = _stubbed(capsys, tmp_path, "--strategies", "torch-block")
    warning = _after_table(out, data["description"])
    assert warning.startswith("WARNING: the step times") and why in warning, out


def test_the_plot_goes_next_to_the_json_and_replacing_a_file_says_so(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_run(monkeypatch, [(1.0, False)] * 3)
    monkeypatch.chdir(tmp_path)
    out_json = tmp_path / "results" / "run1.json"
    argv = ("bench", "--size", "small", "--strategies", "torch-block", "--json", str(out_json))
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert (tmp_path / "results" / "run1.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "bench-out").exists() and "overwrote" not in out
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert f"overwrote {out_json} and {out_json.with_suffix('.png')}" in out


@pytest.mark.parametrize(("suffix", "magic"), [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_the_plot_is_written_in_the_format_its_suffix_names(
    suffix: str,
    magic: bytes,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_run(monkeypatch, [(1.0, False)] * 3)
    plot = tmp_path / f"out{suffix}"
    _stubbed(capsys, tmp_path, "--strategies", "torch-block", "--plot", str(plot))
    assert plot.read_bytes().startswith(magic)


@pytest.mark.parametrize("name", ["out.bmpx", "out"])
def test_a_plot_suffix_matplotlib_cannot_write_is_refused_before_measuring(
    name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def never(*args: Any) -> Any:
        raise AssertionError("measured")

    monkeypatch.setattr(cli, "_run", never)
    plot = tmp_path / "plots" / name
    code, _, err = _run(capsys, "bench", "--plot", str(plot), "--json", str(tmp_path / "r.json"))
    assert code == 2 and err.count("\n") == 1, err
    assert f"--plot {plot} has" in err and ".png" in err and ".svg" in err
    assert list(tmp_path.iterdir()) == []


def test_result_files_get_the_mode_a_plain_open_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_run(monkeypatch, [(1.0, False)] * 3)
    previous = os.umask(0o027)
    try:
        _stubbed(capsys, tmp_path, "--strategies", "torch-block", "--plot", str(tmp_path / "p.png"))
    finally:
        os.umask(previous)
    for name in ("r.json", "p.png"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name
    # A file replaced keeps its own mode, as open() leaves it.
    (tmp_path / "r.json").chmod(0o644)
    _stubbed(capsys, tmp_path, "--strategies", "torch-block", "--plot", str(tmp_path / "p.png"))
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


def test_the_json_says_what_produced_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import platform

    _fake_run(monkeypatch, [(1.0, False)] * 3)
    argv = ("--seed", "3", "--strategies", "torch-block", "--budgets", "50%,torch", "--rounds", "3")
    _, data = _stubbed(capsys, tmp_path, *argv)
    run = data["run"]
    assert run["command"].startswith("remat bench --size small --json ")
    assert run["command"].endswith("--budgets 50%,torch --rounds 3")
    assert (run["seed"], run["size"], run["workload"], run["hf"]) == (3, "small", "gpt", None)
    assert run["strategies"] == ["torch-block"] and run["budgets"] == ["50%", "torch"]
    assert run["disk_budgets"] == [] and run["rounds"] == 3 and run["processes"] == 1
    assert run["remat"] == remat.__version__ and run["torch"] == torch.__version__
    assert run["python"] == platform.python_version()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", run["date"])
    # The fields that were there before keep their meaning.
    assert data["workload"] == "gpt-small" and data["rounds"] == 3 and data["processes"] == 1
    assert [r["strategy"] for r in data["rows"]] == [
        "none", "torch-block", "remat-auto@50%", "remat-auto@torch-block"
    ]  # fmt: skip
    # The default strategies and budgets are recorded as run.
    _, data = _stubbed(capsys, tmp_path, "--workload", "mlp")
    assert data["run"]["strategies"] is None
    assert data["run"]["budgets"] == ["0.75", "0.5", "0.25", "torch"]
    assert data["run"]["disk_budgets"] == ["0.18"]


def test_budgets_take_percentages_as_strategy_names_write_them() -> None:
    run = ["none", "torch-block"]
    assert cli._budgets("50%,12.5%", run) == ["remat-auto@50%", "remat-auto@12.5%"]
    assert cli._budgets("50%", run) == cli._budgets("0.5", run)
    assert cli._disk_budgets("18%") == ["remat-auto-disk@18%"]
    for bad in ("150%", "0%", "%", "x%"):
        with pytest.raises(remat.RematError, match="fractions in"):
            cli._budgets(bad, run)


def test_every_option_has_help() -> None:
    bench = cli._parser()._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    assert all(action.help for action in bench._actions), [
        action.dest for action in bench._actions if not action.help
    ]
    help_text = bench.format_help()
    # NAME is said; the plot follows --json.
    assert "NAME the workload and size" in " ".join(help_text.split())
    assert "--json's path with .png" in " ".join(help_text.split())


def test_a_sigterm_stops_the_bench_as_ctrl_c_does(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal
    import tempfile

    left: list[str] = []

    def terminated(args: Any) -> int:
        with tempfile.TemporaryDirectory(prefix="remat-bench-") as directory:
            left.append(directory)
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not stop the run")
        return 0

    def not_routed(signum: int, frame: object) -> None:
        raise AssertionError("remat bench left SIGTERM to the handler it found")

    monkeypatch.setattr(cli, "_bench", terminated)
    before = signal.signal(signal.SIGTERM, not_routed)  # not this test runner's death
    try:
        code, _, err = _run(capsys, "bench", "--list")
        assert signal.getsignal(signal.SIGTERM) is not_routed  # put back after the run
    finally:
        signal.signal(signal.SIGTERM, before)
    assert (code, err) == (143, "remat bench: terminated.\n")
    assert left and not os.path.exists(left[0])
