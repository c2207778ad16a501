"""Where a job's events go and who may stop it: the stepper, the trace file, the live stream.

Built the same way for a standalone ``trace()`` and for the dormant agent (which keeps them
for the job's life and lends them to each armed period): the stepper first (the publisher
serves its commands), then the file, then the publisher, each a sink in that order after
any the caller gave.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torchscope.protocol.events import Event
from torchscope.tracer.stepper import Stepper, stepping_commands

Sink = Callable[[list[Event]], None]


class Outputs:
    def __init__(self, sinks: Sequence[Sink] = ()) -> None:
        self.sinks: list[Sink] = list(sinks)
        self.stepper: Stepper | None = None
        self.writer: Any = None  # TraceWriter
        self.publisher: Any = None  # EventPublisher

    def start_stepper(self, breakpoints: Iterable[dict[str, Any]], **options: Any) -> Stepper:
        """Step-through control, with the breakpoints the job was started with."""
        self.stepper = Stepper(**options)
        for spec in breakpoints:
            self.stepper.add_breakpoint(spec)
        return self.stepper

    def open_file(
        self, path: str, session: Event | None, on_stop: Callable[[str], None] | None = None
    ) -> None:
        """Record to ``path`` (its header holds the session; the stream starts with it)."""
        from torchscope.protocol.tracefile import TraceWriter

        meta = {"session": dict(session)} if session is not None else {}
        self.writer = TraceWriter(path, metadata=meta, on_stop=on_stop)
        self.sinks.append(self.writer.write)

    def start_publisher(
        self,
        session: Event,
        step: int,
        current_step: Callable[[], int],
        say: Callable[[str], None],
        setup: Callable[[Any], None] | None = None,
    ) -> Any:
        """Stream events to UIs and take their commands; a job whose live view cannot start
        still runs (and records, when asked). Returns the publisher, or None.

        Its commands (the stepper's, then ``setup``'s) are in place before it starts: a UI
        finds the session as soon as it is registered, and its first ``state`` or ``arm``
        must not be refused as unsupported."""
        from torchscope.tracer.publisher import EventPublisher  # pyzmq only when live

        try:
            publisher = EventPublisher(session, sndhwm=100)
            publisher.note_step(step)
            stepper = self.stepper
            if stepper is not None:
                publisher.commands.update(stepping_commands(stepper, current_step))
                publisher.on_request = lambda client, cmd: stepper.contact(client)
            if setup is not None:
                setup(publisher)
            publisher.start()
        except Exception as exc:  # unsafe runtime dir, bad TORCHSCOPE_BIND, bind failure
            say(f"live view disabled: {exc}")
            return None
        self.sinks.append(publisher)
        self.publisher = publisher
        return publisher

    def emit(self, events: list[Event]) -> None:
        """Straight to every sink (no pipeline: nothing to summarise or check)."""
        for sink in self.sinks:
            with contextlib.suppress(Exception):  # a failing sink reports itself; others go on
                sink(events)

    def close(self) -> None:
        """The file first, then the live stream: its last events go before "bye"."""
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            if self.publisher is not None:
                self.publisher.close()
                self.publisher = None
