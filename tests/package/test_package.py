"""The package installs and its commands work from anywhere: a clone built into a wheel whose one top-level name
is ``gpt_shape_tracer``, installed (and, once, installed editable) into fresh virtual environments that see this
environment's packages (its dependencies, the build backend) through a ``.pth`` file, used from another directory,
where nothing of the checkout is importable, and beside a user's own ``model.py``, ``model/`` and ``tracer.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpt_shape_tracer.tracer import load_trace
from tests.app_in_browser import free_port

ROOT = Path(__file__).resolve().parents[2]


def _venv(base: Path, name: str) -> tuple[Path, Path]:
    """A fresh venv seeing this environment's packages: (its python, its bin folder)."""
    venv = base / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}  # this environment, venv or not
    (Path(site) / "this_environment.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python, venv / "bin"


def _pip_install(python: Path, *args: str) -> None:
    """No network: the build backend and every dependency come from this environment (this pip installs into
    the venv; a venv's own pip would bring its own, older setuptools)."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                           "--no-build-isolation", "--no-index", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A clone holding the working tree as it is now (links included, as git keeps them)."""
    base = tmp_path_factory.mktemp("package")
    clone = base / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    # the working tree as it is now, so the test checks what would be committed, not the last commit
    for path in subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.splitlines():
        source = ROOT / path
        if source.is_file() and not source.is_symlink():
            (clone / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / path)
        elif source.is_symlink() and not (clone / path).is_symlink():
            (clone / path).symlink_to(os.readlink(source))
    return clone


@pytest.fixture(scope="module")
def wheel(clone) -> Path:
    out = clone.parent / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-index",
                           "--no-deps", "-w", str(out), str(clone)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_installs_one_name(wheel):
    """Its top-level names are gpt_shape_tracer and its metadata alone (no model, tracer, app … in
    site-packages); the rooms, the page and the bundled models are inside it, the checkout's links resolved."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"gpt_shape_tracer", wheel.name.split("-py3")[0] + ".dist-info"}
    for inside in ("model/gpt/_gpt.py", "tracer/__init__.py", "figures/attention.py", "session/__init__.py",
                   "gui/sidebar.py", "gui/panels.js", "gui/panels.css", "app.py",
                   "model/bundled/story-gpt/model.safetensors", "py.typed"):
        assert f"gpt_shape_tracer/{inside}" in names, inside
    # every module of the rooms (a package pyproject.toml forgot to list would be missing from the wheel alone)
    rooms = [p for room in ("model", "tracer", "figures", "gui", "session") for p in (ROOT / room).rglob("*.py")]
    missing = [str(p.relative_to(ROOT)) for p in rooms if f"gpt_shape_tracer/{p.relative_to(ROOT)}" not in names]
    assert len(rooms) > 100 and not missing, missing


@pytest.fixture(scope="module")
def installed(clone, wheel):
    """(venv python, its bin folder, a directory outside the checkout), the wheel installed."""
    python, bin_dir = _venv(clone.parent, "venv")
    _pip_install(python, str(wheel))
    elsewhere = clone.parent / "elsewhere"
    elsewhere.mkdir()
    return python, bin_dir, elsewhere


def clean_env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_import_tracer_from_another_directory_finds_the_installed_package(installed):
    python, bin_dir, elsewhere = installed
    code = ("import gpt_shape_tracer.tracer as tracer, gpt_shape_tracer.model.sources as m\n"
            "print(tracer.__file__); print(m.ASSETS)\n"
            "import importlib.util as u; print([n for n in ('model', 'tracer', 'figures', 'gui', 'session', 'app')"
            " if u.find_spec(n)])")
    out = subprocess.run([str(python), "-c", code],
                         cwd=elsewhere, env=clean_env(bin_dir), capture_output=True, text=True, check=True)
    tracer_file, assets, top_level = out.stdout.splitlines()
    assert top_level == "[]"  # none of the rooms is a name of its own
    assert "site-packages" in tracer_file and str(ROOT) not in tracer_file
    assert assets.endswith("model/bundled") and (Path(assets) / "story-gpt" / "model.safetensors").is_file()


def test_the_trace_command_traces_a_bundled_model_from_another_directory(installed):
    _, bin_dir, elsewhere = installed
    done = subprocess.run([str(bin_dir / "gpt-shape-tracer"), "trace", "--prompt", "Once upon a time", "--steps", "2",
                           "--out", "t.zip"], cwd=elsewhere, env=clean_env(bin_dir), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "hook_logits" in done.stdout
    trace = load_trace(elsewhere / "t.zip")
    assert trace.n_steps == 2 and trace.model.name == "story-gpt"


@contextmanager
def installed_app(bin_dir: Path, cwd: Path) -> Iterator[str]:
    """``gpt-shape-tracer app`` of the installed package, started in ``cwd`` on a free port; yields its URL once
    its health check answers "ok" (or fails with what the server printed); stops it."""
    port = free_port()
    server = subprocess.Popen([str(bin_dir / "gpt-shape-tracer"), "app", "--server.port", str(port)], cwd=cwd,
                              env=clean_env(bin_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, body = time.time() + 90, ""
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    body = r.read().decode()
                break
            except OSError:
                if server.poll() is not None:
                    break
                time.sleep(0.5)
        assert body == "ok", server.stdout.read() if server.poll() is not None else "no answer"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=20)


def test_the_app_command_serves_the_page(installed):
    _, bin_dir, elsewhere = installed
    with installed_app(bin_dir, elsewhere) as url, urllib.request.urlopen(url + "/", timeout=5) as r:
        assert "<title>Streamlit</title>" in r.read().decode() or r.status == 200


@pytest.fixture(scope="module")
def shadowing(installed):
    """A working directory holding a user's own model.py, model/, tracer.py, figures.py, session.py, gui.py and
    app.py, each of which fails loudly if it is ever imported in place of ours."""
    _, _, elsewhere = installed
    folder = elsewhere.parent / "users-own-files"
    (folder / "model").mkdir(parents=True, exist_ok=True)
    (folder / "model" / "__init__.py").write_text("raise ImportError('the user\\'s own model/ was imported')\n")
    for name in ("model", "tracer", "figures", "session", "gui", "app"):
        (folder / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    return folder


QUICK_START = ("import gpt_shape_tracer as gst\n"
               "model, tok = gst.load_bundled('story-gpt')\n"
               "gen = gst.TracedGeneration(model, tok, ['Once upon a time'])\n"
               "gen.run(2)\n"
               "print(gen.trace.n_steps, gst.figures.__file__, gst.Tracer.__module__)")


def test_import_gpt_shape_tracer_beside_a_users_own_model_py(installed, shadowing):
    python, bin_dir, _ = installed
    out = subprocess.run([str(python), "-c", QUICK_START], cwd=shadowing, env=clean_env(bin_dir), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    steps, figures_file, _ = out.stdout.split()
    assert steps == "2" and "site-packages" in figures_file


def test_the_commands_beside_a_users_own_model_py(installed, shadowing):
    python, bin_dir, _ = installed
    for command in ([str(bin_dir / "gpt-shape-tracer")], [str(python), "-m", "gpt_shape_tracer"]):
        done = subprocess.run([*command, "trace", "--prompt", "Once upon a time", "--steps", "2"], cwd=shadowing,
                              env=clean_env(bin_dir), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "hook_logits" in done.stdout, (command, done.stderr)


def test_the_app_beside_a_users_own_model_py_runs_its_page(installed, shadowing):
    """The page itself runs (a session executes app.py, which imports the rooms), not only the server."""
    from tests.app_in_browser import chromium_page, click, open_app, page_state

    _, bin_dir, _ = installed
    with installed_app(bin_dir, shadowing) as url, chromium_page() as page:
        open_app(page, url)
        click(page, "Step")
        state = page_state(page)
        assert "imported" not in state and page.get_by_text("Step 0, the prefill").count(), state


def test_the_installed_page_runs_under_apptest_beside_a_users_own_model_py(installed, shadowing):
    """AppTest from the installed files: the page the command serves, run from the user's folder, steps."""
    python, bin_dir, _ = installed
    code = ("import sys, gpt_shape_tracer, pathlib\n"
            "from streamlit.testing.v1 import AppTest\n"
            "page = pathlib.Path(gpt_shape_tracer.__file__).with_name('app.py')\n"
            "at = AppTest.from_file(str(page), default_timeout=120).run()\n"
            "at.sidebar.button(key='step_button').click().run()\n"
            "print(str(page)); print([e.value for e in at.exception])\n"
            "print(at.session_state['app'].live.generation.trace.n_steps)")
    out = subprocess.run([str(python), "-c", code], cwd=shadowing, env=clean_env(bin_dir), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    page, exceptions, stepped = out.stdout.splitlines()[-3:]
    assert "site-packages" in page and exceptions == "[]" and stepped == "1", out.stdout


def test_an_editable_install_runs_the_quick_start_beside_a_users_own_model_py(clone, shadowing):
    python, bin_dir = _venv(clone.parent, "editable")
    _pip_install(python, "-e", str(clone))
    out = subprocess.run([str(python), "-c", QUICK_START], cwd=shadowing, env=clean_env(bin_dir), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    steps, figures_file, _ = out.stdout.split()
    assert steps == "2" and figures_file.startswith(str(clone)), figures_file


def test_pip_show_names_the_authors_and_the_classifiers(installed):
    python, bin_dir, elsewhere = installed
    code = ("import importlib.metadata as m, json; d = m.metadata('gpt-shape-tracer'); "
            "print(json.dumps({'author': d['Author-email'], 'classifiers': d.get_all('Classifier'), "
            "'summary': d['Summary']}))")
    import json

    out = json.loads(subprocess.run([str(python), "-c", code], cwd=elsewhere, env=clean_env(bin_dir),
                                    capture_output=True, text=True, check=True).stdout)
    assert "maintainers" in out["author"] and "shape-tracing debugger" in out["summary"]
    assert any(c.startswith("Topic :: Scientific/Engineering") for c in out["classifiers"])
