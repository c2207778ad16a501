"""Small models shared by the tracer tests: fast on one CPU thread, built from a seed."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp(seed: int = 0, d_in: int = 8, hidden: int = 16, d_out: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, d_out),
    )


class ConvNet(nn.Module):
    """Conv2d / BatchNorm2d / ReLU / MaxPool2d feature extractor and a linear head."""

    def __init__(self, channels: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(channels * 2 * 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def convnet(seed: int = 0) -> ConvNet:
    torch.manual_seed(seed)
    return ConvNet()


class Attention(nn.Module):
    """Causal multi-head self-attention written with matmul and softmax."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads
        q, k, v = self.qkv(x).split(c, dim=-1)
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        # A large finite fill: an -inf fill would (correctly) raise an Inf alert in every step.
        scores = scores.masked_fill(mask, -1e4)
        att = torch.softmax(scores, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class FeedForward(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = FeedForward(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A GPT-style language model: token + position embeddings, blocks, tied output head."""

    def __init__(self, vocab: int = 11, d: int = 8, heads: int = 2, layers: int = 2, ctx: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, two names

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def transformer(seed: int = 0, **kwargs: int) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def lm_batch(seed: int = 0, batch: int = 2, t: int = 6, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, t + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def lm_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- helpers ---------------------------------------------------------------------------------
class OutputCapture(torch.overrides.TorchFunctionMode):
    """Entered inside ``torchscope.trace()``: keeps every traced op's output tensors (in the
    order the tracer records ops) and calls ``retain_grad()`` on those in the graph, so tests
    can read autograd's own gradient for each of them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torchscope.tracer.armed.calls import BACKWARD_CALLS, op_name, result_tensors

        result = func(*args, **(kwargs or {}))
        name = op_name(func)
        if name is not None and func not in BACKWARD_CALLS:
            outs = result_tensors(result)
            if not outs and result is None and args and isinstance(args[0], torch.Tensor):
                outs = [args[0]]
            if outs:
                for t in outs:
                    if t.requires_grad and t.grad_fn is not None:
                        t.retain_grad()
                self.calls.append((name, outs))
        return result


def node_id_of(t: torch.Tensor) -> int | None:
    """The tracer's id of ``t.grad_fn`` (None when the tracer never saw that node)."""
    from torchscope.tracer.armed.backward import NODE_ID

    return None if t.grad_fn is None else t.grad_fn.metadata.get(NODE_ID)


def values(summary: dict | None) -> list | None:
    return None if summary is None else summary.get("values")


def norm(summary: dict) -> float:
    return summary["stats"]["norm"]
