"""Beam search traced one forward per step (tracer/generation/_beams.py), against transformers' own
``generate(num_beams=k)`` on the same weights: the returned sequences, their scores and every step's cache
reorder (``beam_idx``, caught on the DynamicCache transformers reorders); the reorder itself against each
surviving beam's history recomputed from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.model import load_model
from gpt_shape_tracer.model.gpt import MIN_CAPACITY, KVCache
from gpt_shape_tracer.tracer import BeamSearch, BeamSearchError
from tests.hf_architectures import build
from tests.tolerance import close_across_cpus

TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "story-gpt" / "tokenizer.json"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    """(ours, tokenizer, transformers' eager model) on one random-weight directory: llama runs as our own GPT,
    qwen3 as transformers' model through our attention function."""
    from transformers import AutoModelForCausalLM

    directory = build(request.param, tmp_path_factory.mktemp(request.param), TOKENIZER, seed=3)
    ours, tok = load_model(str(directory))
    reference = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    return ours, tok, reference


def reference_run(reference, tok, prompts, k, new, *, eos=(), **settings):
    """transformers' generate with the same settings, and the beam_idx of every reorder it made."""
    from transformers import DynamicCache

    rows = [tok.encode(p) for p in prompts]
    width, pad = max(map(len, rows)), eos[0] if eos else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    cache, reorders = DynamicCache(config=reference.config), []
    reorder = cache.reorder_cache
    cache.reorder_cache = lambda beam_idx: (reorders.append(beam_idx.tolist()), reorder(beam_idx))[1]
    out = reference.generate(ids, attention_mask=attention, num_beams=k, max_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, output_scores=True, eos_token_id=list(eos) or None,
                             pad_token_id=pad, past_key_values=cache, **settings)
    return out, reorders


CASES = [  # (prompts, length_penalty, early_stopping, num_return_sequences)
    (["Once upon a time"], 1.0, False, 1),
    (["Once upon a time"], 2.0, True, 3),
    (["Lily had a red ball and", "Tom"], 0.5, "never", 2),  # a batch: the second prompt left-padded
]


@pytest.mark.parametrize("prompts, length_penalty, early_stopping, returned", CASES)
def test_sequences_scores_and_reorders_equal_transformers(pair, prompts, length_penalty, early_stopping, returned):
    ours, tok, reference = pair
    search = BeamSearch(ours, tok, prompts, 4, max_new_tokens=7, length_penalty=length_penalty,
                        early_stopping=early_stopping, num_return_sequences=returned, eos_ids=())
    search.run()
    out, reorders = reference_run(reference, tok, prompts, 4, 7, length_penalty=length_penalty,
                                  early_stopping=early_stopping, num_return_sequences=returned)
    result = search.result()
    assert [list(s) for s in result.sequences] == out.sequences.tolist()
    assert close_across_cpus(torch.tensor(result.scores), out.sequences_scores)
    assert [list(s.beam_idx) for s in search.steps] == reorders  # one reorder per step, the same rows
    assert len(search.steps) == 7 and search.done
    assert any(s.moved_rows for s in search.steps)  # the case really copies one beam's history onto another


def test_a_hypothesis_that_ends_early_is_kept_as_transformers_keeps_it(pair):
    """An end-of-sequence token chosen mid-run: taken from the second step's best candidates of a run without
    one, so a beam really finishes there."""
    ours, tok, reference = pair
    probe = BeamSearch(ours, tok, "Once upon a time", 3, max_new_tokens=6, eos_ids=())
    probe.run(2)
    eos = (probe.steps[1].candidates[0][0].token,)
    search = BeamSearch(ours, tok, "Once upon a time", 3, max_new_tokens=6, eos_ids=eos, num_return_sequences=3)
    search.run()
    finished_at = [s.step for s in search.steps for c in s.candidates[0] if c.fate == "finished"]
    assert finished_at and min(finished_at) == 1 < len(search.steps) - 1
    out, reorders = reference_run(reference, tok, ["Once upon a time"], 3, 6, eos=eos, num_return_sequences=3)
    assert [list(s) for s in search.result().sequences] == out.sequences.tolist()
    assert close_across_cpus(torch.tensor(search.result().scores), out.sequences_scores)
    assert [list(s.beam_idx) for s in search.steps] == reorders


def test_the_reordered_cache_holds_each_beams_own_history(pair):
    """After every step, the rows the snapshot kept are the rows before gathered by beam_idx, and the cache
    equals each running beam's tokens run again from scratch (the history it now continues)."""
    ours, tok, _ = pair
    search = BeamSearch(ours, tok, "Once upon a time", 4, max_new_tokens=5, eos_ids=(), snapshot_layer=1)
    for _ in range(4):
        step = search.step()
        assert torch.equal(step.keys_after, step.keys_before[list(step.beam_idx)])
    width = search.prompt_width
    for beam in range(4):
        history = search._running[0, beam, : search.cur_len - 1]  # what the next forward's cache must hold
        fresh = ours.new_cache(1)
        ours(history[None, :], fresh)
        assert close_across_cpus(search.cache.keys[1][beam], fresh.keys[1][0])
        assert close_across_cpus(search.cache.values[0][beam], fresh.values[0][0])
    assert search.cache.length == width + 3


def test_kv_cache_reorder_gathers_rows_into_a_new_buffer_with_bounded_spare_rows():
    """Row i becomes row rows[i], views handed out before stay as they were, and the new buffer keeps at most
    MIN_CAPACITY unused rows (a beam search reorders every step: each old buffer a trace keeps is charged whole)."""
    cache = KVCache(n_layer=2, batch_size=3)
    k, v = torch.randn(3, 2, 200, 4), torch.randn(3, 2, 200, 4)
    for layer in range(2):
        cache.append(layer, k, v)
    cache.commit(200, None)
    new = torch.randn(3, 2, 1, 4)
    for layer in range(2):  # grows the buffer to 400 rows
        cache.append(layer, new, new)
    cache.commit(1, None)
    before = cache.keys[0]
    rows = torch.tensor([2, 2, 0])
    cache.reorder(rows)
    whole_k, whole_v = torch.cat([k, new], dim=2), torch.cat([v, new], dim=2)
    assert torch.equal(cache.keys[1], whole_k[rows]) and torch.equal(cache.values[0], whole_v[rows])
    assert torch.equal(before, whole_k)  # the view from before the reorder: its buffer was not written
    spare = cache.keys[0].untyped_storage().nbytes() // (3 * 2 * 4 * 4) - 201
    assert spare == MIN_CAPACITY  # not the 199 spare rows of the grown buffer
    for layer in range(2):  # the next step writes into the spare rows, in place
        cache.append(layer, new, new)
    cache.commit(1, None)
    assert torch.equal(cache.keys[0][:, :, 201:], new) and torch.equal(cache.keys[0][:, :, :201], whole_k[rows])


def test_the_trace_holds_one_step_per_forward_with_every_beam_as_a_row(pair):
    ours, tok, _ = pair
    search = BeamSearch(ours, tok, ["Once upon a time", "Tom"], 3, max_new_tokens=3, eos_ids=())
    search.run()
    trace = search.trace
    assert trace.n_steps == 3
    names = [name for name in trace.names(0) if name.endswith("hook_logits")]
    prefill = trace.record(names[0], 0)
    # B·k rows: each prompt repeated k times; the last position's logits only, as generate() unembeds them
    assert names and prefill.shape[:2] == (6, 1)
    embedded = [name for name in trace.names(0) if name.endswith("hook_embed")]
    assert trace.record(embedded[0], 0).shape[:2] == (6, search.prompt_width)  # while every position ran
    assert trace.record(names[0], 2).shape[:2] == (6, 1)  # then one new token per beam


@pytest.mark.parametrize("settings, message", [
    (dict(num_beams=1), "num_beams must be a whole number from 2"),
    (dict(num_beams=17), "from 2 to 16"),
    (dict(num_beams=3, num_return_sequences=4), "num_return_sequences must be from 1 to num_beams = 3"),
    (dict(early_stopping="sometimes"), "early_stopping must be False, True or 'never'"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(max_new_tokens=0), "max_new_tokens must be from 1"),
    (dict(max_new_tokens=200), "positions; this model has n_ctx = 256"),
])
def test_bad_settings_are_refused_with_the_numbers(bundled, settings, message):
    model, tok = bundled
    with pytest.raises(BeamSearchError, match=message.replace("(", r"\(")):
        BeamSearch(model, tok, "Once upon a time, there was a little girl. " * 6, **{"num_beams": 4, **settings})


def test_a_finished_search_refuses_another_step(bundled):
    model, tok = bundled
    search = BeamSearch(model, tok, "Once upon a time", 2, max_new_tokens=2)
    assert search.run() == 2 and search.done
    with pytest.raises(BeamSearchError, match="the beam search is done"):
        search.step()


# -- the views: figures and sentences from the steps' own numbers --------------------------------------------------
SETTINGS = [  # (prompts, k, new tokens, length penalty, early stopping, eos)
    (["Once upon a time"], 4, 8, 1.0, False, None),
    (["Once upon a time", "Tom had a"], 3, 6, 2.0, True, None),
    (["Lily"], 2, 5, 0.5, "never", ()),
]


@pytest.fixture(scope="module", params=SETTINGS, ids=["one prompt", "a padded batch", "no end token"])
def searched(bundled, request):
    model, tok = bundled
    prompts, k, new, penalty, early, eos = request.param
    search = BeamSearch(model, tok, prompts, k, max_new_tokens=new, length_penalty=penalty, early_stopping=early,
                        eos_ids=eos)
    search.run()
    return search, tok


def test_the_tree_puts_the_running_beams_first_and_joins_each_candidate_to_its_parents_slot(searched):
    from gpt_shape_tracer.figures.beams import beam_tree_figure, tree_layout

    search, tok = searched
    for prompt in range(search.batch_size):
        nodes = tree_layout(search.steps, prompt)
        k = search.num_beams
        for s in search.steps:
            mine = [n for n in nodes if n["step"] == s.step]
            assert len(mine) == len(s.candidates[prompt]) and sorted(n["slot"] for n in mine) == list(range(len(mine)))
            running = [n for n in mine if n["fate"] == "running"]
            assert sorted(n["slot"] for n in running) == list(range(len(running)))
            for n in running:  # the slot is the beam the step keeps it as, with its token and parent
                assert (s.tokens[prompt][n["slot"]], s.parents[prompt][n["slot"]]) == (n["token"], n["parent"])
            for n in mine:
                assert n["edge"] == (None if s.step == 0 else (s.step - 1, n["parent"], s.step, n["slot"]))
                assert 0 <= n["parent"] < k
        fig = beam_tree_figure(search.steps, tok.token_label, prompt, shown_step=1)
        drawn = sum(len(t.x) for t in fig.data if t.mode == "markers")
        assert drawn == len(nodes)


def test_the_reorder_figure_draws_each_row_after_as_the_row_it_was_copied_from(searched):
    from gpt_shape_tracer.figures.beams import reorder_figure, row_norms

    search, _ = searched
    for s in search.steps:
        fig = reorder_figure(s)
        before, after = (torch.tensor(t.z) for t in fig.data if t.type == "heatmap")
        assert torch.equal(after, before[list(s.beam_idx)])
        assert close_across_cpus(before, row_norms(s.keys_before).to(before.dtype))
        assert [f"row {j} ← {src}" for j, src in enumerate(s.beam_idx)] == list(fig.data[1].y)


def test_every_step_sentence_states_the_steps_own_numbers(searched):
    import re

    from gpt_shape_tracer.figures.beams import step_sentence

    search, tok = searched
    k = search.num_beams
    for prompt in range(search.batch_size):
        for s in search.steps:
            said = step_sentence(s, tok.token_label, prompt)
            fates = [c.fate for c in s.candidates[prompt]]
            assert f"the {len(fates)} best of the k·V continuations were ranked: {fates.count('running')} go on" in said
            for fate, words in (("finished", "ended and joined"), ("ended", "ended below"),
                                ("dropped", "were dropped")):
                assert (f"{fates.count(fate)} {words}" in said) == bool(fates.count(fate))
            if not fates.count("running"):
                assert "No candidate goes on" in said and s.step == len(search.steps) - 1
                continue
            moved = {j: s.beam_idx[prompt * k + j] - prompt * k for j in range(k)
                     if s.beam_idx[prompt * k + j] != prompt * k + j}
            listed = {int(a): int(b) for a, b in re.findall(r"row (\d+) ← (\d+)", said)}
            assert listed == (moved if s.step else {}), said
            if s.step:
                histories = sorted(set(s.parents[prompt]))
                assert (f"continue {len(histories)} of the {k} histories" in said) == (len(histories) < k)
                best = max(range(k), key=lambda j: s.scores[prompt][j])
                assert f"Best running beam: {best}," in said and f"score {s.scores[prompt][best]:.3f}" in said
            assert ("The search stops after this step" in said) == s.done


def test_the_run_sentence_counts_forwards_and_copied_rows_and_compares_with_greedy(searched):
    from gpt_shape_tracer.figures.beams import run_sentence

    search, _ = searched
    k, texts, result = search.num_beams, search.texts(), search.result()
    sentence, metrics = run_sentence(search.steps, texts[0], result.scores[0], texts[0])
    copied = sum(1 for s in search.steps for j in range(k) if s.beam_idx[j] != j)
    assert dict(metrics) == {"forwards": str(len(search.steps)), "rows copied": str(copied),
                             "best score": f"{result.scores[0]:.3f}"}
    assert f"{k} beams over {len(search.steps)} forward(s)" in sentence and "Greedy decoding says the same" in sentence
    assert "says 'another' instead" in run_sentence(search.steps, texts[0], result.scores[0], "another")[0]


# -- the app -------------------------------------------------------------------------------------------------------
def test_the_beam_search_tab_runs_on_the_live_model_and_says_what_greedy_says():
    from gpt_shape_tracer.model import SamplingConfig, generate
    from tests.app.test_app import gen_of, new_app, press, show_tab

    at = new_app()
    press(at, "step_button")
    show_tab(at, "Decoding")
    at.number_input(key="beam_k").set_value(3)
    at.number_input(key="beam_new").set_value(6)
    at.button(key="beam_run").click().run()
    assert not at.exception and not at.error
    run = at.session_state["app"].live.beams
    search = run.search
    assert search.num_beams == 3 and len(search.steps) <= 6
    gen = gen_of(at)
    ids = generate(gen.model, gen.tokenizer.encode(gen.info.prompts[0]), 6, SamplingConfig(temperature=0))
    ends = [i for i, t in enumerate(ids) if t in search.eos_ids]
    greedy = gen.tokenizer.decode(ids[: ends[0] + 1] if ends else ids)
    said = next(m.value for m in at.markdown if "beams over" in m.value)
    assert (("Greedy decoding says the same" in said) == (greedy == search.texts()[0]))
    assert f"3 beams over {len(search.steps)} forward(s)" in said
    assert len(at.get("plotly_chart")) == 2  # the tree and the reorder
    press(at, "reset_button")
    if any(b.key == "reset_confirm" for b in at.sidebar.button):
        press(at, "reset_confirm")
    assert at.session_state["app"].live.beams is None


# -- the command line ------------------------------------------------------------------------------------------------
def test_the_trace_command_runs_beam_search_and_lists_each_steps_reorder(bundled, capsys):
    import json

    from gpt_shape_tracer.trace_command import main

    assert main(["--prompt", "Once upon a time", "--num-beams", "3", "--steps", "5", "--length-penalty", "2",
                 "--early-stopping", "never", "--num-return-sequences", "2", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    model, tok = bundled
    search = BeamSearch(model, tok, "Once upon a time", 3, max_new_tokens=5, length_penalty=2.0,
                        early_stopping="never", num_return_sequences=2)
    search.run()
    assert said["sequences"] == [list(s) for s in search.result().sequences]
    assert said["texts"] == search.texts() and said["steps"] == len(search.steps)
    assert [s["beam_idx"] for s in said["beam_steps"]] == [list(s.beam_idx) for s in search.steps]
    assert [s["parents"] for s in said["beam_steps"]] == [[list(r) for r in s.parents] for s in search.steps]


@pytest.mark.parametrize("args, message", [
    (["--length-penalty", "2"], "--length-penalty go(es) with --num-beams"),
    (["--num-beams", "1"], "--num-beams takes 2 … 16, got 1"),
    (["--num-beams", "2", "--num-return-sequences", "3"], "--num-return-sequences takes 1 … --num-beams (2), got 3"),
    (["--num-beams", "2", "--no-cache"], "--no-cache does not go with --num-beams"),
    (["--num-beams", "2", "--temperature", "0.7"], "no --temperature, --top-k or --top-p"),
])
def test_the_trace_command_refuses_beam_options_that_do_not_go_together(args, message, capsys):
    from gpt_shape_tracer.trace_command import main

    assert main(["--prompt", "Once upon a time", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_decoding_runs_are_counted_in_the_sessions_memory():
    """What the Decoding tab keeps is part of what the session holds (AppState.held_bytes, which the server's
    ledger reserves): the beam run's key snapshots, counted byte for byte."""
    from tests.app.test_app import new_app, press, show_tab

    at = new_app()
    press(at, "step_button")
    show_tab(at, "Decoding")
    app = at.session_state["app"]
    assert app.held_bytes()["decoding"] == 0
    at.button(key="beam_run").click().run()
    snapshots = sum(t.numel() * t.element_size() for s in app.live.beams.search.steps
                    for t in (s.keys_before, s.keys_after) if t is not None)
    assert snapshots > 0 and app.held_bytes()["decoding"] == snapshots + app.live.beams.search.trace.log.bytes_kept
