"""The timeline's search and filter: a regex matched field by field over rows, and over the
names of aten calls."""

from __future__ import annotations

import re
from itertools import islice

from torchscope.session.rows import NAME, NODE_ID, OP_SEQ, SEQ, Rec, seq_key
from torchscope.session.steps import StepData

__all__ = ["CallHits", "FieldPattern", "NameMatch", "compile_filter"]


class FieldPattern:
    r"""A case-insensitive regex matched against each field of a row on its own (so ``^`` and
    ``$`` anchor within one field, and nothing matches across two): ``search`` takes one
    text, a row's fields (``StepData.haystack``), or those fields as lines
    (``StepData.haystacks``), and matches when any field does. Has ``re.Pattern``'s
    ``pattern``, ``flags`` and ``search``, so the graph panel and the aten call match
    (``NameMatch``) use it as one.

    Over many rows, ``prefilter`` (the same regex with ``re.MULTILINE``, over the fields as
    lines) comes first: one C-level search a row, and it matches every row where a field
    does (``^``/``$`` meet line ends where they meet field ends). Only the rows it keeps are
    checked field by field, since it may also match across two lines (``\s``, ``[^x]``)."""

    __slots__ = ("_field", "flags", "pattern", "prefilter")

    def __init__(self, text: str) -> None:
        field = re.compile(text, re.IGNORECASE)
        self._field = field.search
        self.prefilter = re.compile(text, re.IGNORECASE | re.MULTILINE).search
        self.pattern = field.pattern
        self.flags = field.flags

    def search(self, text: str | tuple[str, ...]) -> bool | None:
        """For one text (several lines: each on its own), or a row's fields: True when
        one matches, else None."""
        fields = text.split("\n") if isinstance(text, str) else text
        return True if any(map(self._field, fields)) else None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, FieldPattern)
            and other.pattern == self.pattern
            and other.flags == self.flags
        )

    def __hash__(self) -> int:
        return hash((FieldPattern, self.pattern, self.flags))

    def __repr__(self) -> str:
        return f"FieldPattern({self.pattern!r})"


def compile_filter(text: str) -> FieldPattern | None:
    """The timeline's search and filter: a case-insensitive regex matched field by field (see
    :class:`FieldPattern`), or None for no filter. Raises re.error."""
    text = text.strip()
    if not text:
        return None
    return FieldPattern(text)


# -- search and filter over aten calls ---------------------------------------------------------
# An aten call is matched on its name alone: its module and source line are those of its op or
# node (the tracer gives it theirs), so a search for a module or a line finds that row once,
# not again in each of its calls.
class NameMatch:
    """``pattern`` over aten call names, each distinct name searched once (a step has many
    calls and few names)."""

    def __init__(self, pattern: re.Pattern[str] | FieldPattern) -> None:
        self.pattern = pattern
        self._seen: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        hit = self._seen.get(name)
        if hit is None:
            hit = self._seen[name] = self.pattern.search(name) is not None
        return hit


class CallHits:
    """The aten calls of one step that a pattern matches, by the seq of the op or node row
    they are shown under (the timeline's filter keeps those rows, for context). Incremental:
    each ``update`` reads the calls that came since, and again the matching calls whose row
    had not come yet (an op's calls come before the op, a node's before its event)."""

    def __init__(self, data: StepData, pattern: re.Pattern[str] | FieldPattern) -> None:
        self.data = data
        self.match = NameMatch(pattern)
        self.by_row: dict[int, tuple[Rec, ...]] = {}
        self._read = 0  # calls of data.aten read (a dict only grows, in arrival order)
        self._waiting: list[Rec] = []

    def update(self) -> list[int]:
        """Read what came; the seqs of the rows that got their first matching call."""
        data, match = self.data, self.match
        fresh = [t for t in islice(data.aten.values(), self._read, None) if match(t[NAME])]
        self._read = len(data.aten)
        todo, self._waiting = self._waiting + fresh, []
        first: list[int] = []
        for t in todo:
            parent = data.aten_parent(t)
            if parent is None:
                if t[OP_SEQ] is not None or t[NODE_ID] is not None:  # its row may yet come
                    self._waiting.append(t)
                continue
            have = self.by_row.get(parent[SEQ])
            if have is None:
                self.by_row[parent[SEQ]] = (t,)
                first.append(parent[SEQ])
            else:
                self.by_row[parent[SEQ]] = tuple(sorted((*have, t), key=seq_key))
        return first

    def calls(self) -> list[Rec]:
        """Every matching call shown under a row, in seq order."""
        return sorted((t for calls in self.by_row.values() for t in calls), key=seq_key)
