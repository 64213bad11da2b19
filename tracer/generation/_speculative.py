"""Assisted (speculative) decoding, greedy, one traced verify forward of the main model per step, equal to
transformers' ``generate(assistant_model=…)`` and ``generate(prompt_lookup_num_tokens=…)`` — and so to the main
model's own greedy decoding.

A step: a draft source proposes up to ``num_draft`` tokens — an *assistant* (a smaller model sharing the main
model's vocabulary, run greedily, one traced forward per drafted token, stopped early at an end-of-sequence token
or once its probability for its own token falls below ``confidence_threshold``) or *prompt lookup* (the tokens
that followed the latest earlier occurrence-by-position of the sequence's last n-gram). The main model then runs
ONE forward over the last accepted token and the n drafts: its logits at each draft position say which token it
would have chosen there. The drafts are accepted up to the first one it would not have chosen; the token it
chooses after that prefix (the *bonus*) is appended too, so a step adds accepted + 1 tokens for one main forward.
The main cache's rows of the rejected drafts are *cropped* (``KVCache.crop``), as are, at the next step, the
assistant's rows past the new sequence; the number of drafts for the next step follows transformers' schedule
("constant", or "heuristic": +2 after a step whose drafts were all accepted, else −1, at least 1).

The decisions are transformers' own where it has a function for them: ``PromptLookupCandidateGenerator.
get_candidates`` proposes the lookup's drafts, ``ConfidenceCriteria`` stops the assistant's drafting, and
``AssistedCandidateGenerator.update_candidate_strategy`` sets the next number of drafts (called on a stand-in
that holds only the numbers it reads). The acceptance rule, the length and end-of-sequence cut and the crops
follow ``GenerationMixin._assisted_decoding`` line for line (tests/tracer/test_speculative.py compares the tokens and
every step's crop with ``generate``). One prompt (transformers' assisted decoding takes batch size 1), no
sampling. With scikit-learn installed, transformers also moves the assistant's confidence threshold during a
run (an ROC fit); this class keeps it fixed, so give ``confidence_threshold=0`` to compare there.

Legend: L = the sequence so far, n = drafts this step, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from gpt_shape_tracer.model.gpt import KVCache
from gpt_shape_tracer.model.sources import TextTokenizer, input_device_of
from gpt_shape_tracer.tracer.capture import Tracer
from gpt_shape_tracer.tracer.generation._events import CacheEvent
from gpt_shape_tracer.tracer.storage import DEFAULT_BUDGET_BYTES

MAX_NEW_TOKENS = 256
MAX_DRAFT_TOKENS = 64
SCHEDULES = ("constant", "heuristic", "heuristic_transient")  # transformers' num_assistant_tokens_schedule
LOGITS_BYTES = 64 * 2**20  # most bytes of verify logits kept, all steps together
FATES = ("accepted", "rejected", "unchecked", "cut")


class SpeculativeError(ValueError):
    """Settings speculative decoding cannot run with (said with the numbers), or a model it cannot crop."""


@dataclass(frozen=True)
class SpeculativeStep:
    """One step of assisted decoding: the drafts, the main model's verify forward, what was kept and cropped.

    ``draft_tokens``: the n tokens proposed; ``draft_probs``: the assistant's probability of each (empty for
    prompt lookup); ``draft_forwards``: the assistant trace's steps that drafted them, and ``draft_fed``: how many
    tokens each fed. ``verify_step``: the main trace's step of the verify forward, which fed ``verify_fed`` tokens;
    ``choices``: the main model's greedy token after the sequence so far and after each draft (n + 1);
    ``verify_logits``: its logits there ``[n + 1, V]`` (float32, on the host; None once the run's kept logits would
    pass ``LOGITS_BYTES``). ``matched``: drafts equal to the main model's choices up to the first that is not;
    ``accepted``: those kept after the length and end-of-sequence cut (transformers' n_matches); ``new_tokens``:
    the tokens appended (the accepted drafts, then ``bonus``, the main model's own choice after them).
    ``main_rows``: the main cache's positions before the verify forward, after it, and after the crop;
    ``main_cropped``: rows dropped (n − accepted). ``draft_rows`` / ``draft_cropped``: the assistant's cache
    before this step's crop, after it, after its drafting, and the rows that crop dropped (the last step's
    rejected drafts; 0 for prompt lookup). ``next_draft``: drafts the next step may propose. ``cache_events``:
    all of it as ``CacheEvent``\\ s, in the order it happened. ``done``: the run ends after this step."""

    step: int
    draft_tokens: tuple[int, ...]
    draft_probs: tuple[float, ...]
    draft_forwards: tuple[int, ...]
    draft_fed: tuple[int, ...]
    verify_step: int
    verify_fed: int
    choices: tuple[int, ...]
    verify_logits: torch.Tensor | None
    matched: int
    accepted: int
    new_tokens: tuple[int, ...]
    main_rows: tuple[int, int, int]
    main_cropped: int
    draft_rows: tuple[int, int, int]
    draft_cropped: int
    next_draft: int
    cache_events: tuple[CacheEvent, ...]
    done: bool

    @property
    def bonus(self) -> int:
        """The last token this step appended: the main model's own choice after the accepted drafts."""
        return self.new_tokens[-1]

    @property
    def fates(self) -> tuple[str, ...]:
        """Per draft: "accepted", "rejected" (the first the main model would not have chosen), "unchecked" (after
        it: never compared) or "cut" (matched, but past the length limit or an end-of-sequence token)."""
        out = []
        for i in range(len(self.draft_tokens)):
            if i < self.accepted:
                out.append("accepted")
            elif i < self.matched:
                out.append("cut")
            elif i == self.matched:
                out.append("rejected")
            else:
                out.append("unchecked")
        return tuple(out)


# a step's drafting: tokens, the assistant's probabilities, its trace steps, tokens each fed, its cache's rows
# (before the crop, after it, after the drafting), rows the crop dropped
_Draft = tuple[list[int], list[float], list[int], list[int], tuple[int, int, int], int]


def _transformers_parts():
    from transformers.generation.candidate_generator import (
        AssistedCandidateGenerator,
        PromptLookupCandidateGenerator,
    )
    from transformers.generation.stopping_criteria import ConfidenceCriteria

    return AssistedCandidateGenerator, PromptLookupCandidateGenerator, ConfidenceCriteria


def _whole(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpeculativeError(f"{name} must be a whole number from {low} to {high}, got {value!r}")
    return value


class SpeculativeDecoding:
    """Greedy assisted decoding of ``prompt`` (one string) by ``model``, drafted by ``assistant`` (a model with the
    same vocabulary) or by prompt lookup (``prompt_lookup`` = tokens per draft), traced one verify forward per step.

    ``max_new_tokens``; ``eos_ids``: the tokens that end the run (default: the tokenizer's). Assistant settings,
    as transformers' assistant ``generation_config``: ``num_assistant_tokens`` (the first step's drafts, default
    20), ``schedule`` ("constant", "heuristic", "heuristic_transient"), ``confidence_threshold`` (drafting stops
    after a token the assistant gives less probability; 0 = off; default 0.4). Prompt lookup:
    ``max_matching_ngram_size`` (default 2). ``capture`` / ``budget_bytes``: the main trace's; ``draft_capture``:
    the assistant trace's (``draft_trace``)."""

    def __init__(self, model, tokenizer: TextTokenizer, prompt: str, *, assistant=None,
                 prompt_lookup: int | None = None, max_new_tokens: int = 16, num_assistant_tokens: int = 20,
                 schedule: str = "constant", confidence_threshold: float = 0.4, max_matching_ngram_size: int = 2,
                 eos_ids=None, capture: str = "values", draft_capture: str = "shapes",
                 budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if (assistant is None) == (prompt_lookup is None):
            raise SpeculativeError("give a draft source: assistant=<a model sharing the vocabulary> or "
                                   "prompt_lookup=<tokens per draft>, one of them")
        if not isinstance(prompt, str) or not prompt.strip():
            raise SpeculativeError("the prompt must be one non-empty text (assisted decoding runs one sequence, as "
                                   "transformers' does)")
        _whole(max_new_tokens, "max_new_tokens", 1, MAX_NEW_TOKENS)
        if prompt_lookup is not None:
            _whole(prompt_lookup, "prompt_lookup", 1, MAX_DRAFT_TOKENS)
            _whole(max_matching_ngram_size, "max_matching_ngram_size", 1, MAX_DRAFT_TOKENS)
        _whole(num_assistant_tokens, "num_assistant_tokens", 1, MAX_DRAFT_TOKENS)
        if schedule not in SCHEDULES:
            raise SpeculativeError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        confidence_threshold = float(confidence_threshold)
        if not 0 <= confidence_threshold <= 1:  # also refuses NaN
            raise SpeculativeError(f"confidence_threshold must lie in [0, 1], got {confidence_threshold!r}")
        ids = tokenizer.encode(prompt)
        if not ids:
            raise SpeculativeError("the prompt encodes to no tokens")
        need = len(ids) + max_new_tokens
        for who, m in (("the model", model), ("the assistant", assistant)):
            if m is not None and need > m.config.n_ctx:
                raise SpeculativeError(f"the prompt ({len(ids)} tokens) and {max_new_tokens} new tokens need {need} "
                                       f"positions; {who} has n_ctx = {m.config.n_ctx}")
        if assistant is not None and assistant.config.vocab_size != model.config.vocab_size:
            raise SpeculativeError(f"the assistant's vocabulary ({assistant.config.vocab_size} tokens) is not the "
                                   f"model's ({model.config.vocab_size}): the drafts must be the model's token ids")
        self.model, self.tokenizer, self.prompt, self.assistant = model, tokenizer, prompt, assistant
        for who, m in (("the model", model), ("the assistant", assistant)):
            if getattr(m, "no_cache_reason", None):  # OpenAI GPT, your own module: no cache to crop
                raise SpeculativeError(f"{who}: {m.no_cache_reason}; speculative decoding crops a KV cache back to "
                                       "the accepted tokens, and it keeps none")
        self.cache = model.new_cache(1)
        for who, cache in (("the model", self.cache), ("the assistant", assistant and assistant.new_cache(1))):
            if getattr(cache, "states", None):
                raise SpeculativeError(f"{who} keeps convolution / state-space state beside its KV cache; a crop "
                                       "drops KV rows only, so speculative decoding is not offered for it yet")
            if cache is not None and not getattr(cache, "rows_by_position", True):  # model/sources/_hf_compressed.py
                raise SpeculativeError(f"{who} compresses its keys and values (DeepSeek-V4): its cache can return only "
                                       "to where a whole step ended, not inside a verified draft, so speculative "
                                       "decoding is not offered for it")
        declared = tuple(getattr(tokenizer, "eos_ids", ()) or ()) if eos_ids is None else tuple(eos_ids)
        self.eos_ids = tuple(int(i) for i in declared)
        self.prompt_tokens = tuple(ids)
        self.ids: list[int] = list(ids)
        self.max_new_tokens, self.max_length = max_new_tokens, need
        self.prompt_lookup, self.max_matching_ngram_size = prompt_lookup, max_matching_ngram_size
        self.schedule, self.confidence_threshold = schedule, confidence_threshold
        self.num_draft = prompt_lookup if prompt_lookup is not None else num_assistant_tokens
        self.tracer = Tracer(model, capture=capture, budget_bytes=budget_bytes)
        self.trace = self.tracer.trace
        self.draft_tracer = Tracer(assistant, capture=draft_capture, budget_bytes=budget_bytes) \
            if assistant is not None else None
        self.draft_trace = self.draft_tracer.trace if self.draft_tracer is not None else None
        self.draft_cache: KVCache | None = None  # the assistant's: made at its first drafting
        self._assisted, self._lookup_class, self._confidence = _transformers_parts()
        eos = torch.tensor(self.eos_ids, dtype=torch.int64) if self.eos_ids else None
        self._eos = eos
        self._lookup = self._lookup_class(
            eos_token_id=eos, num_output_tokens=prompt_lookup, max_matching_ngram_size=max_matching_ngram_size,
            max_length=self.max_length) if prompt_lookup is not None else None
        self.steps: list[SpeculativeStep] = []
        self.done = False
        self.logits_bytes = 0
        self._draft_forwards = 0
        self._main_forwards = 0

    @property
    def source(self) -> str:
        return "assistant" if self.assistant is not None else "prompt lookup"

    @property
    def generated(self) -> tuple[int, ...]:
        return tuple(self.ids[len(self.prompt_tokens):])

    def text(self) -> str:
        """The generated text (the prompt left out)."""
        return self.tokenizer.decode(list(self.generated))

    # -- drafting ------------------------------------------------------------------------------------------------
    def _draft_lookup(self) -> _Draft:
        assert self._lookup is not None
        candidate, _ = self._lookup.get_candidates(torch.tensor([self.ids]))
        return candidate[0, len(self.ids):].tolist(), [], [], [], (0, 0, 0), 0

    @torch.no_grad()
    def _draft_assistant(self) -> _Draft:
        """transformers' AssistedCandidateGenerator.get_candidates with the assistant's own greedy generate inside:
        crop its cache to L − 2 positions, feed what it lacks, then one drafted token per forward."""
        L = len(self.ids)
        wanted = min(int(self.num_draft), self.max_length - L - 1)
        rows = self.draft_cache.length if self.draft_cache is not None else 0
        if wanted <= 0:
            return [], [], [], [], (rows, rows, rows), 0
        cropped = 0
        if self.draft_cache is None:
            self.draft_cache = self.assistant.new_cache(1)
        else:  # _update_past_and_masks: keep L − 2 positions (the last two tokens are fed again)
            drop = rows - (L - 2)
            if drop >= 0:
                self.draft_cache.crop(rows - drop)
                cropped = drop
        kept = self.draft_cache.length
        sequence = list(self.ids)
        feed = sequence[kept:]
        tokens: list[int] = []
        probs: list[float] = []
        forwards: list[int] = []
        fed: list[int] = []
        stop = self._confidence(self.confidence_threshold) if self.confidence_threshold > 0 else None
        device = input_device_of(self.assistant)
        assert self.draft_tracer is not None
        while True:
            forwards.append(self._draft_forwards)
            fed.append(len(feed))
            with self.draft_tracer.active():
                logits = self.assistant(torch.tensor([feed], device=device), self.draft_cache,
                                        logits_to_keep=1)[:, -1, :]  # the last position's only, as generate()
            self._draft_forwards += 1
            scores = logits.to("cpu", torch.float32)  # [1, V]
            token = int(scores.argmax(dim=-1))
            tokens.append(token)
            probs.append(float(scores.softmax(-1)[0, token]))
            sequence.append(token)
            feed = [token]
            if len(tokens) >= wanted or token in self.eos_ids or (
                    stop is not None and bool(stop(torch.tensor([sequence]), (scores,)))):
                break
        return tokens, probs, forwards, fed, (rows, kept, self.draft_cache.length), cropped

    # -- one step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> SpeculativeStep:
        """Draft, verify in one main forward, keep the accepted prefix and the bonus token, crop; raises once the
        run is done."""
        if self.done:
            raise SpeculativeError("the run is done: it reached max_new_tokens or an end-of-sequence token")
        index, cur_len = len(self.steps), len(self.ids)
        if self.assistant is not None:
            drafts, probs, forwards, fed, draft_rows, draft_cropped = self._draft_assistant()
        else:
            drafts, probs, forwards, fed, draft_rows, draft_cropped = self._draft_lookup()
        n = len(drafts)
        rows_before = self.cache.length
        feed = self.ids[rows_before:] + drafts  # the prefill: the prompt; then the last token, then the drafts
        verify_step = self._main_forwards
        with self.tracer.active():
            # the logits of the last accepted token and the drafts only, as _assisted_decoding asks
            # (logits_to_keep = n + 1): at the prefill, not the prompt's other positions
            logits = self.model(torch.tensor([feed], device=input_device_of(self.model)), self.cache,
                                logits_to_keep=n + 1)
        self._main_forwards += 1
        rows_verified = self.cache.length
        new_logits = logits[:, -n - 1:].to("cpu", torch.float32)  # [1, n + 1, V]
        selected = new_logits.argmax(dim=-1)  # [1, n + 1]
        candidate = torch.tensor([drafts], dtype=torch.int64).reshape(1, n)
        matched = int(((~(candidate == selected[:, :-1])).cumsum(dim=-1) < 1).sum())
        valid = selected[:, : matched + 1]
        valid = valid[:, : self.max_length - cur_len]  # the length budget
        if self._eos is not None:
            ends = torch.isin(valid.squeeze(0), self._eos).nonzero()
            if ends.numel() > 0:
                valid = valid[:, : int(ends[0]) + 1]
        accepted = valid.shape[1] - 1
        new_tokens = valid[0].tolist()
        self.ids.extend(new_tokens)
        self.cache.crop(rows_verified - (n - accepted))
        if self.assistant is not None:  # the schedule, by transformers' own update
            holder = SimpleNamespace(num_assistant_tokens=self.num_draft, assistant_generation_config=SimpleNamespace(
                num_assistant_tokens_schedule=self.schedule, assistant_confidence_threshold=None))
            self._assisted.update_candidate_strategy(holder, torch.tensor([self.ids]), new_logits, accepted)
            self.num_draft = holder.num_assistant_tokens
        self.done = len(self.ids) >= self.max_length or new_tokens[-1] in self.eos_ids
        keep = self.logits_bytes + new_logits.numel() * 4 <= LOGITS_BYTES
        if keep:
            self.logits_bytes += new_logits.numel() * 4
        events = []
        if self.assistant is not None and forwards:
            if draft_rows[1] != draft_rows[0]:
                events.append(CacheEvent.crop(index, draft_rows[0], draft_rows[1], "draft"))
            events.append(CacheEvent.grow(index, draft_rows[1], draft_rows[2], "draft"))
        events += [CacheEvent.grow(index, rows_before, rows_verified),
                   CacheEvent.crop(index, rows_verified, self.cache.length)]
        record = SpeculativeStep(
            step=index, draft_tokens=tuple(drafts), draft_probs=tuple(probs), draft_forwards=tuple(forwards),
            draft_fed=tuple(fed), verify_step=verify_step, verify_fed=len(feed), choices=tuple(selected[0].tolist()),
            verify_logits=new_logits[0].clone() if keep else None, matched=matched, accepted=accepted,
            new_tokens=tuple(new_tokens), main_rows=(rows_before, rows_verified, self.cache.length),
            main_cropped=n - accepted, draft_rows=draft_rows, draft_cropped=draft_cropped,
            next_draft=int(self.num_draft), cache_events=tuple(events), done=self.done)
        self.steps.append(record)
        return record

    def run(self, n: int | None = None) -> int:
        """Steps until the run is done (or ``n`` more); returns the steps taken."""
        taken = 0
        while not self.done and (n is None or taken < n):
            self.step()
            taken += 1
        return taken

    @property
    def main_forwards(self) -> int:
        return self._main_forwards

    @property
    def draft_forwards(self) -> int:
        return self._draft_forwards

    def close(self) -> None:
        self.tracer.close()
        if self.draft_tracer is not None:
            self.draft_tracer.close()
