"""Your own module (model/sources/_own_module.py): a hand-written GPT that calls F.scaled_dot_product_attention gets its
attention recorded where it calls it, equal to softmax(QKᵀ·scale + M) recomputed here from its own weights."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpt_shape_tracer.model.sources import OwnDecoder, OwnModuleError, load_factory
from gpt_shape_tracer.tracer import TracedGeneration, Tracer, ablate

GPT_SOURCE = '''
import torch
import torch.nn.functional as F
from torch import nn


class Config:
    block_size, vocab_size, n_layer, n_head, n_kv_head, n_embd = 64, 1024, 2, 4, 2, 32


class Attention(nn.Module):
    """Grouped-query attention written by hand, calling F.scaled_dot_product_attention."""

    def __init__(self, c, mask_kind):
        super().__init__()
        self.c, self.mask_kind = c, mask_kind
        d_head = c.n_embd // c.n_head
        self.q = nn.Linear(c.n_embd, c.n_head * d_head)
        self.kv = nn.Linear(c.n_embd, 2 * c.n_kv_head * d_head)
        self.o = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x):
        B, n, _ = x.shape
        c, dh = self.c, self.c.n_embd // self.c.n_head
        q = self.q(x).view(B, n, c.n_head, dh).transpose(1, 2)
        k, v = self.kv(x).view(B, n, 2, c.n_kv_head, dh).permute(2, 0, 3, 1, 4)
        if self.mask_kind == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            allowed = torch.ones(n, n, dtype=torch.bool).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, n, -1))


class Block(nn.Module):
    def __init__(self, c, mask_kind):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(c.n_embd), Attention(c, mask_kind)
        self.ln2, self.mlp = nn.LayerNorm(c.n_embd), nn.Sequential(nn.Linear(c.n_embd, 64), nn.GELU(),
                                                                  nn.Linear(64, c.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, mask_kind="causal"):
        super().__init__()
        self.config = c = Config()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.block_size, c.n_embd)
        self.h = nn.ModuleList(Block(c, mask_kind) for _ in range(c.n_layer))
        self.ln_f, self.head = nn.LayerNorm(c.n_embd), nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x)), None  # (logits, loss) as nanoGPT


def make(mask_kind="causal"):
    torch.manual_seed(0)
    return TinyGPT(mask_kind).eval()


def make_explicit():
    return make("explicit")
'''


@pytest.fixture()
def user_code(tmp_path, monkeypatch):
    (tmp_path / "my_tiny_gpt.py").write_text(GPT_SOURCE)
    os.chmod(tmp_path, 0o755)
    os.chmod(tmp_path / "my_tiny_gpt.py", 0o644)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_tiny_gpt", None)


def recomputed_pattern(module: nn.Module, tokens: torch.Tensor, layer: int, scale: float | None) -> torch.Tensor:
    """softmax(QKᵀ·scale + M) of one layer, from the module's own weights and plain torch: [B, H, n, n]."""
    c = module.config
    x = module.wte(tokens) + module.wpe(torch.arange(tokens.shape[1]))
    for block in module.h[:layer]:
        x = block(x)
    attn, dh = module.h[layer].attn, c.n_embd // c.n_head
    h = module.h[layer].ln1(x)
    B, n, _ = h.shape
    q = attn.q(h).view(B, n, c.n_head, dh).transpose(1, 2)
    k = attn.kv(h).view(B, n, 2, c.n_kv_head, dh)[:, :, 0].transpose(1, 2).repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(dh))
    hidden = torch.ones(n, n, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)


@pytest.mark.parametrize(("factory", "scale"), [("make", None), ("make_explicit", 0.3)])
def test_the_pattern_of_every_sdpa_call_is_recorded_and_the_logits_are_the_modules(user_code, factory, scale):
    model, tokenizer = load_factory(f"my_tiny_gpt:{factory}")
    assert isinstance(model, OwnDecoder) and tokenizer is None
    assert (model.config.n_layer, model.config.n_head, model.config.n_kv_heads) == (2, 4, 2)
    tokens = torch.randint(0, 1024, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model.inner(tokens)[0]  # the module's own forward, PyTorch's fused SDPA
        with Tracer(model) as tr:
            traced = model(tokens)
        for layer in range(2):
            pattern = tr.trace.get(f"blocks.{layer}.attn.hook_pattern", 0)  # [B, H, n, t]
            assert pattern.shape == (2, 4, 11, 11)
            assert torch.allclose(pattern, recomputed_pattern(model.inner, tokens, layer, scale), atol=1e-5)
            assert tr.trace.record(f"blocks.{layer}.attn.hook_k_all", 0).shape == (2, 2, 11, 8)
    assert (traced - plain).abs().max() <= 1e-5


def test_a_generation_steps_without_a_cache_and_a_head_switched_off_changes_it(user_code, bundled):
    model, _ = load_factory("my_tiny_gpt:make")
    _, tok = bundled
    gen = TracedGeneration(model, tok, "Lily had a red kite.", use_cache=False, temperature=0)
    gen.run(3)
    assert gen.trace.record("blocks.1.attn.hook_pattern", 2).shape[-1] == gen.info.prompt_width + 2
    logits = gen.trace.get("hook_logits", 0)
    with Tracer(model, interventions=[ablate("blocks.0.attn.hook_z", head=1)]) as tr, torch.no_grad():
        model(torch.tensor([gen.tokens(0)[:gen.info.prompt_width]]))
    assert not torch.allclose(tr.trace.get("hook_logits", 0), logits)
    with pytest.raises(OwnModuleError, match="runs without our KV cache"):
        TracedGeneration(model, tok, "Lily", use_cache=True)


def test_code_others_can_write_is_never_run(user_code):
    os.chmod(user_code / "my_tiny_gpt.py", 0o666)
    with pytest.raises(OwnModuleError, match="can be written by others"):
        load_factory("my_tiny_gpt:make")
    assert "my_tiny_gpt" not in sys.modules  # refused before it was imported


FACTORY = "from my_tiny_gpt import make\n"
MARKER = "import pathlib\npathlib.Path({!r}).write_text('ran')\n"


def _write(path, text, mode):
    path.write_text(text)
    os.chmod(path, mode)


def _package(root, name, *, folder_mode=0o755, init_mode=0o644, marker=None):
    """``root/name/`` with an ``__init__.py`` (that writes ``marker`` when it runs) and ``sub.py`` (the factory)."""
    folder = root / name
    folder.mkdir()
    _write(folder / "__init__.py", MARKER.format(str(marker)) if marker else "", init_mode)
    _write(folder / "sub.py", FACTORY, 0o644)
    os.chmod(folder, folder_mode)
    return folder


@pytest.fixture()
def forget_modules():
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("pkg", "linked_pkg", "linked_mod", "open_pkg", "my_tiny_gpt", "loose_mod"):
            sys.modules.pop(name)


def test_a_private_package_chain_loads(user_code, forget_modules):
    _package(user_code, "pkg", marker=user_code / "ran")
    model, _ = load_factory("pkg.sub:make")
    assert isinstance(model, OwnDecoder) and (user_code / "ran").exists()  # its __init__ ran, as import runs it


def test_a_world_writable_parent_package_is_refused_before_its_init_runs(user_code, forget_modules):
    marker = user_code / "ran"
    _package(user_code, "open_pkg", folder_mode=0o777, marker=marker)
    with pytest.raises(OwnModuleError, match="open_pkg can be written by others"):
        load_factory("open_pkg.sub:make")
    assert not marker.exists() and "open_pkg" not in sys.modules


def test_a_world_writable_folder_on_the_path_is_refused(user_code, forget_modules):
    shared = user_code / "shared"
    shared.mkdir()
    _write(shared / "loose_mod.py", FACTORY, 0o644)
    os.chmod(shared, 0o777)
    sys.path.insert(0, str(shared))
    try:
        with pytest.raises(OwnModuleError, match="shared can be written by others"):
            load_factory("loose_mod:make")
    finally:
        sys.path.remove(str(shared))
    assert "loose_mod" not in sys.modules


def test_a_0666_init_in_a_private_package_is_refused_before_it_runs(user_code, forget_modules):
    marker = user_code / "ran"
    _package(user_code, "pkg", init_mode=0o666, marker=marker)
    with pytest.raises(OwnModuleError, match="__init__.py can be written by others"):
        load_factory("pkg.sub:make")
    assert not marker.exists() and "pkg" not in sys.modules


def test_a_module_linked_to_a_file_in_a_world_writable_folder_is_refused(user_code, forget_modules):
    shared = user_code / "shared"
    shared.mkdir()
    _write(shared / "real.py", MARKER.format(str(user_code / "ran")) + FACTORY, 0o644)
    os.chmod(shared, 0o777)
    (user_code / "linked_mod.py").symlink_to(shared / "real.py")
    with pytest.raises(OwnModuleError, match="shared can be written by others"):
        load_factory("linked_mod:make")
    assert not (user_code / "ran").exists() and "linked_mod" not in sys.modules


def test_a_package_folder_linked_into_a_world_writable_folder_is_refused(user_code, forget_modules):
    shared = user_code / "shared"
    shared.mkdir()
    _package(shared, "pkg", marker=user_code / "ran")  # private itself, but its folder's folder is open
    os.chmod(shared, 0o777)
    (user_code / "linked_pkg").symlink_to(shared / "pkg")
    with pytest.raises(OwnModuleError, match="shared can be written by others"):
        load_factory("linked_pkg.sub:make")
    assert not (user_code / "ran").exists() and "linked_pkg" not in sys.modules


def test_a_world_writable_bytecode_cache_is_refused(user_code, forget_modules):
    import importlib.util
    import py_compile

    cache = py_compile.compile(str(user_code / "my_tiny_gpt.py"),
                               importlib.util.cache_from_source(str(user_code / "my_tiny_gpt.py")))
    os.chmod(cache, 0o666)  # Python runs this instead of the source while its timestamp matches
    with pytest.raises(OwnModuleError, match="pyc can be written by others"):
        load_factory("my_tiny_gpt:make")


def test_a_built_in_module_is_refused_by_name():
    with pytest.raises(OwnModuleError, match="sys is built into Python"):
        load_factory("sys:getrecursionlimit")


def test_a_module_that_hides_its_attention_is_refused_by_name():
    class Hidden(nn.Module):
        config = type("C", (), {"block_size": 16})()

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)

        def forward(self, idx):
            x = self.emb(idx)
            return x @ self.emb.weight.T

    with pytest.raises(OwnModuleError, match="no call to torch.nn.functional.scaled_dot_product_attention"):
        OwnDecoder(Hidden())
    assert F.scaled_dot_product_attention(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4),
                                          is_causal=True).shape == (1, 1, 2, 4)  # outside: PyTorch's own


@pytest.mark.parametrize("spec", ["no_colon", "a:b:c", ":make", "no_such_module_here:make"])
def test_a_bad_factory_spec_says_what_to_give(user_code, spec):
    with pytest.raises(OwnModuleError):
        load_factory(spec)




FAILING_FACTORY = "def make():\n    return {}['n_layer']\n"


def test_a_factory_that_raises_is_refused_naming_its_error(user_code, forget_modules):
    _write(user_code / "failing_mod.py", FAILING_FACTORY, 0o644)
    with pytest.raises(OwnModuleError, match="failing_mod:make raised KeyError: 'n_layer'") as refused:
        load_factory("failing_mod:make")
    assert isinstance(refused.value.__cause__, KeyError)  # the factory's own error kept as the cause
    sys.modules.pop("failing_mod", None)


def test_the_app_shows_a_factory_that_raises_as_a_message_and_keeps_the_model(user_code, forget_modules):
    from html import unescape

    from tests.app.test_app import new_app, press, run

    _write(user_code / "failing_mod.py", FAILING_FACTORY, 0o644)
    at = new_app()
    before = at.session_state["app"].model
    at.sidebar.radio(key="source").set_value("Your own module (package.module:function)")
    run(at)
    at.sidebar.text_input(key="model_factory").set_value("failing_mod:make")
    press(at, "load_factory")
    assert not at.exception, [e.value for e in at.exception]  # no traceback on the page
    messages = [unescape(e.value) for e in at.error]
    assert any("Could not load that module, the previous model stays loaded" in m and
               "failing_mod:make raised KeyError: 'n_layer'" in m for m in messages), messages
    assert at.session_state["app"].model == before
    sys.modules.pop("failing_mod", None)

def test_the_command_line_traces_your_module_from_its_factory(user_code, capsys):
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from gpt_shape_tracer.trace_command import main
    from gpt_shape_tracer.tracer import load_trace

    out = user_code / "mine.zip"
    code = main(["--prompt", "Lily had a red kite.", "--model-factory", "my_tiny_gpt:make", "--tokenizer",
                 str(BUNDLED_DIR / "tokenizer.json"), "--steps", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    trace = load_trace(out)
    assert trace.n_steps == 2 and not trace.generation.info.use_cache  # its own forward: no KV cache
    assert trace.record("blocks.1.attn.hook_pattern", 1).shape[-1] == trace.generation.info.prompt_width + 1
    assert trace.model.family == "module:TinyGPT"


def test_the_app_opens_your_module_from_its_factory_and_every_tab_renders(user_code, bundled):
    """"Your own module (package.module:function)" in the sidebar: the factory returns (model, tokenizer path);
    the page runs it without the KV cache, says so, and every tab renders without an error."""
    from html import unescape

    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from tests.app.test_app import TABS, new_app, press, run, show_tab

    (user_code / "my_tiny_app_gpt.py").write_text(
        "from my_tiny_gpt import make\n\n\ndef make_with_tokenizer():\n"
        f"    return make(), {str(BUNDLED_DIR / 'tokenizer.json')!r}\n")
    os.chmod(user_code / "my_tiny_app_gpt.py", 0o644)
    at = new_app()
    at.sidebar.radio(key="source").set_value("Your own module (package.module:function)")
    run(at)
    at.sidebar.text_input(key="model_factory").set_value("my_tiny_app_gpt:make_with_tokenizer")
    press(at, "load_factory")
    assert any("Loaded my_tiny_app_gpt:make_with_tokenizer" in unescape(s.value) for s in at.success)
    assert any("without our KV cache" in c.value for c in at.sidebar.caption)
    press(at, "step_button")
    press(at, "step_button")
    gen = at.session_state["app"].live.generation
    assert gen.n_steps == 2 and not gen.use_cache and isinstance(gen.model, OwnDecoder)
    for tab in TABS:
        show_tab(at, tab)
        assert not at.error, (tab, [e.value for e in at.error])
    for sub in ("Switch heads off", "Activation patching", "Logit attribution", "Logit lens"):
        show_tab(at, "What if", ("whatif_view", sub))
    assert any("a module of your own computes them in its own code" in i.value for i in at.info)
    show_tab(at, "Compare runs")
    options = at.radio(key="compare_with").options
    assert not any("KV cache" in o for o in options) and any("switched off" in o for o in options)  # no cached run
    # the guided tour walks it: the stops that need our KV cache are skipped, each with its reason
    at.button(key="tour_start").click()
    run(at)
    seen = []
    while True:
        seen += [unescape(m.value) for m in at.markdown if m.value.startswith("**Guided tour")]
        following = at.button(key="tour_next")
        if following.disabled:
            break
        following.click()
        run(at)
    assert len(seen) == 8 and seen[-1].startswith("**Guided tour · stop 8 of 8: Gradients")
    skipped = next(unescape(c.value) for c in at.caption if "stops skipped" in unescape(c.value))
    assert "The KV cache — your module runs its own forward, without our KV cache" in skipped and "History" in skipped
