"""The server's limits: one memory budget for every session's traces, a cap on sessions served at once
(gpt_shape_tracer/server_limits.py), in the ledger itself, in the app (AppTest) and on a real server with two
browser pages."""

from __future__ import annotations

import time

import pytest
from streamlit.testing.v1 import AppTest

from gpt_shape_tracer.cli import server_limit_flags
from gpt_shape_tracer.session.runs import LIST_ALL_RUNS_ENV, RUNS_DIR_ENV, RunsSettings
from gpt_shape_tracer.session.server_limits import (
    BUDGET_ENV,
    DEFAULT_MAX_SESSIONS,
    SESSIONS_ENV,
    MiB,
    ServerLimits,
    SessionLedger,
    machine_memory_bytes,
)
from tests.app.test_app import APP, press, press_reset, run


def ledger(budget_mb: int = 1000, sessions: int = 3) -> SessionLedger:
    return SessionLedger(lambda: ServerLimits(budget_mb * MiB, sessions))


def test_sessions_past_the_cap_are_refused_until_one_ends():
    book = ledger(sessions=2)
    assert book.admit("a") == "" and book.admit("b") == "" and book.admit("a") == ""  # a again: already served
    refusal = book.admit("c")
    assert "already serves 2 session(s)" in refusal and f"{SESSIONS_ENV}=2" in refusal
    assert book.forget_all_but({"b", "c"}) == ["a"]  # the server no longer holds a
    assert book.admit("c") == "" and sorted(book.sessions()) == ["b", "c"]


def test_a_reservation_past_the_servers_total_is_refused_with_the_numbers_and_keeps_what_was_held():
    book = ledger(budget_mb=1000)
    for s in "abc":
        book.admit(s)
    assert book.reserve("a", 600 * MiB) == "" and book.reserve("b", 300 * MiB) == ""
    refusal = book.reserve("c", 512 * MiB)
    assert "at most 1,000 MiB" in refusal and "2 other session(s) hold 900 MiB" in refusal
    assert "can have 100 MiB, not 512" in refusal and "at most 100" in refusal
    assert book.held() == 900 * MiB
    assert book.reserve("c", 100 * MiB) == "" and book.held() == 1000 * MiB
    assert book.reserve("a", 0) == "" and book.reserve("c", 700 * MiB) == ""  # a's reset made room
    book.forget_all_but({"b"})
    assert book.held() == 300 * MiB  # an ended session's reservation goes with it


def test_the_budget_advised_fits_beside_what_does_not_follow_it():
    """A refusal advises the largest Budget (MB) that fits: counted as often as the request holds it, beside the
    bytes that do not follow it (an opened file's values); nothing to advise when those alone do not fit."""
    book = ledger(budget_mb=1000)
    book.admit("a")
    book.admit("b")
    assert book.reserve("a", 600 * MiB) == ""
    refusal = book.reserve("b", 2 * 300 * MiB + 100 * MiB, budget_times=2, fixed=100 * MiB)
    assert "can have 400 MiB, not 700" in refusal and "at most 150 (it is counted 2 times here" in refusal
    assert book.reserve("b", 2 * 150 * MiB + 100 * MiB) == ""  # what it advised fits
    book.reserve("b", 0)
    refusal = book.reserve("b", 500 * MiB, fixed=450 * MiB)
    assert "can have 400 MiB, not 500. Wait for another session" in refusal and "Budget" not in refusal.split(".")[-2]


def test_the_limits_come_from_the_environment_with_defaults_from_the_machine():
    memory = machine_memory_bytes()
    assert memory and memory > 0
    default = ServerLimits.from_environment({})
    assert default.budget_bytes == memory // 2 // MiB * MiB and default.max_sessions == DEFAULT_MAX_SESSIONS
    set_ = ServerLimits.from_environment({BUDGET_ENV: "2048", SESSIONS_ENV: "3"})
    assert (set_.budget_bytes, set_.max_sessions) == (2048 * MiB, 3)
    for bad in ("0", "-5", "lots", "1.5"):
        with pytest.raises(ValueError, match=BUDGET_ENV):
            ServerLimits.from_environment({BUDGET_ENV: bad})


def test_the_command_line_sets_the_limits_and_refuses_bad_ones(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "")  # restored after the test, whatever the command line sets
    monkeypatch.setenv(SESSIONS_ENV, "")
    rest = server_limit_flags(["--server.port", "8600", "--server-budget-mb", "4096", "--max-sessions=2"])
    assert rest == ["--server.port", "8600"]
    import os

    assert os.environ[BUDGET_ENV] == "4096" and os.environ[SESSIONS_ENV] == "2"
    with pytest.raises(ValueError, match=SESSIONS_ENV):
        server_limit_flags(["--max-sessions", "none"])
    assert os.environ[SESSIONS_ENV] == "2"  # a refused value is not set


def test_the_command_line_switches_the_list_of_every_run_on(monkeypatch, tmp_path):
    import os

    monkeypatch.setenv(LIST_ALL_RUNS_ENV, "")
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path))
    assert server_limit_flags(["--server.port", "8600"]) == ["--server.port", "8600"]
    assert not RunsSettings.from_environment().list_all
    assert server_limit_flags(["--list-all-runs", "--server.port", "8600"]) == ["--server.port", "8600"]
    assert os.environ[LIST_ALL_RUNS_ENV] == "1" and RunsSettings.from_environment().list_all


def test_the_app_refuses_a_generation_past_the_servers_budget_and_keeps_the_settings(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "300")
    at = AppTest.from_file(APP, default_timeout=240)
    run(at)
    press(at, "step_button")  # the default budget, 512 MB, is more than this server keeps in all
    errors = " ".join(e.value for e in at.error)
    assert "Not started: This server keeps at most 300 MiB of traces" in errors and "not 512" in errors
    assert at.session_state["app"].live.generation is None
    at.sidebar.number_input(key="budget_mb").set_value(200)
    press(at, "step_button")
    assert at.session_state["app"].live.generation is not None and not at.error
    from gpt_shape_tracer.gui.server import session_ledger

    assert session_ledger().held() >= 200 * MiB
    press_reset(at)
    assert session_ledger().held() == 0  # Reset gives the generation's share back


def test_the_app_refuses_recording_gradients_past_the_servers_budget(monkeypatch):
    """"Record ∂L/∂x at every hook point" keeps up to the generation's budget again: on a 300 MiB server, a
    200 MiB generation and 200 MiB of gradients are refused, with the numbers and a budget that would fit, and
    the session holds what it held before."""
    from gpt_shape_tracer.gui.server import session_ledger
    from tests.app.test_app import show_tab

    monkeypatch.setenv(BUDGET_ENV, "300")
    at = AppTest.from_file(APP, default_timeout=240)
    run(at)
    at.sidebar.number_input(key="budget_mb").set_value(200)
    press(at, "step_button")
    held = session_ledger().held()
    assert at.session_state["app"].live.generation is not None and held >= 200 * MiB
    show_tab(at, "Attention", ("attn_view", "Gradients"))
    at.button(key="grad_capture").click()
    run(at)
    errors = " ".join(e.value for e in at.error)
    assert "Not recorded: This server keeps at most 300 MiB of traces" in errors
    assert "can have 300 MiB, not 400" in errors
    # 2 × the advised budget fits beside what does not follow the budget: the attention stages the views recomputed
    recomputed = at.session_state["app"].held_bytes()["recomputed"]
    largest = (300 * MiB - recomputed) // 2 // MiB
    assert largest <= 150
    assert f"Reset with Budget (MB) in the sidebar at most {largest:,} (it is counted 2 times" in errors
    assert at.session_state["app"].live.gradient_trace is None and session_ledger().held() == held
    press(at, "reset_button")


def test_a_real_server_serves_up_to_its_cap_and_admits_again_once_a_tab_closes():
    """Two pages on a server capped at one session: the second is told why; after the first tab closes, the
    server forgets that session (its disconnect TTL set to 2 s here) and the second page is served."""
    from tests.app_in_browser import (
        app_context,
        chromium,
        click,
        open_app,
        server_pid,
        set_prompt,
        status_kib,
        streamlit_server,
        wait_idle,
    )

    def resident_mib(pid: int) -> float:
        return status_kib(pid, "VmRSS") / 1024

    env = {SESSIONS_ENV: "1", "STREAMLIT_SERVER_DISCONNECTED_SESSION_TTL": "2"}
    with streamlit_server(env=env) as url, chromium() as browser:
        server = server_pid(url)
        first_context = app_context(browser)
        first = first_context.new_page()
        open_app(first, url)
        assert first.get_by_role("button", name="Step", exact=True).count() == 1
        # the first tab fills a 200 MB trace: the KV cache off, a long prompt, Run N = 12
        set_prompt(first, " ".join(["Tom had a big red kite and he went to the park with his friend Lily."] * 14))
        first.locator("[data-testid=stSidebar]").get_by_text("KV cache", exact=True).click()
        wait_idle(first)
        for label, value in (("Budget (MB)", "200"), ("N for Run N (1…256)", "12")):
            box = first.get_by_label(label, exact=True)
            box.fill(value)
            box.press("Enter")
            wait_idle(first)
        before = resident_mib(server)
        click(first, "Run N")
        first.get_by_text("Step (time travel: every view shows this step)").wait_for(timeout=120_000)
        wait_idle(first)
        filled = resident_mib(server)
        assert filled > before + 150, (before, filled)  # the trace is there to be let go
        second_context = app_context(browser)
        try:
            second = second_context.new_page()
            second.goto(url)
            second.get_by_text("already serves 1 session(s)").wait_for(timeout=60_000)
            assert second.get_by_role("button", name="Step", exact=True).count() == 0
            first_context.close()  # the first tab closes
            deadline = time.time() + 60
            while True:  # the server forgets ended sessions every 10 s: reload until served (bounded)
                second.reload()
                try:
                    second.get_by_role("button", name="Step", exact=True).wait_for(timeout=5_000)
                    break
                except Exception:  # noqa: BLE001 - playwright's timeout: not forgotten yet
                    assert time.time() < deadline, "the closed tab's session was never forgotten"
            # and the memory its trace held went back to the system (once it never did: a tab's fragment kept
            # the trace it was drawn with for as long as Streamlit kept the ended session)
            released = time.time() + 30  # the release follows the forgetting in the same pass of the server
            while resident_mib(server) >= filled - 100 and time.time() < released:
                time.sleep(1)
            assert resident_mib(server) < filled - 100, (filled, resident_mib(server))
        finally:
            second_context.close()

