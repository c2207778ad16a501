"""A notebook on a real Jupyter kernel (nbclient + ipykernel, headless), as a user runs one:
``serve()`` in the first cell, training in the next, the watch asked for in a later cell with a
second ``serve()``, then a cell whose step makes a NaN. One kernel for the module: its
start-up (and torch's import in it) is most of the time."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("torch")

NOTEBOOK = "train_notebook.ipynb"

CELLS = [
    # 1: serve the kernel, dormant
    """
    import subprocess, sys
    import torch
    import torchscope
    agent = torchscope.serve()
    """,
    # 2: the model and its loop; `bad` makes a NaN in the model at one step
    """
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 8)
            self.b = torch.nn.Linear(8, 1)
            self.bad = False

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if self.bad:
                h = torch.sqrt(h - 2.0)  # NaN origin
            return self.b(h)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(steps, bad=None):
        for i in range(steps):
            model.bad = i == bad
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    print("LOSS", train(3))
    """,
    # 3: the watch, asked for later; the recording cannot start now
    """
    again = torchscope.serve(watch="nan", on_nan="stop", record="late.tsc")
    print("SAME", again is agent)
    """,
    # 4: a NaN at this cell's first step: stopped before the update
    """
    before = [p.detach().clone() for p in model.parameters()]
    train(2, bad=0)
    """,
    # 5: the kernel lives on; the update was not made; ls names the notebook
    """
    print("UNCHANGED", all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    ls = subprocess.run([sys.executable, "-m", "torchscope", "ls"], capture_output=True,
                        text=True, timeout=60)
    print("LS", ls.returncode, ls.stderr)
    print(ls.stdout)
    import os; print("PID", os.getpid())
    """,
    # 6: a healthy step, then a NaN made by the loop's own code (outside the model)
    """
    train(1)
    loss = torch.sqrt(model(torch.randn(16, 4)).pow(2).mean() - 100.0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    """,
    # 7: the same NaN again: refused again
    """
    loss = torch.sqrt(model(torch.randn(16, 4)).pow(2).mean() - 100.0)
    opt.zero_grad()
    loss.backward()
    opt.step()
    """,
]


@pytest.fixture(scope="module")
def notebook(tmp_path_factory) -> list:
    """The notebook's cells, run once on one kernel, errors kept in their cells."""
    here = tmp_path_factory.mktemp("notebook")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(c).strip()) for c in CELLS]
    path = here / NOTEBOOK
    nbformat.write(nb, path)
    client = nbclient.NotebookClient(
        nbformat.read(path, as_version=4),
        timeout=120,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(here)}},
    )
    # What jupyter_server tells the kernels it starts for a notebook.
    env = {**os.environ, "JPY_SESSION_NAME": str(path), "PYTHONPATH": _pythonpath()}
    client.execute(env=env)
    return client.nb.cells


def _pythonpath() -> str:
    repo = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])])


def origin_line() -> int:
    """The line of the model's NaN in its cell (In [2])."""
    lines = textwrap.dedent(CELLS[1]).strip().splitlines()
    (n,) = [i for i, line in enumerate(lines, 1) if "# NaN origin" in line]
    return n


def text(cell, name: str = "stdout") -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == name)


def errors(cell) -> list:
    return [o for o in cell.outputs if o.get("output_type") == "error"]


def test_a_later_serve_turns_the_watch_on_and_says_what_it_cannot_apply(notebook):
    cell = notebook[2]
    assert not errors(cell), errors(cell)
    assert "SAME True" in text(cell)
    said = text(cell, "stderr").splitlines()
    assert "torchscope: watching every step from step 3 (nan, then stop)" in said
    assert (
        "torchscope: this job is already served; record cannot change while it runs "
        "(they stay as first served)"
    ) in said


def test_the_watch_stops_the_cell_with_one_line_the_kernel_lives_on(notebook):
    cell = notebook[3]
    (error,) = errors(cell)
    assert error["ename"] == "WatchStop"
    assert error["traceback"] == [
        'WatchStop: torchscope stopped before the update of step 3 (on_nan="stop"): '
        "the update was not made"
    ]
    # the origin, named by its cell (In [2]) and line, not by IPython's temporary file
    origin = [line for line in text(cell, "stderr").splitlines() if "first appears" in line]
    assert origin and "ipykernel_" not in origin[0], text(cell, "stderr")
    assert origin[0].startswith(
        "torchscope: NaN first appears at step 3 in aten.sqrt.default inside torch.sqrt "
        f"(forward) in model (Net) at cell 2, line {origin_line()}"
    ), origin
    after = notebook[4]
    assert not errors(after), errors(after)
    assert "UNCHANGED True" in text(after)  # stopped before the update


def test_ls_shows_the_notebook_as_the_kernels_script(notebook):
    out = text(notebook[4])
    pid = re.search(r"PID (\d+)", out).group(1)
    assert "LS 0" in out, out
    (row,) = [line for line in out.splitlines() if line.strip().startswith(pid + " ")]
    assert f" {NOTEBOOK} " in row, out


def test_a_kernel_without_a_notebook_name_is_shown_as_ipykernel(monkeypatch):
    from torchscope.tracer import notebook as kernel

    class Shell:
        kernel = object()
        user_ns: dict = {}

    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setattr(kernel, "shell", Shell)
    assert kernel.kernel_script() == "ipykernel"
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/runs/exp 3.ipynb")
    assert kernel.kernel_script() == "exp 3.ipynb"
    monkeypatch.setattr(kernel, "shell", lambda: None)
    assert kernel.kernel_script() is None  # a plain script: its own file, as before


def test_a_nan_the_loop_code_makes_is_named_at_its_cell_and_line(notebook):
    """Outside the module calls, the watch names the loop code's op: by its cell and line."""
    cell = notebook[5]
    (error,) = errors(cell)
    assert error["ename"] == "WatchStop"
    said = [x for x in text(cell, "stderr").splitlines() if "first appears" in x]
    assert said and "ipykernel_" not in said[0], text(cell, "stderr")
    assert said[0].startswith(
        "torchscope: NaN first appears at step 4 in torch.sqrt (forward) at cell 6, line 2, in "
        "the training loop's code"
    ), said[0]


def test_a_stopped_cell_run_again_is_stopped_again_with_no_shell_command(notebook):
    """A stopped notebook gets no shell command (it has no script), nor a traced window: the
    NaN was named. The same NaN made again in a later cell is refused again."""
    said = text(notebook[5], "stderr")
    assert "torchscope run" not in said and "SCRIPT" not in said
    assert "tracing the next" not in said
    (error,) = errors(notebook[6])
    assert error["ename"] == "WatchStop"
    assert (
        "torchscope: still NaN/Inf at step 4 (first at step 4): stopped before the update"
        in text(notebook[6], "stderr").splitlines()
    )
