"""The engine trace (tracer/engine/): transformers' continuous batching stepped through on a tiny random Llama (2
layers, d = 64, 4 query heads, 2 key/value heads of 16), compared with transformers itself: the tokens of every
request equal ``generate_batch``'s and each prompt's own greedy ``generate``; each request's Q, K, V and pattern at
every engine step equal its single-sequence eager forward at the same positions; the sizing equals
``PagedAttentionMemoryHandler``'s; preemption, refusals, the saved run and the CLI's --json."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import GPT, GPTConfig, load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR
from gpt_shape_tracer.tracer.engine import (
    EngineError,
    engine_sizing,
    engine_sizing_table,
    load_engine_run,
    pages_for,
    save_engine_run,
    trace_engine,
)
from tests.hf_architectures import ARCHITECTURES, build
from tests.tolerance import assert_close_across_cpus

PREFIX = list(range(100, 108))  # 8 tokens: two full pages of 4
PROMPTS = [PREFIX + [1, 2, 3], PREFIX + [4, 5], [7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25]]
ARRIVALS = [0, 0, 0, 3]  # the last arrives at engine step 3, mid-run
NEW = [6, 6, 2, 5]  # the third finishes early: its own max_new_tokens


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)


@pytest.fixture(scope="module")
def llama_dir():
    return build("llama", Path(tempfile.mkdtemp(prefix="engine-")) / "llama", BUNDLED_DIR / "tokenizer.json")


@pytest.fixture(scope="module")
def decoder(llama_dir):
    model, tokenizer = load_hf(llama_dir, implementation="transformers")
    return model, tokenizer


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The same weights as transformers loads them, eager attention: generate, generate_batch, and the
    single-sequence Q, K, V and pattern through a recording copy of transformers' eager attention."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    seen: dict[int, dict[str, torch.Tensor]] = {}

    def recording(module, query, key, value, attention_mask, scaling, **kwargs):
        out, weights = eager_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)
        seen[module.layer_idx] = dict(q=query[0].clone(), k=key[0].clone(), v=value[0].clone(), pattern=weights[0])
        return out, weights

    AttentionInterface.register("engine_test_eager", recording)
    AttentionMaskInterface.register("engine_test_eager", eager_mask)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, local_files_only=True, attn_implementation="eager").eval()
    return model, seen


def greedy(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_of(decoder, prompts=PROMPTS, **options):
    model, tokenizer = decoder
    options = {"page_size": 4, "pages": 32, "max_batch_tokens": 64, "max_new_tokens": NEW, "arrivals": ARRIVALS,
               **options}
    return trace_engine(model, tokenizer, prompts, **options)


@pytest.fixture(scope="module")
def shared_run(decoder):
    return run_of(decoder)


@pytest.mark.parametrize("share", [True, False])
def test_tokens_equal_generate_batch_and_each_prompts_own_greedy_generate(decoder, reference, shared_run, share):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    run = shared_run if share else run_of(decoder, share_prefixes=False)
    model = reference[0]
    batch = model.generate_batch(
        inputs=PROMPTS, generation_config=GenerationConfig(max_new_tokens=max(NEW), do_sample=False, eos_token_id=-1),
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, page_size=4,
                                                            allow_block_sharing=share), warmup=False)
    by_prompt = {tuple(out.prompt_ids): out.generated_tokens for out in batch.values()}
    assert model.config._attn_implementation == "eager"  # generate_batch gave it back too
    for request, prompt, n in zip(run.requests, PROMPTS, NEW):
        assert list(request.prompt_ids) == prompt
        assert list(request.generated_ids) == by_prompt[tuple(prompt)][:n] == greedy(model, prompt, n)
        assert request.finish_reason == "length"
    r2, r3 = run.requests[2], run.requests[3]
    assert r3.arrival == r3.first_step == 3 and run.steps[3].arrived == ("r3",)  # arrived mid-run
    assert r2.finished_step is not None and r2.finished_step < run.requests[0].finished_step  # finished early
    assert "r2" in run.steps[r2.finished_step].finished
    shared = {page for s in run.steps for page, _ in s.shared}
    assert bool(shared) == share  # the common prefix's two pages are shared only when sharing is on
    for step in run.steps:  # every page of the pool is held, cached or free, never two of these
        assert step.pages_in_use + len(step.cached) + step.pages_free == step.pages_total == run.pool.pages


def test_a_request_ends_at_its_end_of_sequence_token(decoder, reference):
    model = reference[0]
    tokens = greedy(model, PROMPTS[2], 6)
    k = next(k for k in range(2, 6) if tokens[k] not in tokens[:k])  # a token it first generates third or later
    eos = tokens[k]
    run = run_of(decoder, eos_token_id=eos, max_new_tokens=6, arrivals=None)
    for request, prompt in zip(run.requests, PROMPTS):
        expected = greedy(model, prompt, 6, eos=eos)
        expected = expected[:expected.index(eos) + 1] if eos in expected else expected
        assert list(request.generated_ids) == expected
    assert run.requests[2].generated_ids[-1] == eos and run.requests[2].finish_reason == "eos"
    assert len(run.requests[2].generated_ids) == k + 1


def test_each_requests_attention_equals_its_single_sequence_run(shared_run, reference):
    model, seen = reference
    run = shared_run
    model.set_attn_implementation("engine_test_eager")
    try:
        checked = 0
        for request in run.requests:
            sequence = list(request.prompt_ids) + list(request.generated_ids[:-1])
            with torch.no_grad():
                model(torch.tensor([sequence]))
            for step in run.steps:
                part = step.request(request.request_id)
                if part is None:
                    continue
                start, stop = part.positions
                for layer in range(run.pool.n_layer):
                    got, ref = run.attention(step.step, request.request_id, layer), seen[layer]
                    assert got is not None
                    what = f"{request.request_id} step {step.step} layer {layer}"
                    assert_close_across_cpus(got.q, ref["q"][:, start:stop], f"{what} Q")
                    assert_close_across_cpus(got.k, ref["k"][:, :stop], f"{what} K")
                    assert_close_across_cpus(got.v, ref["v"][:, :stop], f"{what} V")
                    assert_close_across_cpus(got.pattern, ref["pattern"][:, start:stop, :stop], f"{what} pattern")
                    checked += 1
        assert checked >= 2 * sum(len(s.requests) for s in run.steps) > 0
    finally:
        model.set_attn_implementation("eager")


def test_a_shared_prefix_is_read_from_the_same_pages_with_the_same_k_and_v(decoder):
    late = PREFIX + [9, 9, 9]
    run = run_of(decoder, prompts=[PROMPTS[0], late], max_new_tokens=4, arrivals=[0, 1])
    first, second = run.requests
    assert second.prefix_hit_tokens == 8 and first.prefix_hit_tokens == 0  # found in the pool, not recomputed
    step = run.steps[1]
    a, b = step.request("r0"), step.request("r1")
    assert a is not None and b is not None and b.past == 8 and b.tokens == 3  # only its suffix is prefilled
    assert a.block_table[:2] == b.block_table[:2]
    assert {page for page, holders in step.shared if holders == 2} == set(a.block_table[:2])
    for layer in range(run.pool.n_layer):
        ka, kb = run.attention(1, "r0", layer), run.attention(1, "r1", layer)
        assert ka is not None and kb is not None
        assert torch.equal(ka.k[:, :8], kb.k[:, :8]) and torch.equal(ka.v[:, :8], kb.v[:, :8])
        assert not torch.equal(ka.k[:, 8:11], kb.k[:, 8:11])  # the suffixes differ, and so does what they hold


def test_preemption_is_recorded_and_the_tokens_are_still_exact(decoder, reference):
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
    run = run_of(decoder, prompts=prompts, pages=8, max_new_tokens=12, arrivals=None, share_prefixes=False)
    preempted = [(s.step, rid) for s in run.steps for rid in s.preempted]
    assert preempted, "a pool of 8 pages for 3 requests of 17-18 positions must preempt"
    for step, rid in preempted:
        request = run.request(rid)
        assert step in request.preempted_at
        back = next(s for s in run.steps[step + 1:] if s.request(rid) is not None).request(rid)
        assert back is not None and back.recompute and back.contribution == "prefill" and back.past == 0
    for request, prompt in zip(run.requests, prompts):
        assert list(request.generated_ids) == greedy(reference[0], prompt, 12)


def test_what_cannot_run_is_refused_with_the_reason(decoder):
    model, tokenizer = decoder
    with pytest.raises(EngineError, match=r"request 0 cannot fit the pool: it needs 4 pages of 4 positions .* "
                                          r"the pool holds 3"):
        trace_engine(model, tokenizer, [list(range(1, 12))], page_size=4, pages=3, max_new_tokens=6)
    assert pages_for(11, 6, 4) == 4  # 11 prompt + 5 generated positions kept: the last token is never written
    ours = GPT(GPTConfig(vocab_size=64, n_ctx=32, d_model=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(EngineError, match="cannot take the paged path"):
        trace_engine(ours, None, [[1, 2, 3]], page_size=4, pages=8)
    with pytest.raises(EngineError, match="packed attention mask"):
        trace_engine(model, tokenizer, [[1, 2, 3]], page_size=256, pages=4000, max_batch_tokens=8192)


def test_the_model_and_the_attention_registry_are_restored(decoder):
    from transformers.integrations.eager_paged import eager_paged_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, _ = decoder
    before = model.hf.config._attn_implementation
    with pytest.raises(EngineError, match="did not end within 2 engine steps"):
        run_of(decoder, max_steps=2)  # a run that fails midway gives everything back too
    assert model.hf.config._attn_implementation == before != "paged|eager"
    assert ALL_ATTENTION_FUNCTIONS["paged|eager"] is eager_paged_attention_forward


def test_the_values_stay_within_their_budget(decoder, shared_run):
    full = shared_run.bytes_kept
    run = run_of(decoder, budget_bytes=full // 3)
    assert 0 < run.bytes_kept <= full // 3
    assert run.notes and "dropped" in run.notes[0]
    last = run.steps[-1]
    assert run.attention(0, "r0", 0) is None and run.attention(last.step, last.requests[0].request_id, 1) is not None
    assert [r.generated_ids for r in run.requests] == [r.generated_ids for r in shared_run.requests]


def test_a_saved_engine_run_loads_back_equal(shared_run, tmp_path):
    path = save_engine_run(shared_run, tmp_path / "engine.zip")
    back = load_engine_run(path)
    assert back.pool == shared_run.pool and back.requests == shared_run.requests and back.steps == shared_run.steps
    assert back.notes == shared_run.notes and back.budget_bytes == shared_run.budget_bytes
    ours, theirs = list(shared_run.attentions()), list(back.attentions())
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert (a.step, a.request_id, a.layer, a.past) == (b.step, b.request_id, b.layer, b.past)
        assert all(torch.equal(getattr(a, part), getattr(b, part)) for part in ("q", "k", "v", "pattern"))


def _handler(config, dtype, available: int, **cb):
    """transformers' own sizing for the same inputs, its available memory given instead of measured."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    class Given(PagedAttentionMemoryHandler):
        def get_available_memory(self) -> int:
            return available

    cbc = ContinuousBatchingConfig(max_memory_percent=1.0, max_blocks_per_request=0, **cb)
    block = config.num_hidden_layers * 2 * find_num_key_value_heads(config) * find_head_dim(config) * \
        dtype.itemsize * cbc.page_size
    sector = math.lcm(block, 128)
    handler = Given(config=config, cb_config=cbc, dtype=dtype, bytes_per_sector=sector,
                    tokens_per_sector=(sector // block) * cbc.page_size, bytes_per_block=block,
                    attn_types=["full_attention"], model_supports_logits_to_keep=True)
    M, S = handler.infer_max_batch_tokens_and_num_sectors()
    return M, S, S * sector // block, handler.compute_memory_footprint(M, S)


@pytest.mark.parametrize("name, kwargs, memory, page, batch", [
    ("llama-8b-like", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           num_hidden_layers=32, vocab_size=128256, intermediate_size=14336), 80 * 2**30, 256, None),
    ("tiny", dict(ARCHITECTURES["llama"][1]), 2**30, 16, 512),
    ("no-gqa", dict(ARCHITECTURES["llama"][1], num_key_value_heads=4), 3 * 2**28, 4, 64),
])
def test_sizing_equals_transformers_arithmetic(name, kwargs, memory, page, batch):
    from transformers import LlamaConfig

    config = LlamaConfig(**kwargs)
    table = engine_sizing_table(config, memory_bytes=memory, request_tokens=1000, page_size=page,
                                max_batch_tokens=batch, weights_bytes=7 * 2**20)
    for sizing in table:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[sizing.dtype]
        M, S, pages, footprint = _handler(config, dtype, sizing.available_bytes, page_size=page,
                                          max_batch_tokens=batch)
        assert (sizing.max_batch_tokens, sizing.sectors, sizing.pages, sizing.footprint_bytes) == \
            (M, S, pages, footprint), name
        assert sizing.concurrent_requests == pages // math.ceil(1000 / page) and sizing.footprint_bytes <= \
            sizing.available_bytes
    assert table[0].pages < table[1].pages  # float32 pages hold twice the bytes of bfloat16 ones


def test_sizing_counts_the_weights_from_the_config_alone():
    from transformers import LlamaConfig

    config = LlamaConfig(**ARCHITECTURES["llama"][1])
    built = sum(p.numel() for p in __import__("transformers").LlamaForCausalLM(config).parameters())
    sizing = engine_sizing(config, memory_bytes=2**30, request_tokens=64, dtype="bfloat16", page_size=16,
                           max_batch_tokens=256)
    assert sizing.weights_bytes == 2 * built
    nothing = engine_sizing(config, memory_bytes=sizing.weights_bytes + 1000, request_tokens=64, page_size=16,
                            max_batch_tokens=256)
    assert nothing.pages == 0 and "nothing fits" in nothing.note


def test_the_private_step_calls_of_transformers_are_still_there():
    """trace_engine drives transformers' batch processor itself (no public synchronous step in 5.23): these are
    the calls it makes, and the loop body of transformers' own thread makes the same ones in this order."""
    import inspect

    import transformers
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
        ContinuousBatchProcessor,
    )

    assert transformers.__version__.startswith("5.")
    assert callable(ContinuousBatchingManager._create_batch_processor)
    for name in ("prepare_next_batch", "_generation_step", "update_batch", "has_pending_requests"):
        assert callable(getattr(ContinuousBatchProcessor, name)), name
    body = inspect.getsource(ContinuousBatchingManager._generation_loop_body)
    assert body.index("prepare_next_batch") < body.index("_generation_step") < body.index("update_batch")


def test_the_cli_lists_the_requests_as_json(llama_dir, capsys):
    from gpt_shape_tracer.trace_command import main

    code = main(["--continuous-batching", "--model-dir", str(llama_dir), "--page-size", "4", "--pages", "32",
                 "--max-batch-tokens", "64", "--arrivals", "0,0,2", "--steps", "4", "--json", "--quiet",
                 "--prompt", "Lily had a red kite.", "--prompt", "Lily had a red ball.", "--prompt", "Tom said"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [r["prompt"] for r in out["requests"]] == ["Lily had a red kite.", "Lily had a red ball.", "Tom said"]
    assert [r["arrived_step"] for r in out["requests"]] == [0, 0, 2]
    assert all(len(r["generated_ids"]) == 4 and r["finished_step"] >= r["arrived_step"] for r in out["requests"])
    assert out["pool"]["pages"] == 32 and out["pool"]["page_size"] == 4 and len(out["steps"]) == out["engine_steps"]
    code = main(["--continuous-batching", "--model-dir", str(llama_dir), "--page-size", "4", "--pages", "1",
                 "--prompt", "Lily had a red kite."])
    assert code == 2 and "cannot fit the pool" in capsys.readouterr().err
