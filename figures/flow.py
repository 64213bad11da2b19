"""The architecture as a flow of live shapes: token ids → embeddings → one block → logits."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from figures.common import safe_text, shape_text
from model.hook_table import act_name
from tracer import Trace

GROUP_COLORS = {
    "input": "#dfe8f5",
    "attention": "#fde2c8",
    "cache": "#f9d0d0",
    "mlp": "#d7efd9",
    "residual": "#eeeeee",
    "output": "#e6dcf3",
}


@dataclass
class FlowNode:
    label: str  # what the seeds call this stage
    name: str  # the record it shows
    x: float
    y: float
    group: str
    shape: tuple[int, ...] | None = None
    symbolic: list[str] | None = None
    summary: str = ""


def _nodes(layer: int, n_layer: int) -> tuple[list[FlowNode], list[tuple[str, str]]]:
    def h(kind: str) -> str:
        return act_name(kind, layer) if "{L}" in _template(kind) else act_name(kind)

    nodes = [
        FlowNode("token ids", "model:in[0]", 1.0, 0, "input"),
        FlowNode("W_E[tokens]", h("embed"), 0.2, 1, "input"),
        FlowNode("W_pos[positions]", h("pos_embed"), 1.8, 1, "input"),
        FlowNode(f"x into block {layer}" + (f" (after {layer} block{'s' if layer > 1 else ''})" if layer else ""),
                 h("resid_pre"), 1.0, 2, "residual"),
        FlowNode("LN₁(x)", h("ln1"), 1.0, 3, "attention"),
        FlowNode("X·W_QKV", h("qkv"), 1.0, 4, "attention"),
        FlowNode("Q", h("q"), -0.2, 5, "attention"),
        FlowNode("K (new)", h("k"), 1.0, 5, "attention"),
        FlowNode("V (new)", h("v"), 2.2, 5, "attention"),
        FlowNode("K = cache ++ new", h("k_all"), 1.0, 6, "cache"),
        FlowNode("V = cache ++ new", h("v_all"), 2.2, 6, "cache"),
        FlowNode("QKᵀ", h("qk"), 0.4, 7, "attention"),
        FlowNode("÷ √d_k", h("attn_scores"), 0.4, 8, "attention"),
        FlowNode("M (mask)", h("mask"), -0.8, 9, "attention"),
        FlowNode("+ M", h("masked_scores"), 0.4, 9, "attention"),
        FlowNode("A = softmax", h("pattern"), 0.4, 10, "attention"),
        FlowNode("O = A·V", h("z"), 1.4, 11, "attention"),
        FlowNode("merge heads", h("merged"), 1.4, 12, "attention"),
        FlowNode("·W_O", h("attn_out"), 1.4, 13, "attention"),
        FlowNode("x + attention", h("resid_mid"), 4.4, 0, "residual"),
        FlowNode("LN₂(x)", h("ln2"), 4.4, 1, "mlp"),
        FlowNode("x·W₁ + b₁", h("mlp_pre"), 4.4, 2, "mlp"),
        FlowNode("GELU (tanh form)", h("mlp_post"), 4.4, 3, "mlp"),
        FlowNode("·W₂ + b₂", h("mlp_out"), 4.4, 4, "mlp"),
        FlowNode("x + MLP", h("resid_post"), 4.4, 5, "residual"),
        FlowNode(f"× {n_layer} blocks → LN_f", h("ln_final"), 4.4, 7, "output"),
        FlowNode("z = x·W_U (logits)", h("logits"), 4.4, 8, "output"),
    ]
    chain = [("model:in[0]", "embed"), ("model:in[0]", "pos_embed"), ("embed", "resid_pre"),
             ("pos_embed", "resid_pre"), ("resid_pre", "ln1"), ("ln1", "qkv"), ("qkv", "q"), ("qkv", "k"),
             ("qkv", "v"), ("k", "k_all"), ("v", "v_all"), ("q", "qk"), ("k_all", "qk"), ("qk", "attn_scores"),
             ("attn_scores", "masked_scores"), ("mask", "masked_scores"), ("masked_scores", "pattern"),
             ("pattern", "z"), ("v_all", "z"), ("z", "merged"), ("merged", "attn_out"), ("attn_out", "resid_mid"),
             ("resid_mid", "ln2"), ("ln2", "mlp_pre"), ("mlp_pre", "mlp_post"), ("mlp_post", "mlp_out"),
             ("mlp_out", "resid_post"), ("resid_post", "ln_final"), ("ln_final", "logits")]
    return nodes, [(a if a.startswith("model:") else h(a), h(b)) for a, b in chain]


def _template(kind: str) -> str:
    try:
        act_name(kind)
    except ValueError:
        return "{L}"
    return ""


def flow_nodes(trace: Trace, step: int, layer: int = 0) -> tuple[list[FlowNode], list[tuple[int, int]]]:
    """The flow's nodes with the shapes recorded at ``step`` (records missing → shape None)."""
    n_layer = trace.config.n_layer if trace.config is not None else layer + 1
    nodes, edges_by_name = _nodes(layer, n_layer)
    for node in nodes:
        try:
            rec = trace.record(node.name, step)
        except KeyError:
            continue
        node.shape = rec.shape
        node.symbolic = list(rec.axes) if rec.axes else None
        node.summary = trace.summary(rec)
    index = {n.name: i for i, n in enumerate(nodes)}
    return nodes, [(index[a], index[b]) for a, b in edges_by_name]


def flow_table(trace: Trace, step: int, layer: int = 0) -> pd.DataFrame:
    nodes, _ = flow_nodes(trace, step, layer)
    return pd.DataFrame([{
        "stage": n.label, "record": n.name, "shape": n.shape,
        "symbols": "[" + ", ".join(n.symbolic) + "]" if n.symbolic else "",
    } for n in nodes])


def repeat_note(layer: int, n_layer: int | None) -> str:
    """Which blocks the drawn one stands for (blocks are numbered from 0, as in the hook names)."""
    if n_layer is None:
        return f"block {layer} shown; every block has the same shapes"
    if n_layer == 1:
        return "block 0 is the only block"
    others = [b for b in range(n_layer) if b != layer]
    span = f"block {others[0]}" if len(others) == 1 else (
        f"blocks {others[0]} … {others[-1]}" if others == list(range(others[0], others[-1] + 1))
        else f"blocks 0 … {n_layer - 1} except {layer}")
    return f"block {layer} shown; {span} repeat{'s' if len(others) == 1 else ''} the same shapes"


def shape_flow_figure(trace: Trace, step: int, layer: int = 0) -> go.Figure:
    """Boxes and arrows: each box the stage, its live shape, and that shape in symbols."""
    nodes, edges = flow_nodes(trace, step, layer)
    w, h = 1.05, 0.74
    # shapes and annotations go in as one list each: plotly's add_annotation re-validates every earlier
    # one, which made this figure cost 0.4 s
    shapes: list[dict] = []
    notes: list[dict] = []
    for src, dst in edges:
        a, b = nodes[src], nodes[dst]
        if b.x - a.x > 2:  # from the bottom of the attention lane to the top of the MLP lane: route around
            gutter = (a.x + b.x) / 2 + 0.3
            path = (f"M {a.x + w / 2} {a.y} L {gutter} {a.y} L {gutter} {b.y} L {b.x - w / 2 - 0.05} {b.y}")
            shapes.append({"type": "path", "path": path, "line": {"color": "#888", "width": 1.2}})
            notes.append({"x": b.x - w / 2, "y": b.y, "ax": b.x - w / 2 - 0.25, "ay": b.y, "xref": "x", "yref": "y",
                          "axref": "x", "ayref": "y", "showarrow": True, "arrowhead": 2, "arrowwidth": 1.2,
                          "arrowcolor": "#888", "text": ""})
            continue
        if a.y == b.y:  # side by side (the mask into "+ M"): edge to edge, not through either box
            side = 1 if b.x > a.x else -1
            notes.append({"x": b.x - side * w / 2, "y": b.y, "ax": a.x + side * w / 2, "ay": a.y, "xref": "x",
                          "yref": "y", "axref": "x", "ayref": "y", "showarrow": True, "arrowhead": 2,
                          "arrowwidth": 1.2, "arrowcolor": "#888", "text": ""})
            continue
        notes.append({"x": b.x, "y": b.y - h / 2, "ax": a.x, "ay": a.y + h / 2, "xref": "x", "yref": "y",
                      "axref": "x", "ayref": "y", "showarrow": True, "arrowhead": 2, "arrowsize": 1,
                      "arrowwidth": 1.2, "arrowcolor": "#888", "text": ""})
    for node in nodes:
        shapes.append({"type": "rect", "x0": node.x - w / 2, "x1": node.x + w / 2, "y0": node.y - h / 2,
                       "y1": node.y + h / 2, "line": {"color": "#777", "width": 1},
                       "fillcolor": GROUP_COLORS[node.group], "layer": "below"})
        shape = shape_text(node.shape) if node.shape is not None else "(not recorded)"
        sym = "[" + ", ".join(node.symbolic) + "]" if node.symbolic else ""
        text = f"<b>{node.label}</b><br>{shape}" + (f"<br><i>{sym}</i>" if sym else "")
        notes.append({"x": node.x, "y": node.y, "text": text, "showarrow": False,
                      "font": {"size": 11, "color": "#1a1a1a"}})
    notes.append({"x": 4.4, "y": 6, "showarrow": False, "font": {"size": 10, "color": "#666"},
                  "text": repeat_note(layer, trace.config.n_layer if trace.config is not None else None)})
    # invisible points carry the hover: record name and one-line summary
    fig = go.Figure(go.Scatter(
        x=[n.x for n in nodes], y=[n.y for n in nodes], mode="markers", marker={"size": 40, "opacity": 0},
        customdata=[[n.name, safe_text(n.summary or shape_text(n.shape or ()))] for n in nodes],
        hovertemplate="%{customdata[0]}<br>%{customdata[1]}<extra></extra>", showlegend=False,
    ))
    fig.update_layout(shapes=shapes, annotations=notes)
    fig.update_xaxes(visible=False, range=[-1.5, 5.3])
    fig.update_yaxes(visible=False, range=[13.6, -0.6])
    fig.update_layout(height=980, margin={"t": 10, "l": 0, "r": 0, "b": 0}, plot_bgcolor="white",
                      dragmode=False)
    return fig
