"""Which module calls run collectives in their forward, before any backward.

DDP's forward may communicate before it computes anything: it broadcasts the module's
buffers (BatchNorm's running statistics) from rank 0 at the start of every forward of a model
that has them (``broadcast_buffers=True``, the default), rebuilds its gradient buckets once
(a broadcast, in the first forward after a backward) and, under ``Join``, all-reduces
whether ranks still run. FSDP (``fully_shard``, and the older wrapper) all-gathers each
module's parameters in its forward. A rank paused just before such a call (at a step
breakpoint, at the step's first op, by a UI's pause between steps) would leave the others
inside that collective, in C++, until the process group's timeout.

So the ranks meet before a top-level module call (one that no other module call encloses)
whose modules include one that communicates in this forward (``before``). What DDP is about
to do is read from its own flags, exactly as its ``_pre_forward`` decides: a model without
buffers meets before its forward only while DDP may still rebuild its buckets (the first
steps); after that, only the meeting before ``backward()`` remains. Every rank runs the same
model the same way, so every rank decides alike.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any


def _kind(module: Any) -> str | None:
    """ "ddp", "fsdp" or None: what kind of communicating wrapper ``module`` is."""
    names = [c.__name__ for c in type(module).__mro__]
    if "DistributedDataParallel" in names:
        return "ddp"
    if "FSDPModule" in names or "FullyShardedDataParallel" in names:
        return "fsdp"
    return None


def ddp_communicates(ddp: Any) -> bool:
    """Whether this forward of ``ddp`` runs a collective before the model's own code (DDP's
    ``_pre_forward``, torch 2.x): a buffer broadcast, a bucket rebuild, a Join all-reduce.
    Unsure (DDP's private flags changed): True."""
    try:
        import torch

        if ddp._use_python_reducer or ddp._delay_all_reduce_all_params:
            return False
        if ddp._check_sync_bufs_pre_fwd():
            return True
        if ddp._join_config.enable:
            return True
        # The reducer rebuilds its buckets once, in the first forward after a backward, when
        # the graph is static or no parameter may go unused (reducer.cpp's rebuild_buckets).
        return bool(
            torch.is_grad_enabled()
            and not ddp._has_rebuilt_buckets
            and (ddp.static_graph or not ddp.find_unused_parameters)
        )
    except Exception:  # DDP's internals moved: meet to be safe
        return True


class ForwardCollectives:
    """The communicating modules (DDP, FSDP) inside each top-level module called so far, found
    once per module (by weak reference: a model dropped is forgotten)."""

    def __init__(self) -> None:
        self._inside: weakref.WeakKeyDictionary[Any, list[tuple[weakref.ref, str]]] = (
            weakref.WeakKeyDictionary()
        )

    def before(self, module: Any) -> str | None:
        """What the ranks meet before when ``module`` is called at the top level ("
        ``DistributedDataParallel.forward``"), or None: nothing in it communicates now."""
        found = self._inside.get(module)
        if found is None:
            found = []
            try:
                for m in module.modules():
                    kind = _kind(m)
                    if kind is not None:
                        found.append((weakref.ref(m), kind))
            except Exception:  # an odd module: not a wrapper we know
                pass
            with contextlib.suppress(TypeError):  # not weakly referable: looked at again
                self._inside[module] = found
        for ref, kind in found:
            m = ref()
            if m is not None and (kind == "fsdp" or ddp_communicates(m)):
                return f"{type(m).__name__}.forward"
        return None
