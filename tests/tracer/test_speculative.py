"""Assisted (speculative) decoding traced one verify forward per step (tracer/generation/_speculative.py), against
transformers' own ``generate(assistant_model=…)`` and ``generate(prompt_lookup_num_tokens=…)`` on the same weights:
the tokens, and every step's crop of the main cache (caught on the DynamicCache transformers crops); the output
against greedy decoding (ours and transformers'); the cropped caches against the accepted tokens run again from
scratch; ``KVCache.crop``; the cache events beam search and speculative decoding both record; the command line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import KVCache, load_model
from gpt_shape_tracer.tracer import CacheEvent, SpeculativeDecoding, SpeculativeError, TracedGeneration
from tests.hf_architectures import build
from tests.tolerance import close_across_cpus

TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "story-gpt" / "tokenizer.json"
PROMPT = "Once upon a time"
LOOKUP_PROMPT = "one two three one two three one two"  # repeats: prompt lookup finds drafts


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random 2-layer llama (ours and transformers' eager) and its assistant: the same weights cut to the first
    layer (so it agrees with the main model often, not always), ours and transformers'."""
    from transformers import AutoModelForCausalLM

    main_dir = build("llama", tmp_path_factory.mktemp("main"), TOKENIZER, seed=3)
    reference = AutoModelForCausalLM.from_pretrained(main_dir, attn_implementation="eager").eval()
    config = copy.deepcopy(reference.config)
    config.num_hidden_layers = 1
    draft = AutoModelForCausalLM.from_config(config).eval()
    draft.load_state_dict(reference.state_dict(), strict=False)  # layer 1's weights left out
    draft_dir = tmp_path_factory.mktemp("draft")
    draft.save_pretrained(draft_dir)
    (draft_dir / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    draft_reference = AutoModelForCausalLM.from_pretrained(draft_dir, attn_implementation="eager").eval()
    ours, tok = load_model(str(main_dir))
    assistant, _ = load_model(str(draft_dir))
    return ours, assistant, tok, reference, draft_reference


def reference_run(reference, tok, prompt, new, eos=None, **settings):
    """transformers' generate: the new tokens, and the rows each crop of its main cache dropped."""
    from transformers import DynamicCache

    ids = torch.tensor([tok.encode(prompt)])
    cache, crops = DynamicCache(config=reference.config), []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(-n), crop(n))[1]
    out = reference.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache, eos_token_id=eos,
                             pad_token_id=0, **settings)
    return out[0, ids.shape[1]:].tolist(), crops


def greedy_tokens(ours, tok, prompt, new, eos=()):
    gen = TracedGeneration(ours, tok, prompt, temperature=0, capture="shapes")
    gen.run(new)
    out = list(gen.generated(0))
    ends = [i for i, t in enumerate(out) if t in eos]
    return out[: ends[0] + 1] if ends else out


ASSISTED = [  # (num_assistant_tokens, schedule, confidence threshold)
    (5, "heuristic", 0.0),
    (3, "constant", 0.0),
    (20, "constant", 0.4),  # transformers' defaults: drafting stops at the first unconfident token
]


@pytest.mark.parametrize("k, schedule, threshold", ASSISTED)
def test_assisted_output_and_crops_equal_transformers_and_greedy(pair, k, schedule, threshold):
    ours, assistant, tok, reference, draft_reference = pair
    if threshold:
        import importlib.util

        if importlib.util.find_spec("sklearn") is not None:
            pytest.skip("scikit-learn is installed: transformers moves the confidence threshold during the run")
    config = draft_reference.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, schedule
    config.assistant_confidence_threshold = threshold
    expected, crops = reference_run(reference, tok, PROMPT, 12, assistant_model=draft_reference)
    run = SpeculativeDecoding(ours, tok, PROMPT, assistant=assistant, max_new_tokens=12, num_assistant_tokens=k,
                              schedule=schedule, confidence_threshold=threshold, eos_ids=())
    run.run()
    assert list(run.generated) == expected
    assert [s.main_cropped for s in run.steps] == crops  # one crop per step, the same rows
    assert expected == greedy_tokens(ours, tok, PROMPT, 12)
    assert expected == reference.generate(torch.tensor([tok.encode(PROMPT)]), max_new_tokens=12, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(tok.encode(PROMPT)):].tolist()
    if schedule == "heuristic":  # transformers leaves its final number of drafts on the assistant's config
        assert run.num_draft == config.num_assistant_tokens
        prev = k
        for s in run.steps:
            assert s.next_draft == (prev + 2 if s.accepted == len(s.draft_tokens) else max(1, prev - 1))
            prev = s.next_draft
    else:
        assert {s.next_draft for s in run.steps} == {k}
    fates = [f for s in run.steps for f in s.fates]
    assert "accepted" in fates and "rejected" in fates  # the case really accepts some drafts and rejects others
    assert run.main_forwards == len(run.steps) < 12  # fewer main forwards than tokens
    assert run.draft_trace.n_steps == run.draft_forwards == sum(len(s.draft_forwards) for s in run.steps)
    assert run.trace.n_steps == len(run.steps)  # the trace holds one step per verify forward


def test_prompt_lookup_equals_transformers_and_greedy(pair):
    ours, _, tok, reference, _ = pair
    expected, crops = reference_run(reference, tok, LOOKUP_PROMPT, 12, prompt_lookup_num_tokens=3)
    run = SpeculativeDecoding(ours, tok, LOOKUP_PROMPT, prompt_lookup=3, max_new_tokens=12, eos_ids=())
    run.run()
    assert list(run.generated) == expected == greedy_tokens(ours, tok, LOOKUP_PROMPT, 12)
    assert [s.main_cropped for s in run.steps] == crops
    assert any(s.draft_tokens for s in run.steps) and any(s.main_cropped for s in run.steps)
    assert all(not s.draft_forwards and not s.draft_probs for s in run.steps) and run.draft_trace is None


def test_an_end_token_among_the_accepted_drafts_ends_the_run_as_transformers_ends_it(pair):
    """The model drafting for itself: every draft matches, the drafting stops at the end token (the assistant's own
    generate stops there), and that draft is matched but not counted accepted: it ends the run as the last token,
    its row cropped as transformers crops it."""
    ours, _, tok, reference, _ = pair
    eos = greedy_tokens(ours, tok, PROMPT, 6)[4]  # the 5th greedy token ends the run
    config = copy.deepcopy(reference.generation_config)
    reference.generation_config.num_assistant_tokens = 6
    reference.generation_config.num_assistant_tokens_schedule = "constant"
    reference.generation_config.assistant_confidence_threshold = 0.0
    try:
        expected, crops = reference_run(reference, tok, PROMPT, 12, eos=eos, assistant_model=reference)
    finally:
        reference.generation_config = config
    run = SpeculativeDecoding(ours, tok, PROMPT, assistant=ours, max_new_tokens=12, num_assistant_tokens=6,
                              confidence_threshold=0, eos_ids=(eos,))
    run.run()
    assert list(run.generated) == expected == greedy_tokens(ours, tok, PROMPT, 12, eos=(eos,))
    assert run.generated[-1] == eos and run.done and run.steps[-1].done and len(run.generated) == 5
    last = run.steps[-1]
    assert last.fates == ("accepted",) * 4 + ("cut",) and last.bonus == last.draft_tokens[-1] == eos
    assert [s.main_cropped for s in run.steps] == crops == [1]


def test_the_cropped_caches_hold_the_accepted_tokens_as_a_fresh_run_would(pair):
    ours, assistant, tok, _, _ = pair
    run = SpeculativeDecoding(ours, tok, PROMPT, assistant=assistant, max_new_tokens=10, num_assistant_tokens=4,
                              schedule="heuristic", confidence_threshold=0, eos_ids=())
    seen_crop = False
    while not run.done:
        s = run.step()
        seen_crop |= s.main_cropped > 0
        before, verified, after = s.main_rows
        assert verified == before + s.verify_fed and after == verified - s.main_cropped == len(run.ids) - 1
        assert [e.kind for e in s.cache_events][-2:] == ["grow", "crop"]
        fresh = ours.new_cache(1)
        ours(torch.tensor([run.ids[:-1]]), fresh)  # every token but the bonus, which the next step feeds
        for layer in range(ours.config.n_layer):
            assert close_across_cpus(run.cache.keys[layer], fresh.keys[layer])
            assert close_across_cpus(run.cache.values[layer], fresh.values[layer])
        if s.draft_forwards:  # the assistant's cache: the sequence it drafted from, then its own drafts but the last
            drafted = run.ids[: len(run.ids) - len(s.new_tokens)] + list(s.draft_tokens[:-1])
            own = assistant.new_cache(1)
            assistant(torch.tensor([drafted]), own)
            assert run.draft_cache.length == len(drafted) == s.draft_rows[2]
            assert close_across_cpus(run.draft_cache.keys[0], own.keys[0])
        if s.step:
            assert s.verify_fed == len(s.draft_tokens) + 1 and s.verify_logits.shape == (s.verify_fed, 1024)
            assert s.choices == tuple(s.verify_logits.argmax(-1).tolist())
    assert seen_crop and any(s.draft_cropped for s in run.steps)
    first = run.steps[0]  # the prefill verifies too: the logits of its last token and the drafts only
    logits = run.trace.record("hook_logits", first.verify_step)
    assert logits.shape[1] == len(first.draft_tokens) + 1 < run.trace.record("hook_embed", first.verify_step).shape[1]


def test_kv_cache_crop_keeps_the_first_rows_and_leaves_earlier_views_as_they_were():
    cache = KVCache(n_layer=2, batch_size=2)
    k, v = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    for layer in range(2):
        cache.append(layer, k, v)
    cache.commit(6, torch.tensor([[False] + [True] * 5, [True] * 6]))
    view = cache.keys[0]
    cache.crop(4)
    assert cache.length == 4 and torch.equal(cache.keys[1], k[:, :, :4]) and torch.equal(cache.values[0], v[:, :, :4])
    assert cache.key_is_token.tolist() == [[False, True, True, True], [True] * 4]
    new = torch.randn(2, 3, 1, 4)
    for layer in range(2):
        cache.append(layer, new, new)
    cache.commit(1, torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(cache.keys[0][:, :, 4:], new) and torch.equal(view, k)  # the old view saw no overwrite
    cache.crop(5)  # nothing to drop
    assert cache.length == 5
    for bad in (6, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"crop keeps 0 … 5 positions"):
            cache.crop(bad)
    cache.append(0, new, new)
    with pytest.raises(RuntimeError, match="crop between forwards only"):
        cache.crop(1)


def test_cache_events_say_what_each_strategy_did(bundled):
    from gpt_shape_tracer.tracer import BeamSearch

    model, tok = bundled
    search = BeamSearch(model, tok, PROMPT, 3, max_new_tokens=3, eos_ids=())
    search.run()
    for s in search.steps:
        grow, reorder = s.cache_events
        assert (grow.kind, reorder.kind, reorder.indices) == ("grow", "reorder", s.beam_idx)
        assert grow.rows_after == reorder.rows_before == reorder.rows_after and reorder.changed == s.moved_rows
    assert search.steps[0].cache_events[0].indices == tuple(range(len(tok.encode(PROMPT))))
    event = CacheEvent.crop(2, 9, 6, "draft")
    assert event.indices == (6, 7, 8) and event.changed == 3
    assert event.sentence() == "step 2, draft cache: cropped 3 position(s), 6 … 8, back to 6"
    with pytest.raises(ValueError, match="a cache event's kind is one of"):
        CacheEvent("shuffle", 0, 1, 1)


def test_bad_settings_are_refused_with_the_numbers(bundled):
    from gpt_shape_tracer.model import GPT, GPTConfig

    model, tok = bundled
    other = GPT(GPTConfig(vocab_size=64, n_ctx=32, d_model=16, n_layer=1, n_head=2))
    cases = [
        (dict(), "give a draft source"),
        (dict(assistant=model, prompt_lookup=3), "give a draft source"),
        (dict(prompt_lookup=0), "prompt_lookup must be a whole number from 1 to 64, got 0"),
        (dict(prompt_lookup=2, max_new_tokens=0), "max_new_tokens must be a whole number from 1 to 256"),
        (dict(assistant=model, schedule="sometimes"), "schedule must be one of constant, heuristic"),
        (dict(assistant=model, confidence_threshold=float("nan")), r"confidence_threshold must lie in \[0, 1\]"),
        (dict(assistant=model, num_assistant_tokens=65), "num_assistant_tokens must be a whole number from 1 to 64"),
        (dict(assistant=other), r"the assistant's vocabulary \(64 tokens\) is not the model's \(1024\)"),
        (dict(prompt_lookup=2, max_new_tokens=255), "positions; the model has n_ctx = 256"),
    ]
    for settings, message in cases:
        with pytest.raises(SpeculativeError, match=message):
            SpeculativeDecoding(model, tok, PROMPT, **settings)
    with pytest.raises(SpeculativeError, match="one non-empty text"):
        SpeculativeDecoding(model, tok, [PROMPT, "Tom"], prompt_lookup=2)
    run = SpeculativeDecoding(model, tok, PROMPT, prompt_lookup=2, max_new_tokens=2)
    assert run.run() >= 1 and run.done and len(run.generated) == 2
    with pytest.raises(SpeculativeError, match="the run is done"):
        run.step()


# -- the views: figures and sentences from the steps' own numbers --------------------------------------------------
def test_figures_and_sentences_state_the_runs_own_numbers(pair):
    from gpt_shape_tracer.figures.speculative import (
        acceptance_figure,
        cache_figure,
        run_numbers,
        run_sentence,
        step_sentence,
        token_cells,
    )

    ours, assistant, tok, _, _ = pair
    run = SpeculativeDecoding(ours, tok, PROMPT, assistant=assistant, max_new_tokens=10, num_assistant_tokens=3,
                              confidence_threshold=0, eos_ids=(), capture="shapes")
    run.run()
    steps = run.steps
    n = run_numbers(steps)
    drafted = sum(len(s.draft_tokens) for s in steps)
    accepted = sum(s.accepted for s in steps)
    assert (n["drafted"], n["accepted"], n["generated"], n["forwards"]) == (drafted, accepted, 10, len(steps))
    assert n["saved"] == 10 - len(steps) and n["cropped"] == drafted - accepted
    sentence, metrics = run_sentence(steps, run.source)
    assert (f"{drafted} token(s) drafted over {len(steps)} step(s), {accepted} accepted (acceptance rate "
            f"{accepted / drafted:.0%})") in sentence
    assert f"{10 - len(steps)} forward(s) saved" in sentence
    assert f"{run.draft_forwards} assistant forward(s)" in sentence
    assert dict(metrics)["rows cropped"] == str(drafted - accepted)
    for s in steps:
        said = step_sentence(s, tok.token_label)
        assert (f"{len(s.draft_tokens)} token(s) drafted, {s.accepted} accepted" in said if s.draft_tokens else
                "nothing was drafted" in said)
        assert f"{s.main_rows[0]} → {s.main_rows[1]} positions" in said and f"to {s.main_rows[2]}." in said
        assert ("The run ends here" in said) == s.done
    cells = token_cells(steps)
    assert len(cells) == drafted + len(steps)
    fig = acceptance_figure(steps, tok.token_label)
    drawn = {t.name: len(t.x) for t in fig.data if t.mode == "markers"}
    from gpt_shape_tracer.figures.speculative import FATE_WORDS

    for fate in ("accepted", "rejected"):
        assert drawn[FATE_WORDS[fate]] == sum(s.fates.count(fate) for s in steps)
    bars = cache_figure(steps)
    assert [list(b.y) for b in bars.data] == [[s.main_rows[i] for s in steps] for i in range(3)]


# -- the command line ------------------------------------------------------------------------------------------------
def test_the_trace_command_runs_assisted_decoding_and_lists_each_steps_drafts_and_crops(bundled, capsys):
    from gpt_shape_tracer.trace_command import main

    assert main(["--prompt", PROMPT, "--assistant-model", "story-gpt", "--steps", "6", "--num-assistant-tokens",
                 "2", "--assistant-schedule", "heuristic", "--assistant-confidence", "0", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    model, tok = bundled
    run = SpeculativeDecoding(model, tok, PROMPT, assistant=model, max_new_tokens=6, num_assistant_tokens=2,
                              schedule="heuristic", confidence_threshold=0)
    run.run()
    assert said["generated"] == list(run.generated) and said["text"] == run.text()
    assert [s["drafts"] for s in said["speculative_steps"]] == [list(s.draft_tokens) for s in run.steps]
    assert [s["accepted"] for s in said["speculative_steps"]] == [s.accepted for s in run.steps]
    assert [s["cropped"] for s in said["speculative_steps"]] == [0] * len(run.steps)  # it drafts for itself
    assert said["acceptance_rate"] == 1.0 and said["main_forwards"] == len(run.steps) < 6


@pytest.mark.parametrize("args, message", [
    (["--num-assistant-tokens", "3"], "--num-assistant-tokens go(es) with --assistant-model"),
    (["--prompt-lookup", "0"], "--prompt-lookup takes 1 … 64, got 0"),
    (["--prompt-lookup", "2", "--assistant-model", "story-gpt"], "not both: one draft source"),
    (["--prompt-lookup", "2", "--assistant-schedule", "heuristic"], "go(es) with --assistant-model, not"),
    (["--prompt-lookup", "2", "--num-beams", "2"], "--num-beams does not go with assisted decoding"),
    (["--prompt-lookup", "2", "--temperature", "0.7"], "no --temperature, --top-k or --top-p"),
    (["--prompt-lookup", "2", "--prompt", "Tom"], "runs one prompt"),
])
def test_the_trace_command_refuses_speculative_options_that_do_not_go_together(args, message, capsys):
    from gpt_shape_tracer.trace_command import main

    assert main(["--prompt", PROMPT, *args]) == 2
    assert message in capsys.readouterr().err


# -- the app -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["prompt lookup (no second model)", "the bundled story-llama"])
def test_the_decoding_tab_runs_speculative_decoding_whose_output_is_greedy_decoding(source):
    from gpt_shape_tracer.figures.speculative import run_numbers
    from gpt_shape_tracer.model import SamplingConfig, generate
    from tests.app.test_app import gen_of, new_app, press, show_tab

    at = new_app()
    press(at, "step_button")
    show_tab(at, "Decoding")
    at.radio(key="decoding_strategy").set_value("speculative decoding").run()
    at.selectbox(key="spec_source").set_value(source)
    at.number_input(key="spec_new").set_value(8)
    at.button(key="spec_run").click().run()
    assert not at.exception and not at.error
    run = at.session_state["app"].live.speculative
    gen = gen_of(at)
    prompt = gen.tokenizer.encode(gen.info.prompts[0])
    assert list(run.generated) == generate(gen.model, prompt, 8, SamplingConfig(temperature=0))[: len(run.generated)]
    numbers = run_numbers(run.steps)
    said = next(m.value for m in at.markdown if "drafted over" in m.value)
    assert f"{numbers['drafted']} token(s) drafted over {numbers['forwards']} step(s)" in said
    assert ("assistant forward" in said) == (source != "prompt lookup (no second model)")
    assert len(at.get("plotly_chart")) == 2
