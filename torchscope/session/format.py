"""Plain-text pieces the widgets share: numbers, stats, shapes, sparklines, source context.

No textual imports; the table cells of ``torchscope dump`` (compact_stat, shape_text,
short_source) are reused, not re-implemented.
"""

from __future__ import annotations

import linecache
import math
import os
import re
from typing import Any

from torchscope.analysis.render import compact_stat, shape_text, short_source
from torchscope.protocol.events import ATEN, number_text
from torchscope.session.checks import eager_of

__all__ = [
    "CALL_LABELS",
    "SPARK",
    "call_label",
    "call_tag",
    "check_text",
    "compact_stat",
    "event_tag",
    "fnum",
    "label_meaning",
    "mean_std",
    "plural",
    "range_bar",
    "shape_text",
    "shapes_text",
    "short_name",
    "short_path",
    "short_source",
    "source_cell",
    "source_context",
    "sparkline",
    "stat_text",
]

SPARK = "▁▂▃▄▅▆▇█"

_PREFIXES = (("torch.nn.functional.", "F."),)


def short_name(name: str) -> str:
    """``torch.nn.functional.linear`` -> ``F.linear``: the timeline's name column."""
    for long, short in _PREFIXES:
        if name.startswith(long):
            return short + name[len(long) :]
    return name


def plural(n: int, noun: str, many: str | None = None) -> str:
    """A count and its noun, agreeing: ``1 step``, ``2 steps``, ``1 match``, ``3 matches``,
    ``1,024 events`` (``many``: an irregular plural)."""
    if n == 1:
        word = noun
    elif many is not None:
        word = many
    else:
        word = noun + ("es" if noun.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n:,} {word}"


def short_path(path: str, width: int) -> str:
    """A dotted module path or parameter in at most ``width`` cells, shortened from the left
    by whole parts so its leaf stays: ``blocks.0.attn.proj`` -> ``…attn.proj``. A leaf too
    long for the width keeps its end (``…ght``)."""
    if width <= 0:
        return ""
    if len(path) <= width:
        return path
    if width == 1:
        return "…"
    parts = path.split(".")
    tail = parts[-1]
    for part in reversed(parts[:-1]):
        longer = f"{part}.{tail}"
        if len(longer) + 1 > width:
            break
        tail = longer
    if len(tail) + 1 <= width:
        return "…" + tail
    return "…" + path[-(width - 1) :]


def source_cell(source: str | None) -> str:
    """An event's ``path:line`` as the timeline shows it: ``seed_grads.py:30`` (the file's
    name and the line; the detail has the full path)."""
    if not source:
        return ""
    path, sep, line = source.rpartition(":")
    if not sep or not path or not line.isdigit():
        path, line = source, ""
    name = re.split(r"[\\/]", path.rstrip("/\\"))[-1] or path
    return f"{name}:{line}" if line else name


def fnum(x: Any) -> str:
    return number_text(x)


def _flags(stats: dict) -> str:
    out = []
    if stats.get("nan"):
        out.append(f"NaN:{stats['nan']}")
    if stats.get("inf"):
        out.append(f"Inf:{stats['inf']}")
    return (" " + " ".join(out)) if out else ""


def mean_std(summary: dict | None) -> str:
    """``mean±std`` (the single value for one-element tensors), plus NaN/Inf counts."""
    if summary is None:
        return "None"
    stats = summary.get("stats")
    if not isinstance(stats, dict) or not stats:
        return str(summary.get("dtype", "?"))
    values = summary.get("values")
    if isinstance(values, list) and len(values) == 1:
        text = fnum(values[0])
    else:
        text = f"{fnum(stats.get('mean'))}±{fnum(stats.get('std'))}"
    return text + _flags(stats)


def stat_text(summary: dict | None, mode: str = "norm") -> str:
    """One stat cell: ``norm=1.2`` (mode "norm") or ``0.1±0.3`` (mode "mean")."""
    if summary is not None and not isinstance(summary, dict):
        return "?"
    if summary is not None and summary.get("pending") and not summary.get("stats"):
        return "pending"  # an async collective's output, not there yet when it was recorded
    if mode == "mean":
        return mean_std(summary)
    return compact_stat(summary)


def shapes_text(summaries: Any) -> str:
    if not isinstance(summaries, list) or not summaries:
        return "-"
    return " ".join(shape_text(s) if isinstance(s, dict) or s is None else "?" for s in summaries)


# An aten call's ``label``: why it ran when not for its op's or node's own work (the tracer's
# aten level), and what that means, in a few words (the detail panel).
CALL_LABELS = {
    "autocast": "a cast autocast put before the op",
    "recompute": "activation checkpointing re-running the forward inside this backward node",
    "vmap": "run under torch.func.vmap: the batched kernel the transform chose",
    "grad": "run under torch.func.grad",
    "jvp": "run under torch.func.jvp (forward-mode AD)",
}
_TAG_MAX = 12  # a tag longer than any known label is cut: it must leave the name room


def label_meaning(label: str) -> str:
    """What an aten call's label says, in words; a nest of torch.func transforms
    (``vmap(grad)``) reads outermost first."""
    known = CALL_LABELS.get(label)
    if known is not None:
        return known
    names = label.replace(")", "").split("(")
    if len(names) > 1 and all(n in ("vmap", "grad", "jvp") for n in names):
        return "run under torch.func: " + " inside ".join(reversed(names))
    return "why the tracer says it ran"


def call_label(ev: Any) -> str | None:
    """An aten call's ``label`` (``recompute``), or None."""
    label = ev.get("label") if isinstance(ev, dict) else None
    return label if isinstance(label, str) and label else None


def call_tag(ev: Any) -> str:
    """The timeline's tag after an aten call's name: ``[recompute]``, or ""."""
    label = call_label(ev)
    if label is None:
        return ""
    return f"[{label if len(label) <= _TAG_MAX else label[: _TAG_MAX - 1] + '…'}]"


# torch.compile: the timeline's tags of a compiled module's call and of its eager re-run
# (see checks.py).
COMPILED_TAG = "[compiled]"
EAGER_TAG = "[eager]"


def check_text(alert: Any) -> str:
    """An eager check's message without its leading ``<name> against its eager run: ``."""
    message = str(alert.get("message") or "")
    head = f"{alert.get('name')} against its eager run: "
    return message[len(head) :] if message.startswith(head) else message


def event_tag(ev: Any) -> str:
    """The timeline's dim tag after a row's name: an aten call's label (``[recompute]``, see
    ``call_tag``), ``[compiled]`` for a compiled module's call, ``[eager]`` for an op of its
    eager re-run; or ""."""
    if not isinstance(ev, dict):
        return ""
    tag = call_tag(ev) if ev.get("kind") == ATEN else ""
    if tag:
        return tag
    if ev.get("compiled") is True:
        return COMPILED_TAG
    if eager_of(ev) is not None:
        return EAGER_TAG
    return ""


def sparkline(values: Any, width: int | None = None) -> str:
    """Values as a row of block characters, scaled between their min and max (non-finite
    values shown as ``!``)."""
    if not isinstance(values, list) or not values:
        return ""
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(nums) != len(values):
        nums = [float(v) if isinstance(v, (int, float)) else math.nan for v in values]
    if width is not None and len(nums) > width > 0:
        step = len(nums) / width
        nums = [nums[int(i * step)] for i in range(width)]
    finite = [v for v in nums if math.isfinite(v)]
    if not finite:
        return "!" * len(nums)
    lo, hi = min(finite), max(finite)
    span = hi - lo
    out = []
    for v in nums:
        if not math.isfinite(v):
            out.append("!")
        elif span == 0:
            out.append(SPARK[len(SPARK) // 2])
        else:
            out.append(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))])
    return "".join(out)


def range_bar(stats: dict, width: int = 24) -> str:
    """Where mean±std lies between min and max: ``├──[═══]─────┤``."""
    try:
        lo, hi = float(stats["min"]), float(stats["max"])
        mean, std = float(stats["mean"]), float(stats["std"])
    except (KeyError, TypeError, ValueError):
        return ""
    if not all(math.isfinite(v) for v in (lo, hi, mean, std)) or width < 5:
        return ""
    inner = width - 2
    if hi <= lo:
        return "├" + "═" * inner + "┤"

    def pos(v: float) -> int:
        return max(0, min(inner - 1, int((v - lo) / (hi - lo) * inner)))

    a, b = pos(mean - std), pos(mean + std)
    m = pos(mean)
    cells = ["─"] * inner
    for i in range(a, b + 1):
        cells[i] = "═"
    cells[m] = "┼"
    return "├" + "".join(cells) + "┤"


def resolve_source(source: str | None, cwd: str | None = None) -> tuple[str, int] | None:
    """``(path on this machine, line)`` for an event's ``path:line``, or None when the file is
    not here. Relative paths are tried against the job's working directory and ours."""
    if not source:
        return None
    path, _, line = source.rpartition(":")
    if not path or not line.isdigit():
        return None
    candidates = [path]
    if not os.path.isabs(path) and cwd:
        candidates.insert(0, os.path.join(cwd, path))
    if cwd and os.path.isabs(path) and path.startswith(cwd.rstrip(os.sep) + os.sep):
        candidates.append(os.path.relpath(path, cwd))  # a checkout at another place
    for cand in candidates:
        if os.path.isfile(cand):
            return cand, int(line)
    return None


def source_context(
    source: str | None, cwd: str | None = None, radius: int = 3
) -> list[tuple[int, str, bool]] | None:
    """Lines ``[line-radius, line+radius]`` of the source as ``(number, text, is_target)``,
    or None when the file cannot be read here."""
    found = resolve_source(source, cwd)
    if found is None:
        return None
    path, line = found
    try:
        lines = linecache.getlines(path)
    except Exception:  # an unreadable source file: no context
        return None
    if not lines or line < 1 or line > len(lines):
        return None
    lo, hi = max(1, line - radius), min(len(lines), line + radius)
    return [(n, lines[n - 1].rstrip("\n"), n == line) for n in range(lo, hi + 1)]


# -- numbers that fit -------------------------------------------------------------------------
# A number is never cut: a cell too narrow for it gets the number shortened (fewer digits,
# ``16k`` for a count), and only when even that does not fit is the cell cut with an ellipsis.

_FLOAT = re.compile(r"(?<![\w.])(-?(?:\d+\.\d*|\d*\.\d+|\d+)(?:e[+-]?\d+)?)(?![\w.])")
_COUNT = re.compile(r"\b(NaN|Inf|nan|inf):(\d+)")


def count_text(n: int) -> str:
    """``16384`` -> ``16k``, ``2500000`` -> ``2.5M``: a count in at most 4 characters."""
    if n < 1000:
        return str(n)
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            v = n / div
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return str(n)


def _digits(text: str, sig: int) -> str:
    def one(m: re.Match[str]) -> str:
        token = m.group(1)
        try:
            x = float(token)
        except ValueError:
            return token
        if x == int(x) and abs(x) < 10**sig and "e" not in token:
            return str(int(x)) if "." not in token else token.rstrip("0").rstrip(".") or "0"
        short = f"{x:.{sig}g}"
        if "e" in short:  # 1e+02 -> 1e2
            mant, _, exp = short.partition("e")
            short = f"{mant}e{int(exp)}"
        return short if len(short) < len(token) else token

    return _FLOAT.sub(one, text)


def fit_numbers(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, shortening its numbers before cutting anything:
    counts become ``16k``, digits go (3 significant), the ``norm=`` label shortens to ``n=``
    and digits go further (3, 2, 1); only then does the label go (a bare ``0.1572`` for a
    [64,64] tensor reads like its value), then a second stat; an ellipsis only when nothing
    else fits."""
    if width <= 0:
        return ""
    if len(text) <= width:
        return text
    candidates = []
    t = _COUNT.sub(lambda m: f"{m.group(1)}:{count_text(int(m.group(2)))}", text)
    candidates.append(t)
    candidates.append(_digits(t, 3))
    short = t.replace("norm=", "n=")
    candidates.append(short)
    for sig in (3, 2, 1):
        candidates.append(_digits(short, sig))
    t = t.replace("norm=", "")
    candidates.append(t)
    for sig in (3, 2, 1):
        candidates.append(_digits(t, sig))
    last = candidates[-1].replace(" …", "")
    parts = last.split(" ")
    if len(parts) > 1:  # keep the first stat and the NaN/Inf counts
        keep = [parts[0]] + [p for p in parts[1:] if _COUNT.match(p)]
        candidates.append(" ".join(keep))
        candidates.append(" ".join(p for p in keep if _COUNT.match(p)) or keep[0])
    for cand in candidates:
        if len(cand) <= width:
            return cand
    best = candidates[-1]
    return best[: width - 1] + "…" if width > 1 else "…"


# -- values with their shape ------------------------------------------------------------------


def is_bad(v: Any) -> bool:
    """A NaN or an infinity (a value that is not a finite number)."""
    return isinstance(v, float) and not math.isfinite(v)


def first_bad(values: Any) -> int | None:
    """Index of the first NaN or Inf in ``values``, or None."""
    if not isinstance(values, list):
        return None
    return next((i for i, v in enumerate(values) if is_bad(v)), None)


def unravel(flat: int, shape: list[int]) -> list[int]:
    """The multi-index of flat (row-major) index ``flat`` in ``shape``."""
    out = []
    for d in reversed(shape):
        d = max(1, d)
        out.append(flat % d)
        flat //= d
    return out[::-1]


def index_text(flat: int, shape: list[int] | None) -> str:
    """``[1,2]`` for flat index 6 of a [2,4] tensor; ``[6]`` when the shape is not known."""
    if not shape:
        return f"[{flat}]"
    return "[" + ",".join(map(str, unravel(flat, shape))) + "]"


def value_rows(
    values: list, shape: list[int] | None, start: int = 0, per_line: int = 8
) -> list[tuple[str, int, list]]:
    """``values`` (the flat slice ``[start, start+len)`` of a tensor of ``shape``) cut into
    the rows of its last dimension: ``(label, flat index of the first value, values)``, where
    the label names the row (``[1,:]``; ``[1,8:]`` when a long row wraps or the slice starts
    inside it). A 1-D tensor is one row; N-D tensors give the rows of their last two dims, led
    by the index of the leading dims. A row longer than ``per_line`` wraps."""
    shape = [d for d in shape] if isinstance(shape, list) and shape else [len(values) + start]
    if any(type(d) is not int or d < 0 for d in shape):
        shape = [len(values) + start]
    last = max(1, shape[-1])
    per_line = max(1, per_line)
    out = []
    i = 0
    while i < len(values):
        flat = start + i
        col = flat % last
        n = min(per_line, last - col, len(values) - i)
        idx = unravel(flat, shape)
        lead = ",".join(map(str, idx[:-1]))
        tail = ":" if col == 0 else f"{col}:"
        label = f"[{lead},{tail}]" if lead else f"[{tail}]"
        out.append((label, flat, values[i : i + n]))
        i += n
    return out
