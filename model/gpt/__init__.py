"""Our readable GPT, the reference a student opens: one model for GPT-2, Llama, Mistral and Qwen2 (``_gpt.py``,
read bottom-up), attention at any length (``_long_attention.py``: fused kernels, the mask described, exact
regions recomputed in key tiles), its KV cache (``_cache.py``), the table of its hook points
(``_hook_table.py``) and what names a model (``_identity.py``). Imports torch only; nothing above it in model/."""

from model.gpt._cache import MIN_CAPACITY, STORAGES, KVCache, stored, transaction
from model.gpt._gpt import (
    ACTIVATIONS,
    EXTERNAL_FAMILIES,
    FAMILIES,
    GPT,
    HF_FAMILY,
    MAX_VOCAB,
    MAX_WIDTH,
    MODULE_FAMILY,
    AttentionHooks,
    DerivedAttention,
    GPTConfig,
    HookPoint,
    PathNote,
    RopeScaling,
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
from model.gpt._hook_table import (
    HF_ROWS,
    HOOKS,
    HookSpec,
    act_name,
    dims_of,
    hooks_for,
    markdown_table,
    resolve,
    spec_for,
)
from model.gpt._identity import (
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
from model.gpt._long_attention import (
    ATTENTION_MODES,
    KEY_TILE,
    MaskSpec,
    RowNorm,
    attention_bytes,
    attention_path,
    attention_path_settings,
    block_pool,
    choose_path,
    fused_attention,
    grid_edges,
    pattern_from,
    pattern_times_v,
    region,
    row_logsumexp,
    row_norm,
    set_attention_path,
)
from model.gpt._long_attention import STAGES as ATTENTION_STAGES

__all__ = [
    "ATTENTION_MODES", "ATTENTION_STAGES", "KEY_TILE", "MaskSpec", "RowNorm", "attention_bytes", "attention_path",
    "attention_path_settings", "block_pool", "choose_path", "fused_attention", "grid_edges", "pattern_from",
    "pattern_times_v", "region", "row_logsumexp", "row_norm", "set_attention_path", "DerivedAttention", "PathNote",
    "run_attention",
    "ACTIVATIONS", "EXTERNAL_FAMILIES", "FAMILIES", "GPT", "HF_FAMILY", "HF_ROWS", "HOOKS", "MIN_CAPACITY",
    "MODULE_FAMILY", "STORAGES", "AttentionHooks", "BackgroundDigest", "DigestAbandoned", "GPTConfig", "HookPoint",
    "HookSpec", "IdentityUnavailable", "MAX_VOCAB", "MAX_WIDTH",
    "KVCache", "ModelIdentity", "PendingIdentity", "RopeScaling", "act_name",
    "additive_mask", "apply_rope", "attention", "block_attention", "check_tokens", "computed_identity", "dims_of",
    "files_digest", "hooks_for", "identity_of", "markdown_table", "parameters_digest", "positions_and_keys",
    "resolve", "rope_cos_sin", "rope_inv_freq", "spec_for", "stored", "transaction",
]
