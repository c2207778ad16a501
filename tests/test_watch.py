"""The always-on NaN watch: the check, the capture, the replay that names the origin, and the
promise that the job goes on exactly as it would have without the watch."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optim_mod
from watching import bits, data, line_of, watch

import torchscope
from torchscope.tracer import backward_calls
from torchscope.tracer.armed.session import current_tracer
from torchscope.tracer.watch.nan_watch import NanWatch, WatchStop
from torchscope.tracer.watch.report import short_source

ORIGINAL_AUTOGRAD_BACKWARD = torch.autograd.backward
ORIGINAL_TENSOR_BACKWARD = torch.Tensor.backward


def _hook_counts() -> tuple[int, ...]:
    return (
        len(module_mod._global_forward_pre_hooks),
        len(module_mod._global_forward_hooks),
        len(optim_mod._global_optimizer_pre_hooks),
        len(optim_mod._global_optimizer_post_hooks),
    )


@pytest.fixture(autouse=True)
def _clean():
    torch.set_num_threads(1)
    before = _hook_counts()
    yield
    assert current_tracer() is None
    assert torch._C._len_torch_function_stack() == 0
    assert _hook_counts() == before
    assert torch.autograd.backward is ORIGINAL_AUTOGRAD_BACKWARD
    assert torch.Tensor.backward is ORIGINAL_TENSOR_BACKWARD


# -- models ----------------------------------------------------------------------------------
class SqrtNet(nn.Module):
    """NaN in the forward: sqrt of a negative, at the step whose batch has one."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        gate = self.drop(x.abs() + 1.0)  # finite numbers that show the dropout mask
        r = torch.sqrt(x)  # NaN where x < 0
        return self.lin(r * gate)


class DivGrad(torch.autograd.Function):
    """Identity forward; backward divides by ``d``: Inf where ``d`` is 0."""

    @staticmethod
    def forward(ctx, x, d):
        ctx.save_for_backward(d)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (d,) = ctx.saved_tensors
        return g / d, None


class DivGradNet(nn.Module):
    """A backward-only origin inside a module."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4) if bn else nn.Identity()
        self.lin2 = nn.Linear(4, 2)

    def forward(self, x, d):
        h = self.bn(self.lin1(x))
        h = DivGrad.apply(h, d)  # Inf in the backward where d == 0
        return self.lin2(h)


class NormNet(nn.Module):
    """A backward-only origin inside a module: the norm of a zero row (sqrt at 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.lin2 = nn.Linear(5, 2)

    def forward(self, x, mask):
        h = self.lin1(x) * mask
        norm = torch.sqrt(h.pow(2).sum(1, keepdim=True))  # Inf in the backward at 0
        return self.lin2(torch.cat([h, norm], 1))


def positive(step: int) -> torch.Tensor:
    x = data(step, 8, 4).abs() + 0.1
    if step == 3:
        x[2, 1] = -1.0
    return x


def divisor(step: int) -> torch.Tensor:
    d = data(step + 50, 8, 4).abs() + 0.5
    if step == 3:
        d[1, 2] = 0.0
    return d


def norm_loop(model, step):
    mask = torch.ones(8, 1)
    if step == 3:
        mask[5] = 0.0
    return model(data(step, 8, 4), mask).pow(2).mean()


def sqrt_loop(model, step):
    return model(positive(step)).pow(2).mean()


def divgrad_loop(model, step):
    return model(data(step, 8, 4), divisor(step)).pow(2).mean()


def sqrt_at_zero_loop(model, step):
    """Loop code outside any module: sqrt(0) is fine forward, Inf in its backward."""
    out = model(data(step, 8, 4))
    mask = torch.zeros(8, 3) if step == 3 else torch.ones(8, 3)
    energy = (out * mask).pow(2).sum()
    return torch.sqrt(energy)  # backward: Inf at sqrt(0)


def train(model_fn, loop, steps: int, *, ctx=None, seed: int = 0, after_step=None):
    torch.manual_seed(seed)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with ctx if ctx is not None else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            loss = loop(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if after_step is not None:
                after_step(step, model)
    return losses, model


def first_alert(tr, step: int, where: str):
    return next(a for a in tr.alerts if a.step == step and a.where == where)


def quiet() -> list[str]:
    return []


# -- tests -----------------------------------------------------------------------------------
def test_the_replay_runs_at_the_aten_level_and_names_the_kernel():
    w, _ = watch()
    train(SqrtNet, sqrt_loop, 4, ctx=w)
    (det,) = w.detections
    assert det["origin"] == "torch.sqrt" and det["aten"] == "aten.sqrt.default"
    assert det["alert"]["message"].startswith(
        "NaN first appears in aten.sqrt.default inside torch.sqrt (forward) at "
    )


def test_forward_origin_found_by_replay_as_full_tracing_finds_it():
    _, _ = train(SqrtNet, sqrt_loop, 4, ctx=(tr := torchscope.trace()))
    full = first_alert(tr, 3, "forward")
    w, lines = watch()
    train(SqrtNet, sqrt_loop, 4, ctx=w)
    (det,) = w.detections
    assert det["step"] == 3 and det["what"] == "nan" and det["reproduced"] is True
    assert (det["origin"], det["where"], det["source"]) == (full.name, "forward", full.source)
    assert det["origin"] == "torch.sqrt"
    assert det["source"] == line_of(SqrtNet.forward, "torch.sqrt(x)")
    assert det["unit_gradient"] is False
    (line,) = lines
    # the replay ran at the aten level: the line names the kernel, then the op
    assert line.startswith(
        "torchscope: NaN first appears at step 3 in aten.sqrt.default inside torch.sqrt "
        "(forward) in model (SqrtNet) at "  # the root's own code: the name train() binds it to
    )
    assert line.endswith("— replayed") and "test_watch.py:" in line
    # the replay was recorded: forward and backward events of step 3, marked as a replay
    events = w.last_replay.events
    assert events and all(e.get("replay") for e in events)
    assert any(e["kind"] == "op" and e["name"] == "torch.sqrt" for e in events)
    assert any(e["kind"] == "grad" for e in events)
    assert all(e["step"] == 3 for e in events if e["kind"] in ("op", "grad", "alert"))


@pytest.mark.parametrize(
    ("net", "loop", "node", "needle", "kernel_line"),
    [
        (NormNet, norm_loop, "SqrtBackward0", "torch.sqrt(h.pow(2)", None),
        # a custom Function's node belongs to its apply call; the replay, at the aten level,
        # also sees the line of its backward that made the value
        (DivGradNet, divgrad_loop, "DivGradBackward", "DivGrad.apply(h, d)", "g / d"),
    ],
)
def test_backward_origin_inside_a_module_same_node_and_line_as_full_tracing(
    net, loop, node, needle, kernel_line
):
    train(net, loop, 4, ctx=(tr := torchscope.trace()))
    full = first_alert(tr, 3, "backward")
    assert full.name == node
    assert full.source == line_of(net.forward, needle)
    w, lines = watch()
    train(net, loop, 4, ctx=w)
    det = w.detections[0]
    assert (det["step"], det["origin_what"], det["reproduced"]) == (3, full.what, True)
    assert (det["origin"], det["where"]) == (full.name, "backward")
    if kernel_line is None:
        assert det["source"] == full.source
    else:
        assert det["source"] == line_of(DivGrad.backward, kernel_line)
    assert det["outside_modules"] is False
    noun = "NaN" if full.what == "nan" else "Inf"
    kernel = f"{det['aten']} inside " if det["aten"] else ""
    assert det["aten"]
    assert lines[0].startswith(
        f"torchscope: {noun} first appears at step 3 in {kernel}{node} (backward)"
    )


def test_backward_origin_in_loop_code_found_over_the_retained_graph():
    train(lambda: nn.Linear(4, 3), sqrt_at_zero_loop, 4, ctx=(tr := torchscope.trace()))
    full = first_alert(tr, 3, "backward")
    assert full.name == "SqrtBackward0"
    w, lines = watch()
    train(lambda: nn.Linear(4, 3), sqrt_at_zero_loop, 4, ctx=w)
    det = w.detections[0]
    assert (det["step"], det["where"], det["origin"]) == (3, "backward", full.name)
    assert det["origin_what"] == full.what == "inf"
    assert det["reproduced"] is True and det["outside_modules"] is True
    # no line for a node made by untraced loop code, but the backward() call that ran it
    assert det["source"] is None
    assert "outside the module calls" in lines[0] and "backward() at" in lines[0]


def test_forward_nan_in_loop_code_is_named_at_its_op_and_line():
    """The loop is not re-run, but its ops were recorded as the step ran them: the watch names
    the op and line of the loop code that made the loss NaN (the replayed model is finite)."""

    def loop(model, step):
        mse = model(data(step, 8, 4)).pow(2).mean()
        return torch.sqrt(mse - (100.0 if step == 2 else 0.0))  # NaN in the forward at step 2

    w, lines = watch()
    train(lambda: nn.Linear(4, 3), loop, 3, ctx=w)
    (det,) = w.detections
    assert det["step"] == 2 and det["in_loss"] and det["reproduced"] is True
    assert det["where"] == "forward" and det["outside_modules"] is True
    assert det["origin"] == "torch.sqrt" and det["source"] == line_of(loop, "torch.sqrt(")
    assert "in torch.sqrt (forward) at " in lines[0] and "training loop's code" in lines[0]


class RootMeanSquare(nn.Module):
    """A loss module: its own top-level call, replayed on its own."""

    def forward(self, pred, shift):
        return torch.sqrt(pred.pow(2).mean() - shift)  # NaN when shift is too big


def test_model_and_loss_module_each_replayed_from_its_own_inputs():
    crit = RootMeanSquare()

    def loop(model, step):
        out = model(data(step, 8, 4)) * 2.0  # loop code between the two calls
        return crit(out, torch.tensor(1e3 if step == 3 else 0.0))

    train(lambda: nn.Linear(4, 3), loop, 4, ctx=(tr := torchscope.trace()))
    full = first_alert(tr, 3, "forward")
    w, _ = watch()
    lw, _model = train(lambda: nn.Linear(4, 3), loop, 5, ctx=w)  # roots are held weakly
    lp, _ = train(lambda: nn.Linear(4, 3), loop, 5)
    assert bits(lw) == bits(lp)
    assert {type(m).__name__ for m in w.roots} == {"Linear", "RootMeanSquare"}
    det = w.detections[0]
    assert (det["step"], det["origin"], det["where"]) == (3, "torch.sqrt", "forward")
    assert det["source"] == full.source == line_of(RootMeanSquare.forward, "torch.sqrt")
    assert det["notes"] == []


@pytest.mark.parametrize("keep", [False, "auto"])
def test_without_the_graph_loop_code_is_placed_not_replayed(keep):
    """The gradient at the model's output was already Inf (the loss was finite): the origin
    is loop code. "auto" keeps the graph from then on, and names the node the next time."""

    def loop(model, step):
        return sqrt_at_zero_loop(model, 3 if step in (3, 6) else step)

    w, lines = watch(keep_graph=keep)
    train(lambda: nn.Linear(4, 3), loop, 4, ctx=w)
    det = w.detections[0]
    assert det["step"] == 3 and det["reproduced"] is False and det["outside_modules"] is True
    assert "in the backward, outside the module calls" in lines[0]
    assert w.keeping is (keep == "auto")

    torch.manual_seed(0)
    w, lines = watch(keep_graph=keep)
    model = nn.Linear(4, 3)
    with w:
        for step in range(7):
            model.zero_grad()
            loop(model, step).backward()
            w.before_update()  # no optimizer: the job calls the check itself
    found = [d for d in w.detections if d["reproduced"]]
    if keep == "auto":
        assert [(d["step"], d["origin"]) for d in found] == [(6, "SqrtBackward0")]
    else:
        assert found == []


def test_dropout_replay_uses_the_steps_rng():
    """The replay's dropout mask is the step's own: its ops carry the very numbers a fully
    traced run shows for that step; and the job's RNG is where it was."""
    train(lambda: SqrtNet(0.5), sqrt_loop, 4, ctx=(tr := torchscope.trace()))
    w, _ = watch()
    losses_w, _ = train(lambda: SqrtNet(0.5), sqrt_loop, 6, ctx=w)
    losses_0, _ = train(lambda: SqrtNet(0.5), sqrt_loop, 6)
    assert bits(losses_w) == bits(losses_0)
    det = w.detections[0]
    assert det["step"] == 3 and det["origin"] == "torch.sqrt"

    def stats(events, step):
        return [
            (e["name"], e["outputs"][0]["stats"])
            for e in events
            if e["kind"] == "op" and e["step"] == step and e["name"].endswith("dropout")
        ]

    full = stats(tr.events, 3)
    assert full and stats(det["events"], 3) == full


def test_batchnorm_stats_and_grads_are_bit_identical_after_a_replay():
    seen: dict[str, list] = {"watched": [], "plain": []}

    def keep(into):
        def after(step, model):
            into.append([b.clone() for b in model.bn.buffers()])

        return after

    w, _ = watch()
    lw, _ = train(
        lambda: DivGradNet(bn=True), divgrad_loop, 5, ctx=w, after_step=keep(seen["watched"])
    )
    lp, _ = train(lambda: DivGradNet(bn=True), divgrad_loop, 5, after_step=keep(seen["plain"]))
    assert w.detections and w.detections[0]["step"] == 3
    assert w.detections[0]["reproduced"] is True
    assert bits(lw) == bits(lp)
    for a, b in zip(seen["watched"], seen["plain"], strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.view(-1).view(torch.uint8).equal(
                y.view(-1).view(torch.uint8)
            )


def test_grads_untouched_by_the_replay():
    grads: dict[str, list] = {"watched": [], "plain": []}
    keep = {}

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            keep["grads"].append([p.grad.clone() for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    for name, ctx in (("watched", watch()[0]), ("plain", None)):
        keep["grads"] = grads[name]
        torch.manual_seed(0)
        model = DivGradNet()
        opt = Spy(model.parameters(), lr=0.05)
        with ctx if ctx is not None else contextlib.nullcontext():
            for step in range(4):
                opt.zero_grad()
                divgrad_loop(model, step).backward()
                opt.step()
        if ctx is not None:
            assert ctx.detections[0]["step"] == 3
    for a, b in zip(grads["watched"], grads["plain"], strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.view(torch.int32).equal(y.view(torch.int32))


class Mixed(nn.Module):
    """Dropout, BatchNorm, a loss module: everything the watch has to leave as it found it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(6, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 3)
        )

    def forward(self, x):
        return self.net(x)


def test_losses_bit_identical_when_nothing_goes_wrong():
    crit = nn.CrossEntropyLoss()

    def loop(model, step):
        target = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(step))
        return crit(model(data(step, 16, 6)), target)

    w, lines = watch()
    lw, mw = train(Mixed, loop, 6, ctx=w)
    lp, mp = train(Mixed, loop, 6)
    assert bits(lw) == bits(lp)
    assert w.detections == [] and lines == []
    assert w.steps_checked == 6
    assert {type(m).__name__ for m in w.roots} == {"Mixed", "CrossEntropyLoss"}
    for a, b in zip(mw.state_dict().values(), mp.state_dict().values(), strict=True):
        assert a.equal(b)


def test_losses_bit_identical_through_a_detection():
    w, lines = watch()
    lw, _ = train(lambda: SqrtNet(0.2), sqrt_loop, 6, ctx=w)
    lp, _ = train(lambda: SqrtNet(0.2), sqrt_loop, 6)
    assert bits(lw) == bits(lp)
    # the update wrote NaN into the weights: the later steps are bad too, counted, not
    # replayed again
    (det,) = w.detections
    assert (det["step"], det["repeats"], det["last_step"]) == (3, 2, 5)
    assert len(lines) == 2 and lines[1] == (
        "torchscope: NaN/Inf from step 3 lasted 3 checked steps (to step 5; reported once)"
    )


def test_a_nan_the_replay_cannot_reproduce_is_reported_as_such():
    """The batch is overwritten in place after backward(): the replay sees other numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w, lines = watch()
    buf = torch.empty(8, 4)
    with w:
        for step in range(3):
            buf.copy_(data(step, 8, 4))
            if step == 2:
                buf[0, 0] = float("nan")
            opt.zero_grad()
            model(buf).sum().backward()
            buf.copy_(data(99, 8, 4))  # the next batch is prefetched into the same buffer
            opt.step()
    (det,) = w.detections
    assert det["step"] == 2 and det["what"] == "nan" and det["reproduced"] is False
    assert "changed in place after its call" in " ".join(det["notes"])
    (line,) = lines
    assert "did not reproduce" in line and "origin unknown" in line


def test_stop_raises_before_the_update_and_pause_without_a_ui_continues():
    torch.manual_seed(0)
    model = SqrtNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w, lines = watch(on_nan="stop")
    with w, pytest.raises(WatchStop) as info:
        for step in range(5):
            opt.zero_grad()
            sqrt_loop(model, step).backward()
            before = [p.clone() for p in model.parameters()]
            opt.step()
    assert info.value.detection["step"] == 3 and info.value.exit_code == 3
    assert all(p.equal(b) for p, b in zip(model.parameters(), before, strict=True))
    assert lines[0] == str(info.value)

    w, lines = watch(on_nan="pause")
    train(SqrtNet, sqrt_loop, 4, ctx=w)
    assert w.detections[0]["reproduced"] is True
    assert "no UI or stepper" in " ".join(w.detections[0]["notes"])


def test_gradnorm_threshold():
    w, lines = watch(gradnorm=1e-6)
    train(lambda: nn.Linear(4, 3), lambda m, s: m(data(s, 8, 4)).pow(2).mean(), 2, ctx=w)
    (det,) = w.detections
    assert det["what"] == "gradnorm" and det["repeats"] == 1
    assert lines[0].startswith("torchscope: gradient norm ") and "at step 0" in lines[0]


def test_remove_leaves_nothing_behind():
    torch.manual_seed(0)
    model = SqrtNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _hook_counts()
    w = NanWatch(report=lambda s: None).install()
    assert torch.autograd.backward is not ORIGINAL_AUTOGRAD_BACKWARD
    for step in range(2):
        opt.zero_grad()
        sqrt_loop(model, step).backward()
        opt.step()
    assert w.roots == [model] and model._forward_pre_hooks and model._forward_hooks
    w.remove()
    assert _hook_counts() == before
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert torch.autograd.backward is ORIGINAL_AUTOGRAD_BACKWARD
    assert torch.Tensor.backward is ORIGINAL_TENSOR_BACKWARD
    assert not backward_calls.installed()
    assert w.captured.calls == [] and w.captured.backwards == []


def test_errors_inside_the_watch_never_reach_the_job(capsys):
    def broken(text):
        raise RuntimeError("report sink is broken")

    w = NanWatch(report=broken)
    losses, _ = train(SqrtNet, sqrt_loop, 4, ctx=w)
    assert len(losses) == 4 and w.detections[0]["reproduced"] is True
    assert "internal error in the NaN watch (reporting)" in capsys.readouterr().err


def test_a_traced_run_and_a_watched_run_can_nest():
    """The watch replays under its own tracer even inside a fully traced run."""
    w, _ = watch()
    with torchscope.trace() as tr:
        train(SqrtNet, sqrt_loop, 4, ctx=w)
    assert w.detections[0]["origin"] == "torch.sqrt"
    assert first_alert(tr, 3, "forward").name == "torch.sqrt"


def test_nan_on_the_first_step_is_replayed_from_the_discovery_capture():
    """Step 0 is captured by the global hooks that find the top-level modules, keyword
    arguments included."""

    def loop(model, step):
        x = data(step, 8, 4).abs() + 0.1
        if step == 0:
            x[0, 0] = -1.0
        return model(x=x).pow(2).mean()

    w, _ = watch()
    _, model = train(SqrtNet, loop, 2, ctx=w)
    det = w.detections[0]
    assert (det["step"], det["origin"], det["reproduced"]) == (0, "torch.sqrt", True)
    assert w.roots == [model]
    del model
    assert w.roots == []  # held weakly: a watch never keeps a model alive


def test_a_model_call_that_raises_on_the_first_step_leaves_the_watch_working(recwarn):
    """After a forward that raised, torch calls global always_call hooks without the keyword
    arguments they asked for: the watch must take that call, not raise in it (torch would
    warn) and lose count of the module calls in progress."""

    def loop(model, step):
        if step == 0:
            with contextlib.suppress(RuntimeError):
                model(torch.ones(8, 5))  # the wrong width: Linear raises inside the forward
        return sqrt_loop(model, step)

    w, _ = watch()
    _, model = train(SqrtNet, loop, 4, ctx=w)
    assert not [str(r.message) for r in recwarn if "forward hook" in str(r.message)]
    (det,) = w.detections
    assert (det["step"], det["origin"], det["where"]) == (3, "torch.sqrt", "forward")
    assert det["reproduced"] is True and w.roots == [model]


def hand_train(steps: int, ctx, idle_optimizer: bool = False) -> tuple[list[float], nn.Module]:
    """word_language_model's loop: no optimizer, the update written out after backward().
    ``idle_optimizer``: one is built (for its state dict, a scheduler) and never stepped."""
    torch.manual_seed(0)
    model = SqrtNet()
    idle = torch.optim.SGD(model.parameters(), lr=0.05) if idle_optimizer else None
    losses = []
    with ctx:
        for step in range(steps):
            loss = sqrt_loop(model, step)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
            losses.append(loss.item())
    del idle
    return losses, model


def watched_loop_code(made) -> tuple[NanWatch, list[str]]:
    """Three watched steps of a Linear whose loss the loop's own code passes through
    ``made`` at step 1."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w, lines = watch()
    with w:
        for step in range(3):
            loss = model(torch.ones(2, 4)).pow(2).mean()
            if step == 1:
                loss = made(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w, lines


def test_a_python_scalar_nan_of_the_loop_code_is_named_at_its_op():
    """``loss * float("nan")``: the op given the NaN made it (a NaN is never on purpose)."""
    w, lines = watched_loop_code(lambda loss: loss * float("nan"))
    det = w.detections[0]
    assert not [n for n in det["notes"] if "replay failed" in n], det["notes"]
    assert det["outside_modules"] and det["step"] == 1
    assert "NaN first appears at step 1 in Tensor.mul (forward) at " in lines[0]


@pytest.mark.parametrize(
    ("made", "op"),
    [(lambda loss: loss / torch.zeros(()), "Tensor.div"),
     (lambda loss: torch.log(loss * 0), "torch.log")],
    ids=["div", "log"],
)  # fmt: skip
def test_a_loss_the_loop_code_made_infinite_is_named_in_the_forward(made, op):
    """``loss / 0`` and ``log(0)`` in loop code: their backward nodes make Inf from a finite
    gradient, yet the Inf was the loss's first: the forward's loop code made it, at its op (the
    node would only be where the backward shows it)."""
    w, lines = watched_loop_code(made)
    det = w.detections[0]
    assert det["step"] == 1 and det["where"] == "forward" and det["outside_modules"]
    assert lines[0].startswith(f"torchscope: Inf first appears at step 1 in {op} (forward) at ")


def nan_batch_loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        x = torch.ones(2, 4)
        if step == 1:
            x[0, 0] = float("nan")  # a bad batch
        loss = model(x).pow(2).mean()  # the model's call
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_an_op_of_torchs_own_modules_is_placed_at_the_users_call_not_at_the_replay():
    """F.linear inside nn.Linear has no line of the user's own: a traced run names the line
    that called the model. The replay runs under optimizer.step(), and named that line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w, lines = watch()
    with w:
        nan_batch_loop(model, opt, 3)
    det = w.detections[0]
    assert det["where"] == "input" and "of torch.nn.functional.linear" in det["origin"]
    assert det["source"] == line_of(nan_batch_loop, "# the model's call")
    assert lines[0].endswith(f"at {short_source(det['source'])} — replayed")


def test_a_job_that_updates_by_hand_is_checked_after_each_backward():
    """With no optimizer, the check runs when backward() ends: the gradients complete and the
    weights not yet updated (under torchscope run it never ran at all: a silent watch)."""
    gc.collect()  # optimizers of earlier tests, if any are still waiting to be freed
    plain, _ = hand_train(5, contextlib.nullcontext())
    w, lines = watch(backward_checks=True)  # as the agent's watch (torchscope run --watch)
    losses, _ = hand_train(5, w)
    assert bits(losses) == bits(plain)
    (det,) = w.detections
    assert (det["step"], det["origin"], det["where"]) == (3, "torch.sqrt", "forward")
    assert det["reproduced"] is True
    assert lines[0].startswith(
        "torchscope: NaN first appears at step 3 in aten.sqrt.default inside torch.sqrt"
    )

    stopping, _ = watch(on_nan="stop", backward_checks=True)
    with pytest.raises(WatchStop):
        hand_train(5, stopping)  # out of step 3's backward(), before its update


def test_a_job_that_updates_by_hand_beside_an_optimizer_it_never_steps_is_checked_too():
    """An optimizer that exists but never steps made the watch wait for a step() that never
    came: silent on a NaN. The weights written between two backward() calls give the loop
    away (gradient accumulation leaves them alone); steps keep the loop's numbers."""
    gc.collect()
    plain, _ = hand_train(5, contextlib.nullcontext(), idle_optimizer=True)
    w, lines = watch(backward_checks=True)
    losses, _ = hand_train(5, w, idle_optimizer=True)
    assert bits(losses) == bits(plain)
    (det,) = w.detections
    assert (det["step"], det["origin"], det["where"]) == (3, "torch.sqrt", "forward")
    assert lines[0].startswith("torchscope: NaN first appears at step 3")

    stopping, _ = watch(on_nan="stop", backward_checks=True)
    with pytest.raises(WatchStop):
        hand_train(5, stopping, idle_optimizer=True)


def test_a_watched_model_can_be_deep_copied_and_pickled_without_the_watch():
    """EMA models (AveragedModel deep-copies) and torch.save(model) mid-run: the copy takes
    no part of the watch (its locks made deepcopy and pickle fail) and loads without it."""
    import copy
    import pickle

    from torch.optim.swa_utils import AveragedModel

    w, _ = watch()

    def after_step(step, model):
        if step == 1:
            AveragedModel(model)
            copied = copy.deepcopy(model)
            data = pickle.dumps(model)
            # no class of torchscope's in it: it loads where torchscope is not installed
            assert b"torchscope.tracer" not in data and b"Watch" not in data
            loaded = pickle.loads(data)
            x = positive(0)
            assert torch.equal(copied(x), model(x)) and torch.equal(loaded(x), model(x))

    losses, _ = train(SqrtNet, sqrt_loop, 5, ctx=w, after_step=after_step)
    plain, _ = train(SqrtNet, sqrt_loop, 5)
    assert bits(losses) == bits(plain)
    (det,) = w.detections  # the copies' calls are not the watched model's
    assert (det["step"], det["origin"], det["reproduced"]) == (3, "torch.sqrt", True)


def test_a_model_compiled_by_inductor_trains_under_the_watch_and_compiles_once():
    """Inductor's backward donates its buffers and refuses retain_graph: the watch does not
    ask for it on a compiled model (step 1's backward raised). The watch's search for the
    top-level modules leaves no trace in the compiled frame's guards (its global hooks are out
    while the compiled module runs): the model compiled no second time after the search."""
    torch._dynamo.reset()

    def compiled():
        torch.manual_seed(0)
        return torch.compile(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)))

    def loop(model, step):
        return model(data(step, 8, 4)).pow(2).mean()

    plain, _ = train(compiled, loop, 3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    w, _ = watch()
    losses, _ = train(compiled, loop, 3, ctx=w)
    assert bits(losses) == bits(plain) and w.steps_checked == 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def train_compiled_in_place(steps: int, *, w: NanWatch | None, watch_first: bool):
    """``SqrtNet`` compiled in place (``model.compile()``), the watch installed before the
    model is compiled or after."""
    torch.manual_seed(0)
    with contextlib.ExitStack() as stack:
        if w is not None and watch_first:
            stack.enter_context(w)
        model = SqrtNet()
        model.compile(backend="aot_eager")
        if w is not None and not watch_first:
            stack.enter_context(w)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            loss = sqrt_loop(model, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("watch_first", [True, False], ids=["watch_first", "compiled_first"])
def test_a_nan_in_a_model_compiled_in_place_is_replayed_to_its_op_and_compiles_once(
    watch_first,
):
    """``model.compile()`` sends the model's calls straight into compiled code, where no hook
    sees them: the watch listens to the compiled call itself (found when the watch starts, or
    as ``compile()`` runs), replays the call in the model's own code, and its search for the
    top-level modules leaves the compiled frame's guards alone. Afterwards nothing of it is
    left on the model or on ``nn.Module.compile``."""
    original_compile = nn.Module.compile
    torch._dynamo.reset()
    plain, _ = train_compiled_in_place(5, w=None, watch_first=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    w, _ = watch()
    losses, model = train_compiled_in_place(5, w=w, watch_first=watch_first)
    assert bits(losses) == bits(plain)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    (det,) = w.detections
    assert (det["step"], det["origin"], det["reproduced"]) == (3, "torch.sqrt", True)
    assert nn.Module.compile is original_compile
    assert type(model.__dict__["_compiled_call_impl"]).__name__ == "function"


class Holder(nn.Module):
    """A module holding the model, never called itself (as a Lightning module holds its
    network and calls it from ``training_step``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SqrtNet()
        self.net.compile(backend="aot_eager")

    def training_step(self, step: int) -> torch.Tensor:
        return sqrt_loop(self.net, step)


def test_a_model_compiled_in_place_inside_a_module_never_called_is_watched():
    """The watch finds the model compiled in place inside the module the loop holds (its
    frame's ``holder``), and its call, the step's top-level one, is captured and replayed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    holder = Holder()
    opt = torch.optim.SGD(holder.parameters(), lr=0.05)
    w, _ = watch()
    with w:
        for step in range(5):
            opt.zero_grad()
            holder.training_step(step).backward()
            opt.step()
    (det,) = w.detections
    assert (det["step"], det["origin"], det["reproduced"]) == (3, "torch.sqrt", True)


class ComplexNet(nn.Module):
    """A complex weight beside a real one (spectral layers): the watch's norms take both."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.phase = nn.Parameter(torch.ones(3, dtype=torch.complex64))

    def forward(self, x):
        return (self.lin(torch.sqrt(x)) * self.phase).abs()


def test_complex_parameters_are_watched_and_their_nan_found(capsys):
    w, _ = watch()
    train(ComplexNet, sqrt_loop, 5, ctx=w)
    assert "internal error" not in capsys.readouterr().err
    (det,) = w.detections
    assert (det["step"], det["origin"], det["what"]) == (3, "torch.sqrt", "nan")


def test_ddp_replays_the_wrapped_module_not_the_wrapper(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(SqrtNet())
        wrapper_calls = []
        handle = ddp.register_forward_pre_hook(lambda m, a: wrapper_calls.append(1))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        w, _ = watch()
        with w:
            for step in range(4):
                opt.zero_grad()
                sqrt_loop(ddp, step).backward()
                opt.step()
        handle.remove()
        assert len(wrapper_calls) == 4  # the replay ran ddp.module: no DDP forward, no collective
        assert w.roots == [ddp]
        det = w.detections[0]
        assert (det["step"], det["origin"], det["where"]) == (3, "torch.sqrt", "forward")
        assert det["source"] == line_of(SqrtNet.forward, "torch.sqrt(x)")
    finally:
        dist.destroy_process_group()


def test_pause_stops_inside_the_replay_at_the_origin():
    """With a stepper (a UI could attach), "pause" stops the replay at the origin; with no UI
    the lease lets it go on by itself."""
    from torchscope.tracer.armed.session import Tracer

    made = []

    def factory(step):
        tracer = Tracer(
            keep=True, optimizer_steps=False, optimizer_ops=True, stepping=True, lease=0.2
        )
        tracer.step_index = step
        made.append(tracer)
        return tracer.start()

    w, _ = watch(on_nan="pause", tracer_factory=factory)
    train(SqrtNet, sqrt_loop, 4, ctx=w)
    det = w.detections[0]
    assert det["paused"] is True and det["origin"] == "torch.sqrt"
    (tracer,) = made
    assert tracer.stepper.auto_resumed == 1
    (pause,) = [e for e in det["events"] if e["kind"] == "pause"]
    assert pause["event"]["name"] == "torch.sqrt" and pause["step"] == 3
    assert tracer.stepper.breakpoints == {}  # the watch's breakpoints went with the replay


def test_the_benchmark_prints_its_table():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "watch.py"
    args = ["--workload", "mlp", "--steps", "2", "--repeats", "1", "--warmup", "0"]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for row in (
        "| untraced |",
        "| serve(watch='nan'), its check skipped (diagnostic) |",
        "| watch nan (keep_graph=True) |",
        "| detect_anomaly() |",
    ):
        assert row in proc.stdout
    assert "| retained graph (saved activations a plain backward frees) |" in proc.stdout


def test_the_watch_reads_the_parameters_parameters_would_give_in_its_order():
    """The check's own walk of the modules (every step, without Module.parameters()'s name
    building) gives the same parameters, once each, in the same order: shared submodules,
    tied weights, an empty slot, several roots."""
    from torchscope.tracer.watch.nan_watch import parameters_of

    shared = torch.nn.Linear(3, 3)
    a = torch.nn.Sequential(torch.nn.Linear(2, 3), shared, torch.nn.ReLU(), shared)
    b = torch.nn.ModuleDict({"x": torch.nn.Linear(3, 2), "y": torch.nn.Sequential(shared)})
    b["z"] = torch.nn.Linear(3, 3, bias=False)  # a None slot in _parameters
    b["z"].weight = shared.weight  # tied
    every = list(dict.fromkeys(p for m in (a, b) for p in m.parameters()))
    assert [id(p) for p in parameters_of([a, b])] == [id(p) for p in every]
    assert [id(p) for p in parameters_of([a, a])] == [id(p) for p in a.parameters()]


def test_a_bad_gradient_is_named_when_other_parameters_have_none():
    """The names of the bad gradients index the parameters that have one: a frozen layer
    before them must not shift the names."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    w, _ = watch()
    with w:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            model[1].bias.grad.fill_(float("nan"))
            opt.step()
    assert w.detections and w.detections[0]["bad_params"] == ["1.bias"]


@pytest.mark.parametrize("bad", [None, "nan", "inf", "huge"])
def test_the_checks_total_over_many_small_cpu_gradients_is_their_norm(bad):
    """Many small CPU gradients are read through one flat copy: the same norm (in float64, so
    squares of large float32 values do not overflow), and a NaN or Inf anywhere shows."""
    from torchscope.tracer.watch import norms

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(16, 16, generator=g) for _ in range(20)] + [torch.randn(16)] * 20
    if bad == "huge":
        grads[7] = grads[7] * 1e30  # squares overflow float32, the norm does not
    elif bad is not None:
        grads[7] = grads[7].clone()
        grads[7][3, 4] = float(bad)
    assert len(grads) >= norms.FLAT_MIN_TENSORS
    total = norms.norm_of(grads, torch.device("cpu"))
    expected = torch.linalg.vector_norm(torch.cat([t.flatten() for t in grads]).double()).float()
    assert total.dtype == torch.float32
    if bad == "nan":
        assert total.isnan()
    elif bad == "inf":
        assert total.isinf()
    else:
        assert torch.isfinite(total)
        torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
        # and the per-tensor way (below the flat read's threshold) agrees to rounding
        per_tensor = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if bad is None:
            torch.testing.assert_close(total, per_tensor, rtol=1e-5, atol=0)
