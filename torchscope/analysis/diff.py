"""Compare two recordings: what ``torchscope diff A.tsc B.tsc`` reports.

Events of the two runs are aligned by step, then by what they are: an op by its name and
module path, a backward node by its name, module (or parameter) and backward call, each
with its occurrence number (the third ``Tensor.add`` in module ``blocks.0`` of step 2). A
pair differs

- structurally: an event, a step, a tensor or a tensor slot (``None`` on one side) present
  in one run only, a different shape, a different number of tensors, or a dtype of another
  family (float against integer or bool; any dtype change with ``exact`` or
  ``strict_dtype``); or
- numerically: a NaN/Inf count differs, or a stat (min, max, mean, std, norm) or a small
  tensor's value differs by more than ``atol + rtol * scale``, where ``scale`` is the larger
  of the two numbers' magnitudes and the tensor's RMS (``norm / sqrt(numel)``), so a mean
  near zero of a large tensor is judged against the tensor's size of values, not against
  zero. With ``exact``, any difference at all (bit for bit, NaN equal to NaN).

A float-to-float dtype change (float32 against bfloat16) is a precision change: it is
counted and reported, and the tolerances decide. The report names the first divergence in
the order of run A's events (an event of B only is placed after the last event it shares
with A), with both sides' stats and source lines, then how far the runs drift apart per
module and step: the largest relative difference of output (forward) and gradient
(backward) norms, ``|a - b| / max(|a|, |b|)``.

When both recordings hold aten calls (recorded with ``--aten``), the aten level is compared
the same way, each call aligned under its op's or node's key (``align.aten_keyed``), and the
report also names the first divergent aten call (in run A's order), with its op or node:
which kernel inside an op the runs part at. When only one recording holds them, one line
says the level was not compared.

Imports neither torch nor numpy.
"""

from __future__ import annotations

import linecache
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from torchscope.analysis.align import group_aten_by_step, group_by_step, has_aten
from torchscope.analysis.render import short_source
from torchscope.analysis.updates import UpdateDifference, compare_updates, losses_part, step_updates
from torchscope.protocol.events import ATEN, GRAD, OP, Event, number_text

STAT_KEYS = ("min", "max", "mean", "std", "norm")
# Keyed by ``ev.get("kind")``, which is None for an event without one.
_TENSOR_FIELDS: dict[str | None, tuple[str, ...]] = {
    OP: ("inputs", "outputs"),
    GRAD: ("grad_outputs", "grad_inputs"),
    ATEN: ("inputs", "outputs"),
}
# What the drift summary measures: a forward op's outputs, a backward node's gradients.
_DRIFT_FIELD: dict[str | None, str] = {OP: "outputs", GRAD: "grad_inputs"}
_FLOAT_DTYPES = frozenset(
    ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "half")
)


class DiffError(Exception):
    """Bad input: a file that cannot be read as a trace (one line)."""


@dataclass
class Options:
    rtol: float = 1e-5
    atol: float = 1e-8
    exact: bool = False
    strict_dtype: bool = False
    steps: set[int] | None = None
    #: "step": step N with step N; "relative": by position in each recording's window (two
    #: windows of one job: B's first step with A's first, and so on)
    align: str = "step"


@dataclass
class Divergence:
    """One difference between the runs. ``a``/``b`` are the two events (one is None when the
    event is in one run only); ``what`` says which event and what differs, in one line;
    ``key`` is the events' alignment key (None for a step in one run only) and ``detail``
    what differs alone."""

    structural: bool
    what: str
    step: int | None
    a: Event | None = None
    b: Event | None = None
    order: tuple = ()
    key: tuple | None = None
    detail: str = ""


@dataclass
class Tally:
    """What one level of the comparison found: its divergences and how its events paired."""

    divergences: list[Divergence] = field(default_factory=list)
    matched: int = 0
    only_a: int = 0
    only_b: int = 0

    @property
    def first(self) -> Divergence | None:
        return min(self.divergences, key=lambda d: d.order) if self.divergences else None


@dataclass
class Result(Tally):
    """The whole comparison: the ops and backward nodes' tally (the fields of Tally), their
    precision changes and drift, and the aten level's tally in ``aten`` when both runs
    recorded it (``aten_note`` says, in one line, why it was not compared when one did)."""

    dtype_changes: int = 0
    steps_a: list = field(default_factory=list)
    steps_b: list = field(default_factory=list)
    # (module, step) -> largest relative norm difference seen there
    drift: dict[tuple[str, Any], float] = field(default_factory=dict)
    aten: Tally | None = None
    aten_note: str | None = None
    #: one line on how the steps were paired, when that is not step N with step N, or when
    #: the recordings share no step
    align_note: str | None = None
    #: the steps whose update one run skipped (or flagged as a spike) and the other did not,
    #: from the runs' histories (``analysis.updates``)
    updates: list[UpdateDifference] = field(default_factory=list)
    #: the first step whose history losses differ: (step, loss in A, loss in B)
    losses_part: tuple[int, float | None, float | None] | None = None

    @property
    def same(self) -> bool:
        return (
            not self.divergences
            and not (self.aten and self.aten.divergences)
            and not self.updates
            and self.losses_part is None
        )


# -- alignment (shared with the UI's compare view: torchscope.analysis.align) ----------------
def _step_sort(step: Any) -> tuple:
    return (-1, 0) if step is None else (0, step)


# -- comparing one pair ----------------------------------------------------------------------
def _numel(shape: Any) -> int | None:
    if not isinstance(shape, list):
        return None
    n = 1
    for d in shape:
        n *= d
    return n


def _rms(summary: dict) -> float:
    stats = summary.get("stats") or {}
    norm = stats.get("norm")
    n = _numel(summary.get("shape"))
    if not isinstance(norm, (int, float)) or not n or not math.isfinite(norm):
        return 0.0
    return abs(norm) / math.sqrt(n)


def _num_differs(a: Any, b: Any, scale: float, opts: Options) -> float | None:
    """None when a and b agree; otherwise |a - b| (inf when not comparable)."""
    if a is None or b is None:
        return None  # not recorded on one side: nothing to compare
    if opts.exact:
        if a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
            return None
        return abs(a - b) if _finite(a) and _finite(b) else math.inf
    if not (_finite(a) and _finite(b)):
        same = (a != a and b != b) or a == b
        return None if same else math.inf
    d = abs(a - b)
    if d <= opts.atol + opts.rtol * max(abs(a), abs(b), scale):
        return None
    return d


def _nonfinite(x: Any) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def _finite(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _dtype_family(dtype: Any) -> str:
    if dtype in _FLOAT_DTYPES:
        return "float"
    return str(dtype)


def compare_summaries(
    a: dict | None, b: dict | None, where: str, opts: Options
) -> tuple[bool, str] | None:
    """(structural, what) for the first difference between two tensor summaries, or None."""
    if a is None or b is None:
        if a is None and b is None:
            return None
        return True, f"{where} is {'absent' if a is None else 'present'} in A, " + (
            "absent in B" if b is None else "present in B"
        )
    if a.get("shape") != b.get("shape"):
        return True, f"{where} shape {a.get('shape')} vs {b.get('shape')}"
    da, db = a.get("dtype"), b.get("dtype")
    if da != db and (opts.exact or opts.strict_dtype or _dtype_family(da) != _dtype_family(db)):
        return True, f"{where} dtype {da} vs {db}"
    sa, sb = a.get("stats") or {}, b.get("stats") or {}
    for k in ("nan", "inf"):
        x, y = sa.get(k), sb.get(k)
        if x is not None and y is not None and x != y:
            return False, f"{where} {k} count {x} vs {y}"
    scale = max(_rms(a), _rms(b))
    for k in STAT_KEYS:
        d = _num_differs(sa.get(k), sb.get(k), scale, opts)
        if d is not None:
            return False, f"{where} {k} {_fmt(sa.get(k))} vs {_fmt(sb.get(k))} (|diff| {_fmt(d)})"
    va, vb = a.get("values"), b.get("values")
    if isinstance(va, list) and isinstance(vb, list):
        if len(va) != len(vb):
            return True, f"{where} has {len(va)} values vs {len(vb)}"
        for i, (x, y) in enumerate(zip(va, vb, strict=False)):
            d = _num_differs(x, y, scale, opts)
            if d is not None:
                return False, f"{where} value[{i}] {_fmt(x)} vs {_fmt(y)} (|diff| {_fmt(d)})"
    return None


def dtype_changed(a: Event, b: Event) -> bool:
    """Whether any tensor of the pair changed dtype (float32 against bfloat16, say)."""
    for fld in _TENSOR_FIELDS.get(a.get("kind"), ()):
        for x, y in zip(a.get(fld) or (), b.get(fld) or (), strict=False):
            if x and y and x.get("dtype") != y.get("dtype"):
                return True
    return False


def compare_events(a: Event, b: Event, opts: Options) -> tuple[bool, str] | None:
    for fld in _TENSOR_FIELDS.get(a.get("kind"), ()):
        la, lb = a.get(fld) or [], b.get(fld) or []
        if len(la) != len(lb):
            return True, f"{len(la)} {fld} vs {len(lb)}"
        for i, (x, y) in enumerate(zip(la, lb, strict=False)):
            found = compare_summaries(x, y, f"{fld}[{i}]", opts)
            if found is not None:
                return found
    return None


def _norm(ev: Event) -> float | None:
    """Norm of all the tensors an event's drift is measured on (root of sum of squares);
    NaN when one of them holds NaN or Inf (a norm that skipped them would read as no drift)."""
    total, seen = 0.0, False
    for s in ev.get(_DRIFT_FIELD.get(ev.get("kind"), ""), None) or ():
        stats = s.get("stats") if isinstance(s, dict) else None
        n = stats.get("norm") if stats else None
        if stats and (stats.get("nan") or stats.get("inf") or _nonfinite(n)):
            return math.nan
        if _finite(n):
            total += n * n
            seen = True
    return math.sqrt(total) if seen else None


def _drift_module(ev: Event) -> str:
    param = ev.get("param")
    if param:
        return param.rpartition(".")[0]
    return ev.get("module") or ""


# -- the whole comparison --------------------------------------------------------------------
def compare(
    events_a: Iterable[Event], events_b: Iterable[Event], opts: Options | None = None
) -> Result:
    """Compare two runs' events (any iterables of events, e.g. ``torchscope.load(f)``)."""
    opts = opts or Options()
    if opts.align not in ALIGNS:
        raise DiffError(f"--align takes {' or '.join(ALIGNS)}, not {opts.align!r}")
    events_a, events_b = list(events_a), list(events_b)  # read twice when at the aten level
    ga, gb = group_by_step(events_a), group_by_step(events_b)
    res = Result(steps_a=sorted(ga, key=_step_sort), steps_b=sorted(gb, key=_step_sort))
    shift, res.align_note = _step_shift(res.steps_a, res.steps_b, opts.align)
    _compare_steps(ga, _shifted(gb, shift), opts, res, res)
    # What each run did with its updates (its history): a step one run refused parts them.
    # (Two windows of one job, aligned by position, are one history: nothing to compare.)
    ua, ub = (step_updates(events_a), step_updates(events_b)) if not shift else ({}, {})
    res.updates = compare_updates(ua, ub, opts.steps)
    if ua and ub:
        kept = ua if opts.steps is None else {s: u for s, u in ua.items() if s in opts.steps}
        res.losses_part = losses_part(kept, ub, 0.0 if opts.exact else opts.rtol, opts.atol)
    aten_a, aten_b = has_aten(events_a), has_aten(events_b)
    if aten_a and aten_b:
        res.aten = Tally()
        gb_aten = _shifted(group_aten_by_step(events_b), shift)
        _compare_steps(group_aten_by_step(events_a), gb_aten, opts, res.aten)
    elif aten_a or aten_b:
        res.aten_note = (
            f"only {'A' if aten_a else 'B'} has aten calls: the aten level is compared only "
            "when both recordings have it (record with --aten); comparing ops and nodes"
        )
    return res


ALIGNS = ("step", "relative")


def _step_shift(steps_a: list, steps_b: list, align: str) -> tuple[int, str | None]:
    """How much to add to B's step numbers to pair them with A's, and a line saying so.
    ``relative``: B's first step goes with A's first. ``step``: no shift, and when the two
    share no step, a line that says so and offers ``--align relative``."""
    ints_a = [s for s in steps_a if s is not None]
    ints_b = [s for s in steps_b if s is not None]
    if not ints_a or not ints_b:
        return 0, None
    if align == "relative":
        shift = ints_a[0] - ints_b[0]
        return shift, (
            f"steps aligned by position in each recording (--align relative): B's step "
            f"{ints_b[0]} with A's step {ints_a[0]}, and so on; steps below are A's"
        )
    if set(ints_a).isdisjoint(ints_b):
        return 0, (
            f"A and B share no step (A: {_steps_text(ints_a)}, B: {_steps_text(ints_b)}), so "
            "every step is in one recording only; two windows of one job compare by "
            "position with --align relative"
        )
    return 0, None


def _shifted(by_step: dict, shift: int) -> dict:
    if not shift:
        return by_step
    return {(s + shift if s is not None else None): evs for s, evs in by_step.items()}


def _compare_steps(
    ga: dict, gb: dict, opts: Options, tally: Tally, measure: Result | None = None
) -> None:
    """Pair the keyed events of each step (``group_by_step``'s, or the aten level's) into
    ``tally``; with ``measure``, also count precision changes and measure drift there (the
    ops and nodes' level)."""
    steps = sorted(set(ga) | set(gb), key=_step_sort)
    if opts.steps is not None:
        steps = [s for s in steps if s in opts.steps]
    for si, step in enumerate(steps):
        ea, eb = ga.get(step), gb.get(step)
        if ea is None or eb is None:
            _one_sided_step(step, si, ea, eb, tally)
            continue
        last_pos = -1
        pos_in_a = {k: i for i, k in enumerate(ea)}
        for k, b in eb.items():
            i = pos_in_a.get(k)
            if i is None:
                tally.only_b += 1
                tally.divergences.append(_only_in("B", k, step, b, (si, last_pos, 1)))
            else:
                last_pos = i
        for i, (k, a) in enumerate(ea.items()):
            b = eb.get(k)
            if b is None:
                tally.only_a += 1
                tally.divergences.append(_only_in("A", k, step, a, (si, i, 0)))
                continue
            tally.matched += 1
            found = compare_events(a, b, opts)
            if found is not None:
                structural, detail = found
                what = f"{_describe_key(k)}: {detail}"
                tally.divergences.append(
                    Divergence(structural, what, step, a, b, (si, i, 0), key=k, detail=detail)
                )
            if measure is not None:
                _measure(measure, step, a, b)


def _only_in(side: str, k: tuple, step: Any, ev: Event, order: tuple) -> Divergence:
    """An event of one run that the other does not have."""
    a, b = (ev, None) if side == "A" else (None, ev)
    detail = f"only in {side}"
    return Divergence(True, f"{_describe_key(k)} {detail}", step, a, b, order, k, detail)


def _one_sided_step(step: Any, si: int, ea: dict | None, eb: dict | None, tally: Tally) -> None:
    side = "A" if eb is None else "B"
    evs = ea or eb or {}
    first = next(iter(evs.values()), None)
    n = len(evs)
    if side == "A":
        tally.only_a += n
    else:
        tally.only_b += n
    what = f"step {step} only in {side} ({n} events)"
    tally.divergences.append(
        Divergence(
            True,
            what,
            step,
            a=first if side == "A" else None,
            b=first if side == "B" else None,
            order=(si, 0, 0),
            detail=what,
        )
    )


def _measure(res: Result, step: Any, a: Event, b: Event) -> None:
    """Count a precision change and record the drift of one aligned pair."""
    if dtype_changed(a, b):
        res.dtype_changes += 1
    na, nb = _norm(a), _norm(b)
    if na is not None and nb is not None:
        if math.isnan(na) != math.isnan(nb):  # NaN/Inf on one side only: the most drift
            rel = math.inf
        elif math.isnan(na):  # on both: no number to compare (the NaN counts are)
            return
        else:
            big = max(abs(na), abs(nb))
            rel = abs(na - nb) / big if big > 0 else 0.0
        key = (_drift_module(a), step)
        if rel > res.drift.get(key, -1.0):
            res.drift[key] = rel


def _describe_key(k: tuple) -> str:
    if k[0] == OP:
        _, name, module, n = k
        return f"op {name} in {_mod(module)} (#{n + 1})"
    if k[0] == ATEN:
        _, parent, engine_sum, name, n = k
        under = "the engine's sum after" if engine_sum else "inside"
        return f"aten call {name} (#{n + 1}) {under} {_describe_parent(parent)}"
    _, node, where, backward, n = k
    return f"node {node} of {_mod(where)}, backward {backward} (#{n + 1})"


def _describe_parent(parent: tuple) -> str:
    """An aten call's parent key: an op's or a node's, or what an unlinked call says."""
    if parent[0] is not None:
        return _describe_key(parent)
    _, node, module = parent
    if node:
        return f"node {node} of {_mod(module)} (not recorded)"
    return f"no recorded op, in {_mod(module)}"


def _mod(module: Any) -> str:
    return f"module '{module}'" if module else "the top level"


# -- report ----------------------------------------------------------------------------------
def _fmt(x: Any) -> str:
    return number_text(x, 6)


def _summary_text(s: dict | None) -> str:
    if s is None:
        return "None"
    shape = s.get("shape")
    head = f"{s.get('dtype') or '?'}{shape if shape is not None else '[?]'}".replace(" ", "")
    stats = s.get("stats")
    if not stats:
        return head + " (no stats)"
    parts = [f"{k}={_fmt(stats.get(k))}" for k in STAT_KEYS]
    if stats.get("nan") or stats.get("inf"):
        parts.append(f"nan={stats.get('nan')} inf={stats.get('inf')}")
    return head + " " + " ".join(parts)


def _source_line(source: Any, cwd: Any) -> str:
    if not isinstance(source, str) or not source:
        return "(no source)"
    path, _, line = source.rpartition(":")
    text = ""
    if line.isdigit():
        for cand in (path, os.path.join(cwd, path) if isinstance(cwd, str) else None):
            if cand and os.path.isfile(cand):
                text = linecache.getline(cand, int(line)).strip()
                break
    shown = short_source(source, cwd if isinstance(cwd, str) else None)  # as dump shows it
    return f"{shown}  {text}" if text else shown


def _event_lines(label: str, ev: Event | None, cwd: Any) -> Iterator[str]:
    if ev is None:
        yield f"  {label}: (absent)"
        return
    if ev.get("kind") == OP:
        what = f"op {ev.get('name')} in {_mod(ev.get('module'))}"
    elif ev.get("kind") == ATEN:
        what = f"aten call {ev.get('name')} in {_mod(ev.get('module'))} ({_aten_link(ev)})"
    else:
        what = f"node {ev.get('node')} in {_mod(ev.get('module'))}"
        if ev.get("param"):
            what += f" (param {ev.get('param')})"
    yield f"  {label}: {what}, step {ev.get('step')}, seq {ev.get('seq')}"
    yield f"     at {_source_line(ev.get('source'), cwd)}"
    for fld in _TENSOR_FIELDS.get(ev.get("kind"), ()):
        for i, s in enumerate(ev.get(fld) or ()):
            yield f"     {fld}[{i}] {_summary_text(s)}"


def render(
    res: Result,
    name_a: str = "A",
    name_b: str = "B",
    cwd_a: Any = None,
    cwd_b: Any = None,
    max_list: int = 5,
    max_steps: int = 8,
    max_modules: int = 20,
) -> Iterator[str]:
    """The report, line by line."""
    yield f"A: {name_a}"
    yield f"B: {name_b}"
    yield (
        f"{res.matched} events aligned, {res.only_a} only in A, {res.only_b} only in B; "
        f"steps A {_steps_text(res.steps_a)}, B {_steps_text(res.steps_b)}"
    )
    if res.aten is not None:
        yield (
            f"{res.aten.matched} aten calls aligned, {res.aten.only_a} only in A, "
            f"{res.aten.only_b} only in B"
        )
    if res.align_note:
        yield res.align_note
    if res.aten_note:
        yield res.aten_note
    if res.dtype_changes:
        yield (
            f"{res.dtype_changes} aligned events changed float dtype (precision): "
            "the tolerances decide"
        )
    yield from _update_lines(res)
    first = res.first
    if first is None:
        yield "same: no divergence" if res.same else "no divergence in the events recorded"
    else:
        kind = "structural" if first.structural else "numeric"
        yield ""
        yield f"first divergence ({kind}), step {first.step}: {first.what}"
        before = [u for u in res.updates if isinstance(first.step, int) and u.step < first.step]
        if before:
            u = before[-1]
            yield (
                f"  (after step {u.step}, whose update was {u.a.text()} in A and "
                f"{u.b.text()} in B: the runs part there)"
            )
        yield from _event_lines("A", first.a, cwd_a)
        yield from _event_lines("B", first.b, cwd_b)
        rest = sorted(res.divergences, key=lambda d: d.order)[1:]
        if rest:
            n_struct = sum(d.structural for d in res.divergences)
            yield ""
            yield (
                f"{len(res.divergences)} divergences in all "
                f"({n_struct} structural, {len(res.divergences) - n_struct} numeric); next:"
            )
            for d in rest[:max_list]:
                yield f"  step {d.step}: {d.what}"
            if len(rest) > max_list:
                yield f"  ... {len(rest) - max_list} more"
    if res.aten is not None:
        yield from _aten_lines(res.aten, cwd_a, cwd_b)
    yield from _drift_lines(res, max_steps, max_modules)


def _update_lines(res: Result, most: int = 5) -> Iterator[str]:
    """The steps whose update one run skipped (a spike the watch refused) and the other
    applied, and where the histories' losses part."""
    if res.updates:
        yield ""
        yield "updates that differ (from the runs' histories):"
        for u in res.updates[:most]:
            yield f"  {u.text()}"
            line = u.a.line or u.b.line
            if line:
                yield f"    {line}"
        if len(res.updates) > most:
            yield f"  ... {len(res.updates) - most} more"
    part = res.losses_part
    if part is not None and (res.updates or not res.matched):
        step, la, lb = part
        yield (
            f"losses (history) agree before step {step}; at step {step} A {_fmt(la)} vs "
            f"B {_fmt(lb)}"
        )


# -- the aten level's part of the report -----------------------------------------------------
def _aten_lines(aten: Tally, cwd_a: Any, cwd_b: Any) -> Iterator[str]:
    """The first divergent aten call, with both sides, or that there is none."""
    first = aten.first
    yield ""
    if first is None:
        yield "aten level: no divergent aten call"
        return
    kind = "structural" if first.structural else "numeric"
    yield f"first divergent aten call ({kind}): {_aten_divergence_text(first, cwd_a)}"
    yield from _event_lines("A", first.a, cwd_a)
    yield from _event_lines("B", first.b, cwd_b)
    if len(aten.divergences) > 1:
        n_struct = sum(d.structural for d in aten.divergences)
        yield (
            f"{len(aten.divergences)} divergent aten calls in all ({n_struct} structural, "
            f"{len(aten.divergences) - n_struct} numeric)"
        )


def _aten_divergence_text(d: Divergence, cwd: Any) -> str:
    """``aten._log_softmax.default inside torch.nn.functional.cross_entropy in module 'head'
    at train.py:40, step 2: outputs[0] nan count 0 vs 5``."""
    ev = d.a if d.a is not None else d.b
    if d.key is None or ev is None:  # a step of one run only
        return d.detail
    _, parent, engine_sum, name, n = d.key
    under = "the engine's sum after" if engine_sum else "inside"
    text = f"{name}{_nth(n)} {under} {_parent_text(parent, ev)}"
    source = short_source(ev.get("source"), cwd if isinstance(cwd, str) else None)
    if source:
        text += f" at {source}"
    return f"{text}, step {d.step}: {d.detail}"


def _parent_text(parent: tuple, call: Event) -> str:
    """An aten call's op or node as people name it: ``torch.nn.functional.linear in module
    '0'``, ``AddmmBackward0 (node 7) of module '0', backward 1``."""
    if parent[0] == OP:
        _, name, module, n = parent
        return f"{name}{_nth(n)} in {_mod(module)}"
    if parent[0] == GRAD:
        _, node, where, backward, n = parent
        return f"{node}{_nth(n)} (node {call.get('node_id')}) of {_mod(where)}, backward {backward}"
    return _describe_parent(parent)


def _aten_link(call: Event) -> str:
    """What an aten call's event links it to: its op's seq or its node's id."""
    if call.get("node") is not None or call.get("node_id") is not None:
        under = "engine sum after" if call.get("accumulate") else "in"
        return f"{under} node {call.get('node_id')} {call.get('node')}"
    if call.get("op_seq") is not None:
        return f"in op seq {call.get('op_seq')}"
    return "outside any op"


def _nth(n: int) -> str:
    """An occurrence after the first: `` (#2)``."""
    return f" (#{n + 1})" if n else ""


def _steps_text(steps: list) -> str:
    ints = [s for s in steps if s is not None]
    if not ints:
        return "none"
    return f"{ints[0]}-{ints[-1]}" if len(ints) > 1 else str(ints[0])


def _drift_lines(res: Result, max_steps: int, max_modules: int) -> Iterator[str]:
    if not res.drift:
        return
    steps = sorted({s for _, s in res.drift}, key=_step_sort)
    if len(steps) > max_steps:  # first, last, and evenly spaced between
        idx = sorted({round(i * (len(steps) - 1) / (max_steps - 1)) for i in range(max_steps)})
        steps = [steps[i] for i in idx]
    modules: dict[str, float] = {}
    for (m, _), v in res.drift.items():
        modules[m] = max(v, modules.get(m, 0.0))
    order = sorted(modules, key=lambda m: (m != "", m))
    shown = order
    if len(order) > max_modules:  # the most drifting ones, in module order
        top = set(sorted(order, key=lambda m: -modules[m])[:max_modules])
        shown = [m for m in order if m in top]
    width = max(12, *(len(m or "(top level)") for m in shown))
    yield ""
    yield (
        "drift by module and step (largest |a-b|/max(|a|,|b|) of output and gradient norms; "
        "NaN/Inf: on one side only):"
    )
    yield f"  {'module':<{width}} " + " ".join(f"{'step ' + str(s):>9}" for s in steps)
    for m in shown:
        cells = []
        for s in steps:
            drift = res.drift.get((m, s))
            text = "-" if drift is None else "NaN/Inf" if drift == math.inf else f"{drift:.2g}"
            cells.append(f"{text:>9}")
        yield f"  {m or '(top level)':<{width}} " + " ".join(cells)
    if len(shown) < len(order):
        yield f"  ... {len(order) - len(shown)} modules with less drift not shown"


# -- files -----------------------------------------------------------------------------------
def read_events(path: str) -> tuple[list[Event], dict, list[str]]:
    """Every event of a trace file, its session event (or {}) and notes for stderr. Raises
    DiffError with one line when the file cannot be read."""
    from torchscope.protocol.codec import ProtocolError
    from torchscope.protocol.tracefile import TraceReader

    notes: list[str] = []
    try:
        with TraceReader(path) as reader:
            events = list(reader.iter_events())
            if reader.truncated:
                notes.append(
                    f"{path} was cut short at byte {reader.truncated_at}; "
                    f"comparing its {len(events)} events"
                )
            if reader.damaged:
                notes.append(f"{path}: {reader.damaged}")
    except (ProtocolError, OSError) as exc:
        raise DiffError(f"{path}: {exc}") from None
    session: dict[str, Any] = next((e for e in events if e.get("kind") == "session"), {})
    return events, session, notes


def diff_files(
    path_a: str, path_b: str, opts: Options | None = None
) -> tuple[Result, list[str], list[str]]:
    """Compare two trace files: the result, notes for stderr, and the report's lines."""
    ea, sa, notes_a = read_events(path_a)
    eb, sb, notes_b = read_events(path_b)
    res = compare(ea, eb, opts)
    lines = list(render(res, path_a, path_b, sa.get("cwd"), sb.get("cwd")))
    # A recording with edits holds numbers changed by hand: said before any difference.
    lines[3:3] = [*edit_lines(ea, "A"), *edit_lines(eb, "B")]
    return res, [*notes_a, *notes_b], lines


def edit_lines(events: list[Event], label: str, most: int = 5) -> list[str]:
    """One line per tensor changed by hand (``edit`` events), at most ``most`` of them."""
    edits = [e for e in events if e.get("kind") == "edit"]
    out = [
        f"{label} was changed by hand: step {e.get('step')} {e.get('name') or '?'} "
        f"{e.get('target')} <- {e.get('expr')} (by {e.get('by')})"
        for e in edits[:most]
    ]
    if len(edits) > most:
        out.append(f"{label}: ... and {len(edits) - most} more edits")
    return out
