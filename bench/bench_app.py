"""App responsiveness: ``python bench/bench_app.py [--browser]``.

Times a Step rerun of the real app (Streamlit's AppTest runs the script exactly
as the server does) with the bundled model, and a decode Step with a
GPT-2-small-shaped model (124M, loaded from a local directory through the
sidebar) while the Attention tab shows the all-heads grid; then a selector
change, which must redraw without running the model. With ``--browser`` the
same is timed in headless Chromium from the click to the last chart drawn.
Targets: bundled Step ≤ 0.5 s; GPT-2-small decode Step with the grid ≤ 1.5 s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import ROOT, gpt2_small_dir, machine, save
from streamlit.testing.v1 import AppTest


def timed_run(at: AppTest) -> float:
    started = time.perf_counter()
    at.run()
    elapsed = time.perf_counter() - started
    assert not at.exception, [e.value for e in at.exception]
    return elapsed


def press(at: AppTest, key: str) -> float:
    at.sidebar.button(key=key).click()
    return timed_run(at)


def apptest_timings(steps: int) -> dict:
    out = {}
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.run()
    press(at, "step_button")  # prefill
    for tab in ("Shapes", "Attention"):
        at.session_state["view"] = tab
        timed_run(at)
        out[f"bundled_step_{tab.lower()}_s"] = statistics.median(press(at, "step_button") for _ in range(steps))
    at.selectbox(key="attn_layer").set_value(2)
    before = at.session_state["gen"].n_steps
    out["bundled_selector_s"] = timed_run(at)
    assert at.session_state["gen"].n_steps == before

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=600)
    at.run()
    at.sidebar.radio(key="source").set_value("Local GPT-2 directory")
    at.run()
    at.sidebar.text_input(key="model_dir").set_value(str(gpt2_small_dir()))
    at.run()
    at.sidebar.button(key="load_model").click()
    out["gpt2_load_s"] = timed_run(at)
    at.session_state["view"] = "Attention"
    timed_run(at)
    out["gpt2_prefill_step_attention_s"] = press(at, "step_button")
    out["gpt2_decode_step_attention_s"] = statistics.median(press(at, "step_button") for _ in range(steps))
    out["gpt2_forward_s"] = at.session_state["gen"].trace.steps[-1].seconds
    at.selectbox(key="attn_head").set_value(5)
    before = at.session_state["gen"].n_steps
    out["gpt2_selector_s"] = timed_run(at)
    assert at.session_state["gen"].n_steps == before
    return out


def browser_timings(steps: int) -> dict:
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.browser import chromium_page, click, open_app, open_tab, streamlit_server

    out = {}
    with streamlit_server() as url, chromium_page() as page:
        open_app(page, url)
        click(page, "Step")
        for tab in ("Shapes", "Attention"):
            open_tab(page, tab)
            times = []
            for _ in range(steps):
                started = time.perf_counter()
                click(page, "Step", settle_ms=0)  # from the click to the last chart drawn, no padding
                times.append(time.perf_counter() - started)
            out[f"browser_bundled_step_{tab.lower()}_s"] = statistics.median(times)
        page.get_by_label("Weights").get_by_text("Local GPT-2 directory").click()
        page.get_by_label("Directory", exact=True).fill(str(gpt2_small_dir()))
        page.get_by_label("Directory", exact=True).press("Enter")
        click(page, "Load")
        click(page, "Step")
        open_tab(page, "Attention")
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            click(page, "Step", settle_ms=0)  # from the click to the last chart drawn, no padding
            times.append(time.perf_counter() - started)
        out["browser_gpt2_decode_step_attention_s"] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--browser", action="store_true")
    args = ap.parse_args()
    result = {"machine": machine(), "apptest": apptest_timings(args.steps)}
    if args.browser:
        result["browser"] = browser_timings(args.steps)
    path = save("app", result)
    for section in ("apptest", "browser"):
        for key, value in result.get(section, {}).items():
            print(f"{section:>8} {key:<40} {value:.3f}")
    print("targets: bundled Step ≤ 0.5 s; GPT-2-small decode Step with the all-heads grid ≤ 1.5 s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
