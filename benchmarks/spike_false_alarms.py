"""How often ``--watch nan,spike`` alarms on healthy runs: its false-alarm rate.

    python benchmarks/spike_false_alarms.py [--steps N] [--only NAME ...] [--keep DIR]

Each healthy run is this file run under ``torchscope run --watch nan,spike --record R.tsc``
(``--job NAME``: the run's own training loop), as a user runs a job; the recording's history
says how many steps the watch saw and which it flagged as a spike (the ``spike`` mark of its
history point), and its alerts give the line of each. No run is poisoned: every flag is a
false alarm. The runs:

  gpt2         a 2-layer GPT-2 (transformers' ``GPT2LMHeadModel``) on a noisy repeating
               token pattern, AdamW, its own loop
  mlp          benchmarks/workloads.py's MLP 8x(Linear 256, GELU, LayerNorm), SGD, MSE on
               fixed inputs
  mlp-adam     a residual-free MLP classifier on fresh batches each step (labels from a
               fixed linear teacher), Adam
  transformer  benchmarks/workloads.py's transformer LM (hand-written attention), SGD
  bert         a 2-layer BERT (``BertForSequenceClassification``) trained by HF's ``Trainer``
               (linear decay, gradient accumulation 2) on a synthetic token task
  amp          tests/jobs/amp_nan.py, healthy: fp16 autocast with a GradScaler whose scale
               starts high (its first steps overflow and are skipped, as AMP does)
  lightning    a Lightning ``Trainer`` loop (automatic optimization, 2 micro-batches per
               step), Adam, a small regression

Prints one row per run: steps seen, spikes flagged, the rate, and each flagged step's line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
AMP_JOB = HERE.parent / "tests" / "jobs" / "amp_nan.py"
RUNS = ("gpt2", "mlp", "mlp-adam", "transformer", "bert", "amp", "lightning")


# -- the jobs (run under torchscope run, in their own process) ---------------------------------
def job_gpt2(steps: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    vocab, seq = 64, 32
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=vocab, n_positions=seq)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        start = torch.randint(0, vocab, (8, 1), generator=gen)
        ids = (start + torch.arange(seq)) % vocab
        noise = torch.randint(0, vocab, ids.shape, generator=gen)
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.1, noise, ids)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def _workload(name: str, steps: int) -> None:
    sys.path.insert(0, str(HERE))
    import workloads

    w = {"mlp": workloads.make_mlp, "transformer": workloads.make_transformer}[name]()
    for _ in range(steps):
        w.step()


def job_mlp_adam(steps: int) -> None:
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    for step in range(steps):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 + step))
        loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def job_bert(steps: int) -> None:
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    vocab, length = 128, 16

    class Tokens(torch.utils.data.Dataset):
        """Random token ids; the label: whether token 7 is among them."""

        def __init__(self, n: int) -> None:
            gen = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, vocab, (n, length), generator=gen)
            self.labels = (self.ids < 16).any(1).long()

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    config = BertConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, max_position_embeddings=length, num_labels=2,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bert-"),
        max_steps=steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=5e-4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    Trainer(
        model=BertForSequenceClassification(config), args=args, train_dataset=Tokens(4096)
    ).train()


def job_lightning(steps: int) -> None:
    import warnings

    import lightning as pl
    import torch

    warnings.filterwarnings("ignore")

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    torch.manual_seed(0)
    x = torch.randn(4096, 8)
    y = torch.sin(x[:, :1]) + 0.1 * torch.randn(4096, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    trainer = pl.Trainer(
        max_steps=steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(Regression(), loader)


JOBS = {
    "gpt2": job_gpt2,
    "mlp": lambda steps: _workload("mlp", steps),
    "mlp-adam": job_mlp_adam,
    "transformer": lambda steps: _workload("transformer", steps),
    "bert": job_bert,
    "lightning": job_lightning,
}


# -- the runs ------------------------------------------------------------------------------------
def run_one(name: str, steps: int, out: Path) -> dict:
    """One healthy run under ``torchscope run --watch nan,spike``; what its recording says."""
    import torchscope

    record = out / f"{name}.tsc"
    if name == "amp":
        job = [str(AMP_JOB), "--steps", str(steps)]
    else:
        job = [str(Path(__file__).resolve()), "--job", name, "--steps", str(steps)]
    cmd = [sys.executable, "-m", "torchscope", "run", "--watch", "nan,spike", "--record"]
    cmd += [str(record), *job]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=out, check=False)
    seconds = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name}: exit {res.returncode}\n{res.stderr[-3000:]}")
    trace = torchscope.load(str(record))
    points: dict[int, dict] = {}
    for ev in trace.of_kind("history"):
        for p in ev.get("points") or ():
            points[p["step"]] = p
    spikes = sorted(s for s, p in points.items() if p.get("spike"))
    lines = {a.get("step"): a.get("message") for a in trace.alerts if a.get("what") == "spike"}
    return {
        "run": name,
        "steps": len(points),
        "spikes": spikes,
        "lines": lines,
        "skipped": sum(bool(p.get("skipped")) for p in points.values()),
        "seconds": seconds,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    ap.add_argument("--only", nargs="+", choices=RUNS, help="only these runs")
    ap.add_argument("--keep", metavar="DIR", help="keep the recordings in DIR")
    ap.add_argument("--job", choices=sorted(JOBS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:  # this process is one run's job, under torchscope run
        JOBS[args.job](args.steps)
        return 0
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="spikes-") as tmp:
        out = Path(args.keep or tmp).resolve()
        rows = []
        print(f"healthy runs under torchscope run --watch nan,spike, {args.steps} steps each")
        print(f"{'run':<12} {'steps':>6} {'spikes flagged':>15} {'rate':>8} {'skipped':>8} "
              f"{'seconds':>8}")  # fmt: skip
        for name in args.only or RUNS:
            r = run_one(name, args.steps, out)
            rows.append(r)
            rate = len(r["spikes"]) / r["steps"] if r["steps"] else 0.0
            print(
                f"{name:<12} {r['steps']:>6} {len(r['spikes']):>15} {rate:>8.2%} "
                f"{r['skipped']:>8} {r['seconds']:>8.1f}",
                flush=True,
            )
        total = sum(r["steps"] for r in rows)
        flagged = sum(len(r["spikes"]) for r in rows)
        rate = flagged / total if total else 0.0
        print(f"{'all':<12} {total:>6} {flagged:>15} {rate:>8.2%}")
        print("(skipped: updates a loss scaler skipped, not the watch: it never alarms on them)")
        for r in rows:
            for step in r["spikes"]:
                line = r["lines"].get(step) or "(no alert line)"
                print(f"  {r['run']} step {step}: {line}")
        if os.environ.get("TORCHSCOPE_BENCH_STRICT") and flagged:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
