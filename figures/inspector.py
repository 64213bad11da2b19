"""The inspector: any record as a 2-D slice, a histogram, raw numbers, its ops."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.common import shape_text
from gpt_shape_tracer.figures.heatmap import MAX_SIDE, WHOLE_UP_TO, add, grid, style_axes
from gpt_shape_tracer.figures.plot import figure, fitted
from gpt_shape_tracer.tracer import Trace, value_blocks

MAX_RAW_ELEMENTS = 400  # tensors up to this size are shown number by number


def slice_2d(value: torch.Tensor, rows: int, cols: int, fixed: dict[int, int]) -> torch.Tensor:
    """The 2-D slice of ``value`` over dims ``rows`` × ``cols``, other dims fixed at ``fixed[dim]``."""
    if value.dim() == 0:
        return value.reshape(1, 1)
    if value.dim() == 1:
        return value.reshape(1, -1)
    if rows == cols:
        raise ValueError("rows and columns must be different dimensions")
    index: list[int | slice] = []
    for dim in range(value.dim()):
        if dim in (rows, cols):
            index.append(slice(None))
        else:
            i = fixed.get(dim, 0)
            if not 0 <= i < value.shape[dim]:
                raise IndexError(f"index {i} is outside dimension {dim} of size {value.shape[dim]}")
            index.append(i)
    out = value[tuple(index)]
    return out if rows < cols else out.T


@fitted
def tensor_heatmap_figure(matrix: torch.Tensor, title: str, x_labels: list[str] | None = None,
                          y_labels: list[str] | None = None, offset: tuple[int, int] = (0, 0)) -> go.Figure:
    """A 2-D slice as a heatmap: pooled to at most 256 × 256 cells for the page (the title says so); an
    amount in [0, 1] on the ``AMOUNT`` scale, anything signed centred on 0. ``offset`` numbers the rows and
    columns of a window cut from a larger slice."""
    m = matrix.detach()
    if not m.is_floating_point() and m.numel() <= WHOLE_UP_TO:  # a larger one is converted tile by tile (pool)
        m = m.double()
    # labels are made only for a side drawn cell by cell; a pooled side is labelled by its number ranges
    xs = x_labels if x_labels is not None and m.shape[1] <= MAX_SIDE else None
    ys = y_labels if y_labels is not None and m.shape[0] <= MAX_SIDE else None
    g = grid(m, xs, ys, offset=offset)
    drawn = g.z[~np.isnan(g.z)]  # the colour scale is about the cells drawn (pooled means, when pooled)
    amount = bool(drawn.size) and float(drawn.min()) >= 0 and float(drawn.max()) <= 1
    fig = figure()
    add(fig, g, "amount" if amount else "signed", colorbar="value")
    style_axes(fig, g, x_title="column", y_title="row", max_ticks=16)
    fig.update_layout(title_text=f"{title} — slice {shape_text(tuple(m.shape))}" + (f" — {g.caption()}" if g.pooled
                                                                                      else ""),
                      title_font_size=13, height=max(260, min(800, 110 + 14 * len(g.y))),
                      margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


HISTOGRAM_SAMPLE = 1_000_000  # larger tensors are counted over this many values drawn at random (fixed seed)


@fitted
def histogram_figure(value: torch.Tensor, title: str, bins: int = 60, every_value: bool = False) -> go.Figure:
    """The distribution of the finite values, counted here (only the bin counts go to the browser). A tensor
    of more than ``HISTOGRAM_SAMPLE`` values is counted over a random sample of that many unless
    ``every_value``; the title says which, and how many NaN/±∞ were left out."""
    x = value.detach()
    total = x.numel()
    sampled = not every_value and total > HISTOGRAM_SAMPLE
    if sampled:  # picked by their index in each dimension: flattening a strided or stride-0 view would copy it
        picks = torch.randint(total, (HISTOGRAM_SAMPLE,), generator=torch.Generator().manual_seed(0))
        x = x[torch.unravel_index(picks, x.shape)] if x.dim() else x.reshape(1)[picks]
    # counted block by block (a float copy and the flags of one block at a time): every value of a large tensor
    # takes two passes, the range and then the counts, and no copy of the whole
    count, lo, hi = 0, math.inf, -math.inf
    for block in value_blocks(x, WHOLE_UP_TO):
        finite = _finite_floats(block)
        if finite.numel():
            count += finite.numel()
            lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    others = (HISTOGRAM_SAMPLE if sampled else total) - count
    fig = figure()
    if count:
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        counts = sum((torch.histc(_finite_floats(block).float(), bins=bins, min=lo, max=hi)
                      for block in value_blocks(x, WHOLE_UP_TO)), torch.zeros(bins))
        width = (hi - lo) / bins
        fig.add_trace(go.Bar(x=[lo + (i + 0.5) * width for i in range(bins)], y=counts.tolist(), width=width,
                             marker_color="#7a8ca3", hovertemplate="%{x:.4g}: %{y:,} values<extra></extra>"))
    what = (f"a random sample of {HISTOGRAM_SAMPLE:,} of its {total:,} values" if sampled
            else f"all {count:,} finite values")
    left_out = f" ({others:,} NaN/±∞{' in the sample' if sampled else ''} not drawn)" if others else ""
    fig.update_layout(title_text=f"{title}: {what}{left_out}", title_font_size=13, height=280,
                      bargap=0.02, margin={"t": 50, "l": 10, "r": 10, "b": 10}, xaxis_title_text="value",
                      yaxis_title_text="count")
    return fig


def _finite_floats(block: torch.Tensor) -> torch.Tensor:
    """The finite values of ``block``, flattened: float32, float64 for integers (their range read exactly)."""
    x = block.reshape(-1)
    x = x.double() if not x.is_floating_point() else x.float()
    return x[torch.isfinite(x)]


def raw_frame(value: torch.Tensor) -> pd.DataFrame | None:
    """Small tensors as a table of numbers (2-D: rows × columns; higher: flattened rows)."""
    if value.numel() > MAX_RAW_ELEMENTS:
        return None
    v = value.detach()
    if v.dim() == 0:
        return pd.DataFrame({"value": [v.item()]})
    if v.dim() == 1:
        return pd.DataFrame({"value": v.tolist()})
    flat = v.reshape(-1, v.shape[-1])
    frame = pd.DataFrame(flat.tolist())
    if v.dim() > 2:
        prefixes = torch.cartesian_prod(*[torch.arange(s) for s in v.shape[:-1]]).reshape(-1, v.dim() - 1)
        frame.index = [str(tuple(p.tolist())) for p in prefixes]
    return frame


def module_ops(trace: Trace, step: int, module: str | None) -> pd.DataFrame:
    """The ops that ran inside ``module`` (and its children; None: all) at ``step``, in order."""
    frame = trace.ops_frame(step=step, module=module)
    if frame.empty:
        return frame
    frame = frame.copy()
    frame["input shapes"] = [" , ".join(shape_text(s) for s in shapes) for shapes in frame["input_shapes"]]
    frame["output shape"] = [" , ".join(shape_text(s) for s in shapes) for shapes in frame["output_shapes"]]
    return frame[["index", "op", "module", "input shapes", "output shape", "dtype", "error"]]
