"""The architecture as a flow of live shapes, drawn from the model's own config: token ids → embeddings →
one block (norm, attention, MLP, residuals) → logits, with each weight's shape beside the activation it
makes; and the multi-head reshape op by op, with what each op does to memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypedDict

import plotly.graph_objects as go

from gpt_shape_tracer.figures.common import safe_text, shape_text
from gpt_shape_tracer.figures.plot import arrow_trace, figure, fitted, set_layout, text_trace
from gpt_shape_tracer.model.gpt import act_name, residual_sums
from gpt_shape_tracer.tracer import Trace

GROUP_COLORS = {
    "input": "#dfe8f5",
    "attention": "#fde2c8",
    "position": "#f6e7a8",
    "cache": "#f9d0d0",
    "mlp": "#d7efd9",
    "residual": "#eeeeee",
    "output": "#e6dcf3",
}
W, H_BOX = 1.1, 0.86
SKIP_COLOUR = "#4a7f56"  # the residual stream's skips around attention and the MLP


@dataclass
class FlowNode:
    label: str  # what the stage is, in the notation of model/gpt/_gpt.py
    name: str  # the record it shows
    x: float
    y: float
    group: str
    weight: str = ""  # the weight this stage multiplies by, with its shape
    shape: tuple[int, ...] | None = None
    symbolic: list[str] | None = None
    summary: str = ""


class _Architecture(TypedDict):
    norm: str  # "LN" | "RMSNorm"
    rope: bool
    gated: bool
    tied: bool
    grouped: bool


def _architecture(config) -> _Architecture:
    rms = config is not None and getattr(config, "norm", "layernorm") == "rmsnorm"
    return {
        "norm": "RMSNorm" if rms else "LN",
        "rope": config is not None and getattr(config, "positions", "learned") == "rope",
        "gated": config is not None and getattr(config, "mlp", "gelu") == "swiglu",
        "tied": config is None or getattr(config, "tie_embeddings", True),
        "grouped": config is not None and getattr(config, "n_kv_heads", config.n_head) != config.n_head,
    }


def _weights(config) -> dict[str, str]:
    """Each weight's shape, in numbers. (Vaswani et al. 2017 write W_Q, W_K, W_V per head, [d, d_k] each: they are the
    column blocks of W_QKV, one block of d_k columns per head.)"""
    if config is None:
        return {}
    d, H, dh, V, f = config.d_model, config.n_head, config.d_head, config.vocab_size, config.d_ff
    G = getattr(config, "n_kv_heads", H)
    gated = getattr(config, "mlp", "gelu") == "swiglu"
    return {
        "embed": f"W_E [{V}, {d}]",
        "pos_embed": f"W_pos [{config.n_ctx}, {d}]",
        "qkv": f"W_QKV [{d}, {(H + 2 * G) * dh}]",
        "attn_out": f"W_O [{H * dh}, {d}]",
        "mlp_pre": f"W_gate [{d}, {f}]" if gated else f"W₁ [{d}, {f}]",
        "mlp_pre_linear": f"W_up [{d}, {f}]",
        "mlp_out": f"W_down [{f}, {d}]" if gated else f"W₂ [{f}, {d}]",
        "norm": "γ, β [d]" if getattr(config, "norm", "layernorm") == "layernorm" else "γ [d]",
        "logits": f"W_U = W_Eᵀ [{d}, {V}]" if getattr(config, "tie_embeddings", True) else f"W_U [{d}, {V}]",
    }


def residual_label(kind: str, plain: bool | None, mixer: str = "", parallel: bool = False) -> str:
    """The box of the stream after a sublayer (``kind`` "resid_mid" or "resid_post"): "x + attention" only where
    the blocks were found to be plain residual sums (``residual_sums``); where they were found not to be, or
    nothing was measured (a dry run), what the box is without a claim about how the block made it."""
    sub = "attention" if not mixer else "mixer"
    if kind == "resid_mid":
        return f"x + {sub}" if plain else f"after {sub}" + (" (not a plain sum)" if plain is False else "")
    if plain:
        return f"x + {sub} + MLP" if parallel else "x + MLP"
    return "after the MLP" + (" (not a plain sum)" if plain is False else "")


def residual_note(plain: bool | None) -> str:
    """The sentence under a flow whose blocks are not plain residual sums, or were not measured ("" when they are)."""
    if plain:
        return ""
    if plain is False:
        return ("this model's blocks do not simply add each sublayer's output to x: they mix the two their own way "
                "(checked at load on the recorded tensors; see the model's code)")
    # a dry run (no values to add up) or a trace saved before the check: say so, without naming which
    return ("whether each block adds its sublayers' outputs to x as they are was not measured for this trace, so no "
            "box claims it")


def _nodes(layer: int, n_layer: int, config, use_cache: bool) -> tuple[list[FlowNode], list[tuple[str, str]]]:
    arch, w = _architecture(config), _weights(config)
    plain = residual_sums(config)
    norm = arch["norm"]

    def h(kind: str) -> str:
        try:
            return act_name(kind, layer)
        except ValueError:
            return act_name(kind)

    kv = "G" if arch["grouped"] else "H"
    nodes = [FlowNode("token ids", "model:in[0]", 1.0, 0, "input")]
    chain = []
    if arch["rope"]:
        nodes.append(FlowNode("W_E[tokens]", h("embed"), 1.0, 1, "input", w.get("embed", "")))
        chain += [("model:in[0]", "embed"), ("embed", "resid_pre")]
    else:
        nodes += [FlowNode("W_E[tokens]", h("embed"), 0.3, 1, "input", w.get("embed", "")),
                  FlowNode("W_pos[positions]", h("pos_embed"), 1.7, 1, "input", w.get("pos_embed", ""))]
        chain += [("model:in[0]", "embed"), ("model:in[0]", "pos_embed"), ("embed", "resid_pre"),
                  ("pos_embed", "resid_pre")]
    after = f" (after {layer} block{'s' if layer > 1 else ''})" if layer else ""
    k_all = "K = cache ++ new" if use_cache else "K (all t rows, recomputed)"
    v_all = "V = cache ++ new" if use_cache else "V (all t rows, recomputed)"
    y_rot = 1 if arch["rope"] else 0
    nodes += [
        FlowNode(f"x into block {layer}{after}", h("resid_pre"), 1.0, 2, "residual"),
        FlowNode(f"{norm}₁(x)", h("ln1"), 1.0, 3, "attention", w.get("norm", "")),
        FlowNode("X·W_QKV", h("qkv"), 1.0, 4, "attention", w.get("qkv", "")),
        FlowNode("Q", h("q"), -0.3, 5, "attention"),
        # without the cache every position is fed again: K and V of all of them, none of them "new"
        FlowNode(f"K ({'new' if use_cache else 'every position'}, {kv} heads)", h("k"), 1.0, 5, "attention"),
        FlowNode(f"V ({'new' if use_cache else 'every position'}, {kv} heads)", h("v"), 2.3, 5, "attention"),
    ]
    chain += [("resid_pre", "ln1"), ("ln1", "qkv"), ("qkv", "q"), ("qkv", "k"), ("qkv", "v")]
    q_src, k_src = "q", "k"
    if arch["rope"]:
        nodes += [FlowNode("rotate Q: R(m)q (RoPE)", h("rot_q"), -0.3, 6, "position"),
                  FlowNode("rotate K: R(n)k (RoPE)", h("rot_k"), 1.0, 6, "position")]
        chain += [("q", "rot_q"), ("k", "rot_k")]
        q_src, k_src = "rot_q", "rot_k"
    nodes += [
        FlowNode(k_all, h("k_all"), 1.0, 6 + y_rot, "cache" if use_cache else "attention"),
        FlowNode(v_all, h("v_all"), 2.3, 6 + y_rot, "cache" if use_cache else "attention"),
        FlowNode("QKᵀ" + (f" ({kv}→H heads)" if arch["grouped"] else ""), h("qk"), 0.35, 7 + y_rot, "attention"),
        FlowNode("÷ √d_k", h("attn_scores"), 0.35, 8 + y_rot, "attention"),
        FlowNode("M (mask)", h("mask"), -0.95, 9 + y_rot, "attention"),
        FlowNode("+ M", h("masked_scores"), 0.35, 9 + y_rot, "attention"),
        FlowNode("A = softmax", h("pattern"), 0.35, 10 + y_rot, "attention"),
        FlowNode("O = A·V", h("z"), 1.5, 11 + y_rot, "attention"),
        FlowNode("merge heads", h("merged"), 1.5, 12 + y_rot, "attention"),
        FlowNode("·W_O", h("attn_out"), 1.5, 13 + y_rot, "attention", w.get("attn_out", "")),
        FlowNode(residual_label("resid_mid", plain), h("resid_mid"), 4.6, 0, "residual"),
        FlowNode(f"{norm}₂(x)", h("ln2"), 4.6, 1, "mlp", w.get("norm", "")),
    ]
    chain += [(k_src, "k_all"), ("v", "v_all"), (q_src, "qk"), ("k_all", "qk"), ("qk", "attn_scores"),
              ("attn_scores", "masked_scores"), ("mask", "masked_scores"), ("masked_scores", "pattern"),
              ("pattern", "z"), ("v_all", "z"), ("z", "merged"), ("merged", "attn_out"), ("attn_out", "resid_mid"),
              ("resid_mid", "ln2")]
    if arch["gated"]:
        nodes += [FlowNode("gate: x·W_gate", h("mlp_pre"), 4.0, 2, "mlp", w.get("mlp_pre", "")),
                  FlowNode("up: x·W_up", h("mlp_pre_linear"), 5.2, 2, "mlp", w.get("mlp_pre_linear", "")),
                  FlowNode("SiLU(gate) ⊙ up", h("mlp_post"), 4.6, 3, "mlp")]
        chain += [("ln2", "mlp_pre"), ("ln2", "mlp_pre_linear"), ("mlp_pre", "mlp_post"),
                  ("mlp_pre_linear", "mlp_post")]
    else:
        nodes += [FlowNode("x·W₁ + b₁", h("mlp_pre"), 4.6, 2, "mlp", w.get("mlp_pre", "")),
                  FlowNode("GELU (tanh form)", h("mlp_post"), 4.6, 3, "mlp")]
        chain += [("ln2", "mlp_pre"), ("mlp_pre", "mlp_post")]
    nodes += [
        FlowNode("·W₂" if not arch["gated"] else "·W_down", h("mlp_out"), 4.6, 4, "mlp", w.get("mlp_out", "")),
        FlowNode(residual_label("resid_post", plain), h("resid_post"), 4.6, 5, "residual"),
        FlowNode(f"× {n_layer} blocks → {norm}_f", h("ln_final"), 4.6, 7, "output", w.get("norm", "")),
        FlowNode("z = x·W_U (logits)", h("logits"), 4.6, 8, "output", w.get("logits", "")),
    ]
    chain += [("mlp_post", "mlp_out"), ("mlp_out", "resid_post"), ("resid_post", "ln_final"), ("ln_final", "logits")]
    return nodes, [(a if a.startswith("model:") else h(a), h(b)) for a, b in chain]


def _recorded_nodes(trace: Trace, step: int, layer: int) -> tuple[list[FlowNode], list[tuple[int, int]]]:
    """The flow of a model this file has no template for (a transformers-run model, family "hf"), built from
    what the trace holds: block ``layer``'s hook points and the outputs of the model's own leaf modules
    inside that block, in the order the forward ran them, then the logits. Nothing is assumed about the
    architecture: a stage it adds (QK-norm, a soft-cap, a router) is drawn because it was recorded."""
    from gpt_shape_tracer.model.gpt import spec_for

    config = trace.config
    facts = trace.generation
    cached = facts.info.use_cache if facts is not None else True  # no cache (its own, or the switch): no "new"
    records = trace.filter(step=step)
    hooks = [r for r in records if r.kind == "hook" and r.name.startswith(f"blocks.{layer}.")]
    # the outputs of the model's own modules inside block `layer` (a record's layer is its path's first number)
    own = [r for r in records if r.kind == "output" and r.module.startswith(("hf.", "inner.")) and r.slot == ""
           and r.layer == layer]
    leaves = {m for m in (r.module for r in own) if not any(o.module.startswith(m + ".") for o in own)}
    chosen = sorted([*hooks, *(r for r in own if r.module in leaves)], key=lambda r: r.index)
    head = [r for r in records if r.name in ("model:in[0]", "hook_embed")]
    tail = [r for r in records if r.name == "hook_logits"]
    chain = [*head, *chosen, *tail]
    per_column = max(8, -(-len(chain) // 4))  # four columns, left to right, in the order the forward ran
    attn_end = next((r.index for r in chosen if r.name.endswith("hook_attn_out")), -1)
    plain = residual_sums(config)
    mixers = getattr(config, "mixers", None)
    mixer = mixers[layer] if mixers is not None and layer < len(mixers) else ""
    parallel = not any(r.name.endswith("hook_resid_mid") for r in hooks)
    nodes = []
    for i, r in enumerate(chain):
        spec = spec_for(r.name, config) if r.kind == "hook" else None
        if r.name == "model:in[0]":
            label, group = "token ids", "input"
        elif r.kind == "hook" and r.name.endswith(("hook_resid_mid", "hook_resid_post")):
            label, group = residual_label(r.name.rsplit("hook_", 1)[1], plain, mixer, parallel), "residual"
        elif spec is not None:
            label = spec.meaning.replace("block L", f"block {layer}")
            if not cached:  # the table's meanings speak of a cache; without one every position is recomputed
                label = label.replace(": cache ++ new", ", recomputed").replace("of the new positions",
                                                                               "of every position")
            group = ("input" if r.name == "hook_embed" else "output" if r.name == "hook_logits"
                     else "residual" if "resid" in r.name else "attention" if r.index <= attn_end else "mlp")
        else:
            label = f"{r.module.rsplit('.', 1)[-1]} ({r.module_type})"
            group = "attention" if r.index <= attn_end else "mlp"
        nodes.append(FlowNode(_short(label), r.name, -0.8 + 1.8 * (i // per_column), i % per_column, group,
                              shape=r.shape, symbolic=list(r.axes) if r.axes else None, summary=trace.summary(r)))
    return nodes, [(i, i + 1) for i in range(len(nodes) - 1)]


def _short(text: str, width: int = 34) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def recorded_flow(trace: Trace) -> bool:
    """Whether the flow is drawn from the records (no template for this model's architecture)."""
    config = trace.config
    return config is None or getattr(config, "family", "gpt2") in ("hf", "module")


def flow_nodes(trace: Trace, step: int, layer: int = 0) -> tuple[list[FlowNode], list[tuple[int, int]]]:
    """The flow's nodes with the shapes recorded at ``step`` (records missing → shape None)."""
    if recorded_flow(trace):
        return _recorded_nodes(trace, step, layer)
    config = trace.config
    n_layer = config.n_layer if config is not None else layer + 1
    facts = trace.generation
    nodes, edges_by_name = _nodes(layer, n_layer, config, facts.info.use_cache if facts is not None else True)
    for node in nodes:
        try:
            rec = trace.record(node.name, step)
        except KeyError:
            continue
        node.shape = rec.shape
        node.symbolic = list(rec.axes) if rec.axes else None
        node.summary = trace.summary(rec)
    index = {n.name: i for i, n in enumerate(nodes)}
    return nodes, [(index[a], index[b]) for a, b in edges_by_name if a in index and b in index]


def block_shapes(trace: Trace, step: int) -> dict[int, tuple]:
    """Each block's recorded shapes at ``step``: block → its (name within the block, shape) pairs, in order."""
    out: dict[int, list] = {}
    for rec in trace.filter(step=step):  # our hook points (blocks.L.…) and the modules' own (….layers.L.…)
        found = _BLOCK_INDEX.match(rec.name)
        if found:
            out.setdefault(int(found[2]), []).append((found[1] + "*" + found[3], tuple(rec.shape)))
    return {b: tuple(v) for b, v in out.items()}


_BLOCK_INDEX = re.compile(r"^(.*?\b(?:blocks|layers|h)\.)(\d+)([.:].*)?$")


def measured_repeat_note(trace: Trace, step: int, layer: int) -> str:
    """Which blocks have exactly the drawn block's recorded shapes, and which do not (a model whose first layers
    are dense and the rest mixture-of-experts, or whose sliding-window layers keep fewer keys, has both)."""
    shapes = block_shapes(trace, step)
    if layer not in shapes:
        return f"block {layer} shown"
    same = [b for b, v in shapes.items() if b != layer and v == shapes[layer]]
    other = [b for b in shapes if b != layer and b not in same]

    def listed(blocks: list[int]) -> str:
        runs, start = [], None
        for i, b in enumerate(blocks):
            start = b if start is None else start
            if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
                runs.append(str(start) if start == b else f"{start} … {b}")
                start = None
        return ", ".join(runs)

    if not same and not other:
        return f"block {layer} is the only block"
    text = f"block {layer} shown"
    if same:
        text += f"; block{'s' if len(same) > 1 else ''} {listed(same)} record the same shapes"
    if other:
        text += f"; block{'s' if len(other) > 1 else ''} {listed(other)} differ (choose one to see it)"
    return text


@fitted
def _residual_skips(nodes: list[FlowNode], layer: int, shapes: list[dict],
                    arrows: list[tuple[float, float, float, float]]) -> list[tuple[float, float, str]]:
    """The residual stream's two skips, drawn dashed: x goes around attention into "x + attention", and that
    sum around the MLP into "x + MLP" (each block adds to x, never replaces it). Adds the paths and their
    arrowheads; returns the labels to write beside them."""
    where = {n.name: n for n in nodes}
    pre, mid, post = (where.get(act_name(kind, layer)) for kind in ("resid_pre", "resid_mid", "resid_post"))
    if pre is None or mid is None or post is None:
        return []
    line = {"color": SKIP_COLOUR, "width": 1.6, "dash": "dash"}
    # around attention: out of x's right edge, up the free column between the lanes, into the sum's upper left
    up_x, into_y = (pre.x + mid.x) / 2 + 0.1, mid.y - H_BOX / 4
    shapes.append({"type": "path", "line": line,
                   "path": f"M {pre.x + W / 2} {pre.y} L {up_x} {pre.y} L {up_x} {into_y} "
                           f"L {mid.x - W / 2 - 0.25} {into_y}"})
    arrows.append((mid.x - W / 2 - 0.25, into_y, mid.x - W / 2, into_y))
    # around the MLP: out of the sum's right edge, down the right margin, into "x + MLP" from the right
    down_x = mid.x + W / 2 + 0.8
    shapes.append({"type": "path", "line": line,
                   "path": f"M {mid.x + W / 2} {mid.y} L {down_x} {mid.y} L {down_x} {post.y} "
                           f"L {post.x + W / 2 + 0.25} {post.y}"})
    arrows.append((post.x + W / 2 + 0.25, post.y, post.x + W / 2, post.y))
    return [((pre.x + W / 2 + up_x) / 2, pre.y - 0.22, "skip: x"),
            ((mid.x + W / 2 + down_x) / 2, mid.y - 0.22, "skip: x")]


def shape_flow_figure(trace: Trace, step: int, layer: int = 0) -> go.Figure:
    """Boxes and arrows: each box the stage, its live shape, and that shape in symbols; the weight it
    multiplies by beside it."""
    nodes, edges = flow_nodes(trace, step, layer)
    shapes: list[dict] = []
    arrows: list[tuple[float, float, float, float]] = []  # (from x, y, to x, y)
    for src, dst in edges:
        a, b = nodes[src], nodes[dst]
        if b.x - a.x > 2 or (b.x > a.x and b.y < a.y):  # to the top of the next lane: route around
            gutter = (a.x + b.x) / 2 + (0.3 if b.x - a.x > 2 else 0.0)
            path = f"M {a.x + W / 2} {a.y} L {gutter} {a.y} L {gutter} {b.y} L {b.x - W / 2 - 0.25} {b.y}"
            shapes.append({"type": "path", "path": path, "line": {"color": "#888", "width": 1.2}})
            arrows.append((b.x - W / 2 - 0.25, b.y, b.x - W / 2, b.y))
        elif a.y == b.y:  # side by side (the mask into "+ M"): edge to edge, not through either box
            side = 1 if b.x > a.x else -1
            arrows.append((a.x + side * W / 2, a.y, b.x - side * W / 2, b.y))
        else:
            arrows.append((a.x, a.y + H_BOX / 2, b.x, b.y - H_BOX / 2))
    skip_labels: list[tuple[float, float, str]] = []
    if not recorded_flow(trace) and residual_sums(trace.config):  # the skips are x itself, added: only where it is
        skip_labels = _residual_skips(nodes, layer, shapes, arrows)
    labels = []
    for node in nodes:
        shapes.append({"type": "rect", "x0": node.x - W / 2, "x1": node.x + W / 2, "y0": node.y - H_BOX / 2,
                       "y1": node.y + H_BOX / 2, "line": {"color": "#777", "width": 1},
                       "fillcolor": GROUP_COLORS[node.group], "layer": "below"})
        shape = shape_text(node.shape) if node.shape is not None else "(not recorded)"
        sym = "[" + ", ".join(node.symbolic) + "]" if node.symbolic else ""
        text = f"<b>{node.label}</b><br>{shape}" + (f"<br><i>{sym}</i>" if sym else "")
        if node.weight:
            text += f"<br><span style='color:#6b5b95'>{node.weight}</span>"
        labels.append(text)
    fig = figure([
        arrow_trace(arrows),
        text_trace([n.x for n in nodes], [n.y for n in nodes], labels),
        text_trace([x for x, _, _ in skip_labels], [y for _, y, _ in skip_labels],
                   [text for _, _, text in skip_labels], color=SKIP_COLOUR),
        text_trace([4.6] if not recorded_flow(trace) else [2.6],
                   [6] if not recorded_flow(trace) else [max(n.y for n in nodes) + 1.0],
                   [measured_repeat_note(trace, step, layer)
                    + (" — the stages as this model's forward ran them, read from the trace" if recorded_flow(trace)
                       else "")
                    + ("<br>" + residual_note(residual_sums(trace.config)) if not residual_sums(trace.config) else "")],
                   color="#666"),
        # invisible points carry the hover: record name and one-line summary
        go.Scatter(x=[n.x for n in nodes], y=[n.y for n in nodes], mode="markers",
                   marker={"size": 40, "opacity": 0},
                   customdata=[[n.name, safe_text(n.summary or shape_text(n.shape or ()))] for n in nodes],
                   hovertemplate="%{customdata[0]}<br>%{customdata[1]}<extra></extra>", showlegend=False),
    ])
    bottom = max(n.y for n in nodes) + (1 if recorded_flow(trace) else 0)
    return set_layout(fig, {"shapes": shapes, "xaxis": {"visible": False, "range": [-1.6, 6.3]},
                            "yaxis": {"visible": False, "range": [bottom + 0.6, -0.6]},
                            "height": int(80 * (bottom + 1.2)), "margin": {"t": 10, "l": 0, "r": 0, "b": 0},
                            "plot_bgcolor": "white", "dragmode": False})


# -- the multi-head reshape, op by op -------------------------------------------------------------------
@dataclass(frozen=True)
class ReshapeOp:
    op: str  # what runs, as code
    shape: tuple[int, ...]
    symbols: str
    memory: str  # what it does to memory, read off the recorded tensors where they are kept


def reshape_ops(trace: Trace, step: int, layer: int = 0) -> list[ReshapeOp]:
    """The split into heads and the merge back, with the live shapes; whether each op moved data is read
    from the kept tensors (the same storage, or a new one) where values were kept, else stated as what
    PyTorch does."""
    if recorded_flow(trace):
        return _recorded_reshape_ops(trace, step, layer)
    qkv_r, q_r, z_r, merged_r = (trace.record(act_name(k, layer), step) for k in ("qkv", "q", "z", "merged"))
    qkv, q, z, merged = (trace.value(r) for r in (qkv_r, q_r, z_r, merged_r))
    B, n = qkv_r.shape[0], qkv_r.shape[1]
    H, dh = q_r.shape[1], q_r.shape[3]
    G = trace.record(act_name("k", layer), step).shape[1]
    itemsize = q_r.nbytes // max(1, q_r.numel)

    def shares(a, b) -> str | None:
        if a is None or b is None:
            return None
        return "same" if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() else "new"

    split = shares(q, qkv)
    merge = shares(merged, z)
    measured = " (measured: it shares X·W_QKV's storage)" if split == "same" else ""
    copy_bytes = B * n * H * dh * itemsize
    # O.transpose(1, 2) is contiguous whenever n = 1 or H = 1, and also wherever the attention kernel wrote O with
    # each position's heads side by side (a fused kernel may): then .contiguous() returns it as it is. Only the
    # kept tensors say which; without them, only n = 1 or H = 1 is sure
    sure = f"with n = {n}" if n == 1 else "with H = 1" if H == 1 else None
    why = sure or ("the attention kernel wrote O with each position's heads side by side" if merge == "same" else None)
    needs_copy = merge == "new" if merge is not None else (False if sure else None)
    measured_merge = " (measured: a new storage)" if merge == "new" else (
        " (measured: the same storage as O)" if merge == "same" else "")
    if needs_copy:
        transposed = "a view, no longer contiguous: each position's heads are not side by side in memory"
        copied = f"copies {copy_bytes:,} bytes into new memory{measured_merge}"
        viewed = "a view of the copy: each row the H heads' outputs side by side"
    elif needs_copy is None:  # values not kept and n, H > 1: the kernel's layout of O is not known
        transposed = ("a view: contiguous only where the attention kernel wrote O with each position's heads side "
                      "by side")
        copied = (f"copies {copy_bytes:,} bytes where the transposed O is not contiguous, else returns it as it is "
                  "(not measured: values not kept)")
        viewed = "a view of what .contiguous() returned: each row the H heads' outputs side by side"
    else:
        transposed = f"a view, and still contiguous: {why}"
        copied = f"no copy: the transposed O is already contiguous — {why}{measured_merge}"
        viewed = "a view of O itself (nothing was copied): each row the H heads' outputs side by side"
    strides = f"strides {tuple(q.stride())}" if q is not None else "strides not kept"
    qkv_width = (H + 2 * G) * dh
    return [
        ReshapeOp("qkv = x @ W_QKV", qkv_r.shape, "[B, n, (H+2G)·d_head]", "a new tensor (the matmul's output)"),
        ReshapeOp(f"q, k, v = qkv.split(({H * dh}, {G * dh}, {G * dh}), dim=2)", (B, n, H * dh), "[B, n, H·d_head]",
                  "a view: no data moved, every row still strides over all " + f"{qkv_width} columns{measured}"),
        ReshapeOp(f"q.view(B, n, {H}, {dh})", (B, n, H, dh), "[B, n, H, d_head]",
                  "a view: the same numbers, indexed as H groups of d_head"),
        ReshapeOp("q.transpose(1, 2)", q_r.shape, "[B, H, n, d_head]",
                  f"a view: only the strides swap ({strides}); the matmuls now batch over heads"),
        ReshapeOp("o = attention(q, k, v)", z_r.shape, "[B, H, n, d_head]", "a new tensor (A·V)"),
        ReshapeOp("o.transpose(1, 2)", (B, n, H, dh), "[B, n, H, d_head]", transposed),
        ReshapeOp(".contiguous()", (B, n, H, dh), "[B, n, H, d_head]", copied),
        ReshapeOp(f".view(B, n, {H * dh})", merged_r.shape, "[B, n, H·d_head]", viewed),
    ]


def _recorded_reshape_ops(trace: Trace, step: int, layer: int) -> list[ReshapeOp]:
    """The split and merge of a transformers-run model, from its records: its own projection (Q's, or a fused
    one), Q as the attention receives it, O = A·V, and the input of its output projection. What happens
    between them is the model's own code; only the traced attention's transpose and copy are ours."""
    q_r, z_r = trace.record(act_name("q", layer), step), trace.record(act_name("z", layer), step)
    B, H, n, dh = q_r.shape
    itemsize = q_r.nbytes // max(1, q_r.numel)
    own = [r for r in trace.filter(step=step) if r.module.startswith(("hf.", "inner."))
           and r.kind in ("output", "input")
           and r.slot in ("", "[0]") and r.layer == layer]
    # the output projection's input: the merged heads, and the attention module is that projection's parent
    merged = next((r for r in own if r.kind == "input" and r.index > z_r.index and r.shape[-1:] == (H * dh,)), None)
    attention = merged.module.rsplit(".", 1)[0] + "." if merged is not None else None
    first = next((r for r in own if attention and r.module.startswith(attention) and r.kind == "output"
                  and r.index < q_r.index and len(r.shape) == 3), None)  # its first projection (Q's, or fused)
    ops = []
    if first is not None:
        ops.append(ReshapeOp(f"{first.module.rsplit('.', 1)[-1]}(x)", first.shape,
                             "[B, n, H·d_head]" if first.shape[-1] == H * dh else "[B, n, (H+2G)·d_head]",
                             f"a new tensor: the model's own projection ({first.module_type})"))
    q, projected = trace.value(q_r), trace.value(first) if first is not None else None
    if q is None or projected is None:
        moved = "not measured (values not kept): Q as the attention receives it"
    elif q.untyped_storage().data_ptr() == projected.untyped_storage().data_ptr():
        moved = "a view (measured: it shares the projection's storage): only shape and strides changed"
    else:
        moved = "a new tensor (measured: not the projection's storage): position encoding or QK-norm made it"
    ops.append(ReshapeOp("split into heads (the model's code)", q_r.shape, "[B, H, n, d_head]", moved))
    ops.append(ReshapeOp("o = attention(q, k, v)", z_r.shape, "[B, H, n, d_head]", "a new tensor (A·V)"))
    copied = (f"copies {B * n * H * dh * itemsize:,} bytes into new memory" if not (n == 1 or H == 1) else
              f"no copy: with n = {n} the transposed O is already contiguous")
    ops.append(ReshapeOp("o.transpose(1, 2).contiguous()", (B, n, H, dh), "[B, n, H, d_head]", copied))
    if merged is not None:
        ops.append(ReshapeOp(f"merge heads → {merged.module.rsplit('.', 1)[-1]}", merged.shape, "[B, n, H·d_head]",
                             "the heads side by side, into the output projection W_O"))
    return ops


@fitted
def reshape_figure(trace: Trace, step: int, layer: int = 0) -> go.Figure:
    """The reshape ops as a strip of boxes: green = a view (no data moved), orange = new memory."""
    ops = reshape_ops(trace, step, layer)
    shapes = []
    xs = [i * 1.25 for i in range(len(ops))]
    for x, op in zip(xs, ops):
        moves = op.memory.startswith(("a new", "copies"))
        unknown = op.memory.startswith("not measured")
        shapes.append({"type": "rect", "x0": x - 0.58, "x1": x + 0.58, "y0": -0.45, "y1": 0.45,
                       "fillcolor": "#eeeeee" if unknown else "#fbd9b5" if moves else "#d7efd9",
                       "line": {"color": "#777", "width": 1},
                       "layer": "below"})
    fig = figure([
        text_trace(xs, [0] * len(ops),
                   [f"<b>{'<br>'.join(safe_text(line) for line in _wrap(op.op, 22))}</b><br>{shape_text(op.shape)}"
                    f"<br><i>{op.symbols}</i>" for op in ops]),
        text_trace(xs, [-0.5] * len(ops), ["<br>".join(_wrap(op.memory, 24)) for op in ops], size=9,
                   color="#444", position="bottom center"),
        arrow_trace([(x - 0.67, 0, x - 0.58, 0) for x in xs[1:]]),
    ])
    return set_layout(fig, {"shapes": shapes, "height": 250, "margin": {"t": 10, "l": 0, "r": 0, "b": 0},
                            "plot_bgcolor": "white", "dragmode": False,
                            "xaxis": {"visible": False, "range": [-0.7, (len(ops) - 1) * 1.25 + 0.7]},
                            "yaxis": {"visible": False, "range": [-1.9, 0.6]}})


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*lines, line] if line else lines
