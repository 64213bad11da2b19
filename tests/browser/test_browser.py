"""End to end in a real headless Chromium: one `streamlit run app.py` server and one browser page for the
module; each test loads the app into the page anew, which is a new Streamlit session (reusing the page keeps
the browser's compiled scripts: about 1 s per test instead of 2.5 s for a new browser context).

``SAVE_SCREENSHOTS=1 python -m pytest tests/browser/test_browser.py -k "every_tab or llama"`` also writes the
screenshots the README and docs/ show (assets/screenshots/); ``SAVE_SCREENSHOTS=front,shapes`` writes only those named.
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.app_in_browser import (
    app_context,
    click,
    clipped_labels,
    open_app,
    open_directory_and_step,
    open_tab,
    panels_data,
    plotly_data,
    runs_finished,
    set_prompt,
    steps_shown,
    wait_idle,
    wait_settled,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Tom had a big red kite. One day, Tom went to the park."
# the pages that show screenshots: only what they show is written
PAGES = "".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def saving(name: str) -> bool:
    """Whether SAVE_SCREENSHOTS asks for this screenshot: ``1`` for every one a page shows, or a comma list."""
    wanted = os.environ.get("SAVE_SCREENSHOTS", "")
    return f"assets/screenshots/{name}.png" in PAGES and (wanted == "1" or name in wanted.split(","))


def screenshot(page, name: str, anchor=None, settle_ms: int = 300) -> None:
    """Write assets/screenshots/``name``.png if SAVE_SCREENSHOTS asks for it: ``anchor`` (a locator) scrolled into
    view first, then a pause for fonts and canvases to settle."""
    if saving(name):
        if anchor is not None:
            anchor.scroll_into_view_if_needed()
        page.wait_for_timeout(settle_ms)
        page.screenshot(path=str(ROOT / "assets" / "screenshots" / f"{name}.png"))


def sizes(name: str, *also: str) -> list[tuple[int, int, str]]:
    """The widths a test visits: 1600 × 1000 always, 1280 × 800 (screenshot ``name``_1280) only when that screenshot,
    or one of the others the visit takes (``also``), is asked for — the page is the same, and each visit loads the
    model anew."""
    wanted = any(saving(f"{shot}_1280") for shot in (name, *also))
    return [(1600, 1000, name)] + ([(1280, 800, f"{name}_1280")] if wanted else [])


@pytest.fixture(scope="module")
def shared_page(browser):
    context = app_context(browser)
    try:
        yield context.new_page()
    finally:
        context.close()


LISTENERS: list[tuple[str, Callable]] = []  # what the running test listens to on the shared page


def listen(page, event: str, handler: Callable) -> None:
    page.on(event, handler)
    LISTENERS.append((event, handler))


@pytest.fixture
def visit(shared_page):
    """``with visit(width, height) as page``: the module's page at that size, for one test; what the test
    listened to is removed after it."""

    @contextmanager
    def sized(width: int, height: int):
        shared_page.set_viewport_size({"width": width, "height": height})
        try:
            yield shared_page
        finally:
            while LISTENERS:
                shared_page.remove_listener(*LISTENERS.pop())

    return sized


def watch(page, url: str) -> tuple[list[str], list[str]]:
    """(JavaScript errors, requests to anywhere but the app) as the page runs."""
    errors: list[str] = []
    outside: list[str] = []
    listen(page, "pageerror", lambda e: errors.append(str(e)))
    listen(page, "request", lambda r: None if r.url.startswith((url, "data:", "blob:")) else outside.append(r.url))
    return errors, outside


def metric_value(page, label: str) -> str:
    metric = page.locator('[data-testid="stMetric"]').filter(has_text=label)
    return metric.locator('[data-testid="stMetricValue"]').inner_text().strip()


def values(chart: list[dict]) -> list[dict]:
    return [t for t in chart if t["type"] == "heatmap" and not t["skip"]]


def test_type_step_three_times_and_look_at_every_tab(url, visit):
    """Type a prompt, Step three times, then the shapes of the attention, history and KV-cache charts as
    the browser holds them, and every tab drawn without a JavaScript error. With SAVE_SCREENSHOTS=1 it
    also writes the screenshots the README and docs/ show (assets/screenshots/), and the README's front picture:
    the top of the Attention tab, from the title to the stages' heatmaps."""
    from gpt_shape_tracer.model import load_bundled

    _, tok = load_bundled()
    n0 = len(tok.encode(PROMPT))
    t = n0 + 2  # key positions at the third step
    out = ROOT / "assets" / "screenshots"

    clipped: dict[str, list[str]] = {}

    def shot(name: str) -> None:
        clipped[name] = clipped_labels(page)  # every view drawn below is checked for labels cut off
        if saving(name):
            out.mkdir(parents=True, exist_ok=True)
            page.wait_for_timeout(300)  # fonts and the data grid's canvas settle after the charts are drawn
            page.screenshot(path=str(out / f"{name}.png"))
        if name == "attention" and saving("front"):  # 1600 px wide, from the title down to the stages' heatmaps
            top = page.get_by_role("heading", name="GPT shape tracer").bounding_box()["y"] - 24
            chart = page.locator(".panels").first.bounding_box()
            page.screenshot(path=str(out / "front.png"), clip={"x": 0, "y": top, "width": 1600,
                                                               "height": chart["y"] + chart["height"] + 16 - top})

    with visit(1600, 2200) as page:
        errors, outside = watch(page, url)
        open_app(page, url)
        set_prompt(page, PROMPT)
        for _ in range(3):
            click(page, "Step")
        assert metric_value(page, "key positions t") == str(t)
        assert metric_value(page, "cached after step") == str(t)
        assert metric_value(page, "new positions n") == "1"
        texts = page.locator('[data-testid="stMarkdownContainer"]').all_inner_texts()
        assert any(x.startswith(PROMPT) and len(x) > len(PROMPT) for x in texts)  # the prompt and new tokens
        open_tab(page, "Shapes")
        flow = page.locator("div.diagram svg").first  # the shape flow, drawn as SVG (figures/svg.py)
        assert f"[1, 4, 1, {t}]" in (flow.text_content() or "")  # this step's pattern shape, in its box
        hovers = flow.locator("title").all_text_contents()  # each box's record, as the browser's tooltip
        assert any(h.startswith("blocks.0.attn.hook_pattern") for h in hovers), hovers[:5]
        assert page.locator("div.diagram svg marker").count() >= 2  # the arrowheads, defined in each drawing
        shot("shapes")

        open_tab(page, "Attention")
        open_tab(page, "Stages")
        stages = panels_data(page)[0]["panels"]  # drawn on a canvas (gui/panels.js), its titles as text
        assert len(stages) == 4 and all((s["rows"], s["cols"]) == (1, t) for s in stages)
        assert page.get_by_text(f"[1, 4, 1, 32] @ [1, 4, 32, {t}] → [1, 4, 1, {t}]").count() >= 1
        shot("attention")
        for sub, name in (("All heads", "all_heads"), ("Pitfalls", "pitfalls"), ("FlashAttention", "flash_attention"),
                          ("Gradients", "gradients")):
            open_tab(page, sub)
            if sub == "Gradients":  # the backward pass runs as the view opens
                assert page.get_by_text("the 5 gradients computed from their formulas").count() == 1
                assert len(plotly_data(page)) == 2
                click(page, "Record ∂L/∂x at every hook point")
                assert page.get_by_text("∂L/∂x at every hook point the backward pass reaches").count() == 1
                assert page.get_by_role("button", name="Download the gradients trace of step 2").count() == 1
            shot(name)
        open_tab(page, "History")
        history = panels_data(page)[0]["panels"][0]  # on the canvas, as the Stages
        assert (history["rows"], history["cols"]) == (t, t)

        open_tab(page, "KV cache")
        kv = panels_data(page)[0]["panels"][0]  # one head's keys: t positions × d_head, on the canvas
        assert kv["rows"] == t and kv["cols"] == 32
        assert page.get_by_text("Only the new row was needed").count() == 1
        shot("kv_cache")
        open_tab(page, "Over the steps")
        bars = [tr for tr in plotly_data(page)[0] if tr["type"] == "bar"]
        assert len(bars) == 3  # cache length, rows with the cache, rows without it: one figure
        shot("kv_cache_steps")
        open_tab(page, "A cheaper cache")
        click(page, "Run both")
        assert page.get_by_text("first step whose choice differs").count() == 1 and len(plotly_data(page)) == 1
        shot("kv_cache_cheaper")
        open_tab(page, "What grows with n")
        assert page.get_by_text("Attention's two products cost").count() == 1 and len(plotly_data(page)) == 1
        shot("kv_cache_growth")
        for tab, name in (("Causal mask", "causal_mask"), ("Next token", "next_token"), ("What if", "what_if"),
                          ("Worked example", "worked"), ("Inspector", "inspector")):
            open_tab(page, tab)
            shot(name)
        assert not errors, errors
        assert not outside, f"the page fetched from outside localhost: {outside[:5]}"
        assert not any(clipped.values()), {k: v for k, v in clipped.items() if v}


def test_clicking_a_head_on_the_grid_opens_it(url, visit):
    with visit(1500, 1400) as page:
        open_app(page, url)
        click(page, "Step")
        open_tab(page, "Attention")
        open_tab(page, "All heads")
        # where plotly drew the (invisible) marker of layer 3, head 2: click it as a person would
        x, y = page.evaluate("""() => {
            const gd = document.querySelectorAll('.js-plotly-plot')[0];
            const tr = gd._fullData.find(t => t.type === 'scatter');
            const i = tr.customdata.findIndex(c => c[0] === 3 && c[1] === 2);
            const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis, box = gd.getBoundingClientRect();
            return [box.left + xa._offset + xa.l2p(tr.x[i]), box.top + ya._offset + ya.l2p(tr.y[i])];
        }""")
        before = runs_finished(page)
        page.mouse.click(x, y)
        wait_idle(page, after=before)  # the selection reruns the app; on a busy machine that takes a while
        open_tab(page, "Stages")
        assert page.get_by_text("layer 3, head 2, step 0").count() == 1


def test_html_in_the_prompt_shows_as_text(url, visit):
    with visit(1500, 1100) as page:
        dialogs: list[str] = []
        listen(page, "dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        open_app(page, url)
        set_prompt(page, "<script>alert('x')</script><img src=x onerror=alert('y')> Lily")
        click(page, "Step")
        text = " ".join(page.locator('[data-testid="stMarkdownContainer"]').all_inner_texts())
        assert "<script>alert('x')</script>" in text and "onerror=alert('y')" in text
        assert page.locator("img[src='x']").count() == 0
        open_tab(page, "Attention")
        page.wait_for_timeout(500)
        assert not dialogs


def crafted_trace() -> bytes:
    """A valid trace whose labels, model name and prompt try markdown images, links and HTML."""
    from gpt_shape_tracer.model import load_bundled
    from gpt_shape_tracer.tracer import TracedGeneration
    from gpt_shape_tracer.tracer.files import archive_bytes

    model, tok = load_bundled()
    gen = TracedGeneration(model, tok, "Lily had a red ball.", temperature=0)
    gen.run(2)
    data = archive_bytes(gen.trace)
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))
    bait = "a\n\n![p](http://evil.example/img.png) <img src='http://evil.example/2.png'> [l](http://evil.example)"
    manifest["generation"]["info"]["prompt_labels"][0][0] = bait
    manifest["generation"]["steps"][1]["sampling"]["labels"][0] = bait
    manifest["model"]["name"] = "![m](http://evil.example/m.png)"
    manifest["generation"]["info"]["prompts"][0] = bait
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, json.dumps(manifest) if info.filename == "manifest.json"
                         else src.read(info.filename))
    return out.getvalue()


def test_a_crafted_trace_file_makes_the_page_fetch_nothing(url, visit, tmp_path):
    path = tmp_path / "![f](http:evil.example).zip"
    path.write_bytes(crafted_trace())
    with visit(1500, 1100) as page:
        errors, outside = watch(page, url)
        open_app(page, url)
        before = runs_finished(page)
        page.locator('[data-testid="stFileUploaderDropzoneInput"]').last.set_input_files(str(path))
        wait_idle(page, after=before)  # the upload reruns the app (and st.rerun, which opens the file, again)
        page.get_by_role("tab", name="Shapes", exact=True).wait_for(timeout=60_000)
        for tab in ("Shapes", "Attention", "Next token", "Inspector", "Export"):
            open_tab(page, tab)
        assert page.locator("img[src*='evil']").count() == 0 and page.locator("a[href*='evil']").count() == 0
        shown = " ".join(page.locator("body").all_inner_texts()).replace("\u2060", "")  # the link breaker
        assert "![m](http://evil.example/m.png)" in shown  # shown, as text
        assert not outside, outside
        assert not errors, errors


def test_the_actions_are_above_the_fold(url, visit):
    with visit(1600, 1000) as page:
        open_app(page, url)
        for width, height in ((1600, 1000), (1280, 800)):
            page.set_viewport_size({"width": width, "height": height})
            for name in ("Step", "Run N", "Reset"):
                box = page.get_by_role("button", name=name, exact=True).bounding_box()
                assert box is not None and box["y"] + box["height"] <= height, (width, height, name, box)
        open_tab(page, "Export")  # before the first step: no rerun
        assert page.get_by_text("up to 1 GiB").count() == 1  # what the label promises …
        # … is what Streamlit's dropzone says it accepts (the Export tab's: the Engine tab, drawn too before the first
        # step, has an uploader of its own, hidden behind its tab)
        assert page.get_by_text("1GB per file").locator("visible=true").count() == 1


def test_the_llama_model_shows_its_key_value_groups_and_rope(url, visit):
    """The bundled Llama-style model in the browser: K and V have G = 2 heads for H = 4 query heads, the
    all-heads grid brackets the query heads each key/value head serves, and the RoPE view is there."""
    from gpt_shape_tracer.model import load_bundled

    _, tok = load_bundled("story-llama")
    n0 = len(tok.encode(PROMPT))
    with visit(1600, 2200) as page:
        errors, outside = watch(page, url)
        open_app(page, url)
        set_prompt(page, PROMPT)
        before = runs_finished(page)
        page.get_by_label("Weights").get_by_text("Bundled Llama-style story model").click()
        wait_idle(page, after=before)  # choosing the model is a rerun of its own: Step must not count it
        page.get_by_text("story-llama").first.wait_for(timeout=60_000)  # the page names the model chosen
        click(page, "Step")
        click(page, "Step")
        open_tab(page, "KV cache")
        kv = page.get_by_text(f"[1, 2, {n0 + 1}, 32]").first  # [B, G, t, d_head], G = 2
        # the table is drawn on a canvas, its cells kept in the DOM for accessibility: wait for the cell to be
        # there, as long as the page takes on a loaded machine
        kv.wait_for(state="attached", timeout=60_000)
        open_tab(page, "Attention")
        open_tab(page, "All heads")
        grid = [t for t in plotly_data(page)[0] if t["type"] == "heatmap"]
        assert len(grid) == 1 and grid[0]["rows"] and grid[0]["cols"]  # one heatmap, the heads tiled into it
        assert page.locator(".js-plotly-plot").first.get_by_text("K/V head 1").count() >= 1
        screenshot(page, "llama_all_heads")
        open_tab(page, "RoPE")
        assert len(plotly_data(page)) >= 1
        screenshot(page, "llama_rope")
        assert not errors, errors
        assert not outside, outside


def websocket_handshake(url: str, host: str) -> str:
    """The status line the app's websocket endpoint answers an upgrade request with, sent with ``host``."""
    import base64
    import socket
    from urllib.parse import urlparse

    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as s:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall((f"GET /_stcore/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                   f"Sec-WebSocket-Protocol: streamlit\r\n\r\n").encode())
        return s.recv(4096).decode("latin-1").split("\r\n")[0]


def test_a_click_while_a_run_is_going_waits_for_the_step_in_progress(url, visit, browser):
    # Streamlit answers a click during a run by starting a new script thread at once and stopping the old one
    # at its next Streamlit call; both used to step the session's one generation together ("step 5 is still in
    # progress", and the click lost). A second session on the server steps at the same time.
    other_context = app_context(browser)
    try:
        other = other_context.new_page()
        with visit(1500, 1100) as page:
            errors, _ = watch(page, url)
            open_app(page, url)
            open_app(other, url)
            set_prompt(other, "Mia had a small dog.")
            # every op recorded and the cache off: a step takes most of a run's time, so a click comes during one
            set_prompt(page, " ".join([PROMPT] * 12))
            before = runs_finished(page)
            page.get_by_text("KV cache", exact=True).click()
            wait_idle(page, after=before)
            before = runs_finished(page)
            capture = page.get_by_role("combobox", name="Capture")
            capture.click()
            capture.fill("ops")
            capture.press("Enter")
            wait_idle(page, after=before)
            n_box = page.get_by_label(re.compile("^N for Run N"))
            before = runs_finished(page)
            n_box.fill("60")
            n_box.press("Enter")
            wait_idle(page, after=before)
            for _ in range(2):  # the click lands in a step most of the time, not always: twice
                base = steps_shown(page)
                page.get_by_role("button", name="Run N", exact=True).click()
                progress = page.locator('[data-testid="stProgress"]').filter(
                    has_text=re.compile(r"step ([4-9]|\d\d) of 60"))
                progress.wait_for(timeout=60_000)
                in_progress = int(re.search(r"step (\d+) of 60", progress.inner_text()).group(1))
                other.get_by_role("button", name="Step", exact=True).click()
                page.get_by_role("button", name="Step", exact=True).click()  # while step `in_progress` runs
                click(other, "Step")
                wait_settled(page)
                wait_settled(other)
                alerts = page.locator('[data-testid="stAlert"], [data-testid="stException"]').all_inner_texts()
                assert not [a for a in alerts if "failed" in a or "progress" in a or "Error" in a], alerts
                assert not errors
                shown = steps_shown(page)
                # the run stops after the step in progress (or a later one: the page showed the bar a moment
                # ago), then the Step is made: nothing is lost and the 60 steps do not go on
                assert base + in_progress + 1 <= shown < base + 60, (base, in_progress, shown)
            assert steps_shown(other) == 4
            assert "Mia had a small dog." in other.locator('[data-testid="stMarkdownContainer"]').all_inner_texts()[0] \
                or other.get_by_text("Mia had a small dog.", exact=False).count()
            # the other session's generation is nowhere on this page, its Recent runs list included (each page
            # lists only the runs made under its own address: docs/runs.md)
            assert page.get_by_text("Mia had a small dog.", exact=False).count() == 0
    finally:
        other_context.close()


# what the sidebar's elements are (their first child's data-testid) each time Streamlit marks one stale: it does so
# when a rerun that will draw the element again has started, so a rerun of the view alone (a fragment) marks only
# what the view draws in the sidebar
WATCH_SIDEBAR = """() => { window.__staleKinds = [];
  const sidebar = document.querySelector('[data-testid="stSidebar"]');
  new MutationObserver(changes => { for (const c of changes) if (c.target.getAttribute('data-stale') === 'true')
      window.__staleKinds.push(c.target.firstElementChild?.getAttribute('data-testid') || '?'); })
    .observe(sidebar, {attributes: true, subtree: true, attributeFilter: ['data-stale']}); }"""
SETTINGS_WIDGETS = {"stTextArea", "stRadio", "stNumberInput", "stSelectbox", "stCheckbox", "stTextInput"}


def test_a_step_reruns_the_view_and_leaves_the_sidebar_as_it_is(url, visit):
    """A Step reruns the page's view alone (app.py ``view``, a fragment), not the sidebar's widgets: none of them is
    marked for redrawing, while what the view draws into the sidebar is (Recent runs, drawn after the step is made,
    are marked every time: the watch sees the Steps' reruns) and follows each Step. Before the view was a fragment,
    a Step marked the sidebar's settings too (the whole page reran). A sidebar widget drawn at the start of a full
    run may be redrawn before the page ever shows it stale, so a full run is not asked to show its marks."""
    with visit(1600, 1000) as page:
        open_app(page, url)
        set_prompt(page, "Ben saw a big dog.")
        click(page, "Step")
        page.evaluate(WATCH_SIDEBAR)
        for n in (2, 3):
            click(page, "Step")
            assert steps_shown(page) == n
            sidebar = page.locator('[data-testid="stSidebar"]')
            assert sidebar.get_by_role("button").filter(has_text=f"Ben saw a big dog. · {n} steps").count() == 1
        marked = set(page.evaluate("() => window.__staleKinds"))
        assert marked and not marked & SETTINGS_WIDGETS, marked  # the Step button and Recent runs only
        before = runs_finished(page)
        page.get_by_label("Decoding").get_by_text("sample", exact=True).click()  # a sidebar widget: the whole page
        wait_idle(page, after=before)
        click(page, "Step")  # and a Step after a full run is the view's again
        assert steps_shown(page) == 4


def test_a_foreign_host_header_cannot_open_the_websocket(url):
    """DNS rebinding: a page at evil.example whose name resolves to 127.0.0.1 sends Host: evil.example."""
    port = url.rsplit(":", 1)[1].strip("/")
    assert " 101 " in websocket_handshake(url, f"localhost:{port}") + " "
    assert " 101 " in websocket_handshake(url, f"127.0.0.1:{port}") + " "
    refused = websocket_handshake(url, f"evil.example:{port}")
    assert " 101 " not in refused + " " and refused.startswith("HTTP/1.1 4"), refused


def test_a_transformers_run_gemma2_opens_from_a_directory_and_every_tab_draws(url, visit, tmp_path):
    """An architecture we did not re-implement, through "Local Hugging Face directory": Gemma 2 (its own
    score scale, soft-capped scores, sliding-window layers, four norms per block), run by transformers.
    Its KV cache is [B, G, t, d_head], the attention stages are five (the soft-cap is one), the shape flow
    is read from its records, and every tab draws without a JavaScript error."""
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from tests.hf_architectures import build

    directory = build("gemma2", tmp_path / "gemma2", BUNDLED_DIR / "tokenizer.json")
    from gpt_shape_tracer.model import load_bundled

    _, tok = load_bundled()
    n0 = len(tok.encode(PROMPT))
    with visit(1600, 2200) as page:
        errors, outside = watch(page, url)
        open_directory_and_step(page, url, PROMPT, directory, "gemma2")  # the page names the model and its family
        open_tab(page, "Shapes")
        page.get_by_text("soft-cap").first.wait_for(state="attached", timeout=60_000)
        screenshot(page, "gemma2_shapes")
        open_tab(page, "Attention")
        open_tab(page, "Stages")
        stages = panels_data(page)[0]["panels"]
        assert len(stages) == 5 and all((s["rows"], s["cols"]) == (1, n0 + 1) for s in stages)
        screenshot(page, "gemma2_attention")
        open_tab(page, "KV cache")
        page.get_by_text(f"[1, 2, {n0 + 1}, 16]").first.wait_for(state="attached", timeout=60_000)
        for tab in ("Causal mask", "Next token", "What if", "Compare runs", "Inspector", "Export"):
            open_tab(page, tab)
        assert not errors, errors
        assert not outside, outside


def test_a_latent_attention_model_deepseek_v3_shows_its_cached_latent(url, visit, tmp_path):
    """DeepSeek-V3 from a directory: multi-head latent attention, whose cache holds the compressed latent c_KV
    [B,1,t,d_c] and the rotary key k_R instead of K and V. The KV cache tab says so with its bytes and draws c_KV
    (t rows, d_c columns), the attention tab draws its stages, and no view raises a JavaScript error."""
    from gpt_shape_tracer.model import load_bundled
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from tests.hf_architectures import ARCHITECTURES, build

    directory = build("deepseek_v3", tmp_path / "deepseek_v3", BUNDLED_DIR / "tokenizer.json")
    d_c = ARCHITECTURES["deepseek_v3"][1]["kv_lora_rank"]
    _, tok = load_bundled()
    n0 = len(tok.encode(PROMPT))
    with visit(1600, 1000) as page:
        errors, outside = watch(page, url)
        open_directory_and_step(page, url, PROMPT, directory, "deepseek_v3")
        open_tab(page, "Attention")
        open_tab(page, "Stages")
        assert panels_data(page)[0]["panels"]  # the stages' heat maps are drawn
        open_tab(page, "KV cache")
        page.get_by_text("multi-head latent attention").first.wait_for(state="attached", timeout=60_000)
        before = runs_finished(page)
        page.get_by_label("tensor").get_by_text("c_KV", exact=True).click()
        wait_idle(page, after=before)
        page.get_by_text("c_KV of layer 0, one for all heads").first.wait_for(state="attached", timeout=60_000)
        drawn = [(p["rows"], p["cols"]) for canvas in panels_data(page) for p in canvas["panels"]]
        assert (n0 + 1, d_c) in drawn, drawn  # the latent's t positions × d_c, on the canvas
        screenshot(page, "deepseek_v3_kv_cache", page.get_by_text("c_KV of layer 0, one for all heads").first)
        open_tab(page, "Shapes")  # the other tabs are a family's common views, visited for other models above
        assert not errors, errors
        assert not outside, outside


def test_config_only_opens_llama_405b_with_its_shape_flow_and_costs(url, visit):
    """A 405B model from its config alone, in the browser: the dry run's shape flow of one block, the note that
    every other block records the same shapes, the costs table and the time floor on each accelerator."""
    for width, height in ((1600, 1000), (1280, 800)):
        with visit(width, height) as page:
            errors, outside = watch(page, url)
            open_app(page, url)
            before = runs_finished(page)
            page.get_by_label("Weights").get_by_text("Config only (no weights)").click()
            wait_idle(page, after=before)
            box = page.get_by_role("combobox", name="Shipped shape config")  # Streamlit's selectbox
            box.click()
            before = runs_finished(page)
            page.get_by_role("option", name="llama-3.1-405b", exact=True).click()
            wait_idle(page, after=before)
            tokens = page.get_by_label("Prompt tokens")
            before = runs_finished(page)
            tokens.fill("64")
            tokens.press("Enter")
            wait_idle(page, after=before)
            before = runs_finished(page)
            page.get_by_role("button", name="Trace shapes", exact=True).click()
            wait_idle(page, timeout=600, after=before)  # building and tracing 405B: a minute or more when busy
            page.get_by_text("llama-3.1-405b: a dry run").first.wait_for()
            page.get_by_text("blocks 1 … 125 record the same shapes").first.wait_for(state="attached")
            flow = page.locator("div.diagram svg").first.text_content() or ""  # the shape flow, drawn as SVG
            assert "[1, 128, 64, 64]" in flow and "[1, 8, 64, 128]" in flow, flow[:500]  # H = 128, G = 8
            screenshot(page, f"dry_run_405b_{width}", settle_ms=500)
            open_tab(page, "Costs")
            page.get_by_text("multiply-adds in").first.wait_for(state="attached")
            open_tab(page, "Where it would run")
            page.get_by_text("H100 SXM: at least").first.wait_for(state="attached")
            assert not errors, errors
            assert not outside, outside


def test_the_decoding_tab_draws_every_beam_candidate_and_every_draft_as_the_runs_made_them(url, visit):
    """Step once, open Beam search, run k = 4 beams: the tree holds 2k candidates per forward (the page's own
    "forwards" metric), the reorder's two heatmaps are there, and nothing outside the app is asked for. At 1600 ×
    1000, and 1280 × 800 when its screenshot is asked (SAVE_SCREENSHOTS=beams,beams_1280)."""
    for width, height, name in sizes("beams", "speculative"):
        with visit(width, height) as page:
            errors, outside = watch(page, url)
            open_app(page, url)
            click(page, "Step")
            open_tab(page, "Decoding")
            click(page, "Run beam search")
            page.get_by_text("beams over").first.wait_for(timeout=60_000)
            forwards = int(metric_value(page, "forwards"))
            charts = plotly_data(page)
            tree, reorder = charts[0], charts[1]
            markers = page.evaluate(
                "() => document.querySelectorAll('.js-plotly-plot')[0].data"
                ".filter(t => t.mode === 'markers').reduce((n, t) => n + t.x.length, 0)")
            eos = 1  # the bundled tokenizer declares one end-of-sequence id: transformers keeps max(2, 1 + 1)·k
            assert markers == max(2, 1 + eos) * 4 * forwards and 1 <= forwards <= 8
            assert len(values(reorder)) == 2 and any(t["type"] == "scatter" for t in tree)
            screenshot(page, name, page.locator(".js-plotly-plot").first)  # the tree, under the takeaway
            # speculative decoding by prompt lookup: every drafted token and each step's bonus token drawn
            before = runs_finished(page)
            page.get_by_text("speculative decoding", exact=True).click()
            wait_idle(page, after=before)
            click(page, "Run speculative decoding")
            page.get_by_text("drafted over").first.wait_for(timeout=60_000)
            drafted, steps = (int(x) for x in re.search(r"(\d+) token\(s\) drafted over (\d+) step",
                                                         page.get_by_text("drafted over").first.inner_text()).groups())
            cells = page.evaluate(
                "() => document.querySelectorAll('.js-plotly-plot')[0].data"
                ".filter(t => t.mode === 'markers').reduce((n, t) => n + t.x.length, 0)")
            assert cells == drafted + steps  # each draft, and one token of the main model's own per step
            shot = f"speculative{name.removeprefix('beams')}"
            screenshot(page, shot, page.locator(".js-plotly-plot").first)
            assert not errors, errors
            assert not outside, outside


def test_transformers_cache_classes_show_what_a_sliding_cache_keeps_and_drops(url, visit, tmp_path):
    """A Gemma 2 directory (sliding window of 4 on every other layer) run by transformers: the KV cache tab's
    "transformers' cache classes" runs the sliding class and draws which positions each layer holds and which it
    dropped, with the takeaway its numbers make (SAVE_SCREENSHOTS=cache_classes,cache_classes_1280)."""
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from tests.hf_architectures import build

    directory = build("gemma2", tmp_path / "gemma2", BUNDLED_DIR / "tokenizer.json")
    for width, height, name in sizes("cache_classes"):
        with visit(width, height) as page:
            errors, outside = watch(page, url)
            open_directory_and_step(page, url, PROMPT, directory, "gemma2", steps=1)
            open_tab(page, "KV cache")
            open_tab(page, "transformers' cache classes")
            page.get_by_role("combobox", name="cache class").click()  # Streamlit's selectbox
            before = runs_finished(page)
            page.get_by_role("option", name="sliding", exact=True).click()
            wait_idle(page, after=before)
            click(page, "Run")
            page.get_by_text("sliding").nth(2).wait_for(timeout=60_000)
            chart = plotly_data(page)
            assert chart and any(t["type"] == "heatmap" for t in chart[0])
            screenshot(page, name, page.locator(".js-plotly-plot").first)
            assert not errors, errors
            assert not outside, outside


def traced_here(directory):
    """The generation the page makes from ``directory`` (the prompt, greedy, two Steps), traced in this process on
    one thread: the page must show its numbers."""
    import torch

    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.tracer import TracedGeneration

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load_hf(directory, implementation="transformers")
        gen = TracedGeneration(model, tok, [PROMPT], temperature=0)
        gen.run(2)
        return gen
    finally:
        torch.set_num_threads(threads)


CHOICE_PANEL = """() => {
    const plot = Array.from(document.querySelectorAll('.js-plotly-plot'))
        .find(d => String(d.layout && d.layout.title && d.layout.title.text).includes('its indexer chose'));
    if (!plot) return null;
    const heats = plot.data.filter(t => t.type === 'heatmap' && t.hoverinfo !== 'skip');
    const z = heats[heats.length - 1].z;
    const flat = a => (a && a.length !== undefined && typeof a !== 'string') ? Array.from(a).flatMap(flat) : [a];
    return flat(z._inputArray || z);
}"""


def test_an_indexed_attention_model_shows_which_keys_its_indexer_chose(url, visit, tmp_path):
    """HY-V4 (DeepSeek Sparse Attention, a full and a shared indexed layer; top-k 4): loaded from a tiny directory,
    two Steps, the Attention tab's Indexer view. Its figure's choice panel, read back from the page, holds the keys
    the same generation traced here chose at that step — 1 where chosen, 0 where visible but skipped. At 1600 × 1000
    (and 1280 × 800 with SAVE_SCREENSHOTS=indexed,indexed_1280)."""

    from gpt_shape_tracer.figures.indexed import indexer_step
    from tests.model.test_hf_indexed import build_indexed

    directory = build_indexed("hy_v4", tmp_path / "hy_v4")
    gen = traced_here(directory)
    expected = indexer_step(gen.trace, 1, 0, 0)
    assert expected is not None and expected.seen > expected.chosen  # keys really were skipped
    for width, height, name in sizes("indexed"):
        with visit(width, height) as page:
            errors, outside = watch(page, url)
            open_directory_and_step(page, url, PROMPT, directory, "hy_v4")
            open_tab(page, "Attention")
            open_tab(page, "Indexer")
            page.get_by_text("the indexer chose").first.wait_for(timeout=60_000)
            chosen = page.evaluate(CHOICE_PANEL)  # the choice panel's cells, as the browser holds them
            assert chosen is not None
            assert chosen.count(1) == expected.chosen and chosen.count(0) == expected.seen - expected.chosen
            screenshot(page, name, page.locator(".js-plotly-plot").first)
            assert not errors, errors
            assert not outside, outside


def test_a_differential_attention_model_shows_both_softmaxes_and_what_it_applies(url, visit, tmp_path):
    """DiffLlama loaded from a tiny directory, two Steps, the Attention tab's Differential view: its takeaway names
    λ as the records hold it and the figure has the three panels A_1, A_2, A_1 − λ·A_2. At 1600 × 1000 (and
    1280 × 800 with SAVE_SCREENSHOTS=differential,differential_1280)."""
    from tests.model.test_hf_differential import build_diffllama

    directory = build_diffllama(tmp_path / "diffllama")
    for width, height, name in sizes("differential"):
        with visit(width, height) as page:
            errors, outside = watch(page, url)
            open_directory_and_step(page, url, PROMPT, directory, "diffllama")
            open_tab(page, "Attention")
            open_tab(page, "Differential")
            page.get_by_text("subtracts λ =").first.wait_for(timeout=60_000)
            panels = [t for t in plotly_data(page)[0] if t["type"] == "heatmap" and not t["skip"]]
            assert len(panels) == 3
            screenshot(page, name, page.locator(".js-plotly-plot").first)
            assert not errors, errors
            assert not outside, outside


def _sentences_of_every_head(trace, step: int, sentence) -> set[str]:
    layers, heads = trace.config.n_layer, trace.config.n_head
    return {s for layer in range(layers) for head in range(heads) if (s := sentence(trace, step, layer, head, 0))}


def _page_text(page) -> str:
    return " ".join(page.locator('[data-testid="stMain"]').inner_text().split())


@pytest.mark.parametrize("model_type, shot", [("bloom", "own_code_alibi"), ("inkling2_text", "score_bias_sinks")])
def test_a_score_bias_shows_as_its_own_stage(url, visit, tmp_path, model_type, shot):
    """Bloom (attention in the family's own code, traced at the op level; ALiBi beside the mask) and Inkling 2
    (a learned score bias and a sink per head), each loaded from a tiny directory, two Steps, Attention → Stages:
    the figure draws B as a stage of its own (and Inkling 2's sink logit), and the page states the bias sentence
    that figures.attention.score_bias_sentence writes for one (layer, head) of the same generation traced here.
    At 1600 × 1000 (SAVE_SCREENSHOTS=own_code_alibi,score_bias_sinks writes them; and 1280 × 800 with
    own_code_alibi_1280,score_bias_sinks_1280)."""

    from gpt_shape_tracer.figures.attention import score_bias_sentence
    from tests.model.test_hf_variants import _build

    directory = _build(model_type, tmp_path)
    gen = traced_here(directory)
    expected = _sentences_of_every_head(gen.trace, 1, score_bias_sentence)
    assert expected
    for width, height, name in sizes(shot):
        with visit(width, height) as page:
            errors, outside = watch(page, url)
            open_directory_and_step(page, url, PROMPT, directory, model_type)
            open_tab(page, "Attention")
            open_tab(page, "Stages")
            page.get_by_text("adds a bias B to the scores").first.wait_for(timeout=60_000)
            titles = ["".join(r["t"] for line in note["lines"] for r in line)  # the stages' titles, as drawn
                      for drawn in panels_data(page) for note in drawn["spec"]["notes"]]
            assert any("B, the score bias" in t for t in titles), titles
            if model_type == "inkling2_text":
                assert any("s_h" in t for t in titles), titles
            shown = _page_text(page)
            assert sum(s in shown for s in expected) == 1, (expected, shown[:2000])
            screenshot(page, name, page.locator(".panels").first)
            assert not errors, errors
            assert not outside, outside


def test_a_recurrent_model_shows_the_state_it_keeps_beside_k_and_v(url, visit, tmp_path):
    """RecurrentGemma (recurrent blocks beside local attention) loaded from a tiny directory, two Steps, KV cache →
    This step: the page states what its recurrent layers keep beside K and V — the sentence
    figures.cache.state_sentence writes from the same generation traced here (layers, shapes, bytes) — and draws
    no K rows for a recurrent layer. At 1600 × 1000 (SAVE_SCREENSHOTS=recurrent_state writes it; and 1280 × 800
    with recurrent_state_1280)."""

    from gpt_shape_tracer.figures.cache import state_sentence
    from tests.model.test_hf_variants import _build

    directory = _build("recurrent_gemma", tmp_path)
    gen = traced_here(directory)
    expected = state_sentence(gen.trace, 1)
    assert expected is not None
    for width, height, name in sizes("recurrent_state"):
        with visit(width, height) as page:
            errors, outside = watch(page, url)
            open_directory_and_step(page, url, PROMPT, directory, "recurrent_gemma")
            open_tab(page, "KV cache")
            open_tab(page, "This step")
            page.get_by_text("mixer's state in the cache").first.wait_for(timeout=60_000)
            assert " ".join(expected.split()) in _page_text(page)
            screenshot(page, name, page.get_by_text("mixer's state in the cache").first)
            assert not errors, errors
            assert not outside, outside
