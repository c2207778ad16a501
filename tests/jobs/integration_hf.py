"""The Hugging Face ``Trainer`` on a tiny GPT-2 (built from a config, random token ids) with
``TorchscopeCallback``. One process runs, in order, each run named on the command line
(serve() is once per process: the runs after a served one stop its agent):

- ``plain``: no torchscope;
- ``poisoned``: no torchscope, a NaN made at step BAD (sqrt of a negative, in block 1's MLP);
- ``dormant``: the callback, no options;
- ``record``: the callback with record=OUT/record.tsc;
- ``watch``: the callback with watch="nan", the NaN made at step BAD.

Each prints ``RESULT {json}``: the losses, and the agent's step and the Trainer's global step
at each step's start (seen before the callback's own hook).

Usage: integration_hf.py OUT RUN [RUN ...]
"""

import json
import sys
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

STEPS = 6  # optimizer steps per run
BAD = 3  # the step whose forward makes a NaN (poisoned, watch)


class RandomIds(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=64):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossKeepingTrainer(Trainer):
    """Keeps every micro-batch's loss (outside the model's forward, which a replay re-runs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append((loss[0] if return_outputs else loss).detach().clone())
        return loss


class Poison(TrainerCallback):
    """Block 1's MLP makes a NaN during step ``at`` (the flag holds for the whole step, so the
    watch's replay of it makes the NaN again)."""

    def __init__(self, model, at):
        self.at = at
        self.active = False
        model.transformer.h[1].mlp.register_forward_hook(self.hook)

    def hook(self, module, args, out):
        if self.active:
            return torch.sqrt(out - 10.0)  # NaN origin
        return None

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step == self.at


class StepProbe(TrainerCallback):
    """Placed before TorchscopeCallback: what the agent counted by itself."""

    def __init__(self):
        self.numbering = []

    def on_step_begin(self, args, state, control, **kwargs):
        from torchscope.tracer.agent import current_agent

        agent = current_agent()
        self.numbering.append([state.global_step, agent.clock.step if agent else None])


def train(out, callback=None, poison_at=None):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(out / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,  # the backward count is not the step count
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    probe = StepProbe()
    callbacks = [probe] + ([callback] if callback is not None else [])
    if poison_at is not None:
        callbacks.append(Poison(model, poison_at))
    trainer = LossKeepingTrainer(
        model=model, args=args, train_dataset=RandomIds(), callbacks=callbacks
    )
    trainer.train()
    return {
        "losses": [repr(loss.item()) for loss in trainer.losses],
        "numbering": probe.numbering,
        "global_step": trainer.state.global_step,
    }


def stop_agent():
    from torchscope.tracer.agent import current_agent

    agent = current_agent()
    if agent is not None:
        agent.stop()


def main(out, runs):
    hf_logging.set_verbosity_error()
    from torchscope.integrations.hf import TorchscopeCallback

    for run in runs:
        if run == "plain":
            result = train(out)
        elif run == "poisoned":
            result = train(out, poison_at=BAD)
        elif run == "dormant":
            result = train(out, TorchscopeCallback())
        elif run == "record":
            result = train(out, TorchscopeCallback(record=out / "record.tsc"))
        elif run == "watch":
            result = train(out, TorchscopeCallback(watch="nan"), poison_at=BAD)
        else:
            raise SystemExit(f"unknown run {run!r}")
        stop_agent()
        print("RESULT " + json.dumps({"run": run, **result}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
