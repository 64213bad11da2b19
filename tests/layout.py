"""Where the code lies and what it is imported as, for the tests that read the source (test_repo,
test_gui_structure, test_requirements): one installed name, ``gpt_shape_tracer``, whose rooms are the
repository's top-level folders (gpt_shape_tracer/model -> ../model, …)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gpt_shape_tracer"
ROOMS = ("model", "tracer", "figures", "session", "gui", "app")  # the subpackages (and the page) under PACKAGE


def room(module: str) -> str:
    """The room a dotted module name belongs to: ``gpt_shape_tracer.model.sources`` -> "model";
    ``gpt_shape_tracer`` and its own modules (the API, the CLI) -> "gpt_shape_tracer"; anything else (a third
    party's) its first part."""
    parts = module.split(".")
    if parts[0] == PACKAGE:
        return parts[1] if len(parts) > 1 and parts[1] in ROOMS else PACKAGE
    return parts[0]


def module_name(path: Path) -> str:
    """The name a source file of the repository is imported by: every file is under the one installed name."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    dotted = ".".join(parts).removesuffix(".__init__")
    return dotted if parts[0] == PACKAGE else f"{PACKAGE}.{dotted}"


def sources(*rooms: str) -> list[Path]:
    """The Python files of the given rooms ("app" is app.py, PACKAGE the package's own modules, not its links)."""
    out: list[Path] = []
    for name in rooms:
        if name == "app":
            out.append(ROOT / "app.py")
        elif name == PACKAGE:
            out += sorted(p for p in (ROOT / PACKAGE).glob("*.py") if not p.is_symlink())
        else:
            out += sorted((ROOT / name).rglob("*.py"))
    return out
