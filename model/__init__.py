"""One readable GPT for several families (GPT-2, Llama, Mistral, Qwen2) with a named hook point on every
intermediate, a KV cache, and loaders.

Imports torch (and tokenizers/safetensors for loading) only: no streamlit, no tracer.
"""

from model.cache import KVCache
from model.gpt import (
    GPT,
    GPTConfig,
    HookPoint,
    RopeScaling,
    additive_mask,
    apply_rope,
    attention,
    rope_cos_sin,
    rope_inv_freq,
)
from model.identity import ModelIdentity
from model.loading import (
    BUNDLED_MODELS,
    ModelLoadError,
    load_bundled,
    load_hf,
    load_hf_gpt2,
    load_model,
    load_tokenizer,
    logit_tolerance,
    save_hf,
    save_hf_gpt2,
)
from model.nanogpt import load_nanogpt
from model.resolve import hub_cache_dir, resolve_model_path
from model.sampling import SampleResult, SamplingConfig, SamplingError, generate, generate_step, sample
from model.tokenizer import TextTokenizer

__all__ = [
    "BUNDLED_MODELS",
    "GPT",
    "GPTConfig",
    "HookPoint",
    "KVCache",
    "ModelIdentity",
    "ModelLoadError",
    "RopeScaling",
    "SampleResult",
    "SamplingConfig",
    "SamplingError",
    "TextTokenizer",
    "additive_mask",
    "apply_rope",
    "attention",
    "generate",
    "generate_step",
    "hub_cache_dir",
    "load_bundled",
    "load_hf",
    "load_hf_gpt2",
    "load_model",
    "load_nanogpt",
    "load_tokenizer",
    "logit_tolerance",
    "resolve_model_path",
    "rope_cos_sin",
    "rope_inv_freq",
    "sample",
    "save_hf",
    "save_hf_gpt2",
]
