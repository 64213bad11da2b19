"""A cheaper KV cache, measured: ``cache_precision(generation, storage, steps)``.

The same prompt is run twice, greedily, side by side: once with a cache in the model's own precision (the
reference) and once with a cache that rounds every row it stores to ``storage`` (bfloat16, float16, or int8
with one absmax scale per row of each head: model/gpt/_cache.py). Both are fed the reference's tokens, so every
step compares the same context: the largest |Δ logits| of the row a token is chosen from, and whether the
cheaper cache's own argmax would have chosen another token. What each cache holds is counted from its rows:
2·L·B·G·t·d_head numbers at the storage's size (plus int8's scales), and for a grouped-query model what the
same cache would hold with one key/value head per query head (G = H).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt_shape_tracer.model.gpt import STORAGES
from gpt_shape_tracer.tracer.generation import TracedGeneration


@dataclass(frozen=True)
class PrecisionStep:
    step: int
    max_abs_delta: float  # max |Δ logits| over the sequences' chosen-from rows, same tokens fed
    fed: tuple[int, ...]  # the reference's greedy token per sequence (fed to both at the next step)
    own: tuple[int, ...]  # the cheaper cache's own argmax per sequence

    @property
    def differs(self) -> bool:
        return self.fed != self.own


@dataclass(frozen=True)
class CachePrecisionRun:
    storage: str
    steps: tuple[PrecisionStep, ...]
    reference_bytes: int  # the model-precision cache after the last step
    stored_bytes: int  # the same rows stored as ``storage``
    n_layer: int
    batch: int
    kv_heads: int  # G
    query_heads: int  # H
    d_head: int
    t: int  # positions cached after the last step
    number_bytes: int  # bytes per stored number (int8: 1, its scales counted apart)

    @property
    def first_difference(self) -> int | None:
        """The first step whose own choice differs from the reference's, or None."""
        return next((s.step for s in self.steps if s.differs), None)

    @property
    def as_multi_head_bytes(self) -> int:
        """What the cheaper cache would hold with G = H (a multi-head model of the same widths)."""
        return self.stored_bytes * self.query_heads // self.kv_heads

    def formula(self) -> str:
        """The stored bytes as the formula with this run's numbers."""
        numbers = 2 * self.n_layer * self.batch * self.kv_heads * self.t * self.d_head
        text = (f"2·L·B·G·t·d_head = 2·{self.n_layer}·{self.batch}·{self.kv_heads}·{self.t}·{self.d_head} = "
                f"{numbers:,} numbers × {self.number_bytes:g} B")
        if self.storage == "int8":
            scales = 2 * self.n_layer * self.batch * self.kv_heads * self.t
            text += f" + {scales:,} scales × 4 B"
        return text + f" = {self.stored_bytes:,} B"


@torch.no_grad()
def cache_precision(generation: TracedGeneration, storage: str, steps: int = 16) -> CachePrecisionRun:
    """Run ``generation``'s prompt ``steps`` greedy steps with the model-precision cache and with one storing
    ``storage``, untraced, feeding both the reference's tokens (the generation itself is not touched)."""
    if storage not in STORAGES or storage == "model":
        raise ValueError(f"storage must be one of {tuple(s for s in STORAGES if s != 'model')}, got {storage!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number ≥ 1, got {steps!r}")
    model, facts = generation.model, generation.facts
    batch = facts.batch_size
    reason = getattr(model, "no_cache_reason", None)  # your own module; a family whose forward takes no cache
    if reason:
        raise ValueError(f"{reason}: there is no cache to store cheaper")
    if getattr(model.config, "latent_attention", False):
        raise ValueError("this model uses multi-head latent attention: its cache holds a compressed latent and a "
                         "rotary key, not K and V, and this experiment counts and stores K and V")
    width = facts.info.prompt_width
    if width + steps > model.config.n_ctx:
        raise ValueError(f"{steps} steps after a {width}-column prompt pass the model's n_ctx of {model.config.n_ctx}")
    device = generation.device  # every tensor fed to the model is made where its weights are
    columns = torch.tensor([facts.columns(r, 0) for r in range(batch)], device=device)
    real = torch.tensor([facts.is_token(r, 0) for r in range(batch)], device=device)
    mask = real if not bool(real.all()) else None
    last = torch.tensor([facts.last_token_column(r, 0) for r in range(batch)], device=device)  # the prefill's row
    reference, cheaper = model.new_cache(batch), model.new_cache(batch, storage)
    feed, rows = columns, last
    out = []
    for step in range(steps):
        ref = model(feed, cache=reference, padding_mask=mask)[torch.arange(batch, device=device), rows].float()
        got = model(feed, cache=cheaper, padding_mask=mask)[torch.arange(batch, device=device), rows].float()
        fed = ref.argmax(dim=-1)
        out.append(PrecisionStep(step, float((ref - got).abs().max()), tuple(fed.tolist()),
                                 tuple(got.argmax(dim=-1).tolist())))
        feed, rows, mask = fed[:, None], torch.zeros(batch, dtype=torch.long, device=device), None  # one column
    keys = reference.keys[0]
    assert keys is not None  # every layer holds rows after a step
    return CachePrecisionRun(storage, tuple(out), reference.nbytes, cheaper.stored_nbytes, model.config.n_layer,
                             batch, keys.shape[1], model.config.n_head, keys.shape[-1], reference.length,
                             cheaper.stored_number_bytes)
