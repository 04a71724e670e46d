"""The benchmark's parts: strategies, measurement, report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from remat.bench import measure, report
from remat.bench.strategies import STRATEGIES, get_strategy
from remat.workloads import WORKLOAD_NAMES, get_workload

CPU = torch.device("cpu")


def test_peak_of_a_known_allocation_is_exact() -> None:
    def step() -> None:
        a = torch.empty(1024, 1024)  # 4 MiB
        b = torch.empty(256, 1024)  # 1 MiB, while a is alive
        del a, b
        torch.empty(512, 1024)  # 2 MiB, after both are freed

    assert measure.peak_step_bytes(step, torch.device("cpu")) == 5 * 2**20


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_is_exact_or_says_why_it_cannot_run(name: str, strategy: str) -> None:
    workload = get_workload(name, "small")
    entry = get_strategy(strategy)
    reason = entry.unsupported(workload)
    if entry.needs_accelerator:
        assert reason is not None and "accelerator" in reason
        return
    if entry.needs_hf:  # measured on the --hf workloads: test_hugging_face_models_from_config
        assert reason is not None and "Hugging Face" in reason
        return
    if reason is not None:
        with pytest.raises(remat.RematError, match="feed each other directly"):
            entry.prepare(workload.model(), workload)
        return
    result = measure.memory(workload, strategy, seed=0, device=torch.device("cpu"))
    assert result["grads_equal"] is True
    assert result["peak_bytes"] > 0
    has_buffers = any(True for _ in workload.model().buffers())
    if not has_buffers:
        assert result["buffers_equal"] is None
    elif not strategy.startswith("torch-"):
        assert result["buffers_equal"] is True  # torch's recomputes: the test below


def test_buffers_written_twice_by_a_recompute_are_reported() -> None:
    # torch's checkpoint runs a BatchNorm block's forward again in backward, and its running
    # statistics move twice; remat's recompute leaves them as the plain step does.
    workload = get_workload("convnet", "small")
    cpu = torch.device("cpu")
    torch_block = measure.memory(workload, "torch-block", 0, cpu)
    remat_block = measure.memory(workload, "remat-block", 0, cpu)
    assert torch_block["grads_equal"] is True and torch_block["buffers_equal"] is False
    assert remat_block["grads_equal"] is True and remat_block["buffers_equal"] is True
    row = report.Row("torch-block", "", 1, 1.0, 1.0, 1.0, True, buffers_equal=False)
    assert report.exact(row) == "NO: buffers"
    result = _result_with([row])
    assert any("torch-block" in line and "twice" in line for line in report.exactness_lines(result))


def _result_with(rows: list[report.Row]) -> report.Result:
    return report.Result("w", "d", "cpu", 1, 0, 1, rows, {})


class _Drifting(torch.nn.Module):
    """Each instance adds how many instances came before it: two plain models from one seed
    step differently, as one with a nondeterministic kernel does."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.offset = float(_Drifting.made)
        _Drifting.made += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (1 + self.offset)


def test_a_plain_step_that_does_not_reproduce_itself_compares_nothing() -> None:
    workload = dataclasses.replace(
        get_workload("mlp", "small"), build=_Drifting, loss_fn=lambda out, target: out.sum()
    )
    batch = (torch.ones(2, 4), torch.zeros(2))
    model = workload.model(0)
    got = measure.exactness(workload, model, batch, 0, torch.device("cpu"))
    assert got == {
        "grads_equal": None,
        "buffers_equal": None,
        "not_compared": "two plain steps from the same seed differed",
    }
    row = report.Row("x", "", 1, 1.0, 1.0, 1.0, None, not_compared=got["not_compared"])
    assert report.exact(row) == "n/a"
    lines = report.exactness_lines(_result_with([row]))
    assert lines == [
        "exact n/a (x): two plain steps from the same seed differed, so nothing could be compared"
    ]


def test_a_later_step_is_compared_too() -> None:
    """The first compared step warms up the measured one; a step after it is compared again
    (a region's later recomputes may run unguarded): a model that goes wrong between the two
    reads as not exact."""
    workload = get_workload("convnet", "small")
    batch = workload.batch(0)
    model = workload.model(0)
    remat.apply(model, workload.block_types)
    ran = []
    assert measure.exactness(workload, model, batch, 0, CPU, between=lambda: ran.append(1)) == {
        "grads_equal": True,
        "buffers_equal": True,
    }
    assert ran == [1]
    model = remat.apply(workload.model(0), workload.block_types)

    def corrupt() -> None:
        with torch.no_grad():
            next(model.parameters()).add_(1)

    got = measure.exactness(workload, model, batch, 0, CPU, between=corrupt)
    assert got == {"grads_equal": False, "buffers_equal": True}


class _NoDeterministicKernel(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError(
                "scatter_cuda_ does not have a deterministic implementation, but you set "
                "'torch.use_deterministic_algorithms(True)'."
            )
        return super().forward(x)


def test_an_op_without_a_deterministic_kernel_compares_nothing_and_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As on CUDA, where the comparison runs with deterministic kernels only.
    @contextlib.contextmanager
    def strict(device: torch.device) -> Iterator[None]:
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)

    monkeypatch.setattr(measure, "deterministic_kernels", strict)
    workload = dataclasses.replace(
        get_workload("mlp", "small"),
        build=lambda: _NoDeterministicKernel(4, 4),
        loss_fn=lambda out, target: out.sum(),
    )
    model = workload.model(0)
    got = measure.exactness(workload, model, (torch.ones(2, 4), torch.zeros(2)), 0, CPU)
    assert got["grads_equal"] is None and got["buffers_equal"] is None
    assert got["not_compared"] == "scatter_cuda_ has no deterministic kernel on cpu"
    assert model.weight.grad is not None  # the step the peak's measurement follows
    assert not torch.are_deterministic_algorithms_enabled()


def test_an_error_that_is_not_about_determinism_is_raised() -> None:
    error = RuntimeError("shapes cannot be multiplied")
    assert measure._nondeterministic(error) is None
    cublas = RuntimeError("this operation is not deterministic because it uses CuBLAS and ...")
    assert measure._nondeterministic(cublas) == "cuBLAS (set CUBLAS_WORKSPACE_CONFIG=:4096:8)"


def test_deterministic_kernels_are_asked_for_on_cuda_alone() -> None:
    cudnn = torch.backends.cudnn
    before = (cudnn.deterministic, cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    with measure.deterministic_kernels(CPU):
        assert (cudnn.deterministic, cudnn.benchmark) == before[:2]
        assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ValueError), measure.deterministic_kernels(torch.device("cuda")):
        assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
        assert torch.are_deterministic_algorithms_enabled()
        raise ValueError
    after = (cudnn.deterministic, cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    assert after == before


def test_checkpointing_every_block_lowers_the_peak() -> None:
    workload = get_workload("gpt", "small")
    cpu = torch.device("cpu")
    plain = measure.memory(workload, "none", 0, cpu)["peak_bytes"]
    torch_block = measure.memory(workload, "torch-block", 0, cpu)["peak_bytes"]
    remat_block = measure.memory(workload, "remat-block", 0, cpu)["peak_bytes"]
    assert remat_block <= torch_block < plain


def test_times_reports_ratios_for_every_strategy() -> None:
    workload = get_workload("mlp", "small")
    result = measure.times(workload, ["remat-block"], 0, torch.device("cpu"), rounds=3)
    assert set(result["ratio"]) == {"none", "remat-block"} and result["ratio"]["none"] == 1.0
    assert set(result["faults_per_step"]) == {"none", "remat-block"}
    assert result["used_rounds"] == 3 or result["contended_rounds"] > 0
    # The control (a second plain model) is timed in every round but is no strategy.
    control = result["control"]
    assert 0 < control["low"] <= control["ratio"] <= control["high"]
    assert measure.CONTROL not in result["ratio"] and measure.CONTROL not in result["pairwise"]


def test_rounds_pooled_from_several_processes_give_medians_over_all_of_them() -> None:
    def round_(plain: float, block: float, contended: bool = False) -> dict[str, Any]:
        seconds = {"none": plain, measure.CONTROL: plain * 1.01, "remat-block": block}
        return {"seconds": seconds, "faults": dict.fromkeys(seconds, 0), "contended": contended}

    first = [round_(1.0, 2.0), round_(1.0, 2.2), round_(1.0, 9.0, contended=True)]
    second = [round_(2.0, 3.0), round_(2.0, 3.0), round_(2.0, 3.2)]
    pooled = measure.summarize(["none", "remat-block"], first + second)
    assert pooled["rounds"] == 6 and pooled["contended_rounds"] == 1 and pooled["used_rounds"] == 5
    # Per-round ratios 2.0, 2.2, 1.5, 1.5, 1.6 (the contended 9.0 left out): median 1.6.
    assert pooled["ratio"]["remat-block"] == pytest.approx(1.6)
    assert pooled["seconds"]["remat-block"] == pytest.approx(3.0)
    assert pooled["control"]["ratio"] == pytest.approx(1.01)
    assert pooled["timed_rounds"] == first + second


def test_the_timing_control_is_a_second_plain_model_timed_next_to_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prepared: dict[int, str] = {}  # id(model) -> the strategy it was prepared with
    stepped: list[str] = []
    prepare, step = measure._prepared, measure.training_step

    def _prepared(workload: Any, strategy: str, *args: Any) -> torch.nn.Module:
        model = prepare(workload, strategy, *args)
        copies = sum(s.startswith(f"{strategy}#") for s in prepared.values())
        prepared[id(model)] = f"{strategy}#{copies}"
        return model

    def training_step(model: torch.nn.Module, *args: Any) -> torch.Tensor:
        stepped.append(prepared[id(model)])
        return step(model, *args)

    monkeypatch.setattr(measure, "_prepared", _prepared)
    monkeypatch.setattr(measure, "training_step", training_step)
    rounds = 4
    measure.times(get_workload("mlp", "small"), ["remat-block"], 0, torch.device("cpu"), rounds)
    assert sorted(prepared.values()) == ["none#0", "none#1", "remat-block#0"]
    timed = stepped[-3 * rounds :]  # after two warm-up steps of each model
    for r in range(rounds):
        order = timed[3 * r : 3 * r + 3]
        assert sorted(order) == ["none#0", "none#1", "remat-block#0"]
        assert abs(order.index("none#0") - order.index("none#1")) == 1  # side by side


def test_unknown_strategy_suggests_a_name() -> None:
    with pytest.raises(remat.RematError, match="did you mean 'remat-block'"):
        get_strategy("remat-blok")


def _result() -> report.Result:
    rows = [
        report.Row("none", "no checkpointing", 100 * 2**20, 1.0, 1.0, 1.0, True),
        report.Row("remat-block", "x", 20 * 2**20, 0.2, 1.4, 1.4, True, "torch-block", 1.01),
        report.Row("torch-block", "y", 20 * 2**20, 0.2, 1.39, 1.39, True),
        report.Row("slow", "z", 50 * 2**20, 0.5, 2.0, 2.0, False),
    ]
    return report.Result("gpt-small", "a GPT", "cpu", 3, 0, 3, rows, {})


def test_pareto_front() -> None:
    points = [(1.0, 100.0), (1.4, 20.0), (1.39, 20.0), (2.0, 50.0), (1.2, 60.0)]
    assert report._pareto(points) == [(1.0, 100.0), (1.2, 60.0), (1.39, 20.0)]


def test_json_and_plot_are_written(tmp_path: Path) -> None:
    result = _result()
    report.write_json(result, tmp_path / "out.json")
    data = json.loads((tmp_path / "out.json").read_text())
    assert [r["strategy"] for r in data["rows"]] == ["none", "remat-block", "torch-block", "slow"]
    assert data["rows"][1]["counterpart_time_ratio"] == 1.01
    report.write_plot(result, tmp_path / "out.png")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "out.png"]


def test_the_printed_table_cuts_no_header_or_cell(capsys: pytest.CaptureFixture[str]) -> None:
    """In a log (stdout not a terminal), the table is printed as wide as its widest row: a
    planned row at a budget no plan fits, with a long strategy name, cuts nothing."""
    result = _result()
    long = report.Row(
        "remat-auto-disk@torch-every-2",
        "p",
        15 * 2**20,
        0.15,
        1.6,
        1.6,
        True,
        "remat-graph-mm-disk",
        1.532,
        predicted_peak_bytes=15 * 2**20,
        predicted_time_ratio=1.55,
        budget_bytes=15 * 2**20,
        budget_feasible=False,
    )
    result.rows.append(long)
    report.print_table(result)
    out = capsys.readouterr().out
    assert "…" not in out
    assert "remat-auto-disk@torch-every-2" in out and "1.532 (remat-graph-mm-disk)" in out
    assert "(no plan fits; smallest 15.0 MiB)" in out
    for header in ("peak act. MiB", "predicted MiB / time", "time vs torch", "exact"):
        assert header in out


def _boxes(
    centres: list[tuple[float, float]],
    sizes: list[tuple[float, float]],
    places: list[tuple[float, float, str, str, bool]],
) -> list[tuple[float, float, float, float]]:
    # Scale 1: offsets in points are pixels.
    return [
        report.text_box(cx + dx, cy + dy, w, h, ha, va)
        for (cx, cy), (w, h), (dx, dy, ha, va, _) in zip(centres, sizes, places, strict=True)
    ]


def test_plot_labels_of_a_crowded_cluster_overlap_nothing() -> None:
    # Eight points within 10 pixels of each other, like the torch and remat points that
    # share a peak: each label is placed clear of every marker, the legend and each other.
    centres = [(300.0 + 3 * i, 200.0 + (i % 3) * 4) for i in range(8)]
    markers = [(x - 6, y - 6, x + 6, y + 6) for x, y in centres]
    legend = (320.0, 215.0, 420.0, 260.0)
    sizes = [(60.0 + 5 * i, 10.0) for i in range(8)]
    places = report._label_positions(
        centres, sizes, [(6.0, 10.0)] * 8, [*markers, legend], (0, 0, 640, 480), 1.0
    )
    assert not any(numbered for *_, numbered in places)
    boxes = _boxes(centres, sizes, places)
    for i, box in enumerate(boxes):
        assert report._inside(box, (0, 0, 640, 480))
        assert not any(report._overlap(box, other) for other in [*markers, legend])
        assert not any(report._overlap(box, other) for other in boxes[i + 1 :])


def test_plot_labels_fall_back_to_numbers_where_names_do_not_fit() -> None:
    # A frame too small for the long names: numbers, still clear of each other.
    centres = [(50.0, 50.0), (54.0, 50.0), (58.0, 50.0)]
    sizes = [(500.0, 10.0)] * 3
    places = report._label_positions(centres, sizes, [(6.0, 10.0)] * 3, [], (0, 0, 120, 100), 1.0)
    assert [numbered for *_, numbered in places] == [True, True, True]
    boxes = _boxes(centres, [(6.0, 10.0)] * 3, places)
    assert not any(report._overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])


def test_plot_of_a_crowded_run_labels_every_point_or_keys_it() -> None:
    """Thirty long names within 3 MiB and 0.03 s: each point gets its name or a number beside
    it, the numbered ones are listed under the axes, and no two labels overlap."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    rows = [report.Row("none", "x", 100 * 2**20, 1.0, 1.0, 1.0, True)]
    for i in range(30):
        peak = int((50 + 0.1 * i) * 2**20)
        rows.append(
            report.Row(f"remat-a-long-name-{i}", "x", peak, 0.5, 1.2 + 0.001 * i, 1.2, True)
        )
    fig = report.figure(report.Result("w", "d", "cpu", 3, 0, 3, rows, {}))
    fig.canvas.draw()
    labels = [t for t in fig.axes[0].texts if t.get_text()]
    names = [t.get_text() for t in labels]
    numbered = {n for n in names if n.isdigit()}
    assert len(labels) == len(rows) and numbered  # one label a point; some numbered
    key = " ".join(t.get_text() for t in fig.texts)
    assert all(f"{n}: " in key for n in numbered)
    assert sum(f"remat-a-long-name-{i}" in names for i in range(30)) + len(numbered) == 30
    # The text's own box (an annotation's also spans its leader line).
    boxes = [Text.get_window_extent(t) for t in labels]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    plt.close(fig)


def test_plot_with_every_kind_of_point_is_written(tmp_path: Path) -> None:
    rows = [
        *_result().rows,
        report.Row("remat-auto@50%", "p", 50 * 2**20, 0.5, 1.1, 1.1, True),
        report.Row("remat-auto@torch-block", "p", 20 * 2**20, 0.2, 1.3, 1.3, True),
        report.Row("remat-auto-disk@10%", "p", 10 * 2**20, 0.1, 1.6, 1.6, True),
    ]
    result = report.Result("gpt-small", "a GPT", "cpu", 3, 0, 3, rows, {})
    report.write_plot(result, tmp_path / "out.png")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_table() -> None:
    text = report.markdown(_result())
    assert "| remat-block | 20.0 | 0.20 | 1.400 | 1.40 | 1.010 (torch-block) | yes |" in text
    assert "| slow | 50.0 | 0.50 | 2.000 | 2.00 |  | NO: grads |" in text


def test_check_writable(tmp_path: Path) -> None:
    report.check_writable(tmp_path / "sub" / "out.json")
    assert (tmp_path / "sub").is_dir() and list((tmp_path / "sub").iterdir()) == []
    with pytest.raises(remat.RematError, match="is a directory"):
        report.check_writable(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(remat.RematError, match="cannot create"):
        report.check_writable(blocker / "out.json")


@pytest.mark.parametrize("model", ["gpt2", "llama", "bert"])
def test_hugging_face_models_from_config_are_exact(model: str) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    from remat.bench.hf import get_hf_workload

    workload = get_hf_workload(model, "small")
    assert len(workload.blocks(workload.model())) == 2
    peaks = {}
    for strategy in ("none", "remat-block", "remat-hf"):
        result = measure.memory(workload, strategy, seed=0, device=torch.device("cpu"))
        assert result["grads_equal"] is True
        peaks[strategy] = result["peak_bytes"]
    # remat.hf.enable makes the same layers regions as wrapping each block by hand
    assert peaks["remat-hf"] == peaks["remat-block"] < peaks["none"]


def test_tracker_peak_matches_resident_memory_of_a_fresh_process() -> None:
    # The benchmark GPT, one step, in a fresh process where glibc returns freed tensor memory to
    # the system (MALLOC_MMAP_THRESHOLD_), so that resident memory follows live tensors.
    import os
    import subprocess
    import sys

    request = {"kind": "rss", "workload": "gpt", "size": "bench", "strategy": "none"}
    done = subprocess.run(
        [sys.executable, "-m", "remat.bench.measure", json.dumps(request)],
        capture_output=True,
        text=True,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rss, tracked = result["rss_peak_bytes"], result["tracker_peak_bytes"]
    assert tracked > 1000 * 2**20  # about 1.1 GiB of activations
    assert abs(tracked - rss) <= 0.10 * rss, (tracked, rss)


def test_recording_and_replay_overhead_are_measured_per_op() -> None:
    overhead = measure.engine_overhead(get_workload("gpt", "small"), repeats=60)
    assert set(overhead) == {"recording_us_per_op", "replay_us_per_op", "dispatch_mode_us_per_op"}
    # microseconds per op: positive, and not absurd
    assert all(0 < us < 10_000 for us in overhead.values()), overhead
    # recording runs inside a dispatch mode: it costs more than one that only runs each op
    assert overhead["recording_us_per_op"] > overhead["dispatch_mode_us_per_op"], overhead


def test_strategies_are_timed_next_to_their_counterparts() -> None:
    order = measure._adjacent(list(STRATEGIES))
    assert sorted(order) == sorted(STRATEGIES)
    for name in order:
        other = get_strategy(name).counterpart
        if other is not None:
            chain = order[order.index(other) + 1 : order.index(name) + 1]
            assert all(get_strategy(n).counterpart is not None for n in chain)
    assert order.index("remat-block") == order.index("torch-block") + 1
    assert order.index("remat-graph-mm") == order.index("torch-sac-mm") + 1


def test_offload_measurement_runs_and_reports() -> None:
    from remat.bench import offload

    io = offload._spawn({"kind": "io", "size": "small", "seed": 0, "rounds": 1}, False)
    assert io["bytes_written_per_step"] == io["bytes_read_per_step"] > 0
    assert io["isolated_bytes"] > 0 and io["time_ratio"] > 0
    rss = offload._spawn({"kind": "rss", "size": "small", "seed": 0, "strategy": "none"}, True)
    assert rss["rss_peak_bytes"] >= rss["rss_before_bytes"] > 0
    text = offload.report({"size": "small", "rss": {"none": rss}, "io": io})
    assert "disk tier, gpt-small" in text and "ratio" in text
    # A step that does not raise the resident set (the heap holds its pages) reports no ratio.
    flat = {"rss_before_bytes": 2**20, "rss_peak_bytes": 2**20}
    assert "     n/a" in offload.report({"size": "small", "rss": {"none": flat}, "io": io})


def test_offload_ratios_to_less_than_a_mib_read_n_a_and_say_why_once() -> None:
    """At the small size the plain step raises the resident set by a few pages and the
    parameters are a fraction of a MiB: ratios to those are noise, not 41x or 503x."""
    from remat.bench import offload

    mib = 2**20
    rss = {
        "none": {"rss_before_bytes": 300 * mib, "rss_peak_bytes": 300 * mib + 4096},
        "remat-block": {"rss_before_bytes": 300 * mib, "rss_peak_bytes": 300 * mib + 41 * 4096},
    }
    io = {
        "bytes_written_per_step": mib, "bytes_read_per_step": mib, "directory": "/tmp",
        "isolated_bytes": mib, "plain_step_seconds": 0.004, "offload_step_seconds": 0.04,
        "time_ratio": 10.0,
        **{
            f"{prefix}{kind}_{what}_bytes_per_s": 1e9
            for prefix in ("", "isolated_")
            for kind in ("tier", "plain")
            for what in ("write", "read")
        },
    }  # fmt: skip
    model = {"param_bytes": 0.2 * mib, "optimizer_state_bytes": 0.4 * mib}
    om = {
        "offload": {**model, "peak_rss_bytes": 300 * mib, "step_seconds": [0.04]},
        "plain": {"peak_rss_bytes": 300 * mib, "step_seconds": [0.01]},
    }
    text = offload.report({"size": "small", "rss": rss, "io": io, "offload_model": om})
    assert "41.00" not in text and "(ratio n/a)" in text and "500.00" not in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  remat-block ")]
    assert rows[0][-1] == "n/a", text
    assert text.count("n/a: a ratio to less than 1.0 MiB") == 1
    # At a size where they mean something, the ratios are printed and nothing is said.
    big = {k: {"rss_before_bytes": 0, "rss_peak_bytes": 100 * mib} for k in rss}
    om["offload"].update(param_bytes=10 * mib, optimizer_state_bytes=20 * mib)
    text = offload.report({"size": "bench", "rss": big, "io": io, "offload_model": om})
    assert "n/a" not in text and "(ratio 10.00)" in text


def test_budgets_take_fractions_and_the_word_torch() -> None:
    from remat.cli import _budgets

    run = ["none", "torch-block", "remat-block", "torch-every-2"]
    assert _budgets("0.5,torch", run) == [
        "remat-auto@50%",
        "remat-auto@torch-block",
        "remat-auto@torch-every-2",
    ]
    assert _budgets("0.75,0.25", run) == ["remat-auto@75%", "remat-auto@25%"]
    with pytest.raises(remat.RematError, match=r"got 'tourch' \(did you mean 'torch'\?\)"):
        _budgets("0.5,tourch", run)
    with pytest.raises(remat.RematError, match="the run has no torch strategy"):
        _budgets("torch", ["none", "remat-block"])


def test_a_planned_strategy_at_a_torch_peak_is_compared_with_that_torch_strategy() -> None:
    entry = get_strategy("remat-auto@torch-every-2")
    assert entry.counterpart == "torch-every-2" and "torch-every-2's measured peak" in (
        entry.description
    )
    with pytest.raises(remat.RematError, match="unknown strategy 'torch-blok'"):
        get_strategy("remat-auto@torch-blok")
    # Its budget is a peak measured in the same run: outside remat bench there is none.
    workload = get_workload("mlp", "small")
    with pytest.raises(remat.RematError, match="planned at the peak remat bench measures"):
        get_strategy("remat-auto@torch-block").prepare(workload.model(), workload)


def test_a_planned_strategy_is_timed_next_to_its_torch_strategy() -> None:
    names = ["none", "torch-block", "remat-block", "remat-graph-all", "remat-auto@torch-block"]
    order = measure._adjacent([*names, "remat-auto@50%"])
    block = order.index("torch-block")
    assert order[block - 1] == "remat-auto@torch-block" and order[block + 1] == "remat-block"


@pytest.mark.parametrize(
    ("planned_peak", "ratio", "expected"),
    [
        (90, 0.90, "dominates"),
        (100, 0.94, "dominates"),  # the same memory counts as no more
        (90, 0.96, "ties (within the control)"),
        (90, 1.04, "ties (within the control)"),
        (90, 1.06, "slower"),
        (101, 0.50, "more memory"),
    ],
)
def test_verdict(planned_peak: int, ratio: float, expected: str) -> None:
    assert report.verdict(planned_peak, 100, ratio, spread=0.05) == expected


def test_a_quiet_control_still_leaves_a_percent_of_noise() -> None:
    """A control of 1.000 does not make a plan 0.5% faster dominate: the spread is at least
    ``MIN_SPREAD``."""
    mib = 2**20
    rows = [
        report.Row("torch-block", "t", 20 * mib, 0.2, 1.5, 1.5, True),
        report.Row(
            "remat-auto@torch-block", "p", 20 * mib, 0.2, 1.49, 1.49, True, "torch-block", 0.995,
            budget_bytes=20.0 * mib, budget_feasible=True,
        ),
    ]  # fmt: skip
    (found,) = report.dominance(rows, control_ratio=1.0, rounds=5)
    assert found.verdict == "ties (within the control)"
    assert found.control_spread == report.MIN_SPREAD


@pytest.mark.parametrize("rounds", [1, 2])
def test_fewer_than_three_rounds_give_no_verdict(rounds: int) -> None:
    """A plan 12% faster than torch in one or two rounds is not said to dominate it: single
    rounds move by more than that here."""
    mib = 2**20
    rows = [
        report.Row("torch-block", "t", 20 * mib, 0.2, 1.5, 1.5, True),
        report.Row(
            "remat-auto@torch-block", "p", 20 * mib, 0.2, 1.3, 1.3, True, "torch-block", 0.888,
            budget_bytes=20.0 * mib, budget_feasible=True,
        ),
    ]  # fmt: skip
    (found,) = report.dominance(rows, control_ratio=1.0, rounds=rounds)
    assert found.verdict.startswith(report.TOO_FEW_ROUNDS)
    (found,) = report.dominance(rows, control_ratio=1.0, rounds=report.MIN_ROUNDS)
    assert found.verdict == "dominates"


def _timed(rounds: int, contended: int, used: int, control: float) -> report.Result:
    return dataclasses.replace(
        _result(),
        rounds=rounds,
        contended_rounds=contended,
        used_rounds=used,
        control_time_ratio=control,
    )


def test_a_timing_warning_names_what_makes_the_times_unreliable() -> None:
    assert report.timing_warning(_timed(7, 0, 7, 1.0)) is None
    # Contended rounds left out, three or more clean ones used: reliable.
    assert report.timing_warning(_timed(7, 2, 5, 1.0)) is None
    assert "medians of 1 round)" in (report.timing_warning(_timed(1, 0, 1, 1.0)) or "")
    kept = report.timing_warning(_timed(4, 2, 4, 1.0)) or ""
    assert "2 of the 4 rounds used had other processes competing for the CPU" in kept
    wide = report.timing_warning(_timed(7, 0, 7, 0.85)) or ""
    assert "the timing control reads 0.850, outside 0.9-1.1" in wide
    assert "--rounds" in wide and "--processes" in wide and "quiet machine" in wide


def test_the_table_shows_three_significant_figures_of_small_peaks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = [
        report.Row("none", "x", int(0.416 * 2**20), 1.0, 1.0, 1.0, True),
        report.Row("torch-block", "x", int(0.1645 * 2**20), 0.4, 1.0, 1.0, True),
        report.Row("remat-auto@50%", "x", int(0.1602 * 2**20), 0.4, 1.0, 1.0, True),
    ]
    report.print_table(report.Result("w", "d", "cpu", 3, 0, 3, rows, {}))
    out = capsys.readouterr().out
    assert "0.416" in out and "0.164" in out and "0.160" in out
    assert [report.mib(x * 2**20) for x in (558.14, 21.34, 0.2134, 0.0)] == [
        "558.1", "21.3", "0.213", "0.0"
    ]  # fmt: skip
    assert report.mib(20 * 2**20, 2) == "20.00"


def test_dominance_lines_follow_the_rows() -> None:
    mib = 2**20
    rows = [
        report.Row("none", "plain", 100 * mib, 1.0, 1.0, 1.0, True),
        report.Row("torch-block", "t", 20 * mib, 0.2, 1.5, 1.5, True),
        report.Row("torch-every-2", "t", 60 * mib, 0.6, 1.2, 1.2, True),
        report.Row(
            "remat-auto@torch-block", "p", 22 * mib, 0.22, 1.4, 1.4, True, "torch-block", 0.9,
            budget_bytes=22.0 * mib, budget_feasible=False, no_plan="remat.plan: no plan fits",
        ),
        report.Row(
            "remat-auto@torch-every-2", "p", 55 * mib, 0.55, 1.1, 1.1, True, "torch-every-2",
            0.92, budget_bytes=60.0 * mib, budget_feasible=True,
        ),
    ]  # fmt: skip
    found = report.dominance(rows, control_ratio=0.97, rounds=5)
    assert [(d.torch, d.verdict) for d in found] == [
        ("torch-block", "no plan fits"),
        ("torch-every-2", "dominates"),
    ]
    assert found[0].smallest_budget_bytes == 22.0 * mib and found[1].smallest_budget_bytes is None
    assert found[1].control_spread == pytest.approx(0.03)
    result = report.Result("gpt-small", "a GPT", "cpu", 3, 0, 3, rows, {}, dominance=found)
    assert report.dominance_lines(result) == [
        "torch-block 20.00 MiB: no plan fits; the smallest budget that fits is 22.00 MiB "
        "(remat-auto@torch-block 22.00 MiB, time vs torch-block 0.900, planned at that budget)",
        "torch-every-2 60.00 MiB: remat-auto@torch-every-2 55.00 MiB, time vs torch-every-2 "
        "0.920 (control +-0.030): dominates",
    ]
    assert result.to_json()["dominance"][1]["verdict"] == "dominates"


def test_solve_time_measurement_runs_and_reports() -> None:
    from remat.bench import solve_time

    result = solve_time.measure(layers=4, budget="60%")
    assert result["verified_peak_bytes"] <= 0.6 * result["plain_peak_bytes"]
    assert 0 < result["solve_seconds"] < result["seconds"]
    assert 0 < result["profile_seconds"] < result["seconds"]
    text = solve_time.report(result)
    assert "remat.plan on a 4-layer GPT" in text and "solve" in text
    assert result["autocast"] is None and "chain: exact DP over the chain of blocks" in text


def test_solve_time_under_autocast_plans_the_mixed_precision_loop() -> None:
    from remat.bench import solve_time

    result = solve_time.measure(layers=4, budget="60%", autocast=torch.bfloat16)
    assert result["autocast"] == "bfloat16"
    assert result["verified_peak_bytes"] == result["predicted_peak_bytes"]
    assert result["verified_peak_bytes"] <= 0.6 * result["plain_peak_bytes"]
    # The casts autocast's cache holds to the forward's end are in the chain: its MILP ran.
    assert "HiGHS MILP" in result["chain_solver"]
    text = solve_time.report(result)
    assert "at 60%, under torch.autocast (bfloat16):" in text


_SERVED = """
import os
import sys

handled = []


def handle(request):
    if "fail" in request:
        print("measuring", request["fail"])
        raise ValueError("no strategy named " + request["fail"])
    if "exit" in request:
        os._exit(request["exit"])
    handled.append(request["n"])
    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "handled": handled,
        "setting": os.environ.get("REMAT_TEST_SETTING"),
        "preloaded": "colorsys" in sys.modules,
    }
"""


def test_a_fork_server_runs_each_request_in_a_fresh_child_of_one_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request runs in its own child, forked from the one server: what a request leaves
    in the module's globals is gone for the next. The server's environment and the modules it
    preloads reach them. A request that raises, or a child that dies, is a ``RematError`` with
    the child's output, and the server goes on serving."""
    from remat.bench._child import ForkServer

    (tmp_path / "served.py").write_text(_SERVED)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with ForkServer("served", {"REMAT_TEST_SETTING": "on"}, preload=["colorsys"]) as forks:
        first = forks.run({"n": 1}, "the first")
        with pytest.raises(remat.RematError) as failed:
            forks.run({"fail": "sideways"}, "the memory of sideways")
        with pytest.raises(remat.RematError, match=r"the memory of x failed \(exit 3\)"):
            forks.run({"exit": 3}, "the memory of x")
        second = forks.run({"n": 2}, "the second")
    assert first["handled"] == [1] and second["handled"] == [2]
    assert first["pid"] != second["pid"] and first["parent"] == second["parent"] != os.getpid()
    assert first["setting"] == second["setting"] == "on"
    assert first["preloaded"] and second["preloaded"]
    message = str(failed.value)
    assert message.startswith("remat bench: the memory of sideways failed (exit 1):")
    assert "measuring sideways" in message
    assert "ValueError: no strategy named sideways" in message
    with pytest.raises(remat.RematError, match="inside its with block"):
        forks.run({"n": 3}, "a late one")


def test_a_fork_server_that_cannot_start_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose module does not import, or whose imports initialized CUDA (its children
    could not use it), exits; the request says why."""
    from remat.bench._child import ForkServer

    with ForkServer("remat.no_such_module") as forks, pytest.raises(remat.RematError) as failed:
        forks.run({}, "the memory of none")
    message = str(failed.value)
    assert message.startswith("remat bench: the memory of none failed: its server process exited")
    assert "No module named 'remat.no_such_module'" in message
    (tmp_path / "served.py").write_text(_SERVED)
    (tmp_path / "cuda_on.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cuda_on = r"importing \['served', 'cuda_on'\] initialized CUDA"
    with (
        ForkServer("served", preload=["cuda_on"]) as forks,
        pytest.raises(remat.RematError, match=cuda_on),
    ):
        forks.run({"n": 1}, "the memory of none")
