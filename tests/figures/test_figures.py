"""Every figure builder, without Streamlit: each view's data is the traced data, and each sentence it writes
holds for the data it is about (prefill and decode, cache on and off, padding, grouped-query models)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from html import unescape

import numpy as np
import pytest
import torch

from gpt_shape_tracer.figures import (
    attention,
    cache,
    flow,
    heatmap,
    inspector,
    mask,
    pitfalls,
    rope,
    tokens,
    whatif,
    worked,
)
from gpt_shape_tracer.figures.common import key_labels, query_labels, safe_text
from gpt_shape_tracer.figures.palette import ACCENT
from gpt_shape_tracer.model import GPT, GPTConfig, apply_rope, rope_cos_sin
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import PathCost, RecomputeComparison, pattern_digest
from gpt_shape_tracer.tracer.generation._traced import TracedGeneration

PROMPT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(autouse=True)
def plotly_checks_every_property(monkeypatch):
    """Here every figure is built with plotly's checks (a misspelt property raises); the app and the AppTest
    tests build them unchecked, and the last test below shows that changes nothing that is sent."""
    from gpt_shape_tracer.figures.plot import VALIDATE_ENV

    monkeypatch.setenv(VALIDATE_ENV, "1")


@pytest.fixture(scope="module")
def gen(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, PROMPT, temperature=0.8, top_k=30, seed=3, capture="ops")
    g.run(4)
    return g


def z_tensor(z) -> torch.Tensor:
    """A heatmap's z (a float32 array, or nested lists with None) as float64 with NaN for the gaps."""
    if isinstance(z, np.ndarray):
        return torch.from_numpy(z.astype(np.float64))
    return torch.tensor([[math.nan if v is None else v for v in row] for row in z], dtype=torch.float64)


def same(z, expected: torch.Tensor) -> bool:
    """Plotly z (None for ±∞) equals the tensor to the five significant digits a figure sends, with every
    infinite entry drawn as a gap."""
    got = z_tensor(z)
    exp = expected.double()
    gaps = ~torch.isfinite(exp)
    return bool(torch.isnan(got[gaps]).all()) and torch.allclose(got[~gaps], exp[~gaps], rtol=1e-4, atol=1e-9)


def values(fig) -> list:
    """The heatmaps that carry values (not the grey masked layers under them)."""
    return [d for d in fig.data if d.type == "heatmap" and d.hoverinfo != "skip"]


# -- heatmaps -------------------------------------------------------------------------------------------
def test_a_large_matrix_is_pooled_to_block_means_without_its_masked_cells():
    m = torch.arange(600 * 300, dtype=torch.float64).reshape(600, 300)
    m[:, 200:] = -math.inf  # masked columns
    g = heatmap.grid(m, [str(j) for j in range(300)], [str(i) for i in range(600)])
    z = z_tensor(g.z)
    assert len(g.y) <= heatmap.MAX_SIDE and len(g.x) <= heatmap.MAX_SIDE and g.pooled
    rows = heatmap._ranges(600, len(g.y))
    cols = heatmap._ranges(300, len(g.x))
    for i in (0, 57, len(rows) - 1):
        for j in (0, 100, len(cols) - 1):
            block = m[rows[i][0]:rows[i][1], cols[j][0]:cols[j][1]]
            finite = block[torch.isfinite(block)]
            expected = float(finite.mean()) if finite.numel() else math.nan
            assert (math.isnan(expected) and math.isnan(float(z[i, j]))) or math.isclose(float(z[i, j]), expected,
                                                                                        rel_tol=1e-4)
    assert "600 × 300" in g.caption() and g.x[0] == "0…1"


def test_small_heatmaps_write_their_numbers_and_large_ones_do_not():
    small = heatmap.heatmap(heatmap.grid(torch.ones(12, 12) / 3, ["k"] * 12, ["q"] * 12), "amount")
    assert small.text[0][0] == "0.333" and small.texttemplate == "%{text}"
    big = heatmap.heatmap(heatmap.grid(torch.ones(13, 12), ["k"] * 12, ["q"] * 13), "amount")
    assert big.text is None


# -- attention -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("step", [0, 3])
def test_attention_stages_figure_shows_the_four_traced_stages(gen, step):
    t = gen.trace
    fig = attention.attention_stages_figure(t, step, layer=2, head=1)
    maps = values(fig)
    assert len(maps) == 4
    for hm, hook in zip(maps, attention.STAGES):
        assert same(hm.z, t.get(f"blocks.2.attn.hook_{hook}", step)[0, 1]), hook
    n0 = gen.info.prompt_lengths[0]
    n, n_keys = (n0, n0) if step == 0 else (1, n0 + step)
    assert len(maps[3].z) == n and len(maps[3].z[0]) == n_keys
    titles = [a.text for a in fig.layout.annotations]
    assert any(f"[1, 4, {n}, 32] @ [1, 4, 32, {n_keys}] → [1, 4, {n}, {n_keys}]" in text for text in titles)
    assert any("√32 = 5.657" in text for text in titles)
    assert fig.layout.height >= 380  # room for a readable colour bar even with one query row
    if step == 0:  # the masked cells of the prefill are drawn grey under the values
        assert any(d.hoverinfo == "skip" for d in fig.data)


def test_one_colour_scale_shows_the_division_by_root_dk(gen):
    fig = attention.attention_stages_figure(gen.trace, 0, 1, 0, shared_scale=True)
    qk, scaled, masked, pattern = values(fig)
    assert (qk.zmin, qk.zmax) == (scaled.zmin, scaled.zmax) == (masked.zmin, masked.zmax)
    assert qk.zmax == pytest.approx(float(np.nanmax(np.abs(qk.z))), rel=1e-4)
    assert (pattern.zmin, pattern.zmax) == (0.0, 1.0)
    own = attention.attention_stages_figure(gen.trace, 0, 1, 0)
    assert values(own)[0].zmin is None  # each stage its own scale unless asked


def test_weights_far_below_one_have_their_colours_stop_at_the_99_percent_quantile_and_the_bar_says_so():
    """A long causal row's weights are ~1/t: on 0 … 1 every cell would be dark. Where the 99% quantile of the
    nonzero cells is below ½ and the largest cell is more than twice it, the scale stops at that quantile (numpy's)
    and the colour bar says "clipped" and "≥ top"; weights that fill 0 … 1 keep it, and a scale nothing exceeds
    twice over stops at the largest cell, clipping nothing."""
    n = 400
    uniform = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]  # each row spread evenly over its keys
    scale = heatmap.weight_top(uniform)
    nonzero = uniform[uniform > 0]
    assert scale.clipped and scale.top == pytest.approx(np.quantile(nonzero, 0.99)) and scale.largest == 1.0
    assert 0 < (nonzero > scale.top).sum() <= math.ceil(0.01 * nonzero.size)  # drawn in the top colour: ~1 in 100
    bar = scale.bar("A")
    assert bar["title"]["text"] == "A<br>clipped" and bar["tickvals"][-1] == scale.top
    assert bar["ticktext"][-1] == f"≥{scale.top:.3g}" and bar["ticktext"][0] == "0"
    assert scale.note() == (f"colours stop at {scale.top:.3g}, the 99% quantile of the cells (the largest is 1)")
    small = np.tril(np.ones((4, 4))) / np.arange(1, 5)[:, None]  # four tokens: weights ¼ … 1 fill 0 … 1
    assert heatmap.weight_top(small) == heatmap.ColourTop(1.0, 1.0) and heatmap.weight_top(small).bar("A") == {
        "title": {"text": "A", "side": "top"}}
    flat = np.full((8, 8), 0.2)  # nothing far above the rest: the top is the largest cell, nothing clipped
    assert heatmap.weight_top(flat) == heatmap.ColourTop(0.2, 0.2) and not heatmap.weight_top(flat).note()
    assert heatmap.colour_top(np.zeros((3, 3))).top == 1.0 and heatmap.colour_top(np.full((2, 2), np.nan)).top == 1.0


def test_the_all_heads_grid_of_a_long_prompt_stops_its_colours_where_its_note_and_bar_say(gen):
    """512 tokens: each head's weights are ~1/t, so on 0 … 1 the whole grid was dark. Its colours stop at the 99%
    quantile of the nonzero cells drawn (numpy's), the note and the colour bar say so; a short prompt's grid keeps
    0 … 1 with nothing clipped."""
    from gpt_shape_tracer.tracer import Tracer

    torch.manual_seed(0)
    config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=512, d_model=64, n_layer=2, n_head=2, n_kv_head=2,
                                  d_mlp=128)
    model = GPT(config).eval()
    tokens = torch.randint(0, 64, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Tracer(model, capture="values", budget_bytes=2**30) as tr:
        model(tokens)
    grid = attention.all_heads_figure(tr.trace, 0)
    heat = grid.figure.data[0]
    z = np.array(heat.z, dtype=float)
    drawn = z[np.isfinite(z) & (z > 0)]
    assert heat.zmax == pytest.approx(float(np.quantile(drawn, 0.99)), rel=1e-6) and heat.zmax < 0.5
    assert f"colours stop at {heat.zmax:.3g}, the 99% quantile" in grid.note
    assert heat.colorbar.title.text == "A<br>clipped" and heat.colorbar.ticktext[-1] == f"≥{heat.zmax:.3g}"
    short = attention.all_heads_figure(gen.trace, 0)
    assert short.figure.data[0].zmax == 1 and "colours stop" not in short.note


def test_the_stages_pattern_at_a_long_prompt_is_drawn_on_a_clipped_scale_that_its_title_and_bar_state(monkeypatch):
    """The fused kernel at a long prompt (1,024 tokens here, read as one past the size a derived record is handed
    whole: WHOLE_DERIVED lowered so the test stays small): the pattern panel draws the block means recomputed from Q
    and K (each ~1/t, all below 0.1), its colours stop where the panel's title and colour bar say — the 99% quantile
    of the cells drawn — and hovering a cell still reads its own mean, not the clipped value."""
    from gpt_shape_tracer.model.gpt import attention_path
    from gpt_shape_tracer.tracer import Tracer
    from gpt_shape_tracer.tracer.reading import _derived

    monkeypatch.setattr(_derived, "WHOLE_DERIVED", 1 << 20)  # 2 heads × 1,024² is 2 Mi elements

    torch.manual_seed(0)
    config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=1024, d_model=64, n_layer=1, n_head=2, n_kv_head=2,
                                  d_mlp=128)
    model = GPT(config).eval()
    tokens = torch.randint(0, 64, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attention_path("fused"), Tracer(model) as tr:
        model(tokens)
    fig = attention.attention_stages_figure(tr.trace, 0, 0, 1)
    drawn = [d for d in fig.data if d.type == "heatmap" and d.hoverinfo != "skip"]
    assert len(drawn) == 1  # the score stages were never formed
    pattern = drawn[0]
    digest = pattern_digest(tr.trace, tr.trace.record("blocks.0.attn.hook_pattern", 0))[0, 1]
    assert pattern.z.shape == (128, 128) and same(pattern.z, digest)
    cells = np.asarray(pattern.z, dtype=np.float64)
    cells = cells[np.isfinite(cells) & (cells > 0)]
    assert cells.max() > 2 * pattern.zmax and pattern.zmax == pytest.approx(np.quantile(cells, 0.99), rel=1e-6)
    assert 0 < (cells > pattern.zmax).sum() <= math.ceil(0.01 * cells.size) and pattern.zmin == 0
    assert pattern.colorbar.title.text == "A<br>clipped" and pattern.colorbar.ticktext[-1] == f"≥{pattern.zmax:.3g}"
    title = next(a.text for a in fig.layout.annotations if "softmax" in a.text)
    assert f"colours stop at {pattern.zmax:.3g}, the 99% quantile" in title
    # a long shapes line breaks before its result (at 1280 px it ran into its neighbours')
    assert any("[1, 2, 1024, 32] @ [1, 2, 32, 1024]<br>→ [1, 2, 1024, 1024]" in a.text for a in fig.layout.annotations)


def test_a_long_query_row_draws_its_heaviest_and_most_recent_keys_and_says_how_much_it_leaves_out(batch_gen,
                                                                                                  monkeypatch):
    """Past QUERY_ROW_LIMIT keys (a 32k row drawn as 32k spans crashed a browser tab) the row draws the keys the
    query weighs most and those just before it; the note's count and share are the drawn keys' own."""
    t = batch_gen.trace
    row = t.get("blocks.1.attn.hook_pattern", 0)[1, 2, 5]  # [t]: query 5 of sequence 1, head 2
    monkeypatch.setattr(attention, "QUERY_ROW_LIMIT", 3)
    monkeypatch.setattr(attention, "QUERY_ROW_TOP", 2)
    monkeypatch.setattr(attention, "QUERY_ROW_RECENT", 2)
    html_ = attention.query_attention_html(t, 0, 1, 2, query=5, batch=1)
    drawn = [int(j) for j in re.findall(r"title='key (\d+): weight", html_)]
    expected = sorted(set(torch.topk(row, 2).indices.tolist()) | {4, 5})
    assert drawn == expected and len(drawn) < len(row)
    share = float(row[expected].double().sum())
    assert f"{len(drawn):,} of the {len(row):,} keys drawn" in html_ and f"{share:.1%} of its weight" in html_
    assert "the 2 up to itself" in html_
    assert ("keys … " in html_) == (drawn != list(range(len(drawn))))  # a gap before a drawn key is marked


def test_the_query_picker_colours_keys_by_weight_and_outlines_the_query(batch_gen):
    t = batch_gen.trace
    html_ = attention.query_attention_html(t, 0, 1, 2, query=3, batch=1)
    weights = [float(w) for w in re.findall(r"weight ([0-9.]+)'", html_)]
    assert weights == [round(w, 3) for w in t.get("blocks.1.attn.hook_pattern", 0)[1, 2, 3].tolist()]
    outlined = re.findall(r"title='key (\d+): weight[^']*' style='[^']*outline: 2px solid " + ACCENT, html_)
    assert outlined == ["3"]  # query row 3 of the prefill is key column 3
    assert "attention weight of each key" in html_ and "the query itself" in html_
    assert "<script" not in html_ and "<script>alert(1)</script>" in unescape(re.sub(r"<[^>]+>", "", html_))


def test_all_heads_figure_tiles_every_layer_and_head(gen):
    grid = attention.all_heads_figure(gen.trace, 0, picked=(2, 3))
    fig, (rn, rt) = grid.figure, grid.cells
    n = gen.info.prompt_lengths[0]
    assert (rn, rt) == (n, n) and grid.note == ""
    z = z_tensor(fig.data[0].z)
    gap = max(1, rt // 8)
    for layer in range(4):
        pattern = gen.trace.get(f"blocks.{layer}.attn.hook_pattern", 0)
        for head in range(4):
            r0, c0 = layer * (rn + gap), head * (rt + gap)
            assert torch.allclose(z[r0:r0 + rn, c0:c0 + rt], pattern[0, head].double(), atol=1e-4), (layer, head)
    assert list(fig.layout.yaxis.ticktext) == ["L0", "L1", "L2", "L3"]
    assert fig.layout.yaxis.scaleanchor == "x"  # square cells: the causal triangle stays a triangle
    outline = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(outline) == 1 and outline[0].x0 == 3 * (rt + gap) - 0.5 and outline[0].y0 == 2 * (rn + gap) - 0.5
    clicks = fig.data[1].customdata
    assert [list(c[:2]) for c in clicks] == [[layer, head] for layer in range(4) for head in range(4)]


def test_all_heads_grid_pools_long_contexts_and_stretches_a_decode_row(gen, monkeypatch):
    monkeypatch.setattr(attention, "GRID_CELLS", 4 * 4 * 8 * 8)
    grid = attention.all_heads_figure(gen.trace, 0)
    assert grid.cells[0] < gen.info.prompt_lengths[0] and "pooled" in grid.note
    monkeypatch.undo()
    decode = attention.all_heads_figure(gen.trace, 2)
    assert decode.cells[0] == 1 and "6× taller" in decode.note and decode.figure.layout.yaxis.scaleanchor is None
    row = z_tensor(decode.figure.data[0].z)[0:6, 0:decode.cells[1]]
    expected = gen.trace.get("blocks.0.attn.hook_pattern", 2)[0, 0, 0].double()
    assert all(torch.allclose(row[i], expected, atol=5e-4) for i in range(6))


def test_the_grid_marks_which_query_heads_share_a_key_value_head(llama_gen):
    grid = attention.all_heads_figure(llama_gen.trace, 0)
    labels = [a.text for a in grid.figure.layout.annotations]
    assert labels == ["K/V head 0", "K/V head 1"]  # 6 query heads, 3 per key/value head
    assert "K/V head 1" in grid.figure.data[1].customdata[4][2]  # query head 4 reads key/value head 4 // 3 = 1


def test_history_builds_the_lower_triangle_from_one_row_per_step(gen):
    t = gen.trace
    matrix, rows, keys, row_steps = attention.attention_history(t, 1, 2, 3)
    n0 = gen.info.prompt_lengths[0]
    assert matrix.shape == (n0 + 3, n0 + 3)
    assert row_steps == [0] * n0 + [1, 2, 3]
    prefill = t.get("blocks.1.attn.hook_pattern", 0)[0, 2]
    lower = torch.ones(n0, n0, dtype=torch.bool).tril()
    assert torch.allclose(matrix[:n0, :n0][lower], prefill[lower])
    for s in (1, 2, 3):
        assert torch.allclose(matrix[n0 + s - 1, : n0 + s], t.get("blocks.1.attn.hook_pattern", s)[0, 2, 0])
    assert torch.isnan(matrix[torch.ones_like(matrix, dtype=torch.bool).triu(1)]).all()
    assert rows[-1].startswith("s3 · ")
    # a window: the last w rows and key columns of the same matrix, with their own labels
    w = n0 // 2 + 2
    window, w_rows, w_keys, w_steps = attention.attention_history(t, 1, 2, 3, window=w)
    assert window.shape == (w, w) and w_rows == rows[-w:] and w_keys == keys[-w:] and w_steps == row_steps[-w:]
    torch.testing.assert_close(window, matrix[-w:, -w:], equal_nan=True)
    title = attention.attention_history_figure(t, 1, 2, 3).layout.title.text
    assert "the last" not in title  # nothing left out at this size


def test_history_leaves_padding_queries_blank(batch_gen):
    lengths = batch_gen.info.prompt_lengths
    row = lengths.index(min(lengths))
    pad = max(lengths) - min(lengths)
    matrix, labels, _, _ = attention.attention_history(batch_gen.trace, 0, 0, 2, batch=row)
    assert torch.isnan(matrix[:pad]).all() and all("(padding: no query)" in label for label in labels[:pad])
    assert not torch.isnan(matrix[pad, pad])


def test_o_is_the_weighted_sum_of_the_value_rows(gen):
    for step, query in ((0, 5), (2, 0)):
        fig, delta = attention.weighted_sum_figure(gen.trace, step, 3, 1, query)
        assert delta < 1e-5
        alpha = gen.trace.get("blocks.3.attn.hook_pattern", step)[0, 1, query]
        assert same(values(fig)[0].z, alpha[:, None])


def test_the_pitfalls_are_recomputed_from_the_recorded_q_and_k(gen):
    t = gen.trace
    for step in (0, 2):
        variants = pitfalls.pitfall_patterns(t, step, 1, 3)
        recorded = t.get("blocks.1.attn.hook_pattern", step)[0, 3].double()
        assert torch.allclose(variants["as the model does it"], recorded, atol=1e-5)
        # a softmax of scores √d_k times larger is never less peaked, row by row
        sharper = variants["without ÷√d_k"].max(-1).values
        assert (sharper >= variants["as the model does it"].max(-1).values - 1e-9).all()
    table = pitfalls.pitfall_table(t, 0, 1, 3).set_index("variant")
    assert table.loc["without the mask M", "weight on forbidden keys"] > 0.01  # the prefill leaks onto the future
    assert table.loc["as the model does it", "weight on forbidden keys"] == 0
    assert table.loc["mask after the softmax", "row sum"] < 1
    decode = pitfalls.pitfall_table(t, 2, 1, 3).set_index("variant")
    assert decode.loc["without the mask M", "weight on forbidden keys"] == 0  # the newest query has no future
    # the sentence above the table says what the table shows, at each step
    n = t.record("blocks.1.attn.hook_q", 0).shape[2]
    prefill_text = pitfalls.pitfall_sentence(t, 0, 1, 3)
    assert f"leaks onto the {n * (n - 1) // 2:,} (query, key) pairs where the key comes after" in prefill_text
    assert "no longer sum to 1" in prefill_text
    decode_text = pitfalls.pitfall_sentence(t, 2, 1, 3)
    assert "M forbids nothing" in decode_text and "leaks" not in decode_text and "no longer sum" not in decode_text


def test_rope_keeps_the_score_a_function_of_the_distance(llama_gen):
    t = llama_gen.trace
    config = t.config
    q, rot = t.get("blocks.1.attn.hook_q", 0), t.get("blocks.1.attn.hook_rot_q", 0)
    cos, sin = rope_cos_sin(config, torch.arange(q.shape[2])[None])
    assert torch.allclose(apply_rope(q, cos, sin), rot, atol=1e-6)  # the view shows the model's own rotation
    fig = rope.rope_relative_figure(t, 0, 1, 4)
    together, key_only = (torch.tensor(d.y) for d in fig.data)
    assert together.shape == key_only.shape == (len(fig.data[0].x),)  # one line each, a value per shift
    assert float(together.max() - together.min()) < 1e-4 * float(together.abs().max())
    assert float(key_only.max() - key_only.min()) > 0.01 * float(key_only.abs().max())
    assert rope.rope_figure(t, 0, 1, 4) is not None


@pytest.mark.parametrize("side", ["left", "right"])
def test_rope_in_numbers_picks_real_tokens_of_a_padded_sequence(llama_gen, side):
    """In a padded batch the relative-score chart rotates a query and a key that hold tokens of the chosen
    sequence, at the positions those tokens have (padding excluded), never a ⟨pad⟩ row."""
    model, tok = llama_gen.model, llama_gen.tokenizer
    prompts = ["Mia had a small blue boat and a red kite.", "Ben ran"]
    g = TracedGeneration(model, tok, prompts, temperature=0, padding_side=side)
    g.run(2)
    short, width = len(tok.encode(prompts[1])), max(len(tok.encode(p)) for p in prompts)
    real_cols = list(range(width - short, width)) if side == "left" else list(range(short))
    fig = rope.rope_relative_figure(g.trace, 0, 1, 4, batch=1)
    title = fig.layout.title.text  # the columns as every view counts them, and the positions RoPE rotates with
    assert f"query in column {real_cols[-1]}" in title and f"key in column {real_cols[0]}" in title
    assert f"m = {short - 1}" in title and "n = 0" in title
    q, k = g.trace.get("blocks.1.attn.hook_q", 0)[1, 4], g.trace.get("blocks.1.attn.hook_k", 0)[1, 4 // 3]
    cos, sin = rope_cos_sin(model.config, torch.arange(short)[None])
    rq = apply_rope(q[real_cols[-1]].expand(1, 1, short, -1), cos, sin)[0, 0, short - 1]
    rk = apply_rope(k[real_cols[0]].expand(1, 1, short, -1), cos, sin)[0, 0, 0]
    assert fig.data[0].y[0] == pytest.approx(float(rq.double() @ rk.double()), rel=1e-4, abs=1e-5)
    decode = rope.rope_relative_figure(g.trace, 1, 1, 4, batch=1)  # the one new row: the token just chosen
    assert f"m = {short}, " in decode.layout.title.text and f"n = {short}" in decode.layout.title.text


# -- the flow -------------------------------------------------------------------------------------------
def node_labels(trace, step=0) -> dict[str, str]:
    nodes, _ = flow.flow_nodes(trace, step, 0)
    return {n.label: n for n in nodes}


@pytest.mark.parametrize("fixture", ["gen", "llama_gen"])
def test_the_flow_draws_the_residual_skips(fixture, request):
    """The residual stream's two skips: x around attention into "x + attention", that sum around the MLP into
    "x + MLP", dashed, each ending in an arrowhead at its box."""
    g = request.getfixturevalue(fixture)
    fig = flow.shape_flow_figure(g.trace, 1, 0)
    nodes = {n.label: n for n in flow.flow_nodes(g.trace, 1, 0)[0]}
    skips = [sh for sh in fig.layout.shapes if sh.type == "path" and sh.line.dash == "dash"]
    assert len(skips) == 2
    pre, mid, post = nodes["x into block 0"], nodes["x + attention"], nodes["x + MLP"]
    first, second = (list(map(float, sh.path.replace("M", "").replace("L", "").split())) for sh in skips)
    assert first[:2] == [pre.x + flow.W / 2, pre.y] and first[-2] < mid.x - flow.W / 2  # leaves x, reaches the sum
    assert second[:2] == [mid.x + flow.W / 2, mid.y] and second[-1] == post.y  # leaves the sum, reaches x + MLP
    heads = fig.data[0]  # the arrows: an arrowhead at the box edge each skip ends on
    ends = {(x, y) for x, y, size in zip(heads.x, heads.y, heads.marker.size) if size}
    assert (mid.x - flow.W / 2, first[-1]) in ends and (post.x + flow.W / 2, post.y) in ends
    assert [t for d in fig.data if d.mode == "text" for t in d.text].count("skip: x") == 2


def test_the_flow_draws_gpt2_with_its_real_weights(gen):
    nodes = node_labels(gen.trace)
    assert "W_pos[positions]" in nodes and "GELU (tanh form)" in nodes and "LN₁(x)" in nodes
    assert not any("rotate" in label for label in nodes)
    model = gen.model
    assert nodes["X·W_QKV"].weight == f"W_QKV [{model.blocks[0].attn.c_attn.weight.shape[0]}, " \
                                      f"{model.blocks[0].attn.c_attn.weight.shape[1]}]"
    assert nodes["x·W₁ + b₁"].weight == f"W₁ [{', '.join(map(str, model.blocks[0].mlp.c_fc.weight.shape))}]"
    assert nodes["z = x·W_U (logits)"].weight.startswith("W_U = W_Eᵀ")
    assert nodes["K = cache ++ new"].shape == (1, 4, gen.info.prompt_lengths[0], 32)


def test_the_flow_draws_a_llama_model_as_it_is(llama_gen):
    nodes = node_labels(llama_gen.trace)
    assert {"RMSNorm₁(x)", "rotate Q: R(m)q (RoPE)", "rotate K: R(n)k (RoPE)", "gate: x·W_gate", "up: x·W_up",
            "SiLU(gate) ⊙ up", "QKᵀ (G→H heads)", "K (new, G heads)"} <= set(nodes)
    assert "W_pos[positions]" not in nodes and not nodes["z = x·W_U (logits)"].weight.startswith("W_U = W_Eᵀ")
    assert nodes["K (new, G heads)"].symbolic == ["B", "G", "n", "d_head"]
    assert nodes["QKᵀ (G→H heads)"].symbolic == ["B", "H", "n", "t"]


def test_with_the_cache_off_the_flow_draws_no_cache(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, "Tom had a kite.", use_cache=False, temperature=0)
    g.run(2)
    labels = set(node_labels(g.trace, 1))
    assert "K (all t rows, recomputed)" in labels and not any("cache" in label for label in labels)
    assert "K (every position, H heads)" in labels and not any("new" in label for label in labels)
    cached = TracedGeneration(model, tok, "Tom had a kite.", temperature=0)
    cached.run(2)
    assert "K (new, H heads)" in set(node_labels(cached.trace, 1))


def test_the_reshape_says_what_moves_memory_as_measured(gen):
    prefill = flow.reshape_ops(gen.trace, 0, 1)
    decode = flow.reshape_ops(gen.trace, 2, 1)
    n0 = gen.info.prompt_lengths[0]
    merged_0 = gen.trace.get("blocks.1.attn.hook_merged", 0)
    z_0 = gen.trace.get("blocks.1.attn.hook_z", 0)
    if z_0.transpose(1, 2).is_contiguous():  # the fused kernel wrote O as [B,n,H,d_head]: the merge is a view…
        assert prefill[6].memory.startswith("no copy") and "same storage as O" in prefill[6].memory
        assert merged_0.untyped_storage().data_ptr() == z_0.untyped_storage().data_ptr()
    else:  # …the eager A·V writes [B,H,n,d_head], so the prefill's merge must copy
        assert prefill[6].memory.startswith(f"copies {n0 * 128 * 4:,} bytes")
        assert "measured: a new storage" in prefill[6].memory
        assert merged_0.untyped_storage().data_ptr() != z_0.untyped_storage().data_ptr()
    assert gen.trace.get("blocks.1.attn.hook_z", 2).transpose(1, 2).is_contiguous()  # …and a decode step's need not
    assert decode[6].memory.startswith("no copy") and "same storage as O" in decode[6].memory
    for ops, z in ((prefill, z_0), (decode, gen.trace.get("blocks.1.attn.hook_z", 2))):
        # the transpose, the copy and the view say one thing: contiguous ⇔ no copy ⇔ a view of O itself
        contiguous = z.transpose(1, 2).is_contiguous()
        assert ("no longer contiguous" in ops[5].memory) == (not contiguous), ops[5].memory
        assert ops[6].memory.startswith("no copy") == contiguous
        assert ops[7].memory.startswith("a view of O itself" if contiguous else "a view of the copy")
    assert "with n = 1" in decode[5].memory and f"with n = {n0}" not in prefill[6].memory
    assert "shares X·W_QKV's storage" in prefill[1].memory
    assert [op.shape for op in prefill[:4]] == [(1, n0, 384), (1, n0, 128), (1, n0, 4, 32), (1, 4, n0, 32)]


# -- the causal mask ------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["left", "right"])
def test_the_mask_counts_each_cause_and_names_the_exact_padding(bundled, side):
    model, tok = bundled
    prompts = ["Lily had a red ball and a blue kite.", "Tom said,"]
    g = TracedGeneration(model, tok, prompts, temperature=0, padding_side=side)
    g.run(2)
    width = max(len(tok.encode(p)) for p in prompts)
    short = len(tok.encode(prompts[1]))
    pad = list(range(width - short)) if side == "left" else list(range(short, width))
    f = mask.mask_facts(g.trace, 0, 0, batch=1)
    m = g.trace.get("blocks.0.attn.hook_mask", 0)[1, 0]
    assert f.masked == int(torch.isinf(m).sum()) and f.unexplained == 0
    assert f.future == width * (width - 1) // 2 and f.masked == f.future + f.padding_key
    assert list(f.padding_columns) == pad and list(f.padding_rows) == pad
    text = f.explanation()
    assert f"Key column(s) {', '.join(map(str, pad))} of sequence 1 are padding" in text
    assert ("itself only" in text) == (side == "left") and ("the real tokens before it" in text) == (side == "right")
    decode = mask.mask_facts(g.trace, 1, 0, batch=1)
    assert decode.decode and decode.future == 0 and decode.masked == len(pad)
    assert "masks nothing" in decode.explanation()
    assert mask.mask_facts(g.trace, 1, 0, batch=0).masked == 0


def test_a_sliding_window_masks_old_keys_even_at_a_decode_step(bundled):
    _, tok = bundled
    torch.manual_seed(2)
    config = GPTConfig.for_family("mistral", vocab_size=tok.vocab_size, n_ctx=64, d_model=32, n_layer=1, n_head=4,
                                  n_kv_head=2, d_mlp=48, sliding_window=4)
    g = TracedGeneration(GPT(config).eval(), tok, "Lily had a red ball and a kite.", temperature=0)
    g.run(2)
    f = mask.mask_facts(g.trace, 1, 0)
    t = f.t
    assert f.decode and f.window == t - 4 and f.future == 0 and f.unexplained == 0
    assert "only keys outside the sliding window are −∞" in f.explanation()
    assert mask.mask_facts(g.trace, 0, 0).window > 0


def test_a_mask_without_values_is_not_counted(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, "Tom had a kite.", capture="shapes", temperature=0)
    g.step()
    f = mask.mask_facts(g.trace, 0)
    assert not f.counted and "not counted" in f.explanation() and "-1" not in f.explanation()


def test_mask_cells_are_labelled_only_where_a_label_fits(bundled):
    """A small M writes 0 / −∞ in each cell; a decode row over many keys does not (the labels would merge into
    a black bar), and its hover still gives each cell's value."""
    model, tok = bundled
    g = TracedGeneration(model, tok, " ".join(["Tom had a big red kite."] * 8), temperature=0)
    g.run(2)
    n = g.info.prompt_lengths[0]
    assert n > mask.MAX_LABELLED_COLUMNS
    short = TracedGeneration(model, tok, "Tom had a kite.", temperature=0)
    short.run(2)
    labelled = [d for d in mask.mask_figure(short.trace, 0).data if d.hoverinfo != "skip"][-1]
    assert labelled.texttemplate == "%{text}" and labelled.text[0][-1] == "−∞"
    row = [d for d in mask.mask_figure(g.trace, 1).data if d.hoverinfo != "skip"][-1]  # 1 × (n + 1)
    assert row.texttemplate is None and len(row.text[0]) == n + 1 and "%{text}" in row.hovertemplate


# -- the KV cache ----------------------------------------------------------------------------------------
def test_the_cache_memory_formula_uses_this_steps_numbers(gen, llama_gen):
    latex, sentence = cache.memory_formula(gen.trace, 2)
    t = gen.info.prompt_lengths[0] + 2
    assert f"2\\cdot 1\\cdot 4\\cdot {t}\\cdot 32 = {2 * 4 * t * 32:,}" in latex and "G = H = 4" in sentence
    latex, sentence = cache.memory_formula(llama_gen.trace, 1)
    t = llama_gen.info.prompt_lengths[0] + 1
    assert f"2\\cdot 1\\cdot 2\\cdot {t}\\cdot 8" in latex
    assert f"{2 * 6 * t * 8:,}" in sentence and "3× less" in sentence


def comparison(step, cached_rows, full_rows, delta, cached_s=None, full_s=None) -> RecomputeComparison:
    return RecomputeComparison(step, PathCost(cached_rows, 10 * cached_rows, 100, 5, cached_s),
                               PathCost(full_rows, 10 * full_rows, 100, 0, full_s), delta, 1e-4, True)


def test_the_verdict_follows_the_comparison():
    level, text = cache.verdict(comparison(0, 7, 7, 0.0))
    assert level == "info" and "nothing is cached" in text and "says nothing about the cache" in text
    level, text = cache.verdict(comparison(3, 1, 10, 3e-6))
    assert level == "success" and "1 query row(s) with 10 multiply-adds" in text and "10.0× more" in text
    assert "agree within 0.0001 (max |Δ logits| = 3.00e-06: rounding)" in text
    assert text.endswith("The cached side is this run's own cached logits.")
    level, text = cache.verdict(comparison(3, 1, 10, 0.5))
    assert level == "error" and text.startswith("NOT equal")
    assert "(max |Δ logits| = 5.00e-01, above the tolerance 0.0001 for this dtype)" in text
    # with the cache off the run is itself the full recompute: the other side is a cached re-run, and it says so
    off = dataclasses.replace(comparison(3, 1, 10, 3e-6), run_used_cache=False)
    assert cache.verdict(off)[1].endswith("The cached side is an untraced cached re-run (this run has the cache "
                                          "off: it is itself the full recompute).")
    assert "all 7 query rows with the same 70 multiply-adds" in cache.verdict(comparison(0, 7, 7, 0.0))[1]
    # a cached path that computed nothing (no multiply-adds) is not a division by zero
    assert "(inf× more)" in cache.verdict(comparison(3, 0, 10, 0.0))[1]
    assert cache.timing_warning(comparison(3, 1, 10, 0.0, cached_s=0.03, full_s=0.01)).startswith("On this machine")
    assert cache.timing_warning(comparison(3, 1, 10, 0.0, cached_s=0.01, full_s=0.03)) == ""
    table = cache.evidence_table(comparison(3, 1, 10, 0.0, 0.01, 0.03))
    assert list(table["cached path does"][:2]) == ["10.0× fewer", "10.0× fewer"]
    assert table.iloc[-1, 0].startswith("wall time (estimate")


def test_the_verdict_reports_cached_rows_that_differ_even_when_the_logits_agree():
    """Logits within the tolerance do not vouch for the cache: a cached K or V row that differs from its
    recomputation by more than the tolerance (here layer 1's V, by 0.3) makes the verdict an error naming that
    layer and the difference, not "agree in every one of the layers"."""
    agree = dataclasses.replace(comparison(3, 1, 10, 3e-6), cached_rows_delta=((2e-7, 1e-7), (1e-7, 0.3)))
    assert agree.equal and not agree.cached_rows_equal
    level, text = cache.verdict(agree)
    assert level == "error" and "the cached K and V rows do NOT equal their recomputation" in text
    assert "layer 1 differs by 3.00e-01, above the tolerance 0.0001" in text and "agree in every one" not in text
    within = dataclasses.replace(agree, cached_rows_delta=((2e-7, 1e-7), (1e-7, 9e-5)))
    level, text = cache.verdict(within)
    assert level == "success" and "agree in every one of the 2 layers that hold K and V (largest |Δ| 9.00e-05, " \
                                  "layer 1" in text


def test_a_real_comparison_counts_what_each_path_computes(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, "Lily had a red ball.", temperature=0)
    g.step()
    c0 = g.compare_with_recompute()
    g.step()
    c1 = g.compare_with_recompute()
    assert c0.nothing_cached and cache.verdict(c0)[0] == "info"
    n = g.info.prompt_lengths[0] + 1
    assert (c1.cached.query_rows, c1.full.query_rows) == (1, n) and cache.verdict(c1)[0] == "success"
    # the counts are the model's: one more row costs what the MLP, projections and the unembedding cost per row
    config = model.config
    d, d_ff, vocab = config.d_model, config.d_ff, config.vocab_size
    per_row = config.n_layer * (4 * d * d + 2 * d * d_ff) + d * vocab
    attn = config.n_layer * 2 * config.n_head * config.d_head
    assert c1.cached.macs == per_row + attn * n and c1.full.macs == n * per_row + attn * n * n
    # the figure over the steps draws those counts: rows of every step, multiply-adds of the steps compared
    g.step()  # step 2, not compared: no multiply-adds point for it
    fig = cache.cache_steps_figure(g.trace, 2)
    length, kib, with_cache, without, cached_macs, full_macs = fig.data
    n0 = g.info.prompt_lengths[0]
    assert list(length.y) == [n0, n0 + 1, n0 + 2] and kib.yaxis == "y2"  # KiB on the right-hand axis
    assert list(with_cache.y) == [n0, 1, 1] and list(without.y) == [n0, n0 + 1, n0 + 2]
    assert list(cached_macs.x) == [0, 1] and list(cached_macs.y) == [c0.cached.macs, c1.cached.macs]
    assert list(full_macs.y) == [c0.full.macs, c1.full.macs] and cached_macs.yaxis == "y4"
    assert all(tuple(fig.layout[a].range) == (-0.5, 2.5) for a in ("xaxis", "xaxis2", "xaxis3"))  # no step −1
    fresh = TracedGeneration(model, tok, "Lily had a red ball.", temperature=0)
    fresh.step()
    assert len(cache.cache_steps_figure(fresh.trace).data) == 4  # nothing compared: no multiply-adds panel


def test_the_cache_views_show_the_traced_keys(gen):
    t = gen.trace
    n0 = gen.info.prompt_lengths[0]
    table = cache.cache_table(t, 2)
    assert list(table["K"]) == [f"[1, 4, {n0 + 2}, 32]"] * 4
    assert list(table["rows computed this step"]) == [1] * 4 and list(table["rows from the cache"]) == [n0 + 1] * 4
    growth = cache.cache_growth(t)
    assert list(growth["cache length"]) == [n0, n0 + 1, n0 + 2, n0 + 3]
    fig = cache.key_heatmap_figure(t, 2, 3, 1, which="K")
    assert same(values(fig)[0].z, t.get("blocks.3.attn.hook_k_all", 2)[0, 1])
    rect = fig.layout.shapes[0]
    assert (rect.y0, rect.y1) == (n0 + 2 - 1 - 0.5, n0 + 2 - 0.5)  # the one row added at step 2
    rows = cache.rows_computed(t)
    assert list(rows["with cache"]) == [n0, 1, 1, 1] and list(rows["without cache"]) == [n0, n0 + 1, n0 + 2, n0 + 3]
    steps_fig = cache.cache_steps_figure(t, 2)
    assert steps_fig.layout.legend.y >= 1 and steps_fig.layout.margin.t >= 60  # the legend sits above the panels
    assert steps_fig.layout.annotations[0].text == "the KV cache grows by one row per step"


# -- tokens -----------------------------------------------------------------------------------------------
def test_next_token_figure_outlines_the_chosen_token(gen):
    info = gen.facts.step(1).sampling
    fig = tokens.next_token_figure(gen.trace, 1)
    bars = fig.data[0]
    assert sorted(bars.y, reverse=True) == sorted(info.stage_probs[0][3], reverse=True)
    chosen = [x for x, w in zip(bars.x, bars.marker.line.width) if w == 4]
    label = info.candidate_labels[0][info.candidates[0].index(info.tokens[0])]
    assert chosen == [f"{safe_text(label)} ({info.tokens[0]})"] and isinstance(bars.marker.color, str)
    stages = tokens.distribution_stages_figure(gen.trace, 1)
    assert len(stages.data) == 4 and "30 token(s) left" in stages.data[2].name
    assert list(bars.text) == [f"{p:.3g}" for p in bars.y]  # every probability printed on its bar
    log = tokens.next_token_figure(gen.trace, 1, log_scale=True)
    positive = sorted((p for p in info.stage_probs[0][3] if p > 0), reverse=True)
    assert log.layout.yaxis.type == "log" and list(log.data[0].y) == positive  # zeros have no place on a log axis
    low, high = log.layout.yaxis.range
    assert low < math.log10(min(positive)) and high > math.log10(max(positive))  # every candidate is on the axis


def _with_manifest(trace, edit):
    """``trace`` saved, its manifest edited by ``edit``, loaded back: a file someone crafted."""
    from gpt_shape_tracer.tracer import archive_bytes, load_trace
    from tests.tracer.test_hostile_files import with_manifest

    return load_trace(with_manifest(archive_bytes(trace), edit))


def test_a_crafted_choice_outside_its_candidates_is_said_not_raised(gen):
    """A file whose chosen token is not among its candidates (sampling can pick one outside the recorded top
    candidates too), or that records none, draws a title saying so instead of raising."""
    from gpt_shape_tracer.tracer import TraceFileError

    info = gen.facts.step(1).sampling
    other = next(i for i in range(gen.model.config.vocab_size) if i not in info.candidates[0])

    def choose_other(manifest):
        manifest["generation"]["steps"][1]["sampling"]["tokens"][0] = other

    fig = tokens.next_token_figure(_with_manifest(gen.trace, choose_other), 1)
    assert f"({other}) is not among the {len(info.candidates[0])} candidates recorded" in fig.layout.title.text
    assert set(fig.data[0].marker.line.width) == {0}

    def no_candidates(manifest):
        sampling = manifest["generation"]["steps"][1]["sampling"]
        sampling["candidates"], sampling["candidate_labels"] = [[]], [[]]
        sampling["stage_probs"] = [[[] for _ in sampling["stage_probs"][0]]]

    assert "not among the 0 candidates" in tokens.next_token_figure(_with_manifest(gen.trace, no_candidates),
                                                                    1).layout.title.text

    def over_one(manifest):  # every probability in [0, 1], their sum not
        manifest["generation"]["steps"][1]["sampling"]["stage_probs"][0][0] = [0.9] * len(info.candidates[0])

    with pytest.raises(TraceFileError, match="add up to 18, more than 1"):
        _with_manifest(gen.trace, over_one)

    def fewer_labels(manifest):
        manifest["generation"]["steps"][1]["sampling"]["candidate_labels"][0].pop()

    with pytest.raises(TraceFileError, match="labels for 20 candidates"):
        _with_manifest(gen.trace, fewer_labels)


def test_generated_text_is_escaped_coloured_by_probability_and_time_travels(batch_gen):
    t = batch_gen.trace
    html_ = tokens.generated_text_html(t, 1)
    assert "<script" not in html_ and "<script>alert(1)</script>" in unescape(re.sub(r"<[^>]+>", "", html_))
    chosen = re.findall(r"title='step (\d): p = ([0-9.]+)'", html_)
    probs = [s.sampling.probs[1] for s in batch_gen.facts.steps]
    assert [int(s) for s, _ in chosen] == [0, 1, 2] and [float(p) for _, p in chosen] == [round(p, 3) for p in probs]
    assert len(re.findall("title='step", tokens.generated_text_html(t, 1, upto_step=0))) == 1
    assert "probability each generated token was chosen with" in tokens.text_legend()


def test_a_label_with_a_line_break_stays_inside_its_span(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, "Line one.\n\nLine <b>two</b>", temperature=0)
    g.step()
    html_ = tokens.generated_text_html(g.trace, 0)
    assert "<b>" not in html_
    for span in re.findall(r"<span[^>]*>(.*?)</span>", html_, flags=re.S):
        assert "<" not in span  # nothing the text holds opens an element
    assert unescape(re.sub(r"<[^>]+>", "", html_)).startswith("Line one.\\n\\nLine <b>two</b>")


# -- inspector -------------------------------------------------------------------------------------------
def test_inspector_slices_pools_and_counts_every_value():
    value = torch.randn(3, 400, 500)
    value[0, 0, 0] = math.nan
    m = inspector.slice_2d(value, 1, 2, {0: 0})
    assert m.shape == (400, 500)
    fig = inspector.tensor_heatmap_figure(m, "x")
    assert len(fig.data[-1].z) <= 256 and "pooled" in fig.layout.title.text
    window = inspector.tensor_heatmap_figure(m[10:30, 20:40], "x", offset=(10, 20))
    assert window.data[-1].y[0] == "10" and window.data[-1].x[0] == "20" and len(window.data[-1].z) == 20
    hist = inspector.histogram_figure(value, "values of x")
    assert sum(hist.data[0].y) == value.numel() - 1 and "1 NaN/±∞ not drawn" in hist.layout.title.text
    assert len(json.dumps(hist.to_plotly_json()["data"])) < 10_000  # bin counts, not 600,000 values
    assert inspector.raw_frame(torch.arange(6).reshape(2, 3)).shape == (2, 3)


# -- what if -------------------------------------------------------------------------------------------------
def test_the_lens_and_attribution_figures(gen, batch_gen):
    from gpt_shape_tracer.tracer import direct_logit_attribution, logit_lens

    lens = logit_lens(gen.trace, 0, label=gen.tokenizer.token_label)
    fig, note = whatif.lens_figure(lens, 4)
    z = z_tensor(fig.data[0].z)
    last = lens[lens.layer == 3].sort_values("position")
    assert torch.allclose(z[3], torch.tensor(last.final_prob.tolist(), dtype=torch.float64)) and note == ""
    assert fig.data[0].text[3] == [safe_text(s) for s in last.top_label]
    # a left-padded sequence: its padding columns are greyed, with no top token written on them
    short = min(range(2), key=lambda r: batch_gen.info.prompt_lengths[r])
    padded = logit_lens(batch_gen.trace, 0, short, label=batch_gen.tokenizer.token_label)
    pads = sorted(padded.loc[~padded["is_token"], "position"].unique())
    assert pads and all(padded.loc[padded["position"].isin(pads), "input"] == "⟨pad⟩")
    fig, _ = whatif.lens_figure(padded, 4)
    grey, values = fig.data
    assert grey.hoverinfo == "skip" and "padding positions grey" in fig.layout.title.text
    for p in pads:
        assert all(row[p] is None or row[p] != row[p] for row in values.z)  # NaN: no colour
        assert all(row[p] == "" for row in values.text) and all(row[p] == 1 for row in grey.z)
    real = [p for p in range(len(values.x)) if p not in pads]
    assert all(values.z[0][p] == values.z[0][p] for p in real) and all(grey.z[0][p] is None for p in real)
    frame = direct_logit_attribution(gen.trace, 1)
    fig = whatif.attribution_figure(frame, "x", top=8)
    bars = fig.data[0]
    shown = list(bars.x[:-1])  # the last bar is the hidden components together
    assert list(map(abs, shown)) == sorted(map(abs, shown), reverse=True) and len(shown) == 8
    hidden = len(frame) - 8
    assert bars.y[-1] == f"the other {hidden} components, together"
    assert f"the 8 largest of {len(frame)} components and the other {hidden} together" in fig.layout.title.text
    # what is drawn adds up to the total the title states: nothing hidden is lost from the sum
    assert sum(bars.x) + frame.attrs["norm_constant"] == pytest.approx(frame.attrs["total"], abs=1e-6)
    everything = whatif.attribution_figure(frame, "x", top=len(frame)).data[0]
    assert len(everything.x) == len(frame) and "the other" not in everything.y[-1]


def test_what_grows_with_n_is_counted_from_the_models_widths(gen, llama_gen):
    from gpt_shape_tracer.model.analysis import PARTS, attention_overtakes_mlp, forward_cost, forward_parts

    for g in (gen, llama_gen):
        config = g.model.config
        for n in (1, 7, 50):  # the parts add up to the forward's count
            assert sum(forward_parts(config, 2, n, n).values()) == forward_cost(config, 2, n, n).macs
        crossing = attention_overtakes_mlp(config)
        below, above = forward_parts(config, 1, int(crossing) - 1, int(crossing) - 1), \
            forward_parts(config, 1, int(crossing) + 2, int(crossing) + 2)
        assert below["QKᵀ and A·V"] < below["MLP"] and above["QKᵀ and A·V"] > above["MLP"]  # where it says
        t = g.facts.step(1).forward.t
        fig, sentence = cache.growth_figure(config, t)
        lines = {d.name: d for d in fig.data}
        assert set(PARTS) <= set(lines) and f"this step: t = {t}" in lines
        n_index = list(lines["MLP"].x).index(t)
        assert lines["MLP"].y[n_index] == forward_parts(config, 1, t, t)["MLP"]
        assert lines["scores of one layer, [H, n, n]"].y[n_index] == config.n_head * t * t * 4
        # the totals are the per-step counts the KV cache tab shows: a full forward, and one cached row at t
        full = lines["all: a forward of n positions (prefill, or a step without the cache)"].y[n_index]
        decode = lines["all: one cached decode step at t = n"].y[n_index]
        # (forward_cost is what compare_with_recompute counts each path with: test_a_real_comparison_… above)
        assert full == forward_cost(config, 1, t, t).macs and decode == forward_cost(config, 1, 1, t, cached=t - 1).macs
        inside = crossing <= config.n_ctx
        assert (f"attention passes the MLP: n ≈ {crossing:,.0f}" in lines) == inside
        assert (f"from n ≈ {crossing:,.0f} on, inside" in sentence) == inside
        assert f"H × n × t = {config.n_head} × {t} × {t}" in sentence  # no n given: a full forward of t
        passes = 2 * config.n_layer * (config.n_kv_head or config.n_head) * config.d_head / config.n_head
        first = int(passes) + 1  # the first whole n past equality (test_sentences checks every setting)
        assert f"from n = {first:,} on" in sentence or (passes == config.n_ctx and "never larger" in sentence)
    wide = GPTConfig(vocab_size=64, n_ctx=1024, d_model=32, n_layer=1, n_head=4)  # n* = 2·32·128 / (2·4·8) = 128
    fig, sentence = cache.growth_figure(wide, 300)
    assert attention_overtakes_mlp(wide) == 128 and "from n ≈ 128 on, inside this model's n_ctx of 1,024" in sentence
    assert "attention passes the MLP: n ≈ 128" in {d.name for d in fig.data}


# -- the worked example -------------------------------------------------------------------------------------
def test_the_worked_example_gives_the_textbook_numbers():
    w = worked.compute(worked.DEFAULT_Q, worked.DEFAULT_K, worked.DEFAULT_V, worked.DEFAULT_GRAD_O)
    assert torch.allclose(w.a, torch.tensor([[0.359, 0.641], [0.5, 0.5]], dtype=torch.float64), atol=1e-3)
    assert torch.allclose(w.o, torch.tensor([[1.359, 0.641, 0.359], [1.5, 0.5, 0.5]], dtype=torch.float64), atol=1e-3)
    assert torch.allclose(w.grad_v, torch.tensor([[0.359, 0.5, 0.359], [0.641, 0.5, 0.641]], dtype=torch.float64),
                          atol=1e-3)
    assert w.gradient_agrees < 1e-12
    causal = worked.compute(worked.DEFAULT_Q, worked.DEFAULT_K, worked.DEFAULT_V, worked.DEFAULT_GRAD_O, causal=True)
    assert causal.a[0, 1] == 0 and causal.a[0, 0] == 1
    with pytest.raises(worked.WorkedInputError, match="same number of columns"):
        worked.compute([[1.0, 2.0]], worked.DEFAULT_K, worked.DEFAULT_V, worked.DEFAULT_GRAD_O)
    with pytest.raises(worked.WorkedInputError, match="non-finite"):
        worked.compute([[1.0, math.nan, 0.0]], worked.DEFAULT_K, worked.DEFAULT_V, [[1.0, 0.0, 1.0]])


# -- long contexts ---------------------------------------------------------------------------------------------
def test_a_long_context_sends_at_most_a_megabyte_per_figure(bundled):
    _, tok = bundled
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_ctx=1024, d_model=48, n_layer=4, n_head=4)).eval()
    g = TracedGeneration(model, tok, "Lily had a red ball and she went to the park with Tom. " * 60, temperature=0)
    g.run(2)
    n = g.info.prompt_lengths[0]
    assert n > 700
    figures = [attention.attention_stages_figure(g.trace, 0, 1, 2), attention.all_heads_figure(g.trace, 0).figure,
               attention.attention_history_figure(g.trace, 1, 2, 1), mask.mask_figure(g.trace, 0)]
    for fig in figures:
        assert len(fig.to_json()) < 2**20
    assert "pooled" in figures[0].layout.title.text
    assert key_labels(g.trace, 1)[-1].startswith(f"{n} · ") and len(query_labels(g.trace, 1)) == 1


def test_a_crafted_label_from_a_file_stays_plain_text(gen, tmp_path):
    """A trace file can hold any label; in the HTML the page shows, none may end the block or open markdown."""
    import io
    import zipfile

    from gpt_shape_tracer.tracer import load_trace
    from gpt_shape_tracer.tracer.files import archive_bytes

    data = archive_bytes(gen.trace)
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))
    bait = "x\n\n![pic](http://evil.example/p.png) <img src=y> **b**"
    manifest["generation"]["info"]["prompt_labels"][0][0] = bait
    manifest["generation"]["steps"][0]["sampling"]["labels"][0] = bait
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, json.dumps(manifest) if info.filename == "manifest.json"
                         else src.read(info.filename))
    crafted = load_trace(out.getvalue())
    for html_ in (tokens.generated_text_html(crafted, 0), attention.query_attention_html(crafted, 1, 0, 0, 0)):
        assert "\n" not in html_ and "](http" not in html_ and "<img" not in html_ and "**" not in html_
        shown = unescape(re.sub(r"<[^>]+>", "", html_)).replace("\n", "").replace("\u2060", "")  # the link breaker
        assert bait.replace("\n", "") in shown


def test_inert_text_breaks_every_autolink_and_leaves_plain_words_alone():
    """What markdown could act on becomes a character reference; each place GitHub-flavoured markdown would
    start a link (http:, www., an @) gets an invisible word joiner; letters, digits and spaces stay as they
    are (the page does not grow sixfold)."""
    from gpt_shape_tracer.figures.common import WORD_JOINER, inert, safe_text

    text = "see www.evil.example, me@evil.example and HTTPS://evil.example/x"
    out = inert(text)
    assert unescape(out) == text.replace("www", "www" + WORD_JOINER).replace("@", "@" + WORD_JOINER).replace(
        "HTTPS:", "HTTPS:" + WORD_JOINER)
    assert "www." not in out and "@e" not in out and "://" not in out
    assert inert("plain words 123") == "plain words 123"
    # plotly shows &quot; literally, so token text escapes only what could open a tag
    assert safe_text('say "hi" & <b>') == 'say "hi" &amp; &lt;b&gt;'


def test_query_and_key_labels_follow_the_step_and_the_row(batch_gen):
    """Row 1 of a padded batch at step 2: t keys labelled with that row's own tokens (padding as ⟨pad⟩), and
    one query, the newest; at step 0 every prompt position is a query."""
    from gpt_shape_tracer.figures.common import key_labels, query_labels

    trace, facts = batch_gen.trace, batch_gen.facts
    for step in (0, 2):
        t = facts.width(step)
        keys = key_labels(trace, step, 1)
        assert keys == [f"{j} · {label}" for j, label in enumerate(facts.labels(1, step))] and len(keys) == t
        queries = query_labels(trace, step, 1)
        assert queries == (keys if step == 0 else keys[-1:])
    assert key_labels(trace, 2, 1) != key_labels(trace, 2, 0)  # each row its own tokens


def test_the_figure_tests_build_with_plotlys_property_checks(monkeypatch):
    """The app skips plotly's per-property validation (figures/plot.py); these tests must not."""
    from gpt_shape_tracer.figures.plot import VALIDATE_ENV, figure, subplots

    with pytest.raises(ValueError, match="colour"):
        figure(layout={"colour": "red"})
    with pytest.raises(ValueError, match="colour"):
        subplots(rows=1, cols=2).update_layout(colour="red")
    monkeypatch.delenv(VALIDATE_ENV)
    unchecked = figure(layout={"height": 300})
    assert unchecked.layout.height == 300 and unchecked.to_plotly_json()["layout"]["height"] == 300


def test_every_figure_is_the_same_with_and_without_plotlys_checks(gen, batch_gen, llama_gen, monkeypatch):
    """The app builds figures unchecked (figures/plot.py). plotly's checks also normalise — an axis title
    given as text becomes {"text": …}, which plotly.js 3 requires — so what reaches the browser must be
    identical either way, figure by figure."""
    from gpt_shape_tracer.figures.plot import VALIDATE_ENV
    from gpt_shape_tracer.tracer import direct_logit_attribution, logit_lens

    trace, last = gen.trace, gen.trace.n_steps - 1
    lens = logit_lens(trace, 0, label=gen.tokenizer.token_label)
    attribution = direct_logit_attribution(trace, 1)
    w = worked.compute(worked.DEFAULT_Q, worked.DEFAULT_K, worked.DEFAULT_V, worked.DEFAULT_GRAD_O)
    value = trace.get(act_name("pattern", 0), 0)[0, 0]
    restored = torch.linspace(-0.5, 1.5, 12).reshape(4, 3)
    builders = {
        "flow": lambda: flow.shape_flow_figure(trace, last, 1),
        "reshape": lambda: flow.reshape_figure(trace, last, 0),
        "stages": lambda: attention.attention_stages_figure(trace, last, 1, 2),
        "stages, prefill, one scale": lambda: attention.attention_stages_figure(trace, 0, 0, 0, shared_scale=True),
        "all heads": lambda: attention.all_heads_figure(trace, 0, picked=(1, 1)).figure,
        "history": lambda: attention.attention_history_figure(trace, 2, 1, last),
        "weighted sum": lambda: attention.weighted_sum_figure(trace, last, 0, 0, 0)[0],
        "pitfalls": lambda: pitfalls.pitfall_figure(trace, 0, 0, 0),
        "keys": lambda: cache.key_heatmap_figure(trace, last, 0, 1, which="V"),
        "the cache over the steps": lambda: cache.cache_steps_figure(trace, 1),
        "mask, padded": lambda: mask.mask_figure(batch_gen.trace, 0, 0, batch=1),
        "before/after mask": lambda: mask.scores_before_after_figure(trace, 0, 1, 0),
        "next token": lambda: tokens.next_token_figure(trace, last),
        "sampling stages": lambda: tokens.distribution_stages_figure(trace, last),
        "inspector heatmap": lambda: inspector.tensor_heatmap_figure(value, "weights", offset=(1, 2)),
        "histogram": lambda: inspector.histogram_figure(value, "weights"),
        "lens": lambda: whatif.lens_figure(lens, 4)[0],
        "attribution": lambda: whatif.attribution_figure(attribution, "x"),
        "pattern change": lambda: whatif.pattern_change_figure([(0, 1, 0.5)], 4, 4),
        "patching": lambda: whatif.patching_figure(restored, ["a", "b", "c"], "resid_pre"),
        "difference": lambda: whatif.difference_figure(value, value.flip(0), "b − a"),
        "rope": lambda: rope.rope_figure(llama_gen.trace, 0, 1, 4),
        "rope relative": lambda: rope.rope_relative_figure(llama_gen.trace, 0, 1, 4),
        "grouped heads": lambda: attention.all_heads_figure(llama_gen.trace, 0).figure,
        "worked forward": lambda: worked.forward_figure(w),
        "worked backward": lambda: worked.backward_figure(w),
    }

    def sent(build) -> dict:
        spec = json.loads(build().to_json())
        for key in ("shapes", "annotations"):  # an empty list unchecked, absent checked: the same drawing
            if spec["layout"].get(key) == []:
                del spec["layout"][key]
        return spec

    checked = {name: sent(build) for name, build in builders.items()}
    monkeypatch.setenv(VALIDATE_ENV, "0")
    for name, build in builders.items():
        assert sent(build) == checked[name], name


def test_a_notebook_shows_traces_generations_and_the_heads_grid(batch_gen):
    """What Jupyter and VS Code call to display an object: the trace's table of hook points, the generation's
    texts (escaped: a prompt holds <script>), and the heads grid as its figure rather than a wrapper."""
    html_ = batch_gen._repr_html_()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html_ and "<script>alert" not in html_
    assert repr(batch_gen).startswith("TracedGeneration(2 sequence(s), 3 step(s), greedy")
    last = batch_gen.trace.record("blocks.0.attn.hook_q", 2)
    assert f"<code>blocks.0.attn.hook_q</code></td><td>{list(last.shape)}</td><td>[B, H, n, d_head]" in html_
    assert batch_gen.trace._repr_html_().startswith("<b>Trace(capture=&#x27;values&#x27;, steps=3")
    grid = attention.all_heads_figure(batch_gen.trace, 0)
    bundle = grid._repr_mimebundle_()
    assert bundle["application/vnd.plotly.v1+json"]["data"] == grid.figure.to_plotly_json()["data"]
    assert bundle["text/plain"].startswith("HeadsGrid(")
    import plotly.io as pio

    default = pio.renderers.default
    try:  # the renderer a person chose is followed, as for any figure: "notebook" writes the plot into the page
        pio.renderers.default = "notebook"
        bundle = grid._repr_mimebundle_()
        own = grid.figure._repr_mimebundle_()
    finally:
        pio.renderers.default = default
    assert "plotly-graph-div" in bundle["text/html"]
    assert set(bundle) == {*own, "application/vnd.plotly.v1+json", "text/plain"}


def test_the_attention_views_draw_a_plain_tracers_trace_and_the_others_say_what_they_need(bundled):
    """A trace of one forward under a plain Tracer (no generation): the attention stages, every head, O = A·V,
    the pitfalls, the mask and the shape flow draw it, on position labels; the views of a generation say so."""
    from gpt_shape_tracer.tracer import Tracer

    model, tok = bundled
    ids = tok.encode("Lily had a red ball. She")
    with Tracer(model, capture="values") as tr:
        model(torch.tensor([ids]))
    trace = tr.trace
    n = len(ids)
    assert key_labels(trace, 0) == [str(j) for j in range(n)] and query_labels(trace, 0) == key_labels(trace, 0)
    fig = attention.attention_stages_figure(trace, 0, layer=1, head=2)
    softmax = [t for t in fig.data if t.type == "heatmap"][-1]
    pattern = trace.get("blocks.1.attn.hook_pattern", 0)[0, 2]
    assert np.allclose(np.array(softmax.z, dtype=float), pattern.numpy(), atol=1e-6)
    assert list(softmax.x) == [str(j) for j in range(n)]
    grid = attention.all_heads_figure(trace, 0)
    assert grid.cells == (n, n)
    assert mask.mask_figure(trace, 0) is not None and pitfalls.pitfall_figure(trace, 0, 1, 2) is not None
    assert flow.shape_flow_figure(trace, 0) is not None
    for view in (lambda: tokens.next_token_figure(trace, 0), lambda: cache.cache_steps_figure(trace),
                 lambda: attention.attention_history_figure(trace, 1, 2, 0)):
        with pytest.raises(ValueError, match="this view shows a generation .* made by a plain Tracer"):
            view()


def test_the_stages_write_short_numbers_only_where_four_panels_leave_room(bundled):
    """Four panels side by side: a prompt of up to 5 tokens has its numbers written short (each fits a cell of
    the app's page at 1280 px), a longer one none; a single heatmap keeps 3 decimals up to 12."""
    from gpt_shape_tracer.tracer import Tracer

    model, tok = bundled
    for n, written in ((5, True), (6, False)):
        ids = torch.arange(1, n + 1)[None]
        with Tracer(model, capture="values") as tr:
            model(ids)
        fig = attention.attention_stages_figure(tr.trace, 0, 1, 0)
        maps = [d for d in fig.data if d.type == "heatmap" and d.text is not None]
        assert len(maps) == (4 if written else 0), n
        if written:
            pattern = tr.trace.get("blocks.1.attn.hook_pattern", 0)[0, 0]
            assert list(maps[-1].text[n - 1]) == [f"{float(v):.2f}" for v in pattern[n - 1]]
            assert max(len(t) for m in maps for row in m.text for t in row) <= 5
    assert [heatmap.short_number(v) for v in (-22.86, -8.147, 0.8871, 123.4, 0.0)] == ["-22.9", "-8.15", "0.89",
                                                                                          "123", "0.00"]


def test_the_stages_title_says_an_evicted_patterns_digest_counted_its_masked_weights(bundled):
    """A 200-token prefill under a 3 MiB budget: every pattern is evicted and a digest kept. The digest is the
    plain mean of adaptive pooling's blocks of the pattern — its masked weights, 0, counted, not left out — and
    the Stages title says just that, with the largest block (200 rows in 128 cells: blocks of 2 or 3)."""
    from gpt_shape_tracer.model.gpt import attention_path
    from gpt_shape_tracer.tracer import Tracer

    model, _ = bundled
    ids = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    # eager: the pattern a real tensor the budget evicts (a derived one is recomputed from Q and K instead)
    with torch.no_grad(), attention_path("eager"), Tracer(model, capture="values", budget_bytes=3 << 20) as small:
        model(ids)
    with torch.no_grad(), Tracer(model, capture="values") as whole:
        model(ids)
    rec = small.trace.record("blocks.0.attn.hook_pattern", 0)
    digest, pattern = pattern_digest(small.trace, rec), whole.trace.get(rec.name, 0)
    assert small.trace.value(rec) is None and digest is not None and tuple(digest.shape[2:]) == (128, 128)
    edges = [((i * 200) // 128, -(-((i + 1) * 200) // 128)) for i in range(128)]
    head = pattern[0, 0].double()
    expected = torch.tensor([[float(head[a:b, c:d].mean()) for c, d in edges] for a, b in edges], dtype=torch.float64)
    assert torch.allclose(digest[0, 0].double(), expected, atol=1e-6)  # every cell counted, the masked 0s too
    assert float(expected.triu(2).abs().max()) == 0 and float(head[torch.isfinite(head)].min()) == 0
    title = attention.one_line_title(attention.attention_stages_figure(small.trace, 0, 0, 0))
    largest = max(b - a for a, b in edges)
    assert title.endswith(f"— each cell is the mean of a block of at most {largest} × {largest} cells of the "
                          "200 × 200 matrix (every cell counted in A, a digest of evicted values)"), title
    assert "left out" not in title


def test_a_digest_drawn_with_the_whole_matrix_labels_gets_one_label_per_block():
    """A pooled digest (8 × 4 cells of a 32 × 16 matrix) given the whole matrix's labels: one label per cell, the
    block each stands for, and a caption saying so (before, all 16 / 32 labels went into the figure: 32,768 of
    them at 32k tokens, a 1 MB figure)."""
    digest = torch.rand(8, 4)
    xs, ys = [f"{j} · k" for j in range(16)], [f"{i} · q" for i in range(32)]
    g = heatmap.grid(digest, xs, ys)
    assert (len(g.x), len(g.y)) == (4, 8) and g.x[0] == "0…3" and g.y[-1] == "28…31"
    assert g.block == (4, 4) and g.shape == (32, 16) and "4 × 4 cells of the 32 × 16 matrix" in g.caption()
    # the tracer pooled it, as plain block means (a masked weight counts as its 0): not "for the page"
    assert g.caption().endswith("(every cell counted)") and "for the page" not in g.caption()
    assert np.allclose(g.z, digest.numpy())


def test_the_labelled_views_hold_their_tick_labels_and_titles_in_their_margins(llama_gen, batch_gen):
    """Issue 41's layout defects: RoPE's heatmaps had their tick labels clipped and axis titles drawn over the
    heatmaps at both widths (its builder was not fitted: the decorator sat on the function above it). Every view
    below must come out with margins that already hold its labels — fitting them again widens nothing."""
    import copy

    from gpt_shape_tracer.figures import attention, pitfalls, rope
    from gpt_shape_tracer.figures import gradients as grad_views
    from gpt_shape_tracer.figures.plot import fit_margins
    from gpt_shape_tracer.tracer import attention_gradients

    def unfitted(fig):
        before = fig.layout.margin.to_plotly_json()
        after = fit_margins(copy.deepcopy(fig)).layout.margin.to_plotly_json()
        return {side: (before.get(side), after[side]) for side in ("l", "r", "t", "b")
                if after.get(side, 0) > (before.get(side) or 0)}

    llama = llama_gen.trace
    views = {
        "RoPE": rope.rope_figure(llama, 2, 0, 0, 0),
        "RoPE, relative": rope.rope_relative_figure(llama, 2, 0, 0, 0),
        "Stages, grouped": attention.attention_stages_figure(llama, 0, 0, 3, 0),
        "Stages, padded batch": attention.attention_stages_figure(batch_gen.trace, 2, 1, 0, 1),
        "Pitfalls": pitfalls.pitfall_figure(batch_gen.trace, 0, 0, 0, 1),
        "Gradients": grad_views.gradients_figure(attention_gradients(batch_gen, 2, 1, 0, 1),
                                                 [str(j) for j in range(batch_gen.facts.width(2))]),
    }
    assert all(fig is not None for fig in views.values()), [k for k, v in views.items() if v is None]
    wide = {name: gap for name, fig in views.items() if (gap := unfitted(fig))}
    assert not wide, wide
    # the test can fail: the RoPE builder as it was (not fitted) leaves its labels outside its margins
    assert unfitted(rope.rope_figure.__wrapped__(llama, 2, 0, 0, 0))


@pytest.mark.parametrize("checked", ["1", "0"])
def test_set_layout_changes_a_figure_as_update_layout_does(checked, monkeypatch):
    """``plot.set_layout`` (assignment, for speed) against plotly's own ``update_layout`` on the same subplot figure,
    checked by plotly and not (as the app builds them): nested dicts merged (an axis' title, a margin given in part),
    lists and scalars replaced, a value set to None unset, the subplot titles' annotations replaced whole."""
    from gpt_shape_tracer.figures.plot import VALIDATE_ENV, merged, set_layout, subplots

    monkeypatch.setenv(VALIDATE_ENV, checked)

    def made() -> object:
        fig = subplots(rows=1, cols=3, subplot_titles=["a", "b", "c"], horizontal_spacing=0.075)
        fig.update_layout(xaxis2={"title": {"text": "before", "font": {"size": 9}}, "tickangle": 30},
                          margin={"l": 3, "r": 4, "t": 5, "b": 6})
        return fig

    changes = [
        {"xaxis2": {"type": "category", "tickvals": ["0", "1"], "ticktext": ["x", "y"], "title": {"text": "key"}},
         "yaxis2": {"autorange": "reversed", "showticklabels": False, "title": {"text": None}, "tickvals": None},
         "plot_bgcolor": "white"},
        {"margin": {"t": 95, "autoexpand": False}, "height": 420,
         "title": {"text": "layer 0", "y": 0.98, "yref": "container", "font": {"size": 13}}},
    ]
    by_plotly, by_us = made(), made()
    for change in changes:
        by_plotly.update_layout(change)
        set_layout(by_us, change)
    by_plotly.update_annotations(font_size=12)
    set_layout(by_us, {"annotations": [merged(a.to_plotly_json(), {"font": {"size": 12}})
                                       for a in by_us.layout.annotations]})
    assert json.loads(by_us.to_json()) == json.loads(by_plotly.to_json())  # what is sent: a null is not an absence
    assert by_us.layout.xaxis2.title.font.size == 9 and by_us.layout.xaxis2.tickangle == 30  # merged, not replaced
    assert by_us.layout.margin.l == 3 and by_us.layout.margin.t == 95
