"""The top-level module calls of a step, for the NaN watch: which modules are top-level, and
the hooks that tell the watch when one of their calls begins and ends (it captures them for a
replay).

The top-level modules are found on the watch's first step (and again when the model changes)
with global module hooks, which every module call pays for on that step only; then each is
hooked alone. A compiled module's frame is guarded on the global hooks it was compiled with:
the search's step out of torch's dicts while a compiled module runs (``global_hooks``). A
module compiled in place (``model.compile()``) runs straight into compiled code, where no hook
sees it: its calls come through ``in_place.listen``, and such modules are looked for in the
user's globals and frames when a search begins and ends, and caught as ``compile()`` runs.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from torchscope.tracer import global_hooks, in_place
from torchscope.tracer.eager import is_compiled_module
from torchscope.tracer.global_hooks import QuietHook

if TYPE_CHECKING:
    from torchscope.tracer.watch.capture import Call


class CallCapture(Protocol):
    """What captures the top-level calls (the NaN watch)."""

    installed: bool

    @property
    def replaying(self) -> bool: ...

    @property
    def owner(self) -> int: ...

    def begin_call(self, module: nn.Module, args: tuple, kwargs: dict | None) -> None: ...

    def end_call(self, module: nn.Module, kwargs: dict, output: Any) -> None: ...

    def call_raised(self) -> None: ...

    def report_error(self, what: str, exc: BaseException) -> None: ...


class TopLevelCalls:
    """The watch's top-level modules and their hooks (see the module's doc). ``roots``: the
    modules to watch, or None to find them."""

    def __init__(self, watch: CallCapture, roots: Iterable[nn.Module] | None) -> None:
        self._watch = watch
        self._depth = 0  # top-level module calls in progress (owner thread)
        # Weak: a watch that outlives a model (a sweep building one per trial) must not keep
        # it alive; a model that is gone is simply no longer watched.
        self._root_refs: list[weakref.ref[nn.Module]] = [weakref.ref(m) for m in roots or ()]
        self.explicit_roots = roots is not None
        self.discovering = False
        self._searched_in_place = False  # this search looked for modules compiled in place
        self._compile_calls = in_place.CompileCalls(self._compiled_now)
        self._global_hooks: list[Any] = []
        self._aside = global_hooks.Aside()  # the global hooks, out while compiled runs
        self._root_hooks: list[Any] = []

    def install(self) -> None:
        if self.explicit_roots:
            self.hook_roots()  # roots=() watches no module calls: the check alone
        else:
            self._compile_calls.install()
            self.discover()

    def remove(self) -> None:
        self._compile_calls.remove()
        self._show_global_hooks()
        for h in (*self._global_hooks, *self._root_hooks):
            h.remove()
        self._global_hooks, self._root_hooks = [], []
        self.discovering = False

    def live_roots(self) -> list[nn.Module]:
        live = [m for m in (r() for r in self._root_refs) if m is not None]
        if len(live) != len(self._root_refs):
            self._root_refs = [weakref.ref(m) for m in live]
        return live

    # -- finding and hooking top-level modules -------------------------------------------------
    def discover(self) -> None:
        """Global module hooks until the next check: they find the top-level calls (and
        capture them meanwhile); every module call pays for them, on this step only."""
        for h in self._root_hooks:
            h.remove()
        self._root_hooks = []
        self._depth = 0
        self._global_hooks = [
            QuietHook(module_mod.register_module_forward_pre_hook(self._global_pre)),
            QuietHook(
                module_mod.register_module_forward_hook(
                    self._global_post, with_kwargs=True, always_call=True
                )
            ),
        ]
        self.discovering = True
        self._searched_in_place = False
        for m in self._compiled_in_place():
            self._add_compiled_in_place(m)

    def _add_compiled_in_place(self, module: nn.Module) -> None:
        """A top-level module compiled in place is a root from the start: no search's hook
        sees its calls, and its compiled code must not be compiled under the search's."""
        if all(r() is not module for r in self._root_refs):
            self._root_refs.append(weakref.ref(module))
        self._root_hooks.append(_Stop(in_place.listen(module, self)))

    def _compiled_now(self, module: nn.Module) -> None:
        """``nn.Module.compile`` just compiled ``module`` in place."""
        if self._watch.installed and not self.explicit_roots:
            self._add_compiled_in_place(module)

    def _end_discovery(self, found: list[nn.Module]) -> None:
        self._show_global_hooks()
        for h in self._global_hooks:
            h.remove()
        self._global_hooks = []
        self.discovering = False
        live = self.live_roots()
        known = {id(m) for m in live}
        for m in found:
            if id(m) not in known:
                known.add(id(m))
                self._root_refs.append(weakref.ref(m))
        self.hook_roots()

    def hook_roots(self) -> None:
        for h in self._root_hooks:
            h.remove()
        self._depth = 0
        hooks: list[Any] = []
        for m in self.live_roots():
            if in_place.is_compiled_in_place(m):
                # Its hooks would run inside its compiled code: its calls come through here.
                hooks.append(_Stop(in_place.listen(m, self)))
                continue
            pre, post = _RootHook(self, "_root_pre"), _RootHook(self, "_root_post")
            hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        self._root_hooks = hooks

    def call_begins(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._root_pre(module, args, kwargs)
        if (
            self._global_hooks
            and not self._watch.replaying
            and threading.get_ident() == self._watch.owner
        ):
            self._aside.hide(self._global_hooks)  # see _hide_global_hooks_during

    def call_ends(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._compiled_post(module, args, kwargs, output)

    def _global_pre(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() or self._watch.replaying:
            return
        if threading.get_ident() != self._watch.owner:
            return
        try:
            depth = self._depth
            self._depth = depth + 1
            if depth == 0:
                self._watch.begin_call(module, args, None)  # kwargs: in the post-hook
                if is_compiled_module(module):
                    self._hide_global_hooks_during(module)
        except Exception as exc:
            self._watch.report_error("capturing a module call", exc)

    def _hide_global_hooks_during(self, module: nn.Module) -> None:
        """A compiled frame is guarded on the global hooks it was compiled with (see
        ``global_hooks``): the search's leave while a compiled module runs, or the model would
        compile once more when the search ends. The call ends through a hook on the module."""
        self._aside.hide(self._global_hooks, module, self._compiled_post, with_kwargs=True)

    def _compiled_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._show_global_hooks()
        # A forward that raised ends with output None, as one that returned nothing: neither
        # leaves anything to reach a gradient.
        self._global_post(module, args, *((kwargs, output) if output is not None else ()))

    def _show_global_hooks(self) -> None:
        self._aside.show()

    def _global_post(self, module: nn.Module, args: tuple, *rest: Any) -> None:
        # (kwargs, output) after a forward that returned. After one that raised, torch calls
        # global always_call hooks with (module, args, None) whatever with_kwargs said.
        if torch.compiler.is_compiling() or self._watch.replaying:
            return
        if threading.get_ident() != self._watch.owner:
            return
        try:
            self._depth = max(self._depth - 1, 0)
            if self._depth == 0:
                if len(rest) == 2:
                    self._watch.end_call(module, rest[0], rest[1])
                else:
                    self._watch.call_raised()
        except Exception as exc:
            self._watch.report_error("capturing a module call", exc)

    def _root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or self._watch.replaying:
            return None
        if threading.get_ident() != self._watch.owner:
            return None
        try:
            depth = self._depth
            self._depth = depth + 1
            if depth == 0:
                self._watch.begin_call(module, args, kwargs)
        except Exception as exc:
            self._watch.report_error("capturing a module call", exc)
        return None

    def _root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._global_post(module, args, kwargs, output)
        return None

    def look_again(self, calls: list[Call], had_backward: bool) -> None:
        if not self._watch.installed or self.explicit_roots:
            return
        if self.discovering:
            found = [c.module for c in calls] or self._compiled_in_place()
            if found or self._root_refs:
                self._end_discovery(found)
        elif had_backward and not calls:
            self.discover()  # the model was replaced (or compiled) since: look again

    def _compiled_in_place(self) -> list[nn.Module]:
        """Modules compiled in place (``model.compile()``), which no module hook sees called:
        looked for in the user's globals and frames, once per search. Those inside another
        module too: a Lightning module's ``self.net`` is called from ``training_step``, never
        through the module that holds it (when that one is called, its call is the top-level
        one, and the inner call nests in it)."""
        if self._searched_in_place:
            return []
        self._searched_in_place = True
        found: dict[int, nn.Module] = {}
        for holder in in_place.modules_compiled_in_place():
            for m in holder.modules():
                if in_place.is_compiled_in_place(m):
                    found.setdefault(id(m), m)
        return list(found.values())


class _Stop:
    """A handle whose ``remove`` stops listening to a module compiled in place."""

    __slots__ = ("remove",)

    def __init__(self, stop: Callable[[], None]) -> None:
        self.remove = stop


class _RootHook:
    """The watch's hook on a watched top-level module, which copies and pickles of the module
    do not take along: ``copy.deepcopy`` (an EMA model, ``AveragedModel``) and pickling
    (``torch.save(model)``) get an inert stand-in made of the standard library, so the copy
    needs neither this watch (its locks cannot be copied) nor torchscope to load."""

    __slots__ = ("_method", "_watch")

    def __init__(self, watch: TopLevelCalls, method: str) -> None:
        self._watch = weakref.ref(watch)
        self._method = method

    def __call__(self, *args: Any) -> None:
        watch = self._watch()
        if watch is not None:
            getattr(watch, self._method)(*args)

    def __reduce__(self) -> tuple:
        # sys.audit("...", module, args, ...) returns None and does nothing unless the
        # program installed an audit hook: a no-op hook for any signature.
        return (functools.partial, (sys.audit, "torchscope.inactive_hook"))
