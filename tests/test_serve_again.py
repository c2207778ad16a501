"""``serve()`` on a job served already: what changes, what is said (in-process, a real agent)."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

import torchscope  # noqa: E402
from torchscope.tracer.agent import Agent, ServeOptions  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_excepthook(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # serve() chains its own


def step(model, opt, bad: bool = False) -> None:
    loss = model(torch.ones(2, 4)).sum()
    if bad:
        loss = loss * float("nan")
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_a_second_serve_states_the_options_anew(capsys):
    a = torchscope.serve(watch="nan", on_nan="stop")
    try:
        assert a.watch is not None
        capsys.readouterr()
        assert torchscope.serve(values=4) is a  # the watch not asked for: it goes off
        err = capsys.readouterr().err.splitlines()
        assert a.watch is None and a.options.values == 4
        assert err == [
            "torchscope: not watching for NaN from step 0",
            "torchscope: this job is already served; values apply from its next traced step",
        ]
        torchscope.serve(values=4)
        assert capsys.readouterr().err == ""  # the same options again: nothing to say
    finally:
        a.stop()


def test_under_the_command_line_only_what_the_call_sets_applies(capsys):
    a = Agent(ServeOptions(watch="nan", record=None, metadata={"script": "train.py"})).start()
    try:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torchscope.serve()  # the script's own serve(): the command line's watch holds
        assert a.options.watch == "nan" and a.options.on_nan == "continue"
        torchscope.serve(on_nan="stop", steps="5-")
        err = capsys.readouterr().err
        assert a.watch_setting() == ("nan", "stop")
        assert "steps cannot change while it runs" in err
        from torchscope.tracer.watch import WatchStop

        with pytest.raises(WatchStop):
            step(model, opt, bad=True)
    finally:
        a.stop()


def test_a_second_serve_sets_the_budget_of_expressions_asked_at_a_pause():
    import threading
    import time

    from torchscope.tracer.stepper import stepping_commands

    a = torchscope.serve(break_on="op:relu", lease=120, eval_budget=300.0, quiet=True)
    try:
        assert torchscope.serve(break_on="op:relu", lease=120, eval_budget=0.5, quiet=True) is a
        assert a.options.eval_budget == 0.5 and a.stepper.state()["eval_budget_s"] == 0.5
        answers: list[dict] = []

        def ui() -> None:  # at the pause: what a UI's p asks, with no budget of its own
            deadline = time.monotonic() + 120
            try:
                while a.stepper.paused is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                evaluate = stepping_commands(a.stepper, lambda: 0)["evaluate"]
                expr = "sum(1 for _ in iter(int, 1))"
                got = evaluate({"expr": expr, "group": None, "index": None, "count": 16}, None)
                while got.get("pending") and time.monotonic() < deadline:
                    got = evaluate({"poll": got["pending"]}, None)
                answers.append(got)
            finally:
                a.stepper.request_continue()

        helper = threading.Thread(target=ui, daemon=True)
        helper.start()
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        step(model, torch.optim.SGD(model.parameters(), lr=0.1))  # pauses at relu
        helper.join(120)
        (got,) = answers
        assert got.get("interrupted") and "over its budget of 0.5 s" in got["error"], got
    finally:
        a.stop()
