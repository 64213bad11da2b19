"""An idle server is idle: served from a checkout that holds a virtual environment (as the README's first
command makes one), after one Step in an open tab, the server uses under 2 % of a core.

Streamlit's file watcher walks the script's folder recursively; with a ``.venv`` inside the clone that was
~7,500 directories, the kernel's inotify queue overflowed again and again, and an idle tab cost about half
a core. The committed server settings turn the watcher off (``gpt_shape_tracer/server.toml``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.app_in_browser import ROOT, chromium_page, click, open_app, server_pid, streamlit_server

# a real environment's packages are thousands of directories: torch alone has ~1,500, this one ~6,000
VENV_PACKAGE_DIRECTORIES = 6000


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def a_checkout_with_a_virtual_environment(where: Path) -> Path:
    checkout = where / "checkout"
    shutil.copytree(ROOT, checkout, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", "mutants",
        ".streamlit-test-*.log", "results"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(checkout / ".venv")], check=True)
    site = next((checkout / ".venv" / "lib").glob("python*")) / "site-packages"
    for i in range(VENV_PACKAGE_DIRECTORIES):
        (site / f"package{i // 100}" / f"module{i % 100}").mkdir(parents=True)
    return checkout


def test_an_idle_server_uses_under_two_percent_of_a_core(tmp_path):
    checkout = a_checkout_with_a_virtual_environment(tmp_path)
    with streamlit_server(checkout=checkout) as url, chromium_page() as page:
        open_app(page, url)
        click(page, "Step")
        pid = server_pid(url)
        page.wait_for_timeout(2000)  # the Step's own work (figures sent, memory given back) is over
        before, start = cpu_seconds(pid), time.monotonic()
        page.wait_for_timeout(10_000)
        share = (cpu_seconds(pid) - before) / (time.monotonic() - start)
    assert share < 0.02, f"the idle server used {share:.1%} of a core over 10 s"
