"""Debugging never changes what the job computes: PyTorch's OpInfo database (every op with
autograd, its CPU samples, float64 and float32), forward and backward, untraced and inside
``torchscope.trace()`` and ``torchscope.trace(aten=True)``: outputs and gradients bit-identical
(NaN equal to NaN), and an error the same error.

The default suite runs every op with one sample of one dtype, and every op of the aten
level's affected set (tracer/armed/aten_formulas.py) with all its samples; the whole sweep
runs with ``TORCHSCOPE_OPINFO_FULL=1`` (see docs/guides/aten.md for its figures)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import torchscope

# OpInfo entries whose backward runs one of the aten level's whole nodes (BACKWARD_NODES), and
# cumprod (its backward's zero handling is the same formula either way: checked whole).
OPINFO_AFFECTED = frozenset(
    "prod masked.prod masked_fill max.reduction_no_dim min.reduction_no_dim median nanmedian "
    "masked.median linalg.eig linalg.eigh linalg.eigvals linalg.eigvalsh linalg.det logdet "
    "cumprod".split()
)
FULL = os.environ.get("TORCHSCOPE_OPINFO_FULL") == "1"
DTYPES = (torch.float64, torch.float32)
# Whose results are not a function of their inputs and the RNG seed: uninitialised memory.
UNINITIALIZED = frozenset(
    "empty empty_like empty_strided new_empty new_empty_strided "
    "nn.functional.dropout nn.functional.dropout2d nn.functional.dropout3d "
    "nn.functional.alpha_dropout nn.functional.feature_alpha_dropout".split()
)


def _op_db() -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return [op for op in op_db if op.supports_autograd]


def op_key(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _dtypes(op: Any) -> list[torch.dtype]:
    try:
        supported = op.supported_backward_dtypes("cpu")
    except Exception:
        return []
    return [d for d in DTYPES if d in supported]


def samples(op: Any, dtype: torch.dtype) -> list:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return list(op.sample_inputs("cpu", dtype, requires_grad=True))
        except Exception:
            return []


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        c = x.detach().clone()
        if x.requires_grad:
            c.requires_grad_(True)
        return c
    return x


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.clone()


def run(op: Any, sample: Any) -> tuple:
    """(outputs, gradients) of one sample, or ("error", type, first line) where it raised."""
    inp, args, kwargs = tree_map(_clone, (sample.input, sample.args, sample.kwargs))
    leaves = [
        t
        for t in tree_flatten((inp, args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    try:
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = op(inp, *args, **kwargs)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            diff = [t for t in outs if t.requires_grad]
            grads: tuple = ()
            if diff and leaves:
                g = torch.Generator().manual_seed(2)
                gos = [torch.randn(t.shape, dtype=t.dtype, generator=g) for t in diff]
                grads = torch.autograd.grad(diff, leaves, gos, allow_unused=True)
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc).split("\n", 1)[0])
    return (
        [_plain(t) for t in outs],
        [None if g is None else _plain(g) for g in grads],
    )


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return (
        torch.equal(nan, b.isnan())
        and torch.equal(torch.signbit(a), torch.signbit(b))
        and bool(((a == b) | nan).all())
    )


def same(a: tuple, b: tuple) -> bool:
    if a[0] == "error" or b[0] == "error":
        return a == b
    (oa, ga), (ob, gb) = a, b
    return (
        len(oa) == len(ob)
        and len(ga) == len(gb)
        and all(map(_same_tensor, oa, ob))
        and all(map(_same_tensor, ga, gb))
    )


def cases(full: bool) -> Iterator[tuple[Any, torch.dtype, list]]:
    """(op, dtype, samples): all of them, or every op once (its first dtype's first sample)
    and the affected ops whole."""
    for op in _op_db():
        dtypes = _dtypes(op)
        whole = full or op_key(op) in OPINFO_AFFECTED
        if not whole:
            dtypes = dtypes[:1]  # (its other dtype's samples are not made: they cost time)
        for dtype in dtypes:
            got = samples(op, dtype)
            yield op, dtype, got if whole else got[:1]


def sweep(full: bool, levels: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Every case untraced, then every case under each level (one trace each): the figures
    and the cases that differ."""
    t0 = time.perf_counter()
    todo = [(op, dtype, got) for op, dtype, got in cases(full) if got]
    ops = {op_key(op) for op, _, _ in todo}
    n = sum(len(got) for _, _, got in todo)
    todo = [case for case in todo if case[0].name not in UNINITIALIZED]

    def run_all() -> list[list[tuple]]:
        return [[run(op, s) for s in got] for op, _, got in todo]

    plain = run_all()
    differ: dict[str, list[str]] = {}
    for name, level in levels.items():
        with level() as tr:
            traced = run_all()
        assert not tr.errors, tr.errors
        differ[name] = [
            f"{op_key(op)} {dtype} sample {i}"
            for (op, dtype, _), a_s, b_s in zip(todo, plain, traced, strict=True)
            for i, (a, b) in enumerate(zip(a_s, b_s, strict=True))
            if not same(a, b)
        ]
    figures = {"ops": len(ops), "samples": n, "seconds": round(time.perf_counter() - t0, 1)}
    return {"figures": figures, "differ": differ}


LEVELS: dict[str, Callable[[], Any]] = {
    "function": lambda: torchscope.trace(keep=False),
    "aten": lambda: torchscope.trace(keep=False, aten=True),
}


@pytest.mark.timeout(900)
def test_opinfo_ops_compute_the_same_traced_at_both_levels():
    result = sweep(FULL, LEVELS)
    print(result["figures"])
    assert result["differ"] == {"function": [], "aten": []}, result


def test_prod_gradient_on_an_underflowing_product_is_the_jobs():
    def grad() -> torch.Tensor:
        x = torch.tensor([1e-300, 1e-300, 1e300], dtype=torch.float64, requires_grad=True)
        (g,) = torch.autograd.grad(x.prod(), x)
        return g

    plain = grad()
    assert plain.tolist() == [0.0, 0.0, 0.0]  # result/input: the product underflowed to 0
    for level in LEVELS.values():
        with level() as tr:
            traced = grad()
        assert tr.errors == []
        assert _same_tensor(plain, traced), traced


def test_linalg_eig_backward_still_raises_on_a_phase_dependent_loss():
    def loss() -> str:
        torch.manual_seed(0)
        a = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
        _, v = torch.linalg.eig(a)
        with pytest.raises(RuntimeError) as raised:
            v.imag.sum().backward()
        return str(raised.value)

    plain = loss()
    assert "specified up to multiplication by e^{i phi}" in plain
    for level in LEVELS.values():
        with level() as tr:
            assert loss() == plain
        assert tr.errors == []
