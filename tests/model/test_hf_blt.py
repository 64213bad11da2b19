"""BLT (the Byte Latent Transformer, issue 51): attention in six lists of layers — the entropy patcher's, the local
encoder's over bytes, its cross-attention pooling bytes into patch slots, the global transformer's over patches, the
local decoder's cross-attention (bytes reading patches) and its layers over bytes — traced as one block per call,
each named by its path (model/sources/_hf_stacks.py), without a cache (transformers' own cached forward of BLT fails
on its config, and handed a cache it is not the model's forward of the whole text).

References we did not write: transformers' eager forward (its logits, and the weights its attention modules return),
its module tree (the paths), its configs (the patcher's window)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model.gpt import act_name
from tests.hf_every_architecture import DECODE_STEPS, PROMPT, TOLERANCE, build, check

PROMPT_TEXT = "once upon a"


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    """The sweep's tiny BLT, with a byte-level tokenizer of its 256 ids (one id per byte, as BLT reads text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = build("blt", tmp_path_factory.mktemp("blt") / "blt")
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def loaded(directory):
    from gpt_shape_tracer.model import load_hf

    return load_hf(directory)


@pytest.fixture(scope="module")
def generation(loaded):
    from gpt_shape_tracer.tracer import TracedGeneration

    model, tok = loaded
    gen = TracedGeneration(model, tok, PROMPT_TEXT, temperature=0, use_cache=False)
    gen.run(3)
    return gen


def _eager(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _attention_modules(hf) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in hf.named_modules() if type(m).__name__ in ("BltSelfAttention",
                                                                               "BltCrossAttention")]


def _transformers_weights(directory: Path, tokens: torch.Tensor) -> tuple[list[str], list[torch.Tensor], torch.Tensor]:
    """transformers' eager forward of ``tokens`` without a cache: the path of each attention module in the order
    of its calls, the weights each returned, and the logits."""
    hf = _eager(directory)
    order: list[str] = []
    weights: list[torch.Tensor] = []
    def seen(name: str):
        def hook(module, args, out) -> None:
            order.append(name)
            weights.append(out[1])
        return hook

    handles = [m.register_forward_hook(seen(name)) for name, m in _attention_modules(hf)]
    try:
        with torch.no_grad():
            logits = hf(input_ids=tokens, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return [name.removeprefix("model.") for name in order], weights, logits


def test_the_sweep_traces_blt_equal_to_transformers_uncached_forward_at_the_prefill_and_every_step(directory):
    result = check("blt", directory)
    assert result.outcome == "follows uncached", result
    assert len(result.uncached) == 1 + DECODE_STEPS and max(result.uncached) <= TOLERANCE, result
    assert result.note is not None and "fails" in result.note and "without a cache" in result.note


def test_transformers_own_cached_forward_of_blt_is_not_the_model_so_it_runs_without_one(directory, loaded):
    """Why no cache: transformers' cached forward fails on BLT's own config, and handed a cache it skips the
    global transformer's (its decode step differs from the forward of the whole text); our cache is refused with a
    clear message, and the cache-off generation runs."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    from gpt_shape_tracer.model.sources import HFDecoderError
    from gpt_shape_tracer.tracer import TracedGeneration

    hf = _eager(directory)
    tokens = torch.randint(0, 200, (1, PROMPT + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with pytest.raises(AttributeError, match="num_hidden_layers"):
            hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        past = EncoderDecoderCache(DynamicCache(), DynamicCache())
        hf(input_ids=tokens[:, :PROMPT], past_key_values=past, use_cache=True)
        # what that cache holds: K and V over the prompt's bytes for the local encoder's layers (its first cache)
        # and the local decoder's (its second), slots numbered from 0 in each; nothing of the patcher's or the
        # global transformer's (over patches)
        for held, stack in ((past.self_attention_cache, hf.model.local_encoder.layers),
                            (past.cross_attention_cache, hf.model.local_decoder.layers)):
            assert [layer.keys.shape[-2] for layer in held.layers] == [PROMPT] * len(stack)
        step = hf(input_ids=tokens[:, PROMPT:], past_key_values=past, use_cache=True).logits[0, -1]
        whole = hf(input_ids=tokens, use_cache=False).logits[0, -1]
    assert float((step - whole).abs().max()) > 100 * TOLERANCE
    model, tok = loaded
    with pytest.raises(HFDecoderError, match="traced without a cache"):
        model.new_cache()
    with pytest.raises(HFDecoderError, match="traced without a cache"):
        TracedGeneration(model, tok, PROMPT_TEXT, temperature=0)


def test_every_attention_is_a_block_named_by_its_path_in_the_order_transformers_calls_them(directory, loaded):
    model, _ = loaded
    tokens = torch.randint(0, 200, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    order, _, _ = _transformers_weights(directory, tokens)
    paths = [path.rpartition(".")[0] if path.endswith(".self_attn") else path for path in order]
    assert list(model.config.block_paths) == paths
    assert {p.rpartition(".")[0] for p in paths} == {"patcher.layers", "local_encoder.layers",
                                                     "local_encoder.cross_attn_layers", "global_transformer.layers",
                                                     "local_decoder.cross_attn_layers", "local_decoder.layers"}
    crosses = [L for L, name in enumerate(order) if "cross_attn_layers" in name]
    assert list(model.config.cross_blocks) == crosses and crosses
    for L in range(model.config.n_layer):
        stack = model.config.stack_of(L)
        assert stack == paths[L].rpartition(".")[0]
        sentence = model.config.stack_sentence(L)
        assert paths[L] in sentence and ("cross-attention" in sentence) == (L in crosses)


def test_every_recorded_pattern_is_transformers_own_at_every_step(directory, generation):
    """Self-attention and cross-attention alike: each block's recorded pattern equals the weights transformers'
    eager module at the same path returned, at the prefill and each step (the whole text again, no cache)."""
    trace, config = generation.trace, generation.model.config
    for step in range(generation.n_steps):
        tokens = torch.tensor([generation.trace.generation.columns(0, step)])
        order, weights, logits = _transformers_weights(directory, tokens)
        assert float((trace.get("hook_logits", step)[0, -1] - logits[0, -1]).abs().max()) <= TOLERANCE
        for L in range(config.n_layer):
            ours = trace.get(act_name("pattern", L), step)
            assert ours is not None and ours.shape == weights[L].shape, (step, L)
            assert torch.allclose(ours, weights[L], atol=1e-6), (step, L, order[L])


def test_each_self_attention_pattern_is_the_softmax_of_its_recorded_q_k_and_mask(generation):
    trace, config = generation.trace, generation.model.config
    scale = config.attn_scale if config.attn_scale is not None else config.d_head ** -0.5
    for step in range(generation.n_steps):
        for L in range(config.n_layer):
            q, k, mask = (trace.get(act_name(name, L), step) for name in ("q", "k_all", "mask"))
            keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            again = torch.softmax((q @ keys.transpose(-2, -1)) * scale + mask, dim=-1)
            assert torch.allclose(again, trace.get(act_name("pattern", L), step), atol=1e-6), (step, L)


def test_the_views_name_each_blocks_list_and_say_no_causality_of_a_cross_attention(directory, generation):
    """The layer pickers' labels name the list of layers; the mask view's sentence for a cross-attention and for the
    global transformer over patches counts what the recorded mask hides without claiming query i sees keys 0…i;
    the patcher's sliding window is read off its mask and is the one its config gives."""
    from transformers import AutoConfig

    from gpt_shape_tracer.figures.common import key_labels, layer_label, query_labels
    from gpt_shape_tracer.figures.mask import mask_facts

    trace, config = generation.trace, generation.model.config
    step = generation.n_steps - 1
    patcher_window = AutoConfig.from_pretrained(directory).patcher_config.sliding_window
    for L in range(config.n_layer):
        assert layer_label(trace, L) == f"{L} · {config.block_paths[L]}"
        facts = mask_facts(trace, step, L)
        said = facts.explanation()
        mask = trace.get(act_name("mask", L), step)[0, 0]
        hidden = int(torch.isinf(mask).sum())
        assert f"{hidden} of {mask.numel()} entries are −∞" in said, (L, said)
        n_tokens = len(generation.trace.generation.columns(0, step))
        own = L in config.cross_blocks or tuple(mask.shape) != (n_tokens, n_tokens)
        if own:
            assert config.block_paths[L] in said and "j ≤ i" not in said and "causality" not in said, (L, said)
            assert key_labels(trace, step, 0, L) == [f"k{j}" for j in range(mask.shape[1])]
            assert query_labels(trace, step, 0, L) == [f"q{i}" for i in range(mask.shape[0])]
            seen = torch.isfinite(mask).sum(-1)
            assert facts.keys_seen == (int(seen.min()), int(seen.max()))
        else:  # over the text's bytes: every hidden cell has its cause
            assert facts.unexplained == 0 and facts.future == n_tokens * (n_tokens - 1) // 2, (L, said)
            if config.block_paths[L].startswith("patcher."):
                assert facts.sliding_window == patcher_window and facts.window > 0, (L, said)
    assert any(L in config.cross_blocks for L in range(config.n_layer))


def test_the_app_traces_blt_with_the_cache_off_and_names_each_blocks_list(directory):
    """The real app (AppTest): loaded from its directory and stepped with the KV cache toggle left on, BLT runs
    without a cache and the sidebar says why; every tab renders without an error; the layer picker names each
    block's list of layers; the Causal mask tab's takeaway for a cross-attention is counted from its own mask."""
    from html import unescape

    from gpt_shape_tracer.model import load_hf
    from tests.app.test_app import run, show_tab
    from tests.app.test_app_architectures import every_tab_without_error, opened_and_stepped

    config = load_hf(directory)[0].config
    at = opened_and_stepped(directory)
    gen = at.session_state["app"].live.generation
    assert gen.n_steps == 2 and not gen.use_cache
    assert any("lists of layers" in c.value and "traced without a cache" in c.value
               and "every step recomputes all positions" in c.value for c in at.sidebar.caption)
    every_tab_without_error(at)
    lists = len({path.rpartition(".")[0] for path in config.block_paths})
    shown = [unescape(c.value) for c in [*at.caption, *at.sidebar.caption, *at.markdown, *at.sidebar.markdown]]
    assert any(f"{config.n_layer} attention blocks in {lists} lists of layers × {config.n_head} heads" in text
               for text in shown), shown
    show_tab(at, "Causal mask")
    picker = at.selectbox(key="mask_layer")
    assert list(picker.options) == [f"{L} · {path}" for L, path in enumerate(config.block_paths)]
    cross = config.cross_blocks[0]
    picker.set_value(cross)
    run(at)
    mask = gen.trace.get(f"blocks.{cross}.attn.hook_mask", 1)[0, 0]
    hidden = int(torch.isinf(mask).sum())
    said = " ".join(m.value for m in at.markdown)
    assert f"{hidden} of the {mask.numel()} scores are −∞ by this block&#39;s own mask" in said or \
        f"{hidden} of the {mask.numel()} scores are −∞ by this block's own mask" in said, said[:2000]
    assert "comes after the query" not in said


def test_a_blt_whose_lists_attend_with_different_heads_is_refused_naming_each_lists_heads(tmp_path):
    """Real BLT checkpoints give the global transformer more heads than the byte-level lists: the trace's config
    holds one head count, so such a model is refused ("several stacks"), each list's heads as transformers' own
    modules have them."""
    import transformers

    from gpt_shape_tracer.model import ModelLoadError, load_hf
    from tests.hf_every_architecture import tiny_config

    values = tiny_config("blt").to_dict()
    values["global_config"].update(num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    torch.manual_seed(0)
    hf = transformers.BltForCausalLM._from_config(transformers.BltConfig(**values)).eval()
    hf.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as refused:
        load_hf(tmp_path)
    assert refused.value.reason == "several stacks"
    for name, module in _attention_modules(hf):
        stack = name.removeprefix("model.").rsplit(".", 2 if name.endswith("self_attn") else 1)[0]
        heads = (module.num_heads, module.num_key_value_heads, module.head_dim)
        assert f"{stack}: H, G, d_head, d_v, d = ({heads[0]}, {heads[1]}, {heads[2]}, {heads[2]}, 64)" in \
            str(refused.value), (stack, str(refused.value))
