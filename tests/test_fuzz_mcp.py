"""The MCP tools fuzzed with generated arguments (wrong types, huge and negative numbers,
huge strings, unicode, huge pages, fields missing or extra), through the SDK's own client,
on a real recording and on a real job paused at a breakpoint: every call answers (data) or
refuses in one line under its tool's name, never a crash; the job's pause holds through all
of it, and once let go the job goes on exactly as a run never paused (bit-identical losses).

Examples are few and derandomized (the same every run); waits are on conditions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp")
pytest.importorskip("torch")

from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client
from test_evaluate_interrupt import LossJob
from test_mcp import DORMANT, recording  # noqa: F401 (a fixture)

from torchscope.mcp.server import build_server
from torchscope.protocol.policies import POLICIES

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)

# -- generated values -------------------------------------------------------------------------
BIG = 2**70
huge_text = st.integers(1001, 200_000).map(lambda n: ("é" * n)[:n])
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-BIG, BIG),
    st.sampled_from([-1, -(2**63), 2**63, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    huge_text,
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
# Numbers out of every tool's range (pydantic's lax mode turns "5" and True into numbers).
bad_seconds = st.sampled_from([0, -1, -0.0, 601, 1e308, float("nan"), float("inf"), "soon", []])
bad_count = st.sampled_from([0, -1, -(2**63), 10**6, BIG, 1.5, "3x", None, {}])
# Never a pid of a live process (pid_max is at most 2**22), never empty (the only job).
bad_job = st.one_of(
    st.integers(-BIG, -1),
    st.integers(2**40, BIG),
    st.text(min_size=1, max_size=40).filter(lambda s: s.strip() and not s.strip().isdigit()),
    st.sampled_from(["²", "\u0661\u0662x", "-5", "1e3", "0x10", "ipc://", "tcp://", "📈"]),
    huge_text,
    st.floats(allow_nan=True),
    st.lists(st.integers(), max_size=2),
)
# Expressions that may not parse, run or name anything, but never call a function nor
# multiply (no "(": nothing is called; no "*": no 9**9**9 computed in C, beyond interrupting).
expr_text = st.text(
    alphabet=st.characters(blacklist_characters="(*@<", blacklist_categories=["Cs"]),
    max_size=60,
)
exprs = st.one_of(
    st.sampled_from(
        ["x", "out", "args[0]", "x.shape", "1/0", "x[10**6]", "grad_inputs", "module", "x +"]
    ),
    expr_text,
    huge_text,
    junk,
)
groups = st.sampled_from(["inputs", "outputs", "grad_outputs", "grad_inputs", "x", "", "ÿ"])
regexes = st.one_of(st.text(max_size=20), st.sampled_from(["(", "a{99999}", "[", "\\"]), huge_text)
extras = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda k: k.isidentifier()), junk, max_size=2
)


def field(good: st.SearchStrategy, bad: st.SearchStrategy = junk) -> st.SearchStrategy:
    return st.one_of(good, good, bad)


def call(name: str, required: dict, optional: dict, forced: dict | None = None):
    """A call of tool ``name``: each field good or bad, optional ones often left out, a
    required one sometimes missing, extra fields sometimes; ``forced``: a field that is
    always bad (a tool that would otherwise go on or change the job)."""

    @st.composite
    def build(draw: Any) -> tuple[str, dict]:
        args = {}
        for key, strategy in required.items():
            if draw(st.integers(0, 9)):
                args[key] = draw(strategy)
        for key, strategy in optional.items():
            if draw(st.booleans()):
                args[key] = draw(strategy)
        if forced:
            key = draw(st.sampled_from(sorted(forced)))
            args[key] = draw(forced[key])
        args.update(draw(extras) if draw(st.integers(0, 4)) == 0 else {})
        return name, args

    return build()


def recording_calls(path: str) -> st.SearchStrategy:
    target = field(st.just(path), bad_job | st.sampled_from(["/", "/dev/null", "*", "x.tsc"]))
    step = field(st.integers(0, 5), bad_count)
    page = {"offset": field(st.integers(0, 10**9), bad_count), "limit": field(st.integers(1, 200))}
    return st.one_of(
        call("steps", {"target": target}, page),
        call("alerts", {"target": target}, {"step": step, **page}),
        call(
            "events",
            {"target": target, "step": step},
            {
                "search": regexes,
                "filter": regexes,
                "kind": field(st.sampled_from(["op", "grad"])),
                **page,
            },
        ),
        call("event", {"target": target, "step": step, "seq": field(st.integers(0, 10**6))}, {}),
        call(
            "graph",
            {"target": target, "step": step},
            {
                "seq": field(st.integers(0, 300)),
                "node": field(st.integers(0, 300)),
                "depth": field(st.integers(1, 6)),
            },
        ),
        call(
            "diff",
            {"a": target, "b": target},
            {"rtol": junk, "atol": junk, "exact": junk, "steps": junk, "max_lines": junk},
        ),
    )


def job_calls(pid: int, where: str) -> st.SearchStrategy:
    """Calls that must leave the job paused where it is: reads and expressions with any
    arguments; what would go on or change it, always with one bad field."""
    job = field(st.just(pid), bad_job)
    target = field(st.just(str(pid)), bad_job)
    step = field(st.integers(0, 40), bad_count)
    return st.one_of(
        call("state", {}, {"job": job, "wait": field(st.sampled_from([0, 0.01]), bad_seconds)}),
        call(
            "values",
            {"group": field(groups)},
            {
                "job": job,
                "index": field(st.integers(0, 100_000)),
                "start": junk,
                "count": field(st.integers(1, 1000), bad_count),
            },
        ),
        call(
            "evaluate",
            {"expr": exprs},
            {
                "job": job,
                "group": field(groups),
                "index": field(st.integers(0, 100_000)),
                "count": field(st.integers(0, 1000), bad_count),
                "budget_s": field(st.sampled_from([0.5, 5.0, 3600]), bad_seconds),
            },
        ),
        call("history", {}, {"job": job, "since": junk, "last": field(st.integers(1, 500))}),
        call("steps", {"target": target}, {"offset": junk, "limit": junk}),
        call("alerts", {"target": target}, {"step": step, "limit": junk}),
        call("events", {"target": target, "step": step}, {"search": regexes, "limit": junk}),
        call("event", {"target": target, "step": step, "seq": junk}, {}),
        call("graph", {"target": target, "step": step}, {"seq": junk, "node": junk}),
        call("pause", {}, {"job": job, "timeout": field(st.just(0.5), bad_seconds)}),
        call("breakpoint_set", {"spec": field(regexes)}, {"job": job}),
        call("breakpoint_clear", {}, {"job": job}, {"id": st.integers(-BIG, 0) | bad_count}),
        call("step", {}, {"job": job}, {"timeout": bad_seconds, "job": bad_job}),
        call("next", {}, {"job": job}, {"timeout": bad_seconds, "job": bad_job}),
        call("continue", {}, {"job": job}, {"wait": bad_seconds, "job": bad_job}),
        call("release", {}, {}, {"job": bad_job}),
        call(
            "watch",
            {},
            {"job": job, "spec": field(st.just("nan")), "off": junk},
            {
                "on_nan": st.text(max_size=10).filter(lambda s: s not in POLICIES) | junk,
                "max_skips": bad_count,
                "job": bad_job,
            },
        ),
        call(
            "record",
            {"output": field(st.just(where))},
            {"job": job},
            {"next": bad_count, "timeout": bad_seconds, "job": bad_job},
        ),
    )


# -- the property -----------------------------------------------------------------------------
class Tools:
    """The server's tools called from synchronous code (hypothesis'), through the SDK's
    in-memory client on a portal's event loop."""

    def __init__(self, portal: Any, client: Client) -> None:
        self.portal = portal
        self.client = client

    def __call__(self, name: str, args: dict) -> tuple[bool, Any]:
        """(True, data) for an answer; (False, its line) for a refusal, checked."""
        result = self.portal.call(self.client.call_tool, name, args)
        text = result.content[0].text if result.content else ""
        if not result.is_error:
            assert isinstance(result.structured_content, dict), (name, args, text[:300])
            assert len(text) < 2_000_000, (name, len(text))  # bounded, whatever was asked
            return True, result.structured_content
        assert "\n" not in text and text.startswith(f"{name}: "), (name, args, text[:500])
        assert "Traceback" not in text and "internal error" not in text, (name, args, text)
        assert len(text) <= 1100, (name, len(text))
        return False, text


def pause_of(state: dict) -> tuple:
    """Where the job is paused: its step, the event and its side (an op paused before it
    runs has no seq yet)."""
    p = state["paused"] or {}
    return tuple(p.get(k) for k in ("step", "phase", "name", "reason", "seq", "source"))


def with_tools(fn: Any) -> None:
    with start_blocking_portal() as portal:
        server = portal.wrap_async_context_manager(Client(build_server(), mode="legacy"))
        with server as client:
            fn(Tools(portal, client))


def test_fuzzed_arguments_on_a_recording(recording: Path) -> None:  # noqa: F811
    def go(tools: Tools) -> None:
        @FUZZ
        @given(recording_calls(str(recording)))
        def fuzz(tool_call: tuple[str, dict]) -> None:
            tools(*tool_call)

        fuzz()
        ok, alerts = tools("alerts", {"target": str(recording)})  # still read as before
        assert ok and alerts["alerts"][0]["op"] == "torch.sqrt", alerts

    with_tools(go)


def test_fuzzed_arguments_on_a_paused_job_leave_it_untouched(tmp_path: Path) -> None:
    job = LossJob(tmp_path)
    try:
        job.wait_losses(2)

        def go(tools: Tools) -> None:
            ok, _ = tools("breakpoint_set", {"job": job.pid, "spec": r"op:^torch\.log$"})
            assert ok
            ok, hit = tools("continue", {"job": job.pid, "wait": 120})
            assert ok and hit["paused"]["name"] == "torch.log", hit
            where = pause_of(hit)
            printed = len(job.losses)

            @settings(FUZZ, max_examples=80)
            @given(job_calls(job.pid, str(tmp_path / "rec.tsc")))
            def fuzz(tool_call: tuple[str, dict]) -> None:
                tools(*tool_call)
                ok, state = tools("state", {"job": job.pid})
                assert ok and pause_of(state) == where, (tool_call, state, "".join(job.err))

            fuzz()
            assert len(job.losses) == printed  # it never went on
            ok, asked = tools("evaluate", {"job": job.pid, "expr": "x.numel() + 1"})
            assert ok and asked["text"] == "33", asked  # the pause answers as before
            assert tools("breakpoint_clear", {"job": job.pid})[0]
            assert tools("release", {"job": job.pid})[0]

        with_tools(go)
        job.wait_losses(len(job.losses) + 3)
    finally:
        job.stop()
    assert not any("Traceback" in line for line in job.err), "".join(job.err)[-3000:]
    job.assert_as_never_paused(tmp_path)


@pytest.mark.parametrize("text", ["\u00b2", "\u0661\u0662", "\U0001d7e0"])
def test_digits_that_are_not_ascii_name_no_job(text: str) -> None:
    """ "²".isdigit() is true and int("²") fails: such a target is refused, in one line."""
    from torchscope.protocol import endpoints as ep
    from torchscope.protocol.breakpoints import BreakpointError, parse_break_spec
    from torchscope.protocol.expressions import ExpressionError, parse_target

    with pytest.raises(ep.EndpointError, match="cannot tell which session"):
        ep.resolve(text)
    with pytest.raises(ep.EndpointError, match="needs a port"):
        ep.check_bind_address(f"tcp://127.0.0.1:{text}")
    with pytest.raises(BreakpointError, match="FILE:LINE"):
        parse_break_spec(f"line:train.py:{text}")
    with pytest.raises(ExpressionError, match="cannot edit"):
        parse_target(f"grad_inputs[{text}]")
