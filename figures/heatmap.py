"""The one heatmap builder: what a matrix becomes on the page, whatever its size.

* A matrix larger than ``MAX_SIDE`` in either direction is pooled — each cell
  the mean of a block of rows × columns, masked (−∞) cells left out of the mean —
  so no figure sends more than ~256 × 256 numbers to the browser; the title says
  how many rows and columns one cell stands for. A window at full resolution is
  the caller's slice of the same matrix.
* Values travel as float32 NumPy arrays (NaN where a cell holds no number): plotly
  sends them as base64 typed arrays — 5⅓ characters a number, and no per-number
  validation in Python, which for a nested list costs ~10 µs a cell.
* A matrix of at most ``NUMBERS_UP_TO`` × ``NUMBERS_UP_TO`` writes its numbers in
  the cells.
* Amounts in [0, 1] use the ``AMOUNT`` scale from 0 to 1; anything signed uses
  ``SIGNED`` centred on 0; masked cells are ``MASKED`` grey (``add`` draws that layer).
* Weights far below 1 everywhere (a long softmax row's are ~1/t) would leave 0 … 1 dark: ``weight_top`` stops the
  colours at the 99% quantile of the cells instead, and the colour bar says so (``ColourTop.bar``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import torch

from figures.common import safe_text
from figures.palette import AMOUNT, MASKED, SIGNED

MAX_SIDE = 256
NUMBERS_UP_TO = 12
CLIP_SHARE = 0.99  # a clipped colour scale stops at this quantile of the nonzero cells


@dataclass(frozen=True)
class Grid:
    """A matrix ready to draw: values (float32, NaN = masked or absent), unique labels per row and column, and
    its pooling."""

    z: np.ndarray
    x: list[str]
    y: list[str]
    block: tuple[int, int]  # (rows, columns) of the original matrix one cell stands for; (1, 1) unpooled
    shape: tuple[int, int]  # the original matrix's rows × columns

    @property
    def pooled(self) -> bool:
        return self.block != (1, 1)

    def caption(self) -> str:
        if not self.pooled:
            return ""
        return (f"pooled for the page: each cell is the mean of {self.block[0]} × {self.block[1]} cells of the "
                f"{self.shape[0]} × {self.shape[1]} matrix (masked cells left out)")


WHOLE_UP_TO = 1 << 24  # elements: a larger matrix is pooled tile by tile (``_pool_by_tiles``)


def pool(m: torch.Tensor, rows: int, cols: int, whole_up_to: int = WHOLE_UP_TO) -> torch.Tensor:
    """The mean of the finite values in each of rows × cols blocks (NaN where a block has none)."""
    if m.numel() > whole_up_to:
        return _pool_by_tiles(m.detach(), rows, cols, whole_up_to)
    x = m.detach()
    x = x.float() if x.dtype != torch.float64 else x
    if math.isfinite(float(x.sum())):  # one pass, no copy: the common case has nothing to leave out
        return torch.nn.functional.adaptive_avg_pool2d(x[None], (rows, cols))[0]
    finite = torch.isfinite(x)
    sums = torch.nn.functional.adaptive_avg_pool2d(torch.where(finite, x, 0.0)[None], (rows, cols))[0]
    counts = torch.nn.functional.adaptive_avg_pool2d(finite.to(x.dtype)[None], (rows, cols))[0]
    return torch.where(counts > 0, sums / counts.clamp_min(1e-30), torch.full_like(sums, math.nan))


def _pool_by_tiles(x: torch.Tensor, rows: int, cols: int, most: int) -> torch.Tensor:
    """``pool`` of a matrix too large to copy whole (an Inspector slice of an 8 GiB record, or of a stride-0 view
    claiming that much): for each block of rows, tiles of at most ``most`` elements are summed down their
    rows (finite values and their count, in float64), then each column block's sum is read from the running
    sums along the columns. Nothing larger than one tile is allocated; the blocks are adaptive pooling's."""
    R, C = x.shape
    out = torch.empty(rows, cols, dtype=torch.float64)
    col_blocks = _ranges(C, cols)
    starts = torch.tensor([a for a, _ in col_blocks])
    ends = torch.tensor([b for _, b in col_blocks])
    width = min(C, max(1, most))
    for i, (a, b) in enumerate(_ranges(R, rows)):
        sums, counts = torch.zeros(C + 1, dtype=torch.float64), torch.zeros(C + 1, dtype=torch.float64)
        step = max(1, most // width)
        for c0 in range(0, C, width):
            for r0 in range(a, b, step):
                tile = x[r0:min(b, r0 + step), c0:c0 + width]
                tile = tile.float() if tile.dtype != torch.float64 else tile
                where = slice(1 + c0, 1 + c0 + tile.shape[1])
                down = tile.sum(dim=0)
                if bool(torch.isfinite(down).all()):  # one pass, no flags: the common case has nothing to leave out
                    sums[where] += down
                    counts[where] += tile.shape[0]
                    continue
                finite = torch.isfinite(tile)
                sums[where] += torch.where(finite, tile, 0.0).sum(dim=0)
                counts[where] += finite.sum(dim=0)
        sums, counts = sums.cumsum(0), counts.cumsum(0)  # a block's sum: the running sum at its end − at its start
        block_sums, block_counts = sums[ends] - sums[starts], counts[ends] - counts[starts]
        out[i] = torch.where(block_counts > 0, block_sums / block_counts.clamp_min(1), math.nan)
    return out.to(torch.float32 if x.dtype != torch.float64 else torch.float64)


def _ranges(count: int, cells: int) -> list[tuple[int, int]]:
    """The [start, end) index ranges adaptive pooling gives each of ``cells`` cells over ``count`` items."""
    return [((i * count) // cells, -(-((i + 1) * count) // cells)) for i in range(cells)]


def grid(matrix: torch.Tensor, x_labels: list[str] | None, y_labels: list[str] | None, max_side: int = MAX_SIDE,
         offset: tuple[int, int] = (0, 0)) -> Grid:
    """``matrix`` ``[rows, cols]`` as a ``Grid``: pooled when larger than ``max_side``, labels escaped. Labels
    left out (None) are the row and column numbers from ``offset`` — a 50 257-column slice need not make
    50 257 strings to be drawn in 256 columns."""
    rows, cols = matrix.shape
    r, c = min(rows, max_side), min(cols, max_side)
    values = matrix if (r, c) == (rows, cols) else pool(matrix, r, c)
    # a digest (pooled already, ``Trace.digest``) comes with the labels of the whole matrix: each of its cells
    # stands for a block of them (32,768 labels on a 128-column digest made a 1 MB figure that crashed a tab)
    rows = len(y_labels) if y_labels is not None and len(y_labels) > rows else rows
    cols = len(x_labels) if x_labels is not None and len(x_labels) > cols else cols
    z = values.detach().to(torch.float32).numpy(force=True).copy()
    z[~np.isfinite(z)] = np.nan  # ±∞ is drawn as a gap, like a masked cell

    def spans(labels: list[str] | None, count: int, cells: int, first: int) -> list[str]:
        if cells == count:
            return [safe_text(s) for s in labels] if labels is not None else [str(first + i) for i in range(count)]
        return [safe_text(f"{first + a}…{first + b - 1}" if b - a > 1 else f"{first + a}") if labels is None else
                safe_text(f"{a}…{b - 1}" if b - a > 1 else f"{a}") for a, b in _ranges(count, cells)]

    return Grid(z, spans(x_labels, cols, c, offset[1]), spans(y_labels, rows, r, offset[0]),
                (-(-rows // r), -(-cols // c)), (rows, cols))


@dataclass(frozen=True)
class ColourTop:
    """The top of a colour scale that starts at 0: ``top``; ``share`` is set when the top is that quantile of the
    nonzero cells and the cells above it (``largest`` the largest of them) are drawn in the top colour."""

    top: float
    largest: float
    share: float | None = None  # None: nothing is clipped

    @property
    def clipped(self) -> bool:
        return self.share is not None

    def note(self) -> str:
        """What a title says of a clipped scale ("" when nothing is clipped)."""
        if self.share is None:
            return ""
        return (f"colours stop at {self.top:.3g}, the {self.share:.0%} quantile of the cells (the largest is "
                f"{self.largest:.3g})")

    def bar(self, title: str) -> dict:
        """Colour bar options: ``title``, and where the scale is clipped, "clipped" under it and "≥" on its top
        tick — the value from which a cell is drawn in the top colour."""
        if self.share is None:
            return {"title": {"text": title, "side": "top"}}
        ticks = [0.0, self.top / 2, self.top]
        return {"title": {"text": f"{title}<br>clipped", "side": "top"}, "tickvals": ticks,
                "ticktext": ["0", f"{ticks[1]:.2g}", f"≥{self.top:.3g}"]}


def colour_top(z: np.ndarray, share: float = CLIP_SHARE) -> ColourTop:
    """The top of a colour scale from 0: the ``share`` quantile of the finite nonzero cells where the largest
    cells are far above it (more than twice: a causal pattern's first rows put weight 1 on one key, which would
    leave every other cell dark), else the largest cell; 1 when no cell is above 0."""
    shown = z[np.isfinite(z) & (z > 0)]
    if not shown.size:
        return ColourTop(1.0, 0.0)
    largest, quantile = float(shown.max()), float(np.quantile(shown, share))
    if largest <= 2 * quantile:
        return ColourTop(largest, largest)
    return ColourTop(quantile, largest, share)


def weight_top(z: np.ndarray, share: float = CLIP_SHARE) -> ColourTop:
    """The top of a colour scale for attention weights (0 … 1): 1, a weight's own scale, where the weights fill
    it (their ``share`` quantile is at least ½); else ``colour_top`` — the weights of a long row are ~1/t, and
    their block means at 32k tokens ~1e-4, which 0 … 1 draws all dark."""
    shown = z[np.isfinite(z) & (z > 0)]
    if not shown.size or float(np.quantile(shown, share)) >= 0.5:
        return ColourTop(1.0, float(shown.max()) if shown.size else 0.0)
    return colour_top(z, share)


def short_number(v: float) -> str:
    """At most 5 characters below 10 000 ("-22.9", "-8.15", "0.89", "123"): two decimals under 10, one under
    100, none above — what a narrow cell holds."""
    if math.isinf(v):
        return "−∞" if v < 0 else "∞"
    a = abs(v)
    return f"{v:.2f}" if a < 10 else f"{v:.1f}" if a < 100 else f"{v:.0f}"


def heatmap(g: Grid, kind: str = "signed", zmin: float | None = None, zmax: float | None = None,
            colorbar: str = "", coloraxis: str | None = None, showscale: bool = True,
            bar: dict | None = None, numbers_up_to: int = NUMBERS_UP_TO,
            number: Callable[[float], str] = "{:.3f}".format, scale: ColourTop | None = None) -> go.Heatmap:
    """A plotly heatmap of ``g``. ``kind``: "amount" (0 … 1) or "signed" (centred on 0). Its numbers are
    written (by ``number``) when it has at most ``numbers_up_to`` rows and columns: a figure of several
    panels side by side has narrower cells, so it asks for fewer and shorter numbers (``short_number``). An amount's
    ``scale`` (``weight_top``) sets the top of its colours and its colour bar's title and ticks."""
    small = len(g.z) <= numbers_up_to and len(g.x) <= numbers_up_to
    text = [[("" if math.isnan(v) else number(v)) for v in row] for row in g.z.tolist()] if small else None
    amount = kind == "amount"
    if scale is not None:
        zmax = scale.top
    trace = go.Heatmap(
        z=g.z, x=g.x, y=g.y, text=text, texttemplate="%{text}" if small else None, textfont={"size": 11},
        colorscale=None if coloraxis else (AMOUNT if amount else SIGNED),
        zmin=0.0 if amount and zmin is None else zmin, zmax=1.0 if amount and zmax is None else zmax,
        zmid=None if amount or zmin is not None or coloraxis else 0.0, coloraxis=coloraxis, showscale=showscale,
        hovertemplate="row %{y}<br>column %{x}<br>%{z:.4g}<extra></extra>", hoverongaps=False,
        colorbar=({**(scale.bar(colorbar) if scale is not None else {"title": {"text": colorbar, "side": "top"}}),
                   "thickness": 10, **(bar or {})} if colorbar else None),
    )
    return trace


def masked_layer(g: Grid) -> go.Heatmap | None:
    """Grey cells where ``g`` holds no number (masked, or not there at that step); None when there are none.
    Drawn under the values, so the plot's own margins stay white."""
    gaps = np.isnan(g.z)
    if not gaps.any():
        return None
    z = np.where(gaps, np.float32(1), np.float32(np.nan))
    return go.Heatmap(z=z, x=g.x, y=g.y, colorscale=[[0, MASKED], [1, MASKED]], showscale=False, hoverinfo="skip")


def add(fig: go.Figure, g: Grid, kind: str = "signed", row=None, col=None, **options) -> go.Heatmap:
    """``heatmap(g, kind, **options)`` added to ``fig`` (at ``row``, ``col``), on its masked layer."""
    under = masked_layer(g)
    if under is not None:
        fig.add_trace(under, row=row, col=col)
    trace = heatmap(g, kind, **options)
    fig.add_trace(trace, row=row, col=col)
    return trace


def style_axes(fig: go.Figure, g: Grid, x_title: str = "key position (t)", y_title: str = "query (n)", row=None,
               col=None, max_ticks: int = 24, y_ticks: bool = True) -> None:
    """Category axes with the grid's labels (thinned to ``max_ticks``), rows top to bottom, masked grey."""
    sx = max(1, math.ceil(len(g.x) / max_ticks))
    sy = max(1, math.ceil(len(g.y) / max_ticks))
    # one layout update naming the subplot's two axes: update_xaxes(row=, col=) searches every axis of the
    # figure for each call, which was most of a four-panel figure's build time
    cell = fig.get_subplot(row, col) if row is not None else None
    x_name = cell.xaxis.plotly_name if cell is not None else "xaxis"
    y_name = cell.yaxis.plotly_name if cell is not None else "yaxis"
    fig.update_layout({
        x_name: {"type": "category", "tickvals": g.x[::sx], "ticktext": g.x[::sx], "tickangle": -60,
                 "showgrid": False, "title": {"text": x_title}},
        y_name: {"type": "category", "tickvals": g.y[::sy], "ticktext": g.y[::sy], "autorange": "reversed",
                 "showgrid": False, "showticklabels": y_ticks, "title": {"text": y_title if y_ticks else None}},
        "plot_bgcolor": "white",
    })
