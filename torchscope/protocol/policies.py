"""What the watch does after a detection, as the wire, the command line and the MCP tool name
it: the one list of policies (``on_nan``, ``--on-nan``; ``on_spike``, ``--on-spike``) and the
default limit of refused updates in a row under ``skip``."""

from __future__ import annotations

POLICIES = ("continue", "pause", "stop", "skip")
# Under "skip": updates refused in a row before the next bad step stops the job (``max_skips``).
MAX_SKIPS = 5
