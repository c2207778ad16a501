"""The classic question: what gradient flows through MulBackward0, DivBackward0, AddBackward0?

    out = x*y + x/y;  torch.autograd.grad(out, x, grad_outputs=ones)

Tensor hooks show one side of a node; module hooks show nothing for raw tensor ops.
torchscope hooks every autograd node and reports both sides: grad_outputs (what arrives at the
node) and grad_inputs (what it sends to each of its inputs; None where no gradient was asked).
"""

import torch

import torchscope


def fmt(summaries):
    return "(" + ", ".join("None" if s is None else _value(s) for s in summaries) + ")"


def _value(s):
    vals = s.get("values")
    if vals is not None and len(vals) == 1:
        return f"{vals[0]:g}"
    return f"shape={s['shape']} mean={s['stats']['mean']:g}"


def main() -> None:
    x = torch.tensor(2.0, requires_grad=True)
    y = torch.tensor(2.0, requires_grad=True)
    with torchscope.trace() as tr:
        out = x * y + x / y
        (gx,) = torch.autograd.grad(out, x, grad_outputs=torch.ones_like(out))

    print(f"x = {x.item():g}, y = {y.item():g}: out = x*y + x/y = {out.item():g}")
    print(f"d out/dx = {gx.item():g}")
    print(f"{'node':<14} {'created by':<14} {'grad_outputs (in)':<18} grad_inputs (out)")
    ops = {op.seq: op for op in tr.ops}
    for g in tr.grads:
        made_by = ops[g.op_seq].name if g.op_seq in ops else "-"
        print(f"{g.node:<14} {made_by:<14} {fmt(g.grad_outputs):<18} {fmt(g.grad_inputs)}")
    (graph,) = tr.graphs
    skipped = [n["name"] for n in graph.nodes if not n["executed"]]
    print("not executed (only d/dx was requested):", ", ".join(skipped) or "none")


if __name__ == "__main__":
    main()
