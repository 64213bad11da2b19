"""How many times the browser plots a chart whose data changed: ``python bench/plot_passes.py``.

A one-chart Streamlit app (written to a temporary directory) whose heatmap changes on every click, with
``st.plotly_chart(theme="streamlit")`` (Streamlit's default) and ``theme=None`` (what app.py uses), and one
whose heatmap stays the same (a rerun sends the same figure: Streamlit names the element by a hash of it,
so the page keeps the chart it has), and a changing one whose traces carry a fixed ``uid`` and whose layout a
fixed ``datarevision`` (plotly.js then treats its data arrays as unchanged between two plots of one mount); headless
Chromium clicks 4 times per setting, and V8's call counts
(precise coverage) of plotly.js's full plot (``plot``), its defaults pass and its data pass give the passes
per click. The function names are those of
the minified plotly.js inside Streamlit 1.67's bundle (``e.plot``, ``S.supplyDefaults``, ``S.doCalcdata``).

What it found (docs/benchmarks.md): a changed figure is a new element to Streamlit (its id hashes the figure), mounted
afresh, and plotted twice — once before its column's width is measured (hidden, at plotly's default width), once
after; neither a fixed ``uid`` nor ``datarevision`` saves the second plot, since its width differs. Hence the Stages
view's canvas (gui/panels.js), which stays mounted and redraws.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import ROOT, machine, save

APP = '''
import os
import plotly.graph_objects as go
import streamlit as st

n = st.session_state.setdefault("n", 0)
if st.button("Step"):
    st.session_state.n = n = n + 1
shift = n if os.environ["CHART_CHANGES"] == "yes" else 0
fig = go.Figure(go.Heatmap(z=[[i * j + shift for i in range(10)] for j in range(5)]))
fig.update_layout(height=380)
if "uid" in os.environ["CHART_REVISION"]:
    fig.update_traces(uid="chart-trace")
if "datarevision" in os.environ["CHART_REVISION"]:
    fig.update_layout(datarevision="same")
theme = None if os.environ["CHART_THEME"] == "none" else "streamlit"
st.plotly_chart(fig, key="chart", theme=theme)
'''
COUNTED = {"e.plot": "full plots", "S.supplyDefaults": "defaults passes", "S.doCalcdata": "data passes"}
CLICKS = 4


def passes(theme: str, changes: str, revision: str = "no") -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from tests.app_in_browser import chromium_page, click, free_port, open_app

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "one_chart.py"
        script.write_text(APP)
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "streamlit", "run", str(script), "--server.port", str(port),
             "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"],
            env={**os.environ, "CHART_THEME": theme, "CHART_CHANGES": changes,
                 "CHART_REVISION": revision},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(url + "/_stcore/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.2)
            with chromium_page(1600, 1000) as page:
                open_app(page, url)
                click(page, "Step")
                cdp = page.context.new_cdp_session(page)
                cdp.send("Profiler.enable")
                cdp.send("Profiler.startPreciseCoverage", {"callCount": True, "detailed": False})
                cdp.send("Profiler.takePreciseCoverage")  # counts from here on
                for _ in range(CLICKS):
                    click(page, "Step")
                coverage = cdp.send("Profiler.takePreciseCoverage")["result"]
        finally:
            server.terminate()
            server.wait(timeout=15)
    counts: collections.Counter = collections.Counter()
    for script_coverage in coverage:
        if "PlotlyChart" in script_coverage["url"]:
            for function in script_coverage["functions"]:
                if function["functionName"] in COUNTED:
                    counts[COUNTED[function["functionName"]]] += function["ranges"][0]["count"]
    return {what: counts[what] / CLICKS for what in COUNTED.values()}


def main() -> None:
    settings = {"theme streamlit, data changed": ("streamlit", "yes"), "theme None, data changed": ("none", "yes"),
                "theme None, data the same": ("none", "no"),
                "theme None, data changed, uid": ("none", "yes", "uid"),
                "theme None, data changed, uid, datarevision": ("none", "yes", "uid datarevision")}
    result = {"machine": machine(), "per_click": {label: passes(*how) for label, how in settings.items()}}
    for label, counts in result["per_click"].items():
        print(f"{label:<32} per click: " + ", ".join(f"{v:g} {k}" for k, v in counts.items()))
    print(f"wrote {save('plot_passes', result)}")


if __name__ == "__main__":
    main()
