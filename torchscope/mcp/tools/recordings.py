"""What happened, in a recording or a live job this server follows: its ``steps``, its
``alerts`` (where NaN/Inf first appeared, a loss spike), a step's ``events``, one ``event`` in
full, the backward ``graph`` around one; ``diff`` of two recordings."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Field

from torchscope.analysis.diff import Options, diff_files
from torchscope.mcp import views
from torchscope.mcp.sources import SourceError, looks_like_job, source_summary
from torchscope.mcp.tools.context import Limit, Offset, Refusal, Step, Target, ToolContext


def register(ctx: ToolContext) -> None:
    tool, recordings = ctx.tool, ctx.recordings

    @tool()
    def steps(target: Target, offset: Offset = 0, limit: Limit = 50) -> dict[str, Any]:
        """The traced steps of a recording or live job (the UI's step list): ops, backward
        nodes, alerts, loss and global gradient norm of each."""
        src = ctx.source(target)
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
            srcs: list[Any] = [ctx.source(text)]
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
        src = ctx.source(target)
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
        src = ctx.source(target)
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
        src = ctx.source(target)
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


def _side(ev: Any) -> dict[str, Any] | None:
    if not isinstance(ev, dict):
        return None
    return {
        k: ev.get(k)
        for k in ("seq", "step", "kind", "name", "node", "module", "param", "source")
        if ev.get(k) not in (None, "")
    }
