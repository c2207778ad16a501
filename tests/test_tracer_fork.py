"""Forked children (DataLoader workers) inherit the traced thread's state; they must not trace,
nor write into the parent's trace file."""

from __future__ import annotations

import time

import models
import torch
from torch.utils.data import DataLoader, Dataset

import torchscope


class SlowDataset(Dataset):
    """Each item runs torch ops in the worker for a while (past the tracer's 0.5 s flush)
    and reports how many torch-function modes the worker had on its stack."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        t0 = time.monotonic()
        x = torch.zeros(8)
        while time.monotonic() - t0 < 0.2:
            x = torch.randn(8) * 2 + 1
        return x, torch._C._len_torch_function_stack()


def test_dataloader_workers_neither_trace_nor_touch_the_file(tmp_path):
    path = tmp_path / "run.tsc"
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(SlowDataset(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    worker_modes = []
    with torchscope.trace(record=path) as tr:
        for x, modes in loader:
            worker_modes += modes.tolist()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert worker_modes == [0] * 8  # the workers ran their ops untraced
    assert tr.errors == []
    loaded = torchscope.load(path)  # raises if the file were damaged or cut short
    assert [e["seq"] for e in loaded.events] == [e["seq"] for e in tr.events]
    assert {o["name"] for o in loaded.ops} == {o["name"] for o in tr.ops}
    assert not any(o["name"] == "torch.randn" for o in loaded.ops)


def test_dataloader_workers_of_an_agent_job_leave_its_file_and_its_hooks_alone(tmp_path):
    """``torchscope run --record`` (the agent): forked workers drop the agent too."""
    from torch.optim import optimizer as optim_mod

    from torchscope.tracer.agent import Agent, ServeOptions

    class Probe(SlowDataset):
        def __getitem__(self, i: int):
            x, modes = super().__getitem__(i)
            from torchscope.tracer.agent import current_agent

            hooks = len(optim_mod._global_optimizer_pre_hooks)
            return x, modes + (0 if current_agent() is None else 100) + 1000 * hooks

    path = tmp_path / "run.tsc"
    model = models.mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Probe(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    agent = Agent(ServeOptions(record=str(path), live=False, quiet=True)).start()
    seen = []
    try:
        for x, probe in loader:
            seen += probe.tolist()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        agent.stop()
    assert seen == [0] * 8  # no mode, no agent, no optimizer hook in the workers
    loaded = torchscope.load(path)
    assert loaded.ops and not any(o["name"] == "torch.randn" for o in loaded.ops)
