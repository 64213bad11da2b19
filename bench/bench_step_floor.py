"""A Step in the browser beside the framework's own floor, alternating in one run:
``python bench/bench_step_floor.py [--rounds 3] [--steps 8] [TAB ...]``.

The floor is a minimal Streamlit page written here (``FLOOR_PAGE``): a sidebar of about the app's number of widgets,
a title, a caption, a slider, five metrics and three tabs (a 300-row dataframe, a 30 × 30 plotly heatmap), whose
"Step" button only counts its clicks — no model, no trace, no file. It is clicked both ways Streamlit can rerun: the
whole script (as the app's Step does), and a fragment holding the button (written into the sidebar from the
fragment) and the main area, the sidebar left as it is. Each round, in an order alternating by round, the floor page
is clicked ``--steps`` times each way, and the app (this checkout, the bundled model, ``bench_app.PROMPT``) is Stepped
``--steps`` times on each tab after its prefill and one untimed Step there, every click timed from its pointerdown
to the last chart drawn in the three phases of ``bench_app.py``. Prints the medians with the load average; writes
``bench/results/step_floor.json``. What it says: how much of the app's Step the framework itself costs on this
machine, and what a fragment rerun would save of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench_app import stepped_tabs, timed_steps
from common import machine, save

FLOOR_PAGE = '''
import numpy as np
import plotly.graph_objects as go
import streamlit as st

st.set_page_config(page_title="floor", layout="wide")
FRAGMENT = st.query_params.get("rerun") == "fragment"
sb = st.sidebar
sb.text_area("Prompt", value="Tom had a big red kite.", key="prompt", height=96)
slot = sb.container()  # the Step button's place, drawn into by the view (or by the fragment)
sb.number_input("N for Run N", value=8, key="n")
sb.header("Model")
sb.radio("Weights", ["bundled GPT", "bundled Llama", "directory", "own module", "config only"], key="weights")
sb.selectbox("Device", ["cpu"], key="device")
sb.header("Sampling")
sb.radio("Decoding", ["greedy", "sample"], key="decoding", horizontal=True)
for key in ("temperature", "top-k", "top-p"):
    sb.number_input(key, value=1.0, key=key)
sb.text_input("seed", value="0", key="seed")
sb.header("Tracing")
for key in ("KV cache", "chat template", "stop at EOS"):
    sb.toggle(key, value=True, key=key)
sb.selectbox("Capture", ["shapes", "values", "ops"], key="capture")
sb.number_input("Budget (MB)", value=512, key="budget")
sb.number_input("Keep every value on disk (MB)", value=0, key="spill")


def count() -> None:
    st.session_state["steps"] = st.session_state.get("steps", 0) + 1


def view() -> None:
    steps = st.session_state.get("steps", 0)
    slot.button("Step", key="step_button", on_click=count)
    st.title("GPT shape tracer")
    st.caption("Model: a page with no model. " * 8)
    st.slider("Step", 0, max(1, steps), steps)
    for i, column in enumerate(st.columns(5)):
        column.metric(f"metric {i}", steps + i)
    tabs = st.tabs(["Shapes", "Attention", "Export"])
    with tabs[0]:
        st.dataframe({"record": np.arange(300), "value": np.random.default_rng(steps).random(300)})
    with tabs[1]:
        st.plotly_chart(go.Figure(go.Heatmap(z=np.random.default_rng(steps).random((30, 30)))), key="heatmap")


st.fragment(view)() if FRAGMENT else view()
'''


def floor(url: str, rerun: str, steps: int) -> list[dict]:
    from tests.app_in_browser import chromium_page, click, wait_idle

    with chromium_page(1600, 1000) as page:
        page.goto(f"{url}/?rerun={rerun}")
        wait_idle(page)
        click(page, "Step")  # its first rerun is not a Step's
        return timed_steps(page, steps)


def app(url: str, tabs: list[str], steps: int) -> dict[str, list[dict]]:
    from tests.app_in_browser import chromium_page

    with chromium_page(1600, 1000) as page:
        return stepped_tabs(page, url, tabs, steps)


def main() -> None:
    from tests.app_in_browser import streamlit_server

    ap = argparse.ArgumentParser()
    ap.add_argument("tabs", nargs="*", default=["Shapes", "Export"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    page_dir = Path(tempfile.mkdtemp(prefix="step-floor-"))
    (page_dir / "app.py").write_text(FLOOR_PAGE)
    runs_dir = Path(tempfile.mkdtemp(prefix="step-floor-runs-"))
    seen: dict[str, list[dict]] = {"floor, whole script": [], "floor, fragment": []}
    seen.update({f"app, {tab}": [] for tab in args.tabs})
    load_before = os.getloadavg()
    with streamlit_server(checkout=page_dir) as floor_url:
        for r in range(args.rounds):
            order = ["floor", "app"] if r % 2 == 0 else ["app", "floor"]
            for who in order:
                if who == "floor":
                    seen["floor, whole script"] += floor(floor_url, "script", args.steps)
                    seen["floor, fragment"] += floor(floor_url, "fragment", args.steps)
                else:
                    with streamlit_server(env={"GPT_SHAPE_TRACER_RUNS_DIR": str(runs_dir / str(r))}) as url:
                        for tab, phases in app(url, args.tabs, args.steps).items():
                            seen[f"app, {tab}"] += phases
            print(f"round {r + 1} done", flush=True)
    # the totals of every click; the phases of the clicks whose running phase the page's observer saw (it can miss a
    # short one: then the start is not known, and the click's phases are left out of the phase medians)
    medians = {}
    for name, phases in seen.items():
        seen_whole = [p for p in phases if p["running"] > 0 and p["to_start"] >= 0]
        medians[name] = {"total": statistics.median(p["total"] for p in phases),
                         **{k: statistics.median(p[k] for p in seen_whole)
                            for k in ("to_start", "running", "to_drawn")},
                         "phases_missed": len(phases) - len(seen_whole)}
    result = {"machine": machine(), "load_before": load_before, "load_after": os.getloadavg(), "rounds": args.rounds,
              "steps": args.steps, "medians_s": medians, "samples": seen}
    for name, m in medians.items():
        print(f"{name:22s} Step {m['total']:.3f} s (script start {m['to_start']:.3f} + running {m['running']:.3f} + "
              f"to drawn {m['to_drawn']:.3f}; {m['phases_missed']} click(s) without their phases)")
    print(f"load {load_before} → {result['load_after']}")
    print(f"wrote {save('step_floor', result)}")


if __name__ == "__main__":
    main()
