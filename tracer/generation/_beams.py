"""Beam search, one traced forward per step, equal to transformers' ``generate(num_beams=k)``.

Each prompt keeps k hypotheses (beams). A step feeds every beam's newest token (the prefill: the prompt, repeated
k times), turns each beam's last logits into log-probabilities, adds them to the beam's running score and keeps,
per prompt, the best 2k of the k·V continuations: the best k that did not end (an end-of-sequence token or the
last allowed position) go on running; those that ended enter the prompt's list of k finished hypotheses if their
length-penalised score, score / generated_length ** length_penalty, beats one there. A surviving beam may
continue another beam's history, so the cache is *reordered*: row i of every layer's K and V becomes a copy of
row ``beam_idx[i]`` (``KVCache.reorder``, transformers' ``Cache.reorder_cache``).

The decisions are transformers' own: the step calls the same functions its ``_beam_search`` calls
(``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``, ``_update_finished_beams``,
``_check_early_stop_heuristic``, ``_beam_search_has_unfinished_sequences``: private, pinned by
tests/tracer/test_beams.py, which compares sequences, scores and every step's ``beam_idx`` with ``generate``). What is
ours is the stepping (one forward at a time, on any model this project opens, traced) and the record of each
step (``BeamStep``). No logits processor runs (a bare config's ``generate`` runs none for beam search either).

Legend: B prompts, k beams, V vocabulary, L = padded prompt width + max_new_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from gpt_shape_tracer.model.sources import TextTokenizer, input_device_of
from gpt_shape_tracer.tracer.capture import Tracer
from gpt_shape_tracer.tracer.generation._events import CacheEvent
from gpt_shape_tracer.tracer.storage import DEFAULT_BUDGET_BYTES

MAX_BEAMS = 16
MAX_NEW_TOKENS = 256
EARLY_STOPPING = (False, True, "never")
SNAPSHOT_BYTES = 64 * 2**20  # most bytes of one layer's K rows kept, all steps together, for the reorder's views


class BeamSearchError(ValueError):
    """Settings a beam search cannot run with (said with the numbers), or a model whose cache it cannot reorder."""


@dataclass(frozen=True)
class BeamCandidate:
    """One of the 2k continuations a prompt's step ranked: ``parent`` beam + ``token``, its running score, and
    what became of it ("running": one of the k kept; "finished": entered the finished list; "ended": ended but
    did not beat a finished hypothesis; "dropped": not among the k best that go on)."""

    parent: int
    token: int
    score: float
    fate: str


@dataclass(frozen=True)
class BeamStep:
    """What one step of beam search did, per prompt ``b`` and beam ``j`` (lists of length B, each of length k).

    ``tokens[b][j]``: the token beam j of prompt b took at this step; ``parents[b][j]``: the beam (0…k−1) whose
    history it continues; ``scores[b][j]``: its running score (the sum of its tokens' log-probabilities);
    ``beam_idx``: the flattened rows the cache was reordered from (row ``b·k + j`` ← ``beam_idx[b·k + j]``);
    ``candidates[b]``: the 2k continuations ranked, each with its fate; ``finished_scores[b]``: the prompt's
    finished hypotheses' length-penalised scores (−1e9: an empty slot); ``keys_before`` / ``keys_after``: one
    layer's cached keys ``[B·k, G, t, d_head]`` before and after the reorder (None once the search's snapshots
    would pass ``SNAPSHOT_BYTES``); ``cache_events``: what the step did to the cache, as every strategy says it
    (``CacheEvent``: the forward's grow, then the reorder)."""

    step: int
    tokens: tuple[tuple[int, ...], ...]
    parents: tuple[tuple[int, ...], ...]
    scores: tuple[tuple[float, ...], ...]
    beam_idx: tuple[int, ...]
    candidates: tuple[tuple[BeamCandidate, ...], ...]
    finished_scores: tuple[tuple[float, ...], ...]
    done: bool
    snapshot_layer: int
    keys_before: torch.Tensor | None
    keys_after: torch.Tensor | None
    cache_events: tuple[CacheEvent, ...] = ()

    @property
    def moved_rows(self) -> int:
        """Cache rows (beams) that now hold another beam's history."""
        return sum(1 for i, src in enumerate(self.beam_idx) if src != i)


@dataclass(frozen=True)
class BeamResult:
    """The best ``num_return_sequences`` hypotheses per prompt, best first (as ``generate`` returns them):
    token ids (prompt included, the prompt's left padding too), their length-penalised scores, and per
    generated position the flattened beam it came from."""

    sequences: tuple[tuple[int, ...], ...]
    scores: tuple[float, ...]
    beam_indices: tuple[tuple[int, ...], ...]


def _transformers_beam_steps():
    """transformers' beam-search functions, on an object that holds no model (they read no state of ``self``)."""
    from transformers.generation.utils import GenerationMixin

    return GenerationMixin()


class BeamSearch:
    """Beam search over ``prompt`` (a string or a list: a batch, left-padded), traced one forward per step.

    ``num_beams`` k ≥ 2; ``max_new_tokens``; ``length_penalty`` (the score of a finished hypothesis is its sum of
    log-probabilities / its generated length ** length_penalty); ``early_stopping`` (False, True or "never", as
    transformers'); ``num_return_sequences`` ≤ k; ``eos_ids``: the tokens that end a hypothesis (default: the
    tokenizer's). ``snapshot_layer``: the layer whose cached keys each step keeps before and after the reorder.
    """

    def __init__(self, model, tokenizer: TextTokenizer, prompt: str | Sequence[str], num_beams: int = 4, *,
                 max_new_tokens: int = 16, length_penalty: float = 1.0, early_stopping: bool | str = False,
                 num_return_sequences: int = 1, eos_ids: Sequence[int] | None = None, capture: str = "values",
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, snapshot_layer: int = 0) -> None:
        if isinstance(num_beams, bool) or not isinstance(num_beams, int) or not 2 <= num_beams <= MAX_BEAMS:
            raise BeamSearchError(f"num_beams must be a whole number from 2 to {MAX_BEAMS}, got {num_beams!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
            raise BeamSearchError(f"max_new_tokens must be from 1 to {MAX_NEW_TOKENS}, got {max_new_tokens!r}")
        if not 1 <= num_return_sequences <= num_beams:
            raise BeamSearchError(f"num_return_sequences must be from 1 to num_beams = {num_beams}, "
                                  f"got {num_return_sequences!r}")
        if early_stopping not in EARLY_STOPPING or isinstance(early_stopping, int) and \
                not isinstance(early_stopping, bool):
            raise BeamSearchError(f"early_stopping must be False, True or 'never', got {early_stopping!r}")
        length_penalty = float(length_penalty)
        if not torch.isfinite(torch.tensor(length_penalty)):
            raise BeamSearchError(f"length_penalty must be a finite number, got {length_penalty!r}")
        prompts = (prompt,) if isinstance(prompt, str) else tuple(prompt)
        if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
            raise BeamSearchError("every prompt must be non-empty text")
        rows = [tokenizer.encode(p) for p in prompts]
        if any(not r for r in rows):
            raise BeamSearchError("a prompt encodes to no tokens")
        width = max(map(len, rows))
        n_ctx = model.config.n_ctx
        if width + max_new_tokens > n_ctx:
            raise BeamSearchError(f"the prompt ({width} tokens) and {max_new_tokens} new tokens need "
                                  f"{width + max_new_tokens} positions; this model has n_ctx = {n_ctx}")
        if not 0 <= snapshot_layer < model.config.n_layer:
            raise BeamSearchError(f"snapshot_layer must be 0 … {model.config.n_layer - 1}, got {snapshot_layer!r}")
        self.model, self.tokenizer, self.prompts = model, tokenizer, prompts
        self.num_beams, self.max_new_tokens = num_beams, max_new_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.num_return_sequences, self.snapshot_layer = num_return_sequences, snapshot_layer
        declared = tuple(getattr(tokenizer, "eos_ids", ()) or ()) if eos_ids is None else tuple(eos_ids)
        self.eos_ids = tuple(int(i) for i in declared)
        B, k = len(prompts), num_beams
        self.pad_id = self.eos_ids[0] if self.eos_ids else (tokenizer.eos_id if tokenizer.eos_id is not None else 0)
        # left padding, each prompt repeated k times in a row (transformers' _expand_inputs_for_generation)
        padded = torch.tensor([[self.pad_id] * (width - len(r)) + list(r) for r in rows])
        real = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
        self.prompt_width = width
        self._prompt = padded.repeat_interleave(k, dim=0)  # [B·k, n]
        self._real = real.repeat_interleave(k, dim=0) if not bool(real.all()) else None
        self.max_length = width + max_new_tokens
        if getattr(model, "no_cache_reason", None):  # OpenAI GPT, your own module: no cache to reorder
            raise BeamSearchError(f"{model.no_cache_reason}: beam search reorders a KV cache's rows every step, and "
                                  "this model keeps none")
        self.cache = model.new_cache(B * k)
        if getattr(self.cache, "states", None):
            raise BeamSearchError("this model keeps convolution / state-space state beside its KV cache; beam "
                                  "search reorders the KV cache only, so it is not offered for such a model yet")
        self.tracer = Tracer(model, capture=capture, budget_bytes=budget_bytes)
        self.trace = self.tracer.trace
        self._hf = _transformers_beam_steps()
        # transformers' beam state, [B, k, …] (the names of its _beam_search), where the logits come out: its top-k
        # breaks ties (the last step's −1e9 placeholders) in that device's order, so ours must decide there too
        self.device = device = input_device_of(model)
        fill = self.eos_ids[0] if self.eos_ids else -1  # what generate() leaves after a shorter hypothesis
        self._running = torch.full((B, k, self.max_length), fill, dtype=torch.int64, device=device)
        self._running[:, :, :width] = padded[:, None, :].to(device)
        self._sequences = self._running.clone()
        self._running_scores = torch.zeros(B, k, device=device)
        self._running_scores[:, 1:] = -1e9
        self._scores = torch.full((B, k), -1e9, device=device)
        self._finished = torch.zeros(B, k, dtype=torch.bool, device=device)
        self._improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
        self._running_beams = torch.full((B, k, max_new_tokens), -1, dtype=torch.int32, device=device)
        self._beams = self._running_beams.clone()
        self._keep = max(2, 1 + len(self.eos_ids)) * k
        self._top_k_mask = torch.cat([torch.ones(k, dtype=torch.bool), torch.zeros(self._keep - k, dtype=torch.bool)]
                                     ).to(device)
        self.cur_len = width
        self.steps: list[BeamStep] = []
        self.done = False
        self.snapshot_bytes = 0  # of the keys kept for the reorder's views, all steps

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    def _snapshot_fits(self) -> bool:
        """Whether this step's keys, before and after the reorder, stay within ``SNAPSHOT_BYTES`` (counted if so)."""
        keys = self.cache.keys[self.snapshot_layer]
        size = 0 if keys is None else 2 * keys.numel() * keys.element_size()
        if keys is None or self.snapshot_bytes + size > SNAPSHOT_BYTES:
            return False
        self.snapshot_bytes += size
        return True

    def _keys(self) -> torch.Tensor:
        keys = self.cache.keys[self.snapshot_layer]
        assert keys is not None  # _snapshot_fits said so
        return keys.detach().to("cpu", copy=True)

    @torch.no_grad()
    def step(self) -> BeamStep:
        """One forward of every beam (the prefill first) and one beam update; raises once the search is done."""
        if self.done:
            raise BeamSearchError("the beam search is done: every hypothesis has finished or reached max_new_tokens")
        B, k, hf = self.batch_size, self.num_beams, self._hf
        device = self.device
        if not self.steps:
            tokens, mask = self._prompt, self._real
        else:
            tokens, mask = self._running[:, :, self.cur_len - 1].reshape(B * k, 1), None
        rows_before = self.cache.length
        with self.tracer.active():
            # the last position's logits only, as generate() asks (logits_to_keep=1): at the prefill the other
            # n − 1 positions' [B·k, n − 1, V] would be unembedded for nothing
            logits = self.model(tokens.to(device), self.cache, logits_to_keep=1,
                                padding_mask=mask.to(device) if mask is not None else None)  # [B·k, 1, V]
        log_probs = torch.log_softmax(logits[:, -1, :].float(), dim=-1)  # [B·k, V], as generate(): float32
        V = log_probs.shape[-1]
        accumulated = (log_probs.view(B, k, V) + self._running_scores[:, :, None]).view(B, k * V)
        top_scores, top_sequences, top_beams = hf._get_top_k_continuations(
            accumulated_log_probs=accumulated, running_sequences=self._running,
            running_beam_indices=self._running_beams, cur_len=self.cur_len, decoder_prompt_len=self.prompt_width,
            do_sample=False, beams_to_keep=self._keep, num_beams=k, batch_size=B)
        new_tokens = top_sequences[:, :, self.cur_len]  # [B, 2k]
        ends = torch.tensor(self.eos_ids, dtype=torch.int64, device=device)
        hits = torch.isin(new_tokens, ends) if self.eos_ids else torch.zeros_like(new_tokens, dtype=torch.bool)
        hits |= self.cur_len + 1 >= self.max_length  # transformers' MaxLengthCriteria
        self._running, self._running_scores, self._running_beams = hf._get_running_beams_for_next_iteration(
            topk_log_probs=top_scores, topk_running_sequences=top_sequences, topk_running_beam_indices=top_beams,
            next_token_hits_stopping_criteria=hits, num_beams=k)
        before_finished = self._scores.clone()
        self._sequences, self._scores, self._beams, self._finished = hf._update_finished_beams(
            sequences=self._sequences, topk_running_sequences=top_sequences, beam_scores=self._scores,
            topk_log_probs=top_scores, beam_indices=self._beams, topk_running_beam_indices=top_beams,
            is_early_stop_heuristic_unsatisfied=self._improvable, is_sent_finished=self._finished,
            next_token_hits_stopping_criteria=hits, top_num_beam_mask=self._top_k_mask, num_beams=k,
            cur_len=self.cur_len, decoder_prompt_len=self.prompt_width, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping)
        beam_idx = self._running_beams[..., self.cur_len - self.prompt_width].reshape(B * k).to(torch.int64)
        keep = self._snapshot_fits()
        before = self._keys() if keep else None
        self.cache.reorder(beam_idx)
        after = self._keys() if keep else None
        self.cur_len += 1
        self._improvable = hf._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self._improvable, running_beam_scores=self._running_scores,
            beam_scores=self._scores, is_sent_finished=self._finished, cur_len=self.cur_len,
            max_length=self.max_length, decoder_prompt_len=self.prompt_width, early_stopping=self.early_stopping,
            length_penalty=self.length_penalty)
        self.done = not bool(hf._beam_search_has_unfinished_sequences(
            self._improvable, self._finished, hits, self.early_stopping))
        record = self._record(top_scores, new_tokens, top_beams, hits, before_finished, beam_idx, before, after)
        rows = self.cache.length
        record = replace(record, cache_events=(CacheEvent.grow(record.step, rows_before, rows),
                                               CacheEvent.reorder(record.step, rows, record.beam_idx)))
        self.steps.append(record)
        return record

    def _record(self, top_scores, new_tokens, top_beams, hits, before_finished, beam_idx, before, after) -> BeamStep:
        B, k, at = self.batch_size, self.num_beams, self.cur_len - 1 - self.prompt_width
        offset = (torch.arange(B, device=self.device) * k)[:, None]  # prompt b's beams are rows b·k … b·k + k − 1
        parents = (top_beams[:, :, at] - offset).tolist()  # [B, 2k], within the prompt
        kept_parent = (self._running_beams[:, :, at] - offset).tolist()
        running = self._running[:, :, self.cur_len - 1].tolist()
        # a finished hypothesis's score as _update_finished_beams computes it (the same op, so the same float)
        penalised = (top_scores / ((self.cur_len - self.prompt_width) ** self.length_penalty)).tolist()
        candidates = []
        for b in range(B):
            kept = set(zip(kept_parent[b], running[b]))
            entered = set(self._scores[b].tolist()) - set(before_finished[b].tolist())
            row = []
            for c in range(self._keep):
                parent, token, score = parents[b][c], int(new_tokens[b, c]), float(top_scores[b, c])
                if bool(hits[b, c]):
                    fate = "finished" if c < k and penalised[b][c] in entered else "ended"
                else:
                    fate = "running" if (parent, token) in kept else "dropped"
                row.append(BeamCandidate(parent=parent, token=token, score=score, fate=fate))
            candidates.append(tuple(row))
        return BeamStep(
            step=len(self.steps), tokens=tuple(map(tuple, running)), parents=tuple(map(tuple, kept_parent)),
            scores=tuple(tuple(float(s) for s in row) for row in self._running_scores.tolist()),
            beam_idx=tuple(beam_idx.tolist()), candidates=tuple(candidates),
            finished_scores=tuple(tuple(float(s) for s in row) for row in self._scores.tolist()), done=self.done,
            snapshot_layer=self.snapshot_layer, keys_before=before, keys_after=after)

    def run(self, n: int | None = None) -> int:
        """Steps until the search is done (or ``n`` more); returns the steps taken."""
        taken = 0
        while not self.done and (n is None or taken < n):
            self.step()
            taken += 1
        return taken

    def result(self) -> BeamResult:
        """The best hypotheses so far, as ``generate(..., return_dict_in_generate=True)`` returns them at the end."""
        r = self.num_return_sequences
        sequences = self._sequences[:, :r].reshape(-1, self.max_length)
        scores = self._scores[:, :r].reshape(-1)
        beams = self._beams[:, :r].reshape(-1, self.max_new_tokens)
        generated = int((beams + 1).bool().sum(dim=1).max())
        return BeamResult(sequences=tuple(map(tuple, sequences[:, : self.prompt_width + generated].tolist())),
                          scores=tuple(float(s) for s in scores),
                          beam_indices=tuple(map(tuple, beams[:, :generated].tolist())))

    def texts(self) -> list[str]:
        """The returned hypotheses' generated text: the prompt left out, cut after its end-of-sequence token (what
        follows it is generate()'s filling)."""
        out = []
        for seq in self.result().sequences:
            new = [t for t in seq[self.prompt_width:] if t >= 0]
            ends = [i for i, t in enumerate(new) if t in self.eos_ids]
            out.append(self.tokenizer.decode(new[: ends[0] + 1] if ends else new))
        return out

    def close(self) -> None:
        self.tracer.close()
