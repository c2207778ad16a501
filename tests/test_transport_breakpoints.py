"""Breakpoint patterns cannot stall the job, nor its control replies.

What a user is promised: whatever regex a UI or ``--break-on`` gives, evaluating it costs the
training thread at most a bounded time per distinct op name / module path (the verdict is
cached), a pattern longer than 256 characters or one that needs backtracking is refused in
one line, and the job answers control requests within milliseconds while it runs.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from live_events import session_event

from torchscope.protocol import breakpoints as bpmod
from torchscope.protocol import endpoints as ep
from torchscope.protocol.breakpoints import (
    BEFORE,
    Breakpoint,
    BreakpointError,
    SafePattern,
    parse_break_spec,
)
from torchscope.protocol.client import SessionClient
from torchscope.tracer.publisher import EventPublisher
from torchscope.tracer.stepper import Stepper, stepping_commands

CATASTROPHIC = r"^(.|.)*X$"  # 2^n ways to fail on a name of n characters without an X


def names(n: int, length: int = 24) -> list[str]:
    """``n`` distinct op-like names of ``length`` characters, none ending in X."""
    return [f"torch.nn.functional.{i:05d}".ljust(length, "_")[:length] for i in range(n)]


def op(name: str, module: str = "blocks.0.attn", step: int = 0) -> dict:
    return {"kind": "op", "name": name, "module": module, "step": step}


# -- the matcher ---------------------------------------------------------------------------------
def test_catastrophic_pattern_over_many_ops_is_fast() -> None:
    bp = Breakpoint.from_spec(1, {"op": CATASTROPHIC, "module": r"^(\w|\w)*\.X$"})
    events = [op(n, module=f"blocks.{i % 50}.attn.proj") for i, n in enumerate(names(200))]
    t0 = time.perf_counter()
    hits = sum(bp.static_match(e) for _ in range(50) for e in events)  # 10,000 op checks
    elapsed = time.perf_counter() - t0
    assert hits == 0
    # Python's re needs minutes here (2^24 paths per name); linear matching, milliseconds.
    assert elapsed < 20, f"10,000 checks took {elapsed:.2f} s"  # milliseconds on a quiet machine
    assert bp.static_match(op("aten.someX", module="blocks_1.X"))  # still matches what it should


def test_each_distinct_name_is_matched_once(monkeypatch) -> None:
    runs: list[str] = []
    real = SafePattern._run

    def counting(self, text):
        runs.append(text)
        return real(self, text)

    monkeypatch.setattr(SafePattern, "_run", counting)
    bp = Breakpoint.from_spec(1, {"op": "^Tensor\\.div$"})
    for _ in range(100):
        for name in ("Tensor.div", "Tensor.mul", "F.linear"):
            bp.static_match(op(name))
    assert sorted(runs) == ["F.linear", "Tensor.div", "Tensor.mul"]


def test_verdict_cache_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(bpmod, "MAX_CACHED_VERDICTS", 100)
    pattern = SafePattern("a")
    for i in range(1000):
        pattern.search(f"name{i}")
        assert len(pattern._cache) <= 100


def test_long_and_backtracking_patterns_are_refused_in_one_line() -> None:
    for spec, match in [
        ({"op": "a" * 257}, "257 characters long; the limit is 256"),
        ({"module": "(x|y)" * 60}, "the limit is 256"),
        ({"op": r"(a)\1"}, "backreferences are not supported"),
        ({"op": r"Tensor(?=\.)"}, "lookahead/lookbehind are not supported"),
        ({"op": r"(?<!F)\.linear"}, "lookahead/lookbehind are not supported"),
        ({"op": r"(a{50}){50}"}, "too complex"),
        ({"op": "("}, "bad op regex"),
    ]:
        with pytest.raises(BreakpointError, match=re.escape(match)) as err:
            Breakpoint.from_spec(1, spec)
        assert "\n" not in str(err.value)
    assert Breakpoint.from_spec(1, {"op": "a" * 256})  # at the limit: fine
    with pytest.raises(BreakpointError, match="the limit is 256"):
        parse_break_spec("op:" + "a" * 300)  # --break-on says the same


PATTERNS = [
    r"^Tensor\.div$",
    r"^blocks\.3\.",
    r"Backward0$",
    "linear|conv",
    r"(?i)LINEAR",
    r"(?i:lin)ear",
    r"\bmul\b",
    r"^(\w+\.)+\w+$",
    r"[^a-z]+\d",
    r"(ab|a)(c|bcd)(d*)",
    r"^$",
    r"a{2,3}b",
    r"(?:a|b)+?c",
    r"\Aab\Z",
    r"(?s)a.b",
    r"(?m)^b$",
    r"x*",
    r"(a|)+b",
    r"^(.|.)*X$",
    r"[\d_]{2}",
    "é|\u212a",
]


# Python's own (backtracking) re takes 2**len(text) steps on these: compared on short texts.
EXPONENTIAL_IN_RE = {r"^(.|.)*X$", r"(a|)+b"}


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abcdXlinearLINEAR._0123 \n\u212aké", max_size=30))
def test_matches_what_python_re_matches(text: str) -> None:
    for pattern in PATTERNS:
        t = text[:12] if pattern in EXPONENTIAL_IN_RE else text
        assert SafePattern(pattern).search(t) == bool(re.search(pattern, t)), pattern


# -- the job -------------------------------------------------------------------------------------
@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch):
    base = Path(tempfile.mkdtemp(prefix="tsbp-", dir="/tmp"))
    monkeypatch.setenv(ep.ENV_RUNTIME_DIR, str(base / "run"))
    monkeypatch.delenv(ep.ENV_BIND, raising=False)
    yield base / "run"
    shutil.rmtree(base, ignore_errors=True)


def test_control_replies_stay_fast_under_catastrophic_breakpoints(rt: Path) -> None:
    """A UI adds ``op:^(.|.)*X$`` over the wire while the training thread checks every op
    against it; pings keep coming back in milliseconds and the job keeps its pace."""
    stepper = Stepper(lease_seconds=5.0)
    pub = EventPublisher(session_event())
    pub.commands.update(stepping_commands(stepper, lambda: 0))
    pub.start()
    client = SessionClient()
    stop = threading.Event()
    checked = [0]
    try:
        client.connect(None, timeout=30)
        client.request("break_add", op=CATASTROPHIC)
        client.request("break_add", op="^F\\.linear$", module=r"^(.|.)*X$")
        all_names = names(300)

        def train() -> None:
            i = 0
            while not stop.is_set():
                name = all_names[i % len(all_names)]
                assert stepper.should_pause(BEFORE, op(name, module=name)) is None
                i += 1
                checked[0] = i

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        worst = 0.0
        for _ in range(30):
            worst = max(worst, client.ping(timeout=5))
            time.sleep(0.01)
        stop.set()
        trainer.join(10)
        assert not trainer.is_alive()
        # Answered while the training thread checks ops (a starved publisher thread would
        # answer at the ping's 5 s timeout, or not at all); about 10 ms on a quiet machine.
        assert worst < 2.5, f"a ping took {worst:.2f} s"
        assert checked[0] > 1000, f"the training thread checked only {checked[0]} ops"
    finally:
        stop.set()
        client.close()
        pub.close()
