"""Repository hygiene that CI depends on."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.layout import PACKAGE, ROOT, module_name, sources
from tests.layout import room as _room


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1].strip()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    commands = [line.strip() for block in blocks for line in block.splitlines() if line.strip() and not
                line.strip().startswith("#")]
    assert ci in commands, "the README's test command and .ci/run must be the same line"
    assert any(c.endswith("streamlit run app.py") for c in commands)


# model ← tracer ← figures/session ← app.py, gui/ and the installed commands (gpt_shape_tracer's own modules)
LAYERS = {"model": 0, "tracer": 1, "figures": 2, "session": 2, "app": 3, "gui": 3, "gpt_shape_tracer": 3}
FRONT_ENDS = ("app", "gui", "gpt_shape_tracer")  # the only ones that may import streamlit
SOURCES = sources("model", "tracer", "figures", "gui", "session", "app", PACKAGE)


def _package(path: Path) -> str:
    """The room a source file belongs to."""
    return _room(module_name(path))


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module an import names, at any depth (function-level imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def test_every_import_of_ours_goes_through_the_one_installed_name():
    """No file imports ``model``, ``tracer``, … as a top-level name: installed, those names are not there (the
    wheel holds gpt_shape_tracer alone), and a user's own ``model.py`` would answer instead."""
    rooms = set(LAYERS) - {PACKAGE}
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in [*SOURCES, *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
           for line, module in _imports(path) if module.split(".")[0] in rooms]
    assert not bad, bad


def test_dependencies_point_one_way():
    """model ← tracer ← figures/session ← app.py: nothing imports a layer above it or a peer beside it, and
    only app.py imports streamlit."""
    bad = []
    for path in SOURCES:
        mine = _package(path)
        for line, module in _imports(path):
            top = _room(module)
            if top == "streamlit" and mine not in FRONT_ENDS:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports streamlit")
            if top in LAYERS and top != mine and LAYERS[top] >= LAYERS[mine] and not (
                    mine in FRONT_ENDS and top in FRONT_ENDS and top != "app"):  # front ends may share helpers
                bad.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {module}")
    assert not bad, bad



# model/ in rooms: model.gpt (our GPT), model.sources (where models come from), model.sampling, model.analysis,
# model.training; each a package whose __init__.py is its front door, and model/__init__.py the front door of all
MODEL_ROOMS = sorted(p.parent.name for p in (ROOT / "model").glob("*/__init__.py"))
MODEL_MODULES = {module_name(p): p for p in (ROOT / "model").rglob("*.py")}


def _imported_names(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) for every import at any depth: ``from m import a`` gives (…, "m", "a")."""
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, node.module, alias.name) for alias in node.names]
    return out


TEST_ROOMS = {"model", "tracer", "figures", "app", "browser", "package"}


def test_tests_live_in_the_room_they_test():
    """A test module sits in a room folder (tests/model/, tests/tracer/, ...); what several rooms share
    (fixtures, tiny models, the browser driver) sits at tests/ and is not itself a test module."""
    tests = ROOT / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, f"test modules outside a room: {loose}"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name not in {"data", "__pycache__"}}
    assert folders == TEST_ROOMS, f"unexpected test folders: {sorted(folders ^ TEST_ROOMS)}"
    for room in TEST_ROOMS:
        assert list((tests / room).glob("test_*.py")), f"tests/{room}/ holds no test module"
    stems = [p.stem for p in tests.rglob("test_*.py")]
    # pytest imports a test module without a package under its file name: two of one name would collide
    assert len(stems) == len(set(stems)), sorted({s for s in stems if stems.count(s) > 1})


def test_the_model_has_rooms():
    assert {"gpt", "sources", "sampling", "analysis", "training"} <= set(MODEL_ROOMS)
    assert not [p.name for p in (ROOT / "model").glob("*.py") if p.name != "__init__.py"], \
        "model/ holds rooms (packages) and its front door only"


def test_nothing_outside_a_room_of_model_imports_its_private_modules_or_names():
    """Outside a room of model/ — another room, tracer, figures, the GUI, session, app, the CLI, bench — only the
    room's public names are imported (``from gpt_shape_tracer.model.sources import load_hf``): no
    ``model.<room>._module`` and no
    ``_name``, so a room can rearrange its modules without breaking anyone. Tests may open a room to test its
    internals; nothing else may."""
    bad = _private_imports_across_rooms("model", MODEL_ROOMS, [*SOURCES, *(ROOT / "bench").rglob("*.py")])
    assert not bad, bad


def _room_of(module: str, floor: str, rooms: list[str]) -> str | None:
    """The room of ``floor`` (model, tracer, figures) a dotted module name lies in
    (``gpt_shape_tracer.tracer.storage._log`` -> "storage"), or None (another floor, or the floor's front door)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == [PACKAGE, floor] and len(parts) > 2 and parts[2] in rooms else None


def _is_private_import(floor: str, rooms: list[str], importer: str, module: str, name: str | None) -> bool:
    """Whether module ``importer`` importing ``module`` (``name`` from it) opens a room of ``floor`` it is not in:
    a private module (a ``_``-named part of the dotted name) or a private name (``from m import _name``)."""
    mine = _room_of(importer, floor, rooms)
    if _room(module) != floor or (mine is not None and _room_of(module, floor, rooms) == mine):
        return False
    private = any(part.startswith("_") and not part.startswith("__") for part in module.split("."))
    return private or (name or "").startswith("_")


def _private_imports_across_rooms(floor: str, rooms: list[str], paths: list[Path]) -> list[str]:
    """Every import in ``paths`` that opens a room of ``floor`` from outside it, as "file:line imports …"."""
    return [f"{path.relative_to(ROOT)}:{line} imports {module}{f' {name}' if name else ''}"
            for path in paths for line, module, name in _imported_names(path)
            if _is_private_import(floor, rooms, module_name(path), module, name)]


# tracer/ in rooms as model/ is (capture, storage, reading, generation, experiments, files, costs, engine: each a
# package whose __init__.py is its front door); figures/ is flat: each module is a room, its ``_``-named functions
# and constants (and any ``_``-named module) are its own
TRACER_ROOMS = sorted(p.parent.name for p in (ROOT / "tracer").glob("*/__init__.py"))
FIGURE_ROOMS = sorted(p.stem for p in (ROOT / "figures").glob("*.py") if p.name != "__init__.py")


def test_nothing_outside_a_room_of_tracer_or_figures_imports_its_private_modules_or_names():
    """As for model/: a sibling room, the front door of tracer/, figures, session, the GUI, app and the CLI import
    ``from gpt_shape_tracer.tracer.storage import TraceLog``, never ``tracer.storage._log``; a figure module
    imports another's public names only. Tests and bench/ (which swaps a room's internals to time them) may open
    a room; nothing that ships may."""
    assert {"capture", "storage", "reading", "generation", "experiments", "files", "costs", "engine"} <= \
        set(TRACER_ROOMS)
    assert {"attention", "common", "heatmap", "plot"} <= set(FIGURE_ROOMS)
    bad = _private_imports_across_rooms("tracer", TRACER_ROOMS, SOURCES) + \
        _private_imports_across_rooms("figures", FIGURE_ROOMS, SOURCES)
    assert not bad, bad


def test_the_private_import_guard_finds_a_private_import():
    """The check above could fail: another room's private module or name is found, the room's own is not."""
    capture, files = f"{PACKAGE}.tracer.capture._tracer", f"{PACKAGE}.tracer.files._load"
    assert _is_private_import("tracer", TRACER_ROOMS, files, f"{PACKAGE}.tracer.storage._log", "TraceLog")
    assert _is_private_import("tracer", TRACER_ROOMS, f"{PACKAGE}.gui.common", f"{PACKAGE}.tracer.storage", "_x")
    assert not _is_private_import("tracer", TRACER_ROOMS, files, f"{PACKAGE}.tracer.storage", "TraceLog")
    assert not _is_private_import("tracer", TRACER_ROOMS, capture, f"{PACKAGE}.tracer.capture._hooks", None)
    heatmap, cache = f"{PACKAGE}.figures.heatmap", f"{PACKAGE}.figures.cache"
    assert _is_private_import("figures", FIGURE_ROOMS, cache, heatmap, "_cells")
    assert not _is_private_import("figures", FIGURE_ROOMS, cache, heatmap, "grid")
    assert not _is_private_import("figures", FIGURE_ROOMS, heatmap, heatmap, "_cells")


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of model/ it imports by name, at any depth (imports inside functions and under
    TYPE_CHECKING count: a circle there is still a circle a reader has to follow). ``from a.b import c`` is an
    edge to ``a.b.c`` when that is a module, else to ``a.b``. The parent packages Python runs first are not
    edges: every module would otherwise import model/__init__.py, which imports the rooms."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, set())
        for _, imported, name in _imported_names(path):
            target = f"{imported}.{name}" if f"{imported}.{name}" in modules else imported
            if target in modules and target != module:
                edges.add(target)
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it is searched
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_import_graph_has_no_circle():
    """No circle anywhere in what ships: model, tracer, figures, session, gui, the app and the CLI."""
    graph = _import_graph({module_name(p): p for p in SOURCES})
    load = f"{PACKAGE}.model.sources._load"
    assert graph[load] >= {f"{PACKAGE}.model.sources._nanogpt", f"{PACKAGE}.model.sources._resolve"}  # edges read
    circle = _circle(graph)
    assert circle is None, " -> ".join(circle or [])


def test_the_circle_finder_finds_a_circle():
    """The check above could fail: the finder reports the circle loading/nanogpt/resolve once formed on main."""
    graph = {"model.loading": {"model.nanogpt", "model.resolve"}, "model.nanogpt": {"model.loading"},
             "model.resolve": set()}
    assert _circle(graph) == ["model.loading", "model.nanogpt", "model.loading"]
    assert _circle({"a": {"b"}, "b": set()}) is None

# torch's own private attributes we read on purpose, each for a reason a test pins
ALLOWED_PRIVATE = {
    "_scaled_dot_product_flash_attention_for_cpu": "the fused attention kernel a real CPU run calls: a dry run "
                                                   "counts that one op, not SDPA's math (tracer/costs/_counter.py)",
    "_schema": "an aten op's schema, which torch's OpOverload gives only so: whether the op aliases or writes an "
               "argument, read before its meta output is cached (model/sources/_meta_ops.py)",
    "_version": "the in-place version counter that catches a kept value changed later (tracer/storage/_store.py)",
    "_global_forward_hooks": "lets an unhooked hook point or module of our GPT skip nn.Module.__call__ "
                             "(model/gpt/_hook_point.py; tests/model/test_model_hooks.py pins it)",
    "_global_forward_pre_hooks": "as above",
    "_global_backward_hooks": "as above",
    "_global_backward_pre_hooks": "as above",
    "_forward_hooks": "as above: what nn.Module.__call__ itself reads to decide whether to do more than call forward",
    "_forward_pre_hooks": "as above",
    "_backward_hooks": "as above",
    "_backward_pre_hooks": "as above",
    "_compiled_call_impl": "as above: an in-place module.compile() takes the full path (and so does a torch.jit.trace)",
    "_attn": "GPT-J's and GPT-Neo's own eager attention step, which model/sources/_hf_families.py overrides and "
             "calls through super()",
    "_attn_implementation": "transformers' config field naming the attention function: Falcon's module keeps a "
                            "copy of its config that names SDPA (model/sources/_hf_families.py)",
    "_buffers": "KVCache's rows: StateCache.copy (model/sources/_hf_cache.py), a KVCache itself, moves the rows "
                "of the KVCache.copy it has just made into its own twin",
    "_length": "as _buffers",
    "_quantized_keys": "transformers 5.23's Fp8QuantizedLayer keeps its 8-bit rows and per-tensor scale only there, "
                       "with no public reader: tracer/experiments/_cache_classes.py counts their bytes and measures "
                       "each row's dequantization error",
    "_quantized_values": "as _quantized_keys",
    "_dequantize": "as _quantized_keys: the layer's own dequantization, so the error measured is transformers'",
    "_create_batch_processor": "transformers 5.23 has no public synchronous step of continuous batching: "
                               "tracer/engine/_engine.py makes the batch processor its background thread would "
                               "make (test_engine.py::test_the_private_step_calls_of_transformers_are_still_there)",
    "_generation_step": "the forward of one engine step, as the thread's loop body calls it (as above)",
    "_get_top_k_continuations": "transformers' own beam-search step, called by tracer/generation/_beams.py so the "
                                "traced search decides as generate(num_beams=k) does (tests/tracer/test_beams.py pins "
                                "sequences, scores and every beam_idx against generate)",
    "_get_running_beams_for_next_iteration": "as _get_top_k_continuations",
    "_update_finished_beams": "as _get_top_k_continuations",
    "_check_early_stop_heuristic": "as _get_top_k_continuations",
    "_beam_search_has_unfinished_sequences": "as _get_top_k_continuations",
    "_repr_mimebundle_": "IPython's display protocol, public in all but name: the heads grid shows its figure "
                         "as plotly shows it (figures/attention.py)",
}


NAMEDTUPLE_API = {"_make", "_fields", "_replace", "_asdict"}  # public, underscored only to avoid field clashes


def _own_instances(tree: ast.AST) -> dict[ast.AST, set[str]]:
    """Per method, the local names bound to a new instance of its own class (``twin = KVCache(...)``): a
    class may set up the private fields of an object it has just made."""
    out: dict[ast.AST, set[str]] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            names = set()
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                        isinstance(node.value.func, ast.Name) and node.value.func.id in (cls.name, "cls"):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            for node in ast.walk(fn):
                out[node] = names
    return out


def test_no_code_touches_another_objects_private_fields():
    """A class's private fields are read and written by that class alone: ``x._field`` is allowed only on
    ``self``/``cls``, on an instance the class has just made, and for the few torch attributes above."""
    bad = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = _own_instances(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if node.attr in ALLOWED_PRIVATE or node.attr in NAMEDTUPLE_API:
                continue
            if isinstance(node.value, ast.Name) and (node.value.id in ("self", "cls") or
                                                     node.value.id in own.get(node, ())):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not bad, bad


def test_the_bundled_model_is_small_enough_to_ship():
    files = list((ROOT / "assets" / "story-gpt").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "training.json"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) < 20 * 2**20


def test_every_relative_link_in_the_docs_points_to_a_file_that_exists():
    import re

    docs = [ROOT / "README.md", ROOT / "model" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" not in target and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} → {target}")
    assert not missing, missing


def test_every_screenshot_kept_is_shown_by_a_page_and_every_picture_shown_is_kept():
    """The pictures under assets/screenshots/ and docs/images/ are there for the README and docs/ to show: one no
    page shows is stale weight in every clone (or a page lost its reference), and one a page shows must exist —
    as an image (![…](…) or <img src>), not only as a link."""
    import re

    pages = [ROOT / "README.md", ROOT / "model" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    shown, missing = set(), []
    for page in pages:
        said = page.read_text(encoding="utf-8")
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", said) + re.findall(r'<img[^>]*\ssrc="([^"]+)"', said):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            shown.add(path)
            if not path.is_file():
                missing.append(f"{page.relative_to(ROOT)} → {target}")
    assert not missing, missing
    kept = [p.resolve() for folder in (ROOT / "assets" / "screenshots", ROOT / "docs" / "images")
            for p in folder.iterdir() if p.suffix.lower() in (".png", ".gif", ".jpg", ".jpeg", ".webp", ".svg")]
    assert kept
    assert not [p for p in kept if p not in shown], sorted(str(p.relative_to(ROOT)) for p in kept if p not in shown)
