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


SERVER_LOGS: list[Path] = []  # of the servers running now: a test that times out shows their last lines


@contextmanager
def streamlit_server(env: dict | None = None, timeout: float = 90.0, checkout: Path = ROOT):
    """Start ``streamlit run app.py`` in ``checkout`` (its settings from its ``.streamlit/``) on a free localhost
    port; yield its URL; stop it."""
    port = free_port()
    log = open(ROOT / f".streamlit-test-{port}.log", "w")  # noqa: SIM115 - closed below
    SERVER_LOGS.append(Path(log.name))
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
         "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false"],
        cwd=checkout, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited early: {Path(log.name).read_text()[-2000:]}")
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
        SERVER_LOGS.remove(Path(log.name))
        Path(log.name).unlink(missing_ok=True)


def server_pid(url: str) -> int:
    """The pid of the streamlit server listening on ``url``'s port (found by its command line)."""
    port = url.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"streamlit" in b" ".join(args) and port.encode() in args:
            return int(proc.name)
    raise LookupError(f"no streamlit server on port {port}")


def status_kib(pid: int | str, field: str) -> int:
    """A memory line of ``/proc/<pid>/status`` ("VmRSS", "VmHWM", …), in KiB; ``pid`` "self" for this process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


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


# Counts every rerun the server says has finished. The page's own sign, the app element's
# data-test-script-state going "running" → "notRunning", can be skipped: a rerun shorter than a frame is one
# React render, and the attribute never changes (on a fast machine a test then waited for a rerun forever).
# So the count is taken from the websocket: each ForwardMsg that is a script_finished (field 6, an enum) other
# than FINISHED_EARLY_FOR_RERUN (2, a run another replaced). It counts in a task after the app's own listener,
# which has by then dispatched the message. Installed before any of the page's scripts (an init script).
RUNS_SCRIPT = """
window.__stRuns = 0;
(() => {
    function finishedRun(b) {
        let i = 0;
        const varint = () => { let v = 0, s = 0, x; do { x = b[i++]; v += (x & 127) * 2 ** s; s += 7; }
                               while (x & 128 && i < b.length); return v; };
        while (i < b.length) {
            const tag = varint(), field = Math.floor(tag / 8), wire = tag & 7;
            if (wire === 0) { const v = varint(); if (field === 6) return v !== 2; }
            else if (wire === 2) { const n = varint(); i += n; }  // not i += varint(): i is read first
            else if (wire === 1) { i += 8; } else if (wire === 5) { i += 4; } else { return false; }
        }
        return false;
    }
    const Native = window.WebSocket;
    window.WebSocket = class extends Native {
        constructor(...args) {
            super(...args);
            this.addEventListener('message', e => {
                if (e.data instanceof ArrayBuffer && finishedRun(new Uint8Array(e.data))) {
                    setTimeout(() => { window.__stRuns += 1; }, 0);
                }
            });
        }
    };
})();
"""
RUNS = "() => window.__stRuns"


STATE = "() => document.querySelector('[data-testid=\"stApp\"]')?.getAttribute('data-test-script-state')"


def runs_finished(page) -> int:
    """How many reruns the page has seen finish since it loaded."""
    return page.evaluate(RUNS)


def page_state(page) -> str:
    """What the page says about itself, for a test that timed out: reruns seen, the script's state, the
    status widget (e.g. "Connecting") and any exception shown."""
    logs = "".join(f"\n--- {log.name}:\n" + log.read_text(errors="replace")[-3000:] for log in SERVER_LOGS)
    return str(page.evaluate(PAGE_STATE.replace("STATE", STATE))) + logs


PAGE_STATE = """() => ({runs: window.__stRuns, state: (STATE)(),
    status: document.querySelector('[data-testid="stStatusWidget"]')?.innerText,
    exceptions: Array.from(document.querySelectorAll('[data-testid="stException"]')).map(e => e.innerText)})"""


def wait_idle(page, timeout: float = 90.0, settle_ms: int = 0, after: int | None = None) -> None:
    """Wait until no rerun is going and every plotly chart has drawn (then ``settle_ms`` more). With ``after``
    (a ``runs_finished`` count taken before an action that reruns the app), first wait for a rerun to finish
    after it: a rerun shorter than one animation frame is not missed, and nothing waits a fixed time."""
    try:
        if after is not None:
            page.wait_for_function(f"() => (window.__stRuns || 0) > {after}", timeout=timeout * 1000)
        page.wait_for_function(f"() => ({STATE})() === 'notRunning'", timeout=timeout * 1000)
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=\"stPlotlyChart\"]').length"
            " <= document.querySelectorAll('.js-plotly-plot').length",
            timeout=timeout * 1000,
        )
        # every canvas has drawn the spec it was last handed (a drawing that threw never says so)
        page.wait_for_function(f"() => ({PANELS})().every(p => p && p.dataset.revision === p.__handed)",
                               timeout=timeout * 1000)
    except Exception as e:
        raise AssertionError(f"the page did not become idle (after run {after}): {page_state(page)}") from e
    if settle_ms:
        page.wait_for_timeout(settle_ms)


def open_app(page, url: str) -> None:
    """Load the app as a new session and wait until its first run has finished, the page is idle and the
    sidebar's Step button is drawn: the page fetches each kind of widget's code when it first draws one, and on a
    loaded machine the run can finish before they arrive (a page seen with the sidebar's headers and no widgets)."""
    page.goto(url, wait_until="domcontentloaded")
    wait_idle(page, after=0)
    page.get_by_role("button", name="Step", exact=True).wait_for(timeout=60_000)


def wait_for_a_run(page, before: int) -> None:
    """After an action that may or may not rerun the app (opening a tab before the first step starts
    nothing): wait up to 1.5 s for a rerun to finish after ``before`` (a ``runs_finished`` count taken before
    the action) or to be going, then for the page to be idle. A rerun that happens is waited for without a
    fixed delay; only an action that starts none costs the 1.5 s."""
    with contextlib.suppress(Exception):
        page.wait_for_function(f"() => window.__stRuns > {before} || ({STATE})() === 'running'", timeout=1500)
    wait_idle(page)


def set_prompt(page, text: str) -> None:
    """Type ``text`` (which must differ from the prompt shown) and commit it, which always reruns the app."""
    box = page.get_by_label("Prompt (one line per sequence: several lines make a batch)")
    before = runs_finished(page)
    box.fill(text)
    box.press("Control+Enter")  # commit the text area
    wait_idle(page, after=before)


def load_directory(page, directory) -> None:
    """Choose "Local Hugging Face directory", type ``directory``, commit it and click Load (each a rerun)."""
    before = runs_finished(page)
    page.get_by_label("Weights").get_by_text("Local Hugging Face directory").click()
    wait_idle(page, after=before)
    box = page.get_by_role("textbox", name="Directory")
    before = runs_finished(page)
    box.fill(str(directory))
    box.press("Enter")
    wait_idle(page, after=before)
    click(page, "Load")


def open_directory_and_step(page, url: str, prompt: str, directory, model_type: str, steps: int = 2) -> None:
    """Open the app, type ``prompt``, load ``directory``, wait until the page names the model ("hf:<model_type>":
    the server's first transformers model takes long to import and load on a loaded machine), then Step ``steps``
    times."""
    open_app(page, url)
    set_prompt(page, prompt)
    load_directory(page, directory)
    page.get_by_text(f"hf:{model_type}").first.wait_for(timeout=180_000)
    for _ in range(steps):
        click(page, "Step")


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


def steps_shown(page) -> int:
    """How many steps the page's generation has, as the page shows it: the step slider's last step + 1, 1 for
    the prefill alone, 0 before the first Step."""
    slider = page.locator('[data-testid="stSlider"]').filter(has_text="time travel")
    if slider.count():
        return int(slider.first.inner_text().split()[-1]) + 1
    return 1 if page.get_by_text("Step 0, the prefill").count() else 0


def wait_settled(page, quiet_s: float = 2.5, timeout: float = 120.0) -> None:
    """Wait until the page has shown no rerun and the same step count for ``quiet_s`` seconds. For clicks that
    interrupt a run: Streamlit starts the new run while the old one stops, and the page can show "not running"
    between the two, which ``wait_idle`` would take for the end."""
    deadline = time.time() + timeout
    last, since = None, time.time()
    while time.time() < deadline:
        now = (steps_shown(page), page.evaluate(f"({STATE})()"), runs_finished(page))
        if now != last:
            last, since = now, time.time()
        elif now[1] == "notRunning" and time.time() - since >= quiet_s:
            wait_idle(page)
            return
        page.wait_for_timeout(250)
    raise AssertionError(f"the page did not settle: {page_state(page)}")


# every heatmap-panels canvas (gui/panels.js) on the page, found by its element's key (gui.common.PANELS_KEY): the
# drawing inside its component's shadow root, or null while the component's code is still loading
PANELS = ("() => Array.from(document.querySelectorAll('[class*=\"st-key-panels-\"]')).map(c => {"
          " const host = c.querySelector('[data-testid^=\"stBidiComponent\"]');"
          " return host ? (host.shadowRoot || host).querySelector('.panels') : null; })")


def panels_data(page) -> list:
    """Every heatmap-panels canvas's panels as the page drew them: rows and columns of each (as ``plotly_data``
    gives a heatmap's), the spec it drew (``spec``) and the labels it found reaching past its edge (``clipped``)."""
    return page.evaluate(f"() => ({PANELS})().filter(p => p && p.__spec).map(p => ({{"
                         "spec: p.__spec, clipped: JSON.parse(p.dataset.clipped || '[]'), "
                         "panels: p.__spec.panels.map(q => "
                         "({rows: q.z.length, cols: q.z.length ? q.z[0].length : 0}))}))")


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


def clipped_labels(page) -> list[str]:
    """Tick labels and axis titles of the page's plotly charts that stick out of their chart (a margin too
    narrow for them), and the labels and titles of its heatmap-panels canvases that reach past their edge, as
    "text (how many pixels out)"."""
    return page.evaluate("""() => {
        const PANELS = """ + PANELS + """;
        const out = [];
        for (const chart of document.querySelectorAll('.js-plotly-plot')) {
            const box = chart.getBoundingClientRect();
            for (const t of chart.querySelectorAll('.xtick text, .ytick text, .g-xtitle text, .g-ytitle text,'
                                                   + ' .g-y2title text, .cbtitle text, .colorbar .tick text')) {
                const r = t.getBoundingClientRect();
                if (r.width === 0) continue;
                const over = Math.max(box.left - r.left, r.right - box.right, box.top - r.top, r.bottom - box.bottom);
                if (over > 1) out.push(`${t.textContent} (${Math.round(over)} px out)`);
            }
        }
        for (const p of (PANELS)()) {  // a canvas of heatmap panels: the labels it drew past its edge, its titles
            if (!p) continue;
            for (const label of JSON.parse(p.dataset.clipped || '[]')) out.push(label);
            const box = p.getBoundingClientRect();
            for (const t of p.querySelectorAll('.panels-text > div')) {
                const r = t.getBoundingClientRect();
                const over = Math.max(box.left - r.left, r.right - box.right, box.top - r.top, r.bottom - box.bottom);
                if (over > 1) out.push(`${t.textContent} (${Math.round(over)} px out)`);
            }
        }
        return out;
    }""")
