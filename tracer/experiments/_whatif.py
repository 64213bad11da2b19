"""What-if experiments on a generation: a step replayed with interventions, the loss on a text, and
activation patching between a clean and a corrupted prompt.

Each runs real forwards of the model (untraced unless a trace is asked for) with the interventions of
``tracer.capture`` applied on this thread only; nothing here changes the generation it starts from.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from gpt_shape_tracer.model.analysis import HEAD_ROLES, repeated_random_tokens, role_scores
from gpt_shape_tracer.model.gpt import HookPoint, act_name
from gpt_shape_tracer.tracer.capture import Intervention, Tracer, applied, check, patch, running_means_before
from gpt_shape_tracer.tracer.experiments._diff import diff_steps
from gpt_shape_tracer.tracer.generation import TracedGeneration
from gpt_shape_tracer.tracer.reading import Trace

if TYPE_CHECKING:
    from gpt_shape_tracer.model.sources import Decoder


@dataclass(frozen=True)
class Replay:
    """One step of a generation run again with interventions."""

    step: int
    trace: Trace  # the replayed forward, traced (its step 0)
    logits: torch.Tensor  # [B, V] the rows the step's token was chosen from, replayed
    original: torch.Tensor  # [B, V] the same rows in the run itself


@torch.no_grad()
def replay(gen: TracedGeneration, step: int, interventions: Sequence[Intervention], capture: str = "values"
           ) -> Replay:
    """Run ``step`` of ``gen`` again — the same tokens, from a copy of the cache as it was before the step —
    with ``interventions``, traced into a trace of its own. The generation is not changed."""
    facts = gen.facts
    forward = facts.step(step).forward
    tokens, mask, last = gen.feed(step)
    cache = gen.cache.copy(forward.cache_before) if gen.cache is not None else None
    tracer = Tracer(gen.model, capture=capture, interventions=interventions, budget_bytes=gen.trace.budget_bytes,
                    running_means=running_means_before(gen.trace, step, interventions, gen.model))
    with tracer.active():
        logits = gen.model(tokens, cache, padding_mask=mask)
    tracer.close()
    pick = (lambda lg: lg[:, -1, :]) if last is None else (lambda lg: lg[torch.arange(lg.size(0)), last])
    original = gen.trace.get(act_name("logits"), step)
    if original is None:  # values of that step not kept: the run's rows again, untraced
        cache = gen.cache.copy(forward.cache_before) if gen.cache is not None else None
        original = gen.model(tokens, cache, padding_mask=mask)
    return Replay(step=step, trace=tracer.trace, logits=pick(logits).float(), original=pick(original).float())


def pattern_changes(gen: TracedGeneration, result: Replay) -> list[tuple[int, int, float]]:
    """(layer, head, max |Δ weight|) of every head's attention pattern, replayed against the run, largest
    first: which heads an intervention changed most."""
    config = gen.model.config
    out = []
    for layer in _attention_layers(config):  # a hybrid model's state layers have no pattern
        a = gen.trace.get(act_name("pattern", layer), result.step)
        b = result.trace.get(act_name("pattern", layer), 0)
        if a is None or b is None:
            continue
        delta = (a - b).abs().amax(dim=(0, 2, 3))  # [H]
        out += [(layer, h, float(d)) for h, d in enumerate(delta)]
    return sorted(out, key=lambda item: -item[2])


def replay_diff(gen: TracedGeneration, result: Replay):
    """The replayed step's records against the run's own, record by record (``diff_steps`` columns)."""
    return diff_steps(gen.trace, result.step, result.trace, 0)


@torch.no_grad()
def text_loss(model: nn.Module, tokens: Sequence[int], interventions: Sequence[Intervention] = (),
              start: int = 1) -> float:
    """Mean next-token cross-entropy (nats) over positions ``start`` … of one token sequence, with the
    interventions applied: the loss of predicting token i from tokens 0 … i−1."""
    ids = torch.tensor([list(tokens)])
    if ids.size(1) < 2 or not 1 <= start < ids.size(1):
        raise ValueError(f"need at least two tokens and 1 ≤ start < {ids.size(1)}, got start = {start}")
    with applied(model, interventions):
        logits = model(ids)  # [1, n, V]
    return float(F.cross_entropy(logits[0, start - 1:-1].float(), ids[0, start:]))


@dataclass(frozen=True)
class PatchingResult:
    """How much patching each (layer, position) of a clean run into a corrupted one restores the answer."""

    kind: str  # the hook patched: "resid_pre" per (layer, position), or "z" per (layer, head)
    restored: torch.Tensor  # [n_layer, positions or heads]: (patched − corrupted) / (clean − corrupted)
    clean_diff: float  # logit[clean answer] − logit[corrupted answer] on the clean prompt
    corrupted_diff: float  # the same on the corrupted prompt
    clean_answer: int
    corrupted_answer: int


@torch.no_grad()
def activation_patching(model: Decoder, clean: Sequence[int], corrupted: Sequence[int], kind: str = "resid_pre",
                        progress: Callable[[float], None] | None = None) -> PatchingResult:
    """Patch the clean run's activations into the corrupted run, one (layer, position) of the residual
    stream (``kind="resid_pre"``) or one (layer, head) of the head outputs (``kind="z"``, all positions)
    at a time, and measure how much of the clean answer's logit difference each restores (1 = all of it).
    The answers are each run's own top token at the last position. A model's learned prompt positions (CPM-Ant),
    the same in both runs, are not patched: position j is token j of the prompts."""
    if len(clean) != len(corrupted) or len(clean) < 1:
        raise ValueError(f"the clean and corrupted prompts must have the same number of tokens, got "
                         f"{len(clean)} and {len(corrupted)}")
    if kind not in ("resid_pre", "z"):
        raise ValueError(f"kind must be 'resid_pre' or 'z', got {kind!r}")
    config = model.config
    clean_ids, corrupt_ids = torch.tensor([list(clean)]), torch.tensor([list(corrupted)])
    with Tracer(model, capture="values") as tr:
        clean_logits = model(clean_ids)[0, -1]
    corrupt_logits = model(corrupt_ids)[0, -1]
    a, b = int(clean_logits.argmax()), int(corrupt_logits.argmax())

    def diff(logits: torch.Tensor) -> float:
        return float(logits[a] - logits[b])

    clean_diff, corrupt_diff = diff(clean_logits), diff(corrupt_logits)
    span = clean_diff - corrupt_diff
    width = len(clean) if kind == "resid_pre" else config.n_head
    P = getattr(config, "prompt_positions", 0)  # CPM-Ant: its learned prompt positions are rows before the tokens
    restored = torch.zeros(config.n_layer, width)
    total = config.n_layer * width
    for layer in range(config.n_layer):
        name = act_name(kind, layer)
        if kind == "z" and layer not in _attention_layers(config):  # no heads here (a hybrid's state layer)
            restored[layer] = math.nan
            continue
        for j in range(width):
            if kind == "resid_pre":
                iv = patch(name, tr.trace, positions=[P + j])  # token j's row
            else:
                iv = patch(name, tr.trace, head=j)
            check([iv], model)
            with applied(model, [iv]) as hooks:
                hooks.set_step(0)
                logits = model(corrupt_ids)[0, -1]
            restored[layer, j] = (diff(logits) - corrupt_diff) / span if span else 0.0
            if progress is not None:
                progress((layer * width + j + 1) / total)
    return PatchingResult(kind, restored, clean_diff, corrupt_diff, a, b)


def _attention_layers(config) -> tuple[int, ...]:
    """The layers with attention heads: all but a hybrid model's state layers (``GPTConfig.attention_layers``)."""
    layers = getattr(config, "attention_layers", None)
    return tuple(layers) if layers is not None else tuple(range(config.n_layer))


class _ProbeDone(Exception):
    """Raised on the probe's own thread once the last layer's pattern has been recorded."""


@contextlib.contextmanager
def _stop_after(model: nn.Module, n_layer: int):
    """While inside: a forward of ``model`` on this thread stops right after the last layer's attention pattern
    (its hook point's tap, added after the tracer's, so the pattern is recorded first). Other threads' forwards
    of a shared model pass; a model without that hook point runs to the end."""
    try:
        point = model.get_submodule(act_name("pattern", n_layer - 1))
    except AttributeError:
        point = None
    if not isinstance(point, HookPoint):
        yield
        return
    me = threading.get_ident()

    def stop(_value: torch.Tensor) -> None:
        if threading.get_ident() == me:
            raise _ProbeDone

    handle = point.add_tap(stop)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def head_scores(model: Decoder, first_token: int = 0, length: int = 50, seed: int = 7) -> dict[str, torch.Tensor]:
    """What each head does, ``name → [n_layer, n_head]``, measured on a probe of 4 random token sequences
    each repeated twice (after ``first_token``):

    * previous-token: the mean weight a query puts on the key just before it;
    * induction: in the second copy, the weight on the key right after the earlier occurrence of the query's
      own token (what lets a model continue a repeat);
    * duplicate-token: in the second copy, the weight on the earlier occurrence of the query's own token;
    * first-token: the mean weight on the very first key (an "attention sink").

    The forward is traced (per thread), so sessions sharing the model do not see each other's probes."""
    config = model.config
    length = max(2, min(length, (config.n_ctx - 1) // 2))
    tokens = repeated_random_tokens(config.vocab_size, length, 4, seed=seed, prefix=first_token)
    # stopped once the last pattern is recorded: the last MLP and the unembedding after it (404 rows × V
    # logits) were most of the probe's time, for nothing it reads
    attending = _attention_layers(config)
    with Tracer(model, capture="values", budget_bytes=2**31) as tr, _stop_after(model, attending[-1] + 1), \
            contextlib.suppress(_ProbeDone):
        model(tokens)
    out: dict[str, list[torch.Tensor]] = {role: [] for role in HEAD_ROLES}
    for layer in range(config.n_layer):
        if layer not in attending:  # a hybrid model's layer without attention: no head to score
            for role in HEAD_ROLES:
                out[role].append(torch.full((config.n_head,), math.nan, dtype=torch.float64))
            continue
        pattern = tr.trace.get(act_name("pattern", layer), 0)
        if pattern is None:
            raise ValueError(f"the probe's attention pattern of layer {layer} was not kept (over the budget)")
        P = getattr(config, "prompt_positions", 0)  # CPM-Ant's learned prompt positions: none is a token of the probe
        for role, scores in role_scores(pattern[..., P:, P:].double(), length).items():  # [B, H, n, n] -> [H]
            out[role].append(scores)
    return {role: torch.stack(rows).float() for role, rows in out.items()}
