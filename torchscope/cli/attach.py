"""``torchscope attach PID``: make a job that never imported torchscope attachable.

On Python 3.14+ ``sys.remote_exec(pid, path)`` (PEP 768) runs a file inside another Python
process, on its main thread, at its next bytecode boundary (never inside a C call such as a
blocked collective). The file written here imports torchscope *in the target's environment*
and starts the dormant agent there (:func:`torchscope.tracer.agent.attach_here`), exactly as a
``torchscope.serve()`` line would; tracing then begins only when a UI arms the job, at a step
boundary. The payload reports back through a result file, so a failure in the target (no
torchscope there, an error) comes back as one line here.

Imports neither torch nor textual.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PAYLOAD = """\
# torchscope attach payload: runs inside process {pid} between two bytecodes.
def _torchscope_attach(result_path):
    import sys
    try:
        from torchscope.tracer.agent import attach_here
    except Exception as exc:  # runs inside the job: any failure is reported back, never raised
        message = "torchscope is not importable in this job's environment (%s)" % exc
    else:
        try:
            attach_here()
            message = "ok"
        except Exception as exc:
            message = "%s: %s" % (type(exc).__name__, exc)
    try:
        with open(result_path, "w") as f:
            f.write(message)
    except OSError:
        pass
    if message != "ok":
        print("torchscope: attach failed: " + message, file=sys.stderr)


_torchscope_attach({result!r})
del _torchscope_attach
"""


class AttachError(Exception):
    """Attaching failed; the text is the one line the user sees."""


Inject = Callable[[int, str], None]


def remote_exec() -> Inject:
    """``sys.remote_exec`` where this Python has it; AttachError with the reason otherwise."""
    inject = getattr(sys, "remote_exec", None)
    if inject is None:
        v = sys.version_info
        raise AttachError(
            f"attach needs Python 3.14 or newer (sys.remote_exec, PEP 768); this is "
            f"Python {v.major}.{v.minor}. Start the job with `torchscope run SCRIPT` or add "
            "`torchscope.serve()` to it"
        )
    return inject


def write_payload(pid: int, directory: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """The payload file for ``pid`` and the result file it will write."""
    d = Path(directory or tempfile.mkdtemp(prefix="torchscope-attach-"))
    result = d / f"{pid}.result"
    payload = d / f"{pid}.py"
    payload.write_text(PAYLOAD.format(pid=pid, result=str(result)))
    # The target may run as another user only with ptrace rights over it; keep it readable.
    os.chmod(d, 0o755)
    os.chmod(payload, 0o644)
    return payload, result


def attach(pid: int, *, timeout: float = 10.0, inject: Inject | None = None) -> str:
    """Run the payload in ``pid`` and wait until its agent answers; returns its control
    endpoint. Raises AttachError with one line."""
    from torchscope.protocol import endpoints as ep

    if pid <= 0 or not _alive(pid):
        raise AttachError(f"no process {pid}")
    known = next((r for r in ep.list_sessions() if r.pid == pid), None)
    if known is not None:
        return known.control  # already served: nothing to do
    inject = inject or remote_exec()
    payload, result = write_payload(pid)
    try:
        inject(pid, str(payload))
    except PermissionError:
        raise AttachError(
            f"not allowed to attach to process {pid} (same user and ptrace rights needed)"
        ) from None
    except (OSError, RuntimeError, ValueError) as exc:
        raise AttachError(f"cannot attach to process {pid}: {exc}") from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result.exists():
            message = result.read_text()
            shutil.rmtree(payload.parent, ignore_errors=True)
            if message != "ok":
                raise AttachError(f"attach failed in process {pid}: {message}")
            record = next((r for r in ep.list_sessions() if r.pid == pid), None)
            if record is None:
                raise AttachError(f"process {pid} runs torchscope but serves no live endpoint")
            return record.control
        if not _alive(pid):
            raise AttachError(f"process {pid} ended")
        time.sleep(0.05)
    # The payload may still run later (it is queued in the target): its file stays.
    raise AttachError(
        f"process {pid} did not run the attach payload within {timeout:g} s (it runs at the "
        "next Python bytecode of its main thread: a job blocked in a long C call runs it later)"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
