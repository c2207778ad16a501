"""The innermost ``nn.Module`` around each op, and qualified names of parameters.

Global module hooks keep a per-thread stack of module paths. Names come from the outermost
module that was called (the root): ``blocks.3.attn.proj``; the root itself is ``""``.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from torchscope.tracer import global_hooks, in_place
from torchscope.tracer.eager import is_compiled_module
from torchscope.tracer.global_hooks import QuietHook
from torchscope.tracer.shards import local_shard

# Looked up once: the hooks run at every module call (dynamo recognises the function object
# itself, however it is reached).
_is_compiling = torch.compiler.is_compiling
_get_ident = threading.get_ident
_current_node = torch._C._current_autograd_node


class ModuleCallListener(Protocol):
    """Told of each module call of the traced thread once the tracker has named it."""

    def module_enter(self) -> None: ...

    def module_exit(self) -> None: ...


class CompiledCallHooks(Protocol):
    """What runs around a call of a ``torch.compile``'d module (tracer/armed/compiled.py)."""

    def enter(self, module: nn.Module, args: tuple) -> None: ...

    def exit(self, module: nn.Module, args: tuple, output: object) -> None: ...

    def active(self) -> bool: ...


class ModuleTracker:
    """A pair of global hooks around every module's forward, with a stack of module paths
    per thread. A ``listener`` (the scoped aten level) rides on the same two hooks: a second
    pair would cost two more Python calls at every module call. Compiled modules are named
    as the module they wrap (no ``_orig_mod.``), and their calls go to ``compiled_calls``."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._handles: list = []
        self.listener: ModuleCallListener | None = None
        self.compiled_calls: CompiledCallHooks | None = None
        self._compiled: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # OptimizedModules
        self._enter_hook: Callable | None = None  # the global forward pre-hook installed
        self._exit_hook: Callable | None = None  # the global forward hook installed
        # Modules compiled in place, listened to while the tracker is in use (in_place.py):
        # what stops each; and nn.Module.compile, wrapped meanwhile.
        self._in_place: list[Callable[[], None]] = []
        self._compile_calls = in_place.CompileCalls(self.wrap_compiled_in_place)
        self._aside = global_hooks.Aside()  # ours, out while compiled runs
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._indexed_roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # id(param) -> (weakref to param, qualified name); ids are checked against the weakref.
        self._params: dict[int, tuple[weakref.ref, str]] = {}
        self.owner: int | None = None  # the traced thread (None: every thread)
        # Called before each top-level module call (outside any backward) while set: the
        # ranks meet there before a forward that communicates (forward_collectives.py).
        self.before_root: Callable[[nn.Module], None] | None = None
        self._param_roots: list[str] = []  # class names of the roots that own parameters
        # Roots whose gradients are synchronised across ranks: DDP-wrapped, or FSDP2
        # (fully_shard) roots, whose gradients end up reduce-scattered, one shard per rank.
        self._ddp: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._searched: set[int] = set()  # ids of parameters looked for among live modules

    # -- hooks ---------------------------------------------------------------------------
    def install(self) -> None:
        if self._handles:
            return
        enter, exit_ = self._enter, self._exit
        listener = self.listener
        if listener is not None:
            tell_enter, tell_exit = listener.module_enter, listener.module_exit

            def enter(module: nn.Module, args: tuple, in_place: bool = False) -> None:
                self._enter(module, args, in_place)
                tell_enter()

            def exit_(
                module: nn.Module, args: tuple, output: object, in_place: bool = False
            ) -> None:
                tell_exit()
                self._exit(module, args, output, in_place)

        self._handles = [
            QuietHook(module_mod.register_module_forward_pre_hook(enter)),
            QuietHook(module_mod.register_module_forward_hook(exit_, always_call=True)),
        ]
        self._enter_hook, self._exit_hook = enter, exit_
        self._compile_calls.install()

    def remove(self) -> None:
        self._show_hooks()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._enter_hook = self._exit_hook = None
        self._compile_calls.remove()
        for stop in self._in_place:
            stop()
        self._in_place = []
        self._local = threading.local()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self, module: nn.Module, args: tuple, in_place: bool = False) -> None:
        """``in_place``: a call of a module compiled in place, into its compiled code (when
        such a module runs its own code, the watch's replay, it is traced as any other)."""
        if _is_compiling():
            return  # inside a torch.compile graph: no Python state of ours may be traced
        if self.owner is not None and _get_ident() != self.owner and _current_node() is None:
            # Another thread's model: not traced, and not named before ours. (Inside a backward
            # node it is ours: checkpointing re-running the forward on autograd's device thread.)
            return
        stack = self._stack()
        if not stack and self.before_root is not None and _current_node() is None:
            self.before_root(module)  # a top-level call: the ranks may meet before it
        name = self._names.get(module)
        if name is None:
            name = self._name_unknown(module, stack)
        stack.append(name)
        compiled = in_place or (self._compiled and module in self._compiled)
        if compiled and self.compiled_calls is not None:
            self.compiled_calls.enter(module, args)
            self._hide_hooks_during(module)

    def _exit(self, module: nn.Module, args: tuple, output: object, in_place: bool = False) -> None:
        if _is_compiling():
            return
        stack = self._stack()
        if stack:
            compiled = in_place or (self._compiled and module in self._compiled)
            if compiled and self.compiled_calls is not None:
                self._show_hooks()
                self.compiled_calls.exit(module, args, output)
            stack.pop()

    def _hide_hooks_during(self, module: nn.Module) -> None:
        """Ours leave the global dicts while a compiled module runs (see ``global_hooks``);
        the call's end comes through a hook on that module alone (or through our wrapper of
        a module compiled in place)."""
        self._aside.hide(
            self._handles, module if is_compiled_module(module) else None, self._exit_hook
        )

    def hide_global_hooks(self) -> Callable[[], None]:
        """Ours out of the global hook dicts (see above); returns what puts them back."""
        self._aside.hide(self._handles)
        return self._show_hooks

    def _show_hooks(self) -> None:
        self._aside.show()

    def in_compiled_call(self) -> bool:
        return self.compiled_calls is not None and self.compiled_calls.active()

    def _name_unknown(self, module: nn.Module, stack: list[str]) -> str:
        if not stack:
            self.index_root(module)
            return self._names.get(module, "")
        # A module built or attached after its root was indexed, or one called from a module
        # that does not own it: name it after its caller so it is still findable.
        return (
            f"{stack[-1]}.<{type(module).__name__}>" if stack[-1] else f"<{type(module).__name__}>"
        )

    def index_root(self, root: nn.Module) -> None:
        """Name every submodule and parameter of ``root`` (done once per root).

        The first root that owns parameters (the model) names them plainly
        (``blocks.3.attn.proj.weight``); a later one (a GAN's second network, a critic) is
        named with its class in front (``Discriminator:main.0.weight``), so that two models
        never share a name.
        """
        if root in self._indexed_roots:
            return
        self._indexed_roots.add(root)
        if type(root).__name__ == "DistributedDataParallel" or is_fsdp2(root):
            self._ddp.add(root)
        prefix = ""
        params = list(root.parameters())
        # A root that holds parameters named before is the model around an earlier root
        # (a submodule that ran on its own first): it takes the plain names over.
        if params and not any(id(p) in self._params for p in params):
            if self._param_roots:
                prefix = self._root_label(root) + ":"
            self._param_roots.append(type(root).__name__)
        # Only modules nobody named yet become roots, so a root named here contains any root
        # indexed before it (a submodule called on its own first): the outer names win. Within
        # one root, a shared module or parameter keeps its first name.
        seen: set[int] = set()
        for name, mod in root.named_modules(remove_duplicate=False):
            if id(mod) not in seen:
                seen.add(id(mod))
                if is_compiled_module(mod):
                    self._compiled.add(mod)
                elif in_place.is_compiled_in_place(mod):
                    self.wrap_compiled_in_place(mod)
                name = _unwrapped(name)
                # The root itself is "" (the model) or its label ("Discriminator").
                self._names[mod] = prefix + name if name else prefix.removesuffix(":")
        for name, p in root.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                self._params[id(p)] = (weakref.ref(p), prefix + _unwrapped(name))

    def _index_fsdp2(self) -> None:
        """FSDP2 swaps each parameter of a ``fully_shard``ed module between its sharded
        DTensor (what ``named_parameters`` gives between steps, indexed) and an unsharded
        ``nn.Parameter`` (the one the forward reads and AccumulateGrad updates), made at its
        first all-gather and kept after. Both, and the shard's local tensor (what FSDP's
        all-gather copy-in reads), get the name the user wrote: ``layers.0.fc.weight``."""
        for root in list(self._ddp):
            if not is_fsdp2(root):
                continue
            for module in root.modules():
                for fsdp_param in _fsdp_params(module):
                    sharded: Any = fsdp_param.sharded_param
                    entry = self._params.get(id(sharded))
                    if entry is None or id(entry[0]()) != id(sharded):
                        continue
                    also = [getattr(fsdp_param, "_unsharded_param", None)]
                    also.append(local_shard(sharded))
                    for t in also:
                        if t is not None and id(t) not in self._params:
                            self._params[id(t)] = (weakref.ref(t), entry[1])

    def wrap_compiled_in_place(self, module: nn.Module) -> None:
        """A module compiled in place is called straight into its compiled code: its calls
        come through ``in_place.listen`` instead, which the tracker takes as the hooks take a
        ``torch.compile(module)`` call (one op, run with the modes off)."""
        self._in_place.append(in_place.listen(module, self))

    def call_begins(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._enter_hook is not None:
            self._enter_hook(module, args, True)

    def call_ends(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._exit_hook is not None:
            self._exit_hook(module, args, output, True)

    def _root_label(self, root: nn.Module) -> str:
        cls = type(root).__name__
        n = self._param_roots.count(cls)
        return cls if n == 0 else f"{cls}#{n + 1}"

    def _index_live_roots(self) -> None:
        """Index the top-level modules alive in the process (once per unnamed parameter):
        a parameter used before any module call (``next(self.parameters()).new_zeros(...)``
        in an ``init_hidden``) still gets its name."""
        module_type = nn.Module
        # type(), not isinstance(): some objects compute __class__ (and warn) when asked.
        mods = [o for o in gc.get_objects() if issubclass(type(o), module_type)]
        inner = {id(c) for m in mods for c in m.children()}
        for m in mods:
            if id(m) not in inner:
                self.index_root(m)

    # -- queries -------------------------------------------------------------------------
    @property
    def has_ddp(self) -> bool:
        """Whether some model called so far is wrapped in DistributedDataParallel (or sharded
        with FSDP2's fully_shard)."""
        return bool(self._ddp)

    def ddp_roots(self) -> list[nn.Module]:
        return list(self._ddp)

    def name_of(self, module: nn.Module) -> str:
        return self._names.get(module, "")

    def module_named(self, path: str) -> nn.Module | None:
        """The module named ``path`` (an event's ``module``), or None. At a pause only:
        a walk over the named modules."""
        for module, name in list(self._names.items()):
            if name == path:
                return module
        return None

    def current(self) -> str:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else ""

    def innermost(self) -> str | None:
        """The innermost module call open on this thread; None when none is (``current()``
        says ``""`` then, the root's name too)."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    def param_name(self, t: torch.Tensor) -> str | None:
        entry = self._params.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        # type() first: isinstance(t, nn.Parameter) runs its metaclass's Python check, and
        # most tensors asked about (an op's input data) are plain tensors.
        if (
            type(t) is not torch.Tensor
            and isinstance(t, nn.Parameter)
            and id(t) not in self._searched
        ):
            self._searched.add(id(t))  # parameters are few: at most one search each
            self._index_live_roots()
            self._index_fsdp2()
            entry = self._params.get(id(t))
            if entry is not None and entry[0]() is t:
                return entry[1]
        return None


def _unwrapped(path: str) -> str:
    """``_orig_mod.blocks.0`` -> ``blocks.0``: a compiled module is named as the one it wraps."""
    if "_orig_mod" not in path:
        return path
    return ".".join(part for part in path.split(".") if part != "_orig_mod")


def is_fsdp2(module: nn.Module) -> bool:
    """A module ``fully_shard`` made (its class is derived on the fly from ``FSDPModule``)."""
    return any(c.__name__ == "FSDPModule" for c in type(module).__mro__)


def _fsdp_params(module: nn.Module) -> list:
    """The ``FSDPParam``s of one ``fully_shard``ed module (FSDP2's private state: none if it
    changes shape in a later torch)."""
    if not is_fsdp2(module):
        return []
    try:
        # torch's Module stub types any attribute a Tensor or a Module: not a method.
        state = module._get_fsdp_state()  # type: ignore[operator]
        return [p for group in state._fsdp_param_groups for p in group.fsdp_params]
    except Exception:  # FSDP's private state changed shape across versions: none known
        return []
