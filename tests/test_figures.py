"""Every figure builder, without Streamlit: the figure's data equals the traced tensors."""

from __future__ import annotations

import math
import re
from html import unescape

import pytest
import torch

from figures import attention, cache, flow, inspector, mask, tokens
from figures.common import key_labels, query_labels, safe_text
from tracer.generation import TracedGeneration

PROMPT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module")
def gen(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, PROMPT, temperature=0.8, top_k=30, seed=3, capture="ops")
    g.run(4)
    return g


@pytest.fixture(scope="module")
def batch_gen(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, [PROMPT, "Tom said, <script>alert(1)</script>"], temperature=0)
    g.run(3)
    return g


def z_tensor(z) -> torch.Tensor:
    return torch.tensor([[math.nan if v is None else v for v in row] for row in z], dtype=torch.float64)


def same(z, expected: torch.Tensor) -> bool:
    """Plotly z (None for ±∞) equals the tensor, with every infinite entry drawn as a gap."""
    got = z_tensor(z)
    exp = expected.double()
    gaps = ~torch.isfinite(exp)
    return bool(torch.isnan(got[gaps]).all()) and torch.allclose(got[~gaps], exp[~gaps], atol=1e-6)


@pytest.mark.parametrize("step", [0, 3])
def test_attention_stages_figure_shows_the_four_traced_stages(gen, step):
    t = gen.trace
    fig = attention.attention_stages_figure(t, step, layer=2, head=1)
    heatmaps = [d for d in fig.data if d.type == "heatmap"]
    assert len(heatmaps) == 4
    for hm, hook in zip(heatmaps, attention.STAGES):
        assert same(hm.z, t.get(f"blocks.2.attn.{hook}", step)[0, 1]), hook
    n0 = gen.info.prompt_lengths[0]
    n, n_keys = (n0, n0) if step == 0 else (1, n0 + step)
    assert len(heatmaps[3].z) == n and len(heatmaps[3].z[0]) == n_keys
    titles = [a.text for a in fig.layout.annotations]
    assert any(f"[1, 4, {n}, 32] @ [1, 4, 32, {n_keys}] → [1, 4, {n}, {n_keys}]" in text for text in titles)
    assert any("√32 = 5.657" in text for text in titles)


def test_all_heads_figure_tiles_every_layer_and_head(gen):
    fig, note = attention.all_heads_figure(gen.trace, 0)
    assert len(fig.data) == 1 and note == ""
    z = z_tensor(fig.data[0].z)
    n = t = gen.info.prompt_lengths[0]
    gap_cols = max(1, t // 16)
    assert z.shape == (4 * (n + 1) - 1, 4 * (t + gap_cols) - gap_cols)
    for layer in range(4):
        pattern = gen.trace.get(f"blocks.{layer}.attn.hook_pattern", 0)
        for head in range(4):
            r0, c0 = layer * (n + 1), head * (t + gap_cols)
            assert torch.allclose(z[r0:r0 + n, c0:c0 + t], pattern[0, head].double(), atol=5e-4), (layer, head)
        if layer < 3:
            assert torch.isnan(z[r0 + n]).all()  # the gap between layers
    assert list(fig.layout.yaxis.ticktext) == ["L0", "L1", "L2", "L3"]
    assert list(fig.layout.xaxis.ticktext) == ["H0", "H1", "H2", "H3"]
    assert fig.data[0].y[n + 1] == "L1 q0" and fig.data[0].x[t + gap_cols + 2] == "H1 k2"


def test_all_heads_grid_of_a_decode_step_has_one_row_per_head(gen):
    fig, _ = attention.all_heads_figure(gen.trace, 2)
    z = z_tensor(fig.data[0].z)
    t = gen.info.prompt_lengths[0] + 2
    assert z.shape[0] == 4 * 2 - 1
    pattern = gen.trace.get("blocks.2.attn.hook_pattern", 2)
    gap_cols = max(1, t // 16)
    assert torch.allclose(z[4, 3 * (t + gap_cols):3 * (t + gap_cols) + t], pattern[0, 3, 0].double(), atol=5e-4)
    assert fig.data[0].y[4] == f"L2 q{t - 1}"


def test_all_heads_grid_is_trimmed_when_too_big(gen, monkeypatch):
    monkeypatch.setattr(attention, "ALL_HEADS_MAX_CELLS", 16 * 14 * 5)
    fig, note = attention.all_heads_figure(gen.trace, 0)
    assert "newest" in note
    shown = int(note.split("newest ")[1].split(" ")[0])
    assert shown < gen.info.prompt_lengths[0] and len(fig.data[0].z) == 4 * (shown + 1) - 1


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
        row = t.get("blocks.1.attn.hook_pattern", s)[0, 2, 0]
        assert torch.allclose(matrix[n0 + s - 1, : n0 + s], row)
    upper = torch.ones_like(matrix, dtype=torch.bool).triu(1)
    assert torch.isnan(matrix[upper]).all()  # masked and not-yet-existing keys look the same: blank
    assert rows[-1].startswith("s3 · ")


def test_history_leaves_padding_queries_blank(batch_gen):
    lengths = batch_gen.info.prompt_lengths
    row = lengths.index(min(lengths))
    pad = max(lengths) - lengths[row]  # left padding: the first columns of the short row
    matrix, rows, _, _ = attention.attention_history(batch_gen.trace, 0, 0, 2, batch=row)
    assert torch.isnan(matrix[:pad]).all() and all("padding: no query" in r for r in rows[:pad])
    real = batch_gen.trace.get("blocks.0.attn.hook_pattern", 0)[row, 0, pad]
    assert torch.allclose(matrix[pad, : pad + 1], real[: pad + 1])
    assert not any("padding" in r for r in rows[pad:])


def test_mask_views_count_and_draw_the_mask(gen):
    t = gen.trace
    n0 = gen.info.prompt_lengths[0]
    facts = mask.mask_facts(t, 0)
    assert facts.masked == n0 * (n0 - 1) // 2 and not facts.decode
    decode = mask.mask_facts(t, 2)
    assert decode.decode and decode.masked == 0 and decode.shape == (1, 1, 1, n0 + 2)
    assert "masks nothing" in decode.explanation()
    fig = mask.mask_figure(t, 0)
    assert torch.equal(torch.tensor(fig.data[0].z).bool(), torch.isinf(t.get("blocks.0.attn.hook_mask", 0)[0, 0]))
    before_after = mask.scores_before_after_figure(t, 0, 1, 3)
    assert same(before_after.data[0].z, t.get("blocks.1.attn.hook_attn_scores", 0)[0, 3])
    assert same(before_after.data[1].z, t.get("blocks.1.attn.hook_masked_scores", 0)[0, 3])


def test_mask_facts_name_the_padding_columns(batch_gen):
    lengths = batch_gen.info.prompt_lengths
    row = lengths.index(min(lengths))
    facts = mask.mask_facts(batch_gen.trace, 0, batch=row)
    width, short = max(lengths), lengths[row]
    assert width > short
    assert facts.padding_columns == list(range(width - short))
    assert "padding" in facts.explanation()
    # M holds one block per sequence here: the counts say whose block they are
    m = batch_gen.trace.get("blocks.0.attn.hook_mask", 0)
    assert m.shape[0] == len(lengths)
    assert f"in sequence {row}'s n × t block, {int(torch.isinf(m[row, 0]).sum())} entries are −∞" in facts.explanation()
    decode = mask.mask_facts(batch_gen.trace, 2, batch=row).explanation()
    assert "causality masks nothing (only the padding columns below are −∞)" in decode


def test_cache_views_show_the_traced_keys(gen):
    t = gen.trace
    n0 = gen.info.prompt_lengths[0]
    table = cache.cache_table(t, 2)
    assert list(table["K"]) == [f"[1, 4, {n0 + 2}, 32]"] * 4
    assert list(table["rows computed this step"]) == [1] * 4 and list(table["rows from the cache"]) == [n0 + 1] * 4
    growth = cache.cache_growth(t)
    assert list(growth["cache length"]) == [n0, n0 + 1, n0 + 2, n0 + 3]
    assert list(growth["K+V bytes (all layers)"]) == [2 * 4 * 4 * (n0 + s) * 32 * 4 for s in range(4)]
    fig = cache.key_heatmap_figure(t, 2, 3, 1, which="K")
    assert same(fig.data[0].z, t.get("blocks.3.attn.hook_k_all", 2)[0, 1])
    rect = fig.layout.shapes[0]
    assert (rect.y0, rect.y1) == (n0 + 2 - 1 - 0.5, n0 + 2 - 0.5)  # the one row added at step 2
    v = cache.key_heatmap_figure(t, 2, 0, 0, which="V")
    assert same(v.data[0].z, t.get("blocks.0.attn.hook_v_all", 2)[0, 0])
    rows = cache.rows_computed(t)
    assert list(rows["with cache"]) == [n0, 1, 1, 1] and list(rows["without cache"]) == [n0, n0 + 1, n0 + 2, n0 + 3]
    measured = {3: gen.compare_with_recompute()}
    fig = cache.cache_on_off_figure(t)
    by_name = {d.name: d for d in fig.data}
    assert list(by_name["with cache"].y) == [n0, 1, 1, 1]
    assert list(by_name["cached path"].x) == [3] and list(by_name["cached path"].y) == [measured[3].cached.seconds]
    assert list(by_name["full recompute"].y) == [measured[3].full.seconds]
    traced = next(d for d in fig.data if d.name.startswith("this run, traced"))
    assert list(traced.y) == [info.seconds for info in t.steps]


def test_next_token_figures_plot_the_sampled_distribution(gen):
    t = gen.trace
    info = gen.facts.step(1).sampling
    fig = tokens.next_token_figure(t, 1)
    bars = fig.data[0]
    final = info.stage_probs[0][3]
    assert sorted(bars.y, reverse=True) == sorted(final, reverse=True) and list(bars.y) == sorted(bars.y, reverse=True)
    red = [x for x, c in zip(bars.x, bars.marker.color) if c == "#ff4b4b"]
    chosen = info.candidate_labels[0][info.candidates[0].index(info.tokens[0])]
    assert red == [f"{safe_text(chosen)} ({info.tokens[0]})"]
    stages = tokens.distribution_stages_figure(t, 1)
    assert len(stages.data) == 4 and "30 token(s) left" in stages.data[2].name


def test_generated_text_is_escaped_and_time_travels(batch_gen):
    t = batch_gen.trace
    html = tokens.generated_text_html(t, 1)
    assert "<script>" not in html and "&lt;" in html
    visible = unescape(re.sub(r"<[^>]+>", "", html))
    assert visible.startswith("Tom said, <script>alert(1)</script>")
    assert html.count("title='step") == 3
    assert tokens.generated_text_html(t, 1, upto_step=0).count("title='step") == 1


def test_token_text_is_escaped_for_markup_but_quotes_stay_readable():
    # plotly shows &quot; literally, and with < escaped no tag (so no attribute) can open
    assert safe_text('say "hi" & <b>') == 'say "hi" &amp; &lt;b&gt;'


def test_next_token_labels_say_what_chose_the_token(gen, batch_gen):
    greedy = tokens.next_token_figure(batch_gen.trace, 1)
    assert greedy.layout.annotations[0].text == "chosen (argmax)"
    sampled = tokens.next_token_figure(gen.trace, 1)
    assert sampled.layout.annotations[0].text == "sampled"
    names = [d.name for d in tokens.distribution_stages_figure(gen.trace, 1).data]
    assert names[3].startswith("top-p (off) — ") and not names[2].startswith("top-k (off)")


def test_query_attention_html_is_escaped(batch_gen):
    html = attention.query_attention_html(batch_gen.trace, 0, 0, 0, query=-1, batch=1)
    assert "<script>" not in html and "&lt;" in html


def test_flow_nodes_show_the_recorded_shapes_and_symbols(gen):
    t = gen.trace
    frame = flow.flow_table(t, 3, layer=1)
    n0 = gen.info.prompt_lengths[0]
    for row in frame.itertuples():
        assert row.shape == t.record(row.record, 3).shape, row.record
    by_record = dict(zip(frame.record, frame.symbols))
    assert by_record["blocks.1.attn.hook_q"] == "[B, H, n, d_head]"
    assert by_record["blocks.1.attn.hook_k_all"] == "[B, H, t, d_head]"
    assert by_record["blocks.1.mlp.hook_pre"] == "[B, n, 4d]" and by_record["hook_logits"] == "[B, n, V]"
    assert by_record["model:in[0]"] == "[B, n]"
    fig = flow.shape_flow_figure(t, 3, layer=1)
    texts = " ".join(a.text for a in fig.layout.annotations)
    assert f"[1, 4, {n0 + 3}, 32]" in texts and "[1, 1, 1024]" in texts
    assert "[1, 4, 1, 32]" in texts
    assert "block 1 shown; blocks 0 … 3 except 1 repeat the same shapes" in texts


@pytest.mark.parametrize(("layer", "n_layer", "expected"), [
    (0, 4, "block 0 shown; blocks 1 … 3 repeat the same shapes"),
    (3, 4, "block 3 shown; blocks 0 … 2 repeat the same shapes"),
    (1, 4, "block 1 shown; blocks 0 … 3 except 1 repeat the same shapes"),
    (0, 2, "block 0 shown; block 1 repeats the same shapes"),
    (0, 1, "block 0 is the only block"),
])
def test_the_flow_names_the_other_blocks_by_their_hook_numbers(layer, n_layer, expected):
    assert flow.repeat_note(layer, n_layer) == expected


def test_labels_for_queries_and_keys(gen):
    keys = key_labels(gen.trace, 2)
    assert len(keys) == gen.info.prompt_lengths[0] + 2 and keys[0] == "0 · Once"
    assert query_labels(gen.trace, 2) == keys[-1:]


def test_inspector_slices_histograms_and_raw_numbers(gen):
    value = gen.trace.get("blocks.0.attn.hook_pattern", 0)
    m = inspector.slice_2d(value, 2, 3, {0: 0, 1: 2})
    assert torch.equal(m, value[0, 2])
    assert torch.equal(inspector.slice_2d(value, 3, 2, {0: 0, 1: 2}), value[0, 2].T)
    with pytest.raises(IndexError):
        inspector.slice_2d(value, 2, 3, {1: 9})
    fig = inspector.tensor_heatmap_figure(m, "p")
    assert same(fig.data[0].z, m)
    hist = inspector.histogram_figure(value, "h")
    assert len(hist.data[0].x) == value.numel()
    small = gen.trace.get("model:in[0]", 1)
    assert inspector.raw_frame(small).values.tolist() == small.tolist()
    assert inspector.raw_frame(gen.trace.get("hook_logits", 0)) is None
    ops = inspector.module_ops(gen.trace, 0, "blocks.0.attn")
    assert "Tensor.transpose" in set(ops.op) and (ops["output shape"] != "").all()
