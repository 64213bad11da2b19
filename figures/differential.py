"""Differential attention, seen per head (Ye et al. 2024, "Differential Transformer"; DiffLlama): each differential
head j computes two softmaxes with the same queries and keys — A_1 (query head j) and A_2 (query head j + H/2) — and
applies A_1 − λ·A_2 to its values, λ learned. Read from the records ``hook_pattern_1``, ``hook_pattern_2``,
``hook_diff_lambda`` and ``hook_diff_pattern`` (model/sources/_hf_attention.py); every number a sentence states is
counted here from them."""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.common import key_labels, query_labels, real_query_rows
from gpt_shape_tracer.figures.heatmap import add, grid, style_axes
from gpt_shape_tracer.figures.plot import fitted, subplots
from gpt_shape_tracer.tracer import Trace


@dataclass(frozen=True)
class DifferentialHead:
    """Differential head ``head`` (0 … H/2 − 1) of ``layer`` at ``step`` for sequence ``batch``: its two softmaxes
    and what it applies, ``[n, t]`` each, λ, and which query rows are real tokens."""

    layer: int
    step: int
    batch: int
    head: int
    first: torch.Tensor
    second: torch.Tensor
    applied: torch.Tensor
    lam: float
    real_rows: torch.Tensor  # [n] bool

    @property
    def row_sums(self) -> torch.Tensor:
        """Σ_t of what the head applies, per real query row: 1 − λ wherever both softmaxes' rows sum to 1."""
        return self.applied[self.real_rows].sum(dim=-1)

    @property
    def negative(self) -> int:
        """Weights below zero among the real query rows: keys the head subtracts rather than reads."""
        return int((self.applied[self.real_rows] < 0).sum())

    @property
    def cells(self) -> int:
        return int(self.applied[self.real_rows].numel())


def is_differential(trace: Trace, step: int, layer: int) -> bool:
    return trace.has(f"blocks.{layer}.attn.hook_diff_pattern", step)


def differential_head(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> DifferentialHead | None:
    """Differential head ``head % (H/2)`` (the attention tab's head picker counts all H query heads; heads j and
    j + H/2 are its two softmaxes), None where the layer is not differential or its values were not kept."""
    if not is_differential(trace, step, layer):
        return None
    values = [trace.get(f"blocks.{layer}.attn.hook_{name}", step)  # not in the hook table: DiffLlama's own
              for name in ("pattern_1", "pattern_2", "diff_pattern", "diff_lambda")]
    first, second, applied, lam = values
    if first is None or second is None or applied is None or lam is None:
        return None
    j = head % first.shape[1]
    b = min(batch, first.shape[0] - 1)
    n = first.shape[-2]
    return DifferentialHead(layer, step, b, j, first[b, j].float(), second[b, j].float(), applied[b, j].float(),
                            float(lam.reshape(-1)[0]), real_query_rows(trace, step, b, n))


def differential_sentence(d: DifferentialHead) -> str:
    """What the head applies to its values, from its own numbers."""
    sums = d.row_sums
    low, high = float(d.applied[d.real_rows].min()), float(d.applied[d.real_rows].max())
    sentence = (f"Differential head {d.head} subtracts λ = {d.lam:.3f} times its second softmax from its first: the "
                f"weights it applies to V run from {low:.3f} to {high:.3f}, ")
    if d.cells and float((sums - (1 - d.lam)).abs().max()) <= 1e-4:
        sentence += f"and each query row sums to 1 − λ = {1 - d.lam:.3f}, not 1"
    else:
        sentence += f"and its query rows sum to {float(sums.min()):.3f} … {float(sums.max()):.3f}"
    if d.negative:
        sentence += (f"; {d.negative} of its {d.cells} weights are negative — keys it pushes away rather than "
                     "reads.")
    else:
        sentence += "; none is negative at this step."
    return sentence


@fitted
def differential_figure(trace: Trace, d: DifferentialHead) -> go.Figure:
    """Three panels, query rows × key columns: A_1, A_2 (each a softmax, 0 … 1) and A_1 − λ·A_2 on a scale centred
    on 0 (blue below: keys subtracted)."""
    xs, ys = key_labels(trace, d.step, d.batch), query_labels(trace, d.step, d.batch)
    titles = (f"A₁ (query head {d.head})", f"A₂ (query head {d.head} + H/2)", f"A₁ − λ·A₂, λ = {d.lam:.3f}")
    fig = subplots(rows=1, cols=3, subplot_titles=titles, horizontal_spacing=0.05)
    for col, (matrix, kind) in enumerate(((d.first, "amount"), (d.second, "amount"), (d.applied, "signed")), 1):
        g = grid(matrix, xs, ys)
        top = float(matrix.abs().max()) or 1.0
        options = {"zmin": -top, "zmax": top} if kind == "signed" else {}
        add(fig, g, kind, row=1, col=col, showscale=col == 3, colorbar="weight" if col == 3 else "",
            numbers_up_to=0, **options)
        style_axes(fig, g, row=1, col=col, y_ticks=col == 1)
    fig.update_layout(title_text=f"Layer {d.layer}, step {d.step}: what differential head {d.head} applies to its "
                                 "values", title_font_size=13,
                      height=max(300, min(800, 140 + 20 * len(g.y))), margin={"t": 70, "l": 10, "r": 10, "b": 10})
    return fig
