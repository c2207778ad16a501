"""Focus and colour: readable unfocused titles and an obvious focus at 256 and 16 colours.

tmux without COLORTERM gives 256 colours (TERM=screen: 16), and Rich quantises every colour
Textual draws (``Color.downgrade``). The colours are read from the running app (the computed
styles of the panels, the rendered cursor rows), quantised, and their WCAG contrast measured:
unfocused titles and subtitles carry information (``Step 1 · 65 ops``, ``search /x/ 2/2``).
"""

from __future__ import annotations

from rich.color import Color as RichColor
from rich.color import ColorSystem
from textual.color import Color
from tui_pilot import SIZE, focus, sync, until

from torchscope.tui.app import TorchscopeApp
from torchscope.tui.demo.synthetic import make_trace
from torchscope.tui.sources.scripted import ScriptedSource

PANELS = ("#steps", "#alerts", "#timeline", "#detail")
SYSTEMS = {"256": (ColorSystem.EIGHT_BIT, 4.5), "16": (ColorSystem.STANDARD, 3.0)}


def quantise(color: Color, system: ColorSystem) -> RichColor:
    return color.rich_color.downgrade(system)


def luminance(color: RichColor) -> float:
    def channel(v: int) -> float:
        c = v / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = color.get_truecolor()
    return 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b)


def contrast(fg: RichColor, bg: RichColor) -> float:
    hi, lo = sorted((luminance(fg), luminance(bg)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def panel_colours(widget) -> dict[str, Color]:
    """What the border line, its title and subtitle are drawn with (alpha blended)."""
    styles = widget.styles
    bg = widget.background_colors[1]
    title_bg = bg + styles.border_title_background
    subtitle_bg = bg + styles.border_subtitle_background
    return {
        "bg": bg,
        "border": bg + styles.border_top[1],
        "title_bg": title_bg,
        "title": title_bg + styles.border_title_color,
        "subtitle_bg": subtitle_bg,
        "subtitle": subtitle_bg + styles.border_subtitle_color,
        "bold": "bold" in str(styles.border_title_style),
    }


def cursor_bg(widget) -> RichColor:
    """The background the list actually paints its cursor row with."""
    line = widget.cursor + widget.HEADER_LINES - round(widget.scroll_y)
    widget._cache.clear()
    strip = widget.render_line(line)
    colours = {seg.style.bgcolor for seg in strip if seg.style and seg.text.strip()}
    assert len(colours) == 1, colours
    return colours.pop()


def new_app() -> TorchscopeApp:
    return TorchscopeApp(ScriptedSource(make_trace(3, 4, nan_step=1), mode="replay"))


async def loaded(pilot) -> None:
    a = pilot.app
    await until(pilot, lambda: len(a.store.order) == 3 and a.main.current_step is not None)
    await until(pilot, lambda: a.main.timeline.row_count() > 0 and a.main.steps.row_count() > 0)
    # laid out: the lists have their size (their cursor rows are rendered below)
    await until(pilot, lambda: a.main.timeline.size.height > 0 and a.main.steps.size.height > 0)
    await pilot.pause()


@sync
async def test_unfocused_titles_readable_and_focus_obvious_at_256_and_16_colours():
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        main = app.main
        report = []
        for selector in PANELS:
            widget = main.query_one(selector)
            other = main.query_one("#steps" if selector != "#steps" else "#timeline")
            await focus(pilot, other)
            assert not widget.has_focus
            blurred = panel_colours(widget)
            await focus(pilot, widget)
            focused = panel_colours(widget)
            assert focused["bold"] and not blurred["bold"], selector

            for name, (system, minimum) in SYSTEMS.items():
                q = {k: quantise(v, system) for k, v in blurred.items() if k != "bold"}
                f = {k: quantise(v, system) for k, v in focused.items() if k != "bold"}
                title = contrast(q["title"], q["title_bg"])
                subtitle = contrast(q["subtitle"], q["subtitle_bg"])
                border = contrast(q["border"], q["bg"])
                report.append((selector, name, q["title"].number, q["bg"].number, title, border))
                assert title >= minimum, (selector, name, q["title"], q["title_bg"], title)
                assert subtitle >= minimum, (selector, name, q["subtitle"], subtitle)
                # the border line itself stands out from the background (WCAG: 3 for non-text)
                assert border >= 3.0, (selector, name, q["border"], q["bg"], border)
                # focus changes the border colour and the title colour, after quantising
                assert f["border"].number != q["border"].number, (selector, name)
                assert f["title"].number != q["title"].number, (selector, name)
                assert contrast(f["title"], f["title_bg"]) >= minimum, (selector, name)
        print(report)


@sync
async def test_the_cursor_row_of_an_unfocused_list_is_muted():
    app = new_app()
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        main = app.main
        for widget, other in ((main.steps, main.timeline), (main.timeline, main.steps)):
            await focus(pilot, widget)
            focused = cursor_bg(widget)
            await focus(pilot, other)
            blurred = cursor_bg(widget)
            base = widget.background_colors[1].rich_color
            for system, _ in SYSTEMS.values():
                f, b, bg = (c.downgrade(system) for c in (focused, blurred, base))
                # three distinct colours: the bright cursor, the muted one, the list
                assert len({f.number, b.number, bg.number}) == 3, (widget.id, system, f, b, bg)
            # muted: neutral and darker than the focused highlight
            r, g, b_ = blurred.get_truecolor()
            assert max(r, g, b_) - min(r, g, b_) < 16, blurred
            assert luminance(blurred) < luminance(focused)
