"""The MCP server: torchscope's jobs, recordings and commands as tools for coding agents.

Built on the official ``mcp`` SDK (``pip install 'torchscope-debugger[mcp]'``), over stdio
(``torchscope mcp``). Every tool has typed arguments and a bounded answer (pages with
``offset``/``limit`` and ``next_offset``); every failure is one line (``tool: what went
wrong``); a tool that waits (``record``, ``pause``, ``step``, ``next``, ``continue``,
``state``) has a timeout and says what it waited for.

The tools read recordings and live jobs alike (:mod:`~torchscope.mcp.sources`) and shape
them with :mod:`~torchscope.mcp.views`; live jobs are reached through
:mod:`~torchscope.mcp.live`, with a UI's commands and a UI's lease, nothing more.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import CallToolResult, TextContent
from pydantic import Field

from torchscope import __version__
from torchscope.analysis.diff import DiffError, Options, diff_files
from torchscope.mcp import views
from torchscope.mcp.live import JobError, JobLink, Jobs
from torchscope.mcp.sources import Recordings, SourceError, looks_like_job, source_summary
from torchscope.protocol import endpoints as ep
from torchscope.protocol.breakpoints import BreakpointError, parse_break_spec
from torchscope.protocol.client import SessionClient, SessionRefused, SessionUnreachable
from torchscope.protocol.codec import ProtocolError
from torchscope.protocol.frames import one_line
from torchscope.protocol.policies import POLICIES
from torchscope.protocol.runtime import EndpointError
from torchscope.session.stepper_view import pause_key

__all__ = ["build_server", "main"]

INSTRUCTIONS = """\
torchscope: a live step-through debugger for PyTorch training (every forward op and the \
gradient through every backward node). A target is a recording (a trace file, .tsc) or a \
live job (its pid, or a control endpoint).
From "loss is NaN" to the op and line: `ls` finds the running jobs; `record` a job's next \
N steps into a file (or take the file of `torchscope run --record`); `alerts` on it names \
where NaN/Inf first appeared (op, module, file:line, step, rank); `events` lists a step \
(filter/search as in the UI), `event` shows one op or node with both sides, `graph` the \
backward nodes around it. `history` gives a job's loss per step, `watch` switches its NaN \
watch on. To stop a live job: `breakpoint_set` (e.g. "nan"), `continue` with wait, \
`pause`, `step`, `next`, `state`, `values`; `release` lets the job go (it also goes when \
the agent closes this server). `diff` compares two recordings."""

Job = Annotated[
    int | str | None,
    Field(description="a job: its pid or control endpoint; omitted: the only running job"),
]
Target = Annotated[
    str | int,
    Field(description="a recording (trace file path) or a live job (pid or control endpoint)"),
]
Offset = Annotated[int, Field(ge=0, description="first item of the page (from next_offset)")]
Limit = Annotated[int, Field(ge=1, le=views.MAX_LIMIT, description="items per page")]
Step = Annotated[int, Field(ge=0, description="training step number")]


class Refusal(Exception):
    """A one-line refusal a tool raises; turned into the tool's error."""


_EXPECTED = (
    Refusal,
    JobError,
    SourceError,
    views.ViewError,
    DiffError,
    BreakpointError,
    EndpointError,
    SessionUnreachable,
    SessionRefused,
    ProtocolError,  # a request the client cannot send (a number out of range)
)


def _refusals(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Expected failures become the tool's one-line error; answers become a compact JSON
    text plus the same data, structured."""
    if _is_async(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> CallToolResult:
            try:
                return _answer(await fn(*args, **kwargs))
            except _EXPECTED as exc:
                raise ToolError(one_line(str(exc), 1000)) from None

        return run_async

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> CallToolResult:
        try:
            return _answer(fn(*args, **kwargs))
        except _EXPECTED as exc:
            raise ToolError(one_line(str(exc), 1000)) from None

    return run


def _is_async(fn: Callable[..., Any]) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bytes):
        return f"<{len(x)} bytes>"
    return x


def _answer(data: dict[str, Any]) -> CallToolResult:
    data = _jsonable(data)
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=data)


# -- errors on one line -------------------------------------------------------------------------
_PREFIX = re.compile(r"^Error executing tool (\S+): ", re.S)
_PYDANTIC = re.compile(r"^\d+ validation errors? for \S+\n")
_DETAIL = re.compile(r"\s*\[type=(\w+)(?:, input_value=(.*?))?(?:, input_type=\w+)?\]\s*$")


def one_line_error(text: str) -> str:
    """A tool error as one line: ``tool: message``; the SDK's argument validation (several
    lines from pydantic) as ``tool: field: what is wrong (got X)``, every field."""
    tool = ""
    m = _PREFIX.match(text)
    if m:
        tool, text = m.group(1), text[m.end() :]
    if _PYDANTIC.match(text):
        parts: list[str] = []
        field = ""
        for line in text.splitlines()[1:]:
            if not line.startswith(" "):
                field = line.strip()
            elif line.startswith("  ") and not line.startswith("    "):
                msg = line.strip()
                d = _DETAIL.search(msg)
                if d:
                    msg = msg[: d.start()].strip()
                    if d.group(2) is not None and d.group(1) != "missing":
                        msg += f" (got {d.group(2)})"
                parts.append(f"{field}: {msg}" if field else msg)
        text = "bad arguments: " + "; ".join(parts)
    return one_line(f"{tool}: {text}" if tool else text, 1000)


async def _one_line_errors(ctx: Any, call_next: Any) -> Any:
    """Middleware: every tool error leaves as one line."""
    result = await call_next(ctx)
    failed = isinstance(result, dict) and (result.get("isError") or result.get("is_error"))
    if getattr(ctx, "method", None) == "tools/call" and failed:
        for block in result.get("content") or ():
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                block["text"] = one_line_error(block["text"])
    return result


# -- the server ---------------------------------------------------------------------------------
def build_server(*, record_timeout_cap: float = 600.0) -> MCPServer:
    """The server with every tool. Its live jobs are let go when it stops."""
    jobs = Jobs()
    recordings = Recordings()

    @asynccontextmanager
    async def lifespan(_server: MCPServer) -> AsyncIterator[None]:
        try:
            yield None
        finally:
            await anyio.to_thread.run_sync(jobs.close)

    server = MCPServer(
        "torchscope",
        title="torchscope",
        instructions=INSTRUCTIONS,
        version=__version__,
        lifespan=lifespan,
        log_level="WARNING",
        middleware=[_one_line_errors],
    )

    def tool(**kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            # a trailing _ keeps a Python word free: next_ is the tool "next"
            server.add_tool(_refusals(fn), name=kw.get("name") or fn.__name__.rstrip("_"))
            return fn

        return register

    def source(target: str | int) -> Any:
        text = str(target).strip()
        if not text:
            raise Refusal("give a recording (a trace file) or a job (a pid or endpoint)")
        if looks_like_job(text):
            link = jobs.get(text)
            if link.gone:
                raise Refusal(link.gone)
            return link
        return recordings.get(text)

    # -- jobs ------------------------------------------------------------------------------------
    @tool()
    def ls() -> dict[str, Any]:
        """The live torchscope jobs on this machine (as `torchscope ls`): pid, rank, step,
        tracing (dormant / arming / traced), latest loss, script; the ranks of a torchrun job
        share a `job`. `held`: this server holds it (traced while this server runs)."""
        try:
            records = ep.list_sessions()
        except EndpointError as exc:
            raise Refusal(str(exc)) from None
        held = {link.record.control: link for link in jobs.known() if link.gone is None}
        out = []
        for ranks in ep.group_by_job(records)[:50]:
            for rec in ranks[:64]:
                out.append(_ls_row(rec, held.get(rec.control)))
        hint = None if out else "no running torchscope jobs (start one with torchscope run)"
        return {"jobs": out, **({"note": hint} if hint else {})}

    @tool()
    def history(
        job: Annotated[
            int | str | None,
            Field(
                description="a job (its pid or control endpoint; omitted: the only running "
                "job) or a recording (a trace file path)"
            ),
        ] = None,
        since: Annotated[int | None, Field(ge=-1, description="only steps after this")] = None,
        last: Annotated[int, Field(ge=1, le=500, description="the newest N steps")] = 50,
    ) -> dict[str, Any]:
        """A run's loss per step (and, with the watch on, its gradient norm and the
        largest module norms), traced or not: the run's history, as `torchscope history`,
        of a running job or a recording. A step the watch flagged as a loss spike has
        `spike: true` and the spike's `line`; `skipped: true` where its update was skipped
        (the watch's skip policies, a loss scaler)."""
        text = None if job is None else str(job).strip() or None
        lines: dict[int, str] = {}
        if text is not None and not looks_like_job(text):
            try:
                recorded = recordings.get(text)
                reply, lines = views.recorded_history(recorded.step_table_events())
            except SourceError as exc:
                raise Refusal(str(exc)) from None
            if since is not None:
                reply["points"] = [p for p in reply["points"] if p["step"] > since]
        else:
            reply = _ask(jobs, job, "history", since=since, max_points=last)
            try:  # the spikes' lines: from this server's link to the job, when it has one
                control = ep.resolve(text).control
            except EndpointError:
                control = None
            link = next((k for k in jobs.known() if k.record.control == control), None)
            for a in link.alerts() if link is not None else ():
                if a.get("what") == "spike" and type(a.get("step")) is int:
                    lines.setdefault(a["step"], str(a.get("message") or ""))
        points, older = views.history_view(reply, lines, last)
        out: dict[str, Any] = {"step": reply.get("step"), "points": points}
        if reply.get("pending"):
            out["pending"] = f"{reply['pending']} steps still on the device"
        if older:
            out["older"] = older
        return out

    @tool()
    def watch(
        job: Job = None,
        spec: Annotated[
            str, Field(description="nan, gradnorm:X, spike, or a comma list", max_length=64)
        ] = "nan",
        on_nan: Annotated[
            str,
            Field(
                description="what the job does then (skip: refuse the bad update, go on)",
                pattern=f"^({'|'.join(POLICIES)})$",
                json_schema_extra={"enum": list(POLICIES)},
            ),
        ] = "continue",
        max_skips: Annotated[
            int | None,
            Field(ge=0, description="with on_nan=skip: bad steps in a row before it stops"),
        ] = None,
        on_spike: Annotated[
            str | None,
            Field(
                description="with spec spike: what the job does after a loss spike",
                pattern=f"^({'|'.join(POLICIES)})$",
                json_schema_extra={"enum": list(POLICIES)},
            ),
        ] = None,
        off: Annotated[bool, Field(description="stop watching")] = False,
    ) -> dict[str, Any]:
        """Switch a running job's NaN watch on (from its next backward: every step checked,
        an untraced job's NaN replayed to name the op and line) or off, as `torchscope watch`."""
        limit: dict[str, Any] = {} if max_skips is None else {"max_skips": max_skips}
        if on_spike is not None:
            limit["on_spike"] = on_spike
        _ask(jobs, job, "watch", spec=None if off else spec, on_nan=on_nan, **limit)
        if off:
            return {"watch": None, "said": "stops watching for NaN at its next backward()"}
        return {
            "watch": spec,
            "on_nan": on_nan,
            "said": f"watches every step from its next backward() ({spec}, then {on_nan}); "
            "its reports go to its stderr, its trace file and the alerts of a recording",
        }

    @tool()
    async def record(
        output: Annotated[str, Field(description="trace file to write (.tsc)", min_length=1)],
        job: Job = None,
        next: Annotated[int, Field(ge=1, le=10_000, description="steps to record")] = 3,
        timeout: Annotated[
            float, Field(gt=0, le=600, description="seconds to wait for the steps")
        ] = 120.0,
        aten: Annotated[
            str | None, Field(description='also every aten call ("": all; a module regex)')
        ] = None,
        overwrite: Annotated[bool, Field(description="replace an existing file")] = False,
    ) -> dict[str, Any]:
        """Arm a running job for its next N steps and record them into a trace file, as
        `torchscope record JOB --next N`; the job goes dormant again after. Waits for the N
        steps (at most `timeout`; then the file holds what came). Answers with the file's
        steps and its NaN/Inf origins."""
        path = os.path.abspath(os.path.expanduser(output))
        if os.path.exists(path) and not overwrite:
            raise Refusal(f"{output} exists: give another path, or overwrite=true")
        text = None if job is None else str(job).strip() or None
        try:
            found = await anyio.to_thread.run_sync(lambda: ep.resolve(text))
        except EndpointError as exc:
            raise Refusal(str(exc)) from None
        who = str(found.pid) if found.pid else found.control
        args = [sys.executable, "-m", "torchscope", "record", who, "-o", path]
        args += ["--next", str(next), "--quiet", "--timeout", "10"]
        if aten is not None:
            args += [f"--aten={aten}"]
        said, stopped = await _run_recorder(args, min(timeout, record_timeout_cap))
        if not os.path.exists(path):
            raise Refusal(said or f"record: nothing was written to {output}")
        rec = await anyio.to_thread.run_sync(lambda: recordings.get(path))
        steps = await anyio.to_thread.run_sync(
            lambda: views.steps_view(rec.step_table_events(), limit=views.MAX_LIMIT)
        )
        alerts = await anyio.to_thread.run_sync(
            lambda: views.alerts_view({rec.rank: rec.alerts()}, limit=10)
        )
        out: dict[str, Any] = {
            "output": path,
            "said": said,
            "traced_steps": [s["step"] for s in steps["steps"]],
            "alerts": alerts["alerts"],
            "alerts_total": alerts["total"],
        }
        if stopped:
            out["waited"] = (
                f"waited {timeout:g} s for {next} traced steps of {who}: stopped "
                "before they all came (a slow or stalled job); the file holds what came"
            )
        return out

    # -- recordings and live jobs: what happened ---------------------------------------------
    @tool()
    def steps(target: Target, offset: Offset = 0, limit: Limit = 50) -> dict[str, Any]:
        """The traced steps of a recording or live job (the UI's step list): ops, backward
        nodes, alerts, loss and global gradient norm of each."""
        src = source(target)
        return {
            **source_summary(src),
            **views.steps_view(src.step_table_events(), offset=offset, limit=limit),
        }

    @tool()
    def alerts(
        target: Annotated[
            str | int,
            Field(
                description="a recording, several ranks' recordings as a glob "
                "(t.rank*.tsc), or a live job (pid or control endpoint)"
            ),
        ],
        step: Annotated[int | None, Field(ge=0, description="only this step")] = None,
        offset: Offset = 0,
        limit: Limit = 20,
    ) -> dict[str, Any]:
        """Where NaN/Inf first appeared: one alert per origin (op, module, source file:line,
        step, rank) with its consequences counted, origins first; over several ranks, the
        job's origins and the ranks each reached. A loss spike the watch caught is one too
        (`what: spike`): its `message` is the spike's line, `spike` its figures (loss,
        grad_norm, their medians and spreads over the window, `lead`, `on_spike`)."""
        text = str(target).strip()
        if looks_like_job(text):
            srcs: list[Any] = [source(text)]
        else:
            try:
                srcs = recordings.many(text)
            except SourceError as exc:
                raise Refusal(str(exc)) from None
        by_rank: dict[int | None, list] = {}
        for i, src in enumerate(srcs):
            found = src.alerts()
            key = src.rank if src.rank is not None else (None if len(srcs) == 1 else -1 - i)
            by_rank.setdefault(key, []).extend(found)
        out = views.alerts_view(by_rank, step=step, offset=offset, limit=limit)
        notes = [n for s in srcs for n in s.notes()]
        head: dict[str, Any] = {"target": text}
        if notes:
            head["notes"] = notes
        if not out["total"]:
            head["note"] = "no NaN/Inf or spike alert" + (
                f" in step {step}" if step is not None else ""
            )
        return {**head, **out}

    @tool()
    def events(
        target: Target,
        step: Step,
        search: Annotated[
            str | None,
            Field(
                description="regex, as the UI's /: every row stays, matches marked, the "
                "page starts at the first",
                max_length=1000,
            ),
        ] = None,
        filter: Annotated[
            str | None,
            Field(
                description="regex, as the UI's filter (|): only matching rows stay",
                max_length=1000,
            ),
        ] = None,
        kind: Annotated[
            Literal["op", "grad"] | None,
            Field(description="op: forward ops only; grad: backward nodes only"),
        ] = None,
        offset: Annotated[int | None, Field(ge=0, description="first row of the page")] = None,
        limit: Limit = 50,
    ) -> dict[str, Any]:
        """A step's timeline: its forward ops then its backward nodes, in order, a page of
        rows (seq, name, module, source file:line, what came out, NaN/Inf). search and filter
        match each shown field on its own (name, module, parameter, source), case-insensitive,
        as in the UI. Use a row's seq with `event` and `graph`."""
        src = source(target)
        evs = src.step_events(step)
        if not evs:
            raise Refusal(f"{src.label} has no events of step {step} (see steps)")
        rows = views.rows_view(
            evs, step, search=search, filter=filter, kind=kind, offset=offset, limit=limit
        )
        return {**source_summary(src), **rows}

    @tool()
    def event(
        target: Target,
        step: Step,
        seq: Annotated[int, Field(ge=0, description="the event's seq (from events or alerts)")],
    ) -> dict[str, Any]:
        """One op or backward node in full, both sides: an op's inputs and outputs (shape,
        dtype, stats, first values) and the nodes it created; a node's grad_outputs (what
        arrived), grad_inputs (what it sends on, and to which node) and the op that made it."""
        src = source(target)
        return {**source_summary(src), **views.event_view(src.step_events(step), seq)}

    @tool()
    def graph(
        target: Target,
        step: Step,
        seq: Annotated[int | None, Field(ge=0, description="an op's or a node's event seq")] = None,
        node: Annotated[int | None, Field(ge=0, description="a backward node id")] = None,
        depth: Annotated[int, Field(ge=1, le=6, description="links each way")] = 2,
    ) -> dict[str, Any]:
        """The backward graph around an event: the nodes within `depth` links toward the
        loss and toward the parameters, each with the gradient that arrived, what it sent on,
        where NaN/Inf was made, and whether it ran."""
        if (seq is None) == (node is None):
            raise Refusal("give seq (an op or a node's event) or node (a node id), one of them")
        src = source(target)
        return {
            **source_summary(src),
            **views.graph_view(src.step_events(step), seq=seq, node=node, depth=depth),
        }

    @tool()
    def diff(
        a: Annotated[str, Field(description="recording A", min_length=1)],
        b: Annotated[str, Field(description="recording B", min_length=1)],
        rtol: Annotated[float, Field(ge=0)] = 1e-5,
        atol: Annotated[float, Field(ge=0)] = 1e-8,
        exact: Annotated[bool, Field(description="bit for bit")] = False,
        strict_dtype: Annotated[bool, Field(description="a float dtype change diverges")] = False,
        steps: Annotated[list[int] | None, Field(description="only these steps")] = None,
        max_lines: Annotated[int, Field(ge=1, le=200, description="report lines")] = 40,
    ) -> dict[str, Any]:
        """Compare two recordings, as `torchscope diff`: the first op or backward node where
        they diverge (structure, NaN/Inf counts or stats beyond the tolerances), both sides,
        and how far they drift apart per module and step."""
        for p in (a, b):
            if not os.path.isfile(os.path.expanduser(p)):
                raise Refusal(f"{p}: no such recording")
        opts = Options(
            rtol=rtol,
            atol=atol,
            exact=exact,
            strict_dtype=strict_dtype,
            steps=set(steps) if steps else None,
        )
        res, notes, lines = diff_files(os.path.expanduser(a), os.path.expanduser(b), opts)
        if opts.steps is not None and not (res.matched or res.only_a or res.only_b):
            raise Refusal(f"neither recording has step(s) {sorted(opts.steps)}")
        out: dict[str, Any] = {
            "same": res.same,
            "matched": res.matched,
            "only_a": res.only_a,
            "only_b": res.only_b,
            "divergences": len(res.divergences),
            "report": lines[:max_lines],
        }
        first = res.first
        if first is not None:
            out["first"] = {
                "what": first.what,
                "step": first.step,
                "structural": first.structural,
                "a": _side(first.a),
                "b": _side(first.b),
            }
        if len(lines) > max_lines:
            out["report_shown"] = f"{max_lines} of {len(lines)} lines"
        if notes:
            out["notes"] = notes
        return out

    # -- a live job this server holds: breakpoints and stepping ------------------------------
    @tool()
    async def state(
        job: Job = None,
        wait: Annotated[
            float, Field(ge=0, le=600, description="seconds to wait for a pause (0: none)")
        ] = 0.0,
    ) -> dict[str, Any]:
        """The job's stepper: where it is paused (op or node, phase, source, stack), its
        breakpoints; with wait, waits for a pause (a breakpoint hit) first."""
        link = await _link(jobs, job)
        await _call(link.request, "state")
        waited = None
        if wait and link.paused is None:
            waited = await _wait_pause(link, None, wait, "a pause (a breakpoint hit)")
        return _stepper(link, waited)

    @tool()
    async def breakpoint_set(
        spec: Annotated[
            str,
            Field(
                description="conditions joined by ',': nan, inf, anynan, op:REGEX, "
                "module:REGEX, aten:REGEX, line:FILE:LINE, gradnorm:X, step:N, from:N",
                min_length=1,
                max_length=1000,
            ),
        ],
        job: Job = None,
    ) -> dict[str, Any]:
        """Set a breakpoint on a live job, as the UI's B (the --break-on syntax): the job
        stops at the first op or node where all conditions hold (nan: where NaN first
        appears). Holds the job: traced from its next step while this server runs."""
        try:
            fields = parse_break_spec(spec)
        except BreakpointError as exc:
            raise Refusal(str(exc)) from None
        link = await _link(jobs, job)
        await _call(link.hold)
        await _call(link.request, "break_add", **fields)
        return _stepper(link)

    @tool()
    async def breakpoint_clear(
        job: Job = None,
        id: Annotated[int | None, Field(ge=1, description="breakpoint id; omitted: all")] = None,
    ) -> dict[str, Any]:
        """Delete a breakpoint (by id, from state) or all of them."""
        link = await _link(jobs, job)
        await _call(link.request, "break_list")
        ids = [b.get("id") for b in link.stepper.breakpoints] if id is None else [id]
        for bp in ids:
            await _call(link.request, "break_delete", bp=bp)
        return _stepper(link)

    @tool()
    async def pause(
        job: Job = None,
        timeout: Annotated[float, Field(gt=0, le=600, description="seconds to wait")] = 15.0,
    ) -> dict[str, Any]:
        """Pause a live job at its next op or node (the UI's space), and wait until it is
        paused. Holds the job (traced while this server runs)."""
        link = await _link(jobs, job)
        await _call(link.hold)
        await _call(link.request, "state")
        if link.paused is not None:
            return {**_stepper(link), "said": "already paused"}
        await _call(link.request, "pause")
        waited = await _wait_pause(
            link, None, timeout, "the job to pause at its next traced op or node"
        )
        return _stepper(link, waited)

    async def _resume(cmd: str, job: Any, wait: float, what: str) -> dict[str, Any]:
        link = await _link(jobs, job)
        await _call(link.hold)
        before = pause_key(link.paused)
        await _call(link.request, cmd)
        if wait:
            waited = await _wait_pause(link, before, wait, what)
        else:
            waited = None
            await _wait_resumed(link, before)
        return _stepper(link, waited)

    @tool()
    async def step(
        job: Job = None,
        timeout: Annotated[float, Field(gt=0, le=600, description="seconds to wait")] = 15.0,
    ) -> dict[str, Any]:
        """Run one op or node (the UI's s) and wait until the job pauses after it."""
        return await _resume("step", job, timeout, "the job to pause after one op or node")

    @tool()
    async def next_(
        job: Job = None,
        timeout: Annotated[float, Field(gt=0, le=600, description="seconds to wait")] = 60.0,
    ) -> dict[str, Any]:
        """Run to the next training step (the UI's n) and wait until the job pauses there."""
        return await _resume("next", job, timeout, "the job to reach its next training step")

    @tool(name="continue")
    async def continue_(
        job: Job = None,
        wait: Annotated[
            float, Field(ge=0, le=600, description="seconds to wait for the next pause (0: none)")
        ] = 0.0,
    ) -> dict[str, Any]:
        """Continue (the UI's c): the job runs to its next breakpoint; with wait, waits for
        that pause."""
        return await _resume("continue", job, wait, "the next breakpoint hit")

    @tool()
    async def values(
        group: Annotated[
            Literal["inputs", "outputs", "grad_outputs", "grad_inputs"],
            Field(description="which side of the paused event"),
        ],
        job: Job = None,
        index: Annotated[int, Field(ge=0, le=100_000, description="which tensor")] = 0,
        start: Annotated[int, Field(ge=0, description="first flat index")] = 0,
        count: Annotated[int, Field(ge=1, le=1000, description="how many values")] = 100,
    ) -> dict[str, Any]:
        """The values of one tensor of the event the job is paused at (the UI's v), a flat
        slice; NaN and Inf spelled out."""
        link = await _link(jobs, job)
        if link.paused is None:
            await _call(link.request, "state")
        if link.paused is None:
            raise Refusal(f"{link.label} is not paused")
        reply = await _call(
            link.request, "inspect", group=group, index=index, start=start, count=count
        )
        return {
            k: reply.get(k)
            for k in ("group", "index", "shape", "dtype", "numel", "start", "values")
        }

    @tool()
    async def evaluate(
        expr: Annotated[
            str,
            Field(
                max_length=1000,
                description="a Python expression over the paused event's tensors: x, out, "
                "args, kwargs (an op); grad_inputs, grad_outputs (a node); module, torch, F",
            ),
        ],
        job: Job = None,
        group: Annotated[
            Literal["inputs", "outputs", "grad_outputs", "grad_inputs"] | None,
            Field(description="the tensor x names (default: the event's main one)"),
        ] = None,
        index: Annotated[int, Field(ge=0, le=100_000, description="which tensor")] = 0,
        count: Annotated[int, Field(ge=0, le=1000, description="values to return")] = 16,
        budget_s: Annotated[
            float | None,
            Field(
                gt=0,
                le=3600,
                description="seconds it may run before it is interrupted (default: the "
                "job's budget, 10 s unless it was started with another)",
            ),
        ] = None,
    ) -> dict[str, Any]:
        """Evaluate a Python expression in the job at its pause (the UI's p), on its training
        thread under no_grad: a tensor's summary and first values, or a bounded repr; an
        exception as its one line. The expression is code run in the job, as in pdb. One
        that runs past its budget, or that nobody waits for any more (this call cancelled,
        release), is interrupted: "interrupted after N s", the pause as it was."""
        from torchscope.protocol.expressions import answer_text

        link = await _link(jobs, job)
        if link.paused is None:
            await _call(link.request, "state")
        if link.paused is None:
            raise Refusal(f"{link.label} is not paused")
        where: dict[str, Any] = {"group": group, "index": index} if group is not None else {}
        if budget_s is not None:
            where["budget"] = budget_s
        reply = await _call(link.request, "evaluate", expr=expr, count=count, **where)
        task = reply.get("pending")
        budget = budget_s or (link.state or {}).get("eval_budget_s") or 10.0
        # The budget ends it; a call into C++ may hold it longer: then it is let go of.
        deadline = time.monotonic() + float(budget) + 30.0
        try:
            while reply.get("pending") and time.monotonic() < deadline:
                await anyio.sleep(0.2)
                reply = await _call(link.request, "evaluate", poll=task)
        finally:
            if reply.get("pending"):  # nobody waits for it any more: the job lets it go
                with anyio.CancelScope(shield=True), suppress(JobError):
                    reply = await _call(link.request, "evaluate", cancel=task)
        out = {
            k: reply.get(k) for k in ("expr", "summary", "values", "repr", "error", "x", "took_s")
        }
        out["text"] = answer_text(reply)
        if reply.get("interrupted"):
            out["interrupted"] = True
        if reply.get("pending"):
            out["pending"] = True
        return {k: v for k, v in out.items() if v is not None}

    @tool()
    async def release(job: Job = None) -> dict[str, Any]:
        """Let a job go, as quitting the UI: it goes dormant at its next step boundary (unless
        others hold it), this server's breakpoints and pauses with it."""
        link = await _link(jobs, job)
        before = pause_key(link.paused)
        await _call(link.release)
        await _call(link.request, "state")
        await _wait_resumed(link, before)
        if link.paused is not None and (link.state or {}).get("paused") is None:
            link.stepper.clear()  # the job says it runs: the pause this server saw is over
        return {**_stepper(link), "said": f"{link.label} let go"}

    return server


# -- helpers -----------------------------------------------------------------------------------
async def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def _link(jobs: Jobs, job: Any) -> JobLink:
    link = await _call(jobs.get, job)
    if link.gone:
        raise Refusal(link.gone)
    return link


async def _wait_pause(link: JobLink, before: Any, timeout: float, what: str) -> str | None:
    """Wait until the job is paused at a pause other than ``before``; None when it is, else
    one line saying what was waited for. Asks the job's state a few times a second too (a
    pause event may be lost on a slow reader)."""
    deadline = time.monotonic() + timeout
    asked = 0.0
    while True:
        paused = link.paused
        if paused is not None and pause_key(paused) != before:
            return None
        gone = link.gone
        if gone:
            raise Refusal(f"{gone} while waiting for {what}")
        now = time.monotonic()
        if now >= deadline:
            return f"waited {timeout:g} s for {what}: not paused yet (the job is running)"
        if now - asked >= 0.25:
            asked = now
            with suppress(JobError):
                await _call(link.request, "state", timeout=2.0)
            continue
        await anyio.sleep(0.05)


async def _wait_resumed(link: JobLink, before: Any, within: float = 3.0) -> None:
    """Until the pause ``before`` has ended (a reply's state may show it for a few more
    milliseconds: the job resumes right after it answers); at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while before is not None and pause_key(link.paused) == before:
        if link.gone or time.monotonic() >= deadline:
            return
        with suppress(JobError):
            await _call(link.request, "state", timeout=2.0)
        await anyio.sleep(0.05)


def _stepper(link: JobLink, waited: str | None = None) -> dict[str, Any]:
    out = {**link.status(), **views.pause_view(link.state, link.paused, link.stepper)}
    if waited:
        out["waited"] = waited
    return out


def _side(ev: Any) -> dict[str, Any] | None:
    if not isinstance(ev, dict):
        return None
    return {
        k: ev.get(k)
        for k in ("seq", "step", "kind", "name", "node", "module", "param", "source")
        if ev.get(k) not in (None, "")
    }


def _ask(jobs: Jobs, job: Any, cmd: str, **fields: Any) -> dict[str, Any]:
    """One command to a job: through this server's link to it when there is one, else a
    short connection (as the CLI's commands)."""
    text = None if job is None else str(job).strip() or None
    try:
        record = ep.resolve(text)
    except EndpointError as exc:
        raise Refusal(str(exc)) from None
    link = next((k for k in jobs.known() if k.record.control == record.control), None)
    if link is not None and link.gone is None:
        return link.request(cmd, timeout=10.0, **fields)
    with SessionClient() as client:
        client.connect(record, timeout=5.0)
        return client.request(cmd, timeout=10.0, **fields)


def _ls_row(rec: ep.SessionRecord, link: JobLink | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "pid": rec.pid,
        "rank": rec.rank,
        "script": rec.script,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.started)),
        "control": rec.control,
    }
    if rec.job is not None:
        row["job"] = rec.job
        row["world_size"] = rec.world_size
    try:
        with SessionClient() as client:
            hello = client.connect(rec, timeout=1.0)
            row["step"] = hello.get("step")
            row["tracing"] = hello.get("tracing") or "traced"
            try:
                latest = client.request("history", timeout=1.0, max_points=0).get("latest")
            except (SessionUnreachable, SessionRefused):
                latest = None
            if isinstance(latest, dict) and latest.get("loss") is not None:
                row["loss"] = latest["loss"]
    except (SessionUnreachable, SessionRefused, EndpointError) as exc:
        row["unreachable"] = " ".join(str(exc).split())
    row["held"] = link is not None and link.held
    return row


async def _run_recorder(args: list[str], timeout: float) -> tuple[str, bool]:
    """Run ``torchscope record``: its last stderr line, and whether it was stopped at the
    timeout (SIGTERM: it closes its file complete and lets the job go dormant)."""
    stopped = False
    async with await anyio.open_process(
        args,
        stdin=None,
        stdout=None,
        stderr=-1,  # subprocess.PIPE
    ) as proc:
        chunks: list[bytes] = []

        async def read() -> None:
            assert proc.stderr is not None
            async for chunk in proc.stderr:
                chunks.append(chunk)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            with anyio.move_on_after(timeout) as scope:
                await proc.wait()
            if scope.cancelled_caught:
                stopped = True
                proc.send_signal(signal.SIGTERM)
                with anyio.move_on_after(15):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    text = b"".join(chunks).decode(errors="replace").strip().splitlines()
    said = text[-1] if text else ""
    if said.startswith("torchscope: error: "):
        raise Refusal("record: " + said.removeprefix("torchscope: error: "))
    return said.removeprefix("torchscope: "), stopped


def main() -> int:
    """``torchscope mcp``: serve on stdin/stdout until the agent closes them."""
    build_server().run("stdio")
    return 0
