"""Indexed (sparse) attention, seen per step: which keys each query could see (the causal / padding mask), which of
them its layer's learned indexer chose — the only keys the softmax weighs — what the indexer scored, and the key
cache it keeps beside K and V (DeepSeek-AI 2025, "DeepSeek-V3.2": DeepSeek Sparse Attention; GLM-5, Qwen4-Exp's
block-wise QSA). Read from the records ``blocks.{L}.attn.hook_index_*`` (model/sources/_hf_indexer.py); every
number a sentence states is counted here from them."""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.cache import held_bytes
from gpt_shape_tracer.figures.common import key_labels, query_labels, shape_text
from gpt_shape_tracer.figures.heatmap import add, grid, style_axes
from gpt_shape_tracer.figures.plot import fitted, subplots
from gpt_shape_tracer.figures.view_takeaways import size_text
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import Trace


@dataclass(frozen=True)
class IndexerStep:
    """One indexed layer at one step, for sequence ``batch``: ``visible`` and ``selected`` ``[n, t]`` (bool),
    ``scores`` ``[n, t]`` where the indexer's scores were recorded (a DSA indexer; a QSA indexer scores blocks of
    keys), the bytes of the layer's cache (K and V, or what latent attention holds) and of the indexer's keys (all
    B sequences, None without a cache), and whether the layer ran an indexer of its own."""

    layer: int
    step: int
    batch: int
    visible: torch.Tensor
    selected: torch.Tensor
    scores: torch.Tensor | None
    kv_bytes: int
    key_bytes: int | None
    key_shape: tuple[int, ...] | None
    own: bool

    @property
    def n(self) -> int:
        return int(self.visible.shape[0])

    @property
    def t(self) -> int:
        return int(self.visible.shape[1])

    @property
    def seen(self) -> int:
        return int(self.visible.sum())

    @property
    def chosen(self) -> int:
        return int(self.selected.sum())

    @property
    def most_chosen(self) -> int:
        """The most keys any one query attends to at this step."""
        return int(self.selected.sum(dim=-1).max()) if self.n else 0


def indexed_layers(trace: Trace, step: int) -> list[int]:
    """The layers whose attention is indexed at ``step`` (they recorded which keys their indexer chose)."""
    config = trace.config
    layers = range(config.n_layer) if config is not None else ()
    return [L for L in layers if trace.has(act_name("index_selected", L), step)]


def indexer_step(trace: Trace, step: int, layer: int, batch: int = 0) -> IndexerStep | None:
    """The indexed layer ``layer`` at ``step`` (None where it is not indexed or its choice was not kept)."""
    visible, selected = (trace.get(act_name(name, layer), step) if trace.has(act_name(name, layer), step) else None
                         for name in ("index_visible", "index_selected"))
    if visible is None or selected is None:
        return None
    b = min(batch, visible.shape[0] - 1)
    scores_name = act_name("index_scores", layer)
    scores = trace.get(scores_name, step) if trace.has(scores_name, step) else None
    keys_name = act_name("index_keys_all", layer)
    keys = trace.record(keys_name, step) if trace.has(keys_name, step) else None
    own = scores is not None or keys is not None
    return IndexerStep(layer, step, b, visible[b].bool(), selected[b].bool() & visible[b].bool(),
                       scores[b].float() if scores is not None else None, held_bytes(trace, step, layer),
                       keys.nbytes if keys is not None else None, tuple(keys.shape) if keys is not None else None, own)


def selection_sentence(s: IndexerStep) -> str:
    """What the indexer chose at this step, counted from the records."""
    skipped = s.seen - s.chosen
    if s.n == 1:
        sentence = (f"The new query could see {s.seen} key{'s' if s.seen != 1 else ''}; the indexer chose "
                    f"{s.chosen} of them for the softmax and skipped {skipped}")
        sentence += (" — every key it could see: fewer are visible than it may choose." if skipped == 0 else
                     ", which get exactly zero weight (M is −∞ there).")
    else:
        share = s.chosen / s.seen if s.seen else 0.0
        sentence = (f"Over the {s.n} query rows the mask lets the indexer see {s.seen} (query, key) pairs; it chose "
                    f"{s.chosen} ({share:.0%}) and skipped {skipped}, which get exactly zero weight. No query attends "
                    f"to more than {s.most_chosen} key{'s' if s.most_chosen != 1 else ''}.")
    if not s.own:
        sentence += (" This layer runs no indexer of its own: it applies the choice an earlier layer's indexer "
                     "made for these queries.")
    return sentence


def cache_sentence(s: IndexerStep) -> str | None:
    """The two caches this layer holds after the step (None without the indexer's key cache)."""
    if s.key_bytes is None or s.key_shape is None:
        return None
    sentence = (f"After this step layer {s.layer}'s cache holds {size_text(s.kv_bytes)} for its attention and, beside "
                f"it, the indexer's own keys {shape_text(s.key_shape)}: {size_text(s.key_bytes)}")
    if s.kv_bytes:
        sentence += f", {s.key_bytes / s.kv_bytes:.0%} on top."
    else:
        sentence += "."
    return sentence + " Both grow by one row per position."


@fitted
def selection_figure(trace: Trace, s: IndexerStep) -> go.Figure:
    """Two panels, query rows × key columns: the indexer's scores (DSA; grey where the mask hides the key) and its
    choice — 1 where the query attends to the key, 0 where it could see it but the indexer skipped it, grey where
    the mask hid it. Pooled, a cell of the choice is the share chosen of its block's keys."""
    xs, ys = key_labels(trace, s.step, s.batch), query_labels(trace, s.step, s.batch)
    choice = torch.where(s.visible, s.selected.float(), torch.full_like(s.selected, float("nan"), dtype=torch.float32))
    titles = ("indexer scores (grey: masked)" if s.scores is not None else
              "scores not recorded (it scores blocks of keys)",
              "chosen: 1 attended, 0 skipped")
    fig = subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=0.08)
    if s.scores is not None:
        shown = torch.where(s.visible, s.scores, torch.full_like(s.scores, float("nan")))
        gs = grid(shown, xs, ys)
        add(fig, gs, "signed", row=1, col=1, colorbar="score", bar={"x": 0.45})
        style_axes(fig, gs, row=1, col=1)
    gc = grid(choice, xs, ys)
    add(fig, gc, "amount", row=1, col=2, colorbar="chosen")
    style_axes(fig, gc, row=1, col=2, y_ticks=s.scores is None)
    fig.update_layout(title_text=f"Layer {s.layer}, step {s.step}: each query attends only to the keys its indexer "
                                 f"chose ({s.chosen} of {s.seen} visible)", title_font_size=13,
                      height=max(300, min(800, 140 + 20 * len(gc.y))), margin={"t": 70, "l": 10, "r": 10, "b": 10})
    return fig
