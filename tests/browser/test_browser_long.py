"""The app at 32,768 tokens in a real headless Chromium (issue 39): a Llama-style model with a 32k context, built
here with transformers' ``LlamaConfig`` (random weights, the bundled tokenizer), a prompt of exactly 32,768
tokens, one Step (the prefill, every layer on the fused path), then Attention → Zoom: the head's overview
(block mean and block max), a box drawn on it and then on the zoomed region down to ≤ 256 × 256 exact cells, the
query-row strip, and the layer's long-context statistics — each checked in the browser, the exact cells and the
strip against transformers' own eager attention weights.

Minutes on a 2-core machine (the prefill alone is ~30 s, the first overview and the statistics each a pass over
QKᵀ of 32k × 32k), so it is marked ``long_context`` and left out of a plain run:
``python -m pytest -m long_context tests/browser/test_browser_long.py``. ``SAVE_SCREENSHOTS=1`` (or
``long_overview,long_zoom,long_statistics,long_stages,long_stages_1280,long_overview_1280``)
also writes the screenshots docs/views.md shows.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.app_in_browser import (
    PANELS,
    STATE,
    chromium_page,
    clipped_labels,
    load_directory,
    open_app,
    page_state,
    runs_finished,
    streamlit_server,
)

pytestmark = pytest.mark.long_context

ROOT = Path(__file__).resolve().parents[2]
N = 32_768  # tokens of the prompt: the prefill is n = t = 32,768
SHAPE = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
SENTENCES = ("Tom had a big red kite. ", "One day, Tom went to the park with his friend Lily. ",
             "The sun was warm and the wind was strong. ", "Lily laughed and ran after the kite. ")
LAYER, HEAD = 0, 0  # the head Attention opens on: each other pick would cost a pass over QKᵀ
TOL = 1e-5  # our GPT's recomputed weights against transformers' eager ones: two implementations


def saving(name: str) -> bool:
    from tests.browser.test_browser import saving as wanted

    return wanted(name)


def llama_directory(directory: Path, n: int) -> Path:
    """A random-weight Llama-style model whose context holds an ``n``-token prompt and the token it chooses."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gpt_shape_tracer.model.sources import BUNDLED_DIR

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE, max_position_embeddings=n + 1)).eval()
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return directory


def prompt_of(tokenizer, n: int) -> tuple[str, list[int]]:
    """A one-line story of exactly ``n`` tokens of ``tokenizer`` (sentences repeated, then cut at a word whose
    text encodes back to the same ids), and its ids."""
    text = ""
    i = 0
    while len(tokenizer.encode(text)) < n + 8:
        text += "".join(SENTENCES[(i + j) % len(SENTENCES)] for j in range(64))
        i += 1
    ids = tokenizer.encode(text)[:n]
    while True:
        cut = tokenizer.decode(ids)
        again = tokenizer.encode(cut)
        if again == ids:
            return cut, ids
        ids = again[:n] if len(again) > n else again + tokenizer.encode(" a")[: n - len(again)]


def wait_rerun(page, before: int, timeout: float) -> None:
    """Wait for a rerun that finishes after ``before`` and for every chart to be drawn, up to ``timeout`` s."""
    try:
        page.wait_for_function(f"() => (window.__stRuns || 0) > {before}", timeout=timeout * 1000)
        page.wait_for_function(f"() => ({STATE})() === 'notRunning'", timeout=timeout * 1000)
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=\"stPlotlyChart\"]').length"
            " <= document.querySelectorAll('.js-plotly-plot').length", timeout=timeout * 1000)
        page.wait_for_function(f"() => ({PANELS})().every(p => p && p.dataset.revision === p.__handed)",
                               timeout=timeout * 1000)
    except Exception as e:
        raise AssertionError(f"no rerun finished in {timeout} s: {page_state(page)}") from e


def act(page, action, timeout: float = 600) -> float:
    """Do ``action()`` (a click, a key), wait for the rerun it starts; its seconds."""
    before = runs_finished(page)
    started = time.perf_counter()
    action()
    wait_rerun(page, before, timeout)
    print(f"  {time.perf_counter() - started:.1f} s", flush=True)
    return time.perf_counter() - started


def chart_named(page, title: str) -> int:
    """The index among the page's plotly charts of the one whose title starts with ``title``."""
    titles = page.evaluate("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                           ".map(d => (d._fullLayout.title || {}).text || '')")
    found = [i for i, t in enumerate(titles) if t.startswith(title)]
    assert found, (title, titles)
    return found[-1]


def heatmap_of(page, index: int) -> dict:
    """The first heatmap of chart ``index`` as the browser holds it: z as rows of numbers, x and y."""
    return page.evaluate("""(i) => {
        const t = document.querySelectorAll('.js-plotly-plot')[i]._fullData.find(t => t.type === 'heatmap');
        const rows = Array.from(t._z || t.z, r => Array.from(r));
        return {z: rows, x: Array.from(t.x), y: Array.from(t.y)};
    }""", index)


def draw_box(page, index: int, x: tuple[float, float], y: tuple[float, float]) -> None:
    """Drag a box on chart ``index`` from data coordinates (x0, y0) to (x1, y1), as a person does with the mouse
    (the chart is in box-select mode), and let go."""
    page.evaluate("(i) => document.querySelectorAll('.js-plotly-plot')[i].scrollIntoView({block: 'center'})", index)
    (x0, y0), (x1, y1) = (page.evaluate("""([i, x, y]) => {
        const gd = document.querySelectorAll('.js-plotly-plot')[i], box = gd.getBoundingClientRect();
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        return [box.left + xa._offset + xa.l2p(x), box.top + ya._offset + ya.l2p(y)];
    }""", [index, px, py]) for px, py in ((x[0], y[0]), (x[1], y[1])))
    page.mouse.move(x0, y0)
    page.mouse.down()
    for k in range(1, 11):
        page.mouse.move(x0 + (x1 - x0) * k / 10, y0 + (y1 - y0) * k / 10)
    page.mouse.up()


def number_input(page, label: str) -> int:
    return int(page.get_by_label(label, exact=True).input_value().replace(",", ""))


def eager_rows(directory: Path, ids: list[int], upto: int) -> torch.Tensor:
    """transformers' own eager attention weights of layer ``LAYER``, head ``HEAD`` for the first ``upto`` tokens
    ``[upto, upto]``: causal, so rows < ``upto`` of the 32k prefill's pattern are these rows exactly."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([ids[:upto]]), output_attentions=True)
    return out.attentions[LAYER][0, HEAD].float()


def drive(page, url: str, directory: Path, n: int, shots: Path | None = None) -> dict[str, float]:
    """The person's path through the app at ``n`` tokens; returns the seconds of each action."""
    from gpt_shape_tracer.model import load_bundled

    _, tok = load_bundled()
    text, ids = prompt_of(tok, n)
    assert len(ids) == n
    seconds: dict[str, float] = {}
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def shot(name: str, top=None) -> None:
        """The viewport, scrolled so that ``top`` (a locator) is at its top."""
        if shots is not None and saving(name):
            top.first.evaluate("e => e.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(400)
            page.screenshot(path=str(shots / f"{name}.png"))

    open_app(page, url)
    box = page.get_by_label("Prompt (one line per sequence: several lines make a batch)")
    box.wait_for(timeout=180_000)  # a loaded machine draws the sidebar late

    def type_prompt(prompt: str) -> float:
        box.fill(prompt, timeout=180_000)
        return act(page, lambda: box.press("Control+Enter"))

    # the tabs are opened on a short prompt first — Attention → Zoom, which the app reopens after a Reset — so
    # that the long prompt's prefill draws the Zoom directly (Stages is opened at the end)
    type_prompt(SENTENCES[0].strip())
    started = time.perf_counter()
    load_directory(page, directory)
    page.get_by_text(f"n_ctx = {n + 1}").first.wait_for(timeout=180_000)
    seconds["load"] = time.perf_counter() - started
    act(page, lambda: page.get_by_role("button", name="Step", exact=True).click())
    act(page, lambda: page.get_by_role("tab", name="Attention", exact=True).click())
    act(page, lambda: page.get_by_role("tab", name="Zoom", exact=True).click())
    # a short prompt runs the fused kernel too (attention is fused at every length since issue 53)
    page.get_by_text("This layer ran the fused kernel").wait_for(timeout=60_000)
    seconds["prompt"] = type_prompt(text)
    act(page, lambda: page.get_by_role("button", name="Reset", exact=True).click())
    act(page, lambda: page.get_by_role("button", name="Discard", exact=True).click())
    seconds["prefill and zoom"] = act(page, lambda: page.get_by_role("button", name="Step", exact=True).click(),
                                      1800)
    metric = page.locator('[data-testid="stMetric"]').filter(has_text="new positions n")
    assert metric.locator('[data-testid="stMetricValue"]').inner_text().replace(",", "") == str(n)
    assert page.get_by_role("tab", name="Zoom", exact=True).get_attribute("aria-selected") == "true"
    assert page.get_by_text("This layer ran the fused kernel").count() == 1

    # the overview: 128 × 128 blocks of 256 × 256 cells, labelled; then the same as block max
    over = chart_named(page, "block mean of up to")
    title = page.evaluate("(i) => document.querySelectorAll('.js-plotly-plot')[i]._fullLayout.title.text", over)
    width = -(-n // 128)
    assert f"block mean of up to {width:,} queries × {width:,} keys per cell, 128 × 128 cells" in title, title
    heat = heatmap_of(page, over)
    assert len(heat["z"]) == 128 and len(heat["z"][0]) == 128
    assert heat["x"][0] == -0.5 and heat["x"][-1] == n - 0.5  # cell edges on an axis of key positions
    mean_z = heat["z"]
    shot("long_overview", page.get_by_text("This layer ran the fused kernel"))
    seconds["block max"] = act(page, lambda: page.get_by_label("overview cells").get_by_text("max", exact=True).click())
    over = chart_named(page, "block max of up to")
    peak_z = heatmap_of(page, over)["z"]
    assert all(p >= m - 1e-7 for pr, mr in zip(peak_z, mean_z) for p, m in zip(pr, mr))  # a max ≥ the mean
    assert any(p > m + 1e-4 for pr, mr in zip(peak_z, mean_z) for p, m in zip(pr, mr))

    # a box on the overview: rows 1,000–3,000 × keys 500–2,500 (block means: more than 256 × 256)
    seconds["box on overview"] = act(page, lambda: draw_box(page, over, (500, 2500), (1000, 3000)))
    got = [number_input(page, x) for x in ("first query row", "last query row", "first key", "last key")]
    assert abs(got[0] - 1000) <= 0.02 * n and abs(got[2] - 500) <= 0.02 * n, got  # within a pixel or two
    assert got[1] - got[0] > 256 and got[3] - got[2] > 256, got
    region = chart_named(page, f"queries {got[0]:,}–{got[1]:,} × keys {got[2]:,}–{got[3]:,}: block means")
    # a box inside it: about 200 × 200 cells, exact
    r_mid, c_mid = (got[0] + got[1]) // 2, (got[2] + got[3]) // 2
    seconds["box on region"] = act(page, lambda: draw_box(page, region, (c_mid - 100, c_mid + 100),
                                                          (r_mid - 100, r_mid + 100)))
    page.wait_for_function(f"() => ({STATE})() === 'notRunning'", timeout=600_000)  # the rerun it asks for
    r0, r1, k0, k1 = (number_input(page, x) for x in ("first query row", "last query row", "first key", "last key"))
    assert 150 <= r1 - r0 + 1 <= 256 and 150 <= k1 - k0 + 1 <= 256, (r0, r1, k0, k1)
    region = chart_named(page, f"queries {r0:,}–{r1:,} × keys {k0:,}–{k1:,}: exact weights")
    cells = heatmap_of(page, region)
    assert cells["x"] == list(range(k0, k1 + 1)) and cells["y"] == list(range(r0, r1 + 1))
    shot("long_zoom", page.get_by_text("first query row", exact=True))

    # the query-row strip of a row inside the region
    field = page.get_by_label("query row for the strip", exact=True)
    seconds["row strip"] = act(page, lambda: (field.fill(str(r1)), field.press("Enter")))
    strip = chart_named(page, f"query {r1}: its weight on each of {n:,} keys")
    strip_y = page.evaluate("(i) => Array.from(document.querySelectorAll('.js-plotly-plot')[i]._fullData[0].y)",
                            strip)
    assert len(strip_y) == n
    named = page.evaluate("(i) => Array.from(document.querySelectorAll('.js-plotly-plot')[i]._fullData[1].text)",
                          strip)
    assert len(named) == 8 and all(t.replace(",", "").isdigit() for t in named)

    # the layer's long-context statistics: one row per head, one line per head
    seconds["statistics"] = act(page, lambda: page.get_by_text("long-context statistics of this layer").click(),
                                1200)
    page.get_by_text(f"Each number is a mean over this layer's {n:,} query rows").wait_for(timeout=60_000)
    table = page.locator('[data-testid="stDataFrame"]').last
    table.get_by_text("entropy (nats)").first.wait_for(state="attached", timeout=60_000)
    lines = page.evaluate("(i) => document.querySelectorAll('.js-plotly-plot')[i]._fullData.length",
                          chart_named(page, "mean weight by distance"))
    assert lines == SHAPE["num_attention_heads"]
    shot("long_statistics", page.get_by_text("query row for the strip", exact=True))
    clipped = clipped_labels(page)

    # Stages at 32k: its query row drawn bounded (a 32k-span row and a 32k-option list crashed the tab before)
    seconds["stages"] = act(page, lambda: page.get_by_role("tab", name="Stages", exact=True).click(), 1200)
    page.get_by_label(f"query row (0 … {n - 1:,}): which keys does it attend to?").wait_for(timeout=120_000)
    page.get_by_text(f"of the {n:,} keys drawn").first.wait_for(timeout=60_000)
    shot("long_stages", page.get_by_text("QKᵀ").first)
    clipped += clipped_labels(page)

    # the exact cells and the strip against transformers' own eager weights of the first r1 + 1 tokens
    want = eager_rows(directory, ids, r1 + 1)
    z = torch.tensor(cells["z"])
    assert (z - want[r0:r1 + 1, k0:k1 + 1]).abs().max() <= TOL
    assert (torch.tensor(strip_y[:r1 + 1]) - want[r1]).abs().max() <= TOL
    assert max(abs(v) for v in strip_y[r1 + 1:]) == 0  # causal: no weight on a later key
    assert not errors, errors
    assert not clipped, clipped
    return seconds


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return llama_directory(tmp_path_factory.mktemp("llama-32k"), N)


@pytest.mark.timeout(3600)  # minutes of prefill and passes over QKᵀ; longer on a loaded machine
def test_the_app_at_32k_tokens_overview_box_zoom_row_and_statistics(directory, browser):
    shots = ROOT / "assets" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    # the package's Chromium (tests/browser/conftest.py): a second Playwright cannot start while its loop runs
    with streamlit_server() as url, chromium_page(1600, 1000, browser) as page:
        seconds = drive(page, url, directory, N, shots)
        print("seconds:", {k: round(v, 1) for k, v in seconds.items()})
        page.set_viewport_size({"width": 1280, "height": 800})  # the same views at the smaller size
        page.wait_for_timeout(500)
        assert not clipped_labels(page)
        if saving("long_stages_1280"):  # Stages is the tab open last: the pattern panel's clipped colour scale
            page.get_by_text("QKᵀ").first.evaluate("e => e.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(400)
            page.screenshot(path=str(shots / "long_stages_1280.png"))
        if saving("long_overview_1280") or saving("long_zoom_1280"):
            act(page, lambda: page.get_by_role("tab", name="Zoom", exact=True).click(), 1200)
        for name, top in (("long_overview_1280", "This layer ran the fused kernel"),
                          ("long_zoom_1280", "first query row")):
            if saving(name):
                page.get_by_text(top).first.evaluate("e => e.scrollIntoView({block: 'start'})")
                page.wait_for_timeout(400)
                page.screenshot(path=str(shots / f"{name}.png"))
