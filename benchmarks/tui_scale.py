"""How the terminal UI scales. No torch needed.

    python benchmarks/tui_scale.py                 # all four parts, prints a table
    python benchmarks/tui_scale.py --events 200000 --live-seconds 3   # a quicker run

(a) replay: a synthetic 1,000,000-event trace written with TraceWriter (MLP-shaped op, grad
    and graph events). Time from app start to the first screen with the first step's events
    painted, using FileSource, and the peak RSS it added (the file is ~540 MB: a UI that loaded
    it would need gigabytes). Then the same file with its index cut off, which makes the
    reader scan chunk headers and report progress.
(b) live: 50,000 events/s for 10 s through ScriptedSource -> inbox -> 30 Hz batched apply, the
    path LiveSource uses; sustained events/s applied, backlog, and RSS (the store is bounded).
(c) latency: one step with 100,000 events; keypress to repainted screen for down, page down,
    and filter keystrokes, median and p95 (Pilot, headless; the screen is re-rendered in full
    after each key, which is more than a terminal repaint costs).
(c') live keys: a live job (FakeJob: a simulated traced job that pauses and steps) paused in a
    step of 100,000 events: ``g`` there and back, enter/backspace jumps, ``s`` (to the next op,
    so the keypress, the command, the job's pause and the repaint), ``n`` from the step's last
    event (the next step's first op: a step switch with the 100k-event step behind) and ``n``
    across a whole 100k-event step, where the job streams every event of it to the UI first:
    that one is reported in two parts, the whole wait and the UI's share from the moment the
    job's pause reached it (the job's own time and the transfer are not the UI's).
(d) small: the same 100,000-event step at 80x24: a full render with no cached lines (a first
    paint or a resize), and down / page down keypress latency.
(e) huge step: a recording whose one step holds 300,000 events (``--huge-events``; a real
    LBFGS step had 702k), opened with FileSource: time to the first rows of the step, time to
    all of them (the step streams in chunk by chunk), and keypress latency meanwhile.

Each measurement runs in a fresh process, so one part's memory does not hide another's.
Key latencies are printed as the median (and p95) per key, against the goal of 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))


def rss_mb() -> float:
    """Current resident set size (Linux /proc), in MB."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- fixtures -------------------------------------------------------------------------------


def write_trace(path: Path, events: int, layers: int = 200) -> int:
    from torchscope.protocol.tracefile import TraceWriter
    from torchscope.tui.demo.synthetic import events_per_step, iter_trace

    steps = max(1, events // events_per_step(layers))
    with TraceWriter(path, metadata={"synthetic": True}, chunk_events=4096) as w:
        buf = []
        for ev in iter_trace(steps, layers):
            buf.append(ev)
            if len(buf) >= 4096:
                w.write(buf)
                buf = []
        w.write(buf)
        written = w.events_written
    return written


def write_huge_step(path: Path, events: int) -> int:
    """A recording with one step of about ``events`` events (then nothing)."""
    from torchscope.protocol.tracefile import TraceWriter
    from torchscope.tui.demo.synthetic import events_per_step, iter_trace

    layers = max(1, events // (events_per_step(1000) // 1000))
    with TraceWriter(path, metadata={"synthetic": True}, chunk_events=4096) as w:
        buf = []
        for ev in iter_trace(1, layers):
            buf.append(ev)
            if len(buf) >= 4096:
                w.write(buf)
                buf = []
        w.write(buf)
        return w.events_written


def strip_index(src: Path, dst: Path) -> None:
    """A copy of a closed trace without its trailer: readers must scan it."""
    shutil.copyfile(src, dst)
    size = dst.stat().st_size
    os.truncate(dst, size - 16)  # the 16-byte trailer that points at the index


# -- child processes ------------------------------------------------------------------------


async def _first_screen(path: str) -> dict:
    base_rss = rss_mb()
    t0 = time.perf_counter()
    from torchscope.session.items import Progress
    from torchscope.tui.app import TorchscopeApp
    from torchscope.tui.sources.file import FileSource

    progress_calls = []
    source = FileSource(path)
    app = TorchscopeApp(source)
    orig = app.inbox.put

    def put(item):
        if isinstance(item, Progress):
            progress_calls.append(item.label)
        orig(item)

    app.inbox.put = put  # type: ignore[method-assign]
    async with app.run_test(size=(160, 45)) as pilot:
        while app.main.timeline.row_count() == 0:
            await asyncio.sleep(0.002)
        app.screen_text()  # force a full render of the screen, as a first paint
        first = time.perf_counter() - t0
        rss_first = rss_mb()
        # Keys while the background counting pass decodes chunks (it shares the GIL).
        t1 = time.perf_counter()
        lat = []
        for i in range(20):
            lat.append(await key_latency(app, pilot, "up" if i % 2 else "down"))
            await asyncio.sleep(0.1)
        while source.reader is None or any(not i.counted for i in app.store.steps.values()):
            await pilot.pause(0.05)
            if time.perf_counter() - t1 > 120:
                break
        counted = time.perf_counter() - t1
        steps = len(app.store.order)
        resident = app.store.resident_events
    # The counting child has been waited for by now: its peak RSS, separately.
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {
        "child_peak_mb": child_peak,
        "first_screen_s": first,
        "rss_delta_first_mb": rss_first - base_rss,
        "peak_rss_delta_mb": peak_mb() - base_rss,
        "count_pass_s": counted,
        "steps": steps,
        "resident_events": resident,
        "key_ms_during_pass": (1000 * statistics.median(lat), 1000 * _p95(lat)),
        "progress_callbacks": len(progress_calls),
        "progress_labels": sorted(set(progress_calls)),
        "file_mb": os.path.getsize(path) / 2**20,
    }


def _renumbered(pool: list[dict], steps: int | None = None):
    """Endless (or ``steps``-long) stream of steps cut from ``pool``, with fresh seq/step."""
    from torchscope.protocol.events import Event

    seq = 0
    for step in itertools.count() if steps is None else range(steps):
        for ev in pool:
            e = Event(ev)
            e["seq"] = seq
            e["step"] = step
            seq += 1
            yield e


async def _live(rate: int, seconds: float, max_events: int) -> dict:
    from torchscope.tui.app import TorchscopeApp
    from torchscope.tui.demo.synthetic import make_trace
    from torchscope.tui.sources.scripted import ScriptedSource

    pool = [e for e in make_trace(1, 200)[1:]]  # one step of ~2.2k events, no session
    base_rss = rss_mb()
    source = ScriptedSource(_renumbered(pool), rate=rate, reloadable=False)
    app = TorchscopeApp(source, max_events=max_events)
    samples = []
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause(0.2)
        start_applied = app.store.events_applied
        t0 = time.perf_counter()
        lat = []
        while (now := time.perf_counter()) - t0 < seconds:
            lat.append(await key_latency(app, pilot, "up" if len(lat) % 2 else "down"))
            await asyncio.sleep(0.2)
            samples.append((now - t0, app.store.events_applied, rss_mb()))
        elapsed = time.perf_counter() - t0
        applied = app.store.events_applied - start_applied
        backlog = app.inbox.pending_events
        ui_dropped = app.inbox.dropped
        resident = app.store.resident_events
        evictions = app.store.evictions
        steps = len(app.store.order)
    return {
        "offered_eps": rate,
        "applied_eps": applied / elapsed,
        "backlog_events": backlog,
        "ui_dropped": ui_dropped,
        "resident_events": resident,
        "max_events": max_events,
        "evicted_steps": evictions,
        "steps": steps,
        "rss_delta_end_mb": samples[-1][2] - base_rss if samples else 0,
        "peak_rss_delta_mb": peak_mb() - base_rss,
        "key_latency_ms_median": 1000 * statistics.median(lat) if lat else None,
        "key_latency_ms_p95": 1000 * _p95(lat) if lat else None,
    }


def _goal(median_ms: float) -> str:
    """The notes of a key's latency: median / p95, against the goal."""
    return f"median / p95; goal median <= 100 ms: {'ok' if median_ms <= 100 else 'MISSED'}"


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


async def key_latency(app, pilot, key: str) -> float:
    """Keypress to repainted screen: send the key as the terminal driver would, wait until the
    screen and every widget processed it and the messages it caused, then render the whole
    screen (a real repaint redraws only changed lines, so this is an upper bound). Pilot's own
    ``press`` is not used for timing: it sleeps until the process looks idle."""
    import unicodedata

    from textual import events

    char = key if len(key) == 1 else None
    if key == "slash":
        char = "/"
    elif len(key) > 1:
        try:
            char = unicodedata.lookup(key.upper().replace("_", " "))
        except KeyError:
            char = None
    t = time.perf_counter()
    ev = events.Key(key, char)
    ev.set_sender(app)
    app._driver.send_message(ev)
    await pilot._wait_for_screen()
    await pilot._wait_for_screen()
    app.screen_text()
    return time.perf_counter() - t


async def _latency(n_events: int, presses: int) -> dict:
    from torchscope.tui.app import TorchscopeApp
    from torchscope.tui.demo.synthetic import events_per_step, make_trace
    from torchscope.tui.sources.scripted import ScriptedSource

    layers = max(1, n_events // (events_per_step(1000) // 1000))
    events = make_trace(1, layers)
    source = ScriptedSource(events, mode="replay")
    app = TorchscopeApp(source)
    out: dict = {}
    async with app.run_test(size=(160, 45)) as pilot:
        while app.store.data(0) is None or len(app.store.data(0).rows) < n_events * 0.9:
            await pilot.pause(0.05)
        await pilot.pause(0.3)
        out["events_in_step"] = len(app.store.data(0))
        out["rows"] = app.main.timeline.row_count()

        async def measure(keys: list[str]) -> list[float]:
            lat = []
            for k in keys:
                lat.append(await key_latency(app, pilot, k))
                await asyncio.sleep(0.01)
            return lat

        for name, keys in (
            ("down", ["down"] * presses),
            ("page down", ["pagedown"] * presses),
            ("end/home", ["end", "home"] * (presses // 2)),
        ):
            lat = await measure(keys)
            out[name] = (statistics.median(lat) * 1000, _p95(lat) * 1000)
        await pilot.press("slash")
        chars = list("gelu") + ["backspace"] * 4 + list("blocks.1") + ["left_square_bracket"]
        lat = await measure(chars)
        out["filter keystroke"] = (statistics.median(lat) * 1000, _p95(lat) * 1000)
        out["filter rows"] = app.main.timeline.row_count()
        await pilot.press("escape")
        # jump op -> node in a 100k step
        await pilot.press("home")
        lat = await measure(["enter", "backspace"] * 5)
        out["enter/backspace jump"] = (statistics.median(lat) * 1000, _p95(lat) * 1000)
        lat = await measure(["g", "g"] * 3)
        out["graph toggle (g)"] = (statistics.median(lat) * 1000, _p95(lat) * 1000)
    return out


async def _small(n_events: int, presses: int) -> dict:
    """80x24: a full render of the screen (every line composed, as a first paint or a
    resize needs), and keypress latency, on a step of ``n_events`` events."""
    from torchscope.tui.app import TorchscopeApp
    from torchscope.tui.demo.synthetic import events_per_step, make_trace
    from torchscope.tui.sources.scripted import ScriptedSource

    layers = max(1, n_events // (events_per_step(1000) // 1000))
    app = TorchscopeApp(ScriptedSource(make_trace(1, layers, nan_step=0), mode="replay"))
    out: dict = {}
    async with app.run_test(size=(80, 24)) as pilot:
        while app.store.data(0) is None or len(app.store.data(0).rows) < n_events * 0.9:
            await pilot.pause(0.05)
        await pilot.pause(0.3)
        out["events_in_step"] = len(app.store.data(0))
        renders = []
        for _ in range(presses):
            app.main.timeline._cache.clear()  # no cached lines: the cost of a first paint
            t = time.perf_counter()
            app.screen._compositor.render_update(full=True)
            renders.append(time.perf_counter() - t)
        out["full render"] = (statistics.median(renders) * 1000, _p95(renders) * 1000)
        for name, keys in (("down", ["down"] * presses), ("page down", ["pagedown"] * presses)):
            lat = []
            for k in keys:
                lat.append(await key_latency(app, pilot, k))
                await asyncio.sleep(0.01)
            out[name] = (statistics.median(lat) * 1000, _p95(lat) * 1000)
    return out


async def _huge(path: str) -> dict:
    """Open a recording whose first step is huge: first rows, all rows, keys meanwhile."""
    t0 = time.perf_counter()
    from torchscope.tui.app import TorchscopeApp
    from torchscope.tui.sources.file import FileSource

    app = TorchscopeApp(FileSource(path))
    lat = []
    async with app.run_test(size=(160, 45)) as pilot:
        timeline = app.main.timeline
        while timeline.row_count() == 0:
            await asyncio.sleep(0.002)
        app.screen_text()
        first = time.perf_counter() - t0
        first_rows = timeline.row_count()
        timeline.focus()
        while app.store.data(0) is None or 0 in app.store.loading or not app.store.order:
            lat.append(await key_latency(app, pilot, "up" if len(lat) % 2 else "down"))
            await asyncio.sleep(0.1)
            if time.perf_counter() - t0 > 600:
                break
        await pilot.pause(0.05)
        every = time.perf_counter() - t0
        rows = len(app.store.data(0).rows) if app.store.data(0) is not None else 0
    return {
        "first_rows_s": first,
        "first_rows": first_rows,
        "all_rows_s": every,
        "rows": rows,
        "keys": len(lat),
        "key_ms_while_loading": (
            (1000 * statistics.median(lat), 1000 * _p95(lat)) if lat else (0.0, 0.0)
        ),
        "file_mb": os.path.getsize(path) / 2**20,
    }


async def _live_keys(n_events: int, presses: int) -> dict:
    """Keys on a live job paused in a step of ``n_events`` events (see (c') above)."""
    from torchscope.tui.app import TorchscopeApp
    from torchscope.tui.demo.fakejob import FakeJob
    from torchscope.tui.demo.synthetic import events_per_step, make_trace

    layers = max(1, n_events // (events_per_step(1000) // 1000))
    events = make_trace(2, layers)
    points = [e for e in events if e.get("step") == 0 and e.get("kind") in ("op", "grad")]
    ops = [e for e in points if e.get("kind") == "op"]
    app = TorchscopeApp(FakeJob(events, pause_at=ops[len(ops) // 2]["seq"]))
    arrived: list[float] = []  # when the job's last pause reached the UI's inbox
    out: dict = {}
    async with app.run_test(size=(160, 45)) as pilot:
        stepper, tl = app.store.stepper, app.main.timeline
        put = app.inbox.put_events

        def put_events(items):
            ok = put(items)
            if any(type(i) is not tuple and i.get("kind") == "pause" for i in items):
                arrived.append(time.perf_counter())
            return ok

        app.inbox.put_events = put_events  # type: ignore[method-assign]

        async def paused_here(wait: float = 120.0) -> None:
            t = time.perf_counter()
            while stepper.paused is None or tl.paused_index() is None:
                await asyncio.sleep(0.002)
                if time.perf_counter() - t > wait:
                    raise RuntimeError("the job did not pause")

        async def command(key: str) -> tuple[float, float]:
            """Key to the new pause painted: (whole wait, from the pause's arrival)."""
            before = stepper.paused
            t = time.perf_counter()
            await key_latency(app, pilot, key)
            while stepper.paused is before:
                await asyncio.sleep(0.001)
            await paused_here()
            await pilot._wait_for_screen()
            app.screen_text()
            end = time.perf_counter()
            return end - t, end - arrived[-1]

        await paused_here()
        await pilot.pause(0.3)
        out["rows"] = tl.row_count()
        tl.focus()

        async def measure(keys: list[str]) -> list[float]:
            lat = []
            for k in keys:
                lat.append(await key_latency(app, pilot, k))
                await asyncio.sleep(0.01)
            return lat

        out["graph toggle (g)"] = await measure(["g", "g"] * max(1, presses // 4))
        out["enter/backspace jump"] = await measure(["enter", "backspace"] * max(1, presses // 4))
        lat = []
        for _ in range(max(2, presses // 4)):
            lat.append((await command("s"))[0])
            await asyncio.sleep(0.01)
        out["s (job steps, UI repaints)"] = lat
        # n across the rest of the step: the job streams it all, then pauses in step 1
        whole, share = await command("n")
        out["events_in_step"] = len(app.store.data(0)) if app.store.data(0) else 0
        out["n across the step"] = (1000 * whole, 1000 * share)
    # n from a step's last event: the job goes to the next step's first op, a step switch with
    # the 100k-event step behind (a fresh job each time: each n leaves the step it is in)
    lat = []
    for _ in range(3):
        app = TorchscopeApp(FakeJob(events, pause_at=points[-1]["seq"]))
        async with app.run_test(size=(160, 45)) as pilot:
            stepper, tl = app.store.stepper, app.main.timeline
            put = app.inbox.put_events
            app.inbox.put_events = put_events  # type: ignore[method-assign]
            await paused_here()
            await pilot.pause(0.3)
            tl.focus()
            lat.append((await command("n"))[0])
    out["n from a step's end"] = lat
    print("n from a step's end:", [round(1000 * x) for x in lat], file=sys.stderr)
    return {
        k: (v if not isinstance(v, list) else (1000 * statistics.median(v), 1000 * _p95(v)))
        for k, v in out.items()
    }


def child(argv: list[str]) -> None:
    what = argv[0]
    if what == "first":
        res = asyncio.run(_first_screen(argv[1]))
    elif what == "live":
        res = asyncio.run(_live(int(argv[1]), float(argv[2]), int(argv[3])))
    elif what == "latency":
        res = asyncio.run(_latency(int(argv[1]), int(argv[2])))
    elif what == "live-keys":
        res = asyncio.run(_live_keys(int(argv[1]), int(argv[2])))
    elif what == "small":
        res = asyncio.run(_small(int(argv[1]), int(argv[2])))
    elif what == "huge":
        res = asyncio.run(_huge(argv[1]))
    else:
        raise SystemExit(f"unknown child {what}")
    print("RESULT " + json.dumps(res))


def run_child(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE), "--child", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child {args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


# -- main -----------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000, help="events in the replay file")
    ap.add_argument("--rate", type=int, default=50_000, help="live events per second")
    ap.add_argument("--live-seconds", type=float, default=10.0)
    ap.add_argument("--max-events", type=int, default=250_000, help="store bound (live)")
    ap.add_argument("--step-events", type=int, default=100_000, help="events in one step (c)")
    ap.add_argument("--presses", type=int, default=40)
    ap.add_argument("--huge-events", type=int, default=300_000, help="events in one step (e)")
    ap.add_argument("--dir", default=None, help="where to keep the trace (reused if present)")
    ap.add_argument(
        "--only", choices=["replay", "live", "latency", "live-keys", "small", "huge"], default=None
    )
    args = ap.parse_args()

    rows: list[tuple[str, str, str]] = []
    workdir = Path(args.dir or os.path.join(tempfile.gettempdir(), "torchscope-bench"))
    workdir.mkdir(parents=True, exist_ok=True)

    if args.only in (None, "replay"):
        trace = workdir / f"synthetic-{args.events}.tsc"
        if not trace.exists():
            t = time.perf_counter()
            n = write_trace(trace, args.events)
            print(f"wrote {n:,} events to {trace} in {time.perf_counter() - t:.1f} s", flush=True)
        noindex = workdir / f"synthetic-{args.events}-noindex.tsc"
        strip_index(trace, noindex)
        for label, path in (("indexed", trace), ("no index", noindex)):
            r = run_child("first", str(path))
            rows += [
                (f"replay {label}: first screen", f"{r['first_screen_s']:.2f} s", "< 2 s"),
                (
                    f"replay {label}: RSS added at first screen / peak",
                    f"{r['rss_delta_first_mb']:.0f} / {r['peak_rss_delta_mb']:.0f} MB",
                    f"file {r['file_mb']:.0f} MB",
                ),
                (
                    f"replay {label}: background count pass (child process)",
                    f"{r['count_pass_s']:.1f} s",
                    f"{r['steps']} steps; {r['resident_events']:,} events resident; "
                    f"child peak RSS {r['child_peak_mb']:.0f} MB",
                ),
                (
                    f"replay {label}: keypress latency during the pass",
                    "{:.1f} / {:.1f} ms".format(*r["key_ms_during_pass"]),
                    "median / p95",
                ),
            ]
            if label == "no index":
                rows.append(
                    (
                        "replay no index: progress reports",
                        str(r["progress_callbacks"]),
                        ", ".join(r["progress_labels"]),
                    )
                )
        noindex.unlink(missing_ok=True)

    if args.only in (None, "live"):
        r = run_child("live", str(args.rate), str(args.live_seconds), str(args.max_events))
        rows += [
            (
                f"live {args.rate:,} ev/s for {args.live_seconds:g} s: applied",
                f"{r['applied_eps']:,.0f} ev/s",
                f"backlog {r['backlog_events']:,}, ui-dropped {r['ui_dropped']:,}",
            ),
            (
                "live: memory (RSS added, end / peak)",
                f"{r['rss_delta_end_mb']:.0f} / {r['peak_rss_delta_mb']:.0f} MB",
                f"{r['resident_events']:,} resident (bound {r['max_events']:,}), "
                f"{r['evicted_steps']} steps evicted",
            ),
            (
                "live: keypress latency while ingesting",
                f"{r['key_latency_ms_median']:.1f} / {r['key_latency_ms_p95']:.1f} ms",
                "median / p95",
            ),
        ]

    if args.only in (None, "latency"):
        r = run_child("latency", str(args.step_events), str(args.presses))
        for key in (
            "down",
            "page down",
            "end/home",
            "filter keystroke",
            "enter/backspace jump",
            "graph toggle (g)",
        ):
            med, p95 = r[key]
            rows.append(
                (
                    f"{r['events_in_step']:,}-event step: {key}",
                    f"{med:.1f} / {p95:.1f} ms",
                    _goal(med),
                )
            )

    if args.only in (None, "live-keys"):
        r = run_child("live-keys", str(args.step_events), str(args.presses))
        for key in (
            "graph toggle (g)",
            "enter/backspace jump",
            "s (job steps, UI repaints)",
            "n from a step's end",
        ):
            med, p95 = r[key]
            rows.append(
                (
                    f"live, {r['events_in_step']:,}-event step, paused in it: {key}",
                    f"{med:.1f} / {p95:.1f} ms",
                    _goal(med),
                )
            )
        whole, share = r["n across the step"]
        rows.append(
            (
                f"live: n across the {r['events_in_step']:,}-event step",
                f"{whole:.0f} ms",
                f"the job streams the step first; the UI's share, from the pause's arrival: "
                f"{share:.0f} ms",
            )
        )

    if args.only in (None, "small"):
        r = run_child("small", str(args.step_events), str(args.presses))
        for key in ("full render", "down", "page down"):
            med, p95 = r[key]
            rows.append(
                (
                    f"80x24, {r['events_in_step']:,}-event step: {key}",
                    f"{med:.1f} / {p95:.1f} ms",
                    "median / p95 (no cached lines)" if key == "full render" else _goal(med),
                )
            )

    if args.only in (None, "huge"):
        trace = workdir / f"huge-step-{args.huge_events}.tsc"
        if not trace.exists():
            t = time.perf_counter()
            n = write_huge_step(trace, args.huge_events)
            print(f"wrote {n:,} events to {trace} in {time.perf_counter() - t:.1f} s", flush=True)
        r = run_child("huge", str(trace))
        rows += [
            (
                f"huge step ({r['rows']:,} rows): first rows",
                f"{r['first_rows_s']:.2f} s",
                f"{r['first_rows']:,} rows, from app start; file {r['file_mb']:.0f} MB",
            ),
            (
                "huge step: all rows",
                f"{r['all_rows_s']:.1f} s",
                "from app start, streamed in while the UI runs",
            ),
            (
                "huge step: keypress latency while it streams in",
                "{:.1f} / {:.1f} ms".format(*r["key_ms_while_loading"]),
                f"median / p95 of {r['keys']} keys",
            ),
        ]

    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print()
    print(f"{'measure'.ljust(w0)}  {'result'.ljust(w1)}  notes")
    print(f"{'-' * w0}  {'-' * w1}  -----")
    for a, b, c in rows:
        print(f"{a.ljust(w0)}  {b.ljust(w1)}  {c}")


if __name__ == "__main__":
    main()
