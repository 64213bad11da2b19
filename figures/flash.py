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

import pandas as pd
import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.attention import score_bias, score_bias_name
from gpt_shape_tracer.figures.common import (
    attention_layers,
    key_labels,
    kv_head,
    position_is_token,
    query_labels,
    score_scale,
)
from gpt_shape_tracer.figures.heatmap import grid, heatmap, style_axes
from gpt_shape_tracer.figures.palette import ACCENT, MASKED, NEUTRAL
from gpt_shape_tracer.figures.pitfalls import sink_logits
from gpt_shape_tracer.figures.plot import fitted, subplots
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import Trace

UNREAD = "#fdf1e3"  # a key tile not read yet: pale, apart from the masked grey
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
    skipped: bool = False  # every cell of the tile is masked for every row: FlashAttention-2 never reads it


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
        """What the tiled method holds for these rows besides their output (which both paths hold): one tile of
        S (as wide as the keys, when there are fewer than a tile) and the running max m and sum ℓ of each row."""
        rows, t = self.rows[1] - self.rows[0], self.scores.shape[1]
        return tiled_numbers(rows, t, self.block) * self.itemsize

    @property
    def full_bytes(self) -> int:
        """What the staged path holds for these rows besides their output: their scores against every key."""
        return self.scores.numel() * self.itemsize

    @property
    def output_bytes(self) -> int:
        """The output rows (rows × d_v), held by both paths alike."""
        return self.reference.numel() * self.itemsize

    def visible_until(self) -> torch.Tensor:
        """[rows] one past the last key column each row may see (0 for a row that sees none)."""
        finite = torch.isfinite(self.scores)  # [rows, t]
        columns = torch.arange(1, finite.shape[1] + 1)
        return (finite * columns).max(dim=-1).values


def tiled_numbers(rows: int, t: int, block: int) -> int:
    """Numbers the tiled method holds for ``rows`` query rows besides their output: one tile of S, m and ℓ."""
    return rows * min(block, t) + 2 * rows


def tiles_win_from(rows: int, block: int) -> int:
    """The smallest key count t at which the tiles hold fewer numbers than the rows × t scores (counted, not
    solved: the first t where tiled_numbers(rows, t, block) < rows·t)."""
    t = 1
    while tiled_numbers(rows, t, block) >= rows * t:
        t += 1
    return t


def flash_attention(trace: Trace, step: int, layer: int, head: int, batch: int = 0, block: int = 16,
                    query_block: int = 0) -> FlashRun | None:
    """Query block ``query_block`` (rows block·i … block·(i+1) − 1 of this step's n) of one head, computed tile by
    tile over its keys; None when the step kept no Q, K, V, M or O values to recompute from."""
    if block < 1:
        raise ValueError(f"the block size must be at least 1, got {block}")
    config = trace.config
    for what, value, count in (("step", step, trace.n_steps),
                               ("layer", layer, config.n_layer if config is not None else 1 << 62),
                               ("head", head, config.n_head if config is not None else 1 << 62)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
            raise ValueError(f"{what} {value!r} is outside 0 … {count - 1}")
    rope = trace.has(act_name("rot_q", layer), step)
    names = {"q": "rot_q" if rope else "q", "k": "k_all", "v": "v_all", "mask": "mask", "z": "z"}
    values = {key: trace.get(act_name(kind, layer), step) for key, kind in names.items()}
    if any(v is None for v in values.values()):
        return None
    q, k, v, mask, z = (values[key] for key in ("q", "k", "v", "mask", "z"))
    assert q is not None and k is not None and v is not None and mask is not None and z is not None
    if isinstance(batch, bool) or not isinstance(batch, int) or not 0 <= batch < q.shape[0]:
        raise ValueError(f"batch {batch!r} is outside 0 … {q.shape[0] - 1}")
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
    if trace.has(score_bias_name(layer), step):  # Inkling: its learned bias, beside the mask
        bias = score_bias(trace, step, layer, head, batch)
        if bias is None:
            return None
        scores = scores + bias[rows[0]:rows[1]]
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
    tiles: list[Tile] = []
    for index, start in enumerate(range(0, t, block)):
        end = min(t, start + block)
        s = scores[:, start:end]  # one tile of S: the only scores held
        if not bool(torch.isfinite(s).any()):  # every cell masked for every row: FlashAttention-2 skips the tile
            tiles.append(Tile(index, (start, end), m.clone(), l.clone(), tiles[-1].output if tiles else
                              torch.zeros_like(acc), 0, skipped=True))
            continue
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


def size_text(b: int) -> str:
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB" if b >= 2**10 else f"{b} B"


def memory_sentence(run: FlashRun) -> str:
    """What the tiled method holds at once against what the staged path holds, like for like (both hold the
    output rows, so neither side counts them), with this run's numbers and the key count where tiles win."""
    rows = run.rows[1] - run.rows[0]
    t = run.scores.shape[1]
    d_v = run.reference.shape[-1]
    width = min(run.block, t)
    which = "this query row" if rows == 1 else f"these {rows} query rows"
    win = tiles_win_from(rows, run.block)
    here = ("fewer here" if run.tile_bytes < run.full_bytes else
            "as many here" if run.tile_bytes == run.full_bytes else "more here")
    text = (f"Besides the output of {which} ({rows} × {d_v}, {size_text(run.output_bytes)}), which both paths hold, "
            f"the tiles hold one tile of S ({rows} × {width}) and m and ℓ ({rows} each): "
            f"{size_text(run.tile_bytes)} in {run.itemsize}-byte numbers, against the {rows} × {t} scores the staged "
            f"path holds ({size_text(run.full_bytes)}) — {here} (t = {t}); with tiles of {run.block} keys the tiles "
            f"hold fewer from t = {win} on, and stay that size however long the context grows.")
    whole = size_text(run.n * t * run.itemsize)
    if run.n == 1:
        return text + (f" At this decode step the whole head's scores are one row of t = {t} ({whole}): they grow "
                       "linearly with the context; a prefill of n positions holds n × n, the square.")
    return text + (f" The whole head's scores at this step are n × t = {run.n} × {t} ({whole}): over a prefill of n "
                   "positions they grow with the square of n.")


def tile_sentence(run: FlashRun, tile: int) -> str:
    """What tile ``tile`` did to the query block's rows, counted: rescaled rows, a skipped tile, and which rows
    still have unmasked keys in later tiles (a row whose later keys are all masked is already final)."""
    tile = max(0, min(tile, len(run.tiles) - 1))
    current = run.tiles[tile]
    rows = run.rows[1] - run.rows[0]
    end = current.keys[1]
    span = f"keys {current.keys[0]}…{end - 1}"
    if current.skipped:
        what = (f"Tile {tile} ({span}) is skipped: every cell of it is masked for these rows, so FlashAttention-2 "
                "never reads it and m, ℓ and the output stay as they were.")
    elif current.rescaled:
        what = (f"After tile {tile} ({span}): {current.rescaled} of the {rows} row(s) found a larger max in it, and "
                "their sums so far were multiplied by exp(m_old − m_new).")
    else:
        before = run.tiles[tile - 1].m if tile else torch.full_like(current.m, -math.inf)
        started = int((~torch.isfinite(before) & torch.isfinite(current.m)).sum())
        what = (f"After tile {tile} ({span}): no row's max rose in it, so nothing was rescaled"
                + (f" ({started} row(s) saw their first unmasked keys here: nothing summed before to rescale)."
                   if started else "."))
    until = run.visible_until()
    pending = until > end  # rows with an unmasked key after this tile
    gap = float((current.output - run.reference.double()).abs().max())
    if not bool(pending.any()):
        why = "" if tile == len(run.tiles) - 1 else f": every key after {end - 1} is masked for these rows"
        agree = "the model's own output to rounding" if gap <= 1e-5 else "NOT the model's output"
        return what + f" Every row's output is final{why} — max |O(tiles) − O(model)| = {gap:.2e}, {agree}."
    later = [t for t in run.tiles[tile + 1:] if not t.skipped
             and bool(torch.isfinite(run.scores[pending, t.keys[0]:t.keys[1]]).any())]
    final = rows - int(pending.sum())
    return what + (f" {int(pending.sum())} of the {rows} row(s) still have unmasked keys in {len(later)} later "
                   f"tile(s): their output so far covers keys 0…{end - 1} only"
                   + (f"; the other {final} are final (their later keys are all masked)." if final else "."))


def default_query_block(trace: Trace, step: int, batch: int, block: int) -> int:
    """The query block holding the last real (non-padding) row of sequence ``batch`` at ``step``: a
    right-padded sequence's last rows are padding, which nobody reads."""
    facts = trace.generation
    n = trace.record(act_name("q", attention_layers(trace)[0]), step).shape[2]
    if facts is None:
        return (n - 1) // block
    real = position_is_token(trace, batch, step)[-n:]
    last = max((i for i, r in enumerate(real) if r), default=n - 1)
    return last // block


def row_table(run: FlashRun, row: int) -> pd.DataFrame:
    """One query row tile by tile: its max before and after (m_old, m_new), the factor exp(m_old − m_new) its
    sum and output so far are multiplied by, ℓ before and after, and how much the output moved (max |Δ|)."""
    if not 0 <= row < run.rows[1] - run.rows[0]:
        raise ValueError(f"row {row} is not in this query block of {run.rows[1] - run.rows[0]} rows")
    records = []
    m_old, l_old = -math.inf, 0.0
    out_old = torch.zeros_like(run.tiles[0].output[row])
    for tile in run.tiles:
        m_new, l_new, out_new = float(tile.m[row]), float(tile.l[row]), tile.output[row]
        factor = math.exp(m_old - m_new) if math.isfinite(m_old) and math.isfinite(m_new) else math.nan
        records.append({"tile": tile.index, "keys": f"{tile.keys[0]}…{tile.keys[1] - 1}",
                        "read": "skipped (all masked)" if tile.skipped else "read",
                        "m_old": m_old, "m_new": m_new, "exp(m_old − m_new)": factor,
                        "ℓ before": l_old, "Σ exp(s − m_new) of the tile": l_new - (0.0 if math.isnan(factor) else
                                                                                   factor * l_old),
                        "ℓ after": l_new,
                        "max |Δ output|": float((out_new - out_old).abs().max())})
        m_old, l_old, out_old = m_new, l_new, out_new
    return pd.DataFrame(records)


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
    first = run.scores.shape[1] - run.n + run.rows[0]  # first query column: the step's rows are the last n
    fig = subplots(rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]], row_heights=[0.6, 0.4],
                   vertical_spacing=0.28, horizontal_spacing=0.12,
                   subplot_titles=[(f"S of the query in column {first}" if len(rows) == 1 else
                                    f"S of the queries in columns {first}…{first + len(rows) - 1}")
                                   + f": tiles 0…{tile} read, tile "
                                   f"{tile} (keys {current.keys[0]}…{current.keys[1] - 1}) outlined; grey masked, "
                                   "pale not read yet",
                                   "running max m and sum ℓ of each row", "max |O so far − O(model)| per tile"])
    masked = torch.isinf(run.scores)  # −∞: M forbids the cell (causal, padding, window)
    shown = torch.where(masked, torch.full_like(read, math.nan), read)
    g = grid(shown, keys, rows)
    ones = torch.ones_like(run.scores)
    unread = torch.zeros_like(masked)
    unread[:, current.keys[1]:] = True
    layers = (("masked", masked, MASKED), ("not read yet", unread & ~masked, UNREAD))
    for name, where, colour in layers:  # drawn apart: a masked cell is never read; an unread one is still to come
        cells = grid(torch.where(where, ones, torch.full_like(ones, math.nan)), keys, rows)
        if bool(torch.isfinite(torch.as_tensor(cells.z)).any()):
            fig.add_trace(go.Heatmap(z=cells.z, x=cells.x, y=cells.y, colorscale=[[0, colour], [1, colour]],
                                     showscale=False, name=name, hovertemplate=f"{name}<extra></extra>"),
                          row=1, col=1)
    fig.add_trace(heatmap(g, "signed", colorbar="S", bar={"y": 0.8, "len": 0.45}), row=1, col=1)  # beside its panel
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
    fig.update_xaxes(title_text="query column", dtick=1 if len(rows) <= 16 else None, row=2, col=1)
    fig.update_xaxes(title_text="tile", dtick=1, row=2, col=2)
    fig.update_yaxes(type="log", exponentformat="power", row=2, col=2)
    fig.update_layout(height=max(520, min(820, 380 + 16 * len(g.y))),
                      legend={"orientation": "h", "y": -0.12, "yanchor": "top"},
                      margin={"t": 40, "l": 10, "r": 10, "b": 10}, title_font_size=13)
    return fig


def flash_takeaway(run: FlashRun) -> tuple[str, list[tuple[str, str]]]:
    """The view's one-line takeaway and its key numbers, from this run: the tiles give the model's own output
    while holding a fixed tile instead of the rows × t scores."""
    read = sum(not t.skipped for t in run.tiles)
    skipped = len(run.tiles) - read
    rows = run.rows[1] - run.rows[0]
    same = run.max_abs_delta <= 1e-5
    sentence = (f"Tile by tile, with a running max and sum, these {rows} query row(s) get "
                + ("the model's own output" if same else "an output that differs from the model's")
                + f" (max |Δ| = {run.max_abs_delta:.1e}) without ever holding their {rows} × {run.scores.shape[1]} "
                "scores.")
    metrics = [("tiles read" + (" (skipped: all masked)" if skipped else ""),
                f"{read}" + (f" (+{skipped} skipped)" if skipped else "")),
               ("held besides the output: tiles", size_text(run.tile_bytes)),
               ("staged: the rows' scores", size_text(run.full_bytes))]
    return sentence, metrics


def padding_rows_note(trace: Trace, step: int, batch: int, run: FlashRun) -> str:
    """A note when the query block holds padding rows of sequence ``batch`` (nobody reads their output), else ""."""
    facts = trace.generation
    if facts is None:
        return ""
    real = position_is_token(trace, batch, step)[-run.n:][run.rows[0]:run.rows[1]]
    padding = sum(not r for r in real)
    if not padding:
        return ""
    first = run.scores.shape[1] - run.n + run.rows[0]
    where = [first + i for i, r in enumerate(real) if not r]
    return (f"{padding} of the {len(real)} rows of this block (column{'s' if padding > 1 else ''} "
            f"{', '.join(map(str, where[:8]))}{'…' if len(where) > 8 else ''}) are padding: the model computes "
            "them, and no one reads their output.")
