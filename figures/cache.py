"""KV cache views: per-layer K/V shapes, the cache's memory, growth over steps, one head's keys, and the
cached path against a full recompute — counted (rows, multiply-adds, bytes), with time as an estimate."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.cache_hidden import held_name, hidden_memory_formula, hidden_record
from gpt_shape_tracer.figures.common import (
    attention_layers,
    counted,
    facts_of,
    gen_step,
    key_labels,
    no_attention,
    prompt_positions,
    shape_text,
)
from gpt_shape_tracer.figures.heatmap import add, grid, style_axes
from gpt_shape_tracer.figures.palette import ACCENT, NEUTRAL
from gpt_shape_tracer.figures.plot import figure, fitted, set_layout, subplots
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import CachePrecisionRun, RecomputeComparison, TensorRecord, Trace

CACHE_COLOUR = "#f4b6b6"  # the shape flow's colour for the cache, a shade stronger
# what the heat map can show: K, V, and a latent-attention cache's c_KV and k_R (one head: index 0)
HEATMAP_HOOKS = {"K": "k_all", "V": "v_all", "c_KV": "kv_latent_all", "k_R": "k_rope_all"}


def _ran_with_cache(trace: Trace) -> bool:
    return facts_of(trace).info.use_cache


def _n_layer(trace: Trace, step: int) -> int:
    """Layers that hold K and V (every layer but a hybrid model's state layers and the layers that read another
    layer's K and V: KV sharing)."""
    return len(trace.filter(step=step, name="*attn.hook_k_all")) - len(_kv_shared(trace))


def _kv_shared(trace: Trace) -> dict[int, int]:
    """{layer: source} for the layers that attend over another layer's K and V and hold none (Gemma 3n)."""
    config = trace.config
    return dict(getattr(config, "kv_shared", ()) or ()) if config is not None else {}


def _layers(trace: Trace, step: int) -> list[int]:
    """Every layer of the model, attention or not (a hybrid model's state layers hold no K, V rows)."""
    config = trace.config
    return list(range(config.n_layer)) if config is not None else list(range(_n_layer(trace, step)))


def _first_attention(trace: Trace) -> int:
    attending = attention_layers(trace)
    return attending[0] if attending else 0


def latent_records(trace: Trace, step: int, layer: int) -> tuple[TensorRecord, TensorRecord] | None:
    """A latent-attention layer's cache at ``step`` (DeepSeek-V2/V3): the compressed latent c_KV ``[B,1,t,d_c]``
    and the rotary key k_R ``[B,1,t,d_R]`` it holds in place of K and V; None for any other layer."""
    names = act_name("kv_latent_all", layer), act_name("k_rope_all", layer)
    if not all(trace.has(name, step) for name in names):
        return None
    return trace.record(names[0], step), trace.record(names[1], step)


def cache_table(trace: Trace, step: int) -> pd.DataFrame:
    """One row per layer: K and V [B, G, t, d_head] at ``step``, rows new this step, bytes. A latent-attention
    model adds what its cache holds instead — c_KV [B,1,t,d_c] and k_R [B,1,t,d_R] — with their bytes; an indexed
    layer the keys its indexer keeps beside them [B, t, d_I]."""
    use_cache = _ran_with_cache(trace)
    rows = []
    for layer in _layers(trace, step):
        states = state_records(trace, step, layer)
        if no_attention(trace, layer) is not None:  # a hybrid model's state layer: no K, V rows at all
            config = trace.config
            mixer = config.mixers[layer] if config is not None and config.mixers is not None else "state"
            row = {"layer": layer, "K": f"none ({mixer})", "V": "none", "rows from the cache": 0,
                   "rows computed this step": 0, "bytes (K+V)": 0}
            if states:
                row = {**row, "state": " + ".join(shape_text(rec.shape) for rec in states),
                       "state bytes": sum(rec.nbytes for rec in states)}
            rows.append(row)
            continue
        k = trace.record(act_name("k_all", layer), step)
        v = trace.record(act_name("v_all", layer), step)
        hidden = hidden_record(trace, step, layer)
        if hidden is not None:  # XLNet: the cache holds the layer's input hidden states; K and V are made again
            rows.append({"layer": layer, "K": shape_text(k.shape), "V": shape_text(v.shape), "rows from the cache": 0,
                         "rows computed this step": k.shape[2], "bytes (K+V)": 0,
                         "cache holds: hidden states": shape_text(hidden.shape), "bytes held": hidden.nbytes})
            continue
        source = _kv_shared(trace).get(layer)
        if source is not None:  # KV sharing: it attends over layer `source`'s K and V, and its cache holds nothing
            rows.append({"layer": layer, "K": shape_text(k.shape), "V": shape_text(v.shape),
                         "rows from the cache": 0, "rows computed this step": 0, "bytes (K+V)": 0,
                         "K, V read from": f"layer {source} (KV sharing)"})
            continue
        k_new = trace.record(act_name("k", layer), step)
        row = {
            "layer": layer,
            "K": shape_text(k.shape),
            "V": shape_text(v.shape),
            "rows from the cache": k.shape[2] - k_new.shape[2] if use_cache else 0,
            "rows computed this step": k_new.shape[2],
            "bytes (K+V)": k.nbytes + v.nbytes,
        }
        latent = latent_records(trace, step, layer)
        if latent is not None:
            c_kv, k_r = latent
            row = {**row, "cache holds: c_KV": shape_text(c_kv.shape), "k_R": shape_text(k_r.shape),
                   "bytes held (c_KV+k_R)": c_kv.nbytes + k_r.nbytes}
        if trace.has(index_keys := act_name("index_keys_all", layer), step):  # indexed attention: the indexer's
            rec = trace.record(index_keys, step)  # own keys, cached beside K and V
            row = {**row, "indexer keys": shape_text(rec.shape), "indexer bytes": rec.nbytes}
        if states:  # a hybrid layer: its state-space mixer's state, kept by transformers' own cache
            row = {**row, "state": " + ".join(shape_text(rec.shape) for rec in states),
                   "state bytes": sum(rec.nbytes for rec in states)}
        rows.append(row)
    return pd.DataFrame(rows)


def latent_memory_sentence(n_layer: int, B: int, H: int, t: int, d_c: int, d_r: int, d_qk: int, d_v: int,
                           itemsize: int, step: int) -> tuple[str, str]:
    """(LaTeX, sentence) for a latent-attention cache: B·t·(d_c + d_R) numbers per layer held, against the
    B·H·t·(d_qk + d_v) that K and V expanded from them would take."""
    held = B * t * (d_c + d_r)
    full = B * H * t * (d_qk + d_v)
    latex = (rf"B\cdot t\cdot (d_c + d_R) = {B}\cdot {t}\cdot ({d_c} + {d_r}) = {held:,}"
             rf"\ \text{{numbers per layer}}")
    sentence = (f"{counted(n_layer, 'layer')} × {held:,} numbers × {itemsize} bytes = "
                f"{n_layer * held * itemsize / 1024:,.1f} KiB at step {step}: this model uses multi-head latent "
                f"attention (DeepSeek-V2), and its cache holds per position the compressed latent c_KV (d_c = {d_c}) "
                f"and the rotary key k_R (d_R = {d_r}), shared "
                f"by all {H} heads. K and V are expanded from them at every step; held instead, B·H·t·(d_qk + d_v) "
                f"= {B}·{H}·{t}·({d_qk} + {d_v}) = {full:,} numbers per layer, they would take "
                f"{n_layer * full * itemsize / 1024:,.1f} KiB, {full / held:.1f}× as much. transformers' own cache "
                "for this model holds the same two tensors.")
    return latex, sentence


def memory_formula(trace: Trace, step: int) -> tuple[str, str]:
    """(LaTeX, sentence): the cache's size per layer, 2·B·G·t·d_k, with this step's numbers, against the
    2·B·H·t·d_k a cache with one key/value head per query head would hold (latent attention: what its cache
    holds against K and V, ``latent_memory_sentence``)."""
    if trace.config is not None and not attention_layers(trace):  # a state-space model: no K, V anywhere
        return state_memory_formula(trace, step)
    first = _first_attention(trace)
    if hidden_record(trace, step, first) is not None:  # XLNet: hidden states held, K and V made again
        return hidden_memory_formula(trace, step)
    latent = latent_records(trace, step, first)
    if latent is not None:
        c_kv, k_r = latent
        k, v = trace.record(act_name("k_all", first), step), trace.record(act_name("v_all", first), step)
        B, H, t, d_qk = k.shape
        return latent_memory_sentence(_n_layer(trace, step), B, H, t, c_kv.shape[-1], k_r.shape[-1], d_qk,
                                      v.shape[-1], c_kv.nbytes // max(1, c_kv.numel), step)
    k = trace.record(act_name("k_all", first), step)
    q = trace.record(act_name("q", first), step)
    B, G, t, dk = k.shape
    H = q.shape[1]
    n_layer = _n_layer(trace, step)
    size = k.nbytes // max(1, k.numel)
    per_layer = 2 * B * G * t * dk
    full = 2 * B * H * t * dk
    latex = (rf"2\cdot B\cdot G\cdot t\cdot d_k = 2\cdot {B}\cdot {G}\cdot {t}\cdot {dk} = {per_layer:,}"
             rf"\ \text{{numbers per layer}}")
    held = (f"{counted(n_layer, 'layer')} × {per_layer:,} numbers × {size} bytes = "
            f"{n_layer * per_layer * size / 1024:,.1f} KiB")
    shared = _kv_shared(trace)
    others = len(_layers(trace, step)) - n_layer - len(shared)
    if others > 0:  # a hybrid model: only its attention layers hold K and V
        held += (f" (its {counted(n_layer, 'attention layer')}; the other {counted(others, 'layer')} "
                 + ("has no softmax attention and holds" if others == 1 else "have no softmax attention and hold")
                 + " no K, V rows)")
    if shared:  # KV sharing: the reading layers hold nothing of their own
        pairs = ", ".join(f"{L} reads {source}'s" for L, source in sorted(shared.items()))
        held += (f"; {len(shared)} more "
                 + ("layer attends over an earlier layer's K and V and holds none of its own" if len(shared) == 1
                    else "layers attend over an earlier layer's K and V and hold none of their own")
                 + f" (KV sharing: layer {pairs})")
    if G == H:
        sentence = (f"{held} at step {step}. This model has as many key/value heads as query heads (G = H = {H}), "
                    "so its cache is the full multi-head one; grouped-query models share each key/value head "
                    "among several query heads and hold H/G times less.")
    else:
        sentence = (f"{held} at step {step}. With one key/value head per query head it would be 2·B·H·t·d_k = "
                    f"{full:,} numbers per layer: the {G} shared key/value heads hold {H // G}× less "
                    f"({H} query heads, {H // G} per key/value head).")
    return latex, sentence


STATE_HOOKS = ("hook_conv_state", "hook_ssm_state")  # a hybrid model's per-layer state (model/sources/_hf_cache.py)
def state_memory_formula(trace: Trace, step: int) -> tuple[str, str]:
    """(LaTeX, sentence) for a model whose every layer keeps a fixed-size state instead of K and V (Mamba, Mamba-2,
    Falcon-Mamba): the state's bytes per layer, read from the records, the same at every step so far, beside what a
    KV cache of softmax attention at the same width would hold at this step's t — 2·G·d_head numbers per token per
    layer, G·d_head = d_model for multi-head attention (the model has no heads: its width stands in) — and the t
    from which that cache would be the larger."""
    config = trace.config
    assert config is not None
    layers = _layers(trace, step)
    per_layer = [sum(rec.nbytes for rec in state_records(trace, step, layer)) for layer in layers]
    held = sum(per_layer)
    steps = [gs.step for gs in facts_of(trace).steps if gs.step <= step]
    sizes = {sum(held_bytes(trace, s, layer) for layer in layers) for s in steps}
    forward = gen_step(trace, step).forward
    t = forward.t
    out = trace.record(f"blocks.{layers[0]}.hook_mixer_out", step)  # [B, n, d]: the model's batch, width, dtype
    B, d, itemsize = out.shape[0], out.shape[-1], out.nbytes // max(1, out.numel)
    kv_per_token = 2 * B * d * itemsize  # one layer, the batch's B rows: 2·G·d_head·bytes with G·d_head = d
    kv = kv_per_token * t
    states = state_records(trace, step, layers[0])
    shapes = " + ".join(f"{rec.name.rsplit('.', 1)[-1].removeprefix('hook_').replace('_', ' ')} "
                        f"{shape_text(rec.shape)}" for rec in states)
    mixer = config.mixers[layers[0]] if config.mixers is not None else "state"
    equal = per_layer[0] / kv_per_token
    crossing = math.floor(equal) + 1  # the first whole t at which the cache would hold more
    latex = (rf"\text{{state}} = {per_layer[0]:,}\ \text{{B per layer, fixed}}\qquad "
             rf"2\cdot B\cdot t\cdot d\cdot b = 2\cdot {B}\cdot {t}\cdot {d}\cdot {itemsize} = {kv:,}"
             rf"\ \text{{B per layer of a KV cache}}")
    same = (f"the same after every one of the {len(steps)} steps so far" if len(sizes) == 1 else
            f"{len(sizes)} different totals over the {len(steps)} steps so far")
    sentence = (f"{counted(len(layers), 'layer')} × {per_layer[0]:,} bytes = {held / 1024:,.1f} KiB at step {step}, "
                f"{same}: this model has no softmax attention and keeps no KV cache. Each layer ({mixer}) keeps a "
                f"fixed state of {per_layer[0]:,} bytes ({shapes}), overwritten at every step, instead of a cache "
                f"growing by "
                f"2·G·d_head·bytes = 2·{d}·{itemsize} = {2 * d * itemsize:,} bytes per token per sequence (softmax "
                f"attention of the same width, d = G·d_head = {d}). At t = {t} such a cache would hold "
                f"{kv:,} bytes per layer ({B} sequence(s)), {kv / max(1, per_layer[0]):.2g}× the state; it "
                + (f"passes the state from t = {crossing:,} on." if crossing > t else
                   f"has held more than the state since t = {crossing:,}."))
    return latex, sentence


def state_records(trace: Trace, step: int, layer: int) -> list[TensorRecord]:
    """The convolution and state-space state a hybrid model's layer keeps after ``step`` (Falcon-H1's Mamba-2
    mixer: conv ``[B, channels, kernel]``, SSM ``[B, heads, d_head, d_state]``), in transformers' own cache;
    empty for a layer (or model) without."""
    names = [f"blocks.{layer}.{hook}" for hook in STATE_HOOKS]
    return [trace.record(name, step) for name in names if trace.has(name, step)]


def held_bytes(trace: Trace, step: int, layer: int) -> int:
    """Bytes one layer's cache holds after ``step``: K + V, or c_KV + k_R for latent attention, plus the state
    of a hybrid model's state-space layer."""
    latent = latent_records(trace, step, layer)
    hidden = hidden_record(trace, step, layer)
    if hidden is not None:  # XLNet: its input hidden states, and no K, V
        return hidden.nbytes
    if no_attention(trace, layer) is not None or layer in _kv_shared(trace):  # a state layer: its state only; a
        return sum(rec.nbytes for rec in state_records(trace, step, layer))  # KV-sharing layer: nothing
    records = latent if latent is not None else [trace.record(act_name(kind, layer), step)
                                                 for kind in ("k_all", "v_all")]
    return sum(rec.nbytes for rec in (*records, *state_records(trace, step, layer)))


def state_sentence(trace: Trace, step: int) -> str | None:
    """What a hybrid model's state layers hold beside K and V at ``step``, counted from the records; None when
    no layer keeps state."""
    layers = [(layer, state_records(trace, step, layer)) for layer in _layers(trace, step)]
    layers = [(layer, records) for layer, records in layers if records]
    if not layers or (trace.config is not None and not attention_layers(trace)):  # a state-space model:
        return None  # there is no K and V to keep it beside (state_memory_formula says what it holds)
    total = sum(rec.nbytes for _, records in layers for rec in records)
    shapes = " and ".join(f"{rec.name.rsplit('.', 1)[-1].removeprefix('hook_').replace('_', ' ')} "
                          f"{shape_text(rec.shape)}" for rec in layers[0][1])
    keep = "keeps its" if len(layers) == 1 else "keep their"
    return (f"Beside K and V, {counted(len(layers), 'layer')} {keep} mixer's state in the cache — "
            f"per layer {shapes} — {total / 1024:,.1f} KiB in all after step {step}. That state has a fixed size: "
            "each step overwrites it instead of adding a row, so it does not grow with t as K and V do.")


def cache_growth(trace: Trace) -> pd.DataFrame:
    """Per step: cache length after the step and bytes of K+V held (or computed) over all layers."""
    rows = []
    facts = facts_of(trace)
    use_cache = facts.info.use_cache
    P = prompt_positions(trace)  # CPM-Ant: its learned prompt positions are keys of every step too
    for gs in facts.steps:
        total = sum(held_bytes(trace, gs.step, layer) for layer in _layers(trace, gs.step))
        rows.append({"step": gs.step, "cache length": gs.forward.cache_after if use_cache else 0,
                     "t (keys attended)": P + gs.forward.t, "K+V bytes (all layers)": total if use_cache else 0,
                     "K+V bytes computed": total})
    return pd.DataFrame(rows)


@fitted
def key_heatmap_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0, which: str = "K") -> go.Figure:
    """One key/value head's cached keys (or values): positions × d_head, the rows added at ``step`` outlined."""
    value = trace.get(act_name(HEATMAP_HOOKS[which], layer), step)
    fig = figure()
    if value is None:
        fig.add_annotation(text=f"{which} values not kept for this step", showarrow=False)
        return fig
    m = value[batch, head]  # [t, d_head]
    t, d_head = m.shape
    use_cache = _ran_with_cache(trace)
    g = grid(m, [f"d{j}" for j in range(d_head)], key_labels(trace, step, batch))
    add(fig, g, "signed", colorbar=which)
    width = {"c_KV": "d_c", "k_R": "d_R"}.get(which, "d_head")
    style_axes(fig, g, x_title=width, y_title="position", max_ticks=32)
    new = gen_step(trace, step).forward.n if use_cache else t
    cells = len(g.y)
    top = cells - max(1, round(new * cells / t))
    fig.add_shape(type="rect", x0=-0.5, x1=len(g.x) - 0.5, y0=top - 0.5, y1=cells - 0.5,
                  line={"color": ACCENT, "width": 3})
    rows = f"row {t - 1}" if new == 1 else f"rows {t - new}…{t - 1}"
    what = f"{rows} added at step {step}" if use_cache else f"all {t} rows recomputed at step {step}, no cache"
    whose = f"{which} of layer {layer}" + (", one for all heads" if which in ("c_KV", "k_R")
                                          else f", key/value head {head}")
    return set_layout(fig, {"title": {"text": f"{whose}: {shape_text(tuple(m.shape))} = [t, {width}] — {what} "
                                              "(outlined)" + (f" — {g.caption()}" if g.pooled else ""),
                                      "font": {"size": 13}},
                            "height": max(300, min(900, 120 + 16 * cells)),
                            "margin": {"t": 50, "l": 10, "r": 10, "b": 10}})


def rows_computed(trace: Trace) -> pd.DataFrame:
    """Query rows of attention computed per step with the cache (n) and without it (all t); a model's learned
    prompt positions (CPM-Ant) are rows of every full forward."""
    facts = facts_of(trace)
    P = prompt_positions(trace)
    rows = []
    for gs in facts.steps:
        width = P + facts.width(gs.step)
        rows.append({"step": gs.step, "with cache": 1 if gs.step > 0 else width, "without cache": width,
                     "this run": gs.forward.n + (P if gs.forward.n == facts.width(gs.step) else 0)})
    return pd.DataFrame(rows)


def evidence_table(c: RecomputeComparison) -> pd.DataFrame:
    """What each path did at this step, counted from the model's shapes; the measured time last."""
    def ratio(a: float, b: float) -> str:
        if a == b:
            return "the same"
        if not a or not b:
            return "only the cached path" if a else "only the full recompute"
        return f"{b / a:.1f}× fewer" if a < b else f"{a / b:.1f}× more"

    rows = [
        ("query rows of attention computed (per sequence)", c.cached.query_rows, c.full.query_rows),
        ("multiply-adds of the forward", c.cached.macs, c.full.macs),
        ("bytes of weights read", c.cached.weight_bytes, c.full.weight_bytes),
        ("bytes of cached K, V read", c.cached.kv_bytes, c.full.kv_bytes),
    ]
    frame = pd.DataFrame([{"": what, "cached path": f"{a:,}", "full recompute": f"{b:,}",
                           "cached path does": ratio(a, b)} for what, a, b in rows])
    if c.cached.seconds is not None and c.full.seconds is not None:
        how = "estimate: one untraced run each" if c.timing_repeats == 1 else f"estimate: fastest of {c.timing_repeats}"
        frame.loc[len(frame)] = {"": f"wall time ({how})", "cached path": f"{c.cached.seconds * 1000:.1f} ms",
                                 "full recompute": f"{c.full.seconds * 1000:.1f} ms", "cached path does": ""}
    return frame


def _rows_by_layer(c: RecomputeComparison, trace: Trace | None) -> dict[int, tuple[float, float]]:
    """The cached-rows check per layer that holds K and V rows (a hybrid model's state layers hold none)."""
    return {layer: d for layer, d in enumerate(c.cached_rows_delta)
            if trace is None or (no_attention(trace, layer) is None and not _holds_hidden(trace, layer))}


def _holds_hidden(trace: Trace, layer: int) -> bool:
    """Whether ``layer`` keeps hidden states between steps instead of K and V rows (XLNet): recorded at every step
    of a run with the cache on, so the first step says."""
    return any(hidden_record(trace, gs.step, layer) is not None for gs in facts_of(trace).steps[:1])


def verdict(c: RecomputeComparison, trace: Trace | None = None) -> tuple[str, str]:
    """(level, text) for the comparison of one step: what it shows, computed from the comparison itself."""
    delta = f"max |Δ logits| = {c.max_abs_delta:.2e}"
    side = ("this run's own cached logits" if c.run_used_cache else
            "an untraced cached re-run (this run has the cache off: it is itself the full recompute)")
    if c.nothing_cached:
        return ("info", f"At the prefill nothing is cached yet: both paths compute all {c.full.query_rows} query rows "
                        f"with the same {c.full.macs:,} multiply-adds, so their agreement ({delta}) says nothing about "
                        "the cache. From step 1 on, the cached path computes one row per sequence.")
    fewer = c.full.macs / c.cached.macs if c.cached.macs else float("inf")
    if not c.equal:
        return ("error", f"NOT equal: the cached path disagrees with a full recompute ({delta}, above the tolerance "
                         f"{c.tolerance:g} for this dtype). A cache that returned wrong rows would do this. The cached "
                         f"side is {side}.")
    past = c.full.query_rows - c.cached.query_rows
    why = ("Row i of K and V depends on tokens 0…i: in layer 0 on token i alone, in every later layer on all of "
           "them through the residual stream. It depends on nothing after i, because the causal mask keeps every "
           "earlier row from seeing later tokens, so a row made when its own step ran never changes afterwards")
    rows = _rows_by_layer(c, trace)
    if rows and not c.cached_rows_equal:
        layer = max(rows, key=lambda i: max(rows[i]))
        return ("error", f"The logits agree ({delta}), but the cached K and V rows do NOT equal their recomputation "
                         f"from all {c.full.query_rows} tokens: layer {layer} differs by {max(rows[layer]):.2e}, above "
                         f"the tolerance {c.tolerance:g}. The cached side is {side}.")
    if rows:
        layer = max(rows, key=lambda i: max(rows[i]))
        others = len(c.cached_rows_delta) - len(rows)
        shown = (f"Recomputed from all {c.full.query_rows} tokens, the {past} cached rows agree in every one of the "
                 f"{len(rows)} layers that hold K and V (largest |Δ| {max(rows[layer]):.2e}, layer {layer}; table "
                 "below)" + (f"; the other {others} layer(s) have no softmax attention and hold no rows." if others
                             else "."))
    elif trace is not None and any(_holds_hidden(trace, layer) for layer in _layers(trace, 0)):
        shown = (f"This model's cache holds each layer's input hidden states, not K and V ({held_name(trace)}): every "
                 "step computes its K and V rows again from them, so there are no cached K, V rows to check.")
    else:
        shown = "(This file holds no layer-by-layer check of the cached rows.)"
    text = (f"The cached path computed {c.cached.query_rows} query row(s) with {c.cached.macs:,} multiply-adds, "
            f"the full recompute {c.full.query_rows} rows with {c.full.macs:,} ({fewer:.1f}× more), and the logits "
            f"agree within {c.tolerance:g} ({delta}: rounding). Only the new row was needed. {why}. {shown} "
            f"The cached side is {side}.")
    return ("success", text)


def cached_rows_table(c: RecomputeComparison, trace: Trace | None = None) -> pd.DataFrame:
    """Per layer that holds K and V, the cached rows against their recomputation from all tokens (empty when
    none)."""
    return pd.DataFrame([{"layer": layer, "max |ΔK| cached vs recomputed": f"{dk:.2e}",
                          "max |ΔV| cached vs recomputed": f"{dv:.2e}",
                          "equal": "yes" if max(dk, dv) <= c.tolerance else "NO"}
                         for layer, (dk, dv) in _rows_by_layer(c, trace).items()])


def timing_warning(c: RecomputeComparison) -> str:
    """A warning when the measured times contradict the count (a busy machine), else ""."""
    cached, full = c.cached.seconds, c.full.seconds
    if not c.timing_contradicts_count or cached is None or full is None:  # (a contradiction has both timings)
        return ""
    return (f"On this machine the measured times ({cached * 1000:.1f} ms cached vs "
            f"{full * 1000:.1f} ms full) contradict the count of multiply-adds. Why was not measured: times this "
            "short are easily swayed by whatever else the machine does, by caches warming, or by a fixed cost per "
            "call that outweighs the saved work. Wall time is an estimate; the counts above are the evidence.")


@fitted
def cache_steps_figure(trace: Trace, selected_step: int | None = None) -> go.Figure:
    """The cache over the steps, one shared step axis: what the cache holds (positions, KiB of K+V; with the
    cache off, what each step recomputed instead), the query rows each step computed with the cache and
    without it, and — for the steps compared with a recompute — both paths' multiply-adds. All counted.
    One figure, not three: each chart on a page costs the browser full plots on every Step."""
    growth = cache_growth(trace)
    table = rows_computed(trace)
    comparisons = facts_of(trace).comparisons
    compared = sorted(comparisons)
    use_cache = _ran_with_cache(trace)
    if use_cache and trace.config is not None and not attention_layers(trace):  # a state-space model
        bars = ("cache length", "positions seen")
        line = ("K+V bytes (all layers)", "KiB of state held (all layers)")
        title = "no KV cache: the state held has a fixed size, whatever the positions seen"
    elif use_cache and hidden_record(trace, 0, _first_attention(trace)) is not None:  # XLNet, Reformer
        bars = ("cache length", "cache length (positions)")
        line = ("K+V bytes (all layers)", "KiB the cache holds (all layers)")
        title = "the cache grows by one row of hidden states per token; no K, V are held"
    elif use_cache:
        bars = ("cache length", "cache length (positions)")
        line = ("K+V bytes (all layers)", "KiB the cache holds (all layers)")
        title = "the KV cache grows by one row per step"
    else:  # nothing is held between steps: show the work that replaces the cache
        bars = ("t (keys attended)", "K, V rows recomputed (t), none cached")
        line = ("K+V bytes computed", "K+V KiB computed this step (all layers)")
        title = "KV cache off: nothing is kept between steps; every step recomputes all t rows"
    rows = 3 if compared else 2
    fig = subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.09,
                   specs=[[{"secondary_y": True}]] + [[{}]] * (rows - 1),
                   subplot_titles=[title, "query rows computed per step (counted)",
                                   "multiply-adds per step (counted)"][:rows])
    fig.add_trace(go.Bar(x=growth["step"], y=growth[bars[0]], name=bars[1], marker_color=CACHE_COLOUR),
                  row=1, col=1, secondary_y=False)
    fig.add_trace(go.Scatter(x=growth["step"], y=growth[line[0]] / 1024, mode="lines+markers", name=line[1],
                             line={"dash": "dot", "color": NEUTRAL}, marker={"color": NEUTRAL}),
                  row=1, col=1, secondary_y=True)
    fig.add_trace(go.Bar(x=table["step"], y=table["with cache"], name="with cache (rows)", marker_color="#4c78a8"),
                  row=2, col=1)
    fig.add_trace(go.Bar(x=table["step"], y=table["without cache"], name="without cache (rows)",
                         marker_color="#9ecae1"), row=2, col=1)
    if compared:
        fig.add_trace(go.Scatter(x=compared, y=[comparisons[s].cached.macs for s in compared], mode="lines+markers",
                                 name="cached path (multiply-adds)", line={"color": "#4c78a8"}), row=3, col=1)
        fig.add_trace(go.Scatter(x=compared, y=[comparisons[s].full.macs for s in compared], mode="lines+markers",
                                 name="full recompute (multiply-adds)", line={"color": "#9ecae1"},
                                 marker={"symbol": "x", "size": 9}), row=3, col=1)
        fig.update_yaxes(title_text="multiply-adds", rangemode="tozero", row=3, col=1)
    if selected_step is not None:
        fig.add_vline(x=selected_step, line={"color": ACCENT, "width": 2})
    fig.update_yaxes(title_text="positions cached" if use_cache else "positions recomputed", rangemode="tozero",
                     row=1, col=1, secondary_y=False)
    fig.update_yaxes(title_text="KiB", rangemode="tozero", showgrid=False, row=1, col=1, secondary_y=True)
    fig.update_yaxes(title_text="query rows", rangemode="tozero", row=2, col=1)
    dtick = 1 if len(table) <= 30 else None
    # the steps there are, and no more: plotly's padding around the bars would otherwise tick a step −1 and
    # one after the last
    fig.update_xaxes(dtick=dtick, showticklabels=True)
    if len(table):
        fig.update_xaxes(range=[float(table["step"].min()) - 0.5, float(table["step"].max()) + 0.5])
    fig.update_xaxes(title_text="step", row=rows, col=1)
    fig.update_annotations(font_size=13, xanchor="left", x=0)
    fig.update_layout(barmode="group", height=260 * rows + 60, margin={"t": 90, "l": 10, "r": 10, "b": 10},
                      legend={"orientation": "h", "y": 1.04, "yanchor": "bottom", "x": 0})
    return fig


def window_layers(trace: Trace, step: int) -> list[int]:
    """The layers whose recorded mask at ``step`` hides a real key at or before a real query's own column: a
    sliding window at work (read from the masks, not assumed from the config; empty when no mask shows one)."""
    facts = facts_of(trace)
    forward = facts.step(step).forward
    layers = []
    for layer in attention_layers(trace):
        mask = trace.get(act_name("mask", layer), step)
        if mask is None or mask.shape[-1] != forward.t:  # columns that are not positions (compressed attention)
            continue
        for b in range(facts.batch_size):
            real = torch.tensor(facts.is_token(b, step)[:forward.t])  # [t]
            hidden = ~torch.isfinite(mask[min(b, mask.shape[0] - 1), 0]) | (mask[min(b, mask.shape[0] - 1), 0] <=
                                                                           torch.finfo(mask.dtype).min)  # [n, t]
            column = torch.arange(forward.t - forward.n, forward.t)[:, None]  # each query's own column
            earlier = torch.arange(forward.t)[None, :] <= column
            if bool((hidden & earlier & real[None, :] & real[-forward.n:][:, None]).any()):
                layers.append(layer)
                break
    return layers


@fitted
def growth_figure(config, t_now: int, itemsize: int = 4, n_now: int | None = None,
                  windowed: tuple[int, ...] | list[int] = ()) -> tuple[go.Figure, str]:
    """What grows with n, on this model's widths: the multiply-adds of a full forward of n positions part by
    part (left), and the bytes the staged attention's n × n scores of one layer take against the KV cache of
    all layers and the weights (right), for n from 1 to n_ctx on log axes; this step's t marked. Returns the
    figure and a sentence with the crossing where attention overtakes the MLP."""
    from gpt_shape_tracer.model.analysis import PARTS, attention_overtakes_mlp, forward_cost, forward_parts

    n_ctx = int(config.n_ctx)
    ns = sorted({max(1, round(n_ctx ** (i / 40))) for i in range(41)} | {t_now})
    per_n = [forward_parts(config, 1, n, n) for n in ns]
    parts = {name: [counts[name] for counts in per_n] for name in PARTS}
    H, G, dh = config.n_head, getattr(config, "n_kv_head", None) or config.n_head, config.d_head
    L = len(getattr(config, "attention_layers", None) or range(config.n_layer))  # the layers that hold K and V
    scores = [H * n * n * itemsize for n in ns]  # one layer's [H, n, n] scores (each stage as large)
    cache = [2 * L * G * n * dh * itemsize for n in ns]
    weights = forward_cost(config, 1, 1, 1, itemsize=itemsize).weight_bytes
    fig = subplots(rows=1, cols=2, horizontal_spacing=0.12,
                   subplot_titles=["multiply-adds of a forward of n positions", "bytes held"])
    for name, values in parts.items():
        fig.add_trace(go.Scatter(x=ns, y=values, mode="lines", name=name,
                                 line={"width": 3 if name in ("QKᵀ and A·V", "MLP") else 1.5}), row=1, col=1)
    # the same model with the cache: the prefill computes all n rows once; each decode step after it one row
    # over the n cached keys (the counts the KV cache tab shows per step)
    fig.add_trace(go.Scatter(x=ns, y=[forward_cost(config, 1, n, n).macs for n in ns], mode="lines",
                             name="all: a forward of n positions (prefill, or a step without the cache)",
                             line={"color": "#222", "width": 2}), row=1, col=1)
    fig.add_trace(go.Scatter(x=ns, y=[forward_cost(config, 1, 1, n, cached=n - 1).macs for n in ns], mode="lines",
                             name="all: one cached decode step at t = n", line={"color": "#222", "dash": "dash"}),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=ns, y=scores, mode="lines", name="scores of one layer, [H, n, n]",
                             line={"color": ACCENT, "width": 3}), row=1, col=2)
    fig.add_trace(go.Scatter(x=ns, y=cache, mode="lines", name="KV cache, 2·L·G·n·d_head",
                             line={"color": NEUTRAL, "width": 3}), row=1, col=2)
    fig.add_trace(go.Scatter(x=[ns[0], ns[-1]], y=[weights, weights], mode="lines", name="weights",
                             line={"color": NEUTRAL, "dash": "dot"}), row=1, col=2)
    window = getattr(config, "sliding_window", None)
    if windowed and window:
        fig.add_trace(go.Scatter(x=ns, y=[H * n * min(n, window) * itemsize for n in ns], mode="lines",
                                 name=f"scores a windowed layer needs, [H, n, min(n, {window})]",
                                 line={"color": ACCENT, "dash": "dash", "width": 2}), row=1, col=2)
    # vertical marks as two-point lines: a layout shape on a log axis would need its x in log10 units
    low_macs = min(min(v) for v in parts.values())
    high_macs = forward_cost(config, 1, ns[-1], ns[-1]).macs
    low_bytes, high_bytes = min(min(cache), weights), max(max(scores), weights)
    for col, (low, high) in ((1, (low_macs, high_macs)), (2, (low_bytes, high_bytes))):
        fig.add_trace(go.Scatter(x=[t_now, t_now], y=[low, high], mode="lines", name=f"this step: t = {t_now}",
                                 line={"color": ACCENT, "dash": "dash", "width": 1}, showlegend=col == 1,
                                 hoverinfo="skip"), row=1, col=col)
        fig.update_xaxes(type="log", title_text="n (positions)", row=1, col=col)
        fig.update_yaxes(type="log", exponentformat="SI", row=1, col=col)
    crossing = attention_overtakes_mlp(config)
    if crossing <= n_ctx:
        fig.add_trace(go.Scatter(x=[crossing, crossing], y=[low_macs, high_macs], mode="lines",
                                 name=f"attention passes the MLP: n ≈ {crossing:,.0f}", hoverinfo="skip",
                                 line={"color": "#444", "dash": "dot", "width": 1}), row=1, col=1)
    fig.update_layout(height=420, legend={"orientation": "h", "y": -0.22}, title_font_size=13,
                      margin={"t": 40, "l": 10, "r": 10, "b": 10})
    return fig, growth_sentence(config, t_now, itemsize, n_now, windowed)


def growth_sentence(config, t_now: int, itemsize: int = 4, n_now: int | None = None,
                    windowed: tuple[int, ...] | list[int] = ()) -> str:
    """What grows with n, from this model's widths and this step's n and t: attention's cost against the MLP's,
    this step's scores (H × n × t: n = 1 at a cached decode step) against the whole cache, the first whole n at
    which one layer's scores outgrow the cache (equal at 2·L·G·d_head/H), and what a sliding window changes."""
    from gpt_shape_tracer.model.analysis import attention_overtakes_mlp

    n_ctx = int(config.n_ctx)
    n_now = t_now if n_now is None else n_now
    H, G, dh, L = config.n_head, getattr(config, "n_kv_head", None) or config.n_head, config.d_head, config.n_layer
    crossing = attention_overtakes_mlp(config)
    per_token_mlp = (3 if getattr(config, "mlp", "gelu") == "swiglu" else 2) * config.d_model * config.d_ff
    where = (f"from n ≈ {crossing:,.0f} on, inside this model's n_ctx of {n_ctx:,} (dotted line)" if crossing <= n_ctx
             else f"only from n ≈ {crossing:,.0f}, beyond this model's n_ctx of {n_ctx:,}")
    scores_now = H * n_now * t_now * itemsize
    cache_now = 2 * L * G * t_now * dh * itemsize
    step_kind = (f"this cached decode step computes one query row, so its scores are H × 1 × t = {H} × 1 × {t_now}"
                 if n_now == 1 and t_now > 1 else f"this step's scores are H × n × t = {H} × {n_now} × {t_now}")
    equal = 2 * L * G * dh / H  # H·n² = 2·L·G·n·d_head
    first = math.floor(equal) + 1  # the first whole n with H·n² > 2·L·G·n·d_head
    if first <= n_ctx:
        outgrow = (f"one layer's scores of a full forward (H·n²) outgrow the cache of every layer (2·L·G·n·d_head) "
                   f"from n = {first:,} on" + (f" (equal at n = {equal:,.0f})" if equal == int(equal) else "")
                   + f", inside n_ctx = {n_ctx:,}")
    elif equal <= n_ctx:
        outgrow = (f"one layer's scores of a full forward (H·n²) reach the cache of every layer (2·L·G·n·d_head) "
                   f"only at n = {equal:,.0f} = n_ctx, and are never larger inside it")
    else:
        outgrow = (f"one layer's scores of a full forward (H·n²) stay below the cache of every layer "
                   f"(2·L·G·n·d_head) inside n_ctx = {n_ctx:,}: they would pass it from n = {first:,}")
    sentence = (f"Attention's two products cost 2·H·n²·d_head = 2·{H}·n²·{dh} multiply-adds per layer for a forward "
                f"of n positions, quadratic in n; the MLP costs {per_token_mlp:,}·n, linear. Attention costs more "
                f"{where}. In bytes, per sequence, {step_kind} numbers, {_size(scores_now)}, against "
                f"{_size(cache_now)} for the whole KV cache at t = {t_now}; {outgrow}. FlashAttention never holds "
                "them.")
    window = getattr(config, "sliding_window", None)
    if window and windowed:
        names = ", ".join(str(x) for x in windowed)
        sentence += (f" Layer{'s' if len(windowed) > 1 else ''} {names} slide a window of {window} keys: each query "
                     f"sees at most {window}, so what such a layer needs is at most H·n·{window} scores and "
                     f"2·H·n·{window}·d_head multiply-adds — linear in n from n = {window} on, not quadratic. The "
                     "staged path drawn here still forms all n × t scores and masks the rest; a windowed kernel "
                     "does only the linear part.")
    elif window:
        sentence += (f" The config names a sliding window of {window} keys, which no layer's mask at this step shows"
                     + (f" (t = {t_now} ≤ {window}: nothing to hide yet)." if t_now <= window else
                        ": this model does not use it here."))
    return sentence


def _size(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB" if b >= 2**10 else f"{b:,.0f} B"


def growth_takeaway(config, t_now: int, itemsize: int = 4, n_now: int | None = None,
                    batch: int = 1) -> tuple[str, list[tuple[str, str]]]:
    """The view's takeaway: at this step's t, what attention's products and the MLP cost, and what this step's
    scores hold against the whole cache, counted from the model's widths for the step's ``batch`` sequences (the
    figures of the step, as This step shows them; one sequence's are said as such)."""
    from gpt_shape_tracer.model.analysis import forward_parts

    n_now = t_now if n_now is None else n_now
    parts = forward_parts(config, batch, n_now, t_now)
    attention, mlp = parts["QKᵀ and A·V"], parts["MLP"]
    H, G = config.n_head, getattr(config, "n_kv_head", None) or config.n_head
    scores = batch * H * n_now * t_now * itemsize
    L = len(getattr(config, "attention_layers", None) or range(config.n_layer))  # the layers that hold K and V
    cache = batch * 2 * L * G * t_now * config.d_head * itemsize
    verb = "more than" if attention > mlp else "less than" if attention < mlp else "as much as"
    whose = f"this step, its B = {batch} sequences together" if batch > 1 else "this step"
    sentence = (f"At t = {t_now}, attention's products cost {verb} the MLP ({attention:,} against {mlp:,} "
                f"multiply-adds at {whose}): attention grows with n·t, the MLP with n.")
    suffix = f", B = {batch}" if batch > 1 else ""
    return sentence, [("attention ÷ MLP (multiply-adds)", f"{attention / mlp:.3g}×"),
                      (f"this step's scores, one layer{suffix}", _size(scores)),
                      (f"KV cache, all layers{suffix}", _size(cache))]


def precision_takeaway(run: CachePrecisionRun) -> str:
    """The cheaper cache's takeaway, from the run: how much less it holds and whether any step's choice changed."""
    saved = 1 - run.stored_bytes / run.reference_bytes
    first = run.first_difference
    worst = max(s.max_abs_delta for s in run.steps)
    return (f"Stored as {run.storage}, the cache holds {saved:.0%} less"
            + (f", and no step's own choice differs in {len(run.steps)} steps (largest |Δ logits| {worst:.3g})."
               if first is None else f"; from step {first} its own choice would differ (largest |Δ logits| "
               f"{worst:.3g})."))
