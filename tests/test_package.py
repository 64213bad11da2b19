"""The package installs and its commands work from anywhere: a clone installed (not editable) into a fresh
virtual environment that sees this environment's packages (its dependencies, the build backend) through a
``.pth`` file, used from another directory, where nothing of the checkout is importable."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from tracer import load_trace

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, its bin folder, a directory outside the checkout)."""
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
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}  # this environment, venv or not
    (Path(site) / "this_environment.pth").write_text("\n".join(sorted(ours)) + "\n")
    # no network: the build backend and every dependency come from this environment (this pip installs into
    # the venv; a venv's own pip would bring its own, older setuptools)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                           "--no-build-isolation", "--no-index", str(clone)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return python, venv / "bin", elsewhere


def clean_env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_import_tracer_from_another_directory_finds_the_installed_package(installed):
    python, bin_dir, elsewhere = installed
    code = "import tracer, model.sources as m; print(tracer.__file__); print(m.ASSETS)"
    out = subprocess.run([str(python), "-c", code],
                         cwd=elsewhere, env=clean_env(bin_dir), capture_output=True, text=True, check=True)
    tracer_file, assets = out.stdout.splitlines()
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


def test_the_app_command_serves_the_page(installed):
    _, bin_dir, elsewhere = installed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(bin_dir / "gpt-shape-tracer"), "app", "--server.port", str(port)], cwd=elsewhere,
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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert "<title>Streamlit</title>" in r.read().decode() or r.status == 200
    finally:
        server.terminate()
        server.wait(timeout=20)
