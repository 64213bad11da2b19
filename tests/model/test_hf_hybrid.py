"""Hybrid causal LMs whose layers are not all softmax attention (issue 40, item 2): Qwen3-Next and Qwen3.5 (Gated
DeltaNet + attention), Jamba, Bamba, Granite-MoE-hybrid, Nemotron-H, Zamba2 (Mamba + attention), OLMo-hybrid, LFM2
(short convolutions + attention), MiniMax (lightning attention + attention, its state in a cache class of its
own), Kimi Linear and Bailing hybrid (delta-rule linear attention + latent attention: their linear layers are
classes named "…DeltaAttention", found as mixers by the state they write, not by their names). Each is a tiny
random-weight model built from transformers' own config class (tests/hf_every_architecture.py shrinks it), with
its per-layer pattern set so that it keeps at least one attention layer and one state layer; traced for a prefill
and 3 cached decode steps and compared with transformers' eager forward on the same weights. The attention layers
record Q, K, V, the pattern and O; a layer without attention records its mixer's input and output and holds no K,
V rows."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_every_architecture import PROMPT, TOLERANCE, build, check, tiny_config

# The state mixers' own sizes, smaller than the generic shrinking leaves them: transformers' torch path of
# Mamba-2 pads the prompt to a whole chunk and forms [chunk × chunk] blocks per head and state dimension, so 128
# heads, a 256-wide state and 256-token chunks made Bamba the suite's slowest test (25 s quiet). A 16-token chunk
# is still padded and scanned for an 8-token prompt.
SMALL_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)
SMALL_DELTANET = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4)

# the per-layer pattern each family's config reads, set so that the two layers are one of each kind (the generic
# shrinking keeps two kinds where the default pattern has them within its first layers; these do not)
PATTERNS: dict[str, dict] = {
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], **SMALL_DELTANET),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], **SMALL_DELTANET),
    "qwen3_5_moe_text": dict(layer_types=["linear_attention", "full_attention"], **SMALL_DELTANET),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1], **SMALL_MAMBA2),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], **SMALL_MAMBA2),
    # Mamba, MoE, attention, MLP: one mixer per block
    "nemotron_h": dict(hybrid_override_pattern="ME*-", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                       n_groups=1, chunk_size=16),
    "zamba2": dict(layer_types=["mamba", "hybrid"], mamba_d_state=16, chunk_size=16),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # lightning (linear) attention + softmax attention, its state in MiniMax's own cache class; blocks of 4 tokens,
    # so that the prefill's chunked path crosses a block boundary before the cached steps' one-token recurrence; a
    # lightning layer first, as in MiniMax-01 (a softmax layer after every seven lightning ones), where transformers'
    # own cached steps restart the positions (test_minimax_transformers_own_cached_path_restarts_its_positions);
    # weights drawn 5x wider than the default (0.02), so that the attention is sharp enough for that to show far
    # above the tolerance rather than near it
    "minimax": dict(layer_types=["linear_attention", "full_attention"], block_size=4, initializer_range=0.1),
    # delta-rule linear attention (Qwen3-Next's cache layout: a short convolution's state and a recurrent state)
    # + latent attention; Kimi's defaults are 32 heads of 128 in its linear layers
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], linear_num_heads=4, linear_head_dim=16),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"], linear_num_heads=4, linear_head_dim=16),
}


def hybrid_config(model_type: str):
    import transformers

    values = tiny_config(model_type).to_dict()
    values.update(PATTERNS[model_type], vocab_size=1024)  # the bundled tokenizer's, so that the app can run it
    values.pop("full_attn_idxs", None)  # LFM2: derived from layer_types when left out
    return transformers.CONFIG_MAPPING[model_type](**values)


def build_hybrid(model_type: str, directory: Path, seed: int = 0) -> Path:
    """As tests/hf_every_architecture.build, from the pattern above (and our tokenizer, for the app)."""
    import tests.hf_every_architecture as every

    original = every.tiny_config
    every.tiny_config = lambda _: hybrid_config(model_type)  # type: ignore[assignment]
    try:
        build(model_type, directory, seed)
    finally:
        every.tiny_config = original
    (directory / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return directory


@pytest.fixture(scope="module")
def root() -> Path:
    return Path(tempfile.mkdtemp(prefix="hf-hybrid-"))


@pytest.mark.parametrize("model_type", sorted(PATTERNS))
def test_hybrid_logits_equal_transformers_at_the_prefill_and_three_cached_steps(root, model_type):
    directory = build_hybrid(model_type, root / model_type)
    result = check(model_type, directory)
    print(model_type, result.outcome, result.deltas or result.message)
    if result.outcome == "follows uncached":  # transformers' own cached path differs from its uncached forward
        # (Bamba: its one-token Mamba-2 update and its chunked scan disagree by ~3e-4 on these weights); the trace
        # equals the uncached forward at every step, and the model says which one it follows
        assert max(result.uncached) <= TOLERANCE and result.note and "uncached" in result.note, result
    else:
        assert result.outcome == "traced" and len(result.deltas) == 4 and max(result.deltas) <= TOLERANCE, result
    model, _ = load_hf(directory, implementation="transformers")
    assert isinstance(model, HFDecoder)
    config = model.config
    without = [L for L in range(config.n_layer) if not config.has_attention(L)]
    assert without and config.attention_layers  # both kinds kept
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.arange(PROMPT)[None] % 200, cache)
    for layer in range(config.n_layer):
        rows = cache.keys[layer]
        if config.has_attention(layer):
            assert rows is not None and rows.shape[2] == PROMPT
        else:
            assert rows is None  # no K, V rows: what such a layer keeps is fixed-size (StateCache.state_nbytes)
            assert config.mixers is not None and config.mixers[layer]
            sentence = config.no_attention_sentence(layer)
            assert sentence is not None and sentence.startswith(f"layer {layer} has no softmax attention: it is a "
                                                                f"{config.mixers[layer]} layer")
    if config.state_layers:
        assert cache.state_nbytes > 0


def test_the_mixer_is_named_from_its_class():
    """The name the views show is the mixer's class without the family's prefix, in words."""
    from gpt_shape_tracer.model.sources._hf_probe import mixer_name

    cases = {"Qwen3NextGatedDeltaNet": ("Qwen3Next", "Gated DeltaNet"),
             "NemotronHMamba2Mixer": ("NemotronH", "Mamba2 Mixer"), "Lfm2ShortConv": ("Lfm2", "Short Conv"),
             "BambaMixer": ("Bamba", "Bamba Mixer"), "NemotronHMoE": ("NemotronH", "MoE")}
    for cls, (prefix, words) in cases.items():
        assert mixer_name(type(cls, (torch.nn.Module,), {})(), prefix) == words


def traced(directory: Path, steps: int = 4) -> TracedGeneration:
    model, tok = load_hf(directory, implementation="transformers")
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said"], temperature=0, padding_side="left")
    gen.run(steps)
    return gen


def test_a_state_layer_records_its_mixer_and_an_attention_layer_its_attention(root):
    """Qwen3-Next: layer 0 is a Gated DeltaNet, layer 1 attention. Layer 1 records Q, K, V, the pattern and O as
    any other family; layer 0 its mixer's input and output — the output what it adds to the residual stream — its
    recurrent state (fixed-size, [B, …] at every step), and nothing of attention."""
    gen = traced(build_hybrid("qwen3_next", root / "qwen3_next_traced"))
    trace, config = gen.trace, gen.model.config
    assert config.mixers == ("Gated DeltaNet", "") and config.state_layers == (0,)
    for step in range(4):
        assert trace.has("blocks.1.attn.hook_pattern", step) and trace.has("blocks.1.attn.hook_k_all", step)
        assert not trace.has("blocks.0.attn.hook_pattern", step) and not trace.has("blocks.0.attn.hook_k_all", step)
        x_in, out = trace.get("blocks.0.hook_mixer_in", step), trace.get("blocks.0.hook_mixer_out", step)
        assert x_in.shape == out.shape == trace.get("blocks.0.hook_resid_pre", step).shape
        ssm = trace.record("blocks.0.hook_ssm_state", step)
        assert ssm.shape == trace.record("blocks.0.hook_ssm_state", 0).shape  # does not grow with t
    # the mixer's output is what the layer adds before its MLP: resid_mid = resid_pre + mixer_out
    step = 3
    mid = trace.get("blocks.0.hook_resid_mid", step)
    assert torch.allclose(mid, trace.get("blocks.0.hook_resid_pre", step) + trace.get("blocks.0.hook_mixer_out", step),
                          atol=1e-5)
    assert trace.record("blocks.0.hook_mixer_in", step).axes == ("B", "n", "d")  # the hook table's row


def test_the_cache_views_count_k_and_v_at_attention_layers_and_the_state_at_the_others(root, tmp_path):
    from gpt_shape_tracer.figures import cache
    from gpt_shape_tracer.figures.common import no_attention
    from gpt_shape_tracer.model.gpt import spec_for
    from gpt_shape_tracer.tracer import load_trace, save_trace
    from gpt_shape_tracer.tracer.costs import kv_cache_bytes

    gen = traced(build_hybrid("qwen3_next", root / "qwen3_next_cache"))
    trace, step, config = gen.trace, 3, gen.model.config
    table = cache.cache_table(trace, step)
    assert list(table["layer"]) == [0, 1] and table["K"][0] == "none (Gated DeltaNet)" and table["bytes (K+V)"][0] == 0
    k, v = trace.record("blocks.1.attn.hook_k_all", step), trace.record("blocks.1.attn.hook_v_all", step)
    assert table["bytes (K+V)"][1] == k.nbytes + v.nbytes
    state = sum(rec.nbytes for rec in cache.state_records(trace, step, 0))
    assert table["state bytes"][0] == state > 0 and gen.cache.state_nbytes == state  # what the cache holds
    assert kv_cache_bytes(trace, step) == k.nbytes + v.nbytes + state
    _, sentence = cache.memory_formula(trace, step)
    assert sentence.startswith("1 layer ×") and "the other 1 layer has no softmax attention and holds" in sentence
    assert spec_for("blocks.0.hook_mixer_out", config) is not None
    # a saved trace says the same of its layers
    again = load_trace(save_trace(trace, tmp_path / "hybrid.gst"))
    assert again.config is not None and again.config.mixers == config.mixers
    assert no_attention(again, 0) == config.no_attention_sentence(0) and no_attention(again, 1) is None


def test_a_head_at_a_state_layer_cannot_be_switched_off_or_patched(root):
    """The intervention is refused before any forward, with what the layer is; activation patching of the heads
    leaves the state layer's row empty (NaN: it has no heads) and fills the attention layer's."""
    from gpt_shape_tracer.tracer import InterventionError, ablate, activation_patching
    from gpt_shape_tracer.tracer.capture._interventions import check

    model, tok = load_hf(build_hybrid("qwen3_next", root / "qwen3_next_whatif"), implementation="transformers")
    sentence = model.config.no_attention_sentence(0)
    with pytest.raises(InterventionError, match="no softmax attention head to switch off or patch") as refused:
        check([ablate("blocks.0.attn.hook_z", head=1)], model)
    assert sentence is not None and sentence in str(refused.value)
    check([ablate("blocks.1.attn.hook_z", head=1)], model)  # an attention layer's head: accepted
    clean, corrupted = tok.encode("Lily had a red kite."), tok.encode("Tom had a red kite.")
    corrupted = (corrupted + clean)[:len(clean)]
    result = activation_patching(model, clean, corrupted, kind="z")
    assert result.restored.shape == (2, model.config.n_head)
    assert torch.isnan(result.restored[0]).all() and torch.isfinite(result.restored[1]).all()
    # the takeaway names an attention layer's head, never a NaN (random weights may give both prompts one answer:
    # the answers are set apart so that the sentence about the restored shares is the one written)
    from gpt_shape_tracer.figures.view_takeaways import patching_takeaway

    if result.clean_answer == result.corrupted_answer:
        result = dataclasses.replace(result, corrupted_answer=result.clean_answer + 1)
    heads = [f"H{h}" for h in range(model.config.n_head)]
    said = patching_takeaway(result, heads, "a", "b")
    best = float(result.restored[1].max())
    assert "L1" in said.sentence and "nan" not in said.sentence.lower() and f"{best:.0%}" in said.sentence
    assert f"of {model.config.n_head}" in dict(said.metrics)["cells restoring half or more"]


@pytest.fixture(scope="module")
def app():
    from tests.app.test_app import new_app

    return new_app()


@pytest.mark.parametrize("model_type", ["qwen3_next", "minimax"])
def test_every_tab_renders_at_an_attention_layer_and_at_a_state_layer(app, root, model_type):
    """Qwen3-Next and MiniMax in the real app (AppTest): loaded, two steps, every tab and every What-if view
    rendered with layer 1 (attention) and layer 0 (Gated DeltaNet; Lightning Attention) picked; at layer 0 the
    Attention, Causal mask and KV cache views say what the layer is, in the model's own sentence, instead of drawing
    an empty chart."""
    from html import unescape

    from tests.app.test_app import TABS, press, press_reset, show_tab
    from tests.app.test_app_architectures import choose_directory

    at = app
    choose_directory(at, build_hybrid(model_type, root / "app" / model_type))
    press(at, "load_model")
    press_reset(at)
    press(at, "step_button")
    press(at, "step_button")
    gen = at.session_state["app"].live.generation
    assert gen.n_steps == 2 and gen.model.identity.family == f"hf:{model_type}"
    assert any(f"{model_type} (hf:{model_type})" in unescape(c.value) for c in at.caption)
    sentence = gen.model.config.no_attention_sentence(0)
    assert sentence and gen.model.config.no_attention_sentence(1) is None
    for layer in (1, 0):
        for key in ("attn_layer", "mask_layer", "kv_layer", "flow_layer"):
            at.session_state[key] = layer
        for tab in TABS:
            show_tab(at, tab)
            assert not at.error, (layer, tab, [e.value for e in at.error])
            if layer == 0 and tab in ("Attention", "Causal mask", "KV cache"):
                shown = [unescape(i.value) for i in at.info]
                said = sentence[0].upper() + sentence[1:]  # the model's sentence, opening the message
                assert any(text.startswith(said) for text in shown), (tab, shown)
        for sub in ("Switch heads off", "Activation patching", "Logit attribution", "Logit lens"):
            show_tab(at, "What if", ("whatif_view", sub))
            assert not at.error, (layer, sub, [e.value for e in at.error])


def test_minimax_lightning_state_is_what_its_own_cache_holds(root):
    """MiniMax keeps its lightning (linear) attention's state — the decayed sum of K^T·V, [B, H, d_head, d_head] —
    in a cache class of its own (MiniMaxCache, the only one its forward accepts). Traced, that state sits in the
    layer's state layer of our cache: after the prefill (two blocks of 4 tokens) and after each one-token step it
    equals what transformers' own MiniMaxCache holds for the same tokens, it does not grow with t, and a copy of
    the cache at the prefill continues exactly as the original did."""
    from transformers import AutoModelForCausalLM

    directory = build_hybrid("minimax", root / "minimax_state")
    model, _ = load_hf(directory, implementation="transformers")
    config = model.config
    assert config.mixers == ("Lightning Attention", "") and config.state_layers == (0,)
    sentence = config.no_attention_sentence(0)
    assert sentence is not None and sentence.startswith("layer 0 has no softmax attention: it is a Lightning Attention")
    tokens = torch.randint(0, 200, (1, PROMPT + 3), generator=torch.Generator().manual_seed(2))
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    seen: list[torch.Tensor] = []
    model.blocks[0].hook_ssm_state.register_forward_hook(lambda m, a, out: seen.append(out))
    cache = model.new_cache()
    with torch.no_grad():
        ours = [model(tokens[:, :PROMPT], cache)]
        copy = cache.copy(PROMPT)
        theirs = hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        held = [theirs.past_key_values.linear_cache[0].clone()]
        for i in range(PROMPT, PROMPT + 3):
            ours.append(model(tokens[:, i:i + 1], cache))
            theirs = hf(input_ids=tokens[:, i:i + 1], past_key_values=theirs.past_key_values, use_cache=True)
            held.append(theirs.past_key_values.linear_cache[0].clone())
        again = model(tokens[:, PROMPT:PROMPT + 1], copy)
    H, d_head = config.n_head, config.head_dim
    assert len(seen) == 5 and len(held) == 4  # the prefill, 3 steps, and the copy's step
    for mine, its in zip(seen, held):
        assert mine.shape == its.shape == (1, H, d_head, d_head)  # fixed-size: no axis grows with t
        assert torch.allclose(mine, its, atol=1e-5), float((mine - its).abs().max())
    assert cache.keys[0] is None and cache.keys[1] is not None and cache.keys[1].shape[2] == PROMPT + 3
    assert cache.state_nbytes == seen[3].numel() * seen[3].element_size()
    assert torch.equal(again, ours[1]) and torch.equal(seen[4], seen[1])  # the copy started from the prefill's state


def test_minimax_transformers_own_cached_path_restarts_its_positions(root):
    """Where MiniMax's first layer is a lightning layer (as in MiniMax-01), transformers' own MiniMaxCache
    reports a length of 0 after the prefill — it asks its first cache layer, which holds no K, V — so its cached
    decode steps give the softmax layers RoPE positions from 0 again. Our trace keeps the real positions: it equals
    transformers' uncached forward at every step, and the model says so (reference_note) with the numbers."""
    from transformers import AutoModelForCausalLM

    directory = build_hybrid("minimax", root / "minimax_positions")
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        past = hf(input_ids=torch.arange(PROMPT)[None], use_cache=True).past_key_values
    assert past.get_seq_length() == 0 and past.get_seq_length(1) == PROMPT  # the cause, read from transformers
    result = check("minimax", directory)
    assert result.outcome == "follows uncached" and max(result.uncached) <= TOLERANCE, result
    assert max(result.deltas[1:]) > TOLERANCE  # transformers' cached steps differ (wrong positions) …
    assert result.note and "uncached" in result.note and "minimax" in result.note  # … and the model says which


@pytest.mark.parametrize("model_type", ["kimi_linear", "bailing_hybrid"])
def test_a_delta_attention_layer_is_a_mixer_found_by_the_state_it_writes(root, model_type):
    """Kimi Linear's and Bailing hybrid's layer 0 is delta-rule linear attention in a class named
    "…DeltaAttention" — no state-space word in it — holding a short convolution of its own. The layer is traced as
    a mixer because of what it does: it writes a convolution state and a recurrent state into transformers' cache
    (Qwen3-Next's layout). The mixer is that attention module, not the convolution inside it; the state recorded
    after the prefill and each cached step is what transformers' own cache holds for the same tokens."""
    from transformers import AutoModelForCausalLM

    from gpt_shape_tracer.model.sources._hf_probe import _STATE_WORDS

    directory = build_hybrid(model_type, root / f"{model_type}_state")
    model, _ = load_hf(directory, implementation="transformers")
    assert isinstance(model, HFDecoder)
    config, delta = model.config, model.hf.model.layers[0].self_attn
    assert type(delta).__name__.endswith("DeltaAttention")
    assert not any(w in type(delta).__name__.lower() for w in _STATE_WORDS)  # not found by a word of its name
    assert model._mixers[0] is delta and model._mixers[1] is None
    assert config.mixers == ("Delta Attention", "") and config.state_layers == (0,) and config.attention_layers == (1,)
    seen: dict[str, list[torch.Tensor]] = {"hook_conv_state": [], "hook_ssm_state": []}
    for name, values in seen.items():
        getattr(model.blocks[0], name).register_forward_hook(lambda m, a, out, values=values: values.append(out))
    mixed: list[torch.Tensor] = []
    model.blocks[0].hook_mixer_out.register_forward_hook(lambda m, a, out: mixed.append(out))
    tokens = torch.randint(0, 200, (1, PROMPT + 3), generator=torch.Generator().manual_seed(2))
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    cache = model.new_cache()
    held: dict[str, list[torch.Tensor]] = {"hook_conv_state": [], "hook_ssm_state": []}
    with torch.no_grad():
        theirs = hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        ours = [model(tokens[:, :PROMPT], cache)]
        logits = [theirs.logits]
        for i in range(PROMPT, PROMPT + 4):
            state = theirs.past_key_values.layers[0]
            held["hook_conv_state"].append(state.conv_states[0].clone())
            held["hook_ssm_state"].append(state.recurrent_states[0].clone())
            if i == PROMPT + 3:
                break
            ours.append(model(tokens[:, i:i + 1], cache))
            theirs = hf(input_ids=tokens[:, i:i + 1], past_key_values=theirs.past_key_values, use_cache=True)
            logits.append(theirs.logits)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, logits)) <= TOLERANCE
    for name in seen:
        assert len(seen[name]) == len(held[name]) == 4, name  # the prefill and 3 steps
        for mine, its in zip(seen[name], held[name]):
            assert mine.shape == its.shape == seen[name][0].shape  # fixed-size: no axis grows with t
            assert torch.allclose(mine, its, atol=1e-5), (name, float((mine - its).abs().max()))
    assert [x.shape[1] for x in mixed] == [PROMPT, 1, 1, 1]  # the delta attention's output at every step
    assert cache.keys[0] is None and cache.keys[1] is not None and cache.keys[1].shape[2] == PROMPT + 3
    assert cache.state_nbytes == sum(seen[name][-1].nbytes for name in seen)


def test_a_copy_starts_from_that_lengths_state_and_a_failed_step_leaves_the_state_as_it_was(root):
    """Issue 52: LFM2's convolution state is overwritten in place at every step. A copy of the cache at the
    prompt's length, made after three more steps, starts from the state as it was at that length (not the latest
    one); a step that fails after the convolution layer has updated its state (an exception at the attention
    layer after it) leaves the state as it was, so the next step gives exactly the logits of a clean cache that
    never saw the failure (before, either was off by 4–7e-4)."""
    directory = build_hybrid("lfm2", root / "lfm2_copy")
    model, _ = load_hf(directory, implementation="transformers")
    assert model.config.state_layers == (0,)
    tokens = torch.randint(0, 200, (1, PROMPT + 3), generator=torch.Generator().manual_seed(5))
    cache, clean = model.new_cache(), model.new_cache()
    with torch.no_grad():
        ours = [model(tokens[:, :PROMPT], cache)]
        model(tokens[:, :PROMPT], clean)
        for i in range(PROMPT, PROMPT + 3):
            ours.append(model(tokens[:, i:i + 1], cache))
        again = model(tokens[:, PROMPT:PROMPT + 1], cache.copy(PROMPT))
        assert torch.equal(again, ours[1])  # the copy's step is the original's first step

        def fail(module, args, output):
            raise RuntimeError("a step that fails half-way")

        handle = model.blocks[1].hook_resid_post.register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="half-way"):
            model(tokens[:, PROMPT:PROMPT + 1], clean)
        handle.remove()
        assert clean.length == PROMPT
        assert torch.equal(model(tokens[:, PROMPT:PROMPT + 1], clean), ours[1])
