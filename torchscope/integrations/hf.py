"""``TorchscopeCallback`` for the Hugging Face ``Trainer``:
``Trainer(..., callbacks=[TorchscopeCallback()])``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchscope.integrations._serving import ServedJob

try:
    from transformers import TrainerCallback
except ModuleNotFoundError as missing:
    if missing.name != "transformers":
        raise
    raise ImportError(
        "torchscope.integrations.hf needs Hugging Face transformers: pip install transformers"
    ) from None

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from torchscope.tracer.options import ServeKeywords


class TorchscopeCallback(TrainerCallback):
    """Serves the job when training begins (``torchscope.serve(**options)``: dormant and
    attachable, or armed by ``record=``, ``steps=``, ``watch=``...) and numbers its steps by
    ``state.global_step`` (optimizer updates, as the agent counts them)."""

    def __init__(self, **options: Unpack[ServeKeywords]) -> None:
        super().__init__()
        self.served = ServedJob(dict(options))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The optimizer exists by now, and a resumed run's state has been loaded.
        self.served.start(state.global_step)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.served.follow(state.global_step)


__all__ = ["TorchscopeCallback"]
