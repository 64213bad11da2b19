"""The page's layering, read from the source: app.py is a short main, each tab a module of gui/, the GUI
reaches tracer through its front door only and runs no model loop itself; and the logic that left the GUI
(session.py) does what the GUI relied on."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gpt_shape_tracer import session
from gpt_shape_tracer.session import DEFAULTS, SETTING_KEYS, SettingsError
from tests.layout import PACKAGE, ROOT, room, sources

GUI = sources("gui")
PAGE = [*GUI, ROOT / "app.py"]  # the Streamlit layer
FRONT_ENDS = [*PAGE, *sources("session", "figures", PACKAGE)]
BELOW_GUI = sources("session", "figures", "tracer", "model", PACKAGE)


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(encoding="utf-8"))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def _imported_modules(path: Path) -> list[tuple[ast.AST, str]]:
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node, node.module))
    return out


def test_app_py_is_a_short_main():
    lines = (ROOT / "app.py").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"app.py has {len(lines)} lines: a tab's wiring belongs in its gui/ module"
    assert len(GUI) >= 10, "one module per tab under gui/"


def test_front_ends_import_tracer_through_its_front_door():
    """``from gpt_shape_tracer.tracer import Name`` only: no ``tracer.<submodule>`` and no private name, so tracer
    can move its rooms around without breaking a front end."""
    bad = []
    for path in FRONT_ENDS:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                bad += [f"{_where(path, node)} import {a.name}" for a in node.names
                        if a.name.startswith(f"{PACKAGE}.tracer.")]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module.startswith(f"{PACKAGE}.tracer."):
                    bad.append(f"{_where(path, node)} from {node.module}")
                elif node.module == f"{PACKAGE}.tracer":
                    bad += [f"{_where(path, node)} from gpt_shape_tracer.tracer import {a.name}" for a in node.names
                            if a.name.startswith("_") or a.name == "*"]
    assert not bad, bad


LAYERISH = re.compile(r"layer|block", re.I)
MODEL_LOOP_CALLS = {"step", "run"}


def _names_in(node: ast.AST) -> list[str]:
    return [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))]


def _loops(tree: ast.AST):
    """(loop node, what it iterates over or None, its body's nodes) for every for/while and comprehension."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            yield node, node.iter, node.body
        elif isinstance(node, ast.While):
            yield node, node.test, node.body
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            body = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for gen in node.generators:
                yield node, gen.iter, body


def test_the_gui_runs_no_loop_over_layers_and_no_generation_loop():
    """A heuristic that fails when someone writes a model loop into the page: a loop (or comprehension) over
    anything named like layers/blocks (``range(config.n_layer)``, ``model.blocks``), or one whose body calls
    ``.step()`` or ``.run()``. Such loops belong in tracer or session.py."""
    bad = []
    for path in PAGE:
        for node, over, body in _loops(_tree(path)):
            if any(LAYERISH.search(name) for name in _names_in(over)):
                bad.append(f"{_where(path, node)} loops over {ast.unparse(over)}")
            calls = [n for part in body for n in ast.walk(part) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Attribute) and n.func.attr in MODEL_LOOP_CALLS]
            bad += [f"{_where(path, node)} calls .{c.func.attr}() in a loop" for c in calls]
    assert not bad, bad


def test_the_heuristic_catches_the_loops_it_is_for():
    for source in ("for i in range(model.config.n_layer):\n    x = 1",
                   "rows = [f(b) for b in model.blocks]",
                   "for _ in range(n):\n    gen.step()",
                   "while not done:\n    twin.run(1)"):
        tree = ast.parse(source)
        hits = [1 for _, over, body in _loops(tree) if any(LAYERISH.search(n) for n in _names_in(over))
                or any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                       and c.func.attr in MODEL_LOOP_CALLS for part in body for c in ast.walk(part))]
        assert hits, source


def test_layers_point_one_way_around_the_gui():
    """session/ never imports streamlit or the GUI; nothing below the page imports gui or app; the GUI never
    imports app (app.py imports the GUI)."""
    bad = []
    for path in BELOW_GUI:
        for node, module in _imported_modules(path):
            top = room(module)
            if top in ("gui", "app") or (top == "streamlit" and path.is_relative_to(ROOT / "session")):
                bad.append(f"{_where(path, node)} imports {module}")
    for path in GUI:
        bad += [f"{_where(path, node)} imports app" for node, module in _imported_modules(path)
                if room(module) == "app"]
    assert not bad, bad


def test_the_settings_widgets_are_read_once_with_their_defaults_declared_once(monkeypatch):
    """The sidebar draws a widget for every setting and hands their values to session.settings_from, read by one
    function (``sidebar_values``, which a rerun of the page's view alone reads them with too): every setting's key
    and no other; no page module reads a setting's key again from the session state (with a copy of its default)."""
    from gpt_shape_tracer.gui import sidebar as sidebar_module

    sidebar = _tree(ROOT / "gui" / "sidebar.py")
    keys = {k.value.value for k in ast.walk(sidebar) if isinstance(k, ast.keyword) and k.arg == "key"
            and isinstance(k.value, ast.Constant)}
    assert set(SETTING_KEYS) <= keys
    held = {key: f"the widget's {key}" for key in (*SETTING_KEYS, "run_n", "source", "model_dir")}
    monkeypatch.setattr(sidebar_module.st, "session_state", held)
    assert sidebar_module.sidebar_values() == {key: held[key] for key in SETTING_KEYS}
    bad = []
    for path in PAGE:
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in SETTING_KEYS:
                bad.append(f"{_where(path, node)} reads {node.args[0].value!r} again")
    assert not bad, bad


# -- the logic that left the GUI -----------------------------------------------------------------------
def test_settings_from_no_widgets_are_the_defaults():
    settings = session.settings_from({})
    assert settings.prompts == (DEFAULTS.prompt,) and settings.sampling.greedy
    assert settings.use_cache is DEFAULTS.use_cache and settings.capture == DEFAULTS.capture
    assert settings.budget_bytes == DEFAULTS.budget_mb * 2**20
    with pytest.raises(SettingsError, match="seed"):
        session.settings_from({"seed": "x"})


def test_a_model_choice_of_a_directory_and_the_directory_typed():
    choice = session.ModelChoice("directory", "/tmp/a:b", dtype="bfloat16")
    assert session.ModelChoice.from_json(choice.to_json()) == choice and choice.max_memory is None
    offloaded = session.ModelChoice("directory", "/tmp/a:b", dtype="float32", memory_gib=1.5)
    assert offloaded.max_memory == "1.5GiB"
    assert offloaded.describe() == "the directory /tmp/a:b (float32, weights beyond 1.5 GiB on disk)"
    for raw, message in (("  ", "Type the directory"), ("/a\x00b", "NUL character")):
        with pytest.raises(SettingsError, match=message):
            session.checkpoint_path(raw)
        with pytest.raises(SettingsError, match=message):
            session.ModelChoice("directory", raw)
    assert session.checkpoint_path(" ~/m ") == str(Path("~/m").expanduser())


def test_heads_are_offered_as_pairs_and_named_for_people():
    heads = session.all_heads(2, 3)
    assert heads[:2] == [(0, 0), (0, 1)] and len(heads) == 6 and session.head_label((1, 2)) == "L1 H2"
    (off,) = session.head_ablations([(1, 2)], "mean")
    assert off.describe() == "blocks.1.attn.hook_z head 2 mean-ablated"


def test_the_inspector_shows_the_ops_of_the_module_that_made_a_record():
    class Rec:
        def __init__(self, kind: str, module: str):
            self.kind, self.module = kind, module

    assert session.ops_module(Rec("hook", "blocks.0.attn.hook_pattern")) == "blocks.0.attn"
    assert session.ops_module(Rec("hook", "hook_embed")) == ""
    assert session.ops_module(Rec("output", "blocks.0.mlp.c_fc")) == "blocks.0.mlp.c_fc"


def test_run_steps_keeps_what_finished_and_says_why_it_stopped():
    class Gen:
        """Steps until ``fail_at``, then raises; big enough to skip the recompute check."""

        def __init__(self, fail_at: int):
            self.n_steps, self.fail_at, self.stopped = 0, fail_at, None
            self.model = type("M", (), {"num_parameters": session.AUTO_RECOMPUTE_PARAMS})()

        def step(self):
            if self.n_steps == self.fail_at:
                raise RuntimeError("boom <b>")
            self.n_steps += 1

    seen: list[int] = []
    assert session.run_steps(Gen(10), 3, on_step=seen.append) is None and seen == [1, 2, 3]
    gen = Gen(2)
    end = session.run_steps(gen, 5)
    assert gen.n_steps == 2 and end.level == "error" and end.detail == "boom <b>"
    assert end.message == "The forward pass failed at step 2: RuntimeError: "
