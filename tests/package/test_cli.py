"""``gpt-shape-tracer trace``: every argument is checked before the model runs, with a message, not a traceback."""

from __future__ import annotations

import json

import pytest

from gpt_shape_tracer.trace_command import main
from gpt_shape_tracer.tracer import load_trace


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


def test_a_bad_argument_is_refused_before_torch_is_imported():
    """The arguments are read and checked first: a mistyped option is answered without the seconds torch,
    transformers and pandas take to import (the check: none of them is imported when it is refused)."""
    import subprocess
    import sys

    from tests.app_in_browser import ROOT

    script = ("import sys\nfrom gpt_shape_tracer.trace_command import main\ncode = main(ARGS)\n"
              "print(code, sorted(m for m in ('torch', 'transformers', 'pandas', 'numpy') if m in sys.modules))")
    for args in (["--prompt", ""], ["--prompt", "Lily", "--steps", "0"], ["--prompt", "x", "--model", "gpt-5"],
                 ["--prompt", "x", "--top-p", "2"], ["--prompt", "x", "--budget-mb", "nan"]):
        out = subprocess.run([sys.executable, "-c", script.replace("ARGS", repr(args))], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.split() == ["2", "[]"], (args, out.stdout, out.stderr)
        assert out.stderr.startswith("error: "), out.stderr


def test_the_early_checks_use_the_librarys_own_limits():
    from gpt_shape_tracer import session, tracer
    from gpt_shape_tracer import trace_command as cli
    from gpt_shape_tracer.model import BUNDLED_MODELS, SamplingConfig

    assert cli.MAX_RUN_STEPS == tracer.MAX_RUN_STEPS and tuple(tracer.FORWARD_CAPTURES) == cli.FORWARD_CAPTURES
    assert cli.MAX_BATCH == session.MAX_BATCH and cli.DEFAULT_BUDGET_MB == tracer.DEFAULT_BUDGET_BYTES / 2**20
    assert (cli.MAX_BUDGET_MB, cli.MAX_SPILL_MB) == (session.MAX_BUDGET_MB, session.MAX_SPILL_MB)
    assert tuple(BUNDLED_MODELS) == cli.BUNDLED
    assert cli.parser().get_default("temperature") == SamplingConfig().temperature


def test_every_option_says_what_it_does_and_its_default_and_the_help_shows_examples():
    from gpt_shape_tracer.trace_command import parser

    ap = parser()
    options = [a for a in ap._actions if a.option_strings and a.dest != "help"]
    assert options and all(a.help and len(a.help) > 10 for a in options), [a.dest for a in options if not a.help]
    formatter = ap._get_formatter()
    for action in options:  # a flag is off by default; every other option names its default
        if not (action.required or action.nargs == 0):
            assert "(default:" in formatter._get_help_string(action), action.dest
    text = ap.format_help()
    assert "examples:" in text and "--prompt" in text.split("examples:")[1]


def test_json_without_out_prints_the_run_and_writes_nothing(capsys, tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run(capsys, "--prompt", "Lily had", "--steps", "2", "--json")
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["out"] is None and result["steps"] == 2 and list(tmp_path.iterdir()) == []


def test_the_shape_table_fits_120_columns_unless_wide(capsys):
    code, stdout, stderr = run(capsys, "--prompt", "Once upon a time", "--steps", "2", "--all-records",
                               "--model", "story-llama")
    assert code == 0, stderr
    table = [line for line in stdout.splitlines() if not line.startswith(("text[", "nothing written"))]
    assert max(map(len, table)) <= 120 and any("…" in line for line in table)
    code, wide, _ = run(capsys, "--prompt", "Once upon a time", "--steps", "2", "--all-records", "--model",
                        "story-llama", "--wide")
    assert code == 0 and max(map(len, wide.splitlines())) > 120 and "…" not in wide.split("text[")[0]


def test_a_report_over_the_trace_or_into_a_missing_folder_is_refused_first(capsys, tmp_path):
    out = tmp_path / "t.zip"
    code, _, stderr = run(capsys, "--prompt", "Lily", "--out", str(out), "--html", str(out))
    assert code == 2 and "would overwrite the trace" in stderr and not out.exists()
    code, _, stderr = run(capsys, "--prompt", "Lily", "--out", str(out), "--html-run", str(tmp_path / "no" / "r.html"))
    assert code == 2 and "does not exist" in stderr and not out.exists()
    code, _, stderr = run(capsys, "--prompt", "Lily", "--html", str(tmp_path))
    assert code == 2 and "is a directory" in stderr
    folder = tmp_path / "run"
    code, _, stderr = run(capsys, "--prompt", "Lily", "--out", str(folder), "--html", str(folder / "manifest.json"))
    assert code == 2 and "inside the trace directory" in stderr and not folder.exists()
    report = tmp_path / "r.html"
    code, _, stderr = run(capsys, "--prompt", "Lily", "--html", str(report), "--html-run", str(report))
    assert code == 2 and "name one file" in stderr and not report.exists()


def test_a_trace_too_large_to_load_back_is_refused_by_the_command_before_anything_is_written(capsys, tmp_path,
                                                                                            monkeypatch):
    import dataclasses

    import gpt_shape_tracer.tracer.files._save as io_module  # the writer checks against the reader's LIMITS

    monkeypatch.setattr(io_module, "LIMITS", dataclasses.replace(io_module.LIMITS, records=10))
    out = tmp_path / "t.zip"
    code, _, stderr = run(capsys, "--prompt", "Lily", "--out", str(out))
    assert code == 2 and "cannot be saved as one that loads back" in stderr and "limit of 10 " in stderr
    assert not out.exists()


def test_a_bundled_model_stops_at_the_end_of_its_story_unless_told_to_go_on(capsys):
    code, stdout, stderr = run(capsys, "--prompt", "Once upon a time, Tom had a red ball. He", "--steps", "250",
                               "--capture", "shapes", "--json", "--model", "story-llama")
    import json

    steps = json.loads(stdout)["steps"]
    assert code == 0 and steps < 250 and "end-of-sequence" in stderr
    code, stdout, _ = run(capsys, "--prompt", "Once upon a time, Tom had a red ball. He", "--steps",
                          str(steps + 2), "--capture", "shapes", "--json", "--model", "story-llama", "--no-stop-at-eos")
    assert code == 0 and json.loads(stdout)["steps"] == steps + 2


def test_the_device_is_checked_and_cpu_runs(capsys, tmp_path):
    """--device cpu traces as before; a device PyTorch cannot see is refused with a message, nothing written."""
    import torch

    code, stdout, stderr = run(capsys, "--prompt", "Lily had", "--steps", "2", "--device", "cpu", "--json")
    assert code == 0 and '"steps": 2' in stdout, stderr
    code, _, stderr = run(capsys, "--prompt", "Lily", "--device", "tpu")
    assert code == 2 and "give cpu, cuda or cuda:N" in stderr
    if not torch.cuda.is_available():  # CI's machines: the refusal names what is missing
        out = tmp_path / "t.zip"
        code, _, stderr = run(capsys, "--prompt", "Lily", "--device", "cuda", "--out", str(out))
        assert code == 2 and "sees no CUDA device" in stderr and not out.exists()
    else:  # a machine with a GPU: the same greedy tokens as on the CPU
        code, on_gpu, _ = run(capsys, "--prompt", "Lily had", "--steps", "3", "--device", "cuda", "--json")
        _, on_cpu, _ = run(capsys, "--prompt", "Lily had", "--steps", "3", "--json")
        import json
        assert code == 0 and json.loads(on_gpu)["texts"] == json.loads(on_cpu)["texts"]


def test_cli_dry_run_of_one_tensor_parallel_rank(capsys):
    assert main(["--prompt", "x", "--model-dir", "shapes:llama-3.1-8b", "--dry-run", "--tensor-parallel", "4",
                 "--dry-run-tokens", "8", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shapes = {r["name"]: r["shape"] for r in out["shown_step"]["records"]}
    assert shapes["blocks.0.attn.hook_q"] == [1, 32 // 4, 8, 128]
    assert shapes["blocks.0.attn.hook_k"] == [1, 8 // 4, 8, 128]
    parallel = out["tensor_parallel"]
    assert parallel["ranks"] == 4 and "LlamaForCausalLM" in parallel["plan"]
    reduces = [c for c in parallel["collectives"] if c["kind"] == "all-reduce"]
    assert len(reduces) == 2 * 32 + 1 and all(c["bytes"] == 8 * 4096 * 2 for c in reduces)
    assert main(["--prompt", "x", "--model-dir", "shapes:llama-3.1-8b", "--tensor-parallel", "4"]) == 2
    assert "--tensor-parallel goes with --dry-run" in capsys.readouterr().err


def test_a_config_nested_too_deeply_is_a_clear_error_not_a_traceback(capsys, tmp_path):
    """200,000 arrays inside each other: Python's JSON reader stops at its recursion limit (a RecursionError
    traceback, before); both the dry run and a load say what is wrong with the file."""
    directory = tmp_path / "deep"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    for dry in ([], ["--dry-run"]):
        code, stdout, stderr = run(capsys, "--prompt", "Lily", "--model-dir", str(directory), *dry)
        assert code == 2 and "Traceback" not in stderr, stderr[-500:]
        assert f"{directory / 'config.json'}: its JSON is nested too deeply to be a config" in stderr
    # a safetensors header nested as deep, beside a good config
    import struct

    from transformers import Qwen3Config

    from tests.hf_architectures import ARCHITECTURES

    (directory / "config.json").write_text(json.dumps(Qwen3Config(**ARCHITECTURES["qwen3"][1]).to_dict()))
    header = b"[" * 200_000 + b"]" * 200_000
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    code, _, stderr = run(capsys, "--prompt", "Lily", "--model-dir", str(directory), "--dry-run")
    assert code == 2 and "Traceback" not in stderr and "nested too deeply" in stderr, stderr[-500:]


@pytest.mark.parametrize("argv", [["--max-sessions"], ["--max-sessions", "--server.port", "8600"],
                                  ["--max-sessions="], ["--server-budget-mb"], ["--runs-dir="]])
def test_a_server_flag_without_its_value_is_refused(monkeypatch, argv):
    """``app --max-sessions`` with nothing after it was taken as "the default" (and ``--max-sessions=`` took the
    next argument as its value)."""
    import os

    from gpt_shape_tracer.cli import server_limit_flags
    from gpt_shape_tracer.session.server_limits import SESSIONS_ENV

    monkeypatch.setenv(SESSIONS_ENV, "3")
    with pytest.raises(ValueError, match=f"{argv[0].rstrip('=')} needs a value"):
        server_limit_flags(argv)
    assert os.environ[SESSIONS_ENV] == "3"  # nothing set
