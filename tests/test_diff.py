"""`torchscope diff`: real recordings of a tiny training loop, compared as `diff` would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torchscope  # noqa: E402
from torchscope.analysis.diff import Options, compare  # noqa: E402

LOSS_LINE = "loss = ((h * scale - y) ** 2).mean()"


def record(
    path: Path,
    *,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    steps: int = 2,
    extra_op: bool = False,
    hidden: int = 8,
) -> Path:
    """Two SGD steps of a 4-8-2 MLP, recorded; the keyword arguments are the 'one changed
    constant' of each test."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
    ).to(dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(3, 4).to(dtype), torch.randn(3, 2).to(dtype)
    with torchscope.trace(record=path):
        for _ in range(steps):
            opt.zero_grad()
            h = m(x)
            if extra_op:
                h = torch.tanh(h)
            loss = ((h * scale - y) ** 2).mean()
            loss.backward()
            opt.step()
    return path


def diff(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchscope", "diff", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("diff")
    return {
        "base": record(d / "base.tsc"),
        "again": record(d / "again.tsc"),
        "scale": record(d / "scale.tsc", scale=1.5),
        "bf16": record(d / "bf16.tsc", dtype=torch.bfloat16),
        "extra": record(d / "extra.tsc", extra_op=True),
        "wide": record(d / "wide.tsc", hidden=16),
        "longer": record(d / "longer.tsc", steps=3),
    }


def test_a_run_against_itself_and_its_rerun_is_the_same(runs: dict[str, Path]) -> None:
    for other in (runs["base"], runs["again"]):
        res = diff(runs["base"], other, "--exact")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "same: no divergence" in res.stdout
        assert "drift by module and step" in res.stdout
    # Everything aligned, nothing left over.
    a = list(torchscope.load(runs["base"]))
    r = compare(a, list(torchscope.load(runs["again"])), Options(exact=True))
    assert r.same and r.only_a == r.only_b == 0
    assert r.matched == sum(e["kind"] in ("op", "grad") for e in a)


def test_one_changed_constant_names_the_first_divergent_op(runs: dict[str, Path]) -> None:
    res = diff(runs["base"], runs["scale"])
    assert res.returncode == 1, res.stdout + res.stderr
    head = res.stdout.split("first divergence", 1)[1].splitlines()
    # The multiply by `scale` is the first op whose result differs: its input is the same.
    assert "(numeric), step 0: op Tensor.mul in the top level" in head[0]
    assert "outputs[0]" in head[0]
    # Both sides, with their source line read back from this file.
    assert head[1].startswith("  A: op Tensor.mul") and LOSS_LINE in head[2]
    b_at = next(i for i, line in enumerate(head) if line.startswith("  B: "))
    assert LOSS_LINE in head[b_at + 1]
    # ... and the first (linear) op before it was the same on both sides.
    trace = torchscope.load(runs["base"])
    first_mul = next(e for e in trace.ops if e["name"] == "Tensor.mul")
    assert f"seq {first_mul['seq']}" in head[1]


def test_fp32_against_bf16_diverges_without_tolerance_and_not_with_one(
    runs: dict[str, Path],
) -> None:
    strict = diff(runs["base"], runs["bf16"])
    assert strict.returncode == 1
    assert "first divergence (numeric), step 0: op torch.nn.functional.linear" in strict.stdout
    assert "float32[3,8]" in strict.stdout and "bfloat16[3,8]" in strict.stdout
    loose = diff(runs["base"], runs["bf16"], "--rtol", "0.05", "--atol", "0.01")
    assert loose.returncode == 0, loose.stdout
    assert "changed float dtype (precision)" in loose.stdout
    # Drift: bf16's ~3 significant digits show as ~1e-3 relative differences of norms.
    drift = compare(torchscope.load(runs["base"]), torchscope.load(runs["bf16"])).drift
    assert drift and all(0 < v < 0.05 for v in drift.values())
    # A dtype change can also be made a divergence by itself.
    typed = diff(runs["base"], runs["bf16"], "--strict-dtype", "--rtol", "0.05", "--atol", "0.01")
    assert typed.returncode == 1
    assert "(structural)" in typed.stdout and "dtype float32 vs bfloat16" in typed.stdout


def test_structural_divergence_an_extra_op_a_shape_and_a_step(runs: dict[str, Path]) -> None:
    res = diff(runs["base"], runs["extra"])
    assert res.returncode == 1
    assert "first divergence (structural), step 0: op torch.tanh in the top level" in res.stdout
    assert "only in B" in res.stdout
    assert "  A: (absent)" in res.stdout
    wide = diff(runs["base"], runs["wide"])
    assert wide.returncode == 1
    assert "(structural), step 0: op torch.nn.functional.linear in module '0'" in wide.stdout
    assert "shape [3, 8] vs [3, 16]" in wide.stdout
    longer = diff(runs["base"], runs["longer"])
    assert longer.returncode == 1
    assert "(structural), step 2: step 2 only in B" in longer.stdout


def test_bad_input_is_one_line_and_exit_2(runs: dict[str, Path], tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.tsc"
    garbage.write_bytes(b"this is not a trace file" * 10)
    corrupt = tmp_path / "corrupt.tsc"
    data = bytearray(runs["base"].read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = b"\xff" * 16
    corrupt.write_bytes(bytes(data))
    for a, b in (
        (runs["base"], tmp_path / "missing.tsc"),
        (garbage, runs["base"]),
        (runs["base"], corrupt),
    ):
        res = diff(a, b)
        assert res.returncode == 2, (a, b, res.stdout, res.stderr)
        assert res.stderr.startswith("torchscope: error: ")
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert res.stdout == ""
    for options, why in (
        (("--step", "x-y"), "bad step list"),
        (("--step", "5-2"), "bad step list"),  # it compared nothing and said "same"
        (("--step", "999"), "neither recording has step 999"),
        (("--rtol", "nan"), "--rtol and --atol must be numbers >= 0"),  # every event diverged
    ):
        res = diff(runs["base"], runs["base"], *options)
        assert res.returncode == 2 and why in res.stderr, (options, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and res.stdout == ""
    # stdout on a full disk: one line and 2, not a traceback and 1 ("diverged")
    with open("/dev/full", "w") as full:
        res = subprocess.run(
            [sys.executable, "-m", "torchscope", "diff", runs["base"], runs["base"]],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert res.returncode == 2
    assert res.stderr == "torchscope: error: cannot write the output: No space left on device\n"


def test_step_filter_and_truncated_file(runs: dict[str, Path], tmp_path: Path) -> None:
    # The longer run's first two steps are the base run's, bit for bit.
    res = diff(runs["base"], runs["longer"], "--step", "0-1", "--exact")
    assert res.returncode == 0, res.stdout
    # A file cut short is compared up to its last complete chunk, and says so.
    cut = tmp_path / "cut.tsc"
    cut.write_bytes(runs["base"].read_bytes()[:-60])
    res = diff(runs["base"], cut)
    assert res.returncode in (0, 1)
    assert "cut short" in res.stderr or "damaged" in res.stderr
