"""Make the docs' generated files: the UI's pictures and the command-line reference.

    python docs/generate.py                     # copy the snapshot tests' screens, write cli.md
    python docs/generate.py --update-snapshots  # first re-render those screens from the UI

The pictures are the snapshot tests' own SVGs (``tests/__snapshots__``), made from the UI by
the code of ``tests/test_tui_snapshots.py`` and ``tests/test_tui_history.py``; the command-line
reference is each command's ``--help``. ``tests/test_docs.py`` fails when a file here differs
from what this script would write, and the snapshot tests fail when the UI differs from their
SVGs, so no page shows a screen or an option that is not the current one.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "__snapshots__"
IMAGES = ROOT / "docs" / "images"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
OPTIONS_PAGE = ROOT / "docs" / "reference" / "options.md"

#: docs picture -> the snapshot test's SVG it copies
PICTURES = {
    "at-origin.svg": "test_tui_snapshots/test_a_recording_opens_paused_at_its_first_origin.svg",
    "main-screen.svg": "test_tui_snapshots/test_main_screen.svg",
    "main-200x50.svg": "test_tui_snapshots/test_main_screen_at_200x50.svg",
    "main-80x24.svg": "test_tui_snapshots/test_main_screen_at_80x24.svg",
    "backward-node.svg": (
        "test_tui_snapshots/test_detail_of_a_backward_node_with_a_none_gradient.svg"
    ),
    "graph.svg": "test_tui_snapshots/test_graph_view.svg",
    "paused-values.svg": "test_tui_snapshots/test_paused_after_an_op_with_values.svg",
    "help.svg": "test_tui_snapshots/test_alert_step_and_help.svg",
    "history-200x50.svg": "test_tui_history/test_history_screen_snapshot[200x50].svg",
    "history-80x24.svg": "test_tui_history/test_history_screen_snapshot[80x24].svg",
}
SNAPSHOT_TESTS = [
    "tests/test_tui_snapshots.py",
    "tests/test_tui_history.py::test_history_screen_snapshot",
]

HELP_COLUMNS = "100"

CLI_HEAD = """# Command line

This page is generated from each command's `--help` by `python docs/generate.py`; a test
fails when it differs from the installed command. `python -m torchscope ...` works the same
way as `torchscope ...`. Every mistake on the command line is one line on stderr and exit
code 2.

```sh
torchscope run --record trace.tsc train.py --lr 3e-4     # every step traced and recorded
torchscope run --record trace.tsc -m mypkg.train ARGS    # like python -m
torchscope run --steps 0-9 train.py                      # only steps 0..9, then dormant
torchscope dump trace.tsc                                # readable table
torchscope dump trace.tsc --format jsonl --kind grad --step 3
```

Options go before the script; everything after the script is passed to it. `--record`,
`--steps`, `--break-on` and `--wait` arm the job for the steps they select (all of them
unless `--steps` says otherwise); a UI can still attach to it before, between and after
those. Untraced steps run with no mode and no hooks. The update's own ops inside
`optimizer.step()` are not traced (`--optimizer-ops` traces them), except when it is given a
closure (LBFGS): then the whole `step()` is traced, the closure's forward and backward and the
update's own arithmetic too, since they interleave. A subclass whose `step()` calls
`super().step()` still counts as one step.
"""


def help_text(command: str | None) -> str:
    """What ``torchscope [COMMAND] --help`` prints, at a fixed width."""
    os.environ["COLUMNS"] = HELP_COLUMNS
    from torchscope.cli import main

    out = io.StringIO()
    argv = ([command] if command else []) + ["--help"]
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    return out.getvalue().rstrip() + "\n"


def commands() -> list[str]:
    """Every command, in the order ``torchscope --help`` lists them."""
    import argparse

    from torchscope.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def cli_page() -> str:
    parts = [CLI_HEAD, "\n## torchscope\n\n```text\n", help_text(None), "```\n"]
    for command in commands():
        parts += [f"\n## torchscope {command}\n\n```text\n", help_text(command), "```\n"]
    return "".join(parts)


OPTIONS_HEAD = """# Options

This page is generated from the options' one declaration (`torchscope/tracer/options.py`) by
`python docs/generate.py`; a test fails when it differs. Each option is a keyword of
`torchscope.trace()` and/or `torchscope.serve()` (and of the framework callbacks, which take
`serve()`'s), a field of `torchscope.Options`, and mostly a flag of `torchscope run`, with
the same default everywhere. A bad value is one line: a `ValueError` or `TypeError` from
the API, exit code 2 from the command line.

"""


def options_page() -> str:
    import inspect
    import textwrap

    import torchscope
    from torchscope.tracer.options import OPTIONS

    rows = [
        "| option | `trace()` | `serve()` | `torchscope run` | default | what it does |",
        "|---|:-:|:-:|---|---|---|",
    ]
    for o in OPTIONS:
        flag = f"`{o.flag}`" if o.run else ""
        text = " ".join(part.strip() for part in o.help_text().split("\n")).replace("|", "\\|")
        rows.append(
            f"| `{o.name}` | {'✓' if o.trace else ''} | {'✓' if o.serve else ''} | {flag} "
            f"| `{o.default!r}` | {text} |"
        )
    signatures = ""
    for fn in (torchscope.trace, torchscope.serve):
        params = [
            f"{p.name}={p.default!r}" if p.default is not p.empty else p.name
            for p in inspect.signature(fn).parameters.values()
        ]
        head = f"torchscope.{fn.__name__}("
        lines = textwrap.wrap(
            ", ".join(params) + ")",
            88,
            initial_indent=head,
            subsequent_indent=" " * len(head),
            break_on_hyphens=False,
        )
        signatures += "\n".join(lines) + "\n"
    return OPTIONS_HEAD + "\n".join(rows) + f"\n\n```python\n{signatures}```\n"


def expected() -> dict[Path, bytes]:
    """Every generated file and the bytes it should hold."""
    files = {IMAGES / name: (SNAPSHOTS / src).read_bytes() for name, src in PICTURES.items()}
    files[CLI_PAGE] = cli_page().encode()
    files[OPTIONS_PAGE] = options_page().encode()
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--update-snapshots",
        action="store_true",
        help="re-render the snapshot tests' screens first (check them by eye before committing)",
    )
    args = ap.parse_args()
    if args.update_snapshots:
        cmd = [sys.executable, "-m", "pytest", "-q", "--snapshot-update", *SNAPSHOT_TESTS]
        subprocess.run(cmd, cwd=ROOT, check=False)
    IMAGES.mkdir(exist_ok=True)
    for path, data in expected().items():
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
