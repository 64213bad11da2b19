"""Every sentence the new views state with a number or a comparison, run over the settings matrix
(tests/settings_matrix.py: prefill and decode, the cache off, left and right padding, a batch, a sliding window
and a soft-cap, a loaded trace, both bundled models) and checked against the numbers recomputed here from the
trace's own records. One test per statement of issue 41 (2–16); each failed on the text before its fix."""

from __future__ import annotations

import math
from html import unescape

import pytest
import torch

from gpt_shape_tracer.figures import flash, pitfalls, rope
from gpt_shape_tracer.model.gpt import act_name
from tests.settings_matrix import STEPS, build_matrix


@pytest.fixture(scope="module")
def matrix():
    return build_matrix()


def cases(matrix, steps=range(STEPS)):
    """(name, generation or None, trace, step, batch) over the matrix."""
    for name, (gen, trace) in matrix.items():
        for step in steps:
            for batch in range(trace.generation.batch_size):
                yield name, gen, trace, step, batch


# -- 3 and 4: FlashAttention's tile sentence and its memory sentence --------------------------------------------
def mask_rows(trace, step, layer, batch, rows):
    mask = trace.get(act_name("mask", layer), step)
    return mask[min(batch, mask.shape[0] - 1), 0, rows[0]:rows[1]]  # [r, t]


def test_3_the_tile_sentence_counts_rows_still_waiting_and_rescaled_rows(matrix):
    checked = 0
    for name, _, trace, step, batch in cases(matrix):
        layer = trace.config.n_layer - 1
        n = trace.record(act_name("q", layer), step).shape[2]
        for block in (4, 8):
            for query_block in range(math.ceil(n / block)):
                run = flash.flash_attention(trace, step, layer, 0, batch, block=block, query_block=query_block)
                visible = torch.isfinite(mask_rows(trace, step, layer, batch, run.rows))  # [r, t]
                rows = run.rows[1] - run.rows[0]
                last_key = [max((j for j in range(visible.shape[1]) if visible[r, j]), default=-1)
                            for r in range(rows)]
                for tile in run.tiles:
                    text = flash.tile_sentence(run, tile.index)
                    end = tile.keys[1]
                    waiting = [r for r in range(rows) if last_key[r] >= end]
                    if waiting:
                        later = sum(1 for t in run.tiles[tile.index + 1:]
                                    if visible[waiting, t.keys[0]:t.keys[1]].any())
                        assert f"{len(waiting)} of the {rows} row(s) still have unmasked keys in {later} later" \
                            in text, (name, step, batch, block, tile.index, text)
                    else:
                        assert "still" not in text and "Every row's output is final" in text, (name, text)
                        gap = float((tile.output - run.reference.double()).abs().max())
                        assert gap < 1e-5, (name, step, batch, tile.index)  # final means final
                    all_masked = not bool(visible[:, tile.keys[0]:end].any())
                    assert tile.skipped == all_masked
                    if all_masked:
                        assert "skipped" in text
                    before = run.tiles[tile.index - 1].m if tile.index else torch.full((rows,), -math.inf)
                    rose = int((torch.isfinite(before) & (tile.m > before)).sum())
                    if rose:
                        assert f"{rose} of the {rows} row(s) found a larger max" in text
                    else:
                        assert "found a larger max" not in text
                    checked += 1
    assert checked > 300


def test_3_masked_cells_are_drawn_apart_from_unread_ones(matrix):
    _, trace = matrix["left padding"]
    n = trace.record(act_name("q", 0), 0).shape[2]
    run = flash.flash_attention(trace, 0, 0, 0, 1, block=4, query_block=(n - 1) // 4)  # padding keys first
    fig = flash.flash_figure(trace, 0, run, 1)
    masked = next(d for d in fig.data if d.name == "masked")
    unread = next(d for d in fig.data if d.name == "not read yet")
    drawn_masked = torch.tensor([[v == v and v is not None for v in row] for row in masked.z])
    assert torch.equal(drawn_masked, torch.isinf(run.scores))
    drawn_unread = torch.tensor([[v == v and v is not None for v in row] for row in unread.z])
    expected = torch.zeros_like(drawn_unread)
    expected[:, run.tiles[1].keys[1]:] = True
    assert torch.equal(drawn_unread, expected & ~torch.isinf(run.scores))


def test_4_the_memory_sentence_compares_like_with_like_and_says_where_tiles_win(matrix):
    for name, _, trace, step, batch in cases(matrix):
        for block in (4, 16):
            run = flash.flash_attention(trace, step, 0, 0, batch, block=block, query_block=0)
            rows, t, size = run.rows[1] - run.rows[0], run.scores.shape[1], run.itemsize
            assert run.tile_bytes == (rows * min(block, t) + 2 * rows) * size  # the output is on neither side
            assert run.full_bytes == rows * t * size
            text = flash.memory_sentence(run)
            win = block + 3  # rows·b + 2·rows < rows·t  ⇔  t > b + 2
            assert f"hold fewer from t = {win} on" in text
            assert ("fewer here" in text) == (t >= win), (name, step, text)
            if run.n == 1:
                assert f"one row of t = {t}" in text and "grow linearly" in text, (name, step)
                assert "the n × t matrix grows with the square" not in text
            else:
                assert f"n × t = {run.n} × {t}" in text


def test_5_the_default_query_block_holds_the_last_real_row(matrix):
    for name, _, trace, step, batch in cases(matrix):
        real = trace.generation.is_token(batch, step)
        n = trace.record(act_name("q", 0), step).shape[2]
        last = max(i for i, r in enumerate(real[-n:]) if r)
        for block in (4, 8):
            assert flash.default_query_block(trace, step, batch, block) == last // block, name
            run = flash.flash_attention(trace, step, 0, 0, batch, block=block,
                                        query_block=last // block)
            note = flash.padding_rows_note(trace, step, batch, run)
            padding = sum(not r for r in real[-n:][run.rows[0]:run.rows[1]])
            assert (f"{padding} of the" in note) if padding else note == ""


def test_5_the_row_table_follows_the_online_softmax(matrix):
    _, trace = matrix["story-gpt"]
    run = flash.flash_attention(trace, 0, 1, 2, 0, block=4, query_block=2)
    table = flash.row_table(run, 3)
    s = run.scores[3]
    for _, r in table.iterrows():
        read = s[: int(r["keys"].split("…")[1]) + 1]
        assert r["m_new"] == pytest.approx(float(read.max()))
        assert r["ℓ after"] == pytest.approx(float(torch.exp(read - read.max()).sum()))
        if math.isfinite(r["m_old"]):
            assert r["exp(m_old − m_new)"] == pytest.approx(math.exp(r["m_old"] - r["m_new"]))
            assert r["ℓ after"] == pytest.approx(r["exp(m_old − m_new)"] * r["ℓ before"]
                                                 + r["Σ exp(s − m_new) of the tile"])
    with pytest.raises(ValueError, match="row 9"):
        flash.row_table(run, 9)


# -- 5, 6, 7: what grows with n ---------------------------------------------------------------------------------
def test_5_6_7_what_grows_with_n_at_this_step_and_window(matrix):
    from gpt_shape_tracer.figures import cache

    for name, gen, trace, step, _ in cases(matrix):
        config = trace.config
        forward = trace.generation.step(step).forward
        layers = cache.window_layers(trace, step)
        fig, text = cache.growth_figure(config, forward.t, 4, forward.n, layers)
        H, G, L = config.n_head, config.n_kv_head or config.n_head, config.n_layer
        # 5: this step's scores are H × n × t (n = 1 at a cached decode step), not H·t²
        numbers = H * forward.n * forward.t
        assert f"H × {'1' if forward.n == 1 and forward.t > 1 else 'n'} × t = {H} × {forward.n} × {forward.t}" \
            in text, (name, step, text)
        assert f"{cache._size(numbers * 4)}, against" in text
        # 6: the first whole n at which H·n² > 2·L·G·n·d_head, counted
        n = 1
        while H * n * n <= 2 * L * G * n * config.d_head:
            n += 1
        if n <= config.n_ctx:
            assert f"from n = {n:,} on" in text
        else:
            assert "from n =" not in text.split("outgrow")[-1] or "never larger" in text or "stay below" in text
        # 7: a sliding window, read from the masks, agrees with the model's own layer types
        hf = getattr(gen.model, "hf", None) if gen is not None else None
        types = getattr(getattr(hf, "config", None), "layer_types", None)
        if types is not None and config.sliding_window and forward.t > config.sliding_window:
            assert layers == [i for i, kind in enumerate(types) if kind == "sliding_attention"], (name, step)
        if layers:
            assert "not quadratic" in text and f"window of {config.sliding_window} keys" in text
            assert any(d.name.startswith("scores a windowed layer needs") for d in fig.data)
        else:
            assert "not quadratic" not in text
    gpt = matrix["story-gpt"][1].config
    assert 2 * gpt.n_layer * gpt.n_head * gpt.d_head / gpt.n_head == gpt.n_ctx  # story-gpt: equal at n_ctx…
    text = cache.growth_sentence(gpt, 10)
    assert f"only at n = {gpt.n_ctx:,} = n_ctx, and are never larger inside it" in text  # …never larger
    assert cache.window_layers(matrix["gemma2 (window, soft-cap)"][1], 2)  # the matrix has a window to show


# -- 8: a cheaper cache -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["int8", "bfloat16"])
def test_8_sharing_and_quantizing_each_say_their_own_saving(matrix, storage):
    from gpt_shape_tracer.figures import cache_precision as precision_views
    from gpt_shape_tracer.tracer import cache_precision

    for name in ("story-llama", "story-gpt"):
        gen = matrix[name][0]
        run = cache_precision(gen, storage, 3)
        text = precision_views.sharing_sentence(run)
        assert "saves again" not in text
        if run.kv_heads < run.query_heads:
            multi = run.reference_bytes * run.query_heads // run.kv_heads
            assert f"{1 - run.reference_bytes / multi:.0%} less" in text
            assert f"{1 - run.stored_bytes / run.reference_bytes:.0%} less" in text
            assert f"Together, {1 - run.stored_bytes / multi:.0%} less" in text
        else:
            assert text == run.formula() + "."


# -- 15: the timing warning states no unmeasured cause as fact ------------------------------------------------
def test_15_the_timing_warning_does_not_state_an_unmeasured_cause(matrix):
    import dataclasses

    from gpt_shape_tracer.figures import cache

    gen = matrix["story-gpt"][0]
    comparison = gen.compare_with_recompute(timing_repeats=1)
    slow = dataclasses.replace(comparison, cached=dataclasses.replace(comparison.cached, seconds=1.0),
                               full=dataclasses.replace(comparison.full, seconds=0.001))
    assert slow.timing_contradicts_count
    text = cache.timing_warning(slow)
    assert "another program was running" not in text and "Why was not measured" in text
    assert "1000.0 ms cached vs 1.0 ms full" in text


# -- 16: what a padding query row attends to, as the docs say it ---------------------------------------------
def test_16_padding_query_rows_attend_where_the_docs_say(matrix):
    from pathlib import Path

    limits = " ".join((Path(__file__).parents[2] / "docs" / "limits.md").read_text().split())
    assert "attend only to themselves" not in limits
    assert "With left padding a padding row comes before every real token" in limits
    assert "With right padding a padding row comes after the real tokens, and attends to them and to itself" in limits
    assert "a transformers-run model gives it the weight 1/t on every key" in limits
    for name in ("left padding", "right padding", "gemma2 (window, soft-cap)"):
        gen, trace = matrix[name]
        facts = trace.generation
        real = facts.is_token(1, 0)  # "Tom ran": the short, padded sequence, at the prefill
        pattern = trace.get(act_name("pattern", 0), 0)[1, 0]  # [t, t]
        t = len(real)
        for row in (i for i in range(t) if not real[i]):
            weights = pattern[row]
            if facts.info.padding_side == "right":
                seen = {j for j in range(t) if weights[j] > 0}
                assert seen == {j for j in range(row + 1) if real[j]} | {row}, (name, row)
            elif gen.model.config.family == "hf":
                assert torch.allclose(weights, torch.full_like(weights, 1 / t)), (name, row)
            else:
                assert weights[row] == pytest.approx(1.0) and float(weights.sum()) == pytest.approx(1.0)


# -- 2: the logit lens labels its columns as every other view does ------------------------------------------------
def test_2_the_logit_lens_labels_each_column_by_its_own_position(matrix):
    from gpt_shape_tracer.figures import whatif
    from gpt_shape_tracer.figures.common import key_labels, safe_text
    from gpt_shape_tracer.tracer import logit_lens

    live = matrix["left padding"][0].model
    for name, gen, trace, step, batch in cases(matrix):
        model = gen.model if gen is not None else live
        frame = logit_lens(trace, step, batch, model=model)
        fig, _ = whatif.lens_figure(frame, model.config.n_layer)
        n = trace.record(act_name("q", 0), step).shape[2]
        heat = fig.data[-1]
        wanted = [safe_text(label) for label in key_labels(trace, step, batch)[-n:]][-len(heat.x):]
        assert [x.split(" · ")[0] for x in heat.x] == [w.split(" · ")[0] for w in wanted], (name, step, batch)


# -- 9, 10, 11, 12: the gradients' sentences -----------------------------------------------------------------------
def gradient_cases(matrix):
    for name in ("story-gpt", "cache off", "left padding", "right padding", "story-llama",
                 "gemma2 (window, soft-cap)"):
        gen = matrix[name][0]
        for step in (0, 2):
            yield name, gen, step


def test_9_10_11_the_gradients_say_what_they_cover_and_what_they_compute(matrix):
    from gpt_shape_tracer.figures import gradients as grad_views
    from gpt_shape_tracer.tracer import attention_gradients

    for _, gen, step in gradient_cases(matrix):
        batch = gen.facts.batch_size - 1  # the short, padded sequence of a batch
        result = attention_gradients(gen, step, gen.model.config.n_layer - 1, 1, batch)
        forward, t = gen.facts.step(step).forward, gen.facts.width(step)
        # 9: a cached decode step's one row is the last of the t rows the fresh forward computes
        scope = grad_views.scope_sentence(gen.facts, step)
        assert result.formula["G_P"].shape == (t, t)
        if forward.n < t:
            assert f"fresh forward of all {t} positions without the cache" in scope and "cached decode step" in scope
        else:
            assert f"show its {t} query rows" in scope
        # 10: G_O is autograd's own, named so; the five others are compared
        level, text = grad_views.agreement(result)
        assert level == "success" and "All six" not in text
        assert "Starting from autograd's G_O = ∂L/∂O, the 5 gradients computed from their formulas" in text
        assert result.computed == ("G_V", "G_P", "G_S", "G_Q", "G_K")
        fig = grad_views.gradients_figure(result, [str(j) for j in range(t)])
        titles = [a.text for a in fig.layout.annotations]
        assert titles[0].endswith("autograd's own") and all("|Δ| ≤" in x for x in titles[1:])
        # item 5: one colour bar per panel
        bars = [d for d in fig.data if d.type == "heatmap" and d.showscale is not False and d.colorbar.title.text]
        assert sorted(b.colorbar.title.text for b in bars) == sorted(result.formula)
        # 11: the norms' sentence states the factors and calls a trend only when there is one
        norms = result.norms["resid_pre"]
        factors = [norms[i] / norms[i + 1] for i in range(len(norms) - 1)]
        sentence = grad_views.norms_sentence(result)
        for i, f in enumerate(factors):
            assert f"block {i + 1} → {i}: ×{f:.3g}" in sentence
        vanishing, exploding = all(f <= 0.1 for f in factors), all(f >= 10 for f in factors)
        if len(factors) < 2:
            assert "one change, not a trend" in sentence
        else:
            assert ("vanishing toward the input" in sentence) == vanishing
            assert ("exploding toward the input" in sentence) == exploding
            assert ("shows neither" in sentence) == (not vanishing and not exploding)


def test_11_a_steady_fall_is_called_vanishing():
    import dataclasses

    from gpt_shape_tracer.figures import gradients as grad_views
    from gpt_shape_tracer.tracer import HeadGradients

    base = HeadGradients("x", 1.0, 0, 0, 0, {}, {}, {"resid_pre": [1e-6, 1e-4, 1e-2, 1.0]})
    assert "vanishing toward the input" in grad_views.norms_sentence(base)
    rising = dataclasses.replace(base, norms={"resid_pre": [1e6, 1e4, 1e2, 1.0]})
    assert "exploding toward the input" in grad_views.norms_sentence(rising)
    two = dataclasses.replace(base, norms={"resid_pre": [10.7, 1.0]})
    assert "one change, not a trend" in grad_views.norms_sentence(two)


def test_12_a_soft_capped_head_gets_its_gradients_with_the_caps_factor(tmp_path):
    """Gemma 2 with a small cap, so that the factor 1 − tanh²(s·QKᵀ/c) is far from 1: the formulas with it equal
    autograd's; without it (G_Q = s·G_S·K) they would not."""
    import transformers
    from transformers import AutoModelForCausalLM

    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.sources import ASSETS
    from gpt_shape_tracer.tracer import TracedGeneration, attention_gradients
    from tests.hf_architectures import ARCHITECTURES

    kwargs = dict(ARCHITECTURES["gemma2"][1], attn_logit_softcapping=0.5)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(transformers.Gemma2Config(**kwargs)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4.0)  # scores large against the cap
    hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((ASSETS / "story-gpt" / "tokenizer.json").read_bytes())
    model, tok = load_hf(tmp_path)
    assert model.config.attn_softcap == 0.5
    gen = TracedGeneration(model, tok, ["Once upon a time, there was a little girl named Lily.", "Tom ran"],
                           temperature=0)
    gen.run(2)
    for step in (0, 1):
        for layer in (0, 1):
            result = attention_gradients(gen, step, layer, 2, 0)
            assert result.softcap == 0.5
            scale = model.config.attn_scale
            q, k = gen.trace.get(act_name("q", layer), step)[0, 2].double(), None
            k_all = gen.trace.get(act_name("k_all", layer), step)[0].double()
            k = k_all[2 // (model.config.n_head // model.config.n_kv_head)]
            for name in ("G_Q", "G_K"):
                top = float(result.autograd[name].abs().max())
                assert top > 0
                assert result.max_abs_delta(name) <= 1e-6 * max(1.0, top), (step, layer, name)
            plain_q = scale * result.formula["G_S"] @ k  # without the cap's factor
            assert float((plain_q - result.autograd["G_Q"]).abs().max()) > 1e-3 * top, (step, layer)
            del q


# -- 13: a column is a column; RoPE names the position it rotates with -----------------------------------------
def test_13_rope_says_column_and_rotation_position_apart(matrix):

    for name in ("left padding", "right padding", "story-llama", "loaded trace"):
        _, trace = matrix[name]
        if trace.config.positions != "rope":
            continue
        for step in range(STEPS):
            for batch in range(trace.generation.batch_size):
                fig = rope.rope_relative_figure(trace, step, 0, 0, batch)
                if fig is None:
                    continue
                title = fig.layout.title.text
                forward = trace.generation.step(step).forward
                real = trace.generation.is_token(batch, step)
                new = [j for j in range(forward.t - forward.n, forward.t) if real[j]]
                query_col, key_col = new[-1], new[0]
                m, n = sum(real[:query_col]), sum(real[:key_col])
                assert f"query in column {query_col}" in title and f"m = {m}" in title, (name, step, batch, title)
                assert f"key in column {key_col}" in title and f"n = {n}" in title
                assert ("not padding" in title) == ((query_col, key_col) != (m, n))
        fig = rope.rope_figure(trace, 0, 0, 0, 0)
        assert fig.layout.yaxis.title.text == "column · token"


# -- 14: the pitfalls' means are over the real query rows --------------------------------------------------------
def test_14_the_pitfalls_average_the_real_query_rows_only(matrix):

    for name, _, trace, step, batch in cases(matrix):
        for layer in (0, trace.config.n_layer - 1):
            variants = pitfalls.pitfall_patterns(trace, step, layer, 0, batch)
            n = variants["as the model does it"].shape[0]
            real = torch.tensor(trace.generation.is_token(batch, step)[-n:])
            table = pitfalls.pitfall_table(trace, step, layer, 0, batch).set_index("variant")
            after = variants["mask after the softmax"][real]
            assert table.loc["mask after the softmax", "row sum"] == pytest.approx(float(after.sum(-1).mean()))
            text = pitfalls.pitfall_sentence(trace, step, layer, 0, batch)
            if "mean row sum" in text:
                assert f"mean row sum {float(after.sum(-1).mean()):.3f} over the {int(real.sum())} real query" in text
                padding = n - int(real.sum())
                assert (f"the {padding} padding rows" in text) == (padding > 0)
            if name.startswith("gemma2") and step > 0:
                assert "where the key is padding" not in text or batch == 1  # the window is not padding


# -- say it first: each view's takeaway, from its own numbers ----------------------------------------------------
def test_the_takeaways_state_their_own_numbers(matrix):
    from gpt_shape_tracer.figures import attention, cache, whatif
    from gpt_shape_tracer.figures.common import inert, key_labels
    from gpt_shape_tracer.model.analysis import forward_parts
    from gpt_shape_tracer.tracer import direct_logit_attribution, logit_lens

    live = matrix["left padding"][0].model
    for name, gen, trace, step, batch in cases(matrix):
        layer = trace.config.n_layer - 1
        a = trace.get(act_name("pattern", layer), step)[batch, 0].double()
        real = trace.generation.is_token(batch, step)[-a.shape[0]:]
        row = max(i for i, r in enumerate(real) if r)
        top = int(a[row].argmax())
        sentence, metrics = attention.stages_takeaway(trace, step, layer, 0, batch)
        assert f"puts {float(a[row, top]):.3f} of its weight on key {inert(key_labels(trace, step, batch)[top])}" \
            in sentence, (name, step, batch)
        forward = trace.generation.step(step).forward
        parts = forward_parts(trace.config, 1, forward.n, forward.t)
        line, numbers = cache.growth_takeaway(trace.config, forward.t, 4, forward.n)
        assert f"({parts['QKᵀ and A·V']:,} against {parts['MLP']:,} multiply-adds" in line
        assert dict(numbers)["this step's scores, one layer"] == cache._size(trace.config.n_head * forward.n
                                                                             * forward.t * 4)
        model = gen.model if gen is not None else live
        lens = logit_lens(trace, step, batch, model=model)
        said, _ = whatif.lens_takeaway(lens)
        last = lens[lens["position"] == lens.loc[lens["is_token"], "position"].max()].sort_values("layer")
        assert f"p = {float(last['final_prob'].iloc[0]):.3f} after block 0" in said
        if model.config.family != "hf":  # attribution needs our own final norm (it refuses the others, saying so)
            frame = direct_logit_attribution(trace, step, batch, model=model)
            said, _ = whatif.attribution_takeaway(frame, "x")
            best = frame.loc[frame["contribution"].idxmax()]
            assert said.startswith(f"{best['component']} adds the most") and f"{best['contribution']:+.3f}" in said
        if trace.config.positions == "rope" and trace.config.family != "hf":
            fig = rope.rope_relative_figure(trace, step, 0, 0, batch)
            said = rope.rope_takeaway(fig)
            drift = float(said.split("at most ")[1].split(";")[0])
            assert drift < 1e-3  # together: the same score to rounding


def test_5_following_one_row_opens_on_a_row_the_loss_reaches(matrix):
    from gpt_shape_tracer.figures import gradients as grad_views
    from gpt_shape_tracer.tracer import GRADIENT_LOSSES, attention_gradients

    gen = matrix["left padding"][0]
    for loss in GRADIENT_LOSSES:
        result = attention_gradients(gen, 2, 1, 0, 0, loss)
        row = grad_views.default_row(result)
        assert result.formula["G_O"][row].abs().sum() > 0
        assert not result.formula["G_O"][row + 1:].any()
        keys = [str(j) for j in range(result.formula["G_P"].shape[0])]
        table = grad_views.row_table(result, row, keys)
        assert (table["G_S,rj = P_rj·(G_P,rj − Σ P·G_P)"] - table["G_S,rj (autograd)"]).abs().max() < 1e-6
        if row + 1 < len(keys):
            assert "G_O,r = 0" in grad_views.row_sentence(result, row + 1, keys)


# -- activation patching's takeaway (figures/view_takeaways.patching_takeaway) ------------------------------------
def answers_and_diff(model, ids, a=None, b=None):
    """The last position's top token and, given the two answers, z[a] − z[b]: a plain forward, nothing patched."""
    with torch.no_grad():
        z = model(ids)[0, -1].double()
    return int(z.argmax()), (float(z[a] - z[b]) if a is not None else None)


def patched_diff(model, clean_ids, corrupt_ids, kind, layer, column, a, b) -> float:
    """z[a] − z[b] on the corrupted prompt with one clean activation put in by a torch forward hook written here
    (not ``tracer.patch``): position ``column`` of the residual stream entering block ``layer`` ([B, n, d]), or
    head ``column``'s output there ([B, H, n, d_head]) — dimension 1 either way."""
    point = model.get_submodule(act_name(kind, layer))
    kept = {}
    handle = point.register_forward_hook(lambda module, args, out: kept.setdefault("clean", out.detach().clone()))
    with torch.no_grad():
        model(clean_ids)
    handle.remove()

    def put(module, args, out):
        out = out.clone()
        out[:, column] = kept["clean"][:, column]
        return out

    handle = point.register_forward_hook(put)
    try:
        return answers_and_diff(model, corrupt_ids, a, b)[1]
    finally:
        handle.remove()


def test_the_patching_line_names_the_cell_that_restores_most(matrix):
    from gpt_shape_tracer.figures.view_takeaways import patching_takeaway
    from gpt_shape_tracer.session import patching_run

    seen = set()
    branches = {"restores": 0, "none": 0, "same answer": 0}
    for name, (gen, _) in matrix.items():
        if gen is None or id(gen.model) in seen:  # a loaded trace has no model; the same model once
            continue
        seen.add(id(gen.model))
        model, tok = gen.model, gen.tokenizer
        clean = gen.info.prompts[0]
        clean_ids = torch.tensor([tok.encode(clean)])
        corrupted = [clean.replace("Lily", other) for other in ("Tom", "Mia", "Ben")]
        # one corrupted prompt of the clean one's length (each patching run is a forward per cell: the suite's
        # slowest test when all three ran) and the clean prompt itself, for the "same answer" branch
        corrupted = [c for c in corrupted if len(tok.encode(c)) == clean_ids.shape[1]][:1] + [clean]
        for text in corrupted:
            corrupt_ids = torch.tensor([tok.encode(text)])
            a, _ = answers_and_diff(model, clean_ids)
            b, _ = answers_and_diff(model, corrupt_ids)
            for kind in ("resid_pre", "z"):
                run = patching_run(model, tok, clean, text, kind)
                res = run.result
                said = patching_takeaway(res, run.labels, tok.token_label(res.clean_answer),
                                         tok.token_label(res.corrupted_answer))
                line = unescape(said.sentence)
                assert (res.clean_answer, res.corrupted_answer) == (a, b), name
                if a == b:
                    assert line.startswith("Both prompts' top token is"), (name, line)
                    branches["same answer"] += 1
                    continue
                _, clean_diff = answers_and_diff(model, clean_ids, a, b)
                _, corrupt_diff = answers_and_diff(model, corrupt_ids, a, b)
                assert abs(res.clean_diff - clean_diff) < 1e-4 and abs(res.corrupted_diff - corrupt_diff) < 1e-4
                assert f"({res.corrupted_diff:.2f} on the corrupted prompt, {res.clean_diff:.2f} on the clean one)" \
                    in line
                restored = res.restored.double()
                layer, column = divmod(int(restored.argmax()), restored.shape[1])
                share = float(restored[layer, column])
                # the named cell's share, recomputed by patching it here
                again = (patched_diff(model, clean_ids, corrupt_ids, kind, layer, column, a, b) - corrupt_diff) \
                    / (clean_diff - corrupt_diff)
                assert abs(again - share) < 1e-3, (name, kind, again, share)
                cell = (f"the residual stream entering block {layer} at position {run.labels[column]}"
                        if kind == "resid_pre" else f"head L{layer} H{column}'s output")
                assert cell in line, (name, line)
                assert f"{share:.0%}" in line and (restored > share).sum() == 0
                if share > 0:
                    half = int((restored >= 0.5).sum())
                    assert f"no other of the {restored.numel()} cells restores more, and {half} of them" in line
                    branches["restores"] += 1
                else:
                    assert line.startswith("No single patch moves")
                    branches["none"] += 1
    assert branches["restores"] and branches["same answer"], branches


# -- a pooled heatmap's caption: which cells its means took in (figures.heatmap.Pooling) --------------------------
POOLED_SIDE = 5  # the matrix's heads are 1 … 16 rows × 11 … 16 keys: pooled to at most 5 × 5, every one is pooled


def block_means(m: torch.Tensor, rows: int, cols: int, finite_only: bool) -> torch.Tensor:
    """Adaptive average pooling written out: cell (i, j) is the mean over rows ⌊iR/r⌋ … ⌈(i+1)R/r⌉ − 1 and the
    same for columns — of the block's finite cells (NaN when none), or of every cell."""
    R, C = m.shape
    out = torch.full((rows, cols), math.nan, dtype=torch.float64)
    for i in range(rows):
        a, b = (i * R) // rows, -(-((i + 1) * R) // rows)
        for j in range(cols):
            c, d = (j * C) // cols, -(-((j + 1) * C) // cols)
            block = m[a:b, c:d].double()
            block = block[torch.isfinite(block)] if finite_only else block.reshape(-1)
            if block.numel():
                out[i, j] = block.mean()
    return out


def block_sizes(count: int, cells: int) -> str:
    sizes = {-(-((i + 1) * count) // cells) - (i * count) // cells for i in range(cells)}
    return f"{min(sizes)}" if len(sizes) == 1 else f"{min(sizes)}–{max(sizes)}"


def drawn_equal(z, expected: torch.Tensor) -> bool:
    drawn = torch.tensor([[math.nan if v is None else float(v) for v in row] for row in z], dtype=torch.float64)
    both_nan = drawn.isnan() & expected.isnan()
    return bool((both_nan | ((drawn - expected).abs() <= 1e-5 * (1 + expected.abs()))).all())


def test_41_a_pooled_stages_figure_says_which_cells_each_panels_means_left_out(matrix, monkeypatch):
    """The Stages figure pooled (here to 5 × 5): its title says, panel by panel, whether a block's mean left cells
    out — the −∞ of a masked score is left out (their count stated), a masked attention weight is a 0 and counts —
    and each panel's drawn cells are those means, recomputed here. Before, one sentence, "(masked cells left
    out)", was said of every panel: false for A, whose masked weights count."""
    import re

    from gpt_shape_tracer.figures import attention as attention_figures

    monkeypatch.setattr(attention_figures, "STAGE_SIDE", POOLED_SIDE)
    masked_weights_counted = 0
    for name, _, trace, step, batch in cases(matrix):
        for layer in sorted({0, trace.config.n_layer - 1}):
            stages = [s for s in attention_figures.attention_stages(trace, step, layer, 0, batch)
                      if s.matrix is not None]
            fig = attention_figures.attention_stages_figure(trace, step, layer, 0, batch)
            title = attention_figures.one_line_title(fig)
            drawn = [d for d in fig.data if d.type == "heatmap" and d.hoverinfo != "skip"]
            assert len(drawn) == len(stages) == 4 + ("softcapped" in [s.hook for s in stages]), (name, title)
            assert "masked cells left out" not in title
            R, C = stages[0].matrix.shape
            r, c = min(R, POOLED_SIDE), min(C, POOLED_SIDE)
            assert (f"pooled for the page: each cell is the mean of {block_sizes(R, r)} × {block_sizes(C, c)} cells "
                    f"of the {R} × {C} matrix (") in title, (name, step, title)
            counted = re.search(r"every cell counted in ([^)]*)\)", title)
            counted_names = counted[1].split(", ") if counted else []
            for stage, heat in zip(stages, drawn):
                m = stage.matrix.double()
                short = attention_figures.STAGE_NAMES[stage.hook]
                left_out = re.search(rf"{re.escape(short)}: its ([\d,]+) −∞ cells? left out", title)
                minus_inf = int(torch.isneginf(m).sum())
                assert not bool(m.isnan().any() or torch.isposinf(m).any())  # −∞ is the only gap a stage holds
                if minus_inf:
                    assert left_out and int(left_out[1].replace(",", "")) == minus_inf, (name, step, short, title)
                    assert short not in counted_names
                else:
                    assert left_out is None and short in counted_names, (name, step, short, title)
                assert drawn_equal(heat.z, block_means(m, r, c, finite_only=bool(minus_inf))), (name, step, short)
                if stage.hook == "pattern":
                    mask = trace.get(act_name("mask", layer), step)
                    masked = torch.isneginf(mask[min(batch, mask.shape[0] - 1), 0])  # (a row of transformers'
                    # smallest floats that sees nothing spreads its weight evenly: those are no zeros)
                    assert bool((m[masked] == 0).all())  # a masked weight is a 0 …
                    masked_weights_counted += int(masked.sum())  # … and counted in its block's mean
    assert masked_weights_counted > 0


@pytest.mark.parametrize("hook", ["mask", "masked_scores", "pattern", "history"])
def test_41_a_pooled_grid_reports_what_its_means_left_out_for_each_kind_of_matrix(matrix, hook):
    """The pooling's own report, over the matrix, for each kind of matrix a view pools: M (0 / −∞, as the mask
    figure draws it), the masked scores (−∞ where masked, or transformers' smallest float, which is a number and
    counts), the pattern (masked weights are 0: nothing left out) and the stacked rows of History (NaN where a
    row saw no key): the counts it states are the matrix's, and its cells are the means it says."""
    from gpt_shape_tracer.figures import heatmap
    from gpt_shape_tracer.figures.attention import attention_history

    for name, _, trace, step, batch in cases(matrix):
        layer = trace.config.n_layer - 1
        if hook == "history":
            m = attention_history(trace, layer, 0, step, batch)[0].double()
        else:
            value = trace.get(act_name(hook, layer), step)
            m = value[min(batch, value.shape[0] - 1), 0].double()
            if hook == "mask":
                m = torch.where(torch.isinf(m), -math.inf, 0.0)
        g = heatmap.grid(m, None, None, max_side=POOLED_SIDE)
        R, C = m.shape
        r, c = min(R, POOLED_SIDE), min(C, POOLED_SIDE)
        gaps = {"−∞": int(torch.isneginf(m).sum()), "NaN": int(m.isnan().sum()), "+∞": int(torch.isposinf(m).sum())}
        said = [f"{count:,} {kind}" for kind, count in gaps.items() if count]
        total = sum(gaps.values())
        what = f"its {', '.join(said)} cell{'s' if total != 1 else ''} left out" if said else "every cell counted"
        assert g.caption() == (f"pooled for the page: each cell is the mean of {block_sizes(R, r)} × "
                               f"{block_sizes(C, c)} cells of the {R} × {C} matrix ({what})"), (name, step, hook)
        assert (g.pooling.minus_inf, g.pooling.nan, g.pooling.plus_inf) == tuple(gaps.values())
        if hook == "pattern":
            assert what == "every cell counted"
        if hook in ("mask", "history") and step == 0:
            assert total > 0, (name, step)  # the causal mask leaves cells out at the prefill
        assert drawn_equal(g.z.tolist(), block_means(m, r, c, finite_only=bool(total))), (name, step, hook)


# -- none of the 16 statements' old texts remains anywhere a person reads ----------------------------------------
OLD_TEXTS = {  # statement of issue 41 → its false text as the app or the docs printed it
    1: "every position that has a next token",  # right padding dropped the prompt's last pair
    3: "still to read",
    4: "grows with the square of the context",
    5: "The scores of one layer take H·n² numbers",
    6: "outgrow the cache of every layer from n",
    8: "saves what quantizing saves again",
    10: "All six gradients computed from their formulas",
    11: "by decades with depth is a vanishing",
    15: "another program was running",
    16: "attend only to themselves",
}


def test_none_of_the_old_false_texts_remains_in_the_code_or_the_docs():
    """The tests above check each statement's function over the matrix; this one checks that no other place (a
    widget's help, a docstring the docs quote, a docs page) still says the old text. Statement 1's text stayed in
    the loss picker's help after the loss was fixed."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    places = [root / "README.md", root / "app.py"]
    for room in ("gui", "figures", "tracer", "model", "session", "gpt_shape_tracer", "docs"):
        places += [p for p in (root / room).rglob("*") if p.suffix in (".py", ".md", ".ipynb")]
    found = []
    for path in places:
        said = " ".join(path.read_text(encoding="utf-8").split())  # a text broken over lines reads as one
        said = re.sub(r"[\"']\s*[rbfRBF]{0,2}[\"']", "", said)  # Python's implicit concatenation of pieces
        found += [f"{path.relative_to(root)}: statement {n}" for n, old in OLD_TEXTS.items() if old in said]
    assert not found, found


# -- FlashAttention's and the cheaper cache's takeaways: their numbers, recomputed -------------------------------
def test_the_flash_takeaway_counts_the_tiles_read_and_compares_with_the_models_own_output(matrix):
    """The bold line and its metrics: tiles read (those with an unmasked key for some row), tiles skipped, the
    max |Δ| against the model's own output read here from its hook_z, and the bytes each side holds."""
    checked = 0
    for name, _, trace, step, batch in cases(matrix):
        layer = trace.config.n_layer - 1
        n = trace.record(act_name("q", layer), step).shape[2]
        for block in (4, 8):
            run = flash.flash_attention(trace, step, layer, 0, batch, block=block,
                                        query_block=flash.default_query_block(trace, step, batch, block))
            sentence, metrics = flash.flash_takeaway(run)
            numbers = dict(metrics)
            visible = torch.isfinite(mask_rows(trace, step, layer, batch, run.rows))  # [r, t]
            t = visible.shape[1]
            read = sum(bool(visible[:, s:s + block].any()) for s in range(0, t, block))
            skipped = math.ceil(t / block) - read
            key = "tiles read" + (" (skipped: all masked)" if skipped else "")
            assert numbers[key] == f"{read}" + (f" (+{skipped} skipped)" if skipped else ""), (name, step, batch)
            z = trace.get(act_name("z", layer), step)[batch, 0, run.rows[0]:run.rows[1]].double()  # [r, d_head]
            delta = float((run.tiles[-1].output - z).abs().max())
            assert f"(max |Δ| = {delta:.1e})" in sentence, (name, step, sentence)
            assert ("the model's own output" in sentence) == (delta <= 1e-5)
            rows = run.rows[1] - run.rows[0]
            assert f"their {rows} × {t} scores" in sentence and rows <= min(block, n)
            size = trace.get(act_name("z", layer), step).element_size()
            assert numbers["held besides the output: tiles"] == flash.size_text((rows * min(block, t) + 2 * rows)
                                                                                 * size)
            assert numbers["staged: the rows' scores"] == flash.size_text(rows * t * size)
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("storage", ["int8", "bfloat16"])
def test_the_cheaper_cache_takeaway_states_the_saving_and_the_first_changed_choice(matrix, storage):
    from gpt_shape_tracer.figures import cache
    from gpt_shape_tracer.tracer import cache_precision

    for name in ("story-llama", "left padding"):
        gen = matrix[name][0]
        run = cache_precision(gen, storage, 3)
        config = gen.model.config
        G = getattr(config, "n_kv_head", None) or config.n_head
        t = gen.facts.width(0) + len(run.steps) - 1  # the cache after the last step: the prompt and the tokens fed
        assert run.reference_bytes == 2 * config.n_layer * gen.batch_size * G * t * config.d_head * 4, name
        text = cache.precision_takeaway(run)
        assert f"holds {1 - run.stored_bytes / run.reference_bytes:.0%} less" in text
        worst = max(s.max_abs_delta for s in run.steps)
        changed = [s.step for s in run.steps if s.own != s.fed]
        if changed:
            assert f"from step {changed[0]} its own choice would differ" in text
        else:
            assert f"no step's own choice differs in {len(run.steps)} steps" in text
        assert f"(largest |Δ logits| {worst:.3g})" in text
