"""How the NaN watch's line names a module: as the job's code reaches it, with its class.

The tracer names a module by its path from the outermost module called (``4``, ``blocks.1``;
the root itself ``""``; a second model that owns parameters with its class in front,
``Discriminator:main.0``). The line says ``model.4 (Linear)``: the name the job's code binds
the root to, then the path, then the module's class; the root itself ``model (Sequential)``.
The name is a local (or an attribute of a non-module ``self``: ``self.model``) or global of a
frame of the job's own code on the stack at the detection, looked up only then; where none
binds it, the root's class stands in for it (``Sequential.4 (Linear)``; the root itself:
``Sequential``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

from torch import nn

from torchscope.tracer.armed.modules import is_fsdp2
from torchscope.tracer.armed.source import cell_site, is_internal

# Installed packages (Lightning's loop, a Trainer): their frames bind the model under their
# own names (``pl_module``), not the job's.
_INSTALLED = ("site-packages", "dist-packages")

Root = tuple[nn.Module, nn.Module]  # (what the job called, what the replay runs: unwrapped)


def module_text(
    det: dict[str, Any], roots: Sequence[Root], sites: Iterable[tuple[str, int, str] | None] = ()
) -> str | None:
    """``model.4 (Linear)`` for the detection's module, or None where it names none.

    ``roots``: the step's top-level modules, in call order; ``sites``: the user's lines that
    called them (a root-level op of torch's own module, ``nn.Linear`` called by the loop, has
    its call's line as its source)."""
    path = det.get("module")
    source = det.get("source")
    if path:
        label, sep, rest = path.rpartition(":")
        found = _resolve(rest, roots, label if sep else None)
        if found is None:
            return None
        root, _, own = found
        return f"{_root_name(root, label if sep else None)}.{rest}{own}"
    if det.get("outside_modules") or det.get("loop_forward") or not source:
        return None  # loop code: no module
    top = _root_of_source(source, roots, () if det.get("traced_live") else sites)
    if top is None:
        return None
    name, cls = bound_name(top), _class_of(top[1])
    return f"{name} ({cls})" if name else cls  # unbound: the class alone, not "Net (Net)"


def _resolve(
    rest: str, roots: Sequence[Root], label: str | None
) -> tuple[Root, nn.Module, str] | None:
    """The root and module at ``rest`` (a tracer path without its label), and ``" (Class)"``."""
    matches: list[tuple[Root, nn.Module]] = []
    for root in roots:
        if label is not None and type(root[1]).__name__ != label.split("#")[0]:
            continue
        for start in (root[1], root[0]):
            module = _walk(start, rest)
            if module is not None:
                matches.append((root, module))
                break
    if not matches:
        return None
    if label is not None and "#" in label:  # the n-th root of that class to own parameters
        owning = [m for m in matches if _owns_parameters(m[0][1])] or matches
        n = label.split("#")[1]
        index = int(n) - 1 if n.isdigit() else 0
        root, module = owning[min(index, len(owning) - 1)]
    else:
        root, module = next((m for m in matches if _owns_parameters(m[0][1])), matches[0])
    last = rest.rsplit(".", 1)[-1]
    own = "" if last.startswith("<") else f" ({_class_of(module)})"  # "<Linear>" says it
    return root, module, own


def _walk(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule at a tracer path (compiled wrappers' ``_orig_mod`` left out of it)."""
    for part in path.split("."):
        module = _eager(module)
        if part.startswith("<"):  # built after its root was named: named after its caller
            return module
        child = module._modules.get(part)
        if child is None:
            return None
        module = child
    return module


def _eager(module: nn.Module) -> nn.Module:
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else module


def _class_of(module: nn.Module) -> str:
    module = _eager(module)
    cls = type(module)
    if is_fsdp2(module):  # fully_shard made its class FSDP<Name>(FSDPModule, Name)
        cls = next((c for c in cls.__bases__ if c.__name__ != "FSDPModule"), cls)
    return cls.__name__


def _owns_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _root_of_source(
    source: str, roots: Sequence[Root], sites: Iterable[tuple[str, int, str] | None]
) -> Root | None:
    """The root whose own code (a method of its class, not torch's) holds ``source``; else
    the one root whose call was on that line (torch's own module called by the loop)."""
    for root in roots:
        if _in_class_code(source, type(root[1])):
            return root
    on_line = [r for r, s in zip(roots, sites, strict=False) if s and _same_line(source, *s[:2])]
    return on_line[0] if len({id(r[1]) for r in on_line}) == 1 else None


def _in_class_code(source: str, cls: type) -> bool:
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        for value in vars(klass).values():
            func = getattr(value, "__func__", value)  # staticmethod, classmethod
            code = getattr(func, "__code__", None)
            if code is None or is_internal(code):
                continue
            lines = [line for _, _, line in code.co_lines() if line is not None]
            first, last = code.co_firstlineno, max(lines, default=code.co_firstlineno)
            line = _line_in(source, code.co_filename)
            if line is not None and first <= line <= last:
                return True
    return False


def _line_in(source: str, filename: str) -> int | None:
    """The line of ``source`` (an event's ``path:line`` or ``cell 4, line 11``) when it is
    in ``filename``, else None."""
    cell = cell_site(filename, 1)
    if cell is not None:
        line = source.rpartition(", line ")[2]
        if not line.isdigit() or cell_site(filename, int(line)) != source:
            return None
        return int(line)
    path, _, line = source.rpartition(":")
    return int(line) if path == filename and line.isdigit() else None


def _same_line(source: str, filename: str, line: int) -> bool:
    return _line_in(source, filename) == line


def _root_name(root: Root, label: str | None) -> str:
    """The name the job binds the root to, else its label or class."""
    return bound_name(root) or label or _class_of(root[1])


def bound_name(objects: Iterable[nn.Module]) -> str | None:
    """A name the job's own code binds one of ``objects`` to: a local of a frame on the stack
    (innermost first), an attribute of its ``self`` where that is not a module (a trainer's
    ``self.model``), then a global of one. A frame walk: at a detection only."""
    wanted = {id(o): o for o in objects}
    frames = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_internal(frame.f_code) and not any(d in filename for d in _INSTALLED):
            frames.append(frame)
        frame = frame.f_back
    try:
        for f in frames:
            local = f.f_locals
            name = _name_in(local, wanted)
            if name is not None:
                return name
            this = local.get("self")
            if this is not None and not isinstance(this, nn.Module):
                name = _name_in(getattr(this, "__dict__", {}), wanted)
                if name is not None:
                    return f"self.{name}"
        for f in frames:
            name = _name_in(f.f_globals, wanted)
            if name is not None:
                return name
        return None
    except Exception:  # frames of odd objects: class name
        return None
    finally:
        del frames, frame


def _name_in(names: Mapping[str, Any], wanted: dict[int, Any]) -> str | None:
    for key, value in list(names.items()):
        if (
            id(value) in wanted
            and wanted[id(value)] is value
            and isinstance(key, str)
            and key.isidentifier()
            and not key.startswith("_")
            and key != "self"
        ):
            return key
    return None
