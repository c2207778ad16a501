"""record=: the trace file holds exactly the events the tracer kept in memory."""

from __future__ import annotations

import math

import models
import torch

import torchscope


def train(record, steps: int = 3, **trace):
    model = models.transformer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with torchscope.trace(record, **trace) as tr:
        for step in range(steps):
            opt.zero_grad()
            models.lm_loss(model, *models.lm_batch(step)).backward()
            opt.step()
        x = torch.tensor([-1.0], requires_grad=True)
        torch.log(x).sum().backward()  # NaN: an alert, and NaN numbers to round-trip
    return tr


def same(a, b) -> bool:
    """Equality where NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_record_round_trip(tmp_path):
    path = tmp_path / "run.tstrace"
    tr = train(path)
    loaded = torchscope.load(path)
    mem = tr.events
    assert [(e.kind, e.seq, e.get("name") or e.get("node")) for e in loaded] == [
        (e.kind, e.seq, e.get("name") or e.get("node")) for e in mem
    ]
    assert all(same(dict(a), dict(b)) for a, b in zip(loaded.events, mem, strict=True))
    assert len(loaded.ops) == len(tr.ops) > 100
    assert len(loaded.grads) == len(tr.grads) > 50
    assert len(loaded.graphs) == len(tr.graphs) == 4
    assert len(loaded.alerts) == len(tr.alerts) == 1
    assert loaded.alerts[0].name == "torch.log"
    assert [s.step for s in loaded.steps] == [0, 1, 2, 3]
    assert loaded.session.steps == "all" and loaded.session["values"] == 16
    assert loaded.grads_of("AccumulateGrad")[0].param == tr.grads_of("AccumulateGrad")[0].param


def test_record_without_keeping_in_memory(tmp_path):
    path = tmp_path / "run.tstrace"
    tr = train(path, steps=3, keep=False)
    assert tr.events == []
    loaded = torchscope.load(path)
    assert {o.step for o in loaded.ops} == {0, 1, 2, 3}
    assert len(loaded.graphs) == 4


def test_record_selected_steps(tmp_path):
    path = tmp_path / "some.tstrace"
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchscope.trace(path, steps="1"):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
    loaded = torchscope.load(path)
    assert {e.step for e in loaded if e.kind != "session"} == {1}
    assert loaded.session.steps == "1"
