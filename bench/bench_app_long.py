"""The app at 1k tokens: ``python bench/bench_app_long.py [--tokens 1000] [--repeats 3]``.

GPT-2 small (124M, random weights, loaded from a local Hugging Face directory as a user loads one) with a prompt
of ``--tokens`` tokens, driven through the real app script (AppTest runs it as the server does: model, tracer,
figures, Streamlit's serialisation; no browser). Measured in one run, beside its reference:

- the untraced forward of the same prompt on the same model (the floor a Step cannot beat);
- the prefill Step on the Shapes tab, and its parts: the traced forward (the trace's own clock), the rest of the
  rerun (figures and serialisation), and a profile of the rerun grouped by where the time went;
- every other click a person makes at that step: each tab, the Attention sub-tabs, another layer and head, the
  step slider, the Inspector on the largest record.

The targets (issue 27, item 10): a Step at most the untraced forward + 0.5 s, every other click ≤ 1 s. The
machine is shared: wall-clock estimates, every sample kept in ``bench/results/app_long.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import threading
import time

import torch
from common import ROOT, gpt2_small_dir, machine, save
from streamlit.testing.v1 import AppTest

from gpt_shape_tracer.session.memory import reuse_freed_memory

SENTENCE = "Tom had a big red kite. One day, Tom went to the park with his friend Lily. "


def profiled(at: AppTest) -> tuple[float, cProfile.Profile]:
    """One rerun, timed, with a profile of the thread that runs the script (AppTest runs it in a thread of
    its own, which a profiler enabled here would not see): the profiler is switched on by that thread's first
    event."""
    profile = cProfile.Profile()

    def start(frame, event, arg):  # noqa: ARG001 - the signature sys.setprofile calls
        sys.setprofile(None)
        if threading.current_thread().name == "ScriptRunner.scriptThread":
            profile.enable()

    threading.setprofile(start)
    try:
        seconds = timed(at)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    return seconds, profile


def timed(at: AppTest) -> float:
    started = time.perf_counter()
    at.run()
    elapsed = time.perf_counter() - started
    assert not at.exception, [e.value for e in at.exception]
    return elapsed


def app_with_directory(directory, prompt: str) -> AppTest:
    """The real app under AppTest as a person drives it: ``prompt`` typed, "Local Hugging Face directory"
    chosen, ``directory`` typed, Load clicked; ready for its first Step."""
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=900)
    at.run()
    at.sidebar.text_area(key="prompt").set_value(prompt)
    at.sidebar.radio(key="source").set_value("Local Hugging Face directory")
    at.run()
    at.sidebar.text_input(key="model_dir").set_value(str(directory))
    at.run()
    at.sidebar.button(key="load_model").click()
    timed(at)
    return at


def prompt_of(tokenizer, tokens: int) -> str:
    text = SENTENCE
    while len(tokenizer.encode(text)) < tokens:
        text += SENTENCE
    ids = tokenizer.encode(text)[:tokens]
    return tokenizer.decode(ids)


def untraced_forward(model, ids: torch.Tensor, repeats: int) -> list[float]:
    out = []
    with torch.inference_mode():
        for _ in range(repeats):
            started = time.perf_counter()
            model(ids)
            out.append(time.perf_counter() - started)
    return out


def where_the_time_went(profile: cProfile.Profile) -> dict[str, float]:
    """Seconds spent in each layer's own code (self time, so nothing counts twice): torch's kernels, our model,
    the tracer, the figures, plotly, Streamlit (serialising and sending), the rest."""
    stats = pstats.Stats(profile)
    groups = (("torch kernels and tensor methods", ("built-in method torch", "_C.TensorBase", "/torch/")),
              ("waiting on locks (other threads)", ("of '_thread.lock' objects",)),
              ("model/ (Python around the kernels)", ("/work/main/model/",)),
              ("tracer/ (capture, statistics, eviction)", ("/tracer/",)),
              ("figures/ (building figures and tables)", ("/figures/",)),
              ("plotly (figure objects, JSON)", ("/plotly/", "/_plotly_utils/")),
              ("pandas / pyarrow (tables)", ("/pandas/", "/pyarrow/")),
              ("streamlit (elements, serialising)", ("/streamlit/",)))
    out = {label: 0.0 for label, _ in groups} | {"other": 0.0}
    for (path, _, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = path if path != "~" else name
        label = next((label for label, parts in groups if any(part in where for part in parts)), "other")
        out[label] += tottime
    return out


def browser_timings(directory, prompt: str) -> dict[str, float]:
    """The same prefill Step and the heaviest clicks in headless Chromium (1600 × 1000), from the click to the
    page idle with every chart drawn: what the person waits for, transfer and drawing included."""
    sys.path.insert(0, str(ROOT))
    from tests.app_in_browser import (
        chromium_page,
        click,
        load_directory,
        open_app,
        open_tab,
        set_prompt,
        streamlit_server,
        wait_idle,
    )

    out: dict[str, float] = {}
    with streamlit_server() as url, chromium_page(1600, 1000) as page:
        open_app(page, url)
        load_directory(page, directory)
        set_prompt(page, prompt)

        def timed_click(label: str, action) -> None:
            started = time.perf_counter()
            action()
            out[label] = time.perf_counter() - started

        timed_click("prefill Step (Shapes tab)", lambda: click(page, "Step"))
        for tab in ("Attention", "Causal mask", "KV cache", "Next token", "Inspector", "Shapes"):
            timed_click(f"tab {tab}", lambda tab=tab: (open_tab(page, tab), wait_idle(page)))
        open_tab(page, "Attention")
        wait_idle(page)
        for sub in ("All heads", "History", "Stages"):
            timed_click(f"Attention → {sub}", lambda sub=sub: (open_tab(page, sub), wait_idle(page)))
        timed_click("decode Step (Attention tab)", lambda: click(page, "Step"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--browser", action="store_true", help="also time the page in headless Chromium")
    args = parser.parse_args()

    from gpt_shape_tracer.model import load_model

    directory = gpt2_small_dir()
    model, tokenizer = load_model(str(directory))
    prompt = prompt_of(tokenizer, args.tokens)
    ids = torch.tensor([tokenizer.encode(prompt)])
    # the app keeps freed memory for reuse (gpt_shape_tracer/memory.py) from its first run on: the floor is
    # measured under the same allocator setting (with glibc's defaults the untraced forward itself is ~40% slower)
    reuse_freed_memory()
    untraced_forward(model, ids, 1)  # warm
    floor = untraced_forward(model, ids, args.repeats)

    at = app_with_directory(directory, prompt)

    out: dict = {"machine": machine(), "tokens": int(ids.shape[1]), "untraced_forward_s": floor}
    at.sidebar.button(key="step_button").click()
    out["prefill_step_shapes_s"] = timed(at)  # not profiled: a profiler slows every Python call of the tracer
    trace = at.session_state["app"].generation.trace
    out["prefill_traced_forward_s"] = trace.steps[0].seconds
    out["prefill_rest_s"] = out["prefill_step_shapes_s"] - trace.steps[0].seconds
    # where a prefill's time goes: a second prefill of the session (Reset, Step), profiled — its seconds are
    # the profiler's, longer than the Step's
    at.sidebar.button(key="reset_button").click()
    at.run()
    if any(b.key == "reset_confirm" for b in at.sidebar.button):  # Reset asks when there are steps to discard
        at.sidebar.button(key="reset_confirm").click()
    timed(at)
    at.sidebar.button(key="step_button").click()
    out["second_prefill_step_profiled_s"], profile = profiled(at)
    out["prefill_profile_s"] = where_the_time_went(profile)

    clicks: dict[str, float] = {}
    for tab in ("Attention", "Causal mask", "KV cache", "Next token", "What if", "Compare runs", "Worked example",
                "Inspector", "Export", "Shapes"):
        at.session_state["view"] = tab
        clicks[f"tab {tab}"] = timed(at)
    at.session_state["view"] = "Attention"
    timed(at)
    for sub in ("O = A·V", "Pitfalls", "All heads", "History", "Stages"):
        at.session_state["attn_view"] = sub
        if sub == "All heads":
            clicks[f"Attention → {sub}"], profile = profiled(at)
            out["all_heads_profile_s"] = where_the_time_went(profile)
        else:
            clicks[f"Attention → {sub}"] = timed(at)
    at.selectbox(key="attn_layer").set_value(11)
    clicks["Attention: layer 11"] = timed(at)
    at.selectbox(key="attn_head").set_value(7)
    clicks["Attention: head 7"] = timed(at)
    at.sidebar.button(key="step_button").click()
    out["decode_step_attention_s"] = timed(at)
    at.slider(key="step_view").set_value(0)
    clicks["slider to step 0 (Attention)"] = timed(at)
    at.session_state["view"] = "Inspector"
    timed(at)
    at.selectbox(key="inspect_select").set_value("hook_logits")
    clicks["Inspector: hook_logits at the prefill"] = timed(at)
    out["clicks_s"] = clicks
    out["slowest_click"] = max(clicks, key=clicks.__getitem__)

    floor_s = statistics.median(floor)
    print(f"{out['tokens']} tokens, GPT-2 small (random weights) from a directory, AppTest (no browser)")
    print(f"untraced forward {floor_s:.2f} s; prefill Step {out['prefill_step_shapes_s']:.2f} s = forward + "
          f"{out['prefill_step_shapes_s'] - floor_s:.2f} s (traced forward {out['prefill_traced_forward_s']:.2f} s, "
          f"the rest {out['prefill_rest_s']:.2f} s)")
    print(f"a second prefill, profiled: {out['second_prefill_step_profiled_s']:.2f} s")
    for label, seconds in out["prefill_profile_s"].items():
        print(f"  in {label}: {seconds:.2f} s")
    for label, seconds in out["all_heads_profile_s"].items():
        print(f"  All heads, in {label}: {seconds:.2f} s")
    print(f"decode Step on Attention {out['decode_step_attention_s']:.2f} s")
    for label, seconds in clicks.items():
        print(f"  {label}: {seconds:.2f} s{'  (over 1 s)' if seconds > 1 else ''}")
    if args.browser:
        out["browser_s"] = browser_timings(directory, prompt)
        print("in headless Chromium, click → every chart drawn:")
        for label, seconds in out["browser_s"].items():
            print(f"  {label}: {seconds:.2f} s{'  (over 1 s)' if seconds > 1 and 'Step' not in label else ''}")
    print("saved", save("app_long", out))


if __name__ == "__main__":
    main()
