"""Lightning's own loop (automatic optimization: ``optimizer.step(closure)``, 2 micro-batches
per step) with ``TorchscopeCallback``. One process runs, in order, each run named on the
command line (serve() is once per process: the runs after a served one stop its agent):

- ``plain``: no torchscope; saves a checkpoint at OUT/resume.ckpt;
- ``dormant``: the callback, no options;
- ``record``: the callback with record=OUT/record.tsc;
- ``resumed``: the callback with record=OUT/resumed.tsc, resumed from the checkpoint (its
  global step starts at STEPS) for 3 more steps;
- ``legacy``: the callback of the older ``pytorch_lightning`` package, on its own Trainer;
- ``paced``: the callback, dormant, resumed from the checkpoint; it prints ``PACED <pid>``
  when training starts and sleeps 0.05 s a batch while OUT/pace exists (a test attaches
  ``torchscope record PID`` meanwhile), then stops at the next batch once the file is gone.

Each prints ``RESULT {json}``: the losses, and the agent's step and Lightning's global step at
each batch start (seen before the callback's own hook, so before any renumbering it does).

Usage: integration_lightning.py OUT RUN [RUN ...]
"""

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

STEPS = 6  # optimizer steps per run
ACCUMULATE = 2  # micro-batches per step: the backward count is not the step count


def module_class(pl):
    class TinyRegression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 16),
                torch.nn.Tanh(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(16, 1),
            )
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    return TinyRegression


def probe_class(pl):
    class StepProbe(pl.Callback):
        """Placed before TorchscopeCallback: what the agent counted by itself."""

        def __init__(self):
            self.numbering = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            from torchscope.tracer.agent import current_agent

            agent = current_agent()
            clock = agent.clock.step if agent is not None else None
            self.numbering.append([trainer.global_step, clock])

    return StepProbe


def pace_class(pl, pace_file):
    class Pace(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            print(f"PACED {os.getpid()}", flush=True)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if pace_file.exists():
                time.sleep(0.05)
            else:
                trainer.should_stop = True

    return Pace


def fit(pl, callback, max_steps=STEPS, ckpt_path=None, save=None, extra=()):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = module_class(pl)()
    probe = probe_class(pl)()
    trainer = pl.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[probe, *([callback] if callback is not None else []), *extra],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return {
        "losses": [repr(loss.item()) for loss in model.losses],
        "numbering": probe.numbering,
        "global_step": trainer.global_step,
    }


def stop_agent():
    from torchscope.tracer.agent import current_agent

    agent = current_agent()
    if agent is not None:
        agent.stop()


def main(out, runs):
    warnings.filterwarnings("ignore")  # Lightning's advice (num_workers...) is not the test's
    import lightning.pytorch as lp

    from torchscope.integrations.lightning import TorchscopeCallback

    ckpt = out / "resume.ckpt"
    for run in runs:
        if run == "plain":
            result = fit(lp, None, save=ckpt)
        elif run == "dormant":
            result = fit(lp, TorchscopeCallback())
        elif run == "record":
            result = fit(lp, TorchscopeCallback(record=out / "record.tsc"))
        elif run == "resumed":
            callback = TorchscopeCallback(record=out / "resumed.tsc")
            result = fit(lp, callback, max_steps=STEPS + 3, ckpt_path=ckpt)
        elif run == "legacy":
            import pytorch_lightning

            from torchscope.integrations.pytorch_lightning import TorchscopeCallback as Legacy

            result = fit(pytorch_lightning, Legacy())
        elif run == "paced":
            pace = pace_class(lp, out / "pace")()
            result = fit(lp, TorchscopeCallback(), STEPS + 10_000, ckpt_path=ckpt, extra=[pace])
        else:
            raise SystemExit(f"unknown run {run!r}")
        stop_agent()
        print("RESULT " + json.dumps({"run": run, **result}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
