"""`torchscope tui --web`: the Textual app served by textual-serve, loaded in a real headless
Chromium (Debian's ``chromium-headless-shell``), whose terminal must show the timeline."""

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
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

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


@contextlib.contextmanager
def web_server(target: Path, port: int) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchscope", "tui", str(target), "--web", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # textual-serve's app processes too: stopped as a group
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://localhost:{port}/", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                pytest.fail(f"server exited {proc.returncode}: {proc.stderr.read()}")
            if time.monotonic() > deadline:
                pytest.fail("the web UI did not answer within 20 s")
            time.sleep(0.1)
        yield proc
    finally:
        stop_group(proc)


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
        "torchscope: error: the browser UI needs textual-serve: pip install 'torchscope[web]'"
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
    with web_server(trace_file, port):
        with urllib.request.urlopen(f"http://localhost:{port}/", timeout=5) as r:
            page = r.read().decode()
        assert "textual.js" in page and f"ws://localhost:{port}/ws" in page
        with urllib.request.urlopen(
            f"http://localhost:{port}/static/js/textual.js", timeout=5
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


async def _cdp_text(browser_ws: str, http: str, url: str, want: list[str], timeout: float) -> str:
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
                    if msg.get("id") == i:
                        return msg.get("result", {})

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
    with web_server(trace_file, port), tempfile.TemporaryDirectory() as profile:
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
            text = asyncio.run(_cdp_text(browser_ws, http, f"http://localhost:{port}/", want, 45))
            assert all(w in text for w in want), f"timeline text not rendered; page shows:\n{text}"
        finally:
            stop_group(chrome)
    assert os.path.exists(trace_file)
