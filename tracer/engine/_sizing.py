"""Sizing a page pool from a config, without weights: how many pages, and so how many concurrent requests of a
given length, fit in an accelerator's memory after the weights and the activations of a batch of
``max_batch_tokens`` query tokens.

The arithmetic is transformers' (``PagedAttentionMemoryHandler`` in
``transformers/generation/continuous_batching/cache.py``, 5.23), re-derived term by term and written out here so
each term can be shown and named; tests/tracer/test_engine.py checks it against the handler itself for the same inputs.
Its pieces, for a model of L full-attention layers, H query heads, G key/value heads of width d, ``a`` bytes per
value and pages of ``P`` positions:

* a *block* (one page per layer) is ``2·L·G·d·a·P`` bytes; the pool is handed out in *sectors* of
  ``lcm(block, 128)`` bytes, two of which are never used (the padding's trash rows);
* each query token of a batch costs the larger of its LM-head peak (none where the model keeps only the last
  position's logits) and its attention peak ``a·(hidden + H·d + 2·G·d + K/V read-back·d)`` (the read-back is
  ``2·H + G`` heads for eager and SDPA, which repeat K and V to every query head, ``2·G`` for flash), plus its
  share of the packed inputs (int32 rows, int64 read and write indices);
* each cached token costs its read-back copy and its read index beside its bytes in the pool;
* the additive mask, ``[M, pool tokens + M]`` (none for flash), is paid for by removing sectors;
* the logits of up to ``max_requests_per_batch`` (1024 by default) rows are reserved once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gpt_shape_tracer.tracer.engine._engine import EngineError

DEFAULT_MAX_BATCH_TOKENS = 8192  # transformers' default where none is given
DEFAULT_LOGIT_ROWS = 1024  # transformers' fallback max_requests_per_batch
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EngineSizing:
    """What fits: pages and concurrent requests in ``memory_bytes``, and every term that decided it."""

    dtype: str
    memory_bytes: int  # the accelerator's memory
    weights_bytes: int
    available_bytes: int  # (memory - weights) × max_memory_percent: what transformers sizes the cache from
    max_batch_tokens: int
    page_size: int
    bytes_per_page: int  # one block: page_size positions of K and V, every layer
    bytes_per_sector: int
    sectors: int
    pages: int  # whole pages (blocks) in the pool: 0 when nothing fits
    request_tokens: int
    pages_per_request: int
    concurrent_requests: int  # requests of request_tokens positions that fit at once
    cache_bytes: int  # the pool itself
    batch_token_bytes: int  # activations and inputs per query token
    cache_token_bytes: int  # read-back and index per cached token, beside its bytes in the pool
    mask_bytes: int
    fixed_bytes: int  # the trash sectors and the reserved logits rows
    footprint_bytes: int  # everything above: ≤ available_bytes when it fits
    note: str  # why nothing fits, or ""


def _weights_bytes(config: Any, dtype: torch.dtype) -> int:
    """Parameters × bytes: the model built from its config on the meta device (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def engine_sizing(config: Any, *, memory_bytes: int, request_tokens: int, dtype: str = "bfloat16",
                  page_size: int = 256, max_batch_tokens: int | None = None, weights_bytes: int | None = None,
                  max_memory_percent: float = 1.0, flash: bool = False, max_requests_per_batch: int | None = None,
                  logits_to_keep: bool = True, async_batching: bool = False, return_logprobs: bool = False,
                  max_blocks_per_request: int = 0) -> EngineSizing:
    """The pool transformers would build for ``config`` in ``memory_bytes`` of accelerator memory (see the
    module's docstring). ``weights_bytes``: what the weights take (default: the parameters of the model built on
    the meta device, × the dtype's bytes). ``request_tokens``: the length (prompt + generated) of the requests
    to count. The other options are ``ContinuousBatchingConfig``'s and the model's, with the same meaning."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    if dtype not in DTYPES:
        raise EngineError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if request_tokens < 1 or page_size < 1 or memory_bytes < 1:
        raise EngineError("request_tokens, page_size and memory_bytes must be ≥ 1")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    groups = group_layers_by_attn_type(text)
    if set(groups) != {"full_attention"}:
        raise EngineError(f"this config's layers are {', '.join(sorted(groups))}: the sizing covers "
                          "full-attention models (one kind of page)")
    torch_dtype = DTYPES[dtype]
    a, i32, i64 = torch_dtype.itemsize, 4, 8
    L = int(text.num_hidden_layers)
    H, hidden, vocab = int(text.num_attention_heads), int(text.hidden_size), int(text.vocab_size)
    G, d = int(find_num_key_value_heads(text)), int(find_head_dim(text))
    weights = _weights_bytes(config, torch_dtype) if weights_bytes is None else int(weights_bytes)
    available = int((memory_bytes - weights) * max_memory_percent)

    block = 2 * L * G * d * a * page_size
    sector = math.lcm(block, 128)
    tokens_per_sector = (sector // block) * page_size
    kv_read = 2 * G if flash else 2 * H + G
    masks = 0 if flash else 1
    io = 2 if async_batching else 1
    lm_head = 0 if logits_to_keep else hidden * a + vocab * 4
    attention = a * (hidden + H * d + 2 * G * d + kv_read * d)
    inputs = io * (7 * i32 + (2 if return_logprobs else 1) * i32 + max_blocks_per_request * i32 + i64 + i64)
    per_batch_token = max(lm_head, attention) + inputs
    per_cache_token = kv_read * d * a + io * i64
    per_sector = sector + tokens_per_sector * per_cache_token
    fixed = 2 * sector + ((max_requests_per_batch or DEFAULT_LOGIT_ROWS) * (hidden * a + vocab * 4)
                          if logits_to_keep else 0)
    M = DEFAULT_MAX_BATCH_TOKENS if max_batch_tokens is None else int(max_batch_tokens)

    def mask(sectors: int) -> int:
        return io * masks * a * M * (sectors * tokens_per_sector + M)

    sectors = (available - fixed - M * per_batch_token) // per_sector
    sectors -= math.ceil(mask(sectors) / (per_sector + mask(sectors + 1) - mask(sectors)))
    footprint = fixed + M * per_batch_token + sectors * per_sector + mask(sectors)
    note = ""
    if sectors <= 0 or footprint > available:
        note = (f"nothing fits: {max(available, 0):,} B left after {weights:,} B of weights, and a batch of {M} "
                f"tokens alone takes {M * per_batch_token + fixed:,} B")
        sectors = max(sectors, 0)
    pages = sectors * sector // block if not note else 0
    per_request = math.ceil(request_tokens / page_size)
    return EngineSizing(
        dtype=dtype, memory_bytes=int(memory_bytes), weights_bytes=weights, available_bytes=available,
        max_batch_tokens=M, page_size=page_size, bytes_per_page=block, bytes_per_sector=sector,
        sectors=sectors if not note else 0, pages=pages, request_tokens=request_tokens,
        pages_per_request=per_request, concurrent_requests=pages // per_request,
        cache_bytes=(sectors * sector) if not note else 0, batch_token_bytes=per_batch_token,
        cache_token_bytes=per_cache_token, mask_bytes=mask(sectors) if not note else 0, fixed_bytes=fixed,
        footprint_bytes=footprint if not note else 0, note=note)


def engine_sizing_table(config: Any, *, memory_bytes: int, request_tokens: int,
                        dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16"),
                        **options: Any) -> tuple[EngineSizing, ...]:
    """``engine_sizing`` for each dtype (the weights, the pages and the activations all change with it)."""
    return tuple(engine_sizing(config, memory_bytes=memory_bytes, request_tokens=request_tokens, dtype=dt,
                               **options) for dt in dtypes)
