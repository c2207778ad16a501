"""The tracer traces the thread that started it; other threads run untraced and unharmed."""

from __future__ import annotations

import threading

import models
import torch
import torch.nn.functional as F

import torchscope


def training_loop(
    steps: int, seed: int, out: list, barrier: threading.Barrier | None = None, model=None
):
    model = model if model is not None else models.mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        if barrier is not None and i == 0:
            barrier.wait()
        opt.zero_grad()
        loss = F.mse_loss(model(torch.randn(4, 8, generator=g)), torch.zeros(4, 4))
        loss.backward()
        opt.step()
        out.append(loss.item())


def test_other_threads_are_not_traced(capfd):
    ref: list[float] = []
    training_loop(20, seed=1, out=ref)
    other: list[float] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    # Built here: model init seeds the global RNG, which two threads must not do at once.
    other_model, my_model = models.mlp(1), models.mlp(2)

    def worker():
        try:
            training_loop(20, seed=1, out=other, barrier=barrier, model=other_model)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=worker, name="other-trainer")
    mine: list[float] = []
    with torchscope.trace() as tr:
        t.start()
        training_loop(3, seed=2, out=mine, barrier=barrier, model=my_model)
        t.join()
    assert errors == []
    assert other == ref  # the untraced thread computed exactly what it computes alone
    assert {e.thread for e in tr.ops + tr.grads} == {"MainThread"}
    # the other thread's optimizer steps are not this thread's steps
    assert tr.step_index == 3
    assert [s.step for s in tr.trace.steps] == [0, 1, 2]  # none for the code after the last update
    assert len(tr.graphs) == 3
    acc = [g.param for g in tr.grads if g.node == "AccumulateGrad"]
    assert len(acc) == 3 * 6 and set(acc) == {
        f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")
    }
    modules = {o.module for o in tr.ops}
    assert modules <= {"", "0", "1", "2", "3", "4"}
    assert tr.errors == [] and "torchscope" not in capfd.readouterr().err


def test_trace_started_on_a_worker_thread():
    result = {}

    def worker():
        with torchscope.trace() as tr:
            ready.set()
            a = torch.ones(2) * 2
            go.wait(60)
            b = a + 1
        result["tr"] = tr
        result["b"] = b

    ready, go = threading.Event(), threading.Event()
    t = threading.Thread(target=worker, name="tracer-thread")
    t.start()
    ready.wait(60)
    # meanwhile on the main thread: no mode here, nothing recorded
    assert torch._C._len_torch_function_stack() == 0
    main = (torch.zeros(3) - 1).sum()
    go.set()
    t.join()
    tr = result["tr"]
    assert main.item() == -3.0 and result["b"].tolist() == [3.0, 3.0]
    assert [o.name for o in tr.ops] == ["torch.ones", "Tensor.mul", "Tensor.add"]
    assert {o.thread for o in tr.ops} == {"tracer-thread"}
    assert tr.errors == []
