"""Models you can see inside, in five rooms:

* ``model.gpt`` — our readable GPT (GPT-2, Llama, Mistral, Qwen2 in one file) with a named hook point on every
  intermediate, its KV cache, its hook table and what names a model;
* ``model.sources`` — where models come from: a Hugging Face directory into our GPT, a decoder transformers
  runs, a nanoGPT checkpoint, your own module; finding a model, reading tokenizers and safetensors;
* ``model.sampling`` — choosing the next token, generating;
* ``model.analysis`` — head roles and forward costs;
* ``model.training`` — how the bundled story models were trained (not imported here).

This is the front door: the names below are what users call. Imports torch (and tokenizers/safetensors for
loading) only: no streamlit, no tracer.
"""

from gpt_shape_tracer.model.gpt import (
    GPT,
    GPTConfig,
    HookPoint,
    IdentityUnavailable,
    KVCache,
    ModelIdentity,
    RopeScaling,
    additive_mask,
    apply_rope,
    attention,
    identity_of,
    rope_cos_sin,
    rope_inv_freq,
)
from gpt_shape_tracer.model.sampling import SampleResult, SamplingConfig, SamplingError, generate, generate_step, sample
from gpt_shape_tracer.model.sources import (
    BUNDLED_MODELS,
    Decoder,
    HFDecoder,
    HFDecoderError,
    ModelLoadError,
    OwnDecoder,
    OwnModuleError,
    TextTokenizer,
    TokenizerConfigError,
    hub_cache_dir,
    load_bundled,
    load_factory,
    load_hf,
    load_hf_gpt2,
    load_model,
    load_nanogpt,
    load_tokenizer,
    logit_tolerance,
    resolve_model_path,
    save_hf,
    save_hf_gpt2,
)

__all__ = [
    "BUNDLED_MODELS",
    "GPT",
    "Decoder",
    "GPTConfig",
    "HFDecoder",
    "HFDecoderError",
    "HookPoint",
    "IdentityUnavailable",
    "KVCache",
    "ModelIdentity",
    "ModelLoadError",
    "OwnDecoder",
    "OwnModuleError",
    "RopeScaling",
    "SampleResult",
    "SamplingConfig",
    "SamplingError",
    "TextTokenizer",
    "TokenizerConfigError",
    "additive_mask",
    "apply_rope",
    "attention",
    "generate",
    "generate_step",
    "hub_cache_dir",
    "identity_of",
    "load_bundled",
    "load_factory",
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
