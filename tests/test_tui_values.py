"""Issue 12: values shown with their shape (the rows of the last dimension; of the last two
for N-D tensors) and ``!``, the first NaN/Inf: in the small values a recording keeps, and
searched page by page through a paused job's tensor."""

from __future__ import annotations

import math

from tui_pilot import SIZE, sync, until

from torchscope.protocol.events import Event
from torchscope.session.format import first_bad, index_text, value_rows
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.fakejob import FakeJob
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource

NAN = math.nan


def test_value_rows_follow_the_last_dimension():
    rows = value_rows(list(range(12)), [3, 4])
    assert [(label, flat, len(v)) for label, flat, v in rows] == [
        ("[0,:]", 0, 4),
        ("[1,:]", 4, 4),
        ("[2,:]", 8, 4),
    ]
    # N-D: the rows of the last two dims, led by the leading index
    assert [r[0] for r in value_rows(list(range(12)), [2, 2, 3])] == [
        "[0,0,:]",
        "[0,1,:]",
        "[1,0,:]",
        "[1,1,:]",
    ]
    # a slice that starts inside a row, and a row wider than a line
    assert [r[0] for r in value_rows(list(range(6)), [4, 5], start=3)] == ["[0,3:]", "[1,:]"]
    assert [r[0] for r in value_rows(list(range(10)), [10], per_line=4)] == [
        "[:]",
        "[4:]",
        "[8:]",
    ]
    assert first_bad([1.0, 2.0, NAN, math.inf]) == 2 and first_bad([1.0]) is None
    assert index_text(6, [2, 4]) == "[1,2]" and index_text(6, None) == "[6]"


def with_small_nan() -> tuple[list[Event], int]:
    """The synthetic trace with one op whose [2,3] output is recorded in full, NaN at [1,1]."""
    trace = make_trace(2, 2)
    op = next(e for e in trace if e.get("kind") == "op" and e.get("step") == 0)
    out = dict(op["outputs"][0])
    out["shape"] = [2, 3]
    out["values"] = [0.5, 1.5, 2.5, 3.5, NAN, 5.5]
    out["stats"] = {**out.get("stats", {}), "nan": 1}
    op["outputs"] = [out]
    return trace, op["seq"]


@sync
async def test_recorded_values_show_as_rows_and_bang_names_the_first_nan():
    trace, seq = with_small_nan()
    app = TorchscopeApp(ScriptedSource(trace, mode="replay"))
    notes: list[str] = []
    notify = app.notify
    app.notify = lambda m, *a, **k: (notes.append(str(m)), notify(m, *a, **k))
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await until(pilot, lambda: main.timeline.row_count() > 0)
        await pilot.press("colon", *f"#{seq}", "enter")
        await until(
            pilot, lambda: main.detail.event is not None and main.detail.event["seq"] == seq
        )
        body = str(main.detail.body.render())
        lines = body.splitlines()
        row0 = next(line for line in lines if "[0,:]" in line)
        row1 = next(line for line in lines if "[1,:]" in line)
        assert row0.split("[0,:]")[1].split() == ["0.5", "1.5", "2.5"]
        assert row1.split("[1,:]")[1].split() == ["3.5", "nan", "5.5"]
        assert row0.index("[0,:]") == row1.index("[1,:]")  # one under the other
        assert "first NaN/Inf at [1,1] (flat 4)" in body
        await pilot.press("exclamation_mark")
        assert notes[-1] == "first NaN/Inf: outputs[0] at [1,1]"
        from torchscope.tui.keys import key

        assert "first NaN/Inf" in key("!").help


class BigTensorJob(FakeJob):
    """A job paused after an op whose output is a [1000, 300] tensor with one NaN."""

    NAN_AT = 234_567

    def _inspect(self, group: str, index: int, start: int = 0, count: int = 1000) -> dict:
        numel = 1000 * 300
        end = min(numel, start + count)
        values = [NAN if i == self.NAN_AT else float(i % 7) for i in range(start, end)]
        return {
            "group": group,
            "index": index,
            "shape": [1000, 300],
            "dtype": "float32",
            "numel": numel,
            "start": start,
            "values": values,
        }


@sync
async def test_bang_while_paused_searches_the_tensor_page_by_page_and_shows_the_row():
    trace = make_trace(2, 2)
    op = next(e for e in trace if e.get("kind") == "op" and e.get("step") == 1)
    out = dict(op["outputs"][0])
    out["shape"] = [1000, 300]
    out["stats"] = {**out.get("stats", {}), "nan": 1}
    out.pop("values", None)
    op["outputs"] = [out]
    job = BigTensorJob(trace, pause_at=op["seq"])
    app = TorchscopeApp(job)
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await until(pilot, lambda: app.store.stepper.paused is not None, what="pause")
        await pilot.press("exclamation_mark")
        await until(
            pilot,
            lambda: (
                main.values is not None
                and main.values.result is not None
                and main.values.result.get("start") == 234_300
            ),
            what="the page with the NaN",
        )
        starts = [f["start"] for c, f in job.received if c == "inspect"]
        assert starts == [0, 100_000, 200_000, 234_300]
        assert main.values.mark == BigTensorJob.NAN_AT
        await until(pilot, lambda: main.detail.values_version == main.values.version, what="shown")
        text = str(main.detail.values_box.render())
        assert "[781,:]" in text  # 234_567 = 781 * 300 + 267
        assert "first NaN/Inf of this slice: [781,267]" in text


# -- the Steps panel's loss and |g|, live ------------------------------------------------------


@sync
async def test_live_steps_show_loss_and_grad_norm_as_a_recording_does():
    from torchscope.session.countpass import Counter

    trace = make_trace(4, 2, nan_step=2)
    counter = Counter()
    counter.add(trace)
    counts, _ = counter.take()
    losses = counter.take_losses()
    src = ScriptedSource(trace[: len(trace) // 2])  # live
    app = TorchscopeApp(src)
    async with app.run_test(size=SIZE) as pilot:
        store, steps = app.store, app.main.steps
        await until(pilot, lambda: store.overview_version > 0, what="an overview")
        src.feed(trace[len(trace) // 2 :])  # the rest streams in later
        await until(pilot, lambda: len(store.order) == 4 and store.steps[3].grad_norm is not None)
        await until(
            pilot,
            lambda: (
                store.steps[3].last_seq == trace[-1]["seq"] and not store.steps[3].backward_open
            ),
            what="the whole trace",
        )
        for step in range(4):
            info = store.steps[step]
            want = math.sqrt(counts[step][5]) if counts[step][6] else None
            if want is None or not math.isfinite(want):
                assert info.grad_norm == want or not math.isfinite(info.grad_norm)
            else:
                assert math.isclose(info.grad_norm, want), step
            assert (info.loss, info.loss_rank) == tuple(losses[step]) or (
                math.isnan(info.loss) and math.isnan(losses[step][0])
            )
        assert "loss" in steps.render_header(40)[0][0] and "|g|" in steps.render_header(40)[0][0]
        await until(pilot, lambda: steps.border_subtitle.startswith("|g| "), what="sparkline")
        assert "!" in steps.border_subtitle  # the NaN step stands out
