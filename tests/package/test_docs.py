"""The README and every docs/ page: each code block runs and prints what the page says it prints, each shell
line is run or named here with the reason it is not, and the pages link each other.

Python blocks run in an empty temporary working directory (each in a fresh namespace); a ``print(...)  # x``
line says the block prints ``x`` there, and the block's output must be exactly those lines. The examples write
into ``tempfile`` directories, never the working directory: a test checks that it stays empty.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order."""
    return FENCE.findall(text(page))


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


PYTHON = [(page, i, code) for page in PAGES for i, (lang, code) in enumerate(blocks(page)) if lang == "python"]


def expected_output(code: str) -> list[str]:
    return [line.split("  # ", 1)[1] for line in code.splitlines() if line.startswith("print(") and "  # " in line]


def trace_format_context(tmp_path: Path):
    """docs/trace-format.md's block reads one record's value from a saved trace's ``tensors`` and ``row``: both
    given from a real file, and its ``value`` checked against the trace's own."""
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load as load_safetensors

    import gpt_shape_tracer as gst

    model, tok = gst.load_bundled()
    gen = gst.TracedGeneration(model, tok, ["Tom had a big red kite.", "Lily ran"], temperature=0)
    gen.run(3)
    gst.save_trace(gen.trace, tmp_path / "t.zip")
    with zipfile.ZipFile(tmp_path / "t.zip") as archive:
        rows = pq.read_table(io.BytesIO(archive.read("records.parquet"))).to_pylist()
        tensors = load_safetensors(archive.read("values.safetensors"))
    (tmp_path / "t.zip").unlink()
    row = next(r for r in rows if r["name"] == "blocks.1.attn.hook_q" and r["step"] == 2)

    def check(namespace: dict) -> None:
        assert torch.equal(namespace["value"], gen.trace.get("blocks.1.attn.hook_q", 2))

    return {"tensors": tensors, "row": row, "torch": torch}, check


CONTEXTS = {"docs/trace-format.md": trace_format_context}  # blocks that are a fragment of a larger program


@pytest.mark.parametrize(("page", "index", "code"), PYTHON, ids=[f"{name(p)}#{i}" for p, i, _ in PYTHON])
def test_every_python_block_prints_what_its_comments_say(page, index, code, tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    namespace, check = {"__name__": "docs"}, None
    if name(page) in CONTEXTS:
        given, check = CONTEXTS[name(page)](tmp_path)
        namespace.update(given)
    monkeypatch.chdir(work)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{name(page)} block {index}", "exec"), namespace)
    expected = expected_output(code)
    assert expected or check, f"{name(page)} block {index} shows nothing a test can check"
    assert out.getvalue().splitlines() == expected
    if check:
        check(namespace)
    assert not list(work.iterdir()), "the example wrote into the working directory, not a temporary one"


# Shell lines the tests do not run, each with the reason. Every other line must be a command run below.
NOT_RUN = {
    "python3 -m venv .venv": "makes a virtual environment, installs every pinned package and serves the app until "
                             "stopped; tests/app/test_idle_server.py serves the app from a checkout holding a "
                             "virtual environment, tests/browser/test_browser.py drives it",
    "(test -x /usr/bin/chromium": "the test command is this whole suite: .ci/run runs it (tests/package/test_repo.py "
                                  "keeps the two lines identical)",
    "pip install": "installs packages (the network); tests/package/test_package.py installs the package into a fresh "
                   "virtual environment, tests/package/test_requirements.py checks what requirements.txt and "
                   "pyproject.toml declare",
    "python -m pip install mutmut": "installs a package (the network), for mutation testing by hand",
    "python -m mutmut": "mutation testing by hand: most of an hour on two cores, not in CI",
    "python bench/mutants.py": "mutation testing by hand without mutmut: a test run per mutant, not in CI",
    "ATEN_CPU_CAPABILITY=": "the whole suite again, under another instruction set (minutes; run by hand before a "
                            "change to a tolerance: docs/testing.md)",
    "gpt-shape-tracer app": "serves the app until stopped; tests/package/test_package.py starts the installed command, "
                            "tests/browser/test_browser.py and tests/app/test_server_limits.py drive the served app",
}
RUN = "gpt-shape-tracer trace "  # run as written (from a clone: python -m gpt_shape_tracer)


def shell_lines(page: Path) -> list[tuple[str, str | None]]:
    """(command, the text block that follows its block, if any) for each line of each bash/console block:
    comments dropped, continuation lines joined."""
    found = blocks(page)
    out = []
    for i, (lang, code) in enumerate(found):
        if lang not in ("bash", "console", "sh", "shell"):
            continue
        shown = found[i + 1][1] if i + 1 < len(found) and found[i + 1][0] == "text" else None
        lines = [re.sub(r"\s+#\s.*$", "", line).strip() for line in code.replace("\\\n", " ").splitlines()]
        commands = [re.sub(r"\s+", " ", line.removeprefix("$ ")) for line in lines if line and not
                    line.startswith("#")]
        out += [(c, shown if c == commands[-1] else None) for c in commands]
    return out


_shown: dict[str, str | None] = {}
for _page in PAGES:
    for _command, _text in shell_lines(_page):  # a command on two pages runs once, checked against a text shown
        _shown[_command] = _shown.get(_command) or _text
SHELL = sorted(_shown.items())


def test_every_shell_line_is_run_or_named_with_the_reason_it_is_not():
    assert SHELL
    unknown = [c for c, _ in SHELL if not c.startswith(RUN) and not any(c.startswith(p) for p in NOT_RUN)]
    assert not unknown, f"run these in a test, or name them in NOT_RUN with the reason: {unknown}"
    unused = [p for p in NOT_RUN if not any(c.startswith(p) for c, _ in SHELL)]
    assert not unused, f"NOT_RUN names lines no page has any more: {unused}"


TRACE_COMMANDS = [(c, shown) for c, shown in SHELL if c.startswith(RUN)]


@pytest.mark.parametrize(("command", "shown"), TRACE_COMMANDS, ids=[c for c, _ in TRACE_COMMANDS])
def test_every_trace_command_runs_and_prints_what_its_page_shows(command, shown, tmp_path):
    args = shlex.split(command)[1:]
    # the console command is `python -m gpt_shape_tracer` (a test of the installed command is in test_package.py)
    result = subprocess.run([sys.executable, "-m", "gpt_shape_tracer", *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    if shown is not None:  # the table the page shows is the start of what it prints
        printed = [line.rstrip() for line in result.stdout.splitlines()]
        assert printed[:len(shown.splitlines())] == [line.rstrip() for line in shown.splitlines()]
    if "--json" in args:
        json.loads(result.stdout)
    for flag in ("--out", "--html", "--html-run"):  # each file it was asked to write is there, and not empty
        if flag in args:
            assert (tmp_path / args[args.index(flag) + 1]).stat().st_size > 0, flag


def links(page: Path) -> set[Path]:
    """Every relative link of a page, resolved (anchors dropped)."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text(page))
    return {(page.parent / t).resolve() for t in targets if "://" not in t}


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    lines = text(README).splitlines()
    assert len(lines) <= 160, len(lines)
    assert not {p.resolve() for p in DOCS} - links(README), "the README must link every docs page"
    # a picture before the first scroll: within the first 20 lines, and a file that exists
    picture = next(i for i, line in enumerate(lines) if line.startswith("!["))
    assert picture < 20
    quick = next(code for lang, code in blocks(README) if lang == "python")
    assert "import gpt_shape_tracer as gst" in quick and len(quick.strip().splitlines()) <= 10


def test_the_table_of_contents_links_every_docs_page():
    contents = ROOT / "docs" / "README.md"
    pages = {p.resolve() for p in (ROOT / "docs").iterdir() if p.suffix in (".md", ".ipynb") and p != contents}
    assert not pages - links(contents), sorted(p.name for p in pages - links(contents))


def test_the_python_examples_use_the_one_import_name():
    """``import gpt_shape_tracer as gst`` in every example and the notebook; none imports a room by its bare name
    (installed, the rooms are ``gpt_shape_tracer.model`` …; a bare ``model`` would be a user's own model.py)."""
    notebook = json.loads(text(ROOT / "docs" / "notebook.ipynb"))
    cells = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    for page, index, code in [*PYTHON, (ROOT / "docs" / "notebook.ipynb", 0, cells)]:
        if name(page) in CONTEXTS:
            continue
        assert "import gpt_shape_tracer as gst" in code, (name(page), index)
        for line in code.splitlines():
            bare = re.match(r"\s*(from|import) (model|tracer|figures|session|gui)\b", line)
            assert not bare, (name(page), index, line)


def test_what_the_examples_write_in_a_clone_is_ignored_and_nothing_tracked_is():
    """The files the pages' commands write (``--out trace.zip``, ``--html report.html`` …) and the README's
    ``.venv`` are ignored by git; no tracked file is."""
    written = {".venv/bin/python"}
    for command, _ in TRACE_COMMANDS:
        args = shlex.split(command)
        written |= {args[args.index(flag) + 1] for flag in ("--out", "--html", "--html-run") if flag in args}
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *sorted(written)], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert sorted(ignored) == sorted(written)
    tracked = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert tracked == []
