"""Step-by-step traced generation: one forward pass and one chosen token per sequence per step.

Step 0 is the prefill: the whole prompt, n₀ tokens, queries and keys alike.
Step s ≥ 1 feeds the token chosen at step s−1: with the KV cache that is one
query row (n = 1) over t = n₀ + s keys; without it, all n₀ + s tokens again.

Several prompts make a batch. Shorter prompts are padded (left by default, or
right); padding never gets attention from a real token — the mask shows −∞ in
its columns — and positions count real tokens only, so each row generates
exactly what it would alone.

The facts of the generation live in the trace (``trace.generation``): what it
is (``GenerationInfo``) and what each step fed and chose (``GenerationStep``).
This class only drives it; it keeps no second copy of them.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch

from gpt_shape_tracer.model.analysis import forward_cost
from gpt_shape_tracer.model.gpt import identity_of
from gpt_shape_tracer.model.sampling import SamplingConfig, sample
from gpt_shape_tracer.model.sources import TextTokenizer, input_device_of, meta_op_cache, on_meta
from gpt_shape_tracer.tracer.capture import Intervention, Tracer, check, check_shapes
from gpt_shape_tracer.tracer.reading import GenerationFacts
from gpt_shape_tracer.tracer.storage import DEFAULT_BUDGET_BYTES, on_host
from gpt_shape_tracer.tracer.storage.records import (
    PADDING_SIDES,
    ForwardFacts,
    GenerationInfo,
    GenerationStep,
    PathCost,
    RecomputeComparison,
    SamplingRecord,
)

if TYPE_CHECKING:
    from gpt_shape_tracer.model.sources import Decoder

MAX_RUN_STEPS = 256  # most steps one run() call may take
MAX_BATCH = 16  # most prompts in one batch
FLOAT32_TOLERANCE = 1e-4  # |Δ logits| within which two float32 computations of one step count as equal


class _SamplingFields(TypedDict, total=False):
    """SamplingConfig's fields given one by one (``TracedGeneration(temperature=…, top_k=…)``)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


class PromptError(ValueError):
    """A prompt that cannot be generated from (empty, or nothing but padding)."""


class ContextFullError(ValueError):
    """The sequence has reached the model's n_ctx: no position is left for another token."""


class GenerationStopped(ValueError):
    """The generation cannot continue (its last step produced logits no token can be chosen from)."""


def logit_tolerance(dtype: torch.dtype) -> float:
    """What |Δ logits| counts as equal when one step is computed two ways in ``dtype``."""
    try:
        from gpt_shape_tracer.model import (
            logit_tolerance as model_tolerance,  # the model package's rule, where it has one
        )
    except ImportError:
        return FLOAT32_TOLERANCE if dtype == torch.float32 else 5e-2
    return model_tolerance(dtype)


class TracedGeneration:
    """Generate from ``prompt`` one traced step at a time.

    ``prompt`` is a string or a list of strings (a batch). Sampling is given as
    ``sampling=SamplingConfig(...)`` or as ``temperature=, top_k=, top_p=, seed=``.
    A prompt longer than n_ctx − 1 tokens is cut from the left (keeping its end)
    and ``warnings`` says so; ``truncate="error"`` refuses it instead.

    ``stop_at_eos``: once every sequence of the batch has chosen one of the ids the model's files
    declare as ending a sequence (``tokenizer.eos_ids``), generation stops and ``stopped`` says so,
    as transformers' ``generate`` does. A tokenizer that declares none (the bundled story models,
    whose config.json sets no eos_token_id) never stops on a token. A sequence that ended before the
    others goes on being generated (its tokens after the end are the model's, not padding) until the
    last one ends: the batch shares one forward pass per step.
    """

    def __init__(
        self,
        model: Decoder,
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
        spill_bytes: int = 0,
        copy: str = "auto",
        truncate: str = "left",
        interventions: Sequence[Intervention] = (),
        stop_at_eos: bool = True,
    ) -> None:
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if truncate not in ("left", "error"):
            raise ValueError(f"truncate must be 'left' or 'error', got {truncate!r}")
        given: _SamplingFields = {}
        if temperature is not None:
            given["temperature"] = temperature
        if top_k is not None:
            given["top_k"] = top_k
        if top_p is not None:
            given["top_p"] = top_p
        if seed is not None:
            given["seed"] = seed
        if sampling is not None and given:
            raise ValueError("give either sampling=SamplingConfig(...) or temperature/top_k/top_p/seed, not both")
        sampling = sampling if sampling is not None else SamplingConfig(**given)
        self.model = model
        self.tokenizer = tokenizer
        n_ctx: int = model.config.n_ctx
        prompts = (prompt,) if isinstance(prompt, str) else tuple(prompt)
        warnings: list[str] = []
        rows = self._encode(prompts, truncate, n_ctx, warnings)
        info = GenerationInfo(
            model=identity_of(model), prompts=prompts, prompt_tokens=rows,
            prompt_labels=tuple(tuple(tokenizer.token_label(i) for i in row) for row in rows),
            padding_side=padding_side, pad_id=tokenizer.eos_id if tokenizer.eos_id is not None else 0,
            use_cache=use_cache, sampling=sampling, n_ctx=n_ctx, warnings=tuple(warnings),
        )
        self.tracer = Tracer(model, capture=capture, budget_bytes=budget_bytes, copy=copy, interventions=interventions,
                             spill_bytes=spill_bytes)
        self.trace = self.tracer.trace
        self.trace.log.begin_generation(info)
        self.cache = model.new_cache(len(rows)) if use_cache else None
        self.dry_run = on_meta(model)  # a model on the meta device: shapes only, no sampling (a dry run)
        # the seeded generator, made where the logits come out at the first draw (on a GPU: there, so that a draw
        # copies no logits to the host); None until then, and in a dry run
        self.generator: torch.Generator | None = None
        self.stopped: str = ""
        # the ids that end a sequence; empty: never stop on a token
        declared = getattr(tokenizer, "eos_ids", ()) or ()
        self.stop_ids: frozenset[int] = frozenset(declared) if stop_at_eos and not self.dry_run else frozenset()
        self._last: tuple | None = None  # (tokens, padding mask, last index, cache length before, logits rows)

    # -- prompts -------------------------------------------------------------------------------
    def _encode(self, prompts: tuple, truncate: str, n_ctx: int, warnings: list[str]) -> tuple[tuple[int, ...], ...]:
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
            limit = n_ctx - 1  # keep one position free for the first generated token
            if len(ids) > limit:
                if truncate == "error":
                    raise PromptError(f"{which} has {len(ids)} tokens; this model's n_ctx allows at most {limit}")
                warnings.append(
                    f"{which} had {len(ids)} tokens, more than n_ctx − 1 = {limit}: kept its last {limit} "
                    f"tokens (the first {len(ids) - limit} were cut)"
                )
                ids = ids[-limit:]
            rows.append(tuple(ids))
        return tuple(rows)

    # -- what the generation is ------------------------------------------------------------------
    @property
    def facts(self) -> GenerationFacts:
        facts = self.trace.generation
        assert facts is not None  # set in __init__
        return facts

    @property
    def info(self) -> GenerationInfo:
        return self.facts.info

    @property
    def use_cache(self) -> bool:
        return self.info.use_cache

    @property
    def sampling(self) -> SamplingConfig:
        return self.info.sampling

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.info.warnings

    @property
    def batch_size(self) -> int:
        return self.info.batch_size

    @property
    def padded(self) -> bool:
        return self.info.padded

    @property
    def n_steps(self) -> int:
        return self.trace.n_steps

    @property
    def cache_length(self) -> int:
        return self.cache.length if self.cache is not None else 0

    @property
    def sequence_length(self) -> int:
        """Columns of the padded token matrix so far (prompt width + chosen tokens)."""
        return self.facts.width(self.n_steps)

    def tokens(self, row: int = 0) -> tuple[int, ...]:
        """The sequence's real tokens: its prompt and every token chosen so far."""
        return self.info.prompt_tokens[row] + self.generated(row)

    def __repr__(self) -> str:
        return (f"TracedGeneration({self.facts.batch_size} sequence(s), {self.n_steps} step(s), "
                f"{self.facts.info.sampling.describe()}, cache {'on' if self.use_cache else 'off'}, "
                f"capture={self.trace.capture!r})")

    def _repr_html_(self) -> str:
        """In a notebook: what it is, each sequence's text so far (the prompt, then what was generated, escaped),
        and its trace's table."""
        import html

        texts = "".join(f"<li>{html.escape(self.facts.info.prompts[r])}<b>"
                        f"{html.escape(self.generated_text(r))}</b></li>"
                        for r in range(self.facts.batch_size))
        return f"<b>{html.escape(repr(self))}</b><ol start='0'>{texts}</ol>{self.trace.html_summary()}"

    def generated(self, row: int = 0) -> tuple[int, ...]:
        return tuple(s.sampling.tokens[row] for s in self.facts.steps if s.sampling is not None)

    def text(self, row: int = 0) -> str:
        """The sequence's text so far: its prompt, then what was generated (``generated_text``)."""
        if self.dry_run:
            return self.tokenizer.decode(list(self.info.prompt_tokens[row])) + self.generated_text(row)
        return self.tokenizer.decode(list(self.tokens(row)))

    def generated_text(self, row: int = 0) -> str:
        """What the steps chose for sequence ``row``, decoded; a dry run's choices are placeholder ids, labelled as
        such and not decoded: a tokenizer would read id 0 as a real token (GPT-2's <|endoftext|>)."""
        chosen = list(self.generated(row))
        if self.dry_run:
            return f"⟨{len(chosen)} placeholder id(s): a dry run samples nothing⟩" if chosen else ""
        return self.tokenizer.decode(chosen)

    @property
    def interventions(self) -> tuple[Intervention, ...]:
        return self.tracer.interventions

    def set_interventions(self, interventions: Sequence[Intervention]) -> None:
        """What later steps switch off or patch (checked against the model now; each step records its own)."""
        check(interventions, self.model)
        self.tracer.interventions = tuple(interventions)

    # -- stepping --------------------------------------------------------------------------------
    def feed(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What ``step`` feeds the model: token ids ``[B, n]``, the padding mask (or None), and per sequence
        the position whose logits choose its token (None: the last)."""
        facts = self.facts
        host = torch.device("cpu")  # built from Python lists on the host, moved below
        cols = torch.tensor([facts.columns(r, step) for r in range(facts.batch_size)], device=host)
        padded = facts.info.padded
        mask = torch.tensor([facts.is_token(r, step) for r in range(facts.batch_size)], device=host) if padded else None
        # the ids go where the model is (an embedding on a GPU reads ids on the GPU); a dry run's go to the meta
        # device in step(), once their values are written down
        device = torch.device("cpu") if self.dry_run else self.device
        cols = cols.to(device)
        mask = mask.to(device) if mask is not None else None
        if step == 0:
            last = None
            if padded and facts.info.padding_side == "right":
                last = torch.tensor([len(r) for r in facts.info.prompt_tokens], device=device) - 1
            return cols, mask, last
        if self.use_cache:
            return cols[:, -1:], None, None
        return cols, mask, None

    @property
    def device(self) -> torch.device:
        """Where the model reads its token ids (``model.sources.input_device_of``)."""
        return input_device_of(self.model)

    def step(self) -> GenerationStep:
        """One forward pass (traced) and one chosen token per row."""
        if self.stopped:
            raise GenerationStopped(self.stopped)
        facts = self.facts
        step = facts.n_steps
        if facts.width(step) >= facts.info.n_ctx:
            raise ContextFullError(
                f"reached n_ctx = {facts.info.n_ctx}: the model has no position for another token, "
                "so generation stops here (Reset, or start from a shorter prompt)")
        tokens, mask, last = self.feed(step)
        before = self.cache_length
        n = tokens.size(1)
        check_shapes(self.interventions, self.model, tokens.size(0), n, before + n, step)
        fed = tuple(map(tuple, tokens.tolist()))
        if self.dry_run:  # the meta device: ids, masks and positions there too (their values are never read)
            tokens = tokens.to("meta")
            mask = mask.to("meta") if mask is not None else None
            last = last.to("meta") if last is not None else None
        # a dry run's ops answered once per distinct input (model.sources.meta_op_cache: its layers are alike)
        with torch.no_grad(), self.tracer.active(), meta_op_cache() if self.dry_run else contextlib.nullcontext():
            logits = self.model(tokens, self.cache, padding_mask=mask)  # [B, n, V]
        rows = logits[:, -1, :] if last is None else logits[torch.arange(logits.size(0), device=logits.device), last]
        forward = ForwardFacts(n=n, t=before + n if self.use_cache else n, cache_before=before,
                               cache_after=self.cache_length, fed_tokens=fed)
        # the choice is made where the logits are: one host read of whether each row can give a token, the draw on
        # the device, and the few numbers the record keeps read back together — per step, never per row
        bad = [] if self.dry_run else [r for r, ok in enumerate(_choosable(rows).tolist()) if not ok]
        if self.dry_run:  # no logits to sample from: a placeholder id, labelled as one
            choice = placeholder_choice(rows.size(0))
        elif bad:
            self.stopped = (f"step {step}: the logits of sequence {bad[0]} hold NaN or +∞, so no token can be "
                            "chosen; generation stops here (the step's tensors are kept: the first bad record "
                            "is named above)")
            choice = None
        else:
            choice = self._sampling_record(sample(rows, self.sampling, self._generator_for(rows.device)))
        self.trace.log.add_generation_step(GenerationStep(step=step, forward=forward, sampling=choice))
        self._last = (tokens, mask, last, before, rows)
        if choice is not None and self.stop_ids and all(
                any(t in self.stop_ids for t in self.generated(r)) for r in range(self.batch_size)):
            self.stopped = self._eos_reason(step, choice)
        return self.facts.step(step)

    def _eos_reason(self, step: int, choice: SamplingRecord) -> str:
        """Why generation stopped at an end-of-sequence token, naming the token (and, for a batch, the step
        each sequence ended at)."""
        names = ", ".join(f"{self.tokenizer.token_label(i)!r} (id {i})" for i in sorted(self.stop_ids))
        if self.batch_size == 1:
            return (f"step {step}: the model chose {choice.labels[0]!r} (id {choice.tokens[0]}), an end-of-sequence "
                    f"token; generation stops here (stop_at_eos=False goes on; end-of-sequence ids: {names})")
        ended = [next(s for s, t in enumerate(self.generated(r)) if t in self.stop_ids)
                 for r in range(self.batch_size)]
        return (f"step {step}: every sequence has chosen an end-of-sequence token (at steps "
                f"{', '.join(map(str, ended))}, in batch order); generation stops here (stop_at_eos=False goes "
                f"on; end-of-sequence ids: {names})")

    def _generator_for(self, device: torch.device) -> torch.Generator:
        """The run's seeded generator, on ``device`` (made there at the first draw)."""
        if self.generator is None:
            self.generator = self.sampling.generator(device)
        elif self.generator.device.type != device.type and not self.sampling.greedy:
            raise RuntimeError(f"this generation's seeded draws are made on {self.generator.device}, and its logits "
                               f"are now on {device}: a generator cannot follow them there without drawing other "
                               "tokens; start a new generation on this device")
        return self.generator

    def _sampling_record(self, res) -> SamplingRecord:
        label = self.tokenizer.token_label
        # [B], [B], [B, K], [B, stages, K], [B, stages]: read to the host together (one wait on a GPU)
        tokens, token_probs, candidate_ids, stage_probs, kept = (t.tolist() for t in on_host(
            (res.token, res.token_prob, res.candidates, res.stage_probs, res.kept)))
        candidates = tuple(tuple(row) for row in candidate_ids)
        return SamplingRecord(
            tokens=tuple(tokens),
            labels=tuple(label(i) for i in tokens),
            probs=tuple(round(float(p), 6) for p in token_probs),
            candidates=candidates,
            candidate_labels=tuple(tuple(label(i) for i in row) for row in candidates),
            stage_probs=tuple(tuple(tuple(round(float(p), 6) for p in stage) for stage in row)
                              for row in stage_probs),
            kept=tuple(tuple(row) for row in kept),
        )

    def run(self, n: int, on_step=None) -> int:
        """Up to ``n`` steps (1 ≤ n ≤ MAX_RUN_STEPS); stops early at n_ctx, at a step no token can be
        chosen from, once every sequence has chosen an end-of-sequence token (``stop_at_eos``), or when
        ``on_step(steps done)`` returns False. Returns steps taken."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_RUN_STEPS:
            raise ValueError(f"run(n) takes 1 ≤ n ≤ {MAX_RUN_STEPS} steps, got {n!r}")
        done = 0
        for _ in range(n):
            try:
                self.step()
            except (ContextFullError, GenerationStopped):
                break
            done += 1
            if self.stopped or (on_step is not None and on_step(done) is False):
                break
        return done

    # -- the cache comparison --------------------------------------------------------------------
    @torch.no_grad()
    def compare_with_recompute(self, timing_repeats: int = 1) -> RecomputeComparison:
        """Redo the latest step both ways, untraced, and compare: the cached path (the new position(s)
        over a cache of the earlier ones) and a full recompute of all t positions without a cache.

        The evidence is counted, not timed: query rows, multiply-adds and bytes read per path (from the
        model's shapes). ``max_abs_delta`` is over the logits rows the tokens were chosen from; with the
        cache on, the cached side is this run's own logits; with it off, the run *is* the full recompute,
        so the cached side is an untraced cached re-run. Each path is also timed once untraced (the
        fastest of ``timing_repeats``): an estimate on a shared machine. The result is stored in the trace."""
        if self.dry_run:
            raise ValueError("a dry run has no logits to compare: the costs of both paths are counted from the shapes "
                             "(model.costs.forward_cost)")
        if self._last is None:
            raise ValueError("no step has run yet")
        if isinstance(timing_repeats, bool) or not isinstance(timing_repeats, int) or timing_repeats < 1:
            raise ValueError(f"timing_repeats must be a whole number ≥ 1, got {timing_repeats!r}")
        facts = self.facts
        step = facts.n_steps - 1
        width = facts.width(step)  # the columns that existed when the latest step ran
        cols = torch.tensor([facts.columns(r, step) for r in range(facts.batch_size)], device=self.device)
        mask = (torch.tensor([facts.is_token(r, step) for r in range(facts.batch_size)], device=self.device)
                if self.padded else None)
        tokens, _, last, _, run_rows = self._last
        pick = (lambda lg: lg[:, -1, :]) if last is None else (lambda lg: lg[torch.arange(lg.size(0)), last])

        new = tokens.size(1) if self.use_cache else (width if step == 0 else 1)
        past = width - new
        if self.use_cache:
            assert self.cache is not None  # __init__ makes one whenever use_cache
            base = self.cache  # this run's own cache: its first `past` rows are what the step started from
        else:  # no cache kept: fill one with the earlier positions (untimed)
            base = self.model.new_cache(cols.size(0))
            if past:
                self.model(cols[:, :past], cache=base, padding_mask=mask[:, :past] if mask is not None else None)
        full_seconds = cached_seconds = math.inf
        for _ in range(timing_repeats):
            started = time.perf_counter()
            full = pick(self.model(cols, padding_mask=mask))
            full_seconds = min(full_seconds, time.perf_counter() - started)
            cache = base.copy(past)  # the earlier positions' K, V, then this step's new ones
            started = time.perf_counter()
            cached = pick(self.model(cols[:, past:], cache=cache, padding_mask=None if past else mask))
            cached_seconds = min(cached_seconds, time.perf_counter() - started)
        run_cached = run_rows if self.use_cache else cached
        # the rows the cache held (each made at its own step, from the tokens up to it) against the same rows
        # recomputed from all t tokens: equal, because no row of any layer sees a token after its own
        recomputed = self.model.new_cache(cols.size(0))
        self.model(cols, cache=recomputed, padding_mask=mask)
        real = mask[:, :past] if mask is not None else torch.ones(cols.size(0), past, dtype=torch.bool)
        rows_delta = tuple(
            (_max_delta_on(held_k, new_k, real, past), _max_delta_on(held_v, new_v, real, past))
            for held_k, held_v, new_k, new_v in zip(base.keys, base.values, recomputed.keys, recomputed.values)
        ) if past and getattr(base, "rows_by_position", True) else ()  # a compressed cache holds no row per position
        config, batch = self.model.config, cols.size(0)
        itemsize = next(self.model.parameters()).element_size()
        cost_cached = forward_cost(config, batch, new, width, cached=past, itemsize=itemsize)
        cost_full = forward_cost(config, batch, width, width, itemsize=itemsize)
        comparison = RecomputeComparison(
            step=step,
            cached=PathCost(new, cost_cached.macs, cost_cached.weight_bytes, cost_cached.kv_cache_bytes,
                            cached_seconds),
            full=PathCost(width, cost_full.macs, cost_full.weight_bytes, cost_full.kv_cache_bytes, full_seconds),
            max_abs_delta=float((full - run_cached).abs().max()),
            tolerance=logit_tolerance(run_rows.dtype),
            run_used_cache=self.use_cache,
            timing_repeats=timing_repeats,
            cached_rows_delta=rows_delta,
        )
        self.trace.log.add_comparison(comparison)
        return comparison

    def close(self) -> None:
        self.tracer.close()


PLACEHOLDER_ID = 0  # what a dry run "chooses": there are no logits to choose from
PLACEHOLDER_LABEL = "⟨placeholder: a dry run samples nothing⟩"


def placeholder_choice(batch: int) -> SamplingRecord:
    """The sampling record of a dry-run step: id 0 for every sequence, labelled as a placeholder, no probabilities
    (NaN), no candidates but the placeholder."""
    return SamplingRecord(tokens=(PLACEHOLDER_ID,) * batch, labels=(PLACEHOLDER_LABEL,) * batch,
                          probs=(math.nan,) * batch, candidates=((PLACEHOLDER_ID,),) * batch,
                          candidate_labels=((PLACEHOLDER_LABEL,),) * batch, stage_probs=(((math.nan,),),) * batch,
                          kept=((0,),) * batch)


def _max_delta_on(a: torch.Tensor | None, b: torch.Tensor | None, real: torch.Tensor, past: int) -> float:
    """max |a − b| over the first ``past`` positions of ``[B, G, t, d_head]`` rows, those holding a token
    (``real`` is [B, past]); 0 for a layer that holds no rows in either (a hybrid model's layer without attention)."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return math.inf
    delta = (a[:, :, :past].float() - b[:, :, :past].float()).abs().amax(dim=(1, 3))  # [B, past]
    picked = delta[real.to(delta.device)]
    return float(picked.max()) if picked.numel() else 0.0


def _choosable(logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` → ``[B]``: whether each row of logits can give a token (no NaN, no +∞, not everything −∞),
    computed where the logits are."""
    return ~(torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1) | torch.isneginf(logits).all(dim=-1))

