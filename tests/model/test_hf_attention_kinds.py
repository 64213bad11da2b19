"""Attention that is not one K and one V of one width and one softmax over the keys (issue 40): multi-head latent
attention (DeepSeek-V2/V3, MiniCPM3), whose cache holds a compressed latent and whose value heads are narrower than
its query/key heads; attention sinks (gpt-oss), a learned logit per head that joins every softmax row; hybrid
models (Falcon-H1), whose layers keep a state-space mixer's state beside K and V.
Tiny random-weight models built with transformers' own config classes; each is traced for a prefill and 3 cached
decode steps and compared with transformers' eager forward on the same weights, and its cache with the cache
transformers itself fills."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder
from gpt_shape_tracer.tracer import TracedGeneration
from tests import hf_architectures
from tests.hf_architectures import ARCHITECTURES, COMMON

PROMPTS = ["Lily had a red kite.", "Tom said"]
MLA = dict(COMMON, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=8)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
           first_k_dense_replace=1, n_shared_experts=1)
# deepseek_v3, gpt_oss and falcon_h1 are in tests/hf_architectures.py (every architecture test runs them too)
KINDS: dict[str, tuple[str, dict]] = {
    "deepseek_v3": ARCHITECTURES["deepseek_v3"],
    "deepseek_v2": ("DeepseekV2Config", dict(MLA, **MOE)),
    "minicpm3": ("MiniCPM3Config", dict(MLA)),
    "gpt_oss": ARCHITECTURES["gpt_oss"],
    "falcon_h1": ARCHITECTURES["falcon_h1"],
}
LATENT = ("deepseek_v3", "deepseek_v2", "minicpm3")


def build(model_type: str, directory: Path, seed: int = 0) -> Path:
    """As tests/hf_architectures.build, from this file's table, with the bundled tokenizer."""
    return hf_architectures.build(model_type, directory, BUNDLED_DIR / "tokenizer.json", seed, table=KINDS)


@pytest.fixture(scope="module")
def directories():
    root = Path(tempfile.mkdtemp(prefix="hf-kinds-"))
    return {name: build(name, root / name) for name in KINDS}


def reference(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()


def traced(directory: Path, steps: int = 4) -> TracedGeneration:
    model, tok = load_hf(directory, implementation="transformers")
    assert isinstance(model, HFDecoder)
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0, padding_side="left")
    gen.run(steps)
    return gen


def logit_deltas(gen: TracedGeneration, ref) -> list[float]:
    """max |Δ logits| against transformers' uncached eager forward over the same columns, per step."""
    B, last = len(PROMPTS), gen.n_steps - 1
    ids = torch.tensor([gen.facts.columns(r, last) for r in range(B)])  # [B, width + last]
    real = torch.tensor([gen.facts.is_token(r, last) for r in range(B)])  # False on the left padding
    with torch.no_grad():
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        expected = ref(input_ids=ids, attention_mask=real.long(), position_ids=positions).logits  # [B, t, V]
    width = gen.info.prompt_width
    deltas = []
    for step in range(gen.n_steps):
        got = gen.trace.get("hook_logits", step)  # [B, n, V]
        want = expected[:, :width] if step == 0 else expected[:, width + step - 1:width + step]
        rows = real[:, :width] if step == 0 else torch.ones(B, 1, dtype=torch.bool)
        deltas.append(float((got - want)[rows].abs().max()))
    return deltas


@pytest.mark.parametrize("model_type", LATENT)
def test_latent_attention_logits_equal_transformers_at_the_prefill_and_three_cached_steps(directories, model_type):
    gen = traced(directories[model_type])
    deltas = logit_deltas(gen, reference(directories[model_type]))
    print(model_type, "max |Δ logits| per step:", [f"{d:.1e}" for d in deltas])
    assert max(deltas) <= 1e-4, deltas
    config, trace = gen.model.config, gen.trace
    assert config.latent_attention and (config.d_head, config.d_v, config.kv_latent_dim, config.rope_key_dim) == (
        24, 8, 16, 8)  # d_qk = 16 + 8 (nope + rope), d_v, d_c, d_R as the config says
    t = gen.info.prompt_width + 3
    for layer in range(config.n_layer):
        q, k = trace.record(f"blocks.{layer}.attn.hook_q", 3), trace.record(f"blocks.{layer}.attn.hook_k_all", 3)
        v, z = trace.record(f"blocks.{layer}.attn.hook_v_all", 3), trace.record(f"blocks.{layer}.attn.hook_z", 3)
        assert (q.shape, k.shape, v.shape, z.shape) == ((2, 4, 1, 24), (2, 4, t, 24), (2, 4, t, 8), (2, 4, 1, 8))
        assert (q.axes, k.axes, v.axes, z.axes) == (("B", "H", "n", "d_qk"), ("B", "H", "t", "d_qk"),
                                                     ("B", "H", "t", "d_v"), ("B", "H", "n", "d_v"))
        c_kv = trace.record(f"blocks.{layer}.attn.hook_kv_latent_all", 3)
        k_r = trace.record(f"blocks.{layer}.attn.hook_k_rope_all", 3)
        assert (c_kv.shape, k_r.shape) == ((2, 1, t, 16), (2, 1, t, 8))
        assert (c_kv.axes, k_r.axes) == (("B", "1", "t", "d_c"), ("B", "1", "t", "d_R"))


@pytest.mark.parametrize("model_type", LATENT)
def test_the_latent_recorded_is_what_transformers_own_cache_holds(directories, model_type):
    """transformers' DynamicCache, filled by its own forward of the same columns, holds for each layer the same two
    tensors our cache held at the last step: c_KV as its "keys", k_R as its "values"."""
    from transformers import DynamicCache

    gen = traced(directories[model_type])
    ref = reference(directories[model_type])
    B, last = len(PROMPTS), gen.n_steps - 1
    ids = torch.tensor([gen.facts.columns(r, last) for r in range(B)])
    real = torch.tensor([gen.facts.is_token(r, last) for r in range(B)])
    theirs = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=real.long(), position_ids=(real.long().cumsum(-1) - 1).clamp(min=0),
            past_key_values=theirs, use_cache=True)
    for layer in range(gen.model.config.n_layer):
        ours_c = gen.trace.get(f"blocks.{layer}.attn.hook_kv_latent_all", last)
        ours_r = gen.trace.get(f"blocks.{layer}.attn.hook_k_rope_all", last)
        held = theirs.layers[layer]
        assert held.keys.shape == ours_c.shape and held.values.shape == ours_r.shape
        assert (held.keys - ours_c)[:, 0][real].abs().max() <= 1e-5  # the padding rows are never read
        assert (held.values - ours_r)[:, 0][real].abs().max() <= 1e-5


def test_the_kv_cache_view_counts_the_latent_against_k_and_v(directories):
    from gpt_shape_tracer.figures import cache

    gen = traced(directories["deepseek_v3"])
    trace, step = gen.trace, 3
    t = gen.info.prompt_width + step
    table = cache.cache_table(trace, step)
    held = [trace.record(f"blocks.{L}.attn.hook_kv_latent_all", step).nbytes
            + trace.record(f"blocks.{L}.attn.hook_k_rope_all", step).nbytes for L in range(2)]
    full = [trace.record(f"blocks.{L}.attn.hook_k_all", step).nbytes
            + trace.record(f"blocks.{L}.attn.hook_v_all", step).nbytes for L in range(2)]
    assert list(table["bytes held (c_KV+k_R)"]) == held and list(table["bytes (K+V)"]) == full
    assert list(table["cache holds: c_KV"]) == [f"[2, 1, {t}, 16]"] * 2
    latex, sentence = cache.memory_formula(trace, step)
    per_layer = 2 * t * (16 + 8)  # B·t·(d_c + d_R)
    assert per_layer * 4 == held[0] and 2 * 4 * t * (24 + 8) * 4 == full[0]  # float32: 4 bytes a number
    assert f"= {per_layer:,}" in latex
    assert f"{sum(held) / 1024:,.1f} KiB at step {step}" in sentence
    assert f"{sum(full) / 1024:,.1f} KiB, {full[0] / held[0]:.1f}× as much" in sentence
    growth = cache.cache_growth(trace)
    assert growth["K+V bytes (all layers)"].iloc[step] == sum(held)  # what the cache holds, not K and V
    from gpt_shape_tracer.tracer.costs import kv_cache_bytes

    assert kv_cache_bytes(trace, step) == sum(held)
    fig = cache.key_heatmap_figure(trace, step, 1, 0, which="c_KV")
    z = fig.data[0].z
    assert len(z) == t and len(z[0]) == 16 and "one for all heads" in fig.layout.title.text


@pytest.fixture(scope="module")
def app():
    from tests.app.test_app import new_app

    return new_app()


@pytest.mark.parametrize("model_type", ["deepseek_v3", "gpt_oss", "falcon_h1"])
def test_every_tab_renders_for(app, directories, model_type):
    """As tests/app/test_app_architectures.py: load, step twice, every tab and every What-if view without an error."""
    from html import unescape

    from tests.app.test_app import press, press_reset, show_tab
    from tests.app.test_app_architectures import choose_directory, every_tab_without_error

    at = app
    choose_directory(at, directories[model_type])
    press(at, "load_model")
    press_reset(at)  # confirms the discard when the previous type's generation is there
    press(at, "step_button")
    show_tab(at, "Attention")
    press(at, "step_button")
    every_tab_without_error(at)
    for sub in ("Switch heads off", "Activation patching", "Logit attribution", "Logit lens"):
        show_tab(at, "What if", ("whatif_view", sub))
        assert not at.error, (sub, [e.value for e in at.error])
    assert any(f"{model_type} (hf:{model_type})" in unescape(c.value) for c in at.caption)
    gen = at.session_state["app"].live.generation
    assert gen.n_steps == 2 and gen.model.identity.family == f"hf:{model_type}"
    if gen.model.config.latent_attention:  # the KV cache view says what the cache holds, from the numbers
        from gpt_shape_tracer.figures.cache import memory_formula

        show_tab(at, "KV cache")
        _, sentence = memory_formula(gen.trace, 1)
        assert any(c.value == sentence for c in at.caption), [c.value for c in at.caption]
    if "falcon_h1" in model_type:  # the KV cache view says what the state layers hold, from the numbers
        from gpt_shape_tracer.figures.cache import state_sentence

        show_tab(at, "KV cache")
        sentence = state_sentence(gen.trace, 1)
        assert sentence and any(c.value == sentence for c in at.caption), [c.value for c in at.caption]
    if gen.model.config.attn_sinks:  # the Attention tab says how much went to the sink, from the numbers
        from gpt_shape_tracer.figures.pitfalls import sink_sentence

        show_tab(at, "Attention")
        layer, head = at.selectbox(key="attn_layer").value, at.selectbox(key="attn_head").value
        batch = at.selectbox(key="attn_batch").value if gen.facts.batch_size > 1 else 0
        sentence = sink_sentence(gen.trace, 1, int(layer), int(head), int(batch))
        assert sentence and any(c.value == sentence for c in at.caption), [c.value for c in at.caption]


def test_the_shapes_legend_and_the_model_line_name_both_head_sizes():
    from gpt_shape_tracer.gui.shapes import LEGEND, legend
    from gpt_shape_tracer.model.gpt import GPTConfig

    plain = GPTConfig(family="hf", n_layer=1, d_model=64, n_head=4, head_dim=16)
    assert legend(plain) == LEGEND and "d_qk" not in legend(plain)
    latent = GPTConfig(family="hf", n_layer=1, d_model=64, n_head=4, head_dim=24, v_head_dim=8, kv_latent_dim=16,
                       rope_key_dim=8)
    text = legend(latent)
    assert "d_qk = d_k = 24" in text and "d_v = 8" in text and "d_c = 16" in text and "d_R = 8" in text
    assert latent.cache_width == 16 + 8 and plain.cache_width == 2 * 4 * 16  # numbers per position per layer


def test_the_cheaper_cache_experiment_refuses_latent_attention(directories):
    from gpt_shape_tracer.tracer import cache_precision

    gen = traced(directories["deepseek_v3"], steps=1)
    with pytest.raises(ValueError, match="multi-head latent attention"):
        cache_precision(gen, "int8", 2)


def test_attention_sinks_are_a_stage_of_their_own(directories):
    """gpt-oss: logits equal transformers'; the keys' weights and the sink's sum to 1 per row, the keys' alone to
    less; the views that recompute a head from Q, K, M (and the sink logit) get the model's own numbers."""
    from gpt_shape_tracer.figures.attention import attention_latex, attention_stages
    from gpt_shape_tracer.figures.flash import flash_attention
    from gpt_shape_tracer.figures.pitfalls import pitfall_patterns, sink_sentence

    gen = traced(directories["gpt_oss"])
    deltas = logit_deltas(gen, reference(directories["gpt_oss"]))
    print("gpt_oss max |Δ logits| per step:", [f"{d:.1e}" for d in deltas])
    assert max(deltas) <= 1e-4, deltas
    trace, config = gen.trace, gen.model.config
    assert config.attn_sinks and "s_h" in attention_latex(trace, 3, 0)
    for step in (0, 3):
        for layer in range(config.n_layer):
            pattern = trace.get(f"blocks.{layer}.attn.hook_pattern", step)  # [B, H, n, t]
            sink = trace.get(f"blocks.{layer}.attn.hook_sink_weight", step)  # [B, H, n, 1]
            assert torch.allclose(pattern.sum(-1) + sink[..., 0], torch.ones(()), atol=1e-5)
            assert (pattern.sum(-1) < 1).all() and (sink > 0).all()
            logits = trace.get(f"blocks.{layer}.attn.hook_sink_logits", step)  # [B, H, n, 1]: s_h on every row
            own = gen.model.hf.model.layers[layer].self_attn.sinks
            assert torch.equal(logits[0, :, 0, 0], own.detach())
            for head in (0, 3):
                redone = pitfall_patterns(trace, step, layer, head, batch=1)["as the model does it"]
                assert torch.allclose(redone, pattern[1, head].double(), atol=1e-5), (step, layer, head)
                assert flash_attention(trace, step, layer, head, batch=1, block=4).max_abs_delta <= 1e-5
    titles = [s.title for s in attention_stages(trace, 3, 0, 0)]
    assert titles[-2:] == [titles[-2], "a_sink = 1 − Σ_t A"] and "s_h" in titles[-3]
    sentence = sink_sentence(trace, 3, 1, 2, batch=0)
    w = trace.get("blocks.1.attn.hook_sink_weight", 3)[0, 2, :, 0].double()  # one decode row
    assert f"the sink took {float(w.mean()):.1%}" in sentence and f"sum to {1 - float(w.max()):.3f}" in sentence
    prefill = sink_sentence(trace, 0, 1, 2, batch=1)  # "Tom said": left padding, whose rows are left out
    real = torch.tensor(gen.facts.is_token(1, 0))
    w0 = trace.get("blocks.1.attn.hook_sink_weight", 0)[1, 2, :, 0].double()[real]
    assert f"over its {int(real.sum())} query rows" in prefill and f"took {float(w0.mean()):.1%}" in prefill


def test_a_hybrid_model_keeps_its_state_in_transformers_cache_beside_our_k_and_v(directories):
    """Falcon-H1 (attention and a Mamba-2 mixer in every layer): logits equal transformers' at the prefill and 3
    cached steps; the state recorded after the last step is the state transformers' own cache holds after one
    forward of the same columns; the KV cache view counts it; a copy of the cache at an earlier length replays a
    step exactly (the what-if experiments start from such copies)."""
    from transformers import DynamicCache

    from gpt_shape_tracer.figures import cache

    gen = traced(directories["falcon_h1"])
    ref = reference(directories["falcon_h1"])
    deltas = logit_deltas(gen, ref)
    print("falcon_h1 max |Δ logits| per step:", [f"{d:.1e}" for d in deltas])
    assert max(deltas) <= 1e-4, deltas
    trace, last, B = gen.trace, gen.n_steps - 1, len(PROMPTS)
    ids = torch.tensor([gen.facts.columns(r, last) for r in range(B)])
    real = torch.tensor([gen.facts.is_token(r, last) for r in range(B)])
    theirs = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=real.long(), position_ids=(real.long().cumsum(-1) - 1).clamp(min=0),
            past_key_values=theirs, use_cache=True)
    for layer in range(gen.model.config.n_layer):
        conv = trace.get(f"blocks.{layer}.hook_conv_state", last)
        ssm = trace.get(f"blocks.{layer}.hook_ssm_state", last)
        held = theirs.layers[layer]
        assert conv.shape == held.conv_states[0].shape and ssm.shape == held.recurrent_states[0].shape
        assert (conv - held.conv_states[0]).abs().max() <= 1e-4
        assert (ssm - held.recurrent_states[0]).abs().max() <= 1e-4
        assert trace.record(f"blocks.{layer}.hook_ssm_state", 0).shape == ssm.shape  # fixed: it does not grow
    table = cache.cache_table(trace, last)
    state = [sum(rec.nbytes for rec in cache.state_records(trace, last, L)) for L in range(2)]
    assert list(table["state bytes"]) == state and state[0] > 0
    sentence = cache.state_sentence(trace, last)
    assert f"{sum(state) / 1024:,.1f} KiB in all after step {last}" in sentence and "2 layers keep their" in sentence
    kv = sum(trace.record(f"blocks.{L}.attn.hook_{k}_all", last).nbytes for L in range(2) for k in "kv")
    assert cache.cache_growth(trace)["K+V bytes (all layers)"].iloc[last] == kv + sum(state)
    # replay step 2 from a copy of the cache as it was before it: the same logits, to the bit. The traced step ran
    # the fused kernel (its stages are derived from Q and K when read): the same path is forced, so that only the
    # cache can make a difference
    before = gen.facts.step(2).forward.cache_before
    copy = gen.cache.copy(before)
    fed = torch.tensor([[gen.facts.columns(r, 2)[-1]] for r in range(B)])
    with torch.no_grad(), attention_path("fused"):
        again = gen.model(fed, cache=copy)
    assert torch.equal(again, trace.get("hook_logits", 2))
    with pytest.raises(ValueError, match="a copy can hold"):
        gen.cache.copy(before + 99)


def test_granites_sink_drawn_as_the_keys_share_is_transformers_softmax_scaled(tmp_path):
    """Granite's sliding-window family returns the softmax over the keys alone and scales O by
    σ(logsumexp(scores + M) − s_h) after it (transformers' eager path); the trace draws A as the keys' share of a
    softmax over the keys and the sink. The sink sentence says the two are one computation: each recorded row of A is
    transformers' row times that row's scale, and renormalised it is transformers' row."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpt_shape_tracer.figures.pitfalls import sink_sentence
    from gpt_shape_tracer.tracer import Tracer
    from tests.hf_every_architecture import build

    directory = build("granite_swa", tmp_path / "granite_swa")
    model, _ = load_hf(directory, implementation="transformers")
    ids = torch.tensor([[3, 17, 41, 8, 99, 5]])
    with Tracer(model) as tracer:
        model(ids)
    trace = tracer.trace
    ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        weights = ref(input_ids=ids, output_attentions=True).attentions
    for layer in range(model.config.n_layer):
        a = trace.get(f"blocks.{layer}.attn.hook_pattern", 0)  # [1, H, n, t]
        sink = trace.get(f"blocks.{layer}.attn.hook_sink_weight", 0)[..., 0]  # [1, H, n]
        w = weights[layer]
        assert torch.allclose(a.sum(-1), 1 - sink, atol=1e-5)
        assert torch.allclose(a / a.sum(-1, keepdim=True), w, atol=1e-5)
        assert torch.allclose(a, w * (1 - sink)[..., None], atol=1e-5)
    assert "the same O; A here is the keys' share after the sink" in sink_sentence(trace, 0, 0, 0)
