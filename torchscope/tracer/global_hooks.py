"""Global module hooks that do not make ``torch.compile`` warn at every call.

A compiled module (``OptimizedModule``) warns at each call while any global module hook is
installed ("this will cause the hooks to fire an extra time"), and the warning comes back
whenever the process's warning filters change. Ours (the module tracker of a traced step, the
watch's search for the top-level modules) count that extra call as the compiled module's own:
the warning would tell the user of a traced or watched compiled model nothing but noise.

It is ignored while one of ours is installed, and only then: the filter goes with the last
of them, and so does every trace of our hooks in torch's global dicts. (A job's own global
hooks next to ours would lose the warning meanwhile: it would have warned already, at their
first compiled call before ours.)

Dynamo also guards a compiled frame on the global hooks it saw when compiling
(``len(_global_forward_hooks)``): ours step out of the global dicts while a compiled module
runs (``hide``/``show``), so that a frame compiled while ours were there still matches once
they are gone, and the other way round.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, cast

from torch.nn.modules import module as module_mod

_MESSAGE = r"Using `torch\.compile\(module\)` when there are global hooks on modules"

_GLOBAL_HOOK_DICTS = (
    module_mod._global_forward_pre_hooks,
    module_mod._global_forward_hooks,
    module_mod._global_forward_hooks_always_called,
    module_mod._global_forward_hooks_with_kwargs,
)

Hidden = list[tuple[dict, int, Any]]

_lock = threading.Lock()
_held = 0
_entry: Any = None  # our filter in warnings.filters, while held


def _hold() -> None:
    global _held, _entry
    with _lock:
        _held += 1
        if _held == 1:
            warnings.filterwarnings("ignore", message=_MESSAGE, category=UserWarning)
            _entry = warnings.filters[0]


def _release() -> None:
    global _held, _entry
    with _lock:
        _held -= 1
        if _held == 0 and _entry is not None:
            # Ignored warnings leave no trace in the modules' registries: taking the filter
            # out is enough, and changes no other warning's once-per-place state.
            with contextlib.suppress(ValueError):  # the job reset its filters meanwhile
                cast("list[Any]", warnings.filters).remove(_entry)
            _entry = None


class QuietHook:
    """A global module hook's handle (``register_module_forward_*_hook``'s) that keeps the
    compile warning quiet until it is removed."""

    __slots__ = ("_handle", "_held")

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._held = True
        _hold()

    @property
    def id(self) -> int:
        return self._handle.id

    def remove(self) -> None:
        self._handle.remove()
        # torch leaves a removed hook's with_kwargs flag behind (its handle knows only the
        # always_call flags): a stale flag counts as a global hook for good, and every
        # compiled call of the job would warn from then on.
        module_mod._global_forward_hooks_with_kwargs.pop(self._handle.id, None)
        if self._held:
            self._held = False
            _release()


class Aside:
    """Our global hooks out of torch's dicts while a compiled module runs (``hide``), and the
    hook on that module that ends its call; ``show`` puts the first back and removes the
    second."""

    __slots__ = ("_end", "_hidden")

    def __init__(self) -> None:
        self._hidden: Hidden = []
        self._end: Any = None

    def hide(self, hooks: list[QuietHook], during: Any = None, end: Any = None, **how: Any) -> None:
        """``during``, ``end``: the module whose forward hook ``end`` (registered with
        ``always_call`` and ``how``) ends the call."""
        self._hidden = hide(hooks)
        if during is not None and end is not None:
            self._end = during.register_forward_hook(end, always_call=True, **how)

    def show(self) -> None:
        show(self._hidden)
        self._hidden = []
        if self._end is not None:
            self._end.remove()
            self._end = None


def hide(hooks: list[QuietHook]) -> Hidden:
    """Take ``hooks`` out of torch's global hook dicts; ``show`` puts them back."""
    hidden: Hidden = []
    for table in _GLOBAL_HOOK_DICTS:
        for h in hooks:
            if h.id in table:
                hidden.append((table, h.id, table.pop(h.id)))
    return hidden


def show(hidden: Hidden) -> None:
    for table, i, value in hidden:
        table[i] = value
