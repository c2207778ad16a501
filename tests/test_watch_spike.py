"""``--watch spike``: a loss spike caught before the update, from the figures the watch reads
each step (no extra sync), under each ``--on-spike`` policy; healthy runs never alarm."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_watch import _clean, watch  # noqa: F401  (_clean: the watch leaves nothing behind)
from test_watch_cli import run
from torch import nn
from torch.nn import functional as F
from watching import line_of

from torchscope.tracer.watch.nan_watch import WatchStop
from torchscope.tracer.watch.report import short_source
from torchscope.tracer.watch.spikes import Spikes

# -- the detector alone (no torch) ------------------------------------------------------------


def feed(spikes: Spikes, losses, grads=None) -> list[int]:
    grads = grads if grads is not None else [1.0] * len(losses)
    return [s for s, (lo, g) in enumerate(zip(losses, grads, strict=True)) if spikes.took(s, lo, g)]


def test_a_falling_loss_never_alarms_however_fast():
    losses = [10.0 * 0.5**s for s in range(60)]  # halves every step
    assert feed(Spikes(), losses, losses) == []


def test_a_flat_loss_with_a_tiny_spread_does_not_alarm_at_a_wobble():
    losses = [1.0 + 1e-6 * (s % 3) for s in range(100)] + [1.5]  # 500000 sigmas, 1.5x
    assert feed(Spikes(), losses) == []


def test_a_loss_with_a_heavy_upper_tail_does_not_alarm_within_it():
    """A loss whose batches vary with a heavy upper tail (log-normal: a regression's few hard
    samples): the spread is its upper tail's (the 95th percentile), not the median deviation
    of the rest, which the tail's steps would exceed by 6 of it (7 alarms over these 3 seeds
    that way); a step far above the tail is still a spike."""
    import random

    for seed in (1, 2, 3):
        rng = random.Random(seed)
        losses = [math.exp(rng.gauss(0.0, 0.6)) for _ in range(400)]
        assert feed(Spikes(), losses) == [], seed
        assert feed(Spikes(), [*losses, 30.0]) == [400], seed


def test_a_spike_is_caught_from_step_ten_and_kept_out_of_the_window():
    losses = [2.0 - 0.05 * s for s in range(10)] + [50.0] + [1.5] * 5
    s = Spikes()
    assert feed(s, losses) == [10]
    assert len(s) == 15  # the spiked step is not in the window


def test_non_finite_figures_are_the_nan_watchs_and_not_history():
    s = Spikes()
    for step in range(20):
        assert s.took(step, 1.0 + 0.01 * (step % 2), 1.0) is None
    assert s.took(20, math.nan, 1.0) is None and s.took(21, 1.0, math.inf) is None
    assert len(s) == 20


def test_a_jump_that_lasts_is_a_new_level():
    s = Spikes(lasting=4)
    flags = feed(s, [1.0 + 0.01 * (i % 2) for i in range(20)] + [10.0] * 10)
    assert flags == [20, 21, 22]  # the 4th in a row is the run's new level
    assert len(s) == 4 + 6


def test_the_line_names_the_modules_that_jumped_most():
    s = Spikes()
    names = ("inp", "blocks.0.fc", "head")
    for step in range(20):
        s.took(step, 1.0, 1.0, (names, [1.0, 1.0, 1.0, 1.0, 4.0], 2))  # squared norms
    spike = s.took(20, 100.0, 30.0, (names, [30.0, 100.0, 1.0, 900.0, 64.0], 2))
    assert spike is not None and spike.lead == "loss"
    assert spike.top_modules() == [("blocks.0.fc", 30.0), ("head", 4.0)]


def test_the_deepest_module_that_carries_the_jump_comes_first():
    """The embedding and the root model's own parameters before the attention carry its jump
    back (within 2x of the largest): the attention, deepest, is named first; a module whose
    jump is far smaller stays behind by its ratio."""
    s = Spikes()
    names = ("Net", "emb", "body.layers.0.attn", "body.layers.0.fc", "head")
    for step in range(20):
        s.took(step, 1.0, 1.0, (names, [1.0, 1.0, *[1.0] * 5], 2))
    now = [34.0**2, 33.0**2, 32.0**2, 3.0**2, 10.0**2]
    spike = s.took(20, 1.0, 30.0, (names, [1.0, 1.0, *now], 2))
    assert spike is not None and spike.lead == "gradient norm"
    assert [p for p, _ in spike.top_modules()] == ["body.layers.0.attn", "Net", "emb"]
    assert [p for p, _ in spike.top_modules(5)][3:] == ["head", "body.layers.0.fc"]


def test_bad_settings():
    with pytest.raises(ValueError):
        Spikes(window=10, warmup=20)
    with pytest.raises(ValueError):
        Spikes(min_ratio=0.5)


# -- real loops --------------------------------------------------------------------------------
BAD = 80
STEPS = 200


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(F.gelu(self.norm(x)))


class ResMLP(nn.Module):
    """A residual MLP classifier."""

    def __init__(self, d_in: int = 16, d: int = 64, n: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def batches(steps: int = STEPS, bad: int | None = None, scale: float = 300.0, n: int = 32):
    """Synthetic classification batches (labels from a fixed linear teacher); the batch at
    ``bad`` arrives with its features x``scale``."""
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    out = []
    for step in range(steps):
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(1000 + step))
        y = (x @ teacher).argmax(1)
        out.append((x * scale if step == bad else x, y))
    return out


def train_mlp(data, ctx=None, *, warmup: int = 0, accumulate: int = 1, lr: float = 1e-2):
    """Adam on the residual MLP; the losses as floats (``ctx``: the watch)."""
    torch.manual_seed(0)
    model = ResMLP()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = None
    if warmup:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    losses = []
    with ctx if ctx is not None else _nothing():
        for x, y in data:
            opt.zero_grad()
            step_loss = 0.0
            for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
                loss = F.cross_entropy(model(xs), ys) / accumulate
                loss.backward()
                step_loss += loss.item()
            opt.step()
            if sched is not None:
                sched.step()
            losses.append(step_loss)
    return losses


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 32, seq: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, idx):
        return self.head(self.body(self.emb(idx) + self.pos, mask=self.mask, is_causal=True))


def train_lm(steps: int, ctx=None):
    """A small causal transformer LM on a repeating pattern with noise."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(3)
    losses = []
    with ctx if ctx is not None else _nothing():
        for _ in range(steps):
            start = torch.randint(0, 32, (8, 1), generator=gen)
            seq = (start + torch.arange(17)) % 32
            noise = torch.randint(0, 32, seq.shape, generator=gen)
            seq = torch.where(torch.rand(seq.shape, generator=gen) < 0.1, noise, seq)
            logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 32), seq[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def train_fp16_scaler(steps: int, ctx=None):
    """fp16 autocast with a GradScaler on the CPU (its first steps overflow and are skipped)."""
    scaler_cls = getattr(torch.amp, "GradScaler", None)
    if scaler_cls is None:
        pytest.skip("no torch.amp.GradScaler")
    torch.manual_seed(0)
    model = ResMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = scaler_cls("cpu")
    losses = []
    with ctx if ctx is not None else _nothing():
        for x, y in batches(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return losses


def train_fast_fall(steps: int, ctx=None):
    """A regression whose loss falls by orders of magnitude in its first 20 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].bias.fill_(30.0)  # starts far off: loss ~900
    opt = torch.optim.Adam(model.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(5)
    losses = []
    with ctx if ctx is not None else _nothing():
        for _ in range(steps):
            x = torch.randn(32, 8, generator=gen)
            y = x[:, :1] * 0.5
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


HEALTHY = {
    "mlp": lambda ctx: train_mlp(batches(), ctx),
    "lm": lambda ctx: train_lm(STEPS, ctx),
    "warmup": lambda ctx: train_mlp(batches(), ctx, warmup=50, lr=3e-2),
    "accumulation": lambda ctx: train_mlp(batches(), ctx, accumulate=4),
    "fp16-scaler": lambda ctx: train_fp16_scaler(STEPS, ctx),
    "fast-fall": lambda ctx: train_fast_fall(STEPS, ctx),
}


def bits(values: list[float]) -> list[str]:
    return [v.hex() for v in values]


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_runs_never_alarm_and_keep_their_losses_bit_for_bit(name):
    plain = HEALTHY[name](None)
    w, lines = watch(spikes=True, on_spike="stop")
    watched = HEALTHY[name](w)
    assert [d["step"] for d in w.detections] == [], lines
    assert lines == []
    assert bits(watched) == bits(plain)
    assert w.steps_checked >= STEPS - 20  # (a scaler's overflowed first steps are not updates)
    if name == "fast-fall":
        assert plain[0] > 20 * plain[20]  # it does fall fast


def test_stop_at_the_spike_before_its_update():
    w, lines = watch(spikes=True, on_spike="stop")
    with pytest.raises(WatchStop) as info:
        train_mlp(batches(bad=BAD), w)
    exc = info.value
    assert exc.detection["step"] == BAD and exc.option == "on_spike"
    line, batch, module = lines
    assert line.startswith(f"torchscope: loss spike at step {BAD}: loss ")
    assert f"over the last {BAD} steps; gradient norm " in line
    assert "the gradient norms that jumped most: " in line and "(Linear) \u00d7" in line
    spike = exc.detection["spike"]
    assert spike["loss"] > 5 * spike["loss_median"]
    assert spike["grad_norm"] > 20 * spike["grad_median"]
    assert w.step == BAD  # the stopped update did not end its step
    # The batch: the model call's inputs, x300, every sample of it.
    site = short_source(line_of(train_mlp, "model(xs)"))
    assert batch.startswith(f"torchscope: the inputs of the model call at {site} have norm ")
    assert batch.endswith(": samples 0-31")
    inputs = spike["inputs"]
    assert 250 < inputs["norm"] / inputs["median"] < 350 and inputs["samples"] == list(range(32))
    # The first module whose output jumped, against step 79's batch at the same weights.
    assert module.startswith("torchscope: the first module whose output jumped: model.inp (Linear)")
    assert module.endswith(f"with step {BAD - 1}'s batch at the same weights")
    assert spike["first_module"]["path"] == "inp"


def test_the_batch_names_only_the_samples_out_of_range():
    """Three bad rows of the batch: the line names them, the first module too."""

    def rows_bad(data):
        x, y = data[BAD]
        x = x.clone()
        x[[3, 4, 5, 17]] *= 300
        data[BAD] = (x, y)
        return data

    w, lines = watch(spikes=True, on_spike="stop")
    with pytest.raises(WatchStop):
        train_mlp(rows_bad(batches()), w)
    assert lines[1].endswith(": samples 3-5, 17"), lines
    assert "model.inp (Linear)" in lines[2]


def test_a_spike_from_the_weights_says_the_batch_did_not_do_it():
    """The same batch again at grown weights: no input out of range, no module output jumped
    against the previous batch at the same weights: the line says so."""
    torch.manual_seed(0)
    model = ResMLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w, lines = watch(spikes=True, on_spike="stop")
    data = batches(40)
    with pytest.raises(WatchStop), w:
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if step == 30:
                with torch.no_grad():
                    model.head.weight.mul_(100.0)  # the weights jump, not the batch
            opt.step()
    assert (
        lines[0].startswith("torchscope: loss spike at step 31") or "spike at step 31" in lines[0]
    )
    assert not any("the inputs of" in line for line in lines)
    assert lines[-1] == (
        "torchscope: no module's output jumped against step 30's batch at the same weights: "
        "the weights did it, not the batch"
    )


def test_skip_refuses_the_spiked_update_and_training_ends_near_the_healthy_run():
    healthy = train_mlp(batches())
    left_out = [b for i, b in enumerate(batches(bad=BAD)) if i != BAD]
    ref = train_mlp(left_out)
    w, lines = watch(spikes=True, on_spike="skip")
    skipped = train_mlp(batches(bad=BAD), w)
    assert [d["step"] for d in w.detections] == [BAD] and w.refusal.refused == 1
    assert lines[-1] == f"torchscope: skipped the update of step {BAD}; training goes on"
    # As if the batch had been left out (Adam's state untouched too), bit for bit...
    assert bits(skipped[:BAD] + skipped[BAD + 1 :]) == bits(ref)
    # ...and so near the healthy run at its end.
    tail = sum(skipped[-20:]) / 20
    assert abs(tail - sum(healthy[-20:]) / 20) < 0.25 * tail


def test_continue_reports_and_goes_on():
    w, lines = watch(spikes=True)  # on_spike="continue"
    losses = train_mlp(batches(bad=BAD), w)
    assert len(losses) == STEPS and [d["step"] for d in w.detections] == [BAD]
    assert lines[0].startswith(f"torchscope: loss spike at step {BAD}")
    assert w.refusal.refused == 0


def test_pause_holds_the_job_at_the_first_module_that_jumped(capfd):
    """With a stepper (a UI or an agent could attach), "pause" holds the job in the traced
    replay of the spiked step, at the first op of the module whose output jumped, and says on
    stderr at once that it waits; with no UI the lease lets it go on by itself."""
    from torchscope.tracer.armed.session import Tracer

    made = []

    def factory(step):
        tracer = Tracer(
            keep=True, optimizer_steps=False, optimizer_ops=True, stepping=True, lease=0.2
        )
        tracer.step_index = step
        made.append(tracer)
        return tracer.start()

    w, lines = watch(spikes=True, on_spike="pause", tracer_factory=factory)
    losses = train_mlp(batches(bad=BAD), w)
    assert len(losses) == STEPS  # it went on after the pause
    (det,) = w.detections
    assert det["step"] == BAD and det["paused"] is True
    (tracer,) = made
    assert tracer.stepper.auto_resumed == 1
    (pause,) = [e for e in det["events"] if e["kind"] == "pause"]
    assert pause["step"] == BAD and pause["event"]["module"] == "inp"
    assert tracer.stepper.breakpoints == {}  # the watch's breakpoint went with the replay
    said = capfd.readouterr().err
    assert "torchscope: paused at " in said and "resumes in 0.2 s" in said
    assert not any("no UI or stepper" in line for line in lines)


def test_pause_with_nowhere_to_pause_goes_on_and_says_so_once():
    w, lines = watch(spikes=True, on_spike="pause")
    train_mlp(batches(bad=BAD), w)
    assert [d["step"] for d in w.detections] == [BAD]
    assert lines[-1] == (
        'torchscope: on_spike="pause" has no UI or stepper to pause for: the job goes on as '
        'under "continue"'
    )


def test_nan_policy_stays_the_nans():
    """A spike under on_nan="stop" and on_spike="continue" does not stop the job."""
    w, _ = watch(spikes=True, on_nan="stop")
    train_mlp(batches(bad=BAD), w)
    assert [d["what"] for d in w.detections] == ["spike"]


def train_too_fast(steps: int, ctx=None, lr: float = 1.0):
    """A regression MLP under SGD with a learning rate far too large: its loss grows by
    orders of magnitude a step until it is Inf (5.04, 2.74, 10.1, 57.9, 2.11e8, inf)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    with ctx if ctx is not None else _nothing():
        for step in range(steps):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 + step))
            loss = F.mse_loss(model(x), x[:, :1] * 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_a_divergence_is_said_as_such_before_the_first_inf():
    plain = train_too_fast(8)
    first_inf = next(i for i, v in enumerate(plain) if not math.isfinite(v))
    w, lines = watch(spikes=True)
    train_too_fast(8, w)
    diverging = [(d["step"], d) for d in w.detections if d["what"] == "spike"]
    assert diverging, lines
    step, det = diverging[0]
    assert step < first_inf and det["lead"] == "divergence"
    # The gradient norm grew first (1.76 -> 195 from step 0), then the loss (from step 1).
    said = [x for x in lines if "diverging" in x]
    assert said[0].startswith("torchscope: diverging since step 0: gradient norm \u00d7")
    assert said[1].startswith(
        "torchscope: diverging since step 1: loss \u00d7426 per step (2.74 \u2192 2.11e8 "
        "over 3 steps); gradient norm "
    )
    # Said before the NaN watch's own Inf line.
    assert lines.index(said[1]) < next(i for i, x in enumerate(lines) if "Inf first" in x)
    assert any(x.startswith("torchscope: a divergence from step 3 lasted") for x in lines)


def test_a_divergence_stops_the_job_under_stop_before_the_inf():
    w, lines = watch(spikes=True, on_spike="stop")
    with pytest.raises(WatchStop) as info:
        train_too_fast(8, w)
    assert info.value.detection["diverging"] == 0 and info.value.detection["step"] == 3
    assert lines[0].startswith("torchscope: diverging since step 0")


def test_growing_attention_logits_are_named_at_the_attention_module_before_any_nan():
    """A large learning rate on the attention's input projections only (queries, keys and
    values): the gradient norm spikes, before any NaN; the attention module is named first,
    ahead of the embedding and the root model's positional embedding, which jumped as much
    (they only carry its gradient back); the batch is not out of range, and the weights,
    not the batch, did it."""
    torch.manual_seed(0)
    model = TinyLM()
    qk = [p for n, p in model.named_parameters() if "in_proj" in n]
    rest = [p for n, p in model.named_parameters() if "in_proj" not in n]
    opt = torch.optim.AdamW([{"params": rest}, {"params": qk, "lr": 1.0}], lr=3e-3)
    gen = torch.Generator().manual_seed(3)
    w, lines = watch(spikes=True, on_spike="stop")
    with pytest.raises(WatchStop) as info, w:
        for _ in range(60):
            start = torch.randint(0, 32, (8, 1), generator=gen)
            seq = (start + torch.arange(17)) % 32
            noise = torch.randint(0, 32, seq.shape, generator=gen)
            seq = torch.where(torch.rand(seq.shape, generator=gen) < 0.1, noise, seq)
            loss = F.cross_entropy(model(seq[:, :-1]).reshape(-1, 32), seq[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    det = info.value.detection
    assert det["what"] == "spike" and det["lead"] == "gradient norm"
    named = [m for m, _ in det["spike"]["modules"]]
    assert named[0] == "model.body.layers.0.self_attn (MultiheadAttention)", lines[0]
    assert set(named[1:]) == {"model.emb (Embedding)", "model (TinyLM)"}, lines[0]  # .pos
    assert "jumped most: model.body.layers.0.self_attn (MultiheadAttention) \u00d7" in lines[0]
    assert not any("the inputs of" in x for x in lines)  # token ids: no float input
    assert lines[-1].endswith("the weights did it, not the batch")


def test_the_spike_settings_come_from_the_spec():
    from torchscope.tracer.steps import StepSpecError, parse_watch_spec

    spec = parse_watch_spec("nan,spike:sigmas=8,window=64,warmup=4")
    assert spec.spike and spec.spike_kwargs() == {"sigmas": 8.0, "window": 64, "warmup": 4}
    assert parse_watch_spec("spike:ratio=3,grad_ratio=20").spike_kwargs() == {
        "min_ratio": 3.0,
        "grad_ratio": 20.0,
    }
    s = Spikes(**parse_watch_spec("spike:window=16,warmup=4").spike_kwargs())
    assert (s.window, s.warmup, s.sigmas) == (16, 4, 6.0)
    for bad, said in (
        ("window=64", "settings follow spike"),
        ("spike:alpha=1", "the spike watch takes sigmas, ratio"),
        ("spike:warmup=200", "2 <= warmup <= window"),
        ("spike:sigmas=0", "sigmas needs a number above 0"),
        ("spike:window=1.5", "window needs a whole number"),
    ):
        with pytest.raises(StepSpecError, match=said):
            parse_watch_spec(bad)


# -- torchscope run --watch spike -------------------------------------------------------------
JOB = """\
import torch
import torch.nn.functional as F
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
for step in range(120):
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 + step))
    y = (x @ teacher).argmax(1)
    if step == BAD:
        x = x * 300  # a bad batch
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} {loss.item()!r}", flush=True)
"""


def test_run_watch_spike_on_spike_stop_exits_3_with_the_line(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(JOB.replace("BAD", str(BAD)))
    res = run("run", "--watch", "spike", "--on-spike", "stop", str(script), cwd=tmp_path)
    assert res.returncode == 3, res.stderr
    assert f"torchscope: loss spike at step {BAD}: loss " in res.stderr
    assert "the gradient norms that jumped most: model.0 (Linear)" in res.stderr
    assert f"stopped before the update of step {BAD} (--on-spike stop); exit code 3" in res.stderr
    assert res.stdout.splitlines()[-1].startswith(f"step {BAD - 1} ")
    assert "Traceback" not in res.stderr


def test_run_watch_nan_spike_skip_marks_the_history(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(JOB.replace("BAD", str(BAD)))
    res = run(
        "run", "--watch", "nan,spike", "--on-spike", "skip", "--record", "w.tsc", str(script),
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"skipped the update of step {BAD}; training goes on" in res.stderr
    history = run("dump", "w.tsc", "--kind", "history", "--format", "jsonl", cwd=tmp_path)
    points = [p for line in history.stdout.splitlines() for p in json.loads(line)["points"]]
    assert [p["step"] for p in points if p.get("spike")] == [BAD]
    assert [p["step"] for p in points if p.get("skipped")] == [BAD]


def test_run_refuses_on_spike_without_the_spike_watch(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    res = run("run", "--watch", "nan", "--on-spike", "stop", str(script), cwd=tmp_path)
    assert res.returncode == 2 and "--watch spike" in res.stderr


def test_the_spec_parses():
    from torchscope.tracer.steps import StepSpecError, parse_watch_spec

    assert parse_watch_spec("nan, spike").spike
    assert parse_watch_spec("gradnorm:10,spike").gradnorm == 10
    assert not parse_watch_spec("nan").spike
    with pytest.raises(StepSpecError, match="spike"):
        parse_watch_spec("spikes")
