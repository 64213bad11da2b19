"""End to end in a real headless Chromium: `streamlit run app.py`, type, Step ×3, check the page.

Also saves the README's screenshots (assets/screenshots/) when SAVE_SCREENSHOTS=1.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.browser import chromium_page, click, open_app, open_tab, plotly_data, set_prompt, streamlit_server

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Tom had a big red kite. One day, Tom went to the park."


def metric_value(page, label: str) -> str:
    metric = page.locator('[data-testid="stMetric"]').filter(has_text=label)
    return metric.locator('[data-testid="stMetricValue"]').inner_text().strip()


def test_type_step_three_times_and_check_attention_and_cache():
    from model import load_bundled

    _, tok = load_bundled()
    n0 = len(tok.encode(PROMPT))
    with streamlit_server() as url, chromium_page() as page:
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        open_app(page, url)
        set_prompt(page, PROMPT)
        for _ in range(3):
            click(page, "Step")
        assert metric_value(page, "key positions t") == str(n0 + 2)
        assert metric_value(page, "cache length after step") == str(n0 + 2)
        assert metric_value(page, "new positions n") == "1"
        texts = page.locator('[data-testid="stMarkdownContainer"]').all_inner_texts()
        assert any(t.startswith(PROMPT) and len(t) > len(PROMPT) for t in texts)  # the prompt and new tokens

        open_tab(page, "Attention")
        charts = plotly_data(page)
        stages = [t for t in charts[0] if t["type"] == "heatmap"]
        assert len(stages) == 4 and all((t["rows"], t["cols"]) == (1, n0 + 2) for t in stages)
        history = charts[1][0]
        assert (history["rows"], history["cols"]) == (n0 + 2, n0 + 2)
        assert page.get_by_text(f"[1, 4, 1, 32] @ [1, 4, 32, {n0 + 2}] → [1, 4, 1, {n0 + 2}]").count() >= 1

        open_tab(page, "KV cache")
        kv = plotly_data(page)[1][0]  # one head's keys: t positions × d_head
        assert kv["rows"] == n0 + 2 and kv["cols"] == 32
        if os.environ.get("SAVE_SCREENSHOTS"):
            save_screenshots(page)

        assert not errors, errors
        outside = [u for u in requests if not u.startswith(url) and not u.startswith("data:")
                   and not u.startswith("blob:")]
        assert not outside, f"the page fetched from outside localhost: {outside[:5]}"


def test_html_in_the_prompt_shows_as_text():
    with streamlit_server() as url, chromium_page() as page:
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        open_app(page, url)
        set_prompt(page, "<script>alert('x')</script><img src=x onerror=alert('y')> Lily")
        click(page, "Step")
        text = " ".join(page.locator('[data-testid="stMarkdownContainer"]').all_inner_texts())
        assert "<script>alert('x')</script>" in text and "onerror=alert('y')" in text
        assert page.locator("img[src='x']").count() == 0
        open_tab(page, "Attention")
        page.wait_for_timeout(500)
        assert not dialogs


def save_screenshots(page) -> None:
    out = ROOT / "assets" / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1500, "height": 2300})
    for tab in ["Shapes", "Attention", "Causal mask", "KV cache", "Next token", "Inspector"]:
        open_tab(page, tab)
        page.screenshot(path=str(out / f"{tab.lower().replace(' ', '_')}.png"))
