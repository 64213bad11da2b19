"""The README's examples run, and print what the README says they print."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def block_after(heading: str, lang: str) -> str:
    section = README[README.index(heading):]
    return re.search(rf"```{lang}\n(.*?)```", section, flags=re.S).group(1)


def test_the_python_example_prints_what_its_comments_say(tmp_path, monkeypatch):
    code = block_after("### From Python", "python")
    expected = [line.split("  # ", 1)[1] for line in code.splitlines()
                if line.startswith("print(") and "  # " in line]
    assert len(expected) >= 8
    monkeypatch.chdir(tmp_path)  # it writes trace.zip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert out.getvalue().splitlines() == expected
    assert (tmp_path / "trace.zip").stat().st_size > 0


def test_the_command_line_example_prints_the_table_it_shows(tmp_path):
    section = README[README.index("### From the command line"):]
    command = re.search(r"`(gpt-shape-tracer trace [^`]+)`", section).group(1)
    shown = block_after("### From the command line", "text").splitlines()
    # the console command is `python -m gpt_shape_tracer` (a test of the installed command is in test_package.py)
    result = subprocess.run([sys.executable, "-m", "gpt_shape_tracer", *shlex.split(command)[1:]], cwd=tmp_path,
                            capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert printed[:len(shown)] == shown
    assert (tmp_path / "trace.zip").stat().st_size > 0
