"""The UI runs where torch is not installed: a laptop looking at a cluster job's trace."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tui_and_protocol_import_and_replay_without_torch(tmp_path: Path) -> None:
    trace = tmp_path / "t.tsc"
    code = textwrap.dedent(
        f"""
        import sys
        import time
        sys.modules["torch"] = None  # any "import torch" now raises ImportError
        import torchscope.protocol
        import torchscope.protocol.tracefile
        import torchscope.tui
        import torchscope.tui.app
        from torchscope.tui import FileSource, ScriptedSource, TorchscopeApp, run_tui
        from torchscope.tui.demo.synthetic import make_trace
        from torchscope.protocol.tracefile import TraceWriter

        with TraceWriter({str(trace)!r}) as w:
            w.write(make_trace(2, 2))

        import asyncio

        async def main():
            app = TorchscopeApp(FileSource({str(trace)!r}))
            async with app.run_test(size=(120, 30)) as pilot:
                deadline = time.monotonic() + 60  # a poll: long for a loaded machine
                while not app.main.timeline.row_count() and time.monotonic() < deadline:
                    await pilot.pause(0.02)
                assert app.main.timeline.row_count() > 0
                await pilot.press("q")
            assert app.return_code == 0

        asyncio.run(main())
        loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert sys.modules["torch"] is None and loaded == ["torch"], loaded
        print("ok")
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")
