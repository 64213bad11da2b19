"""Attention at any length (model/long_attention.py, tracer/reading/_regions.py): the fused kernel runs the model,
and every region of the scores, the mask and the pattern recomputed from Q, K and the mask description equals
what the eager path records (≤ 1e-6 float32) — our GPT families and every architecture of tests/hf_architectures.py,
at the prefill and at cached decode steps, with left and right padding and a sliding window; the recomputed
pattern times V equals the fused kernel's O; a saved trace recomputes the same regions; interventions work on the
fused path; and a long prompt is traced, viewed and saved without any n × t allocation (a memory probe in a
child process)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import GPT, GPTConfig
from gpt_shape_tracer.model.gpt import MaskSpec, additive_mask, attention_path, fused_attention, pattern_times_v, region
from gpt_shape_tracer.tracer import (
    RegionError,
    TracedGeneration,
    Tracer,
    ablate,
    attention_overview,
    attention_region,
    check_output,
    head_statistics,
    is_derived,
    load_trace,
    patch,
    query_row,
    save_trace,
)

STAGES = ("hook_qk", "hook_attn_scores", "hook_mask", "hook_masked_scores", "hook_pattern")
TOL = 1e-6


def assert_same(eager: torch.Tensor, derived: torch.Tensor, what: str) -> None:
    assert eager.shape == derived.shape, what
    assert torch.equal(torch.isinf(eager), torch.isinf(derived)), what  # the mask hides the same cells
    finite = torch.isfinite(eager)
    assert (eager - derived)[finite].abs().max() <= TOL * max(1.0, float(eager[finite].abs().max())), what


def test_the_mask_description_writes_the_mask_our_gpt_builds():
    key_is_token = torch.ones(2, 9, dtype=torch.bool)
    key_is_token[0, :3] = False  # left padding
    key_is_token[1, 7:] = False  # right padding
    for n, window in ((9, None), (9, 3), (2, None), (1, 4)):
        spec = MaskSpec(n=n, t=9, scale=None, window=window, key_is_token=key_is_token)
        want = additive_mask(n, 9 - n, key_is_token, torch.device("cpu"), torch.float32, window)
        assert torch.equal(spec.full_additive(torch.float32), want)
        if n > 1:
            assert torch.equal(spec.additive(range(1, n), range(2, 7), torch.float32), want[..., 1:, 2:7])
        assert MaskSpec.from_json(spec.to_json()).to_json() == spec.to_json()


def test_a_row_that_sees_nothing_is_uniform_as_transformers_writes_it():
    key_is_token = torch.tensor([[False, False, True, True]])
    spec = MaskSpec(n=4, t=4, scale=0.5, key_is_token=key_is_token, empty_rows="uniform")
    mask = spec.full_additive(torch.float32)[0, 0]
    assert (mask[:2] == torch.finfo(torch.float32).min).all()  # queries 0, 1 see no token
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    pattern = region(q, k, spec, "pattern")
    assert torch.allclose(pattern[0, :, :2], torch.full((2, 2, 4), 0.25))
    eager = torch.softmax(q @ k.transpose(-2, -1) * 0.5 + mask, -1)
    assert (pattern - eager).abs().max() <= TOL
    assert (pattern_times_v(q, k, v, spec) - fused_attention(q, k, v, spec).double()).abs().max() <= TOL


def _families():
    yield "gpt2", {}
    yield "llama", dict(n_kv_head=2)
    yield "mistral", dict(n_kv_head=2, sliding_window=5)


@pytest.mark.parametrize("family,fields", list(_families()))
@pytest.mark.parametrize("side", ["left", "right"])
def test_gpt_regions_equal_the_eager_records_at_the_prefill_and_cached_decode(family, fields, side):
    torch.manual_seed(0)
    config = GPTConfig.for_family(family, vocab_size=64, n_ctx=64, d_model=32, n_layer=2, n_head=4, **fields)
    model = GPT(config).eval()
    tokens = torch.randint(0, 64, (2, 12))
    decode = torch.randint(0, 64, (2, 2))
    padding = torch.ones(2, 12, dtype=torch.bool)
    if side == "left":
        padding[1, :5] = False
    else:
        padding[1, 9:] = False
    traces = {}
    for mode in ("eager", "fused"):
        cache = model.new_cache(2)
        with torch.no_grad(), attention_path(mode), Tracer(model) as tr:
            model(tokens, cache, padding_mask=padding)
            for i in range(2):
                model(decode[:, i:i + 1], cache)
        traces[mode] = tr.trace
    eager, fused = traces["eager"], traces["fused"]
    for step in range(3):
        assert (eager.get("hook_logits", step) - fused.get("hook_logits", step)).abs().max() <= 1e-5
        for layer in range(2):
            for hook in STAGES:
                name = f"blocks.{layer}.attn.{hook}"
                assert is_derived(fused, name, step) and not is_derived(eager, name, step)
                # read whole, the derived record is the eager one: value, NaN/∞ flag and statistics
                assert_same(eager.get(name, step), fused.get(name, step), f"{name} whole, step {step}")
                assert fused.finite_flag(fused.record(name, step)) == eager.finite_flag(eager.record(name, step))
                assert fused.record(name, step).shape == eager.record(name, step).shape
                assert_same(eager.get(name, step), attention_region(fused, name, step), f"{name} step {step}")
            name = f"blocks.{layer}.attn.hook_pattern"
            t = eager.record(name, step).shape[-1]
            sub = attention_region(fused, name, step, rows=(0, 1), cols=(1, t - 1), heads=[3, 1])
            assert_same(eager.get(name, step)[:, [3, 1], :1, 1:t - 1], sub, f"{name} sub-region")
            assert check_output(fused, name, step) <= TOL  # recomputed A·V = the fused kernel's O


@pytest.fixture(scope="module")
def hf_directories():
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from tests.hf_architectures import ARCHITECTURES, build

    root = Path(tempfile.mkdtemp(prefix="hf-long-"))
    return {name: build(name, root / name, BUNDLED_DIR / "tokenizer.json") for name in ARCHITECTURES}


def _hf_architectures():
    from tests.hf_architectures import ARCHITECTURES

    return list(ARCHITECTURES)


@pytest.mark.parametrize("model_type", _hf_architectures())
def test_transformers_run_regions_equal_the_eager_records(hf_directories, model_type):
    from gpt_shape_tracer.model import load_hf

    model, tok = load_hf(hf_directories[model_type], implementation="transformers")
    for side in ("left", "right"):
        gens = {}
        for mode in ("eager", "fused"):
            with attention_path(mode):
                gen = TracedGeneration(model, tok, ["Lily had a red kite.", "Tom said"], temperature=0,
                                       padding_side=side)
                gen.run(3)
            gens[mode] = gen.trace
        eager, fused = gens["eager"], gens["fused"]
        derived = not model.config.attn_sinks  # a sink's column is computed eager in any mode: recorded, not derived
        for step in range(3):
            assert (eager.get("hook_logits", step) - fused.get("hook_logits", step)).abs().max() <= 1e-5
            for layer in range(model.config.n_layer):
                for hook in ("hook_attn_scores", "hook_mask", "hook_masked_scores", "hook_pattern"):
                    name = f"blocks.{layer}.attn.{hook}"
                    assert is_derived(fused, name, step) == derived
                    got = attention_region(fused, name, step) if derived else fused.get(name, step)
                    assert_same(eager.get(name, step), got, f"{model_type} {side} {name} step {step}")
                if derived:  # A·V recomputed from the derived pattern = the fused kernel's O
                    assert check_output(fused, f"blocks.{layer}.attn.hook_pattern", step) <= TOL


def _llama(n_ctx: int = 256, d_model: int = 64) -> GPT:
    torch.manual_seed(1)
    config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=n_ctx, d_model=d_model, n_layer=2, n_head=4,
                                  n_kv_head=2)
    return GPT(config).eval()


def test_tracing_never_changes_the_path_so_never_the_logits():
    model = _llama()
    tokens = torch.randint(0, 64, (1, 200))
    for mode in ("eager", "fused"):
        with torch.no_grad(), attention_path(mode):
            untraced = model(tokens)
            with Tracer(model) as tr:
                traced = model(tokens)
        assert torch.equal(untraced, traced)
        assert is_derived(tr.trace, "blocks.0.attn.hook_pattern", 0) == (mode == "fused")
    with torch.no_grad(), attention_path("auto", threshold=4 * 200 * 200), Tracer(model) as tr:
        model(tokens)  # exactly at the threshold: fused
        model(tokens[:, :199])  # below it: eager
    assert is_derived(tr.trace, "blocks.0.attn.hook_pattern", 0)
    assert not is_derived(tr.trace, "blocks.0.attn.hook_pattern", 1)


def test_a_traced_forward_runs_fused_at_every_length_as_the_untraced_one_does():
    """Under "auto" (threshold 0, issue 53) a traced forward runs the fused kernel even at 100 tokens, as the untraced
    one does: the same logits bit for bit; its n × t stages are derived, and read whole they equal the eager ones to
    rounding. A threshold above 0 still keeps a traced layer below it eager."""
    model = _llama()
    tokens = torch.randint(0, 64, (1, 100))  # 4 · 100² cells
    with torch.no_grad():
        with attention_path("fused"):
            fused = model(tokens)
        with attention_path("eager"):
            eager = model(tokens)
        assert not torch.equal(fused, eager)  # the two kernels round differently, so the paths can be told apart
        untraced = model(tokens)
        with Tracer(model) as tr:
            traced = model(tokens)
        # a tracer installed but not active on this thread (TracedGeneration keeps its tracer installed between
        # steps; another session may be tracing the same model) reads nothing: the forward is still untraced
        installed = Tracer(model).install()
        try:
            untraced_beside = model(tokens)
            with installed.active():
                traced_again = model(tokens)
        finally:
            installed.close()
        with attention_path("auto", threshold=4 * 100 * 100 + 1), Tracer(model) as below:
            model(tokens)
    assert torch.equal(untraced, fused) and torch.equal(traced, fused)
    assert torch.equal(untraced_beside, fused) and torch.equal(traced_again, fused)
    assert is_derived(tr.trace, "blocks.0.attn.hook_pattern", 0)
    assert not is_derived(below.trace, "blocks.0.attn.hook_pattern", 0)
    for hook in STAGES:
        name = f"blocks.0.attn.{hook}"
        assert_same(below.trace.get(name, 0), tr.trace.get(name, 0), name)


def test_the_views_read_a_derived_record_as_they_read_a_kept_one():
    model = _llama()
    tokens = torch.randint(0, 64, (1, 150))
    traces = {}
    for mode in ("eager", "fused"):
        with torch.no_grad(), attention_path(mode), Tracer(model) as tr:
            model(tokens)
        traces[mode] = tr.trace
    name = "blocks.1.attn.hook_pattern"
    eager, fused = (attention_overview(traces[m], name, 0, head=2, bins=16) for m in ("eager", "fused"))
    assert eager.row_edges == fused.row_edges == list(range(0, 151, 10))  # 15 blocks of ⌈150 / 16⌉ = 10 rows
    assert (eager.mean - fused.mean).abs().max() <= TOL and (eager.peak - fused.peak).abs().max() <= TOL
    assert "block mean / block max" in fused.label() and not fused.exact
    weights, top = query_row(traces["fused"], name, 0, row=120, head=2, top=5)
    want = traces["eager"].get(name, 0)[0, 2, 120]
    assert (weights - want).abs().max() <= TOL and top[0][0] == int(want.argmax())
    for a, b in zip(head_statistics(traces["eager"], name, 0), head_statistics(traces["fused"], name, 0)):
        assert abs(a.entropy - b.entropy) <= 1e-5 and abs(a.sink_mass - b.sink_mass) <= 1e-6
        assert max(abs(x - y) for x, y in zip(a.distance_mass, b.distance_mass)) <= 1e-6
        assert abs(sum(b.distance_mass) - 1) <= 1e-6 and [k for k, _ in a.top_keys] == [k for k, _ in b.top_keys]
    with pytest.raises(RegionError, match="inside"):
        attention_region(traces["fused"], name, 0, rows=(0, 151))


def test_interventions_on_q_k_v_and_o_keep_the_fused_path_and_a_pattern_write_makes_its_layer_eager():
    model = _llama()
    tokens = torch.randint(0, 64, (1, 40))
    for iv in (ablate("blocks.0.attn.hook_z", head=1), ablate("blocks.1.attn.hook_v_all", head=0),
               patch("blocks.0.attn.hook_rot_q", torch.zeros(1, 4, 40, 16), head=2)):
        runs = {}
        for mode in ("eager", "fused"):
            with torch.no_grad(), attention_path(mode), Tracer(model, interventions=[iv]) as tr:
                runs[mode] = model(tokens)
            assert is_derived(tr.trace, "blocks.0.attn.hook_pattern", 0) == (mode == "fused")
        assert (runs["eager"] - runs["fused"]).abs().max() <= 1e-5, iv.name
        for layer in (0, 1):  # A·V = O with the V the layer used; O as the kernel made it (before an ablation of it)
            if iv.name != f"blocks.{layer}.attn.hook_z":
                assert check_output(tr.trace, f"blocks.{layer}.attn.hook_pattern", 0) <= TOL
    with torch.no_grad(), attention_path("eager"), Tracer(model, interventions=[ablate("blocks.1.attn.hook_pattern",
                                                                                      head=3)]) as tr:
        want = model(tokens)
    with torch.no_grad(), attention_path("fused"), Tracer(model, interventions=[ablate("blocks.1.attn.hook_pattern",
                                                                                      head=3)]) as tr:
        got = model(tokens)
    assert (want - got).abs().max() <= 1e-5
    trace = tr.trace
    assert is_derived(trace, "blocks.0.attn.hook_pattern", 0)  # the other layer stays fused
    assert not is_derived(trace, "blocks.1.attn.hook_pattern", 0)  # this one ran eager, and says so
    assert (trace.get("blocks.1.attn.hook_pattern", 0)[0, 3] == 0).all()
    assert "ran eager, not fused" in trace.value_note(trace.record("blocks.1.attn.hook_pattern", 0))


def test_a_saved_trace_recomputes_the_same_regions(tmp_path):
    model = _llama()
    tokens = torch.randint(0, 64, (2, 30))
    padding = torch.ones(2, 30, dtype=torch.bool)
    padding[0, :7] = False
    with torch.no_grad(), attention_path("fused"), Tracer(model) as tr:
        model(tokens, padding_mask=padding)
    loaded = load_trace(save_trace(tr.trace, tmp_path / "long"))
    for hook in STAGES:
        name = f"blocks.1.attn.{hook}"
        assert is_derived(loaded, name, 0)
        assert torch.equal(attention_region(tr.trace, name, 0), attention_region(loaded, name, 0))
    assert check_output(loaded, "blocks.1.attn.hook_pattern", 0) <= TOL


PROBE = textwrap.dedent("""
    import resource, sys, tempfile, torch
    from gpt_shape_tracer.model import GPT, GPTConfig
    from gpt_shape_tracer.tracer import (
        Tracer,
        attention_overview,
        attention_region,
        head_statistics,
        load_trace,
        query_row,
        save_trace,
    )
    n = int(sys.argv[1])
    torch.manual_seed(0)
    config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=n, d_model=64, n_layer=2, n_head=4, n_kv_head=2)
    model = GPT(config).eval()
    tokens = torch.randint(0, 64, (1, n))
    def peak():  # bytes (Linux reports KiB)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.no_grad():
        model(tokens[:, :256])  # warm up the kernels and the allocator
    base = peak()
    with torch.no_grad(), Tracer(model) as tr:
        model(tokens)
    name = "blocks.1.attn.hook_pattern"
    attention_overview(tr.trace, name, 0, head=1, bins=64)
    attention_region(tr.trace, name, 0, rows=(n - 256, n), cols=(0, 256))
    query_row(tr.trace, name, 0, row=n - 1, head=0)
    head_statistics(tr.trace, "blocks.0.attn.hook_pattern", 0)
    viewed = peak()
    with tempfile.TemporaryDirectory() as d:
        loaded = load_trace(save_trace(tr.trace, d + "/t"))
        attention_region(loaded, name, 0, rows=(n - 256, n), cols=(0, 256))
    print(viewed - base, peak() - viewed, tr.trace.bytes_kept)
""")


def test_a_long_prompt_is_traced_viewed_and_saved_without_an_n_by_t_allocation():
    """8,192 tokens, 4 heads: one head's pattern alone would be 256 MiB, a layer's [B,H,n,t] 1 GiB. In a child
    process, tracing with values, the overview, a region, a query row and a layer's statistics may grow the peak
    resident memory by the values the trace keeps plus 96 MiB; saving and loading it back (a second copy of the
    values) by as much again: never by an n × t tensor."""
    n = 8192
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", PROBE, str(n)], cwd=repo, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.returncode == 0, out.stderr[-3000:]
    viewing, saving, kept = map(int, out.stdout.split())
    slack = 96 * 2**20
    assert slack < n * n * 4  # less than one head's pattern
    assert kept < n * n * 4  # the trace holds Q, K, V, O and the rest, no pattern
    assert viewing <= kept + slack, (viewing, kept)
    assert saving <= kept + slack, (saving, kept)


def test_the_values_budget_holds_q_k_v_and_o_of_a_fused_layer_first():
    """A budget far smaller than one forward's values: everything else is evicted before the records the derived
    patterns are recomputed from, so every layer's regions can still be recomputed and checked against O."""
    torch.manual_seed(0)
    config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=2048, d_model=64, n_layer=2, n_head=4, n_kv_head=2)
    model = GPT(config).eval()
    with torch.no_grad(), attention_path("fused"), Tracer(model, budget_bytes=5 * 2**20) as tr:
        model(torch.randint(0, 64, (1, 1024)))
    trace = tr.trace
    assert trace.log.evicted_count > 0 and not trace.has_value(trace.record("blocks.0.mlp.hook_post", 0))
    for layer in (0, 1):
        for hook in ("hook_rot_q", "hook_k_all", "hook_v_all", "hook_z"):
            assert trace.has_value(trace.record(f"blocks.{layer}.attn.{hook}", 0)), (layer, hook)
        assert check_output(trace, f"blocks.{layer}.attn.hook_pattern", 0) <= TOL


def test_the_zoom_views_read_a_derived_pattern_exactly_and_send_at_most_256_by_256_cells():
    from gpt_shape_tracer.figures import long_attention as views

    model = _llama(n_ctx=512)
    tokens = torch.randint(0, 64, (1, 400))
    traces = {}
    for mode in ("eager", "fused"):
        with torch.no_grad(), attention_path(mode), Tracer(model) as tr:
            model(tokens)
        traces[mode] = tr.trace
    fused, eager = traces["fused"], traces["eager"]
    over = views.overview(fused, 0, 1, 2, 0)
    fig = views.overview_figure(over, "max")
    assert fig.data[0].z.shape == (100, 100)  # blocks of ⌈400 / 128⌉ = 4 rows and 4 keys
    assert fig.layout.title.text.startswith("block max of up to 4 queries × 4 keys per cell, 100 × 100 cells")
    assert list(fig.data[0].x) == [e - 0.5 for e in range(0, 401, 4)]  # cell edges on an axis of key positions
    assert views.box_range(99.6, 356.2, 400) == (100, 357)  # a box covers the cells whose centres it holds
    assert views.box_range(10.2, 10.4, 400) == (10, 11) and views.box_range(-3, 1000, 400) == (0, 400)
    assert views.box_range(400.6, 420, 400) is None
    matrix, exact = views.zoom(fused, 0, 1, 2, 0, (100, 356), (0, 256))
    assert exact and matrix.shape == (256, 256)
    want = eager.get("blocks.1.attn.hook_pattern", 0)[0, 2, 100:356, :256].numpy()
    assert abs(matrix - want).max() <= TOL
    matrix, exact = views.zoom(fused, 0, 1, 2, 0, (0, 400), (0, 300))
    assert not exact and matrix.shape[0] <= 256 and matrix.shape[1] <= 256
    strip = views.row_strip_figure(fused, 0, 1, 2, 0, 399, top=5)
    assert len(strip.data[0].y) == 400 and len(strip.data[1].x) == 5
    stats = head_statistics(fused, "blocks.1.attn.hook_pattern", 0)
    table = views.statistics_frame(stats)
    assert list(table["head"]) == [0, 1, 2, 3]
    said = views.statistics_sentence(stats, 400, 400)
    sinkiest = max(stats, key=lambda s: s.sink_mass)  # the sentence's numbers are the table's
    assert f"Head {sinkiest.head} puts the most on keys 0–3: {sinkiest.sink_mass:.3f}" in said \
        or f"Every head puts, of a row's weight, {sinkiest.sink_mass:.3f} on keys 0–3" in said
    one = views.statistics_sentence(stats[:1], 400, 400)
    assert f"The head puts, of a row's weight, {stats[0].sink_mass:.3f} on keys 0–3" in one
    assert "mean over this layer's 400 query rows" in said and "ln 400 = 5.99" in said
    assert "recomputed from the recorded Q and K" in views.derived_sentence(fused, 0, 1)


@pytest.mark.parametrize("n, t, window, padded, empty_rows", [(300, 300, None, False, "self"),
                                                               (200, 330, 50, False, "self"),
                                                               (257, 257, None, True, "self"),
                                                               (150, 180, 40, True, "uniform")])
def test_the_pooled_overview_of_any_range_equals_pooling_the_whole_pattern(n, t, window, padded, empty_rows):
    """The one-pass overview (block mean and max of whole or zoomed ranges, with and without each row's normaliser
    known beforehand) against the block means and maxima of the full recomputed pattern (which the tests above
    hold equal to the eager one); a zoomed range whose rows see none of its columns included (the window)."""
    from gpt_shape_tracer.model.gpt import grid_edges, pool_pattern, row_norm

    torch.manual_seed(0)
    key_is_token = None
    if padded:
        key_is_token = torch.ones(2, t, dtype=torch.bool)
        key_is_token[1, :37] = False
    spec = MaskSpec(n=n, t=t, scale=0.3 if window else None, window=window, key_is_token=key_is_token,
                    empty_rows=empty_rows)
    B = 2 if padded else 1
    q, k = torch.randn(B, 4, n, 16), torch.randn(B, 2, t, 16)
    full = region(q, k, spec, "pattern")  # [B, 4, n, t]
    for b in range(B):
        one = MaskSpec(n=n, t=t, scale=spec.scale, window=window, empty_rows=empty_rows,
                       key_is_token=None if key_is_token is None else key_is_token[b:b + 1])
        norm = row_norm(q[b:b + 1], k[b:b + 1], one, [1, 3])
        for rows, cols in ((range(n), range(t)), (range(20, 120), range(5, 170))):
            r_edges = [rows.start + e for e in grid_edges(len(rows), 16)]
            c_edges = [cols.start + e for e in grid_edges(len(cols), 16)]
            for known in (None, norm):
                got = pool_pattern(q, k, spec, [1, 3], b, 16, rows, cols, norm=known)
                assert got.row_edges == r_edges and got.col_edges == c_edges
                for j, h in enumerate((1, 3)):
                    p = full[b, h]
                    for i, (r0, r1) in enumerate(zip(r_edges, r_edges[1:])):
                        for jj, (c0, c1) in enumerate(zip(c_edges, c_edges[1:])):
                            block = p[r0:r1, c0:c1]
                            assert abs(float(got.mean[j, i, jj]) - float(block.double().mean())) <= TOL
                            assert abs(float(got.peak[j, i, jj]) - float(block.max())) <= TOL


def test_head_statistics_of_each_sequence_and_step_equal_the_recorded_pattern_read_by_hand():
    """Issue 52: the statistics of sequence b are read with b's own padding (a left-padded sequence 1 read with
    sequence 0's mask has weight on its padding keys), and the distance of a query at a decode step counts the
    cached past (query slot = past + row; without it every weight of a one-row step sits at distance 0). Both
    paths — the eager one reading the kept pattern, the fused one recomputing it from Q and K — against the entropy,
    the sink mass and the mass by distance computed here from the recorded eager pattern."""
    torch.manual_seed(0)
    config = GPTConfig.for_family("llama", vocab_size=64, n_ctx=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    model = GPT(config).eval()
    tokens, decode = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 2))
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :5] = False
    traces = {}
    for mode in ("eager", "fused"):
        cache = model.new_cache(2)
        with torch.no_grad(), attention_path(mode), Tracer(model) as tr:
            model(tokens, cache, padding_mask=padding)
            for i in range(2):
                model(decode[:, i:i + 1], cache)
        traces[mode] = tr.trace
    name, sink = "blocks.1.attn.hook_pattern", 4
    for step in (0, 2):
        pattern = traces["eager"].get(name, step).double()  # [B, H, n, t]
        n, t = pattern.shape[-2:]
        past = t - n
        distance = past + torch.arange(n)[:, None] - torch.arange(t)[None, :]  # [n, t]
        for b in range(2):
            p = pattern[b]
            entropy = -torch.special.xlogy(p, p).sum(-1).mean(-1)  # [H]
            sink_mass = p[..., :sink].sum(-1).mean(-1)
            for mode in ("eager", "fused"):
                stats = head_statistics(traces[mode], name, step, batch=b, sink=sink)
                edges = stats[0].distance_edges
                for h, s in enumerate(stats):
                    assert abs(s.entropy - float(entropy[h])) <= 1e-5, (mode, step, b, h)
                    assert abs(s.sink_mass - float(sink_mass[h])) <= 1e-6, (mode, step, b, h)
                    by_distance = [float(p[h][(distance >= lo) & (distance < hi)].sum() / n)
                                   for lo, hi in zip(edges, edges[1:])]
                    assert max(abs(x - y) for x, y in zip(s.distance_mass, by_distance)) <= 1e-6, (mode, step, b)
