"""Choosing the next token: greedy, temperature, top-k, top-p — seeded and deterministic.

``P = softmax(z / τ)`` (τ the temperature): τ < 1 sharpens, τ > 1 flattens;
τ = 0 means greedy (argmax). Top-k keeps the k most probable tokens, top-p the
smallest set whose probability reaches p; both renormalise what they keep.
Every stage is kept (for the top candidates) so a view can show how each
setting reshaped the distribution.

``generate_step`` is one forward pass and one sampled token, so a tracer can
step through generation.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpt_shape_tracer.model.gpt import KVCache

if TYPE_CHECKING:
    from gpt_shape_tracer.model.sources import Decoder

MAX_TEMPERATURE = 100.0  # above this softmax(z/τ) is uniform to float precision for any real logits
CANDIDATES = 20  # tokens per row kept for the stage-by-stage view


class SamplingError(ValueError):
    """A sampling parameter outside its documented range."""


@dataclass(frozen=True)
class SamplingConfig:
    """How to turn logits into a token.

    temperature: τ in softmax(z/τ); 0 means greedy, otherwise 0 < τ ≤ 100.
    top_k: keep the k most probable tokens; None or 0 turns it off; k larger than V keeps all V.
    top_p: keep the smallest set of tokens whose probability reaches p, 0 < p ≤ 1; None is off.
    seed: integer seed of the generator; the same seed gives the same tokens.
    """

    temperature: float = 0.0  # greedy unless asked, as in the app and on the command line
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(float(t)):
            raise SamplingError(f"temperature must be a finite number, got {t!r}")
        if t < 0:
            raise SamplingError(f"temperature must be ≥ 0 (0 = greedy), got {t}")
        if t > MAX_TEMPERATURE:
            raise SamplingError(
                f"temperature {t} is above the maximum {MAX_TEMPERATURE:g}: the distribution would be "
                "uniform to float precision"
            )
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0):
            raise SamplingError(f"top_k must be a non-negative integer or None (0 = off), got {k!r}")
        p = self.top_p
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, numbers.Real) or not math.isfinite(float(p)):
                raise SamplingError(f"top_p must be a number in (0, 1] or None, got {p!r}")
            if not 0 < p <= 1:
                raise SamplingError(f"top_p must lie in (0, 1], got {p}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise SamplingError(f"seed must be an integer, got {s!r}")
        if not -(2**63) <= s < 2**64:
            raise SamplingError(f"seed must fit in 64 bits, got {s}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy (argmax)"
        parts = [f"τ = {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k = {self.top_k}")
        if self.top_p is not None and self.top_p < 1:
            parts.append(f"top-p = {self.top_p:g}")
        parts.append(f"seed {self.seed}")
        return ", ".join(parts)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The seeded generator that draws on ``device`` (where the logits are: a draw on a GPU then needs no copy
        of them to the host). On the CPU the same tokens for a seed as ever; a CUDA generator is another algorithm
        (Philox, not the CPU's Mersenne Twister), so a seed draws other tokens there than on the CPU (greedy picks
        the same wherever the logits agree)."""
        return torch.Generator(device=device).manual_seed(int(self.seed) % 2**64)


STAGES = ("softmax(z)", "softmax(z/τ)", "top-k", "top-p")


@dataclass
class SampleResult:
    """One sampled token per row and how the distribution got there."""

    token: torch.Tensor  # [B] the chosen ids
    probs: torch.Tensor  # [B, V] the distribution the token was drawn from (after every filter)
    candidates: torch.Tensor  # [B, K] ids: the most probable under softmax(z); the chosen one always among them
    stage_probs: torch.Tensor  # [B, len(STAGES), K] probability of each candidate at each stage
    kept: torch.Tensor  # [B, len(STAGES)] how many tokens have non-zero probability at each stage

    @property
    def token_prob(self) -> torch.Tensor:
        """[B] probability of the chosen token under the final distribution."""
        return self.probs.gather(1, self.token[:, None])[:, 0]


def _top_k(probs: torch.Tensor, k: int | None) -> torch.Tensor:
    if not k or k >= probs.size(-1):
        return probs
    threshold = probs.topk(k, dim=-1).values[..., -1:]  # [B, 1], the k-th largest
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def _top_p(probs: torch.Tensor, p: float | None) -> torch.Tensor:
    if p is None or p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of the tokens ahead of each
    keep_sorted = before < p
    keep_sorted[..., 0] = True  # the most probable token always stays (p below float32's smallest is 0 there)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None) -> SampleResult:
    """Pick one token per row of ``logits`` ``[B, V]``."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {list(logits.shape)}")
    if generator is not None and not config.greedy and generator.device.type != logits.device.type:
        raise ValueError(f"the generator draws on {generator.device} but the logits are on {logits.device}: "
                         f"make it where they are (SamplingConfig.generator(device))")
    z = logits.detach().float()
    base = torch.softmax(z, dim=-1)
    if config.greedy:
        tempered = filtered_k = final = base
        token = base.argmax(dim=-1)
    else:
        # shift, then divide in float64: z/τ overflows to inf for a tiny τ (and τ itself rounds to 0 in
        # float32), while (z − max z)/τ in float64 only reaches −inf, and the top logit stays at 0
        shifted = (z - z.max(dim=-1, keepdim=True).values).double()
        tempered = torch.softmax(shifted / config.temperature, dim=-1).float()
        filtered_k = _top_k(tempered, config.top_k)
        final = _top_p(filtered_k, config.top_p)
        token = torch.multinomial(final, 1, generator=generator)[:, 0]
    stages = torch.stack([base, tempered, filtered_k, final], dim=1)  # [B, 4, V]
    top = base.topk(min(CANDIDATES, z.size(-1)), dim=-1).indices  # [B, K]
    chosen_in_top = (top == token[:, None]).any(dim=-1)
    candidates = top.clone()
    candidates[:, -1] = torch.where(chosen_in_top, top[:, -1], token)  # the chosen token is always a candidate
    stage_probs = stages.gather(2, candidates[:, None, :].expand(-1, len(STAGES), -1))
    kept = (stages > 0).sum(dim=-1)
    return SampleResult(token=token, probs=final, candidates=candidates, stage_probs=stage_probs, kept=kept)


@dataclass
class StepOutput:
    logits: torch.Tensor  # [B, n, V] of the forward pass
    last_logits: torch.Tensor  # [B, V] the rows the tokens were sampled from
    sample: SampleResult


@torch.no_grad()
def generate_step(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    cache: KVCache | None = None,
    *,
    padding_mask: torch.Tensor | None = None,
    last_index: torch.Tensor | None = None,
) -> StepOutput:
    """One forward pass of ``tokens`` ``[B, n]`` and one sampled token per row.

    ``last_index`` ``[B]`` picks which position's logits each row samples from
    (default: the last one — right-padded prompts need their own last real token)."""
    logits = model(tokens, cache, padding_mask=padding_mask)  # [B, n, V]
    if last_index is None:
        last = logits[:, -1, :]
    else:
        last = logits[torch.arange(logits.size(0)), last_index]
    return StepOutput(logits=logits, last_logits=last, sample=sample(last, sampling, generator))


@torch.no_grad()
def generate(
    model: Decoder,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Continue one prompt by ``max_new_tokens`` tokens (stops early at n_ctx)."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    sampling = sampling or SamplingConfig(temperature=0)
    generator = sampling.generator()
    n_ctx = model.config.n_ctx
    ids = list(prompt_ids)
    cache = model.new_cache(1) if use_cache else None
    feed = ids
    for _ in range(max_new_tokens):
        if len(ids) >= n_ctx:
            break
        out = generate_step(model, torch.tensor([feed]), sampling, generator, cache)
        nxt = int(out.sample.token[0])
        ids.append(nxt)
        feed = [nxt] if use_cache else ids
    return ids[len(prompt_ids) :]
