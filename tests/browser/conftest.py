"""Fixtures the browser tests share: one Chromium and one served app per test module."""

from __future__ import annotations

import pytest

from tests.app_in_browser import chromium, streamlit_server


@pytest.fixture(scope="module")
def url():
    # every test opens a new session, and a closed one is counted until the server forgets it (30 s after it
    # disconnects, then up to 10 s): nine tests in a minute can reach the default cap of 8 sessions, whose
    # refusal page has no sidebar. The cap itself is tested in tests/app/test_server_limits.py.
    with streamlit_server(env={"GPT_SHAPE_TRACER_MAX_SESSIONS": "64"}) as address:
        yield address


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b
