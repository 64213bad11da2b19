"""A dry-run generation: the prefill of a prompt and ``k`` decode steps of a model on the meta device
(model/sources/_dry_run.py), every record's name, shape, axes and dtype as a run with weights would record them.

The prompt is tokenized when the model has a tokenizer; otherwise it is ``n`` placeholder ids. Each decode step
feeds one new token and the KV cache grows by one row per layer; nothing is sampled (there are no logits), and the
"chosen" ids are placeholders, labelled as such (``PLACEHOLDER_LABEL``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from gpt_shape_tracer.model.gpt import HookPoint
from gpt_shape_tracer.model.sources import MAX_DRY_RECORDS, on_meta
from gpt_shape_tracer.tracer.generation._traced import MAX_BATCH, PLACEHOLDER_ID, PLACEHOLDER_LABEL, TracedGeneration

if TYPE_CHECKING:
    from torch import nn

    from gpt_shape_tracer.model.sources import Decoder, TextTokenizer

DEFAULT_PROMPT_TOKENS = 16


class PlaceholderTokenizer:
    """What a tokenizer-less model is fed in a dry run: ``n`` placeholder ids (id 0) for any prompt."""

    eos_id = None
    eos_ids: tuple[int, ...] = ()

    def __init__(self, n: int, vocab_size: int) -> None:
        self.n = n
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [PLACEHOLDER_ID] * self.n

    def token_label(self, token_id: int) -> str:
        return PLACEHOLDER_LABEL

    def decode(self, ids: list[int]) -> str:
        return f"⟨{len(ids)} placeholder id(s)⟩"


def records_per_step(model: nn.Module) -> int:
    """A lower bound of the records one forward makes: one per hook point, an input and an output per module."""
    return sum(1 if isinstance(m, HookPoint) else 2 for m in model.modules())


def latent_cache(model: nn.Module) -> bool:
    """Whether the model caches a compressed latent instead of keys and values (DeepSeek's multi-head latent
    attention: transformers hands the cache c_KV ``[B,1,t,d_c]`` and the rotary key ``[B,1,t,d_R]`` in place of K
    and V, and our ``KVCache`` holds them as they are)."""
    return bool(getattr(getattr(model, "config", None), "latent_attention", False))


def dry_run(model: Decoder, tokenizer: TextTokenizer | None = None, prompt: str | None = None, *,
            n: int = DEFAULT_PROMPT_TOKENS, steps: int = 4, batch: int = 1, use_cache: bool = True) -> TracedGeneration:
    """Trace a dry run of ``model`` (on the meta device): the prefill of ``prompt`` (with ``tokenizer``), or of
    ``n`` placeholder ids, then ``steps`` decode steps; returns the ``TracedGeneration`` (shapes captured).
    ``use_cache=False``: every step recomputes all positions."""
    gen = prepare_dry_run(model, tokenizer, prompt, n=n, steps=steps, batch=batch, use_cache=use_cache)
    with no_cyclic_collection():
        gen.run(1 + steps)
    return gen


_GC_LOCK = threading.Lock()
_gc_pauses = 0  # dry runs in progress with the collector paused (one per thread at most)
_gc_was_enabled = False


@contextlib.contextmanager
def no_cyclic_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused while the block runs, then restored as it was. A dry run makes
    tens of thousands of small objects that live until it ends (records, costs, weak references to meta
    storages), and each automatic collection walks all of them again: a fifth of a 405B costed dry run's CPU time
    (docs/benchmarks.md). Nothing is leaked: reference counting still frees what it frees, and cycles made in the
    block are collected by the first collection after it. Nested and concurrent blocks (two threads) share one
    pause: the collector is restored when the last ends."""
    global _gc_pauses, _gc_was_enabled
    with _GC_LOCK:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def prepare_dry_run(model: Decoder, tokenizer: TextTokenizer | None = None, prompt: str | None = None, *,
                    n: int = DEFAULT_PROMPT_TOKENS, steps: int = 4, batch: int = 1,
                    use_cache: bool = True) -> TracedGeneration:
    """``dry_run``'s generation, checked and ready, before its first step (``tracer.costs`` steps it itself)."""
    if not on_meta(model):
        raise ValueError("a dry run needs a model on the meta device: load_model(spec, weights=False)")
    for what, value, low in (("n", n, 1), ("steps", steps, 0), ("batch", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{what} must be a whole number ≥ {low}, got {value!r}")
    if batch > MAX_BATCH:
        raise ValueError(f"batch = {batch}: at most {MAX_BATCH} sequences")
    estimate = records_per_step(model) * (1 + steps)
    if estimate > MAX_DRY_RECORDS:
        raise ValueError(f"this dry run would make at least {estimate:,} records ({records_per_step(model):,} per "
                         f"step × {1 + steps} steps); a dry-run trace holds at most {MAX_DRY_RECORDS:,}")
    if tokenizer is None or prompt is None:
        limit = model.config.n_ctx - 1 - steps
        if n > limit:
            raise ValueError(f"n = {n} placeholder ids and {steps} decode steps do not fit this model's n_ctx = "
                             f"{model.config.n_ctx}")
        tok = PlaceholderTokenizer(n, model.config.vocab_size)
        prompt = f"⟨{n} placeholder ids⟩"
        gen = TracedGeneration(model, tok, [prompt] * batch,  # type: ignore[arg-type]  # what it reads of one
                               capture="shapes", stop_at_eos=False, use_cache=use_cache)
    else:
        gen = TracedGeneration(model, tokenizer, [prompt] * batch, capture="shapes", stop_at_eos=False,
                               use_cache=use_cache)
    return gen
