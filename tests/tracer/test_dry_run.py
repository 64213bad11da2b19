"""Dry runs (model/sources/_dry_run.py, tracer/generation/_dry.py): a model built from its config alone on the meta
device records what the same model with its weights records — name for name, shape for shape — prefill and
decode; bad configs are refused with their reason."""

from __future__ import annotations

import html
import json
import math
import shutil

import pytest
import torch

from gpt_shape_tracer.model import ModelLoadError, load_model
from gpt_shape_tracer.model.sources import ASSETS, MAX_DRY_LAYERS, NO_WEIGHTS, on_meta
from gpt_shape_tracer.tracer import Finite, TracedGeneration, Tracer, dry_run
from tests.hf_architectures import ARCHITECTURES, build

PROMPT = "Once upon a time"
TOKENIZER = ASSETS / "story-gpt" / "tokenizer.json"


def _rows(trace, hook_axes_only: bool = True):
    """(step, name, shape, dtype, axes) of every record; axes for hook points only. A module's input or output
    takes the axes of the hook point that saw the same tensor, found by address, and a freed tensor's address is
    reused by the allocator in a run with values (and by the meta device's bookkeeping in a dry run) in an order
    that differs from run to run: those inherited axes are not the model's, so they are not compared."""
    return [(r.step, r.name, r.shape, r.dtype, r.axes if r.kind == "hook" or not hook_axes_only else None)
            for r in trace.records]


def _compare(directory, tokenizer_dir=None):
    real, tok = load_model(directory)
    dry, dry_tok = load_model(directory, weights=False)
    assert on_meta(dry) and not on_meta(real)
    assert dry.identity.weights_digest == NO_WEIGHTS
    assert type(dry) is type(real)
    gen = TracedGeneration(real, tok, PROMPT, capture="shapes", temperature=0.0)
    gen.run(3)
    dry_gen = dry_run(dry, dry_tok, PROMPT, steps=2)
    real_rows, dry_rows = _rows(gen.trace), _rows(dry_gen.trace)
    assert {r[0] for r in dry_rows} == {0, 1, 2}  # the prefill and two decode steps
    assert real_rows == dry_rows
    assert sum(r[4] is not None for r in dry_rows) > 0
    # the KV cache grew one row per decode step, as in the real run
    assert [s.forward.cache_after for s in dry_gen.facts.steps] == [s.forward.cache_after for s in gen.facts.steps]
    return dry_gen


@pytest.mark.parametrize("name", ["story-gpt", "story-llama"])
def test_dry_run_records_equal_the_real_run_for_our_gpt(name):
    gen = _compare(ASSETS / name)
    trace = gen.trace
    assert trace.dry_run
    rec = trace.record("blocks.0.attn.hook_pattern", step=1)
    assert trace.summary(rec).endswith("no values (dry run)")
    assert trace.stats(rec) is None and trace.finite_flag(rec) == Finite.UNKNOWN
    assert trace.value_note(rec) == "no values (dry run)"
    # a module's output is known as the tensor its hook point saw (by the meta tensor's storage, as by an address)
    assert trace.record("blocks.0.attn:out", step=0).axes == ("B", "n", "d")
    step = gen.facts.steps[1]
    assert step.sampling is not None and "placeholder" in step.sampling.labels[0]
    assert all(math.isnan(p) for p in step.sampling.probs)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_dry_run_records_equal_the_real_run_for_every_architecture(model_type, tmp_path):
    build(model_type, tmp_path / model_type, TOKENIZER)
    _compare(tmp_path / model_type)


def test_placeholder_ids_without_a_tokenizer(tmp_path):
    (tmp_path / "config.json").write_bytes((ASSETS / "story-llama" / "config.json").read_bytes())
    dry, tok = load_model(tmp_path, weights=False)
    assert tok is None
    gen = dry_run(dry, n=7, steps=3)
    assert gen.facts.steps[0].forward.n == 7 and gen.facts.steps[-1].forward.cache_after == 10
    assert gen.trace.record("blocks.3.attn.hook_k_all", step=3).shape == (1, 2, 10, 32)


def test_a_dry_run_with_a_tokenizer_labels_its_placeholder_ids(capsys):
    """Issue 52: the chosen ids of a dry run are placeholders (id 0, which GPT-2's tokenizer reads as
    <|endoftext|>): the text says so instead of decoding them, in the library and in the CLI's printing."""
    from gpt_shape_tracer.trace_command import main
    from gpt_shape_tracer.tracer.generation._traced import PLACEHOLDER_ID

    dry, tok = load_model(ASSETS / "story-gpt", weights=False)
    assert tok is not None
    gen = dry_run(dry, tok, PROMPT, steps=2)
    chosen = gen.generated(0)
    assert chosen == (PLACEHOLDER_ID,) * 3  # the prefill and two decode steps each "chose" one
    decoded = tok.decode([PLACEHOLDER_ID])
    assert decoded  # the id reads as a real token when decoded: what the text must not show
    text = gen.text(0)
    assert text == tok.decode(list(gen.info.prompt_tokens[0])) + "⟨3 placeholder id(s): a dry run samples nothing⟩"
    assert decoded not in text and decoded not in html.unescape(gen._repr_html_())
    assert main(["--prompt", PROMPT, "--model-dir", str(ASSETS / "story-gpt"), "--dry-run", "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "text[0]: 'Once upon a time⟨2 placeholder id(s): a dry run samples nothing⟩'" in printed, printed[-300:]
    assert decoded not in printed


def test_sources_bare_config_and_headers(tmp_path):
    dry, _ = load_model(ASSETS / "story-gpt" / "config.json", weights=False)
    assert on_meta(dry)
    # a directory with safetensors: read for their headers only, checked against the config
    shutil.copytree(ASSETS / "story-gpt", tmp_path / "m")
    dry, tok = load_model(tmp_path / "m", weights=False)
    assert tok is not None and on_meta(dry)
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(raw, n_layer=raw["n_layer"] + 1)))
    with pytest.raises(ModelLoadError, match="n_layer"):
        load_model(tmp_path / "m", weights=False)


def test_dtype_from_the_config_unless_asked(tmp_path):
    raw = json.loads((ASSETS / "story-llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, torch_dtype="bfloat16")))
    dry, _ = load_model(tmp_path, weights=False)
    assert next(dry.parameters()).dtype == torch.bfloat16
    dry, _ = load_model(tmp_path, weights=False, dtype="float16")
    assert next(dry.parameters()).dtype == torch.float16


def test_values_capture_of_a_meta_model_is_refused():
    dry, _ = load_model(ASSETS / "story-gpt", weights=False)
    with pytest.raises(ValueError, match="capture='shapes'"):
        Tracer(dry, capture="values")


@pytest.mark.parametrize("change, match", [
    ({"num_hidden_layers": 10**6}, f"more than a dry run builds \\({MAX_DRY_LAYERS:,}"),
    ({"vocab_size": 2**40}, "vocab_size"),
    ({"model_type": "no-such-model"}, "'no-such-model' is unknown"),
    ({"num_experts": -3}, "num_experts must be a whole number ≥ 0, got -3"),
    ({"text_config": {"num_local_experts": -1}}, "num_local_experts must be a whole number ≥ 0, got -1"),
])
def test_bad_configs_are_refused(tmp_path, change, match):
    raw = json.loads((ASSETS / "story-llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, **change)))
    with pytest.raises(ModelLoadError, match=match):
        load_model(tmp_path, weights=False)


def _sizes_elsewhere() -> dict[str, dict]:
    """Configs whose sizes are not where the check once looked (the top level's num_hidden_layers, or the
    text_config's when there is one): each made transformers build, or its config class list, every layer."""
    from transformers import Gemma2Config

    llama = json.loads((ASSETS / "story-llama" / "config.json").read_text())
    gemma2 = {k: v for k, v in Gemma2Config(**ARCHITECTURES["gemma2"][1]).to_dict().items() if k != "layer_types"}
    return {
        "llama, empty text_config": dict(llama, num_hidden_layers=60_000, text_config={}),
        "gemma2, empty text_config": dict(gemma2, num_hidden_layers=10**9, text_config={}),
        "mpt, n_layers": dict(model_type="mpt", d_model=64, n_heads=4, vocab_size=1024, n_layers=10**9),
        "dbrx, n_layers": dict(model_type="dbrx", d_model=64, n_heads=4, vocab_size=1024, n_layers=10**9,
                               attn_config={"rope_theta": 10000.0}),
    }


@pytest.mark.parametrize("case", sorted(_sizes_elsewhere()))
def test_sizes_under_other_keys_or_levels_are_refused_before_anything_is_built(tmp_path, case):
    """Each once passed the size check and built for minutes; refused now in a child process with a time limit
    (so a regression fails here rather than hanging the suite)."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps(_sizes_elsewhere()[case]))
    probe = ("import sys\nfrom gpt_shape_tracer.model import ModelLoadError, load_model\n"
             "try:\n    load_model(sys.argv[1], weights=False)\nexcept ModelLoadError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "is more than a dry run builds" in done.stdout, done.stdout
    where = "(n_layers)" if "n_layers" in case else "(num_hidden_layers) = "
    assert where in done.stdout, done.stdout


def test_a_config_transformers_refuses_gives_its_message(tmp_path):
    from transformers import CONFIG_MAPPING, Qwen3Config

    raw = dict(Qwen3Config(**dict(ARCHITECTURES["qwen3"][1])).to_dict(), num_attention_heads="four")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="transformers refuses this config") as err:
        load_model(tmp_path, weights=False)
    with pytest.raises(Exception) as theirs:  # noqa: B017, PT011 (whatever transformers raises)
        CONFIG_MAPPING["qwen3"].from_dict(raw)
    assert str(theirs.value) in str(err.value)


# the total parameters each model's authors state (billions, as they round them): a mistyped number in a shipped
# config would move its count off the published one
PUBLISHED_PARAMETERS = {"llama-3.1-8b": 8.0, "llama-3.1-70b": 70.6, "llama-3.1-405b": 405.9, "mixtral-8x22b": 140.6,
                        "qwen3-235b-a22b": 235.1, "gemma-3-27b": 27.0, "gpt2": 0.124, "gpt2-xl": 1.56,
                        "deepseek-v3": 671.0}


def test_every_shipped_shape_config_builds_with_its_published_size():
    from gpt_shape_tracer.model.sources import parameters_by_dtype, shapes_available

    assert set(shapes_available()) == set(PUBLISHED_PARAMETERS)
    for name, billions in PUBLISHED_PARAMETERS.items():
        model, tok = load_model(f"shapes:{name}", weights=False)
        assert tok is None and on_meta(model)
        total = sum(parameters_by_dtype(model).values())
        assert total / 1e9 == pytest.approx(billions, rel=0.02), name


def test_a_405b_dry_run_prefill_and_decode():
    """Correctness at scale (no timing): Llama 3.1 405B, an 8,192-token prefill and 4 decode steps."""
    model, _ = load_model("shapes:llama-3.1-405b", weights=False)
    gen = dry_run(model, n=8192, steps=4)
    trace = gen.trace
    assert trace.n_steps == 5
    assert trace.record("blocks.125.attn.hook_pattern", step=0).shape == (1, 128, 8192, 8192)
    assert trace.record("blocks.125.attn.hook_k_all", step=4).shape == (1, 8, 8196, 128)
    assert trace.record("hook_logits", step=4).shape == (1, 1, 128256)
    assert trace.record("blocks.0.mlp.hook_post", step=0).dtype == "bfloat16"


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-235b-a22b", "llama-3.1-8b"])
def test_the_meta_op_cache_gives_every_op_the_output_its_kernel_gives(name):
    """``meta_op_cache`` (a dry run's ops answered once per distinct input): every op of a forward — prefill and
    a cached decode step — returns what it returns without the cache: shape, strides, dtype, storage offset and
    storage size, in the same order; and most ops were answered from the cache."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from gpt_shape_tracer.model.sources import MetaOpCache

    class Outputs(TorchDispatchMode):  # pushed after the cache: sees every op first, as the costs' counter does
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((str(func), [(tuple(t.shape), t.stride(), t.dtype, t.device.type, t.storage_offset(),
                                           t.untyped_storage().nbytes(), t.requires_grad)
                                          for t in tree_leaves(out) if isinstance(t, torch.Tensor)]))
            return out

    model, _ = load_model(f"shapes:{name}", weights=False)

    def run(cache):
        kv = model.new_cache(1)
        seen = []
        with torch.no_grad(), cache if cache is not None else contextlib.nullcontext():
            for n in (5, 1):
                with Outputs() as outputs:
                    model(torch.zeros(1, n, dtype=torch.long, device="meta"), kv)
                seen.append(outputs.seen)
        return seen

    cache = MetaOpCache()
    plain, cached = run(None), run(cache)
    assert cached == plain
    assert cache.hits > 5 * cache.misses, (cache.hits, cache.misses)


def test_latent_attention_dry_run_holds_the_latent_in_its_cache():
    """DeepSeek-V3 with its cache: the cache holds c_KV [B,1,t,512] and k_R [B,1,t,64] per layer (what
    transformers' own cache holds), K and V are expanded from them to [B,H,t,192] and [B,H,t,128]."""
    model, _ = load_model("shapes:deepseek-v3", weights=False)
    gen = dry_run(model, n=4, steps=1)
    trace = gen.trace
    assert [s.forward.cache_after for s in gen.facts.steps] == [4, 5]
    assert trace.record("blocks.60.attn.hook_q", step=1).shape == (1, 128, 1, 192)
    assert trace.record("blocks.60.attn.hook_v", step=1).shape == (1, 128, 1, 128)
    assert trace.record("blocks.60.attn.hook_kv_latent_all", step=1).shape == (1, 1, 5, 512)
    assert trace.record("blocks.60.attn.hook_k_rope_all", step=1).shape == (1, 1, 5, 64)
    assert trace.record("blocks.60.attn.hook_v_all", step=1).axes == ("B", "H", "t", "d_v")
    assert trace.record("blocks.60.attn.hook_kv_latent_all", step=1).axes == ("B", "1", "t", "d_c")
    recomputed = dry_run(model, n=4, steps=1, use_cache=False)  # the same shapes without the cache
    assert recomputed.trace.record("blocks.60.attn.hook_v", step=1).shape == (1, 128, 5, 128)


def test_a_dry_run_trace_saved_and_loaded_says_it_is_one(tmp_path):
    from gpt_shape_tracer.tracer import load_trace, save_trace

    model, _ = load_model("shapes:gpt2", weights=False)
    gen = dry_run(model, n=5, steps=1)
    save_trace(gen.trace, tmp_path / "t")
    back = load_trace(tmp_path / "t")
    assert back.dry_run and back.model.weights_digest == NO_WEIGHTS
    rec = back.record("blocks.11.attn.hook_pattern", step=1)
    assert rec.shape == (1, 12, 1, 6) and back.summary(rec).endswith("no values (dry run)")
    assert "placeholder" in back.generation.steps[0].sampling.labels[0]


def test_cli_dry_run(tmp_path, capsys):
    from gpt_shape_tracer.cli import main

    code = main(["trace", "--dry-run", "--model-dir", "shapes:llama-3.1-8b", "--prompt", "x", "--steps", "3",
                 "--dry-run-tokens", "20", "--out", str(tmp_path / "t"), "--json", "--quiet"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 3 and out["shown_step"]["t"] == 22
    k_all = next(r for r in out["shown_step"]["records"] if r["name"] == "blocks.31.attn.hook_k_all")
    assert k_all["shape"] == [1, 8, 22, 128] and k_all["dtype"] == "bfloat16"


def test_a_repo_id_from_the_local_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_bytes((ASSETS / "story-llama" / "config.json").read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model, tok = load_model("org/tiny", weights=False)
    assert on_meta(model) and tok is None and model.identity.name == "org/tiny"


def test_the_flow_says_which_blocks_record_the_drawn_blocks_shapes():
    """DeepSeek-V3's first ``first_k_dense_replace`` blocks have a dense MLP, the rest mixture-of-experts: the note
    under the shape flow says which blocks repeat the drawn one and which differ, from the recorded shapes."""
    from gpt_shape_tracer.figures.flow import measured_repeat_note

    model, _ = load_model("shapes:deepseek-v3", weights=False)
    dense, n_layer = model.hf.config.first_k_dense_replace, model.config.n_layer
    gen = dry_run(model, n=4, steps=0, use_cache=False)
    assert measured_repeat_note(gen.trace, 0, 0) == (
        f"block 0 shown; blocks 1 … {dense - 1} record the same shapes; blocks {dense} … {n_layer - 1} differ "
        "(choose one to see it)")
    assert measured_repeat_note(gen.trace, 0, n_layer - 1) == (
        f"block {n_layer - 1} shown; blocks {dense} … {n_layer - 2} record the same shapes; blocks 0 … {dense - 1} "
        "differ (choose one to see it)")
    gpt2, _ = load_model("shapes:gpt2", weights=False)
    same = dry_run(gpt2, n=4, steps=0)
    last = gpt2.config.n_layer - 1
    assert measured_repeat_note(same.trace, 0, 3) == f"block 3 shown; blocks 0 … 2, 4 … {last} record the same shapes"


def test_the_meta_op_cache_keys_on_the_argument_types_and_the_default_dtype():
    """Issue 52: on int64, ``x + 1``, ``x + 1.0`` and ``x + True`` give int64, float32 and int64 — 1, 1.0 and True
    are equal and hash alike, so a key of values alone answers the second with the first's dtype; ``ones()``
    gives the default dtype, which no argument holds. Each compared with what torch gives on real tensors, the
    same calls in the same order inside one cache."""
    from gpt_shape_tracer.model.sources import meta_op_cache

    def dtypes(device: str) -> list[torch.dtype]:
        x = torch.zeros(3, dtype=torch.long, device=device)
        got = [(x + 1).dtype, (x + 1.0).dtype, (x + True).dtype, torch.ones(2, device=device).dtype]
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got += [torch.ones(2, device=device).dtype, (x + 1.0).dtype]
        finally:
            torch.set_default_dtype(default)
        return got

    real = dtypes("cpu")
    assert real == [torch.int64, torch.float32, torch.int64, torch.float32, torch.float64, torch.float64]
    with meta_op_cache() as cache:
        assert cache is not None
        assert dtypes("meta") == real


# issue 53 item 5: identical blocks costed once. Tiny configs of each kind of model whose blocks differ: a dense
# Llama (our GPT), DeepSeek-V3's dense first layers then mixture-of-experts, Gemma 2's sliding / full alternation,
# and two hybrids (Qwen3-Next: linear attention with a full-attention layer every fourth; Jamba: Mamba mixers with
# attention every fourth layer, experts every second)
_TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)
REPLICATION_CONFIGS = {
    "llama": ("LlamaConfig", dict(_TINY, num_hidden_layers=6)),
    "deepseek_v3": ("DeepseekV3Config", dict(ARCHITECTURES["deepseek_v3"][1], num_hidden_layers=7,
                                             first_k_dense_replace=3)),
    "gemma2": ("Gemma2Config", dict(ARCHITECTURES["gemma2"][1], num_hidden_layers=8)),
    "qwen3_next": ("Qwen3NextConfig", dict(_TINY, num_hidden_layers=8, head_dim=16, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32, linear_num_value_heads=4,
                                           linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)),
    "jamba": ("JambaConfig", dict(_TINY, num_hidden_layers=8, num_experts=4, num_experts_per_tok=2,
                                  attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                                  expert_layer_offset=1, mamba_d_state=8, mamba_expand=2)),
}


def _tiny_dry(tmp_path, model_type):
    import transformers

    config_class, kwargs = REPLICATION_CONFIGS[model_type]
    (tmp_path / "config.json").write_text(json.dumps(getattr(transformers, config_class)(**kwargs).to_dict()))
    model, _ = load_model(tmp_path, weights=False)
    return model


def _layer_kinds(model) -> list[str]:
    """Each block's kind as the model's own config says it (not as tracer/costs/_blocks.py reads it)."""
    hf = getattr(model, "hf", None)
    config = hf.config if hf is not None else None
    n = model.config.n_layer
    if config is None:
        return ["dense"] * n
    if getattr(config, "first_k_dense_replace", None) is not None:
        return ["dense" if i < config.first_k_dense_replace else "moe" for i in range(n)]
    if getattr(config, "layers_block_type", None) is not None:  # Jamba: mixer and experts per layer
        return [f"{config.layers_block_type[i]}/{i % config.expert_layer_period == config.expert_layer_offset}"
                for i in range(n)]
    return list(config.layer_types)


def _replicable(kinds: list[str]) -> int:
    """Blocks a kind's template covers at most: all but the first two of each kind."""
    return sum(max(0, kinds.count(k) - 2) for k in set(kinds))


@pytest.mark.parametrize("model_type", sorted(REPLICATION_CONFIGS))
def test_replicated_blocks_give_the_costs_and_records_of_counting_every_block(model_type, tmp_path):
    """``costed_dry_run`` (replicate on, the default) against ``replicate=False`` (every block counted op by op):
    every op's cost (module, op, output shape, multiply-adds, bytes), each step's peak activation memory and every
    record equal, prefill and two cached decode steps; and blocks were replicated — at most all but the first two
    of each kind the config declares, at least one where a kind has three or more."""
    from gpt_shape_tracer.tracer import costed_dry_run

    model = _tiny_dry(tmp_path, model_type)
    every, every_costs = costed_dry_run(model, n=6, steps=2, replicate=False)
    once, once_costs = costed_dry_run(model, n=6, steps=2)
    assert [c.ops for c in once_costs] == [c.ops for c in every_costs]
    assert [c.peak_activation_bytes for c in once_costs] == [c.peak_activation_bytes for c in every_costs]
    assert _rows(once.trace) == _rows(every.trace)
    assert all(c.replicated_blocks == () for c in every_costs)
    kinds = _layer_kinds(model)
    for costs in once_costs:
        assert 0 < len(costs.replicated_blocks) <= _replicable(kinds), (costs.replicated_blocks, kinds)
        # a replicated block's costs sit at its own path, never its template's
        for path in costs.replicated_blocks:
            assert any(op.module.startswith(f"{path}.") for op in costs.ops), path


def test_a_block_whose_shapes_differ_is_counted_not_replicated(tmp_path):
    """Our GPT with block 4's MLP widened (its parameters' shapes differ from every other block's): block 4 is
    counted op by op — its MLP's ops have the new width — and the costs equal counting every block; the blocks
    like block 0 are still replicated, after it too."""
    import dataclasses

    from gpt_shape_tracer.tracer import costed_dry_run

    model = _tiny_dry(tmp_path, "llama")
    wide = dataclasses.replace(model.config, d_mlp=model.config.d_ff * 2)
    with torch.device("meta"):
        model.blocks[4].mlp = type(model.blocks[4].mlp)(wide).to(next(model.parameters()).dtype)
    _, every = costed_dry_run(model, n=6, steps=1, replicate=False)
    _, once = costed_dry_run(model, n=6, steps=1)
    assert [c.ops for c in once] == [c.ops for c in every]
    assert [c.peak_activation_bytes for c in once] == [c.peak_activation_bytes for c in every]
    for costs in once:
        assert "blocks.4" not in costs.replicated_blocks
        # blocks 0 … 3 and 5 are one kind: those after two consecutive agreeing blocks are replicated, block 5
        # among them though block 4 came between
        assert {"blocks.3", "blocks.5"} <= set(costs.replicated_blocks) <= {f"blocks.{i}" for i in (2, 3, 5)}
        widths = {op.output_shape[-1] for op in costs.ops if op.module.startswith("blocks.4.mlp.")}
        assert wide.d_ff in widths and model.config.d_ff not in widths


def test_replication_is_refused_for_a_model_with_weights():
    from gpt_shape_tracer.tracer.costs import Blocks, count_forward

    model, _ = load_model(ASSETS / "story-llama")
    with pytest.raises(ValueError, match="only in a dry run"):
        count_forward(model, lambda: model(torch.zeros(1, 3, dtype=torch.long)), blocks=Blocks(model))
