"""``TorchscopeCallback`` for the older ``pytorch_lightning`` package name."""

from __future__ import annotations

from torchscope.integrations._lightning_hooks import LightningHooks

try:
    from pytorch_lightning import Callback
except ModuleNotFoundError as missing:
    if missing.name != "pytorch_lightning":
        raise
    raise ImportError(
        "torchscope.integrations.pytorch_lightning needs pytorch_lightning: "
        "pip install pytorch-lightning (or use torchscope.integrations.lightning)"
    ) from None


class TorchscopeCallback(LightningHooks, Callback):
    """Serves the job at fit start (``torchscope.serve(**options)``) and numbers its steps by
    ``trainer.global_step``."""


__all__ = ["TorchscopeCallback"]
