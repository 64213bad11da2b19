"""Every causal-LM model_type of the installed transformers (tests/hf_every_architecture.py builds each from its
own config class): traced types equal transformers at the prefill and 3 cached decode steps (≤ 1e-4, float32);
refused types are refused with a reason category whose truth the test checks on its own; nothing crashes.

The full sweep is marked ``every_architecture`` (minutes; run it with ``pytest -m every_architecture``); a
representative subset — one type per outcome and mechanism — runs unmarked."""

from __future__ import annotations

import inspect
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model.sources._hf_refusals import ENCODERS, REFUSAL_REASONS
from tests.hf_every_architecture import (
    PROMPT,
    TOLERANCE,
    Result,
    build,
    causal_lm_types,
    check,
    machine,
    markdown,
    tiny_config,
    unbuilt,
)

# representative types transformers 5.23 itself cannot build (its Gemma 4 text layers, all reading shared K/V, find
# none of theirs computing them): load_hf refuses their config alone
UNBUILDABLE = {"gemma4_assistant"}
# one type per mechanism and outcome (the outcome itself is not written here: each is checked for what it is)
REPRESENTATIVE = [
    "llama",  # our own GPT runs it
    "qwen3", "gemma2",  # the attention interface
    "gptj", "gpt_neo", "falcon", "git",  # their own tables of attention classes
    "gemma3", "got_ocr2",  # a vision tower as deep as the text stack, not run for text
    "bert", "roberta",  # BERT family configured as a causal decoder (is_decoder = true)
    "moshi",  # transformers' own cached path differs from its uncached forward
    "deepseek_v3", "minicpm3",  # latent attention (value heads narrower than query/key heads)
    "deepseek_v32",  # an indexer's key cache beside K and V
    "deepseek_v4",  # the family's own cache layers (compressed keys and values), kept in CompressedCache
    "gemma4_text",  # per-layer overrides (per_layer_config) of its global layers' head size
    "doge",  # a learned per-head mask added to the scores (kept: it runs eager with transformers' own mask)
    "gemma3n_text",  # one feed-forward width per layer
    "inkling2_text",  # a position bias and sinks handed to the attention function by names of its own
    "recurrent_gemma",  # its recurrent state kept inside its modules, no cache object
    "minimax",  # lightning (linear) attention layers whose state its own cache class (MiniMaxCache) keeps
    "blt",  # byte-level stacks around a global transformer over patches, cross-attending: one block per call,
    # traced without a cache (transformers' own cached forward fails on its config)
    "xlstm",  # mLSTM blocks only, their state in a cache object of its own (built at a width its config and its
    # layers agree on)
    "openai-gpt",  # its forward takes no cache: every step a full forward, compared with transformers' full forward
    "xlm",  # its own cache= handed the whole text (built as its causal LM)
    "cpmant",  # learned prompt positions before the text, a mask that is not causal: traced without a cache, its own
    # cached path (a prefix LM) differing
    "gemma4_assistant",  # a drafter: every layer reads the main model's K and V (refused by its config; transformers
    # 5.23 cannot build it either)
    "bloom", "mamba", "rwkv", "falcon_h1", "hrm_text", "prophetnet", "bart", "xlnet",
]


def _source_calls_the_interface(model_type: str) -> bool:
    """Whether the family's modeling file looks its attention up in transformers' attention interface."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    import transformers

    module = importlib.import_module(getattr(transformers, cls_name).__module__)
    source = inspect.getsource(module)
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _first_sees_second(directory: Path) -> bool:
    """Whether transformers' own eager forward of two tokens gives position 0 a weight on position 1 (its
    ``output_attentions``): attention that is not causal."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([[5, 6]]), output_attentions=True)
    attentions = getattr(out, "attentions", None) or ()
    return any(isinstance(a, torch.Tensor) and a.shape[-1] >= 2 and bool((a[..., 0, 1] > 0).any()) for a in attentions)


def _takes_no_cache(directory: Path) -> bool:
    """Whether the causal LM's forward has no parameter for a cache of any name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory, local_files_only=True))
    return not any("cache" in name or "past" in name or name in ("mems", "state")
                   for name in inspect.signature(model.forward).parameters if name != "use_cache")


def _reason_is_true(result: Result, directory: Path) -> bool:
    """The refusal's category checked independently of the code that refused (from the config, transformers'
    own cache, the family's source, or transformers failing on its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    reason = result.reason
    if reason == "encoder-decoder":
        return bool(getattr(config, "is_encoder_decoder", False))  # add_cross_attention alone is no encoder
    if reason == "encoder":  # a BERT-style type configured so, or transformers' own weights show it: position 0
        # attends to position 1 (XLM with causal = false)
        return (result.model_type in ENCODERS and not getattr(config, "is_decoder", False)) or \
            _first_sees_second(directory)
    if reason == "attention outside the interface":
        return not _source_calls_the_interface(result.model_type) or "layer(s)" in result.message
    if reason == "no softmax attention":
        return not any("attention" in type(m).__name__.lower() and "norm" not in type(m).__name__.lower()
                       for m in AutoModelForCausalLM.from_config(config).modules()) or \
            not _source_calls_the_interface(result.model_type)
    if reason == "state layers":
        layers = DynamicCache(config=config).layers
        model = AutoModelForCausalLM.from_config(config)
        return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers) or any(
            k in type(m).__name__.lower() for m in model.modules() for k in ("mamba", "conv", "lightning", "delta"))
    if reason == "attention sinks":
        model = AutoModelForCausalLM.from_config(config)
        return any("sink" in name for name, _ in model.named_parameters())
    if reason == "latent attention":
        return any(isinstance(getattr(config, k, None), int) for k in ("kv_lora_rank", "v_head_dim"))
    if reason == "several attentions per layer":
        return True  # the message names the layers; the probe counted the calls (test_probe_counts_calls below)
    if reason == "several stacks":  # more than one list of layers holds attention modules (read from the modules)
        model = AutoModelForCausalLM.from_config(config)
        return sum(1 for m in model.modules() if isinstance(m, torch.nn.ModuleList) and any(
            "attention" in type(x).__name__.lower() and "norm" not in type(x).__name__.lower()
            for x in m.modules())) > 1
    if reason == "indexed attention":  # the config names indexed layers, or an indexer's sizes
        text = getattr(config, "text_config", None) or config
        return "indexed_attention" in (getattr(text, "layer_types", None) or []) or any(
            key.startswith(("index_", "indexer_")) for key in text.to_dict())
    if reason == "compressed attention":  # the config names compressed layers or a compressor
        text = getattr(config, "text_config", None) or config
        return any("compress" in kind for kind in getattr(text, "layer_types", None) or []) or any(
            "compress" in key for key in text.to_dict())
    if reason == "score bias":  # the family's own code hands a bias to the attention function
        import importlib

        source = inspect.getsource(importlib.import_module(type(AutoModelForCausalLM.from_config(config)).__module__))
        return any(f"{k}=" in source for k in ("position_bias", "attention_bias"))
    if reason == "alibi":
        return bool(getattr(config, "alibi", False))
    if reason == "drafter":  # every layer reads shared keys and values, its causal LM's forward takes them
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        text = config.get_text_config()
        forward = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[result.model_type]).forward
        return text.num_kv_shared_layers >= text.num_hidden_layers and \
            "shared_kv_states" in inspect.signature(forward).parameters
    if reason == "cannot load":
        try:  # transformers itself fails on the directory
            hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
            hf(input_ids=torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2, dtype=torch.long))
        except Exception:  # noqa: BLE001
            return True
        return False
    return False


def _assert_outcome(result: Result, directory: Path | None) -> None:
    if result.outcome == "traced":
        assert len(result.deltas) == 4 and max(result.deltas) <= TOLERANCE, result
    elif result.outcome == "follows uncached":
        assert max(result.uncached) <= TOLERANCE and result.note and "uncached" in result.note, result
    elif result.outcome == "no cache":  # every step a full forward: true only of a forward with no cache parameter
        assert len(result.uncached) == 4 and max(result.uncached) <= TOLERANCE, result
        assert directory is not None and _takes_no_cache(directory), result
    elif result.outcome == "refused":
        assert result.reason in REFUSAL_REASONS, result
        assert result.reason != "differs from transformers", result
        assert directory is not None and _reason_is_true(result, directory), result
    else:
        assert result.outcome == "not built", result  # crash and differs fail here


def _check_in(model_type: str, root: Path) -> tuple[Result, Path | None]:
    directory = root / model_type
    try:
        build(model_type, directory)
    except Exception as e:  # noqa: BLE001 (refused by its config alone, or reported as not built)
        result = unbuilt(model_type, directory, e)
        return result, directory if result.outcome == "refused" else None
    try:
        return check(model_type, directory), directory
    except Exception as e:  # noqa: BLE001 (a crash is reported with the others, and fails the test at the end)
        return Result(model_type, "crash", type(e).__name__, str(e)[:300]), directory


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_representative_type_traced_exactly_or_refused_for_a_true_reason(model_type, tmp_path):
    result, directory = _check_in(model_type, tmp_path)
    print(f"{model_type}: {result.outcome} {result.reason} {result.deltas or result.message[:200]}")
    _assert_outcome(result, directory)
    assert result.outcome != "not built", result
    # every representative type builds offline but the drafter, which transformers itself builds from no config of
    # its own (and which load_hf refuses from the config alone): a type that stopped building is not let through
    # as refused by its config
    unbuildable = "transformers itself builds no model" in result.message
    assert unbuildable == (model_type in UNBUILDABLE), result


def test_dbrx_its_attention_found_in_a_class_named_for_norms(tmp_path):
    """DBRX (its default config cannot build: transformers reads attn_config.rope_theta, which it does not set;
    and clip_qkv None fails its forward), with both given: its attention sits in DbrxNormAttentionNorm."""
    from transformers import AutoModelForCausalLM, DbrxConfig

    config = DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=256,
                        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2, "hidden_size": 64})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    result = check("dbrx", tmp_path)
    assert result.outcome == "traced" and max(result.deltas) <= TOLERANCE, result


def test_prophetnet_is_refused_for_its_two_attention_streams_not_as_an_encoder_decoder(tmp_path):
    """ProphetNetForCausalLM builds itself with is_encoder_decoder = False; its config's add_cross_attention only
    lets its layers cross-attend when handed an encoder's output, which a causal LM's forward never is. What keeps
    it out is its n-gram self-attention, computed in its own code: read from its ops
    (model/sources/_hf_own_attention.py), each layer computes two softmax attentions, the main stream's and the
    predicting stream's."""
    from transformers import AutoModelForCausalLM

    result, directory = _check_in("prophetnet", tmp_path)
    assert result.outcome == "refused" and result.reason == "several attentions per layer", result
    assert "ProphetNetNgramSelfAttention" in result.message and "2 softmax attentions" in result.message, result
    assert "encoder" not in result.message, result.message
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    assert hf.config.is_encoder_decoder is False and hf.config.add_cross_attention is True
    assert not _source_calls_the_interface("prophetnet")
    assert directory is not None and _reason_is_true(result, directory)


def test_the_page_can_say_what_every_refusal_reason_means():
    from tests.hf_every_architecture import REASON_WORDS

    assert set(REASON_WORDS) == set(REFUSAL_REASONS)


def test_the_blt_and_xlstm_overrides_are_needed():
    """The two values the sweep gives BLT and xLSTM fix a failure of transformers' own forward on its own config,
    not a choice of ours: without them, BLT's cached forward asks its top-level config for num_hidden_layers, and
    xLSTM at width 64 builds its state 16 wide per head for queries 8 wide (if transformers fixes either, this fails
    and the override can go)."""
    import transformers

    from tests.hf_every_architecture import _OVERRIDES

    config = tiny_config("blt")
    model = transformers.BltForCausalLM._from_config(config).eval()
    with torch.no_grad():
        assert model(input_ids=torch.arange(PROMPT)[None], use_cache=False).logits.shape[:2] == (1, PROMPT)
        with pytest.raises(AttributeError, match="num_hidden_layers"):
            model(input_ids=torch.arange(PROMPT)[None], use_cache=True)
    assert _OVERRIDES["blt"] == {"use_cache": False}
    values = tiny_config("xlstm").to_dict()
    values.update(hidden_size=64, embedding_dim=64)
    with torch.no_grad(), pytest.raises(ValueError, match="wrong shape"):
        transformers.xLSTMForCausalLM._from_config(transformers.xLSTMConfig(**values))(input_ids=torch.arange(4)[None])


def test_the_family_tables_record_every_layer(tmp_path):
    """GPT-J, GPT-Neo, Falcon, GIT: every layer's pattern goes through its hook point (a distribution over the
    keys the causal mask allows), at the prefill and at a cached step — not only the logits right."""
    from gpt_shape_tracer.model import load_hf

    for model_type in ("gptj", "gpt_neo", "falcon", "git"):
        model, _ = load_hf(build(model_type, tmp_path / model_type))
        patterns: dict[int, list[torch.Tensor]] = {L: [] for L in range(model.config.n_layer)}
        for L, block in enumerate(model.blocks):
            block.attn.hook_pattern.register_forward_hook(lambda m, a, out, seen=patterns[L]: seen.append(out))
        cache = model.new_cache()
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4, 5]]), cache)
            model(torch.tensor([[6]]), cache)
        for L, (prefill, step) in patterns.items():
            assert prefill.shape[-2:] == (5, 5) and step.shape[-2:] == (1, 6), (model_type, L)
            assert torch.allclose(prefill.sum(-1), torch.ones(())) and torch.allclose(step.sum(-1), torch.ones(()))
            assert (prefill.triu(1) == 0).all(), (model_type, L)  # position i sees positions ≤ i


@pytest.mark.parametrize("model_type", ["jamba", "bamba", "recurrent_gemma", "granitemoehybrid", "gemma4_text",
                                        "dots3_note_text", "gpt_neo"])
def test_the_tiny_config_keeps_one_layer_of_each_kind(model_type):
    """Shrunk to two layers, a model whose layers differ keeps two different ones — a hybrid an attention layer
    and a state layer (transformers' own cache for the config says which is which), a model of local and global
    attention one of each — and its per-layer overrides point at layers it has."""
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    config = tiny_config(model_type)
    text = getattr(config, "text_config", None) or config
    kinds = getattr(text, "layer_types", None) or getattr(text, "attention_layers", None)
    cache_kinds = {isinstance(layer, LinearAttentionCacheLayerMixin) for layer in DynamicCache(config=config).layers}
    assert len(set(kinds or [])) == 2 or cache_kinds == {True, False}, (kinds, cache_kinds)
    overrides = text.to_dict().get("per_layer_config") or {}
    assert all(0 <= int(k) < text.num_hidden_layers for k in overrides), overrides


@pytest.mark.every_architecture
@pytest.mark.timeout(3600)  # one test for 189 types: ~6 min on a quiet 2-core machine, past the 900 s default when busy
def test_every_causal_lm_type_traced_exactly_or_refused_for_a_true_reason():
    """With WRITE_ARCHITECTURES_MD=docs/architectures.md, this run also writes the page from its results."""
    types = causal_lm_types()
    assert len(types) > 100  # transformers' own list, not a hand-picked one
    counts: dict[str, int] = {}
    failures = []
    results = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in types:
            result, directory = _check_in(model_type, Path(tmp))
            results.append(result)
            counts[result.outcome] = counts.get(result.outcome, 0) + 1
            print(f"{model_type:28s} {result.outcome:16s} {result.reason:30s} "
                  f"{result.deltas or result.message[:160]}")
            try:
                _assert_outcome(result, directory)
            except AssertionError as e:
                failures.append(f"{model_type}: {e}")
    print(f"{len(types)} causal-LM types:", counts)
    page = os.environ.get("WRITE_ARCHITECTURES_MD")
    if page:
        Path(page).write_text(markdown(results, machine(), time.perf_counter() - start))
    assert not failures, "\n".join(failures)
