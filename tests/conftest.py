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


def _armed_state() -> dict[str, object]:
    """What arming a job in this process changes and disarming must restore: modes on torch's
    stacks, global module and optimizer hooks, ``torch.autograd.backward``."""
    import torch
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optim_mod

    return {
        "torch function mode(s) on the stack": torch._C._len_torch_function_stack(),
        "torch dispatch mode(s) on the stack": torch._C._len_torch_dispatch_stack(),
        "global forward hooks": len(module_mod._global_forward_hooks),
        "global forward pre-hooks": len(module_mod._global_forward_pre_hooks),
        "global backward hooks": len(module_mod._global_backward_hooks),
        "optimizer step hooks": len(optim_mod._global_optimizer_post_hooks),
        "optimizer step pre-hooks": len(optim_mod._global_optimizer_pre_hooks),
        "torch.autograd.backward": torch.autograd.backward,
    }


@pytest.fixture(autouse=True)
def _tracer_isolation(request: pytest.FixtureRequest):
    """After every test that has torch loaded (any test may arm a job in this process: the
    tracer's, the watch's, stepping, MCP): no agent or tracer left running, no mode left on
    torch's stacks, no global module or optimizer hooks left behind, ``backward`` unwrapped.
    Tracer tests also run on one CPU thread."""
    if _is_tracer_test(request):
        import torch

        torch.set_num_threads(1)
    before = _armed_state() if "torch" in sys.modules else None
    yield
    if "torch" not in sys.modules:
        return
    import torch

    from torchscope.tracer import agent, backward_calls
    from torchscope.tracer.armed import session

    problems = []
    if agent.current_agent() is not None:
        agent.current_agent().stop()
        problems.append("an agent was left running")
    if session.current_tracer() is not None:
        session.current_tracer().stop()
        problems.append("a tracer was left running")
    after = _armed_state()
    if before is None:  # torch came with the test: nothing armed before it was imported
        before = {k: 0 if isinstance(v, int) else v for k, v in after.items()}
    if after["torch.autograd.backward"] is not before["torch.autograd.backward"] or (
        backward_calls.installed()
    ):
        problems.append("torch.autograd.backward left wrapped")
    for what, n in after.items():
        if isinstance(n, int) and n != before[what]:
            problems.append(f"{what}: {before[what]} before the test, {n} after")
    while torch._C._len_torch_function_stack() > before["torch function mode(s) on the stack"]:
        torch._C._pop_torch_function_stack()
    while torch._C._len_torch_dispatch_stack() > before["torch dispatch mode(s) on the stack"]:
        torch._C._pop_torch_dispatch_stack()
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
