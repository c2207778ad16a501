"""Per-step cost of torchscope next to its peers, all measured in one run.

    python benchmarks/overhead.py [--steps N] [--repeats R] [--quick] [--profile] [--clock cpu]

Three workloads (see ``benchmarks/workloads.py``):
  mlp          8 x (Linear 256, GELU, LayerNorm), batch 64, SGD, MSE loss
  transformer  2-layer pre-LN LM, d_model 128, 4 heads, seq 64, batch 8, hand-written
               causal attention, SGD, cross-entropy
  policy       4 -> 128 -> 2 policy net, batch 1, Adam (tiny ops: the per-event cost)

Headline rows, run as a user runs them: garbage collection on and nothing frozen (the
collector runs inside the timed steps when the job's allocations trigger it):
  as run: untraced                  the plain training step (the headline rows' denominator)
  as run: trace()                   ``with torchscope.trace():`` (default arguments)
  as run: run --steps all           the agent ``torchscope run --steps all`` starts, in-process
                                    (``Agent(ServeOptions(steps="all"))``): live stream on,
                                    no UI attached
  as run: run --steps all, UI reads the same, with one ``SessionClient`` (another process)
                                    subscribed and reading every frame
  as run: run --steps all --no-live the same agent without the live stream
  as run: run --record F --steps all  live on, no UI, recording to a file

Controlled rows (``gc.freeze()`` of everything alive and ``gc.collect()`` before each block,
outside the timing, so the collector's work is not counted; the tracer's fixed costs only):
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
``--clock cpu`` times steps by this thread's CPU time instead of the wall clock (a host
shared with other jobs: time spent descheduled is left out).
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
import subprocess
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
from workloads import ALL_WORKLOADS as WORKLOADS  # noqa: E402
from workloads import Workload  # noqa: E402

import torchscope  # noqa: E402
from torchscope.tracer import publisher as publisher_mod  # noqa: E402
from torchscope.tracer.agent import Agent, ServeOptions, current_agent  # noqa: E402
from torchscope.tracer.armed.session import current_tracer  # noqa: E402


# -- configurations ------------------------------------------------------------------------
@dataclass
class Config:
    key: str
    label: str
    make: Callable[[Workload], Any]  # -> a context manager for one block
    untimed: int = 0  # steps run inside the block before timing starts
    # Controlled rows: gc.freeze() + gc.collect() before the block, outside the timing.
    # Headline rows (False): the collector as in the user's job, nothing frozen.
    controlled: bool = True
    base: str = "base"  # the row this one's ratios divide by
    last: dict[str, int] | None = None  # counters of its last block (agent rows fill it)


@dataclass
class Result:
    times: list[float] = field(default_factory=list)  # seconds per step
    block_medians: list[float] = field(default_factory=list)  # one per round, in round order
    around: list[float] = field(default_factory=list)  # seconds to enter + leave, per block
    file_bytes: list[int] = field(default_factory=list)  # trace-file size per block
    counters: list[dict[str, int]] = field(default_factory=list)  # per block (agent rows)
    full_gcs: int = 0  # full (oldest-generation) collections during the timed steps


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


# The UI: another process, connected and subscribed as ``torchscope tui PID`` is, reading every
# frame until the job says bye; it prints how many events it received.
READER = """\
import sys
from torchscope.protocol.client import SessionClient
c = SessionClient()
c.connect(sys.argv[1], timeout=20)
print("subscribed" if c.subscribed else "not subscribed", flush=True)
n = 0
while not c.ended and c.alive:
    n += len(c.recv_events(100))
print(n, flush=True)
"""

# Frames of events the publisher builds, counted at its one call of the codec for them (a
# counter per frame, on the publisher's thread; the events themselves are encoded once each
# by the sink, on the training thread).
PACKED = [0]
_pack_frame = publisher_mod.pack_with_packed


def _counting_pack(msg: Any, key: str, items: list[bytes]) -> bytes:
    PACKED[0] += 1
    return _pack_frame(msg, key, items)


publisher_mod.pack_with_packed = _counting_pack


@contextlib.contextmanager
def agent_block(
    w: Workload, *, ui: bool = False, live: bool = True, record: str | None = None, out=None
):
    """What ``torchscope run --steps all [--record F] [--no-live]`` starts around the script,
    started in-process, around one block; ``ui``: one reader attached before the timed steps.
    ``out`` (a dict) receives the block's counters after the agent stopped."""
    packed0 = PACKED[0]
    agent = Agent(ServeOptions(steps="all", live=live, record=record, quiet=True)).start()
    reader = None
    try:
        if ui:
            reader = subprocess.Popen(
                [sys.executable, "-c", READER, str(os.getpid())],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert reader.stdout is not None
            line = reader.stdout.readline().strip()
            if line != "subscribed" or not agent.publisher.subscribed:
                deadline = time.monotonic() + 5
                while not agent.publisher.subscribed and time.monotonic() < deadline:
                    time.sleep(0.01)
            if not agent.publisher.subscribed:
                raise RuntimeError(f"the reader did not subscribe ({line!r})")
        yield
    finally:
        pub = agent.publisher
        agent.stop()
        received = -1
        if reader is not None:
            try:
                stdout, _ = reader.communicate(timeout=10)
                received = int(stdout.split()[-1])
            except Exception:
                reader.kill()
                reader.wait()
    assert current_agent() is None
    if out is not None:
        out.update(
            events=pub.events_total if pub is not None else -1,  # -1: no publisher
            packed=PACKED[0] - packed0,
            frames_sent=pub.frames_sent if pub is not None else 0,
            received=received,
            file_bytes=os.path.getsize(record) if record else 0,
        )
    if record:
        os.remove(record)


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


def _agent_config(key: str, label: str, tmpdir: str, **kw: Any) -> Config:
    last: dict[str, int] = {}
    n = [0]

    def make(w: Workload) -> Any:
        n[0] += 1
        path = os.path.join(tmpdir, f"{w.name}-{key}-{n[0]}.tsc") if kw.get("record") else None
        return agent_block(w, **{**kw, "record": path}, out=last)

    return Config(key, label, make, controlled=False, base="user", last=last)


def headline_configs(tmpdir: str) -> list[Config]:
    """The rows as a user runs them: GC on, nothing frozen."""
    return [
        Config(
            "user",
            "as run: untraced",
            lambda w: contextlib.nullcontext(),
            controlled=False,
            base="user",
        ),
        Config(
            "user_trace",
            "as run: trace()",
            lambda w: torchscope.trace(),
            controlled=False,
            base="user",
        ),
        _agent_config("run", "as run: run --steps all (live, no UI)", tmpdir),
        _agent_config("run_ui", "as run: run --steps all, one UI reading", tmpdir, ui=True),
        _agent_config("run_nolive", "as run: run --steps all --no-live", tmpdir, live=False),
        _agent_config(
            "run_record", "as run: run --record F --steps all (live, no UI)", tmpdir, record=True
        ),
    ]


def build_configs(tmpdir: str) -> tuple[list[Config], _RecordTo, list[str]]:
    notes: list[str] = []
    record = _RecordTo(tmpdir)
    configs = [
        *headline_configs(tmpdir),
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
# What a step's time is read from: wall time (what a job pays), or with ``--clock cpu`` this
# thread's CPU time, which leaves out the time the thread sat descheduled while other
# processes had the cores (a shared machine); the tracer does all its work on this thread.
CLOCK: list[Callable[[], float]] = [time.perf_counter]
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


class FullCollections:
    """Counts CPython's full collections (generation 2) while installed (``gc.callbacks``):
    what a tool that keeps objects alive across steps makes the collector do, a fraction of
    a second each in a process with torch loaded."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info.get("generation") == 2:
            self.count += 1

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run_block(w: Workload, cfg: Config, n: int, result: Result | None, record: _RecordTo) -> None:
    if cfg.controlled:
        # Everything alive now (setup, long-lived state) is parked out of the collector's way
        # and the young generations are emptied: no row pays for another's garbage.
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()  # as in the user's job: every live object is the collector's to visit
    perf = CLOCK[0]
    times = []
    t_enter = perf()
    with cfg.make(w):
        entered = perf()
        for _ in range(cfg.untimed):
            w.step()
        with FullCollections() as full:
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
        result.full_gcs += full.count
        if size is not None:
            result.file_bytes.append(size)
        if cfg.last is not None:
            result.counters.append(dict(cfg.last))


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


def block_arguments(
    description: str | None, workloads: list[str], argv: list[str] | None
) -> argparse.Namespace:
    """The command line of a benchmark timed in interleaved blocks of steps (watch.py,
    history.py): ``--steps``, ``--repeats``, ``--warmup``, ``--quick``, ``--workload``."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per block (10; quick 3)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (20; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per row (3; quick 1)")
    p.add_argument("--quick", action="store_true", help="a short run (a smoke test)")
    p.add_argument("--workload", choices=workloads, default="all")
    args = p.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 10)
    args.repeats = args.repeats or (2 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.steps < 2 or args.repeats < 1:
        p.error("need --steps >= 2 and --repeats >= 1")
    return args


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


def _spread(block_medians: list[float]) -> float:
    """The slowest round's block median over the median round's: a job that stutters (a full
    collection now and then) shows here when its median does not."""
    return max(block_medians) / statistics.median(block_medians) if block_medians else 1.0


def table(w: Workload, configs: list[Config], results, steps: int) -> list[str]:
    lines = [
        f"| configuration | median ms/step | ratio | paired ratio | min ms | p25-p75 ms "
        f"| enter+exit ms per {steps}-step block | ratio incl. enter+exit "
        "| full collections per 1000 steps | slowest round / median round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cfg in configs:
        base_res = results[(w.name, cfg.base)]
        base = statistics.median(base_res.times)
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
            f"| {_ms(q1)}-{_ms(q3)} | {_ms(around)} | {amortized:.2f}x "
            f"| {res.full_gcs / len(res.times) * 1000:.1f} | {_spread(res.block_medians):.2f}x |"
        )
    return lines


def report(workloads, configs, results, counts, args, notes, wall: float) -> None:
    print("## torchscope overhead per training step\n")
    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} torch thread, {os.cpu_count()} CPUs visible; "
        f"{args.repeats} rounds x {args.steps} timed steps per configuration "
        f"(+{args.warmup}-step warm-up block each), interleaved, {args.clock} clock; "
        f"whole run {wall:.0f} s.\n"
    )
    headline = [c for c in configs if not c.controlled]
    controlled = [c for c in configs if c.controlled]
    for w in workloads:
        c = counts[w.name]
        per_event = ""
        us = per_event_us(w, results, c)
        if "traced" in us:  # --only may leave it out
            per_event = (
                f" (traced - untraced) / (ops + grads) = {us['traced']:.0f} µs per event "
                "(controlled)."
            )
        print(f"### {w.name}: {w.description}\n")
        print(
            f"Per traced step: {c['ops']} ops, {c['grads']} grads (backward nodes that ran), "
            f"{c['graph nodes']} backward-graph nodes hooked, {c['events']} events in all."
            f"{per_event}\n"
        )
        if headline:
            print("**Headline: as a user runs it** (GC on, nothing frozen)\n")
            print("\n".join(table(w, headline, results, args.steps)))
            print()
            absent = absent_readers_table(w, headline, results, args.steps)
            if absent:
                print("**No work for absent readers** (counters of the timed blocks above)\n")
                print("\n".join(absent))
                print()
        if controlled:
            print(
                "**Controlled** (`gc.freeze()` + `gc.collect()` before each block, outside the "
                "timing: the tracer's own cost, without the collector's)\n"
            )
            print("\n".join(table(w, controlled, results, args.steps)))
        rec = results[(w.name, "record")].file_bytes if (w.name, "record") in results else None
        if rec:
            per_step = statistics.median(rec) / args.steps
            print(f"\nTrace file: {per_step / 1024:.1f} KiB per traced step.")
        print()
    per_event_table(workloads, results, counts)
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
        "- Headline rows (`as run: ...`) run as a user's job does: the collector on, nothing "
        "frozen, no collection forced between blocks; their ratios divide by `as run: "
        'untraced`. The agent rows start `Agent(ServeOptions(steps="all"))` in-process, '
        "which is what `torchscope run --steps all` starts around the script; the UI is "
        "another process subscribed as `torchscope tui PID` is, reading every frame; its "
        "start and subscription (and the agent's start) are in the enter+exit column, so "
        "that row's `ratio incl. enter+exit` counts a process start per block of N steps: "
        "read its per-step columns."
    )
    print(
        "- Controlled rows: before each block everything alive is `gc.freeze()`d and "
        "`gc.collect()` runs (outside the timing), so one row's garbage is not collected on "
        "another's time; rare full-collection pauses inside a block fall outside the median."
    )
    print(
        "- `torchscope, untraced step`: step 0 of each block is traced and not timed; the "
        "timed steps run with no mode and no node hooks (only the optimizer-step hook)."
    )
    for n in notes:
        print(f"- {n}")


PER_EVENT_ROWS = [
    ("traced", "base", "controlled: trace(keep=False)"),
    ("user_trace", "user", "as run: trace()"),
    ("run", "user", "as run: run --steps all, no UI"),
]


def per_event_us(w: Workload, results, c: dict[str, int]) -> dict[str, float]:
    """(row median - its untraced median) / (ops + grads), in µs, for the rows measured."""
    n_events = max(c["ops"] + c["grads"], 1)
    out = {}
    for key, base, _ in PER_EVENT_ROWS:
        if (w.name, key) in results and (w.name, base) in results:
            row = statistics.median(results[(w.name, key)].times)
            untraced = statistics.median(results[(w.name, base)].times)
            out[key] = (row - untraced) * 1e6 / n_events
    return out


def per_event_table(workloads: list[Workload], results, counts) -> None:
    rows = [r for r in PER_EVENT_ROWS if any((w.name, r[0]) in results for w in workloads)]
    if not rows:
        return
    print("### Per-event cost\n")
    print("(row median - untraced median) / (ops + grads per traced step), µs per event.\n")
    print("| workload | ops + grads per step | " + " | ".join(r[2] for r in rows) + " |")
    print("|---|---:|" + "---:|" * len(rows))
    for w in workloads:
        c = counts[w.name]
        us = per_event_us(w, results, c)
        cells = " | ".join(f"{us[k]:.1f}" if k in us else "-" for k, _, _ in rows)
        print(f"| {w.name} | {c['ops'] + c['grads']} | {cells} |")
    print()


def absent_readers_table(w: Workload, configs: list[Config], results, steps: int) -> list[str]:
    rows = [c for c in configs if results[(w.name, c.key)].counters]
    if not rows:
        return []
    lines = [
        "| row | events per step | frames encoded by the publisher per step | frames sent "
        "per step | events the UI received per step (once subscribed) | trace file KiB per step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cfg in rows:
        blocks = results[(w.name, cfg.key)].counters
        per_block = steps + cfg.untimed

        def med(name: str, blocks=blocks, per_block=per_block) -> float:
            return statistics.median(b[name] for b in blocks) / per_block

        events = "-" if blocks[0]["events"] < 0 else f"{med('events'):.1f}"
        received = "-" if blocks[0]["received"] < 0 else f"{med('received'):.1f}"
        lines.append(
            f"| {cfg.label} | {events} | {med('packed'):.2f} | {med('frames_sent'):.2f} "
            f"| {received} | {med('file_bytes') / 1024:.1f} |"
        )
    return lines


# -- profile mode --------------------------------------------------------------------------
def profile_traced(name: str = "mlp", steps: int = 50, top: int = 25) -> None:
    """cProfile, then tracemalloc, of traced steps of one workload; calls and allocations are
    also given per event (ops + grads of a traced step)."""
    import tracemalloc

    w = WORKLOADS[name]()
    for _ in range(3):
        w.step()
    n_events = max(sum(event_counts(w)[k] for k in ("ops", "grads")), 1)
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
    per = steps * n_events
    print(f"## cProfile: traced {name} step, {steps} steps, top {top} by tottime\n")
    print(
        f"{n_events} events (ops + grads) per step; {st.total_calls / per:.1f} Python-visible "
        f"calls per event.\n"
    )
    st.sort_stats("tottime").print_stats(top)
    print(out.getvalue())
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("cumulative").print_stats(r"torchscope", top)
    print(f"## same profile, torchscope functions by cumulative time (top {top})\n")
    print(out.getvalue())

    # Allocations: with keep=True every event stays alive, so the blocks still allocated after
    # the steps are what each event is made of (dicts, lists, floats, strings), by line.
    with torchscope.trace():
        for _ in range(3):
            w.step()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for _ in range(steps):
            w.step()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
    assert_clean("tracemalloc")
    diff = [
        d
        for d in after.compare_to(before, "lineno")
        if "tracemalloc" not in str(d.traceback) and d.count_diff > 0
    ]
    grown = sum(d.count_diff for d in diff)
    size = sum(d.size_diff for d in diff)
    print(
        f"## tracemalloc: traced {name} (keep=True), {steps} steps: {grown / per:.1f} blocks, "
        f"{size / per:.0f} bytes per event kept (top {top} lines)\n"
    )
    for d in diff[:top]:
        print(
            f"{d.count_diff / per:8.2f} blocks/event {d.size_diff / per:8.1f} B/event  "
            f"{d.traceback}"
        )
    print()
    # The collector: how often it ran while tracing, with everything alive before frozen.
    with torchscope.trace(keep=False):
        for _ in range(3):
            w.step()
        gc.collect()
        gc.freeze()
        s0 = [g["collections"] for g in gc.get_stats()]
        for _ in range(steps):
            w.step()
        s1 = [g["collections"] for g in gc.get_stats()]
        gc.unfreeze()
    print(
        f"## gc: traced {name} (keep=False), {steps} steps: collections by generation "
        f"{[b - a for a, b in zip(s0, s1, strict=True)]}\n"
    )


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
        help="comma-separated rows to run (headline: user,user_trace,run,run_ui,run_nolive,"
        "run_record; controlled: base,traced,idle,record,anomaly,profiler,debugmode)",
    )
    p.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="time steps by wall clock (default) or by this thread's CPU time (a busy host)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile + tracemalloc of the traced step (50 steps; MLP unless --workload)",
    )
    args = p.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 10)
    args.repeats = args.repeats or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.steps < 2 or args.repeats < 1:
        p.error("need --steps >= 2 and --repeats >= 1")

    torch.set_num_threads(1)
    CLOCK[0] = CLOCKS[args.clock]
    if args.profile:
        profile_traced("mlp" if args.workload == "all" else args.workload)
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
            keep |= {c.base for c in configs if c.key in keep}
            configs = [c for c in configs if c.key in keep]
        assert_clean("start")
        # Everything imported and built so far lives for the whole run: park it out of the
        # collector's way, so the gc.collect() before each controlled block stays cheap
        # (headline blocks unfreeze it: a user's job has it all in the collector's view).
        gc.collect()
        gc.freeze()
        counts = {w.name: event_counts(w) for w in workloads}
        results = measure(workloads, configs, args.steps, args.repeats, args.warmup, record)
    report(workloads, configs, results, counts, args, notes, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
