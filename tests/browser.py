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


def app_context(browser, width: int = 1500, height: int = 1100):
    """A new browser context (its own cookies and cache) whose pages count the app's reruns."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.add_init_script(RUNS_SCRIPT)  # every rerun of the page's session is counted, from its first
    return context


@contextmanager
def chromium_page(width: int = 1500, height: int = 1100, browser=None):
    """A fresh page (its own context: a new browser session of the app) at ``width`` × ``height``."""
    if browser is None:
        with chromium() as own, chromium_page(width, height, own) as page:
            yield page
        return
    context = app_context(browser, width, height)
    try:
        yield context.new_page()
    finally:
        context.close()


# Counts every finished rerun, however short, from the page's first: installed before any of the page's own
# scripts run (an init script), on the whole document, since React may replace the app's root element and an
# observer on the old one would never count again.
RUNS_SCRIPT = """
window.__stRuns = 0;
new MutationObserver(records => {
    if (records.some(r => r.target.getAttribute('data-test-script-state') === 'notRunning')) {
        window.__stRuns += 1;
    }
}).observe(document, {attributes: true, subtree: true, attributeFilter: ['data-test-script-state']});
"""
RUNS = "() => window.__stRuns"


STATE = "() => document.querySelector('[data-testid=\"stApp\"]')?.getAttribute('data-test-script-state')"


def runs_finished(page) -> int:
    """How many reruns the page has seen finish since it loaded."""
    return page.evaluate(RUNS)


def wait_idle(page, timeout: float = 90.0, settle_ms: int = 0, after: int | None = None) -> None:
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
    """Load the app as a new session and wait until its first run has finished and the page is idle."""
    page.goto(url, wait_until="domcontentloaded")
    page.get_by_role("button", name="Step").wait_for(timeout=90_000)
    wait_for_a_run(page, before=0)


def wait_for_a_run(page, before: int) -> None:
    """After an action that may or may not rerun the app (committing the same prompt, or opening a tab before
    the first step, starts nothing): wait up to 1.5 s for a rerun to finish after ``before`` (a
    ``runs_finished`` count taken before the action) or to be going, then for the page to be idle. A rerun
    that happens is waited for without a fixed delay; only an action that starts none costs the 1.5 s."""
    with contextlib.suppress(Exception):
        page.wait_for_function(f"() => window.__stRuns > {before} || ({STATE})() === 'running'", timeout=1500)
    wait_idle(page)


def set_prompt(page, text: str) -> None:
    """Type ``text`` (which must differ from the prompt shown) and commit it: that always reruns the app, so
    the rerun is waited for, counted — pressing Ctrl+Enter again once if none came in 20 s."""
    box = page.get_by_label("Prompt (one line per sequence: several lines make a batch)")
    before = runs_finished(page)
    box.fill(text)
    for attempt in range(2):
        box.press("Control+Enter")  # commit the text area
        try:
            page.wait_for_function(f"() => window.__stRuns > {before}", timeout=20_000)
            break
        except Exception:
            if attempt:
                raise
    wait_idle(page)


def click(page, name: str, settle_ms: int = 0) -> None:
    before = runs_finished(page)
    page.get_by_role("button", name=name, exact=True).click()
    wait_idle(page, settle_ms=settle_ms, after=before)


def open_tab(page, name: str) -> None:
    """Open the tab ``name`` (no click if it is open already: that would start no rerun to wait for)."""
    tab = page.get_by_role("tab", name=name, exact=True)
    if tab.get_attribute("aria-selected") == "true":
        return
    before = runs_finished(page)
    tab.click()
    wait_for_a_run(page, before)


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
