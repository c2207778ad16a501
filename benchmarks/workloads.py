"""Benchmark workloads: small models and a ready-to-call training step for each.

Each ``make_*`` function returns a ``Workload`` whose ``step()`` runs one full training step
(zero_grad, forward, loss, backward, optimizer.step) on fixed, pre-built inputs, so the only
thing that varies between configurations is what is watching the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Workload:
    name: str
    description: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]


# -- (a) MLP ---------------------------------------------------------------------------------
class MLP(nn.Module):
    """``depth`` x (Linear(width, width), GELU, LayerNorm(width))."""

    def __init__(self, width: int = 256, depth: int = 8) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_mlp(width: int = 256, depth: int = 8, batch: int = 64, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = MLP(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = _mse_step(model, opt, torch.randn(batch, width), torch.randn(batch, width))
    desc = f"MLP {depth}x(Linear {width}, GELU, LayerNorm), batch {batch}, SGD, MSE"
    return Workload("mlp", desc, model, opt, step)


def _mse_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> Callable[[], None]:
    """One plain training step on fixed inputs: zero_grad, MSE loss, backward, update."""

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    return step


def make_amp(width: int = 256, depth: int = 8, batch: int = 64, seed: int = 0) -> Workload:
    """The MLP under fp16 autocast with a GradScaler: mixed precision as large runs train."""
    torch.manual_seed(seed)
    model = MLP(width, depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    desc = (
        f"MLP {depth}x(Linear {width}, GELU, LayerNorm), batch {batch}, fp16 autocast, GradScaler"
    )
    return Workload("amp", desc, model, opt, step)


# -- (b) transformer -------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LN decoder block with hand-written causal attention (q @ k^T, softmax, @ v).

    Hand-written on purpose: ``nn.TransformerEncoderLayer`` in training runs its attention
    through ``F.multi_head_attention_forward``, which a TorchFunctionMode sees as *one* call,
    hiding most of the attention's ops from the tracer. Explicit ops are what HF-style model
    code looks like to torchscope, so they measure its per-op cost honestly.
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 512, d_model: int = 128, n_heads: int = 4, layers: int = 2, seq: int = 64
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1))
        self.register_buffer("positions", torch.arange(seq))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(self.positions[:t])
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln_f(x))


def make_transformer(
    layers: int = 2,
    d_model: int = 128,
    n_heads: int = 4,
    seq: int = 64,
    batch: int = 8,
    vocab: int = 512,
    seed: int = 0,
) -> Workload:
    torch.manual_seed(seed)
    model = TinyLM(vocab, d_model, n_heads, layers, seq)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    idx = torch.randint(0, vocab, (batch, seq))
    target = torch.randint(0, vocab, (batch, seq))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))
        loss.backward()
        opt.step()

    desc = (
        f"Transformer LM {layers} layers, d_model {d_model}, {n_heads} heads, seq {seq}, "
        f"batch {batch}, vocab {vocab}; hand-written causal attention, SGD, cross-entropy"
    )
    return Workload("transformer", desc, model, opt, step)


# -- (c) tiny ops: an RL-sized policy ------------------------------------------------------
def make_policy(hidden: int = 128, seed: int = 0) -> Workload:
    """A CartPole-sized policy net (4 -> hidden -> 2), batch 1, Adam, a REINFORCE-style loss:
    the shape of pytorch/examples' reinforcement_learning scripts, one forward per step.
    Every op is a few microseconds, so the tracer's per-event cost is almost all of a step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    obs = torch.randn(1, 4)
    action = torch.tensor([1])
    ret = torch.tensor([0.5])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logp = F.log_softmax(model(obs), dim=-1).gather(1, action.unsqueeze(1)).squeeze(1)
        loss = -(logp * ret).sum()
        loss.backward()
        opt.step()

    desc = f"policy net 4->{hidden}->2 (ReLU), batch 1, Adam, REINFORCE-style loss"
    return Workload("policy", desc, model, opt, step)


# -- (d) a tiny, fast step: fixed per-step costs ------------------------------------------
def make_tiny(width: int = 16, depth: int = 20, batch: int = 4, seed: int = 0) -> Workload:
    """``depth`` x Linear(width, width), batch 4, SGD, MSE: a step of about half a millisecond
    (RL-sized policies look like this), where what a tool pays per *step* (hooks at the
    optimizer, around ``backward()``, at the step boundary) shows instead of hiding under the
    model's own work."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = _mse_step(model, opt, torch.randn(batch, width), torch.randn(batch, width))
    desc = f"tiny step: {depth}x Linear({width},{width}), batch {batch}, SGD, MSE"
    return Workload("tiny", desc, model, opt, step)


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp": make_mlp,
    "transformer": make_transformer,
    "tiny": make_tiny,
}
# The watch's benchmark adds mixed precision (and, in its own processes, FSDP2).
WATCH_WORKLOADS: dict[str, Callable[[], Workload]] = {**WORKLOADS, "amp": make_amp}
# overhead.py also runs the tiny-op workload (its per-event cost); the other scripts keep to
# the two above.
ALL_WORKLOADS: dict[str, Callable[[], Workload]] = {**WORKLOADS, "policy": make_policy}
