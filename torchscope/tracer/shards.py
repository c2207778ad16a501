"""DTensors (FSDP2's parameters and gradients) as this rank sees them.

Reading a whole DTensor (``.tolist()``, a norm, a foreach over a mix with plain tensors) runs a
collective or fails; what a rank holds is its local shard. The tracer reads that and says so.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor | None:
    """A DTensor's local tensor (this rank's shard, no copy, no collective); None for any
    other tensor. Never imports DTensor: a job that has not loaded it has none."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(t, dtensor.DTensor):
        return None
    return t._local_tensor


def placements(t: Any) -> str:
    """A DTensor's placements as the user reads them (``Shard(dim=0)``)."""
    return ", ".join(map(repr, t.placements))
