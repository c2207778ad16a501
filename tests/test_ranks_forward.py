"""The ranks' meeting before a forward that communicates, in one process: which module calls
DDP makes communicate, and what a rank that waits for a paused one says."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank (DDP runs in it, communicating with itself)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _step(model, loss_fn) -> None:
    loss_fn(model(torch.randn(8, 4))).backward()


def test_ddp_with_buffers_communicates_in_every_forward_one_without_only_until_rebuilt(
    one_rank_group,
) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchscope.tracer.forward_collectives import ForwardCollectives

    torch.manual_seed(0)
    calls = ForwardCollectives()
    bn = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)))
    plain = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()))
    loss = torch.nn.MSELoss()
    mse = lambda out: loss(out, torch.zeros_like(out))  # noqa: E731
    wrapper = torch.nn.ModuleDict({"model": bn})  # a module that holds DDP inside
    for _ in range(3):
        assert calls.before(bn) == "DistributedDataParallel.forward"
        assert calls.before(wrapper) == "DistributedDataParallel.forward"
        _step(bn, mse)
    # Without buffers: only the first forward after a backward may rebuild the buckets.
    assert calls.before(plain) == "DistributedDataParallel.forward"
    _step(plain, mse)
    _step(plain, mse)
    assert plain._has_rebuilt_buckets
    assert calls.before(plain) is None
    assert calls.before(loss) is None  # the loss module: nothing inside communicates
    with torch.no_grad():  # under no_grad DDP neither syncs buffers nor rebuilds, after one
        bn(torch.randn(8, 4))
        assert calls.before(bn) is None
    bn_off = DDP(torch.nn.BatchNorm1d(4), forward_sync_buffers=False)
    _step(bn_off, mse)
    _step(bn_off, mse)
    assert calls.before(bn_off) is None


def test_a_rank_that_waits_for_a_paused_one_says_at_once_where_it_is_paused() -> None:
    from torchscope.tracer import ranks

    store = dist.HashStore()
    said: list[str] = []
    told = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        told.set()

    gate = ranks.RankGate(store, rank=0, world=2, say=say)
    other = ranks.RankPauses(store, rank=1, world=2)
    assert gate.pauses.paused() == {}  # nobody paused: one key read
    other.tell("torch.randn (before) at train.py:29, step 7")
    seen: dict = {}

    def rank_1() -> None:
        # It goes on once rank 0 has said why it waits (a condition, not a time).
        try:
            if told.wait(60):  # else the test fails below, with the meeting let go
                seen.update(ranks.waiting() or {})
        finally:
            other.tell(None)
            store.add("torchscope/gate/7/0", 1)

    t = threading.Thread(target=rank_1)
    t.start()
    gate.meet(7, "DistributedDataParallel.forward")
    t.join(30)
    assert said[0] == (
        "waiting before DistributedDataParallel.forward at step 7 for the other ranks "
        "(1 of 2 there): rank 1 is paused at torch.randn (before) at train.py:29, step 7"
    )
    assert said[-1] == "all 2 ranks reached DistributedDataParallel.forward at step 7; going on"
    assert seen == {
        "before": "DistributedDataParallel.forward",
        "step": 7,
        "here": 1,
        "of": 2,
        "paused": {"1": "torch.randn (before) at train.py:29, step 7"},
    }
    assert ranks.waiting() is None  # the meeting is over
    assert gate.pauses.paused() == {}
