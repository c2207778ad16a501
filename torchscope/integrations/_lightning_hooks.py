"""The Lightning callback's hooks, shared by ``lightning.pytorch`` and ``pytorch_lightning``
(two packages with the same API and distinct ``Callback`` classes: a Trainer accepts only its
own package's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchscope.integrations._serving import ServedJob

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from torchscope.tracer.options import ServeKeywords


class LightningHooks:
    """Mixed in before the package's ``Callback``: serve at fit start, number steps by
    ``trainer.global_step`` (optimizer steps taken, every optimizer counted, as the agent
    counts them)."""

    def __init__(self, **options: Unpack[ServeKeywords]) -> None:
        super().__init__()
        self.served = ServedJob(dict(options))

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.served.start(trainer.global_step)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # A checkpoint's loops are restored after on_fit_start: a resumed run's count is
        # known from here.
        self.served.follow(trainer.global_step)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self.served.follow(trainer.global_step)
