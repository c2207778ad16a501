"""A private tmux server for one test: its own socket, no configuration file, killed at close.

Tests that shared the default server raced each other: killing the last session makes that
server exit, and a ``new-session`` that reaches it while it goes fails with "server exited
unexpectedly". A server of one's own also leaves a developer's tmux untouched, and its options
(``set-clipboard``) are the test's alone.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

Condition = Callable[[str], object]


class TmuxServer:
    def __init__(self, prefix: str = "ts") -> None:
        self.socket = f"{prefix}-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str, check: bool = True) -> str:
        """One tmux command on this server; its stdout."""
        done = subprocess.run(
            ["tmux", "-L", self.socket, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=15,
        )
        return done.stdout if done.returncode == 0 else ""

    def new_session(
        self, name: str, size: tuple[int, int], command: str, cwd: Path | None = None
    ) -> None:
        """A detached session of ``size`` (columns, rows) running the shell line ``command``."""
        where = ("-c", str(cwd)) if cwd is not None else ()
        args = (
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            str(size[0]),
            "-y",
            str(size[1]),
            *where,
            command,
        )
        try:
            self(*args)
        except subprocess.CalledProcessError as e:
            # tmux itself, not what it runs: a server that went while a client reached it
            if "server exited unexpectedly" not in (e.stderr or ""):
                raise
            self.close()
            self(*args)

    def screen(self, target: str) -> str:
        return self("capture-pane", "-p", "-t", target)

    def keys(self, target: str, *keys: str) -> None:
        self("send-keys", "-t", target, *keys)

    def wait(
        self,
        target: str,
        cond: str | Condition,
        *,
        gone: bool = False,
        what: str = "",
        timeout: float = 90.0,
        explain: Callable[[], str] = str,
    ) -> str:
        """Poll ``target``'s screen until it shows ``cond`` (a text, or a test of the screen;
        with ``gone``: until it no longer does). Waits for a condition, never for a time.
        ``what`` names the condition in the failure; ``explain`` adds to it (a job's logs)."""
        test = (lambda out: cond in out) if isinstance(cond, str) else cond
        deadline = time.monotonic() + timeout
        while True:
            out = self.screen(target)
            if bool(test(out)) != gone:
                return out
            if time.monotonic() > deadline:
                never = "went" if gone else "appeared"
                raise AssertionError(
                    f"{what or repr(cond)} never {never}; screen:\n{out}\n{explain()}"
                )
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)
        # tmux leaves a killed server's socket file behind
        sockets = Path(os.environ.get("TMUX_TMPDIR") or "/tmp") / f"tmux-{os.getuid()}"
        (sockets / self.socket).unlink(missing_ok=True)
