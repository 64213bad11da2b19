"""Drive the real app in headless Chromium: a `streamlit run app.py` server on a free port, Playwright.

Used by the end-to-end tests and by ``bench/bench_app.py``. Chromium is
Debian's (``/usr/bin/chromium``); nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def streamlit_server(env: dict | None = None, timeout: float = 90.0):
    """Start ``streamlit run app.py`` on a free localhost port; yield its URL; stop it."""
    port = free_port()
    log = open(ROOT / f".streamlit-test-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
         "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited early: {(ROOT / log.name).read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise TimeoutError("streamlit did not start")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        Path(log.name).unlink(missing_ok=True)


@contextmanager
def chromium():
    """Debian's Chromium, headless, driven by Playwright (one browser for many pages)."""
    if not os.path.exists(CHROMIUM):
        raise RuntimeError(f"{CHROMIUM} is missing: install Debian's chromium package (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def chromium_page(width: int = 1500, height: int = 1100, browser=None):
    """A fresh page (its own context: a new browser session of the app) at ``width`` × ``height``."""
    if browser is None:
        with chromium() as own, chromium_page(width, height, own) as page:
            yield page
        return
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        yield context.new_page()
    finally:
        context.close()


RUNS = """() => {
    if (!window.__stRunsWatched) {  // count every finished rerun, however short, from now on
        window.__stRunsWatched = true;
        window.__stRuns = 0;
        // the whole document, not one element: React may replace the app's root element, and an observer
        // on the old one would never count again
        new MutationObserver(records => {
            if (records.some(r => r.target.getAttribute('data-test-script-state') === 'notRunning')) {
                window.__stRuns += 1;
            }
        }).observe(document.documentElement,
                   {attributes: true, subtree: true, attributeFilter: ['data-test-script-state']});
    }
    return window.__stRuns;
}"""


STATE = "() => document.querySelector('[data-testid=\"stApp\"]')?.getAttribute('data-test-script-state')"


def runs_finished(page) -> int:
    """How many reruns the page has seen finish (installs the counter on first use)."""
    return page.evaluate(RUNS)


def wait_idle(page, timeout: float = 90.0, settle_ms: int = 200, after: int | None = None) -> None:
    """Wait until no rerun is going and every plotly chart has drawn (then ``settle_ms`` more). With ``after``
    (a ``runs_finished`` count taken before an action that reruns the app), first wait for a rerun to finish
    after it: a rerun shorter than one animation frame is not missed, and nothing waits a fixed time."""
    if after is not None:
        page.wait_for_function(f"() => (window.__stRuns || 0) > {after}", timeout=timeout * 1000)
    page.wait_for_function(f"() => ({STATE})() === 'notRunning'", timeout=timeout * 1000)
    page.wait_for_function(
        "() => document.querySelectorAll('[data-testid=\"stPlotlyChart\"]').length"
        " <= document.querySelectorAll('.js-plotly-plot').length",
        timeout=timeout * 1000,
    )
    if settle_ms:
        page.wait_for_timeout(settle_ms)


def open_app(page, url: str) -> None:
    page.goto(url, wait_until="domcontentloaded")
    page.get_by_role("button", name="Step").wait_for(timeout=90_000)
    runs_finished(page)  # the counter, from here on
    wait_for_a_run(page)


def wait_for_a_run(page) -> None:
    """After an action that may or may not rerun the app (a new session may run more than once as it
    connects; committing the same prompt, or opening a tab before the first step, starts nothing): give a
    run 1.5 s to start, then wait for the page to be idle. In the fresh-clone CI run, waiting instead for a
    counted rerun after loading or typing the prompt timed out twice, so these keep the tolerant wait."""
    with contextlib.suppress(Exception):
        page.wait_for_function(f"() => ({STATE})() === 'running'", timeout=1500)
    wait_idle(page)


def set_prompt(page, text: str) -> None:
    box = page.get_by_label("Prompt (one line per sequence: several lines make a batch)")
    box.fill(text)
    box.press("Control+Enter")  # commit the text area
    wait_for_a_run(page)


def click(page, name: str, settle_ms: int = 200) -> None:
    before = runs_finished(page)
    page.get_by_role("button", name=name, exact=True).click()
    wait_idle(page, settle_ms=settle_ms, after=before)


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name, exact=True).click()
    wait_for_a_run(page)


def plotly_data(page) -> list:
    """The data arrays of every plotly chart on the page, as the browser holds them (a numpy array arrives
    packed, ``{dtype, bdata, shape}``, and plotly.js keeps that object with the decoded ``_inputArray``)."""
    return page.evaluate(
        "() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => (d.data || []).map(t => {"
        "  const z = t.z; let rows = null, cols = null;"
        "  if (z && z.shape !== undefined) { const s = String(z.shape).split(',').map(Number);"
        "    rows = s[0]; cols = s.length > 1 ? s[1] : null;"
        "    const a = z._inputArray;"
        "    if (!a || (a.length !== rows && a.length !== rows * (cols || 1))) { rows = cols = null; } }"
        "  else if (z) { rows = z.length; cols = z[0] && z[0].length !== undefined ? z[0].length : null; }"
        "  return {type: t.type, skip: t.hoverinfo === 'skip', rows: rows, cols: cols}; }))"
    )
