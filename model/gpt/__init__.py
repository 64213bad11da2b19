"""Our readable GPT, the reference a student opens: one model for GPT-2, Llama, Mistral and Qwen2 (``_gpt.py``,
read bottom-up, with its config in ``_config.py`` and the hook point every tensor passes through in
``_hook_point.py``), attention at any length (``_long_attention.py``: fused kernels, the mask described, exact
regions recomputed in key tiles), its KV cache (``_cache.py``), the table of its hook points
(``_hook_table.py``) and what names a model (``_identity.py``). Imports torch only; nothing above it in model/."""

from gpt_shape_tracer.model.gpt._cache import MIN_CAPACITY, STORAGES, KVCache, stored, transaction
from gpt_shape_tracer.model.gpt._config import (
    ACTIVATIONS,
    EXTERNAL_FAMILIES,
    FAMILIES,
    HF_FAMILY,
    MAX_VOCAB,
    MAX_WIDTH,
    MODULE_FAMILY,
    GPTConfig,
    RopeScaling,
)
from gpt_shape_tracer.model.gpt._gpt import (
    GPT,
    AttentionHooks,
    DerivedAttention,
    PathNote,
    additive_mask,
    apply_rope,
    attention,
    block_attention,
    check_tokens,
    positions_and_keys,
    rope_cos_sin,
    rope_inv_freq,
    run_attention,
)
from gpt_shape_tracer.model.gpt._hook_point import HookPoint, TappedModule
from gpt_shape_tracer.model.gpt._hook_table import (
    HF_ROWS,
    HOOKS,
    HookSpec,
    act_name,
    dims_of,
    hooks_for,
    markdown_table,
    residual_sums,
    resolve,
    spec_for,
)
from gpt_shape_tracer.model.gpt._identity import (
    BackgroundDigest,
    DigestAbandoned,
    IdentityUnavailable,
    ModelIdentity,
    PendingIdentity,
    computed_identity,
    files_digest,
    identity_of,
    parameters_digest,
)
from gpt_shape_tracer.model.gpt._long_attention import (
    ATTENTION_MODES,
    SWEEP_CELLS,
    WHOLE_DERIVED,
    MaskSpec,
    Pooled,
    RowNorm,
    ScoreSweep,
    attention_bytes,
    attention_path,
    attention_path_settings,
    block_pool,
    choose_path,
    fused_attention,
    grid_edges,
    pattern_from,
    pattern_times_v,
    pool_pattern,
    region,
    row_logsumexp,
    row_norm,
    set_attention_path,
)
from gpt_shape_tracer.model.gpt._long_attention import STAGES as ATTENTION_STAGES

__all__ = [
    "ATTENTION_MODES", "ATTENTION_STAGES", "SWEEP_CELLS", "WHOLE_DERIVED", "MaskSpec", "Pooled", "RowNorm",
    "ScoreSweep",
    "attention_bytes", "attention_path", "attention_path_settings", "block_pool", "choose_path", "fused_attention",
    "grid_edges", "pattern_from", "pattern_times_v", "pool_pattern", "region", "row_logsumexp", "row_norm",
    "set_attention_path", "DerivedAttention", "PathNote",
    "run_attention",
    "ACTIVATIONS", "EXTERNAL_FAMILIES", "FAMILIES", "GPT", "HF_FAMILY", "HF_ROWS", "HOOKS", "MIN_CAPACITY",
    "MODULE_FAMILY", "STORAGES", "AttentionHooks", "BackgroundDigest", "DigestAbandoned", "GPTConfig", "HookPoint",
    "HookSpec", "IdentityUnavailable", "MAX_VOCAB", "MAX_WIDTH", "TappedModule",
    "KVCache", "ModelIdentity", "PendingIdentity", "RopeScaling", "act_name",
    "additive_mask", "apply_rope", "attention", "block_attention", "check_tokens", "computed_identity", "dims_of",
    "files_digest", "hooks_for", "identity_of", "markdown_table", "parameters_digest", "positions_and_keys",
    "residual_sums", "resolve", "rope_cos_sin", "rope_inv_freq", "spec_for", "stored", "transaction",
]
