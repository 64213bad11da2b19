"""The causal mask: what M holds at a step, what it does to the scores, and why decode needs none."""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from figures.attention import _axes, _heatmap
from figures.common import facts_of, key_labels, query_labels, safe_text, shape_text
from model.hook_table import act_name
from tracer import Trace


@dataclass
class MaskFacts:
    shape: tuple[int, ...]
    n: int
    t: int
    masked: int  # −∞ entries in the chosen batch row's n × t block
    allowed: int
    padding_columns: list[int]  # key columns masked for every real query (padding)
    use_cache: bool
    decode: bool  # a cached step with one new position
    batch: int = 0  # the sequence the counts are for (M has one block per sequence when padding needs it)

    def explanation(self) -> str:
        whose = f"in sequence {self.batch}'s n × t block, " if self.shape[0] > 1 else ""
        counts = (f"{whose}{self.masked} entries are −∞ and {self.allowed} are 0." if self.masked >= 0 else
                  "its values were not kept (capture “shapes”, or evicted by the budget), so its entries "
                  "are not counted here.")
        lines = [
            f"M has shape {shape_text(self.shape)}: n = {self.n} query row(s) × t = {self.t} key column(s); "
            + counts,
        ]
        if self.decode:
            lines.append(
                "This is a decode step with the KV cache: the only query is the newest position, t − 1. Every key "
                f"0 … {self.t - 1} is at or before it, so causality masks nothing"
                + (" (only the padding columns below are −∞)" if self.padding_columns else "")
                + " — as the KV-caching notes this app follows (seed document 001) put it: “since we’re now only "
                "computing the last row of attention, we don’t need to account for causal attention.” "
                f"Q is [.., 1, d_head], Kᵀ is [.., d_head, {self.t}], and QKᵀ is one row of {self.t} scores."
            )
        elif self.n > 1:
            lines.append(
                f"A full pass over n = {self.n} positions: row i may only see keys j ≤ i, so the "
                f"{self.n * (self.n - 1) // 2} cells above the diagonal are −∞ and get exactly zero weight after "
                "softmax (e^−∞ = 0)."
            )
            if not self.use_cache:
                lines.append(
                    "Without the cache every step recomputes all rows; only the last row is new, and its mask row "
                    "is all zeros — exactly the one row a cached step computes."
                )
        if self.padding_columns:
            cols = ", ".join(map(str, self.padding_columns[:12])) + (" …" if len(self.padding_columns) > 12 else "")
            lines.append(f"Key columns {cols} are padding: −∞ for every real query of this sequence.")
        return "\n\n".join(lines)


def mask_facts(trace: Trace, step: int, layer: int = 0, batch: int = 0) -> MaskFacts:
    rec = trace.record(act_name("mask", layer), step)
    facts = facts_of(trace)
    mask = trace.value(rec)
    n, t = rec.shape[-2], rec.shape[-1]
    if mask is not None:
        block = mask[min(batch, mask.shape[0] - 1), 0]
        masked = int(torch.isinf(block).sum())
        pad_cols = [j for j in facts.padding_columns(batch, step) if j < t]
    else:
        masked, pad_cols = -1, []
    use_cache = facts.info.use_cache
    return MaskFacts(
        shape=rec.shape, n=n, t=t, masked=masked, allowed=n * t - masked if masked >= 0 else -1,
        padding_columns=pad_cols, use_cache=use_cache, decode=use_cache and step > 0 and n == 1, batch=batch,
    )


def mask_figure(trace: Trace, step: int, layer: int = 0, batch: int = 0) -> go.Figure:
    """M as a 0 / −∞ picture (query rows × key columns)."""
    mask = trace.get(act_name("mask", layer), step)
    xs, ys = key_labels(trace, step, batch), query_labels(trace, step, batch)
    fig = go.Figure()
    if mask is None:
        fig.add_annotation(text="mask values not kept for this step", showarrow=False)
        return fig
    block = mask[min(batch, mask.shape[0] - 1), 0]
    is_masked = torch.isinf(block).float()
    n, t = block.shape
    show_text = n * t <= 900
    fig.add_trace(go.Heatmap(
        z=is_masked.tolist(), x=[safe_text(label) for label in xs], y=[safe_text(label) for label in ys],
        zmin=0, zmax=1, colorscale=[[0, "#e8f4ea"], [1, "#3b3b3b"]], showscale=False,
        text=[["−∞" if v else "0" for v in row] for row in is_masked.tolist()],
        texttemplate="%{text}" if show_text else None,
        hovertemplate="q %{y}<br>k %{x}<br>M = %{text}<extra></extra>",
    ))
    _axes(fig, xs, ys)
    fig.update_layout(title_text=f"M at step {step}: {shape_text(tuple(mask.shape))} (0 = may attend, −∞ = masked)",
                      height=max(260, min(800, 120 + 20 * n)), margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


def scores_before_after_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> go.Figure:
    """QKᵀ/√d_k before and after adding M, for one head."""
    before = trace.get(act_name("attn_scores", layer), step)
    after = trace.get(act_name("masked_scores", layer), step)
    xs, ys = key_labels(trace, step, batch), query_labels(trace, step, batch)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("before: QKᵀ/√d_k", "after: QKᵀ/√d_k + M  (−∞ left blank)"))
    if before is None or after is None:
        fig.add_annotation(text="score values not kept for this step", showarrow=False)
        return fig
    b, a = before[batch, head], after[batch, head]
    finite = b[torch.isfinite(b)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (None, None)
    fig.add_trace(_heatmap(b, xs, ys, zmin=lo, zmax=hi, showscale=False), row=1, col=1)
    fig.add_trace(_heatmap(a, xs, ys, zmin=lo, zmax=hi), row=1, col=2)
    _axes(fig, xs, ys, row=1, col=1, max_x_ticks=24)
    _axes(fig, xs, ys, row=1, col=2, max_x_ticks=24, y_ticks=False)
    fig.update_layout(height=max(280, min(800, 130 + 18 * len(ys))), margin={"t": 60, "l": 10, "r": 10, "b": 10})
    return fig
