"""Deterministic, realistic-looking trace events without torch: for tests, snapshots,
benchmarks and demos of the UI.

``make_trace(steps=3, layers=4)`` gives what ``torchscope.trace`` would record for a small MLP
trained for a few steps: per step a ``step`` event, forward ops (linear, gelu, layer_norm per
block, then the loss), the backward nodes with both sides of each node, one ``graph`` event,
the optimizer's ops, and, at ``nan_step``, a NaN that first appears in one op (with its alert).
No timestamps, so screens rendered from it are identical run after run.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from typing import Any

from torchscope.protocol.events import Event

SCRIPT = "/work/job/train.py"


def summary(shape: list[int], rng: random.Random, scale: float = 1.0, nan: int = 0) -> dict:
    numel = math.prod(shape) if shape else 1
    mean = rng.uniform(-0.1, 0.1) * scale
    std = abs(rng.gauss(0.5, 0.1)) * scale + 1e-6
    norm = math.sqrt(numel * (mean * mean + std * std))
    out: dict[str, Any] = {
        "shape": list(shape),
        "dtype": "float32",
        "device": "cpu",
        "stats": {
            "min": round(mean - 2.5 * std, 6),
            "max": round(mean + 2.5 * std, 6),
            "mean": round(mean, 6),
            "std": round(std, 6),
            "norm": round(norm, 6) if not nan else math.nan,
            "nan": nan,
            "inf": 0,
        },
    }
    if nan:
        out["stats"]["mean"] = out["stats"]["std"] = math.nan
    if numel <= 16:
        vals = [round(rng.gauss(mean, std), 5) for _ in range(numel)]
        if nan:
            vals[0] = math.nan
        out["values"] = vals
    return out


class _Gen:
    def __init__(self, seed: int, batch: int, width: int) -> None:
        self.rng = random.Random(seed)
        self.seq = 0
        self.node_id = 0
        self.batch = batch
        self.width = width

    def next_seq(self) -> int:
        s = self.seq
        self.seq += 1
        return s

    def next_node(self) -> int:
        self.node_id += 1
        return self.node_id


def _op(
    g: _Gen,
    step: int,
    name: str,
    module: str,
    line: int,
    ins: list,
    outs: list,
    nodes: list[tuple[int, str]],
    function: str = "forward",
) -> Event:
    return Event(
        kind="op",
        seq=g.next_seq(),
        step=step,
        name=name,
        module=module,
        source=f"{SCRIPT}:{line}",
        function=function,
        inputs=ins,
        outputs=outs,
        grad_fn=nodes[0][1] if nodes else None,
        nodes=[{"id": i, "name": n} for i, n in nodes],
        duration_us=12.5,
        thread="MainThread",
    )


def make_step(g: _Gen, step: int, layers: int, nan: bool = False) -> Iterator[Event]:
    """The events of one training step."""
    rng = g.rng
    b, w = g.batch, g.width
    yield Event(kind="step", seq=g.next_seq(), step=step)
    graph_nodes: list[dict] = []
    # Forward: per layer linear -> gelu -> layer_norm. Remember nodes for backward.
    x = summary([b, w], rng)
    chain: list[dict] = []  # per created node: {id, name, op_seq, module, param, line, inputs}
    nan_at = layers // 2 if nan else -1
    poisoned = False
    alerts: list[Event] = []
    params: list[tuple[str, list[int]]] = []
    for i in range(layers):
        mod = f"blocks.{i}"
        lin_id, t_id = g.next_node(), g.next_node()
        out_nan = 12 if (i == nan_at or poisoned) else 0
        y = summary([b, w], rng, nan=out_nan)
        op = _op(
            g,
            step,
            "torch.nn.functional.linear",
            f"{mod}.fc",
            20,
            [x, summary([w, w], rng, 0.1), summary([w], rng, 0.01)],
            [y],
            [(lin_id, "AddmmBackward0"), (t_id, "TBackward0")],
        )
        if i == nan_at and not poisoned:
            alerts.append(
                Event(
                    kind="alert",
                    seq=-1,
                    step=step,
                    what="nan",
                    where="forward",
                    event_seq=op["seq"],
                    name=op["name"],
                    module=op["module"],
                    source=op["source"],
                    node_id=None,
                    message=f"NaN first appears in {op['name']} (forward) at {op['source']}",
                )
            )
            poisoned = True
        yield op
        for a in alerts:
            if a["seq"] == -1:
                a["seq"] = g.next_seq()
                yield a
        chain.append(
            {
                "id": lin_id,
                "name": "AddmmBackward0",
                "op_seq": op["seq"],
                "module": f"{mod}.fc",
                "line": 20,
                "param": None,
                "shape": [b, w],
                "acc": f"{mod}.fc.bias",
            }
        )
        chain.append(
            {
                "id": t_id,
                "name": "TBackward0",
                "op_seq": op["seq"],
                "module": f"{mod}.fc",
                "line": 20,
                "param": None,
                "shape": [w, w],
                "acc": f"{mod}.fc.weight",
                "side": True,
            }
        )
        params += [(f"{mod}.fc.weight", [w, w]), (f"{mod}.fc.bias", [w])]
        gelu_id = g.next_node()
        z = summary([b, w], rng, nan=out_nan)
        op = _op(
            g,
            step,
            "torch.nn.functional.gelu",
            f"{mod}.act",
            21,
            [y],
            [z],
            [(gelu_id, "GeluBackward0")],
        )
        yield op
        chain.append(
            {
                "id": gelu_id,
                "name": "GeluBackward0",
                "op_seq": op["seq"],
                "module": f"{mod}.act",
                "line": 21,
                "param": None,
                "shape": [b, w],
            }
        )
        ln_id = g.next_node()
        x = summary([b, w], rng, nan=out_nan)
        op = _op(
            g,
            step,
            "torch.nn.functional.layer_norm",
            f"{mod}.norm",
            22,
            [z, summary([w], rng), summary([w], rng, 0.01)],
            [x],
            [(ln_id, "NativeLayerNormBackward0")],
        )
        yield op
        chain.append(
            {
                "id": ln_id,
                "name": "NativeLayerNormBackward0",
                "op_seq": op["seq"],
                "module": f"{mod}.norm",
                "line": 22,
                "param": None,
                "shape": [b, w],
            }
        )
    target = summary([b, w], rng)
    loss_id = g.next_node()
    loss_nan = 1 if poisoned else 0
    loss = _op(
        g,
        step,
        "torch.nn.functional.mse_loss",
        "",
        30,
        [x, target],
        [summary([], rng, nan=loss_nan)],
        [(loss_id, "MseLossBackward0")],
        "main",
    )
    yield loss
    chain.append(
        {
            "id": loss_id,
            "name": "MseLossBackward0",
            "op_seq": loss["seq"],
            "module": "",
            "line": 30,
            "param": None,
            "shape": [],
        }
    )
    # Backward: from the loss back; each node gets what arrived and what it sends on.
    acc_ids: dict[str, int] = {}
    trunk = [c for c in chain if not c.get("side")]
    side_of = {c["op_seq"]: c for c in chain if c.get("side")}
    for c in reversed(trunk):
        go = [summary(c["shape"], rng, 0.05, nan=12 if poisoned else 0)]
        if c["name"] == "AddmmBackward0":
            acc_b = acc_ids.setdefault(c["acc"], g.next_node())
            t_node = side_of[c["op_seq"]]
            gi = [
                summary([g.width], rng, 0.05, nan=12 if poisoned else 0),
                # the first layer's input is data: it needs no gradient
                None if c is trunk[0] else go[0],
                summary([g.width, g.width], rng, 0.05, nan=12 if poisoned else 0),
            ]
            yield _grad(g, step, c, go, gi)
            yield _grad(
                g,
                step,
                {
                    "id": acc_b,
                    "name": "AccumulateGrad",
                    "op_seq": None,
                    "module": "",
                    "line": None,
                    "param": c["acc"],
                },
                [gi[0]],
                [],
            )
            yield _grad(g, step, t_node, [gi[2]], [gi[2]])
            acc_w = acc_ids.setdefault(t_node["acc"], g.next_node())
            yield _grad(
                g,
                step,
                {
                    "id": acc_w,
                    "name": "AccumulateGrad",
                    "op_seq": None,
                    "module": "",
                    "line": None,
                    "param": t_node["acc"],
                },
                [gi[2]],
                [],
            )
            nxt = [[acc_b, 0], None, [t_node["id"], 0]]
            graph_nodes.append(_gnode(acc_b, "AccumulateGrad", None, None, c["acc"], []))
            graph_nodes.append(
                _gnode(t_node["id"], "TBackward0", t_node["op_seq"], 20, None, [[acc_w, 0]])
            )
            graph_nodes.append(_gnode(acc_w, "AccumulateGrad", None, None, t_node["acc"], []))
        else:
            gi = [summary(c["shape"] or [b, w], rng, 0.05, nan=12 if poisoned else 0)]
            yield _grad(g, step, c, go, gi)
            nxt = [None]
        graph_nodes.append(_gnode(c["id"], c["name"], c["op_seq"], c["line"], None, nxt))
    # Wire the trunk: each node's first free edge points to the next trunk node.
    ids = [c["id"] for c in reversed(trunk)]
    by_id = {n["id"]: n for n in graph_nodes}
    for a, b_ in itertools.pairwise(ids):
        nxt = by_id[a]["next"]
        slot = 1 if by_id[a]["name"] == "AddmmBackward0" else 0
        nxt[slot] = [b_, 0]
    for n in graph_nodes:
        n["next"] = [e for e in n["next"] if e is not None]
    yield Event(
        kind="graph",
        seq=g.next_seq(),
        step=step,
        backward=1,
        source=f"{SCRIPT}:31",
        call="Tensor.backward",
        roots=[loss_id],
        nodes=graph_nodes,
    )
    for _name, shape in params:
        yield _op(
            g,
            step,
            "Tensor.add_",
            "",
            32,
            [summary(shape, rng), summary(shape, rng, 0.01)],
            [summary(shape, rng)],
            [],
            "main",
        )


def _gnode(
    nid: int, name: str, op_seq: int | None, line: int | None, param: str | None, nxt: list
) -> dict:
    return {
        "id": nid,
        "name": name,
        "op_seq": op_seq,
        "source": f"{SCRIPT}:{line}" if line else None,
        "param": param,
        "next": nxt,
        "executed": True,
    }


def _grad(g: _Gen, step: int, c: dict, go: list, gi: list) -> Event:
    return Event(
        kind="grad",
        seq=g.next_seq(),
        step=step,
        backward=1,
        node=c["name"],
        node_id=c["id"],
        op_seq=c["op_seq"],
        source=f"{SCRIPT}:{c['line']}" if c.get("line") else None,
        param=c.get("param"),
        grad_inputs=gi,
        grad_outputs=go,
        thread="MainThread",
    )


def session_event(g: _Gen | None = None, pid: int = 4242) -> Event:
    return Event(
        kind="session",
        seq=0 if g is None else g.next_seq(),
        step=0,
        protocol=[1, 0],
        pid=pid,
        host="node-1",
        argv=["train.py"],
        script=SCRIPT,
        cwd="/work/job",
        rank=0,
        world_size=1,
        torch="2.13.0",
        python="3.11",
        steps="all",
        values=16,
    )


def iter_trace(
    steps: int = 3,
    layers: int = 4,
    *,
    seed: int = 0,
    nan_step: int | None = None,
    batch: int = 8,
    width: int = 32,
    first_step: int = 0,
) -> Iterator[Event]:
    g = _Gen(seed, batch, width)
    yield session_event(g)
    for step in range(first_step, first_step + steps):
        yield from make_step(g, step, layers, nan=step == nan_step)


def make_trace(steps: int = 3, layers: int = 4, **kwargs: Any) -> list[Event]:
    """A list of events: a session, then ``steps`` steps of a ``layers``-block MLP."""
    return list(iter_trace(steps, layers, **kwargs))


def events_per_step(layers: int) -> int:
    """How many events one step of ``layers`` blocks has."""
    return len(list(make_step(_Gen(0, 2, 4), 0, layers)))
