"""``torchscope tui --web``: the same Textual app, served to a browser by textual-serve.

textual-serve starts one ``torchscope tui TARGET`` process per browser tab and relays its
screen over a websocket. It is an optional extra (``pip install 'torchscope-debugger[web]'``) and is
imported only here.

textual-serve has no authentication, and every local user reaches a loopback port, so the
server is guarded as Jupyter's is: a random token made at start and printed in the URL
(``http://localhost:8000/?token=...``) is required on every request, HTTP and websocket,
either in the query or in the HttpOnly, SameSite=Strict cookie the first good request sets.
Anything else gets 403 and one line, before textual-serve sees it: no UI process starts. A
request from a page of another origin (another port of localhost included, which cookies do
not tell apart) is refused the same way. The page textual-serve renders loads its font from
the internet: the served page uses the copy textual-serve ships instead, and loads nothing
from another host.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import secrets
import shlex
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

MISSING = "the browser UI needs textual-serve: pip install 'torchscope-debugger[web]'"
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
TOKEN_PARAM = "token"
FORBIDDEN = (
    "torchscope: 403 forbidden: open the URL that 'torchscope tui --web' printed, "
    "with its ?token=\n"
)
# textual-serve's Server builds its aiohttp Application here (1.1 to at least 1.1.3): the one
# place to add the token check without copying its handlers.
SEAM = "_make_app"


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

    from torchscope.tui import glyphs
    from torchscope.tui.app import run_tui
    from torchscope.tui.sources.base import SourceError
    from torchscope.tui.sources.open import open_source
    from torchscope.tui.targets import check_target

    os.environ[glyphs.ENV] = glyphs.WEB  # marks the browser's fonts have (see glyphs)
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


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_ok(given: str | None, token: str) -> bool:
    """Whether ``given`` is the server's token, compared in constant time."""
    if not given or not token:
        return False
    return hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass")
    )


def cookie_name(port: int) -> str:
    """One cookie per port: cookies do not tell a host's ports apart."""
    return f"torchscope-web-{port}"


def base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def same_origin(origin: str | None, host_header: str | None) -> bool:
    """A request a page makes (fetch, websocket) names the page's origin: it must be this
    server's own. A page on another port of localhost is the same site to a browser, which
    sends it this server's SameSite cookie, but it is another origin."""
    if origin is None:  # a navigation, or not a browser
        return True
    if not host_header:
        return False
    return urlsplit(origin).netloc.lower() == host_header.lower()


_LINK = re.compile(r"<link\b[^>]*?\bhref\s*=\s*[\"']?(https?://[^\"'\s>]*)[^>]*>", re.I)
_SCRIPT = re.compile(
    r"<script\b[^>]*?\bsrc\s*=\s*[\"']?(https?://[^\"'\s>]*)[^>]*>\s*</script>", re.I
)
FONTS = (  # textual-serve's own copies of the font its page asks Google Fonts for
    ("RobotoMono-VariableFont_wght.ttf", "normal"),
    ("RobotoMono-Italic-VariableFont_wght.ttf", "italic"),
)


def offline_page(html: str, base: str, statics: Path | None) -> str:
    """The page without what it would load from another host (links and scripts), and with
    textual-serve's bundled Roboto Mono, served here, in place of Google Fonts'."""

    def keep_local(m: re.Match[str]) -> str:
        return m.group(0) if m.group(1).startswith(base + "/") else ""

    html = _SCRIPT.sub(keep_local, _LINK.sub(keep_local, html))
    faces = [
        f'@font-face{{font-family:"Roboto Mono";font-style:{style};font-weight:100 700;'
        f'src:url("{base}/static/fonts/{name}") format("truetype");}}'
        for name, style in FONTS
        if statics is not None and (statics / "fonts" / name).is_file()
    ]
    if faces and "</head>" in html:
        html = html.replace("</head>", "<style>" + "".join(faces) + "</style></head>", 1)
    return html


Handler = Callable[[Any], Awaitable[Any]]


class RedactToken(logging.Filter):
    """The access log (each request's line) names the token as ``<token>``."""

    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.token in message:
            record.msg, record.args = message.replace(self.token, "<token>"), ()
        return True


def token_middleware(token: str, *, port: int, base: str, statics: Path | None) -> Any:
    """The aiohttp middleware that guards every route textual-serve adds."""
    from aiohttp import web

    name = cookie_name(port)

    @web.middleware
    async def check_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        in_query = token_ok(request.query.get(TOKEN_PARAM), token)
        if not (in_query or token_ok(request.cookies.get(name), token)) or not same_origin(
            request.headers.get("Origin"), request.headers.get("Host")
        ):
            return web.Response(status=403, text=FORBIDDEN)
        response = await handler(request)
        if isinstance(response, web.StreamResponse) and not response.prepared:
            if in_query:
                response.set_cookie(name, token, path="/", httponly=True, samesite="Strict")
            if (
                isinstance(response, web.Response)
                and response.content_type == "text/html"
                and response.text
            ):
                response.text = offline_page(response.text, base, statics)
        return response

    return check_token


class WebServer(Protocol):
    """What ``serve`` uses of the server ``make_server`` builds (textual-serve is untyped)."""

    torchscope_token: str

    def serve(self) -> None: ...


def make_server(
    target: str | None, *, host: str, port: int, max_events: int, token: str | None = None
) -> WebServer:
    """textual-serve's Server, every request of it checked for ``token`` (made if None:
    ``server.torchscope_token``)."""
    try:
        from aiohttp import web
        from textual_serve.server import Server
    except ImportError:
        raise WebError(MISSING) from None
    if not callable(getattr(Server, SEAM, None)):
        raise WebError(unsupported())
    secret = token or new_token()
    base = base_url(host, port)

    class TokenServer(Server):
        torchscope_token = secret

        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            if not isinstance(app, web.Application):
                raise WebError(unsupported())
            statics = getattr(self, "statics_path", None)
            app.middlewares.append(
                token_middleware(
                    secret,
                    port=port,
                    base=base,
                    statics=Path(statics) if statics is not None else None,
                )
            )
            return app

        async def on_startup(self, app: web.Application) -> None:
            """Quiet: textual-serve's banner gives the URL without its token."""

        def initialize_logging(self) -> None:
            super().initialize_logging()
            logging.getLogger("aiohttp.access").addFilter(RedactToken(secret))

    return TokenServer(
        tui_command(target, max_events), host=host, port=port, title="torchscope", public_url=base
    )


def unsupported() -> str:
    try:
        from importlib.metadata import version

        have = f"textual-serve {version('textual-serve')}"
    except Exception:  # metadata missing or odd: the message only loses the version
        have = "this textual-serve"
    return (
        f"{have} has no Server.{SEAM}, where torchscope adds its token check: "
        "pip install 'textual-serve>=1.1,<=1.1.3'"
    )


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
    """Serve until Ctrl+C. Every request needs the token printed in the URL. The page is
    reachable from this machine only unless ``host`` says otherwise (then the token crosses
    the network in clear: use an SSH tunnel instead)."""
    server = make_server(target, host=host, port=port, max_events=max_events)
    _check_port(host, port)
    if host not in LOCAL_HOSTS:
        print(
            f"torchscope: warning: serving on {host}:{port}, over plain HTTP: the token "
            "crosses the network unencrypted (prefer the default localhost and an SSH tunnel)",
            file=sys.stderr,
        )
    url = f"{base_url(host, port)}/?{TOKEN_PARAM}={server.torchscope_token}"
    print(f"torchscope: open {url} in a browser (Ctrl+C stops)", file=sys.stderr)
    try:
        server.serve()
    except OSError as exc:
        raise WebError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(app_main(sys.argv[1:]))
