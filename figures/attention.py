"""Attention views: the four stages of A = softmax(QKᵀ/√d_k + M), O = A·V, every head at once, and the rows a
cached generation builds up step by step (the pitfalls the scale and the mask prevent: figures/pitfalls.py; RoPE:
figures/rope.py).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.common import (
    facts_of,
    inert,
    key_labels,
    kv_head,
    own_stream,
    position_is_token,
    positions,
    query_labels,
    real_query_rows,
    score_scale,
    shape_text,
)
from gpt_shape_tracer.figures.heatmap import (
    Grid,
    Pooling,
    add,
    grid,
    pool,
    pooled_caption,
    short_number,
    style_axes,
    weight_top,
)
from gpt_shape_tracer.figures.palette import ACCENT, AMOUNT, amount_legend, amount_span
from gpt_shape_tracer.figures.plot import figure, fitted, merged, set_layout, subplots
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import RegionError, Trace, attention_region, can_recompute, is_derived, pattern_digest

STAGES = ("qk", "attn_scores", "masked_scores", "pattern")
GRID_CELLS = 120_000  # the all-heads grid sends at most this many numbers (pooling each head to fit)
MIN_TILE_ROWS = 6  # a head with fewer query rows has them drawn taller, up to this many rows
ROLE_SHOWN = 0.3  # a head's clearest role is written on its tile from this score up
STAGE_SIDE = 128  # four stages side by side: each pooled to at most 128 × 128, under 1 MB together
NOTE_LINE = ("<br><span style='font-size:11px'>", "</span>")  # how each line of that note is written
NOTE_WIDTH = 110  # characters per line of the pooling note under the Stages title (one line ran off at 1280 px)
# each stage's short name in a pooled figure's caption (what its means left out)
STAGE_NAMES = {"qk": "QKᵀ", "attn_scores": "scaled QKᵀ", "softcapped": "soft-capped", "score_bias": "B",
               "masked_scores": "+ M",
               "sink_logits": "s_h", "pattern": "A", "sink_weight": "a_sink"}
M_NOTE = ("Here M is added after the scaling; the formula is often written softmax((QKᵀ + M)/√d_k). The two are "
          "equal because M holds only 0 and −∞: (x + 0)/√d_k = x/√d_k, and −∞/√d_k = −∞.")

HISTORY_WINDOW = 2048  # most rows and key columns the History builds: 2048² float32 = 16 MiB


@dataclass
class Stage:
    hook: str
    title: str  # the formula of this stage
    shapes: str  # the real shapes: operands → result
    matrix: torch.Tensor | None  # [n, t] for the chosen batch row and head; None if not kept
    pooled_only: bool = False  # the matrix is the pooled digest of evicted values



def score_bias_name(layer: int) -> str:
    """The record of the bias a model adds to its scores beside the mask (Inkling's relative position bias,
    model/sources/_hf_variants.py; Bloom's and MPT's ALiBi, model/sources/_hf_own_attention.py); not a row of the
    hook table, which our own GPT's hooks make up."""
    return f"blocks.{layer}.attn.hook_score_bias"


def score_bias_kind(trace: Trace) -> str:
    """What the model's score bias is, in words, by its family."""
    family = str(getattr(trace.config, "hf_model_type", "") or "")
    if family.startswith("inkling"):
        return "a learned relative position bias, one value per head, query and key"
    if family == "cpmant":  # its CpmAntSegmentPositionEmbedding
        return ("a learned relative position bias, one value per head for each bucket of query–key distance (and, "
                "between the prompt positions and the text, for the pair of segments)")
    if family in ("bloom", "mpt"):
        return "ALiBi: a fixed slope per head times the key's position"
    if family == "xlnet":  # its scores' second query–key product, read as a bias (model/sources/_hf_own_attention.py)
        return ("XLNet's position term: the queries plus a learned per-head bias times keys made from sinusoidal "
                "encodings of the query–key distance, times the scale")
    return "the family's own bias, added to the scores"


def stage_name(hook: str, layer: int) -> str:
    """The record of one stage of ``attention_stages`` (its ``hook``) in ``layer``."""
    return score_bias_name(layer) if hook == "score_bias" else act_name(hook, layer)


def score_bias(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> torch.Tensor | None:
    """The bias the model adds to one head's scores beside the mask, ``[n, t]`` (Inkling's learned relative position
    bias); None for a model without one, or when its values were not kept."""
    name = score_bias_name(layer)
    value = trace.get(name, step) if trace.has(name, step) else None
    return None if value is None else value[min(batch, value.shape[0] - 1), head].double()  # [B|1,H,n,t] -> [n,t]




def head_matrix(trace: Trace, name: str, step: int, batch: int, head: int) -> tuple[torch.Tensor | None, bool]:
    """One head's ``[n, t]`` of a ``[B, H, n, t]`` record: its kept value, else its pooled digest
    (second item True), else None."""
    rec = trace.record(name, step)
    value = trace.value(rec)
    if value is not None:
        return value[batch, head], False
    digest = pattern_digest(trace, rec)
    return (digest[batch, head], True) if digest is not None else (None, False)


def attention_latex(trace: Trace, step: int, layer: int) -> str:
    """The attention formula as this model computes it, in LaTeX: Vaswani et al.'s softmax(QKᵀ/√d_k + M) for a
    model with the usual scale; ``s·QKᵀ`` with the model's own scale; inside ``c·tanh(·/c)`` where it
    soft-caps its scores (Gemma 2). The constants follow the formula."""
    d_k = trace.record(act_name("q", layer), step).shape[-1]
    scale = score_scale(trace, d_k)
    usual = math.isclose(scale, d_k**-0.5, rel_tol=1e-6)
    scores = r"\frac{QK^\top}{\sqrt{d_k}}" if usual else r"s\,QK^\top"
    constants = [] if usual else [f"s = {scale:.4g}"]
    cap = getattr(trace.config, "attn_softcap", None)
    if cap:
        scores = rf"c\,\tanh\!\left({scores} / c\right)"
        constants.append(f"c = {cap:g}")
    tail = "".join(rf", \quad {c}" for c in constants)
    if trace.has(score_bias_name(layer), step):  # Inkling: a learned bias beside the mask
        scores = rf"{scores} + B"
    if getattr(trace.config, "attn_sinks", False):  # the sink's logit s_h is one more column; its weight is dropped
        return (rf"\left[A \;\middle|\; a_{{\text{{sink}}}}\right] = \operatorname{{softmax}}\!\left(\left["
                rf"{scores} + M \;\middle|\; s_h\right]\right), \qquad O = A\,V{tail}")
    return rf"A = \operatorname{{softmax}}\!\left({scores} + M\right), \qquad O = A\,V{tail}"


def attention_stages(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> list[Stage]:
    """QKᵀ, ÷√d_k, + M and softmax for one head, with the formula and the real shapes of each."""
    rope = trace.has(act_name("rot_q", layer), step)
    q = trace.record(act_name("rot_q" if rope else "q", layer), step).shape
    k = trace.record(act_name("k_all", layer), step).shape
    qk = trace.record(act_name("qk", layer), step).shape
    mask = trace.record(act_name("mask", layer), step).shape
    d_k = q[-1]
    kt = (*k[:-2], k[-1], k[-2])
    grouped = k[1] != q[1]
    share = f" ({q[1] // k[1]} query heads per K head)" if grouped else ""
    config = trace.config
    scale = getattr(config, "attn_scale", None)
    if scale is None or math.isclose(scale, d_k**-0.5, rel_tol=1e-6):
        scaled, scaling = "QKᵀ/√d_k", (f"QKᵀ / √d_k   (√{d_k} = {math.sqrt(d_k):.3f})",
                                        f"{shape_text(qk)} / {math.sqrt(d_k):.3f} → {shape_text(qk)}")
    else:  # the model's own scale (Gemma's query_pre_attn_scalar, Granite's attention_multiplier)
        scaled, scaling = "s·QKᵀ", (f"s·QKᵀ   (s = {scale:.4g})",
                                    f"× {scale:.4g}, the model's scale (1/√{d_k} = {d_k**-0.5:.4g}) → {shape_text(qk)}")
    stages = [
        Stage("qk", "QKᵀ", f"{shape_text(q)} @ {shape_text(kt)}{share} → {shape_text(qk)}", None),
        Stage("attn_scores", *scaling, None),
    ]
    if trace.has(act_name("softcapped", layer), step):
        cap = getattr(config, "attn_softcap", None)
        c = f"{cap:g}" if cap else "c"
        stages.append(Stage("softcapped", f"c·tanh({scaled}/c)   (c = {c})",
                            f"soft-capped: every score inside (−{c}, {c}) → {shape_text(qk)}", None))
        scaled = f"c·tanh({scaled}/c)"
    if trace.has(score_bias_name(layer), step):  # Inkling's learned bias, Bloom's ALiBi: beside the mask
        bias = trace.record(score_bias_name(layer), step).shape
        stages.append(Stage("score_bias", "B, the score bias", f"{score_bias_kind(trace)}: {shape_text(bias)}", None))
        scaled = f"{scaled} + B"
    stages.append(
        Stage("masked_scores", f"{scaled} + M", f"{shape_text(qk)} + {shape_text(mask)} → {shape_text(qk)}", None))
    if trace.has(act_name("sink_logits", layer), step):  # gpt-oss: the sink is a stage of its own
        sink = trace.record(act_name("sink_logits", layer), step).shape
        with_sink = (*qk[:-1], qk[-1] + 1)
        stages += [
            Stage("sink_logits", "s_h, the sink's logit", f"one learned logit per head, a column beside the scores: "
                                                          f"{shape_text(qk)} ++ {shape_text(sink)} → "
                                                          f"{shape_text(with_sink)}", None),
            Stage("pattern", f"A = softmax([{scaled} + M | s_h]) without the sink's column",
                  f"row-wise over t = {qk[-1]} keys and the sink, its column dropped → {shape_text(qk)}: rows sum "
                  "to < 1", None),
            Stage("sink_weight", "a_sink = 1 − Σ_t A", f"the sink's share of each row → {shape_text(sink)}", None),
        ]
    else:
        stages.append(Stage("pattern", f"A = softmax({scaled} + M)", f"row-wise over t = {qk[-1]} keys → "
                                                                     f"{shape_text(qk)}", None))
    for stage in stages:
        matrix, pooled = head_matrix(trace, stage_name(stage.hook, layer), step, batch, head)
        stage.matrix, stage.pooled_only = matrix, pooled
    return stages


def words_wrapped(text: str, width: int | None) -> str:
    """``text`` broken into lines of at most ``width`` characters at its spaces (plotly's ``<br>``); a word longer
    than the width keeps its own line. ``None``: unchanged."""
    if width is None:
        return text
    lines: list[str] = []
    for word in text.split(" "):
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(lines)


def shapes_line(shapes: str, width: int | None, wrap: bool) -> str:
    """A stage's shapes under its title: wrapped at the words to ``width``, else broken before its result and its
    note where ``wrap``, else one line."""
    if width is not None:
        return words_wrapped(shapes, width)
    return shapes.replace(" → ", "<br>→ ").replace(" (", "<br>(") if wrap else shapes


def missing_stage_note(trace: Trace, name: str, step: int) -> str:
    """What a Stages panel with no matrix says: a fused layer's stage that the app's Zoom can recompute (its Q and K
    kept), one it cannot (a shapes trace, or Q and K not kept), or a value not kept."""
    if can_recompute(trace, name, step):
        return "not formed:<br>the fused kernel ran<br>(the app's Zoom<br>recomputes any region)"
    if is_derived(trace, name, step):
        return "not formed:<br>the fused kernel ran,<br>and its Q and K<br>were not kept"
    return "values not kept"


@fitted
def attention_stages_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0,
                            shared_scale: bool = False) -> go.Figure:
    """Four heatmaps side by side (query rows × key columns), the formula and shapes above each (five where
    the model soft-caps its scores).

    Each stage has its own colour scale unless ``shared_scale``: then QKᵀ, ÷√d_k and + M share one, and
    the division by √d_k shows as what it is — the same picture, its colours √d_k times fainter."""
    stages = attention_stages(trace, step, layer, head, batch)
    xs, ys = key_labels(trace, step, batch, layer), query_labels(trace, step, batch, layer)
    # five panels (a soft-capped model), or a grouped model's longer QKᵀ line: the shapes line breaks before its
    # result (at 1280 px the grouped line ran into its neighbour's, issue 41)
    # a long prompt's shapes line too ("[1, 2, 32768, 64] @ [1, 2, 64, 32768] → …" ran into its neighbours at 1280)
    wrap = len(stages) > 4 or any(" query heads per K head)" in s.shapes or len(s.shapes) > 50 for s in stages)
    grids = {s.hook: grid(s.matrix, xs, ys, max_side=STAGE_SIDE) for s in stages if s.matrix is not None}
    # the weights' colours: 0 … 1, or where that would draw them all dark (a long row's weights are ~1/t),
    # stopped at the 99% quantile of the cells drawn, said under the panel's title and on its colour bar
    weights = weight_top(grids["pattern"].z) if "pattern" in grids else None
    clip_line = (f"<br>colours stop at {weights.top:.3g}, the {weights.share:.0%} quantile"
                 if weights is not None and weights.share is not None else "")
    # six or seven panels (a sink: gpt-oss, Inkling 2): a panel is ~150 px wide at 1600 px, and its one-line title
    # ran over its neighbours' (seen in a screenshot): each title and shapes line wraps at the words to fit
    # five with a sentence for a shapes line (Bloom's "ALiBi: a fixed slope per head …"): at 1280 px it ran into
    # its neighbours' lines (seen in a screenshot), so it wraps at the words too
    width = 132 // len(stages) if len(stages) > 5 else (
        30 if len(stages) == 5 and any(len(s.shapes) > 60 for s in stages) else None)
    titles = [f"<b>{words_wrapped(s.title, width)}</b><br><span style='font-size:10px'>"
              f"{shapes_line(s.shapes, width, wrap)}"
              f"{clip_line if s.hook == 'pattern' else ''}</span>"
              for s in stages]
    fig = subplots(rows=1, cols=len(stages), subplot_titles=titles, horizontal_spacing=0.075)
    score_values = [s.matrix[torch.isfinite(s.matrix)] for s in stages[:-1] if s.matrix is not None]
    lo = min((float(v.min()) for v in score_values if v.numel()), default=0.0)
    hi = max((float(v.max()) for v in score_values if v.numel()), default=1.0)
    poolings: dict[str, Pooling] = {}
    digests: list[str] = []
    # four or five panels in one row: in the app's page at 1280 px a panel is about 140 px wide, so at most 5
    # (4) columns carry numbers, short ones ("-22.9", "0.89"); 7 overlapped there (seen in a screenshot)
    numbers = {"numbers_up_to": 20 // len(stages), "number": short_number}
    for i, stage in enumerate(stages, start=1):
        if stage.matrix is None:
            # placed on the page (paper) at the middle of the panel's own domain: refs to an axis with no trace
            # were drawn over the last panel in the browser (seen in a screenshot at 32k tokens)
            left, right = fig.layout[f"xaxis{i if i > 1 else ''}"].domain
            fig.add_annotation(text=missing_stage_note(trace, stage_name(stage.hook, layer), step), showarrow=False,
                               x=(left + right) / 2, y=0.5, xref="paper", yref="paper")
            continue
        g = grids[stage.hook]
        name = STAGE_NAMES.get(stage.hook, stage.hook)
        if stage.pooled_only:  # block means: recomputed from Q and K where the fused kernel kept no pattern, else
            # evicted values' digest — said beside its own panel's pooling, not of every panel
            name += (" recomputed from Q and K" if is_derived(trace, stage_name(stage.hook, layer), step)
                     else ", a digest of evicted values")
            digests.append(name)
        poolings[name] = g.pooling  # what its means took in: one per panel
        right = fig.layout[f"xaxis{i if i > 1 else ''}"].domain[1]
        bar = {"x": right + 0.003, "len": 0.9, "thickness": 8, "nticks": 5, "tickfont": {"size": 9}, "xpad": 0}
        if stage.hook == "pattern":
            add(fig, g, "amount", row=1, col=i, colorbar="A", bar=bar, scale=weights, **numbers)
        elif shared_scale:
            top = max(abs(lo), abs(hi))
            last = len(stages) - 1  # the last score stage (+ M) carries the shared colour bar
            add(fig, g, "signed", row=1, col=i, zmin=-top, zmax=top, colorbar="score" if i == last else "",
                showscale=i == last, bar=bar, **numbers)
        else:
            add(fig, g, "signed", row=1, col=i, colorbar="score", bar=bar, **numbers)
        style_axes(fig, g, row=1, col=i, max_ticks=12, y_ticks=i == 1, x_title="key (t)")
    height = max(380, min(760, 220 + 16 * min(len(ys), 36)))  # room for the colour bars even with one row
    note = pooled_caption(poolings)
    # a digest drawn at its own size (not pooled, so not in the caption) still says what it is
    unpooled = [name for name in digests if not poolings[name].pooled]
    note = "; ".join([note] * bool(note) + unpooled)
    # the figure's title at the very top, above the subplot titles (four lines when wrapped: they reached it)
    # the right margin holds the weights' colour bar and its ticks ("≥0.00249" where clipped)
    margin_right = 75 if weights is not None and weights.clipped else 40
    # the note on lines of its own under the title: on one line it ran under plotly's toolbar and past the
    # figure's right edge at 1280 px (seen in a screenshot at 32k tokens)
    note_lines = textwrap.wrap(note, NOTE_WIDTH, break_on_hyphens=False, break_long_words=False) if note else []
    # the panels' titles stand in the top margin: words wrapped to a narrow panel take more lines than the 4 of a
    # wrapped shapes line (Inkling 2's seven panels: up to 10), each line ~15 px
    lines = max(title.count("<br>") + 1 for title in titles) if width else 0
    extra = max(0, 65 + 15 * lines - (155 if wrap else 95))
    margin_top = (155 if wrap else 95) + extra + (15 if clip_line else 0) + 15 * len(note_lines)
    total = height + extra + (20 if wrap else 0) + (15 if clip_line else 0) + 15 * len(note_lines)
    # plotly sets a title of several lines with its first line above "top" by the lines after it: the first line
    # ran under the toggle above the chart (seen in a screenshot of Inkling 2's stages), so it starts that much lower
    set_layout(fig, {"height": total, "margin": {"t": margin_top, "l": 10, "r": margin_right, "b": 10},
                     "title": {"text": f"layer {layer}, head {head}, step {step}" + " —" * bool(note_lines)
                                       + "".join(f"{NOTE_LINE[0]}{ln}{NOTE_LINE[1]}" for ln in note_lines),
                               "y": 1 - (5 + 15 * len(note_lines)) / total, "yref": "container", "yanchor": "top",
                               "font": {"size": 13}},
                     "annotations": [merged(a.to_plotly_json(), {"font": {"size": 12}})
                                     for a in fig.layout.annotations]})
    return fig


def one_line_title(fig: go.Figure) -> str:
    """The Stages figure's title as one line of text: its note's lines joined as the reader reads them."""
    return fig.layout.title.text.replace(NOTE_LINE[1], "").replace(NOTE_LINE[0], " ")


def query_attention_html(trace: Trace, step: int, layer: int, head: int, query: int, batch: int = 0) -> str:
    """The key tokens on the ``AMOUNT`` colour of the weight query row ``query`` gives them; the query's own
    token outlined in the accent; a legend. Token text is made inert."""
    try:  # the one row: sliced from a kept pattern, or recomputed from Q and K where it is derived
        row = attention_region(trace, act_name("pattern", layer), step, rows=(query, query + 1), heads=[head])
    except RegionError:
        row = None
    if row is None:
        return "<i>values not kept for this step</i>"
    weights = row[batch, 0, 0]  # [t]
    keys = key_labels(trace, step, batch, layer)
    # the query's own key column; none where its block's rows and columns are not the text's (BLT: own_stream)
    own = -1 if own_stream(trace, step, layer) is not None else len(keys) - positions(trace, step)[0] + query
    shown = keys_to_show(weights, own)
    spans, previous = [], -1
    for j in shown:
        if j > previous + 1:  # a gap: the keys between are not drawn
            spans.append(f"<span style='color: #888'> … {j - previous - 1:,} keys … </span>")
        w = float(weights[j])
        spans.append(amount_span(inert(keys[j].split(" · ", 1)[-1]), w, f"key {j}: weight {w:.3f}", outline=j == own))
        previous = j
    if previous < len(weights) - 1:
        spans.append(f"<span style='color: #888'> … {len(weights) - 1 - previous:,} keys</span>")
    note = ""
    if len(shown) < len(weights):  # a long row: a bounded page (32k spans crashed a browser tab)
        mass = float(weights[shown].double().sum())
        note = (f"<div style='font-size: 0.8rem; color: #555'>{len(shown):,} of the {len(weights):,} keys drawn: "
                f"the {QUERY_ROW_TOP} this query weighs most and the {min(QUERY_ROW_RECENT, own + 1)} up to "
                f"itself, together "
                f"{mass:.1%} of its weight; the Zoom view's query-row strip plots every key.</div>")
    return ("<div style='line-height: 2.1; font-family: monospace'>" + "".join(spans) + "</div>" + note
            + amount_legend("attention weight of each key", "the query itself"))


QUERY_ROW_LIMIT = 1024  # keys drawn one by one as tokens; past it, the top and the most recent ones only
QUERY_ROW_TOP, QUERY_ROW_RECENT = 64, 192


def keys_to_show(weights: torch.Tensor, own: int) -> list[int]:
    """The key positions a query's row draws as tokens, in order: every key of a row up to ``QUERY_ROW_LIMIT``;
    past it the ``QUERY_ROW_TOP`` heaviest keys and the ``QUERY_ROW_RECENT`` keys up to the query itself."""
    t = len(weights)
    if t <= QUERY_ROW_LIMIT:
        return list(range(t))
    top = torch.topk(weights.float(), QUERY_ROW_TOP).indices.tolist()
    recent = range(max(0, own - QUERY_ROW_RECENT + 1), own + 1)
    return sorted(set(top) | set(recent))


@fitted
def pattern_figure(g: Grid, title: str) -> go.Figure:
    fig = figure()
    add(fig, g, "amount", colorbar="A")
    style_axes(fig, g)
    fig.update_layout(title_text=title + (f" — {g.caption()}" if g.pooled else ""), title_font_size=13,
                      height=max(300, min(900, 140 + 16 * len(g.y))), margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


def attention_history(trace: Trace, layer: int, head: int, upto_step: int, batch: int = 0,
                      window: int | None = None) -> tuple[torch.Tensor, list[str], list[str], list[int]]:
    """The attention rows of steps 0…upto_step stacked into one [rows × keys] matrix.

    With the cache, step 0 gives the prefill's n₀ rows and every later step one
    more row, so the lower-triangular picture builds up token by token. Cells a
    row could not see are NaN (a step whose values were evicted leaves its rows blank).
    Only the last ``window`` rows and key columns are built (default ``HISTORY_WINDOW``): the matrix is
    sized by how many positions the trace claims, which a file may set to anything.
    Returns (matrix, row labels, key labels, step of each row)."""
    window = HISTORY_WINDOW if window is None else window
    all_keys = key_labels(trace, upto_step, batch)
    first_key = max(0, len(all_keys) - window)  # the window's first key column
    keys = all_keys[first_key:]
    t = len(keys)
    facts = facts_of(trace)
    is_token = position_is_token(trace, batch, upto_step)
    use_cache = facts.info.use_cache
    # how many rows each step adds, newest last: the window keeps the last `window` of them
    counts = [len(query_labels(trace, s, batch)) if s == 0 or use_cache else 1 for s in range(upto_step + 1)]
    skip = max(0, sum(counts) - window)
    rows: list[torch.Tensor] = []
    row_steps: list[int] = []
    row_labels: list[str] = []
    for s in range(upto_step + 1):
        if skip >= counts[s]:  # every row of this step is before the window
            skip -= counts[s]
            continue
        queries = query_labels(trace, s, batch)
        new = queries[-counts[s]:][skip:]
        skip = 0
        n_rows = len(queries)
        block = torch.full((len(new), t), math.nan)
        padding = [False] * len(new)
        try:  # only the rows shown: sliced from a kept pattern, or recomputed from Q and K where it is derived
            pattern = attention_region(trace, act_name("pattern", layer), s, rows=(n_rows - len(new), n_rows),
                                       heads=[head])
        except RegionError:
            pattern = None  # Q or K of a derived pattern not kept
        if pattern is not None:
            values = pattern[batch, 0].float()  # [new rows, t_s]
            t_s = values.shape[-1]
            positions = torch.arange(t_s - len(new), t_s)  # each new query's own key column
            seen = torch.arange(t_s)[None, :] <= positions[:, None]  # later keys: masked, or not there yet
            padding = [p < len(is_token) and not is_token[p] for p in positions.tolist()]
            seen &= ~torch.tensor(padding)[:, None]  # a padding position is no real query: its row stays blank
            shown = torch.where(seen, values, math.nan)[:, first_key:]
            block[:, : shown.shape[1]] = shown
        row_steps += [s] * len(new)
        row_labels += [f"s{s} · {label}" + (" (padding: no query)" if pad else "") for label, pad in zip(new, padding)]
        rows.append(block)
    return torch.cat(rows), row_labels, keys, row_steps


@fitted
def attention_history_figure(trace: Trace, layer: int, head: int, upto_step: int, batch: int = 0) -> go.Figure:
    matrix, ys, xs, row_steps = attention_history(trace, layer, head, upto_step, batch)
    g = grid(matrix, xs, ys)
    total = len(key_labels(trace, upto_step, batch))
    shown = f" (the last {len(xs):,} of {total:,} positions)" if len(xs) < total else ""
    fig = pattern_figure(g, f"rows of layer {layer} head {head} over steps 0…{upto_step}{shown}")
    first_new = row_steps.index(upto_step) if upto_step in row_steps else len(row_steps) - 1
    cells = len(g.y)
    top = min(cells - 1, first_new * cells // len(row_steps))
    fig.add_shape(type="rect", x0=-0.5, x1=len(g.x) - 0.5, y0=top - 0.5, y1=cells - 0.5,
                  line={"color": ACCENT, "width": 2})
    return fig


# -- every head ------------------------------------------------------------------------------------
PLOTLY_MIME = "application/vnd.plotly.v1+json"


@dataclass(frozen=True)
class HeadsGrid:
    figure: go.Figure
    note: str
    cells: tuple[int, int]  # rows and columns one head is drawn with

    def _repr_mimebundle_(self, include=None, exclude=None):
        """A notebook shows the grid's figure, not the wrapper, as it shows any plotly figure: the figure's own
        bundle, so it follows plotly's renderer setting (the inlined page of ``pio.renderers.default =
        "notebook"`` is what an HTML export keeps), and always plotly's JSON mime type, which JupyterLab,
        Notebook 7 and VS Code draw (offline: their plotly.js ships with them)."""
        bundle = dict(self.figure._repr_mimebundle_(include, exclude) or {})
        bundle.setdefault(PLOTLY_MIME, {**self.figure.to_plotly_json(), "config": {}})  # with no renderer set
        bundle["text/plain"] = (f"HeadsGrid({self.cells[0]} × {self.cells[1]} cells per head"
                                + (f"; {self.note})" if self.note else ")"))
        return bundle


@fitted
def all_heads_figure(trace: Trace, step: int, batch: int = 0, scores: dict[str, torch.Tensor] | None = None,
                     picked: tuple[int, int] | None = None) -> HeadsGrid:
    """Every layer × head attention pattern at ``step``, tiled into one heatmap (a browser lays out one
    heatmap in milliseconds, 144 subplots in seconds). Each head is pooled to fit ``GRID_CELLS`` in all;
    cells are square, so a causal triangle stays a triangle. Query heads that share a key/value head are
    bracketed; ``scores`` (name → [L, H]) are written under each head; ``picked`` is outlined. An invisible
    marker at each head's centre carries (layer, head), so a click can open it."""
    layers = trace.filter(step=step, name="*attn.hook_pattern")
    n_layer = len(layers)  # rows: the layers with attention (all of them but a hybrid model's state layers)
    row_layer = [int(rec.name.split(".")[1]) for rec in layers]  # row i shows layer row_layer[i]
    H = layers[0].shape[1]
    G = trace.record(act_name("k_all", row_layer[0]), step).shape[1]
    n, t = layers[0].shape[2], layers[0].shape[3]
    per_head = GRID_CELLS // max(1, n_layer * H)
    scale = min(1.0, math.sqrt(per_head / max(1, n * t)))
    rn = max(1, round(n * scale))
    stretch = -(-MIN_TILE_ROWS // rn) if rn < MIN_TILE_ROWS else 1  # a decode row is a band, not a hairline
    tall = rn * stretch
    # the stretched rows count against the budget too: a one-row head gets per_head / tall key columns
    rt = max(1, min(t, round(t * scale) if stretch == 1 else per_head // tall))
    rgap, cgap = max(1, tall // 8), max(1, rt // 8)
    tiles = torch.full((n_layer * (tall + rgap) - rgap, H * (rt + cgap) - cgap), math.nan)
    missing, pooled_any = 0, False
    for layer in range(n_layer):
        value, from_digest = None, False
        rec = layers[layer]
        full = trace.value(rec)
        if full is None:
            digest = pattern_digest(trace, rec)
            value, from_digest = (digest[batch], True) if digest is not None else (None, False)
        else:
            value = full[batch]
        if value is None:
            missing += 1
            continue
        r0 = layer * (tall + rgap)
        for head in range(H):
            m = value[head].double()
            if tuple(m.shape) != (rn, rt):
                m, pooled_any = pool(m, rn, rt), True
            c0 = head * (rt + cgap)
            tiles[r0:r0 + tall, c0:c0 + rt] = m.repeat_interleave(stretch, dim=0)
        pooled_any = pooled_any or from_digest
    z = tiles.to(torch.float32).numpy()
    colours = weight_top(z)  # 0 … 1, or stopped at the 99% quantile where a long prompt's weights (~1/t) are all dark
    fig = figure(go.Heatmap(z=z, colorscale=AMOUNT, zmin=0, zmax=colours.top, hoverinfo="skip",
                            colorbar={**colours.bar("A"), "thickness": 10}))
    centres_x, centres_y, data = [], [], []
    for row, layer in enumerate(row_layer):
        for head in range(H):
            centres_x.append(head * (rt + cgap) + (rt - 1) / 2)
            centres_y.append(row * (tall + rgap) + (tall - 1) / 2)
            text = f"L{layer} H{head}" + (f" (K/V head {head // (H // G)})" if G != H else "")
            if scores:
                text += "<br>" + "<br>".join(f"{k}: {float(v[layer, head]):.2f}" for k, v in scores.items())
            data.append([layer, head, text])
    fig.add_trace(go.Scatter(x=centres_x, y=centres_y, mode="markers", customdata=data, showlegend=False,
                             marker={"size": max(8, min(40, rt * 0.6)), "opacity": 0.0},
                             hovertemplate="%{customdata[2]}<extra>click to open</extra>"))
    shapes = []
    if G != H:  # brackets over the query heads that read one key/value head
        per = H // G
        for g in range(G):
            x0, x1 = g * per * (rt + cgap) - 0.5, ((g + 1) * per - 1) * (rt + cgap) + rt - 0.5
            shapes.append({"type": "line", "x0": x0, "x1": x1, "y0": -1.5, "y1": -1.5, "line": {"color": "#555"}})
            fig.add_annotation(x=(x0 + x1) / 2, y=-2, text=f"K/V head {g}", showarrow=False, yanchor="bottom",
                               font={"size": 10, "color": "#555"})
    if picked is not None and picked[0] in row_layer:
        layer, head = picked
        x0, y0 = head * (rt + cgap) - 0.5, row_layer.index(layer) * (tall + rgap) - 0.5
        shapes.append({"type": "rect", "x0": x0, "x1": x0 + rt, "y0": y0, "y1": y0 + tall,
                       "line": {"color": ACCENT, "width": 3}})
    if scores:  # each tile names its clearest role (a score of at least ROLE_SHOWN) inside its lower edge, not
        # in the gap below, where it would cover the next layer's tile; the hover lists them all
        for row, layer in enumerate(row_layer):
            for head in range(H):
                role, score = max(((k, float(v[layer, head])) for k, v in scores.items()), key=lambda kv: kv[1])
                if score >= ROLE_SHOWN:
                    fig.add_annotation(x=head * (rt + cgap) + (rt - 1) / 2, y=row * (tall + rgap) + tall - 0.5,
                                       text=f"{role} {score:.2f}", showarrow=False, yanchor="bottom",
                                       font={"size": 10, "color": "#111"}, bgcolor="rgba(255,255,255,0.8)")
    fig.update_layout(shapes=shapes, plot_bgcolor="white", margin={"t": 40, "l": 40, "r": 10, "b": 10},
                      height=int(min(1400, max(320, 90 + n_layer * (60 if tall <= 6 else 110)))))
    fig.update_xaxes(tickvals=[h * (rt + cgap) + (rt - 1) / 2 for h in range(H)], ticktext=[f"H{h}" for h in range(H)],
                     side="top", showgrid=False, zeroline=False)
    fig.update_yaxes(tickvals=[layer * (tall + rgap) + (tall - 1) / 2 for layer in range(n_layer)],
                     ticktext=[f"L{layer}" for layer in row_layer], autorange="reversed", showgrid=False,
                     zeroline=False)
    if tall == rn:  # square cells: one query row is as tall as one key column is wide
        fig.update_yaxes(scaleanchor="x", scaleratio=1)
    notes = []
    if pooled_any or (rn, rt) != (n, t):
        notes.append(f"each head pooled from {n} × {t} to {rn} × {rt} for the page")
    if tall != rn:
        notes.append(f"the {n} query row{'s' if n != 1 else ''} of each head drawn {stretch}× taller to be seen")
    if missing:
        notes.append(f"{missing} layer(s) have no kept values at this step")
    if colours.clipped:
        notes.append(colours.note())
    return HeadsGrid(fig, "; ".join(notes), (rn, rt))


# -- O = A·V -----------------------------------------------------------------------------------------
@fitted
def weighted_sum_figure(trace: Trace, step: int, layer: int, head: int, query: int, batch: int = 0
                        ) -> tuple[go.Figure, float] | None:
    """For one query row: the weights αᵢ, the value vectors vᵢ, each αᵢ·vᵢ, and their sum o = Σ αᵢ vᵢ —
    checked against the recorded O. Returns (figure, max |Σ αᵢvᵢ − O|) or None without values."""
    pattern = trace.get(act_name("pattern", layer), step)
    values = trace.get(act_name("v_all", layer), step)
    out = trace.get(act_name("z", layer), step)
    if pattern is None or values is None or out is None:
        return None
    alpha = pattern[batch, head, query].double()  # [t]
    v = values[batch, kv_head(trace, layer, head, step)].double()  # [t, d_head]
    scaled = alpha[:, None] * v  # [t, d_head]: each value vector times its weight
    o = scaled.sum(0)
    recorded = out[batch, head, query].double()
    delta = float((o - recorded).abs().max())
    keys = key_labels(trace, step, batch, layer)
    dims = [f"d{j}" for j in range(v.shape[1])]
    fig = subplots(rows=2, cols=3, column_widths=[0.06, 0.47, 0.47], row_heights=[0.88, 0.12],
                        shared_yaxes=False, horizontal_spacing=0.04, vertical_spacing=0.08,
                        subplot_titles=("αᵢ", "vᵢ (the value rows)", "αᵢ·vᵢ", "", "",
                                        f"o = Σᵢ αᵢ·vᵢ (recorded O differs by {delta:.1e})"))
    ga = grid(alpha[:, None], ["α"], keys)
    gv = grid(v, dims, keys)
    gs = grid(scaled, dims, keys)
    go_ = grid(o[None], dims, ["o"])
    add(fig, ga, "amount", row=1, col=1, showscale=False)
    add(fig, gv, "signed", row=1, col=2, colorbar="v")
    top = float(scaled.abs().max()) or 1.0
    add(fig, gs, "signed", row=1, col=3, zmin=-top, zmax=top, showscale=False)
    add(fig, go_, "signed", row=2, col=3, zmin=-top, zmax=top, showscale=False)
    style_axes(fig, ga, x_title="", y_title="key (t)", row=1, col=1)
    style_axes(fig, gv, x_title="", row=1, col=2, y_ticks=False)
    style_axes(fig, gs, x_title="", row=1, col=3, y_ticks=False)
    style_axes(fig, go_, x_title="d_head", y_title="", row=2, col=3)
    fig.update_xaxes(showticklabels=False, row=1, col=3)  # the row under it names the same d_head columns
    fig.update_traces(colorbar={"thickness": 8, "len": 0.6, "y": 0.6}, selector={"type": "heatmap"})
    fig.update_layout(height=max(360, min(900, 160 + 16 * len(ga.y))), margin={"t": 40, "l": 10, "r": 10, "b": 10})
    return fig, delta


# -- the pitfalls ÷√d_k and M prevent -----------------------------------------------------------------
def stages_takeaway(trace: Trace, step: int, layer: int, head: int, batch: int = 0
                    ) -> tuple[str, list[tuple[str, str]]] | None:
    """The Stages view's takeaway, from the head's recorded weights: where the last real query row puts most of
    its weight, and how many (query, key) pairs M hides; None when the weights were not kept."""
    pattern = trace.get(act_name("pattern", layer), step)
    mask = trace.get(act_name("mask", layer), step)
    if pattern is None:
        return None
    a = pattern[batch, head].double()  # [n, t]
    n, t = a.shape
    real = real_query_rows(trace, step, batch, n, layer)
    row = int(real.nonzero().max()) if bool(real.any()) else n - 1
    keys, queries = key_labels(trace, step, batch, layer), query_labels(trace, step, batch, layer)
    top = int(a[row].argmax())
    hidden = int((~torch.isfinite(mask[min(batch, mask.shape[0] - 1), 0])).sum()) if mask is not None else 0
    biased = "biased, " if trace.has(score_bias_name(layer), step) else ""  # Inkling: B is a stage of its own
    share = f"{float(a[row, top]):.3f}"  # one rounding for the sentence and the metric: 0.998 is not "100%"
    sentence = (f"Scores, scaled, {biased}masked, softmaxed: the last real query, {inert(queries[row])}, puts "
                f"{share} of its weight on key {inert(keys[top])}.")  # markdown: labels made inert
    return sentence, [("query rows × keys", f"{n} × {t}"), ("largest weight of that row", share),
                      ("pairs M hides", f"{hidden:,}")]


def score_bias_sentence(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> str | None:
    """What the learned score bias adds at this head (from ``hook_score_bias`` and ``hook_mask``): its range over the
    (query, key) pairs the mask lets through at this step's real query rows, and how many of them it leaves at 0 (keys
    beyond its reach); None for a model without a bias or without its values."""
    bias = score_bias(trace, step, layer, head, batch)
    mask = trace.get(act_name("mask", layer), step)
    if bias is None or mask is None:
        return None
    seen = torch.isfinite(mask[min(batch, mask.shape[0] - 1), 0])  # [n, t]
    seen &= real_query_rows(trace, step, batch, seen.shape[0], layer)[:, None]
    values = bias[seen]
    if not values.numel():
        return None
    zero = int((values == 0).sum())
    reach = " (keys beyond its reach)" if str(getattr(trace.config, "hf_model_type", "")).startswith("inkling") else ""
    return (f"This model adds a bias B to the scores beside the mask ({score_bias_kind(trace)}). In layer {layer}, "
            f"head {head}, over the {values.numel():,} (query, key) pairs the mask lets through, B ranges from "
            f"{float(values.min()):.3g} to {float(values.max()):.3g}; it is 0 at {zero:,} of them{reach}.")
