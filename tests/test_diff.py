"""`torchscope diff`: real recordings of a tiny training loop, compared as `diff` would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import torchscope  # noqa: E402
from torchscope.analysis.align import aten_keyed, keyed  # noqa: E402
from torchscope.analysis.diff import Options, compare  # noqa: E402
from torchscope.protocol.events import ATEN, GRAD, OP  # noqa: E402
from torchscope.protocol.tracefile import TraceReader  # noqa: E402

LOSS_LINE = "loss = ((h * scale - y) ** 2).mean()"
CE_LINE = "return F.cross_entropy(logits, target)"


def record(
    path: Path,
    *,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    steps: int = 2,
    extra_op: bool = False,
    hidden: int = 8,
    aten: bool = False,
) -> Path:
    """Two SGD steps of a 4-8-2 MLP, recorded; the keyword arguments are the 'one changed
    constant' of each test (``aten``: recorded at the aten level)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
    ).to(dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(3, 4).to(dtype), torch.randn(3, 2).to(dtype)
    with torchscope.trace(record=path, aten=aten):
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


# -- the aten level --------------------------------------------------------------------------
class Head(torch.nn.Module):
    """The loss inside a module, so its ops and aten calls carry module 'head'."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = Head()

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.head(logits, target)


def record_loss(
    path: Path, *, masked_row_at: int | None = None, target_at: int | None = None
) -> Path:
    """Three SGD steps on logits (leaves, so the loss is the only op), recorded at the aten
    level. ``masked_row_at``: the step whose logits have a row of -inf (log_softmax makes NaN
    of it, inside cross_entropy); ``target_at``: the step whose target changes."""
    torch.manual_seed(0)
    logits = [torch.randn(2, 5) for _ in range(3)]
    targets = [torch.tensor([1, 3]) for _ in range(3)]
    if masked_row_at is not None:
        logits[masked_row_at][0] = float("-inf")
    if target_at is not None:
        targets[target_at] = torch.tensor([1, 2])
    opt = torch.optim.SGD([t.requires_grad_() for t in logits], lr=0.1)
    model = Classifier()
    with torchscope.trace(record=path, aten=True):
        for step in range(3):
            loss = model(logits[step], targets[step])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return path


@pytest.fixture(scope="module")
def aten_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("diff-aten")
    return {
        "loss": record_loss(d / "loss.tsc"),
        "loss again": record_loss(d / "loss-again.tsc"),
        "nan": record_loss(d / "nan.tsc", masked_row_at=1),
        "target": record_loss(d / "target.tsc", target_at=1),
        "mlp": record(d / "mlp.tsc", aten=True),
        "mlp extra": record(d / "mlp-extra.tsc", aten=True, extra_op=True),
    }


def aten_headline(stdout: str) -> list[str]:
    """The first divergent aten call's line and the lines after it."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("first divergent aten call"))
    return lines[at:]


def ce_source() -> str:
    """Where this file calls cross_entropy, as the report writes it: ``test_diff.py:N``."""
    n = Path(__file__).read_text().splitlines().index(f"        {CE_LINE}") + 1
    return f"test_diff.py:{n}"


def test_a_nan_made_inside_cross_entropy_is_named_at_its_log_softmax_call(
    aten_runs: dict[str, Path],
) -> None:
    res = diff(aten_runs["loss"], aten_runs["nan"])
    assert res.returncode == 1, res.stdout + res.stderr
    # the op level, as before: the op whose outputs went NaN
    assert (
        "first divergence (numeric), step 1: op torch.nn.functional.cross_entropy in module "
        "'head' (#1): outputs[0] nan count 0 vs 1"
    ) in res.stdout
    # the aten level: which of its calls made the NaN, with its op, module, source and step
    head = aten_headline(res.stdout)
    assert head[0].startswith(
        "first divergent aten call (numeric): aten._log_softmax.default inside "
        "torch.nn.functional.cross_entropy in module 'head' at "
    )
    assert head[0].endswith(f"{ce_source()}, step 1: outputs[0] nan count 0 vs 5"), head[0]
    # both sides, linked to the cross_entropy op of step 1 in each run
    loss = torchscope.load(aten_runs["loss"])
    ce = [e for e in loss.ops if e.name == "torch.nn.functional.cross_entropy"][1]
    assert head[1].startswith(
        f"  A: aten call aten._log_softmax.default in module 'head' (in op seq {ce.seq}), step 1"
    )
    assert CE_LINE in head[2]
    b_at = next(i for i, line in enumerate(head) if line.startswith("  B: "))
    b_outputs = next(line for line in head[b_at:] if line.startswith("     outputs[0] "))
    assert "nan=5" in b_outputs
    # the library says the same: the call, and its parent's key (op, module, occurrence)
    r = compare(loss, torchscope.load(aten_runs["nan"]))
    first = r.aten.first
    assert first.a.name == "aten._log_softmax.default" and first.a.op_seq == ce.seq
    assert first.key[1] == (OP, "torch.nn.functional.cross_entropy", "head", 0)
    assert r.aten.matched == len(loss.of_kind(ATEN)) and r.aten.only_a == r.aten.only_b == 0
    assert min(d.step for d in r.aten.divergences) == 1  # step 0 was the same


def test_a_changed_target_passes_the_same_log_softmax_and_names_nll_loss(
    aten_runs: dict[str, Path],
) -> None:
    """The op level says cross_entropy's result differs; the aten level says where inside:
    its log_softmax is the same in both runs, its nll_loss is not."""
    res = diff(aten_runs["loss"], aten_runs["target"])
    assert res.returncode == 1
    head = aten_headline(res.stdout)[0]
    assert head.startswith(
        "first divergent aten call (numeric): aten.nll_loss_forward.default inside "
        "torch.nn.functional.cross_entropy in module 'head' at "
    )
    assert f"{ce_source()}, step 1: outputs[0] " in head
    r = compare(torchscope.load(aten_runs["loss"]), torchscope.load(aten_runs["target"]))
    assert "aten._log_softmax.default" not in {d.a.name for d in r.aten.divergences}


def test_identical_runs_have_no_divergent_aten_call(aten_runs: dict[str, Path]) -> None:
    n = len(torchscope.load(aten_runs["loss"]).of_kind(ATEN))
    assert n > 0
    res = diff(aten_runs["loss"], aten_runs["loss again"], "--exact")
    assert res.returncode == 0, res.stdout
    lines = res.stdout.splitlines()
    assert f"{n} aten calls aligned, 0 only in A, 0 only in B" in lines
    assert "same: no divergence" in lines and "aten level: no divergent aten call" in lines
    assert "first divergent aten call" not in res.stdout
    with TraceReader(aten_runs["loss"]) as reader:  # what the tracer writes is format 1.2
        assert reader.version == (1, 2)


def test_an_extra_op_shifts_no_other_aten_call(aten_runs: dict[str, Path]) -> None:
    """Calls are aligned under their op's or node's key, not by position: a tanh more in B
    adds its own calls (only in B) and every call of A still finds its partner."""
    a = torchscope.load(aten_runs["mlp"])
    r = compare(a, torchscope.load(aten_runs["mlp extra"]))
    assert r.aten.only_a == 0 and r.aten.matched == len(a.of_kind(ATEN))
    extra = [d for d in r.aten.divergences if d.structural]
    assert len(extra) == r.aten.only_b > 0
    assert {d.key[1][1] for d in extra} == {"torch.tanh", "TanhBackward0"}
    assert {"aten.tanh.default", "aten.tanh_backward.default"} <= {d.b.name for d in extra}
    res = diff(aten_runs["mlp"], aten_runs["mlp extra"])
    assert aten_headline(res.stdout)[0].startswith(
        "first divergent aten call (structural): aten.tanh.default inside torch.tanh in the "
        "top level at "
    )


def test_only_one_recording_at_the_aten_level_is_said_in_one_line(
    runs: dict[str, Path], aten_runs: dict[str, Path]
) -> None:
    for a, b, which in (
        (aten_runs["mlp"], runs["base"], "A"),
        (runs["base"], aten_runs["mlp"], "B"),
    ):
        res = diff(a, b, "--exact")
        # the ops and nodes are compared as before: the aten level changes none of them
        assert res.returncode == 0, res.stdout
        assert "same: no divergence" in res.stdout
        notes = [line for line in res.stdout.splitlines()[2:] if "aten" in line]  # not A:, B:
        assert notes == [
            f"only {which} has aten calls: the aten level is compared only when both "
            "recordings have it (record with --aten); comparing ops and nodes"
        ]


def test_aten_keys_link_each_call_to_its_op_or_node() -> None:
    """Forward calls under their op's key; a node's kernels under its grad event's key (the
    one of their backward call, though node ids repeat across calls); the engine's sum
    apart from the kernels."""
    x = torch.tensor(2.0, requires_grad=True)
    y = torch.tensor(2.0, requires_grad=True)
    with torchscope.trace(aten=True) as tr:
        out = x * y + x / y
        out.backward(retain_graph=True)
        out.backward()
    key_of = {e.seq: k for _, k, e in keyed(tr.events)}
    calls = [(k, e) for _, k, e in aten_keyed(tr.events)]
    for k, e in calls:
        if e.op_seq is not None:
            _, parent, engine_sum, name, _ = k
            assert parent == key_of[e.op_seq] and engine_sum is False and name == e.name
    grads = {e.seq: e for e in tr.grads}
    under_mul = []  # (backward call, engine sum, name, occurrence) of MulBackward0's calls
    for k, e in calls:
        _, parent, engine_sum, name, n = k
        if parent[0] == GRAD and parent[1] == "MulBackward0":
            (grad,) = [g for s, g in grads.items() if key_of[s] == parent]
            assert grad.node_id == e.node_id
            under_mul.append((parent[3], engine_sum, name, n))
    # x * y sends a gradient to each of x and y; each gets another from x / y: two sums
    assert under_mul == [
        (call, engine_sum, name, n)
        for call in (1, 2)
        for engine_sum, name in ((False, "aten.mul.Tensor"), (True, "aten.add.Tensor"))
        for n in (0, 1)
    ]
    # each backward call's seed has no op or node: keyed by what it says, one occurrence each
    seeds = [k for k, e in calls if e.name == "aten.ones_like.default"]
    assert seeds == [
        (ATEN, (None, None, ""), False, "aten.ones_like.default", 0),
        (ATEN, (None, None, ""), False, "aten.ones_like.default", 1),
    ]
