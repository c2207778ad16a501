"""Backward: hooks on every autograd node reachable from the roots of one backward call.

Nodes are identified through ``node.metadata`` (a dict that lives on the C++ node), never by
holding the Python wrapper: wrappers keep saved tensors alive. Hook closures capture plain data
only, so a graph and its hooks are freed together.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import get_gradient_edge

if TYPE_CHECKING:
    from torchscope.tracer.armed.session import Tracer

NODE_ID = "torchscope.id"  # our stable id for the node
NODE_OP = "torchscope.op"  # seq of the forward op that created it
NODE_SRC = "torchscope.src"  # source line of that op
NODE_MOD = "torchscope.mod"  # module path around that op
NODE_RUN = "torchscope.run"  # run_id of the tracer whose op seq NODE_OP is


# What a grad event says about its node, gathered once when the hooks go in, as the graph
# event lists it: id, name, op_seq, source, param, module, next, executed (set by its hook).
# The graph event carries these very dicts (the hooks are gone by then).
NodeInfo = dict[str, Any]


_node_names: dict[type, str] = {}


def node_name(node: Any) -> str:
    """``MulBackward0``, ``AccumulateGrad``: C++ namespaces dropped."""
    # One Python type per node class (C++ nodes and each custom Function's backward).
    cls = type(node)
    name = _node_names.get(cls)
    if name is None:
        name = node.name().rsplit("::", 1)[-1]
        if cls.__name__ == name:  # only cache where the type pins the name down
            _node_names[cls] = name
    return name


def root_tensors(call: str, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a backward call starts from."""
    if call == "Tensor.backward":
        roots: Any = args[0] if args else kwargs.get("self")
    elif call == "torch.autograd.grad":
        roots = args[0] if args else kwargs.get("outputs")
    else:
        roots = args[0] if args else kwargs.get("tensors")
    if isinstance(roots, torch.Tensor):
        return [roots]
    return [t for t in (roots or ()) if isinstance(t, torch.Tensor)]


class NodeHooks:
    """Installs a post-hook on each reachable node for one backward call, then removes them."""

    def __init__(
        self, tracer: Tracer, call: str, roots: list[torch.Tensor], *, batched: bool = False
    ) -> None:
        self.tracer = tracer
        self.call = call
        self.nodes: list[NodeInfo] = []
        self.root_ids: list[int] = []
        self._handles: list[Any] = []
        try:
            self._install(roots, batched)
        except BaseException:
            self.remove()  # no half-hooked graph: its hooks would fire in this and later calls
            raise

    def _install(self, roots: list[torch.Tensor], batched: bool) -> None:
        tracer = self.tracer
        # Pre-hooks only when someone may pause in this backward: they cost a call per node.
        # A batched backward's gradients cannot be read, so it is not stepped through.
        stepping = tracer.stepper is not None and tracer.stepper.active and not batched
        node_id = tracer.node_id
        new_id = tracer._node_ids.__next__
        run_id = tracer.run_id
        on_grad = tracer.on_batched_grad if batched else tracer.on_grad
        param_name = tracer.modules.param_name
        infos = self.nodes
        handles = self._handles
        seen: set[int] = set()
        todo = []
        for t in roots:
            if not t.requires_grad:
                continue
            node = get_gradient_edge(t).node
            self.root_ids.append(node_id(node))
            todo.append(node)
        # This walk runs over every node of every backward call: one metadata fetch per node
        # and per edge (node_id, inlined), nothing looked up twice.
        while todo:
            node = todo.pop()
            md = node.metadata
            nid = md.get(NODE_ID)
            if nid is None:
                nid = md[NODE_ID] = new_id()
            elif nid in seen:
                continue
            seen.add(nid)
            name = node_name(node)
            param = param_name(node.variable) if name == "AccumulateGrad" else None
            # An op seq of an earlier run names no op of this one; the source line still holds.
            op_seq = md.get(NODE_OP) if md.get(NODE_RUN) == run_id else None
            edges: list[list[int] | None] = []
            info = {
                "id": nid,
                "name": name,
                "op_seq": op_seq,
                "source": md.get(NODE_SRC),
                "param": param,
                "module": md.get(NODE_MOD, ""),
                "next": edges,
                "executed": False,
            }
            for nxt, input_nr in node.next_functions:
                if nxt is None:
                    edges.append(None)
                else:
                    nmd = nxt.metadata
                    nxt_id = nmd.get(NODE_ID)
                    if nxt_id is None:
                        nxt_id = nmd[NODE_ID] = new_id()
                    edges.append([nxt_id, input_nr])
                    if nxt_id not in seen:
                        todo.append(nxt)
            infos.append(info)
            # A partial, not a closure: called without a Python frame of its own, and it
            # holds the node's info and a bound method only (see the module docstring).
            handles.append(node.register_hook(partial(on_grad, info)))
            if stepping:
                handles.append(node.register_prehook(partial(tracer.on_grad_pre, info)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def graph(self) -> dict[str, Any]:
        return {
            "call": self.call,
            "roots": self.root_ids,
            "nodes": self.nodes,
        }
