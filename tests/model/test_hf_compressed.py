"""Compressed attention (DeepSeek-V4: model/sources/_hf_compressed.py), traced: a tiny random-weight V4 with a
sliding-window, a compressed sparse (CSA, with its indexer) and a heavily compressed (HCA) layer, as the real
checkpoints mix them (tests/hf_every_architecture.py's override), compared with transformers' eager forward; its
pattern against transformers' own attention weights and against one recomputed here from the recorded Q, K and
mask; its cache against transformers' own cache layers after the same steps; rollback, copy, crop and reorder; the
bytes against hand arithmetic from the config; the Over the steps section in the app."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model.sources import (
    BUNDLED_DIR,
    CompressedCache,
    compressed_cache_bytes,
    load_hf,
    uncompressed_cache_bytes,
)
from tests.hf_every_architecture import PROMPT, TOLERANCE, build, run, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS = 5  # cached steps after the prefill: CSA (m = 2) and HCA (m = 4) both add an entry within them


@pytest.fixture(scope="module")
def directory() -> Path:
    """The tiny V4 at the bundled tokenizer's vocabulary (so that the app can run it), with that tokenizer."""
    import transformers

    import tests.hf_every_architecture as every

    out = Path(tempfile.mkdtemp(prefix="hf-compressed-")) / "deepseek_v4"
    original = every.tiny_config
    every.tiny_config = lambda t: transformers.CONFIG_MAPPING[t](**{**original(t).to_dict(), "vocab_size": 1024})
    try:
        build("deepseek_v4", out)
    finally:
        every.tiny_config = original
    (out / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return out


def tokens(n: int = PROMPT + STEPS) -> torch.Tensor:
    return torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(3))


def reference(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def recording(model) -> dict[str, list[torch.Tensor]]:
    """Every hook point's tensors, in call order (taps on the model's own hook points)."""
    seen: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1].startswith("hook_"):
            module.add_tap(lambda x, name=name: seen.setdefault(name, []).append(x.detach().clone()))
    return seen


def test_the_tiny_config_has_every_layer_kind_real_checkpoints_use():
    config = tiny_config("deepseek_v4")
    assert set(config.layer_types) == {"sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention"}
    assert config.index_topk < PROMPT // config.compress_rates["compressed_sparse_attention"]  # really selects


def test_logits_equal_transformers_at_the_prefill_and_three_cached_steps():
    result = run("deepseek_v4")
    assert result.outcome == "traced", result
    assert len(result.deltas) == 4 and max(result.deltas) <= TOLERANCE


def test_the_pattern_equals_transformers_weights_and_one_recomputed_from_q_k_and_the_mask(directory):
    """Per layer and step: the recorded pattern against transformers' own eager attention weights
    (output_attentions) at the same step, and against softmax([QKᵀ·scale + M, sink]) without the sink's column,
    from the recorded Q, K (= V), mask and the model's own sink logits. The compressed layers' K ends with their
    compressed entries, and a CSA layer's mask over them is the indexer's choice."""
    model, _ = load_hf(directory, implementation="transformers")
    seen = recording(model)
    ids = tokens()
    hf = reference(directory)
    cache = model.new_cache()
    theirs = []
    with torch.no_grad():
        model(ids[:, :PROMPT], cache)
        out = hf(input_ids=ids[:, :PROMPT], use_cache=True, output_attentions=True)
        theirs.append(out.attentions)
        past = out.past_key_values
        for i in range(PROMPT, PROMPT + STEPS):
            model(ids[:, i:i + 1], cache)
            out = hf(input_ids=ids[:, i:i + 1], past_key_values=past, use_cache=True, output_attentions=True)
            theirs.append(out.attentions)
            past = out.past_key_values
    n_layer = model.config.n_layer
    for step in range(STEPS + 1):
        for L in range(n_layer):
            pattern = seen[f"blocks.{L}.attn.hook_pattern"][step]
            assert torch.allclose(pattern, theirs[step][L], atol=1e-6), (step, L)
            q, k, mask = (seen[f"blocks.{L}.attn.hook_{name}"][step] for name in ("q", "k_all", "mask"))
            scores = q @ k.transpose(-2, -1) * model.architecture.scale + mask  # [B,H,n,d] @ [B,1,d,t]
            sinks = model.hf.model.layers[L].self_attn.sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            again = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
            assert torch.allclose(pattern, again, atol=1e-6), (step, L)
            if L:  # a compressed layer: K's last T rows are its compressed entries, K = V
                entries = seen[f"blocks.{L}.attn.hook_compressed_kv_all"][step]
                T = entries.shape[2]
                assert T and torch.equal(k[:, :, -T:], entries)
                assert torch.equal(k, seen[f"blocks.{L}.attn.hook_v_all"][step])
                new = seen[f"blocks.{L}.attn.hook_k"][step]
                assert torch.equal(new, k[:, :, -T - new.shape[2]:-T])  # the n new rows, before the entries
    # the CSA layer's indexer: its choice is the top-k of its recorded scores, and exactly the compressed entries
    # the mask lets each query see
    k_top = model.hf.config.index_topk
    for step in range(STEPS + 1):
        scores, chosen = seen["blocks.1.attn.hook_index_scores"][step], seen["blocks.1.attn.hook_index_selected"][step]
        T = scores.shape[-1]
        assert chosen.dtype == torch.bool and chosen.shape == scores.shape
        top = torch.zeros_like(chosen).scatter_(-1, scores.topk(min(k_top, T), dim=-1).indices, True)
        assert torch.equal(chosen, top & scores.isfinite())
        mask = seen["blocks.1.attn.hook_mask"][step][:, 0, :, -T:]  # [B, n, T]
        assert torch.equal(chosen, mask == 0)
        assert bool((chosen.sum(-1) <= k_top).all()) and bool((~chosen).any())  # it really leaves entries out


def layer_contents(layer) -> dict[str, torch.Tensor]:
    out = {"keys": layer.keys, "values": layer.values}
    for field in ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
        for name, value in getattr(layer, field, {}).items():
            if value is not None:
                out[f"{field}.{name}"] = value
    return out


def assert_same(ours, theirs) -> None:
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        x, y = layer_contents(a), layer_contents(b)
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].shape == y[key].shape and torch.allclose(x[key], y[key], atol=1e-6), key
        assert getattr(a, "entry_count", None) == getattr(b, "entry_count", None)
        assert a.get_seq_length() == b.get_seq_length()


def test_the_cache_holds_what_transformers_cache_layers_hold_after_the_same_steps(directory):
    model, _ = load_hf(directory, implementation="transformers")
    seen = recording(model)
    hf = reference(directory)
    ids = tokens()
    cache = model.new_cache()
    assert isinstance(cache, CompressedCache)
    with torch.no_grad():
        model(ids[:, :PROMPT], cache)
        past = hf(input_ids=ids[:, :PROMPT], use_cache=True).past_key_values
        for i in range(PROMPT, PROMPT + STEPS):
            model(ids[:, i:i + 1], cache)
            past = hf(input_ids=ids[:, i:i + 1], past_key_values=past, use_cache=True).past_key_values
            assert_same(cache, past)
    assert cache.length == PROMPT + STEPS
    # the records of each step are what the layer held: the compressed entries and the window
    last = STEPS
    assert torch.equal(seen["blocks.1.attn.hook_compressed_kv_all"][last][:, 0],
                       past.layers[1].compressed_kv["compressor"])
    assert torch.equal(seen["blocks.1.attn.hook_index_keys_all"][last], past.layers[1].compressed_kv["indexer"])
    assert torch.equal(seen["blocks.2.attn.hook_window_kv"][last], past.layers[2].keys)
    # growth: one entry per m positions
    rates = model.hf.config.compress_rates
    for L, kind in ((1, "compressed_sparse_attention"), (2, "heavily_compressed_attention")):
        counts = [x.shape[2] for x in seen[f"blocks.{L}.attn.hook_compressed_kv_all"]]
        assert counts == [t // rates[kind] for t in range(PROMPT, PROMPT + STEPS + 1)]


def test_a_failed_forward_rolls_the_cache_back_and_copy_crop_reorder_keep_it_whole(directory):
    model, _ = load_hf(directory, implementation="transformers")
    ids = tokens()
    cache = model.new_cache()
    with torch.no_grad():
        model(ids[:, :PROMPT], cache)
        model(ids[:, PROMPT:PROMPT + 1], cache)
        before = cache.copy()
        expected = model(ids[:, PROMPT + 1:PROMPT + 2], cache.copy())

        def fail(module, args, output):
            raise RuntimeError("a failure inside the last layer")

        handle = model.hf.model.layers[2].register_forward_hook(fail)  # after layers 0, 1 updated their cache
        with pytest.raises(RuntimeError, match="a failure inside"):
            model(ids[:, PROMPT + 1:PROMPT + 2], cache)
        handle.remove()
        assert cache.length == PROMPT + 1
        assert_same(cache, before)
        assert torch.equal(model(ids[:, PROMPT + 1:PROMPT + 2], cache), expected)  # as if it never ran
        # crop back to the prefill and step again: the same as the first time
        again = cache.copy(PROMPT)
        cache.crop(PROMPT)
        assert_same(cache, again)
        first = model(ids[:, PROMPT:PROMPT + 1], cache)
        assert_same(cache, before)
        with pytest.raises(ValueError, match="kept only where a committed step ended"):
            cache.crop(PROMPT - 1)  # inside the prefill: no state kept there
        # reorder: a batch of two different sequences, swapped, continues as the swapped sequences would
        pair = model.new_cache(2)
        two = torch.cat([ids[:, :PROMPT], ids[:, 2:PROMPT + 2]])
        model(two, pair)
        pair.reorder(torch.tensor([1, 0]))
        x = ids[:, PROMPT:PROMPT + 1]
        swapped = model(x.expand(2, 1), pair)  # row 0 now continues the second sequence
        alone = model.new_cache()
        model(ids[:, 2:PROMPT + 2], alone)
        assert torch.allclose(swapped[0], model(x, alone)[0], atol=1e-5)
    assert first.shape[-1] == model.config.vocab_size


def test_the_bytes_against_hand_arithmetic_from_the_config(directory):
    """The tiny config: window 4 (3 rows kept), d_head 16, d_I 16, CSA m = 2 (kv and gate projected to 2·16),
    HCA m = 4; float32. At t = 11: the sliding layer keeps 3 rows of K and 3 of V; the CSA layer 3 rows (K = V),
    ⌊11/2⌋ = 5 entries, 1 pending row of kv and gate (2·32 numbers), the last window's half (2 rows of kv and
    gate, 2·2·16), and its indexer the same at d_I; the HCA layer 3 rows, ⌊11/4⌋ = 2 entries, 3 pending rows
    (3·2·16)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    sliding = 3 * 16 * 2
    csa = 3 * 16 + 2 * (5 * 16 + 1 * 2 * 32 + 2 * 2 * 16)
    hca = 3 * 16 + 2 * 16 + 3 * 2 * 16
    assert compressed_cache_bytes(config, 11) == 4 * (sliding + csa + hca) == 2944
    assert compressed_cache_bytes(config, 11, batch=2, itemsize=2) == 2 * 2 * (sliding + csa + hca)
    # an uncompressed cache: K and V of 11 positions, 3 layers, one key/value head of 16
    assert uncompressed_cache_bytes(3, 1, 16, 16, 11) == 2 * 3 * 11 * 16 * 4 == 4224
    # and what the cache really holds after 11 positions
    model, _ = load_hf(directory, implementation="transformers")
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens(11), cache)
    assert cache.nbytes == 2944


def test_the_over_the_steps_section_shows_the_compressed_cache(directory):
    """The real app: the model loaded from its directory, stepped, the KV cache tab's Over the steps section; its
    sentence is the figures function's on the same trace, and its numbers are the cache's own."""
    from gpt_shape_tracer.figures import compressed_cache as views
    from tests.app.test_app import charts, gen_of, new_app, page_text, press, press_reset, show_tab
    from tests.app.test_app_architectures import choose_directory

    at = new_app()
    choose_directory(at, directory)
    press(at, "load_model")
    press_reset(at)
    for _ in range(3):
        press(at, "step_button")
    show_tab(at, "KV cache", ("kv_view", "Over the steps"))
    assert not at.error, [e.value for e in at.error]
    gen = gen_of(at)
    table = views.compressed_table(gen.trace)
    step = gen.n_steps - 1
    sentence = views.compressed_sentence(table, step)
    assert sentence in page_text(at)
    assert int(table.iloc[-1]["compressed cache (B)"]) == gen.cache.nbytes
    assert f"{gen.cache.nbytes:,} bytes" in sentence
    assert any(any("compressed entries" in (trace.get("name") or "") for trace in c["data"]) for c in charts(at))
    # This step says the same of the step shown, not the formula 2·B·G·t·d_head (which K and V of every position
    # would take)
    show_tab(at, "KV cache", ("kv_view", "This step"))
    assert not at.error, [e.value for e in at.error]
    assert sentence in page_text(at) and "numbers per layer" not in page_text(at)
    # the Causal mask tab at the CSA layer: its columns are no positions, so it counts the −∞ cells and says why
    # instead of attributing each to a position's cause
    from gpt_shape_tracer.figures.mask import compressed_mask_sentence, mask_facts

    for layer, entries in ((0, 0), (1, gen.trace.record("blocks.1.attn.hook_compressed_kv_all", step).shape[2])):
        at.session_state["mask_layer"] = layer
        show_tab(at, "Causal mask")
        assert not at.error, [e.value for e in at.error]
        facts = mask_facts(gen.trace, step, layer)
        mask = gen.trace.get(f"blocks.{layer}.attn.hook_mask", step)[0, 0]
        assert facts.compressed_masked == int(torch.isinf(mask).sum()) and facts.compressed_entries == entries
        said = compressed_mask_sentence(facts.n, facts.t, facts.compressed_masked, entries)
        assert said in page_text(at) and ("compressed entries" in said) == bool(entries)


def test_beam_search_runs_on_the_compressed_cache_and_speculative_decoding_is_refused_before_it_starts(directory):
    """Beam search reorders the cache (CompressedCache.reorder): its sequences, scores and reorders equal
    transformers' generate(num_beams=3) with V4's own cache layers; speculative decoding would crop the cache
    inside a verified draft, where no step ended: refused up front, with why."""
    from gpt_shape_tracer.tracer.generation._beams import BeamSearch
    from gpt_shape_tracer.tracer.generation._speculative import SpeculativeDecoding, SpeculativeError
    from tests.tracer.test_beams import reference_run

    model, tok = load_hf(directory, implementation="transformers")
    search = BeamSearch(model, tok, "Once upon a time", 3, max_new_tokens=6, eos_ids=())
    search.run()
    out, reorders = reference_run(reference(directory), tok, ["Once upon a time"], 3, 6)
    assert [list(s) for s in search.result().sequences] == out.sequences.tolist()
    assert torch.allclose(torch.tensor(search.result().scores), out.sequences_scores, atol=1e-5)
    assert [list(s.beam_idx) for s in search.steps] == reorders
    assert any(s.moved_rows for s in search.steps)  # one beam's history really copied onto another
    with pytest.raises(SpeculativeError, match="compresses its keys and values"):
        SpeculativeDecoding(model, tok, "Tom had a kite. Tom had", prompt_lookup=3, max_new_tokens=4, eos_ids=())


def test_transformers_shared_cache_classes_are_refused_with_why(directory):
    """None of transformers' shared cache classes holds V4's compressed state (its forward fails on them): each is
    refused before it runs, with a CacheClassError the app shows."""
    from gpt_shape_tracer.tracer import CACHE_CLASSES, CacheClassError, cache_class_run

    model, tok = load_hf(directory, implementation="transformers")
    for choice in CACHE_CLASSES:
        with pytest.raises(CacheClassError, match="compresses its keys and values"):
            cache_class_run(model, tok, "Tom had a kite", choice, 2)
