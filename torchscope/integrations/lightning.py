"""``TorchscopeCallback`` for Lightning: ``Trainer(callbacks=[TorchscopeCallback()])``.

Built on ``lightning.pytorch.Callback``, or on ``pytorch_lightning.Callback`` where only the
older package is installed (a job with both that uses ``pytorch_lightning`` takes
``torchscope.integrations.pytorch_lightning.TorchscopeCallback``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchscope.integrations._lightning_hooks import LightningHooks

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:
    try:
        from lightning.pytorch import Callback
    except ModuleNotFoundError as missing:
        if missing.name not in ("lightning", "lightning.pytorch"):
            raise  # Lightning is there but broken: its own error says why
        try:
            from pytorch_lightning import Callback
        except ModuleNotFoundError as also_missing:
            if also_missing.name != "pytorch_lightning":
                raise
            raise ImportError(
                "torchscope.integrations.lightning needs Lightning: pip install lightning"
            ) from None


class TorchscopeCallback(LightningHooks, Callback):
    """Serves the job at fit start (``torchscope.serve(**options)``: dormant and attachable,
    or armed by ``record=``, ``steps=``, ``watch=``...) and numbers its steps by
    ``trainer.global_step``."""


__all__ = ["TorchscopeCallback"]
