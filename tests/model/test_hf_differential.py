"""Differential attention (issue 51, item 3): DiffLlama's layers call transformers' attention function twice per
forward with the same Q and K — once with each half of V — and combine query heads j and j + H/2 as
(A_j − λ·A_{j+H/2})·[V_1, V_2] (Ye et al. 2024, "Differential Transformer"). Traced, each layer records the softmax
of all H heads as any layer does (hook_pattern), its two halves under their own names (hook_pattern_1,
hook_pattern_2), λ (hook_diff_lambda) and the combined pattern the layer really applies (hook_diff_pattern), with the
second call's values and output (hook_v_all_2, hook_z_2). The logits equal transformers' eager forward; the recorded
patterns equal ones recomputed here from the recorded Q, K and mask; the combined pattern applied to the recorded
values equals what transformers' own module feeds its group norm."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder, HFDecoderError
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_every_architecture import DECODE_STEPS, TOLERANCE, build, check, tiny_config
from tests.tolerance import assert_close_across_cpus


@pytest.fixture(scope="module")
def directory() -> Path:
    return build_diffllama(Path(tempfile.mkdtemp(prefix="hf-diffllama-")) / "diffllama")


def build_diffllama(out: Path) -> Path:
    """A tiny random-weight DiffLlama (4 query heads, 2 key/value heads) with the bundled tokenizer's vocabulary."""
    import transformers

    import tests.hf_every_architecture as every

    values = {**tiny_config("diffllama").to_dict(), "vocab_size": 1024}
    original = every.tiny_config
    every.tiny_config = lambda _: transformers.CONFIG_MAPPING["diffllama"](**values)  # type: ignore[assignment]
    try:
        build("diffllama", out)
    finally:
        every.tiny_config = original
    (out / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return out


def test_logits_equal_transformers_at_the_prefill_and_three_cached_steps(directory):
    result = check("diffllama", directory)
    assert result.outcome == "traced" and len(result.deltas) == 1 + DECODE_STEPS, result
    assert max(result.deltas) <= TOLERANCE, result


def test_both_softmaxes_and_the_differential_pattern_are_recorded_and_recomputed(directory):
    """Left-padded batch of two, 3 steps after the prefill. At every step and layer: the two softmaxes are the halves
    of the softmax of QKᵀ·s + M recomputed from the recorded Q, K and M; λ is exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init
    of the module's own parameters; the differential pattern is A_1 − λ·A_2, and applied to both calls' values it is
    what transformers' module hands its group norm (recorded at the module's input, not computed by our code)."""
    model, tok = load_hf(directory, implementation="transformers")
    assert isinstance(model, HFDecoder)
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said"], temperature=0, padding_side="left")
    gen.run(1 + DECODE_STEPS)
    trace, config = gen.trace, model.config
    H, G = config.n_head, config.n_kv_heads
    half = H // 2
    for layer in range(config.n_layer):
        attn = model.hf.model.layers[layer].self_attn
        lam = (torch.exp((attn.lambda_q1 * attn.lambda_k1).sum()) - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
               + attn.lambda_init)
        for step in range(gen.n_steps):
            def get(name: str, layer: int = layer, step: int = step) -> torch.Tensor:
                value = trace.get(f"blocks.{layer}.attn.{name}", step)
                assert value is not None, name
                return value

            q, k, mask = get("hook_q"), get("hook_k_all"), get("hook_mask")  # [B,H,n,d], [B,G,t,d], [B|1,1,n,t]
            scores = q @ k.repeat_interleave(H // G, dim=1).transpose(-2, -1) * attn.scaling + mask
            pattern = torch.softmax(scores.float(), dim=-1)  # [B,H,n,t]
            first, second = get("hook_pattern_1"), get("hook_pattern_2")
            assert first.shape == second.shape == (q.shape[0], half, q.shape[2], k.shape[2])
            assert_close_across_cpus(first, pattern[:, :half], f"layer {layer} step {step} A_1")
            assert_close_across_cpus(second, pattern[:, half:], f"layer {layer} step {step} A_2")
            assert_close_across_cpus(get("hook_diff_lambda"), lam.reshape(1).float(), "λ")
            combined = get("hook_diff_pattern")
            assert_close_across_cpus(combined, pattern[:, :half] - lam * pattern[:, half:], "A_1 − λ·A_2")
            # the pattern the layer applies: to [V_1, V_2] of each differential head's key/value head
            both = torch.cat([get("hook_v_all"), get("hook_v_all_2")], dim=-1)  # [B,G,t,2·d]
            values = both.repeat_interleave(H // G, dim=1)[:, :half]  # head j reads key/value head j // (H/G)
            applied = (combined @ values).transpose(1, 2)  # [B,n,H/2,2·d]
            theirs = trace.get(f"hf.model.layers.{layer}.self_attn.groupnorm:in[0]", step)
            assert theirs is not None and theirs.shape == applied.shape
            assert_close_across_cpus(applied, theirs, f"layer {layer} step {step}: (A_1 − λ·A_2)·V")
    assert gen.cache.keys[0] is not None and gen.cache.keys[0].shape[2] == trace.record(
        "blocks.0.attn.hook_k_all", gen.n_steps - 1).shape[2]  # one K, V cache row per position, as any layer


def test_a_differential_head_output_is_not_split_per_head(directory):
    """Per-head outputs through W_O assume each head's A·V reaches W_O alone; a differential layer subtracts head
    pairs and group-normalises them first, so it is refused with what the layer does, not computed wrong."""
    model, _ = load_hf(directory, implementation="transformers")
    hooks = model.blocks[0].attn
    with pytest.raises(HFDecoderError, match="differential attention layer combines its heads in pairs"):
        hooks.head_outputs(torch.zeros(1, model.config.n_head, 1, model.config.d_head))


def test_every_tab_renders_for_a_differential_model(directory):
    """DiffLlama in the real app (AppTest): loaded, two steps, every tab and every What-if view rendered at layer 0
    without an error (its H heads' softmax drawn as any model's; per-head outputs refused in words, not failing)."""
    from tests.app.test_app import TABS, show_tab
    from tests.app.test_app_architectures import opened_and_stepped

    at = opened_and_stepped(directory)
    gen = at.session_state["app"].live.generation
    assert gen.n_steps == 2 and gen.model.identity.family == "hf:diffllama"
    for tab in TABS:
        show_tab(at, tab)
        assert not at.error, (tab, [e.value for e in at.error])
    for sub in ("Switch heads off", "Activation patching", "Logit attribution", "Logit lens"):
        show_tab(at, "What if", ("whatif_view", sub))
        assert not at.error, (sub, [e.value for e in at.error])
    # the Attention tab's Differential view: the head's own numbers, counted from the records
    from gpt_shape_tracer.figures.differential import differential_head, differential_sentence
    from tests.app.test_app import charts

    show_tab(at, "Attention", ("attn_view", "Differential"))
    assert not at.error, [e.value for e in at.error]
    d = differential_head(gen.trace, 1, 0, 0, 0)
    assert any(differential_sentence(d) in m.value for m in at.markdown)
    drawn = [f for f in charts(at) if "what differential head 0 applies" in f["layout"]["title"]["text"]]
    assert len(drawn) == 1 and len(drawn[0]["data"]) >= 3


def test_the_differential_view_counts_what_the_records_hold(directory):
    """Every step, both sequences of a left-padded batch, every differential head: the view's A_1, A_2 and λ are the
    records', what it applies is A_1 − λ·A_2, its rows sum to 1 − λ (two softmaxes, each summing to 1), and its
    sentence states the extremes, the row sum and the count of negative weights it was given."""
    from gpt_shape_tracer.figures.differential import differential_figure, differential_head, differential_sentence
    from gpt_shape_tracer.model.gpt import act_name

    model, tok = load_hf(directory, implementation="transformers")
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said"], temperature=0, padding_side="left")
    gen.run(3)
    trace, H = gen.trace, model.config.n_head
    for step in range(3):
        for batch in (0, 1):
            for head in range(H):
                d = differential_head(trace, step, 0, head, batch)
                assert d is not None and d.head == head % (H // 2)
                lam = float(trace.get("blocks.0.attn.hook_diff_lambda", step)[0])
                assert d.lam == lam
                assert torch.equal(d.first, trace.get(act_name("pattern", 0), step)[batch, d.head].float())
                assert torch.equal(d.second, trace.get(act_name("pattern", 0), step)[batch, d.head + H // 2].float())
                assert torch.allclose(d.applied, d.first - lam * d.second, atol=1e-6)
                assert torch.allclose(d.row_sums, torch.full_like(d.row_sums, 1 - lam), atol=1e-5)
                said = differential_sentence(d)
                assert f"1 − λ = {1 - lam:.3f}" in said and f"{float(d.applied[d.real_rows].min()):.3f}" in said
                negative = int((d.applied[d.real_rows] < 0).sum())
                assert (f"{negative} of its {d.cells} weights are negative" in said) == (negative > 0)
                fig = differential_figure(trace, d)
                assert len([t for t in fig.data if t.type == "heatmap" and t.hoverinfo != "skip"]) == 3
    assert differential_head(trace, 0, 0, 0, 0) is not None
