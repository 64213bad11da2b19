"""Fixtures the browser tests share: one Chromium and one served app for every browser test (each test opens a new
session of it), the server's runs kept in a folder of the package's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app_in_browser import chromium, streamlit_server


@pytest.fixture(scope="package")
def server_runs(tmp_path_factory) -> Path:
    """The runs folder of the shared server (``GPT_SHAPE_TRACER_RUNS_DIR``): a test reads what it wrote there."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="package")
def url(server_runs):
    # one server for every browser test: each start costs about 6 s (the app's imports, its first page). Every
    # test opens a new session, and a closed one is counted until the server forgets it (30 s after it
    # disconnects, then up to 10 s): nine tests in a minute can reach the default cap of 8 sessions, whose
    # refusal page has no sidebar. The cap itself is tested in tests/app/test_server_limits.py.
    env = {"GPT_SHAPE_TRACER_MAX_SESSIONS": "64", "GPT_SHAPE_TRACER_RUNS_DIR": str(server_runs)}
    with streamlit_server(env=env) as address:
        yield address


@pytest.fixture(scope="package")
def browser():
    with chromium() as b:
        yield b
