"""Backpropagation through attention, drawn: one head's six gradients as heatmaps, each titled with its formula,
its live shape and how far the formula is from autograd; and ‖∂L/∂x‖ per layer. Pure functions: a
``tracer.HeadGradients`` in, figures out."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from gpt_shape_tracer.figures.heatmap import add, grid, style_axes
from gpt_shape_tracer.figures.palette import ACCENT, NEUTRAL
from gpt_shape_tracer.figures.plot import figure, fitted, subplots
from gpt_shape_tracer.tracer import HeadGradients

FORMULAS = {"G_O": "G_O = ∂L/∂O", "G_V": "G_V = Pᵀ·G_O", "G_P": "G_P = G_O·Vᵀ",
            "G_S": "G_S,r = (diag(P_r) − P_r P_rᵀ)·G_P,r", "G_Q": "G_Q = s·G_S·K", "G_K": "G_K = s·G_Sᵀ·Q"}
AXES = {"G_O": ("d_head", "query"), "G_V": ("d_head", "key"), "G_P": ("key", "query"), "G_S": ("key", "query"),
        "G_Q": ("d_head", "query"), "G_K": ("d_head", "key")}


SOFTCAP_FORMULAS = {"G_Q": "G_Q = s·(G_S ⊙ cap′)·K", "G_K": "G_K = s·(G_S ⊙ cap′)ᵀ·Q"}  # cap′ = 1 − tanh²(s·QKᵀ/c)


def formula_of(result: HeadGradients, name: str) -> str:
    return (SOFTCAP_FORMULAS.get(name) if result.softcap else None) or FORMULAS[name]


def panel_title(result: HeadGradients, name: str) -> str:
    """A panel's title: its formula, live shape, and how far it is from autograd — or, for G_O, that it is
    autograd's own (the formulas start from it)."""
    shape = list(result.formula[name].shape)
    if name in result.GIVEN:
        return f"{formula_of(result, name)} {shape} · autograd's own"
    return f"{formula_of(result, name)} {shape} · |Δ| ≤ {result.max_abs_delta(name):.0e}"


@fitted
def gradients_figure(result: HeadGradients, keys: list[str]) -> go.Figure:
    """The six gradients of one head (3 × 2), by formula, each title with the shape and max |formula − autograd|,
    each with its own colour bar (their scales differ by orders of magnitude)."""
    names = list(FORMULAS)
    titles = [panel_title(result, n) for n in names]
    fig = subplots(rows=3, cols=2, subplot_titles=titles, horizontal_spacing=0.2, vertical_spacing=0.12)
    for i, name in enumerate(names):
        row, col = i // 2 + 1, i % 2 + 1
        matrix = result.formula[name]
        x_kind, y_kind = AXES[name]
        xs = keys[: matrix.shape[1]] if x_kind == "key" else [f"d{j}" for j in range(matrix.shape[1])]
        ys = keys[-matrix.shape[0]:] if y_kind == "query" else keys[: matrix.shape[0]]
        g = grid(matrix, xs, ys)
        cell = fig.get_subplot(row, col)
        x_end, (y_low, y_high) = cell.xaxis.domain[1], cell.yaxis.domain  # the bar right beside its own panel
        add(fig, g, "signed", row=row, col=col, colorbar=name,
            bar={"x": x_end + 0.01, "y": (y_low + y_high) / 2, "len": y_high - y_low, "yanchor": "middle",
                 "thickness": 8, "tickfont": {"size": 9}, "exponentformat": "power"})
        style_axes(fig, g, row=row, col=col, max_ticks=8, x_title=x_kind, y_title=y_kind)
    fig.update_layout(height=960, margin={"t": 40, "l": 10, "r": 40, "b": 10}, title_font_size=12)
    fig.update_annotations(font_size=11)
    return fig


@fitted
def gradient_norms_figure(result: HeadGradients) -> go.Figure:
    """‖∂L/∂x‖ per layer for the residual stream entering each block and the attention and MLP outputs, on a
    log axis: a gradient that vanishes or explodes with depth shows as a line falling or rising by decades."""
    colours = {"resid_pre": ACCENT, "attn_out": NEUTRAL, "mlp_out": "#4c78a8"}
    labels = {"resid_pre": "residual stream entering block L", "attn_out": "attention output of block L",
              "mlp_out": "MLP output of block L"}
    fig = figure([go.Scatter(x=list(range(len(values))), y=[v if math.isfinite(v) and v > 0 else None for v in values],
                             mode="lines+markers", name=labels[kind], line={"color": colours[kind]})
                  for kind, values in result.norms.items()])
    fig.update_yaxes(type="log", exponentformat="power", title_text="‖∂L/∂x‖")
    fig.update_xaxes(title_text="layer L", dtick=1)
    fig.update_layout(height=320, legend={"orientation": "h", "y": 1.15}, title_font_size=13,
                      margin={"t": 60, "l": 10, "r": 10, "b": 10})
    return fig


def scope_sentence(facts, step: int, prompt: int = 0) -> str:
    """Which positions the gradients cover at ``step``: the backward pass runs a fresh forward of every position
    the step saw, without the cache, so a cached decode step's one query row is the last of t rows here. ``prompt``:
    the learned positions the model runs before the text (CPM-Ant), which every forward computes too."""
    forward = facts.step(step).forward
    t = facts.width(step)
    if prompt and forward.n == t:
        return (f"Step {step} computed the model's {prompt} learned prompt positions and all its {t} token positions "
                f"itself, and so does the backward pass here: the heatmaps show its {prompt + t} query rows.")
    if forward.n == t:
        return (f"Step {step} computed all its {t} positions itself, and so does the backward pass here: the heatmaps "
                f"show its {t} query rows.")
    return (f"Step {step} was a cached decode step: it computed {forward.n} query row(s) over {forward.t} keys. "
            f"Gradients need every position's graph, so the backward pass runs a fresh forward of all {t} positions "
            f"without the cache: the heatmaps show {t} query rows, the last being this step's.")


def agreement(result: HeadGradients, tolerance: float = 1e-5) -> tuple[str, str]:
    """(level, text): whether the gradients computed from their formulas equal autograd's, saying which are
    computed (G_O is autograd's own: the formulas start from it)."""
    computed = result.computed
    worst_name = max(computed, key=result.max_abs_delta)
    worst = result.max_abs_delta(worst_name)
    names = ", ".join(computed)
    cap = (f" (with the soft-cap's factor 1 − tanh²(s·QKᵀ/{result.softcap:g}) between QKᵀ and the capped scores, in "
           "G_Q and G_K)" if result.softcap else "")
    start = f"L = {result.loss:.4f} ({result.loss_words()}). Starting from autograd's G_O = ∂L/∂O, "
    if worst <= tolerance:
        return "success", (start + f"the {len(computed)} gradients computed from their formulas ({names}){cap} equal "
                           f"autograd's within {worst:.1e}.")
    return "error", (start + f"{worst_name} computed from its formula{cap} differs from autograd's by {worst:.2e}: see "
                     "the titles.")


def norms_sentence(result: HeadGradients) -> str:
    """What ‖∂L/∂x‖ of the residual stream does from block to block on this model, and whether that is a
    vanishing or exploding gradient: a steady fall (or rise) by a decade or more per block toward the input,
    which takes at least two block-to-block changes to call."""
    norms = result.norms.get("resid_pre", [])
    finite = [v for v in norms if math.isfinite(v) and v > 0]
    if len(finite) != len(norms) or len(norms) < 2:
        return "‖∂L/∂x‖ of the residual stream is not finite and positive at every block: no trend to read."
    factors = [norms[i] / norms[i + 1] for i in range(len(norms) - 1)]  # toward the input: block i against i + 1
    listed = ", ".join(f"block {i + 1} → {i}: ×{f:.3g}" for i, f in enumerate(factors))
    head = (f"‖∂L/∂x‖ of the residual stream entering each block, from the last block back to the first: "
            f"{norms[-1]:.3g} → {norms[0]:.3g} ({listed}). ")
    rule = ("A vanishing (exploding) gradient falls (rises) by a steady factor block after block toward the input, "
            "decades over a deep model")
    if len(factors) < 2:
        return head + rule + f"; with {len(norms)} blocks there is one change, not a trend to call either."
    if all(f <= 0.1 for f in factors):
        return head + rule + ": here it falls by a decade or more at every block — vanishing toward the input."
    if all(f >= 10 for f in factors):
        return head + rule + ": here it rises by a decade or more at every block — exploding toward the input."
    return head + rule + ": these changes are not a steady decade per block, so this head's model shows neither."


def row_table(result: HeadGradients, row: int, keys: list[str]) -> pd.DataFrame:
    """Follow one query row r from G_O to G_S, key by key: G_P,rj = G_O,r·v_j, then the softmax's Jacobian,
    G_S,rj = P_rj·(G_P,rj − Σ_k P_rk·G_P,rk), beside autograd's G_S,rj."""
    p, v = result.values["P"], result.values["V"]  # [t, t], [t, d_head]
    t = p.shape[0]
    if not 0 <= row < t:
        raise ValueError(f"row {row} is not one of the {t} query rows")
    g_o = result.formula["G_O"][row]  # [d_head]
    g_p = v @ g_o  # [t]: G_P,rj = G_O,r·v_j
    mean = float((p[row] * g_p).sum())  # Σ_k P_rk·G_P,rk
    g_s = p[row] * (g_p - mean)
    return pd.DataFrame({"key": keys[:t], "P_rj": p[row].tolist(), "G_P,rj = G_O,r·v_j": g_p.tolist(),
                         "G_P,rj − Σ P·G_P": (g_p - mean).tolist(), "G_S,rj = P_rj·(G_P,rj − Σ P·G_P)": g_s.tolist(),
                         "G_S,rj (autograd)": result.autograd["G_S"][row].tolist()})


def row_sentence(result: HeadGradients, row: int, keys: list[str]) -> str:
    """One query row's walk from G_O to G_S, with its numbers."""
    table = row_table(result, row, keys)
    label = keys[row] if row < len(keys) else row
    if not bool(result.formula["G_O"][row].any()):
        return (f"Row {label}: G_O,r = 0 — this position's output does not reach L (the last position has no next "
                "token; −log p(chosen) reads only the chosen position), so G_P,r and G_S,r are zero too.")
    p, v = result.values["P"], result.values["V"]
    g_p = v @ result.formula["G_O"][row]
    mean = float((p[row] * g_p).sum())
    visible = table["P_rj"] > 0
    top = table.loc[table["G_S,rj = P_rj·(G_P,rj − Σ P·G_P)"].abs().idxmax()]
    delta = float((table["G_S,rj = P_rj·(G_P,rj − Σ P·G_P)"] - table["G_S,rj (autograd)"]).abs().max())
    return (f"Row {label}: ‖G_O,r‖ = {float(result.formula['G_O'][row].norm()):.3g}. "
            f"G_P,r = G_O,r·Vᵀ gives one number per key ({int(visible.sum())} keys with weight > 0). The softmax's "
            f"Jacobian subtracts their P-weighted mean Σ_k P_rk·G_P,rk = {mean:.3g} and multiplies by P_r: keys "
            f"with no weight get no gradient, and the row of G_S sums to {float(table.iloc[:, 4].sum()):.1e} (zero: "
            f"shifting every score of a row changes no weight). The largest |G_S,rj| is at key {top['key']} "
            f"(P = {top['P_rj']:.3g}); autograd's row agrees within {delta:.1e}.")


def default_row(result: HeadGradients) -> int:
    """The last query row whose G_O is not zero (the last position has none under the next-token loss)."""
    nonzero = result.formula["G_O"].abs().sum(dim=-1) > 0
    rows = nonzero.nonzero()
    return int(rows.max()) if rows.numel() else nonzero.shape[0] - 1
