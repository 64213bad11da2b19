"""Indexed (sparse) attention, traced instead of refused (issue 51, item 1): DeepSeek-V3.2's DeepSeek Sparse
Attention and the families built on it — GLM-5 (glm_moe_dsa), HY-V4 (with "shared" layers that reuse the previous
layer's choice), dots3, AXK2 — and Qwen4-Exp's block-wise QSA, each a tiny random-weight model built from
transformers' own config class with a top-k below the prompt's length, so that keys really are skipped.

Checked against transformers itself: the logits at the prefill and three cached steps; the pattern against the
attention weights transformers' eager path returns (where it folds the indexer's choice into its mask); the
indexer's key cache against the one transformers' ``DynamicIndexedLayer`` holds after the same tokens. And against
the records themselves: the pattern recomputed from Q, K and M, M hiding exactly the keys not chosen, the chosen
keys the top-k of the recorded scores. Then our cache's transactions with the indexer's keys, and the view."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.figures.indexed import (
    cache_sentence,
    indexed_layers,
    indexer_step,
    selection_figure,
    selection_sentence,
)
from gpt_shape_tracer.figures.mask import mask_facts
from gpt_shape_tracer.figures.view_takeaways import mask_takeaway
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.gpt import KVCache, act_name
from gpt_shape_tracer.model.sources import BUNDLED_DIR
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_every_architecture import TOLERANCE, check, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DSA = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "dots3_note_text", "axk2")
TYPES = (*DSA, "qwen4_exp_text")
PROMPTS = ["Lily had a red kite and a dog.", "Tom said"]  # a left-padded batch of two


def build_indexed(model_type: str, directory: Path) -> Path:
    """As tests/hf_every_architecture.build (its tiny config: top-k 4, HY-V4 one full and one shared layer), with
    the bundled tokenizer's vocabulary and tokenizer, so that text can be traced."""
    import transformers

    import tests.hf_every_architecture as every

    values = tiny_config(model_type).to_dict()
    values["vocab_size"] = 1024
    original = every.tiny_config
    every.tiny_config = lambda _: transformers.CONFIG_MAPPING[model_type](**values)  # type: ignore[assignment]
    try:
        every.build(model_type, directory)
    finally:
        every.tiny_config = original
    (directory / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return directory


@pytest.fixture(scope="module")
def root() -> Path:
    return Path(tempfile.mkdtemp(prefix="hf-indexed-"))


@pytest.fixture(scope="module")
def traces(root):
    """One traced generation per type: the left-padded batch, the prefill and 3 cached steps."""
    out = {}
    for model_type in TYPES:
        model, tok = load_hf(build_indexed(model_type, root / model_type), implementation="transformers")
        gen = TracedGeneration(model, tok, PROMPTS, temperature=0, padding_side="left")
        gen.run(4)
        out[model_type] = gen
    return out


@pytest.mark.parametrize("model_type", TYPES)
def test_logits_equal_transformers_at_the_prefill_and_three_cached_steps(root, model_type):
    result = check(model_type, build_indexed(model_type, root / f"check-{model_type}"))
    assert result.outcome == "traced", result
    assert len(result.deltas) == 4 and max(result.deltas) <= TOLERANCE, result


@pytest.mark.parametrize("model_type", TYPES)
def test_the_indexer_really_skips_keys_and_m_hides_exactly_those(traces, model_type):
    """Every indexed layer at every step: the chosen keys are visible ones; M is 0 at the chosen keys and −∞ at
    every other (a row that sees something); the pattern is zero wherever M is −∞; and somewhere keys were skipped."""
    gen = traces[model_type]
    trace = gen.trace
    skipped_somewhere = False
    for step in range(4):
        layers = indexed_layers(trace, step)
        assert layers == list(gen.model.config.indexed_layers) and layers
        for layer in layers:
            visible = trace.get(act_name("index_visible", layer), step)
            selected = trace.get(act_name("index_selected", layer), step)
            mask = trace.get(act_name("mask", layer), step)[:, 0]  # [B, n, t]
            pattern = trace.get(act_name("pattern", layer), step)
            assert visible.dtype == selected.dtype == torch.bool
            assert not (selected & ~visible).any()
            rows = visible.any(dim=-1, keepdim=True).expand_as(visible)  # a row that sees a key (not a padding row)
            assert torch.equal((mask == 0) & rows, selected & rows)
            assert torch.isinf(mask[rows & ~selected]).all()
            assert (pattern.transpose(0, 1)[:, rows & ~selected] == 0).all()
            skipped_somewhere |= bool((visible & ~selected).any())
    assert skipped_somewhere


@pytest.mark.parametrize("model_type", TYPES)
def test_the_pattern_is_the_softmax_of_the_recorded_q_k_and_m(traces, model_type):
    gen = traces[model_type]
    trace, hf = gen.trace, gen.model.hf
    attn = {int(name.split(".")[-2]): m for name, m in hf.named_modules() if name.endswith("layers.0.self_attn")
            or name.endswith("layers.1.self_attn")}  # each layer's attention module: its own scale
    for step in (0, 3):
        for layer in indexed_layers(trace, step):
            q, k = trace.get(act_name("q", layer), step), trace.get(act_name("k_all", layer), step)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = q @ k.transpose(-2, -1) * attn[layer].scaling + trace.get(act_name("mask", layer), step)
            sink = trace.get(act_name("sink_logits", layer), step) if trace.has(act_name("sink_logits", layer), step) \
                else None  # HY-V4 has a learned sink logit per head too
            expected = torch.softmax(scores if sink is None else torch.cat([scores, sink], dim=-1), dim=-1)
            expected = expected if sink is None else expected[..., :-1]
            assert torch.allclose(trace.get(act_name("pattern", layer), step), expected, atol=1e-5)


@pytest.mark.parametrize("model_type", DSA)
def test_the_chosen_keys_are_the_top_k_of_the_recorded_scores(traces, model_type):
    """A DSA indexer's scores are recorded (−∞ where the mask hides a key); its choice is their top-k among the
    visible keys, k = index_topk of the config (4 here)."""
    gen = traces[model_type]
    trace, top_k = gen.trace, gen.model.hf.config.index_topk
    for step in range(4):
        for layer in indexed_layers(trace, step):
            if not trace.has(act_name("index_scores", layer), step):  # a "shared" layer runs no indexer of its own:
                # it applies an earlier layer's choice
                assert model_type == "hy_v4"
                continue
            scores = trace.get(act_name("index_scores", layer), step)
            visible = trace.get(act_name("index_visible", layer), step)
            chosen = torch.zeros_like(visible).scatter(-1, scores.topk(min(top_k, scores.shape[-1])).indices, True)
            assert torch.equal(chosen & visible, trace.get(act_name("index_selected", layer), step))


def test_a_shared_layer_applies_the_previous_layers_choice(traces):
    trace = traces["hy_v4"].trace
    for step in range(4):
        assert trace.has(act_name("index_scores", 0), step) and not trace.has(act_name("index_scores", 1), step)
        assert torch.equal(trace.get(act_name("index_selected", 0), step),
                           trace.get(act_name("index_selected", 1), step))
        s = indexer_step(trace, step, 1, batch=0)
        assert s is not None and not s.own and "applies the choice an earlier layer's indexer made" in \
            selection_sentence(s)


@pytest.mark.parametrize("model_type", ("deepseek_v32", "qwen4_exp_text"))
def test_the_pattern_and_the_indexer_keys_equal_transformers_own(root, traces, model_type):
    """One sequence, no padding: transformers' eager forward with its own DynamicCache over the same tokens returns
    the attention weights (the indexer's choice folded into its mask) and holds the indexer's keys."""
    from transformers import AutoModelForCausalLM, DynamicCache

    directory = root / model_type
    model, tok = load_hf(directory, implementation="transformers")
    gen = TracedGeneration(model, tok, [PROMPTS[0]], temperature=0)
    gen.run(3)
    trace = gen.trace
    ids = torch.tensor([gen.tokens(0)])  # the prompt and the tokens generated
    ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        out = ref(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True, output_attentions=True)
    last = ids.shape[1] - 2  # the step whose forward ended at the last position fed
    for layer in indexed_layers(trace, 0):
        n0 = trace.get(act_name("pattern", layer), 0).shape[-2]
        weights = out.attentions[model.config.attention_layers.index(layer)]  # one per softmax attention layer
        assert torch.allclose(trace.get(act_name("pattern", layer), 0), weights[:, :, :n0, :n0], atol=1e-5)
        keys = trace.get(act_name("index_keys_all", layer), 2)
        assert keys.shape[1] == ids.shape[1] - 1 and keys.shape[1] == last + 1
        assert torch.allclose(keys, cache.layers[layer].indexer_keys, atol=1e-6)


def test_the_cache_keeps_the_indexer_keys_with_k_and_v():
    """KVCache's indexer buffers follow K and V: counted at commit, forgotten by a rollback, required of every
    indexed layer, and copied, reordered and cropped with them."""
    cache = KVCache(2, 2, indexed=(1,))
    k, v, ik = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4), torch.randn(2, 3, 5)
    cache.append(0, k, v)
    cache.append(1, k, v)
    with pytest.raises(RuntimeError, match=r"indexer keys of layers \[1\]"):
        cache.commit(3, None)
    assert cache.length == 0
    cache.append(0, k, v)
    cache.append(1, k, v)
    assert torch.equal(cache.append_indexer(1, ik), ik)
    cache.commit(3, None)
    assert torch.equal(cache.indexer_keys[1], ik) and cache.indexer_nbytes == ik.numel() * 4
    cache.append(0, k[:, :, :1], v[:, :, :1])
    cache.append_indexer(1, ik[:, :1])
    cache.rollback()  # a failed forward: its rows are forgotten
    assert torch.equal(cache.indexer_keys[1], ik)
    twin = cache.copy(2)
    assert torch.equal(twin.indexer_keys[1], ik[:, :2])
    cache.reorder(torch.tensor([1, 0]))
    assert torch.equal(cache.indexer_keys[1], ik.flip(0))
    cache.crop(1)
    assert torch.equal(cache.indexer_keys[1], ik.flip(0)[:, :1])
    with pytest.raises(ValueError, match="keeps no indexer key cache"):
        cache.append_indexer(0, ik)


@pytest.mark.parametrize("model_type", ("hy_v4", "qwen4_exp_text"))
def test_the_view_counts_what_the_records_hold(traces, model_type):
    """The Indexer view's numbers, its sentences and the mask's takeaway, over the steps and both sequences."""
    trace = traces[model_type].trace
    for step in range(4):
        for batch in (0, 1):
            layer = indexed_layers(trace, step)[0]
            s = indexer_step(trace, step, layer, batch)
            visible = trace.get(act_name("index_visible", layer), step)[batch]
            selected = trace.get(act_name("index_selected", layer), step)[batch]
            assert (s.seen, s.chosen) == (int(visible.sum()), int(selected.sum()))
            said = selection_sentence(s)
            assert f"skipped {s.seen - s.chosen}" in said and str(s.seen) in said
            keys = trace.record(act_name("index_keys_all", layer), step)
            assert f"{tuple(keys.shape)}".replace(" ", "") in cache_sentence(s).replace(" ", "").replace("[", "(") \
                .replace("]", ")") or str(list(keys.shape)[1]) in cache_sentence(s)
            fig = selection_figure(trace, s)
            chosen_panel = fig.data[-1].z
            assert int((chosen_panel == 1).sum()) == s.chosen and int((chosen_panel == 0).sum()) == s.seen - s.chosen
            facts = mask_facts(trace, step, layer, batch)
            assert facts.unexplained == 0 and facts.indexer == s.seen - s.chosen
            if step > 0 and facts.indexer:
                said = mask_takeaway(facts).sentence  # the indexer alone, or named among the other causes
                assert (f"{facts.indexer} not chosen by the indexer" in said if facts.padding_key or facts.window
                        else f"; {facts.indexer} of them are −∞ because the indexer did not choose the key." in said)


def test_the_app_shows_the_indexers_choice(root):
    """The real app on HY-V4 (a full and a shared indexed layer): Load, Step, Step, the Attention tab's Indexer view
    says what the indexer chose at this step — the same numbers as the records — and draws it; the Causal mask
    view attributes the skipped keys to the indexer, none to an unknown reason."""
    from gpt_shape_tracer.figures.mask import mask_facts
    from tests.app.test_app import charts, show_tab
    from tests.app.test_app_architectures import opened_and_stepped

    directory = build_indexed("hy_v4", root / "app-hy_v4")
    at = opened_and_stepped(directory)
    show_tab(at, "Attention", ("attn_view", "Indexer"))
    assert not at.error, [e.value for e in at.error]
    trace = at.session_state["app"].live.generation.trace
    step = trace.n_steps - 1
    s = indexer_step(trace, step, 0, 0)
    assert any(selection_sentence(s) in m.value for m in at.markdown)
    drawn = [f for f in charts(at) if "its indexer chose" in f["layout"]["title"]["text"]]
    assert len(drawn) == 1 and f"({s.chosen} of {s.seen} visible)" in drawn[0]["layout"]["title"]["text"]
    chosen = [v for row in drawn[0]["data"][-1]["z"] for v in row]
    assert chosen.count(1) == s.chosen and chosen.count(0) == s.seen - s.chosen
    show_tab(at, "Causal mask")
    assert not at.error, [e.value for e in at.error]
    assert mask_facts(trace, step, 0, 0).unexplained == 0
