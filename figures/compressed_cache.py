"""Compressed attention's cache (DeepSeek-V4: model/sources/_hf_compressed.py): per step, the bytes its cache layers
hold — the window's rows, the compressed entries, the indexer's keys and the rows of windows not yet full, summed
from the records of what the cache held — against an uncompressed cache of the same model (K and V of every
position, every layer, at its head sizes), and the compressed entries each layer holds as t grows."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from gpt_shape_tracer.figures.common import facts_of
from gpt_shape_tracer.figures.palette import ACCENT, NEUTRAL
from gpt_shape_tracer.figures.plot import fitted, subplots
from gpt_shape_tracer.model.sources import (
    COMPRESSED_FORWARD_RECORDS,
    COMPRESSED_HELD_RECORDS,
    uncompressed_cache_bytes,
)
from gpt_shape_tracer.tracer import Trace

COMPRESSED = "compressed_kv_all"  # the record whose rows are a layer's compressed entries, [B, 1, T, d_head]
# every record of what a layer's cache held after a step (of COMPRESSED_FORWARD_RECORDS, the cache contents)
HELD = tuple(name.removeprefix("hook_") for name in (*COMPRESSED_FORWARD_RECORDS[:2], *COMPRESSED_HELD_RECORDS))


def _name(kind: str, layer: int) -> str:
    """The record's name (these records are not in the hook table: their widths are V4's own, not the legend's)."""
    return f"blocks.{layer}.attn.hook_{kind}"


def compressed_layers(trace: Trace) -> list[int]:
    """The layers whose attention appends compressed entries (any step recorded them); empty for other models."""
    config = trace.config
    if config is None or not trace.n_steps:
        return []
    return [L for L in range(config.n_layer) if trace.has(_name(COMPRESSED, L), 0)]


def compressed_table(trace: Trace) -> pd.DataFrame:
    """One row per step: t (positions the cache holds after it), the bytes the compressed cache held (the sum of its
    records at that step), the bytes an uncompressed cache of the same heads would hold (``uncompressed_cache_bytes``
    from the config, at the records' batch and number size), and each compressed layer's entries T."""
    config = trace.config
    if config is None:
        raise ValueError("this trace holds no model config, so an uncompressed cache cannot be sized")
    layers = compressed_layers(trace)
    rows = []
    for step in range(trace.n_steps):
        facts = facts_of(trace).step(step).forward
        held = [trace.record(_name(name, L), step) for L in range(config.n_layer) for name in HELD
                if trace.has(_name(name, L), step)]
        if not held:
            continue
        first = trace.record(_name(COMPRESSED, layers[0]), step)
        itemsize = first.nbytes // max(1, first.numel)
        row = {"step": step, "t": facts.cache_after,
               "compressed cache (B)": sum(rec.nbytes for rec in held),
               "uncompressed K and V (B)": uncompressed_cache_bytes(
                   config.n_layer, config.n_kv_heads, config.d_head, config.d_v, facts.cache_after,
                   batch=first.shape[0], itemsize=itemsize)}
        for L in layers:
            row[f"layer {L} entries"] = trace.record(_name(COMPRESSED, L), step).shape[2]
        rows.append(row)
    return pd.DataFrame(rows)


def compressed_sentence(table: pd.DataFrame, step: int) -> str:
    """What the table says at ``step``: the compressed cache's bytes against the uncompressed cache's, as a ratio,
    and the entries each compressed layer holds for its t positions (and how many it added this step)."""
    rows = table[table["step"] == step]
    if rows.empty:
        return f"The cache held nothing recorded at step {step}."
    row = rows.iloc[0]
    t, ours, full = int(row["t"]), int(row["compressed cache (B)"]), int(row["uncompressed K and V (B)"])
    ratio = ours / full if full else float("nan")
    verb = "less than" if ours < full else "more than" if ours > full else "as much as"
    sentence = (f"After step {step} (t = {t} positions) the compressed cache holds {ours:,} bytes, {verb} the "
                f"{full:,} bytes that K and V of every position would take ({ratio:.2f}×).")
    before = table[table["step"] < step]
    parts = []
    for column in [c for c in table.columns if c.endswith(" entries")]:
        entries = int(row[column])
        added = entries - int(before.iloc[-1][column]) if not before.empty else entries
        layer = column.removesuffix(" entries")
        parts.append(f"{layer} holds {entries} compressed {'entry' if entries == 1 else 'entries'} "
                     f"({'+' + str(added) if added else 'none new'} this step)")
    if parts:
        sentence += " For its " + f"{t} positions: " + "; ".join(parts) + "."
    return sentence


@fitted
def compressed_figure(table: pd.DataFrame, step: int | None = None) -> go.Figure:
    """Left: the bytes held per step, the compressed cache against K and V of every position. Right: each compressed
    layer's entries per step. The step shown is marked."""
    fig = subplots(rows=1, cols=2, horizontal_spacing=0.12,
                   subplot_titles=["bytes held after each step", "compressed entries per layer"])
    t = list(table["t"])
    fig.add_trace(go.Scatter(x=t, y=list(table["uncompressed K and V (B)"]), mode="lines+markers",
                             name="uncompressed: K and V of every position", line={"color": NEUTRAL, "width": 3}),
                  row=1, col=1)
    fig.add_trace(go.Scatter(x=t, y=list(table["compressed cache (B)"]), mode="lines+markers",
                             name="the compressed cache, as held", line={"color": ACCENT, "width": 3}), row=1, col=1)
    for column in [c for c in table.columns if c.endswith(" entries")]:
        fig.add_trace(go.Scatter(x=t, y=list(table[column]), mode="lines+markers", line={"shape": "hv"},
                                 name=column.replace(" entries", ": compressed entries")), row=1, col=2)
    if step is not None and not table[table["step"] == step].empty:
        here = int(table[table["step"] == step].iloc[0]["t"])
        for col in (1, 2):
            fig.add_vline(x=here, line={"color": ACCENT, "dash": "dash", "width": 1}, row=1, col=col)
    for col in (1, 2):
        fig.update_xaxes(title_text="t (positions held)", row=1, col=col)
    fig.update_yaxes(title_text="bytes", row=1, col=1)
    fig.update_yaxes(title_text="entries", row=1, col=2)
    fig.update_layout(height=380, legend={"orientation": "h", "y": -0.25}, margin={"t": 40, "l": 10, "r": 10, "b": 10})
    return fig
