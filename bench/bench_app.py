"""App responsiveness: ``python bench/bench_app.py [--steps 5] [--browser]``.

Times the real app as a user drives it. AppTest runs the script exactly as the server does (model, tracer,
figures, Streamlit's serialisation), without a browser; ``--browser`` times the same in headless Chromium
from the click to the last chart drawn.

- Step, per tab (median of ``--steps`` decode Steps), with each bundled model;
- GPT-2 small (124M, from a local Hugging Face directory): the first Step (the prefill) after loading, then
  decode Steps on the Attention tab;
- the Inspector opened on ``hook_logits`` ``[1, n, 50257]`` (the largest record of a step);
- Run N = 64 with the bundled model: seconds per step, against a single Step on the same tab.

The targets (issue 13): Step ≤ 0.3 s with a bundled model, ≤ 0.5 s for a GPT-2-small decode, the Inspector
≤ 0.5 s on any record, each step of Run N no slower than a Step, first GPT-2 prefill ≤ 1.5 s. The machine is
shared: these are wall-clock estimates, and the JSON keeps every sample, not only the median.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

from common import ROOT, gpt2_small_dir, machine, save
from streamlit.testing.v1 import AppTest

TABS = ("Shapes", "Attention", "KV cache", "Next token")
PROMPT = "Tom had a big red kite. One day, Tom went to the park."


def timed_run(at: AppTest) -> float:
    started = time.perf_counter()
    at.run()
    elapsed = time.perf_counter() - started
    assert not at.exception, [e.value for e in at.exception]
    return elapsed


def press(at: AppTest, key: str) -> float:
    at.sidebar.button(key=key).click()
    return timed_run(at)


def fresh_app(source: str | None = None) -> AppTest:
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=900)
    at.run()
    at.sidebar.text_area(key="prompt").set_value(PROMPT)
    if source is not None:
        at.sidebar.radio(key="source").set_value(source)
    at.run()
    return at


def step_per_tab(at: AppTest, steps: int) -> dict[str, list[float]]:
    out = {}
    for tab in TABS:
        at.session_state["view"] = tab
        timed_run(at)
        out[tab] = [press(at, "step_button") for _ in range(steps)]
    return out


def apptest_timings(steps: int) -> dict:
    out: dict = {}
    for label, source in (("story-gpt", None), ("story-llama", "Bundled Llama-style story model")):
        at = fresh_app(source)
        out[f"{label}_prefill_s"] = press(at, "step_button")
        out[f"{label}_step_s"] = step_per_tab(at, steps)

    # what Streamlit's default runner.postScriptGC (a full collection after every rerun) would cost here
    objects = len(gc.get_objects())
    full_gc = []
    for _ in range(3):
        started = time.perf_counter()
        gc.collect(2)
        full_gc.append(time.perf_counter() - started)
    out["full_gc"] = {"objects": objects, "seconds": full_gc}

    at = fresh_app()
    at.session_state["view"] = "Shapes"
    press(at, "step_button")
    single = [press(at, "step_button") for _ in range(steps)]
    at.sidebar.number_input(key="run_n").set_value(64)
    before = at.session_state["app"].generation.n_steps
    seconds = press(at, "run_button")
    done = at.session_state["app"].generation.n_steps - before
    out["run_n"] = {"steps": done, "seconds": seconds, "per_step_s": seconds / done, "single_step_s": single}

    at = fresh_app("Local Hugging Face directory")
    at.sidebar.text_input(key="model_dir").set_value(str(gpt2_small_dir()))
    at.run()
    out["gpt2_load_s"] = press(at, "load_model")
    at.session_state["view"] = "Attention"
    timed_run(at)
    out["gpt2_prefill_attention_s"] = press(at, "step_button")
    out["gpt2_decode_attention_s"] = [press(at, "step_button") for _ in range(steps)]
    at.session_state["view"] = "Inspector"
    timed_run(at)
    at.selectbox(key="inspect_select").set_value("hook_logits")
    out["gpt2_inspector_logits_s"] = timed_run(at)
    gen = at.session_state["app"].generation
    out["gpt2_logits_shape"] = list(gen.trace.record("hook_logits").shape)
    return out


# Times in the page itself (performance.now()), from the pointerdown the click makes: when the page saw the
# script start running, stop running, and the end (the last chart drawn). Playwright's own overhead is left out.
WATCH = """() => {
  window.__phase = {down: null, running: null, done: null};
  document.addEventListener('pointerdown', () => { window.__phase.down = performance.now(); },
                            {capture: true, once: true});
  if (window.__phaseWatched) return;  // one observer per page, on the whole document (as tests/app_in_browser.py)
  window.__phaseWatched = true;
  new MutationObserver(records => records.forEach(r => {
    const s = r.target.getAttribute('data-test-script-state'), p = window.__phase;
    if (s === 'running' && p.running === null) p.running = performance.now();
    if (s === 'notRunning') p.done = performance.now();
  })).observe(document.documentElement,
              {attributes: true, subtree: true, attributeFilter: ['data-test-script-state']});
}"""
PHASES = """() => { const p = window.__phase, now = performance.now();
  return {total: (now - p.down) / 1000, to_start: (p.running - p.down) / 1000,
          running: (p.done - p.running) / 1000, to_drawn: (now - p.done) / 1000}; }"""


def timed_steps(page, steps: int) -> list[dict]:
    """``steps`` clicks on Step, each timed in the three phases above (``WATCH`` before the click, ``PHASES`` after)."""
    sys.path.insert(0, str(ROOT))
    from tests.app_in_browser import click

    seen = []
    for _ in range(steps):
        page.evaluate(WATCH)
        click(page, "Step")
        seen.append(page.evaluate(PHASES))
    return seen


def stepped_tabs(page, url: str, tabs: list[str], steps: int) -> dict[str, list[dict]]:
    """The app at ``url`` opened, ``PROMPT`` Stepped once (the prefill), then on each tab one untimed Step (the tab's
    first draw is not a Step's) and ``steps`` timed ones (``timed_steps``)."""
    sys.path.insert(0, str(ROOT))
    from tests.app_in_browser import click, open_app, open_tab, set_prompt

    open_app(page, url)
    set_prompt(page, PROMPT)
    click(page, "Step")
    out = {}
    for tab in tabs:
        open_tab(page, tab)
        click(page, "Step")
        out[tab] = timed_steps(page, steps)
    return out


def browser_timings(steps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.app_in_browser import (
        chromium_page,
        load_directory,
        open_app,
        open_tab,
        runs_finished,
        set_prompt,
        streamlit_server,
        wait_idle,
    )

    phases: dict[str, dict[str, float]] = {}

    def clicks(page, label: str, times: int = steps) -> list[float]:
        """Click Step ``times`` times; the totals, from the pointerdown to the last chart drawn (no padding). The
        median of each phase goes to ``phases[label]``."""
        seen = timed_steps(page, times)
        phases[label] = {k: statistics.median(t[k] for t in seen) for k in seen[0]}
        return [t["total"] for t in seen]

    out: dict = {}
    with streamlit_server() as url:
        for label, source in (("story-gpt", None), ("story-llama", "Bundled Llama-style story model")):
            with chromium_page(1600, 1000) as page:
                open_app(page, url)
                set_prompt(page, PROMPT)
                if source:
                    before = runs_finished(page)
                    page.get_by_label("Weights").get_by_text(source).click()
                    wait_idle(page, after=before)  # choosing the model is a rerun of its own
                out[f"{label}_prefill_s"] = clicks(page, f"{label} prefill", times=1)[0]
                out[f"{label}_step_s"] = {}
                for tab in TABS:
                    open_tab(page, tab)
                    out[f"{label}_step_s"][tab] = clicks(page, f"{label} / {tab}")
        with chromium_page(1600, 1000) as page:
            open_app(page, url)
            set_prompt(page, PROMPT)
            load_directory(page, gpt2_small_dir())
            # the tabs appear with the first step: this one draws Shapes
            out["gpt2_prefill_shapes_s"] = clicks(page, "gpt2 prefill / Shapes", times=1)[0]
            open_tab(page, "Attention")
            out["gpt2_decode_attention_s"] = clicks(page, "gpt2 decode / Attention")
            # the Inspector on the largest record of a step, [1, 1, 50257] after a decode step: from the Enter
            # that picks it in the record box to its heatmap and histogram drawn
            open_tab(page, "Inspector")
            picks = []
            for name in ("hook_logits", "blocks.0.attn.hook_pattern") * 3:
                box = page.get_by_label("record", exact=True)
                box.click()
                page.keyboard.type(name)
                before = runs_finished(page)
                started = time.perf_counter()
                page.keyboard.press("Enter")
                wait_idle(page, after=before)
                picks.append((name, time.perf_counter() - started))
            out["gpt2_inspector_pick_s"] = {name: [t for n, t in picks if n == name] for name, _ in picks}
    out["phases"] = phases
    return out


def summarise(section: str, result: dict) -> None:
    for key, value in result.items():
        if key == "phases":
            for label, p in value.items():
                print(f"{section:>8} {label:<34} {p['total']:.3f} s = to script start {p['to_start']:.3f} + "
                      f"running {p['running']:.3f} + to drawn {p['to_drawn']:.3f}")
        elif key == "full_gc":
            print(f"{section:>8} a full gc.collect(2) over {value['objects']:,} objects: "
                  f"{statistics.median(value['seconds']):.3f} s (Streamlit's default after every rerun; off here)")
        elif isinstance(value, dict) and key != "run_n":
            for tab, xs in value.items():
                print(f"{section:>8} {key + ' / ' + tab:<44} median {statistics.median(xs):.3f} s  "
                      f"(min {min(xs):.3f}, max {max(xs):.3f})")
        elif isinstance(value, list) and value and isinstance(value[0], float):
            print(f"{section:>8} {key:<44} median {statistics.median(value):.3f} s  "
                  f"(min {min(value):.3f}, max {max(value):.3f})")
        elif key == "run_n":
            print(f"{section:>8} Run N = 64: {value['steps']} steps in {value['seconds']:.2f} s → "
                  f"{value['per_step_s']:.3f} s per step; "
                  f"a single Step {statistics.median(value['single_step_s']):.3f} s")
        elif isinstance(value, float):
            print(f"{section:>8} {key:<44} {value:.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--browser", action="store_true")
    args = ap.parse_args()
    result = {"machine": machine(), "apptest": apptest_timings(args.steps)}
    path = save("app", result)
    if args.browser:
        result["browser"] = browser_timings(args.steps)
        path = save("app", result)
    for section in ("apptest", "browser"):
        summarise(section, result.get(section, {}))
    print("targets: bundled Step ≤ 0.3 s; GPT-2-small decode Step ≤ 0.5 s; Inspector ≤ 0.5 s; "
          "Run N per step ≤ a Step; first GPT-2 prefill ≤ 1.5 s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
