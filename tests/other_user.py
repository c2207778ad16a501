"""Running a script as a second local user (uid ``nobody``), for the tests that check what
another user on the machine can reach. Only root can do it; the tests skip elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

UID = GID = 65534  # nobody


def can_become_other() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def other_home(prefix: str) -> Path:
    """A fresh home directory the other user owns."""
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chown(home, UID, GID)
    return home


def _become_other() -> None:
    os.setgroups([])
    os.setgid(GID)
    os.setuid(UID)


def system_pythons(*more: str) -> list[str]:
    """This interpreter, then the same Python version from the system (the other user may
    not reach this one, e.g. a pyenv under /root)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}", *more]


def run_as_other(
    args: list[str], env: dict[str, str], home: Path, pythons: list[str]
) -> subprocess.CompletedProcess | None:
    """``python ARGS`` as the other user with the first of ``pythons`` it can start; None
    when it can start none of them."""
    for python in pythons:
        try:
            return subprocess.run(
                [python, *args],
                env=env,
                cwd=str(home),
                capture_output=True,
                text=True,
                timeout=60,
                preexec_fn=_become_other,
            )
        except (PermissionError, FileNotFoundError, subprocess.SubprocessError):
            continue
    return None
