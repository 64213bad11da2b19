"""TracedGeneration: steps, cache, batches with padding, budget, threads."""

from __future__ import annotations

import threading

import pytest
import torch

from gpt_shape_tracer.figures import cache
from gpt_shape_tracer.model import GPT, GPTConfig, SamplingConfig, generate
from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.tracer import Tracer, pattern_digest
from gpt_shape_tracer.tracer.generation._traced import MAX_RUN_STEPS, ContextFullError, PromptError, TracedGeneration


def test_step_zero_is_the_prefill_and_later_steps_feed_one_token(bundled):
    model, tok = bundled
    prompt = "Once upon a time, there was a little girl named Lily."
    n0 = len(tok.encode(prompt))
    gen = TracedGeneration(model, tok, prompt, temperature=0)
    for s in range(4):
        done = gen.step()
        info = done.forward
        assert done.step == s
        assert (info.n, info.t) == ((n0, n0) if s == 0 else (1, n0 + s))
        assert gen.cache_length == n0 + s == info.cache_after
        t = gen.trace
        assert t.record("blocks.0.attn.hook_q", s).shape == (1, 4, info.n, 32)
        assert t.record("blocks.3.attn.hook_k_all", s).shape == (1, 4, n0 + s, 32)
        assert t.record("blocks.2.attn.hook_pattern", s).shape == (1, 4, info.n, n0 + s)
        assert t.record("hook_logits", s).shape == (1, info.n, model.config.vocab_size)
        assert len(done.sampling.candidates[0]) == 20 and done.sampling.tokens[0] in done.sampling.candidates[0]
    assert list(gen.generated()) == generate(model, tok.encode(prompt), 4, SamplingConfig(temperature=0))
    assert gen.text().startswith(prompt)


def test_without_the_cache_every_step_recomputes_everything_and_agrees(bundled):
    model, tok = bundled
    prompt = "Tom had a big red kite."
    n0 = len(tok.encode(prompt))
    cached = TracedGeneration(model, tok, prompt, use_cache=True, temperature=0.9, top_k=50, seed=11)
    full = TracedGeneration(model, tok, prompt, use_cache=False, temperature=0.9, top_k=50, seed=11)
    cached.run(5)
    full.run(5)
    assert cached.generated() == full.generated()
    for s in range(5):
        forward = full.facts.step(s).forward
        assert forward.n == n0 + s and forward.t == n0 + s
        assert full.trace.record("blocks.0.attn.hook_q", s).shape[2] == n0 + s
        # the cached step's single row equals the last row of the full recompute
        last_full = full.trace.get("hook_logits", s)[:, -1]
        last_cached = cached.trace.get("hook_logits", s)[:, -1]
        assert (last_full - last_cached).abs().max() < 1e-4
    on = cached.compare_with_recompute()
    off = full.compare_with_recompute(timing_repeats=2)
    # both ways the latest step is a decode over n0 + 4 columns: one row cached, all rows recomputed
    for c in (on, off):
        assert c.equal and c.max_abs_delta < 1e-4 and not c.nothing_cached
        assert (c.cached.query_rows, c.full.query_rows) == (1, n0 + 4)
        assert c.cached.macs < c.full.macs and c.cached.kv_bytes > 0 == c.full.kv_bytes
    assert on.run_used_cache and not off.run_used_cache and off.timing_repeats == 2
    assert cached.trace.generation.comparisons[4] == on  # the comparison is part of the trace
    with pytest.raises(ValueError, match="timing_repeats"):
        cached.compare_with_recompute(timing_repeats=0)


def test_the_recompute_comparison_catches_a_cache_that_lies(bundled):
    """The check must be able to fail: corrupt the cached keys and it reports the disagreement."""
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Tom had a big red kite.", temperature=0)
    gen.run(2)
    honest = gen.compare_with_recompute()
    assert honest.equal and honest.cached_rows_equal and len(honest.cached_rows_delta) == model.config.n_layer
    for keys in gen.cache.keys:
        keys.data.mul_(-1.0)  # what a cache bug that stored wrong keys would do to the next step
    gen.step()
    lied = gen.compare_with_recompute()
    assert lied.max_abs_delta > 1e-2 and not lied.equal
    # the layer-by-layer check names the rows: every layer's cached keys differ from their recomputation, the
    # values (left alone) do not
    assert not lied.cached_rows_equal
    assert all(dk > 1e-2 and dv <= lied.tolerance for dk, dv in lied.cached_rows_delta)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("side", ["left", "right"])
def test_the_cached_rows_equal_their_recomputation_layer_by_layer(bundled, use_cache, side):
    """What the KV cache tab shows: the K and V rows the cache held, made when their own step ran, equal the
    same rows recomputed from all tokens in every layer, padded batches included (padding rows are not compared)."""
    model, tok = bundled
    gen = TracedGeneration(model, tok, ["Tom had a big red kite.", "Lily ran"], temperature=0,
                           use_cache=use_cache, padding_side=side)
    gen.run(3)
    c = gen.compare_with_recompute()
    assert len(c.cached_rows_delta) == model.config.n_layer and c.cached_rows_equal
    level, text = cache.verdict(c)
    assert level == "success" and "depends on nothing after i" in text and "own token alone" not in text
    assert f"agree in every one of the {model.config.n_layer} layers" in text


def test_a_key_row_depends_on_earlier_tokens_beyond_layer_0(bundled):
    """The lesson's claim, checked on the model: row i of K depends on token i alone in layer 0 and on the
    tokens before it in later layers, never on a token after it."""
    model, tok = bundled
    ids = tok.encode("Tom had a big red kite and a ball.")
    changed = list(ids)
    changed[0] = ids[1]  # another first token
    def keys(tokens):
        cache = model.new_cache(1)
        model(torch.tensor([tokens]), cache=cache)
        return cache.keys
    a, b = keys(ids), keys(changed)
    i = len(ids) - 1
    assert torch.equal(a[0][0, :, i], b[0][0, :, i])  # layer 0: only token i itself
    assert (a[1][0, :, i] - b[1][0, :, i]).abs().max() > 1e-3  # layer 1: the first token reached it
    later = list(ids[:4]) + [ids[5]] * (len(ids) - 4)  # the same first 4 tokens, others after them
    c = keys(later)
    for layer in range(model.config.n_layer):  # nothing after row 3 moves rows 0…3
        assert torch.allclose(a[layer][0, :, :4], c[layer][0, :, :4], atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_generates_what_each_prompt_generates_alone(bundled, side):
    model, tok = bundled
    prompts = ["Mia had a small blue boat. One day,", "Ben said,"]
    gen = TracedGeneration(model, tok, prompts, temperature=0, padding_side=side)
    gen.run(6)
    for row, prompt in enumerate(prompts):
        alone = generate(model, tok.encode(prompt), 6, SamplingConfig(temperature=0))
        assert list(gen.generated(row)) == alone, (side, row)
    width = max(len(tok.encode(p)) for p in prompts)
    mask = gen.trace.get("blocks.0.attn.hook_mask", 0)
    assert mask.shape == (2, 1, width, width)
    short = len(tok.encode(prompts[1]))
    pad_cols = list(range(width - short)) if side == "left" else list(range(short, width))
    real_rows = [r for r in range(width) if r not in pad_cols]
    for q in real_rows:  # no real query ever sees a padding key
        assert torch.isinf(mask[1, 0, q, pad_cols]).all()
    decode_mask = gen.trace.get("blocks.0.attn.hook_mask", 3)
    assert decode_mask.shape == (2, 1, 1, width + 3)
    assert torch.isinf(decode_mask[1, 0, 0, pad_cols]).all() and not torch.isinf(decode_mask[0]).any()
    labels = gen.facts.labels(1, gen.n_steps)
    assert [labels[c] for c in pad_cols] == ["⟨pad⟩"] * len(pad_cols)


def test_bad_prompts_are_refused_clearly(bundled):
    model, tok = bundled
    with pytest.raises(PromptError, match="empty"):
        TracedGeneration(model, tok, "")
    with pytest.raises(PromptError, match="whitespace"):
        TracedGeneration(model, tok, "   \n ")
    with pytest.raises(PromptError, match="prompt 2 is empty"):
        TracedGeneration(model, tok, ["fine", ""])
    with pytest.raises(ValueError, match="run\\(n\\)"):
        TracedGeneration(model, tok, "hi").run(MAX_RUN_STEPS + 1)


def test_reaching_n_ctx_stops_with_a_message_and_keeps_every_step():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, n_ctx=12, d_model=16, n_layer=1, n_head=2)).eval()
    from gpt_shape_tracer.model import load_bundled

    _, tok = load_bundled()
    gen = TracedGeneration(model, tok, "Lily had a ball.", temperature=0)
    n0 = len(tok.encode("Lily had a ball."))
    done = gen.run(20)
    assert done == 12 - n0  # one column per step, from the prompt's n0 up to n_ctx
    assert gen.sequence_length == 12
    with pytest.raises(ContextFullError, match="n_ctx = 12"):
        gen.step()
    assert gen.n_steps == done and gen.trace.get("hook_logits", done - 1) is not None


def test_long_prompts_are_cut_from_the_left_with_a_warning(bundled):
    model, tok = bundled
    text = "Lily and Tom played with the red ball all day. " * 40
    gen = TracedGeneration(model, tok, text, temperature=0)
    assert [len(r) for r in gen.info.prompt_tokens] == [model.config.n_ctx - 1]
    assert gen.warnings and "kept its last 255 tokens" in gen.warnings[0]
    assert list(gen.info.prompt_tokens[0]) == tok.encode(text)[-255:]
    gen.step()
    with pytest.raises(PromptError, match="at most 255"):
        TracedGeneration(model, tok, text, truncate="error")


def test_the_byte_budget_is_never_exceeded_and_old_steps_keep_their_stats(bundled):
    model, tok = bundled
    budget = 2**20
    gen = TracedGeneration(model, tok, "Once upon a time, there was a boy named Sam.", budget_bytes=budget,
                           temperature=0)
    for _ in range(30):
        gen.step()
        assert gen.trace.bytes_kept <= budget
    t = gen.trace
    assert t.log.peak_bytes_kept <= budget
    assert t.log.evicted_count > 0
    assert t.get("hook_logits", 0) is None  # the oldest steps were dropped…
    rec = t.record("hook_logits", 0)
    assert t.stats(rec) is not None and "evicted" in t.value_note(rec)  # …but keep shape and stats
    assert rec.shape == (1, len(tok.encode("Once upon a time, there was a boy named Sam.")), 1024)
    assert t.get("hook_logits", 29) is not None  # the newest step is whole
    assert t.log.steps_with_values()[-1] == 29


def test_shapes_only_keeps_no_values(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Hello", capture="shapes", temperature=0)
    gen.run(3)
    assert gen.trace.bytes_kept == 0 and gen.trace.get("hook_logits") is None
    assert gen.trace.record("hook_logits").shape == (1, 1, 1024)


def test_two_threads_tracing_one_model_see_only_their_own_tensors(bundled):
    model, tok = bundled
    prompts = {"a": "Once upon a time, there was a little girl named Lily.", "b": ["Tom said,", "Mia had a cat."]}
    expected = {}
    for key, prompt in prompts.items():  # sequential reference runs
        gen = TracedGeneration(model, tok, prompt, temperature=0)
        gen.run(6)
        expected[key] = gen
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def work(key):
        try:
            gen = TracedGeneration(model, tok, prompts[key], temperature=0)
            barrier.wait()
            for _ in range(6):
                gen.step()
            results[key] = gen
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in prompts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for key in prompts:
        got, ref = results[key].trace, expected[key].trace
        assert len(got.records) == len(ref.records)
        assert [r.shape for r in got.records] == [r.shape for r in ref.records]
        for s in range(6):
            assert torch.equal(got.get("blocks.3.attn.hook_pattern", s), ref.get("blocks.3.attn.hook_pattern", s))
            assert torch.equal(got.get("hook_logits", s), ref.get("hook_logits", s))
    assert results["a"].trace.record("hook_embed", 0).shape[0] == 1
    assert results["b"].trace.record("hook_embed", 0).shape[0] == 2


def test_an_untraced_forward_on_another_thread_is_not_recorded(bundled):
    model, tok = bundled
    tokens = torch.tensor([tok.encode("Ben had a dog.")])
    started, release = threading.Event(), threading.Event()

    def other():
        started.set()
        release.wait()
        with torch.no_grad():
            for _ in range(3):
                model(tokens)

    th = threading.Thread(target=other)
    th.start()
    with torch.no_grad(), Tracer(model, capture="shapes") as tr:
        started.wait()
        release.set()
        model(tokens[:, :2])
        th.join()
    assert tr.trace.n_steps == 1
    assert {r.shape for r in tr.trace.filter(name="hook_embed")} == {(1, 2, 128)}


def test_an_evicted_attention_pattern_keeps_a_pooled_summary_of_block_means():
    """A 256 × 256 pattern the budget cannot keep leaves a 128 × 128 summary: each cell the mean of a
    2 × 2 block of the real weights (computed here by slicing, not by the pooling the tracer uses)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_ctx=300, d_model=16, n_layer=1, n_head=2)).eval()
    tokens = torch.randint(0, 64, (1, 256))
    with Tracer(model, capture="values") as full, torch.no_grad():
        model(tokens)
    pattern = full.trace.get("blocks.0.attn.hook_pattern")
    # eager: the pattern a real tensor the budget evicts (a derived one is recomputed from Q and K instead)
    with attention_path("eager"), Tracer(model, capture="values", budget_bytes=256 * 1024) as tight, torch.no_grad():
        model(tokens)
    rec = tight.trace.record("blocks.0.attn.hook_pattern")
    assert tight.trace.get("blocks.0.attn.hook_pattern") is None  # evicted: 2 heads × 256² floats > 256 KiB
    digest = pattern_digest(tight.trace, rec)
    assert digest is not None and tuple(digest.shape) == (1, 2, 128, 128)
    blocks = pattern.reshape(1, 2, 128, 2, 128, 2).mean(dim=(3, 5))
    torch.testing.assert_close(digest, blocks)
    # only the weights are summarised
    assert pattern_digest(tight.trace, tight.trace.record("blocks.0.attn.hook_qk")) is None
    assert tight.trace.log.peak_bytes_kept <= 256 * 1024  # the summary counts against the budget, with the values


def test_summaries_count_against_the_budget_and_go_oldest_first():
    """Pooled summaries are charged to the value budget: over many steps with the cache off they never hold
    more than it, the oldest steps' summaries go first, and a summary larger than the budget is not kept."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_ctx=400, d_model=16, n_layer=2, n_head=2)).eval()
    budget = 600 * 1024
    tracer = Tracer(model, capture="values", budget_bytes=budget)
    with tracer, torch.no_grad():
        for step in range(12):  # each forward a step recomputing 200 + step positions: [1, 2, t, t] patterns
            model(torch.randint(0, 64, (1, 200 + step)))
    log = tracer.trace.log
    assert tracer.trace.n_steps == 12 and log.peak_bytes_kept <= budget and log.bytes_kept <= budget
    summarised = [s for s in range(12)
                  if pattern_digest(tracer.trace, tracer.trace.record("blocks.0.attn.hook_pattern", s)) is not None]
    assert summarised and summarised == list(range(summarised[0], 12))  # the newest steps, none missing
    assert summarised[0] > 0  # older ones were dropped to stay within the budget
    with Tracer(model, capture="values", budget_bytes=96 * 1024) as tiny, torch.no_grad():
        model(torch.randint(0, 64, (1, 256)))  # its summary alone (128 KiB) is larger than the budget
    assert pattern_digest(tiny.trace, tiny.trace.record("blocks.0.attn.hook_pattern")) is None
    assert tiny.trace.log.peak_bytes_kept <= 96 * 1024


def test_the_bytes_of_cached_keys_and_values_read_are_the_cache_tensors_own_bytes():
    """A grouped-query model (story-llama: 4 query heads share 2 key/value heads) caches G heads, not H: the
    bytes the cached path reads are those of the K and V tensors the step started from, as they were recorded."""
    from gpt_shape_tracer.model import load_bundled

    model, tok = load_bundled("story-llama")
    c = model.config
    assert c.n_kv_head < c.n_head
    gen = TracedGeneration(model, tok, ["Tom had a big red kite.", "Lily ran"], temperature=0)
    gen.run(3)
    held = sum(gen.trace.get(f"blocks.{layer}.attn.hook_{kind}_all", 1).nbytes  # [B, G, t − 1, d_head] each
               for layer in range(c.n_layer) for kind in "kv")
    comparison = gen.compare_with_recompute()
    assert comparison.cached.kv_bytes == held and comparison.full.kv_bytes == 0


def test_the_cached_rows_survive_the_cache_buffer_growing(bundled):
    """The cache's buffers start at 32 positions and grow by copying what they hold: a generation that passes 32
    positions still reads the same K and V as a full recompute (both of them: a growth that copied K into V
    would leave the keys right)."""
    from gpt_shape_tracer.model.gpt import MIN_CAPACITY

    model, tok = bundled
    prompt = "Once upon a time, there was a little girl named Lily. She had a red ball and a big dog named Max."
    n0 = len(tok.encode(prompt))
    gen = TracedGeneration(model, tok, prompt, temperature=0, capture="shapes")
    gen.run(MIN_CAPACITY - n0 + 3 if n0 < MIN_CAPACITY else 3)
    assert gen.cache_length > MIN_CAPACITY
    comparison = gen.compare_with_recompute()
    assert comparison.equal and comparison.cached_rows_equal


def test_a_rollback_after_a_failed_forward_restores_the_cache_exactly_and_forgets_what_it_staged():
    """A forward that fails part-way (after layer 0 wrote its rows, before layer 1 did) is rolled back: the
    length and every cached row are as before, and what it staged is forgotten — the next forward that skips a
    layer is refused by ``commit``, not taken for complete because the failed one wrote that layer."""
    from gpt_shape_tracer.model import KVCache

    g = torch.Generator().manual_seed(0)
    cache = KVCache(n_layer=2, batch_size=1)
    for layer in range(2):
        cache.append(layer, torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g))
    cache.commit(3, None)
    keys, values = [k.clone() for k in cache.keys], [v.clone() for v in cache.values]
    cache.append(0, torch.randn(1, 2, 2, 4, generator=g), torch.randn(1, 2, 2, 4, generator=g))  # then it fails
    cache.rollback()
    assert cache.length == 3
    for layer in range(2):
        assert torch.equal(cache.keys[layer], keys[layer]) and torch.equal(cache.values[layer], values[layer])
    cache.append(1, torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g))  # layer 0 skipped
    with pytest.raises(RuntimeError, match=r"layers \[0\] not updated"):
        cache.commit(1, None)
    assert cache.length == 3
    new_k, new_v = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g)
    for layer in range(2):  # a whole forward afterwards: its row follows the three kept ones
        cache.append(layer, new_k, new_v)
    cache.commit(1, None)
    for layer in range(2):
        assert torch.equal(cache.keys[layer], torch.cat([keys[layer], new_k], dim=2))
        assert torch.equal(cache.values[layer], torch.cat([values[layer], new_v], dim=2))
