"""CPM-Ant (issue 51), traced as transformers' uncached forward runs it: its forward puts ``prompt_length`` learned
prompt positions before the text (ids past its vocabulary, embedded as tokens are) and its mask lets every position of
a forward see every other, so it runs without a cache, every step a full forward of the whole text
(model/sources/_hf_own_cache.py); its records hold the prompt positions first (P + n rows), its logits the tokens'
only; and the views say what its mask does instead of what a causal mask does.

References we did not write: transformers' eager forward (its logits, its generate(), the attention weights it
returns for the text's positions, its input embedding table), and the recorded Q, K, bias and mask recomputed here.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.model.sources import HFDecoderError
from gpt_shape_tracer.tracer import TracedGeneration
from tests.hf_every_architecture import DECODE_STEPS, TOLERANCE, build, check
from tests.model.test_hf_own_attention import recomputed_pattern
from tests.model.test_hf_reach_more import transformers_model, with_tokenizer
from tests.tolerance import cross_cpu_atol

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "Lily had a red kite."
WITH_PAD_ID = "Lily<|endoftext|> had a"  # the bundled tokenizer's id 0, which CPM-Ant reads as padding


@pytest.fixture(scope="module")
def directory() -> Path:
    return with_tokenizer("cpmant", Path(tempfile.mkdtemp(prefix="cpmant-")))


@pytest.fixture(scope="module")
def loaded(directory):
    return load_hf(directory)


@pytest.fixture(scope="module")
def generation(loaded):
    model, tok = loaded
    gen = TracedGeneration(model, tok, TEXT, temperature=0, use_cache=False)
    gen.run(3)
    return gen


def test_the_sweep_traces_cpmant_equal_to_transformers_uncached_forward_and_says_its_cached_path_differs(tmp_path):
    result = check("cpmant", build("cpmant", tmp_path / "cpmant"))
    assert result.outcome == "follows uncached" and not result.deltas, result
    assert len(result.uncached) == 1 + DECODE_STEPS and max(result.uncached) <= TOLERANCE, result
    assert result.note and "cached forward of cpmant differs from its uncached forward" in result.note


def test_every_step_is_transformers_uncached_forward_and_generate_without_a_cache_chooses_the_same(directory, loaded,
                                                                                                   generation):
    """Each step's logits are transformers' forward of the whole text so far (use_cache=False), row for row;
    transformers' generate() without a cache picks the same tokens; its cached path, a prefix LM, gives other logits
    (what the model's no_cache_reason and reference_note say)."""
    model, _ = loaded
    hf = transformers_model(directory)
    facts = generation.facts
    assert not generation.use_cache and model.no_cache_reason is not None
    assert "32 learned prompt positions" in model.no_cache_reason and "bidirectional" in model.no_cache_reason
    for step in range(generation.n_steps):
        ids = torch.tensor([facts.columns(0, step)])
        with torch.no_grad():
            theirs = hf(input_ids=ids, use_cache=False).logits
        ours = generation.trace.get("hook_logits", step)
        assert ours.shape == theirs.shape and float((ours - theirs).abs().max()) <= TOLERANCE, step
    prompt = torch.tensor([facts.columns(0, 0)])
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=generation.n_steps, do_sample=False, use_cache=False)
        past = hf(input_ids=prompt, use_cache=True).past_key_values
        whole = torch.tensor([facts.columns(0, 1)])  # its forward slices the cached positions off the whole text
        cached = hf(input_ids=whole, past_key_values=past, use_cache=True).logits[0, -1]
        uncached = hf(input_ids=whole, use_cache=False).logits[0, -1]
    assert out[0, prompt.shape[1]:].tolist() == list(generation.generated(0))
    assert float((cached - uncached).abs().max()) > TOLERANCE
    assert model.reference_note and "follows the uncached forward" in model.reference_note


def test_the_records_hold_the_learned_prompt_positions_first_and_the_pattern_is_softmax_of_the_recorded_stages(
        directory, loaded, generation):
    """The embeddings' first P rows are the input embedding's rows of the prompt ids (vocab + 2P … vocab + 3P − 1);
    every layer's pattern is the softmax of the recorded Q·Kᵀ·scale + bias + M over all P + n positions, its text
    block the weights transformers returns, and tokens weigh keys after them (no causal mask)."""
    model, _ = loaded
    hf = transformers_model(directory)
    P, V = model.config.prompt_positions, model.config.vocab_size
    assert hf.config.prompt_length == P and model.config.bidirectional
    trace, step = generation.trace, generation.n_steps - 1
    n = len(generation.facts.columns(0, step))
    table = hf.get_input_embeddings().weight
    embedded = trace.get("hook_embed", step)
    assert embedded.shape[1] == P + n
    torch.testing.assert_close(embedded[0, :P], table[V + 2 * P: V + 3 * P], atol=0, rtol=0)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([generation.facts.columns(0, step)]), output_attentions=True,
                    use_cache=False).attentions
    for layer in range(model.config.n_layer):
        names = ("hook_q", "hook_k_all", "hook_score_bias", "hook_mask")
        records = {name: trace.get(f"blocks.{layer}.attn.{name}", step) for name in names}
        pattern = trace.get(act_name("pattern", layer), step)
        assert pattern.shape[-2:] == (P + n, P + n)
        again = recomputed_pattern(records, model.config.attn_scale)  # float64
        # a weight's rounding follows its scores' (|Δp| ≤ 2·max|Δs|): another CPU's rounding of scores of this size
        q, k = records["hook_q"].double(), records["hook_k_all"].double()
        scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2) * model.config.attn_scale
        scores = (scores + records["hook_score_bias"].double()).float()
        torch.testing.assert_close(again, pattern.double(), atol=max(1e-5, 2 * cross_cpu_atol(scores)), rtol=0)
        values = trace.get(act_name("v_all", layer), step).double()
        torch.testing.assert_close(pattern.double() @ values, trace.get(act_name("z", layer), step).double(),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(pattern[..., P:, P:], theirs[layer], atol=1e-6, rtol=0)
        # no key after a token hidden, and the tokens weigh those after them
        assert bool((records["hook_mask"][0, 0, P:, P:] == 0).all())
        assert float(pattern[0, :, P:, P:].triu(1).sum()) > 0.1


def test_each_sublayer_adds_its_output_to_the_stream_as_the_records_show(loaded, generation):
    """CPM-Ant's blocks of a norm, a sublayer and its own residual add: hook_attn_out and hook_mlp_out are what each
    adds (the MLP inside its block, CpmAntFeedForward), so the load measures plain residual sums; its gated MLP
    (GELU(x·W_0) ⊙ x·W_1) of dim_ff is counted as three matrices."""
    model, _ = loaded
    assert model.config.plain_residual is True
    assert model.config.mlp == "swiglu" and model.config.d_mlp == model.hf.config.dim_ff
    trace = generation.trace
    for layer in range(model.config.n_layer):
        pre, mid, post = (trace.get(act_name(kind, layer), 0) for kind in ("resid_pre", "resid_mid", "resid_post"))
        attn, mlp = trace.get(act_name("attn_out", layer), 0), trace.get(act_name("mlp_out", layer), 0)
        torch.testing.assert_close(pre + attn, mid, atol=1e-5, rtol=0)
        torch.testing.assert_close(mid + mlp, post, atol=1e-5, rtol=0)


def test_a_padded_batch_is_refused_and_a_cache_too(loaded):
    model, tok = loaded
    gen = TracedGeneration(model, tok, [TEXT, "Tom"], temperature=0, use_cache=False)
    with pytest.raises(HFDecoderError, match="takes no attention mask: it reads token id 0 as padding"):
        gen.step()
    with pytest.raises(HFDecoderError, match="32 learned prompt positions"):
        model.new_cache()


def test_the_mask_views_say_this_mask_is_not_causal_counting_what_it_hides(loaded, generation):
    """The mask view, the Stages' neighbours (pitfalls), the shapes takeaway and the tour say what the recorded mask
    does — each row sees the keys after it — and never that query i sees keys 0 … i; with id 0 in the text, the
    cells the model's own mask hides are counted from the record."""
    from html import unescape

    from gpt_shape_tracer.figures.common import key_labels
    from gpt_shape_tracer.figures.mask import mask_facts
    from gpt_shape_tracer.figures.pitfalls import pitfall_sentence
    from gpt_shape_tracer.figures.tour import tour_context, tour_stops
    from gpt_shape_tracer.figures.view_takeaways import mask_takeaway, shapes_takeaway

    model, tok = loaded
    P = model.config.prompt_positions
    trace, last = generation.trace, generation.n_steps - 1
    n = len(generation.facts.columns(0, last))
    causal = ("j ≤ i", "above the diagonal", "comes after the query", "0 … i", "causality masks")
    said = mask_facts(trace, last, 0).explanation()
    assert "not causal" in mask_takeaway(mask_facts(trace, last, 0)).sentence
    assert f"every query row sees all {P + n} keys, those after it included" in said
    assert f"{P} learned prompt positions" in said and not any(words in said for words in causal), said
    pitfalls = pitfall_sentence(trace, last, 0, 0)
    assert "not causal" in pitfalls and "newest position" not in pitfalls, pitfalls
    assert f"[B, P + n, d] = [1, {P + n}, {model.config.d_model}]" in unescape(shapes_takeaway(trace, last).sentence)
    labels = key_labels(trace, last)
    assert labels[:P] == [f"{j} · ⟨prompt⟩" for j in range(P)] and labels[P].endswith("Lily")
    stops = {s.key: s for s in tour_stops(tour_context(trace, None, live=True, caches=False,
                                                      no_cache_reason=model.no_cache_reason))}
    n0 = len(generation.facts.columns(0, 0))
    assert "not causal" in stops["mask"].look and not any(words in stops["mask"].look for words in causal)
    assert (stops["mask"].title, stops["mask"].tab) == ("The attention mask", "Attention mask")
    assert f"[B, P + n, d] = [1, {P + n0}, {model.config.d_model}]" in stops["shapes"].look
    assert "the earlier rows changed too" in stops["step"].look and "only the last one new" not in stops["step"].look
    gen = TracedGeneration(model, tok, WITH_PAD_ID, temperature=0, use_cache=False)
    gen.step()
    mask = gen.trace.get(act_name("mask", 0), 0)[0, 0]
    facts = mask_facts(gen.trace, 0, 0)
    hidden = int(torch.isinf(mask).sum())
    seen = (torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min / 2)).sum(-1)
    assert hidden > 0 and facts.masked == hidden and facts.keys_seen == (int(seen.min()), int(seen.max()))
    assert f"{hidden} of {mask.numel()} entries are −∞" in facts.explanation()


def test_a_saved_trace_keeps_the_prompt_positions_and_its_mask_views_say_the_same(generation, tmp_path):
    """The config fields the views read (prompt_positions, bidirectional) travel with the file: the mask view of the
    trace read back says what the live one says."""
    from gpt_shape_tracer.figures.common import key_labels
    from gpt_shape_tracer.figures.mask import mask_facts
    from gpt_shape_tracer.tracer import load_trace, save_trace

    trace, last = generation.trace, generation.n_steps - 1
    save_trace(trace, tmp_path / "cpmant.zip")
    back = load_trace(tmp_path / "cpmant.zip")
    assert back.config.prompt_positions == trace.config.prompt_positions > 0 and back.config.bidirectional
    assert mask_facts(back, last, 1).explanation() == mask_facts(trace, last, 1).explanation()
    assert key_labels(back, last) == key_labels(trace, last)


def test_the_head_scores_and_patching_read_token_positions_after_the_prompt_positions(directory, loaded):
    """The head roles are measured on the probe's tokens only: equal to the scores of the weights transformers
    returns for the text's positions. Patching position j patches token j: at layer 0, the one position where the
    prompts differ restores the clean answer whole, every other none."""
    from gpt_shape_tracer.model.analysis import repeated_random_tokens, role_scores
    from gpt_shape_tracer.session import first_token
    from gpt_shape_tracer.tracer import activation_patching, head_scores

    model, tok = loaded
    hf = transformers_model(directory)
    scores = head_scores(model, first_token=first_token(tok), length=12)
    tokens = repeated_random_tokens(model.config.vocab_size, 12, 4, seed=7, prefix=first_token(tok))
    with torch.no_grad():
        weights = hf(input_ids=tokens, output_attentions=True, use_cache=False).attentions
    for layer, pattern in enumerate(weights):
        for role, values in role_scores(pattern.double(), 12).items():
            torch.testing.assert_close(scores[role][layer], values.float(), atol=1e-5, rtol=0)
    clean = tok.encode(TEXT)

    def answer(ids: list[int]) -> int:
        with torch.no_grad():
            return int(model(torch.tensor([ids]))[0, -1].argmax())

    corrupted = next(c for c in ([*clean[:2], other, *clean[3:]] for other in range(1, 200))
                     if answer(c) != answer(clean))  # a corrupted prompt whose answer differs from the clean one's
    result = activation_patching(model, clean, corrupted, "resid_pre")
    assert float(result.restored[0, 2]) == pytest.approx(1.0, abs=1e-4)
    assert float(result.restored[0, [j for j in range(len(clean)) if j != 2]].abs().max()) <= 1e-4


def test_the_app_traces_cpmant_without_a_cache_and_its_mask_tab_says_what_its_mask_does(directory):
    """The real app (AppTest): loaded from its directory and stepped with the KV cache toggle left on, CPM-Ant runs
    without a cache and the sidebar says why; every tab renders without an error; the mask tab is named "Attention
    mask", not "Causal mask", and its takeaway is counted from its mask and says it is not causal; the header counts
    the prompt positions in n and t."""
    from tests.app.test_app import page_text, show_tab
    from tests.app.test_app_architectures import every_tab_without_error, opened_and_stepped

    at = opened_and_stepped(directory)
    gen = at.session_state["app"].live.generation
    P = gen.model.config.prompt_positions
    assert gen.n_steps == 2 and not gen.use_cache
    assert any("32 learned prompt positions" in c.value and "whichever way this switch is set" in c.value
               for c in at.sidebar.caption)
    every_tab_without_error(at)
    show_tab(at, "Causal mask")  # the tab opened under the name a causal model's has: drawn as this model's
    assert "Attention mask" in [t.label for t in at.tabs] and "Causal mask" not in [t.label for t in at.tabs]
    assert at.session_state["view"] == "Attention mask"
    mask = gen.trace.get(act_name("mask", 0), 1)[0, 0]
    text = page_text(at)
    assert f"{int(torch.isinf(mask).sum())} of the {mask.numel()} scores are −∞: this model's mask is not causal" \
        in text, text[:2000]
    assert "comes after the query" not in text and "j ≤ i" not in text
    n = len(gen.facts.columns(0, 1))
    assert [m.value for m in at.metric][:2] == [str(P + n), str(P + n)]
    assert [m.label for m in at.metric][:2] == ["positions P + n", "key positions P + t"]  # as the takeaway writes
    show_tab(at, "KV cache")
    assert "there is no cached path to compare it with" in page_text(at)
    assert "Press the button to redo this step" not in page_text(at)


def test_the_open_tab_stays_open_when_the_mask_tab_changes_its_name(directory):
    """A live GPT generation on the Attention tab, then a CPM-Ant trace file opened, then the live generation again:
    the mask tab is renamed each time ("Causal mask" ↔ "Attention mask") and the tab the person had open stays open
    (Streamlit names the tabs' widget by its labels: without handing the open tab over, it fell back to Shapes)."""
    from tests.app.test_app import new_app, press, run, show_tab
    from tests.app.test_app_architectures import opened_and_stepped
    from tests.tracer.test_tracer_io import archive_bytes

    cpm = opened_and_stepped(directory)
    data = archive_bytes(cpm.session_state["app"].live.generation.trace)
    at = new_app()
    press(at, "step_button")
    show_tab(at, "Export")
    at.file_uploader(key="upload_trace").upload("cpmant.zip", data, "application/zip")
    run(at)
    assert at.session_state["app"].viewing_file
    masks = [t.label for t in at.tabs if "mask" in t.label]
    assert masks == ["Attention mask"] and at.session_state["view"] == "Export", (masks, at.session_state["view"])
    show_tab(at, "Attention")
    at.button(key="show_live").click()
    run(at)
    assert not at.session_state["app"].viewing_file
    assert [t.label for t in at.tabs if "mask" in t.label] == ["Causal mask"]
    assert at.session_state["view"] == "Attention"
    at.button(key="show_file").click()
    run(at)
    assert at.session_state["view"] == "Attention"
    show_tab(at, "Causal mask")  # asked by the other name: opened under this trace's
    assert at.session_state["view"] == "Attention mask"


def test_the_flow_speaks_of_no_cache_for_a_model_traced_without_one(generation):
    """CPM-Ant runs every step as a full forward, no cache: its recorded flow's boxes say K and V of every
    position, recomputed — not "cache ++ new" nor "the new positions" (the hook table's words for a cached model).
    A box's label is cut at 34 characters: the words are checked where they stand, at its start."""
    from gpt_shape_tracer.figures.flow import flow_nodes

    assert not generation.use_cache
    labels = [node.label for node in flow_nodes(generation.trace, generation.n_steps - 1, 0)[0]]
    assert "all keys K, recomputed" in labels and "all values V, recomputed" in labels, labels
    assert any(label.startswith("keys of every position") for label in labels), labels
    assert not any("cache ++ new" in label or "new positions" in label for label in labels), labels
