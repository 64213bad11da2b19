"""Attention variants and state models traced since they were refused (model/sources/_hf_variants.py):

* HRM runs its two stacks of layers several times per forward (each run with a cache slot of its own), LongCat-Flash
  runs two attention sublayers in each layer (each with its own slot): traced, every attention call is a block of
  its own, in the order the calls run, which is the order of the cache slots they write.
* RecurrentGemma keeps its recurrent blocks' state in attributes of its own modules and returns no cache object;
  xLSTM keeps its state in a cache object of its family's own (``xLSTMCache``): traced as state models, their state
  held in our ``StateCache`` (copied after every committed step, rolled back, copied at a length), set where the
  model reads it before each forward and read back after it, recorded per step as ``hook_conv_state`` /
  ``hook_ssm_state``.
* Inkling and Inkling 2 hand transformers' attention function a learned relative position bias beside the mask
  (``position_bias``); Inkling 2 also a sink logit per head and query (``sinks``). Traced, the bias is a stage of
  its own (``hook_score_bias``: masked scores = scores + bias + M) and Inkling 2's sink the extra column of each
  softmax row (``hook_sink_logits`` / ``hook_sink_weight``, as gpt-oss's). Both keep a short convolution's state
  beside K and V (transformers' hybrid cache layers), held in our ``StateCache``.

Tiny random-weight models built by tests/hf_every_architecture.py from transformers' own config classes. Logits
equal transformers' eager forward at the prefill and 3 cached steps; every recorded pattern equals one recomputed
here from the recorded stages, and equals the attention weights transformers' own eager forward returns
(``output_attentions=True``: one entry per attention call, in order) for the same columns."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_every_architecture import DECODE_STEPS, TOLERANCE, build, check, tiny_config
from tests.tolerance import assert_close_across_cpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BIASED = ("inkling_text", "inkling2_text")  # a score bias beside the mask; Inkling 2 with a sink per query
SEVERAL = ("hrm_text", "longcat_flash")  # several attention calls per layer: layers re-entered; two per layer
STATE = ("recurrent_gemma", "xlstm")  # state kept in the model's own modules; in the family's own cache object
TYPES = BIASED + SEVERAL + STATE
PROMPTS = ["Lily had a red kite.", "Tom said"]


def _build(model_type: str, root: Path) -> Path:
    """tests/hf_every_architecture.py's tiny model of ``model_type``, its vocabulary the bundled tokenizer's."""
    import transformers  # noqa: F401 (the config classes below come from it)

    import tests.hf_every_architecture as every

    config = tiny_config(model_type)
    values = {**config.to_dict(), "vocab_size": 1024}
    out = root / model_type
    original = every.tiny_config
    every.tiny_config = lambda _: type(config)(**values)  # type: ignore[assignment]
    try:
        build(model_type, out)
    finally:
        every.tiny_config = original
    (out / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return out


@pytest.fixture(scope="module")
def directories() -> dict[str, Path]:
    root = Path(tempfile.mkdtemp(prefix="hf-variants-"))
    return {t: _build(t, root) for t in TYPES}


def traced(directory: Path, prompts: list[str] = PROMPTS, steps: int = 1 + DECODE_STEPS) -> TracedGeneration:
    model, tok = load_hf(directory, implementation="transformers")
    assert isinstance(model, HFDecoder)
    gen = TracedGeneration(model, tok, prompts, temperature=0, padding_side="left")
    gen.run(steps)
    return gen


@pytest.mark.parametrize("model_type", TYPES)
def test_logits_equal_transformers_at_the_prefill_and_three_cached_steps(directories, model_type):
    result = check(model_type, directories[model_type])
    print(model_type, "max |Δ logits| per step:", [f"{d:.1e}" for d in result.deltas])
    assert result.outcome == "traced" and len(result.deltas) == 1 + DECODE_STEPS, result
    assert max(result.deltas) <= TOLERANCE, result


@pytest.mark.parametrize("model_type", BIASED)
def test_the_score_bias_is_a_stage_and_the_pattern_is_recomputed_from_the_stages(directories, model_type):
    """Left-padded batch of two, prefill and 3 cached steps. At every step and layer: masked scores = QKᵀ·s + B + M
    from the recorded Q, K, B, M; the pattern = the softmax of that (with the recorded sink logit as one more column
    where the model has one, the sink's weight then 1 − Σ_t A); the bias is 0 from its extent back (the sliding
    layers': their window) and changes the pattern (recomputed without it, the pattern differs)."""
    gen = traced(directories[model_type])
    trace, config = gen.trace, gen.model.config
    H, G = config.n_head, config.n_kv_heads
    sinks = model_type == "inkling2_text"
    assert config.attn_sinks == sinks
    for layer in range(config.n_layer):
        attn = gen.model.hf.model.layers[layer].self_attn
        extent = attn.rel_logits_proj.rel_extent
        for step in range(gen.n_steps):
            def get(name: str, layer: int = layer, step: int = step) -> torch.Tensor:
                value = trace.get(f"blocks.{layer}.attn.{name}", step)
                assert value is not None, name
                return value

            q, k, bias, mask = get("hook_q"), get("hook_k_all"), get("hook_score_bias"), get("hook_mask")
            n, t = q.shape[2], k.shape[2]
            assert bias.shape[1:] == (H, n, t)
            scores = q @ k.repeat_interleave(H // G, dim=1).transpose(-2, -1) * attn.scaling
            assert_close_across_cpus(get("hook_attn_scores"), scores, f"{layer}/{step} scores")
            assert_close_across_cpus(get("hook_masked_scores"), scores + bias + mask, f"{layer}/{step} + B + M")
            distance = torch.arange(t - n, t)[:, None] - torch.arange(t)[None, :]  # query column − key column
            assert not bias[..., distance >= extent].any() and not bias[..., distance < 0].any()
            assert bias.abs().max() > 1e-3
            if sinks:
                sink = get("hook_sink_logits")  # [B, H, n, 1], one per head and query (projected from x)
                own = attn.sink_proj(trace.get(f"hf.model.layers.{layer}.self_attn.sink_proj:in[0]", step))
                assert_close_across_cpus(sink, own.transpose(1, 2).unsqueeze(-1), f"{layer}/{step} sink logits")
                logits = torch.cat([scores + bias + mask, sink], dim=-1).float()
                redone = torch.softmax(logits, dim=-1)[..., :-1]
                without = torch.softmax(torch.cat([scores + mask, sink], dim=-1).float(), dim=-1)[..., :-1]
                assert_close_across_cpus(get("hook_sink_weight"), 1 - redone.sum(-1, keepdim=True), "sink weight")
            else:
                redone = torch.softmax((scores + bias + mask).float(), dim=-1)
                without = torch.softmax((scores + mask).float(), dim=-1)
            pattern = get("hook_pattern")
            assert_close_across_cpus(pattern, redone, f"layer {layer} step {step} pattern")
            assert float((without - pattern).abs().max()) > 1e-4  # the bias is not a no-op


@pytest.mark.parametrize("model_type", BIASED + SEVERAL + ("recurrent_gemma",))
def test_the_recorded_pattern_is_transformers_own_attention_weights(directories, model_type):
    """One prompt, prefill and 3 cached steps: each block's recorded pattern at each step equals the rows of the
    attention weights transformers' eager forward returns over the same columns without a cache (its own bias, sinks
    and mask), the b-th call's weights for block b."""
    from transformers import AutoModelForCausalLM

    gen = traced(directories[model_type], prompts=PROMPTS[:1])
    ref = AutoModelForCausalLM.from_pretrained(directories[model_type], local_files_only=True,
                                               attn_implementation="eager").eval()
    last = gen.n_steps - 1
    ids = torch.tensor([gen.facts.columns(0, last)])
    with torch.no_grad():
        weights = ref(input_ids=ids, output_attentions=True).attentions  # per attention call [1, H, t, t]
    attending = gen.model.config.attention_layers  # RecurrentGemma: its attention layers only
    assert len(weights) == len(attending)
    width = gen.info.prompt_width
    for layer, weights_of in zip(attending, weights):
        for step in range(gen.n_steps):
            theirs = weights_of[:, :, :width, :width] if step == 0 else \
                weights_of[:, :, width + step - 1:width + step, :width + step]
            ours = gen.trace.get(f"blocks.{layer}.attn.hook_pattern", step)
            assert_close_across_cpus(ours, theirs, f"{model_type} layer {layer} step {step}")


def test_a_copy_of_the_cache_replays_a_step_with_its_convolution_state(directories):
    """Inkling 2's keys and values (and the layer's input to its attention and MLP) pass short convolutions whose
    state transformers' cache layer keeps beside K and V: a copy of our cache as it was before step 2 replays that
    step to the bit (the what-if experiments start from such copies), and a forward that fails after layer 0 updated
    its state leaves the state as it was."""
    gen = traced(directories["inkling2_text"])
    before = gen.facts.step(2).forward.cache_before
    B = len(PROMPTS)
    fed = torch.tensor([[gen.facts.columns(r, 2)[-1]] for r in range(B)])
    copy = gen.cache.copy(before)
    with torch.no_grad(), attention_path("eager"):
        again = gen.model(fed, cache=copy)
    assert torch.equal(again, gen.trace.get("hook_logits", 2))
    conv = {L: {i: x.clone() for i, x in state.conv_states.items()} for L, state in gen.cache.states.items()}
    # per layer four convolutions keep state: the keys', the values', and two in the layer around its attention and MLP
    assert conv and all(len(held) == 4 for held in conv.values())
    length = gen.cache.length

    def fail(*args: object) -> None:  # after layer 0 has updated its state in place
        raise RuntimeError("stopped in layer 1")

    handle = gen.model.hf.model.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="stopped in layer 1"), torch.no_grad():
            gen.model(fed, cache=gen.cache)
    finally:
        handle.remove()
    assert gen.cache.length == length
    assert all(torch.equal(gen.cache.states[L].conv_states[i], x) for L, held in conv.items() for i, x in held.items())
    with torch.no_grad():  # and the step runs from there as it would have
        gen.model(fed, cache=gen.cache)
    assert not all(torch.equal(gen.cache.states[L].conv_states[i], x) for L, held in conv.items()
                   for i, x in held.items())


@pytest.mark.parametrize("model_type", SEVERAL)
def test_every_attention_call_is_a_block_with_its_own_cache_slot(directories, model_type):
    """Left-padded batch of two, prefill and 3 cached steps: the model has one block per attention call per forward
    — as many as transformers' own cache has slots for its config (HRM: layers per stack × H_cycles × (L_cycles + 1);
    LongCat-Flash: 2 per layer) — and block b's cache after the last step is slot b of the cache transformers' own
    forward fills over the same columns (LongCat-Flash's latent c_KV: its slots hold that); each block's pattern is
    the softmax of its recorded QKᵀ·s + M; each block's stream sums (x + attention = the stream into the MLP's norm)
    hold, and LongCat-Flash's second sublayer adds the layer's shortcut MoE besides its own MLP, as its code does."""
    from transformers import AutoModelForCausalLM, DynamicCache

    gen = traced(directories[model_type])
    trace, config, hf = gen.trace, gen.model.config, gen.model.hf
    ref = AutoModelForCausalLM.from_pretrained(directories[model_type], local_files_only=True,
                                               attn_implementation="eager").eval()
    theirs = DynamicCache(config=ref.config)
    last, B = gen.n_steps - 1, len(PROMPTS)
    ids = torch.tensor([gen.facts.columns(r, last) for r in range(B)])
    real = torch.tensor([gen.facts.is_token(r, last) for r in range(B)])
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=real.long(), position_ids=(real.long().cumsum(-1) - 1).clamp(min=0),
            past_key_values=theirs, use_cache=True)
    if model_type == "hrm_text":
        cfg = hf.config
        assert config.n_layer == cfg.num_layers_per_stack * cfg.H_cycles * (cfg.L_cycles + 1) == 16
    else:
        assert config.n_layer == 2 * hf.config.num_layers
    assert len(theirs.layers) == config.n_layer
    cached = "hook_kv_latent_all" if model_type == "longcat_flash" else "hook_k_all"
    for block in range(config.n_layer):
        mine = trace.get(f"blocks.{block}.attn.{cached}", last)
        held = theirs.layers[block].keys
        assert mine.shape == held.shape, (block, mine.shape, held.shape)
        rows = real[:, None, :, None].expand_as(held)  # the padding's rows hold whatever a padding token gives
        assert float((mine - held)[rows].abs().max()) <= 1e-5, block
        attn = hf.model.layers[block // 2].self_attn[block % 2] if model_type == "longcat_flash" else \
            hf.model.L_module.layers[0].self_attn  # one scale for all
        for step in (0, last):
            def get(name: str, block: int = block, step: int = step) -> torch.Tensor:
                value = trace.get(f"blocks.{block}.{name}", step)
                assert value is not None, name
                return value

            q, k, mask = get("attn.hook_q"), get("attn.hook_k_all"), get("attn.hook_mask")
            scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-2, -1) * attn.scaling
            assert_close_across_cpus(get("attn.hook_pattern"), torch.softmax((scores + mask).float(), dim=-1),
                                     f"block {block} step {step}")
            pre, mid, post = get("hook_resid_pre"), get("hook_resid_mid"), get("hook_resid_post")
            assert_close_across_cpus(mid, pre + get("hook_attn_out"), f"block {block} step {step}: x + attention")
            beside = post - mid - get("hook_mlp_out")  # what the block adds besides its MLP: nothing, or the shortcut
            if model_type == "longcat_flash" and block % 2 == 1:
                shortcut = trace.get(f"hf.model.layers.{block // 2}.mlp:out", step)
                assert_close_across_cpus(beside, shortcut, f"block {block} step {step}: the shortcut MoE")
            else:
                assert float(beside.abs().max()) <= 1e-5, (block, step)
    assert config.plain_residual is (model_type != "longcat_flash")


def _their_state(model_type: str, directory: Path, ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """The state transformers' own eager forward leaves after the columns ``ids`` in one cached forward, per layer that
    keeps one: RecurrentGemma's module attributes; xLSTM's cache object (C, n, m flattened per head and joined)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    ref = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    with torch.no_grad():
        if model_type == "recurrent_gemma":
            ref(input_ids=ids, past_key_values=DynamicCache(config=ref.config), use_cache=True)
            return {L: {"hook_conv_state": layer.temporal_block.conv1d_state,
                        "hook_ssm_state": layer.temporal_block.rg_lru.recurrent_states}
                    for L, layer in enumerate(ref.model.layers) if hasattr(layer.temporal_block, "rg_lru")}
        state = ref(input_ids=ids, use_cache=True).cache_params.rnn_state
        return {L: {"hook_ssm_state": torch.cat([x.flatten(2) for x in held], dim=-1)} for L, held in state.items()}


@pytest.mark.parametrize("model_type", STATE)
def test_the_state_is_recorded_per_step_and_kept_transactionally(directories, model_type):
    """One prompt, prefill and 3 cached steps. The state recorded after the last step is the state transformers' own
    forward leaves after the same columns (computed there, not by our code); it does not grow with t; the cache counts
    its bytes. A copy of the cache as it was before step 2 replays that step to the bit; a forward that fails after
    layer 0 has updated its state leaves the cache's state and length as they were, and the step then runs as it
    did."""
    gen = traced(directories[model_type], prompts=PROMPTS[:1])
    trace, config, last = gen.trace, gen.model.config, gen.n_steps - 1
    ids = torch.tensor([gen.facts.columns(0, last)])
    theirs = _their_state(model_type, directories[model_type], ids)
    assert set(theirs) == set(config.state_layers) and theirs
    for layer, named in theirs.items():
        for name, value in named.items():
            mine = trace.get(f"blocks.{layer}.{name}", last)
            assert mine is not None and mine.shape == value.shape, (layer, name)
            assert_close_across_cpus(mine, value.to(mine.dtype), f"{model_type} layer {layer} {name}")
            assert trace.record(f"blocks.{layer}.{name}", 0).shape == mine.shape  # fixed: it does not grow
    held = sum(x.numel() * x.element_size() for x in gen.cache.carried or ())
    assert gen.cache.state_nbytes == held > 0
    # replay step 2 from a copy of the cache as it was before it
    before = gen.facts.step(2).forward.cache_before
    fed = torch.tensor([[gen.facts.columns(0, 2)[-1]]])
    with torch.no_grad(), attention_path("fused"):  # the path the traced step ran
        again = gen.model(fed, cache=gen.cache.copy(before))
    assert torch.equal(again, trace.get("hook_logits", 2))
    # a failed forward rolls the state back
    state, length = [x.clone() for x in gen.cache.carried], gen.cache.length
    nxt = torch.tensor([[gen.facts.columns(0, last)[-1]]])

    def fail(*args: object) -> None:
        raise RuntimeError("stopped in layer 1")

    layers = gen.model.hf.model.layers if model_type == "recurrent_gemma" else gen.model.hf.backbone.blocks
    handle = layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="stopped in layer 1"), torch.no_grad():
            gen.model(nxt, cache=gen.cache)
    finally:
        handle.remove()
    assert gen.cache.length == length
    assert all(torch.equal(a, b) for a, b in zip(gen.cache.carried, state))
    copy = gen.cache.copy(length)
    with torch.no_grad(), attention_path("fused"):  # the path the traced step ran
        first, second = gen.model(nxt, cache=gen.cache), gen.model(nxt, cache=copy)
    assert torch.equal(first, second)  # the rolled-back cache and a copy taken before the failure agree
    assert not all(torch.equal(a, b) for a, b in zip(gen.cache.carried, state))  # and the step moved the state


def test_the_score_bias_sentence_reads_the_recorded_bias(directories):
    """The Stages view's sentence about Inkling's bias: its range and its zeros over the (query, key) pairs the mask
    lets through at the real query rows, counted here from the recorded bias and mask (the second sequence is
    left-padded: its padding rows are left out)."""
    from gpt_shape_tracer.figures.attention import score_bias_sentence

    gen = traced(directories["inkling_text"])
    trace = gen.trace
    for step, layer, head, batch in ((0, 0, 1, 1), (3, 1, 2, 0)):
        bias = trace.get(f"blocks.{layer}.attn.hook_score_bias", step)[batch, head]  # [n, t]
        mask = trace.get(f"blocks.{layer}.attn.hook_mask", step)[batch, 0]
        real = torch.tensor(gen.facts.is_token(batch, step)[-bias.shape[0]:])
        values = bias[torch.isfinite(mask) & real[:, None]].double()
        sentence = score_bias_sentence(trace, step, layer, head, batch)
        assert sentence is not None
        assert f"over the {values.numel():,} (query, key) pairs" in sentence
        assert f"from {float(values.min()):.3g} to {float(values.max()):.3g}" in sentence
        assert f"it is 0 at {int((values == 0).sum()):,} of them" in sentence
    assert score_bias_sentence(traced(directories["hrm_text"], steps=1).trace, 0, 0, 0) is None  # no bias there
    assert set(gen.model.block_origins) == {None}  # one block per layer: nothing to say about it


def test_the_app_shows_inkling_2s_bias_and_sink_stages(directories):
    """Inkling 2 in the real app (AppTest): loaded from its directory, two steps, every tab without an error; the
    Attention tab's Stages draw the bias and the sink as stages of their own and say what the bias adds, the sentence
    the function writes from the app's own trace."""
    from gpt_shape_tracer.figures.attention import score_bias_sentence
    from tests.app.test_app import TABS, page_text, panels, show_tab
    from tests.app.test_app_architectures import opened_and_stepped

    at = opened_and_stepped(directories["inkling2_text"])
    gen = at.session_state["app"].live.generation
    assert gen.n_steps == 2 and gen.model.identity.family == "hf:inkling2_text"
    for tab in TABS:
        show_tab(at, tab)
        assert not at.error, (tab, [e.value for e in at.error])
    show_tab(at, "Attention")
    titles = ["".join(r["t"] for line in note["lines"] for r in line) for drawn in panels(at)
              for note in drawn["notes"]]  # the Stages' panel titles, drawn on the canvas (gui/panels.js)
    assert any("B, the score bias" in t for t in titles) and any("s_h" in t for t in titles), titles
    layer, head, batch = (at.session_state.get(k, 0) or 0 for k in ("attn_layer", "attn_head", "attn_batch"))
    sentence = score_bias_sentence(gen.trace, gen.n_steps - 1, layer, head, batch)
    assert sentence is not None and sentence in page_text(at)


def test_hrm_s_gradients_reach_the_blocks_it_trains_through_and_say_why_not_the_others(directories):
    """HRM runs all but its last low-level cycles under torch.no_grad (its one-step gradient): the Gradients view's
    backward pass reaches the last block (its high-level stack's last run) and, for block 0, says that the model's own
    forward computes it without gradients rather than failing."""
    from gpt_shape_tracer.tracer import attention_gradients

    gen = traced(directories["hrm_text"], steps=1)
    last = gen.model.config.n_layer - 1
    result = attention_gradients(gen, 0, last, 0)
    assert result.loss > 0
    with pytest.raises(ValueError, match="computes layer 0 without gradients"):
        attention_gradients(gen, 0, 0, 0)


@pytest.mark.parametrize("model_type", SEVERAL)
def test_each_block_says_which_run_or_sublayer_of_which_layer_it_is(directories, model_type):
    """The sentence the Attention tab shows above a block of a layer that holds several: for HRM, which run of which
    stack's layer, from its cache-slot layout (slot = (h·(L_cycles + 1) + l)·layers + layer, l = L_cycles for the
    high-level stack); for LongCat-Flash, which of the two attention sublayers of which layer."""
    model, _ = load_hf(directories[model_type], implementation="transformers")
    origins = model.block_origins
    assert len(origins) == model.config.n_layer
    cfg = model.hf.config
    for block, sentence in enumerate(origins):
        assert sentence is not None and sentence.startswith(f"Block {block} is ")
        if model_type == "hrm_text":
            n, cycles, high = cfg.num_layers_per_stack, cfg.L_cycles, cfg.H_cycles
            h, rest = divmod(block, (cycles + 1) * n)
            low, layer = divmod(rest, n)
            if low == cycles:  # the high-level stack, run once per high-level cycle
                expected = f"run {h + 1} of {high} of the layer model.H_module.layers.{layer}:"
            else:
                expected = f"run {h * cycles + low + 1} of {high * cycles} of the layer model.L_module.layers.{layer}:"
        else:
            layer, i = divmod(block, 2)
            expected = (f"attention {i + 1} of 2 of the layer model.layers.{layer} "
                        f"(model.layers.{layer}.self_attn.{i}):")
        assert expected in sentence, (block, sentence)


def test_inkling_2s_four_convolution_states_are_recorded_and_counted(directories):
    """Inkling 2's layers keep four short convolutions' windows (keys, values, and around attention and MLP): the
    state recorded after the last step is all four, joined along their channels, equal to what transformers' own
    cache holds after one forward of the same columns; the KV cache tab's sentence counts all of them, as the cache
    does."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from gpt_shape_tracer.figures import cache as cache_views

    gen = traced(directories["inkling2_text"], prompts=PROMPTS[:1])
    last = gen.n_steps - 1
    ref = AutoModelForCausalLM.from_pretrained(directories["inkling2_text"], local_files_only=True,
                                               attn_implementation="eager").eval()
    theirs = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(input_ids=torch.tensor([gen.facts.columns(0, last)]), past_key_values=theirs, use_cache=True)
    for layer in range(gen.model.config.n_layer):
        held = theirs.layers[layer].conv_states
        assert len(held) == 4
        expected = torch.cat([held[i] for i in range(4)], dim=1)  # [B, ΣC, k]
        assert_close_across_cpus(gen.trace.get(f"blocks.{layer}.hook_conv_state", last), expected, f"layer {layer}")
    total = gen.cache.state_nbytes
    assert total == sum(x.numel() * x.element_size() for L in range(2) for x in theirs.layers[L].conv_states.values())
    assert f"{total / 1024:,.1f} KiB in all after step {last}" in cache_views.state_sentence(gen.trace, last)
