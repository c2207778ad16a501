"""``torchscope tui --web``: the same Textual app, served to a browser by textual-serve.

textual-serve starts one ``torchscope tui TARGET`` process per browser tab and relays its
screen over a websocket. It is an optional extra (``pip install 'torchscope[web]'``) and is
imported only here.
"""

from __future__ import annotations

import shlex
import sys

MISSING = "the browser UI needs textual-serve: pip install 'torchscope[web]'"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


class WebError(Exception):
    """One line: why the browser UI cannot start."""


def tui_command(target: str | None, max_events: int) -> str:
    """The shell command textual-serve runs for each browser tab: ``app_main`` below."""
    parts = [sys.executable, "-m", "torchscope.cli.web"]
    if target:
        parts.append(target)
    parts += ["--max-events", str(max_events)]
    return " ".join(shlex.quote(p) for p in parts)


class _WebTerminal:
    """textual-serve's web driver talks to the browser through pipes: for the UI's
    "is this a terminal" rule, the browser is the terminal."""

    @staticmethod
    def isatty() -> bool:
        return True


def app_main(argv: list[str]) -> int:
    """One browser tab: ``torchscope tui TARGET`` under textual-serve's web driver."""
    import argparse

    from torchscope.tui.app import run_tui
    from torchscope.tui.sources import SourceError, open_source
    from torchscope.tui.targets import check_target

    parser = argparse.ArgumentParser(prog="torchscope tui --web")
    parser.add_argument("target", nargs="?")
    parser.add_argument("--max-events", type=int, default=250_000)
    args = parser.parse_args(argv)
    problem = check_target("tui", args.target, stdin=_WebTerminal(), stdout=_WebTerminal())
    if problem is None:
        try:
            source = open_source(args.target)
        except SourceError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"torchscope: error: {problem}", file=sys.stderr)
        return 2
    return run_tui(source, max_events=args.max_events)


def make_server(target: str | None, *, host: str, port: int, max_events: int) -> object:
    try:
        from textual_serve.server import Server
    except ImportError:
        raise WebError(MISSING) from None
    return Server(tui_command(target, max_events), host=host, port=port, title="torchscope")


def _check_port(host: str, port: int) -> None:
    """Refuse a port the server could not listen on, before saying where to browse (the
    server logs its failure and goes on serving nothing)."""
    import socket

    if not 0 < port < 65536:
        raise WebError(f"--port must be 1-65535, not {port}")
    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(addr)
    except OSError as exc:
        raise WebError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None


def serve(
    target: str | None, *, host: str = "localhost", port: int = 8000, max_events: int = 250_000
) -> int:
    """Serve until Ctrl+C. The page is reachable from this machine only unless ``host`` says
    otherwise (then anyone who reaches the port gets the UI: use an SSH tunnel instead)."""
    server = make_server(target, host=host, port=port, max_events=max_events)
    _check_port(host, port)
    if host not in LOCAL_HOSTS:
        print(
            f"torchscope: warning: serving on {host}:{port}; anyone who reaches it can use "
            "the UI (prefer the default localhost and an SSH tunnel)",
            file=sys.stderr,
        )
    print(f"torchscope: open http://{host}:{port} in a browser (Ctrl+C stops)", file=sys.stderr)
    try:
        server.serve()  # type: ignore[attr-defined]
    except OSError as exc:
        raise WebError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(app_main(sys.argv[1:]))
