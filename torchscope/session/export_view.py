"""``e``: what the UI shows, written to a JSON-lines file (one event a line, as
``torchscope dump --format jsonl`` writes them: :func:`torchscope.analysis.render.render`).

- the current step: all of its events in memory (ops, backward nodes, their aten calls,
  graphs, alerts, step markers), in seq order;
- the filtered view (``|`` filter on): only the timeline's rows that the filter keeps, and
  the aten calls it matches.

No textual here: :func:`snapshot` takes what to write on the UI thread (records' bytes, cheap),
:func:`write_jsonl` decodes and writes them on a worker thread.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

from torchscope.analysis.render import render
from torchscope.protocol import codec
from torchscope.protocol.events import Event
from torchscope.protocol.output import replacing
from torchscope.session.rows import RAW, SEQ, Rec
from torchscope.session.steps import StepData

__all__ = ["default_path", "snapshot", "write_jsonl"]


def default_path(step: int, filtered: bool, directory: str | None = None) -> str:
    """``torchscope-step12.jsonl`` (``-filtered`` when the filter is on) in ``directory``
    (the current one), numbered so it never names a file that exists."""
    directory = directory or os.getcwd()
    stem = f"torchscope-step{step}" + ("-filtered" if filtered else "")
    path = os.path.join(directory, f"{stem}.jsonl")
    n = 1
    while os.path.exists(path):
        path = os.path.join(directory, f"{stem}-{n}.jsonl")
        n += 1
    return path


def snapshot(data: StepData, view: list[int] | None, calls: Iterable[Rec] = ()) -> list[Any]:
    """What to write, in seq order: the rows at ``view`` (indices into ``data.rows``, the
    filtered view) and the aten ``calls`` the filter keeps, else every event of the step.
    Records stay as their msgpack bytes."""
    if view is not None:
        kept = sorted([data.rows[i] for i in view] + list(calls), key=lambda t: t[SEQ])
        return [t[RAW] for t in kept]
    items: list[tuple[int, Any]] = [(t[SEQ], t[RAW]) for t in data.rows]
    items.extend((t[SEQ], t[RAW]) for t in data.aten.values())
    for ev in (*data.graphs, *data.alerts, *data.others):
        seq = ev.get("seq")
        items.append((seq if type(seq) is int else -1, ev))
    items.sort(key=lambda item: item[0])
    return [item for _, item in items]


def _events(items: list[Any]):
    for item in items:
        yield Event(codec.unpack(item)) if isinstance(item, bytes) else item


def write_jsonl(items: list[Any], path: str) -> int:
    """Write ``items`` (see :func:`snapshot`) to ``path``, atomically; the number written."""
    n = 0
    with replacing(os.path.expanduser(path)) as f:
        for line in render(_events(items), "jsonl"):
            f.write(line)
            f.write("\n")
            n += 1
    return n


def clean_path(text: str) -> str:
    """The path typed in the prompt: trimmed, ``~`` expanded, quotes removed."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return os.path.expanduser(re.sub(r"\s+$", "", text))
