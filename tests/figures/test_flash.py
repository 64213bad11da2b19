"""FlashAttention tile by tile (figures/flash.py): the online softmax recomputed from a trace's own Q, K, V and
M gives the model's own O, for every block size, our GPT-2 and Llama (rotated, grouped) and a model run by
transformers; the running max and sum are what their definitions say after every tile."""

from __future__ import annotations

import math

import pytest
import torch

from gpt_shape_tracer.figures import flash
from gpt_shape_tracer.tracer import TracedGeneration

PROMPT = "Tom had a big red kite. One day, Tom went to the park with his friend Lily."


@pytest.mark.parametrize("block", flash.BLOCK_SIZES[:4])
def test_the_tiles_give_the_models_own_output_at_the_prefill_and_a_decode_step(batch_gen, block):
    for step, batch in ((0, 0), (0, 1), (2, 0), (2, 1)):
        n = batch_gen.trace.record("blocks.1.attn.hook_q", step).shape[2]
        for query_block in range(math.ceil(n / block)):
            run = flash.flash_attention(batch_gen.trace, step, 1, 2, batch, block=block, query_block=query_block)
            assert run.max_abs_delta < 1e-5, (step, batch, block, query_block)
            assert len(run.tiles) == math.ceil(run.scores.shape[1] / block)


def test_after_each_tile_m_and_l_are_the_max_and_sum_over_the_keys_read(batch_gen):
    n = batch_gen.trace.record("blocks.0.attn.hook_q", 0).shape[2]
    run = flash.flash_attention(batch_gen.trace, 0, 0, 1, 0, block=4, query_block=(n - 1) // 4)  # the last rows
    scores = run.scores
    for tile in run.tiles:
        read = scores[:, : tile.keys[1]]
        m = read.max(dim=-1).values
        finite = torch.isfinite(m)
        assert torch.equal(torch.isfinite(tile.m), finite)
        assert torch.allclose(tile.m[finite], m[finite])
        l = torch.exp(read[finite] - m[finite][:, None]).sum(dim=-1)  # noqa: E741
        assert torch.allclose(tile.l[finite], l)
    # "rescaled" counts the rows whose max rose at that tile (their sums so far multiplied by exp(m_old − m_new))
    for before, tile in zip(run.tiles, run.tiles[1:]):
        assert tile.rescaled == int((torch.isfinite(before.m) & (tile.m > before.m)).sum())
    assert sum(t.rescaled for t in run.tiles) > 0  # late rows see many tiles: some raise the max


def test_a_rotated_grouped_query_model_and_its_bytes(llama_gen):
    run = flash.flash_attention(llama_gen.trace, 0, 1, 4, 0, block=8)  # query head 4 reads K/V head 1
    assert run.max_abs_delta < 1e-5
    rows = run.rows[1] - run.rows[0]
    t = run.scores.shape[1]
    assert run.tile_bytes == (rows * min(8, t) + 2 * rows) * 4  # the output rows, held by both, on neither side
    assert run.full_bytes == rows * t * 4 and run.output_bytes == rows * run.reference.shape[-1] * 4
    text = flash.memory_sentence(run)
    assert f"one tile of S ({rows} × {min(8, t)})" in text and f"{run.n} × {t}" in text


def test_a_model_run_by_transformers(tmp_path):
    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.sources import ASSETS
    from tests.hf_architectures import build

    directory = build("qwen3", tmp_path / "qwen3", ASSETS / "story-gpt" / "tokenizer.json")
    model, tok = load_hf(directory)
    g = TracedGeneration(model, tok, PROMPT, temperature=0)
    g.run(2)
    for step in (0, 1):
        assert flash.flash_attention(g.trace, step, 1, 3, block=8).max_abs_delta < 1e-5


def test_the_figure_draws_the_tiles_read_so_far(batch_gen):
    run = flash.flash_attention(batch_gen.trace, 0, 0, 0, 0, block=4)
    fig = flash.flash_figure(batch_gen.trace, 0, run, 1)
    heat = next(d for d in fig.data if d.type == "heatmap" and d.colorbar.title.text == "S")
    read_through = run.tiles[1].keys[1]
    assert all(v is None or v != v for row in heat.z for v in row[read_through:])  # later tiles: not read yet
    gaps = next(d for d in fig.data if d.name == "max |O so far − O|")
    assert len(gaps.y) == len(run.tiles) and gaps.y[-1] < 1e-5
    with pytest.raises(ValueError, match="query block 99"):
        flash.flash_attention(batch_gen.trace, 0, 0, 0, 0, block=4, query_block=99)


def test_nothing_to_recompute_from_with_shapes_capture(bundled):
    model, tok = bundled
    g = TracedGeneration(model, tok, PROMPT, temperature=0, capture="shapes")
    g.step()
    assert flash.flash_attention(g.trace, 0, 0, 0) is None


def test_after_each_tile_the_output_is_the_softmax_of_the_keys_read_times_their_values(batch_gen):
    """The running output is rescaled with the running sum: after tile j it is softmax(S[:, :end_j])·V[:end_j]
    exactly, checked on rows whose running max rises at a later tile (where a missing rescale shows)."""
    trace = batch_gen.trace
    rises = 0
    for layer, head in ((0, 1), (1, 2)):
        n = trace.record(f"blocks.{layer}.attn.hook_q", 0).shape[2]
        run = flash.flash_attention(trace, 0, layer, head, 0, block=4, query_block=(n - 1) // 4)
        g = flash.kv_head(trace, layer, head, 0)
        v = trace.get(f"blocks.{layer}.attn.hook_v_all", 0)[0, g].double()  # [t, d_head]
        for before, tile in zip(run.tiles, run.tiles[1:]):
            read = run.scores[:, : tile.keys[1]]  # [rows, keys read so far]
            seen = torch.isfinite(read.max(dim=-1).values)
            want = torch.softmax(read[seen], dim=-1) @ v[: tile.keys[1]]
            assert torch.allclose(tile.output[seen], want, atol=1e-12), (layer, head, tile.index)
            rises += int((torch.isfinite(before.m) & (tile.m > before.m)).sum())
    assert rises > 0  # some row's max rose after its first tile: the rescale was exercised
