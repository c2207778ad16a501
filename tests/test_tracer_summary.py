"""Tensor summaries: every kind of tensor is summarised without crashing, and says what makes
sense for it."""

from __future__ import annotations

import math

import pytest
import torch

import torchscope


class Tagged(torch.Tensor):
    """A trivial tensor subclass."""


def summarize(t: torch.Tensor, values: int = 16) -> dict:
    """The tracer's summary of ``t.detach()``, an op output with ``t``'s kind, memory and
    numbers (``detach`` accepts any tensor kind)."""
    with torchscope.trace(values=values) as tr:
        t.detach()
    assert tr.errors == []
    (op,) = tr.ops
    assert op.name == "Tensor.detach"
    return dict(op.outputs[0])


def check_stats(s: dict, ref: torch.Tensor) -> None:
    ref = ref.double()
    st = s["stats"]
    assert st["min"] == pytest.approx(ref.min().item(), rel=1e-6)
    assert st["max"] == pytest.approx(ref.max().item(), rel=1e-6)
    assert st["mean"] == pytest.approx(ref.mean().item(), rel=1e-5, abs=1e-6)
    if ref.numel() > 1:
        assert st["std"] == pytest.approx(ref.std().item(), rel=1e-4, abs=1e-6)
    assert st["norm"] == pytest.approx(ref.norm().item(), rel=1e-5)
    assert st["nan"] == 0 and st["inf"] == 0


def test_float_stats_match_torch():
    torch.manual_seed(0)
    t = torch.randn(37, 5) * 3 + 1
    s = summarize(t)
    assert (s["shape"], s["dtype"], s["device"]) == ([37, 5], "float32", "cpu")
    check_stats(s, t)
    assert "values" not in s
    # non-contiguous, expanded and float64 inputs read the same numbers
    check_stats(summarize(t.t()), t)
    check_stats(summarize(t[::2, 1:]), t[::2, 1:])
    e = torch.tensor([1.0, -2.0, 4.0]).expand(6, 3)
    check_stats(summarize(e), e.contiguous())
    check_stats(summarize(t.double()), t.double())


def test_nan_and_inf_counts():
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), float("nan"), 2.0] * 5)
    st = summarize(t)["stats"]
    assert (st["nan"], st["inf"]) == (10, 10)
    t = torch.full((100,), 2.0)
    t[7] = float("-inf")
    st = summarize(t)["stats"]
    assert (st["nan"], st["inf"], st["min"]) == (0, 1, -math.inf)


def test_int_and_bool_tensors():
    s = summarize(torch.tensor([3, -1, 4, 1, 5]))
    assert s["dtype"] == "int64" and s["values"] == [3, -1, 4, 1, 5]
    assert all(type(v) is int for v in s["values"])
    check_stats(s, torch.tensor([3.0, -1, 4, 1, 5]))
    s = summarize(torch.tensor([True, False, True, True]))
    assert s["dtype"] == "bool" and s["values"] == [1, 0, 1, 1]
    assert all(type(v) is int for v in s["values"])
    assert s["stats"]["mean"] == 0.75 and (s["stats"]["min"], s["stats"]["max"]) == (0, 1)
    s = summarize(torch.tensor([250, 3], dtype=torch.uint8))
    assert s["values"] == [250, 3] and s["stats"]["max"] == 250


def test_complex_stats_of_abs():
    z = torch.tensor([3 + 4j, 1 - 1j, -2j])
    s = summarize(z)
    assert s["dtype"] == "complex64" and s["stats_of"] == "abs"
    check_stats(s, z.abs())
    assert s["values"] == [3.0, 4.0, 1.0, -1.0, 0.0, -2.0]  # (re, im) pairs
    c = summarize(z.conj())  # a lazily conjugated view reads as its true values
    assert c["values"] == [3.0, -4.0, 1.0, 1.0, 0.0, 2.0]
    assert summarize(z.conj().imag)["values"] == [-4.0, 1.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    t = torch.tensor([1.5, -2.0, 0.25], dtype=dtype)
    s = summarize(t)
    assert s["dtype"] == str(dtype).removeprefix("torch.")
    assert s["values"] == [1.5, -2.0, 0.25]
    check_stats(s, t.float())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sparse_meta_nested_subclass_have_no_stats():
    sparse = summarize(torch.eye(3).to_sparse())
    assert sparse["layout"] == "sparse_coo" and sparse["stats"] is None
    assert sparse["shape"] == [3, 3] and "values" not in sparse
    csr = summarize(torch.eye(3).to_sparse_csr())
    assert csr["layout"] == "sparse_csr" and csr["stats"] is None
    meta = summarize(torch.empty(4, 2, device="meta"))
    assert meta == {"shape": [4, 2], "dtype": "float32", "device": "meta", "stats": None}
    nested = summarize(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    assert nested["nested"] is True and nested["shape"] is None and nested["stats"] is None
    jagged = summarize(
        torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged)
    )
    assert jagged["nested"] is True and jagged["stats"] is None
    sub = summarize(torch.arange(3.0).as_subclass(Tagged))
    assert sub["type"] == f"{__name__}.Tagged" and sub["stats"] is None
    assert sub["shape"] == [3] and "values" not in sub
    param = summarize(torch.nn.Parameter(torch.ones(2)))
    assert "type" not in param and param["values"] == [1.0, 1.0]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_quantized_dequantized():
    q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0, -0.2]), 0.1, 10, torch.quint8)
    s = summarize(q)
    assert s["dtype"] == "quint8" and s["stats_of"] == "dequantized"
    assert s["values"] == pytest.approx([0.5, 1.0, -0.2])
    check_stats(s, q.dequantize())


def test_zero_element_and_zero_dim():
    for t in (torch.empty(0, 3), torch.empty(0, dtype=torch.long)):
        s = summarize(t)
        assert s["shape"] == list(t.shape) and s["stats"] is None and s["values"] == []
    s = summarize(torch.tensor(2.5))
    assert s["shape"] == [] and s["values"] == [2.5]
    assert s["stats"] == {
        "min": 2.5,
        "max": 2.5,
        "mean": 2.5,
        "std": 0.0,
        "norm": 2.5,
        "nan": 0,
        "inf": 0,
    }


@pytest.mark.parametrize("limit", [0, 1, 4, 16])
def test_values_iff_numel_within_limit(limit):
    for n in range(0, 20, 3):
        t = torch.arange(float(n))
        s = summarize(t, values=limit)
        if n <= limit:
            assert s["values"] == t.tolist()
        else:
            assert "values" not in s
    assert ("values" in summarize(torch.tensor(1), values=limit)) == (limit >= 1)


def test_inference_mode_tensors():
    with torch.inference_mode():
        t = torch.ones(3) * 2
    s = summarize(t)
    assert s["values"] == [2.0, 2.0, 2.0]
    with torchscope.trace() as tr, torch.inference_mode():
        (torch.ones(2) + 1).sum()
    assert [o.name for o in tr.ops] == ["torch.ones", "Tensor.add", "Tensor.sum"]
    assert tr.ops[-1].outputs[0]["values"] == [4.0] and tr.errors == []


def test_functorch_transforms_do_not_break_the_batch(capfd):
    """vmap / func.grad wrap tensors: summaries must not call .item() on them or stack their
    reductions later (that used to fail the whole batch, leaving every summary empty)."""
    x = torch.randn(4, 3)
    w = torch.randn(3)
    with torchscope.trace() as tr:
        a = torch.ones(2) * 3
        y = torch.vmap(lambda r: (r * w).sum())(x)
        g = torch.func.grad(lambda ww: (x @ ww).sin().sum())(w)
        b = a + 1
    assert torch.allclose(y, x @ w)
    assert torch.allclose(g, x.t() @ (x @ w).cos())
    assert tr.errors == [] and "torchscope" not in capfd.readouterr().err
    ops = tr.ops
    assert ops[1].outputs[0]["values"] == [3.0, 3.0] and ops[1].outputs[0]["stats"]["max"] == 3
    assert ops[-1].outputs[0]["values"] == b.tolist() and ops[-1].outputs[0]["stats"]["min"] == 4
    # every summary is resolved: stats are either None or complete
    for o in ops:
        for s in o.inputs + o.outputs:
            assert s["stats"] is None or set(s["stats"]) >= {"min", "max", "norm"}


def test_memo_sees_in_place_changes():
    """A tensor summarised, changed in place, then used again shows its new value."""
    with torchscope.trace() as tr:
        a = torch.zeros(3)
        b = a + 1
        a.fill_(5)
        c = a + 1
        a.data.mul_(2)  # through .data: bumps no version counter a shares
        torchscope.step()
        d = a + 1
    assert [o.name for o in tr.ops] == [
        "torch.zeros",
        "Tensor.add",
        "Tensor.fill_",
        "Tensor.add",
        "Tensor.mul_",
        "Tensor.add",
    ]
    assert tr.ops[1].inputs[0]["values"] == [0.0] * 3
    assert tr.ops[3].inputs[0]["values"] == [5.0] * 3
    # A new step forgets old summaries: `a` is an outside input again, whose numbers wait
    # until an output needs judging; a stale memo would still say 5.
    assert tr.ops[5].inputs[0].get("values") in (None, [10.0] * 3)
    assert tr.ops[5].inputs[0]["external"] is True
    assert tr.ops[5].outputs[0]["values"] == [11.0] * 3
    assert (b + c + d).tolist() == [18.0] * 3


def test_outside_inputs_get_stats_when_an_output_goes_bad():
    """Data and weights entering the traced ops carry metadata only, until an op using them
    makes NaN/Inf: then their stats are filled in (so the alert can blame them, or not)."""
    w = torch.tensor([1.0, 2.0, float("nan")])
    x = torch.tensor([1.0, 0.0, 3.0])
    big = torch.full((4,), 3e38)
    with torchscope.trace() as tr:
        x * 2  # fine: nothing to judge
        x / 0.0  # 1/0 = inf, 0/0 = nan: x is finite, the op is the origin
        w * 1.0  # the NaN comes in with w
        big * big  # overflow to inf: the input is finite
    assert tr.errors == []
    assert [o.name for o in tr.ops] == ["Tensor.mul", "Tensor.div", "Tensor.mul", "Tensor.mul"]
    fine, div, by_w, square = tr.ops
    assert all(o.inputs[0]["external"] for o in tr.ops)
    # x's summary is one dict, shared by both of its uses: filled in when div went bad.
    assert fine.inputs[0] is div.inputs[0]
    assert div.inputs[0]["stats"]["max"] == 3.0 and div.inputs[0]["stats"]["nan"] == 0
    assert by_w.inputs[0]["stats"]["nan"] == 1
    assert square.inputs[0]["stats"]["max"] == pytest.approx(3e38)
    assert [(a.where, a.name) for a in tr.alerts] == [
        ("forward", "Tensor.div"),
        ("input", "input 0 of Tensor.mul (from outside the traced ops)"),
        ("forward", "Tensor.mul"),
    ]


def test_outside_inputs_stay_metadata_while_outputs_are_finite():
    w = torch.randn(8, 8)
    with torchscope.trace() as tr:
        w @ w
    (op,) = tr.ops
    assert op.inputs[0]["external"] and op.inputs[0]["stats"] is None
    assert op.inputs[0]["shape"] == [8, 8] and op.outputs[0]["stats"]["nan"] == 0


def test_batched_path_gives_the_same_summaries_as_reading_at_once():
    """CUDA tensors always take the batched path (stack, async copy, resolve later); on a
    machine without a GPU ``host_now=False`` sends host tensors the same way."""
    from torchscope.tracer.armed.summary import SealedBatch, Summarizer

    torch.manual_seed(0)
    tensors = [
        torch.randn(64, 32),
        torch.randn(32, 64).t(),
        torch.tensor([1.0, float("nan"), float("inf"), -2.0]),
        torch.arange(10),
        torch.tensor([True, False, True]),
        1 + 1e-4 * torch.randn(1000, dtype=torch.float64),
        torch.randn(5, dtype=torch.complex64),
        # float16/bfloat16 take float32 accumulators there, with no float32 copy
        torch.randn(64, 32).to(torch.bfloat16),
        (3 * torch.randn(300)).half(),
        torch.tensor([1.0, float("inf"), 2.0] * 10, dtype=torch.bfloat16),
    ]
    now = Summarizer(host_now=True)
    later = Summarizer(host_now=False)
    expected = [now.summarize(t) for t in tensors]
    pending = [later.summarize(t) for t in tensors]
    assert all(s["stats"] == {} for s in pending)  # nothing read yet
    sealed = SealedBatch(later.take_batch())
    assert sealed.ready()
    sealed.resolve()
    for got, want in zip(pending, expected, strict=True):
        assert got.keys() == want.keys()
        for key, value in want["stats"].items():
            # float32 sums in another order (x - min there): equal to float32 precision
            tol = 1e-9 if want["dtype"] == "float64" else 2e-5
            assert got["stats"][key] == pytest.approx(value, nan_ok=True, rel=tol, abs=tol), key
        assert got.get("values") == pytest.approx(want.get("values"), nan_ok=True)


@pytest.mark.parametrize("host_now", [True, False], ids=["read-at-once", "batched"])
def test_float32_stats_hold_precision_where_plain_sums_would_not(host_now):
    """A tiny spread around a big mean (LayerNorm weights near 1) loses every digit of its std
    to float32 cancellation in sum/sum-of-squares, and 1e19-sized values overflow a float32
    sum of squares. Both paths keep the std and norm of a float64 reference."""
    from torchscope.tracer.armed.summary import SealedBatch, Summarizer

    torch.manual_seed(0)
    cases = [
        1 + 1e-5 * torch.randn(4096),
        3e19 + 1e15 * torch.arange(100.0),
    ]
    summarizer = Summarizer(host_now=host_now)
    summaries = [summarizer.summarize(t) for t in cases]
    if not host_now:
        sealed = SealedBatch(summarizer.take_batch())
        sealed.resolve()
    for s, t in zip(summaries, cases, strict=True):
        ref = t.double()
        st = s["stats"]
        assert st["mean"] == pytest.approx(ref.mean().item(), rel=1e-6)
        assert st["std"] == pytest.approx(ref.std().item(), rel=1e-3)
        assert st["norm"] == pytest.approx(ref.norm().item(), rel=1e-6)
        assert (st["nan"], st["inf"]) == (0, 0)


@pytest.mark.parametrize(
    "vals",
    [
        [0.5, -2.0, 3.25, 1.0],
        [7.0],
        [1.0 + 1e-7 * i for i in range(16)],
        [1.0, float("nan"), 2.0],
        [1.0, float("inf"), -3.0],
        [float("inf"), float("-inf"), 0.0],
        [float("-inf"), -1.0],
    ],
    ids=["plain", "one", "near-constant", "nan", "inf", "both-infs", "neg-inf"],
)
def test_small_tensors_read_as_values_give_the_same_stats(vals):
    """Tensors within the value limit get their stats from the values read to the host; the
    numbers and NaN/Inf conventions are those of the reductions used for bigger tensors."""
    t = torch.tensor(vals, dtype=torch.float64)
    from_values = summarize(t, values=16)
    from_reductions = summarize(t, values=0)
    assert from_values["values"] == vals or any(v != v for v in vals)
    assert "values" not in from_reductions
    a, b = from_values["stats"], from_reductions["stats"]
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(b[k], float) and math.isnan(b[k]):
            assert math.isnan(a[k]), k
        else:
            assert a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-12), k


def test_a_transposed_gradient_shares_the_stats_it_was_made_from():
    """TBackward0 sends on a transposed view of what it received: same memory, same numbers,
    so its two sides share one stats dict and no reduction runs twice."""
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    with torchscope.trace() as tr:
        lin(x).sum().backward()
    (node,) = [g for g in tr.grads if g.node == "TBackward0"]
    received, sent = node.grad_outputs[0], node.grad_inputs[0]
    assert (received["shape"], sent["shape"]) == ([8, 4], [4, 8])
    assert sent["stats"] is received["stats"]
    assert sent["stats"]["norm"] == pytest.approx(lin.weight.grad.norm().item(), rel=1e-5)
    assert sent["stats"]["min"] == pytest.approx(lin.weight.grad.min().item(), rel=1e-6)


def _aten_ops(fn) -> list[str]:
    """The aten ops ``fn`` runs (each reduction is one pass over its tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def test_one_pass_per_moment_and_no_counting_pass_on_the_device_path():
    """Batched (CUDA) summaries: aminmax and var_mean, nothing else per tensor; NaN/Inf are
    only counted, at resolve time, for a tensor whose min or max came back non-finite."""
    from torchscope.tracer.armed.summary import SealedBatch, Summarizer

    torch.manual_seed(0)
    t = torch.randn(64, 32)
    summarizer = Summarizer(host_now=False)
    summary: dict = {}

    def summarize() -> None:
        summary.update(summarizer.summarize(t))

    assert sorted(_aten_ops(summarize)) == ["aminmax", "var_mean"]
    sealed = SealedBatch(summarizer.take_batch())
    assert sorted(_aten_ops(sealed.resolve)) == []  # the stack was made when sealing
    ref = t.double()
    assert summary["stats"]["mean"] == pytest.approx(ref.mean().item(), rel=1e-6)
    assert summary["stats"]["norm"] == pytest.approx(ref.norm().item(), rel=1e-6)
    assert (summary["stats"]["nan"], summary["stats"]["inf"]) == (0, 0)
    # float16/bfloat16: float32 sum and norm instead of var_mean, still no counting pass.
    half = _aten_ops(lambda: summarizer.summarize(t.bfloat16()))
    assert "isnan" not in half and "isinf" not in half
    assert [op for op in half if op in ("aminmax", "sum", "linalg_vector_norm")] == [
        "aminmax",
        "sum",
        "linalg_vector_norm",
    ]


def test_read_at_once_path_makes_three_reductions_and_counts_only_when_not_finite():
    """Host tensors: aminmax, sum and dot (var_mean's Welford pass is ~20x slower on the CPU
    than the three together); isnan/isinf only when the sum is not finite."""
    from torchscope.tracer.armed.summary import Summarizer

    torch.manual_seed(0)
    summarizer = Summarizer()
    t = torch.randn(64, 32)
    ops = _aten_ops(lambda: summarizer.summarize(t))
    passes = ("aminmax", "sum", "dot", "var_mean", "isnan", "isinf", "linalg_vector_norm")
    assert [op for op in ops if op in passes] == ["aminmax", "sum", "dot"]
    bad = torch.randn(64, 32)
    bad[3, 4] = float("nan")
    ops = _aten_ops(lambda: summarizer.summarize(bad))
    assert "isnan" in ops and "isinf" in ops


def test_non_finite_counts_on_the_device_path_exact_while_the_tensor_lives():
    from torchscope.tracer.armed.summary import SealedBatch, Summarizer

    summarizer = Summarizer(host_now=False)
    kept = torch.ones(100)
    kept[:3] = float("nan")
    kept[5:7] = float("inf")
    gone = torch.ones(100)
    gone[10] = -float("inf")
    a, b = summarizer.summarize(kept), summarizer.summarize(gone)
    gone.add_(1)  # changed behind the summary: its counts can no longer be made exactly
    sealed = SealedBatch(summarizer.take_batch())
    sealed.resolve()
    assert (a["stats"]["nan"], a["stats"]["inf"]) == (3, 2) and "counts_exact" not in a["stats"]
    # What min and max prove: at least one Inf (a -inf min), marked inexact.
    assert (b["stats"]["nan"], b["stats"]["inf"], b["stats"]["counts_exact"]) == (0, 1, False)
    assert b["stats"]["min"] == -math.inf


def test_small_integer_and_bool_tensors_read_their_values_without_a_reduction():
    from torchscope.tracer.armed.summary import Summarizer

    summarizer = Summarizer()
    ops = _aten_ops(lambda: summarizer.summarize(torch.tensor([[3, -1], [4, 1]])))
    assert not {"aminmax", "sum", "dot", "_to_copy"} & set(ops)
    s = summarizer.summarize(torch.tensor([[3, -1], [4, 1]]))
    assert s["values"] == [3, -1, 4, 1] and s["stats"]["mean"] == 1.75
    assert (s["stats"]["min"], s["stats"]["max"]) == (-1.0, 4.0)


def _summaries(tensors: list[torch.Tensor], host_now: bool) -> list[dict]:
    """Summaries of ``tensors`` on one path, resolved (the batched path waits for its batch)."""
    from torchscope.tracer.armed.summary import SealedBatch, Summarizer

    summarizer = Summarizer(host_now=host_now)
    out = [summarizer.summarize(t) for t in tensors]
    batch = summarizer.take_batch()
    if len(batch):
        SealedBatch(batch).resolve()
    return out


def _reference(t: torch.Tensor) -> tuple[float, float, float]:
    """Mean, std and norm in float64 of ``t / max|t|``, scaled back: exact where float64 has
    a number for them (a float64 norm past its largest value is inf)."""
    ref = t.double()
    scale = ref.abs().max().item()
    unit = ref / scale
    std = unit.std().item() if t.numel() > 1 else 0.0
    return unit.mean().item() * scale, std * scale, unit.norm().item() * scale


@pytest.mark.parametrize("host_now", [True, False], ids=["read-at-once", "batched"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_tensors_at_their_dtypes_max_have_finite_stats(dtype, host_now):
    """bfloat16 near 1e38 overflowed the float32 sum of squares: mean/std/norm came out NaN
    with a NaN count of 0. Finite values give finite stats, near each floating dtype's max,
    on both paths and for small tensors (read as values) too."""
    big = torch.finfo(dtype).max
    spread = (torch.linspace(-1.0, 1.0, 64, dtype=torch.float64) * big).to(dtype)
    tensors = [
        spread,  # both signs, the whole range
        torch.full((64,), big, dtype=dtype),  # all at the max
        (torch.linspace(0.5, 1.0, 100, dtype=torch.float64) * big).to(dtype).view(10, 10).t(),
        spread[:8],  # within the value limit
        spread[-1:],
    ]
    for t, s in zip(tensors, _summaries(tensors, host_now), strict=True):
        st = s["stats"]
        assert (st["nan"], st["inf"]) == (0, 0)
        assert (st["min"], st["max"]) == (t.min().item(), t.max().item())
        for name, want in zip(("mean", "std", "norm"), _reference(t), strict=True):
            got = st[name]
            if math.isinf(want):  # float64's norm of 64 values at its max: no float64 number
                assert dtype is torch.float64 and got == want, (name, got)
                continue
            assert math.isfinite(got), (name, got, t.numel())
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6 * big), (name, t.numel())


def test_overflowing_sums_are_unknown_not_nan_once_the_tensor_is_gone():
    """The batched path finds the overflow when its batch resolves, and recomputes from the
    tensor while it still holds the same numbers; once it is gone, the moments it cannot
    know are None (marked inexact), never NaN: the values were finite."""
    from torchscope.tracer.armed.summary import SealedBatch, Summarizer

    summarizer = Summarizer(host_now=False)
    t = torch.full((64,), 1e38, dtype=torch.bfloat16)
    s = summarizer.summarize(t)
    del t
    SealedBatch(summarizer.take_batch()).resolve()
    st = s["stats"]
    assert (st["nan"], st["inf"], st["moments_exact"]) == (0, 0, False)
    assert st["std"] is None and st["norm"] is None
    assert st["mean"] is None or math.isfinite(st["mean"])
