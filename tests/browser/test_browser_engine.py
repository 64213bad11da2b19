"""The Engine tab in headless Chromium: three requests submitted (two sharing a prefix, one arriving at engine step 3)
on the bundled model (its files run through transformers), the engine step slider stepped with the keyboard, and the
pool grid's column read back from the page's own plotly data — equal to the page's metrics and to the same run traced
here; then a reload brings the run back from the runs folder with the same numbers. ``SAVE_SCREENSHOTS=1`` (or
``engine``) also writes docs/images/engine-1600.png and, visiting 1280 × 800 too, engine-1280.png."""

from __future__ import annotations

import os

import pytest
import torch

from tests.app_in_browser import ROOT, chromium_page, click, open_app, wait_settled

REQUESTS = ["Once upon a time, there was a little girl named Lily.", "Once upon a time, there was a little girl who",
            "The cat sat on the mat."]
ARRIVALS = [0, 0, 3]
NEW = 6


def saving() -> bool:
    wanted = os.environ.get("SAVE_SCREENSHOTS", "")
    return wanted == "1" or "engine" in wanted.split(",")


@pytest.fixture(scope="module")
def expected():
    """The same run, traced in this process: the page must show its numbers."""
    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.sources import ASSETS
    from gpt_shape_tracer.tracer.engine import trace_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load_hf(ASSETS / "story-gpt", implementation="transformers")
        return trace_engine(model, tok, REQUESTS, page_size=4, pages=32, max_batch_tokens=16, max_new_tokens=NEW,
                            arrivals=ARRIVALS, eos_token_id=tuple(tok.eos_ids) or None, values=False)
    finally:
        torch.set_num_threads(threads)


POOL_COLUMN = """(step) => {
    const plot = Array.from(document.querySelectorAll('.js-plotly-plot'))
        .find(d => String(d.layout && d.layout.title && d.layout.title.text).includes('page pool'));
    // the cells as plotly.js drew them (they arrive packed, a numpy array: _fullData holds them decoded)
    const heat = plot._fullData.find(t => t.type === 'heatmap');
    const col = Array.from(heat.x).indexOf(step);
    return Array.from(heat._z || heat.z, row => {
        const z = row[col];
        return z === undefined || Number.isNaN(z) ? null : z;  // a free page: a gap
    });
}"""


def metric(page, label: str) -> str:
    box = page.locator('[data-testid="stMetric"]').filter(has_text=label).first
    return box.locator('[data-testid="stMetricValue"]').inner_text().strip()


def engine_slider(page):
    return page.locator('[data-testid="stSlider"]').filter(has_text="Engine step").first.get_by_role("slider")


def shown_step(page) -> int:
    """The engine step slider's value as the browser holds it (its range input's value)."""
    return int(engine_slider(page).evaluate("el => el.value"))


def test_three_requests_stepped_through_and_the_pool_grid_read_back(expected, url, browser):
    # 1280 × 800 when its screenshot is asked: the page is the same, and each visit runs the engine anew
    for width, height, name in ((1600, 1000, "engine-1600"),) + (((1280, 800, "engine-1280"),) if saving() else ()):
        with chromium_page(width, height, browser) as page:
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))  # noqa: B023 - read in this iteration
            open_app(page, url)
            page.get_by_role("tab", name="Engine", exact=True).click()  # before a Step: tabs without reruns
            page.get_by_label("Requests (one prompt per line)").fill("\n".join(REQUESTS))
            page.get_by_label("Arrival step of each request", exact=False).fill(", ".join(map(str, ARRIVALS)))
            box = page.get_by_label("new tokens per request")
            box.fill(str(NEW))
            click(page, "Run the engine")
            page.get_by_text("engine steps on a pool of").first.wait_for(timeout=120_000)
            takeaway = page.get_by_text("engine steps on a pool of").first.inner_text()
            assert f"3 requests in {len(expected.steps)} engine steps" in takeaway
            seen = set()
            for _ in range(4):
                step = shown_step(page)
                seen.add(step)
                s = expected.steps[step]
                column = page.evaluate(POOL_COLUMN, step)
                held = sum(1 for z in column if z is not None and z >= 1)
                assert held == s.pages_in_use == int(metric(page, "held after this step").split()[0])
                assert sum(1 for z in column if z == 0) == len(s.cached)
                assert int(metric(page, "shared after it").split()[0]) == len(s.shared)
                assert int(metric(page, "free after it").split()[0]) == s.pages_free
                if saving() and len(seen) == 1:  # the busiest step: the run opens there
                    page.get_by_text(f"Engine step {step} ran").first.scroll_into_view_if_needed()
                    page.mouse.wheel(0, -120)
                    page.wait_for_timeout(400)
                    page.screenshot(path=str(ROOT / "docs" / "images" / f"{name}.png"))
                if step == len(expected.steps) - 1:
                    break
                engine_slider(page).focus()
                engine_slider(page).press("ArrowRight")
                wait_settled(page)
                assert shown_step(page) == step + 1
            assert len(seen) >= 2
            assert any(s.shared for s in expected.steps)
            if width == 1600:  # a reload: the run comes back from the runs folder (?engine= in the address)
                assert "engine=" in page.url
                page.reload(wait_until="domcontentloaded")
                wait_settled(page)
                page.get_by_text("Reopened engine run").first.wait_for(timeout=60_000)
                step = shown_step(page)
                s = expected.steps[step]
                column = page.evaluate(POOL_COLUMN, step)
                assert sum(1 for z in column if z is not None and z >= 1) == s.pages_in_use
                assert int(metric(page, "held after this step").split()[0]) == s.pages_in_use
                assert page.get_by_text("engine steps on a pool of").first.inner_text() == takeaway
            assert not errors, errors
