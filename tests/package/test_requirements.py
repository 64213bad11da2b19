"""The first command installs what the code imports: every third-party module the runtime code imports
(not the tests, bench or docs) is pinned in requirements.txt and declared in pyproject.toml, as a
dependency or in a named extra; an optional one missing at run time is named with its install command."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib

from tests.layout import PACKAGE, ROOT, sources

RUNTIME = sources("model", "tracer", "figures", "gui", "session", "app", PACKAGE)


def runtime_imports() -> set[str]:
    """The top-level names of every module the runtime code imports, anywhere in a file (a function's import
    of an optional package included)."""
    names: set[str] = set()
    for file in RUNTIME:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {PACKAGE, "__future__"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(lines: list[str]) -> set[str]:
    return {canonical(re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0])
            for line in lines if line.strip() and not line.strip().startswith(("#", "-"))}


def test_every_third_party_import_of_the_runtime_is_a_requirement():
    distributions = importlib.metadata.packages_distributions()
    imported = runtime_imports()
    assert {"torch", "transformers", "streamlit", "accelerate"} <= imported  # the walk sees them
    needed = {module: {canonical(d) for d in distributions.get(module, [module])} for module in imported}
    pinned = requirement_names((ROOT / "requirements.txt").read_text().splitlines())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = requirement_names(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        declared |= requirement_names(extra)
    missing_pin = {module for module, dists in needed.items() if not dists & pinned}
    missing_declared = {module for module, dists in needed.items() if not dists & declared}
    assert not missing_pin, f"imported by the runtime code but not in requirements.txt: {sorted(missing_pin)}"
    assert not missing_declared, f"imported but not in pyproject's dependencies or extras: {sorted(missing_declared)}"


def test_requirements_txt_pins_every_runtime_requirement_exactly():
    lines = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+]*", line) for line in lines), lines


def test_a_missing_optional_package_is_named_with_its_install_command(tmp_path):
    """accelerate hidden from the interpreter: offloading says what to install instead of a bare ImportError."""
    script = (
        "import sys; sys.modules['accelerate'] = None; sys.modules['accelerate.utils'] = None\n"
        "from gpt_shape_tracer.model.sources._hf_loading import HFDecoderError, _max_memory\n"
        "try:\n    _max_memory('2GiB')\nexcept HFDecoderError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "accelerate" in out.stdout and "pip install" in out.stdout, out.stdout + out.stderr
