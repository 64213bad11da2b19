"""The architecture as a flow of live shapes: token ids → embeddings → one block → logits."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from figures.common import dims_for, safe_text, shape_text, symbols
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


def _nodes(layer: int, n_layer: int) -> tuple[list[FlowNode], list[tuple[int, int]]]:
    b = f"blocks.{layer}"
    a = f"{b}.attn"
    nodes = [
        FlowNode("token ids", "model:in[0]", 1.0, 0, "input"),
        FlowNode("W_E[tokens]", "hook_embed", 0.2, 1, "input"),
        FlowNode("W_pos[positions]", "hook_pos_embed", 1.8, 1, "input"),
        FlowNode(f"x into block {layer}" + (f" (after {layer} block{'s' if layer > 1 else ''})" if layer else ""),
                 f"{b}.hook_resid_pre", 1.0, 2, "residual"),
        FlowNode("LN₁(x)", f"{b}.ln1.hook_normalized", 1.0, 3, "attention"),
        FlowNode("X·W_QKV", f"{a}.hook_qkv", 1.0, 4, "attention"),
        FlowNode("Q", f"{a}.hook_q", -0.2, 5, "attention"),
        FlowNode("K (new)", f"{a}.hook_k", 1.0, 5, "attention"),
        FlowNode("V (new)", f"{a}.hook_v", 2.2, 5, "attention"),
        FlowNode("K = cache ++ new", f"{a}.hook_k_all", 1.0, 6, "cache"),
        FlowNode("V = cache ++ new", f"{a}.hook_v_all", 2.2, 6, "cache"),
        FlowNode("QKᵀ", f"{a}.hook_qk", 0.4, 7, "attention"),
        FlowNode("÷ √d_k", f"{a}.hook_attn_scores", 0.4, 8, "attention"),
        FlowNode("M (mask)", f"{a}.hook_mask", -0.8, 9, "attention"),
        FlowNode("+ M", f"{a}.hook_masked_scores", 0.4, 9, "attention"),
        FlowNode("A = softmax", f"{a}.hook_pattern", 0.4, 10, "attention"),
        FlowNode("z = A·V", f"{a}.hook_z", 1.4, 11, "attention"),
        FlowNode("merge heads", f"{a}.hook_merged", 1.4, 12, "attention"),
        FlowNode("·W_O", f"{b}.hook_attn_out", 1.4, 13, "attention"),
        FlowNode("x + attention", f"{b}.hook_resid_mid", 4.4, 0, "residual"),
        FlowNode("LN₂(x)", f"{b}.ln2.hook_normalized", 4.4, 1, "mlp"),
        FlowNode("x·W₁ + b₁", f"{b}.mlp.hook_pre", 4.4, 2, "mlp"),
        FlowNode("GELU", f"{b}.mlp.hook_post", 4.4, 3, "mlp"),
        FlowNode("·W₂ + b₂", f"{b}.hook_mlp_out", 4.4, 4, "mlp"),
        FlowNode("x + MLP", f"{b}.hook_resid_post", 4.4, 5, "residual"),
        FlowNode(f"× {n_layer} blocks → LN_f", "ln_final.hook_normalized", 4.4, 7, "output"),
        FlowNode("logits = x·W_Eᵀ", "hook_logits", 4.4, 8, "output"),
    ]
    index = {n.name: i for i, n in enumerate(nodes)}
    edges_by_name = [
        ("model:in[0]", "hook_embed"), ("model:in[0]", "hook_pos_embed"), ("hook_embed", f"{b}.hook_resid_pre"),
        ("hook_pos_embed", f"{b}.hook_resid_pre"), (f"{b}.hook_resid_pre", f"{b}.ln1.hook_normalized"),
        (f"{b}.ln1.hook_normalized", f"{a}.hook_qkv"), (f"{a}.hook_qkv", f"{a}.hook_q"),
        (f"{a}.hook_qkv", f"{a}.hook_k"), (f"{a}.hook_qkv", f"{a}.hook_v"), (f"{a}.hook_k", f"{a}.hook_k_all"),
        (f"{a}.hook_v", f"{a}.hook_v_all"), (f"{a}.hook_q", f"{a}.hook_qk"), (f"{a}.hook_k_all", f"{a}.hook_qk"),
        (f"{a}.hook_qk", f"{a}.hook_attn_scores"), (f"{a}.hook_attn_scores", f"{a}.hook_masked_scores"),
        (f"{a}.hook_mask", f"{a}.hook_masked_scores"), (f"{a}.hook_masked_scores", f"{a}.hook_pattern"),
        (f"{a}.hook_pattern", f"{a}.hook_z"), (f"{a}.hook_v_all", f"{a}.hook_z"), (f"{a}.hook_z", f"{a}.hook_merged"),
        (f"{a}.hook_merged", f"{b}.hook_attn_out"), (f"{b}.hook_attn_out", f"{b}.hook_resid_mid"),
        (f"{b}.hook_resid_mid", f"{b}.ln2.hook_normalized"), (f"{b}.ln2.hook_normalized", f"{b}.mlp.hook_pre"),
        (f"{b}.mlp.hook_pre", f"{b}.mlp.hook_post"), (f"{b}.mlp.hook_post", f"{b}.hook_mlp_out"),
        (f"{b}.hook_mlp_out", f"{b}.hook_resid_post"), (f"{b}.hook_resid_post", "ln_final.hook_normalized"),
        ("ln_final.hook_normalized", "hook_logits"),
    ]
    return nodes, [(index[s], index[d]) for s, d in edges_by_name]


def flow_nodes(trace: Trace, step: int, layer: int = 0) -> tuple[list[FlowNode], list[tuple[int, int]]]:
    """The flow's nodes with the shapes recorded at ``step`` (records missing → shape None)."""
    n_layer = trace.meta.get("model_config", {}).get("n_layer", layer + 1)
    nodes, edges = _nodes(layer, n_layer)
    dims = dims_for(trace, step)
    for node in nodes:
        try:
            rec = trace.record(node.name, step)
        except KeyError:
            continue
        node.shape = rec.shape
        node.symbolic = symbols(node.name, rec.shape, dims)
        node.summary = trace.summary(node.name, step) if rec.stats is not None else ""
    return nodes, edges


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
                  "text": repeat_note(layer, trace.meta.get("model_config", {}).get("n_layer"))})
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
