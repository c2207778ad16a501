"""The backward level: hooks on every autograd node reachable from the roots of one backward
call, and the recorder that turns each node's run into a grad event (what it received, what
it sent on), plus one graph event per call.

Nodes are identified through ``node.metadata`` (a dict that lives on the C++ node), never by
holding the Python wrapper: wrappers keep saved tensors alive. Hook closures capture plain data
only, so a graph and its hooks are freed together.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

from torchscope.protocol.breakpoints import AFTER, BEFORE
from torchscope.protocol.events import GRAD, GRAPH, OP, Event
from torchscope.tracer import scaler_calls
from torchscope.tracer.armed.modules import is_fsdp2
from torchscope.tracer.armed.recorder_base import Recorder
from torchscope.tracer.armed.recorder_shared import THIS_THREAD, is_grad_enabled
from torchscope.tracer.armed.source import user_frame
from torchscope.tracer.armed.summary import tensor_meta

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
        self,
        recorder: BackwardRecorder,
        call: str,
        roots: list[torch.Tensor],
        *,
        batched: bool = False,
    ) -> None:
        self.recorder = recorder
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
        recorder = self.recorder
        # Pre-hooks only when someone may pause in this backward: they cost a call per node.
        # A batched backward's gradients cannot be read, so it is not stepped through.
        stepping = recorder.stepping() and not batched
        new_id = recorder.new_node_id
        run_id = recorder.run_id
        on_grad = recorder.on_batched_grad if batched else recorder.on_grad
        param_name = recorder.param_name
        scoped = recorder.aten_scope
        whole = recorder.whole_nodes
        whole_nodes = whole.nodes if whole is not None else ()
        # Node.metadata is a property (a dict); torch's stub declares it a method.
        md: Any
        nmd: Any
        hook: partial[Any]
        infos = self.nodes
        handles = self._handles
        seen: set[int] = set()
        todo = []
        for t in roots:
            if not t.requires_grad:
                continue
            node = get_gradient_edge(t).node
            md = node.metadata
            nid = md.get(NODE_ID)
            if nid is None:
                nid = md[NODE_ID] = new_id()
            self.root_ids.append(nid)
            todo.append(node)
        # This walk runs over every node of every backward call: one metadata fetch per node
        # and per edge, nothing looked up twice.
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
            # AccumulateGrad's .variable (its parameter) is missing from torch's Node stub.
            param = param_name(node.variable) if name == "AccumulateGrad" else None  # type: ignore[attr-defined]
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
            if name == "AccumulateGrad" and not batched:
                # AccumulateGrad: also what it stored in ``param.grad`` (a weak reference to
                # the parameter, so the hook keeps nothing alive).
                # .variable: not in torch's Node stub (see above).
                hook = partial(recorder.on_accumulate, info, weakref.ref(node.variable))  # type: ignore[attr-defined]
            else:
                hook = partial(on_grad, info)
            handles.append(node.register_hook(hook))
            if name in whole_nodes:
                # A formula a dispatch mode changes: run without the aten level's mode, and
                # recorded whole (tracer/armed/aten.py, WholeNodes).
                assert whole is not None
                if scoped is None:
                    handles.append(node.register_prehook(whole.node_enter))
                    handles.append(node.register_hook(whole.node_exit))
                elif scoped.covers(info["module"]):
                    handles.append(node.register_prehook(whole.scoped_enter))
                    handles.append(node.register_hook(whole.node_exit))
            elif scoped is not None and scoped.covers(info["module"]):
                # A scoped aten level: its mode on the stack while this node's kernels run.
                handles.append(node.register_prehook(scoped.node_enter))
                handles.append(node.register_hook(scoped.node_exit))
            if stepping:
                handles.append(node.register_prehook(partial(recorder.on_grad_pre, info)))

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


class BackwardRecorder(Recorder):
    """Grad events of every node a backward call runs, and its graph event."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.param_name = self.modules.param_name
        self.backward_index = 0  # backward calls in this step, numbered from 1
        # Ids of the nodes whose post-hook ran in the backward call in progress (kept only
        # with the aten level on: what runs under such a node is the engine's own summing).
        self.done_nodes: set[int] | None = None
        self.aten_scope: Any = None  # AtenScope: a scoped aten level's hooks on its nodes
        self.whole_nodes: Any = None  # WholeNodes: the aten level's nodes recorded whole
        self.scaled = False  # the backward in progress is of a loss scaler's scaled loss

    def begin_step(self) -> None:
        self.backward_index = 0

    def stepping(self) -> bool:
        """Whether someone may pause in this backward (the pre-hooks are then needed)."""
        return self.stepper is not None and self.stepper.active

    def run_backward(self, call: str, func: Any, args: tuple, kwargs: dict) -> Any:
        state = self.state
        pauser = self.pauser
        was_between = pauser.between_ranks if pauser is not None else False
        if pauser is not None and self.stepping():
            # Before the ranks meet: a rank stopped here holds the others in Python.
            try:
                roots = root_tensors(call, args, kwargs)
                # The loss's summary as the op that made it left it; all or nothing is shown.
                known = [s for s in map(self.summaries.memo.get, roots) if s is not None]
            except Exception:  # odd arguments to backward(): the stub shows no loss
                roots, known = [], []
            stub = self.op_stub(call, known if len(known) == len(roots) else [], user_frame(1))
            call_args = {"args": args, "kwargs": kwargs}  # for expressions at the pause
            pauser.pause_point(BEFORE, stub, {"inputs": roots}, call=call_args)
        if state.gated and call != "torch.autograd.grad":
            state.meet_ranks(f"{call}()")
            if pauser is not None:
                pauser.between_ranks = True
        hooks = None
        self.scaled = False
        try:
            # autograd.grad(..., is_grads_batched=True) runs the backward under vmap: the
            # hooks get batched gradients, whose numbers cannot be read there.
            batched = bool(kwargs.get("is_grads_batched"))
            roots = root_tensors(call, args, kwargs)
            hooks = NodeHooks(self, call, roots, batched=batched)
            # The backward of a loss the scaler scaled: its alerts say an overflow may be the
            # scaler's (it skips the update), not a bug.
            self.scaled = scaler_calls.is_scaled(roots)
            self.backward_index += 1
            if self.done_nodes is not None:
                self.done_nodes.clear()
            frame = user_frame(1)
        except Exception as exc:
            self.report_error("installing backward hooks", exc)
            if hooks is not None:
                hooks.remove()
                hooks = None
        try:
            grads = func(*args, **kwargs)
            if call == "torch.autograd.grad" and hooks is not None:
                self._note_returned_grads(grads)
            return grads
        finally:
            if pauser is not None:
                pauser.between_ranks = was_between
            if self.aten_scope is not None:
                self.aten_scope.unwind()
            if hooks is not None:
                try:
                    hooks.remove()
                    with self.pipeline.lock:
                        self.pipeline.add(
                            Event(
                                kind=GRAPH,
                                seq=self.next_seq(),
                                step=state.step_index,
                                backward=self.backward_index,
                                source=f"{frame[0]}:{frame[1]}" if frame else None,
                                **hooks.graph(),
                            )
                        )
                except Exception as exc:
                    self.report_error("removing backward hooks", exc)
            if call != "torch.autograd.grad" and self.modules.has_ddp:
                try:
                    self._ddp_synced_grads(frame)
                except Exception as exc:
                    self.report_error("recording DDP's synchronised gradients", exc)

    def _note_returned_grads(self, grads: Any) -> None:
        """What ``autograd.grad`` returned: gradients the traced backward made, not values
        from outside, for the ops that read them."""
        try:
            with self.locked:
                for g in grads if isinstance(grads, (tuple, list)) else (grads,):
                    if isinstance(g, torch.Tensor):
                        self.summaries.backward_wrote(g)
        except Exception as exc:
            self.report_error("noting the gradients autograd.grad returned", exc)

    def _ddp_synced_grads(self, frame: tuple | None) -> None:
        """Under DDP the gradient the optimizer uses is the ranks' average, which DDP's C++
        reducer writes into ``p.grad`` by the time ``backward()`` returns; AccumulateGrad
        only ever sees this rank's local one. One event per DDP model and backward call.
        FSDP2 (``fully_shard``) likewise: ``p.grad`` is then this rank's shard of the
        reduce-scattered gradient (a DTensor), recorded as
        ``torch.distributed.fsdp_gradient_sync``."""
        modules = self.modules
        for ddp in modules.ddp_roots():
            fsdp = is_fsdp2(ddp)
            if not fsdp and not ddp.require_backward_grad_sync:
                continue  # inside no_sync(): gradients are accumulated locally, not averaged
            outputs = []
            with self.recording:
                for name, p in ddp.named_parameters():
                    grad = p.grad
                    if grad is None:
                        continue
                    if fsdp and hasattr(grad, "to_local"):
                        grad = grad.to_local()  # this rank's shard, as the optimizer sees it
                    synced = self.summaries.summarizer.summarize(grad)
                    self.summaries.backward_wrote(grad, synced)  # what clipping reads next
                    s = dict(synced)
                    s["param"] = modules.param_name(p) or name
                    outputs.append(s)
                self.pipeline.add(
                    Event(
                        kind=OP,
                        seq=self.next_seq(),
                        step=self.state.step_index,
                        name="torch.distributed."
                        + ("fsdp_gradient_sync" if fsdp else "ddp_gradient_sync"),
                        module=modules.name_of(ddp),
                        source=f"{frame[0]}:{frame[1]}" if frame else None,
                        function=frame[2] if frame else None,
                        inputs=[],
                        outputs=outputs,
                        grad_fn=None,
                        nodes=[],
                        duration_us=0.0,
                        thread=THIS_THREAD.name,
                        group_size=_ddp_world(ddp),
                        backward=self.backward_index,
                    )
                )

    def on_grad(self, info: NodeInfo, grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        """Post-hook of one node: runs on the thread that executes the node. Returns the
        node's grad_inputs when an edit replaced one (at a pause, or ``--edit``)."""
        info["executed"] = True
        if self.done_nodes is not None:
            self.done_nodes.add(info["id"])
        try:
            # Backward hooks run with grad mode off, unless create_graph=True: the lock is
            # then all the summaries need (and costs no Python call).
            with self.recording if is_grad_enabled() else self.locked:
                # Loops, not comprehensions: a comprehension costs a frame, and this runs
                # for every node.
                summary_of = self.summaries.summary_of
                go = []
                for g in grad_outputs:
                    go.append(None if g is None else summary_of(g))
                if len(grad_inputs) == 1 and len(grad_outputs) == 1:
                    # TBackward0 and friends send on a reordered view of what they received.
                    (g,), (received,) = grad_inputs, grad_outputs
                    aliases = [received] if received is not None else ()
                    gi = [None if g is None else summary_of(g, aliases)]
                else:
                    gi = []
                    for g in grad_inputs:
                        gi.append(None if g is None else summary_of(g))
                event = self._grad_event(info, go, gi)
                self.pipeline.add(event)
        except Exception as exc:
            self.report_error("backward hook", exc)
            return None
        stepper = self.stepper
        if stepper is not None and stepper.active:
            tensors = {"grad_outputs": list(grad_outputs), "grad_inputs": list(grad_inputs)}
            pauser = self.pauser
            assert pauser is not None  # built with the stepper
            pauser.pause_point(AFTER, event, tensors)
            return _edited(tensors["grad_inputs"], grad_inputs)
        return None

    def on_accumulate(
        self, info: NodeInfo, param: weakref.ref, grad_inputs: tuple, grad_outputs: tuple
    ) -> None:
        """Post-hook of an AccumulateGrad node: its grad event, and the gradient it stored
        in ``param.grad`` known as made by the traced backward (``clip_grad_norm_`` reads
        it next: a NaN there is the origin's, not one entering from outside)."""
        self.on_grad(info, grad_inputs, grad_outputs)
        try:
            p = param()
            stored = p.grad if p is not None else None
            if stored is None:
                return
            received = grad_outputs[0] if grad_outputs else None
            with self.locked:
                memo = self.summaries.memo
                # The gradient stored as it came (the usual first backward of a step): its
                # summary is the one just made; summed into an older one: numbers unknown.
                same = None
                if received is not None and _same_view(stored, received):
                    same = memo.get(received)
                self.summaries.backward_wrote(stored, same)
        except Exception as exc:
            self.report_error("noting a stored gradient", exc)

    def on_batched_grad(self, info: NodeInfo, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """Post-hook of one node of a batched backward (``is_grads_batched=True``): each
        gradient is a vmap batch, so its shape is recorded and its numbers are not."""
        info["executed"] = True
        try:
            with self.pipeline.lock:
                go = [_batched_summary(g) for g in grad_outputs]
                gi = [_batched_summary(g) for g in grad_inputs]
                self.pipeline.add(self._grad_event(info, go, gi))
        except Exception as exc:
            self.report_error("backward hook", exc)

    def on_grad_pre(self, info: NodeInfo, grad_outputs: tuple) -> tuple | None:
        """Pre-hook of one node (installed only while stepping): before the node runs.
        Returns its grad_outputs when an edit at the pause replaced one."""
        if not self.stepping():
            return None
        try:
            with self.recording:
                summary_of = self.summaries.summary_of
                go = [None if g is None else summary_of(g) for g in grad_outputs]
            stub = self._grad_event(info, go, None)
        except Exception as exc:
            self.report_error("backward pre-hook", exc)
            return None
        tensors = {"grad_outputs": list(grad_outputs)}
        pauser = self.pauser
        assert pauser is not None  # pre-hooks are installed only for a stepper
        pauser.pause_point(BEFORE, stub, tensors)
        return _edited(tensors["grad_outputs"], grad_outputs)

    def _grad_event(self, info: NodeInfo, go: list, gi: list | None) -> Event:
        """A node's grad event; a stub (no seq, no grad_inputs) before the node has run."""
        event = Event(
            kind=GRAD,
            seq=self.next_seq() if gi is not None else None,
            step=self.state.step_index,
            backward=self.backward_index,
            node=info["name"],
            node_id=info["id"],
            op_seq=info["op_seq"],
            module=info["module"],
            source=info["source"],
            param=info["param"],
            grad_inputs=gi,
            grad_outputs=go,
            thread=THIS_THREAD.name,
        )
        if self.scaled:
            event["scaled"] = True
        return event


def _edited(now: list, given: tuple) -> tuple | None:
    """The gradients to hand back to autograd when an edit replaced one of ``given``."""
    if any(a is not b for a, b in zip(now, given, strict=False)):
        return tuple(now)
    return None


def _ddp_world(ddp: Any) -> int | None:
    try:
        return int(ddp.process_group.size())
    except Exception:  # no group on this wrapper: ask the default group
        pass
    try:
        import torch.distributed as dist

        return int(dist.get_world_size())  # FSDP2: its mesh spans the default group here
    except Exception:  # no process group: the size is unknown
        return None


def _same_view(stored: torch.Tensor, received: torch.Tensor) -> bool:
    """Whether the gradient AccumulateGrad stored is the very one it received: one memory,
    one layout (the engine has checked that both have the parameter's shape and dtype)."""
    try:
        return stored.data_ptr() == received.data_ptr() and stored.stride() == received.stride()
    except RuntimeError:  # no storage (sparse, subclasses)
        return False


def _batched_summary(g: torch.Tensor | None) -> dict | None:
    if g is None:
        return None
    summary = tensor_meta(g)  # the shape of one gradient of the batch
    summary["stats"] = None
    summary["stats_of"] = "batched"
    return summary
