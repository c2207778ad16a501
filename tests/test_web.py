"""`torchscope tui --web`: the Textual app served by textual-serve, loaded in a real headless
Chromium (Debian's ``chromium-headless-shell``), whose terminal must show the timeline.

Every request needs the token the command prints (query or cookie): without it, HTTP and the
websocket get 403 and no UI process starts, for this user and another one (when run as root).
The page loads nothing from another host."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import other_user
import pytest

from torchscope.cli import web
from torchscope.protocol.events import Event
from torchscope.protocol.tracefile import TraceWriter

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
NO_BROWSER = (
    "no Chromium on this machine (Debian: apt-get install chromium-headless-shell); "
    "the page is still checked over HTTP"
)

# Finds the xterm.js terminal textual-serve creates (its bundle keeps it in a closure): the
# app object assigns ``this.fitAddon`` right after ``this.terminal``, and a setter on
# Object.prototype sees that assignment. ``__tsText()`` then reads the terminal's buffer, the
# text the page renders (on a canvas, so not in the DOM).
HOOK = """
Object.defineProperty(Object.prototype, "fitAddon", {
  configurable: true,
  set(v) {
    Object.defineProperty(this, "fitAddon", {value: v, writable: true, configurable: true});
    window.__tsTerminal = this.terminal;
  },
});
window.__tsText = () => {
  const t = window.__tsTerminal;
  if (!t) return null;
  const b = t.buffer.active, out = [];
  for (let i = 0; i < b.length; i++) {
    const line = b.getLine(i);
    if (line) out.push(line.translateToString(true));
  }
  return out.join("\\n");
};
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def op(seq: int, step: int, name: str, module: str) -> Event:
    out = {
        "shape": [4, 4],
        "dtype": "float32",
        "device": "cpu",
        "stats": {
            "min": -1.0,
            "max": 1.0,
            "mean": 0.0,
            "std": 0.5,
            "norm": 2.0,
            "nan": 0,
            "inf": 0,
        },
    }
    return Event(
        kind="op",
        seq=seq,
        step=step,
        name=name,
        module=module,
        source="train.py:12",
        function="forward",
        inputs=[out],
        outputs=[out],
        grad_fn=None,
        nodes=[],
        duration_us=3.0,
        thread="MainThread",
    )


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small recording (written directly: this test needs no torch)."""
    path = tmp_path_factory.mktemp("web") / "t.tsc"
    events = [
        Event(kind="session", seq=0, step=0, pid=1, script="train.py"),
        Event(kind="step", seq=1, step=0, t=0.0),
    ]
    names = [
        "torch.nn.functional.linear",
        "torch.nn.functional.gelu",
        "torch.nn.functional.layer_norm",
    ]
    for i in range(12):
        events.append(op(2 + i, 0, names[i % 3], f"blocks.{i // 3}.mlp"))
    with TraceWriter(path) as w:
        w.write(events)
    return path


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    url: str  # the one the command printed, with its token
    token: str

    @property
    def base(self) -> str:
        return f"http://localhost:{self.port}"


def wait_for(what: str, check, timeout: float = 20.0, proc: subprocess.Popen | None = None):
    """Poll ``check`` until it returns something true (returned), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode} waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)


def status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=5
        ) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


@contextlib.contextmanager
def web_server(target: Path, port: int) -> Iterator[Served]:
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchscope", "tui", str(target), "--web", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
            start_new_session=True,  # textual-serve's app processes too: stopped as a group
        )

        def printed() -> re.Match | None:
            err.seek(0)
            return re.search(r"open (http://\S+/\?token=(\S+)) in a browser", err.read())

        try:
            m = wait_for("the URL with its token on stderr", printed, proc=proc)
            served = Served(proc, port, m.group(1), m.group(2))
            assert served.url == f"http://localhost:{port}/?token={served.token}"

            def answers() -> bool:
                try:
                    return status(served.url) == 200
                except OSError:
                    return False

            wait_for("the web UI answering", answers, proc=proc)
            yield served
        finally:
            stop_group(proc)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def external_urls(page: str, port: int) -> list[str]:
    """Every http(s) URL in the page to another place than this server (XML namespaces,
    which name nothing to load, apart)."""
    page = re.sub(r"""xmlns(:\w+)?\s*=\s*["'][^"']*["']""", "", page)
    urls = re.findall(r"""(?:https?:)?//[^\s"'()<>]+""", page)
    return [u for u in urls if urlhost(u) != f"localhost:{port}"]


def urlhost(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url if "://" in url else "http:" + url).netloc


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process started with ``start_new_session`` and everything it started."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)


def test_without_textual_serve_it_is_one_line(trace_file: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['textual_serve'] = sys.modules['textual_serve.server'] = None\n"
        "from torchscope.cli import main\n"
        f"sys.exit(main(['tui', {str(trace_file)!r}, '--web']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "torchscope: error: the browser UI needs textual-serve: "
        "pip install 'torchscope-debugger[web]'"
    )


def test_web_serves_the_page_on_localhost(trace_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("textual_serve")
    bad = tmp_path / "bad.tsc"
    bad.write_bytes(b"garbage" * 20)
    res = subprocess.run(
        [sys.executable, "-m", "torchscope", "tui", str(bad), "--web", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    # No target, no port: refused before "open http://..." (it served nothing for ever).
    taken = socket.socket()
    taken.bind(("localhost", 0))
    taken.listen()
    for target, port, why in (
        (tmp_path / "missing.tsc", free_port(), "no such trace file, endpoint or pid"),
        (trace_file, 99999, "--port must be 1-65535, not 99999"),
        (trace_file, taken.getsockname()[1], "Address already in use"),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "torchscope", "tui", str(target), "--web", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 2 and why in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    taken.close()
    port = free_port()
    with web_server(trace_file, port) as served:
        with urllib.request.urlopen(served.url, timeout=5) as r:
            page = r.read().decode()
        assert "textual.js" in page and f"ws://localhost:{port}/ws" in page
        with urllib.request.urlopen(
            f"http://localhost:{port}/static/js/textual.js?token={served.token}", timeout=5
        ) as r:
            assert r.status == 200
        # Bound to the loopback interface only.
        addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)} - {
            "127.0.0.1",
            "::1",
        }
        for addr in addrs:
            with pytest.raises(OSError), socket.create_connection((addr, port), timeout=1):
                pass


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


async def _cdp_text(
    browser_ws: str, http: str, url: str, want: list[str], timeout: float, requested: list[str]
) -> str:
    import aiohttp  # textual-serve's own dependency

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{http}/json/list") as r:
            pages = [t for t in await r.json() if t.get("type") == "page"]
        async with session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 1_000_000))

            async def call(method: str, **params: object) -> dict:
                i = next(ids)
                await ws.send_json({"id": i, "method": method, "params": params})
                while True:
                    msg = json.loads((await ws.receive()).data)
                    if msg.get("method") == "Network.requestWillBeSent":
                        requested.append(msg["params"]["request"]["url"])
                    if msg.get("id") == i:
                        return msg.get("result", {})

            await call("Network.enable")
            await call("Page.enable")
            await call("Page.addScriptToEvaluateOnNewDocument", source=HOOK)
            await call("Page.navigate", url=url)
            deadline = time.monotonic() + timeout
            text = ""
            while time.monotonic() < deadline:
                res = await call(
                    "Runtime.evaluate",
                    expression="window.__tsText && window.__tsText()",
                    returnByValue=True,
                )
                text = res.get("result", {}).get("value") or ""
                if all(w in text for w in want):
                    return text
                await asyncio.sleep(0.25)
            return text


def test_web_page_in_a_real_browser_shows_the_timeline(trace_file: Path) -> None:
    pytest.importorskip("textual_serve")
    browser = find_browser()
    if browser is None:
        pytest.skip(NO_BROWSER)
    port = free_port()
    with web_server(trace_file, port) as served, tempfile.TemporaryDirectory() as profile:
        chrome = subprocess.Popen(
            [
                browser,
                "--headless",
                "--no-sandbox",  # CI runs as root
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "--window-size=1400,900",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Debian's chromium-headless-shell is a wrapper script
        )
        try:
            browser_ws = None
            deadline = time.monotonic() + 30
            while browser_ws is None and time.monotonic() < deadline:
                line = chrome.stderr.readline()
                if not line and chrome.poll() is not None:
                    pytest.fail(f"{browser} exited {chrome.returncode}")
                m = re.search(r"DevTools listening on (ws://\S+)", line)
                if m:
                    browser_ws = m.group(1)
            assert browser_ws, f"{browser} never opened its DevTools port"
            http = "http://" + browser_ws.split("/")[2]
            want = ["linear", "gelu", "blocks.0.mlp"]
            requested: list[str] = []
            text = asyncio.run(_cdp_text(browser_ws, http, served.url, want, 45, requested))
            assert all(w in text for w in want), f"timeline text not rendered; page shows:\n{text}"
            # The page, its script, style, images and websocket: all from this server. (The
            # token travels in a cookie after the first request: the websocket has none.)
            assert any(u.endswith("/static/js/textual.js") for u in requested), requested
            elsewhere = [
                u for u in requested if not u.startswith(("data:", "blob:", served.base + "/"))
            ]
            assert not elsewhere, f"the page loads from elsewhere: {elsewhere}"
        finally:
            stop_group(chrome)
    assert os.path.exists(trace_file)


# -- the token ---------------------------------------------------------------------------------
def test_token_is_random_and_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = {web.new_token() for _ in range(20)}
    assert len(tokens) == 20 and all(len(t) >= 43 for t in tokens)  # 32 random bytes
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", t) for t in tokens)  # safe in a URL as it is
    token = tokens.pop()
    compared: list[tuple[bytes, bytes]] = []
    real = web.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(web.hmac, "compare_digest", spy)
    assert web.token_ok(token, token)
    assert compared == [(token.encode(), token.encode())]
    for wrong in (token[:-1], token + "x", token.upper() if token.upper() != token else "x", "é"):
        assert not web.token_ok(wrong, token)
    assert len(compared) == 5  # every candidate through compare_digest, non-ASCII included
    assert not web.token_ok("", token) and not web.token_ok(None, token)
    assert not web.token_ok("", "")  # no token set never lets anyone in
    assert web.same_origin(None, "localhost:8000")  # a navigation names no origin
    assert web.same_origin("http://localhost:8000", "localhost:8000")
    for origin in ("http://localhost:8001", "http://evil.example", "null"):
        assert not web.same_origin(origin, "localhost:8000")


def test_offline_page_loads_nothing_from_another_host(tmp_path: Path) -> None:
    statics = tmp_path / "static"
    (statics / "fonts").mkdir(parents=True)
    for name, _ in web.FONTS:
        (statics / "fonts" / name).write_bytes(b"ttf")
    base = "http://localhost:8000"
    page = (
        "<html><head>"
        f'<link rel="stylesheet" href="{base}/static/css/xterm.css" />'
        '<link\n  rel="stylesheet"\n  href="https://fonts.googleapis.com/css?family=Roboto%20Mono"\n/>'
        f'<script src="{base}/static/js/textual.js"></script>'
        '<script src="https://cdn.example/x.js"></script>'
        '</head><body><svg xmlns="http://www.w3.org/2000/svg"></svg></body></html>'
    )
    out = web.offline_page(page, base, statics)
    assert external_urls(out, 8000) == []
    assert f"{base}/static/css/xterm.css" in out and f"{base}/static/js/textual.js" in out
    for name, _ in web.FONTS:
        assert f'url("{base}/static/fonts/{name}")' in out
    # Without the bundled fonts: the link goes all the same (the browser's monospace).
    assert external_urls(web.offline_page(page, base, tmp_path / "none"), 8000) == []


async def _ws_status(url: str, *, cookies: dict | None = None, origin: str | None = None) -> int:
    """The websocket handshake's answer: 101 (then closed at once) or the refusal's status."""
    import aiohttp

    headers = {"Origin": origin} if origin else {}
    async with aiohttp.ClientSession(cookies=cookies) as session:
        try:
            async with session.ws_connect(url, headers=headers) as ws:
                await ws.close()
                return 101
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status


async def _ws_ui(served: Served) -> tuple[int, list[int]]:
    """Through the cookie the token URL sets: the websocket opens, a UI process starts and
    sends its screen. Returns the bytes it sent and the server's children meanwhile."""
    import aiohttp

    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        async with session.get(served.url) as r:
            assert r.status == 200
            assert any(c.key == web.cookie_name(served.port) for c in session.cookie_jar)
        async with session.get(f"{served.base}/static/js/textual.js") as r:
            assert r.status == 200  # the cookie alone
        ws_url = f"ws://localhost:{served.port}/ws?width=100&height=30"
        async with session.ws_connect(ws_url, origin=served.base) as ws:
            got = 0
            deadline = time.monotonic() + 30
            while got < 1000 and time.monotonic() < deadline:
                msg = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
                if msg.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    got += len(msg.data)
                else:
                    break
            kids = children(served.proc.pid)
            await ws.close()
    return got, kids


def test_without_the_token_nothing_gets_in_and_no_ui_starts(trace_file: Path) -> None:
    pytest.importorskip("textual_serve")
    if not os.path.isdir("/proc/self"):
        pytest.skip("counts the server's child processes in /proc")
    with web_server(trace_file, free_port()) as served:
        base, token = served.base, served.token
        wrong = web.new_token()
        name = web.cookie_name(served.port)
        for path in ("/", "/static/js/textual.js", "/static/fonts/", "/ws", "/download/x"):
            for query in (
                "",
                f"?token={wrong}",
                f"?token={token[:-1]}",
                "?token=",
                "?tok=" + token,
            ):
                assert status(base + path + query) == 403, path + query
            assert status(base + path, {"Cookie": f"{name}={wrong}"}) == 403
            # Another port's cookie (another torchscope) is not this one's.
            other = web.cookie_name(served.port + 1)
            assert status(base + path, {"Cookie": f"{other}={token}"}) == 403
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "/", timeout=5)
        body = refused.value.read().decode()
        assert refused.value.code == 403 and body.count("\n") == 1 and "token" in body
        assert "Set-Cookie" not in refused.value.headers
        ws = f"ws://localhost:{served.port}/ws?width=80&height=24"
        assert asyncio.run(_ws_status(ws)) == 403
        assert asyncio.run(_ws_status(ws + f"&token={wrong}")) == 403
        assert asyncio.run(_ws_status(ws, cookies={name: wrong})) == 403
        # The right cookie from a page of another origin (another port of localhost: the
        # same site to a browser, which would send the cookie along) is refused too.
        evil = f"http://localhost:{served.port + 1}"
        assert asyncio.run(_ws_status(ws, cookies={name: token}, origin=evil)) == 403
        assert status(served.url, {"Origin": evil}) == 403
        # Not one of those started a UI.
        assert children(served.proc.pid) == []

        # The right token: the page, and through its cookie a UI that draws its screen.
        assert status(served.url) == 200
        got, kids = asyncio.run(_ws_ui(served))
        assert got >= 1000, "the UI sent no screen"
        assert kids, "no UI process behind the websocket"
        # Closing the tab stops its UI.
        wait_for("the UI process to stop", lambda: not children(served.proc.pid), 30, served.proc)
        assert asyncio.run(_ws_status(ws + f"&token={token}")) == 101  # the query alone


def test_served_page_references_no_other_host(trace_file: Path) -> None:
    pytest.importorskip("textual_serve")
    with web_server(trace_file, free_port()) as served:
        with urllib.request.urlopen(served.url, timeout=5) as r:
            page = r.read().decode()
            cookie = r.headers["Set-Cookie"]
        assert external_urls(page, served.port) == [], external_urls(page, served.port)
        assert "fonts.googleapis.com" not in page
        # What it references instead is served here, to the cookie alone.
        name = web.cookie_name(served.port)
        assert cookie.startswith(f"{name}={served.token};")
        attrs = {a.strip().lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/"} <= attrs, cookie
        refs = re.findall(rf"{re.escape(served.base)}/static/[^\s\"')]+", page)
        assert any("/fonts/" in u for u in refs) and any(u.endswith(".js") for u in refs)
        for url in refs:
            assert status(url, {"Cookie": f"{name}={served.token}"}) == 200, url


# -- a real second user ------------------------------------------------------------------------
STRANGER = textwrap.dedent(
    """
    import json, os, sys, urllib.error, urllib.request
    base = sys.argv[1]
    out = {"uid": os.getuid(), "status": {}}
    for path in ("/", "/?token=guess", "/static/js/textual.js", "/ws"):
        try:
            with urllib.request.urlopen(base + path, timeout=10) as r:
                out["status"][path] = r.status
                out.setdefault("leaked", r.read()[:200].decode(errors="replace"))
        except urllib.error.HTTPError as exc:
            out["status"][path] = exc.code
        except OSError as exc:
            out["status"][path] = repr(exc)
    try:  # the token is in no place another user can read
        out["cmdline"] = open("/proc/%s/cmdline" % sys.argv[2], "rb").read().decode()
    except OSError:
        out["cmdline"] = ""
    print(json.dumps(out))
    """
)


def test_another_uid_cannot_get_the_page_without_the_token(trace_file: Path) -> None:
    """Run only where this test can become another user (root); skipped elsewhere."""
    pytest.importorskip("textual_serve")
    if not other_user.can_become_other():
        pytest.skip("needs root to run a second uid")
    home = other_user.other_home("tsweb-other-")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home)}
    # The stranger needs only the standard library: any Python 3 of the system will do.
    pythons = other_user.system_pythons("/usr/bin/python3")
    try:
        with web_server(trace_file, free_port()) as served:
            args = ["-c", STRANGER, served.base, str(served.proc.pid)]
            proc = other_user.run_as_other(args, env, home, pythons)
            no_ui = children(served.proc.pid) == [] if os.path.isdir("/proc/self") else True
            assert status(served.url) == 200  # meanwhile the user's own URL works
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if proc is None:
        pytest.skip("no Python this test can run as another uid")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["uid"] == other_user.UID
    # It reaches the port (a 403, not a refused connection) and gets nothing else.
    assert out["status"] == {p: 403 for p in ("/", "/?token=guess", "/static/js/textual.js", "/ws")}
    assert "leaked" not in out
    assert served.token not in out["cmdline"]
    assert no_ui


@pytest.mark.parametrize("change", ["no seam", "seam returns another thing"])
def test_a_textual_serve_without_the_seam_is_one_line(trace_file: Path, change: str) -> None:
    """The token check rides on textual-serve's private ``Server._make_app``: a version
    without it (or with another one) stops with one line, never serves unguarded."""
    pytest.importorskip("textual_serve")
    patch = (
        "del Server._make_app"
        if change == "no seam"
        else "async def _other(self): return object()\nServer._make_app = _other"
    )
    code = (
        "import sys\n"
        "from textual_serve.server import Server\n"
        f"{patch}\n"
        "from torchscope.cli import main\n"
        f"sys.exit(main(['tui', {str(trace_file)!r}, '--web', '--port', '{free_port()}']))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("torchscope: error: textual-serve ") and "Server._make_app" in last
    if change == "no seam":  # refused before it says where to browse
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
