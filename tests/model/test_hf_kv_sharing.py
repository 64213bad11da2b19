"""KV sharing (issue 51, Gemma 3n): as in the real checkpoints, the last ``num_kv_shared_layers`` layers compute no K
and V of their own and attend over those of the last earlier layer of their kind. Such a layer makes no cache update,
which the cache's guard took for a failed forward ("KV cache commit with layers [2, 3] not updated"); traced, it is a
layer that reads another's K and V — found by the very tensor its attention receives — whose cache holds no rows,
and the KV-cache view says which layer it reads. A tiny random-weight Gemma 3n text model (the sweep's tiny config,
which keeps a producing and a reading layer of each kind), compared with transformers' eager forward at the prefill
and 3 cached decode steps."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_every_architecture import PROMPT, TOLERANCE, build, check, tiny_config


def small_config():
    """The sweep's tiny Gemma 3n text config (4 layers: sliding, full, then one reading layer of each), with its
    per-layer feed-forward widths made small and the bundled tokenizer's vocabulary."""
    import transformers

    values = tiny_config("gemma3n_text").to_dict()
    values.update(intermediate_size=[128] * values["num_hidden_layers"], vocab_size=1024,
                  vocab_size_per_layer_input=1024)
    return transformers.Gemma3nTextConfig(**values)


@pytest.fixture(scope="module")
def directory() -> Path:
    import tests.hf_every_architecture as every

    path = Path(tempfile.mkdtemp(prefix="hf-kv-sharing-")) / "gemma3n_text"
    original = every.tiny_config
    every.tiny_config = lambda _: small_config()  # type: ignore[assignment]
    try:
        build("gemma3n_text", path)
    finally:
        every.tiny_config = original
    (path / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return path


def test_the_sweep_builds_gemma3n_with_kv_sharing_layers():
    """The sweep's tiny config keeps the layout real checkpoints have: a layer producing each kind's K and V, then
    a layer of each kind reading them (transformers' own config says which reuses)."""
    config = tiny_config("gemma3n_text")
    assert config.num_kv_shared_layers == 2 and config.num_hidden_layers == 4
    assert config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    assert config.layer_types[:2] == config.layer_types[2:] and len(set(config.layer_types)) == 2


def test_kv_sharing_layers_traced_with_logits_equal_to_transformers(directory):
    result = check("gemma3n_text", directory)
    assert result.outcome == "traced" and len(result.deltas) == 4 and max(result.deltas) <= TOLERANCE, result
    model, _ = load_hf(directory, implementation="transformers")
    assert isinstance(model, HFDecoder)
    # which layer each reads, against transformers' own config: the last earlier non-reading layer of its kind
    hf_config = model.hf.config
    modes, kinds = hf_config.kv_sharing_modes, hf_config.layer_types
    expected = tuple((L, max(P for P in range(L) if modes[P] != "reuse" and kinds[P] == kinds[L]))
                     for L in range(len(modes)) if modes[L] == "reuse")
    assert model.config.kv_shared == expected == ((2, 0), (3, 1))
    assert model.config.kv_source(2) == 0 and model.config.kv_source(0) is None
    sentence = model.config.kv_shared_sentence(3)
    assert sentence is not None and sentence.startswith("layer 3 computes no K and V of its own: it attends over "
                                                        "layer 1's")
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.arange(PROMPT)[None] % 200, cache)
        model(torch.tensor([[7]]), cache)
    assert [None if k is None else k.shape[2] for k in cache.keys] == [PROMPT + 1, PROMPT + 1, None, None]


def test_a_reading_layer_attends_over_its_source_layers_k_and_v(directory, tmp_path):
    """Traced for a prefill and 3 steps: layer 2's K and V are layer 0's at every step, and its pattern is the
    softmax of its own queries against them (recomputed here from the records); the KV-cache view counts no bytes
    for it and says which layer it reads; a saved trace keeps which layer reads which."""
    from gpt_shape_tracer.figures import cache
    from gpt_shape_tracer.tracer import load_trace, save_trace
    from gpt_shape_tracer.tracer.costs import kv_cache_bytes

    model, tok = load_hf(directory, implementation="transformers")
    assert tok is not None
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said"], temperature=0, padding_side="left")
    gen.run(4)
    trace = gen.trace
    scale = model.architecture.scale
    for step in range(4):
        for reader, source in ((2, 0), (3, 1)):
            for kind in ("k_all", "v_all"):
                assert torch.equal(trace.get(f"blocks.{reader}.attn.hook_{kind}", step),
                                   trace.get(f"blocks.{source}.attn.hook_{kind}", step)), (step, reader, kind)
            q = trace.get(f"blocks.{reader}.attn.hook_q", step)  # [B, H, n, d]
            k = trace.get(f"blocks.{source}.attn.hook_k_all", step)  # [B, G, t, d]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = q @ k.transpose(-2, -1) * scale + trace.get(f"blocks.{reader}.attn.hook_mask", step)
            pattern = torch.softmax(scores.float(), dim=-1)
            recorded = trace.get(f"blocks.{reader}.attn.hook_pattern", step)
            assert torch.allclose(recorded, pattern, atol=1e-6), (step, reader, float((recorded - pattern).abs().max()))
    step = 3
    table = cache.cache_table(trace, step)
    assert list(table["bytes (K+V)"][2:]) == [0, 0] and all(table["bytes (K+V)"][:2] > 0)
    assert list(table["K, V read from"][2:]) == ["layer 0 (KV sharing)", "layer 1 (KV sharing)"]
    held = sum(trace.record(f"blocks.{L}.attn.hook_{kind}", step).nbytes for L in (0, 1) for kind in ("k_all", "v_all"))
    assert kv_cache_bytes(trace, step) == held == sum(cache.held_bytes(trace, step, L) for L in range(4))
    _, sentence = cache.memory_formula(trace, step)
    assert sentence.startswith("2 layers ×") and "KV sharing: layer 2 reads 0's, 3 reads 1's" in sentence
    again = load_trace(save_trace(trace, tmp_path / "shared.gst"))
    assert again.config is not None and again.config.kv_shared == ((2, 0), (3, 1))


@pytest.mark.parametrize("model_type", ["gemma4_assistant", "gemma4_unified_assistant"])
def test_a_drafter_reading_every_k_and_v_from_its_main_model_is_refused_by_its_config(model_type, tmp_path):
    """Gemma 4's assistant (multi-token prediction): every layer attends over the keys and values the main model
    hands it (its config demands num_kv_shared_layers = num_hidden_layers), its forward takes no token ids. A
    directory of it is refused before anything is built, saying what it is and what to load; transformers itself
    builds no model from that config (its layers look for a layer of theirs computing the K/V they reuse) — the day
    it does, this test fails, and the drafter should be traced beside its main model."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from gpt_shape_tracer.model.sources import ModelLoadError

    config = tiny_config(model_type)
    text = config.get_text_config()
    assert text.num_kv_shared_layers == text.num_hidden_layers == 2
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as refused:
        load_hf(tmp_path)
    assert refused.value.reason == "drafter"
    message = str(refused.value)
    assert "none of its 2 layers computes keys or values" in message and "shared_kv_states" in message, message
    assert "load the model it drafts for" in message, message
    with pytest.raises(ValueError, match="layer types producing a cache"):
        getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config)
