"""Llama, Mistral and Qwen2 against Hugging Face's own classes, on random weights built and saved here.

Odd shapes on purpose: grouped-query attention with 6 query and 2 key/value heads,
multi-query (1 key/value head), head_dim ≠ d/H, a non-default rope_theta, a llama3
rope scaling, untied and tied unembeddings, Qwen2's q/k/v biases, a Mistral sliding
window shorter than the sequence. Biases and norm weights are made non-trivial so
every term counts. Logits are compared on a left-padded batch of two with the
position ids Hugging Face's ``generate`` would pass, and cached decoding is
compared with a full recompute.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import GPT, GPTConfig, RopeScaling, load_hf, logit_tolerance, save_hf
from gpt_shape_tracer.model.gpt import apply_rope, attention, rope_cos_sin, rope_inv_freq

TOL = 1e-4
V = 97
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}

CASES = {
    # name: (HF class names, config kwargs)
    "llama-gqa-llama3": ("Llama", dict(num_attention_heads=6, num_key_value_heads=2, rope_theta=5000.0,
                                       rope_scaling=LLAMA3, tie_word_embeddings=False)),
    "llama-mqa-bias": ("Llama", dict(num_attention_heads=6, num_key_value_heads=1, attention_bias=True,
                                     mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-bias-headdim": ("Qwen2", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                                         tie_word_embeddings=True, rope_theta=1e6)),
    "mistral-window": ("Mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=5)),
}


def build_hf(kind: str, seed: int = 0, **kwargs):
    import copy

    import transformers

    kwargs = copy.deepcopy(kwargs)  # transformers writes rope_theta into the rope_scaling dict it is given
    torch.manual_seed(seed)
    config_cls = getattr(transformers, f"{kind}Config")
    model_cls = getattr(transformers, f"{kind}ForCausalLM")
    fields = dict(hidden_size=48, intermediate_size=72, num_hidden_layers=2, vocab_size=V,
                  max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(kwargs)
    hf = model_cls(config_cls(**fields)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    kind, kwargs = CASES[request.param]
    hf = build_hf(kind, **kwargs)
    directory = Path(tempfile.mkdtemp(prefix=f"hf-{request.param}-"))
    hf.save_pretrained(directory)
    ours, tok = load_hf(directory)
    assert tok is None
    return request.param, hf, ours, directory


def padded_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    long, short = torch.randint(3, V, (12,), generator=g), torch.randint(3, V, (5,), generator=g)
    tokens = torch.stack([long, torch.cat([torch.zeros(7, dtype=torch.long), short])])
    mask = torch.stack([torch.ones(12, dtype=torch.bool), torch.arange(12) >= 7])
    return tokens, mask, short


def test_the_config_is_read_as_the_family_it_is(pair):
    name, hf, ours, _ = pair
    c, h = ours.config, hf.config
    assert c.family == h.model_type and (c.norm, c.positions, c.mlp) == ("rmsnorm", "rope", "swiglu")
    assert (c.n_head, c.n_kv_heads, c.d_head) == (h.num_attention_heads, h.num_key_value_heads, hf.model.layers[0]
                                                  .self_attn.head_dim)
    assert c.tie_embeddings == bool(h.tie_word_embeddings)
    assert c.qkv_bias == (hf.model.layers[0].self_attn.q_proj.bias is not None)
    assert c.attn_out_bias == (hf.model.layers[0].self_attn.o_proj.bias is not None)
    if name == "mistral-window":
        assert c.sliding_window == 5
    assert torch.equal(rope_inv_freq(c), hf.model.rotary_emb.inv_freq)  # default, linear and llama3 alike


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_batch_matches_hugging_face(pair, attn):
    _, hf, ours, _ = pair
    hf.config._attn_implementation = attn
    tokens, mask, short = padded_batch()
    # the position ids Hugging Face's generate passes: attention_mask.cumsum(-1) − 1, padding set to 1
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)
    with torch.no_grad():
        expected = hf(tokens, attention_mask=mask.long(), position_ids=position_ids).logits
        got = ours(tokens, padding_mask=mask)
        alone = ours(short[None])
    assert got.shape == (2, 12, V)
    assert (got[mask] - expected[mask]).abs().max().item() < TOL
    assert (got[1, 7:] - alone[0]).abs().max().item() < TOL  # padding changes nothing for the real tokens
    assert torch.isfinite(got).all()


def test_cached_decoding_equals_full_recompute_and_hugging_face(pair):
    _, hf, ours, _ = pair
    tokens = torch.randint(3, V, (2, 14), generator=torch.Generator().manual_seed(2))
    prompt = 6
    cache = ours.new_cache(2)
    with torch.no_grad():
        rows = [ours(tokens[:, :prompt], cache)]
        rows += [ours(tokens[:, i : i + 1], cache) for i in range(prompt, 14)]
        full = ours(tokens)
        expected = hf(tokens).logits
    stepped = torch.cat(rows, dim=1)
    assert cache.length == 14
    assert tuple(cache.keys[0].shape) == (2, ours.config.n_kv_heads, 14, ours.config.d_head)  # [B, G, t, d_head]
    assert (stepped - full).abs().max().item() < 1e-5
    assert (stepped - expected).abs().max().item() < TOL


def test_hugging_face_reads_what_we_save(pair, tmp_path):
    import transformers

    name, hf, ours, _ = pair
    save_hf(ours, tmp_path)
    cls = getattr(transformers, f"{type(hf).__name__}")
    reread = cls.from_pretrained(tmp_path).eval()
    again, _ = load_hf(tmp_path)
    tokens = torch.randint(3, V, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (reread(tokens).logits - ours(tokens)).abs().max().item() < TOL
        assert torch.equal(again(tokens), ours(tokens))


def test_the_identity_digest_is_the_weight_file_hash(pair):
    name, _, ours, directory = pair
    file_hash = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    ident = ours.identity
    assert ident.weights_digest == "sha256:" + file_hash
    assert ident.family == ours.config.family and ident.source == str(directory.resolve())
    assert ident.name == directory.name and ident.config["n_kv_head"] == ours.config.n_kv_head
    assert ident.weights_digest[7:19] in ident.describe()


def test_a_model_built_in_code_has_an_identity_that_follows_its_weights():
    model = GPT(GPTConfig.for_family("llama", vocab_size=V, n_ctx=16, d_model=32, n_layer=1, n_head=4, n_kv_head=2))
    first = model.identity
    assert (first.name, first.source, first.family) == ("unnamed", "built in code", "llama")
    assert first.weights_digest.startswith("sha256:") and len(first.weights_digest) == 7 + 64
    assert model.identity == first  # deterministic
    with torch.no_grad():
        model.blocks[0].ln1.weight[0] += 1
    assert model.identity.weights_digest != first.weights_digest


def test_the_digest_of_a_model_built_in_code_is_computed_once_per_set_of_weights(monkeypatch):
    """Entering a Tracer asks for the model's identity; a model built in code hashes its weights the first time
    and again only after they change (a tiny change too: every byte is hashed, nothing is elided)."""
    import gpt_shape_tracer.model.gpt._identity as identity_module
    from gpt_shape_tracer.tracer import Tracer

    calls = []
    real = identity_module.parameters_digest
    monkeypatch.setattr(identity_module, "parameters_digest", lambda m: calls.append(1) or real(m))
    model = GPT(GPTConfig.for_family("gpt2", vocab_size=V, n_ctx=16, d_model=32, n_layer=1, n_head=4)).eval()
    tokens = torch.tensor([[1, 2, 3]])
    digests = []
    for _ in range(3):
        with Tracer(model, capture="shapes") as tr:
            model(tokens)
        digests.append(tr.trace.model.weights_digest)
    assert len(calls) == 1 and len(set(digests)) == 1
    with torch.no_grad():
        model.embed.weight[5, 7] += 1e-5  # one number, far below anything a printed tensor would show
    with Tracer(model, capture="shapes") as tr:
        model(tokens)
    assert len(calls) == 2 and tr.trace.model.weights_digest != digests[0]
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # new values, same storage
    assert model.identity.weights_digest == tr.trace.model.weights_digest and len(calls) == 3


def test_a_bf16_checkpoint_loads_as_float32_or_bf16():
    import transformers

    hf = build_hf("Llama", seed=5, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    directory = Path(tempfile.mkdtemp(prefix="hf-bf16-"))
    hf.to(torch.bfloat16).save_pretrained(directory)
    assert "BF16" in (directory / "model.safetensors").read_bytes()[:4000].decode("latin-1")
    tokens, mask, _ = padded_batch(seed=6)
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 1)

    ours32, _ = load_hf(directory)  # float32 by default: the bf16 values, upcast exactly
    assert all(p.dtype == torch.float32 for p in ours32.parameters())
    hf32 = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        diff32 = (ours32(tokens, padding_mask=mask)[mask]
                  - hf32(tokens, attention_mask=mask.long(), position_ids=position_ids).logits[mask]).abs().max()
    assert diff32.item() < logit_tolerance(torch.float32) == 1e-4

    ours16, _ = load_hf(directory, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in ours16.parameters())
    hf16 = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                                         attn_implementation="eager").eval()
    with torch.no_grad():
        got = ours16(tokens, padding_mask=mask)
        expected = hf16(tokens, attention_mask=mask.long(), position_ids=position_ids).logits
        cache = ours16.new_cache(1)
        stepped = torch.cat([ours16(tokens[:1, :6], cache)] + [ours16(tokens[:1, i : i + 1], cache)
                                                               for i in range(6, 12)], dim=1)
    assert got.dtype == torch.bfloat16
    assert (got[mask].float() - expected[mask].float()).abs().max().item() < logit_tolerance(torch.bfloat16)
    assert (stepped.float() - got[:1].float()).abs().max().item() < logit_tolerance("bfloat16")
    # and bf16 is really coarser than float32: the tolerance is not hiding a float32 model
    assert (got.float() - ours32(tokens, padding_mask=mask)).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_trained_model_in_half_precision_matches_hugging_face_within_the_tolerance(dtype):
    """Random weights give logits near 0, where bf16 rounding vanishes; the bundled model's reach ±22."""
    import transformers

    from gpt_shape_tracer.model.sources import BUNDLED_DIR

    ours, _ = load_hf(BUNDLED_DIR, dtype=dtype)
    hf = transformers.GPT2LMHeadModel.from_pretrained(BUNDLED_DIR, dtype=dtype, attn_implementation="eager").eval()
    tokens = torch.randint(1, 1024, (2, 60), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got, expected = ours(tokens), hf(tokens).logits
        cache = ours.new_cache(2)
        stepped = torch.cat([ours(tokens[:, :20], cache)] + [ours(tokens[:, i : i + 1], cache)
                                                             for i in range(20, 60)], dim=1)
    assert got.dtype == dtype and got.float().abs().max().item() > 5
    assert (got.float() - expected.float()).abs().max().item() < logit_tolerance(dtype)
    assert (stepped.float() - got.float()).abs().max().item() < logit_tolerance(dtype)


def test_rope_helpers_are_hugging_faces_rotation():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = build_hf("Llama", seed=7, num_attention_heads=4, num_key_value_heads=4, rope_theta=321.0,
                  rope_scaling=LLAMA3)
    config = GPTConfig.for_family("llama", vocab_size=V, d_model=48, n_layer=1, n_head=4, rope_theta=321.0,
                                  rope_scaling=RopeScaling(**LLAMA3))
    positions = torch.tensor([[0, 1, 2, 7, 30]])
    cos, sin = rope_cos_sin(config, positions)
    x = torch.randn(1, 4, 5, 12)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf.config)(x, positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    expected, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    assert torch.equal(apply_rope(x, cos, sin), expected)
    # the halves convention: dimension i turns with i + d_head/2, by angle p·inv_freq[i]
    p, i = 3, 2
    angle = positions[0, p].item() * rope_inv_freq(config)[i].item()
    rotated = apply_rope(x, cos, sin)[0, 0, p]
    x1, x2 = x[0, 0, p, i].item(), x[0, 0, p, i + 6].item()
    assert rotated[i].item() == pytest.approx(x1 * torch.cos(torch.tensor(angle)).item()
                                              - x2 * torch.sin(torch.tensor(angle)).item(), abs=1e-5)


@pytest.mark.parametrize("G", [1, 2, 6])
def test_grouped_attention_equals_repeating_the_key_value_heads(G):
    """Query head h reads key/value head h // (H/G) — what Hugging Face's repeat_kv builds by copying."""
    g = torch.Generator().manual_seed(G)
    q, k, v = torch.randn(2, 6, 3, 8, generator=g), torch.randn(2, G, 5, 8, generator=g), torch.randn(2, G, 5, 8,
                                                                                                        generator=g)
    mask = torch.zeros(1, 1, 3, 5).masked_fill(torch.ones(3, 5).triu(3).bool(), float("-inf"))
    out, weights = attention(q, k, v, mask)
    k_rep, v_rep = k.repeat_interleave(6 // G, dim=1), v.repeat_interleave(6 // G, dim=1)
    ref_out, ref_weights = attention(q, k_rep, v_rep, mask)
    assert out.shape == (2, 6, 3, 8) and weights.shape == (2, 6, 3, 5)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(weights, ref_weights, atol=1e-6)
    with pytest.raises(ValueError, match="G must divide H"):
        attention(q, torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8))


def test_the_sliding_window_hides_keys_exactly_window_slots_back():
    from gpt_shape_tracer.model import additive_mask

    m = additive_mask(6, 0, None, torch.device("cpu"), torch.float32, window=3)[0, 0]
    allowed = ~torch.isinf(m)
    for q in range(6):
        assert allowed[q].tolist() == [q - 3 < j <= q for j in range(6)]  # at most 3 keys, itself included


def test_the_weights_digest_is_taken_beside_the_load_and_stops_when_asked(tmp_path, monkeypatch):
    """The identity's hash runs on a thread of its own (model.gpt.BackgroundDigest): the same digest as
    hashing the bytes in order (by_name=False: our loader's) or each file's name and sha256 (True: the
    transformers path's), on a daemon thread, and it stops at its next buffer once abandoned."""
    import threading

    from gpt_shape_tracer.model.gpt import BackgroundDigest, DigestAbandoned, files_digest

    files = []
    for i, size in enumerate((0, 5, (16 << 20) + 3)):  # empty, tiny, and more than one 16 MiB buffer
        path = tmp_path / f"part-{i}.safetensors"
        path.write_bytes(bytes((j * 7 + i) % 251 for j in range(size)) if size < 1000 else
                         torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())
        files.append(path)
    whole = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    named = hashlib.sha256()
    for f in files:
        named.update(f.name.encode() + hashlib.sha256(f.read_bytes()).digest())
    assert files_digest(files, by_name=False) == "sha256:" + whole
    assert files_digest(files, by_name=True) == "sha256:" + named.hexdigest()
    started = []

    class Watched(threading.Thread):
        def start(self) -> None:
            started.append((self.name, self.daemon))
            super().start()

    monkeypatch.setattr(threading, "Thread", Watched)
    background = BackgroundDigest(files, by_name=False)
    assert started == [("weights-digest", True)]  # a stalled read never keeps the process alive
    assert background.result() == "sha256:" + whole
    stop = threading.Event()
    stop.set()
    with pytest.raises(DigestAbandoned):
        files_digest(files, by_name=False, abandon=stop)
