"""Per-step cost of torchscope next to its peers, all measured in one run.

    python benchmarks/overhead.py [--steps N] [--repeats R] [--quick] [--profile]

Two workloads (see ``benchmarks/models.py``):
  mlp          8 x (Linear 256, GELU, LayerNorm), batch 64, SGD, MSE loss
  transformer  2-layer pre-LN LM, d_model 128, 4 heads, seq 64, batch 8, hand-written
               causal attention, SGD, cross-entropy

Configurations (rows):
  untraced          the plain training step
  traced            ``with torchscope.trace(keep=False)``: every step traced, summaries made
  untraced step     ``torchscope.trace(steps="0", keep=False)``: step 0 traced (not timed),
                    the later, untraced steps are timed (what a dormant tracer costs)
  traced + record   ``torchscope.trace(record=<tmpfile>, keep=False)``
  detect_anomaly    ``torch.autograd.detect_anomaly()``
  profiler          ``torch.profiler.profile(record_shapes=True, with_stack=True)``, CPU
  DebugMode         ``torch.utils._debug_mode.DebugMode()`` (skipped if not importable)

Method: ``torch.set_num_threads(1)``; every configuration first runs one untimed warm-up
block; then R rounds, each running one block of N timed steps per configuration (the order
rotates every round, so drift and "who ran before me" effects hit all rows alike). Each block
enters its context once, times every step on its own, then leaves the context. Per-step times
exclude entering and leaving the context; that cost (the profiler's post-processing at exit,
the trace file's index, ...) is reported in its own column, per block of N steps.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import WORKLOADS, Workload  # noqa: E402

import torchscope  # noqa: E402
from torchscope.tracer.session import current_tracer  # noqa: E402


# -- configurations ------------------------------------------------------------------------
@dataclass
class Config:
    key: str
    label: str
    make: Callable[[Workload], Any]  # -> a context manager for one block
    untimed: int = 0  # steps run inside the block before timing starts


@dataclass
class Result:
    times: list[float] = field(default_factory=list)  # seconds per step
    block_medians: list[float] = field(default_factory=list)  # one per round, in round order
    around: list[float] = field(default_factory=list)  # seconds to enter + leave, per block
    file_bytes: list[int] = field(default_factory=list)  # trace-file size per block


class _RecordTo:
    """``torchscope.trace(record=<fresh temp file>)``; the file is sized, then deleted."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = ""
        self._n = 0

    def __call__(self, w: Workload) -> Any:
        self._n += 1
        self.path = os.path.join(self.directory, f"{w.name}-{self._n}.tsc")
        return torchscope.trace(record=self.path, keep=False)

    def collect(self) -> int:
        size = os.path.getsize(self.path)
        os.remove(self.path)
        return size


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2: kineto prints two ``USDT: profiler_start/stop`` lines per
    profile that no setting turns off. Only the profiler's blocks are wrapped."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _profiler():
    with (
        _quiet_stderr(),
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, with_stack=True
        ),
    ):
        yield


def _debug_mode_factory() -> tuple[Callable[[Workload], Any] | None, str]:
    try:
        from torch.utils._debug_mode import DebugMode
    except Exception as exc:  # older torch
        return None, f"DebugMode not importable ({type(exc).__name__}: {exc})"
    return (lambda w: DebugMode()), ""


def build_configs(tmpdir: str) -> tuple[list[Config], _RecordTo, list[str]]:
    notes: list[str] = []
    record = _RecordTo(tmpdir)
    configs = [
        Config("base", "untraced", lambda w: contextlib.nullcontext()),
        Config("traced", "torchscope traced (summaries)", lambda w: torchscope.trace(keep=False)),
        Config(
            "idle",
            "torchscope, untraced step",
            lambda w: torchscope.trace(steps="0", keep=False),
            untimed=1,
        ),
        Config("record", "torchscope traced + record file", record),
        Config("anomaly", "detect_anomaly()", lambda w: torch.autograd.detect_anomaly()),
        Config("profiler", "profiler(record_shapes, with_stack)", lambda w: _profiler()),
    ]
    dm, why = _debug_mode_factory()
    if dm is not None:
        configs.append(Config("debugmode", "DebugMode()", dm))
    else:
        notes.append(f"DebugMode row skipped: {why}")
    return configs, record, notes


# -- hygiene -------------------------------------------------------------------------------
def assert_clean(where: str) -> None:
    """No tracer, mode or global hook may survive a block into the next one."""
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    problems = []
    if current_tracer() is not None:
        problems.append("a torchscope tracer is still active")
    if torch._C._len_torch_function_stack():
        problems.append("a TorchFunctionMode is still pushed")
    if torch._C._len_torch_dispatch_stack():
        problems.append("a TorchDispatchMode is still pushed")
    if module_mod._global_forward_pre_hooks or module_mod._global_forward_hooks:
        problems.append("global module hooks are still installed")
    if optimizer_mod._global_optimizer_post_hooks:
        problems.append("global optimizer hooks are still installed")
    if torch.is_anomaly_enabled():
        problems.append("anomaly detection is still on")
    if torch.autograd.profiler._is_profiler_enabled:
        problems.append("the profiler is still on")
    if problems:
        raise RuntimeError(f"after {where}: " + "; ".join(problems))


# -- measuring -----------------------------------------------------------------------------
def run_block(w: Workload, cfg: Config, n: int, result: Result | None, record: _RecordTo) -> None:
    gc.collect()
    perf = time.perf_counter
    times = []
    t_enter = perf()
    with cfg.make(w):
        entered = perf()
        for _ in range(cfg.untimed):
            w.step()
        for _ in range(n):
            t0 = perf()
            w.step()
            times.append(perf() - t0)
        t_leave = perf()
    left = perf()
    size = record.collect() if cfg.key == "record" else None
    assert_clean(f"{w.name}/{cfg.key}")
    if result is not None:
        result.times += times
        result.block_medians.append(statistics.median(times))
        result.around.append((entered - t_enter) + (left - t_leave))
        if size is not None:
            result.file_bytes.append(size)


def event_counts(w: Workload) -> dict[str, int]:
    """Events of one traced step (the second, so caches are warm)."""
    with torchscope.trace() as tr:
        w.step()
        w.step()
    assert_clean(f"{w.name}/counts")
    counts = {
        "ops": sum(1 for e in tr.ops if e.step == 1),
        "grads": sum(1 for e in tr.grads if e.step == 1),
        "graph nodes": sum(len(e.nodes) for e in tr.graphs if e.step == 1),
        "events": sum(1 for e in tr.events if e.step == 1),
    }
    return counts


def measure(
    workloads: list[Workload], configs: list[Config], steps: int, repeats: int, warmup: int, record
) -> dict[tuple[str, str], Result]:
    results = {(w.name, c.key): Result() for w in workloads for c in configs}
    for w in workloads:
        for cfg in configs:
            run_block(w, cfg, warmup, None, record)
    for r in range(repeats):
        for w in workloads:
            k = r % len(configs)
            for cfg in configs[k:] + configs[:k]:
                run_block(w, cfg, steps, results[(w.name, cfg.key)], record)
    return results


# -- reporting -----------------------------------------------------------------------------
def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def table(w: Workload, configs: list[Config], results, steps: int) -> list[str]:
    base_res = results[(w.name, "base")]
    base = statistics.median(base_res.times)
    lines = [
        f"| configuration | median ms/step | ratio | paired ratio | min ms | p25-p75 ms "
        f"| enter+exit ms per {steps}-step block | ratio incl. enter+exit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cfg in configs:
        res = results[(w.name, cfg.key)]
        med = statistics.median(res.times)
        q1, _, q3 = statistics.quantiles(res.times, n=4) if len(res.times) > 1 else [med] * 3
        around = statistics.median(res.around)
        amortized = (med + around / steps) / base
        paired = statistics.median(
            m / b for m, b in zip(res.block_medians, base_res.block_medians, strict=True)
        )
        lines.append(
            f"| {cfg.label} | {_ms(med)} | {med / base:.2f}x | {paired:.2f}x "
            f"| {_ms(min(res.times))} "
            f"| {_ms(q1)}-{_ms(q3)} | {_ms(around)} | {amortized:.2f}x |"
        )
    return lines


def report(workloads, configs, results, counts, args, notes, wall: float) -> None:
    print("## torchscope overhead per training step\n")
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} torch thread, {os.cpu_count()} CPUs visible; "
        f"{args.repeats} rounds x {args.steps} timed steps per configuration "
        f"(+{args.warmup}-step warm-up block each), interleaved; whole run {wall:.0f} s.\n"
    )
    for w in workloads:
        c = counts[w.name]
        base = statistics.median(results[(w.name, "base")].times)
        per_event = ""
        if (w.name, "traced") in results:  # --only may leave it out
            traced = statistics.median(results[(w.name, "traced")].times)
            n_events = max(c["ops"] + c["grads"], 1)
            per_event_us = (traced - base) * 1e6 / n_events
            per_event = f" (traced - untraced) / (ops + grads) = {per_event_us:.0f} µs per event."
        print(f"### {w.name}: {w.description}\n")
        print(
            f"Per traced step: {c['ops']} ops, {c['grads']} grads (backward nodes that ran), "
            f"{c['graph nodes']} backward-graph nodes hooked, {c['events']} events in all."
            f"{per_event}\n"
        )
        print("\n".join(table(w, configs, results, args.steps)))
        rec = results[(w.name, "record")].file_bytes if (w.name, "record") in results else None
        if rec:
            per_step = statistics.median(rec) / args.steps
            print(f"\nTrace file: {per_step / 1024:.1f} KiB per traced step.")
        print()
    print("Notes:")
    print(
        "- ratio = median ms/step of the row / median ms/step of `untraced`, same workload, "
        "same run; min and p25-p75 are over every timed step of every round. `paired ratio` is "
        "the median over rounds of (this row's block median / the untraced block median of the "
        "same round): less sensitive to load that comes and goes on a shared machine."
    )
    print(
        "- Per-step times exclude entering and leaving each context. The profiler's "
        "post-processing at exit (building events, stacks) is therefore *excluded* from its "
        "ms/step and shown in the last column instead, as are the tracer's start/stop and the "
        "trace file's final flush and index. `ratio incl. enter+exit` spreads that column over "
        "the block's steps: (median + enter+exit / N) / median(untraced)."
    )
    print(
        "- Objects alive after setup are `gc.freeze()`d and `gc.collect()` runs before each "
        "block (outside the timing), so one row's garbage is not collected on another's time; "
        "rare full-collection pauses inside a block fall outside the median."
    )
    print(
        "- `torchscope, untraced step`: step 0 of each block is traced and not timed; the "
        "timed steps run with no mode and no node hooks (only the optimizer-step hook)."
    )
    for n in notes:
        print(f"- {n}")


# -- profile mode --------------------------------------------------------------------------
def profile_traced_mlp(steps: int = 50, top: int = 25) -> None:
    w = WORKLOADS["mlp"]()
    for _ in range(3):
        w.step()
    prof = cProfile.Profile()
    with torchscope.trace(keep=False):
        for _ in range(3):  # warm the tracer's caches outside the profile
            w.step()
        prof.enable()
        for _ in range(steps):
            w.step()
        prof.disable()
    assert_clean("profile")
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    print(f"## cProfile: traced MLP step, {steps} steps, top {top} by tottime\n")
    print(out.getvalue())
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("cumulative").print_stats(r"torchscope", top)
    print(f"## same profile, torchscope functions by cumulative time (top {top})\n")
    print(out.getvalue())


# -- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="timed steps per block (10; quick 5)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (10; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per config (3; quick 1)")
    p.add_argument("--quick", action="store_true", help="a short run (well under 20 s)")
    p.add_argument(
        "--workload", choices=[*WORKLOADS, "all"], default="all", help="which workload(s)"
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated rows to run (base,traced,idle,record,anomaly,profiler,debugmode)",
    )
    p.add_argument(
        "--profile", action="store_true", help="cProfile the traced MLP step (50 steps) instead"
    )
    args = p.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 10)
    args.repeats = args.repeats or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.steps < 2 or args.repeats < 1:
        p.error("need --steps >= 2 and --repeats >= 1")

    torch.set_num_threads(1)
    if args.profile:
        profile_traced_mlp()
        return 0

    start = time.perf_counter()
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    workloads = [WORKLOADS[n]() for n in names]
    with tempfile.TemporaryDirectory(prefix="torchscope-bench-") as tmpdir:
        configs, record, notes = build_configs(tmpdir)
        if args.only:
            keep = {"base", *args.only.split(",")}
            unknown = keep - {c.key for c in configs}
            if unknown:
                p.error(f"--only: unknown rows {', '.join(sorted(unknown))}")
            configs = [c for c in configs if c.key in keep]
        assert_clean("start")
        # Everything imported and built so far lives for the whole run: park it out of the
        # collector's way, so the gc.collect() before each block stays cheap.
        gc.collect()
        gc.freeze()
        counts = {w.name: event_counts(w) for w in workloads}
        results = measure(workloads, configs, args.steps, args.repeats, args.warmup, record)
    report(workloads, configs, results, counts, args, notes, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
