"""The figures of a Step, built and drawn: ``python bench/bench_figures.py [--browser [--against REV]]``.

Building: the app builds figures without plotly's per-property checks (``figures/plot.py``); this times each
builder of a Step's tabs both ways, alternating, on a 3-step trace of the bundled model, and prints the
milliseconds and the ratio.

Drawing (``--browser``): each figure's JSON drawn by ``Plotly.newPlot`` in headless Chromium (plotly.js from
the plotly package: the same major version Streamlit bundles), median of 12 draws, in a page of its own. With
``--against REV`` the same figures are also built by revision REV (a temporary git worktree) and both are
drawn alternately in the same page, so the two columns come from one run. In the app each chart costs
about three such draws per change: Streamlit's chart element plots a new figure three times (V8's call
counts, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, save

# name → the expression that builds it, evaluated where ``trace`` is a 3-step trace and ``step`` = 2
BUILDERS = {
    "shape flow (Shapes)": "flow.shape_flow_figure(trace, step, 0)",
    "reshape strip (Shapes)": "flow.reshape_figure(trace, step, 0)",
    "attention stages (Attention)": "attention.attention_stages_figure(trace, step, 0, 0)",
    "all heads (Attention)": "attention.all_heads_figure(trace, step).figure",
    "cache over the steps (KV cache)": "cache.cache_steps_figure(trace, step)",
    "keys (KV cache)": "cache.key_heatmap_figure(trace, step, 0, 0)",
    "mask (Causal mask)": "mask.mask_figure(trace, 0, 0)",
    "next token (Next token)": "tokens.next_token_figure(trace, step)",
}
# run with a revision's tree as the working directory: builds its figures and prints them as JSON
DUMP = """
import json, sys
from gpt_shape_tracer.figures import attention, cache, flow, mask, tokens
from gpt_shape_tracer.model import load_bundled
from gpt_shape_tracer.tracer.generation._traced import TracedGeneration
model, tok = load_bundled()
gen = TracedGeneration(model, tok, "Tom had a big red kite. One day, Tom went to the park.")
gen.run(3)
trace, step = gen.trace, 2
builders = json.loads(sys.argv[1])
out = {}
for name, code in builders.items():
    try:
        out[name] = json.loads(eval(code).to_json())
    except Exception as e:  # a builder this revision does not have
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
print(json.dumps(out))
"""
PLOTLY_JS = Path(__import__("plotly").__file__).parent / "package_data" / "plotly.min.js"
DRAW = """async (spec) => {
    const g = document.getElementById('g'); const times = [];
    for (let i = 0; i < 12; i++) {
        const t = performance.now();
        await Plotly.newPlot(g, spec.data, Object.assign({}, spec.layout, {width: 1200}), {displaylogo: false});
        g.getBoundingClientRect();  // the layout the draw left pending
        times.push(performance.now() - t);
        Plotly.purge(g);
    }
    times.sort((a, b) => a - b); return times[6];
}"""


def specs_of(tree: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", DUMP, json.dumps(BUILDERS)], cwd=tree, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout)


def drawing(against: str | None, rounds: int = 3) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.app_in_browser import chromium

    trees = {"working tree": ROOT}
    tmp = Path(tempfile.mkdtemp(prefix="figures-"))
    try:
        if against:
            subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tmp / "old"), against], cwd=ROOT,
                           check=True)
            trees = {against: tmp / "old", **trees}
        specs = {name: specs_of(tree) for name, tree in trees.items()}
    finally:
        if against:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "old")], cwd=ROOT, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict = {name: {} for name in BUILDERS}
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_content("<div id=g style='width:1200px'></div>")
        page.add_script_tag(path=str(PLOTLY_JS))
        for figure in BUILDERS:
            seen: dict[str, list[float]] = {rev: [] for rev in specs if figure in specs[rev]}
            for r in range(rounds):
                for rev in (list(seen) if r % 2 == 0 else list(reversed(seen))):
                    seen[rev].append(page.evaluate(DRAW, specs[rev][figure]) / 1000)
            out[figure] = {rev: statistics.median(t) for rev, t in seen.items()}
            print(f"{figure:<32} " + "   ".join(f"{rev}: {s * 1000:6.1f} ms" for rev, s in out[figure].items()))
    return out


def building(repeats: int = 7) -> dict:
    from gpt_shape_tracer.figures import attention, cache, flow, mask, tokens  # noqa: F401 - the builders' namespace
    from gpt_shape_tracer.figures.plot import VALIDATE_ENV
    from gpt_shape_tracer.model import load_bundled
    from gpt_shape_tracer.tracer.generation._traced import TracedGeneration

    model, tok = load_bundled()
    gen = TracedGeneration(model, tok, "Tom had a big red kite. One day, Tom went to the park.")
    gen.run(3)
    trace, step = gen.trace, 2  # noqa: F841 - used by the builders' expressions
    out = {}
    for name, code in BUILDERS.items():
        times: dict[str, list[float]] = {"checked": [], "unchecked": []}
        for _ in range(repeats):
            for mode, flag in (("checked", "1"), ("unchecked", "0")):
                os.environ[VALIDATE_ENV] = flag
                started = time.perf_counter()
                eval(code)
                times[mode].append(time.perf_counter() - started)
        checked, unchecked = (statistics.median(times[m]) for m in ("checked", "unchecked"))
        out[name] = {"checked_s": checked, "unchecked_s": unchecked}
        print(f"{name:<32} checked {checked * 1000:6.1f} ms   unchecked {unchecked * 1000:6.1f} ms   "
              f"×{unchecked / checked:.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--browser", action="store_true", help="draw each figure in headless Chromium")
    ap.add_argument("--against", help="with --browser: also draw the figures revision AGAINST builds")
    args = ap.parse_args()
    result = {"machine": machine(), "figures": building()}
    if args.browser:
        result["drawn_s"] = drawing(args.against)
        result["against"] = args.against
    print(f"wrote {save('figures', result)}")


if __name__ == "__main__":
    main()
