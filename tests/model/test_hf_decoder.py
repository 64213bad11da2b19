"""Any Hugging Face decoder, run by transformers, through our hook points (model/sources/_hf_decoder.py): for each
architecture the logits equal transformers' own at the prefill and at cached decode steps, the patterns are
distributions over the keys the mask allows, and the KV cache grows one position per step."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import ModelLoadError, load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder, HFDecoderError
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_architectures import ARCHITECTURES, build

PROMPTS = ["Lily had a red kite.", "Tom said"]


@pytest.fixture(scope="module")
def directories():
    root = Path(tempfile.mkdtemp(prefix="hf-archs-"))
    return {name: build(name, root / name, BUNDLED_DIR / "tokenizer.json") for name in ARCHITECTURES}


def reference(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_logits_equal_transformers_and_the_records_hold_their_meaning(directories, model_type):
    model, tok = load_hf(directories[model_type], implementation="transformers")
    assert isinstance(model, HFDecoder) and model.identity.family == f"hf:{model_type}"
    ref = reference(directories[model_type])
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0, padding_side="left")
    gen.run(3)
    B = len(PROMPTS)
    G = model.config.n_kv_heads
    ids = torch.tensor([gen.facts.columns(r, 2) for r in range(B)])  # [B, width + 2]: what step 2 sees
    real = torch.tensor([gen.facts.is_token(r, 2) for r in range(B)])  # False on the left padding
    with torch.no_grad():  # one uncached forward of transformers' own model over the same columns
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        expected = ref(input_ids=ids, attention_mask=real.long(), position_ids=positions).logits  # [B, t, V]
    width = gen.info.prompt_width
    for step in range(3):
        got = gen.trace.get("hook_logits", step)  # [B, n, V]: the prompt at step 0, one position after
        want = expected[:, :width] if step == 0 else expected[:, width + step - 1:width + step]
        rows = real[:, :width] if step == 0 else torch.ones(B, 1, dtype=torch.bool)
        assert (got - want)[rows].abs().max() <= 1e-4, (model_type, step)
        t = width + step
        for layer in range(model.config.n_layer):
            k_all = gen.trace.record(f"blocks.{layer}.attn.hook_k_all", step)
            assert k_all.shape == (B, G, t, model.config.d_head)
            pattern = gen.trace.get(f"blocks.{layer}.attn.hook_pattern", step)  # [B, H, n, t]
            mask = gen.trace.get(f"blocks.{layer}.attn.hook_mask", step)  # [B|1, 1, n, t]
            sink = gen.trace.get(f"blocks.{layer}.attn.hook_sink_weight", step) if model.config.attn_sinks else None
            rows = pattern.sum(-1) + (sink[..., 0] if sink is not None else 0)  # gpt-oss: the sink takes the rest
            assert torch.allclose(rows, torch.ones(()), atol=1e-5)
            hidden = torch.isinf(mask).expand_as(pattern)
            assert hidden.any() and (pattern[hidden] == 0).all()


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mistral", "qwen2"])
def test_the_families_we_reimplemented_give_the_same_logits_through_transformers(directories, model_type):
    ours, tok = load_hf(directories[model_type], implementation="ours")
    theirs, _ = load_hf(directories[model_type], implementation="transformers")
    assert not isinstance(ours, HFDecoder) and isinstance(theirs, HFDecoder)
    ids = torch.tensor([tok.encode("Once upon a time there was a dog")])
    with torch.no_grad():
        assert (ours(ids) - theirs(ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_logits_to_keep_unembeds_the_last_positions_as_transformers_does(directories, model_type):
    ours, tok = load_hf(directories[model_type], implementation="ours")
    theirs, _ = load_hf(directories[model_type], implementation="transformers")
    ids = torch.tensor([tok.encode("Once upon a time there was a dog")])
    with torch.no_grad():
        want = reference(directories[model_type])(input_ids=ids, logits_to_keep=2).logits  # [1, 2, V]
        for model in (ours, theirs):
            got = model(ids, logits_to_keep=2)
            assert got.shape == want.shape == (1, 2, model.config.vocab_size)
            assert (got - want).abs().max() <= 1e-4
            assert (got - model(ids)[:, -2:]).abs().max() <= 1e-5  # the same numbers as every position's last two
            for bad in (-1, 1.5, True):
                with pytest.raises(ValueError, match="logits_to_keep must be a whole number ≥ 0"):
                    model(ids, logits_to_keep=bad)


def test_what_an_architecture_adds_is_its_own_stage(directories):
    gemma2, _ = load_hf(directories["gemma2"])
    assert hasattr(gemma2.blocks[0].attn, "hook_softcapped")  # c·tanh(s/c) between the scale and the mask
    assert gemma2.config.attn_scale == pytest.approx(24**-0.5)  # query_pre_attn_scalar, not √d_head
    neox, _ = load_hf(directories["gpt_neox"])  # a parallel block: no resid_mid to show
    assert neox.architecture.parallel_block and not hasattr(neox.blocks[0], "hook_resid_mid")


def test_a_model_that_does_not_route_attention_through_the_interface_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2))

    def own_attention(self, hidden_states, *args, **kwargs):  # a layer computing attention its own way
        return self.o_proj(hidden_states), None

    hf.model.layers[1].self_attn.forward = own_attention.__get__(hf.model.layers[1].self_attn)
    with pytest.raises(HFDecoderError, match=r"layer\(s\) 1 hold attention \(LlamaAttention\) that does not go through "
                       r"transformers' attention interface"):
        HFDecoder(hf)


def test_on_the_meta_device_the_routing_is_checked_by_the_first_forward():
    """A dry run's build runs one probe forward, not two: the check that every layer's attention reaches its
    hooks is made by the model's first forward instead — and still refuses a layer that computes its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    model = HFDecoder(hf)
    # the head counts come from what the probe's attention received: H = 4, G = 2, d_head = 8
    assert (model.config.n_head, model.config.n_kv_head, model.config.head_dim) == (4, 2, 8)

    def own_attention(self, hidden_states, *args, **kwargs):  # changed after the build: only a forward sees it
        return self.o_proj(hidden_states), None

    hf.model.layers[1].self_attn.forward = own_attention.__get__(hf.model.layers[1].self_attn)
    tokens = torch.zeros(1, 3, dtype=torch.long, device="meta")
    with torch.no_grad(), pytest.raises(HFDecoderError, match=r"layer\(s\) 1 does not go through"):
        model(tokens)
    del hf.model.layers[1].self_attn.forward  # its own forward again: the next forward passes the check
    with torch.no_grad():
        assert model(tokens).shape == (1, 3, 64)


@pytest.fixture(scope="module")
def traced(directories):
    """Two decode steps of qwen3 (QK-norm) and gemma2 (its own scale, soft-capping, sliding layers)."""
    out = {}
    for name in ("qwen3", "gemma2"):
        model, tok = load_hf(directories[name])
        gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
        gen.run(3)
        out[name] = gen.trace
    return out


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_the_views_recompute_what_the_model_computed(traced, model_type):
    """The Pitfalls view recomputes the pattern from the recorded Q, K and M with the model's own scale and
    soft-cap: "as the model does it" must be the recorded pattern, at every layer."""
    from gpt_shape_tracer.figures.attention import attention_stages
    from gpt_shape_tracer.figures.pitfalls import pitfall_patterns

    trace = traced[model_type]
    for step in (0, 2):
        for layer in range(trace.config.n_layer):
            recorded = trace.get(f"blocks.{layer}.attn.hook_pattern", step)[0, 1].double()
            redone = pitfall_patterns(trace, step, layer, head=1)["as the model does it"]
            assert torch.allclose(redone, recorded, atol=1e-5), (step, layer)
    titles = [s.title for s in attention_stages(trace, 2, 0, 0)]
    if model_type == "gemma2":  # five stages: the soft-cap is one; the scale is the model's, not 1/√d_head
        assert len(titles) == 5 and "s = 0.2041" in titles[1] and titles[2].startswith("c·tanh(s·QKᵀ/c)")
    else:
        assert len(titles) == 4 and titles[1].startswith("QKᵀ / √d_k")


def test_the_shape_flow_of_an_unseen_architecture_is_read_from_its_records(traced):
    from gpt_shape_tracer.figures.flow import flow_nodes, reshape_ops

    nodes, edges = flow_nodes(traced["qwen3"], 2, layer=1)
    names = [n.name for n in nodes]
    assert "hf.model.layers.1.self_attn.q_norm:out" in names  # QK-norm: recorded, so drawn
    assert names.index("hf.model.layers.1.self_attn.q_proj:out") < names.index("blocks.1.attn.hook_q")
    assert all(n.shape is not None for n in nodes) and len(edges) == len(nodes) - 1
    assert not any(n.startswith("hf.model.layers.0.") for n in names)  # only the chosen block
    gemma = [n.name for n in flow_nodes(traced["gemma2"], 2, layer=0)[0]]
    assert "blocks.0.attn.hook_softcapped" in gemma
    ops = reshape_ops(traced["qwen3"], 2, 1)
    assert ops[0].op == "q_proj(x)" and ops[-1].shape == (1, 1, 4 * 16)


def test_bfloat16_through_transformers_and_the_size_stated_before_loading(directories):
    from gpt_shape_tracer.model.sources import logit_tolerance, weights_size

    directory = directories["qwen3"]
    ref = reference(directory)
    count, nbytes = weights_size(directory, "bfloat16")
    assert count == sum(p.numel() for p in ref.parameters())  # every parameter once, from the headers alone
    assert nbytes == 2 * count
    model, tok = load_hf(directory, dtype="bfloat16")
    assert next(model.hf.parameters()).dtype == torch.bfloat16
    ids = torch.tensor([tok.encode("Once upon a time")])
    with torch.no_grad():
        got = model(ids).float()
        want = ref.to(torch.bfloat16)(ids).logits.float()
    assert (got - want).abs().max() <= logit_tolerance(torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cache_on_and_off_agree_record_by_record_through_transformers(directories, dtype):
    """The diff lines up a cached step's inputs with the uncached run's by the positions each fed, also for
    transformers' own module records that carry no named axes (position ids, rotary tables), and bfloat16
    rounding stays within bfloat16's tolerance: no record diverges, none is left uncompared."""
    from gpt_shape_tracer.tracer import TracedGeneration, diff_traces

    model, tok = load_hf(directories["qwen3"], dtype=dtype)
    prompt = "Once upon a time, there was a little girl named Lily."
    on = TracedGeneration(model, tok, prompt, temperature=0)
    off = TracedGeneration(model, tok, prompt, temperature=0, use_cache=False)
    on.run(3)
    off.run(3)
    frame = diff_traces(on.trace, off.trace)
    shared = frame[frame.shape_a.notna() & frame.shape_b.notna()]
    assert shared.compared.all() and not frame.diverged.any(), frame[frame.diverged][["step", "name", "note"]]
    aligned = shared[shared.note.str.contains("last 1 position")]
    assert "hf.model:in.position_ids" in set(aligned.name)  # [1, 1] against [1, t]: lined up, not "differ"


def test_what_the_mask_view_says_of_padding_rows_is_read_from_the_models_mask(directories):
    """transformers hides every key from a left-padding query row with the smallest float, not −∞ (our GPT lets
    the row see itself): the Causal mask view says which, from the recorded numbers."""
    from gpt_shape_tracer.figures.mask import mask_facts

    model, tok = load_hf(directories["llama"], implementation="transformers")
    gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom"], temperature=0, padding_side="left")
    gen.run(1)
    facts = mask_facts(gen.trace, 0, layer=0, batch=1)
    assert facts.padding_rows and facts.padding_rows_see == "nothing"
    assert "smallest finite number instead of −∞" in facts.explanation() and facts.unexplained == 0
    values = gen.trace.get("blocks.0.attn.hook_mask", 0)[1, 0]
    assert facts.masked + facts.smallest < values.numel() == facts.masked + facts.smallest + int((values == 0).sum())
    assert f"{facts.smallest} hold the smallest finite number instead" in facts.explanation()  # not "the rest are 0"
    from gpt_shape_tracer.figures.mask import mask_figure

    labels = [d for d in mask_figure(gen.trace, 0, 0, batch=1).data if d.type == "heatmap"][-1].text
    assert set(labels[0]) == {"min"}  # a padding row: the smallest float, not written as 0
    ours, tok = load_hf(directories["llama"], implementation="ours")
    gen = TracedGeneration(ours, tok, ["Lily had a red kite.", "Tom"], temperature=0, padding_side="left")
    gen.run(1)
    assert "may see itself only" in mask_facts(gen.trace, 0, layer=0, batch=1).explanation()


def test_the_reshape_strip_measures_whether_q_is_a_view_of_the_projection(traced):
    from gpt_shape_tracer.figures.flow import reshape_ops

    split = reshape_ops(traced["qwen3"], 2, 0)[1]
    assert split.memory.startswith("a new tensor (measured")  # QK-norm and RoPE made Q anew


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_the_logit_lens_ends_at_the_models_own_logits(directories, model_type):
    """The lens applies the model's final norm and head to each block's output; at the last block that must be
    the logits the model returned (Granite divides them, Cohere scales them, Gemma 2 soft-caps them). Direct
    logit attribution needs our written-out norm and is refused, saying so."""
    from gpt_shape_tracer.tracer import direct_logit_attribution, logit_lens

    model, tok = load_hf(directories[model_type], implementation="transformers")
    gen = TracedGeneration(model, tok, "Lily had a red kite.", temperature=0)
    gen.run(2)
    lens = logit_lens(gen.trace, 1, model=model)  # raises when the last layer is not the model's logits
    last = lens[lens.layer == model.config.n_layer - 1]
    assert (last.top_token == last.final_token).all()
    with pytest.raises(ValueError, match="needs the norm written out"):
        direct_logit_attribution(gen.trace, 1, model=model)


def test_a_forward_that_fails_leaves_the_cache_as_it_was(directories):
    model, tok = load_hf(directories["qwen3"])
    ids = torch.tensor([tok.encode("Lily had a red kite.")])
    cache = model.new_cache(1)
    with torch.no_grad():
        model(ids, cache)
        before = cache.length

        def broken(module, args, output):
            raise RuntimeError("a hook broke")

        handle = model.hf.model.layers[1].register_forward_hook(broken)
        with pytest.raises(RuntimeError, match="a hook broke"):
            model(ids[:, -1:], cache)
        handle.remove()
        assert cache.length == before  # the rows layer 0 appended were forgotten
        again = model(ids[:, -1:], cache)[0, -1]
    with torch.no_grad():
        want = reference(directories["qwen3"])(torch.cat([ids, ids[:, -1:]], dim=1)).logits[0, -1]
    assert (again - want).abs().max() <= 1e-4


def test_the_identity_of_a_loaded_directory_is_the_hash_of_its_files(directories, tmp_path):
    """load_hf hashes the files on a second thread while transformers loads: the digest is still sha256 over
    each file's name and sha256, in name order (the format every saved trace carries), and it changes with one
    byte of one weight."""
    import hashlib
    import shutil

    source = directories["qwen3"]
    model, _ = load_hf(source, implementation="transformers")
    h = hashlib.sha256()
    for file in sorted(source.iterdir()):
        if file.name == "config.json" or file.suffix == ".safetensors":
            h.update(file.name.encode() + hashlib.sha256(file.read_bytes()).digest())
    assert model.identity.weights_digest == "sha256:" + h.hexdigest()
    changed = shutil.copytree(source, tmp_path / "changed")
    weights = changed / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # the last byte of the last tensor
    weights.write_bytes(bytes(raw))
    assert load_hf(changed, implementation="transformers")[0].identity.weights_digest != model.identity.weights_digest


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_new_values_are_transformers_own_value_projections_not_the_keys(directories, model_type):
    """``hook_v`` holds the values of the new positions: transformers' own ``v_proj`` output (V has no rotation)
    at those positions, the last n rows of ``hook_v_all``, and not the keys (the views show and files keep it,
    so a swap must not pass unseen)."""
    model, tok = load_hf(directories[model_type], implementation="transformers")
    ref = reference(directories[model_type])
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0, padding_side="left")
    gen.run(3)
    B, G, dh = len(PROMPTS), model.config.n_kv_heads, model.config.d_head
    seen: dict[int, torch.Tensor] = {}
    handles = [layer.self_attn.v_proj.register_forward_hook(
        lambda m, a, out, L=L: seen.__setitem__(L, out.view(out.shape[0], out.shape[1], G, dh).transpose(1, 2)))
        for L, layer in enumerate(ref.model.layers)]  # [B, t, G·d_head] -> [B, G, t, d_head]
    try:
        for step in (0, 2):
            ids = torch.tensor([gen.facts.columns(r, step) for r in range(B)])
            real = torch.tensor([gen.facts.is_token(r, step) for r in range(B)])
            with torch.no_grad():  # one uncached forward of transformers' own model over the columns step saw
                ref(input_ids=ids, attention_mask=real.long(), position_ids=(real.long().cumsum(-1) - 1).clamp(min=0))
            for layer in range(model.config.n_layer):
                v = gen.trace.get(f"blocks.{layer}.attn.hook_v", step)  # [B, G, n, d_head]
                n = v.shape[2]
                rows = real[:, -n:]  # the new positions' real ones (padding rows hold no token's value)
                want = seen[layer][:, :, -n:]
                assert (v - want).abs().amax(dim=(1, 3))[rows].max() <= 1e-5, (model_type, step, layer)
                assert torch.equal(v, gen.trace.get(f"blocks.{layer}.attn.hook_v_all", step)[:, :, -n:])
                assert not torch.allclose(v, gen.trace.get(f"blocks.{layer}.attn.hook_k", step), atol=1e-3)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_the_new_keys_are_the_last_n_rows_of_all_keys_the_ones_the_cache_keeps(directories, model_type):
    """``hook_k`` holds the keys of this step's n new positions: the last n rows of ``hook_k_all`` (the cache
    plus the new rows), which the next step's ``hook_k_all`` still holds at the same columns, for every real
    token. At a decode step n = 1, so the first row (position 0's key) is not the new key."""
    model, tok = load_hf(directories[model_type], implementation="transformers")
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0, padding_side="left")
    gen.run(3)
    B = len(PROMPTS)
    for step in range(3):
        real = torch.tensor([gen.facts.is_token(r, step) for r in range(B)])  # [B, t] of this step
        for layer in range(model.config.n_layer):
            k = gen.trace.get(f"blocks.{layer}.attn.hook_k", step)  # [B, G, n, d_head]
            k_all = gen.trace.get(f"blocks.{layer}.attn.hook_k_all", step)  # [B, G, t, d_head]
            n, t = k.shape[2], k_all.shape[2]
            assert n == (t if step == 0 else 1), (model_type, step)
            assert torch.equal(k, k_all[:, :, t - n:]), (model_type, step, layer)
            if step < 2:  # the cache kept them: the next step reads the same rows at the same columns
                later = gen.trace.get(f"blocks.{layer}.attn.hook_k_all", step + 1)[:, :, t - n:t]
                rows = real[:, t - n:]  # padding columns hold no token's key
                assert (k - later).abs().amax(dim=(1, 3))[rows].max() == 0, (model_type, step, layer)
            if step > 0:
                assert not torch.allclose(k, k_all[:, :, :1], atol=1e-3)  # the new key is not position 0's


def test_a_vocabulary_the_weights_do_not_back_is_refused_before_anything_is_built(tmp_path):
    """A Qwen3 config claiming 2²² tokens over 1,024 rows of weights: transformers built the whole model (a
    [4,194,304, 64] embedding and head, 2.4 GB peak) before refusing it. Refused now from the shapes the config
    builds on the meta device against the safetensors headers, in a fresh process whose peak memory is measured."""
    import json
    import subprocess
    import sys

    directory = build("qwen3", tmp_path / "m", BUNDLED_DIR / "tokenizer.json")
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] = 2**22
    (directory / "config.json").write_text(json.dumps(config))
    probe = ("import resource, sys\n"
             "import transformers\n"
             "from gpt_shape_tracer.model import ModelLoadError, load_hf\n"
             "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
             "try:\n"
             "    load_hf(sys.argv[1])\n"
             "    print('LOADED')\n"
             "except ModelLoadError as e:\n"
             "    print('REFUSED', e)\n"
             "print('GREW_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)\n")
    done = subprocess.run([sys.executable, "-c", probe, str(directory)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert ("the config builds model.embed_tokens.weight as [4194304, 64], but the weights hold [1024, 64]: refused "
            "before loading") in done.stdout, done.stdout
    grew_mib = int(done.stdout.split("GREW_KIB")[1]) / 1024
    assert grew_mib < 256, f"{grew_mib:.0f} MiB to refuse a config of 2²² tokens"  # the embedding alone is 1 GiB


@pytest.mark.parametrize(("change", "expected"), [
    ({"num_hidden_layers": 600, "layer_types": ["full_attention"] * 600},
     "builds 600 layers (num_hidden_layers = 600), but the weights hold 2 (0 … 1)"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number, got 0"),
    ({"tie_word_embeddings": "false"}, "Field 'tie_word_embeddings' expected bool, got str"),
    ({"layer_types": ["full_attention"] * 3}, "transformers cannot read its config"),
    ({"num_experts": -3}, "num_experts must be a whole number ≥ 0, got -3"),
    ({"num_experts_per_tok": 1.5}, "num_experts_per_tok must be a whole number ≥ 0, got 1.5"),
])
def test_a_config_the_weights_do_not_back_is_refused_before_building(tmp_path, change, expected):
    """A config claiming 600 layers over weights holding 2 was built (598 random layers, about a minute); no heads
    was a ZeroDivisionError; "false" as a string is truthy and tied the embeddings; each is refused by name."""
    import json
    import re

    directory = build("qwen3", tmp_path / "m", BUNDLED_DIR / "tokenizer.json")
    config = json.loads((directory / "config.json").read_text())
    config.update(change)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises((HFDecoderError, ModelLoadError), match=re.escape(expected)):
        load_hf(directory)
