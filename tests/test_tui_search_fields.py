"""`/` search and `|` filter match each field a row shows on its own: the name (as shown,
`F.layer_norm`, and in full), the module (or parameter), the source (as shown, `train.py:21`,
and the full path). `^` and `$` anchor within one field; nothing matches across two fields;
the prompt says which fields are searched."""

from __future__ import annotations

import json

from tui_pilot import SIZE, sync, until

from torchscope.session.format import short_name, source_cell
from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource

# The synthetic model, its linear layers renamed so that one module path is a prefix of
# another: blocks.0.attn and blocks.0.attn.proj.
_TEXT = json.dumps(make_trace(2, 2))
TRACE = json.loads(
    _TEXT.replace("blocks.0.fc", "blocks.0.attn").replace("blocks.1.fc", "blocks.0.attn.proj")
)


def replay() -> ScriptedSource:
    return ScriptedSource(TRACE, mode="replay")


async def shown(pilot, app: TorchscopeApp) -> None:
    await until(
        pilot,
        lambda: app.main.current_step == 0 and app.main.timeline.row_count() > 0,
        what="step 0 shown",
    )


def rows(app: TorchscopeApp) -> list:
    tl = app.main.timeline
    return [tl.row(i) for i in range(tl.row_count())]


def where(app: TorchscopeApp, keep) -> list[int]:
    """Indices (as shown) of the rows ``keep`` accepts."""
    return [i for i, row in enumerate(rows(app)) if keep(row)]


async def search(pilot, app: TorchscopeApp, text: str) -> None:
    main = app.main
    await pilot.press("escape", "slash", *text)
    await until(
        pilot,
        lambda: main.filter.mode.name == "search" and main.filter.value == text,
        what=f"search /{text}/ typed",
    )


async def keep(pilot, app: TorchscopeApp, text: str) -> None:
    tl = app.main.timeline
    await pilot.press("vertical_line", "ctrl+u", *text, "enter")
    await until(
        pilot,
        lambda: tl.pattern is not None and tl.pattern.pattern == text,
        what=f"filter /{text}/",
    )


@sync
async def test_a_search_for_the_shown_name_finds_the_rows_shown_so():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await shown(pilot, app)
        norms = where(app, lambda r: r.is_op and short_name(r.name) == "F.layer_norm")
        assert len(norms) >= 2
        for text in ("F.layer_norm", r"^F\.layer_norm$", "layer_norm"):
            await search(pilot, app, text)
            await until(pilot, lambda: tl.cursor == norms[0], what=f"/{text}/ at a layer_norm")
            assert "no match" not in main.filter.border_title
            assert [i for i, _ in main.matches()] == norms
        # the full name matches too, anchored within that field
        await search(pilot, app, r"^torch\.nn\.functional\.layer_norm$")
        await until(pilot, lambda: [i for i, _ in main.matches()] == norms, what="full name")
        # the filter keeps the rows shown as F.layer_norm, and only those
        await pilot.press("escape")
        await keep(pilot, app, "F.layer_norm")
        assert {short_name(r.name) for r in rows(app)} == {"F.layer_norm"}
        assert len(rows(app)) == len(norms)


@sync
async def test_dollar_anchors_the_module_path_not_a_hidden_joined_string():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        tl = app.main.timeline
        await shown(pilot, app)
        attn = [r.seq for r in rows(app) if r.module == "blocks.0.attn"]
        assert attn and any(r.module == "blocks.0.attn.proj" for r in rows(app))
        await keep(pilot, app, r"blocks\.0\.attn$")
        kept = rows(app)
        assert [r.seq for r in kept] == attn
        assert {r.module for r in kept} == {"blocks.0.attn"}
        assert any(r.is_op for r in kept)  # the op and its nodes (they have its module)
        # without the anchor, the sub-module's rows come along
        await keep(pilot, app, r"blocks\.0\.attn")
        assert {r.module for r in rows(app)} >= {"blocks.0.attn", "blocks.0.attn.proj"}
        # a parameter is its own field: ^...weight$ keeps its accumulation rows
        await keep(pilot, app, r"^blocks\.0\.attn\.weight$")
        assert rows(app) and {r.param for r in rows(app)} == {"blocks.0.attn.weight"}
        assert f"{tl.row_count():,} shown" in tl.border_subtitle


@sync
async def test_the_source_matches_as_shown_and_as_the_full_path():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await shown(pilot, app)
        line21 = where(app, lambda r: source_cell(r.source) == "train.py:21")
        line2x = where(app, lambda r: source_cell(r.source).startswith("train.py:2"))
        assert line21 and len(line2x) > len(line21)
        await search(pilot, app, "^train.py:2")
        await until(pilot, lambda: [i for i, _ in main.matches()] == line2x, what="^train.py:2")
        await search(pilot, app, r"^train\.py:21$")
        await until(pilot, lambda: [i for i, _ in main.matches()] == line21, what="line 21")
        full = rows(app)[line21[0]].source
        assert full != "train.py:21" and full.endswith("/train.py:21")
        await pilot.press("escape")
        await keep(pilot, app, "^" + full.replace(".", r"\.") + "$")
        assert [source_cell(r.source) for r in rows(app)] == ["train.py:21"] * len(line21)


@sync
async def test_a_pattern_across_two_fields_matches_nothing():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main, tl = app.main, app.main.timeline
        await shown(pilot, app)
        total = tl.row_count()
        for text in ("linear blocks", r"linear\sblocks", "linear.blocks", r"attn\s+/work"):
            await search(pilot, app, text)
            await until(
                pilot,
                lambda: "no match" in main.filter.border_title,
                what=f"/{text}/: no match",
            )
            assert main.matches() == [] and tl.row_count() == total
        await pilot.press("escape")
        await keep(pilot, app, r"linear\sblocks")
        assert tl.row_count() == 0
        # either field alone still matches
        await keep(pilot, app, "linear|blocks")
        assert tl.row_count() > 0


@sync
async def test_the_prompt_says_which_fields_are_searched_and_bad_regexes_are_told():
    app = TorchscopeApp(replay())
    async with app.run_test(size=SIZE) as pilot:
        main = app.main
        await shown(pilot, app)
        for key, mode in (("slash", "search"), ("vertical_line", "filter")):
            await pilot.press(key)
            await until(pilot, lambda m=mode: main.filter.display and main.filter.mode.name == m)
            assert "name · module · source" in main.filter.placeholder
            assert "name · module · source" in main.filter.border_title
            await pilot.press("(")
            await until(pilot, lambda: "invalid regex" in main.filter.border_title)
            await pilot.press("escape")
            await until(pilot, lambda: not main.filter.display, what="prompt closed")
