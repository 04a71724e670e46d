"""``remat bench --pipeline``: the in-process rows, fast, and the command's argument checks.

The rows with one process per stage (``stages-*``) spawn processes; they are exercised by
``remat bench --pipeline`` itself and, for correctness, by test_pipe_distributed.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from remat import cli
from remat.bench import pipeline


def test_in_process_rows_measure_memory_and_time() -> None:
    result = pipeline.run("small", partitions=2, chunks=4, rounds=1, processes=False)
    names = [row.name for row in result.rows]
    assert names == ["plain", "pipe-never", "pipe-except_last", "pipe-always"]
    peaks = {row.name: row.peak_bytes for row in result.rows}
    assert all(p > 0 for p in peaks.values())
    # Checkpointed micro-batches keep only their inputs: a lower peak than keeping everything.
    assert peaks["pipe-always"] < peaks["pipe-never"]
    assert all(row.step_seconds > 0 for row in result.rows)
    assert result.balance == [3, 3] and result.batch_rows == 4
    table = result.table()
    assert "pipe-always" in table and "vs plain" in table and ", 1 round\n" in table
    again = pipeline.from_json(json.loads(json.dumps(dataclasses.asdict(result))))
    assert again == result


def test_pipeline_flag_rejects_other_workloads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        ["bench", "--pipeline", "--workload", "mlp", "--json", str(tmp_path / "x.json")]
    )
    assert code == 2
    assert "--pipeline: measures the unet workload" in capsys.readouterr().err


def test_partitions_out_of_range_fail_clearly() -> None:
    from remat import RematError

    with pytest.raises(RematError, match=r"9 partitions for a model of 6 layers"):
        pipeline.run("small", partitions=9, processes=False)
