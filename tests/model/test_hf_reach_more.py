"""Two causal LMs that were refused, traced as they really run (model/sources/_hf_own_cache.py), or refused for the
reason transformers' own forward shows:

* OpenAI GPT keeps no cache (its forward takes none): every step a full forward over the text so far, equal to
  transformers' full forward on it; the pattern recomputed from the recorded Q, K and mask; the KV-cache tab and the
  sidebar say that the model keeps no cache (not that the cache was switched off, nor that it is a module of yours).
* XLM built as its causal LM (XLMConfig(causal=True), what its CLM checkpoints set) is traced with its own cache
  (``cache=``, handed the whole text); built as its masked LM (causal = false) it is refused as bidirectional. Its
  causal mask does not hide padding keys, and the mask view says so from M.
(CPM-Ant, once refused here, is traced without a cache: tests/model/test_hf_cpmant.py.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR, HFDecoder, HFDecoderError
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_every_architecture import DECODE_STEPS, TOLERANCE, build, check, tiny_config
from tests.model.test_hf_own_attention import recomputed_pattern

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Lily had a red kite.", "Tom"]


def with_tokenizer(model_type: str, root: Path, **overrides) -> Path:
    """A tiny random-weight directory of ``model_type`` (its sweep config) with the bundled tokenizer's ids."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type)
    for key, value in {"vocab_size": 1024, "n_words": 1024, **overrides}.items():
        if key in config.to_dict():
            setattr(config, key, value)
    torch.manual_seed(0)
    directory = root / model_type
    getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])._from_config(config).eval() \
        .save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return directory


@pytest.fixture(scope="module")
def openai_gpt() -> Path:
    return with_tokenizer("openai-gpt", Path(tempfile.mkdtemp(prefix="reach-gpt-")))


@pytest.fixture(scope="module")
def xlm() -> Path:
    return with_tokenizer("xlm", Path(tempfile.mkdtemp(prefix="reach-xlm-")))


def transformers_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                attn_implementation="eager").eval()


# -- OpenAI GPT ------------------------------------------------------------------------------------------------
def test_openai_gpt_in_the_sweep_every_step_a_full_forward_equal_to_transformers(tmp_path):
    result = check("openai-gpt", build("openai-gpt", tmp_path / "gpt"))
    assert result.outcome == "no cache" and not result.deltas, result
    assert len(result.uncached) == 1 + DECODE_STEPS and max(result.uncached) <= TOLERANCE, result


def test_openai_gpt_generation_recomputes_every_position_as_transformers_does(openai_gpt):
    model, tok = load_hf(openai_gpt)
    assert isinstance(model, HFDecoder) and model.no_cache_reason is not None
    hf = transformers_model(openai_gpt)
    gen = TracedGeneration(model, tok, PROMPTS[0], temperature=0, use_cache=False)
    gen.run(3)
    H = model.config.n_head
    for step in range(3):
        ids = torch.tensor([gen.facts.columns(0, step)])  # [1, t]: every column this step fed
        t = ids.shape[1]
        assert gen.facts.step(step).forward.n == t  # the whole text again, not one new row
        with torch.no_grad():
            expected = hf(input_ids=ids).logits
        got = gen.trace.get("hook_logits", step)
        assert got.shape == expected.shape and float((got - expected).abs().max()) <= TOLERANCE, step
        for layer in range(model.config.n_layer):
            r = {name: gen.trace.get(f"blocks.{layer}.attn.{name}", step)
                 for name in ("hook_q", "hook_k_all", "hook_mask", "hook_pattern")}
            assert tuple(r["hook_pattern"].shape) == (1, H, t, t)
            hidden = r["hook_mask"][0, 0] == float("-inf")  # its causal mask, read from its ops
            assert torch.equal(hidden, torch.ones(t, t, dtype=torch.bool).triu(1)), (step, layer)
            torch.testing.assert_close(recomputed_pattern(r, model.config.attn_scale), r["hook_pattern"].double(),
                                       atol=1e-5, rtol=0)
    # its own weights, as transformers' eager forward returns them (output_attentions), at the last step
    with torch.no_grad():
        theirs = hf(input_ids=ids, output_attentions=True).attentions
    for layer, weights in enumerate(theirs):
        torch.testing.assert_close(gen.trace.get(f"blocks.{layer}.attn.hook_pattern", 2), weights, atol=1e-6, rtol=0)


def test_openai_gpt_refuses_a_cache_with_the_reason_and_the_app_settings_turn_it_off(openai_gpt):
    from gpt_shape_tracer.figures.tour import skipped_sentence, tour_context, tour_stops
    from gpt_shape_tracer.model.gpt import KVCache
    from gpt_shape_tracer.session import caches, new_generation, no_cache_reason, settings_from

    model, tok = load_hf(openai_gpt)
    with pytest.raises(HFDecoderError, match="takes no past keys and values.*turn the cache off"):
        model.new_cache()
    with pytest.raises(HFDecoderError, match="keeps no KV cache"):
        TracedGeneration(model, tok, PROMPTS[0], temperature=0)
    with pytest.raises(HFDecoderError, match="keeps no KV cache"), torch.no_grad():  # a cache handed in anyway
        model(torch.tensor([[1, 2]]), KVCache(model.config.n_layer, 1, "model"))
    assert not caches(model)
    settings = settings_from({"prompt": PROMPTS[0]})  # the sidebar's defaults: the cache on
    gen = new_generation(model, tok, settings)
    assert settings.use_cache and not gen.use_cache
    gen.run(2)  # the guided tour skips the cache's stops for the model's own reason
    said = skipped_sentence(tour_stops(tour_context(gen.trace, None, live=True, caches=caches(model),
                                                    no_cache_reason=no_cache_reason(model) or "")))
    assert "The KV cache — this model's forward (openai-gpt) takes no past keys and values" in said, said
    assert "History — this model's forward (openai-gpt)" in said and "your own" not in said


def test_the_app_says_openai_gpt_keeps_no_cache():
    """The real app (AppTest) on an OpenAI GPT directory: Load, Step twice, the KV cache tab — its warning and the
    comparison's place say the model keeps no cache (its forward takes none), and nothing says it was switched off
    or is a module of yours; the sidebar says the switch changes nothing (from the Load on, before any Step); beam
    search is refused with the reason."""
    from html import unescape

    from tests.app.test_app import page_text, press, run, show_tab
    from tests.app.test_app_architectures import opened_and_stepped

    directory = with_tokenizer("openai-gpt", Path(tempfile.mkdtemp(prefix="app-gpt-")))
    # the sidebar says so from the Load on, before any Step: a Step reruns the page's view alone, not the sidebar
    at = opened_and_stepped(directory, steps=0)
    assert any("whichever way this switch is set" in c.value for c in at.sidebar.caption)
    for _ in range(2):  # the same page, Stepped as opened_and_stepped does
        press(at, "step_button")
    show_tab(at, "KV cache")
    assert not at.error, [e.value for e in at.error]
    gen = at.session_state["app"].live.generation
    assert not gen.use_cache and gen.facts.step(1).forward.n == gen.facts.step(1).forward.t
    text = page_text(at)
    said = "This model's forward (openai-gpt) takes no past keys and values, so it keeps no KV cache"
    assert f"{said} (transformers' generate() feeds it the whole text at every step): every step recomputes K and V" \
        in text
    assert f"{said} (transformers' generate() feeds it the whole text at every step): every step recomputes all " \
           "positions, and there is no cached path to compare it with." in text
    assert "Your module" not in text and "The KV cache is off for this generation" not in text
    assert any("whichever way this switch is set" in c.value for c in at.sidebar.caption)
    show_tab(at, "Decoding")  # beam search and speculative decoding need a cache: refused with the reason, no crash
    at.button(key="beam_run").click()
    run(at)
    assert any("beam search reorders a KV cache" in unescape(e.value) and "keeps no KV cache" in unescape(e.value)
               for e in at.error), [e.value for e in at.error]


# -- XLM ---------------------------------------------------------------------------------------------------------
def test_xlm_is_built_as_its_causal_lm_and_its_masked_lm_is_refused_as_bidirectional(tmp_path):
    """The sweep builds XLM with causal = true (its override table says why); XLMConfig's default, causal = false, is
    its masked LM, whose transformers forward lets position 0 weigh position 1: refused by its config, so."""
    from transformers import XLMConfig, XLMWithLMHeadModel

    from tests.hf_every_architecture import _OVERRIDES

    assert _OVERRIDES["xlm"] == {"causal": True} and tiny_config("xlm").causal is True
    values = tiny_config("xlm").to_dict()
    for causal in (True, False):
        values["causal"] = causal
        torch.manual_seed(0)
        hf = XLMWithLMHeadModel(XLMConfig(**values)).eval()
        with torch.no_grad():
            weights = hf(input_ids=torch.tensor([[5, 6]]), output_attentions=True).attentions
        assert bool((weights[0][..., 0, 1] > 0).any()) == (not causal)  # transformers' own: 0 sees 1 unless causal
        if causal:
            assert isinstance(HFDecoder(hf), HFDecoder)
        else:
            with pytest.raises(HFDecoderError, match=r"masked LM \(causal = false\)") as refused:
                HFDecoder(hf)
            assert refused.value.reason == "encoder"
    result = check("xlm", build("xlm", tmp_path / "xlm"))
    assert result.outcome == "traced" and max(result.deltas) <= TOLERANCE, result


def test_xlm_padding_keys_stay_open_and_the_mask_view_says_so(xlm):
    """XLM's causal mask does not hide padding keys (its attention mask only zeroes the padding's hidden states):
    with left padding, the real rows' logits equal transformers' forward given the same mask and positions, the
    padding keys get weight, and the mask view says so — never "−∞ for every real query"."""
    from gpt_shape_tracer.figures.mask import mask_facts

    model, tok = load_hf(xlm)
    hf = transformers_model(xlm)
    gen = TracedGeneration(model, tok, PROMPTS, temperature=0, padding_side="left")
    gen.run(2)
    ids = torch.tensor([gen.facts.columns(r, 1) for r in range(2)])
    real = torch.tensor([gen.facts.is_token(r, 1) for r in range(2)])
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=real.long(), position_ids=positions).logits
    width = gen.info.prompt_width
    prefill = gen.trace.get("hook_logits", 0)
    assert float((prefill - expected[:, :width])[real[:, :width]].abs().max()) <= TOLERANCE
    assert float((gen.trace.get("hook_logits", 1) - expected[:, width:]).abs().max()) <= TOLERANCE
    padding = [j for j, is_token in enumerate(real[1].tolist()) if not is_token]
    assert padding
    for step in (0, 1):
        facts = mask_facts(gen.trace, step, layer=0, batch=1)
        mask = gen.trace.get("blocks.0.attn.hook_mask", step)[1, 0]
        pattern = gen.trace.get("blocks.0.attn.hook_pattern", step)[1]
        last = mask.shape[0] - 1  # the last real query row
        assert bool((mask[last, padding] == 0).all()) and bool((pattern[:, last, padding] > 0).all())
        said = facts.explanation()
        assert "−∞ for every real query" not in said
        assert f"leaves column(s) {', '.join(map(str, padding))} open to the real queries" in said


def test_a_dry_run_of_openai_gpt_is_full_forwards_and_says_why(tmp_path):
    """Built on the meta device from its config: every step a full forward (n = t), and the page's note says the
    model keeps no cache — not a refusal to build."""
    from gpt_shape_tracer.gui.dry_run import DryRun, run_dry

    tiny_config("openai-gpt").save_pretrained(tmp_path)
    result = run_dry(str(tmp_path / "config.json"), 6, 2)
    assert isinstance(result, DryRun), result
    assert "(openai-gpt) takes no past keys and values, so it keeps no KV cache" in result.cache_note
    facts = result.trace.generation
    assert facts is not None and not facts.info.use_cache
    assert all(facts.step(s).forward.n == facts.step(s).forward.t for s in range(result.trace.n_steps))


@pytest.mark.parametrize("model_type", ["xlnet", "xlm"])
def test_the_model_says_how_far_generate_s_own_inputs_take_its_prediction_from_the_traced_forward(model_type, tmp_path):
    """XLNet's and XLM's generate() do not read the forward's logits at the last token: their own
    prepare_inputs_for_generation appends a token (XLNet's dummy, read through its query stream; XLM's mask token)
    and reads the logits there. The loaded model's reference_note (shown above the views) states what is appended, the
    gap in the next-token logits and which token each picks; checked against transformers' generate() itself (its
    first greedy token and the scores it picked it by) on the load check's tokens."""
    from transformers import AutoModelForCausalLM

    from gpt_shape_tracer.model.sources._hf_loading import GUARD_PROMPT

    directory = build(model_type, tmp_path / model_type)
    model, _ = load_hf(directory)
    note = model.reference_note
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    n = GUARD_PROMPT
    tokens = (torch.arange(n + 1) * 7 + 3)[None] % hf.config.vocab_size
    with torch.no_grad():
        out = hf.generate(tokens, max_new_tokens=1, do_sample=False, output_scores=True, return_dict_in_generate=True,
                          use_cache=False, pad_token_id=0)
        forward = hf(input_ids=tokens).logits[0, -1]  # the forward's logits at the last token, which the trace equals
    picked, scores = int(out.sequences[0, -1]), out.scores[0][0]
    gap = float((scores - forward).abs().max())
    assert gap > 1e-3 and note is not None, note  # the two predictions really differ on these models
    appended = 0 if model_type == "xlnet" else hf.config.mask_token_id  # XLNet: a token of zeros
    assert f"it appends token {appended}" in note, note
    assert ("query stream" in note) == (model_type == "xlnet"), note
    said = f"on the {n + 1} tokens the load checks it with, its next-token logits differ from the trace's by {gap:.3g}"
    assert said in note, note
    mine = int(forward.argmax())
    said = (f"both pick token {picked} greedily" if mine == picked else
            f"generate() picks token {picked} greedily where the trace picks {mine}")
    assert said in note, note
    if model_type == "xlnet":  # its checkpoints' attn_type "bi": traced without a cache, its mems path differing
        assert note.endswith("and the trace follows the uncached one (exactly)"), note
    else:
        assert note.endswith(said), note


def test_a_family_whose_generate_reads_the_forward_s_last_logits_has_no_such_note(tmp_path):
    """CTRL prepares its own inputs for generate() too, but they are the text: the logits agree, and nothing is said."""
    model, _ = load_hf(build("ctrl", tmp_path / "ctrl"))
    assert model.reference_note is None
