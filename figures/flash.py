"""FlashAttention, tile by tile (Dao et al., 2022): the same O = softmax(S)·V without ever holding S whole.

For one head and one block of query rows, the scores are read one tile of key columns at a time. After each
tile j the rows keep only three things — a running max m, a running sum ℓ = Σ exp(s − m) and an unnormalised
output acc = Σ exp(s − m)·v — and when a tile raises the max, what was summed so far is rescaled by
exp(m_old − m_new) ("online softmax"). After the last tile acc / ℓ is exactly softmax(S)·V: the recorded
output of the model, to rounding. Everything here is recomputed in float64 from the trace's own Q (after the
rotation, where the model rotates), K, V and M, with the model's own scale and soft-cap; nothing is assumed.

Pure functions: a trace in, the tile steps and figures out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from figures.attention import kv_head, sink_logits
from figures.common import key_labels, query_labels, score_scale
from figures.heatmap import add, grid, style_axes
from figures.palette import ACCENT, NEUTRAL
from figures.plot import fitted, subplots
from model.gpt import act_name
from tracer import Trace

BLOCK_SIZES = (4, 8, 16, 32, 64, 128)  # tile widths offered (FlashAttention's own are 64–128 on a GPU)


@dataclass(frozen=True)
class Tile:
    """The state of the query block's rows after reading one tile of keys."""

    index: int
    keys: tuple[int, int]  # [first, last + 1) key columns of the tile
    m: torch.Tensor  # [rows] running max of the scores read so far (−∞ while a row has seen only masked keys)
    l: torch.Tensor  # [rows] running sum Σ exp(s − m)  # noqa: E741 - the paper's ℓ
    output: torch.Tensor  # [rows, d_v] acc / ℓ: the output as far as the tiles read so far go
    rescaled: int  # rows whose max rose at this tile (their earlier sums rescaled by exp(m_old − m_new))


@dataclass(frozen=True)
class FlashRun:
    """One head's query block computed tile by tile, with what the model itself returned."""

    layer: int
    head: int
    batch: int
    rows: tuple[int, int]  # [first, last + 1) query rows of this step's n
    n: int  # query rows of the step
    block: int  # tile width (key columns) and query-block height
    scores: torch.Tensor  # [rows, t] the scores S (+ M), float64: drawn tile by tile, never needed by the method
    tiles: tuple[Tile, ...]
    reference: torch.Tensor  # [rows, d_v] the model's own O rows (hook_z)
    itemsize: int  # bytes per number in the model's dtype

    @property
    def max_abs_delta(self) -> float:
        """max |O(tiles) − O(model)| after the last tile."""
        return float((self.tiles[-1].output - self.reference.double()).abs().max())

    @property
    def tile_bytes(self) -> int:
        """What the method holds for these rows at once: one tile of S, m and ℓ, and the running output."""
        rows = self.rows[1] - self.rows[0]
        return (rows * self.block + 2 * rows + rows * self.reference.shape[-1]) * self.itemsize

    @property
    def full_bytes(self) -> int:
        """The scores of these rows against every key, as the staged path holds them (one head)."""
        return self.scores.numel() * self.itemsize


def flash_attention(trace: Trace, step: int, layer: int, head: int, batch: int = 0, block: int = 16,
                    query_block: int = 0) -> FlashRun | None:
    """Query block ``query_block`` (rows block·i … block·(i+1) − 1 of this step's n) of one head, computed tile by
    tile over its keys; None when the step kept no Q, K, V, M or O values to recompute from."""
    if block < 1:
        raise ValueError(f"the block size must be at least 1, got {block}")
    rope = trace.has(act_name("rot_q", layer), step)
    names = {"q": "rot_q" if rope else "q", "k": "k_all", "v": "v_all", "mask": "mask", "z": "z"}
    values = {key: trace.get(act_name(kind, layer), step) for key, kind in names.items()}
    if any(v is None for v in values.values()):
        return None
    q, k, v, mask, z = (values[key] for key in ("q", "k", "v", "mask", "z"))
    assert q is not None and k is not None and v is not None and mask is not None and z is not None
    n = q.shape[2]
    first = query_block * block
    if not 0 <= first < n:
        raise ValueError(f"query block {query_block} starts at row {first}, but this step has {n} query rows")
    rows = (first, min(n, first + block))
    g = kv_head(trace, layer, head, step)
    qh = q[batch, head, rows[0]:rows[1]].double()  # [r, d_k]
    kh, vh = k[batch, g].double(), v[batch, g].double()  # [t, d_k], [t, d_v]
    m_rows = mask[min(batch, mask.shape[0] - 1), 0, rows[0]:rows[1]].double()  # [r, t]
    scores = qh @ kh.T * score_scale(trace, qh.shape[-1])  # [r, t]
    cap = getattr(trace.config, "attn_softcap", None)
    if cap:
        scores = torch.tanh(scores / cap) * cap
    scores = scores + m_rows
    t = kh.shape[0]
    m = torch.full((qh.shape[0],), -math.inf, dtype=torch.float64)
    l = torch.zeros(qh.shape[0], dtype=torch.float64)  # noqa: E741 - the paper's ℓ
    if trace.has(act_name("sink_logits", layer), step):  # gpt-oss: the sink is one more key, of value 0, read first
        sink = sink_logits(trace, step, layer, head, batch)
        if sink is None:
            return None
        m, l = sink[rows[0]:rows[1]].clone(), torch.ones(qh.shape[0], dtype=torch.float64)  # noqa: E741
    acc = torch.zeros(qh.shape[0], vh.shape[-1], dtype=torch.float64)
    tiles = []
    for index, start in enumerate(range(0, t, block)):
        end = min(t, start + block)
        s = scores[:, start:end]  # one tile of S: the only scores held
        m_new = torch.maximum(m, s.max(dim=-1).values)
        seen = torch.isfinite(m_new)  # a row whose keys so far are all masked has nothing to sum yet
        safe = torch.where(seen, m_new, torch.zeros_like(m_new))
        p = torch.where(seen[:, None], torch.exp(s - safe[:, None]), torch.zeros_like(s))
        correction = torch.where(torch.isfinite(m), torch.exp(m - safe), torch.zeros_like(m))
        rescaled = int((torch.isfinite(m) & (m_new > m)).sum())
        l = correction * l + p.sum(dim=-1)  # noqa: E741
        acc = correction[:, None] * acc + p @ vh[start:end]
        m = m_new
        output = torch.where(l[:, None] > 0, acc / l.clamp_min(1e-300)[:, None], torch.zeros_like(acc))
        tiles.append(Tile(index, (start, end), m.clone(), l.clone(), output, rescaled))
    return FlashRun(layer, head, batch, rows, n, block, scores, tuple(tiles),
                    reference=z[batch, head, rows[0]:rows[1]], itemsize=z.element_size())


def memory_sentence(run: FlashRun) -> str:
    """What the tiled method holds at once against what the staged path holds, with this run's numbers."""
    rows = run.rows[1] - run.rows[0]
    t = run.scores.shape[1]
    d_v = run.reference.shape[-1]

    def size(b: int) -> str:
        return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB" if b >= 2**10 else f"{b} B"

    which = "this query row" if rows == 1 else f"these {rows} query rows"
    return (f"Held at once for {which}: one tile of S ({rows} × {run.block}), m and ℓ ({rows} each) "
            f"and the running output ({rows} × {d_v}) — {size(run.tile_bytes)} in {run.itemsize}-byte numbers — "
            f"against the {rows} × {t} scores the staged path holds for them ({size(run.full_bytes)}), and "
            f"{run.n} × {t} = {size(run.n * t * run.itemsize)} for the whole head at this step. The tiles hold a "
            "fixed size whatever t is; the n × t matrix grows with the square of the context.")


@fitted
def flash_figure(trace: Trace, step: int, run: FlashRun, tile: int) -> go.Figure:
    """After tile ``tile``: the query block's scores with the tiles read so far (the current one outlined, the
    rest not yet read) above; below, the running max m and sum ℓ of each row, and how far the output so far is
    from the model's O after each tile (rounding at the last)."""
    tile = max(0, min(tile, len(run.tiles) - 1))
    current = run.tiles[tile]
    read = run.scores.clone()
    read[:, current.keys[1]:] = math.nan  # not read yet
    keys = key_labels(trace, step, run.batch)
    rows = query_labels(trace, step, run.batch)[run.rows[0]:run.rows[1]]
    first = run.scores.shape[1] - run.n + run.rows[0]  # first query position: the step's rows are the last n
    fig = subplots(rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]], row_heights=[0.6, 0.4],
                   vertical_spacing=0.28, horizontal_spacing=0.12,
                   subplot_titles=[(f"S of the query at position {first}" if len(rows) == 1 else
                                    f"S of the queries at positions {first}…{first + len(rows) - 1}")
                                   + f": tiles 0…{tile} read, tile "
                                   f"{tile} (keys {current.keys[0]}…{current.keys[1] - 1}) outlined",
                                   "running max m and sum ℓ of each row", "max |O so far − O(model)| per tile"])
    shown = torch.where(torch.isinf(read), torch.full_like(read, math.nan), read)
    g = grid(shown, keys, rows)
    add(fig, g, "signed", row=1, col=1, colorbar="S")
    fig.data[-1].update(colorbar={"y": 0.8, "len": 0.45, "thickness": 10})  # beside its own panel
    style_axes(fig, g, row=1, col=1, max_ticks=16, x_title="key (t)", y_title="query row")
    scale_x = len(g.x) / max(1, run.scores.shape[1])  # the grid may pool columns: outline in its cells
    fig.add_shape(type="rect", x0=current.keys[0] * scale_x - 0.5, x1=current.keys[1] * scale_x - 0.5,
                  y0=-0.5, y1=len(g.y) - 0.5, line={"color": ACCENT, "width": 2}, row=1, col=1)
    labels = list(range(first, first + len(rows)))
    fig.add_trace(go.Scatter(x=labels, y=[v if math.isfinite(v) else None for v in current.m.tolist()],
                             mode="lines+markers", name="m (running max)", line={"color": ACCENT}), row=2, col=1)
    fig.add_trace(go.Scatter(x=labels, y=current.l.tolist(), mode="lines+markers", name="ℓ (running sum)",
                             line={"color": NEUTRAL}), row=2, col=1)
    reference = run.reference.double()
    gaps = [float((t.output - reference).abs().max()) for t in run.tiles]
    fig.add_trace(go.Scatter(x=list(range(len(gaps))), y=[max(x, 1e-18) for x in gaps], mode="lines+markers",
                             name="max |O so far − O|", line={"color": NEUTRAL, "dash": "dot"}), row=2, col=2)
    fig.add_trace(go.Scatter(x=[tile], y=[max(gaps[tile], 1e-18)], mode="markers", marker={"color": ACCENT, "size": 11},
                             showlegend=False, hoverinfo="skip"), row=2, col=2)
    fig.update_xaxes(title_text="query position", dtick=1 if len(rows) <= 16 else None, row=2, col=1)
    fig.update_xaxes(title_text="tile", dtick=1, row=2, col=2)
    fig.update_yaxes(type="log", exponentformat="power", row=2, col=2)
    fig.update_layout(height=max(520, min(820, 380 + 16 * len(g.y))),
                      legend={"orientation": "h", "y": -0.12, "yanchor": "top"},
                      margin={"t": 40, "l": 10, "r": 10, "b": 10}, title_font_size=13)
    return fig
