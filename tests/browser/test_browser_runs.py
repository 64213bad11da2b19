"""Nothing lost, in a real headless Chromium (issue 41 item 1): a reload and a restarted server give back the run;
200 arrow keys pressed fast on the step slider leave the page alive and on the right step; Reset asks.

A test that restarts a server starts its own, its runs in the test's own folder (``GPT_SHAPE_TRACER_RUNS_DIR``), so a
second server started on the same folder is the first one restarted; the others use the shared server
(tests/browser/conftest.py) and read its runs folder. ``SAVE_SCREENSHOTS=runs`` also writes the screenshots
docs/runs.md shows (docs/images/).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import pytest

from gpt_shape_tracer.session.runs import RUN_FILE
from gpt_shape_tracer.tracer import MAX_RUN_STEPS
from tests.app_in_browser import (
    app_context,
    click,
    open_app,
    page_state,
    runs_finished,
    set_prompt,
    steps_shown,
    streamlit_server,
    wait_idle,
    wait_settled,
)

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"


def server_env(runs: Path) -> dict[str, str]:
    return {"GPT_SHAPE_TRACER_RUNS_DIR": str(runs), "GPT_SHAPE_TRACER_MAX_SESSIONS": "64"}


@pytest.fixture
def page(browser):
    context = app_context(browser, 1600, 1000)
    try:
        yield context.new_page()
    finally:
        context.close()


def address_run(page) -> str:
    run = page.evaluate("() => new URLSearchParams(window.location.search).get('run')")
    assert run, f"no run id in the address {page.url}"
    return run


def saved(runs: Path, run_id: str, timeout: float = 30.0, **expected) -> dict:
    """The run's record as written, once its fields hold ``expected`` (or after ``timeout``): the server writes a
    run by a thread of its own once its Steps pause (gui/runs.py RunWrite), so a test waits for it."""
    deadline = time.monotonic() + timeout
    while True:
        path = runs / run_id / RUN_FILE
        record = json.loads(path.read_text()) if path.exists() else {}
        if (record and all(record.get(k) == v for k, v in expected.items())) or time.monotonic() > deadline:
            return record
        time.sleep(0.05)


def generated_text(page) -> str:
    """The generated text above the tabs, as shown (prompt and the tokens chosen up to the viewed step)."""
    shown = page.locator('[data-testid="stMain"] [data-testid="stMarkdownContainer"]').filter(has_text="Once upon")
    shown = shown.filter(has_not_text="Restored run")  # the notice quotes the prompt too
    return shown.first.inner_text()


def slider_value(page) -> int:
    """The step slider's value as the browser holds it (its range input's value)."""
    return int(page.get_by_role("slider").first.evaluate("el => el.value"))


def metric_value(page, label: str) -> str:
    metric = page.locator('[data-testid="stMetric"]').filter(has_text=label)
    return metric.locator('[data-testid="stMetricValue"]').inner_text().strip()


def alive(page) -> None:
    """The page is connected, shows no exception and no connection error, and its script is not running."""
    assert page.locator('[data-testid="stException"]').count() == 0, page_state(page)
    assert page.get_by_text("Connection error").count() == 0, page_state(page)
    assert page.get_by_text("Is Streamlit still running?").count() == 0, page_state(page)


def screenshot(page, name: str, width: int, height: int, shown: str) -> None:
    """The sidebar at ``width`` × ``height``, scrolled to the text ``shown``, as docs/images/<name>-<width>.png."""
    if "runs" not in os.environ.get("SAVE_SCREENSHOTS", "").split(","):
        return
    page.set_viewport_size({"width": width, "height": height})
    wait_idle(page, settle_ms=300)
    with contextlib.suppress(Exception):  # a screenshot for the docs: never the test's failure
        page.locator('[data-testid="stSidebar"]').get_by_text(shown).first.scroll_into_view_if_needed(timeout=5000)
    page.wait_for_timeout(300)
    IMAGES.mkdir(exist_ok=True)
    page.locator('[data-testid="stSidebar"]').screenshot(path=str(IMAGES / f"{name}-{width}.png"))


def test_a_reload_and_a_restarted_server_give_the_run_back(page, tmp_path):
    runs = tmp_path / "runs"
    with streamlit_server(env=server_env(runs)) as url:
        open_app(page, url)
        for _ in range(4):
            click(page, "Step")
        assert steps_shown(page) == 4
        run_id = address_run(page)
        slider = page.get_by_role("slider").first
        slider.focus()
        before = runs_finished(page)
        slider.press("ArrowLeft")
        slider.press("ArrowLeft")
        wait_settled(page)
        assert slider_value(page) == 1 and runs_finished(page) > before
        text = generated_text(page)
        assert saved(runs, run_id, step=1)["step"] == 1

        page.reload(wait_until="domcontentloaded")  # a new session: before this issue, an empty page
        wait_settled(page)
        alive(page)
        assert address_run(page) == run_id and steps_shown(page) == 4
        assert slider_value(page) == 1 and generated_text(page) == text
        assert page.get_by_text("Restored run").count() == 1
        address = page.url
    with streamlit_server(env=server_env(runs)) as url:  # the server restarted (another port, the same folder)
        page.goto(url + "/?" + address.split("?", 1)[1], wait_until="domcontentloaded")
        wait_settled(page)
        alive(page)
        assert address_run(page) == run_id and steps_shown(page) == 4 and slider_value(page) == 1
        assert generated_text(page) == text
        click(page, "Step")  # it goes on from where it was
        assert steps_shown(page) == 5 and saved(runs, run_id, n_steps=5)["n_steps"] == 5
        screenshot(page, "recent-runs", 1600, 1000, "(this page)")
        screenshot(page, "recent-runs", 1280, 800, "(this page)")


def recent_titles(page) -> list[str]:
    """The labels of the sidebar's Recent runs buttons (each begins with its run's prompt)."""
    sidebar = page.locator('[data-testid="stSidebar"]')
    return [t for t in sidebar.get_by_role("button").all_inner_texts() if " step" in t and " · " in t]


def test_two_browsers_on_one_server_each_list_only_their_own_runs(browser, page, tmp_path):
    """A shared server: each browser's Recent runs lists the runs it made and never the other's prompt; a reload
    keeps the list (the owner token is in the address); the other's run still opens by its id alone."""
    runs = tmp_path / "runs"
    other_context = app_context(browser, 1600, 1000)
    try:
        other = other_context.new_page()
        with streamlit_server(env=server_env(runs)) as url:
            open_app(page, url)
            open_app(other, url)
            set_prompt(page, "Alice kept a secret diary.")
            set_prompt(other, "Bob grew tall sunflowers.")
            click(page, "Step")
            click(other, "Step")
            hers, his = address_run(page), address_run(other)
            assert hers != his
            for shown in (page, other):
                shown.reload(wait_until="domcontentloaded")  # a new session: the list comes from the address
                wait_settled(shown)
                alive(shown)
            assert [t.split(" · ")[0] for t in recent_titles(page)] == ["Alice kept a secret diary."]
            assert [t.split(" · ")[0] for t in recent_titles(other)] == ["Bob grew tall sunflowers."]
            assert page.get_by_text("Bob grew", exact=False).count() == 0
            assert other.get_by_text("Alice kept", exact=False).count() == 0
            page.goto(f"{url}/?run={his}", wait_until="domcontentloaded")  # his link, without his owner token
            wait_settled(page)
            alive(page)
            assert address_run(page) == his and steps_shown(page) == 1
            assert [t.split(" · ")[0] for t in recent_titles(page)] == []  # a new address: a new, empty list
        with streamlit_server(env={**server_env(runs), "GPT_SHAPE_TRACER_LIST_ALL_RUNS": "1"}) as url:
            open_app(other, url)  # a server for one person lists every run
            assert sorted(t.split(" · ")[0] for t in recent_titles(other)) == ["Alice kept a secret diary.",
                                                                              "Bob grew tall sunflowers."]
    finally:
        other_context.close()


def expected_after(start: int, last: int, keys: list[str]) -> int:
    """The step the slider lands on after ``keys``: each arrow moves one step, never past either end."""
    step = start
    for key in keys:
        step = max(0, step - 1) if key == "ArrowLeft" else min(last, step + 1)
    return step


def ran_n(page, n: int) -> None:
    """Run N with ``n`` typed into its box; returns once the page shows the ``n`` steps."""
    box = page.get_by_label(f"N for Run N (1…{MAX_RUN_STEPS})", exact=True)
    box.fill(str(n))
    box.press("Enter")
    wait_idle(page)
    click(page, "Run N")
    wait_settled(page)
    assert steps_shown(page) == n


def test_200_fast_arrow_keys_on_the_step_slider_leave_the_page_alive_on_the_right_step(page, url, server_runs):
    open_app(page, url)
    ran_n(page, 24)
    run_id = address_run(page)
    t_last = int(metric_value(page, "key positions t"))  # t at step 23; the cache is on: t grows by 1 a step
    keys = (["ArrowLeft"] * 15 + ["ArrowRight"] * 10) * 8  # 200 keys, net 40 steps back, past the start
    target = expected_after(23, 23, keys)
    slider = page.get_by_role("slider").first
    slider.focus()
    for key in keys:
        page.keyboard.press(key)  # no wait between keys: as fast as the browser takes them
    wait_settled(page, quiet_s=3.0)
    alive(page)
    assert slider_value(page) == target
    assert int(metric_value(page, "key positions t")) == t_last - (23 - target)  # the page shows that step
    assert saved(server_runs, run_id, step=target)["step"] == target  # the server drew (and wrote) the step shown
    click(page, "Step")  # and it still answers
    alive(page)
    assert steps_shown(page) == 25


def test_arrow_keys_paced_across_several_reruns_land_on_the_right_step(page, url):
    """Keys pressed in groups, paced so that reruns for older values finish and draw while keys still come: a rerun of
    the page's view is not stopped by a newer value (Streamlit lets a fragment's run finish), and one that set the
    slider's value would put the browser's slider back mid-burst, losing the keys pressed since."""
    open_app(page, url)
    ran_n(page, 16)
    t_last = int(metric_value(page, "key positions t"))
    keys = (["ArrowLeft"] * 2 + ["ArrowRight"]) * 10  # net 10 back, never at an end (where lost keys could hide)
    target = expected_after(15, 15, keys)
    assert target == 5
    slider = page.get_by_role("slider").first
    slider.focus()
    for i, key in enumerate(keys):
        page.keyboard.press(key)
        if i % 2:
            page.wait_for_timeout(250)  # about a settle's length: reruns start, wait, draw while keys still come
    wait_settled(page, quiet_s=3.0)
    alive(page)
    assert slider_value(page) == target
    assert int(metric_value(page, "key positions t")) == t_last - (15 - target)


def test_a_recent_run_clicked_opens_with_its_steps(page, url):
    """Recent runs are drawn by the page's view (a fragment, rerun alone by a Step): a click on one asks the page's
    full run, which opens the run the address then names — its steps, its text, its id in the address."""
    open_app(page, url)
    set_prompt(page, "Ada drew a red fox.")
    click(page, "Step")
    click(page, "Step")
    first = address_run(page)
    click(page, "Reset")
    click(page, "Discard")
    set_prompt(page, "Sam baked a small cake.")
    click(page, "Step")
    assert address_run(page) != first and steps_shown(page) == 1
    sidebar = page.locator('[data-testid="stSidebar"]')
    entry = sidebar.get_by_role("button").filter(has_text="Ada drew a red fox. · 2 steps")
    before = runs_finished(page)
    entry.click()
    wait_settled(page)
    assert runs_finished(page) > before
    assert address_run(page) == first and steps_shown(page) == 2
    main = page.locator('[data-testid="stMain"] [data-testid="stMarkdownContainer"]')
    assert main.filter(has_text="Ada drew a red fox.").count() and not main.filter(has_text="Sam baked").count()


def test_reset_asks_before_it_discards_a_generation(page, url):
    open_app(page, url)
    click(page, "Step")
    click(page, "Step")
    click(page, "Reset")
    question = page.get_by_text("Reset discards this page's generation (2 steps)")
    assert question.count() == 1 and steps_shown(page) == 2  # asked; nothing discarded
    screenshot(page, "reset-question", 1600, 1000, "Discard")
    screenshot(page, "reset-question", 1280, 800, "Discard")
    click(page, "Cancel")
    assert steps_shown(page) == 2 and page.get_by_role("button", name="Discard").count() == 0
    click(page, "Reset")
    click(page, "Discard")
    assert steps_shown(page) == 0
    assert "run=" not in page.url
