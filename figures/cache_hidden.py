"""What a model keeps between steps where its cache holds each layer's input hidden states instead of K and V
(XLNet's mems, Reformer's states, recorded as ``blocks.{L}.hook_mems`` by model/sources/_hf_cache.py): the record,
and the memory sentence the KV cache view (figures/cache.py) shows for it, counted from the records."""

from __future__ import annotations

from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import TensorRecord, Trace

HIDDEN_HOOK = "hook_mems"  # [B, m, d]: the input hidden states a layer keeps between steps (XLNet's mems)


def hidden_record(trace: Trace, step: int, layer: int) -> TensorRecord | None:
    """The hidden states ``layer`` keeps after ``step`` in place of K and V (XLNet's mems, [B, m, d]), from which
    the next step computes K and V of every position again; None for a layer (or model) without."""
    name = f"blocks.{layer}.{HIDDEN_HOOK}"
    return trace.record(name, step) if trace.has(name, step) else None


def held_name(trace: Trace) -> str:
    """What the family calls the hidden states its cache holds, by its family."""
    family = str(getattr(trace.config, "hf_model_type", "") or "")
    return {"xlnet": "XLNet's mems", "reformer": "the states of Reformer's past_buckets_states"}.get(
        family, "the family's own cache")


def hidden_memory_formula(trace: Trace, step: int) -> tuple[str, str]:
    """(LaTeX, sentence) for a model whose cache holds each layer's input hidden states instead of K and V
    (XLNet): B·m·d numbers per layer, read from the records, beside the 2·B·G·t·d_k a KV cache would hold at this
    step and the K, V rows every step computes again from them."""
    n_layer = trace.config.n_layer if trace.config is not None else 0
    held = {layer: rec for layer in range(n_layer) if (rec := hidden_record(trace, step, layer)) is not None}
    first = min(held)
    B, m, d = held[first].shape
    size = held[first].nbytes // max(1, held[first].numel)
    total = sum(rec.nbytes for rec in held.values())
    layers = list(held)
    k = trace.record(act_name("k_all", first), step)
    _, G, t, dk = k.shape
    kv = 2 * B * G * t * dk
    latex = (rf"B\cdot m\cdot d = {B}\cdot {m}\cdot {d} = {B * m * d:,}\ \text{{numbers per layer}}\qquad "
             rf"2\cdot B\cdot G\cdot t\cdot d_k = {kv:,}\ \text{{for K and V}}")
    sentence = (f"{len(layers)} layers × {B * m * d:,} numbers × {size} bytes = {total / 1024:,.1f} KiB at step "
                f"{step}: this model's cache holds no K and V. What each layer keeps between steps is its input "
                f"hidden states ({held_name(trace)}), {m} position(s) of width d = {d} per sequence; every step "
                f"computes K and V of all t = {t} positions again from them and the new tokens. K and V held instead "
                f"would take 2·B·G·t·d_k = 2·{B}·{G}·{t}·{dk} = {kv:,} numbers per layer, "
                f"{kv / max(1, B * m * d):.2g}× as many.")
    return latex, sentence
