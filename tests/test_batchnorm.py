"""BatchNorm in training mode writes its running statistics in place from the activations: a
NaN made upstream reaches them in the same call. They are consequences of that origin, not
inputs from outside (a conv net in channels_last, recorded with ``torchscope run``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

JOB = Path(__file__).parent / "jobs" / "batchnorm_nan.py"
LOG_LINE = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if "torch.log" in line)


def test_batchnorm_running_stats_are_consequences_not_origins(tmp_path):
    import torchscope
    from torchscope.analysis.trace import CONSEQUENCES, job_origins

    res = subprocess.run(
        [sys.executable, "-m", "torchscope", "run", "--quiet", "--record", "f.tsc", str(JOB)],
        cwd=tmp_path, env={**os.environ, "JOB_BAD": "1"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    alerts = [dict(a) for a in torchscope.load(tmp_path / "f.tsc").of_kind("alert")]
    (origin,) = [a for a in alerts if a["where"] != CONSEQUENCES]
    assert origin["name"] == "torch.log" and origin["step"] == 4
    assert origin["source"].endswith(f"batchnorm_nan.py:{LOG_LINE}")
    assert not any("batch_norm" in a["message"] and "outside" in a["message"] for a in alerts)
    assert len(job_origins({0: alerts})) == 1
    counted = [a for a in alerts if a["where"] == CONSEQUENCES][-1]
    assert counted["consequences"] > 0
