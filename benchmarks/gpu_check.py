"""The GPU path, checked in one unattended run (under 5 minutes on one CUDA device).

    python benchmarks/gpu_check.py [--layers 12] [--d-model 768] [--seq 512] [--batch 4]

On a CUDA machine, for the MLP (fp32) and a GPT-2-sized transformer (config only, random
weights; fp32, and bf16 under autocast), it:

  (a) times the training step untraced, under ``torchscope.trace(keep=False)`` and under
      ``torchscope.trace()`` (default arguments), interleaved in rounds, each step ended by
      ``torch.cuda.synchronize()``: ms per step, ratios, events per step, µs per event;
  (b) counts host-device syncs per step with ``torch.cuda.set_sync_debug_mode("warn")``
      (every warning captured and attributed to the tracer call it happened in: the op,
      the backward node, the hook installation or the step boundary), untraced and traced;
  (c) checks that traced losses and final parameters are bit-identical to untraced ones
      (two untraced runs are compared first: a baseline that differs from itself is
      reported as such, not blamed on the tracer);
  (d) counts the syncs of the dormant agent's run history (``serve()``: every step's loss,
      copied to the host in batches behind CUDA events: expected 0 per step) and of the watch
      with the history's per-module norms (``serve(watch="nan")``: expected 1 per step, the
      watch's own read, shared by the norms), over more steps than one batch of the history;

and prints one Markdown table. Exit status 1 if the tracer caused any sync (in an op, a
backward node, the hook installation or the step boundary; the places are listed) or changed
a loss, or if the history synced or the watch with module norms synced more than once a step;
0 otherwise. On a machine without CUDA it prints one line saying
it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
# cuBLAS picks the same kernels run after run only with a fixed workspace (bit-identity check).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import MLP, TinyLM  # noqa: E402

import torchscope  # noqa: E402
from torchscope.tracer.armed import session as session_mod  # noqa: E402
from torchscope.tracer.history import HistoryCollector  # noqa: E402
from torchscope.tracer.watch.nan_watch import NanWatch  # noqa: E402

BUDGET_S = 270.0  # leave room under the 5 minutes for start-up and the table


@dataclass
class Job:
    name: str
    precision: str
    build: Callable[[], tuple[torch.nn.Module, Callable[[], torch.Tensor]]]


@dataclass
class Row:
    job: Job
    times: dict[str, list[float]] = field(default_factory=dict)  # config -> seconds per step
    events: int = 0  # ops + grads per traced step
    syncs: dict[str, Counter] = field(default_factory=dict)  # config -> place -> count
    sync_steps: int = 0
    baseline_deterministic: bool | None = None
    identical: bool | None = None
    note: str = ""
    agent_syncs: dict[str, Counter] = field(default_factory=dict)  # (d): config -> place -> n
    agent_steps: int = 0
    agent_missing: dict[str, int] = field(default_factory=dict)  # (d): steps with no loss


# -- workloads ---------------------------------------------------------------------------
def mlp_job(device: torch.device) -> Job:
    def build():
        torch.manual_seed(0)
        model = MLP(256, 8).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(64, 256, device=device)
        y = torch.randn(64, 256, device=device)

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        return model, step

    return Job("MLP 8x(Linear 256, GELU, LayerNorm), batch 64", "fp32", build)


def gpt_job(device: torch.device, args: argparse.Namespace, bf16: bool) -> Job:
    vocab = 50257

    def build():
        torch.manual_seed(0)
        model = TinyLM(vocab, args.d_model, args.heads, args.layers, args.seq).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        g = torch.Generator(device="cpu").manual_seed(1)
        idx = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        target = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        autocast = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
            if bf16
            else contextlib.nullcontext
        )

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with autocast():
                logits = model(idx)
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))
            loss.backward()
            opt.step()
            return loss.detach()

        return model, step

    name = (
        f"GPT-2-sized LM: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
        f"seq {args.seq}, batch {args.batch}, vocab {vocab}"
    )
    return Job(name, "bf16 autocast" if bf16 else "fp32", build)


# -- (a) timing ----------------------------------------------------------------------------
CONFIGS: dict[str, Callable[[], Any]] = {
    "untraced": contextlib.nullcontext,
    "trace(keep=False)": lambda: torchscope.trace(keep=False),
    "trace()": lambda: torchscope.trace(),
}


def time_blocks(step: Callable[[], torch.Tensor], row: Row, rounds: int, steps: int) -> None:
    sync = torch.cuda.synchronize
    keys = list(CONFIGS)
    for key in keys:  # one untimed warm-up block per configuration
        with CONFIGS[key]():
            step()
            sync()
    for r in range(rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            times = row.times.setdefault(key, [])
            with CONFIGS[key]():
                for _ in range(steps):
                    t0 = time.perf_counter()
                    step()
                    sync()
                    times.append(time.perf_counter() - t0)


def count_events(step: Callable[[], torch.Tensor]) -> int:
    with torchscope.trace() as tr:
        step()
        step()
    return sum(1 for e in tr.events if e.get("step") == 1 and e["kind"] in ("op", "grad"))


# -- (b) host syncs ------------------------------------------------------------------------
_where: list[str] = []  # the tracer call running now (innermost last)


def _labelled(method: Callable, label: Callable[..., str]) -> Callable:
    def wrapper(self, *args, **kwargs):
        _where.append(label(*args))
        try:
            return method(self, *args, **kwargs)
        finally:
            _where.pop()

    return wrapper


@contextlib.contextmanager
def sync_watch(found: Counter):
    """Count every sync the CUDA sync debug mode reports, by the tracer call it was made in
    ("user code" outside any). Backward hooks run on autograd's device thread: the label
    stack is shared (one thread runs at a time there: the caller waits in backward)."""
    T = session_mod.Tracer
    patches = {
        (T, "before_op"): lambda name, *a: f"op {name} (before)",
        (T, "after_op"): lambda pending, *a: f"op {pending[0]}",
        (T, "on_grad"): lambda info, *a: f"node {info['name']}",
        (T, "on_grad_pre"): lambda info, *a: f"node {info['name']} (pre-hook)",
        (T, "run_backward"): lambda call, *a: f"{call}: hook installation / graph event",
        (T, "boundary"): lambda step, *a: "step boundary (flush)",
        # (d): the dormant agent's history and the watch's check (with the module norms)
        (HistoryCollector, "backward_begins"): lambda *a: "history: backward()",
        (HistoryCollector, "step_ends"): lambda *a: "history: step boundary",
        (NanWatch, "check"): lambda *a: "watch: check",
    }
    saved = {key: getattr(*key) for key in patches}
    for (cls, name), label in patches.items():
        setattr(cls, name, _labelled(saved[(cls, name)], label))

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            place = _where[-1] if _where else "user code"
            found[f"{place} [{os.path.basename(filename)}:{lineno}]"] += 1

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        for (cls, name), method in saved.items():
            setattr(cls, name, method)


def count_syncs(step: Callable[[], torch.Tensor], row: Row, steps: int) -> None:
    for key, ctx in (("untraced", contextlib.nullcontext), ("traced", torchscope.trace)):
        found: Counter = Counter()
        with ctx():
            step()  # first step: caches, lazy inits
            torch.cuda.synchronize()
            with sync_watch(found):
                for _ in range(steps):
                    step()
            torch.cuda.synchronize()
        row.syncs[key] = found
    row.sync_steps = steps


# -- (d) the dormant agent's history ---------------------------------------------------------
AGENT_CONFIGS: dict[str, dict[str, Any]] = {
    "dormant (history)": {},
    "watch nan + module norms": {"watch": "nan"},
}
# Syncs per step each may make, by the place it is counted in: the history none; the watch its
# one read (the module norms ride in it).
AGENT_ALLOWED = {"dormant (history)": ("history", 0), "watch nan + module norms": ("watch", 1)}


def count_agent_syncs(step: Callable[[], torch.Tensor], row: Row, steps: int = 70) -> None:
    """Over more than two of the history's 32-step batches: its copies start and are read."""
    from torchscope.tracer.agent import Agent, ServeOptions

    for key, options in AGENT_CONFIGS.items():
        found: Counter = Counter()
        agent = Agent(ServeOptions(quiet=True, live=False, **options)).start()
        try:
            for _ in range(2):  # the watch finds the top-level modules on its first step
                step()
            torch.cuda.synchronize()
            with sync_watch(found):
                for _ in range(steps):
                    step()
            torch.cuda.synchronize()
        finally:
            agent.stop()
        points = list(agent.history.history.points)
        row.agent_missing[key] = max(0, steps - len(points)) + sum(p.loss is None for p in points)
        row.agent_syncs[key] = found
    row.agent_steps = steps


def agent_table(rows: list[Row]) -> list[str]:
    lines = [
        "| workload | precision | "
        + " | ".join(
            f"{k}: syncs per step by it (expected {AGENT_ALLOWED[k][1]})" for k in AGENT_CONFIGS
        )
        + " |",
        "|---|---|" + "---:|" * len(AGENT_CONFIGS),
    ]
    for r in rows:
        if not r.agent_syncs:
            continue
        cells = []
        for key in AGENT_CONFIGS:
            prefix, _ = AGENT_ALLOWED[key]
            n = sum(v for p, v in r.agent_syncs[key].items() if p.startswith(prefix))
            cells.append(f"{n / max(r.agent_steps, 1):g}")
        lines.append(f"| {r.job.name} | {r.job.precision} | " + " | ".join(cells) + " |")
    return lines


# -- (c) bit-identical losses --------------------------------------------------------------
def run_losses(job: Job, steps: int, traced: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model, step = job.build()
    with torchscope.trace(keep=False) if traced else contextlib.nullcontext():
        losses = [step() for _ in range(steps)]
    torch.cuda.synchronize()
    return torch.stack(losses).float().cpu(), [p.detach().cpu() for p in model.parameters()]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point and a.element_size() in (2, 4, 8):
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def check_identical(job: Job, row: Row, steps: int) -> None:
    """Deterministic kernels for this check only (the timing runs as users run)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ref_loss, ref_params = run_losses(job, steps, traced=False)
        again_loss, again_params = run_losses(job, steps, traced=False)
        loss, params = run_losses(job, steps, traced=True)
    finally:
        torch.use_deterministic_algorithms(False)
    row.baseline_deterministic = _same_bits(ref_loss, again_loss) and all(
        _same_bits(a, b) for a, b in zip(ref_params, again_params, strict=True)
    )
    row.identical = _same_bits(ref_loss, loss) and all(
        _same_bits(a, b) for a, b in zip(ref_params, params, strict=True)
    )


# -- report ----------------------------------------------------------------------------------
def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| workload | precision | untraced ms/step | trace(keep=False) | trace() | ops + grads "
        "per step | µs per event (keep=False) | host syncs per step, untraced / traced "
        "| losses bit-identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "untraced" not in r.times:
            lines.append(f"| {r.job.name} | {r.job.precision} | {r.note or 'not run'} |||||||")
            continue
        base = _ms(r.times["untraced"])
        ratios = [f"{_ms(r.times[k]) / base:.2f}x" for k in ("trace(keep=False)", "trace()")]
        per_event = (_ms(r.times["trace(keep=False)"]) - base) * 1e3 / max(r.events, 1)
        n = max(r.sync_steps, 1)
        syncs = (
            f"{sum(r.syncs['untraced'].values()) / n:g} / {sum(r.syncs['traced'].values()) / n:g}"
            if r.syncs
            else "-"
        )
        if r.identical is None:
            same = "-"
        elif r.identical:
            same = "yes"
        elif r.baseline_deterministic is False:
            same = "no (untraced runs differ from each other too)"
        else:
            same = "**NO**"
        lines.append(
            f"| {r.job.name} | {r.job.precision} | {base:.2f} | {ratios[0]} | {ratios[1]} "
            f"| {r.events} | {per_event:.0f} | {syncs} | {same} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds (3)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per block (5)")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            f"gpu_check: skipped: no CUDA device (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'})"
        )
        return 0

    start = time.monotonic()
    device = torch.device("cuda")
    jobs = [mlp_job(device), gpt_job(device, args, bf16=False), gpt_job(device, args, bf16=True)]
    rows = [Row(job) for job in jobs]
    failures: list[str] = []
    for row in rows:
        if time.monotonic() - start > BUDGET_S:
            row.note = "skipped: time budget spent"
            continue
        job = row.job
        try:
            _model, step = job.build()
            row.events = count_events(step)
            count_syncs(step, row, steps=2)
            count_agent_syncs(step, row)
            time_blocks(step, row, args.rounds, args.steps)
            del _model, step
            gc.collect()
            torch.cuda.empty_cache()
            check_identical(job, row, steps=3)
        except torch.cuda.OutOfMemoryError as exc:
            row.note = f"out of memory ({str(exc).splitlines()[0][:80]}); try a smaller --batch"
            gc.collect()
            torch.cuda.empty_cache()
            continue
        label = f"{job.name} ({job.precision})"
        for place, n in row.syncs.get("traced", Counter()).items():
            if not place.startswith("user code"):  # an op, a node, hooks, the boundary
                failures.append(f"{label}: {n / row.sync_steps:g} host sync(s) per step in {place}")
        if row.identical is False and row.baseline_deterministic:
            failures.append(f"{label}: traced losses or parameters differ from untraced ones")
        for key, (prefix, allowed) in AGENT_ALLOWED.items():
            found = row.agent_syncs.get(key, Counter())
            n = sum(v for p, v in found.items() if p.startswith(prefix))
            if n > allowed * row.agent_steps:
                places = ", ".join(p for p in found if p.startswith(prefix))
                failures.append(
                    f"{label}: {key}: {n / row.agent_steps:g} host sync(s) per step ({places})"
                )
            if row.agent_missing.get(key):
                failures.append(f"{label}: {key}: {row.agent_missing[key]} steps have no loss")

    gpu = torch.cuda.get_device_name()
    print(f"## torchscope on {gpu}\n")
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); {args.rounds} rounds x "
        f"{args.steps} timed steps per configuration, interleaved, each step ended by "
        f"torch.cuda.synchronize(); median ms/step; host syncs counted over 2 steps with "
        f"torch.cuda.set_sync_debug_mode('warn'); bit-identity over 3 steps from the same "
        f"seed (losses and final parameters); {time.monotonic() - start:.0f} s.\n"
    )
    print("\n".join(table(rows)))
    print(
        "\nThe dormant agent (torchscope.serve()), host syncs per step made by its run history "
        "and by the watch with the history's per-module norms:\n"
    )
    print("\n".join(agent_table(rows)))
    other = [
        f"{r.job.name} ({r.job.precision}): {place}: {n}"
        for r in rows
        for key in ("untraced", "traced")
        for place, n in r.syncs.get(key, Counter()).items()
        if place.startswith("user code")
    ]
    if other:
        print("\nSyncs in the workload's own code (not the tracer's), untraced and traced:")
        for line in other:
            print(f"- {line}")
    if failures:
        print("\nFAILED:")
        for line in failures:
            print(f"- {line}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
