"""The guided tour: its stops, in the order a reader of the math meets them, each with the one sentence that says
what to look at. Pure: what a stop says is a function of the trace's numbers and of the measured head scores
(``tracer.head_scores``), so a stop's claim about a head is the score that was measured, not an assertion.

A stop that needs what this model or this generation does not have (the KV cache, kept values, a live model, a
backward pass through a soft-cap) is skipped with its reason; a stop that needs one more Step says so and waits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gpt_shape_tracer.figures.common import bidirectional, facts_of, mask_tab_name, position_is_token, prompt_positions
from gpt_shape_tracer.figures.engine import memory_at
from gpt_shape_tracer.model.analysis import HEAD_ROLES
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import EngineRun, Trace

CLEAR_SCORE = 0.3  # a head is a clear example of a role from this score up (the all-heads grid's ROLE_SHOWN)
PROBE = "4 random token sequences, each repeated twice"  # what tracer.head_scores measures on

ROLE_MEANING = {
    "previous-token": "puts on the key just before the query",
    "induction": "puts, in a repeat, on the key right after the earlier occurrence of the query's own token",
}


@dataclass(frozen=True)
class HeadPick:
    """The head that scores highest on one role, and its score (mean attention weight, 0 … 1)."""

    role: str
    layer: int
    head: int
    score: float

    @property
    def label(self) -> str:
        return f"L{self.layer} H{self.head}"

    @property
    def clear(self) -> bool:
        return self.score >= CLEAR_SCORE

    def sentence(self) -> str:
        """What the measured score says about the head, true for any score."""
        meaning = ROLE_MEANING.get(self.role, f"puts on its {self.role} key")
        if self.clear:
            return (f"{self.label} is this model's clearest {self.role} head: the mean weight it {meaning} is "
                    f"{self.score:.2f} (measured on {PROBE}).")
        return (f"No head of this model is a clear {self.role} head: the highest mean weight one {meaning} is "
                f"{self.score:.2f}, by {self.label} (measured on {PROBE}; a clear head reaches {CLEAR_SCORE}).")


def clearest_head(scores: Mapping[str, torch.Tensor], role: str) -> HeadPick | None:
    """The best-scoring head of ``role`` in ``scores`` (``tracer.head_scores``: role → ``[n_layer, n_head]``);
    None when the role was not measured."""
    if role not in HEAD_ROLES:
        raise ValueError(f"unknown head role {role!r}; the roles are {', '.join(HEAD_ROLES)}")
    table = scores.get(role)
    if table is None or table.numel() == 0:
        return None
    flat = int(torch.argmax(table))
    layer, head = divmod(flat, table.shape[1])
    return HeadPick(role, layer, head, float(table[layer, head]))


def weight_on_previous_key(trace: Trace, step: int, layer: int, head: int,
                           batch: int = 0) -> tuple[int, float] | None:
    """(the step's last real query row (not padding), the weight it puts on the key just before it), read from
    the kept pattern ``[B, H, n, t]``; None when the pattern was not kept or that key is not a real token."""
    pattern = trace.get(act_name("pattern", layer), step)
    if pattern is None:
        return None
    n, t = pattern.shape[-2:]
    real = position_is_token(trace, batch, step)  # the t key positions: a token, or padding
    rows = [i for i in range(n) if real[t - n + i]]
    if not rows or t - n + rows[-1] < 1 or not real[t - n + rows[-1] - 1]:
        return None
    row = rows[-1]
    return row, float(pattern[batch, head, row, t - n + row - 1])


@dataclass(frozen=True)
class TourContext:
    """The numbers the tour's sentences are made of, read once from the trace (``tour_context``)."""

    n_layer: int
    n_head: int
    batch_size: int
    d_model: int
    vocab: int
    n_steps: int
    prefill_n: int  # positions the prefill fed
    last_n: int  # the latest step's new positions n …
    last_t: int  # … and key positions t
    cache_after: int  # positions cached after the latest step (0 without the cache)
    use_cache: bool
    caches: bool  # whether the model runs with our KV cache (a module of your own, OpenAI GPT do not)
    values: bool  # whether values were captured (not "shapes")
    live: bool  # whether the model that made the trace is here to rerun (gradients)
    softcap: bool  # the scores are soft-capped (a stage of their own; Gradients applies the cap's derivative)
    greedy: bool
    chosen: str | None  # what the latest step chose for sequence 0, and its probability
    chosen_p: float | None
    previous: HeadPick | None  # measured on the model (None: no live model to probe)
    induction: HeadPick | None
    previous_weight: tuple[int, float] | None  # (the last real prefill row, its weight on the key before), for
    # the previous-token head
    prefill_padding: tuple[int, ...] = ()  # sequence 0's padding positions at the prefill (keys M hides too)
    engine: EngineRun | None = None  # the Engine tab's run on view (None: none was run or opened yet)
    engine_refused: str = ""  # why the sidebar's model cannot run the engine ("" when it can)
    no_cache_reason: str = ""  # why the model keeps no KV cache, where it keeps none (its no_cache_reason)
    prompt_positions: int = 0  # learned positions the model runs before the text (CPM-Ant), which have no logits
    bidirectional: bool = False  # its mask lets every position of a forward see every other (CPM-Ant)


def tour_context(trace: Trace, scores: Mapping[str, torch.Tensor] | None, live: bool, caches: bool,
                 engine: EngineRun | None = None, engine_refused: str = "", no_cache_reason: str = "") -> TourContext:
    facts = facts_of(trace)
    config = trace.config
    last = trace.n_steps - 1
    prefill, latest = facts.step(0).forward, facts.step(last).forward
    sampling = facts.step(last).sampling
    previous = clearest_head(scores, "previous-token") if scores else None
    induction = clearest_head(scores, "induction") if scores else None
    return TourContext(
        n_layer=config.n_layer, n_head=config.n_head, batch_size=facts.batch_size,
        d_model=int(getattr(config, "d_model", 0)), vocab=int(getattr(config, "vocab_size", 0)),
        n_steps=trace.n_steps, prefill_n=prefill.n, last_n=latest.n, last_t=latest.t,
        cache_after=latest.cache_after if facts.info.use_cache else 0, use_cache=facts.info.use_cache,
        caches=caches, values=trace.capture != "shapes", live=live,
        softcap=bool(getattr(config, "attn_softcap", None)), greedy=facts.info.sampling.greedy,
        chosen=sampling.labels[0] if sampling is not None else None,
        chosen_p=sampling.probs[0] if sampling is not None else None,
        previous=previous, induction=induction,
        previous_weight=weight_on_previous_key(trace, 0, previous.layer, previous.head) if previous else None,
        prefill_padding=tuple(i for i, real in enumerate(facts.is_token(0, 0)) if not real),
        engine=engine, engine_refused=engine_refused, no_cache_reason=no_cache_reason,
        prompt_positions=prompt_positions(trace), bidirectional=bidirectional(trace))


@dataclass(frozen=True)
class Stop:
    """One stop: the view it opens (a tab, and a sub-view of it), the step and head it presets, what to look at;
    ``skipped`` says why this model or generation has no such view, ``waiting`` what to do first."""

    key: str
    title: str
    tab: str
    look: str
    sub: tuple[str, str] | None = None  # (the tabs' key, the sub-view's label)
    step: int | None = None  # the step to show (None: leave the slider where it is)
    head: tuple[int, int] | None = None  # (layer, head) to open
    query: int | None = None  # the query row (of the step's rows, sequence 0) to pick
    engine_step: int | None = None  # the Engine tab's engine step to show
    skipped: str = ""
    waiting: str = ""


def _shape(*dims: object) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


def mask_look(n: int, padding: tuple[int, ...], prompt: int = 0, both_ways: bool = False) -> str:
    """The mask stop's sentence at a prefill of ``n`` positions whose sequence 0 has ``padding`` positions: with
    padding, the keys a query may weigh are not all of 0 … i. A model whose mask is not causal (``both_ways``,
    CPM-Ant, its ``prompt`` learned positions before the text) has no such triangle."""
    if both_ways:
        first = f" (its {prompt} learned prompt positions first)" if prompt else ""
        return (f"At the prefill M is {prompt + n} × {prompt + n}{first}, and this model's mask is not causal: no cell "
                "is −∞ for coming after its query, so query i weighs the keys after it too.")
    text = f"At the prefill M is {n} × {n}: every cell above the diagonal is −∞, so query i weighs "
    if not padding:
        return text + "only keys 0 … i, and the scores after + M are −∞ there too."
    text += "no key after i"
    listed = ", ".join(map(str, padding[:8])) + (" …" if len(padding) > 8 else "")
    text += f"; sequence 0's padding position(s) {listed} are −∞ as keys too, so "
    if padding == tuple(range(len(padding))):  # left padding: its real tokens start after it
        return text + f"its query i weighs only keys {len(padding)} … i. The scores after + M are −∞ there too."
    return text + "its real query i weighs only its real keys up to i. The scores after + M are −∞ there too."


def tour_stops(ctx: TourContext) -> tuple[Stop, ...]:
    """Every stop, in order; those this model or generation cannot show carry their reason in ``skipped``."""
    last = ctx.n_steps - 1
    decoded = ctx.n_steps > 1
    press_step = "Press Step (top of the sidebar) once more: step 0 is the prefill, and this stop shows a later step."
    no_values = ("this generation's capture is “shapes”: no values were kept to draw (choose values under Tracing "
                 "and Reset)")
    prev = ctx.previous
    prev_head = (prev.layer, prev.head) if prev else None
    head_note = f" {prev.sentence()}" if prev else ""
    stops: list[Stop] = []

    B, n0, d, P = ctx.batch_size, ctx.prefill_n, ctx.d_model, ctx.prompt_positions
    stream = (f"{_shape('B', 'n', 'd')} = {_shape(B, n0, d)}" if not P else  # CPM-Ant: its prompt positions first
              f"{_shape('B', 'P + n', 'd')} = {_shape(B, P + n0, d)} (its {P} learned prompt positions, then the "
              "tokens)")
    stops.append(Stop(
        "shapes", "The shape flow", "Shapes",
        f"Follow the residual stream {stream} through one block at step 0: "
        f"attention and the MLP each give back the same shape, so blocks stack, and only the logits leave as "
        f"{_shape('B', 'n', 'V')} = {_shape(B, n0, ctx.vocab)}" + (", the tokens' only." if P else "."), step=0))

    stops.append(Stop(
        "stages", "The attention stages", "Attention",
        "Read the heatmaps left to right — the scores QKᵀ, scaled"
        + (", soft-capped" if ctx.softcap else "") + ", plus the mask M, then the softmax A — at the "
        f"prefill, where row i is query i.{head_note}",
        sub=("attn_view", "Stages"), step=0, head=prev_head,
        skipped="" if ctx.values else no_values))

    stops.append(Stop(
        "mask", "The " + mask_tab_name(ctx.bidirectional).lower(), mask_tab_name(ctx.bidirectional),
        mask_look(n0, ctx.prefill_padding, P, ctx.bidirectional), step=0,
        head=prev_head))

    if prev is not None and ctx.previous_weight is not None:
        row, weight = ctx.previous_weight
        share = (f"here query {row} of sequence 0 (its last token) puts {weight:.2f} of its weight on the key before "
                 "it, so its output row o is " + ("mostly" if weight >= 0.5 else "only partly")
                 + " that key's value row")
        av_look = (f"Each output row is o = Σᵢ αᵢ vᵢ, the value rows weighted by one row of A; with {prev.label}, "
                   f"{share}.")
    else:
        av_look = "Each output row is o = Σᵢ αᵢ vᵢ: the value rows vᵢ weighted by one row of A, summed."
    stops.append(Stop(
        "av", "O = A·V", "Attention", av_look, sub=("attn_view", "O = A·V"), step=0, head=prev_head,
        query=ctx.previous_weight[0] if ctx.previous_weight else None,
        skipped="" if ctx.values else no_values))

    if not decoded:
        step_look = "A decode step feeds the one token the previous step chose."
    elif ctx.use_cache:
        rows = "one query row" if ctx.last_n == 1 else f"{ctx.last_n} query rows"
        step_look = (f"At step {last} the model fed n = {ctx.last_n} new position(s) and attended over t = "
                     f"{ctx.last_t} keys: Q is {_shape('B', 'H', ctx.last_n, 'd_head')}, {rows} against the whole "
                     "cache.")
    elif ctx.bidirectional:  # CPM-Ant: every position sees the new token, so no earlier row stays as it was
        step_look = (f"At step {last} the model keeps no KV cache, so it fed all n = {ctx.last_n} tokens again"
                     + (f" after its {P} learned prompt positions" if P else "")
                     + f" and attended over {P + ctx.last_t} keys: every row recomputed, and the earlier rows changed "
                     "too, since every position sees the new token.")
    else:
        step_look = (f"At step {last} the KV cache is off, so the model fed all n = {ctx.last_n} positions again "
                     f"and attended over t = {ctx.last_t} keys: every row recomputed, only the last one new.")
    stops.append(Stop("step", "One Step", "Attention", step_look, sub=("attn_view", "Stages"),
                      step=last if decoded else None, head=prev_head,
                      skipped="" if ctx.values else no_values, waiting="" if decoded else press_step))

    own = ctx.no_cache_reason or "this model runs its own forward, without our KV cache"
    no_cache = own if not ctx.caches else ("this generation runs with the KV cache off (turn it on in the sidebar and "
                                           "Reset)" if not ctx.use_cache else "")
    stops.append(Stop(
        "cache", "The KV cache", "KV cache",
        f"K and V of every position seen are kept per layer as {_shape('B', 'G', 't', 'd_head')}: after step "
        f"{last} the cache holds {ctx.cache_after} positions, and a decode step appends one and reads them all.",
        sub=("kv_view", "This step"), step=last, skipped=no_cache))

    ind = ctx.induction
    history_head = (ind.layer, ind.head) if ind is not None and ind.clear else prev_head
    about = ind.sentence() if ind is not None and ind.clear else (prev.sentence() if prev else "")
    stops.append(Stop(
        "history", "History", "Attention",
        "Each cached decode step computed one query row; stacked, the rows of steps 0 … s rebuild the "
        f"lower-triangular pattern token by token (this step's row outlined). {about}".rstrip(),
        sub=("attn_view", "History"), step=last if decoded else None, head=history_head,
        skipped=no_cache or ("" if ctx.values else no_values), waiting="" if decoded else press_step))

    if ctx.chosen is None:
        token_look = f"Step {last} chose no token: its logits were not finite."
    elif ctx.greedy:
        token_look = (f"The bars are the top candidates of z = h·W_U after the softmax; greedy decoding took the "
                      f"most probable, “{ctx.chosen}” (p = {ctx.chosen_p:.3f}).")
    else:
        token_look = (f"The bars are the top candidates after temperature, top-k and top-p; step {last} sampled "
                      f"“{ctx.chosen}” (p = {ctx.chosen_p:.3f} under the final distribution).")
    stops.append(Stop("next", "Next-token sampling", "Next token", token_look, step=last))

    stops.append(Stop(
        "flash", "FlashAttention", "Attention",
        "The same O without ever holding the n × t scores: move the tiles slider and watch each row's running max "
        "m and sum ℓ change tile by tile, until the output equals the model's.",
        sub=("attn_view", "FlashAttention"), step=0, head=prev_head, skipped="" if ctx.values else no_values))

    no_backward = ("the backward pass reruns the model that made the trace, and it is not loaded (the selected "
                   "model's weights differ)" if not ctx.live else "")
    stops.append(Stop(
        "gradients", "Gradients", "Attention",
        "From a loss L back through this head: G_V = Aᵀ·G_O, G_P = G_O·Vᵀ, the softmax's Jacobian to G_S, then "
        "G_Q and G_K — each computed from its formula beside autograd's.",
        sub=("attn_view", "Gradients"), step=0, head=prev_head, skipped=no_backward))

    stops.append(engine_stop(ctx))
    return tuple(stops)


ENGINE_IDEA = ("Serving engines do not keep one contiguous cache per sequence: K and V live in a pool of fixed-size "
               "pages, each request's block table maps its logical positions to pages, requests arrive and finish "
               "mid-run, and identical prompt prefixes share pages.")


def engine_stop(ctx: TourContext) -> Stop:
    """The Engine tab: with a run on view, what its pool held at its fullest (the step it opens), from the run's own
    numbers; without one, the idea and a wait for **Run the engine**."""
    title = "The KV cache in a serving engine"
    run = ctx.engine
    if run is None or not run.steps:
        skipped = f"the sidebar's model cannot run the engine: {ctx.engine_refused}" if ctx.engine_refused else ""
        return Stop("engine", title, "Engine", ENGINE_IDEA, skipped=skipped,
                    waiting="Press **Run the engine** in the Engine tab below (its three requests, two sharing a "
                            "prefix, one arriving at engine step 3, are filled in), then read the pool grid.")
    steps = run.steps
    peak = max(s.pages_in_use for s in steps)
    at = next(s.step for s in steps if s.pages_in_use == peak)
    fullest = steps[at]
    shared = (f", {len(fullest.shared)} of them shared by a common prefix" if fullest.shared else "")
    tables = len(fullest.tables)
    contiguous = memory_at(run, at).contiguous  # the tab's memory sentence's number
    look = (f"Each column of the pool grid is an engine step, each row a page of {run.pool.page_size} positions. "
            f"After engine step {at}, the fullest, {peak} of the {run.pool.pages} pages are held by "
            f"{tables} request{'s' if tables != 1 else ''}{shared} — {peak * run.pool.page_size} positions, "
            f"where a padded contiguous cache of the same {len(run.requests)} requests would hold {contiguous}. "
            "Pick a request to see its block table map its logical positions to those pages.")
    return Stop("engine", title, "Engine", look, engine_step=at)


def shown_stops(stops: tuple[Stop, ...]) -> tuple[Stop, ...]:
    """The stops the tour visits: every one not skipped."""
    return tuple(s for s in stops if not s.skipped)


def skipped_sentence(stops: tuple[Stop, ...]) -> str:
    """One line naming the skipped stops and why ("" when none is)."""
    skipped = [s for s in stops if s.skipped]
    if not skipped:
        return ""
    return (f"{len(skipped)} of {len(stops)} stops skipped for this model and generation: "
            + "; ".join(f"{s.title} — {s.skipped}" for s in skipped) + ".")
