"""The inspector: any record as a 2-D slice, a histogram, raw numbers, its ops."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import torch

from figures.common import HEATMAP_SCALE, finite_or_none, hover_values, shape_text
from tracer import Trace

MAX_RAW_ELEMENTS = 400  # tensors up to this size are shown number by number
MAX_HISTOGRAM_VALUES = 200_000


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


def tensor_heatmap_figure(matrix: torch.Tensor, title: str) -> go.Figure:
    m = matrix.detach()
    if not m.is_floating_point():
        m = m.double()
    fig = go.Figure(go.Heatmap(z=finite_or_none(m), customdata=hover_values(m), colorscale=HEATMAP_SCALE,
                               hovertemplate="[%{y}, %{x}] = %{customdata}<extra></extra>"))
    # integer ticks only: a 1-row slice would otherwise get ticks at −0.4 … 0.4
    fig.update_yaxes(autorange="reversed", tickformat="d", dtick=max(1, m.shape[0] // 10))
    fig.update_xaxes(tickformat="d", dtick=max(1, m.shape[-1] // 16))
    fig.update_layout(title_text=f"{title} — slice {shape_text(tuple(m.shape))}",
                      height=max(260, min(800, 100 + 14 * m.shape[0])), margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


def histogram_figure(value: torch.Tensor, title: str) -> go.Figure:
    x = value.detach().flatten().double()
    x = x[torch.isfinite(x)]
    if x.numel() > MAX_HISTOGRAM_VALUES:
        step = x.numel() // MAX_HISTOGRAM_VALUES + 1
        x = x[::step]
        title += f" (every {step}th value)"
    fig = go.Figure(go.Histogram(x=x.tolist(), nbinsx=60))
    fig.update_layout(title_text=title, height=280, bargap=0.02, margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


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
