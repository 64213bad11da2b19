"""The records of an engine run, all frozen: the pool, each request, each engine step, each request's attention.

Words as the engines use them. A *page* is ``page_size`` token positions of K and V for every layer (transformers
calls it a block: one page per layer, a block per request position range); the *pool* holds a fixed number of
them; a request's *block table* lists, in order, the pages that hold its logical positions (position p lies in page
``table[p // page_size]`` at row ``p % page_size``). No torch logic here except the tensors a
``RequestAttention`` carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

Contribution = Literal["prefill", "decode"]  # what a request brings to an engine step: a prompt chunk or one token
FinishReason = Literal["eos", "length"]  # why a request ended: its end-of-sequence token, or its max_new_tokens
CONTRIBUTIONS: tuple[Contribution, ...] = get_args(Contribution)
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)


@dataclass(frozen=True, slots=True)
class PoolFacts:
    """The page pool of a run, as transformers built it from the sizes given."""

    page_size: int  # token positions per page
    pages: int  # pages in the pool (transformers' num_blocks, after rounding up to whole sectors)
    pages_asked: int  # what the caller asked for
    max_batch_tokens: int  # query tokens one engine step may hold (prefill chunks + decode tokens)
    bytes_per_page: int  # K and V of page_size positions, every layer: 2 · L · G · d_head · page_size · bytes
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    dtype: str
    prefix_sharing: bool  # identical full pages of prompts are shared (ref counted) instead of recomputed

    @property
    def pool_bytes(self) -> int:
        return self.pages * self.bytes_per_page


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request of a run: what was asked, and what became of it."""

    request_id: str
    prompt: str | None  # the text, when the request was given as text
    prompt_ids: tuple[int, ...]
    arrival: int  # the engine step before which it was handed to the engine
    max_new_tokens: int
    generated_ids: tuple[int, ...]
    first_step: int | None  # the first engine step it was in (None: never scheduled)
    finished_step: int | None  # the engine step that produced its last token
    finish_reason: FinishReason | None
    preempted_at: tuple[int, ...]  # engine steps at which it lost its pages and went back to the queue
    prefix_hit_tokens: int  # prompt positions found already in the pool when it was first scheduled


@dataclass(frozen=True, slots=True)
class RequestInStep:
    """A request's part in one engine step."""

    request_id: str
    contribution: Contribution
    past: int  # logical positions already in its pages before this step
    tokens: int  # query tokens it brings: a prefill chunk's length, or 1 for a decode token
    block_table: tuple[int, ...]  # the pages this step's attention read, in logical order
    new_token: int | None  # the token this step produced for it (None: a prefill chunk that is not the last)
    prefix_hit: int  # positions matched in the pool instead of computed (its first step only; 0 otherwise)
    recompute: bool  # a prefill after a preemption: it recomputes what it had lost

    @property
    def positions(self) -> tuple[int, int]:
        """[start, stop) of the logical positions its query tokens have."""
        return self.past, self.past + self.tokens

    @property
    def length(self) -> int:
        """Keys its attention reads this step: every position up to and including its last query token."""
        return self.past + self.tokens


@dataclass(frozen=True, slots=True)
class EngineStep:
    """One engine step: a schedule, one forward over every scheduled token, the tokens it produced, the pool after."""

    step: int
    requests: tuple[RequestInStep, ...]  # empty: an idle step (nothing to run before a later arrival)
    arrived: tuple[str, ...]  # handed to the engine before this step
    finished: tuple[str, ...]  # ended with this step's token
    preempted: tuple[str, ...]  # lost their pages while this step was scheduled (requeued; recomputed later)
    allocated: tuple[int, ...]  # pages taken from the free pool for this step
    freed: tuple[int, ...]  # pages given back to the free pool (by finished, preempted or de-duplicated requests)
    cached: tuple[int, ...]  # pages no request holds, kept for their content (a later prompt with that prefix)
    shared: tuple[tuple[int, int], ...]  # (page, requests holding it) for every page held by 2 or more
    tables: tuple[tuple[str, tuple[int, ...]], ...]  # every live request's block table after the step
    pages_in_use: int  # pages some request holds after the step
    pages_free: int  # pages free after the step
    pages_total: int

    @property
    def query_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    def request(self, request_id: str) -> RequestInStep | None:
        return next((r for r in self.requests if r.request_id == request_id), None)


@dataclass(frozen=True, eq=False)
class RequestAttention:
    """One request's attention at one layer of one engine step, over its own logical positions 0 … length-1.

    ``q`` [H, n, d_head] its query tokens; ``k``, ``v`` [G, length, d_head] gathered from the pool's pages through
    its block table after this step wrote its new rows; ``pattern`` [H, n, length] its rows of the softmax
    (column j is logical position j, whatever page holds it)."""

    step: int
    request_id: str
    layer: int
    past: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pattern: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.pattern))
