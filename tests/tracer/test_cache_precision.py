"""A KV cache stored at a lower precision (model/gpt/_cache.py ``storage``) and the experiment that measures it
(tracer.cache_precision): the rounding is what each format does, the reference run is the generation's own
greedy run, the bytes are the formula's, and the differences are measured, never assumed."""

from __future__ import annotations

import pytest
import torch

from gpt_shape_tracer.model.gpt import KVCache, stored
from gpt_shape_tracer.tracer import TracedGeneration, cache_precision

PROMPT = "Tom had a big red kite. One day, Tom went to the park with his friend Lily."


def test_int8_rounds_each_row_to_127_steps_of_its_own_absmax():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 16) * torch.tensor([0.01, 1.0, 30.0])[None, :, None, None]
    y = stored(x, "int8")
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    assert ((y - x).abs() <= scale / 2 + 1e-7).all()  # round to nearest: half a step at most
    assert torch.equal(torch.round(y / scale), torch.round(x / scale))  # 255 levels per row, shared by the row
    assert torch.equal(stored(x, "bfloat16"), x.to(torch.bfloat16).float())
    assert torch.equal(stored(x, "float32"), x) and stored(torch.zeros(1, 1, 1, 4), "int8").abs().sum() == 0
    with pytest.raises(ValueError, match="storage must be one of"):
        stored(x, "int4")


def test_a_cache_hands_back_its_rows_as_stored_and_counts_their_bytes():
    cache = KVCache(n_layer=1, batch_size=1, storage="int8")
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    got_k, got_v = cache.append(0, k, v)
    cache.commit(3, None)
    assert torch.equal(got_k, stored(k, "int8")) and torch.equal(cache.keys[0], stored(k, "int8"))
    assert cache.stored_nbytes == 2 * (2 * 3 * 8 * 1 + 2 * 3 * 4)  # K and V: a byte a number, a float32 per row
    assert cache.nbytes == 2 * 2 * 3 * 8 * 4
    assert cache.copy().storage == "int8"


@pytest.mark.parametrize("side", ["left", "right"])
def test_the_reference_is_the_generations_own_greedy_run_and_float32_changes_nothing(bundled, side):
    model, tok = bundled
    prompts = [PROMPT, "Ben ran to"]
    gen = TracedGeneration(model, tok, prompts, temperature=0, padding_side=side)
    gen.run(6)
    same = cache_precision(gen, "float32", steps=6)
    for row in range(2):
        assert [s.fed[row] for s in same.steps] == list(gen.generated(row))  # padding handled as the app does
    assert all(s.max_abs_delta == 0 and not s.differs for s in same.steps) and same.first_difference is None


def test_cheaper_storage_is_measured_with_this_runs_numbers(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, PROMPT, temperature=0)
    gen.step()
    n0 = gen.info.prompt_lengths[0]
    half = cache_precision(gen, "bfloat16", steps=8)
    fp16 = cache_precision(gen, "float16", steps=8)
    byte = cache_precision(gen, "int8", steps=8)
    for run in (half, fp16, byte):
        assert all(s.max_abs_delta > 0 for s in run.steps)  # rounding K and V moves the logits: measured
        assert run.t == n0 + 7 and run.reference_bytes == 2 * 4 * 1 * 4 * run.t * 32 * 4
    assert half.stored_bytes == fp16.stored_bytes == half.reference_bytes // 2
    assert max(s.max_abs_delta for s in fp16.steps) < max(s.max_abs_delta for s in half.steps)  # 10 bits beat 7
    numbers = 2 * 4 * 1 * 4 * byte.t * 32
    assert byte.stored_bytes == numbers + 2 * 4 * 4 * byte.t * 4
    assert byte.formula().endswith(f"= {byte.stored_bytes:,} B") and f"{numbers:,} numbers × 1 B" in byte.formula()
    assert max(s.max_abs_delta for s in byte.steps) > max(s.max_abs_delta for s in half.steps) / 100
    with pytest.raises(ValueError, match="storage must be one of"):
        cache_precision(gen, "model")
    with pytest.raises(ValueError, match="n_ctx"):
        cache_precision(gen, "int8", steps=10_000)


def test_a_grouped_query_model_and_its_multi_head_twin(llama_gen):
    run = cache_precision(llama_gen, "int8", steps=3)
    assert (run.kv_heads, run.query_heads) == (2, 6) and run.as_multi_head_bytes == 3 * run.stored_bytes
