"""Memory of one app server: ``python bench/bench_sessions.py [--sessions 8] [--steps 30]``.

1. **One heavy session, in the app script (AppTest):** GPT-2 small (124M, random weights, from a local
   directory), the KV cache off, the default 512 MiB budget, Run N = 150. The process's peak resident memory
   during the run (VmHWM, reset before it) against what it held before: the target is budget + 400 MB.
2. **Many sessions on a real server:** ``streamlit run app.py`` with a server budget of 2048 MiB, a cap of
   ``--sessions`` sessions and a 5 s disconnect TTL; that many Chromium tabs each fill a 200 MB budget (the
   bundled model, a 200-token prompt, the cache off, Run N = ``--steps``); one more tab is refused. Then every
   tab closes, and the server's resident memory (VmRSS) is sampled every 5 s: the target is memory back
   within a minute.

Figures go to ``bench/results/sessions.json`` and docs/benchmarks.md, with the machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import ROOT, gpt2_small_dir, machine, save

sys.path.insert(0, str(ROOT))
from tests.app_in_browser import status_kib  # noqa: E402 - the checkout's own test helpers, on the path just above

MiB = 2**20


def one_heavy_session(steps: int) -> dict:
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=1800)
    at.run()
    at.sidebar.radio(key="source").set_value("Local Hugging Face directory")
    at.run()
    at.sidebar.text_input(key="model_dir").set_value(str(gpt2_small_dir()))
    at.run()
    at.sidebar.button(key="load_model").click()
    at.run()
    at.sidebar.toggle(key="use_cache").set_value(False)
    at.sidebar.number_input(key="run_n").set_value(steps)
    at.run()
    before = status_kib("self", "VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    started = time.perf_counter()
    at.sidebar.button(key="run_button").click()
    at.run()
    seconds = time.perf_counter() - started
    assert not at.exception, [e.value for e in at.exception]
    peak = status_kib("self", "VmHWM") * 1024
    gen = at.session_state["app"].generation
    budget = gen.trace.log.budget_bytes
    return {"steps": gen.n_steps, "seconds": seconds, "rss_before_mib": before / MiB, "peak_mib": peak / MiB,
            "peak_over_before_mib": (peak - before) / MiB, "budget_mib": budget / MiB,
            "kept_peak_mib": gen.trace.log.peak_bytes_kept / MiB,
            "target_mib": budget / MiB + 400, "within_target": peak - before <= budget + 400 * MiB}


def many_sessions(sessions: int, steps: int) -> dict:
    from tests.app_in_browser import (
        SERVER_LOGS,
        app_context,
        chromium,
        click,
        open_app,
        server_pid,
        set_prompt,
        streamlit_server,
        wait_idle,
    )

    env = {"GPT_SHAPE_TRACER_SERVER_BUDGET_MB": "2048", "GPT_SHAPE_TRACER_MAX_SESSIONS": str(sessions),
           "STREAMLIT_SERVER_DISCONNECTED_SESSION_TTL": "5"}
    out: dict = {"server_budget_mib": 2048, "sessions": sessions, "steps": steps, "samples": []}
    prompt = " ".join(["Tom had a big red kite and he went to the park with his friend Lily."] * 14)
    with streamlit_server(env=env) as url, chromium() as browser:
        pid = server_pid(url)
        log = SERVER_LOGS[-1]  # this server's log: what it says when it lets sessions go
        contexts = []
        for i in range(sessions):
            context = app_context(browser, 1280, 800)
            contexts.append(context)
            page = context.new_page()
            open_app(page, url)
            set_prompt(page, prompt)
            page.locator("[data-testid=stSidebar]").get_by_text("KV cache", exact=True).click()  # off
            wait_idle(page)
            for label, value in (("Budget (MB)", "200"), ("N for Run N (1…256)", str(steps))):
                box = page.get_by_label(label, exact=True)
                box.fill(value)
                box.press("Enter")
                wait_idle(page)
            click(page, "Run N")
            out["samples"].append({"after_session": i + 1, "rss_mib": status_kib(pid, "VmRSS") / 1024})
        extra = app_context(browser, 1280, 800)
        page = extra.new_page()
        page.goto(url)
        page.get_by_text(f"already serves {sessions} session(s)").wait_for(timeout=60_000)
        out["one_more_refused"] = True
        extra.close()
        out["rss_with_all_mib"] = status_kib(pid, "VmRSS") / 1024
        out["peak_mib"] = status_kib(pid, "VmHWM") / 1024
        for context in contexts:
            context.close()
        closed = time.perf_counter()
        out["after_close"] = []
        for _ in range(24):  # two minutes
            time.sleep(5)
            out["after_close"].append({"seconds": round(time.perf_counter() - closed, 1),
                                       "rss_mib": status_kib(pid, "VmRSS") / 1024})
        out["server_said"] = [line for line in log.read_text().splitlines() if "gpt-shape-tracer:" in line]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--heavy-steps", type=int, default=150)
    parser.add_argument("--skip-heavy", action="store_true")
    args = parser.parse_args()
    out: dict = {"machine": machine()}
    if not args.skip_heavy:
        out["heavy"] = heavy = one_heavy_session(args.heavy_steps)
        print(f"one session, GPT-2 small, cache off, Run N {heavy['steps']} steps in {heavy['seconds']:.0f} s: peak "
              f"{heavy['peak_over_before_mib']:.0f} MiB over the {heavy['rss_before_mib']:.0f} MiB held before "
              f"(budget {heavy['budget_mib']:.0f} MiB + 400 = target {heavy['target_mib']:.0f}; values kept at most "
              f"{heavy['kept_peak_mib']:.0f} MiB)")
    out["many"] = many = many_sessions(args.sessions, args.steps)
    print(f"{args.sessions} sessions × 200 MB on a 2048 MiB server: RSS {many['rss_with_all_mib']:.0f} MiB with all "
          f"open (peak {many['peak_mib']:.0f}); one more refused: {many.get('one_more_refused', False)}")
    print("the server said:", many["server_said"])
    for sample in many["after_close"]:
        print(f"  {sample['seconds']:5.1f} s after closing every tab: {sample['rss_mib']:.0f} MiB")
    print("saved", save("sessions", out))


if __name__ == "__main__":
    main()
