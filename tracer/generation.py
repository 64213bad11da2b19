"""Step-by-step traced generation: one forward pass and one sampled token per step.

Step 0 is the prefill: the whole prompt, n₀ tokens, queries and keys alike.
Step s ≥ 1 feeds the token sampled at step s−1: with the KV cache that is one
query row (n = 1) over t = n₀ + s keys; without it, all n₀ + s tokens again.

Several prompts make a batch. Shorter prompts are padded (left by default, or
right); padding never gets attention — the mask shows −∞ in its columns — and
positions count real tokens only, so each row generates exactly what it would
alone.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from model.sampling import SamplingConfig, generate_step
from model.tokenizer import TextTokenizer
from tracer.capture import Tracer
from tracer.records import StepInfo
from tracer.store import DEFAULT_BUDGET_BYTES
from tracer.trace import Trace

MAX_RUN_STEPS = 256  # most steps one run() call may take
MAX_BATCH = 16  # most prompts in one batch
PAD_LABEL = "⟨pad⟩"


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, or nothing but padding)."""


class ContextFullError(ValueError):
    """The sequence has reached the model's n_ctx: no position is left for another token."""


@dataclass(frozen=True)
class RecomputeComparison:
    """The latest step redone with and without the KV cache (see ``compare_with_recompute``)."""

    max_abs_delta: float  # max |Δ logits|, cached path vs full recompute, rows sampled from
    cached_seconds: float  # untraced: the new position(s) over the cached ones
    full_seconds: float  # untraced: all t positions, no cache
    cached_rows: int  # query rows the cached path computes (n)
    full_rows: int  # query rows the full recompute computes (t)
    run_used_cache: bool  # whether this generation itself ran with the cache


class TracedGeneration:
    """Generate from ``prompt`` one traced step at a time.

    ``prompt`` is a string or a list of strings (a batch). Sampling is given as
    ``sampling=SamplingConfig(...)`` or as ``temperature=, top_k=, top_p=, seed=``.
    A prompt longer than n_ctx − 1 tokens is cut from the left (keeping its end)
    and ``warnings`` says so; ``truncate="error"`` refuses it instead.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TextTokenizer,
        prompt: str | Sequence[str],
        use_cache: bool = True,
        capture: str = "values",
        *,
        sampling: SamplingConfig | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        padding_side: str = "left",
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        copy: str = "auto",
        truncate: str = "left",
    ) -> None:
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if truncate not in ("left", "error"):
            raise ValueError(f"truncate must be 'left' or 'error', got {truncate!r}")
        loose = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        given = {k: v for k, v in loose.items() if v is not None}
        if sampling is not None and given:
            raise ValueError("give either sampling=SamplingConfig(...) or temperature/top_k/top_p/seed, not both")
        self.sampling = sampling if sampling is not None else SamplingConfig(**given)
        self.model = model
        self.tokenizer = tokenizer
        self.use_cache = use_cache
        self.padding_side = padding_side
        self.n_ctx: int = model.config.n_ctx
        self.warnings: list[str] = []
        self.prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.rows = self._encode(self.prompts, truncate)
        self.prompt_lengths = [len(r) for r in self.rows]
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self.tracer = Tracer(model, capture=capture, budget_bytes=budget_bytes, copy=copy)
        self.trace: Trace = self.tracer.trace
        self.cache = model.new_cache(len(self.rows)) if use_cache else None
        self.generator = self.sampling.generator()
        self.stopped: str = ""
        self._columns, self._is_token = self._pad(self.rows)
        self._last_feed: tuple | None = None
        self._last_logits: torch.Tensor | None = None
        self._update_meta()

    # -- prompts -------------------------------------------------------------------
    def _encode(self, prompts: list[str], truncate: str) -> list[list[int]]:
        if not prompts:
            raise PromptError("no prompt given")
        if len(prompts) > MAX_BATCH:
            raise PromptError(f"{len(prompts)} prompts: at most {MAX_BATCH} fit in one batch")
        rows = []
        for i, text in enumerate(prompts):
            which = f"prompt {i + 1}" if len(prompts) > 1 else "the prompt"
            if not isinstance(text, str):
                raise PromptError(f"{which} is not text ({type(text).__name__})")
            if not text.strip():
                raise PromptError(f"{which} is empty" if not text else f"{which} is only whitespace")
            ids = self.tokenizer.encode(text)
            if not ids:
                raise PromptError(f"{which} encodes to no tokens")
            limit = self.n_ctx - 1  # keep one position free for the first generated token
            if len(ids) > limit:
                if truncate == "error":
                    raise PromptError(f"{which} has {len(ids)} tokens; this model's n_ctx allows at most {limit}")
                self.warnings.append(
                    f"{which} had {len(ids)} tokens, more than n_ctx − 1 = {limit}: kept its last {limit} "
                    f"tokens (the first {len(ids) - limit} were cut)"
                )
                ids = ids[-limit:]
            rows.append(ids)
        return rows

    def _pad(self, rows: list[list[int]]) -> tuple[list[list[int]], list[list[bool]]]:
        width = max(len(r) for r in rows)
        cols, mask = [], []
        for r in rows:
            pad = width - len(r)
            if self.padding_side == "left":
                cols.append([self.pad_id] * pad + r)
                mask.append([False] * pad + [True] * len(r))
            else:
                cols.append(r + [self.pad_id] * pad)
                mask.append([True] * len(r) + [False] * pad)
        return cols, mask

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def padded(self) -> bool:
        return not all(all(m) for m in self._is_token)

    # -- stepping ------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        return len(self.trace.steps)

    @property
    def cache_length(self) -> int:
        return self.cache.length if self.cache is not None else 0

    @property
    def sequence_length(self) -> int:
        """Columns of the padded token matrix so far (prompt width + generated tokens)."""
        return len(self._columns[0])

    def _feed(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        cols = torch.tensor(self._columns)
        mask = torch.tensor(self._is_token) if self.padded else None
        step = self.n_steps
        if step == 0:
            last = None
            if self.padded and self.padding_side == "right":
                last = torch.tensor(self.prompt_lengths) - 1
            return cols, mask, last
        if self.use_cache:
            return cols[:, -1:], None, None
        return cols, mask, None

    def step(self) -> StepInfo:
        """One forward pass (traced) and one sampled token per row."""
        if self.sequence_length >= self.n_ctx:
            self.stopped = (
                f"reached n_ctx = {self.n_ctx}: the positional table has no row for another token, "
                "so generation stops here (Reset, or start from a shorter prompt)"
            )
            raise ContextFullError(self.stopped)
        tokens, mask, last = self._feed()
        before = self.cache_length
        started = time.perf_counter()
        with torch.no_grad(), self.tracer.active():
            out = generate_step(self.model, tokens, self.sampling, self.generator, self.cache,
                                padding_mask=mask, last_index=last)
        seconds = time.perf_counter() - started
        info = self.trace.steps[-1]
        n = tokens.size(1)
        info.n, info.t = n, (before + n) if self.use_cache else n
        info.cache_length_before, info.cache_length_after = before, self.cache_length
        info.use_cache = self.use_cache
        info.seconds = seconds
        res = out.sample
        info.fed_tokens = tokens.tolist()
        info.sampled = res.token.tolist()
        info.sampled_prob = [round(float(p), 6) for p in res.token_prob]
        info.candidates = res.candidates.tolist()
        info.candidate_labels = [[self.tokenizer.token_label(i) for i in row] for row in info.candidates]
        info.stage_probs = [[[round(float(p), 6) for p in stage] for stage in row] for row in res.stage_probs]
        info.kept = res.kept.tolist()
        self._last_feed = (tokens, mask, last, before)
        self._last_logits = out.last_logits
        for row, token in zip(self.rows, info.sampled):
            row.append(int(token))
        for cols, is_tok, token in zip(self._columns, self._is_token, info.sampled):
            cols.append(int(token))
            is_tok.append(True)
        self._update_meta()
        return info

    def run(self, n: int) -> int:
        """Up to ``n`` steps (1 ≤ n ≤ MAX_RUN_STEPS); stops early at n_ctx. Returns steps taken."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_RUN_STEPS:
            raise ValueError(f"run(n) takes 1 ≤ n ≤ {MAX_RUN_STEPS} steps, got {n!r}")
        done = 0
        for _ in range(n):
            try:
                self.step()
            except ContextFullError:
                break
            done += 1
        return done

    @torch.no_grad()
    def compare_with_recompute(self, repeats: int = 1) -> RecomputeComparison:
        """Redo the latest step both ways, untraced, and compare: the cached path
        (the new position(s) over a cache of the earlier ones) and a full recompute
        of all t positions without a cache.

        ``max_abs_delta`` is over the logits rows sampled from. With the cache on,
        the cached side is this run's own logits (the seed's claim that only the new
        row is needed, checked on the real run); with it off, the run *is* the full
        recompute, so the cached side is an untraced cached re-run. Both timings
        are untraced, so neither includes the tracer's recording; each is the
        fastest of ``repeats`` runs."""
        if self._last_feed is None or self._last_logits is None:
            raise ValueError("no step has run yet")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an integer ≥ 1, got {repeats!r}")
        width = self.sequence_length - 1  # the columns that existed when the latest step ran
        cols = torch.tensor([c[:width] for c in self._columns])
        mask = torch.tensor([m[:width] for m in self._is_token]) if self.padded else None
        tokens, _, last, _ = self._last_feed
        pick = (lambda lg: lg[:, -1, :]) if last is None else (lambda lg: lg[torch.arange(lg.size(0)), last])

        full_seconds = cached_seconds = float("inf")
        new = tokens.size(1) if self.use_cache else (width if self.n_steps == 1 else 1)
        past = width - new
        if self.use_cache:
            base = self.cache  # this run's own cache: its first `past` rows are what the step started from
        else:  # no cache kept: fill one with the earlier positions (untimed)
            base = self.model.new_cache(cols.size(0))
            if past:
                self.model(cols[:, :past], cache=base, padding_mask=mask[:, :past] if mask is not None else None)
        for _ in range(repeats):  # the fastest of the repeats: the least disturbed by a busy machine
            started = time.perf_counter()
            full = pick(self.model(cols, padding_mask=mask))
            full_seconds = min(full_seconds, time.perf_counter() - started)

            cache = base.copy(past)  # the cached path: the earlier positions' K, V, then this step's new ones
            started = time.perf_counter()
            cached = self.model(cols[:, past:], cache=cache, padding_mask=None if past else mask)
            cached_seconds = min(cached_seconds, time.perf_counter() - started)
        cached = pick(cached)
        run_cached = self._last_logits if self.use_cache else cached
        return RecomputeComparison(
            max_abs_delta=float((full - run_cached).abs().max()),
            cached_seconds=cached_seconds,
            full_seconds=full_seconds,
            cached_rows=new,
            full_rows=width,
            run_used_cache=self.use_cache,
        )

    # -- views of the state --------------------------------------------------------
    def text(self, row: int = 0) -> str:
        return self.tokenizer.decode(self.rows[row])

    def generated(self, row: int = 0) -> list[int]:
        return self.rows[row][self.prompt_lengths[row] :]

    def column_labels(self, row: int = 0) -> list[str]:
        """Display label of every column of the padded matrix (key positions) for one row."""
        return [
            self.tokenizer.token_label(tok) if is_tok else PAD_LABEL
            for tok, is_tok in zip(self._columns[row], self._is_token[row])
        ]

    def _update_meta(self) -> None:
        cfg = self.model.config
        self.trace.meta.update({
            "kind": "generation",
            "prompts": self.prompts,
            "prompt_lengths": self.prompt_lengths,
            "columns": [list(c) for c in self._columns],
            "is_token": [list(m) for m in self._is_token],
            "labels": [self.column_labels(r) for r in range(self.batch_size)],
            "use_cache": self.use_cache,
            "padding_side": self.padding_side,
            "sampling": {"temperature": self.sampling.temperature, "top_k": self.sampling.top_k,
                         "top_p": self.sampling.top_p, "seed": self.sampling.seed},
            "model_config": {
                k: getattr(cfg, k) for k in ("vocab_size", "n_ctx", "d_model", "n_layer", "n_head", "d_ff")
            },
            "warnings": list(self.warnings),
        })

    def close(self) -> None:
        self.tracer.close()
