"""A torch.compile'd model that returns a dict, as every Hugging Face model returns a
``ModelOutput``: its call is one op like a tensor-returning model's, and the compiled graph's
backward node belongs to it."""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict

import torch

import torchscope
from torchscope.tracer.armed.calls import nested_tensors


class DictNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict:
        logits = self.lin(x)
        return {"loss": logits.pow(2).mean(), "logits": logits}


def step(model, x):
    out = model(x)  # the compiled call
    out["loss"].backward()
    return out["loss"].detach(), model.lin.weight.grad.clone()


def line_of(needle: str) -> int:
    with open(__file__) as f:
        return next(i for i, s in enumerate(f, 1) if needle in s and "line_of" not in s)


def test_a_compiled_model_returning_a_dict_is_one_op_with_its_backward_node():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.compile(DictNet(), backend="aot_eager")
    x = torch.randn(4, 8)
    plain = step(model, x)  # compiled before tracing
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on global module hooks
        with torchscope.trace(eager_check=True) as tr:
            traced = step(model, x)
    assert tr.errors == []
    assert torch.equal(plain[0], traced[0]) and torch.equal(plain[1], traced[1])
    (call,) = [o for o in tr.ops if o.get("compiled")]
    assert call.name == "torch.compile:DictNet" and call.module == ""
    assert call.source == f"{__file__}:{line_of('# the compiled call')}"
    # every tensor of the dict, in its order: the loss, then the logits
    assert [s["shape"] for s in call.outputs] == [[], [4, 1]]
    assert call.inputs[0]["shape"] == [4, 8]
    (node,) = [g for g in tr.grads if g.node == "CompiledFunctionBackward"]
    assert [n["name"] for n in call.nodes] == ["CompiledFunctionBackward"]
    assert (node.op_seq, node.source, node.module) == (call.seq, call.source, "")
    # the eager check compares the dict's tensors too
    (forward,) = [a for a in tr.alerts if a.get("what") == "eager_check" and a.where == "forward"]
    assert "eager agrees" in forward.message


@dataclasses.dataclass
class Output(OrderedDict):
    """Shaped like transformers' ModelOutput: a dataclass and an ordered dict at once."""

    loss: torch.Tensor | None = None
    hidden: tuple | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


@dataclasses.dataclass
class Plain:
    a: torch.Tensor
    rest: list


def test_the_tensors_of_a_model_output_are_found_at_any_depth_each_once():
    a, b, c = torch.zeros(1), torch.ones(2), torch.ones(3)
    assert nested_tensors(Output(loss=a, hidden=(b, c))) == [a, b, c]
    assert nested_tensors({"x": [a, (b, {"y": c})], "again": a, "n": 3, "s": "text"}) == [a, b, c]
    found = nested_tensors(Plain(a=a, rest=[b, None]))
    assert len(found) == 2 and found[0] is a and found[1] is b
    assert nested_tensors(None) == [] and nested_tensors(a) == [a]
