"""Where a Step's time goes in the browser: ``python bench/profile_browser_step.py [TAB ...] [--steps 3]``.

Steps the bundled model in headless Chromium with V8's sampling profiler on (Chrome DevTools Protocol), and
prints the page's main-thread time per Step by script file: Streamlit's React bundle, plotly, the CSS-in-JS
libraries, and "(program)" — the browser's own style, layout and paint work, which the profiler cannot
attribute to a script. Beside it, the three phases of each click (see ``bench_app.py``). The main thread's
total per Step is the part of a Step's time that no change to the script's speed can remove.
"""

from __future__ import annotations

import argparse
import collections
import statistics

from bench_app import PROMPT, timed_steps
from common import machine, save


def profile(tabs: list[str], steps: int) -> dict:
    from tests.app_in_browser import chromium_page, click, open_app, open_tab, set_prompt, streamlit_server

    out: dict = {}
    with streamlit_server() as url, chromium_page(1600, 1000) as page:
        open_app(page, url)
        set_prompt(page, PROMPT)
        click(page, "Step")
        for tab in tabs:
            open_tab(page, tab)
            click(page, "Step")  # the tab's first draw is not a Step's
            cdp = page.context.new_cdp_session(page)
            cdp.send("Profiler.enable")
            cdp.send("Profiler.setSamplingInterval", {"interval": 500})  # µs
            cdp.send("Profiler.start")
            phases = timed_steps(page, steps)
            result = cdp.send("Profiler.stop")["profile"]
            cdp.detach()
            nodes = {n["id"]: n["callFrame"] for n in result["nodes"]}
            by_source: collections.Counter = collections.Counter()
            for node, micros in zip(result["samples"], result["timeDeltas"]):
                frame = nodes[node]
                by_source[frame["url"].rsplit("/", 1)[-1] or frame["functionName"] or "(anonymous)"] += micros
            busy = sum(v for k, v in by_source.items() if k != "(idle)")
            out[tab] = {
                "main_thread_busy_s_per_step": busy / 1e6 / steps,
                "by_source_s_per_step": {k: v / 1e6 / steps for k, v in by_source.most_common()},
                "phases_median_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tabs", nargs="*", default=["Shapes", "Attention", "KV cache", "Next token"])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    result = {"machine": machine(), "tabs": profile(args.tabs, args.steps)}
    path = save("browser_profile", result)
    for tab, r in result["tabs"].items():
        p = r["phases_median_s"]
        print(f"{tab}: Step {p['total']:.3f} s (script start {p['to_start']:.3f} + running {p['running']:.3f} + "
              f"to drawn {p['to_drawn']:.3f}); the page's main thread busy {r['main_thread_busy_s_per_step']:.3f} s "
              "per Step:")
        for source, seconds in list(r["by_source_s_per_step"].items())[:8]:
            print(f"    {seconds * 1000:7.0f} ms  {source}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
