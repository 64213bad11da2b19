"""The causal mask: what M holds at a step, what it does to the scores, and why a cached decode step needs
(almost) none. Every count is read off the recorded mask, each −∞ cell attributed to its cause."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.common import (
    bidirectional,
    facts_of,
    gen_step,
    key_labels,
    position_is_token,
    prompt_sentence,
    query_labels,
    scores_formula,
    shape_text,
    stream_sentence,
)
from gpt_shape_tracer.figures.heatmap import add, grid, masked_layer, style_axes
from gpt_shape_tracer.figures.plot import figure, fitted, subplots
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import Trace

ALLOWED = "#e3f1e5"  # a cell M lets through (0); masked cells are the palette's MASKED grey

# a cause of −∞ (Reformer's LSH layers: shared queries and keys), for the mask's sentences
OWN_KEY = ("because the key is the query's own position (its queries and keys are one projection, as in Reformer's LSH "
           "attention: a position is hidden from itself wherever it has another key to see)")
MAX_LABELLED_COLUMNS = 40  # more key columns and a cell is too narrow for its "0" or "−∞"


@dataclass(frozen=True)
class MaskFacts:
    shape: tuple[int, ...]
    n: int
    t: int
    batch: int  # the sequence the counts are for (M has one block per sequence when padding needs it)
    counted: bool  # False: the mask's values were not kept, nothing below is counted
    masked: int  # −∞ cells in this sequence's n × t block
    future: int  # … because the key comes after the query
    padding_key: int  # … because the key is padding (and not after the query)
    window: int  # … because the key is further back than the sliding window
    unexplained: int  # … for none of these reasons (a bug if ever non-zero)
    padding_columns: tuple[int, ...]
    padding_rows: tuple[int, ...]  # query rows that are padding themselves
    use_cache: bool
    decode: bool  # a cached step with one new position
    sliding_window: int | None
    padding_side: str
    padding_rows_see: str = ""  # what the padding query rows may see, read from M ("" when not counted)
    smallest: int = 0  # cells holding the smallest finite float instead (transformers' rows that see nothing)
    indexer: int = 0  # … because an indexed layer's indexer did not choose the key (indexed / sparse attention)
    own: int = 0  # … because the key is the query's own position (shared queries and keys: Reformer's LSH layers)
    # compressed attention (DeepSeek-V4): the columns are a window's last rows, the new rows, then compressed entries
    # — not the positions 0 … t−1 — so no cell's cause is read from its column; how many cells are −∞ (−1: not that)
    compressed_masked: int = -1
    compressed_entries: int = 0  # … and how many of its last columns are compressed entries
    # a block whose rows and columns are not the text's positions (BLT's cross-attention, its global transformer
    # over patches: figures.common.own_stream): what they are, and how many keys each query row sees (fewest, most)
    stream: str = ""
    keys_seen: tuple[int, int] = (0, 0)
    cached_steps: bool = True  # False: the model has no cached step (BLT, traced without a cache)
    # a mask that is not causal (CPM-Ant: every position of a forward sees every other, its learned prompt positions
    # first): what its rows and columns are ("" for a causal model); its −∞ cells are counted with the keys each query
    # row sees (``keys_seen``), and no cell's cause is read from its place
    bidirectional: str = ""
    # padding key columns a real query after them may still see (XLM's causal mask leaves padding keys open: it
    # zeroes their hidden states instead), read from M
    padding_open: tuple[int, ...] = ()
    # whether the padding query rows' recorded weights spread evenly over the keys, as a softmax of equal scores
    # does (None: the pattern was not kept); OpenAI GPT's mask, −10⁴ after the query but the lowest float on padding
    # keys, puts theirs on the real keys after them instead
    padding_rows_even: bool | None = None

    def explanation(self) -> str:
        if self.stream and self.counted:
            fewest, most = self.keys_seen
            return (f"M has shape {shape_text(self.shape)}: n = {self.n} query row(s) × t = {self.t} key column(s). "
                    f"{self.stream} {self.masked} of {self.n * self.t} entries are −∞ and the rest are 0: each query "
                    + (f"row sees {fewest} key(s)" if fewest == most else f"row sees between {fewest} and {most} keys")
                    + ", as this block's own mask says (the model builds it; no cause is read from a cell's place).")
        if self.bidirectional and self.counted:
            return bidirectional_sentence(self)
        if self.compressed_masked >= 0:
            return compressed_mask_sentence(self.n, self.t, self.compressed_masked, self.compressed_entries)
        if not self.counted:
            return (f"M has shape {shape_text(self.shape)}: n = {self.n} query row(s) × t = {self.t} key column(s). "
                    "Its values were not kept (capture “shapes”, or evicted by the budget), so its entries are not "
                    "counted here.")
        whose = f"In sequence {self.batch}'s n × t block, " if self.shape[0] > 1 else ""
        lines = [f"M has shape {shape_text(self.shape)}: n = {self.n} query row(s) × t = {self.t} key column(s). "
                 f"{whose}{self.masked} of {self.n * self.t} entries are −∞ (they get exactly zero weight after "
                 "the softmax, since e^−∞ = 0)"
                 + (f", {self.smallest} hold the smallest finite number instead (the padding rows below)"
                    if self.smallest else "") + " and the rest are 0."]
        causes = [f"{self.future} because the key comes after the query (causality)" if self.future else "",
                  f"{self.padding_key} because the key is padding" if self.padding_key else "",
                  f"{self.window} because the key lies more than the sliding window of {self.sliding_window} "
                  "positions back" if self.window else "",
                  f"{self.indexer} because the layer's indexer did not choose the key (indexed attention: each query "
                  "attends only to the keys its indexer ranks highest)" if self.indexer else "",
                  f"{self.own} {OWN_KEY}" if self.own else "",
                  f"{self.unexplained} for no reason this view knows (please report it)" if self.unexplained else ""]
        causes = [c for c in causes if c]
        if causes:
            lines.append("Of the −∞ entries: " + "; ".join(causes) + ".")
        if self.decode:
            reasons = []
            if self.padding_key:
                reasons.append("padding columns")
            if self.window:
                reasons.append("keys outside the sliding window")
            if self.indexer:
                reasons.append("keys the indexer did not choose")
            if self.own:
                reasons.append("the query's own key")
            verb = "is" if reasons == ["the query's own key"] else "are"
            rest = f" — only {' and '.join(reasons)} {verb} −∞" if reasons else ""
            lines.append(
                f"This is a decode step with the KV cache: the only query is the newest position, t − 1 = "
                f"{self.t - 1}. Every key 0 … {self.t - 1} is at or before it, so causality masks nothing here{rest}. "
                "That is why a cached step need not build the triangular mask: the one row it computes is the "
                f"last row of the full mask, and causality leaves that row open. Q is [.., 1, d_head], Kᵀ is "
                f"[.., d_head, {self.t}], and QKᵀ is one row of {self.t} scores.")
        elif self.n > 1:
            lines.append(
                f"A pass over n = {self.n} positions: row i may only see keys j ≤ i, so the {self.future} cells "
                "above the diagonal are −∞"
                + (f" (and {self.own} on it: each row's own key, {OWN_KEY.removeprefix('because the key is ')})"
                   if self.own else "")
                + (f", and so are the {self.padding_key} cells of padding keys at or before their query: each real "
                   f"row i of sequence {self.batch} weighs only its real keys up to i." if self.padding_key else "."))
            if not self.use_cache and self.cached_steps:
                lines.append("Without the cache every step recomputes all rows; only the last row is new, and its "
                             "causal part is all zeros — exactly the one row a cached step computes.")
        if self.padding_columns:
            cols = ", ".join(map(str, self.padding_columns[:12])) + (" …" if len(self.padding_columns) > 12 else "")
            shut = [j for j in self.padding_columns if j not in self.padding_open]
            if not self.padding_open:
                lines.append(f"Key column(s) {cols} of sequence {self.batch} are padding: −∞ for every real query.")
            else:
                open_ = ", ".join(map(str, self.padding_open[:12])) + (" …" if len(self.padding_open) > 12 else "")
                lines.append(f"Key column(s) {cols} of sequence {self.batch} are padding, but this model's mask "
                             f"leaves column(s) {open_} open to the real queries at or after them (0, not −∞): "
                             "they get weight" + (f"; {len(shut)} other(s) are −∞ for every real query." if shut
                                                  else "."))
        if self.padding_rows:
            rows = ", ".join(map(str, self.padding_rows[:12])) + (" …" if len(self.padding_rows) > 12 else "")
            if self.padding_rows_see == "nothing":  # transformers' mask: the row holds the smallest float, not −∞
                spread = ("so its softmax spreads evenly over all keys" if self.padding_rows_even else
                          "yet the recorded weights of such a row do not spread evenly (the model's own scores "
                          "before its mask differ where M shows one value)" if self.padding_rows_even is False else
                          "so a softmax of M alone would spread evenly over all keys (the weights were not kept)")
                lines.append(f"Query row(s) {rows} are padding themselves: the model's mask hides every key from "
                             f"such a row with the smallest finite number instead of −∞, {spread}; its output is "
                             "never used.")
            else:
                sees = {"itself": "itself only",
                        "before": "the real tokens before it and itself (its output is never used)"}.get(
                    self.padding_rows_see, "some keys")
                lines.append(f"Query row(s) {rows} are padding themselves: such a row may see {sees}, so that its "
                             "softmax has at least one finite score.")
        return "\n\n".join(lines)


def mask_facts(trace: Trace, step: int, layer: int = 0, batch: int = 0) -> MaskFacts:
    rec = trace.record(act_name("mask", layer), step)
    facts = facts_of(trace)
    forward = gen_step(trace, step).forward
    mask = trace.value(rec)
    n, t = rec.shape[-2], rec.shape[-1]
    config = trace.config
    window = getattr(config, "sliding_window", None) if config is not None else None
    stream = stream_sentence(trace, step, layer)
    # CPM-Ant: no causal mask, every position of a forward seeing every other (its learned prompt positions first)
    open_mask = "" if stream is not None or not bidirectional(trace) else (
        prompt_sentence(trace, step) or "This model's mask lets every position of a forward see every other.")
    if stream is not None or open_mask:  # BLT's cross-attention, its patches: rows and columns of its own streams
        own = MaskFacts(shape=rec.shape, n=n, t=t, batch=batch, counted=False, masked=-1, future=0, padding_key=0,
                        window=0, unexplained=0, padding_columns=(), padding_rows=(), use_cache=facts.info.use_cache,
                        decode=False, sliding_window=None, padding_side=facts.info.padding_side, stream=stream or "",
                        cached_steps=False, bidirectional=open_mask)
        if mask is None:
            return own
        values = mask[min(batch, mask.shape[0] - 1), 0]  # [n, t]
        # CPM-Ant: a row that sees no key holds the smallest finite number (read so from its −∞ row, whose weights
        # the model sets to 0 after the softmax): it sees none
        lowest = torch.finfo(values.dtype).min / 2 if values.is_floating_point() and open_mask else -math.inf
        seen = (torch.isfinite(values) & (values > lowest)).sum(-1)
        return replace(own, counted=True, masked=int(torch.isinf(values).sum()),
                       smallest=int((torch.isfinite(values) & (values <= lowest)).sum()),
                       keys_seen=(int(seen.min()), int(seen.max())))
    real = position_is_token(trace, batch, step)  # the t key columns this step saw
    compressed = len(real) != t  # columns that are not the positions 0 … t−1 (compressed attention: a window's
    # rows, then compressed entries; model/sources/_hf_compressed.py): no cause can be read from a column's position
    if compressed:
        real = (True,) * t
    pad_cols = tuple(j for j in range(t) if not real[j])
    first_query = t - n
    pad_rows = tuple(i for i in range(n) if not real[first_query + i])
    use_cache = facts.info.use_cache
    uncounted = MaskFacts(shape=rec.shape, n=n, t=t, batch=batch, counted=False, masked=-1, future=-1,
                          padding_key=-1, window=-1, unexplained=-1, padding_columns=pad_cols, padding_rows=pad_rows,
                          use_cache=use_cache, decode=use_cache and step > 0 and forward.n == 1,
                          sliding_window=window, padding_side=facts.info.padding_side,
                          cached_steps=not getattr(config, "block_paths", ()))
    if mask is None:
        return uncounted
    values = mask[min(batch, mask.shape[0] - 1), 0]  # [n, t]
    if compressed:
        entries = f"blocks.{layer}.attn.hook_compressed_kv_all"  # model/sources/_hf_compressed.py's record
        return replace(uncounted, compressed_masked=int(torch.isinf(values).sum()),
                       compressed_entries=trace.record(entries, step).shape[2] if trace.has(entries, step) else 0)
    block = torch.isinf(values)
    smallest = int((torch.isfinite(values) & (values <= torch.finfo(values.dtype).min / 2)).sum()) \
        if values.is_floating_point() else 0
    query = torch.arange(first_query, t)[:, None]
    key = torch.arange(t)[None, :]
    future = key > query
    padding = torch.tensor([not r for r in real])[None, :].expand(n, t) & ~future
    if window is None and config is not None and config.block_paths:  # BLT: each list of layers
        window = _window_in(block, ~future & ~padding, query - key)  # has its own window (its patcher's), read off M
        uncounted = replace(uncounted, sliding_window=window)
    outside = (key <= query - window) & ~future & ~padding if window else torch.zeros_like(future)
    visible, selected = (trace.get(act_name(name, layer), step) if trace.has(act_name(name, layer), step) else None
                         for name in ("index_visible", "index_selected"))
    skipped = (visible[min(batch, visible.shape[0] - 1)] & ~selected[min(batch, selected.shape[0] - 1)]
               & ~future & ~padding & ~outside) if visible is not None and selected is not None \
        else torch.zeros_like(future)  # [n, t]: visible keys an indexed layer's indexer did not choose
    own_key = (key == query) & ~future & ~padding & ~outside & ~skipped  # Reformer's LSH: a query's own key
    explained = future | padding | outside | skipped | own_key
    real_rows = [i for i in range(n) if real[first_query + i]]
    padding_open = tuple(j for j in pad_cols if any(not bool(block[i, j]) and j <= first_query + i
                                                    for i in real_rows))
    pattern = trace.get(act_name("pattern", layer), step) if pad_rows and trace.has(act_name("pattern", layer),
                                                                                    step) else None
    even = None if pattern is None else bool(torch.allclose(
        pattern[min(batch, pattern.shape[0] - 1)][:, list(pad_rows)].double(), torch.full((), 1 / t).double(),
        atol=1e-4, rtol=0))
    return replace(uncounted, counted=True, masked=int(block.sum()), future=int((block & future).sum()),
                   padding_open=padding_open, padding_rows_even=even,
                   padding_key=int((block & padding).sum()), window=int((block & outside).sum()),
                   indexer=int((block & skipped).sum()), own=int((block & own_key).sum()),
                   unexplained=int((block & ~explained).sum()), smallest=smallest,
                   padding_rows_see=_padding_rows_see(values, pad_rows, first_query))


def _window_in(block: torch.Tensor, eligible: torch.Tensor, back: torch.Tensor) -> int | None:
    """The sliding window a mask keeps, read off it: w where, among the earlier real keys (``eligible`` [n, t]: not
    after the query, not padding), the −∞ ones (``block``) are exactly those w or more positions back from their
    query (``back``); None where none is hidden, or where the hidden ones are no such band."""
    hidden = block & eligible
    if not bool(hidden.any()):
        return None
    w = int(back[hidden].min())
    return w if bool((hidden == ((back >= w) & eligible)).all()) else None


def bidirectional_sentence(facts: MaskFacts) -> str:
    """What M says at a model whose mask is not causal (CPM-Ant), from its counted cells: the keys each query row sees,
    the ones after it included, and why a cached step cannot keep a row of it."""
    fewest, most = facts.keys_seen
    sees = (f"every query row sees all {facts.t} keys" if fewest == most == facts.t else
            f"each query row sees {fewest} key(s)" if fewest == most else
            f"each query row sees between {fewest} and {most} keys")
    smallest = (f", {facts.smallest} hold the smallest finite number instead (rows that see no key: their weights "
                "are set to 0 after the softmax)" if facts.smallest else "")
    return (f"M has shape {shape_text(facts.shape)}: n = {facts.n} query row(s) × t = {facts.t} key column(s). "
            f"{facts.bidirectional}\n\n{facts.masked} of {facts.n * facts.t} entries are −∞{smallest} and the rest "
            f"are 0: {sees}, those after it included, as the model's own mask says (it builds it; no cell is hidden "
            "for coming after its query).\n\nWithout a cache every step recomputes every row, and a new token changes "
            "the rows of the positions before it too, since they see it: there is no row a cached step could keep "
            "as it was.")


def compressed_mask_sentence(n: int, t: int, masked: int, entries: int) -> str:
    """What M says at a layer whose cache keeps a sliding window's rows (and, ``entries`` > 0, compressed entries
    after them: DeepSeek-V4): its columns are no positions, so no cell's cause is counted, only the −∞ cells."""
    kept = t - n - entries
    columns = (f"the cache's last {kept} row(s) of a sliding window and the {n} new row(s)"
               + (f", then {entries} compressed entries (each pooling several positions)" if entries else ""))
    why = ("a row after the query or out of its window" + (", or an entry the query may not read (its positions not "
                                                          "all before the query, or not chosen by the indexer)"
                                                          if entries else ""))
    return (f"M is n = {n} query row(s) × t = {t} key column(s): {columns}, not the positions 0 … t−1. {masked} of "
            f"{n * t} entries are −∞: {why}.")


def _padding_rows_see(values: torch.Tensor, rows: tuple[int, ...], first_query: int) -> str:
    """What the padding query rows of M ``[n, t]`` may see, from the numbers: "itself", "before" (real keys
    before it and itself), "nothing" (no key above the smallest float: transformers' mask) or "other"."""
    if not rows:
        return ""
    smallest = torch.finfo(values.dtype).min / 2 if values.is_floating_point() else -1
    kinds = set()
    for i in rows:
        seen = torch.nonzero((values[i] > smallest) & torch.isfinite(values[i])).flatten().tolist()
        kinds.add("nothing" if not seen else "itself" if seen == [first_query + i] else
                  "before" if seen[-1] == first_query + i else "other")
    return kinds.pop() if len(kinds) == 1 else "other"


@fitted
def mask_figure(trace: Trace, step: int, layer: int = 0, batch: int = 0) -> go.Figure:
    """M as a 0 / −∞ picture (query rows × key columns): grey where −∞. A cell holding the smallest finite float
    (transformers' padding rows that see nothing: their softmax spreads evenly) is drawn as allowed, labelled
    "min", since it does get weight."""
    mask = trace.get(act_name("mask", layer), step)
    xs, ys = key_labels(trace, step, batch, layer), query_labels(trace, step, batch, layer)
    fig = figure()
    if mask is None:
        fig.add_annotation(text="mask values not kept for this step", showarrow=False)
        return fig
    block = mask[min(batch, mask.shape[0] - 1), 0]
    lowest = torch.finfo(block.dtype).min / 2 if block.is_floating_point() else -math.inf
    # 0 where allowed, −∞ where masked: pooled, a cell is allowed (0) when any cell of its block is — the −∞
    # ones are left out of its mean, and the caption reads that from the pooling
    allowed = torch.where(torch.isinf(block), torch.full_like(block, -math.inf), torch.zeros_like(block))
    g = grid(allowed, xs, ys)
    n, t = block.shape
    small = n * t <= 900  # few enough cells to carry each one's value in the hover text
    labelled = small and t <= MAX_LABELLED_COLUMNS  # wide enough cells to write it in: else the labels merge
    under = masked_layer(g)
    if under is not None:
        fig.add_trace(under)
    fig.add_trace(go.Heatmap(
        z=g.z, x=g.x, y=g.y, zmin=0, zmax=1, colorscale=[[0, ALLOWED], [1, ALLOWED]], showscale=False,
        text=[["−∞" if math.isinf(v) else "min" if v <= lowest else "0" for v in row] for row in block.tolist()]
        if small else None,
        texttemplate="%{text}" if labelled else None, hoverongaps=True,
        hovertemplate="q %{y}<br>k %{x}<br>M = " + ("%{text}" if small else "0" if not bool((block <= lowest).any())
                                                    else "0, or the smallest float in a row that sees nothing")
        + "<extra></extra>",
        xgap=1, ygap=1,
    ))
    style_axes(fig, g)
    fig.update_layout(title_text=f"M at step {step}: {shape_text(tuple(mask.shape))} — green: 0 (may attend), "
                                 "grey: −∞ (masked)" + (f" — {g.caption()}" if g.pooled else ""),
                      title_font_size=13,
                      height=max(260, min(800, 130 + 20 * len(g.y))), margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


@fitted
def scores_before_after_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> go.Figure:
    """The scores (QKᵀ/√d_k, or as this model computes them) before and after adding M, for one head, on one
    colour scale."""
    before_name = act_name("softcapped" if trace.has(act_name("softcapped", layer), step) else "attn_scores", layer)
    before = trace.get(before_name, step)
    after = trace.get(act_name("masked_scores", layer), step)
    xs, ys = key_labels(trace, step, batch, layer), query_labels(trace, step, batch, layer)
    formula = scores_formula(trace, trace.record(act_name("q", layer), step).shape[-1])
    fig = subplots(rows=1, cols=2, subplot_titles=(f"before: {formula}", f"after: {formula} + M  (−∞ grey)"))
    if before is None or after is None:
        fig.add_annotation(text="score values not kept for this step", showarrow=False)
        return fig
    b, a = before[batch, head], after[batch, head]
    finite = b[torch.isfinite(b)]
    top = float(finite.abs().max()) if finite.numel() else 1.0
    gb, ga = grid(b, xs, ys), grid(a, xs, ys)
    add(fig, gb, "signed", row=1, col=1, zmin=-top, zmax=top, showscale=False)
    add(fig, ga, "signed", row=1, col=2, zmin=-top, zmax=top, colorbar="score")
    style_axes(fig, gb, row=1, col=1, max_ticks=24)
    style_axes(fig, ga, row=1, col=2, max_ticks=24, y_ticks=False)
    fig.update_layout(height=max(280, min(800, 130 + 18 * len(gb.y))), margin={"t": 60, "l": 10, "r": 10, "b": 10})
    return fig
