"""Record the cheap, derive the rest (issue 53): a traced forward runs attention fused at every length, and the n × t
stages it never held (QKᵀ, the scaled and soft-capped scores, the mask, the masked scores, the pattern) read back —
value, NaN/∞ flag, statistics, whether there is a value, a saved file — as the eager capture recorded them, record by
record. Our GPT's families (GPT-2, Llama with grouped K/V heads, Mistral's sliding window, Qwen2 with one K/V
head) at several prompt lengths and cached steps, and transformers' decoders of tests/hf_architectures.py (RoPE,
GQA, sliding windows, soft-caps; gpt-oss's sinks stay eager, recorded as before)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pandas
import pytest
import torch

from gpt_shape_tracer.model import GPT, GPTConfig
from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.tracer import Finite, Trace, TracedGeneration, Tracer, is_derived, load_trace, save_trace

# relative to a record's largest magnitude: the fused kernel and the eager path round differently, and float32 sums
# round differently by instruction set (the suite also runs with ATEN_CPU_CAPABILITY=default); measured ≤ 2e-6
TOL = 2e-5
STAGES = ("hook_qk", "hook_attn_scores", "hook_softcapped", "hook_mask", "hook_masked_scores", "hook_pattern")


def assert_close(want: torch.Tensor, got: torch.Tensor, what: str) -> None:
    assert want.shape == got.shape and want.dtype == got.dtype, what
    if not want.is_floating_point():  # token ids, masks of booleans: equal
        assert torch.equal(want, got), what
        return
    assert torch.equal(torch.isnan(want), torch.isnan(got)), what
    assert torch.equal(torch.isinf(want), torch.isinf(got)) and torch.equal(want[torch.isinf(want)],
                                                                           got[torch.isinf(got)]), what
    finite = torch.isfinite(want)
    if finite.any():
        scale = max(1.0, float(want[finite].abs().max()))
        assert float((want[finite].double() - got[finite].double()).abs().max()) <= TOL * scale, what


def assert_same_records(eager: Trace, derived: Trace, derived_expected: bool = True, stages_only: bool = False) -> int:
    """Every record of the two traces (``stages_only``: the n × t stages), one by one: name, shape, dtype, value,
    flag, statistics; returns how many records were derived."""
    count = 0
    assert eager.n_steps == derived.n_steps
    for a, b in zip(eager.records, derived.records, strict=True):
        what = f"{b.name} step {b.step}"
        assert (a.name, a.shape, a.dtype, a.step) == (b.name, b.shape, b.dtype, b.step), what
        if stages_only and not is_derived(derived, b):
            continue
        assert not is_derived(eager, a)
        if is_derived(derived, b):
            count += 1
            assert b.name.rsplit(".", 1)[-1].split("#")[0] in STAGES, what
        assert eager.has_value(a) == derived.has_value(b), what
        va, vb = eager.value(a), derived.value(b)
        assert (va is None) == (vb is None), what
        if va is not None:
            assert vb is not None
            assert_close(va, vb, what)
        assert eager.finite_flag(a) == derived.finite_flag(b), what
        sa, sb = eager.stats(a), derived.stats(b)
        assert (sa is None) == (sb is None), what
        if sa is not None and sb is not None:
            assert (sa.nan, sa.pos_inf, sa.neg_inf) == (sb.nan, sb.pos_inf, sb.neg_inf), what
            for x, y in ((sa.min, sb.min), (sa.max, sb.max), (sa.mean, sb.mean)):
                assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5), (what, x, y)
    assert (count > 0) == derived_expected
    return count


OUR_FAMILIES = [
    ("gpt2", {}),
    ("llama", dict(n_kv_head=2)),  # RoPE, grouped K/V heads
    ("mistral", dict(n_kv_head=2, sliding_window=5)),
    ("qwen2", dict(n_kv_head=1)),  # one K/V head for all four query heads
]


@pytest.mark.parametrize("family,fields", OUR_FAMILIES, ids=[f for f, _ in OUR_FAMILIES])
@pytest.mark.parametrize("n", [1, 9, 40])
def test_our_gpt_derived_stages_equal_the_materialised_ones_record_by_record(family, fields, n):
    torch.manual_seed(n)
    config = GPTConfig.for_family(family, vocab_size=64, n_ctx=64, d_model=32, n_layer=2, n_head=4, **fields)
    model = GPT(config).eval()
    tokens, decode = torch.randint(0, 64, (1, n)), torch.randint(0, 64, (1, 2))
    traces = {}
    for mode in ("eager", "auto"):  # auto: the defaults a tracer runs under
        cache = model.new_cache(1)
        with torch.no_grad(), attention_path(mode), Tracer(model) as tr:
            model(tokens, cache)
            for i in range(2):
                model(decode[:, i:i + 1], cache)
        traces[mode] = tr.trace
    derived = assert_same_records(traces["eager"], traces["auto"])
    assert derived == 3 * config.n_layer * 5  # five stages a layer, three steps
    # a saved derived trace reads back the same numbers (the file holds Q and K and the mask description)
    with tempfile.TemporaryDirectory() as d:
        save_trace(traces["auto"], Path(d) / "t")
        assert_same_records(traces["eager"], load_trace(Path(d) / "t"))


@pytest.mark.parametrize("capture", ["shapes", "values", "ops"])
def test_a_fused_layers_stages_reach_the_tracer_in_one_call_and_are_recorded_as_one_by_one(capture):
    """A fused layer's five derived stages reach a tracer in one call (``record_derived_each``, from its taps'
    group), and leave the records, call numbers, notes, values and flags that telling each stage on its own
    (``record_derived``) leaves: a batch of two with padding, a prefill and cached steps."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.for_family("llama", vocab_size=64, n_ctx=64, d_model=32, n_layer=2, n_head=4,
                                     n_kv_head=2)).eval()
    tokens = torch.randint(0, 64, (2, 12))
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :3] = False
    heard: dict[str, list] = {"together": [], "one by one": []}
    traces = {}
    for way in heard:
        tracer = Tracer(model, capture=capture)
        each = tracer.record_derived_each
        if way == "together":
            tracer.record_derived_each = lambda told, each=each: (heard["together"].append(
                [stage.stage for _, stage in told]), each(told))[-1]
        else:  # the same stages handed over one at a time, as a tap outside the group would
            tracer.record_derived_each = lambda told, one=tracer.record_derived: [
                (heard["one by one"].append(stage.stage), one(index, stage)) for index, stage in told]
        cache = model.new_cache(2)
        with torch.no_grad(), tracer:
            model(tokens[:, :9], cache, padding_mask=padding[:, :9])
            for i in range(9, 12):
                model(tokens[:, i:i + 1], cache)  # the cache remembers the prompt's padding
        traces[way] = tracer.trace
    stages = ["qk", "scores", "mask", "masked_scores", "pattern"]
    assert heard["together"] == [stages] * (4 * 2)  # one call a layer, four steps of two layers
    assert heard["one by one"] == stages * (4 * 2)
    a, b = traces["together"], traces["one by one"]
    frame_a, frame_b = a.to_frame(stats=capture != "shapes"), b.to_frame(stats=capture != "shapes")
    assert len(frame_a) > 0
    pandas.testing.assert_frame_equal(frame_a, frame_b)  # every column: names, calls, shapes, notes, flags, stats
    for ra, rb in zip(a.records, b.records, strict=True):
        va, vb = a.value(ra), b.value(rb)
        assert (va is None) == (vb is None) and (va is None or torch.equal(va, vb)), ra.name
    assert sum(is_derived(a, r) for r in a.records) == 5 * 4 * 2


def test_the_table_reads_a_derived_trace_as_an_eager_one():
    torch.manual_seed(0)
    model = GPT(GPTConfig.for_family("llama", vocab_size=64, n_ctx=64, d_model=32, n_layer=2, n_head=4,
                                     n_kv_head=2)).eval()
    tokens = torch.randint(0, 64, (2, 17))
    padding = torch.ones(2, 17, dtype=torch.bool)
    padding[1, :6] = False  # left padding: padding queries see themselves
    frames = {}
    for mode in ("eager", "auto"):
        with torch.no_grad(), attention_path(mode), Tracer(model) as tr:
            model(tokens, padding_mask=padding)
        frames[mode] = tr.trace.to_frame()
    a, b = frames["eager"], frames["auto"]
    assert list(a["finite"]) == list(b["finite"]) and list(a["has_value"]) == list(b["has_value"])
    assert list(a["neg_inf"]) == list(b["neg_inf"]) and list(a["nan"]) == list(b["nan"])
    for column in ("min", "max", "mean", "std"):
        for x, y in zip(a[column], b[column], strict=True):
            assert math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(x) and math.isnan(y)), column


def test_a_nan_in_q_is_counted_in_the_derived_stages_not_assumed_away():
    torch.manual_seed(0)
    model = GPT(GPTConfig.for_family("gpt2", vocab_size=64, n_ctx=64, d_model=32, n_layer=1, n_head=4)).eval()
    with torch.no_grad():
        model.blocks[0].attn.c_attn.weight[0, 0] = float("nan")  # one input dimension of head 0's Q
    tokens = torch.randint(0, 64, (1, 8))
    traces = {}
    for mode in ("eager", "auto"):
        with torch.no_grad(), attention_path(mode), Tracer(model) as tr:
            model(tokens)
        traces[mode] = tr.trace
    # the stages: NaN where the eager path has it, counted; after them the paths part — PyTorch's fused CPU kernel
    # writes 0 where the eager A·V writes NaN (with AVX2; NaN with ATEN_CPU_CAPABILITY=default), and the traced
    # forward is the untraced one (which runs fused): equal to the bit, a NaN where the other has one
    assert_same_records(traces["eager"], traces["auto"], stages_only=True)
    for hook in ("hook_qk", "hook_attn_scores", "hook_masked_scores", "hook_pattern"):
        assert traces["auto"].stats(f"blocks.0.attn.{hook}").nan > 0
        assert traces["auto"].finite_flag(traces["auto"].record(f"blocks.0.attn.{hook}")) == Finite.BAD
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), traces["auto"].get("hook_logits"), rtol=0, atol=0, equal_nan=True)


def _hf_architectures():
    from tests.hf_architectures import ARCHITECTURES

    return [name for name in ARCHITECTURES if name in ("gpt2", "llama", "mistral", "qwen3", "gemma2", "gpt_neox",
                                                        "gpt_oss", "phi3")]


@pytest.fixture(scope="module")
def hf_directories():
    from gpt_shape_tracer.model.sources import BUNDLED_DIR
    from tests.hf_architectures import build

    root = Path(tempfile.mkdtemp(prefix="hf-derived-"))
    return {name: build(name, root / name, BUNDLED_DIR / "tokenizer.json") for name in _hf_architectures()}


@pytest.mark.parametrize("model_type", _hf_architectures())
def test_transformers_derived_stages_equal_the_materialised_ones_record_by_record(hf_directories, model_type):
    from gpt_shape_tracer.model import load_hf

    model, tok = load_hf(hf_directories[model_type], implementation="transformers")
    for prompts in (["Lily had a red kite."], ["Lily had a red kite that flew over the hill.", "Tom said"]):
        gens = {}
        for mode in ("eager", "auto"):
            with attention_path(mode):
                gen = TracedGeneration(model, tok, prompts, temperature=0, padding_side="left")
                gen.run(3)
            gens[mode] = gen.trace
        # a sink's column is computed eager in any mode (model/sources/_hf_attention.py): recorded, not derived
        assert_same_records(gens["eager"], gens["auto"], derived_expected=not model.config.attn_sinks)


def test_recomputed_stages_are_bounded_counted_and_never_recomputed_by_a_save():
    """What readers recompute is remembered within WHOLE_MEMO_BYTES and counted (``Trace.recomputed_bytes``, which
    the app's session adds to what the server reserves for it); saving a trace recomputes nothing (a run is written
    after every Step: it once recomputed every stage of every step), and a file read back recomputes the same."""
    from gpt_shape_tracer.model import load_bundled
    from gpt_shape_tracer.session import AppState
    from gpt_shape_tracer.tracer.files import archive_bytes
    from gpt_shape_tracer.tracer.reading._derived import WHOLE_MEMO_BYTES

    model, tok = load_bundled("story-gpt")
    gen = TracedGeneration(model, tok, "Lily had a red kite that flew over the hill. " * 3, temperature=0.0,
                           use_cache=False)
    gen.run(3)
    trace = gen.trace
    assert trace.recomputed_bytes == 0
    data = archive_bytes(trace)
    assert trace.recomputed_bytes == 0 and not trace.derived_memo  # the save took no derived statistics
    pattern = trace.record("blocks.1.attn.hook_pattern", 2)
    value = trace.value(pattern)
    assert value is not None and trace.recomputed_bytes == value.numel() * value.element_size()
    frame = trace.to_frame(step=1)  # the Shapes table: every derived record of the step, recomputed and remembered
    derived = [r for r in trace.filter(step=1) if is_derived(trace, r.name, 1)]
    assert derived and all(frame.set_index("index").loc[r.index, "min"] == trace.stats(r).min for r in derived)
    assert 0 < trace.recomputed_bytes <= WHOLE_MEMO_BYTES
    app = AppState()
    app.live.generation = gen
    assert app.held_bytes()["recomputed"] == trace.recomputed_bytes
    back = load_trace(data)
    assert_close(value, back.value(back.record("blocks.1.attn.hook_pattern", 2)), "read back")
