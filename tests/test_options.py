"""Each option is declared once (``torchscope/tracer/options.py``'s ``OPTIONS``): the public
signatures, the typed keywords, the ``Options`` fields and the command line agree with it."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

import torchscope
from torchscope.cli.common import UsageError
from torchscope.cli.run import _run_usage, parse_run
from torchscope.tracer.options import OPTIONS, Options, ServeKeywords, TraceKeywords


def keywords(fn) -> dict[str, object]:
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()}


@pytest.mark.parametrize(
    ("fn", "flag", "typed"),
    [(torchscope.trace, "trace", TraceKeywords), (torchscope.serve, "serve", ServeKeywords)],
)
def test_the_public_signatures_take_the_declared_options_with_their_defaults(fn, flag, typed):
    declared = {o.name: o.default for o in OPTIONS if getattr(o, flag)}
    assert keywords(fn) == declared
    # TraceKeywords leaves out trace()'s positional record
    assert set(typing.get_type_hints(typed)) | ({"record"} if flag == "trace" else set()) == set(
        declared
    )


def test_options_fields_hold_the_declared_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(Options)}
    for o in OPTIONS:
        if o.name in ("break_on", "log", "edit"):  # parsed into breakpoints
            assert fields["breakpoints"] is dataclasses.MISSING
            continue
        assert fields[o.name] == o.default, o.name


def test_every_flag_is_documented_in_help_with_its_words():
    usage = _run_usage()
    flat = " ".join(usage.split())
    for o in OPTIONS:
        if not o.run:
            assert not o.flag, o.name
            continue
        assert f"\n  {o.flag}" in usage, o.name
        assert " ".join(o.help_text().split()) in flat, o.name


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--values", "3"], "values", 3),
        (["--lease", "2.5"], "lease", 2.5),
        (["--eval-budget=4"], "eval_budget", 4.0),
        (["--steps", "0-2"], "steps", "0-2"),
        (["--quiet"], "quiet", True),
        (["--no-live"], "live", False),
        (["--aten"], "aten", True),
        (["--aten=^blocks"], "aten", "^blocks"),
        (["--watch", "nan", "--on-nan", "skip", "--max-skips", "2"], "max_skips", 2),
    ],
)
def test_a_flag_sets_its_option(argv, field, value):
    parsed = parse_run([*argv, "train.py", "--values", "9"])  # the script's own args after it
    assert getattr(parsed, field) == value
    assert parsed.script == "train.py" and parsed.args == ["--values", "9"]


def test_an_option_not_given_has_its_declared_default_and_live_is_on():
    parsed = parse_run(["train.py"])
    for o in OPTIONS:
        if o.run and o.name not in ("break_on", "log", "edit", "live"):
            assert getattr(parsed, o.name) == o.default, o.name
    assert parsed.live is True


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--values", "x", "a.py"], "--values takes a count"),
        (["--values", "-1", "a.py"], "--values takes a count"),
        (["--max-skips", "1.5", "a.py"], "--max-skips takes a count"),
        (["--values", "²", "a.py"], "--values takes a count"),  # a digit, but not ASCII
        (["--lease", "0", "a.py"], "--lease must be a number of seconds above 0"),
        (["--eval-budget", "soon", "a.py"], "--eval-budget takes seconds"),
        (["--on-spike", "halt", "a.py"], "--on-spike takes continue, pause, stop, skip"),
        (["--quiet=1", "a.py"], "--quiet takes no value"),
        (["--record"], "--record needs a value"),
    ],
)
def test_a_bad_flag_is_one_line(argv, words):
    with pytest.raises(UsageError) as err:
        parse_run(argv)
    assert words in str(err.value) and "\n" not in str(err.value)
