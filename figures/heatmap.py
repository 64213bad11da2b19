"""The one heatmap builder: what a matrix becomes on the page, whatever its size.

* A matrix larger than ``MAX_SIDE`` in either direction is pooled — each cell
  the mean of the finite numbers in a block of rows × columns — so no figure sends
  more than ~256 × 256 numbers to the browser. The pooling reports what it did
  (``Pooling``: the block sizes, and how many −∞, NaN and +∞ cells it left out of the
  means), and the caption is read from that report: a masked score (−∞) is left out,
  while a masked attention weight is a 0 like any other and counts. A window at full
  resolution is the caller's slice of the same matrix.
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
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.common import safe_text
from gpt_shape_tracer.figures.palette import AMOUNT, MASKED, SIGNED
from gpt_shape_tracer.figures.plot import set_layout

MAX_SIDE = 256
NUMBERS_UP_TO = 12
CLIP_SHARE = 0.99  # a clipped colour scale stops at this quantile of the nonzero cells


@dataclass(frozen=True)
class Pooling:
    """What pooling did to a matrix, reported by the function that pooled it (``pool_reported``, or the tracer's
    digest), so that the caption says only what happened.

    ``rows``, ``cols``: the fewest and most rows (columns) of the matrix one cell's block spans — adaptive pooling's
    blocks differ by one where the sizes do not divide, so "2 × 2" would be false for some cells (fewest 0: not
    known, only the most). ``minus_inf``,
    ``nan``, ``plus_inf``: the matrix's cells of each kind, left out of every mean (a block of none but those is a
    gap). ``by``: "page" — pooled here for the page; "digest" — a summary the tracer pooled when it evicted the
    values (``tracer.storage._log.pooled``) or recomputed them from Q and K (``model.gpt.pool_pattern``): both are
    plain block means, every cell counted, and only attention weights are digested, whose masked cells are 0."""

    shape: tuple[int, int]  # the original matrix's rows × columns
    rows: tuple[int, int] = (1, 1)
    cols: tuple[int, int] = (1, 1)
    minus_inf: int = 0
    nan: int = 0
    plus_inf: int = 0
    by: Literal["page", "digest"] = "page"

    @property
    def pooled(self) -> bool:
        return (self.rows, self.cols) != ((1, 1), (1, 1))

    @property
    def left_out(self) -> int:
        return self.minus_inf + self.nan + self.plus_inf

    def blocks(self) -> str:
        """ "each cell is the mean of 2 × 3 cells of the 600 × 700 matrix" (sizes as ranges where they vary)."""
        def span(lo: int, hi: int) -> str:
            return f"{lo}" if lo == hi else f"{lo}–{hi}"

        where = "pooled for the page: " if self.by == "page" else ""  # a digest's caller says what it is
        if self.rows[0] == 0 or self.cols[0] == 0:  # only the largest block is known
            return (f"{where}each cell is the mean of a block of at most {self.rows[1]} × {self.cols[1]} cells "
                    f"of the {self.shape[0]} × {self.shape[1]} matrix")
        return (f"{where}each cell is the mean of {span(*self.rows)} × {span(*self.cols)} cells of the "
                f"{self.shape[0]} × {self.shape[1]} matrix")

    def what_counted(self) -> str:
        """ "its 78 −∞ cells left out" or "every cell counted": what the means were taken over."""
        if not self.left_out:
            return "every cell counted"
        kinds = [f"{count:,} {kind}" for count, kind in ((self.minus_inf, "−∞"), (self.nan, "NaN"),
                                                         (self.plus_inf, "+∞")) if count]
        return f"its {', '.join(kinds)} cell{'s' if self.left_out != 1 else ''} left out"

    def caption(self) -> str:
        return f"{self.blocks()} ({self.what_counted()})" if self.pooled else ""


def pooled_caption(poolings: dict[str, Pooling]) -> str:
    """One caption for panels drawn side by side (the stages of one head), by name: the blocks once when they are
    pooled alike, then what each panel's means left out ("+ M: its 78 −∞ cells left out; every cell counted in
    QKᵀ, A"); "" when none is pooled."""
    pooled = {name: p for name, p in poolings.items() if p.pooled}
    if not pooled:
        return ""
    heads = {p.blocks() for p in pooled.values()}
    if len(heads) > 1:  # pooled differently (a digest beside kept values): each says its own
        return "; ".join(f"{name}: {p.caption()}" for name, p in pooled.items())
    parts = [f"{name}: {p.what_counted()}" for name, p in pooled.items() if p.left_out]
    counted = [name for name, p in pooled.items() if not p.left_out]
    if counted:
        parts.append("every cell counted in " + ", ".join(counted))
    return f"{heads.pop()} ({'; '.join(parts)})"


@dataclass(frozen=True)
class Grid:
    """A matrix ready to draw: values (float32, NaN = masked or absent), unique labels per row and column, and
    what its pooling did."""

    z: np.ndarray
    x: list[str]
    y: list[str]
    pooling: Pooling = field(default_factory=lambda: Pooling((0, 0)))

    @property
    def pooled(self) -> bool:
        return self.pooling.pooled

    @property
    def block(self) -> tuple[int, int]:
        """(rows, columns) of the original matrix the largest cell stands for; (1, 1) unpooled."""
        return self.pooling.rows[1], self.pooling.cols[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.pooling.shape

    def caption(self) -> str:
        return self.pooling.caption()


WHOLE_UP_TO = 1 << 24  # elements: a larger matrix is pooled tile by tile (``_pool_by_tiles``)


def pool(m: torch.Tensor, rows: int, cols: int, whole_up_to: int = WHOLE_UP_TO) -> torch.Tensor:
    """The mean of the finite values in each of rows × cols blocks (NaN where a block has none)."""
    return pool_reported(m, rows, cols, whole_up_to)[0]


def pool_reported(m: torch.Tensor, rows: int, cols: int, whole_up_to: int = WHOLE_UP_TO
                  ) -> tuple[torch.Tensor, Pooling]:
    """``pool``, and what it did: the blocks' sizes and the non-finite cells it left out, counted on the way."""
    R, C = m.shape
    if m.numel() > whole_up_to:
        values, gaps = _pool_by_tiles(m.detach(), rows, cols, whole_up_to)
        return values, _report(R, C, rows, cols, gaps)
    x = m.detach()
    x = x.float() if x.dtype != torch.float64 else x
    if math.isfinite(float(x.sum())):  # one pass, no copy: the common case has nothing to leave out
        return torch.nn.functional.adaptive_avg_pool2d(x[None], (rows, cols))[0], _report(R, C, rows, cols)
    finite = torch.isfinite(x)
    kept = torch.where(finite, x, 0.0)
    # transformers masks with the smallest float32: a block of those overflows a float32 sum to −∞, and the mean
    # of numbers would be drawn as a gap (grey, like a masked cell); such a matrix is pooled in float64
    if kept.dtype != torch.float64 and max(float(kept.max()), -float(kept.min())) * -(-R // rows) * -(-C // cols) \
            > torch.finfo(kept.dtype).max:  # (two reductions, no copy of the matrix)
        kept = kept.double()
    sums = torch.nn.functional.adaptive_avg_pool2d(kept[None], (rows, cols))[0]
    counts = torch.nn.functional.adaptive_avg_pool2d(finite.to(kept.dtype)[None], (rows, cols))[0]
    values = torch.where(counts > 0, sums / counts.clamp_min(1e-30), torch.full_like(sums, math.nan))
    return values, _report(R, C, rows, cols, _gaps(x))


def _gaps(x: torch.Tensor) -> tuple[int, int, int]:
    """(−∞, NaN, +∞) cells of ``x``."""
    return int(torch.isneginf(x).sum()), int(torch.isnan(x).sum()), int(torch.isposinf(x).sum())


def _report(R: int, C: int, rows: int, cols: int, gaps: tuple[int, int, int] = (0, 0, 0)) -> Pooling:
    row_sizes = [b - a for a, b in _ranges(R, rows)]
    col_sizes = [b - a for a, b in _ranges(C, cols)]
    return Pooling((R, C), (min(row_sizes), max(row_sizes)), (min(col_sizes), max(col_sizes)), *gaps)


def _pool_by_tiles(x: torch.Tensor, rows: int, cols: int, most: int
                   ) -> tuple[torch.Tensor, tuple[int, int, int]]:
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
    gaps = [0, 0, 0]  # −∞, NaN, +∞ cells left out: each tile counted once, by the row block that starts there
    counted_to = 0  # rows below this were counted (adaptive blocks may share a row)
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
                fresh = tile[max(0, counted_to - r0):]  # rows an earlier block did not count
                gaps = [g + n for g, n in zip(gaps, _gaps(fresh))]
        counted_to = b
        sums, counts = sums.cumsum(0), counts.cumsum(0)  # a block's sum: the running sum at its end − at its start
        block_sums, block_counts = sums[ends] - sums[starts], counts[ends] - counts[starts]
        out[i] = torch.where(block_counts > 0, block_sums / block_counts.clamp_min(1), math.nan)
    return out.to(torch.float32 if x.dtype != torch.float64 else torch.float64), (gaps[0], gaps[1], gaps[2])


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
    values, pooling = (matrix, Pooling((rows, cols))) if (r, c) == (rows, cols) else pool_reported(matrix, r, c)
    # a digest (pooled already, ``Trace.digest``) comes with the labels of the whole matrix: each of its cells
    # stands for a block of them (32,768 labels on a 128-column digest made a 1 MB figure that crashed a tab)
    whole_rows = len(y_labels) if y_labels is not None and len(y_labels) > rows else rows
    whole_cols = len(x_labels) if x_labels is not None and len(x_labels) > cols else cols
    if (whole_rows, whole_cols) != (rows, cols):  # the tracer's block means: every cell counted (``Pooling``)
        # its blocks: adaptive pooling's (an evicted value's digest) or one width ⌈R/r⌉ and a narrower last one
        # (a pattern recomputed from Q and K): the same where the sizes divide, else only the largest is known
        span = _report(whole_rows, whole_cols, r, c)
        even = whole_rows % r == 0 and whole_cols % c == 0
        pooling = Pooling((whole_rows, whole_cols), span.rows if even else (0, span.rows[1]),
                          span.cols if even else (0, span.cols[1]), by="digest")
    rows, cols = whole_rows, whole_cols
    z = values.detach().to(torch.float32).numpy(force=True).copy()
    z[~np.isfinite(z)] = np.nan  # ±∞ is drawn as a gap, like a masked cell

    def spans(labels: list[str] | None, count: int, cells: int, first: int) -> list[str]:
        if cells == count:
            return [safe_text(s) for s in labels] if labels is not None else [str(first + i) for i in range(count)]
        return [safe_text(f"{first + a}…{first + b - 1}" if b - a > 1 else f"{first + a}") if labels is None else
                safe_text(f"{a}…{b - 1}" if b - a > 1 else f"{a}") for a, b in _ranges(count, cells)]

    return Grid(z, spans(x_labels, cols, c, offset[1]), spans(y_labels, rows, r, offset[0]), pooling)


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
    # one layout change naming the subplot's two axes: update_xaxes(row=, col=) searches every axis of the
    # figure for each call, and update_layout checks every key path (set_layout)
    cell = fig.get_subplot(row, col) if row is not None else None
    x_name = cell.xaxis.plotly_name if cell is not None else "xaxis"
    y_name = cell.yaxis.plotly_name if cell is not None else "yaxis"
    set_layout(fig, {
        x_name: {"type": "category", "tickvals": g.x[::sx], "ticktext": g.x[::sx], "tickangle": -60,
                 "showgrid": False, "title": {"text": x_title}},
        y_name: {"type": "category", "tickvals": g.y[::sy], "ticktext": g.y[::sy], "autorange": "reversed",
                 "showgrid": False, "showticklabels": y_ticks, "title": {"text": y_title if y_ticks else None}},
        "plot_bgcolor": "white",
    })
