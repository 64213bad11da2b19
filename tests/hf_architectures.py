"""Tiny random-weight Hugging Face decoders of many families, built with transformers' own config classes
(never downloaded): the architectures the generic path (model/sources/_hf_decoder.py) is tested on."""

from __future__ import annotations

from pathlib import Path

import torch

# one small size for all: V = 1024 (the bundled tokenizer's), d = 64, 4 query heads, 2 key/value heads
COMMON = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3Config", dict(COMMON, head_dim=16)),
    "gemma2": ("Gemma2Config", dict(COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=4)),
    "gemma3_text": ("Gemma3TextConfig", dict(COMMON, head_dim=16, sliding_window=4)),
    "phi3": ("Phi3Config", dict(COMMON, pad_token_id=0)),
    "olmo2": ("Olmo2Config", dict(COMMON)),
    "gpt_neox": ("GPTNeoXConfig", dict(COMMON, rotary_pct=0.5)),
    "stablelm": ("StableLmConfig", dict(COMMON, partial_rotary_factor=0.25)),
    "granite": ("GraniteConfig", dict(COMMON, attention_multiplier=0.3, embedding_multiplier=2.0,
                                      residual_multiplier=0.5, logits_scaling=4.0)),
    "starcoder2": ("Starcoder2Config", dict(COMMON)),
    "cohere": ("CohereConfig", dict(COMMON)),
    "opt": ("OPTConfig", dict(vocab_size=1024, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=128, word_embed_proj_dim=64)),
    "mixtral": ("MixtralConfig", dict(COMMON, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, decoder_sparse_step=1)),
    "smollm3": ("SmolLM3Config", dict(COMMON, pad_token_id=0)),
    "gpt2": ("GPT2Config", dict(vocab_size=1024, n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    "llama": ("LlamaConfig", dict(COMMON)),
    "mistral": ("MistralConfig", dict(COMMON, sliding_window=4)),
    "qwen2": ("Qwen2Config", dict(COMMON)),
    # issue 40: latent attention (value heads narrower than query/key heads, the cache holds a latent), attention
    # sinks, and a hybrid whose layers keep a Mamba-2 mixer's state beside K and V
    # (tests/model/test_hf_attention_kinds.py)
    "deepseek_v3": ("DeepseekV3Config", dict(COMMON, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=4,
                                              num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                                              first_k_dense_replace=1, n_shared_experts=1)),
    "gpt_oss": ("GptOssConfig", dict(COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                     rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                                          truncate=False, original_max_position_embeddings=4,
                                                          rope_theta=150000.0))),
    "falcon_h1": ("FalconH1Config", dict(COMMON, head_dim=16)),
}


def build(model_type: str, directory: Path, tokenizer_file: Path | None = None, seed: int = 0,
          table: dict[str, tuple[str, dict]] | None = None) -> Path:
    """Save a random-weight model of ``model_type`` (and the given tokenizer.json) into ``directory``; its config
    class and arguments come from ``table`` (default: this file's ARCHITECTURES)."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, kwargs = (ARCHITECTURES if table is None else table)[model_type]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so every term shows in the logits
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    if tokenizer_file is not None:
        (directory / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    return directory
