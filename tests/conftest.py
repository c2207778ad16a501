"""Shared fixtures. torch is imported only for the tracer tests: other tests (protocol, TUI)
must keep running, and proving things, without it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tmux_server import TmuxServer

# Every session a test starts (in this process or in subprocesses, which inherit the
# environment) registers in a private runtime dir, never in the user's real one.
_RUNTIME = tempfile.mkdtemp(prefix="torchscope-test-")
os.chmod(_RUNTIME, 0o700)
os.environ["TORCHSCOPE_RUNTIME_DIR"] = _RUNTIME
# ... and no CURVE keys a user made with `torchscope keys` change what tests see.
os.environ["TORCHSCOPE_KEYS_DIR"] = tempfile.mkdtemp(prefix="torchscope-test-keys-")


@pytest.fixture
def closing():
    """A list the test appends sockets, publishers and clients to; closed after it, last first."""
    items: list = []
    yield items
    for item in reversed(items):
        item.close()


@pytest.fixture
def tmux():
    """A tmux server of the test's own, killed after it."""
    server = TmuxServer()
    yield server
    server.close()


def _is_tracer_test(request: pytest.FixtureRequest) -> bool:
    module = getattr(request.node, "module", None)
    return module is not None and module.__name__.rsplit(".", 1)[-1].startswith("test_tracer_")


@pytest.fixture(autouse=True)
def _tracer_isolation(request: pytest.FixtureRequest):
    """One CPU thread, and after each tracer test: no tracer left running, no mode left on the
    torch function stack, no global module or optimizer hooks left behind."""
    if not _is_tracer_test(request):
        yield
        return
    import torch
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optim_mod

    from torchscope.tracer import agent, backward_calls
    from torchscope.tracer.armed import session

    torch.set_num_threads(1)
    backward_fn = torch.autograd.backward
    fwd_hooks = len(module_mod._global_forward_hooks)
    pre_hooks = len(module_mod._global_forward_pre_hooks)
    opt_hooks = len(optim_mod._global_optimizer_post_hooks)
    opt_pre_hooks = len(optim_mod._global_optimizer_pre_hooks)
    yield
    problems = []
    if agent.current_agent() is not None:
        agent.current_agent().stop()
        problems.append("an agent was left running")
    if torch.autograd.backward is not backward_fn or (
        backward_calls.installed() and backward_fn is torch.autograd.backward
    ):
        problems.append("torch.autograd.backward left wrapped")
    if session.current_tracer() is not None:
        session.current_tracer().stop()
        problems.append("a tracer was left running")
    n = torch._C._len_torch_function_stack()
    if n:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        problems.append(f"{n} torch function mode(s) left on the stack")
    if len(module_mod._global_forward_hooks) != fwd_hooks:
        problems.append("global forward hooks left behind")
    if len(module_mod._global_forward_pre_hooks) != pre_hooks:
        problems.append("global forward pre-hooks left behind")
    if len(optim_mod._global_optimizer_post_hooks) != opt_hooks:
        problems.append("optimizer step hooks left behind")
    if len(optim_mod._global_optimizer_pre_hooks) != opt_pre_hooks:
        problems.append("optimizer step pre-hooks left behind")
    assert not problems, "; ".join(problems)


@pytest.fixture(scope="session")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/seed_grads.py recorded, run from the repository (its source lines resolve)."""
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("seed") / "seed.tsc"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchscope",
            "run",
            "--quiet",
            "--record",
            str(path),
            "examples/seed_grads.py",
        ],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return path
