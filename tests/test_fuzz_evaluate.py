"""The control channel's expressions fuzzed: ``evaluate``, ``edit`` and logpoints/edits at
every hit (``break_add`` with ``log``/``edit``), with generated fields, sent by a real
client holding a real job paused at a breakpoint (under ``torchscope run``). Each answers
(data) or refuses in one line, never a traceback nor an "internal error"; the pause holds
through all of it, and once let go the job goes on exactly as a run never paused
(bit-identical losses).

Examples are few and derandomized; waits are on conditions (the job's replies), never on
fixed times."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_evaluate_interrupt import LossJob

from torchscope.protocol.client import SessionClient, SessionRefused
from torchscope.protocol.codec import ProtocolError

BIG = 2**70
ints = st.one_of(st.integers(-BIG, BIG), st.sampled_from([0, 1, 2, -1, 2**31, 2**62, 2**63, 2**64]))
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 1e-9, 0.01, 5.0, 1e308]),
)
junk = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    floats,
    st.text(max_size=30),
    st.binary(max_size=10),
    st.lists(st.integers(-3, 3), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
huge_text = st.integers(1001, 100_000).map(lambda n: "é" * n)
# Expressions that may not parse, run or name anything, but never call a function nor
# multiply (no "(": nothing is called; no "*": no 9**9**9 computed in C, beyond interrupting).
safe_text = st.text(
    alphabet=st.characters(blacklist_characters="(*@<", blacklist_categories=["Cs"]),
    max_size=60,
)


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of ``choices``, each picked in proportion to its weight."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


exprs = weighted(
    (
        3,
        st.sampled_from(
            [
                "x",
                "x.sum",
                "out",
                "grad_inputs",
                "1",
                "-x",
                "x[0]",
                "x.T",
                "x[1:]",
                "args[0]",
                "x.shape",
                "1/0",
                "x[10**6]",
                "[1 for _ in x]",
                "lambda: 0",
                "outputs[0] = x",
                "grad_inputs[99] = x",
                "x = ",
            ]
        ),
    ),
    (2, st.sampled_from(["await x", "x\x00", "grad_inputs[\u00b2] = x", "[" * 300, "yield x"])),
    (3, safe_text),
    (1, huge_text),
    (1, junk),
)


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a value of the field's type and range, sometimes anything."""
    return weighted((4, strategy), (1, junk))


groups = maybe(st.sampled_from(["inputs", "outputs", "grad_outputs", "grad_inputs", "x", "a_b"]))


expression_fields = {
    "group": groups,
    "index": maybe(st.integers(0, 3)),
    "count": maybe(st.integers(0, 1000)),
    "budget": maybe(st.sampled_from([0.001, 0.5, 5.0])),
}
# Asking again for (or cancelling) an answer: rarer, as they leave every other field aside.
later_fields = {"poll": maybe(st.integers(1, 5)), "cancel": maybe(st.integers(1, 5))}
break_fields = {
    "op": maybe(st.sampled_from(["relu", "(", "^torch\\.log$", "\u00e9"])),
    "node": maybe(st.sampled_from(["Backward", "["])),
    "source": maybe(st.sampled_from(["job.py:11", "job.py:\u00b2", ":", "job.py:-1"])),
    "step": maybe(st.integers(0, 10**6)),
    "nan": maybe(st.sampled_from(["nan", "inf", "anynan", "no"])),
    "grad_norm": maybe(floats),
    "enabled": maybe(st.booleans()),
}
extras = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda k: k not in ("v", "id", "cmd")),
    junk,
    max_size=2,
)


@st.composite
def messages(draw: Any) -> tuple[str, dict]:
    cmd = draw(st.sampled_from(["evaluate", "edit", "break_add"]))
    fields: dict[str, Any] = {}
    if cmd == "break_add":
        fields[draw(st.sampled_from(["log", "edit"]))] = draw(exprs)
        choices = break_fields
    else:
        if draw(st.integers(0, 5)):
            fields["expr"] = draw(exprs)
        choices = {k: v for k, v in expression_fields.items() if cmd == "evaluate" or k != "count"}
    for key, strategy in choices.items():
        if draw(st.integers(0, 2)) == 0:
            fields[key] = draw(strategy)
    if cmd != "break_add" and draw(st.integers(0, 9)) == 0:
        key = draw(st.sampled_from(sorted(later_fields)))
        fields[key] = draw(later_fields[key])
    if draw(st.integers(0, 4)) == 0:
        fields.update(draw(extras))
    return cmd, fields


def paused_at(reply: dict) -> tuple:
    p = (reply.get("state") or {}).get("paused") or {}
    ev = p.get("event") or {}
    return p.get("step"), p.get("phase"), ev.get("name"), ev.get("seq"), p.get("since")


def one_line(text: str) -> None:
    assert "\n" not in text and "Traceback" not in text, text
    assert "internal error" not in text, text
    assert len(text) <= 2000, len(text)


def test_fuzzed_expressions_over_the_wire_leave_the_job_untouched(tmp_path: Path) -> None:
    job = LossJob(tmp_path)
    client = SessionClient()
    try:
        job.wait_losses(2)
        client.connect(str(job.pid), timeout=30)
        client.request("arm", timeout=30)
        first = client.request("break_add", timeout=30, op=r"^torch\.log$")
        (mine,) = [b["id"] for b in first["state"]["breakpoints"]]
        client.request("continue", timeout=30)
        deadline = time.monotonic() + 120
        while True:
            state = client.request("state", timeout=30)
            if state["state"].get("paused"):
                break
            assert time.monotonic() < deadline, "the job did not pause at torch.log"
            assert job.proc.poll() is None, "".join(job.err)[-3000:]
        where = paused_at(state)
        printed = len(job.losses)
        seen = {"answered": 0, "refused": 0}

        @settings(
            max_examples=120,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(messages())
        def fuzz(message: tuple[str, dict]) -> None:
            cmd, fields = message
            try:
                reply = client.request(cmd, timeout=30, **fields)
            except (SessionRefused, ProtocolError) as exc:  # the job's refusal, or the client's
                one_line(str(exc))
                seen["refused"] += 1
            else:
                seen["answered"] += 1
                task = reply.get("pending")
                while reply.get("pending"):  # a slow one: asked again until it ends
                    reply = client.request(cmd, timeout=30, poll=task)
                for key in ("error", "text", "repr"):
                    if isinstance(reply.get(key), str):
                        one_line(reply[key])
            # whatever it did, nothing stays that the job would act on later, and the pause
            # is where it was
            state = client.request("state", timeout=30)
            for bp in state["state"]["breakpoints"]:
                if bp["id"] != mine:
                    client.request("break_delete", timeout=30, bp=bp["id"])
            assert paused_at(state) == where, (message, state["state"].get("paused"))

        fuzz()
        assert seen["answered"] and seen["refused"], seen
        assert len(job.losses) == printed  # it never went on
        asked = client.request("evaluate", timeout=30, expr="x.numel() + 1")
        assert asked["text"] == "33", asked  # the pause answers as before
        client.request("break_delete", timeout=30, bp=mine)
        client.request("continue", timeout=30)
        client.request("disarm", timeout=30)
        client.close()
        job.wait_losses(printed + 3)
    finally:
        client.close()
        job.stop()
    assert not any("Traceback" in line for line in job.err), "".join(job.err)[-3000:]
    job.assert_as_never_paused(tmp_path)
