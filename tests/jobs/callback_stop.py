"""A framework's Trainer with torchscope's callback under ``watch="nan", on_nan="stop"``, run
as a plain script (no ``torchscope run``): a NaN at step 3 must end it as ``run`` would.

Usage: callback_stop.py hf OUT | callback_stop.py lightning
"""

import sys
import warnings
from pathlib import Path


def hf(out: Path) -> None:
    import integration_hf as job
    from transformers.utils import logging as hf_logging

    from torchscope.integrations.hf import TorchscopeCallback

    hf_logging.set_verbosity_error()
    callback = TorchscopeCallback(watch="nan", on_nan="stop", record=out / "stop.tsc")
    job.train(out, callback, poison_at=job.BAD)


def lightning() -> None:
    import lightning as L
    import lightning_nan as job
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from torchscope.integrations.lightning import TorchscopeCallback

    warnings.filterwarnings("ignore")  # Lightning's advice (workers, logging) is not the test's
    torch.manual_seed(0)
    data = torch.randn(8 * 6, 4, generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        callbacks=[TorchscopeCallback(watch="nan", on_nan="stop")],
    )
    trainer.fit(job.Net(bad=3), DataLoader(TensorDataset(data), batch_size=8))


if __name__ == "__main__":
    if sys.argv[1] == "hf":
        hf(Path(sys.argv[2]))
    else:
        lightning()
    print("the job went on after the stop", flush=True)
