"""``gpt-shape-tracer trace``: every argument is checked before the model runs, with a message, not a traceback."""

from __future__ import annotations

import pytest

from gpt_shape_tracer.trace_command import main
from tracer import load_trace


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv, message", [
    (["--budget-mb", "inf"], "the value budget must be between 1 and 8192 MB"),
    (["--budget-mb", "nan"], "the value budget must be between 1 and 8192 MB"),
    (["--budget-mb", "0"], "the value budget must be between 1 and 8192 MB"),
    (["--show-step", "99", "--steps", "3"], "--show-step must name one of the steps 0 … 2, got 99"),
    (["--show-step", "-1", "--steps", "3"], "--show-step must name one of the steps 0 … 2, got -1"),
    (["--steps", "0"], "--steps takes 1 …"),
    (["--model", "gpt-5"], "--model 'gpt-5': bundled models are story-gpt"),
    (["--top-p", "1.5"], "top_p"),
])
def test_bad_arguments_are_refused_before_anything_is_written(capsys, tmp_path, argv, message):
    out = tmp_path / "t.zip"
    code, stdout, stderr = run(capsys, "--prompt", "Lily", "--out", str(out), *argv)
    assert code == 2 and message in stderr and "Traceback" not in stderr
    assert not out.exists() and stdout == ""


def test_an_empty_out_is_refused_instead_of_writing_into_the_working_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run(capsys, "--prompt", "Lily", "--out", "")
    assert code == 2 and "--out is empty" in stderr and list(tmp_path.iterdir()) == []


def test_an_out_below_a_file_is_refused_before_the_run(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, _, stderr = run(capsys, "--prompt", "Lily", "--out", str(blocker / "sub" / "t.zip"))
    assert code == 2 and "is a file, so nothing can be written below it" in stderr


def test_show_step_prints_the_step_asked_for(capsys, tmp_path):
    out = tmp_path / "t.zip"
    code, stdout, stderr = run(capsys, "--prompt", "Lily had", "--steps", "3", "--show-step", "0",
                               "--out", str(out))
    assert code == 0, stderr
    assert "step 0: n = 2, t = 2" in stdout and "[1, 4, 2, 2]" in stdout
    assert load_trace(out).n_steps == 3


def test_json_prints_one_object_of_the_run_that_was_saved(capsys, tmp_path):
    import json

    out = tmp_path / "t.zip"
    code, stdout, stderr = run(capsys, "--prompt", "Lily had", "--prompt", "Tom", "--steps", "3", "--json",
                               "--out", str(out))
    assert code == 0, stderr
    summary = json.loads(stdout)  # the whole of stdout is one object
    trace = load_trace(out)
    assert summary["steps"] == trace.n_steps == 3 and summary["records"] == len(trace.records)
    assert summary["texts"][0].startswith("Lily had") and summary["texts"][1].startswith("Tom")
    shown = summary["shown_step"]
    assert (shown["step"], shown["n"], shown["t"]) == (2, 1, 4)
    pattern = next(r for r in shown["records"] if r["name"] == "blocks.0.attn.hook_pattern")
    assert pattern["shape"] == list(trace.record("blocks.0.attn.hook_pattern", 2).shape) == [2, 4, 1, 4]
    assert pattern["axes"] == ["B", "H", "n", "t"]


def test_progress_shows_on_a_terminal_only(tmp_path):
    """Under a pseudo-terminal, stderr shows "step k of N" rewritten in place; piped, or with --quiet, nothing."""
    import os
    import pty
    import subprocess
    import sys

    def stderr_of(*extra: str, terminal: bool) -> str:
        argv = [sys.executable, "-m", "gpt_shape_tracer", "trace", "--prompt", "Lily had", "--steps", "4",
                "--out", str(tmp_path / "t.zip"), *extra]
        if not terminal:
            return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stderr
        main_fd, other_fd = pty.openpty()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=other_fd)
        os.close(other_fd)
        seen = b""
        while True:
            try:
                chunk = os.read(main_fd, 4096)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=120) == 0
        os.close(main_fd)
        return seen.decode()

    shown = stderr_of(terminal=True)
    assert "\rstep 1 of 4" in shown and "\rstep 4 of 4" in shown
    assert "step 1 of 4" not in stderr_of(terminal=False)
    assert "step 1 of 4" not in stderr_of("--quiet", terminal=True)
