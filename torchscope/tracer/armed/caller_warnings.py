"""Warnings raised inside traced calls point at the line that made the call, as untraced.

Under the tracer every torch call goes through ``TorchFunctionMode.__torch_function__``, so
a warning torch raises there (``float(loss)`` on a tensor that requires grad, ``softmax``
without ``dim``) names the tracer's own frame: torch's C code warns about "the Python frame
that called me", and torch's Python functions count ``stacklevel`` frames up a stack the
mode made deeper. ``warnings`` hands every warning it shows or records to
``warnings._showwarnmsg`` (from C too), with the location already chosen, so that is where
one is moved back: only when it names a torchscope file, and nothing is paid otherwise.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Any

import torch.overrides

from torchscope.tracer.armed.source import TORCHSCOPE_DIR

_OURS = TORCHSCOPE_DIR + os.sep
_OVERRIDES = os.path.abspath(torch.overrides.__file__)
_installed = False


def install() -> None:
    """Wrap ``warnings._showwarnmsg`` once per process (idempotent)."""
    global _installed
    if _installed:
        return
    # typeshed leaves out the private hook every shown or recorded warning goes through.
    original = warnings._showwarnmsg  # type: ignore[attr-defined]

    def show(msg: Any) -> None:
        try:
            if str(getattr(msg, "filename", "")).startswith(_OURS):
                where = _caller(sys._getframe(1))
                if where is not None:
                    msg.filename, msg.lineno = where.f_code.co_filename, where.f_lineno
        except Exception:
            pass  # a warning is never lost for our sake
        original(msg)

    warnings._showwarnmsg = show  # type: ignore[attr-defined]  # (typeshed: as above)
    _installed = True


def _caller(frame: FrameType | None) -> FrameType | None:
    """The frame that called the torch API whose call the tracer's frame is handling."""
    while frame is not None and not frame.f_code.co_filename.startswith(_OURS):
        frame = frame.f_back  # up to the tracer's frame (warnings' own, torch's inner ones)
    while frame is not None and frame.f_code.co_filename.startswith(_OURS):
        frame = frame.f_back
    dispatched = False
    while frame is not None and frame.f_code.co_filename == _OVERRIDES:
        frame, dispatched = frame.f_back, True  # handle_torch_function
    if dispatched and frame is not None:
        frame = frame.f_back  # the Python torch function that dispatched to the mode
    return frame
