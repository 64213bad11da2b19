"""The attention Stages drawn on a canvas (gui/panels.js), in a real Chromium: each cell in the colour plotly's own
colour scale gives its value, a masked cell grey and silent, hover writing the cell's row and column and its value in
every stage and drawing its row and column across every panel, read again when the drawing changes under a resting
pointer, no label cut off at either width; and the colour limits and colour-bar ticks of figures/panels.py equal to
those plotly.js itself computes for the same figures (plotly.min.js, as the plotly package ships it, plotted offline
in a blank page), at the app's settings and on scales from 10⁻³ to 10³⁸."""

from __future__ import annotations

import json
from pathlib import Path

import plotly
import plotly.colors
import pytest
import torch

from gpt_shape_tracer.figures.attention import attention_stages_figure
from gpt_shape_tracer.figures.palette import MASKED
from gpt_shape_tracer.figures.panels import panels_spec
from gpt_shape_tracer.tracer import TracedGeneration
from tests.app_in_browser import (
    PANELS,
    chromium_page,
    click,
    open_app,
    open_tab,
    panels_data,
    set_prompt,
    wait_idle,
)

PROMPT = "Tom had a big red kite. One day, Tom went to the park."


def _root(page) -> str:
    """JavaScript for the page's first heatmap-panels canvas."""
    return f"({PANELS})()[0]"


def _cell_point(page, panel: int, row: int, col: int) -> tuple[float, float]:
    """A cell's centre on the page, from the drawn spec and the canvas's box (as gui/panels.js places it)."""
    return tuple(page.evaluate(f"""([k, i, j]) => {{
        const root = {_root(page)}, s = root.__spec, p = s.panels[k];
        const box = root.getBoundingClientRect();
        const pw = box.width - s.margin.l - s.margin.r, ph = s.height - s.margin.t - s.margin.b;
        const x0 = s.margin.l + p.domain[0] * pw, x1 = s.margin.l + p.domain[1] * pw;
        const y0 = s.margin.t + (1 - p.ydomain[1]) * ph, y1 = s.margin.t + (1 - p.ydomain[0]) * ph;
        return [box.left + x0 + (j + 0.5) * (x1 - x0) / p.z[0].length,
                box.top + y0 + (i + 0.5) * (y1 - y0) / p.z.length];
    }}""", [panel, row, col]))


def _pixel(page, which: str, x: float, y: float) -> list[int]:
    """The RGBA of a canvas of the panels (``which``: 0 the cells, 1 the hover overlay) at page point (x, y)."""
    return page.evaluate(f"""([w, x, y]) => {{
        const root = {_root(page)}, c = root.querySelectorAll('canvas')[w], box = c.getBoundingClientRect();
        const r = c.width / box.width;
        return Array.from(c.getContext('2d').getImageData(Math.floor((x - box.left) * r),
                                                          Math.floor((y - box.top) * r), 1, 1).data);
    }}""", [int(which), x, y])


def _tip(page) -> str:
    return page.evaluate(f"() => {{ const t = {_root(page)}.querySelector('.panels-tip');"
                         " return t.style.display === 'none' ? '' : t.innerText; }")


def _overlaps(page) -> list[str]:
    """Pairs of the drawing's titles (the figure's, the panels', the colour bars') whose boxes overlap."""
    return page.evaluate(f"""() => {{
        const boxes = [...{_root(page)}.querySelectorAll('.panels-text > div')].map(d => [d.textContent,
                                                                                    d.getBoundingClientRect()]);
        const out = [];
        for (let a = 0; a < boxes.length; a++) for (let b = a + 1; b < boxes.length; b++) {{
            const [s, p] = boxes[a], [t, q] = boxes[b];
            const w = Math.min(p.right, q.right) - Math.max(p.left, q.left);
            const h = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
            if (w > 1 && h > 1) out.push(`${{s}} / ${{t}}`);
        }}
        return out;
    }}""")


def _expected_colour(panel: dict, value: float) -> list[int]:
    """The colour plotly's own colour-scale sampling gives ``value`` on the panel's scale and limits."""
    f = min(1.0, max(0.0, (value - panel["zmin"]) / (panel["zmax"] - panel["zmin"])))
    rgb = plotly.colors.sample_colorscale(panel["colours"], [f])[0]
    return [round(float(c)) for c in rgb[rgb.index("(") + 1:-1].split(",")]


def test_the_stages_canvas_colours_hovers_and_fits(url, browser):
    with chromium_page(1600, 1000, browser) as page:
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        open_app(page, url)
        set_prompt(page, PROMPT)
        for _ in range(3):
            click(page, "Step")
        open_tab(page, "Attention")
        open_tab(page, "Stages")
        drawn = panels_data(page)[0]
        spec = drawn["spec"]
        assert [(p["rows"], p["cols"]) for p in drawn["panels"]] == [(1, len(spec["panels"][0]["x"]))] * 4
        assert drawn["clipped"] == [] and _overlaps(page) == []
        page.locator(".panels").first.scroll_into_view_if_needed()
        # a decode step: one query row; the cell of the last key, in each panel
        for k, panel in enumerate(spec["panels"]):
            j = len(panel["x"]) - 1
            x, y = _cell_point(page, k, 0, j)
            got = _pixel(page, "0", x, y)
            want = _expected_colour(panel, panel["z"][0][j])
            assert max(abs(a - b) for a, b in zip(got[:3], want)) <= 2, (k, got, want)
            page.mouse.move(x, y)
            page.wait_for_function(f"() => {_root(page)}.dataset.hovered === '{k},0,{j}'")
            lines = _tip(page).split("\n")
            assert lines[:2] == [f"row {panel['y'][0]}", f"column {panel['x'][j]}"], lines
            # the cell read in every panel, the hovered one's first: a score followed through the stages
            order = [k] + [m for m in range(4) if m != k]
            for line, m in zip(lines[2:], order, strict=True):
                other = spec["panels"][m]
                name, _, value = line.rpartition(": ")
                assert name == other["name"] and other["name"], (line, other["name"])
                assert float(value.replace("−", "-")) == pytest.approx(other["z"][0][j], rel=1e-3), line  # 4 digits
            for m in range(4):  # the row's and the column's lines across each panel, nothing between them
                xm, ym = _cell_point(page, m, 0, j)
                assert _pixel(page, "1", xm - 3, ym)[3] > 0 and _pixel(page, "1", xm, ym - 3)[3] > 0, m
                assert _pixel(page, "1", xm - 3, ym - 3)[3] == 0, m
        # the pointer resting on a cell while another head is picked (with the keyboard): what it shows is read again
        # from the new drawing, not left from the one before
        j = len(spec["panels"][0]["x"]) - 1
        page.mouse.move(*_cell_point(page, 0, 0, j))
        page.wait_for_function(f"() => {_root(page)}.dataset.hovered === '0,0,{j}'")
        old = _tip(page)
        revision = page.evaluate(f"() => {_root(page)}.dataset.revision")
        head = page.locator('[data-testid="stSelectbox"]').filter(has_text="head").locator("input")
        head.focus()
        page.keyboard.press("ArrowDown")
        page.keyboard.type("2")
        page.keyboard.press("Enter")
        wait_idle(page)
        page.wait_for_function(f"() => {_root(page)}.dataset.revision !== '{revision}'")
        spec = panels_data(page)[0]["spec"]
        assert page.evaluate(f"() => {_root(page)}.dataset.hovered") == f"0,0,{j}"
        lines = _tip(page).split("\n")
        assert lines != old.split("\n"), lines
        assert float(lines[2].rpartition(": ")[2].replace("−", "-")) == pytest.approx(
            spec["panels"][0]["z"][0][j], rel=1e-3)
        page.mouse.move(5, 5)
        page.wait_for_function(f"() => {_root(page)}.dataset.hovered === ''")
        assert _tip(page) == ""

        # the prefill: M's panel holds −∞ above the diagonal, drawn grey, with nothing to hover
        revision = page.evaluate(f"() => {_root(page)}.dataset.revision")
        page.get_by_role("slider").first.focus()
        page.keyboard.press("Home")
        wait_idle(page)
        page.wait_for_function(f"() => {_root(page)}.dataset.revision !== '{revision}'")
        spec = panels_data(page)[0]["spec"]
        masked = spec["panels"][2]
        assert masked["z"][0][1] is None and masked["masked"] == "rgb({}, {}, {})".format(
            *plotly.colors.hex_to_rgb(MASKED))
        x, y = _cell_point(page, 2, 0, 1)
        assert _pixel(page, "0", x, y)[:3] == list(plotly.colors.hex_to_rgb(MASKED))
        page.mouse.move(x, y)
        page.wait_for_timeout(200)
        assert _tip(page) == "" and page.evaluate(f"() => {_root(page)}.dataset.hovered") == ""

        # narrower: the canvas follows its column's width and still cuts off no label
        width = page.evaluate(f"() => {_root(page)}.clientWidth")
        page.set_viewport_size({"width": 1280, "height": 800})
        root = _root(page)
        page.wait_for_function(f"() => {root}.clientWidth < {width} && "
                               f"{root}.querySelector('canvas').style.width === {root}.clientWidth + 'px'")
        assert panels_data(page)[0]["clipped"] == []
        assert _overlaps(page) == []  # a panel's title wraps within its panel: it ran into a colour bar's title here
        assert not errors, errors


@pytest.fixture(scope="module")
def figures():
    from gpt_shape_tracer.model import load_bundled

    out = []
    for name in ("story-gpt", "story-llama"):
        model, tok = load_bundled(name)
        gen = TracedGeneration(model, tok, [PROMPT, "Tom had"], temperature=0.0)
        gen.run(3)
        for step, layer, head, batch, shared in ((0, 0, 0, 0, False), (0, 1, 2, 1, True), (2, 2, 1, 0, False),
                                                 (2, 3, 3, 1, True)):
            out.append(attention_stages_figure(gen.trace, step, layer, head, batch, shared))
    from gpt_shape_tracer.figures.heatmap import add, grid, style_axes
    from gpt_shape_tracer.figures.plot import figure

    for top in (5e-4, 4e4, 2e9, 3.4e38, 0.00249):  # colour bars past 10³ and below 10⁻³: SI prefixes, ×10ⁿ
        fig = figure()
        g = grid((torch.linspace(-1, 1, 12, dtype=torch.float64) * top).float().reshape(3, 4), ["a", "b", "c", "d"],
                 ["p", "q", "r"])
        add(fig, g, "signed", colorbar="score")
        style_axes(fig, g)
        fig.update_layout(height=300)
        out.append(fig)
    model, tok = load_bundled("story-gpt")  # 192 tokens: a decode row's weights on a clipped colour scale (≥ …)
    gen = TracedGeneration(model, tok, " ".join([PROMPT] * 12), temperature=0.0)
    gen.run(2)
    out += [attention_stages_figure(gen.trace, 1, 0, 0), attention_stages_figure(gen.trace, 0, 3, 2)]
    assert "clipped" in out[-2].data[-1].colorbar.title.text
    return out


def test_colour_limits_and_colour_bar_ticks_equal_plotly_js(browser, figures):
    script = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    with chromium_page(1400, 900, browser) as page:
        page.set_content("<div id='g' style='width: 1100px'></div>")
        page.add_script_tag(content=script.read_text(encoding="utf-8"))
        for fig in figures:
            spec = panels_spec(fig)
            theirs = page.evaluate("""f => Plotly.newPlot('g', f.data, f.layout).then(gd => ({
                limits: gd._fullData.filter(t => !(t.hoverinfo === 'skip' && t.showscale === false))
                                    .map(t => [t.zmin, t.zmax]),
                ticks: Array.from(gd.querySelectorAll('.colorbar')).map(c =>
                    Array.from(c.querySelectorAll('.cbaxis text, .ytick text')).map(t => t.textContent)) }))""",
                                   json.loads(fig.to_json()))
            ours = [v for p in spec["panels"] for v in (p["zmin"], p["zmax"])]
            assert ours == pytest.approx([v for pair in theirs["limits"] for v in pair], rel=1e-6)
            # plotly writes ×10ⁿ's exponent as a superscript element: its text is the digits
            plain = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789−")
            assert [[label.translate(plain) for label in p["bar"]["labels"]] for p in spec["panels"] if p["bar"]] \
                == [[label.replace("\u200b", "") for label in bar] for bar in theirs["ticks"]]
