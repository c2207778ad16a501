"""Events as tables: ``torchscope.load(f).to_pandas(kind="op")``, ``export --format csv``.

One row per event of the kind asked for; scalar fields are columns as they are, the tensor
summaries are flattened into columns (``out0_norm``, ``in1_shape``...: the first
``MAX_TENSORS`` tensors of each list), and any other list or map (``nodes``, ``argv``) is a
JSON string, so that every column survives CSV and Parquet. ``kind="tensor"`` gives one row
per tensor summary instead (``seq``, ``field``, ``index`` and the summary), for every op and
grad event.

pandas (and pyarrow for Parquet) are optional extras, imported only when a table is asked
for: ``pip install 'torchscope-debugger[pandas]'``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import IO, Any

from torchscope.protocol.events import GRAD, KINDS, OP, STAT_KEYS, Event
from torchscope.protocol.jsontext import json_safe

TENSOR = "tensor"
TABLE_KINDS = (*KINDS, TENSOR)
MAX_TENSORS = 4
SUMMARY_COLUMNS = ("shape", "dtype", "device", "param", *STAT_KEYS, "values")
# kind -> list field -> column prefix (looked up by ``ev.get("kind")``: None for no kind)
_FLAT: dict[str | None, dict[str, str]] = {
    OP: {"inputs": "in", "outputs": "out"},
    GRAD: {"grad_outputs": "gout", "grad_inputs": "gin"},
}
# Leading columns, in this order, when present.
_FIRST = ("seq", "step", "kind")

MISSING_PANDAS = "tables need pandas: pip install 'torchscope-debugger[pandas]'"
MISSING_PYARROW = "parquet needs pyarrow: pip install 'torchscope-debugger[pandas]'"


class TableError(Exception):
    """One line: a missing optional package or a kind that has no table."""


class MissingExtra(TableError, ImportError):
    """pandas or pyarrow is not installed (an ImportError too)."""


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise MissingExtra(MISSING_PANDAS) from None
    return pandas


def check_extras(fmt: str) -> None:
    """Raise MissingExtra (one line) when writing a ``fmt`` table (``"csv"``, ``"parquet"``)
    needs a package this environment lacks: a check to make before reading anything."""
    _pandas()
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise MissingExtra(MISSING_PYARROW) from None


def _json(v: Any) -> str:
    return json.dumps(json_safe(v), separators=(",", ":"))


def _cell(v: Any) -> Any:
    """A value a CSV or Parquet column holds: lists and maps become JSON text."""
    if isinstance(v, (list, dict)):
        return _json(v)
    if isinstance(v, bytes):
        return v.hex()
    return v


def _summary_cells(s: Any, prefix: str, row: dict) -> None:
    if not isinstance(s, dict):  # None: the slot exists but holds no tensor
        row[f"{prefix}_shape"] = None
        return
    shape = s.get("shape")
    row[f"{prefix}_shape"] = _json(shape) if shape is not None else None
    row[f"{prefix}_dtype"] = s.get("dtype")
    row[f"{prefix}_device"] = s.get("device")
    row[f"{prefix}_param"] = s.get("param")
    stats = s.get("stats") or {}
    for k in STAT_KEYS:
        v = stats.get(k)
        row[f"{prefix}_{k}"] = (
            float(v) if isinstance(v, (int, float)) and k not in ("nan", "inf") else v
        )
    values = s.get("values")
    row[f"{prefix}_values"] = _json(values) if values is not None else None


def event_row(ev: Event) -> dict:
    """One event as a flat row (a dict of column -> scalar)."""
    row: dict[str, Any] = {}
    flat = _FLAT.get(ev.get("kind"), {})
    for k, v in ev.items():
        prefix = flat.get(k)
        if prefix is None:
            row[k] = _cell(v)
            continue
        tensors = v or []
        row[f"n_{k}"] = len(tensors)
        for i, s in enumerate(tensors[:MAX_TENSORS]):
            _summary_cells(s, f"{prefix}{i}", row)
    return row


def tensor_rows(ev: Event) -> Iterable[dict]:
    for fld in _FLAT.get(ev.get("kind"), {}):
        for i, s in enumerate(ev.get(fld) or ()):
            row: dict[str, Any] = {
                "seq": ev.get("seq"),
                "step": ev.get("step"),
                "kind": ev.get("kind"),
                "name": ev.get("name") if ev.get("kind") == OP else ev.get("node"),
                "module": ev.get("module"),
                "field": fld,
                "index": i,
            }
            _summary_cells(s, "t", row)
            yield {k[2:] if k.startswith("t_") else k: v for k, v in row.items()}


def rows(events: Iterable[Event], kind: str) -> list[dict]:
    if kind not in TABLE_KINDS:
        raise TableError(f"no table of kind {kind!r}: one of {', '.join(TABLE_KINDS)}")
    if kind == TENSOR:
        out: list[dict] = []
        for ev in events:
            if ev.get("kind") in _FLAT:
                out.extend(tensor_rows(ev))
        return out
    return [event_row(ev) for ev in events if ev.get("kind") == kind]


def _columns(table: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in table:
        for k in r:
            seen.setdefault(k, None)
    first = [c for c in _FIRST if c in seen]
    return first + [c for c in seen if c not in _FIRST]


def to_pandas(events: Iterable[Event], kind: str = "op") -> Any:
    """A DataFrame with one row per event of ``kind`` (or per tensor, ``kind="tensor"``).
    Integer fields are nullable ``Int64`` columns (a null step stays null, not NaN)."""
    pd = _pandas()
    table = rows(events, kind)
    cols = _columns(table)
    types: dict[str, set] = {c: set() for c in cols}
    for r in table:
        for k, v in r.items():
            if v is not None:
                types[k].add(type(v))
    data = {}
    for c in cols:
        values = [r.get(c) for r in table]
        t = types[c]
        if t == {int}:
            data[c] = pd.array(values, dtype="Int64")
        elif t == {bool}:
            data[c] = pd.array(values, dtype="boolean")
        elif t and t <= {int, float}:
            data[c] = pd.array([math.nan if v is None else float(v) for v in values], "float64")
        else:
            data[c] = pd.array(values, dtype=object)
    return pd.DataFrame(data, columns=cols)


def write_table(df: Any, path: str | IO[Any], fmt: str) -> None:
    """Write ``df`` to a path or an open file (text for CSV, binary for Parquet)."""
    if fmt == "csv":
        df.to_csv(path, index=False)
        return
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise MissingExtra(MISSING_PYARROW) from None
        df.to_parquet(path, index=False)
        return
    raise TableError(f"unknown table format {fmt!r}")


def read_table(path: str, fmt: str) -> Any:
    """Read back what ``write_table`` wrote. Parquet keeps the column types; CSV does not
    (an integer column with holes comes back as floats)."""
    pd = _pandas()
    if fmt == "parquet":
        return pd.read_parquet(path)
    return pd.read_csv(path, keep_default_na=False, na_values=[""])
