"""Names that are true: every module and file the product code names in a docstring or comment exists.

The rule, for the docstrings (of modules, classes and functions) and the comments of what ships — model/,
tracer/, figures/, session/, gui/, app.py and gpt_shape_tracer's own modules — and the comments of
requirements*.txt and pyproject.toml:

* a dotted name that starts with a room (``model.``, ``tracer.``, ``figures.``, ``session.``, ``gui.``) or with
  ``gpt_shape_tracer.``, in backticks or not (``tracer.storage._log``, ``gpt_shape_tracer.session.runs``), names
  a module relative to the package, the prefix optional. It resolves when its longest leading part that is a
  module or package of the repository is followed by nothing, or by a name that module binds at its top level (a
  function, class or constant it defines, or a name a front door imports: ``tracer.head_scores``,
  ``model.gpt.GPT``); what follows that name is an attribute and is not checked;
* a path that starts with a top-level folder (``model/gpt/_gpt.py``, ``gpt_shape_tracer/cli.py``,
  ``assets/shapes/NAME/config.json``) names a file or folder of the repository; an all-capitals part is a
  placeholder for any name.

Not module names: ``model.<attribute>`` where ``model`` is a model object, not the package (MODEL_ATTRIBUTES),
and file names (``model.safetensors``, ``model.py``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

from tests.layout import PACKAGE, ROOMS, ROOT, sources

SHIPPED = sources("model", "tracer", "figures", "session", "gui", "app", PACKAGE)
CONFIGS = [ROOT / "requirements.txt", ROOT / "requirements-dev.txt", ROOT / "pyproject.toml"]

# a model object's attributes (our GPT's or a transformers model's) that comments write as ``model.<name>``
MODEL_ATTRIBUTES = {"blocks", "hf", "identity", "layers", "reference_note", "state_dict", "tensor_parallel", "tp_plan"}
FILE_SUFFIXES = {"py", "json", "safetensors"}  # ``model.safetensors``, ``model.py``: a file's name, not a module
# where the wheel puts assets/ (pyproject.toml's package data): no such folder in a checkout
INSTALLED_ONLY = {"model/bundled", "gpt_shape_tracer/model/bundled"}

DOTTED = re.compile(rf"(?<![\w.])(?:{PACKAGE}|model|tracer|figures|session|gui)(?:\.\w+)+")
PATH = re.compile(rf"(?<![\w./-])(?:{PACKAGE}|model|tracer|figures|session|gui|tests|docs|bench|assets)/[\w./-]*\w")


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file, or every comment of a config file."""
    source = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return [(n, line[line.index("#"):]) for n, line in enumerate(source.splitlines(), 1) if "#" in line]
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                out.append((first.lineno, first.value.value))
    return out


def _module_file(parts: list[str]) -> Path | None:
    """The file of the module ``gpt_shape_tracer.<parts>`` (a room's folder, the package's own modules, or the
    package itself when ``parts`` is empty)."""
    base = (ROOT if parts and parts[0] in ROOMS else ROOT / PACKAGE).joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def _top_level_names(path: Path) -> frozenset[str]:
    """The names a module binds at its top level (under ``if``/``try`` too): defs, classes, assignments, imports."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "finalbody", []) + \
                [s for handler in getattr(node, "handlers", []) for s in handler.body]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """Whether a dotted name (prefix ``gpt_shape_tracer.`` optional) is a module of ours or a name one binds."""
    parts = dotted.split(".")
    if parts[0] == "model" and parts[1] in MODEL_ATTRIBUTES:  # a model object's attribute
        return True
    if set(parts[1:]) & FILE_SUFFIXES:
        return True
    parts = parts[1:] if parts[0] == PACKAGE else parts
    for i in range(len(parts), -1, -1):
        if found := _module_file(parts[:i]):
            return i == len(parts) or parts[i] in _top_level_names(found)
    return False


def exists(path: str) -> bool:
    """Whether a repository path (an all-capitals part: any name) is a file or folder of the checkout."""
    if path.rstrip("/") in INSTALLED_ONLY:
        return True
    pattern = "/".join("*" if part.isupper() else part for part in path.rstrip("/").split("/"))
    return any(ROOT.glob(pattern))


def _named() -> list[tuple[str, str, str]]:
    """(where, "module"/"path", name) for every name the shipped code's docstrings and comments give."""
    out = []
    for path in [*SHIPPED, *CONFIGS]:
        for line, text in _texts(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            out += [(where, "module", m.group(0)) for m in DOTTED.finditer(text)]
            out += [(where, "path", m.group(0)) for m in PATH.finditer(text)]
    return out


def test_every_module_and_file_named_in_a_docstring_or_comment_exists():
    named = _named()
    assert len(named) > 100  # the scan reads what it should
    stale = [f"{where} {kind} {name}" for where, kind, name in named
             if not (resolves(name) if kind == "module" else exists(name))]
    assert not stale, stale


def test_the_rule_tells_true_names_from_stale_ones():
    for true in ("tracer.storage._log", "gpt_shape_tracer.tracer.capture", "tracer.head_scores",
                 "model.gpt.GPT.forward", "gpt_shape_tracer.cli", "session.runs", "model.identity",
                 "model.safetensors.index.json"):
        assert resolves(true), true
    for stale in ("tracer.hooks", "tracer.io", "tracer.storage._nothing", "gpt_shape_tracer.memory",
                  "model.resolve", "model.sources.no_such_name"):
        assert not resolves(stale), stale
    assert exists("model/gpt/_gpt.py") and exists("assets/shapes/NAME/config.json") and exists("model/bundled")
    assert not exists("model/hf_decoder.py") and not exists("gpt_shape_tracer/runs.py")
    assert "model/bundled" in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def test_comments_cite_public_sources_not_documents_outside_the_repository():
    """The math cites what a reader can open (a paper, a library), not the "seed" documents this project was
    planned from, which are not in the repository."""
    cited = [f"{path.relative_to(ROOT)}:{line}" for path in SHIPPED for line, text in _texts(path)
             if re.search(r"\bseed \(?0\d\d\b|\bseeds['’]|\bseed documents?\b|shared/seeds", text, flags=re.I)]
    assert not cited, cited
