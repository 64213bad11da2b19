"""State-space causal LMs with no attention at all (issue 51, item 5): Mamba, Mamba-2 and Falcon-Mamba — no layer calls
attention; every layer writes a convolution state and a state-space state into transformers' own cache, and is traced
as a mixer because of that (``_state_writers``), as a hybrid model's state layers are — and RWKV, whose forward hands
its state back as tensors with one slice per layer. Each is a tiny random-weight
model built from transformers' own config class (tests/hf_every_architecture.py shrinks it), traced for a prefill and
3 cached decode steps and compared with transformers' eager forward on the same weights; the state recorded after each
step is what transformers' own cache holds. The KV-cache view says, from the records, what the model keeps instead of
a cache, beside what a KV cache of the same width would hold; the attention views say once that there is no pattern."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_every_architecture import DECODE_STEPS, PROMPT, TOLERANCE, build, check, tiny_config
from tests.tolerance import close_across_cpus, cross_cpu_atol

STATE_SPACE = ("mamba", "mamba2", "falcon_mamba")


def build_state_space(model_type: str, directory: Path, seed: int = 0) -> Path:
    """As tests/hf_every_architecture.build, with the bundled tokenizer's vocabulary (so that the app can run it);
    XLNet with its causal attn_type "uni", whose cache is its mems (its checkpoints' "bi" keeps none)."""
    import transformers

    import tests.hf_every_architecture as every

    values = {**tiny_config(model_type).to_dict(), "vocab_size": 1024,
              **({"attn_type": "uni"} if model_type == "xlnet" else {})}
    original = every.tiny_config
    every.tiny_config = lambda _: transformers.CONFIG_MAPPING[model_type](**values)  # type: ignore[assignment]
    try:
        build(model_type, directory, seed)
    finally:
        every.tiny_config = original
    (directory / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return directory


@pytest.fixture(scope="module")
def root() -> Path:
    return Path(tempfile.mkdtemp(prefix="hf-state-space-"))


@pytest.mark.parametrize("model_type", STATE_SPACE)
def test_every_layer_is_a_state_mixer_and_its_state_is_transformers_own(root, model_type):
    """Logits equal to transformers' at the prefill and 3 cached steps (the sweep's check); every layer a mixer that
    keeps state, none with attention or K, V rows; each layer's conv and SSM state after every step equal to what
    transformers' own cache holds for the same tokens, its shape the same at every t."""
    from transformers import AutoModelForCausalLM

    directory = build_state_space(model_type, root / model_type)
    result = check(model_type, directory)
    assert result.outcome == "traced" and len(result.deltas) == 1 + DECODE_STEPS, result
    assert max(result.deltas) <= TOLERANCE, result  # the sweep's parity bar (float32)
    model, _ = load_hf(directory, implementation="transformers")
    assert isinstance(model, HFDecoder)
    config = model.config
    n = config.n_layer
    assert config.attention_layers == () and config.state_layers == tuple(range(n))
    assert config.mixers is not None and all(config.mixers) and len(set(config.mixers)) == 1
    mixer_class = type(model._mixers[0]).__name__
    assert "Mixer" in mixer_class and all(type(m).__name__ == mixer_class for m in model._mixers)
    for layer in range(n):
        assert not hasattr(model.blocks[layer], "attn")
        sentence = config.no_attention_sentence(layer)
        assert sentence is not None and "does not grow with t" in sentence
    seen: dict[tuple[int, str], list[torch.Tensor]] = {}
    for layer in range(n):
        for name in ("hook_conv_state", "hook_ssm_state"):
            values = seen.setdefault((layer, name), [])
            getattr(model.blocks[layer], name).register_forward_hook(lambda m, a, out, v=values: v.append(out))
    tokens = torch.randint(0, 200, (1, PROMPT + DECODE_STEPS), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    held: dict[tuple[int, str], list[torch.Tensor]] = {key: [] for key in seen}
    cache = model.new_cache()
    with torch.no_grad():
        theirs = hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        model(tokens[:, :PROMPT], cache)
        for i in range(PROMPT, PROMPT + DECODE_STEPS + 1):
            for layer, state in enumerate(theirs.cache_params.layers):
                held[(layer, "hook_conv_state")].append(state.conv_states[0].clone())
                held[(layer, "hook_ssm_state")].append(state.recurrent_states[0].clone())
            if i == PROMPT + DECODE_STEPS:
                break
            model(tokens[:, i:i + 1], cache)
            theirs = hf(input_ids=tokens[:, i:i + 1], cache_params=theirs.cache_params, use_cache=True)
    for key, mine in seen.items():
        assert len(mine) == len(held[key]) == 1 + DECODE_STEPS, key
        for ours, its in zip(mine, held[key]):
            assert ours.shape == its.shape == mine[0].shape, key  # fixed-size: no axis grows with t
            # the same kernels on the same weights and tokens, in another order of calls: float rounding only
            assert close_across_cpus(ours, its), (key, float((ours - its).abs().max()), cross_cpu_atol(its))
    assert all(cache.keys[layer] is None for layer in range(n))  # no K, V rows anywhere
    assert cache.length == PROMPT + DECODE_STEPS
    assert cache.state_nbytes == sum(v[-1].nbytes for v in seen.values())


def test_rwkv_keeps_the_state_its_forward_hands_back(root):
    """RWKV makes no attention call and writes nothing into transformers' cache: its forward takes a list of state
    tensors (``state``: the two token shifts, and the numerator, denominator and running maximum of its WKV recurrence,
    each [B, d, n_layer]), updates it in place and hands it back. Traced, that list lives in our cache: every layer is
    a state layer recording its slice, equal to transformers' own state after the prefill and each of 3 steps; the
    logits equal transformers'; a copy of the cache at the prefill continues exactly as the original did (the state
    is snapshotted per length, not only overwritten)."""
    from transformers import AutoModelForCausalLM

    directory = build_state_space("rwkv", root / "rwkv")
    result = check("rwkv", directory)
    assert result.outcome == "traced" and max(result.deltas) <= TOLERANCE, result
    model, _ = load_hf(directory, implementation="transformers")
    config = model.config
    n = config.n_layer
    assert config.attention_layers == () and config.state_layers == tuple(range(n))
    assert config.mixers == ("Rwkv Self Attention",) * n
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {L: [] for L in range(n)}
    for layer in range(n):
        block = model.blocks[layer]
        pairs: list = []
        block.hook_conv_state.register_forward_hook(lambda m, a, out, p=pairs: p.append([out]))
        block.hook_ssm_state.register_forward_hook(lambda m, a, out, p=pairs: p[-1].append(out))
        seen[layer] = pairs
    tokens = torch.randint(0, 200, (1, PROMPT + DECODE_STEPS), generator=torch.Generator().manual_seed(4))
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    held: list[list[torch.Tensor]] = []
    cache = model.new_cache()
    with torch.no_grad():
        ours = [model(tokens[:, :PROMPT], cache)]
        copy = cache.copy(PROMPT)
        theirs = hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        held.append([x.clone() for x in theirs.state])
        for i in range(PROMPT, PROMPT + DECODE_STEPS):
            ours.append(model(tokens[:, i:i + 1], cache))
            theirs = hf(input_ids=tokens[:, i:i + 1], state=theirs.state, use_cache=True)
            held.append([x.clone() for x in theirs.state])
        again = model(tokens[:, PROMPT:PROMPT + 1], copy)
    for layer in range(n):
        assert len(seen[layer]) == 2 + DECODE_STEPS  # the prefill, 3 steps, and the copy's step
        for (shifts, wkv), its in zip(seen[layer], held):
            assert shifts.shape == (1, config.d_model, 2) and wkv.shape == (1, config.d_model, 3)  # fixed-size
            assert close_across_cpus(shifts, torch.stack([x[..., layer] for x in its[:2]], dim=-1))
            assert close_across_cpus(wkv, torch.stack([x[..., layer] for x in its[2:]], dim=-1))
    assert torch.equal(again, ours[1]) and all(torch.equal(a, b) for a, b in zip(seen[0][-1], seen[0][1]))
    assert all(cache.keys[layer] is None for layer in range(n))
    assert cache.state_nbytes == sum(x.nbytes for x in held[-1])


def traced(directory: Path, steps: int = 4) -> TracedGeneration:
    model, tok = load_hf(directory, implementation="transformers")
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said"], temperature=0, padding_side="left")
    gen.run(steps)
    return gen


def test_the_cache_view_says_what_a_state_space_model_keeps_instead_of_a_cache(root):
    """Mamba's KV-cache view: no K or V at any layer, each layer's state with its bytes; the memory sentence gives the
    state per layer — the bytes transformers' own cache holds — as the same at every step, beside what a KV cache of
    softmax attention at the same width would hold at this t (2·d·bytes per token per sequence) and the t from which
    it would hold more; the cache over the steps shows a constant number of bytes."""
    from gpt_shape_tracer.figures import cache
    from gpt_shape_tracer.tracer.costs import kv_cache_bytes

    gen = traced(build_state_space("mamba", root / "mamba_cache"))
    trace, config = gen.trace, gen.model.config
    last = gen.n_steps - 1
    table = cache.cache_table(trace, last)
    assert list(table["layer"]) == list(range(config.n_layer))
    assert all(b == 0 for b in table["bytes (K+V)"]) and all(k == "none (Mamba Mixer)" for k in table["K"])
    per_layer = [sum(rec.nbytes for rec in cache.state_records(trace, last, L)) for L in range(config.n_layer)]
    assert list(table["state bytes"]) == per_layer and per_layer[0] > 0
    # what the cache itself holds (transformers' own state layers inside StateCache), counted apart from the records
    assert gen.cache.state_nbytes == sum(per_layer) == kv_cache_bytes(trace, last)
    conv, ssm = gen.cache.states[0].conv_states[0], gen.cache.states[0].recurrent_states[0]
    assert per_layer[0] == conv.nbytes + ssm.nbytes
    latex, sentence = cache.memory_formula(trace, last)
    B, d = conv.shape[0], config.d_model
    t = gen.trace.record("blocks.0.hook_mixer_in", 0).shape[1] + last  # the prompt's width, then one per step
    kv = 2 * B * d * 4 * t  # float32: a KV cache of the same width at this t
    assert sentence.startswith(f"{config.n_layer} layers × {per_layer[0]:,} bytes")  # 2 layers
    assert f"the same after every one of the {gen.n_steps} steps so far" in sentence
    assert f"2·G·d_head·bytes = 2·{d}·4 = {2 * d * 4:,} bytes per token" in sentence
    assert f"At t = {t} such a cache would hold {kv:,} bytes per layer" in sentence
    crossing = per_layer[0] // (2 * B * d * 4) + 1
    assert f"from t = {crossing:,} on" in sentence or f"since t = {crossing:,}" in sentence
    assert latex.startswith(r"\text{state} = " + f"{per_layer[0]:,}") and f"= {kv:,}" in latex
    assert cache.state_sentence(trace, last) is None  # nothing beside K and V: the formula said it
    growth = cache.cache_growth(trace)
    assert set(growth["K+V bytes (all layers)"]) == {sum(per_layer)}  # constant over t
    assert list(growth["cache length"]) == [t - last + s for s in range(gen.n_steps)]
    fig = cache.cache_steps_figure(trace, last)
    assert "fixed size" in fig.layout.annotations[0].text


def test_the_offline_reports_say_once_that_there_is_no_attention(root):
    """The step and run reports of a Mamba trace: where they would draw head (0, 0)'s stages, the grid and the mask,
    the layer's own sentence and one line saying the model has no heads, patterns or mask."""
    from html import unescape

    from gpt_shape_tracer.figures.report import report_html, run_report_html

    gen = traced(build_state_space("mamba", root / "mamba_report"), steps=2)
    sentence = gen.model.config.no_attention_sentence(0)
    assert sentence is not None
    step_page, run_page = unescape(report_html(gen.trace)), unescape(run_report_html(gen.trace))
    said = sentence[0].upper() + sentence[1:]
    assert step_page.count(said) == 1 and run_page.count(said) == 1
    assert step_page.count("there are no heads, patterns or mask") == 1


@pytest.fixture(scope="module")
def app():
    from tests.app.test_app import new_app

    return new_app()


def test_every_tab_renders_for_a_model_without_attention(app, root):
    """Mamba in the real app (AppTest): loaded, two steps, every tab rendered at both layers; the Attention, Causal
    mask and KV cache views say what the layer is, in the model's own sentence, once, instead of drawing an empty
    chart or failing."""
    from html import unescape

    from tests.app.test_app import TABS, press, press_reset, show_tab
    from tests.app.test_app_architectures import choose_directory

    at = app
    choose_directory(at, build_state_space("mamba", root / "app" / "mamba"))
    press(at, "load_model")
    press_reset(at)
    press(at, "step_button")
    press(at, "step_button")
    gen = at.session_state["app"].live.generation
    assert gen.n_steps == 2 and gen.model.identity.family == "hf:mamba"
    for layer in (0, 1):
        sentence = gen.model.config.no_attention_sentence(layer)
        assert sentence is not None
        said = sentence[0].upper() + sentence[1:]
        for key in ("attn_layer", "mask_layer", "kv_layer", "flow_layer"):
            at.session_state[key] = layer
        for tab in TABS:
            show_tab(at, tab)
            assert not at.error, (layer, tab, [e.value for e in at.error])
            if tab in ("Attention", "Causal mask", "KV cache"):
                shown = [unescape(i.value) for i in at.info]
                assert sum(text.startswith(said) for text in shown) == 1, (tab, shown)
    for view in ("Over the steps", "A cheaper cache", "What grows with n", "This step"):
        show_tab(at, "KV cache", ("kv_view", view))
        assert not at.error, (view, [e.value for e in at.error])
        if view == "What grows with n":
            assert any("has no softmax attention" in unescape(i.value) for i in at.info)
