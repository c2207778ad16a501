"""The front page and the docs site: generated files current, links that resolve, no words
about how the project is made, and README's commands the ones CI runs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _generate():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def user_pages() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def test_generated_pictures_and_cli_reference_are_current():
    # The pictures are the snapshot tests' screens (those tests hold them to the UI); the CLI
    # page is every command's --help.
    stale = [
        str(path.relative_to(ROOT))
        for path, data in _generate().expected().items()
        if not path.exists() or path.read_bytes() != data
    ]
    assert not stale, f"out of date: {stale}; run: python docs/generate.py"


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.encode()) <= 25_000
    for part in ("torchscope demo", "torchscope tui PID", "--watch nan", "pip install torchscope-"):
        assert part in text


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    assert test_cmd in ci
    assert "mkdocs build --strict" in ci


def test_local_links_resolve():
    missing = []
    for page in user_pages():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing


@pytest.mark.parametrize(
    "pattern",
    [r"\bsession \d", r"\bissue \d", r"\bthis session\b", r"\bwas lent\b", r"\bsession's\b"],
)
def test_no_words_about_how_the_project_is_made(pattern):
    hits = [
        f"{page.relative_to(ROOT)}: {m.group(0)}"
        for page in user_pages()
        for m in re.finditer(pattern, page.read_text(), re.I)
    ]
    assert not hits


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    assert [p for p in pages if p not in nav] == []


@pytest.mark.parametrize(
    ("guide", "exit_code", "needs"),
    [
        ("watch.md", 3, "torch"),
        ("evaluate.md", 0, "torch"),
        ("stepping.md", 0, "torch"),
        ("frameworks.md", 3, "lightning"),
    ],
)
def test_a_guide_opens_with_what_its_example_prints(guide, exit_code, needs):
    """A guide's first example (``torchscope run ...`` or ``python examples/...``) is run as
    shown; its stderr lines (but the pid) are the guide's."""
    pytest.importorskip(needs)
    import re
    import shlex
    import subprocess
    import sys

    text = (ROOT / "docs" / "guides" / guide).read_text()
    command = re.search(r"```sh\n((?:torchscope run|python) [^\n]+)\n```", text).group(1)
    shown = re.search(r"```text\n(.*?)```", text, re.S).group(1).splitlines()
    program, *args = shlex.split(command)
    res = subprocess.run(
        [sys.executable, *(["-m", "torchscope"] if program == "torchscope" else []), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == exit_code, res.stderr[-2000:]
    assert said(res.stderr.splitlines()) == said(shown)


def said(lines: list[str]) -> list[str]:
    """The torchscope lines among ``lines``, their pids written ``PID``."""
    return [re.sub(r"tui \d+", "tui PID", x) for x in lines if x.startswith("torchscope")]


@pytest.mark.parametrize(
    ("guide", "exit_code"), [("aten.md", 0), ("history.md", 0), ("recordings.md", 1)]
)
def test_a_guide_shows_what_its_example_reads_back(guide, exit_code, tmp_path):
    """A guide whose example records runs and reads them back is run as shown, in a folder
    holding the examples; what it shows is what the reading prints (numbers to 5 digits:
    another CPU's kernels may round the last one otherwise)."""
    pytest.importorskip("torch")
    import re
    import shlex
    import shutil
    import subprocess
    import sys

    text = (ROOT / "docs" / "guides" / guide).read_text()
    *records, read = re.search(
        r"```sh\n((?:torchscope run [^\n]+\n)+torchscope [^\n]+)\n```", text
    )[1].splitlines()
    shown = re.search(r"```text\n(.*?)```", text, re.S)[1]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")

    def run(command: str, expected: int) -> str:
        res = subprocess.run(
            [sys.executable, "-m", "torchscope", *shlex.split(command)[1:]],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == expected, res.stderr[-2000:]
        return res.stdout

    for command in records:
        run(command, 0)
    printed = run(read, exit_code)
    assert rounded(printed) == rounded(shown)


def rounded(text: str) -> str:
    """``text`` with each decimal number to 5 significant digits."""
    return re.sub(r"-?\d+\.\d+(?:e[-+]?\d+)?", lambda m: f"{float(m[0]):.5g}", text)


def test_the_attach_guides_example_attaches_to_its_job(tmp_path):
    """The attach guide's example, as a user types it: the job runs dormant and is listed,
    ``record --next 3`` writes three traced steps, and the job says on stderr when it was
    armed and when it went dormant again, three steps later."""
    pytest.importorskip("torch")
    import re
    import shlex
    import subprocess
    import sys

    text = (ROOT / "docs" / "guides" / "attach.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    start, listing, record = (line.split("#")[0].strip() for line in block.splitlines())
    shown_pid = re.search(r"record (\d+)", record).group(1)
    job = subprocess.Popen(
        [sys.executable, "-m", "torchscope", *shlex.split(start.rstrip("& "))[1:]],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert job.stderr is not None
    try:
        said = job.stderr.readline()
        assert said.startswith("torchscope: running examples/long_job.py dormant"), said

        def torchscope(command: str) -> subprocess.CompletedProcess:
            argv = [str(job.pid) if a == shown_pid else a for a in shlex.split(command)[1:]]
            return subprocess.run(
                [sys.executable, "-m", "torchscope", *argv],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
            )

        ls = torchscope(listing)
        assert any(line.split()[:1] == [str(job.pid)] for line in ls.stdout.splitlines())
        rec = torchscope(record)
        assert rec.returncode == 0, rec.stderr
        assert re.fullmatch(
            r"torchscope: \d+ events, 3 traced steps written to t.tsc\n", rec.stderr
        )
        # the job lets go at its next step boundary, which may come after record's end
        lines = [said]
        while lines[-1] and "dormant again" not in lines[-1]:
            lines.append(job.stderr.readline())
    finally:
        job.terminate()
        job.communicate(timeout=60)
    rest = "".join(lines)
    armed = re.search(r"tracing from step (\d+) \(held by: record\)", rest)
    dormant = re.search(r"dormant again at step (\d+) \(held by: nobody\)", rest)
    assert armed and dormant, rest
    assert int(dormant.group(1)) == int(armed.group(1)) + 3


def test_the_ranks_guides_example_names_one_origin_across_ranks():
    """The ranks guide's example under torchrun, as shown: each rank's lines are the guide's
    (the two ranks' order varies; pids aside)."""
    pytest.importorskip("torch")
    import shlex

    from ranks import ended_well, torchrun

    text = (ROOT / "docs" / "guides" / "ranks.md").read_text()
    command = re.search(r"```sh\n(torchrun [^\n]+)\n```", text)[1]
    head = "torchrun --standalone --nproc_per_node 2 "
    assert command.startswith(head)
    shown = re.search(r"```text\n(.*?)```", text, re.S)[1].splitlines()
    job = torchrun(*shlex.split(command[len(head) :]), cwd=ROOT, env={"OMP_NUM_THREADS": "1"})
    try:
        _, err = job.communicate(timeout=240)
    finally:
        job.kill()
    assert ended_well(job, err), err[-3000:]

    assert sorted(said(err.splitlines())) == sorted(said(shown))
