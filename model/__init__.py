"""A GPT-2 with a named hook point on every intermediate, a KV cache, and loaders.

Imports torch (and tokenizers/safetensors for loading) only: no streamlit, no tracer.
"""

from model.cache import KVCache
from model.gpt import GPT, GPTConfig, HookPoint, additive_mask, attention
from model.loading import ModelLoadError, load_bundled, load_hf_gpt2, save_hf_gpt2
from model.sampling import SampleResult, SamplingConfig, SamplingError, generate, generate_step, sample
from model.tokenizer import TextTokenizer

__all__ = [
    "GPT",
    "GPTConfig",
    "HookPoint",
    "KVCache",
    "ModelLoadError",
    "SampleResult",
    "SamplingConfig",
    "SamplingError",
    "TextTokenizer",
    "additive_mask",
    "attention",
    "generate",
    "generate_step",
    "load_bundled",
    "load_hf_gpt2",
    "sample",
    "save_hf_gpt2",
]
