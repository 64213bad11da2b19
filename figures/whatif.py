"""What-if views: an intervention's effect on the next token and on later heads, activation patching, direct
logit attribution, the logit lens, and the difference of two runs."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.common import inert, safe_text
from gpt_shape_tracer.figures.heatmap import add, grid, style_axes
from gpt_shape_tracer.figures.palette import ACCENT, AMOUNT, MASKED, NEUTRAL
from gpt_shape_tracer.figures.plot import figure, fitted

LENS_POSITIONS = 48  # the lens heatmap shows at most this many (the last) positions, each cell labelled


def next_token_change(original: torch.Tensor, changed: torch.Tensor, label, top: int = 12) -> pd.DataFrame:
    """The tokens most probable before or after, with both probabilities (one sequence's logits ``[V]``)."""
    p0, p1 = torch.softmax(original.float(), -1), torch.softmax(changed.float(), -1)
    ids = sorted(set(p0.topk(top).indices.tolist()) | set(p1.topk(top).indices.tolist()), key=lambda i: -float(p0[i]))
    return pd.DataFrame([{"token": label(i), "id": i, "before": float(p0[i]), "after": float(p1[i]),
                          "change": float(p1[i] - p0[i])} for i in ids])


@fitted
def next_token_change_figure(frame: pd.DataFrame, title: str) -> go.Figure:
    xs = [f"{safe_text(t)} ({i})" for t, i in zip(frame["token"], frame["id"])]
    fig = figure([go.Bar(x=xs, y=frame["before"], name="as the model ran", marker_color=NEUTRAL),
                  go.Bar(x=xs, y=frame["after"], name="with the intervention", marker_color=ACCENT)])
    fig.update_layout(barmode="group", height=340, title_text=title, title_font_size=13, yaxis_title_text="probability",
                      xaxis_tickangle=-45, legend={"orientation": "h", "y": 1.1},
                      margin={"t": 60, "l": 10, "r": 10, "b": 10})
    return fig


@fitted
def pattern_change_figure(changes: list[tuple[int, int, float]], n_layer: int, n_head: int) -> go.Figure:
    """Layers × heads: the largest change in any attention weight of that head."""
    m = torch.zeros(n_layer, n_head)
    for layer, head, delta in changes:
        m[layer, head] = delta
    g = grid(m, [f"H{h}" for h in range(n_head)], [f"L{layer}" for layer in range(n_layer)])
    fig = figure()
    add(fig, g, "amount", colorbar="max |Δ A|")
    style_axes(fig, g, x_title="head", y_title="layer")
    fig.update_layout(height=max(220, 80 + 40 * n_layer), title_font_size=13,
                      title_text="how much each head's attention pattern moved (max |Δ weight|)",
                      margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


@fitted
def patching_figure(restored: torch.Tensor, columns: list[str], kind: str) -> go.Figure:
    """Layers × positions (or heads): the share of the clean answer's logit difference that patching the clean
    activation there restores (1 = all of it, 0 = none, below 0 = the wrong way)."""
    n_layer = restored.shape[0]
    g = grid(restored, columns, [f"L{layer}" for layer in range(n_layer)])
    top = max(1.0, float(restored.abs().max()))
    fig = figure()
    add(fig, g, "signed", zmin=-top, zmax=top, colorbar="restored")
    style_axes(fig, g, x_title="position" if kind == "resid_pre" else "head", y_title="layer", max_ticks=48)
    what = "the residual stream entering each layer, one position at a time" if kind == "resid_pre" else \
        "each head's output O_h, at every position"
    fig.update_layout(height=max(240, 90 + 45 * n_layer), margin={"t": 50, "l": 10, "r": 10, "b": 10},
                      title_text=f"patching {what}: share of the logit difference restored", title_font_size=13)
    return fig


@fitted
def attribution_figure(frame: pd.DataFrame, token_label: str, top: int = 16) -> go.Figure:
    """The ``top`` components that add most to (or take most from) one logit, largest magnitude first, and one
    last bar for all the others together (how many, and their sum), so the bars drawn add up to the title's
    total whatever is hidden."""
    ranked = frame.reindex(frame["contribution"].abs().sort_values(ascending=False).index)
    shown, rest = ranked.head(top), ranked.iloc[top:]
    names, values = list(shown["component"]), [float(v) for v in shown["contribution"]]
    colours = [ACCENT if v > 0 else "#4c78a8" for v in values]
    if len(rest):
        names.append(f"the other {len(rest)} components, together")
        values.append(float(rest["contribution"].sum()))
        colours.append(NEUTRAL)
    fig = figure(go.Bar(x=values, y=names, orientation="h", marker_color=colours,
                        hovertemplate="%{y}: %{x:+.3f}<extra></extra>"))
    attrs = frame.attrs
    fig.update_yaxes(autorange="reversed")
    counted = (f"the {len(shown)} largest of {len(frame)} components and the other {len(rest)} together"
               if len(rest) else f"all {len(frame)} components")
    # the title in two short lines: one long line was cut off at the page's width (issue 41)
    fig.update_layout(height=max(280, 60 + 22 * len(names)), margin={"t": 70, "l": 10, "r": 10, "b": 10},
                      xaxis_title_text="share of the logit", title_font_size=13,
                      title_text=(f"direct logit attribution for {safe_text(token_label)!s}: {counted}<br>"
                                  f"the shares add up to {attrs['total']:.3f} (logit {attrs['logit']:.3f}, the norm's "
                                  f"constant {attrs['norm_constant']:+.3f} included)"))
    return fig


def attribution_takeaway(frame: pd.DataFrame, token_label: str) -> tuple[str, list[tuple[str, str]]]:
    """The attribution's takeaway: which component adds most to the chosen logit, and its share, from the frame."""
    attrs = frame.attrs
    top = frame.loc[frame["contribution"].idxmax()]
    against = frame.loc[frame["contribution"].idxmin()]
    share = float(top["contribution"]) / attrs["logit"] if attrs["logit"] else math.nan
    part = f" ({share:.0%})" if math.isfinite(share) and attrs["logit"] > 0 else ""
    sentence = (f"{top['component']} adds the most to the logit of {inert(token_label)}: "
                f"{float(top['contribution']):+.3f} of {attrs['logit']:.3f}{part}"
                + (f"; {against['component']} takes the most away ({float(against['contribution']):+.3f})."
                   if float(against["contribution"]) < 0 else "."))
    return sentence, [("logit z", f"{attrs['logit']:.3f}"), (f"largest: {top['component']}",
                                                              f"{float(top['contribution']):+.3f}"),
                      ("components", str(len(frame)))]


def lens_takeaway(frame: pd.DataFrame) -> tuple[str, list[tuple[str, str]]]:
    """The lens's takeaway at the last real position (where the step's token was chosen, for a sequence that is
    not right-padded at the prefill): the first layer from which the finally chosen token stays the top one."""
    real = frame[frame["is_token"]] if "is_token" in frame else frame
    position = int(real["position"].max())
    at = frame[frame["position"] == position].sort_values("layer")
    label = inert(str(at["final_label"].iloc[-1]))  # for markdown
    tops = list(at["top_token"] == at["final_token"])
    first = next((i for i in range(len(tops)) if all(tops[i:])), None)
    p0, p_last = float(at["final_prob"].iloc[0]), float(at["final_prob"].iloc[-1])
    if first is None:
        sentence = (f"At column {position}, the token finally chosen, {label}, is the top token of no layer (it was "
                    f"sampled): p = {p0:.3f} after block 0, {p_last:.3f} after the last.")
    else:
        sentence = (f"At column {position}, the token finally chosen, {label}, is each layer's top token from block "
                    f"{first} on: p = {p0:.3f} after block 0, {p_last:.3f} after the last.")
    return sentence, [("column", str(position)), ("p after block 0", f"{p0:.3f}"),
                      ("top from block", "—" if first is None else str(first))]


@fitted
def lens_figure(frame: pd.DataFrame, n_layer: int) -> tuple[go.Figure, str]:
    """Layers × positions: the probability each layer's residual stream, read by the final norm and W_U, gives
    the token the model finally chose there; each cell names that layer's own top token."""
    positions = sorted(frame["position"].unique())
    shown = positions[-LENS_POSITIONS:]
    sub = frame[frame["position"].isin(shown)]
    z = sub.pivot(index="layer", columns="position", values="final_prob").reindex(range(n_layer))
    top = sub.pivot(index="layer", columns="position", values="top_label").reindex(range(n_layer))
    inputs = sub[sub["layer"] == 0].set_index("position")["input"].reindex(shown)
    xs = [safe_text(f"{p} · {inputs[p]}") for p in shown]
    ys = [f"after L{layer}" for layer in range(n_layer)]
    padding = [p for p in shown if "is_token" in sub and not bool(sub[sub["position"] == p]["is_token"].iloc[0])]
    if padding:  # a padding position predicts nothing anyone reads: greyed, not coloured
        z.loc[:, padding] = float("nan")
        top.loc[:, padding] = ""
    text = [[safe_text(str(v)) for v in row] for row in top.values.tolist()]
    fig = figure()
    if padding:
        fig.add_trace(go.Heatmap(z=[[1 if p in padding else None for p in shown] for _ in ys], x=xs, y=ys,
                                 colorscale=[[0, MASKED], [1, MASKED]], showscale=False, hoverinfo="skip"))
    fig.add_trace(go.Heatmap(z=z.values.tolist(), x=xs, y=ys, zmin=0, zmax=1, colorscale=AMOUNT, text=text,
                            texttemplate="%{text}", textfont={"size": 10},
                            colorbar={"title": {"text": "p(final)", "side": "top"}, "thickness": 10},
                            hovertemplate="%{y}, position %{x}<br>top token: %{text}<br>p(final token) = "
                                          "%{z:.3f}<extra></extra>"))
    fig.update_xaxes(type="category", tickangle=-60, title_text="position · input token")
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_layout(height=max(260, 90 + 48 * n_layer), margin={"t": 40, "l": 10, "r": 10, "b": 10},
                      title_text="logit lens: each layer's residual stream, through the final norm and W_U"
                                 + ("<br>padding positions grey" if padding else ""),
                      title_font_size=13)
    note = f"the last {len(shown)} of {len(positions)} positions" if len(shown) < len(positions) else ""
    return fig, note


def divergence_sentence(row) -> str:
    """The first divergence of a ``diff_traces`` frame, as one sentence (its note only when it has one)."""
    delta = row["max_abs_delta"]
    measured = (f"max |Δ| {delta:.3g}, tolerance {row['tolerance']:.1e}" if delta == delta else "")  # NaN: no distance
    note = inert(row["note"]) if row["note"] else ""
    detail = "; ".join(part for part in (measured, note) if part)
    return (f"The runs first diverge at step {row['step']} in **{inert(row['name'])}**"
            + (f" ({detail})." if detail else "."))


@fitted
def difference_figure(a: torch.Tensor, b: torch.Tensor, title: str, first_row: int = 0) -> go.Figure:
    """b − a of one record's 2-D slice, centred on 0; rows numbered from ``first_row`` (the position of the
    first row when only the last positions are compared)."""
    delta = (b.double() - a.double())
    g = grid(delta, [str(j) for j in range(delta.shape[1])], [str(first_row + i) for i in range(delta.shape[0])])
    fig = figure()
    add(fig, g, "signed", colorbar="b − a")
    style_axes(fig, g, x_title="column", y_title="row", max_ticks=16)
    fig.update_layout(title_text=title + (f" — {g.caption()}" if g.pooled else ""), title_font_size=13,
                      height=max(260, min(800, 110 + 14 * len(g.y))), margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig
